"""Process lifetime of N ranks started from a notebook or a script.

``launch(fn, num_processes=N)`` forks N ranks (also for one rank), creates a real process group in
each (gloo on machines without GPUs, NCCL where every rank has its own GPU), runs ``fn`` in every
rank and returns the ranks' return values as a list ordered by rank. ``launch_command`` runs a
script as N ranks with the environment torchrun gives.

Guarantees, whatever happens (success, an exception in a rank, a hang past the deadline, a killed
rank, KeyboardInterrupt in the caller, the caller killed with SIGKILL):
- every rank has SIGINT/SIGTERM at their defaults and dies with its parent (PR_SET_PDEATHSIG);
- each rank's Python stacks can be dumped on request: a traced rank's helper thread writes them
  holding the GIL; otherwise faulthandler on ``STACK_SIGNAL`` (blocked across the fork so an early
  signal cannot kill a rank before the handler is registered);
- the run ends with every child and grandchild gone (SIGTERM, SIGKILL within 2 s), and the run's
  temporary folder removed: torch.distributed's and torchelastic's temporary files go inside it.

Why not accelerate's ``notebook_launcher``: it returns nothing, runs with ``/tmp/torchelastic_*``
left behind, turns Ctrl-C into an exception that ``except Exception`` swallows, and leaves blocked
ranks running when the caller is killed. Notebook 03 still exercises it, in a guarded child.

Modules: ``errors`` (what a failure raises), ``rank`` (everything inside a rank), ``runner`` (the
caller's side: start, watch, stop). Watchers come from the caller: this package never imports the
hang doctor (``helpers.doctor.launch`` is launch under the doctor).
"""

from helpers.cuda_watch import CudaInitializedError, check_cuda_not_initialized
from helpers.launch.errors import LaunchError, LaunchTimeout, RankError, RankExited, describe_exit
from helpers.launch.rank import STACK_SIGNAL
from helpers.launch.runner import (
    HELPER_STACK_WAIT_S,
    STACK_WAIT_S,
    CommandProcess,
    Run,
    Watcher,
    default_backend,
    first_error,
    launch,
    launch_command,
    rank_failure,
    start_janitor,
    stop_janitor,
    stop_ranks,
)
from helpers.procs import KILL_GRACE_S, free_port

__all__ = ["HELPER_STACK_WAIT_S", "KILL_GRACE_S", "STACK_SIGNAL", "STACK_WAIT_S", "CommandProcess",
           "CudaInitializedError", "LaunchError", "LaunchTimeout", "RankError", "RankExited", "Run",
           "Watcher", "check_cuda_not_initialized", "default_backend", "describe_exit", "first_error",
           "free_port", "launch", "launch_command", "rank_failure", "start_janitor", "stop_janitor",
           "stop_ranks"]
