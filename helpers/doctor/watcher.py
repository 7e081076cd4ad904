"""The hang doctor as a ``helpers.launch`` watcher: notices a stall or a dead rank, says what went wrong.

Each tick ``Doctor`` reads the ranks' traces (``helpers.trace``). A *stall* is some rank waiting
inside one collective for ``stall_s`` seconds while no rank completed a collective meanwhile
(start-up and compute phases in which nobody waits are not stalls). On a stall, or when a rank ends
while others still need it, the doctor asks every live rank for its stack and Flight Recorder
entries, names the first divergence (``helpers.doctor.diagnosis``), and the run stops with the
diagnosis attached to the error (``error.diagnosis``): ``HangDetected`` for a hang, the rank's own
``RankError``/``RankExited`` for a crash, ``MismatchDetected`` for a run that finished with
mismatched collectives.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from helpers import params, report, rundir, trace
from helpers.collectives import INIT_OP
from helpers.doctor.diagnosis import Diagnosis, diagnose, main_stack
from helpers.doctor.loading import ImportWatch, LookNotes, stall_ended, stall_ended_note
from helpers.doctor.records import RankView, read_current, read_new_records, read_text
from helpers.launch import LaunchError, LaunchTimeout, RankError, RankExited, Run, Watcher, rank_failure

DEFAULT_STALL_S = 30.0
EVIDENCE_WAIT_S = 2.0
PY_SPY_S = 2.0  # reading a rank whose helper thread did not answer
CONNECT_BACKOFF_MAX_S = 90.0  # torch's TCPStore client: 60 s between tries at most, +50 % jitter


# ---------------------------------------------------------------------------------------------
# errors and results


class HangDetected(LaunchTimeout):
    """The doctor stopped a run that stalled (or would): ``.diagnosis`` says where and why."""


class MismatchDetected(LaunchError):
    """The run finished, but its ranks' collectives did not match: results may be wrong."""


# ---------------------------------------------------------------------------------------------
# the watcher


class Doctor(Watcher):
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
        self.read_by_py_spy: set[int] = set()  # ranks whose stack py-spy read (their helper was silent)
        self.passed = LookNotes()  # stalls that ended on their own while the evidence was gathered
        self.imports = ImportWatch()  # a stall while a rank imports is looked at again (loading.py)
        self.hold_until = 0.0  # when a stall that found a rank importing is looked at again

    # -- Watcher protocol -------------------------------------------------------------------

    def poll(self, run: Run) -> None:
        """Read new records; stop the run (raise HangDetected) on a stall or an early finish."""
        self._refresh(run)
        now = time.time()
        needed = self._finished_but_needed(run)
        if needed:
            self._stop(run, "exited", now, None)
        stall_start = self._stall_start(now)
        if stall_start is not None and now >= self.hold_until:
            self._stop(run, "stall", now, stall_start)

    def explain(self, run: Run, error: LaunchError) -> LaunchError:
        """Attach a diagnosis to a failure launch noticed; return the error to raise."""
        noticed = time.time()
        reason = "timeout" if isinstance(error, LaunchTimeout) else "failure"
        self._gather(run)
        diagnosis = diagnose(self.views, run.num_processes, reason, _since(noticed), self.stacks_of(run))
        diagnosis.evidence.started = self.started
        diagnosis.notes.extend(self._read_notes())
        self._conclude(run, diagnosis)
        culprit = _culprit_error(run, diagnosis, error)
        _attach(culprit, diagnosis)
        return culprit

    def finish(self, run: Run, results: list[Any]) -> None:
        """After a run that ended well: check the collectives matched (else MismatchDetected)."""
        self._refresh(run)
        self._read_states(run, "final")
        diagnosis = diagnose(self.views, run.num_processes, "finished", None, {})
        diagnosis.evidence.started = self.started
        diagnosis.notes.extend(self.passed.lines())
        self._conclude(run, diagnosis)
        if diagnosis.verdict == "mismatch":
            error = MismatchDetected(diagnosis.text())
            error.results = diagnosis.results = results
            _attach(error, diagnosis)
            raise error

    # -- reading ----------------------------------------------------------------------------

    def _refresh(self, run: Run) -> None:
        for rank in range(run.num_processes):
            view = self.views.setdefault(rank, RankView(rank))
            code = run.exit_codes.get(rank)
            if code is None and rank in run.processes and run.processes[rank].exitcode is not None:
                code = run.processes[rank].exitcode
            ended = code is not None or rank in run.exit_codes  # before its records: all of them on file
            read_new_records(view, rundir.trace_path(run.run_dir, rank))
            if ended:
                if not view.ended:  # once: nothing more comes from a process that has ended
                    read_current(view, run.run_dir)
                view.ended, view.exit_code = True, code

    def _read_states(self, run: Run, request: str | None) -> None:
        for rank, view in self.views.items():
            path = rundir.state_path(run.run_dir, rank)
            try:
                state = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                continue
            if request is None or state.get("request") in (request, "final"):
                view.state = state

    def _gather(self, run: Run) -> None:
        """Ask every live rank for its state and stack; wait up to EVIDENCE_WAIT_S for answers."""
        self._refresh(run)
        self.requests += 1
        tag = str(self.requests)
        stacks = run.request_stacks(self._read_silent)  # first: answered at once, before the state dumps
        asked = [rank for rank in run.live_ranks() if trace.ask(run.run_dir, rank, tag)]
        end = time.monotonic() + EVIDENCE_WAIT_S
        for rank, text in stacks.items():
            self.views[rank].stack_text = text
        for rank, view in self.views.items():  # a rank already gone: the stack faulthandler dumped as it died
            if rank not in stacks and (view.ended or not view.stack_text):
                view.stack_text = read_text(run.stack_file(rank))
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
        self._mark_silent()
        self._read_workers(run)

    def _read_silent(self, pids: dict[int, int]) -> dict[int, str]:
        """The stacks of ranks whose helper thread did not answer, read with py-spy from outside:
        a signal would end the native call such a rank is in (a ``sleep()``) and change the run."""
        from helpers.doctor import pyspy

        read = {rank: frames for rank, frames in pyspy.read_stacks(pids, PY_SPY_S).items() if frames}
        self.read_by_py_spy.update(read)
        return {rank: pyspy.faulthandler_text(frames) for rank, frames in read.items()}

    def _read_workers(self, run: Run) -> None:
        """The DataLoader workers of the ranks that wait for one, read with py-spy."""
        from helpers.doctor import pyspy

        waiting = {}
        for rank in run.live_ranks():
            view, pid = self.views[rank], run.processes[rank].pid
            if pid:
                waiting[rank] = (pid, main_stack(view))
        for rank, workers in pyspy.children_waited_for(waiting).items():
            self.views[rank].workers = workers

    def _mark_silent(self) -> None:
        for rank in self.read_by_py_spy:
            if rank in self.views:
                self.views[rank].silent = True

    def _read_notes(self) -> list[str]:
        return [f"rank {rank}'s helper thread did not answer (native code holding the GIL, or a "
                "starved machine): its stack was read with py-spy" for rank in sorted(self.read_by_py_spy)]

    def stacks_of(self, run: Run) -> dict[int, str]:
        """The faulthandler stacks gathered so far, by rank."""
        return {rank: view.stack_text for rank, view in self.views.items() if view.stack_text}

    # -- deciding ---------------------------------------------------------------------------

    def _stall_start(self, now: float) -> float | None:
        """When the current stall began, if some rank has waited ``stall_s`` with no progress (in
        init_process_group, ``stall_s`` after the last rank arrived there and its peers' backoff)."""
        last_done = max((v.last_done_t or 0.0 for v in self.views.values()), default=0.0)
        starts = []
        for view in self.views.values():
            since = None if view.ended else view.waiting_since()
            if since is not None:
                start = max(since, last_done)
                if now - start >= self.stall_s and now >= self._connected_by(view):
                    starts.append(start)
        return min(starts) if starts else None

    def _connected_by(self, view: RankView) -> float:
        """When a rank waiting in init_process_group should have met the others that arrived (0
        for a rank not waiting there). Launched here, rank 0 hosts the group's store, and a rank
        that came before it retries its connection with torch's backoff (``ExponentialBackoffWithJitter``:
        0.5 s growing 1.5 times a try, +-50 %, at most 60 s; torch/csrc/distributed/c10d/Backoff.hpp):
        its next try typically comes up to about 0.75 times what it had waited after the last rank
        arrived. With rank 0 15 s late, here, both ranks sat in init_process_group 4.3 s, and a
        stall_s of 4 s named a hang. Each rank's latest init_process_group counts (a script may
        set its group up again)."""
        if not any(op.op == INIT_OP for op in view.open.values()):
            return 0.0
        arrivals = [latest for latest in (_latest_init(other) for other in self.views.values())
                    if latest is not None]
        if not arrivals:
            return 0.0
        waited = max(arrivals) - min(arrivals)
        return max(arrivals) + self.stall_s + min(CONNECT_BACKOFF_MAX_S, 0.75 * (waited + 1.0))

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
        diagnosis.evidence.started, diagnosis.evidence.stall_start = self.started, stall_start
        if diagnosis.kind == "ok":  # every rank finished meanwhile: a late rank, not a hang
            self.passed.add(f"progress stopped for {_since(since):.1f} s ({reason}), then every rank "
                            "went on and finished while their stacks were gathered")
            return
        if reason == "stall" and stall_ended(diagnosis):  # its collective completed as the stacks came
            self.passed.add(stall_ended_note(_since(since)))
            return
        if reason == "stall":  # a rank importing a module: late, not stuck, while its import moves on
            stacks = {rank: main_stack(view) for rank, view in self.views.items()}
            again, note = self.imports.look(diagnosis, stacks, self.stall_s)
            self.passed.add(note)
            if again:
                self.hold_until = time.time() + self.stall_s
                return
        diagnosis.notes.extend(self._read_notes() + self.passed.lines())
        self._conclude(run, diagnosis)
        error = HangDetected(diagnosis.text(), self.stacks_of(run))
        _attach(error, diagnosis)
        raise error

    def _conclude(self, run: Run, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis
        if self.keep_dir is not None:
            keep(run.run_dir, self.keep_dir, diagnosis)


def _latest_init(view: RankView) -> float | None:
    """When the rank last called init_process_group (None: never, as far as its records go)."""
    return max((op.start for op in view.python_ops() if op.op == INIT_OP and op.start is not None),
               default=None)


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
            failure = rank_failure(run.run_dir, entry.rank, entry.exit_code)
            if failure is not None:
                return failure
    return error


def keep(run_dir: Path, keep_dir: Path, diagnosis: Diagnosis | None) -> None:
    """Copy a run's traces, stacks and states into ``keep_dir`` (and the diagnosis as JSON)."""
    keep_dir.mkdir(parents=True, exist_ok=True)
    for pattern in rundir.KEPT_PATTERNS:
        for path in Path(run_dir).glob(pattern):
            shutil.copyfile(path, keep_dir / path.name)
    if diagnosis is not None:
        report.atomic_write_json(rundir.diagnosis_path(keep_dir), diagnosis.to_dict())


