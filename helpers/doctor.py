"""The hang doctor: watches running ranks, notices a stall or a dead rank, and says what went wrong.

``Doctor`` is a ``helpers.launch`` watcher (``launch`` and ``launch_command`` use one by default).
Each tick it reads the ranks' traces (``helpers.trace``). A *stall* is some rank waiting inside one
collective for ``stall_s`` seconds while no rank completed a collective meanwhile (start-up and
compute phases in which nobody waits are not stalls). On a stall, or when a rank ends while others
still need it, the doctor asks every live rank for its stack and Flight Recorder entries, names the
first divergence (``diagnose``), and the run stops with the diagnosis attached to the error
(``error.diagnosis``): ``HangDetected`` for a hang, the rank's own ``RankError``/``RankExited`` for a
crash, ``MismatchDetected`` for a run that finished with mismatched collectives.

Kinds (stable names): ok, collective-mismatch, shape-mismatch, rank-missing, rank-exited, unknown.
CLI: ``python -m helpers doctor --num-processes N -- script.py [args]`` (exit 0/3/4/5, 2 on usage).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import launch, params, report
from helpers.launch import LaunchError, LaunchTimeout, RankError, RankExited, Run, describe_exit

DEFAULT_STALL_S = 30.0
EXIT_CODES = {"ok": 0, "hang": 3, "crash": 4, "mismatch": 5}
EVIDENCE_WAIT_S = 2.0
KEPT_OPS = 4096  # Python-level records kept per rank in memory
KINDS = ("ok", "collective-mismatch", "shape-mismatch", "rank-missing", "rank-exited", "unknown")

NB_REPRO = "notebooks/02_minimal_repro_builder.ipynb"
NB_EARLY_STOP = "notebooks/05_early_stop_sync.ipynb"
NB_MEMORY = "notebooks/04_batch_size_explorer.ipynb"

FIXES = {
    "ok": "Nothing to fix.",
    "collective-mismatch": (
        "Make every rank issue the same collectives in the same order: take collectives (gather, "
        "reduce, wait_for_everyone, in_order logging) out of rank-dependent branches, and stop loops "
        "on every rank together with accelerator.set_trigger() / accelerator.check_trigger(). "
        f"{NB_EARLY_STOP} teaches the early-stop fix; {NB_REPRO} turns this run into a minimal repro."),
    "shape-mismatch": (
        "Give the collective tensors of the same shape and dtype on every rank: pad with "
        "accelerator.pad_across_processes(...) before gather (drop the padding after), or use "
        "gather_object for ragged data; ACCELERATE_DEBUG_MODE=1 makes accelerate check shapes first. "
        f"{NB_REPRO} reproduces it in a few lines."),
    "rank-missing": (
        "Make the missing ranks reach the same collective: look at where they are (location above): "
        "a rank-dependent branch, a loop that does not end, data loading or a wait. "
        f"{NB_REPRO} builds a minimal repro; {NB_EARLY_STOP} shows how ranks agree to stop."),
    "rank-exited": (
        "Find out why the rank ended: its exit code and log (SIGKILL is often the out-of-memory killer: "
        f"see {NB_MEMORY}; an exception: its traceback). If it finished early, make every rank run "
        f"the same collectives to the end ({NB_EARLY_STOP})."),
    "unknown": (
        "No known pattern: read each rank's stack (kept with --keep DIR) and build a minimal repro with "
        f"{NB_REPRO}."),
}


# ---------------------------------------------------------------------------------------------
# errors and results


class HangDetected(LaunchTimeout):
    """The doctor stopped a run that stalled (or would): ``.diagnosis`` says where and why."""


class MismatchDetected(LaunchError):
    """The run finished, but its ranks' collectives did not match: results may be wrong."""


@dataclass
class RankReport:
    """One rank in a diagnosis."""

    rank: int
    state: str  # in-collective | outside-collective | exited | finished
    op: str | None = None
    seq: int | None = None
    shapes: list | None = None
    location: str | None = None
    exit_code: int | None = None


@dataclass
class Diagnosis(report.ResultMixin):
    """What the doctor concluded (JSON as documented in issue 4)."""

    verdict: str  # ok | hang | crash | mismatch
    kind: str
    ranks: list[int]
    summary: str
    fix: str
    detected_after_s: float | None
    per_rank: list[RankReport] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The CLI's exit code for this verdict (0 ok, 3 hang, 4 crash, 5 mismatch)."""
        return EXIT_CODES[self.verdict]

    def rows(self) -> list[dict[str, Any]]:
        """The per-rank table as dict rows (culprit column included)."""
        rows = []
        for entry in self.per_rank:
            row = report.to_jsonable(entry)
            row["shapes"] = _shapes_text(entry.shapes)
            row["culprit"] = entry.rank in self.ranks
            rows.append(row)
        return rows

    def text(self) -> str:
        """A plain-text report for the CLI and logs."""
        columns = ["rank", "state", "op", "seq", "shapes", "location", "exit_code"]
        rows = [{**row, "rank": f"{row['rank']}{' *' if row['culprit'] else ''}"} for row in self.rows()]
        head = f"doctor: {self.verdict} ({self.kind})"
        if self.detected_after_s is not None:
            head += f", detected {self.detected_after_s:.1f} s after progress stopped"
        return "\n".join([head, self.summary, "", report.text_table(rows, columns), "", "fix: " + self.fix])

    def _repr_html_(self) -> str:
        import html

        colour = {"ok": "#2e7d32", "hang": "#c62828", "crash": "#c62828", "mismatch": "#ef6c00"}
        rows = [{**row, "culprit": not row["culprit"]} for row in self.rows()]
        table = report.html_table(rows, ["rank", "state", "op", "seq", "shapes", "location",
                                         "exit_code"], highlight="culprit")
        when = ("" if self.detected_after_s is None
                else f" &middot; detected {self.detected_after_s:.1f} s after progress stopped")
        return (f"<div><b style='color:{colour.get(self.verdict, '#000')}'>{html.escape(self.verdict)}"
                f"</b> &middot; <code>{html.escape(self.kind)}</code>{when}"
                f"<p>{html.escape(self.summary)}</p>{table}"
                f"<p><b>Fix:</b> {html.escape(self.fix)}</p></div>")

    def swimlane(self):
        """A matplotlib Figure: one lane per rank, collectives as boxes, the divergence marked."""
        from helpers.swimlane import swimlane

        return swimlane(self)


def _shapes_text(shapes: list | None) -> str | None:
    if shapes is None:
        return None
    return ", ".join("[" + ", ".join(str(d) for d in shape) + "]" for shape in shapes) or "[]"


# ---------------------------------------------------------------------------------------------
# what the doctor knows about one rank


@dataclass
class Op:
    """One operation as one rank saw it (a Python-level record, or a Flight Recorder entry)."""

    op: str
    pg: str = "0"
    seq: int | None = None
    shapes: list | None = None
    dtypes: list | None = None
    out: list | None = None
    where: str | None = None
    file: str | None = None
    line: int | None = None
    start: float | None = None
    end: float | None = None
    ok: bool | None = None
    error: str | None = None
    p2p: bool = False
    async_: bool = False
    source: str = "python"

    def signature(self) -> tuple:
        """What must agree across ranks at one sequence number: the op, then shapes and dtypes."""
        return (canonical_op(self.op), _shape_key(self))


_FR_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
              "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
              "Bool": "bool"}
_SHAPE_CHECKED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                  "reduce_scatter_tensor", "barrier")


def canonical_op(name: str) -> str:
    """One name per collective whatever recorded it: 'gloo:all_reduce' -> 'all_reduce'."""
    name = name.split(":", 1)[-1]
    return _ALIASES.get(name, name)


_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "monitored_barrier": "barrier",
            "_allgather_base": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
            "_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
            "reduce_scatter_single": "reduce_scatter_tensor"}


def _shape_key(op: Op) -> tuple:
    if canonical_op(op.op) not in _SHAPE_CHECKED or op.shapes is None:
        return ()
    return (tuple(tuple(s) for s in op.shapes), tuple(op.dtypes or ()))


@dataclass
class RankView:
    """Everything read so far about one rank: its records, progress, end and latest state dump."""

    rank: int
    offset: int = 0
    partial: bytes = b""
    hello: bool = False
    ops: dict[int, Op] = field(default_factory=dict)
    order: deque = field(default_factory=lambda: deque(maxlen=KEPT_OPS))
    open: dict[int, Op] = field(default_factory=dict)
    progress: dict[str, list[int]] = field(default_factory=dict)
    progress_t: float | None = None
    group_up_t: float | None = None
    last_done_t: float | None = None
    exit: dict[str, Any] | None = None
    state: dict[str, Any] | None = None
    exit_code: int | None = None
    ended: bool = False
    stack_text: str = ""

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one trace record into the view."""
        kind = event.get("ev")
        if kind == "op":
            self._start(event)
        elif kind == "end":
            self._end(event)
        elif kind == "pg":
            self._progress(event["pg"], event["t"])
        elif kind == "exit":
            self.exit = event
            if event.get("pg"):
                self._progress(event["pg"], event["t"])
        elif kind == "hello":
            self.hello = True

    def _start(self, event: dict[str, Any]) -> None:
        op = Op(op=event["op"], pg=event.get("pg", "0"), seq=event.get("seq"), shapes=event.get("shapes"),
                dtypes=event.get("dtypes"), where=event.get("where"), file=event.get("file"),
                line=event.get("line"), start=event["t"], p2p=bool(event.get("p2p")),
                async_=bool(event.get("async")))
        if len(self.order) == self.order.maxlen:
            self.ops.pop(self.order[0], None)
        self.order.append(event["id"])
        self.ops[event["id"]] = op
        self.open[event["id"]] = op
        if self.group_up_t is None:
            self.group_up_t = event["t"]

    def _end(self, event: dict[str, Any]) -> None:
        op = self.open.pop(event["id"], None) or self.ops.get(event["id"])
        if op is None:
            return
        op.end, op.ok, op.error = event["t"], event.get("ok"), event.get("error")
        if op.ok:
            self.last_done_t = max(self.last_done_t or 0.0, event["t"])

    def _progress(self, progress: dict[str, list[int]], t: float) -> None:
        if self.group_up_t is None:
            self.group_up_t = t
        for name, (_enq, done) in progress.items():
            if done > self.progress.get(name, [0, 0])[1]:
                self.last_done_t = max(self.last_done_t or 0.0, t)
        if progress != self.progress:
            self.progress, self.progress_t = progress, t

    def waiting_since(self) -> float | None:
        """When this rank started waiting in the collective it is still in (None: not waiting)."""
        sync = [op.start for op in self.open.values() if not op.async_ and op.start is not None]
        if sync:
            return min(sync)
        if any(enq > done for enq, done in self.progress.values()):
            return self.progress_t
        return None

    def pending_seq(self) -> int | None:
        """torch's sequence number of the collective this rank waits in (pg-seq numbering)."""
        sync = [op for op in self.open.values() if not op.async_ and op.seq is not None]
        if sync:
            return max(op.seq for op in sync)
        pending = [done + 1 for enq, done in self.progress.values() if enq > done]
        return min(pending) if pending else None

    def last_seq(self) -> int:
        """The highest sequence number this rank is known to have issued."""
        seqs = [op.seq for op in self.ops.values() if op.seq is not None]
        seqs += [enq for enq, _done in self.progress.values()]
        return max(seqs, default=0)

    def python_ops(self) -> list[Op]:
        """The Python-level records kept, oldest first."""
        return [self.ops[i] for i in self.order if i in self.ops]


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
            _read_new_records(view, trace.trace_path(run.run_dir, rank))
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
        asked = [rank for rank in run.live_ranks() if _ask(trace.control_path(run.run_dir, rank), tag)]
        end = time.monotonic() + EVIDENCE_WAIT_S
        stacks = run.request_stacks()
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


def _ask(fifo: Path, tag: str) -> bool:
    """Write a request line to a rank's FIFO; False when the rank is not listening."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, f"{tag}\n".encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read_new_records(view: RankView, path: Path) -> None:
    try:
        with open(path, "rb") as handle:
            handle.seek(view.offset)
            data = handle.read()
    except FileNotFoundError:
        return
    view.offset += len(data)
    *lines, view.partial = (view.partial + data).split(b"\n")
    for line in lines:
        try:
            view.apply(json.loads(line))
        except (ValueError, KeyError, TypeError):
            continue


def _attach(error: LaunchError, diagnosis: Diagnosis) -> None:
    error.diagnosis = diagnosis
    if hasattr(error, "add_note") and diagnosis.summary not in getattr(error, "__notes__", []):
        error.add_note(f"doctor: {diagnosis.verdict} ({diagnosis.kind}): {diagnosis.summary}")


def _culprit_error(run: Run, diagnosis: Diagnosis, error: LaunchError) -> LaunchError:
    """The failure of a culprit rank, when launch noticed another rank's failure first."""
    if not isinstance(error, (RankError, RankExited)) or error.rank in diagnosis.ranks:
        return error
    for entry in diagnosis.per_rank:
        if entry.rank in diagnosis.ranks and entry.state == "exited":
            try:
                launch._read_outcome(run, entry.rank, entry.exit_code)
            except (RankError, RankExited) as own:
                return own
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
# diagnosing (pure: views in, Diagnosis out)


@dataclass
class Position:
    """Where one rank is (or ended) when the doctor looks."""

    rank: int
    state: str
    op: Op | None = None
    seq: int | None = None
    where: str | None = None
    file: str | None = None
    line: int | None = None
    detail: str = ""
    exit_code: int | None = None
    abnormal: bool = False  # ended by a signal, a non-zero exit or an exception
    victim: bool = False  # raised inside a collective (a consequence, not a cause)
    timed_out: bool = False  # its collective hit torch's process-group timeout


def diagnose(views: dict[int, RankView], num_processes: int, reason: str,
             detected_after_s: float | None, stacks: dict[int, str] | None = None) -> Diagnosis:
    """Name what went wrong from the ranks' views. ``reason``: stall, exited, failure, timeout, finished."""
    positions = {rank: position(views[rank]) if rank in views else Position(rank, "exited")
                 for rank in range(num_processes)}
    histories = {rank: history(view) for rank, view in views.items()}
    kind, culprits, summary = _classify(positions, histories, views)
    verdict = _verdict(kind, reason, positions)
    if verdict == "ok":
        detected_after_s = None
    per_rank = [_report(positions[rank]) for rank in range(num_processes)]
    diagnosis = Diagnosis(verdict, kind, culprits, summary, FIXES[kind], detected_after_s, per_rank)
    diagnosis.evidence = {"histories": histories, "positions": positions,  # type: ignore[attr-defined]
                          "views": views, "stacks": stacks or {}, "reason": reason}
    return diagnosis


def _verdict(kind: str, reason: str, positions: dict[int, Position]) -> str:
    if reason == "finished":
        return "ok" if kind == "ok" else "mismatch"
    crashed = [p for p in positions.values() if p.abnormal and not p.timed_out]
    return "crash" if crashed else "hang"


def _report(pos: Position) -> RankReport:
    op = pos.op
    return RankReport(rank=pos.rank, state=pos.state, op=op.op.split(":", 1)[-1] if op else None,
                      seq=pos.seq, shapes=op.shapes if op else None, location=pos.where,
                      exit_code=pos.exit_code)


def python_history(view: RankView) -> dict[tuple[str, int], Op]:
    """The rank's Python-level collectives by (process group, torch's sequence number)."""
    return {(op.pg, op.seq): op for op in view.python_ops() if not op.p2p and op.seq is not None}


def history(view: RankView) -> dict[tuple[str, int], Op]:
    """The rank's collectives by (process group, sequence number), sites attached where known.

    From the Flight Recorder when the rank's state dump has it (it sees C++ collectives too),
    else from the Python-level records. The two number sequences agree unless p2p ops were used.
    """
    python = [op for op in view.python_ops() if not op.p2p]
    fr = (view.state or {}).get("fr") or []
    if not fr:
        return python_history(view)
    entries: dict[tuple[str, int], Op] = {}
    for entry in fr:
        if entry.get("is_p2p"):
            continue
        created = (entry.get("time_created_ns") or 0) / 1e9
        owner = _owner(python, created)
        op = _fr_op(entry)
        op.ok = True if entry.get("retired") else None
        if owner is not None:
            _adopt(op, owner, entry["profiling_name"])
        entries[(op.pg, op.seq)] = op
    return entries


def _adopt(op: Op, owner: Op, recorded_name: str) -> None:
    """Give a Flight Recorder entry the site, name and shapes of the Python call that issued it."""
    op.where, op.file, op.line, op.end, op.error = owner.where, owner.file, owner.line, owner.end, owner.error
    op.start = owner.start
    if owner.end is not None:
        op.ok = owner.ok
    if not owner.op.endswith(("_object", "_object_list")):  # those issue several inner collectives
        op.op = owner.op
        op.shapes = owner.shapes if owner.shapes is not None else op.shapes
        op.dtypes = owner.dtypes or op.dtypes
    else:
        op.op = f"{owner.op} ({recorded_name.split(':', 1)[-1]})"


_CLOCK_SLACK_S = 1e-4  # both clocks are the wall clock; the entry is created inside the call


def _owner(python: list[Op], created: float) -> Op | None:
    """The Python-level call during which a Flight Recorder entry was created."""
    for op in reversed(python):
        if op.start is None:
            continue
        if op.start - _CLOCK_SLACK_S <= created and (op.end is None or created <= op.end + _CLOCK_SLACK_S):
            return op
        if op.end is not None and op.end < created - _CLOCK_SLACK_S:
            break
    return None


def position(view: RankView) -> Position:
    """Where a rank is: in a collective, outside any, finished, or exited (and how)."""
    exit_record = view.exit or {}
    if view.ended and view.exit_code == 0 and exit_record.get("status") == "finished":
        return Position(view.rank, "finished", exit_code=0, seq=view.last_seq() or None)
    pos = _current(view)
    if not view.ended and view.exit is None:
        return pos
    pos.state, pos.exit_code, pos.abnormal = "exited", view.exit_code, True
    error = exit_record.get("error")
    failed = _failed_op(view) or _failed_inside(view, error)
    if failed is not None:
        pos.op, pos.victim = failed, True
        pos.where, pos.file, pos.line = failed.where, failed.file, failed.line
        pos.seq = failed.seq if pos.seq is None else pos.seq
        pos.timed_out = bool(re.search(r"timed out|timeout", failed.error or "", re.IGNORECASE))
        pos.detail = f"raised {failed.error}"
    elif error:
        pos.op, pos.seq = None, None
        pos.where, pos.file, pos.line = (exit_record.get(k) for k in ("where", "file", "line"))
        pos.detail = f"raised {error}"
    else:
        known = view.exit_code is not None
        pos.detail = describe_exit(view.exit_code) if known else "ended (no exit recorded)"
        if not any(not op.async_ for op in view.open.values()):
            pos.op = pos.seq = None  # its last progress note may be stale: do not guess an op
        last = next((op for op in reversed(view.python_ops()) if op.where), None)
        if pos.op is None and last is not None:
            pos.where, pos.file, pos.line = last.where, last.file, last.line
    return pos


_COMM_ERROR = re.compile(r"gloo|nccl|Connection (reset|closed)|DistBackendError|ProcessGroup|"
                         r"Timed out waiting|timed out", re.IGNORECASE)


def _failed_inside(view: RankView, error: str | None) -> Op | None:
    """For a communication error raised outside any Python wrapper (DDP's collectives, issued from
    C++): the collective it came from, i.e. the first not retired, else the last one enqueued."""
    if not error or not _COMM_ERROR.search(error):
        return None
    entries = [e for e in (view.state or {}).get("fr") or [] if not e.get("is_p2p")]
    pending = [e for e in entries if not e.get("retired")] or entries[-1:]
    op = _fr_op(pending[0]) if pending else Op(op="collective", seq=view.pending_seq())
    exit_record = view.exit or {}
    op.where, op.file, op.line = (exit_record.get(k) for k in ("where", "file", "line"))
    op.error, op.ok = error, False
    return op


def _failed_op(view: RankView) -> Op | None:
    for op in reversed(view.python_ops()):
        if op.end is not None and op.ok is False:
            return op
    return None


def _current(view: RankView) -> Position:
    """A live (or last known) rank's position from its open ops, state dump and progress."""
    state = view.state or {}
    pending_fr = [e for e in state.get("fr") or [] if not e.get("retired") and not e.get("is_p2p")]
    sync_open = [op for op in view.open.values() if not op.async_]
    frame = _innermost_user_frame(state.get("stack") or [])
    if sync_open:
        op = sync_open[-1]
        seq = op.seq
        if pending_fr:
            seq = pending_fr[0]["collective_seq_id"]
        return Position(view.rank, "in-collective", op=op, seq=seq, where=op.where, file=op.file,
                        line=op.line)
    pending = pending_fr[0] if pending_fr else None
    if pending is not None or view.pending_seq() is not None:
        op = _fr_op(pending) if pending else Op(op="collective", seq=view.pending_seq())
        pos = Position(view.rank, "in-collective", op=op, seq=op.seq,
                       detail=_issued_by(state.get("stack") or []))
        if frame:
            pos.where, pos.file, pos.line = frame["where"], frame["file"], frame["line"]
            op.where, op.file, op.line = pos.where, pos.file, pos.line
        return pos
    pos = Position(view.rank, "outside-collective", seq=None)
    if frame:
        pos.where, pos.file, pos.line = frame["where"], frame["file"], frame["line"]
        pos.detail = _activity(view.rank, frame, state.get("stack") or [])
    return pos


def _fr_op(entry: dict[str, Any]) -> Op:
    return Op(op=entry["profiling_name"], pg=entry.get("pg", "0"), seq=entry["collective_seq_id"],
              shapes=entry.get("input_sizes"), source="flight-recorder",
              dtypes=[_FR_DTYPES.get(d, d) for d in entry.get("input_dtypes") or []],
              start=(entry.get("time_created_ns") or 0) / 1e9)


def _innermost_user_frame(stack: list[dict[str, Any]]) -> dict[str, Any] | None:
    for frame in reversed(stack):
        if frame.get("user"):
            return frame
    return None


def _issued_by(stack: list[dict[str, Any]]) -> str:
    """Who issued a collective that no Python wrapper saw (DDP from C++, most often)."""
    names = {(Path(f["file"]).name, f["func"]) for f in stack}
    if any(func in ("backward", "_engine_run_backward") for _file, func in names):
        return "issued by DDP inside backward(): the gradient all-reduce"
    if any(file == "distributed.py" and func in ("forward", "_pre_forward") for file, func in names):
        return "issued by DDP inside forward(): buffers or bucket order"
    return "issued outside Python (no Python wrapper saw it)"


def _activity(rank: int, frame: dict[str, Any], stack: list[dict[str, Any]]) -> str:
    innermost = stack[-1] if stack else frame
    if innermost.get("func") == "sleep" or "time.sleep" in _source_line(frame):
        return "sleeping"
    loop = _enclosing_loop(frame.get("file"), frame.get("line"))
    if loop is not None:
        return f"in a loop at {Path(frame['file']).name}:{loop}"
    return f"at {frame['where']}"


# ---------------------------------------------------------------------------------------------
# classification


def _classify(positions: dict[int, Position], histories: dict[int, dict], views: dict[int, RankView]):
    divergence = first_divergence(histories)
    python = first_divergence({rank: python_history(view) for rank, view in views.items()})
    if python is not None and (divergence is None or python[0][1] < divergence[0][1]):
        divergence = python
    if divergence is not None:
        return _divergence_kind(divergence, positions, histories)
    exited = _exited_culprits(positions)
    if exited:
        return "rank-exited", exited, _exited_summary(exited, positions)
    missing = _missing_ranks(positions)
    if missing:
        return "rank-missing", missing, _missing_summary(missing, positions)
    if all(p.state == "finished" for p in positions.values()):
        count = max((len(h) for h in histories.values()), default=0)
        return "ok", [], (f"All {len(positions)} ranks finished; their collectives matched "
                          f"({count} compared per rank).")
    return "unknown", [], _unknown_summary(positions)


def first_divergence(histories: dict[int, dict[tuple[str, int], Op]]):
    """The lowest (group, seq) at which ranks that both issued it disagree.

    Returns (key, {signature: ranks}, {rank: op}) or None. Only histories from the same source
    (Flight Recorder, or Python records) are compared: their numbers agree.
    """
    sources = {rank: _source(h) for rank, h in histories.items() if h}
    fr_ranks = [r for r, s in sources.items() if s == "flight-recorder"]
    ranks = fr_ranks if len(fr_ranks) >= 2 else [r for r, s in sources.items() if s == "python"]
    keys = sorted({key for r in ranks for key in histories[r]}, key=lambda k: (k[0], k[1]))
    for key in keys:
        present = {r: histories[r][key] for r in ranks if key in histories[r]}
        if len(present) < 2:
            continue
        groups: dict[tuple, list[int]] = {}
        for rank, op in sorted(present.items()):
            groups.setdefault(op.signature(), []).append(rank)
        if len(groups) > 1:
            return key, groups, present
    return None


def _source(history: dict) -> str:
    return next(iter(history.values())).source if history else "python"


def _divergence_kind(divergence, positions, histories):
    key, groups, present = divergence
    ops = {sig[0] for sig in groups}
    kind = "collective-mismatch" if len(ops) > 1 else "shape-mismatch"
    culprits = _odd_ones_out(groups, present, histories, key)
    return kind, culprits, _divergence_summary(kind, key, present, culprits, positions)


def _odd_ones_out(groups: dict[tuple, list[int]], present: dict[int, Op], histories, key) -> list[int]:
    """Which ranks diverged: rank-conditional code first, then a strict majority, then history."""
    everyone = sorted(present)
    conditional = [r for r in everyone if _rank_conditional(present[r].file, present[r].line)]
    if conditional and len(conditional) < len(everyone):
        return conditional
    largest = max(groups.values(), key=len)
    if len(largest) * 2 > len(everyone):
        return [r for r in everyone if r not in largest]
    novel = [r for r in everyone if not _seen_elsewhere(r, present[r], histories, key)]
    if novel and len(novel) < len(everyone):
        return novel
    return everyone


def _seen_elsewhere(rank: int, op: Op, histories, key) -> bool:
    """Did another rank issue this same op (and site, when known) earlier? Then it is the common path."""
    for other, history in histories.items():
        if other == rank:
            continue
        for other_key, seen in history.items():
            if other_key[0] != key[0] or other_key[1] >= key[1]:
                continue
            same_site = op.where is None or seen.where is None or op.where == seen.where
            if seen.signature() == op.signature() and same_site:
                return True
    return False


def _exited_culprits(positions: dict[int, Position]) -> list[int]:
    """Ranks that ended (not as a victim of another's end) while others still needed them."""
    demand = max((p.seq or 0 for p in positions.values() if p.state == "in-collective" or p.victim),
                 default=0)
    stuck = any(p.state in ("in-collective", "outside-collective") or p.victim for p in positions.values())
    culprits = []
    for pos in positions.values():
        if pos.state == "exited" and not pos.victim:
            culprits.append(pos.rank)
        elif pos.state == "finished" and stuck and demand > (pos.seq or 0):
            culprits.append(pos.rank)
    return sorted(culprits)


def _missing_ranks(positions: dict[int, Position]) -> list[int]:
    waiting = [p for p in positions.values() if p.state == "in-collective" or p.victim]
    if not waiting:
        return []
    return sorted(p.rank for p in positions.values() if p.state == "outside-collective")


# ---------------------------------------------------------------------------------------------
# sentences


def _op_name(op: Op | None) -> str:
    return canonical_op(op.op) if op else "a collective"


def _at(pos: Position) -> str:
    return f" at {pos.where}" if pos.where else ""


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    return "Ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _divergence_summary(kind: str, key, present: dict[int, Op], culprits: list[int], positions) -> str:
    seq = key[1]
    if kind == "shape-mismatch":
        op = next(iter(present.values()))
        parts = [f"rank {r} {_shapes_text(o.shapes)} {','.join(o.dtypes or [])}".strip()
                 for r, o in sorted(present.items())]
        site = next((o.where for o in present.values() if o.where), None)
        where = f" at {site}" if site else ""
        odd = (f"{_ranks_text(culprits)} differ{'s' if len(culprits) == 1 else ''} from the others."
               if len(culprits) < len(present) else "Every rank must pass the same shape and dtype.")
        return (f"Ranks called {_op_name(op)}{where} (collective #{seq}) with different shapes or dtypes: "
                + "; ".join(parts) + ". " + odd)
    parts = []
    for rank, op in sorted(present.items()):
        where, extra = op.where, ""
        pos = positions.get(rank)
        if pos is not None and pos.op is not None and pos.seq == seq:  # where the rank is now
            where = where or pos.where
            if pos.detail and pos.op.source == "flight-recorder":
                extra = f", {pos.detail}"
        parts.append(f"rank {rank} in {_op_name(op)}{' at ' + where if where else ''}{extra}")
    lead = _ranks_text(culprits)
    return (f"Ranks issued different collectives as collective #{seq}: " + "; ".join(parts)
            + f". {lead} took a different path from the others.")


def _exited_summary(culprits: list[int], positions: dict[int, Position]) -> str:
    sentences = []
    needing = [p for p in positions.values() if p.state == "in-collective" or p.victim]
    for rank in culprits:
        pos = positions[rank]
        if pos.state == "finished":
            how = "finished its work"
        elif pos.detail.startswith("raised"):
            how = pos.detail + _at(pos)
        else:
            how = f"was {pos.detail}" if pos.detail.startswith("killed") else f"ended ({pos.detail})"
            how += f" after its last collective{_at(pos)}" if pos.where else ""
        sentences.append(f"Rank {rank} {how}")
    text = "; ".join(sentences)
    if needing:
        waits = ", ".join(f"rank {p.rank} in {_op_name(p.op)}{_at(p)}" for p in needing)
        text += f" while other ranks still needed it ({waits})"
    return text + "."


def _missing_summary(missing: list[int], positions: dict[int, Position]) -> str:
    waiting = [p for p in positions.values() if p.state == "in-collective" or p.victim]
    first = waiting[0]
    who = ", ".join(f"rank {p.rank}" for p in waiting)
    text = (f"{_ranks_text(missing)} never reached the {_op_name(first.op)} that {who} entered"
            f"{_at(first)}")
    if first.seq:
        text += f" (collective #{first.seq})"
    where = []
    for rank in missing:
        pos = positions[rank]
        where.append(f"rank {rank} is {pos.detail or 'somewhere'}" + (f" ({pos.where})" if pos.where and
                                                                       pos.where not in pos.detail else ""))
    return text + "; " + "; ".join(where) + "."


def _unknown_summary(positions: dict[int, Position]) -> str:
    parts = []
    for pos in positions.values():
        what = pos.state
        if pos.op is not None:
            what += f" {_op_name(pos.op)}"
        if pos.where:
            what += f" at {pos.where}"
        if pos.detail:
            what += f" ({pos.detail})"
        parts.append(f"rank {pos.rank}: {what}")
    return "The run stopped without a recognisable pattern. " + "; ".join(parts) + "."


# ---------------------------------------------------------------------------------------------
# source code: rank-conditional branches and loops


_RANK_TEST = re.compile(r"is_main_process|is_local_main_process|is_last_process|process_index|"
                        r"local_process_index|\brank\b|get_rank|RANK")
_trees: dict[str, Any] = {}


def _tree(filename: str | None):
    if not filename:
        return None
    if filename not in _trees:
        try:
            source = Path(filename).read_text()
            _trees[filename] = (ast.parse(source), source)
        except (OSError, SyntaxError, ValueError):
            _trees[filename] = None
    return _trees[filename]


def _rank_conditional(filename: str | None, line: int | None) -> bool:
    """Is ``line`` inside an ``if`` whose test depends on the rank (is_main_process, rank == 0...)?"""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return False
    tree, source = parsed
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.lineno < line <= (node.end_lineno or 0):
            test = ast.get_source_segment(source, node.test) or ""
            if _RANK_TEST.search(test):
                return True
    return False


def _enclosing_loop(filename: str | None, line: int | None) -> int | None:
    """The header line of the innermost for/while loop around ``line`` (None outside loops)."""
    parsed = _tree(filename)
    if parsed is None or line is None:
        return None
    best = None
    for node in ast.walk(parsed[0]):
        if isinstance(node, (ast.For, ast.While)) and node.lineno <= line <= (node.end_lineno or 0):
            if best is None or node.lineno > best:
                best = node.lineno
    return best


def _source_line(frame: dict[str, Any]) -> str:
    parsed = _tree(frame.get("file"))
    if parsed is None or not frame.get("line"):
        return ""
    lines = parsed[1].splitlines()
    index = frame["line"] - 1
    return lines[index] if 0 <= index < len(lines) else ""


# ---------------------------------------------------------------------------------------------
# after the fact: a folder of traces (kept with --keep, or written under torchrun)


def diagnose_dir(folder: str | Path, num_processes: int | None = None) -> Diagnosis:
    """Diagnose a finished run from its traces: a ``--keep`` folder, or one that ranks started as
    ``torchrun ... -m helpers.trace script.py`` with ``HELPERS_TRACE_DIR`` set wrote to.

    Exit codes are not known there: a rank without an exit record counts as killed. The
    ``detected_after_s`` is how long after the last progress the first failure came.
    """
    from helpers import trace

    folder = Path(folder)
    ranks = sorted(int(p.stem.split("-")[1]) for p in folder.glob("trace-*.jsonl"))
    num_processes = num_processes or (max(ranks) + 1 if ranks else 0)
    views = {}
    for rank in range(num_processes):
        view = RankView(rank)
        _read_new_records(view, trace.trace_path(folder, rank))
        try:
            view.state = json.loads(trace.state_path(folder, rank).read_text())
        except (FileNotFoundError, ValueError):
            pass
        status = (view.exit or {}).get("status")
        view.ended = True
        view.exit_code = {"finished": 0, "raised": 1}.get(status) if status else None
        views[rank] = view
    all_finished = all((v.exit or {}).get("status") == "finished" for v in views.values())
    diagnosis = diagnose(views, num_processes, "finished" if all_finished else "failure",
                         _post_mortem_delay(views))
    starts = [op.start for v in views.values() for op in v.python_ops() if op.start]
    diagnosis.evidence["started"] = min(starts, default=None)  # type: ignore[attr-defined]
    return diagnosis


def _post_mortem_delay(views: dict[int, RankView]) -> float | None:
    last_done = max((v.last_done_t or 0.0 for v in views.values()), default=0.0)
    failures = [op.end for v in views.values() for op in v.python_ops() if op.ok is False and op.end]
    failures += [v.exit["t"] for v in views.values() if v.exit and v.exit.get("status") == "raised"]
    if not failures or not last_done:
        return None
    return round(max(0.0, min(failures) - last_done), 3)


# ---------------------------------------------------------------------------------------------
# running things under the doctor


def run_command(command: list[str], num_processes: int = 2, stall_s: float = DEFAULT_STALL_S,
                timeout_s: float = 3600.0, keep_dir: str | Path | None = None,
                env: dict[str, str] | None = None) -> Diagnosis:
    """Run a script on ``num_processes`` local ranks under the doctor; return its diagnosis."""
    doctor = Doctor(stall_s, keep_dir=keep_dir)
    try:
        launch.launch_command(command, num_processes=num_processes, timeout_s=timeout_s,
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
        results = launch.launch(fn, args, kwargs, num_processes=num_processes, timeout_s=timeout_s,
                                watchers=[doctor])
    except LaunchError as error:
        if getattr(error, "diagnosis", None) is None:
            raise
        return error.diagnosis
    assert doctor.diagnosis is not None
    doctor.diagnosis.results = results  # type: ignore[attr-defined]
    return doctor.diagnosis


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
    parser.add_argument("--json", default="", help="write the diagnosis as JSON to this path")
    parser.add_argument("--keep", default="", help="keep traces, stacks and the diagnosis in this folder")
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
