"""The doctor's reasoning: per-rank evidence in, a ``Diagnosis`` out (pure functions).

``RankView`` folds one rank's trace records (``helpers.trace``), its progress notes and its latest
state dump (stack, Flight Recorder entries). ``diagnose(views, ...)`` finds each rank's position
(in a collective, outside any, finished, exited), the first divergence between the ranks'
collectives, and names the kind, the culprit ranks, a summary and the fix. ``diagnose_dir`` does
the same after the fact from a folder of traces (``--keep``, or a torchrun run).

Kinds (stable names): ok, collective-mismatch, shape-mismatch, rank-missing, rank-exited, unknown.
"""

from __future__ import annotations

import ast
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import params, report
from helpers.launch import describe_exit

EXIT_CODES = {"ok": 0, "hang": 3, "crash": 4, "mismatch": 5}
KEPT_OPS = 4096  # Python-level records kept per rank in memory
KINDS = ("ok", "collective-mismatch", "shape-mismatch", "rank-missing", "rank-exited", "unknown")

NB_REPRO, NB_EARLY_STOP, NB_MEMORY = params.NB_REPRO, params.NB_EARLY_STOP, params.NB_MEMORY

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


def read_new_records(view: RankView, path: Path) -> None:
    """Fold the records appended to ``path`` since the last call into ``view``."""
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
    # not part of the JSON: what the swimlane, the repro builder and notebooks draw from
    diagnosis.evidence = {"histories": histories, "positions": positions,  # type: ignore[attr-defined]
                          "views": views, "stacks": stacks or {}, "reason": reason,
                          "detected_at": time.time()}
    return diagnosis


def _verdict(kind: str, reason: str, positions: dict[int, Position]) -> str:
    if reason == "finished":
        return "ok" if kind == "ok" else "mismatch"
    if any(p.abnormal and not p.victim for p in positions.values()):
        return "crash"  # killed, a non-zero exit, an exception outside any collective
    if any(p.timed_out for p in positions.values()):
        return "hang"  # torch's timeout ended it; other ranks' errors are its echoes
    return "crash" if any(p.victim for p in positions.values()) else "hang"


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
        pos.exit_code = view.exit_code  # known after the fact for a rank its launcher stopped
        return pos
    pos.state, pos.exit_code, pos.abnormal = "exited", view.exit_code, True
    error = exit_record.get("error")
    failed = _failed_op(view) or _failed_inside(view, error)
    if failed is not None:
        pos.op, pos.victim = failed, True
        pos.where, pos.file, pos.line = failed.where, failed.file, failed.line
        pos.seq = failed.seq if pos.seq is None else pos.seq
        pos.timed_out = bool(re.search(r"timed out|timeout", failed.error or "", re.IGNORECASE))
        pos.detail = f"raised {short_error(failed.error)}"
    elif error:
        pos.op, pos.seq = None, None
        pos.where, pos.file, pos.line = (exit_record.get(k) for k in ("where", "file", "line"))
        pos.detail = f"raised {short_error(error)}"
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


def short_error(text: str | None) -> str:
    """An exception's first sentence, without gloo's source path: 'RuntimeError: Connection closed ...'."""
    text = re.sub(r"\[[^\]]*/[^\]]*:\d+\] ", "", text or "")
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    return first if len(first) <= 160 else first[:157] + "..."


def _failed_op(view: RankView) -> Op | None:
    """The rank's last Python-level call, if it raised (an earlier error the code caught is not it)."""
    ops = view.python_ops()
    if ops and ops[-1].end is not None and ops[-1].ok is False:
        return ops[-1]
    return None


def _current(view: RankView) -> Position:
    """A live (or last known) rank's position from its open ops, state dump and progress."""
    state = view.state or {}
    pending_fr = [e for e in state.get("fr") or [] if not e.get("retired") and not e.get("is_p2p")]
    sync_open = [op for op in view.open.values() if not op.async_]
    stack = state.get("stack") or faulthandler_stack(view.stack_text)
    frame = _innermost_user_frame(stack)
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
        pos = Position(view.rank, "in-collective", op=op, seq=op.seq, detail=_issued_by(stack))
        if frame:
            pos.where, pos.file, pos.line = frame["where"], frame["file"], frame["line"]
            op.where, op.file, op.line = pos.where, pos.file, pos.line
        return pos
    pos = Position(view.rank, "outside-collective", seq=None)
    if frame:
        pos.where, pos.file, pos.line = frame["where"], frame["file"], frame["line"]
        pos.detail = _activity(view.rank, frame, stack)
    return pos


_FH_THREAD = re.compile(r"^((Current thread|Thread) 0x[0-9a-f]+ .*|Stack )\(most recent call first\):?$",
                        re.MULTILINE)
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.MULTILINE)


def faulthandler_stack(text: str) -> list[dict[str, Any]]:
    """The main thread's frames (outermost first) from faulthandler's last dump in ``text``.

    The main thread is the one running a module's code (a ``<module>`` frame).
    """
    if not text:
        return []
    starts = [m.start() for m in _FH_THREAD.finditer(text)]
    blocks = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    dumps: list[list[dict[str, Any]]] = []
    for block in blocks:
        frames = [{"file": m["file"], "line": int(m["line"]), "func": m["func"],
                   "user": user_path(m["file"]), "where": f"{Path(m['file']).name}:{m['line']}"}
                  for m in _FH_FRAME.finditer(block)][::-1]
        if any(frame["func"] == "<module>" for frame in frames):
            dumps.append(frames)
    return dumps[-1] if dumps else []


def user_path(path: str) -> bool:
    """Is a file user code, judged by its path alone (torch, accelerate, helpers, stdlib are not)?"""
    from helpers import trace

    if "/helpers/scenarios/" in path:
        return True
    if path.startswith("<") or "site-packages" in path or "/helpers/" in path:
        return False
    return not path.startswith(trace._STDLIB)


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
    """What a rank outside any collective is doing: 'in a loop at train.py:41', 'sleeping at ...'."""
    innermost = stack[-1] if stack else frame
    sleeping = innermost.get("func") == "sleep" or "time.sleep" in _source_line(frame)
    loop = _enclosing_loop(frame.get("file"), frame.get("line"))
    where = f"in a loop at {Path(frame['file']).name}:{loop}" if loop is not None else f"at {frame['where']}"
    return f"sleeping {where}" if sleeping else where


# ---------------------------------------------------------------------------------------------
# classification


def _classify(positions: dict[int, Position], histories: dict[int, dict], views: dict[int, RankView]):
    divergence = first_divergence(histories)
    python = first_divergence({rank: python_history(view) for rank, view in views.items()})
    if python is not None and (divergence is None or (python[0][1], -len(python[2])) <
                               (divergence[0][1], -len(divergence[2]))):
        divergence = python  # earlier, or as early and seen by more ranks (a killed rank has no FR)
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
    # A rank killed while waiting in a collective after a peer died outside any (gloo can SIGSEGV
    # or SIGABRT when the peer's sockets close) is that death's echo, not a second cause.
    outside = [r for r in culprits if positions[r].state != "exited" or positions[r].op is None]
    return sorted(outside or culprits)


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
        what = pos.detail or ("outside any collective" if not pos.where else "")
        where.append(f"rank {rank} is {what}".rstrip()
                     + (f" ({pos.where})" if pos.where and pos.where not in what else ""))
    return text + "; " + "; ".join(where) + "."


def _unknown_summary(positions: dict[int, Position]) -> str:
    parts = []
    for pos in positions.values():
        what = pos.state
        if pos.op is not None:
            what += f" {_op_name(pos.op)}"
        if pos.where:
            what += f" at {pos.where}"
        if pos.detail and pos.detail != f"at {pos.where}":
            what += f" ({pos.detail})"
        parts.append(f"rank {pos.rank}: {what}")
    if all(pos.state == "outside-collective" for pos in positions.values()):
        lead = ("No rank was waiting in a collective: all were computing, or stuck outside "
                "torch.distributed (their stacks say where). ")
    else:
        lead = "The run stopped without a recognisable pattern. "
    return lead + "; ".join(parts) + "."


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


def diagnose_dir(folder: str | Path, num_processes: int | None = None,
                 exit_codes: dict[int, int] | None = None) -> Diagnosis:
    """Diagnose a finished run from its traces: a ``--keep`` folder, or one that ranks started as
    ``torchrun ... -m helpers.trace script.py`` with ``HELPERS_TRACE_DIR`` set wrote to.

    ``exit_codes`` (by rank) where known. A rank without an exit record that was killed by
    SIGTERM (or whose end is unknown) while another rank failed was stopped by its launcher
    (torchrun stops every rank when one fails): it is shown where it was, not blamed.
    ``detected_after_s`` is how long the wait that failed first lasted (torch's timeout).
    """
    from helpers import trace

    folder = Path(folder)
    ranks = sorted(int(p.stem.split("-")[1]) for p in folder.glob("trace-*.jsonl"))
    num_processes = num_processes or (max(ranks) + 1 if ranks else 0)
    views = {}
    for rank in range(num_processes):
        view = RankView(rank)
        read_new_records(view, trace.trace_path(folder, rank))
        try:
            view.state = json.loads(trace.state_path(folder, rank).read_text())
        except (FileNotFoundError, ValueError):
            pass
        view.stack_text = _read_text(trace.stack_path(folder, rank))
        status = (view.exit or {}).get("status")
        view.ended = True
        view.exit_code = (exit_codes or {}).get(rank, {"finished": 0, "raised": 1}.get(status))
        views[rank] = view
    for view in views.values():
        if view.exit is None and view.exit_code in (None, -15) and _failed_elsewhere(view.rank, views):
            view.ended = False  # stopped by the launcher after another rank failed
    all_finished = all((v.exit or {}).get("status") == "finished" for v in views.values())
    diagnosis = diagnose(views, num_processes, "finished" if all_finished else "failure",
                         _post_mortem_delay(views))
    starts = [op.start for v in views.values() for op in v.python_ops() if op.start]
    diagnosis.evidence["started"] = min(starts, default=None)  # type: ignore[attr-defined]
    return diagnosis


def _failed_elsewhere(rank: int, views: dict[int, RankView]) -> bool:
    for other in views.values():
        status = (other.exit or {}).get("status")
        if other.rank != rank and (status in ("raised", "exited") or other.exit_code not in (0, None, -15)):
            return True
    return False


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


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


