"""``python -m helpers.launch script.py [args]``: one untraced command rank of ``launch_command``.

An entry point, not part of the library's import graph (see ``helpers.launch.rank``).
"""

import sys

from helpers.launch.rank import run_command_rank

if __name__ == "__main__":
    run_command_rank(sys.argv[1:], traced=False)
