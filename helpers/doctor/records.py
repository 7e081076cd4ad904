"""The doctor's evidence about each rank, read from a run folder (``helpers.rundir``).

``RankView`` folds one rank's trace records (``helpers.trace``): the Python-level operations
(``Op``), progress notes, how it ended, and its latest state dump (stack, Flight Recorder entries).
``read_new_records`` reads what a live rank appended since the last look; ``read_folder`` reads a
whole kept folder, leniently (a torchrun post-mortem: skip what is damaged) or strictly (a replay:
a missing or corrupt file is a ValueError naming it). ``Position`` says where a rank is, and
``Evidence`` keeps what a diagnosis was drawn from (the swimlane and the repro builder read it).
Every collector of evidence produces these records; ``helpers.doctor.diagnosis`` reasons on them.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from helpers import rundir
from helpers.collectives import FR_DTYPES, INIT_OP, SHAPE_CHECKED, canonical_op

KEPT_OPS = 4096  # Python-level records kept per rank in memory


WORLD_PG = "0"  # the default group's name in the records and the Flight Recorder
NOTED = "noted"  # an Op's source when it is a call a dead rank noted in place (``read_current``)

@dataclass
class Op:
    """One operation as one rank saw it (a Python-level record, or a Flight Recorder entry)."""

    op: str
    pg: str = WORLD_PG
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
    peer: int | None = None  # a send's destination or a recv's source (global rank)
    root: int | None = None  # a rooted collective's src or dst (global rank), as Python passed it
    splits: list | None = None  # all_to_all_single's [output rows, output splits, input splits]
    pg_ranks: list[int] | None = None  # the group's global ranks (a subgroup's; None: the world or unknown)
    pg_desc: str | None = None  # torch's description of a subgroup ('mesh_dp': a DeviceMesh dimension's)
    outside: bool = False  # called on new_group's placeholder for a rank outside the group (torch skips it)
    world: int | None = None  # init_process_group's: the world size it waits for (argument or WORLD_SIZE)
    thread: str | None = None  # the id of the thread that called it, when not the main thread
    batch: list | None = None  # batch_isend_irecv's [["send" or "recv", peer], ...]
    inferred: bool = False  # closed with no end on file (``RankView.close_passed``): ended, well or not
    returned: float | None = None  # an async call's return, its work queued (its end: the work's)

    def signature(self) -> tuple:
        """What must agree across ranks at one sequence number: the op, then shapes and dtypes."""
        return (canonical_op(self.op), _shape_key(self))


def _rank_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _ranks_or_none(value: Any) -> list[int] | None:
    if not isinstance(value, list) or any(_rank_or_none(each) is None for each in value):
        return None
    return value


def _batch_or_none(value: Any) -> list | None:
    def part_ok(part: Any) -> bool:
        return (isinstance(part, list) and len(part) == 2 and part[0] in ("send", "recv")
                and _rank_or_none(part[1]) is not None)

    return value if isinstance(value, list) and all(part_ok(part) for part in value) else None


def _splits_or_none(value: Any) -> list | None:
    return value if isinstance(value, list) and len(value) == 3 else None


def _shape_key(op: Op) -> tuple:
    if canonical_op(op.op) not in SHAPE_CHECKED or op.shapes is None:
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
    silent: bool = False  # its helper thread did not answer: its stack came from py-spy
    workers: list[dict[str, Any]] = field(default_factory=list)  # its DataLoader workers' stacks (py-spy)
    used_p2p: bool = False  # a p2p op was recorded: the groups' progress numbers differ from "seq"
    destroyed: dict[str, Any] | None = None  # its destroy_process_group's record (where it was called)
    completed: dict[str, int] = field(default_factory=dict)  # per group, the highest number seen to end
    posted: int | None = None  # the id of a call known from its start alone, posted before it ran (job)
    unheard: bool = False  # a job's rank that never posted a heartbeat: still starting, or never started
    current: Op | None = None  # the call it died in, its record still queued (``read_current``)
    node: int | None = None  # its node in a job (GROUP_RANK), where known

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one trace record into the view."""
        kind = event.get("ev")
        if kind == "op":
            self._start(event)
            if "te" in event:  # a call that had returned when its record was written
                self._end({"id": event["id"], "t": event["te"], "ok": event.get("ok")})
        elif kind == "end":
            self._end(event)
        elif kind == "enq":  # an async call returned: what it issued, it issued by then
            op = self.ops.get(event.get("id"))
            if op is not None:
                op.returned = event.get("t")
        elif kind == "pg":
            self._progress(event["pg"], event["t"])
        elif kind == "exit":
            self.exit = event
            if event.get("pg"):
                self._progress(event["pg"], event["t"])
        elif kind == "hello":
            self.hello = True
        elif kind == "destroy":  # the default group destroyed (destroy_process_group), from this line
            self.destroyed = event  # (its numbers stay: a note taken before may still come after it)

    def _start(self, event: dict[str, Any]) -> None:
        op = Op(op=event["op"], pg=event.get("pg", "0"), seq=event.get("seq"), shapes=event.get("shapes"),
                dtypes=event.get("dtypes"), where=event.get("where"), file=event.get("file"),
                line=event.get("line"), start=event["t"], p2p=bool(event.get("p2p")),
                async_=bool(event.get("async")), peer=_rank_or_none(event.get("peer")),
                root=_rank_or_none(event.get("root")), splits=_splits_or_none(event.get("splits")),
                pg_ranks=_ranks_or_none(event.get("pg_ranks")), pg_desc=_text_or_none(event.get("pg_desc")),
                world=_rank_or_none(event.get("world")), thread=_text_or_none(event.get("thread")),
                batch=_batch_or_none(event.get("batch")), outside=event.get("pg_outside") is True)
        if op.batch and op.peer is None and len({peer for _kind, peer in op.batch}) == 1:
            op.peer = op.batch[0][1]  # a batch with one peer: waited on as a send or recv with it is
        if len(self.order) == self.order.maxlen:  # forgotten, open or not (an isend never waited for)
            self.ops.pop(self.order[0], None)
            self.open.pop(self.order[0], None)
        self.order.append(event["id"])
        self.ops[event["id"]] = op
        self.open[event["id"]] = op
        self.used_p2p = self.used_p2p or op.p2p
        if op.op == INIT_OP:  # a new default group counts from 1 again
            self.completed = {}
        if self.group_up_t is None:
            self.group_up_t = event["t"]

    def _end(self, event: dict[str, Any]) -> None:
        op = self.open.pop(event["id"], None) or self.ops.get(event["id"])
        if op is None:
            return
        op.end, op.ok, op.error = event["t"], event.get("ok"), event.get("error")
        op.inferred = False  # its end came after a progress note had closed it
        if op.ok:
            self.last_done_t = max(self.last_done_t or 0.0, event["t"])
            self._completed(op)

    def _completed(self, op: Op) -> None:
        """A collective's end says its number completed: a progress note taken while it ran (the
        last, when the script then destroys the group) must not show the rank waiting in it."""
        if op.p2p or self.used_p2p or not op.seq:
            return
        self.completed[op.pg] = max(self.completed.get(op.pg, 0), op.seq)
        entry = self.progress.get(op.pg)
        if entry is None:
            return
        if entry[1] < op.seq <= entry[0]:
            self.progress = {**self.progress, op.pg: [entry[0], op.seq]}

    def _progress(self, progress: dict[str, list[int]], t: float) -> None:
        progress = self._not_before_completed(progress)
        if self.group_up_t is None:
            self.group_up_t = t
        for name, (_enq, done) in progress.items():
            if done > self.progress.get(name, [0, 0])[1]:
                self.last_done_t = max(self.last_done_t or 0.0, t)
        if progress != self.progress:
            self.progress, self.progress_t = progress, t
        self._close_completed(t)

    def _not_before_completed(self, progress: dict[str, list[int]]) -> dict[str, list[int]]:
        """``progress`` with no group behind a collective whose end is on file: under load the helper
        thread can note the groups' progress during a call and write the note after that call's end
        (the rank then showed as waiting in a collective it had finished)."""
        if self.used_p2p or not self.completed:
            return progress
        return {name: [max(enqueued, self.completed.get(name, 0)), max(done, self.completed.get(name, 0))]
                for name, (enqueued, done) in progress.items()}

    def _close_completed(self, t: float) -> None:
        """Close the open calls that the groups' progress shows completed: their ends were not on
        file (still queued when the rank was SIGKILLed, or not written yet), and a rank killed
        after five collectives must not show as waiting in its first. Not once the rank has used
        p2p ops: then torch's two numberings differ (``diagnosis.history``)."""
        if self.used_p2p:
            return
        for op_id, op in list(self.open.items()):
            done = self.progress.get(op.pg)
            if op.seq and done is not None and done[1] >= op.seq:  # not init_process_group's 0: the
                self.close_passed(op_id, t)  # group may show progress while it still waits there

    def close_passed(self, op_id: int, t: float) -> None:
        """Close an open call known to have completed (by ``t`` at the latest) though its end is
        not on file."""
        op = self.open.pop(op_id)
        op.end, op.ok, op.inferred = t, True, True

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


def read_new_records(view: RankView, path: Path) -> None:
    """Fold the records appended to ``path`` since the last call into ``view``."""
    try:
        with open(path, "rb") as handle:
            handle.seek(view.offset)
            data = handle.read()
    except FileNotFoundError:
        return
    fold(view, data)


def read_current(view: RankView, folder: str | Path) -> None:
    """For a rank that has ended: the call it was in as it died, noted in place (``rundir.CURRENT``)
    when that call's record was still queued, not on file (gloo aborts a rank within milliseconds
    of a size mismatch): ``view.current``. Its op, group and line are those of the first call from
    its line with as many bytes (its record in the rank's trace); its shapes are unknown (as many
    bytes may be another shape), and so is its peer or root (a loop may change it)."""
    try:
        data = rundir.current_path(folder, view.rank).read_bytes()
    except OSError:
        return
    if len(data) < rundir.CURRENT.size:
        return
    seq, first_id = rundir.CURRENT.unpack_from(data)
    if seq <= 0:  # returned (or no number to place it by)
        return
    first = view.ops.get(first_id) or _record_of(rundir.trace_path(folder, view.rank), first_id)
    if first is None or any(op.pg == first.pg and (op.seq or 0) >= seq for op in view.python_ops()):
        return  # on file
    view.current = replace(first, seq=seq, shapes=None, dtypes=None, out=None, start=None, end=None,
                           ok=None, error=None, peer=None, root=None, splits=None, batch=None, inferred=False,
                           source=NOTED)


def _record_of(trace: Path, op_id: int) -> Op | None:
    """The start of call ``op_id`` in a trace file (one ``RankView`` keeps the latest KEPT_OPS)."""
    marker = f'"id":{op_id},'.encode()
    try:
        with open(trace, "rb") as handle:
            line = next((line for line in handle if marker in line and b'"ev":"op"' in line), None)
    except OSError:
        return None
    if line is None:
        return None
    view = RankView(-1)
    fold(view, line)
    return view.ops.get(op_id)


def fold(view: RankView, data: bytes) -> list[dict[str, Any]]:
    """Fold newly appended trace bytes into ``view``; returns the complete records read."""
    view.offset += len(data)
    *lines, view.partial = (view.partial + data).split(b"\n")
    records = []
    for line in lines:
        try:
            record = json.loads(line)
            view.apply(record)
        except (ValueError, KeyError, TypeError):
            continue
        records.append(record)
    return records


def fr_op(entry: dict[str, Any]) -> Op:
    """A Flight Recorder entry as an ``Op`` (its names and dtypes in torch's spelling; the user's
    line when a dump's frames gave one: ``entry["site"]``)."""
    site = entry.get("site") or {}
    return Op(op=entry["profiling_name"], pg=entry.get("pg", "0"), seq=entry["collective_seq_id"],
              shapes=entry.get("input_sizes"), source="flight-recorder",
              dtypes=[FR_DTYPES.get(d, d) for d in entry.get("input_dtypes") or []],
              start=(entry.get("time_created_ns") or 0) / 1e9, where=site.get("where"),
              file=site.get("file"), line=site.get("line"), pg_desc=_text_or_none(entry.get("pg_desc")))


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
    fatal: int | None = None  # the fatal signal it died of (faulthandler's first, where a second fault
    #                           as it dumped its stack gave its exit status another signal)
    victim: bool = False  # raised inside a collective (a consequence, not a cause)
    exit_call: str = ""  # the sys.exit() / exit() it left through inside a loop ('sys.exit(0)'), at ``where``
    #                      or under a condition in a function outside any (``exit_early``)
    exit_from: tuple[str, int] | None = None  # its caller's line in that loop (a function called there)
    exit_early: bool = False  # that sys.exit() is under a condition in a function, outside any loop
    #                           of collectives (a helper's 'if deprecated: sys.exit(0)')
    exit_callers: list[tuple[str, int]] = field(default_factory=list)  # the calls up to it, innermost first
    destroyed_at: str = ""  # where it destroyed the default group ('train.py:10'), when it did
    destroyed_site: tuple[str, int] | None = None  # that line's file and number
    timed_out: bool = False  # its wait was ended from outside: torch's timeout, or a signal as it waited
    callers: list[tuple[str, int, str]] = field(default_factory=list)  # the user's frames it was called
    #                                     from, outermost first: (file, line, where)
    logged_at: str = ""  # its call runs in a logging handler, for a record logged at this user line


@dataclass
class Evidence:
    """What a diagnosis was drawn from; not part of its JSON (the swimlane and replays read it)."""

    views: dict[int, RankView] = field(default_factory=dict)
    histories: dict[int, dict[tuple[str, int], Op]] = field(default_factory=dict)
    positions: dict[int, Position] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    reason: str = ""
    detected_at: float | None = None  # when the diagnosis was made (the last state dump)
    started: float | None = None  # when the run started (its first call, after the fact)
    stall_start: float | None = None  # when progress stopped (hangs)


# ---------------------------------------------------------------------------------------------
# reading a whole folder


def read_folder(folder: str | Path, ranks: range, strict: bool = False,
                peers: dict[int, dict[int, int]] | None = None) -> dict[int, RankView]:
    """Every rank's view from a kept folder: trace records, last state dump, stacks.

    ``strict`` (a replay, ``repro --from-trace``): a missing trace or a corrupt record or state is
    a ValueError naming the parameter ``from_trace``, the file and the line. Otherwise (a
    post-mortem) damaged parts are skipped. ``peers`` collects each rank's p2p peers by record id.
    """
    folder = Path(folder)
    peers = {} if peers is None else peers
    views = {}
    for rank in ranks:
        view = RankView(rank)
        if strict:
            _read_strictly(view, folder, peers.setdefault(rank, {}))
        else:
            read_new_records(view, rundir.trace_path(folder, rank))
            view.state = _lenient_json(rundir.state_path(folder, rank))
        read_current(view, folder)
        view.stack_text = read_text(rundir.stack_path(folder, rank))
        views[rank] = view
    return views


def _lenient_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def read_text(path: Path) -> str:
    """A file's text, or '' when it is missing or unreadable (stacks are auxiliary)."""
    try:
        return path.read_text(errors="replace")
    except OSError:  # stacks are auxiliary: a missing or unreadable file is no stack
        return ""


def _read_strictly(view: RankView, folder: Path, peers: dict[int, int]) -> None:
    trace_file = rundir.trace_path(folder, view.rank)
    if not trace_file.is_file():
        raise ValueError(f"from_trace: {folder} holds no {trace_file.name} (the diagnosis names "
                         f"rank {view.rank}); keep the whole folder the doctor wrote")
    try:
        lines = trace_file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"from_trace: {trace_file} is corrupt: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or "ev" not in event:
                raise ValueError("not a trace record")
            view.apply(event)
            if event.get("p2p") and isinstance(event.get("peer"), int):
                peers[event["id"]] = event["peer"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"from_trace: {trace_file} line {number} is a corrupt record "
                             f"({type(exc).__name__}: {exc})") from None
    view.state = _strict_state(rundir.state_path(folder, view.rank))


def _strict_state(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"from_trace: {path} is corrupt: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("fr", []), list):
        raise ValueError(f"from_trace: {path} is corrupt: not a rank's state dump")
    return state
