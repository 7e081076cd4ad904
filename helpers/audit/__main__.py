"""``python -m helpers.audit [--fleet] ...``: the audit, or the fleet gather under torchrun.

An entry point only, so that the library is never loaded twice (once as ``__main__``).
"""

import sys

from helpers.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
