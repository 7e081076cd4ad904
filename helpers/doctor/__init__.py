"""The hang doctor: notices a stall or a dead rank in a distributed run, and says what went wrong.

A pipeline by file, like torch's Flight Recorder analyzer:
- ``records``: the evidence about each rank (``RankView``, ``Op``, ``Position``, ``Evidence``) and the
  readers of a run folder (live, lenient post-mortem, strict for replays);
- ``diagnosis``: pure reasoning, views in, a ``Diagnosis`` out (its JSON is the doctor's schema);
- ``wording``: the fixes and the summary sentences; ``source``: the user's files and stack text;
- ``watcher``: ``Doctor``, the ``helpers.launch`` watcher that stops a stalled run;
- ``runs``: launching under the doctor (``launch``, ``run_function``, ``run_command``, torchrun);
- ``postmortem``: ``diagnose_dir`` on a kept folder; ``swimlane``: the plot; ``cli``: the command;
- collectors for jobs the doctor did not start: ``pyspy`` (``attach``: py-spy on running ranks; ``merge`` of
  many nodes) and ``flight_recorder`` (torch's Flight Recorder dumps);
- inside a job (``torchrun ... -m helpers.doctor train.py``): ``job`` (each rank's bootstrap and
  watchdog), ``leader`` (when to diagnose, and from what), ``board`` (the doctor's keys in the job's
  c10d store); ``runs.run_job`` runs such a job on one machine.

Kinds (stable names): ok, collective-mismatch, shape-mismatch, rank-missing, rank-exited, unknown.
CLI: ``python -m helpers doctor --num-processes N -- script.py [args]`` (exit 0/3/4/5, 2 on usage);
inside a job: ``torchrun <flags> -m helpers.doctor [--stall-s S] [--json PATH] train.py [args]``.
"""

from helpers.doctor.cli import cli_main
from helpers.doctor.diagnosis import (
    EXIT_CODES,
    FIXES,
    KINDS,
    Diagnosis,
    RankReport,
    diagnose,
    first_divergence,
    history,
    position,
    python_history,
)
from helpers.doctor.flight_recorder import diagnose_dumps, read_dumps
from helpers.doctor.postmortem import diagnose_dir
from helpers.doctor.pyspy import Attached, AttachError, attach, find_ranks, merge
from helpers.doctor.records import Evidence, Op, Position, RankView, fr_op, read_folder, read_new_records
from helpers.doctor.runs import (
    launch,
    launch_command,
    run_command,
    run_function,
    run_torchrun,
    torchrun_exit_codes,
)
from helpers.doctor.watcher import DEFAULT_STALL_S, Doctor, HangDetected, MismatchDetected, keep
from helpers.doctor.wording import short_error

__all__ = ["DEFAULT_STALL_S", "EXIT_CODES", "FIXES", "KINDS", "AttachError", "Attached", "Diagnosis",
           "Doctor", "Evidence", "attach", "diagnose_dumps", "find_ranks", "merge", "read_dumps",
           "HangDetected", "MismatchDetected", "Op", "Position", "RankReport", "RankView", "cli_main",
           "diagnose", "diagnose_dir", "first_divergence", "fr_op", "history", "keep", "launch",
           "launch_command", "position", "python_history", "read_folder", "read_new_records",
           "run_command", "run_function", "run_torchrun", "short_error", "torchrun_exit_codes"]
