"""``python -m helpers.trace script.py [args]``: run a script as one traced rank (see helpers.trace).

An entry point, not part of the library's import graph: the in-rank bootstrap is
``helpers.launch.rank.run_command_rank``.
"""

import sys

from helpers.launch.rank import run_command_rank

if __name__ == "__main__":
    run_command_rank(sys.argv[1:], traced=True)
