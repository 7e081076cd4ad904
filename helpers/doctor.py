"""The hang doctor: watches running ranks, notices a stall or a dead rank, and says what went wrong.

``Doctor`` is a ``helpers.launch`` watcher (``launch`` and ``launch_command`` use one by default).
Each tick it reads the ranks' traces (``helpers.trace``). A *stall* is some rank waiting inside one
collective for ``stall_s`` seconds while no rank completed a collective meanwhile (start-up and
compute phases in which nobody waits are not stalls). On a stall, or when a rank ends while others
still need it, the doctor asks every live rank for its stack and Flight Recorder entries, names the
first divergence (``helpers.diagnosis``), and the run stops with the diagnosis attached to the error
(``error.diagnosis``): ``HangDetected`` for a hang, the rank's own ``RankError``/``RankExited`` for a
crash, ``MismatchDetected`` for a run that finished with mismatched collectives.

Kinds (stable names): ok, collective-mismatch, shape-mismatch, rank-missing, rank-exited, unknown.
CLI: ``python -m helpers doctor --num-processes N -- script.py [args]`` (exit 0/3/4/5, 2 on usage).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers import cli, params, report
from helpers import launch as launching
from helpers.diagnosis import (
    EXIT_CODES,
    KINDS,
    Diagnosis,
    RankReport,
    RankView,
    diagnose,
    diagnose_dir,
    read_new_records,
)
from helpers.launch import LaunchError, LaunchTimeout, RankError, RankExited, Run

__all__ = ["DEFAULT_STALL_S", "EXIT_CODES", "KINDS", "Diagnosis", "Doctor", "HangDetected",
           "MismatchDetected", "RankReport", "cli_main", "diagnose", "diagnose_dir", "launch",
           "launch_command", "run_command",
           "run_function", "run_torchrun"]

DEFAULT_STALL_S = 30.0
EVIDENCE_WAIT_S = 2.0


# ---------------------------------------------------------------------------------------------
# errors and results


class HangDetected(LaunchTimeout):
    """The doctor stopped a run that stalled (or would): ``.diagnosis`` says where and why."""


class MismatchDetected(LaunchError):
    """The run finished, but its ranks' collectives did not match: results may be wrong."""


# ---------------------------------------------------------------------------------------------
# the watcher


class Doctor:
    """A ``helpers.launch`` watcher that diagnoses stalls, dead ranks and mismatched collectives.

    ``stall_s``: seconds some rank may wait in one collective with no rank completing one before
    the run counts as hung. ``keep_dir``: copy traces, stacks and the diagnosis there at the end.
    After the run, ``doctor.diagnosis`` holds the last diagnosis (also for runs that went well).
    """

    wants_trace = True  # launch installs the tracer in the ranks when a watcher says so

    def __init__(self, stall_s: float = DEFAULT_STALL_S, keep_dir: str | Path | None = None):
        self.stall_s = params.check("stall_s", stall_s)
        self.keep_dir = Path(keep_dir) if keep_dir else None
        self.views: dict[int, RankView] = {}
        self.diagnosis: Diagnosis | None = None
        self.requests = 0
        self.started = time.time()

    # -- Watcher protocol -------------------------------------------------------------------

    def poll(self, run: Run) -> None:
        """Read new records; stop the run (raise HangDetected) on a stall or an early finish."""
        self._refresh(run)
        now = time.time()
        needed = self._finished_but_needed(run)
        if needed:
            self._stop(run, "exited", now, None)
        stall_start = self._stall_start(now)
        if stall_start is not None:
            self._stop(run, "stall", now, stall_start)

    def explain(self, run: Run, error: LaunchError) -> LaunchError:
        """Attach a diagnosis to a failure launch noticed; return the error to raise."""
        noticed = time.time()
        reason = "timeout" if isinstance(error, LaunchTimeout) else "failure"
        self._gather(run)
        diagnosis = diagnose(self.views, run.num_processes, reason, _since(noticed), self.stacks_of(run))
        diagnosis.evidence["started"] = self.started  # type: ignore[attr-defined]
        self._conclude(run, diagnosis)
        culprit = _culprit_error(run, diagnosis, error)
        _attach(culprit, diagnosis)
        return culprit

    def finish(self, run: Run, results: list[Any]) -> None:
        """After a run that ended well: check the collectives matched (else MismatchDetected)."""
        self._refresh(run)
        self._read_states(run, "final")
        diagnosis = diagnose(self.views, run.num_processes, "finished", None, {})
        diagnosis.evidence["started"] = self.started  # type: ignore[attr-defined]
        self._conclude(run, diagnosis)
        if diagnosis.verdict == "mismatch":
            error = MismatchDetected(diagnosis.text())
            error.results = results  # type: ignore[attr-defined]
            _attach(error, diagnosis)
            raise error

    # -- reading ----------------------------------------------------------------------------

    def _refresh(self, run: Run) -> None:
        from helpers import trace

        for rank in range(run.num_processes):
            view = self.views.setdefault(rank, RankView(rank))
            read_new_records(view, trace.trace_path(run.run_dir, rank))
            code = run.exit_codes.get(rank)
            if code is None and rank in run.processes and run.processes[rank].exitcode is not None:
                code = run.processes[rank].exitcode
            if code is not None or rank in run.exit_codes:
                view.ended, view.exit_code = True, code

    def _read_states(self, run: Run, request: str | None) -> None:
        from helpers import trace

        for rank, view in self.views.items():
            path = trace.state_path(run.run_dir, rank)
            try:
                state = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                continue
            if request is None or state.get("request") in (request, "final"):
                view.state = state

    def _gather(self, run: Run) -> None:
        """Ask every live rank for its state and stack; wait up to EVIDENCE_WAIT_S for answers."""
        from helpers import trace

        self._refresh(run)
        self.requests += 1
        tag = str(self.requests)
        stacks = run.request_stacks()  # first: answered at once, before the slower state dumps
        asked = [rank for rank in run.live_ranks() if trace.ask(run.run_dir, rank, tag)]
        end = time.monotonic() + EVIDENCE_WAIT_S
        for rank, text in stacks.items():
            self.views[rank].stack_text = text
        while time.monotonic() < end:
            self._refresh(run)
            self._read_states(run, tag)
            waiting = [r for r in asked if (self.views[r].state or {}).get("request") not in (tag, "final")
                       and run.processes[r].exitcode is None]
            ending = [r for r, v in self.views.items() if v.exit is not None and not v.ended]
            if not waiting and not ending:
                break
            time.sleep(0.02)
        self._refresh(run)
        self._read_states(run, None)  # what each rank wrote last (an unasked "auto" state included)

    def stacks_of(self, run: Run) -> dict[int, str]:
        """The faulthandler stacks gathered so far, by rank."""
        return {rank: view.stack_text for rank, view in self.views.items() if view.stack_text}

    # -- deciding ---------------------------------------------------------------------------

    def _stall_start(self, now: float) -> float | None:
        """When the current stall began, if some rank has waited ``stall_s`` with no progress."""
        last_done = max((v.last_done_t or 0.0 for v in self.views.values()), default=0.0)
        starts = []
        for view in self.views.values():
            since = None if view.ended else view.waiting_since()
            if since is not None:
                start = max(since, last_done)
                if now - start >= self.stall_s:
                    starts.append(start)
        return min(starts) if starts else None

    def _finished_but_needed(self, run: Run) -> bool:
        finished = [v for v in self.views.values() if v.ended and v.exit_code == 0 and
                    (v.exit or {}).get("status") == "finished"]
        for view in finished:
            for other in self.views.values():
                seq = None if other.ended else other.pending_seq()
                if seq is not None and seq > view.last_seq():
                    return True
        return False

    def _stop(self, run: Run, reason: str, now: float, stall_start: float | None) -> None:
        self._gather(run)
        since = stall_start if stall_start is not None else now
        diagnosis = diagnose(self.views, run.num_processes, reason, _since(since), self.stacks_of(run))
        diagnosis.evidence["started"] = self.started  # type: ignore[attr-defined]
        diagnosis.evidence["stall_start"] = stall_start  # type: ignore[attr-defined]
        self._conclude(run, diagnosis)
        error = HangDetected(diagnosis.text(), self.stacks_of(run))
        _attach(error, diagnosis)
        raise error

    def _conclude(self, run: Run, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis
        if self.keep_dir is not None:
            keep(run.run_dir, self.keep_dir, diagnosis)


def _since(moment: float) -> float:
    return round(max(0.0, time.time() - moment), 3)


def _attach(error: LaunchError, diagnosis: Diagnosis) -> None:
    """Carry the diagnosis on the error, and say it in its traceback (a note, Python 3.11+)."""
    error.diagnosis = diagnosis
    note = f"doctor: {diagnosis.verdict} ({diagnosis.kind}): {diagnosis.summary}"
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", []):
        error.add_note(note)


def _culprit_error(run: Run, diagnosis: Diagnosis, error: LaunchError) -> LaunchError:
    """The failure of a culprit rank, when launch noticed another rank's failure first."""
    if not isinstance(error, (RankError, RankExited)) or error.rank in diagnosis.ranks:
        return error
    for entry in diagnosis.per_rank:
        if entry.rank in diagnosis.ranks and entry.state == "exited":
            path = run.run_dir / f"result-{entry.rank}.pkl"
            if not path.exists():
                return RankExited(entry.rank, entry.exit_code)
            outcome = pickle.loads(path.read_bytes())
            if outcome[0] == "error":
                return RankError(entry.rank, *outcome[1:4])
    return error


def keep(run_dir: Path, keep_dir: Path, diagnosis: Diagnosis | None) -> None:
    """Copy a run's traces, stacks and states into ``keep_dir`` (and the diagnosis as JSON)."""
    keep_dir.mkdir(parents=True, exist_ok=True)
    for path in Path(run_dir).iterdir():
        if path.is_file() and path.suffix in (".jsonl", ".json", ".txt"):
            shutil.copyfile(path, keep_dir / path.name)
    if diagnosis is not None:
        report.atomic_write_json(keep_dir / "diagnosis.json", diagnosis)


# ---------------------------------------------------------------------------------------------
# running things under the doctor


def launch(fn, args: tuple = (), kwargs: dict | None = None, *, stall_s: float = DEFAULT_STALL_S,
           keep_dir: str | Path | None = None, watchers: Sequence[launching.Watcher] = (),
           **options: Any) -> list[Any]:
    """``helpers.launch.launch`` under the hang doctor: a stall, a dead rank or mismatched
    collectives stop the run with an error whose ``.diagnosis`` says which rank, which collective
    and which line (``HangDetected``, the rank's ``RankError``/``RankExited``, ``MismatchDetected``).
    ``options`` are ``launch``'s (num_processes, timeout_s, env, ...)."""
    return launching.launch(fn, args, kwargs, watchers=[Doctor(stall_s, keep_dir), *watchers], **options)


def launch_command(command: Sequence[str], *, stall_s: float = DEFAULT_STALL_S,
                   keep_dir: str | Path | None = None, watchers: Sequence[launching.Watcher] = (),
                   **options: Any) -> list[int]:
    """``helpers.launch.launch_command`` under the hang doctor (see ``launch``)."""
    return launching.launch_command(command, watchers=[Doctor(stall_s, keep_dir), *watchers], **options)


def run_command(command: list[str], num_processes: int = 2, stall_s: float = DEFAULT_STALL_S,
                timeout_s: float = 3600.0, keep_dir: str | Path | None = None,
                env: dict[str, str] | None = None) -> Diagnosis:
    """Run a script on ``num_processes`` local ranks under the doctor; return its diagnosis."""
    doctor = Doctor(stall_s, keep_dir=keep_dir)
    try:
        launching.launch_command(command, num_processes=num_processes, timeout_s=timeout_s,
                              watchers=[doctor], env=env)
    except LaunchError as error:
        if getattr(error, "diagnosis", None) is None:
            raise
        return error.diagnosis
    assert doctor.diagnosis is not None
    return doctor.diagnosis


def run_function(fn, args: tuple = (), kwargs: dict | None = None, num_processes: int = 2,
                 stall_s: float = DEFAULT_STALL_S, timeout_s: float = 300.0,
                 keep_dir: str | Path | None = None) -> Diagnosis:
    """Run ``fn`` on ``num_processes`` forked ranks under the doctor; return its diagnosis.

    The ranks' return values are in ``diagnosis.results`` when every rank finished.
    """
    doctor = Doctor(stall_s, keep_dir=keep_dir)
    try:
        results = launching.launch(fn, args, kwargs, num_processes=num_processes, timeout_s=timeout_s,
                                watchers=[doctor])
    except LaunchError as error:
        if getattr(error, "diagnosis", None) is None:
            raise
        return error.diagnosis
    assert doctor.diagnosis is not None
    doctor.diagnosis.results = results  # type: ignore[attr-defined]
    return doctor.diagnosis


def run_torchrun(command: list[str], trace_dir: str | Path, num_processes: int = 2,
                 timeout_s: float = 600.0) -> tuple[int, Diagnosis, str]:
    """Run a script under plain torchrun with the tracer (``-m helpers.trace``), then diagnose.

    For comparing with what torchrun users get: a hang lasts until torch's process-group timeout.
    Returns torchrun's exit code, the diagnosis from ``trace_dir`` and torchrun's output.
    """
    import subprocess
    import tempfile

    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    python_path = os.pathsep.join(filter(None, [str(params.REPO_ROOT), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="helpers-torchrun-") as scratch:
        env = {**os.environ, "HELPERS_TRACE_DIR": str(trace_dir), "TMPDIR": scratch,
               "PYTHONPATH": python_path}
        env.pop("HELPERS_PARENT_PID", None)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_processes),
                "--max-restarts", "0", "--master-port", str(launching.free_port()),
                "-m", "helpers.trace", *command]
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s)
    output = done.stdout + done.stderr
    return done.returncode, diagnose_dir(trace_dir, num_processes, torchrun_exit_codes(output)), output


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exit_codes(output: str) -> dict[int, int]:
    """The failed ranks' exit codes from torchrun's error summary ("rank : 1 ... exitcode : -9")."""
    return {int(rank): int(code) for rank, code in _TORCHRUN_FAILURE.findall(output)}


def cli_main(argv: list[str]) -> int:
    """``python -m helpers doctor --num-processes N [...] -- script.py [args]``: exit 0/3/4/5, 2."""
    from helpers.cli import EXIT_USAGE, add_param

    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1:]
    else:
        options, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m helpers doctor",
        description="Run a script on N local ranks with torchrun's environment and explain any hang.",
        epilog="Exit: 0 ok, 3 hang, 4 crash, 5 mismatch, 2 bad usage.")
    add_param(parser, "num_processes", 2)
    add_param(parser, "stall_s", DEFAULT_STALL_S)
    add_param(parser, "timeout_s", 3600.0)
    parser.add_argument("--json", default="", type=cli.path_arg,
                        help="write the diagnosis as JSON to this path")
    parser.add_argument("--keep", default="", type=cli.path_arg,
                        help="keep traces, stacks and the diagnosis in this folder")
    try:
        args = parser.parse_args(options)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    problem = _command_problem(command)
    if problem:
        print(f"error: {problem}\nusage: python -m helpers doctor --num-processes N -- script.py [args]",
              file=sys.stderr)
        return EXIT_USAGE
    diagnosis = run_command(command, args.num_processes, args.stall_s, args.timeout_s,
                            keep_dir=params.resolve_path(args.keep) if args.keep else None)
    print(diagnosis.text(), file=sys.stderr)
    if args.json:
        diagnosis.to_json(params.resolve_path(args.json))
    return diagnosis.exit_code


def _command_problem(command: list[str]) -> str | None:
    if not command:
        return "command: give the script to run after '--'"
    if command[0] == "-m":
        return None if len(command) > 1 else "command: '-m' needs a module name"
    if command[0].endswith(".py") and not Path(command[0]).is_file():
        return f"command: script {command[0]!r} not found"
    return None
