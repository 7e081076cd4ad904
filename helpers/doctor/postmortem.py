"""After the fact: a diagnosis from a folder of traces (kept with ``--keep``, or written under torchrun).

The folder is read leniently (``records.read_folder``): a rank killed mid-write leaves a partial
last record, which is skipped; the diagnosis says what the rest shows.
"""

from __future__ import annotations

from pathlib import Path

from helpers import rundir
from helpers.doctor.diagnosis import Diagnosis, diagnose
from helpers.doctor.records import RankView, read_folder


def diagnose_dir(folder: str | Path, num_processes: int | None = None,
                 exit_codes: dict[int, int] | None = None, stopped: bool = False) -> Diagnosis:
    """Diagnose a finished run from its traces: a ``--keep`` folder, or one that ranks started as
    ``torchrun ... -m helpers.trace script.py`` with ``HELPERS_TRACE_DIR`` set wrote to.

    ``exit_codes`` (by rank) where known. A rank without an exit record that was killed by
    SIGTERM (or whose end is unknown) while another rank failed was stopped by its launcher
    (torchrun stops every rank when one fails): it is shown where it was, not blamed.
    ``detected_after_s`` is how long the wait that failed first lasted (torch's timeout).
    ``stopped``: the whole job was stopped from outside (a deadline): every rank without an exit
    record is shown where it was when stopped.
    """
    ranks = rundir.traced_ranks(folder)
    num_processes = num_processes or (max(ranks) + 1 if ranks else 0)
    views = read_folder(folder, range(num_processes))
    for rank, view in views.items():
        status = (view.exit or {}).get("status")
        view.ended = True
        view.exit_code = (exit_codes or {}).get(rank, {"finished": 0, "raised": 1}.get(status))
    stop_codes = (None, -15, -9) if stopped else (None, -15)  # the deadline escalates to SIGKILL
    for view in views.values():
        stopped_from_outside = stopped or _failed_elsewhere(view.rank, views)
        if view.exit is None and view.exit_code in stop_codes and stopped_from_outside:
            view.ended = False  # stopped by the launcher (after another rank failed, or a deadline)
    all_finished = all((v.exit or {}).get("status") == "finished" for v in views.values())
    diagnosis = diagnose(views, num_processes, "finished" if all_finished else "failure",
                         _post_mortem_delay(views))
    starts = [op.start for v in views.values() for op in v.python_ops() if op.start]
    diagnosis.evidence.started = min(starts, default=None)
    return diagnosis


def _failed_elsewhere(rank: int, views: dict[int, RankView]) -> bool:
    for other in views.values():
        status = (other.exit or {}).get("status")
        if other.rank != rank and (status in ("raised", "exited") or other.exit_code not in (0, None, -15)):
            return True
    return False


def _post_mortem_delay(views: dict[int, RankView]) -> float | None:
    """Seconds from the start of the wait that failed first to its failure (torch's timeout)."""
    failures = [(op.end, op.start) for v in views.values() for op in v.python_ops()
                if op.ok is False and op.end and op.start]
    for view in views.values():
        if view.exit and view.exit.get("status") == "raised" and view.progress_t:
            failures.append((view.exit["t"], view.progress_t))
    if not failures:
        return None
    end, start = min(failures)
    return round(max(0.0, end - start), 3)
