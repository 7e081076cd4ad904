"""The run folder: every file a run's ranks, its launcher and the hang doctor share, in one place.

One folder per run (``helpers.launch`` makes it under the temporary folder and removes it at the
end; ``--keep DIR`` copies the doctor's part; a torchrun job under ``-m helpers.trace`` writes into
``HELPERS_TRACE_DIR``)::

    trace-<rank>.jsonl   the tracer's records, one JSON object a line (helpers.trace)
    state-<rank>.json    a rank's state on request: main-thread stack, Flight Recorder tail
    stack-<rank>.txt     Python stacks appended on request and at a fatal signal (faulthandler)
    ctl-<rank>           FIFO on which a traced rank's helper thread takes requests
    result-<rank>.pkl    how the rank ended: a pickled ``RankOutcome`` (launcher runs only)
    pid-<pid>            one empty file per rank process, for the janitor
    tmp/                 the ranks' TMPDIR (torch's and torchelastic's temporary files)
    diagnosis.json       the doctor's diagnosis (kept folders)

The file names are a persisted format: users keep folders with ``--keep`` and feed them back to
``repro --from-trace``. Add a file here, with its path function, and nowhere else.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the environment a traced rank reads its folder and rank from (helpers.launch and torchrun users)
ENV_DIR, ENV_RANK, ENV_PARENT = "HELPERS_TRACE_DIR", "HELPERS_TRACE_RANK", "HELPERS_PARENT_PID"
PID_PREFIX = "pid-"
DIAGNOSIS_NAME = "diagnosis.json"
TMP_NAME = "tmp"
# what the doctor keeps of a run (--keep), and what a new record replaces
KEPT_PATTERNS = ("trace-*.jsonl", "current-*.bin", "state-*.json", "stack-*.txt", DIAGNOSIS_NAME)


def trace_path(run_dir: str | Path, rank: int) -> Path:
    """The rank's record of operations (JSON lines)."""
    return Path(run_dir) / f"trace-{rank}.jsonl"


# a rank's small call in progress, in place in current-<rank>.bin: its sequence number (0 once it
# returned, -1 for a call with none) and the id of the first call from its line with as many bytes
# (whose record is on file: written before it ran); helpers.trace.tracer writes it, the doctor reads it
CURRENT = struct.Struct("<qq")


def current_path(run_dir: str | Path, rank: int) -> Path:
    """The rank's call in progress (``CURRENT``): a call whose record was still queued when the rank
    died is known from it."""
    return Path(run_dir) / f"current-{rank}.bin"


def state_path(run_dir: str | Path, rank: int) -> Path:
    """Where the rank writes its stack and Flight Recorder entries on request."""
    return Path(run_dir) / f"state-{rank}.json"


def control_path(run_dir: str | Path, rank: int) -> Path:
    """The FIFO on which the rank's helper thread takes requests."""
    return Path(run_dir) / f"ctl-{rank}"


def stack_path(run_dir: str | Path, rank: int) -> Path:
    """Where the rank's Python stacks are appended: on request, and on a fatal signal."""
    return Path(run_dir) / f"stack-{rank}.txt"


def result_path(run_dir: str | Path, rank: int) -> Path:
    """How the rank ended (``RankOutcome``), written by the rank itself."""
    return Path(run_dir) / f"result-{rank}.pkl"


def pid_marker(run_dir: str | Path, pid: int) -> Path:
    """An empty file naming one rank process, for the janitor to kill if the launcher dies."""
    return Path(run_dir) / f"{PID_PREFIX}{pid}"


def tmp_dir(run_dir: str | Path) -> Path:
    """The ranks' TMPDIR inside the run folder."""
    return Path(run_dir) / TMP_NAME


def diagnosis_path(folder: str | Path) -> Path:
    """The doctor's diagnosis in a kept folder."""
    return Path(folder) / DIAGNOSIS_NAME


def traced_ranks(folder: str | Path) -> list[int]:
    """The ranks that have a trace in ``folder``, sorted."""
    return sorted(int(path.stem.split("-")[1]) for path in Path(folder).glob("trace-*.jsonl"))


def outcome_ranks(folder: str | Path) -> list[int]:
    """The ranks that wrote their outcome in ``folder``, sorted."""
    return sorted(int(path.stem.split("-")[1]) for path in Path(folder).glob("result-*.pkl"))


def clear_record(folder: str | Path) -> None:
    """Remove a previous doctor record from ``folder`` (only the doctor's own files)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for pattern in KEPT_PATTERNS:
        for path in folder.glob(pattern):
            path.unlink()


def clear_rank_record(folder: str | Path, rank: int) -> None:
    """Remove one rank's previous records from ``folder`` (its trace, state and stacks, and a state's
    temporary file that a killed process left)."""
    state = state_path(folder, rank)
    cut_off = list(Path(folder).glob(f".{state.name}.*.tmp"))
    for path in (trace_path(folder, rank), current_path(folder, rank), state, stack_path(folder, rank),
                 *cut_off):
        Path(path).unlink(missing_ok=True)


@dataclass
class RankOutcome:
    """How one rank ended: its return value, or the exception it raised (type, message, traceback).

    ``t`` is when it raised: among ranks that failed, the earliest is the cause and the others its
    echoes ("Connection closed by peer").
    """

    ok: bool
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    t: float = 0.0

    @classmethod
    def failure(cls, exc: BaseException, tb: str) -> RankOutcome:
        """The outcome of a rank that raised ``exc`` (``tb``: its formatted traceback)."""
        return cls(False, None, type(exc).__name__, str(exc), tb, time.time())

    def write(self, path: str | Path) -> None:
        """Write the outcome (atomically); a value that cannot be pickled becomes an error."""
        try:
            data = pickle.dumps(self)
        except Exception as exc:  # noqa: BLE001 - the user's return value: anything can fail
            data = pickle.dumps(RankOutcome(False, None, "PicklingError",
                                            f"the rank's return value cannot be sent back: {exc}",
                                            "", time.time()))
        tmp = Path(f"{path}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    @staticmethod
    def read(path: str | Path) -> RankOutcome | None:
        """The outcome written at ``path`` (None when the rank wrote none: it died first)."""
        try:
            return pickle.loads(Path(path).read_bytes())
        except FileNotFoundError:
            return None


def describe_exit(exit_code: int | None) -> str:
    """'exit code 3', 'killed by SIGKILL' (negative codes are signals, as subprocess reports)."""
    if exit_code is None:
        return "still running"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"
