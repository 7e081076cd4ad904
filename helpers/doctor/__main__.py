"""``python -m helpers.doctor [options] train.py [args]``: the hang doctor inside a job.

Under torchrun, ``accelerate launch`` or ``srun ... torchrun`` each rank runs the script watched
(``helpers.doctor.job``); without a launcher, ``--num-processes N`` runs it on N local ranks as
``python -m helpers doctor`` does. An entry point, not part of the library's import graph.
"""

import sys

from helpers.doctor.cli import module_main

if __name__ == "__main__":
    sys.exit(module_main(sys.argv[1:]))
