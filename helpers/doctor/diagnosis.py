"""The doctor's reasoning: per-rank evidence in, a ``Diagnosis`` out.

``diagnose(views, ...)`` finds each rank's position (in a collective, outside any, finished,
exited), the first divergence between the ranks' collectives (by process group and torch's
sequence number, from the Flight Recorder or the Python-level records), and names the kind, the
culprit ranks, a summary and the fix (``helpers.doctor.wording``). Views come from any collector
(``helpers.doctor.records``); the reasoning is the same for all.

Kinds (stable names): ok, collective-mismatch, shape-mismatch, rank-missing, rank-exited, unknown.
"""

from __future__ import annotations

import collections
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from helpers import report
from helpers.collectives import (
    ALL_JOIN,
    INIT_OP,
    MULTI_OPS,
    OBJECT_LISTS,
    OPS,
    ROOTS,
    SPLIT_OPS,
    canonical_op,
)
from helpers.doctor import wording
from helpers.doctor.records import KEPT_OPS, NOTED, WORLD_PG, Evidence, Op, Position, RankView, fr_op
from helpers.doctor.source import (
    call_chain,
    enclosing_condition,
    enclosing_function,
    enclosing_loop,
    faulthandler_stack,
    faulthandler_threads,
    goes_first_block,
    in_loop_body,
    opposite_branches,
    rank_conditional,
    share_a_loop,
    source_line,
)
from helpers.rundir import describe_exit
from helpers.sites import installed

EXIT_CODES = {"ok": 0, "hang": 3, "crash": 4, "mismatch": 5}
KINDS = ("ok", "collective-mismatch", "shape-mismatch", "rank-missing", "rank-exited", "unknown")
FIXES = wording.FIXES


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
    """What the doctor concluded. Its JSON (``to_json``, ``--json``) is the doctor's schema:
    verdict, kind, ranks, summary, fix, detected_after_s and per_rank (one ``RankReport`` per rank
    of the world). ``evidence`` and ``results`` are not part of it."""

    verdict: str  # ok | hang | crash | mismatch
    kind: str
    ranks: list[int]
    summary: str
    fix: str
    detected_after_s: float | None
    per_rank: list[RankReport] = field(default_factory=list)
    # what the swimlane, the repro builder and notebooks draw from
    evidence: Evidence = field(default_factory=Evidence, repr=False, compare=False,
                               metadata={"json": False})
    # the ranks' return values, when every rank returned (runs of a function)
    results: list[Any] | None = field(default=None, repr=False, compare=False, metadata={"json": False})
    # what the evidence could not tell (stacks alone: no sequence numbers, no shapes)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Diagnosis:
        """A diagnosis read back from its JSON (``diagnosis.json``); the evidence stays empty."""
        names = [f.name for f in fields(RankReport)]
        per_rank = [RankReport(**{name: entry.get(name) for name in names})
                    for entry in data.get("per_rank") or []]
        return cls(verdict=data.get("verdict"), kind=data.get("kind"), ranks=list(data.get("ranks") or []),
                   summary=data.get("summary") or "", fix=data.get("fix") or "",
                   detected_after_s=data.get("detected_after_s"), per_rank=per_rank,
                   notes=list(data.get("notes") or []))

    def to_dict(self) -> dict[str, Any]:
        """The doctor's JSON; ``notes`` (what the evidence could not tell) only when there are some."""
        data = report.to_jsonable(self)
        if not data["notes"]:
            del data["notes"]
        return data

    @property
    def exit_code(self) -> int:
        """The CLI's exit code for this verdict (0 ok, 3 hang, 4 crash, 5 mismatch)."""
        return EXIT_CODES[self.verdict]

    def rows(self) -> list[dict[str, Any]]:
        """The per-rank table as dict rows (culprit column included)."""
        rows = []
        for entry in self.per_rank:
            row = report.to_jsonable(entry)
            row["shapes"] = wording.shapes_text(entry.shapes)
            row["culprit"] = entry.rank in self.ranks
            rows.append(row)
        return rows

    def text(self) -> str:
        """A plain-text report for the CLI and logs."""
        columns = [f.name for f in fields(RankReport)]
        rows = [{**row, "rank": f"{row['rank']}{' *' if row['culprit'] else ''}"} for row in self.rows()]
        head = f"doctor: {self.verdict} ({self.kind})"
        if self.detected_after_s is not None:
            head += f", detected {self.detected_after_s:.1f} s after progress stopped"
        notes = [f"note: {note}" for note in self.notes]
        return "\n".join([head, self.summary, "", report.text_table(rows, columns), "", "fix: " + self.fix,
                          *notes])

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
                f"<p><b>Fix:</b> {html.escape(self.fix)}</p>"
                + "".join(f"<p><i>{html.escape(note)}</i></p>" for note in self.notes) + "</div>")

    def swimlane(self, title: str | None = None):
        """A matplotlib Figure: one lane per rank, collectives as boxes, the divergence marked."""
        from helpers.doctor.swimlane import swimlane

        return swimlane(self, title)


def diagnose(views: dict[int, RankView], num_processes: int, reason: str,
             detected_after_s: float | None, stacks: dict[int, str] | None = None,
             unseen_missing: bool = False) -> Diagnosis:
    """Name what went wrong from the ranks' views. ``reason``: stall, exited, failure, timeout, finished.

    A rank without a view has exited, unless ``unseen_missing`` (evidence from one node of many:
    the others' ranks were not looked at): then it is "unseen" and judged by nobody.
    """
    missing = Position(0, "unseen") if unseen_missing else Position(0, "exited")
    _close_passed(views)
    positions = {rank: position(views[rank]) if rank in views else replace(missing, rank=rank)
                 for rank in range(num_processes)}
    histories = {rank: history(view) for rank, view in views.items()}
    kind, culprits, summary, *cures = _classify(positions, histories, views)  # a cure the evidence tells
    if kind == "ok" and reason == "finished":  # though a collective raised on a rank that caught it
        caught = _caught_failures(views)
        first = min(caught.values(), key=lambda each: each.start or 0.0) if caught else None
        left = _left_before(first, caught, views) if first is not None else []
        if left:
            kind, culprits = "rank-exited", left
            summary = wording.caught_failure_summary(caught, first, left, positions)
    if wording.SWALLOWED in summary:  # a collective in a try whose except swallows a rank's error
        cures = [wording.SWALLOW_CURE, *cures]
    if wording.SWALLOWED_END in summary:  # a rank that may have caught its error, ended through a finally
        # after the loop's own cures when a loop that ran out first explains the end as well
        ran_out = wording.LOOP_RAN_OUT in summary
        cures = [*cures, wording.SWALLOWED_END_CURE] if ran_out else [wording.SWALLOWED_END_CURE, *cures]
    outsiders = _calls_outside_their_group(views)
    if kind != "ok" and outsiders:  # torch skipped them: these ranks went on, their group's members wait
        kind, culprits = "collective-mismatch", sorted(outsiders)
        summary, cures = wording.outside_group_summary(outsiders, positions), [wording.OUTSIDE_GROUP_CURE]
    sizes = _batch_sizes(views)
    if kind != "ok" and len(set(sizes.values())) > 1:  # find_executable_batch_size retried on some alone
        culprits = sorted(rank for rank, size in sizes.items() if size < max(sizes.values()))
        summary += wording.batch_sizes_text(sizes)
        cures = [wording.BATCH_SIZE_CURE, *cures]
    threads = {rank: found for rank, view in views.items() if (found := _threads_on_one_group(view))}
    aborted = any(_aborted_inside(pos) for pos in positions.values())
    if threads and (kind in _THREADS_EXPLAIN or (kind == "rank-exited" and aborted)):
        # calls met in any order: sizes or calls that differ; every rank whose threads took turns,
        # with the ranks the evidence named (one whose dump or records are lost, the one gloo aborted)
        kind, culprits = "collective-mismatch", sorted({*culprits, *threads})
        summary += wording.threads_text(threads)
        cures = [wording.THREADS_CURE, *cures]
    nodes = _sides_by_node(positions, views) if kind in ("shape-mismatch", "collective-mismatch") else None
    if nodes:  # each node's ranks alike, the nodes not: something each node read for itself
        summary += wording.by_node_text(nodes)
        cures = [*cures, wording.BY_NODE_CURE]
    verdict = _verdict(kind, reason, positions)
    if verdict == "ok":
        detected_after_s = None
    per_rank = [_report(positions[rank]) for rank in range(num_processes)]
    evidence = Evidence(views=views, histories=histories, positions=positions, stacks=stacks or {},
                        reason=reason, detected_at=time.time())
    fix = wording.fix(kind, [positions[rank] for rank in culprits if rank in positions], cures)
    return Diagnosis(verdict, kind, culprits, summary, fix, detected_after_s, per_rank, evidence)


# what calls of two threads, met in a different order on each rank, leave: calls or sizes that differ,
# nothing recognisable, or a rank gloo aborted (a mismatch of calls keeps its own culprits)
_THREADS_EXPLAIN = ("collective-mismatch", "shape-mismatch", "unknown")


def _calls_outside_their_group(views: dict[int, RankView]) -> dict[int, Op]:
    """Each rank's first collective on the placeholder ``new_group`` hands the ranks outside a group
    (``Op.outside``). torch skips such a call with a warning ('Running all_reduce on global rank 1
    which does not belong to the given group') and returns at once."""
    found = {}
    for rank, view in views.items():
        for op in view.python_ops():
            if op.outside:
                found[rank] = op
                break
    return found


def _batch_sizes(views: dict[int, RankView]) -> dict[int, int]:
    """The batch size each rank's accelerate find_executable_batch_size runs with now, where its
    stack shows one (``helpers.trace.callsites.describe_stack``): its innermost."""
    sizes = {}
    for rank, view in views.items():
        found = [frame["batch_size"] for frame in (view.state or {}).get("stack") or []
                 if isinstance(frame.get("batch_size"), int)]
        if found:
            sizes[rank] = found[-1]
    return sizes


def _close_passed(views: dict[int, RankView]) -> None:
    """Close each rank's open call that the group has since passed: another rank completed a later
    collective of the group that no rank leaves before all have joined (``ALL_JOIN``), so this rank
    issued it too and its record of the earlier call is stale (a rank SIGKILLed between its
    watchdog's beats, its ends still queued). A call known from the start its rank posted alone
    (``posted``) closes once another rank's record shows that one ended well and none shows it
    failed: the rank got through it, and may have gone on. A progress note proves less: torch counts
    a collective that failed as completed (gloo aborted the posting rank inside it, and the others'
    calls failed or were stopped). Not on a rank that used p2p ops (two numberings)."""
    passed: dict[tuple[int, str], tuple[int, float]] = {}  # (rank, group) -> its highest such seq, end
    recorded: dict[tuple[int, str], tuple[int, float]] = {}  # the same, by ends on file alone
    failed: set[tuple[str, int]] = set()  # (group, seq) some rank's record shows ended in an error
    for rank, view in views.items():
        for op in view.python_ops():
            if op.seq is None or op.end is None or op.p2p or canonical_op(op.op) not in ALL_JOIN:
                continue
            if op.ok is False:
                failed.add((op.pg, op.seq))
            elif op.ok:
                _note_highest(passed, (rank, op.pg), op)
                if not op.inferred:
                    _note_highest(recorded, (rank, op.pg), op)
    for rank, view in views.items():
        if view.used_p2p:
            continue
        for op_id, op in list(view.open.items()):
            through = op_id == view.posted and canonical_op(op.op) in ALL_JOIN
            if through and (op.pg, op.seq) in failed:
                continue
            reached = op.seq if through else (op.seq or 0) + 1  # what another rank must have completed
            later = [done for (other, group), done in (recorded if through else passed).items()
                     if other != rank and group == op.pg and op.seq is not None and done[0] >= reached]
            if later:
                view.close_passed(op_id, min(end for _seq, end in later))


def _note_highest(highest: dict[tuple[int, str], tuple[int, float]], key: tuple[int, str], op: Op) -> None:
    """Keep in ``highest`` the (seq, end) of the highest-numbered of the ops noted under ``key``."""
    if op.seq > highest.get(key, (0, 0.0))[0]:
        highest[key] = (op.seq, op.end)


def _sides_by_node(positions: dict[int, Position], views: dict[int, RankView]) -> dict[int, list[int]] | None:
    """Each node's ranks (a job's, ``RankView.node``) when the ranks' calls differ along the nodes
    alone: every node's ranks issued one call (op, shapes, dtypes, root), and the nodes did not all
    issue the same; None otherwise, and where no node runs more than one rank (any split is by node)."""
    nodes: dict[int, list[int]] = {}
    for rank, pos in positions.items():
        node = views[rank].node if rank in views else None
        if node is None or pos.op is None:
            return None
        nodes.setdefault(node, []).append(rank)
    calls = {node: {positions[rank].op.signature() for rank in ranks} for node, ranks in nodes.items()}
    if len(nodes) < 2 or max(len(ranks) for ranks in nodes.values()) < 2 or \
            any(len(signatures) > 1 for signatures in calls.values()):
        return None
    return nodes if len({signatures.pop() for signatures in calls.values()}) > 1 else None


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
    return {(op.pg, op.seq): op for op in _collectives(view) if op.seq is not None}


def _collectives(view: RankView) -> list[Op]:
    """The rank's Python-level collectives, oldest first: neither p2p ops nor the group's setup."""
    return [op for op in view.python_ops() if not op.p2p and op.op != INIT_OP]


def history(view: RankView) -> dict[tuple[str, int], Op]:
    """The rank's collectives by (process group, sequence number), sites attached where known.

    From the Flight Recorder when the rank's state dump has it (it sees C++ collectives too),
    else from the Python-level records. The two number sequences agree unless p2p ops were used.
    """
    python = _collectives(view)
    fr = (view.state or {}).get("fr") or []
    if not fr:
        return python_history(view)
    entries: dict[tuple[str, int], Op] = {}
    on_group: dict[str, list[Op]] = {}  # the Python-level calls by group
    for entry in fr:
        if entry.get("is_p2p"):
            continue
        created = (entry.get("time_created_ns") or 0) / 1e9
        op = fr_op(entry)
        if op.pg not in on_group:
            on_group[op.pg] = [each for each in python if each.pg in (op.pg, None, "?")]
        owner = _owner(on_group[op.pg], created)
        op.ok = True if entry.get("retired") else None
        if owner is not None:
            _adopt(op, owner, entry["profiling_name"])
        entries[(op.pg, op.seq)] = op
    return entries


def _adopt(op: Op, owner: Op, recorded_name: str) -> None:
    """Give a Flight Recorder entry the site, name, shapes (and split sizes) of the Python call that
    issued it."""
    op.where, op.file, op.line, op.end, op.error = owner.where, owner.file, owner.line, owner.end, owner.error
    op.start, op.pg_ranks = owner.start, owner.pg_ranks
    if owner.end is not None:
        op.ok = owner.ok
    if not owner.op.endswith(("_object", "_object_list")):  # those issue several inner collectives
        op.op = owner.op
        op.shapes = owner.shapes if owner.shapes is not None else op.shapes
        op.dtypes = owner.dtypes or op.dtypes
        op.splits = owner.splits  # all_to_all_single's: the Flight Recorder keeps none
    else:
        op.op = f"{owner.op} ({recorded_name.split(':', 1)[-1]})"


_CLOCK_SLACK_S = 1e-4  # both clocks are the wall clock; the entry is created inside the call


def _owner(python: list[Op], created: float) -> Op | None:
    """The Python-level call during which a Flight Recorder entry was created: the one whose
    times hold it, else the one they hold within the clocks' slack (the next call can start within
    the slack of a short barrier's entry: it must not take it, as it did under load). An async
    call's times end where it returned, not where its work completed: DDP's gradient all-reduce,
    issued from C++ meanwhile (under Join, after its async all_reduces), is not its; its return
    is read after the call, so no slack is given to it (DDP's next entry came 100 us later).
    ``python``: the calls on the entry's group alone (a thread's blocking all_reduce on a group of its
    own holds the times of the main thread's entries on the default group)."""
    for slack in (0.0, _CLOCK_SLACK_S):
        for op in reversed(python):
            if op.start is None:
                continue
            returned = op.async_ and op.returned is not None
            end, end_slack = (op.returned, 0.0) if returned else (op.end, slack)
            if op.start - slack <= created and (end is None or created <= end + end_slack):
                return op
            if end is not None and end < created - slack:
                break
    return None


def position(view: RankView) -> Position:
    """Where a rank is: in a collective, outside any, finished, or exited (and how), and the
    user's frames that led there."""
    pos = _position(view)
    pos.callers = _callers(view) or _callers_by_source(pos)
    if pos.state == "in-collective":
        pos.logged_at = _logged_at(main_stack(view))
    return pos


_LOGGING = "/logging/__init__.py"


def _logged_at(stack: list[dict[str, Any]]) -> str:
    """The user's line that logged the record whose handler runs the rank's call ('train.py:91':
    its frames go from that line through the logging module's handle/callHandlers to the user's
    emit); '' when the call does not run in a logging handler."""
    for index, frame in enumerate(stack):
        if str(frame.get("file", "")).endswith(_LOGGING) and frame.get("func") == "callHandlers":
            before = [f for f in stack[:index] if f.get("user")]
            after = [f for f in stack[index + 1:] if f.get("user")]
            return str(before[-1].get("where") or "") if before and after else ""
    return ""


def _callers_by_source(pos: Position) -> list[tuple[str, int, str]]:
    """The user's frames that led to a rank's call, read from the source (``call_chain``), for a
    rank whose stack never reached the doctor (gloo aborted it within milliseconds)."""
    file = pos.file or (pos.op.file if pos.op is not None else None)
    line = pos.line or (pos.op.line if pos.op is not None else None)
    if not file or not line or installed(file):
        return []
    return [(file, each, f"{Path(file).name}:{each}") for each in call_chain(file, line)]


def _callers(view: RankView) -> list[tuple[str, int, str]]:
    """The user's frames (file, line, where) a rank was in, outermost first: its error's traceback,
    else its last stack."""
    recorded = (view.exit or {}).get("callers")
    if isinstance(recorded, list) and recorded:
        callers = [tuple(caller) for caller in recorded if isinstance(caller, list) and len(caller) == 3]
    else:
        stack = main_stack(view)
        callers = [(frame["file"], frame["line"], frame["where"]) for frame in stack if frame.get("user")]
    # the user's own files: an installed package counts as the user's code for a call site, but its
    # loops and branches (a trainer's, a test runner's) are not the user's story
    return [caller for caller in callers if not installed(str(caller[0]))]


def rank_branch(pos: Position) -> str | None:
    """Where the rank entered a branch on the rank on its way to where it is: its own line's, or a
    caller's ('train.py:41', where ``evaluate(model)`` sits under ``if accelerator.is_main_process:``);
    None when no branch on the rank leads there."""
    file, line = pos.file or (pos.op and pos.op.file), pos.line or (pos.op and pos.op.line)
    if rank_conditional(file, line):
        return pos.where or (pos.op and pos.op.where) or ""
    return next((where for file, line, where in pos.callers if rank_conditional(file, line)), None)


def _position(view: RankView) -> Position:
    pos = _position_of(view)
    if view.destroyed is not None and pos.state != "in-collective":
        pos.destroyed_at = str(view.destroyed.get("where") or "")
        file, line = view.destroyed.get("file"), view.destroyed.get("line")
        pos.destroyed_site = (file, line) if isinstance(file, str) and isinstance(line, int) else None
    return pos


def _position_of(view: RankView) -> Position:
    exit_record = view.exit or {}
    if view.ended and view.exit_code == 0 and exit_record.get("status") == "finished":
        pos = Position(view.rank, "finished", exit_code=0, seq=view.last_seq() or None)
        _place_exit_call(pos, exit_record, view)
        return pos
    pos = _current(view)
    if not view.ended and view.exit is None:
        pos.exit_code = view.exit_code  # known after the fact for a rank its launcher stopped
        return pos
    pos.state, pos.exit_code, pos.abnormal = "exited", view.exit_code, True
    error = exit_record.get("error")
    failed = _failed_op(view) or _failed_inside(view, error)
    if failed is not None and failed.op == INIT_OP and not _init_echo(failed.error or ""):
        failed = None  # its own setup failed (a peer's address refused): its own error, not an echo
    if exit_record.get("status") == "stopped":  # its launcher stopped it: an echo, not a cause,
        pos.victim = not exit_record.get("orphaned")  # unless its launcher died (a lost node)
        pos.detail = f"stopped: {exit_record.get('by') or describe_exit(view.exit_code)}"
        stopped_in = _stopped_in(view, failed, pos) if pos.op is None else None
        if stopped_in is not None:  # shown with its shapes
            pos.op, pos.seq = stopped_in, stopped_in.seq
            pos.where, pos.file, pos.line = stopped_in.where, stopped_in.file, stopped_in.line
        if pos.where is None:
            last = next((op for op in reversed(view.python_ops()) if op.where), None)
            pos.where, pos.file, pos.line = (last.where, last.file, last.line) if last else (None,) * 3
    elif failed is not None:
        pos.op, pos.victim = failed, True
        pos.where, pos.file, pos.line = failed.where, failed.file, failed.line
        pos.seq = failed.seq if pos.seq is None else pos.seq
        pos.timed_out = bool(_ENDED_WAITING.search(failed.error or ""))
        pos.detail = f"raised {wording.short_error(failed.error)}"
    elif error:
        pos.op, pos.seq = None, None
        pos.where, pos.file, pos.line = (exit_record.get(k) for k in ("where", "file", "line"))
        pos.detail = f"raised {wording.short_error(error)}"
    else:
        known = view.exit_code is not None
        pos.detail = describe_exit(view.exit_code) if known else "ended (no exit recorded)"
        pos.fatal = _fatal_signal(view) if known and view.exit_code < 0 else None  # a child's dump: not its
        if pos.fatal is not None and pos.fatal != -view.exit_code:
            then = describe_exit(view.exit_code).removeprefix("killed by ")
            pos.detail = f"{describe_exit(-pos.fatal)} (then {then}, a second fault as its stack was dumped)"
        if exit_record.get("status") == "vanished":  # gone, never said how (the doctor in a job)
            pos.detail = ("killed: no exception and no exit code, e.g. SIGKILL; a fatal signal such as "
                          "gloo's abort prints 'Fatal Python error' and where it was in its log")
        if not any(not op.async_ for op in view.open.values()):
            pos.op = pos.seq = None  # its last progress note may be stale: do not guess an op
            dying = _dying_call(view)  # unless the stack dumped at its fatal signal shows it in one,
            noted = view.current  # or it noted the call it died in (the same line's: its number)
            if noted is not None and (dying is None or (dying.file, dying.line) == (noted.file, noted.line)):
                dying = noted
            if dying is not None:
                pos.op, pos.seq = dying, dying.seq
                pos.where, pos.file, pos.line = dying.where, dying.file, dying.line
        last = next((op for op in reversed(view.python_ops()) if op.where), None)
        if pos.op is None and last is not None:
            pos.where, pos.file, pos.line = last.where, last.file, last.line
        if exit_record.get("status") == "exited":  # a non-zero sys.exit(): inside a loop, its line
            _place_exit_call(pos, exit_record, view)
    return pos


# 'sys.exit(0)', 'exit()', 'sys.exit(main())', 'raise SystemExit(2)' in the line that raised it
_EXIT_CALL = re.compile(r"\b(?:sys\.exit|exit|quit)\((?:[^()]|\([^()]*\))*\)"
                        r"|\braise SystemExit\b(?:\([^()]*\))?")


def _place_exit_call(pos: Position, exit_record: dict, view: RankView) -> None:
    """A rank that left through ``sys.exit()`` (or ``exit()``) in a turn of a loop that holds its
    collectives, early, while the loop may still have held collectives for the others (the call in
    the loop's body, or in a function called there): placed at that call. Not for one outside any
    loop (``sys.exit(main())`` at a script's end), in a loop's
    ``else``, or in a loop of no collectives of its own (a retry loop around ``main()`` holds them
    only through the call)."""
    site = exit_record.get("exit_site")
    if not isinstance(site, dict):
        return
    file, line = site.get("file"), site.get("line")
    callers = [(caller[0], caller[1]) for caller in exit_record.get("exit_callers") or []
               if isinstance(caller, list) and len(caller) == 3]
    frames = [(file, line)] + [frame for frame in reversed(callers) if frame != (file, line)]
    held = next((frame for depth, frame in enumerate(frames)
                 if _loop_holds_collectives(frame, frames[:depth], view)), None)
    if held is None:
        if not _exits_early(file, line):
            return
        pos.exit_early = True  # named at its line, from the script's own line that called down to it
        script = frames[-1][0]  # the outermost user frame's file: the script run as __main__
        held = next(frame for frame in frames if frame[0] == script)
    found = _EXIT_CALL.search(source_line(site))
    pos.exit_call = found.group(0) if found else "a SystemExit"
    pos.where, pos.file, pos.line = site.get("where"), file, line
    if held != (file, line):  # sys.exit() in a function called inside the loop
        pos.exit_from = held
        pos.exit_callers = frames[1:frames.index(held) + 1]


def _exits_early(file: str | None, line: int | None) -> bool:
    """Is a sys.exit() at ``file:line`` an early exit outside any loop: under an ``if`` inside the
    function it is in ('if spec["status"] == "deprecated": sys.exit(0)' in a helper), not a script's
    last line (``sys.exit(main())``) nor a function's unconditional end?"""
    function = enclosing_function(file, line)
    condition = enclosing_condition(file, line)
    return bool(function) and condition is not None and condition[0] > function


def _loop_holds_collectives(frame: tuple[str | None, int | None], inner: list[tuple[str | None, int | None]],
                            view: RankView) -> bool:
    """Is a frame's line in the body of a loop that holds collectives of the rank's own: there, or
    in a function it called on the way to the exit (``inner``: those calls' frames)?"""
    file, line = frame
    header = enclosing_loop(file, line)
    if header is None or not in_loop_body(file, header, line):
        return False
    functions = {(each[0], enclosing_function(*each)) for each in inner}
    return any(op.line and ((op.file == file and share_a_loop(file, line, op.line))
                            or (op.file, enclosing_function(op.file, op.line)) in functions)
               for op in view.python_ops())


# faulthandler's header at each fatal signal it handles (Modules/faulthandler.c)
_FATAL_NAMES = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS,
                "Floating-point exception": signal.SIGFPE, "Illegal instruction": signal.SIGILL}


def _fatal_signal(view: RankView) -> int | None:
    """The fatal signal a rank died of: the first that faulthandler named in its log ('Fatal Python
    error: Aborted'; gloo's abort can fault again as the stacks are dumped, and the process then
    ends by SIGSEGV), else its exit status's, else None."""
    fatal = _FATAL.search(view.stack_text or "")
    if fatal is not None:
        name = view.stack_text[fatal.end():].split("\n", 1)[0].strip()
        if name in _FATAL_NAMES:
            return int(_FATAL_NAMES[name])
    code = view.exit_code
    return -code if code is not None and code < 0 else None


def _dying_call(view: RankView) -> Op | None:
    """The collective a rank killed by a fatal signal was in, from the stack faulthandler dumped
    as it died ('Fatal Python error: Aborted'): torch's Python function of the op, called from the
    user's line. Its number and shapes are unknown (the record it queued died with it)."""
    return next((op for op, main in _dying_calls(view).values() if main), None)


def _dying_calls(view: RankView) -> dict[str, tuple[Op, bool]]:
    """``_dying_call`` of each of the rank's threads that was in a collective: {its id: (the call,
    whether it is the main thread)}."""
    fatal = _FATAL.search(view.stack_text or "")
    if fatal is None:
        return {}
    calls = {}
    for thread, main, stack in faulthandler_threads(view.stack_text[fatal.start():]):
        frame = _innermost_user_frame(stack)
        inside = next((f for f in stack if f["func"] in OPS and "/torch/distributed/" in f["file"]),
                      None)  # the outermost: broadcast_object_list, not the broadcast it issues
        if inside is not None and frame is not None:
            calls[thread] = (Op(op=inside["func"], seq=None, where=frame["where"], file=frame["file"],
                                line=frame["line"], source="stack"), main)
    return calls


_ThreadCall = tuple[str, Op, bool]  # a call on a group: its thread's id, the call, whether it is the main one


def _threads_on_one_group(view: RankView) -> dict[str, tuple[Op, bool]] | None:
    """Two or more of the rank's threads issuing collectives on one process group where it failed:
    {a thread's id: (its latest call there, whether it is the main thread)}; else None.

    Either the stack faulthandler dumped as the rank died shows two threads inside collectives on
    one group (each line's group as its records say), or its Flight Recorder (each entry names its
    thread) shows the group's last two calls from two threads, in flight at once, each entry
    matched with the Python call of its number (with dumps alone, ``--from-fr``: each entry with the
    user's line from its own frames), or its own records (each names a thread other than
    the main one) show the group's last two blocking calls so (a rank that died leaves no Flight
    Recorder, and its dying dump may be cut short by a second fault). C++'s own calls (DDP's, from
    autograd's threads) have no Python call and are left out, as are numbers two Python calls took
    (read as two threads raced) and ranks that used p2p ops (whose numbers drift from the Python calls').
    """
    python = _collectives(view)
    group_of = {op.where: op.pg for op in python if op.where}
    dying: dict[str, dict[str, tuple[Op, bool]]] = {}
    for thread, (op, main) in _dying_calls(view).items():
        if op.where in group_of:
            dying.setdefault(group_of[op.where], {})[thread] = (replace(op, pg=group_of[op.where]), main)
    found = next((threads for threads in dying.values() if len(threads) > 1), None)
    if found is not None or view.used_p2p:
        return found
    taken = collections.Counter((op.pg, op.seq) for op in python if op.seq is not None)
    numbered = {(op.pg, op.seq): op for op in python if op.seq is not None and taken[(op.pg, op.seq)] == 1}
    calls: dict[str, list[_ThreadCall]] = {}  # group: (thread, call, main), oldest first
    dumps_alone = all(op.source == "flight-recorder" for op in python)  # --from-fr: no Python records
    for entry in (view.state or {}).get("fr") or []:
        op = numbered.get((str(entry.get("pg")), entry.get("collective_seq_id")))
        if op is None and dumps_alone and entry.get("site"):  # each entry's own frames
            op = fr_op(entry)
            op.end = _fr_end(entry, op)
        if entry.get("thread") and op is not None and not entry.get("is_p2p"):
            calls.setdefault(op.pg, []).append((entry["thread"], op, bool(entry.get("main"))))
    found = _last_two_from_two_threads(calls)
    if found is not None or not any(op.thread for op in python):  # no thread named: an older tracer's
        return found
    own: dict[str, list[_ThreadCall]] = {}
    for op in python:
        if op.seq is not None and not op.async_:
            own.setdefault(op.pg, []).append((op.thread or "main", op, op.thread is None))
    return _last_two_from_two_threads(own)


def _fr_end(entry: dict, op: Op) -> float | None:
    """When a dumped call ended: None while the dump shows it in flight; NCCL's completion time where
    timing was on; else its start (over, whenever it ended: never read as overlapping a later call)."""
    if entry.get("in_flight"):
        return None
    completed = entry.get("time_discovered_completed_ns")
    return completed / 1e9 if isinstance(completed, int) and completed > 0 else op.start


def _last_two_from_two_threads(calls: dict[str, list[_ThreadCall]]) -> dict[str, tuple[Op, bool]] | None:
    """Of each group's calls (thread, call, whether it is the main thread), oldest first: the
    threads and their calls when the last two came from two threads, in flight at once."""
    for group in calls.values():
        if len(group) > 1 and group[-1][0] != group[-2][0] and _overlap(group[-2][1], group[-1][1]):
            return {thread: (op, main) for thread, op, main in group}  # both in flight as it failed
    return None


def _overlap(earlier: Op, later: Op) -> bool:
    """Did ``later`` start before ``earlier`` returned (two threads' calls in flight at once, not
    one thread's calls after another thread was joined)?"""
    return later.start is not None and (earlier.end is None or later.start < earlier.end)


_FATAL = re.compile(r"^Fatal Python error: ", re.MULTILINE)  # faulthandler's header at a fatal signal


_COMM_ERROR = re.compile(r"gloo|nccl|Connection (reset|closed|refused)|DistBackendError|ProcessGroup|"
                         r"Timed out waiting|timed out|Socket Timeout|Broken pipe|(Read|Write) error|"
                         r"monitoredBarrier",  # 'Rank 2 failed to pass monitoredBarrier in 2000 ms'
                         re.IGNORECASE)
# a wait ended from outside: torch's timeout, or the rank stopped as it waited (a signal torch turned
# into an exception, Ctrl-C): an echo of what held it, never its own cause
_ENDED_WAITING = re.compile(r"timed out|timeout|SignalException|got signal|KeyboardInterrupt|"
                            r"failed to pass monitoredBarrier", re.IGNORECASE)
# init_process_group's errors while it waited for the other ranks: gloo waits for each rank's address
# in the store ('DistStoreError: wait timeout after 90000ms, keys: /default_pg/0//cpu//0/1', torch
# 2.13), or the rank was stopped as it waited (torchrun's SIGTERM: 'SignalException: Process 7 got
# signal: 15'; Ctrl-C)
_INIT_WAITED = re.compile(r"DistStoreError|wait timeout|Timed out waiting|Socket Timeout|SignalException|"
                          r"got signal|KeyboardInterrupt", re.IGNORECASE)
# a peer closed its connections: it ended. Raised in init_process_group ('Gloo connectFullMesh failed
# with ... Connection closed by peer', torch 2.13), when a faster peer got through init, raised in a
# check of its own arguments and left before this rank finished connecting: that peer's echo
_PEER_GONE = re.compile(r"(closed|reset) by peer", re.IGNORECASE)


def _init_echo(error: str) -> bool:
    """Did init_process_group fail because of another rank (it waited for it, or it left)?"""
    return bool(_INIT_WAITED.search(error) or _PEER_GONE.search(error))


# ...unless it says the rank's own arguments were wrong ('ProcessGroupGloo::allgather: invalid output
# tensor list at index 0 (expected length 2, got 3)', 'ProcessGroupGloo::scatter: Incorrect input list
# size 3. Input list size should be 4', 'requires a single-element input list'; torch's checks in
# Python raise ValueError or TypeError: 'ValueError: Global rank 0 is not part of group
# <...ProcessGroup object at ...>', a dst outside the group): the backend names itself in those too
_ARGUMENT_ERROR = re.compile(r"invalid|expected|must (be|have|match)|does ?n[o']?t match|mismatch|"
                             r"unsupported|not supported|incorrect|requires a single|not part of group|"
                             r"^(ValueError|TypeError):", re.IGNORECASE)


# Python's own socket and pipe errors are never the process group's (torch raises its own types):
# a rank's DataLoader pipe broken by a dead worker is one ('ConnectionResetError: [Errno 104] ...')
_PYTHON_OS_ERROR = re.compile(r"^(ConnectionResetError|BrokenPipeError|ConnectionAbortedError|"
                              r"ConnectionRefusedError|EOFError):")


def is_comm_error(error: str) -> bool:
    """Does an error say the communication failed (a peer gone, a timeout), not the call itself?"""
    return (bool(_COMM_ERROR.search(error)) and not _ARGUMENT_ERROR.search(error)
            and not _PYTHON_OS_ERROR.match(error))


def _failed_inside(view: RankView, error: str | None) -> Op | None:
    """For a communication error raised outside any Python wrapper (DDP's collectives, issued from
    C++; a p2p work's ``wait()``): the collective it came from, i.e. the first not retired, else
    the isend or irecv posted last of those still open, else the last collective enqueued."""
    if not error or not is_comm_error(error):
        return None
    entries = [e for e in (view.state or {}).get("fr") or [] if not e.get("is_p2p")]
    pending = [e for e in entries if not e.get("retired")]
    posted = _posted_p2p(view)  # in the wait() of one, mostly
    if not entries and not posted and not _collectives(view) and not view.last_seq():
        if _PEER_GONE.search(error) and _GROUP_ERROR.search(error) and not _init_done(view):  # still
            # connecting in init_process_group as a peer left (not a download's reset connection)
            return Op(op=INIT_OP, seq=0, pg="0", error=error, ok=False, **_exit_site(view))
        return None  # before any collective: init_process_group's own connections, its own error
    if pending or not posted:
        pending = pending or entries[-1:]
        op = fr_op(pending[0]) if pending else Op(op="collective", seq=view.pending_seq())
    else:  # the newest send or recv still open: the helper thread may not have seen the earlier
        op = replace(posted[-1])  # ones complete (it looks every FLUSH_S)
    op.where, op.file, op.line = _exit_site(view).values()
    op.error, op.ok = error, False
    return op


_GROUP_ERROR = re.compile(r"gloo|nccl|connectFullMesh|ProcessGroup", re.IGNORECASE)  # the backend's own


def _init_done(view: RankView) -> bool:
    """Did the rank's recorded init_process_group return?"""
    return any(op.op == INIT_OP and op.end is not None and op.ok is not False for op in view.python_ops())


def _exit_site(view: RankView) -> dict[str, Any]:
    """Where the rank's exception left the user's code, as its exit record says."""
    exit_record = view.exit or {}
    return {key: exit_record.get(key) for key in ("where", "file", "line")}


def _stopped_in(view: RankView, failed: Op | None, pos: Position) -> Op | None:
    """The call a rank its launcher stopped was last in: one that raised, else its last collective
    when that one's return is not on file (only the group's progress, which counts a failed
    collective as completed too, closed it); None when its stack shows it at another line of its
    own (it caught the error, or the call had returned, and went on)."""
    ops = _collectives(view)
    call = failed or (ops[-1] if ops and ops[-1].inferred else None)
    if call is None or pos.where not in (None, call.where):
        return None
    return call


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
    stack = main_stack(view)
    frame = _innermost_user_frame(stack)
    if sync_open:
        op = sync_open[-1]
        seq = op.seq
        if pending_fr:
            seq = pending_fr[0]["collective_seq_id"]
        return Position(view.rank, "in-collective", op=op, seq=seq, where=op.where, file=op.file,
                        line=op.line, detail=wording.fsdp_call(stack, op.op))
    pending = pending_fr[0] if pending_fr else None
    if pending is not None or view.pending_seq() is not None:
        op = fr_op(pending) if pending else Op(op="collective", seq=view.pending_seq())
        pos = Position(view.rank, "in-collective", op=op, seq=op.seq, detail=wording.issued_by(stack))
        if frame:
            pos.where, pos.file, pos.line = frame["where"], frame["file"], frame["line"]
            op.where, op.file, op.line = pos.where, pos.file, pos.line
        return pos
    waited = _waited_p2p(view, stack, frame)
    if waited is not None:
        return waited
    pos = Position(view.rank, "outside-collective", seq=None)
    frame = _own_frame(stack) or frame  # the user's own line: a package's is named by its activity
    if frame:
        pos.where, pos.file, pos.line = frame["where"], frame["file"], frame["line"]
        pos.detail = wording.activity(view.rank, frame, stack, view.silent, view.workers,
                                      (view.state or {}).get("thread_errors"))
    elif view.unheard:
        pos.detail = wording.UNHEARD
    return pos


def _waited_p2p(view: RankView, stack: list[dict[str, Any]], frame: dict[str, Any] | None) -> Position | None:
    """A rank blocked in the ``wait()`` of an isend or irecv: in its oldest one still open.

    gloo's have no future, so the tracer sees one complete only once its ``wait()`` has returned
    (``Tracer.poll_waited``): an open one is not yet waited for, or waited for now. It is taken as
    the rank's position when the rank's own line (or a frame it called) waits, or when that line
    cannot be read; a rank busy elsewhere with a recv posted stays outside any collective.
    """
    posted = [op for op in _posted_p2p(view) if op.peer is not None]
    if not posted or frame is None:
        return None
    below = stack[stack.index(frame) + 1:] if frame in stack else []
    text = source_line(frame)
    if text and "wait" not in text and not any("wait" in str(f.get("func")) for f in below):
        return None
    op = posted[0]
    pos = Position(view.rank, "in-collective", op=op, seq=op.seq, where=frame["where"], file=frame["file"],
                   line=frame["line"])
    pos.detail = f"waits for the {op.op} posted at {op.where}" if op.where else f"waits for an {op.op}"
    return pos


def _posted_p2p(view: RankView) -> list[Op]:
    """The rank's isends and irecvs (and batches of them) still open, oldest first."""
    return sorted((op for op in view.open.values() if op.async_ and op.p2p), key=lambda op: op.start or 0.0)


def _groups_made_in_different_orders(views: dict[int, RankView]
                                     ) -> tuple[list[int], str, dict[tuple[int, ...], list[int]]] | None:
    """(the ranks, the group's name, {its members as each rank has them: those ranks}) when one
    group name holds different ranks on different ranks: torch names a group by the order
    new_group was called, which must be the same on every rank (members or not), or the groups'
    rendezvous keys meet across groups. None otherwise."""
    seen: dict[str, dict[tuple[int, ...], set[int]]] = {}
    for rank, view in views.items():
        for op in view.python_ops():
            if op.pg != WORLD_PG and op.pg_ranks:
                seen.setdefault(op.pg, {}).setdefault(tuple(op.pg_ranks), set()).add(rank)
    for name, members in sorted(seen.items()):
        if len(members) > 1:
            ranks = sorted({rank for holders in members.values() for rank in holders})
            return ranks, name, {key: sorted(holders) for key, holders in sorted(members.items())}
    return None


def main_stack(view: RankView) -> list[dict[str, Any]]:
    """A rank's main-thread frames (outermost first): from its state dump, else faulthandler's."""
    return (view.state or {}).get("stack") or faulthandler_stack(view.stack_text)


def _innermost_user_frame(stack: list[dict[str, Any]]) -> dict[str, Any] | None:
    for frame in reversed(stack):
        if frame.get("user"):
            return frame
    return None


def _own_frame(stack: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame of the user's own files: user code that is not an installed package's
    (a package in site-packages counts as the user's for a call site, not for where a rank waits)."""
    for frame in reversed(stack):
        if frame.get("user") and not installed(str(frame.get("file"))):
            return frame
    return None


# ---------------------------------------------------------------------------------------------
# classification


def _classify(positions: dict[int, Position], histories: dict[int, dict], views: dict[int, RankView]):
    """(kind, culprits, summary), and a cure when the evidence tells one that the culprits'
    positions do not (split sizes that do not pair up)."""
    reordered = _groups_made_in_different_orders(views)
    if reordered is not None:  # every later collective of those groups is meaningless: this first
        summary = wording.group_order_summary(*reordered)
        return "collective-mismatch", reordered[0], summary, wording.GROUP_ORDER_CURE
    divergence = first_divergence(histories, mixed=not any(view.used_p2p for view in views.values()))
    python_histories = {rank: python_history(view) for rank, view in views.items()}
    python = first_divergence(python_histories)
    if python is not None and (divergence is None or (python[0][1], -len(python[2])) <
                               (divergence[0][1], -len(divergence[2]))):
        divergence = python  # earlier, or as early and seen by more ranks (a killed rank has no FR)
        histories = python_histories  # what the ranks issued before it, as the same source tells
    exited = _exited_culprits(positions)
    if divergence is None:
        aborted = _aborted_on_different_calls(exited, positions)
        if aborted is not None:
            now = _numbered_divergence_now(positions)
            repeated = now and _repeated_call_kind(now[0], now[2], histories, positions)
            return repeated or _aborted_kind(*aborted, positions, views)
        divergence = _numbered_divergence_now(positions) or _current_divergence(positions)
    if divergence is not None:
        kind, culprits, summary, *cures = _divergence_kind(divergence, positions, histories, views)
        aborted = [pos for pos in positions.values() if _aborted_inside(pos)]
        if aborted and wording.ABORT_CAUSES not in summary:  # ranks gloo aborted in their call: how, why
            summary += wording.aborted_note(aborted)
        return kind, culprits, summary, *cures
    unpaired = _unpaired_own_splits(positions)
    if unpaired:
        return "shape-mismatch", *unpaired, wording.SPLIT_CURE
    extra = _extra_collectives(positions, exited)
    if extra:
        summary = wording.extra_collective_summary(extra, positions)
        fsdp = next((cure for rank in extra if (cure := wording.fsdp_cure(positions[rank].detail))), None)
        if fsdp is not None:
            return "collective-mismatch", extra, summary, fsdp
        if any(_issued_from_cpp(positions[rank], views.get(rank)) for rank in extra):
            cure = wording.model_cure(positions[rank] for rank in extra)
            return "collective-mismatch", extra, summary, cure
        return "collective-mismatch", extra, summary
    if exited:
        summary = wording.exited_summary(exited, positions)
        loop = _loop_ran_longer(exited, positions, histories)
        if loop is not None:
            summary += wording.loop_ran_longer(loop, exited, positions, wording.SWALLOWED_END in summary)
            return "rank-exited", exited, summary, *_loop_cures(summary)
        if any(positions[rank].exit_call for rank in exited):  # an early exit, inside a loop or not
            early = all(positions[rank].exit_early for rank in exited if positions[rank].exit_call)
            cure = wording.EARLY_EXIT_CURE if early else wording.LOOP_EXIT_CURE
            return "rank-exited", exited, summary, cure
        return "rank-exited", exited, summary
    crossed = _crossed_p2p(positions)
    if crossed:
        fewer = {rank: found for rank in crossed
                 if (found := _fewer_matches(positions[rank], positions[rank].op.peer, views)) is not None}
        summary = wording.crossed_p2p_summary(crossed, positions, fewer)
        return "collective-mismatch", crossed, summary, *([wording.P2P_COUNT_CURE] if fewer else [])
    unanswered = _unanswered_p2p(positions)
    if unanswered:
        fewer = {rank: found for rank, peer in unanswered.items()
                 if (found := _fewer_matches(positions[rank], peer, views)) is not None}
        summary = wording.p2p_summary(unanswered, positions, fewer)
        cures = [wording.LOOP_EXIT_CURE] if wording.LOOP_EXITS in summary else []
        return "rank-missing", _first_in_chains(unanswered), summary, *cures
    skipped = _skipped_group_collective(positions, histories)
    if skipped is not None:
        ranks, waiter, members, crossed, likewise = skipped
        if crossed:
            ranks = sorted({waiter.rank, *ranks})
            return ("collective-mismatch", ranks, wording.crossed_groups_summary(ranks, positions, members),
                    wording.CROSSED_GROUPS_CURE)
        summary = wording.skipped_group_summary(ranks, waiter, positions, members, likewise)
        ranks = sorted({*ranks, *(rank for more, _other in likewise for rank in more)})
        return "collective-mismatch", ranks, summary, *_loop_cures(summary)
    missing = _missing_ranks(positions)
    if missing:
        cures = [wording.INIT_CURE] if _waiting_in_init(positions) else []
        if wording.gave_up(positions):  # torch's timeout ended a wait: the missing rank may be slow
            monitored = wording.monitored_timeout(positions)
            cures.append(wording.MONITORED_TIMEOUT_CURE if monitored else wording.TIMEOUT_CURE)
        for wait, cure in ((wording.FILE_LOCK_WAIT, wording.FILE_LOCK_CURE),
                           (wording.STORE_WAIT, wording.STORE_CURE)):
            if any(positions[rank].detail.startswith(wait) for rank in missing):
                cures.insert(0, cure)
        return ("rank-missing", missing, wording.missing_summary(missing, positions), *cures)
    if _all_in_init(positions):
        unborn = _asked_for_a_larger_world(positions)
        if unborn:
            return "rank-missing", unborn, wording.unborn_ranks_summary(unborn, positions), wording.WORLD_CURE
        return "unknown", [], wording.all_in_init_summary(positions), wording.INIT_CONNECT_CURE
    if all(p.state == "finished" for p in positions.values()):
        count = max((len(h) for h in histories.values()), default=0)
        return "ok", [], (f"All {len(positions)} ranks finished; their collectives matched "
                          f"({count} compared per rank).")
    return "unknown", [], wording.unknown_summary(positions)


def _caught_failures(views: dict[int, RankView]) -> dict[int, Op]:
    """Each rank's first collective that raised, of ranks that finished all the same (the script
    caught the error: 'except Exception: log'), by rank."""
    found = {}
    for rank, view in views.items():
        failed = [op for op in _collectives(view) if op.ok is False]
        if failed and view.exit_code == 0:
            found[rank] = failed[0]
    return found


def _left_before(op: Op, caught: dict[int, Op], views: dict[int, RankView]) -> list[int]:
    """The ranks that never came to ``op``, the earliest collective that failed (by its group and
    number): members of its group (where known), not among the ranks it failed on (``caught``), whose
    calls on that group stopped below its number. They had left, their group destroyed or their
    process ended, when the others called it."""
    if op.seq is None:
        return []
    left = []
    for rank, view in views.items():
        numbers = [seq for pg, seq in python_history(view) if pg == op.pg]
        member = not op.pg_ranks or rank in op.pg_ranks
        if rank not in caught and member and max(numbers, default=0) < op.seq:
            left.append(rank)
    return sorted(left)


def _aborted_kind(culprits: list[int], dead: int, others: list[int], positions: dict[int, Position],
                  views: dict[int, RankView]):
    """The classification of ``_aborted_on_different_calls``'s finding."""
    from_cpp = [rank for rank in others if _issued_from_cpp(positions[rank], views.get(rank))]
    summary = wording.aborted_summary(dead, others, positions, from_cpp)
    if wording.DECIDES_ITSELF in summary:
        return "collective-mismatch", culprits, summary, wording.CONDITION_CURE
    return "collective-mismatch", culprits, summary


def _numbered_divergence_now(positions: dict[int, Position]):
    """Ranks in one numbered collective now (or when they failed or died in it) from different calls,
    seen in their positions: what the histories cannot show when their sources differ (a rank killed
    before its Flight Recorder was read has its Python records alone, and the others' call, DDP's,
    is in their Flight Recorder alone). (key, groups, present) as ``first_divergence`` gives it."""
    by_key: dict[tuple[str, int], dict[int, Op]] = {}
    for rank, pos in sorted(positions.items()):
        if pos.op is None or pos.seq is None or pos.op.p2p or pos.state not in ("in-collective", "exited"):
            continue
        op = replace(pos.op, where=pos.op.where or pos.where, file=pos.op.file or pos.file,
                     line=pos.op.line or pos.line)
        by_key.setdefault((pos.op.pg, pos.seq), {})[rank] = op
    for key, present in sorted(by_key.items()):
        names = {canonical_op(op.op) for op in present.values()}
        if len(present) < 2 or len(names) > 1 or names & MULTI_OPS:
            continue  # one op by both sources' names: Python's all_gather_object is FR's all_gather
        present = {rank: op for rank, op in present.items() if op.source != NOTED}  # shapes unknown
        if len(present) < 2:
            continue
        groups = _grouped(present)
        if len(groups) > 1:
            return key, groups, present
    return None


def _current_divergence(positions: dict[int, Position]):
    """With no sequence numbers at all (stacks alone): ranks waiting in different collectives now.

    Keyed (group, -1): "the collective each waits in now", not a numbered one.
    """
    waiting = {rank: pos.op for rank, pos in positions.items()
               if pos.state == "in-collective" and pos.op is not None}
    if len(waiting) < 2 or any(op.seq is not None for op in waiting.values()):
        return None
    groups: dict[tuple, list[int]] = {}
    for rank, op in sorted(waiting.items()):
        groups.setdefault(op.signature(), []).append(rank)
    return (("0", -1), groups, waiting) if len(groups) > 1 else None


def first_divergence(histories: dict[int, dict[tuple[str, int], Op]], mixed: bool = False):
    """The lowest (group, seq) at which ranks that both issued it disagree.

    Returns (key, {signature: ranks}, {rank: op}) or None. Only histories from the same source
    (Flight Recorder, or Python records) are compared, unless ``mixed`` (no rank used p2p ops, whose
    numbers drift between the two): then a rank known from its Python records alone (one that died
    before it could answer: a rank gloo aborted on another node) is compared with the others too.
    """
    sources = {rank: _source(h) for rank, h in histories.items() if h}
    fr_ranks = [r for r, s in sources.items() if s == "flight-recorder"]
    python_ranks = [r for r, s in sources.items() if s == "python"]
    ranks = (fr_ranks + python_ranks if mixed else fr_ranks) if len(fr_ranks) >= 2 else python_ranks
    keys = sorted({key for r in ranks for key in histories[r]}, key=lambda k: (k[0], k[1]))
    own = "flight-recorder" if len(fr_ranks) >= 2 else "python"
    for key in keys:  # a rank of the other source, only with the shapes it passed (a barrier has none)
        present = {r: histories[r][key] for r in ranks if key in histories[r]
                   and (sources[r] == own or histories[r][key].shapes is not None)}
        if len(present) < 2:
            continue
        present = _object_lists_as_recorded(present, {r for r in present if sources[r] != own})
        groups = _grouped(present)
        if len(groups) > 1 or split_mismatch(present):
            return key, groups, present
    return None


def _object_lists_as_recorded(present: dict[int, Op], others: set[int]) -> dict[int, Op]:
    """Ranks known from their Python records alone (``others``) in an object-list call that the
    rest's Flight Recorder shows by its first inner collective ('broadcast_object_list (broadcast)',
    the tensor of the objects' sizes, as long as the list): compared as that collective, their
    lists' lengths being its shape."""
    names = {op.op for rank, op in present.items() if rank not in others and " (" in op.op}
    if not others or len(names) != 1:
        return present
    seen = next(op for rank, op in present.items() if rank not in others and op.op in names)
    return {rank: replace(op, op=seen.op, dtypes=seen.dtypes) if rank in others and op.dtypes == ["object"]
            and seen.op.startswith(f"{op.op} (") else op for rank, op in present.items()}


def _grouped(present: dict[int, Op]) -> dict[tuple, list[int]]:
    """Ranks by what they issued; the root of a rooted collective too, when every rank's is known
    (Python's records have it, the Flight Recorder's not)."""
    roots = {op.root for op in present.values()}
    with_root = len(roots) > 1 and None not in roots
    groups: dict[tuple, list[int]] = {}
    for rank, op in sorted(present.items()):
        groups.setdefault(op.signature() + ((op.root,) if with_root else ()), []).append(rank)
    return groups


def _goes_first(present: dict[int, Op], positions: dict[int, Position]) -> tuple[list[int], str] | None:
    """The ranks that issued a collective inside a ``main_process_first`` block (there, or in a
    function called there) while every other rank waits in a barrier at the block's header (the
    barrier the block puts the others in), and that header ('train.py:12'); None otherwise."""
    headers = {rank: _goes_first_header(op, positions.get(rank)) for rank, op in present.items()}
    if None in headers.values() or len(set(headers.values())) != 1:
        return None
    file, header = next(iter(headers.values()))  # type: ignore[misc] - no None left
    waiting = [rank for rank, op in present.items() if op.file == file and op.line == header]
    inside = sorted(rank for rank in present if rank not in waiting)
    if not waiting or not inside or any(canonical_op(present[rank].op) != "barrier" for rank in waiting):
        return None
    return inside, f"{Path(file).name}:{header}"


def _goes_first_header(op: Op, pos: Position | None) -> tuple[str, int] | None:
    """The file and header line of the ``main_process_first`` block around the call, or around the
    innermost of the user's lines that led to it (``Position.callers``)."""
    callers = reversed(pos.callers) if pos is not None else ()
    frames = [(op.file, op.line)] + [(file, line) for file, line, _where in callers]
    for file, line in frames:
        header = goes_first_block(file, line)
        if file and header is not None:
            return file, header
    return None


def _loop_cures(summary: str) -> list[str]:
    """The cures for a loop that ran out first on some ranks: deciding its skips and exits together
    first when the summary names one likely to differ between ranks (``wording.loop_exits_text``),
    second when it names one only hedged. For a turn some ranks skipped part of, that alone when a
    continue did it, or the condition around the call (the kind's own fix otherwise)."""
    if wording.LATER_TURN in summary:  # a turn's skip on some ranks, not a loop that ran out
        if wording.LOOP_EXITS in summary or wording.ON_THE_WAY in summary:
            return [wording.LOOP_EXIT_CURE]
        return [wording.CONDITION_CURE] if wording.UNDER_GUARD in summary else []
    if wording.LOOP_EXITS not in summary:
        return [wording.UNEVEN_LOOP_CURE]
    if wording.EXIT_HEDGE in summary:  # an exit alike on every rank, most likely: the data came first
        return [wording.UNEVEN_LOOP_CURE, wording.LOOP_EXIT_CURE]
    return [wording.LOOP_EXIT_CURE, wording.UNEVEN_LOOP_CURE]


def _returned_early_cures(summary: str) -> list[str]:
    """For a call some ranks returned from early: deciding from a file once, when a file's presence
    decided it; deciding its condition together, when a return did (an except that swallows errors
    has its own cure, ``diagnose`` adds it)."""
    if wording.FILE_TEST in summary:
        return [wording.FILE_TEST_CURE]
    return [wording.CONDITION_CURE] if "the return at" in summary else []


def _source(history: dict) -> str:
    return next(iter(history.values())).source if history else "python"


def _divergence_kind(divergence, positions, histories, views):
    key, groups, present = divergence
    ops = {sig[0] for sig in groups}
    pairs = split_mismatch(present) if len(groups) == 1 else []
    if pairs:
        culprits = _split_culprits(present, pairs)
        summary = wording.split_summary(key, present, pairs, culprits)
        return "shape-mismatch", culprits, summary, wording.SPLIT_CURE
    first = _goes_first(present, positions)
    if first is not None:
        inside, header = first
        return ("collective-mismatch", inside, wording.goes_first_summary(key, present, inside, header),
                wording.GOES_FIRST_CURE)
    culprits = _odd_ones_out(groups, present, histories, key, positions)
    repeated = _repeated_call_kind(key, present, histories, positions)
    if repeated is not None:
        return repeated
    turns = _loop_turns(key, present, histories, positions)
    if turns is not None:
        summary = wording.divergence_summary("collective-mismatch", key, present, culprits, positions,
                                             path=wording.loop_turns_text(turns, positions))
        cures = [*wording.loop_turns_cures(turns), *_loop_cures(summary)]
        return "collective-mismatch", culprits, summary, *cures
    if len(ops) == 1 and len({sig[:2] for sig in groups}) == 1:  # the same call but for its root
        summary = wording.root_summary(key, present, culprits)
        return "collective-mismatch", culprits, summary, wording.ROOT_CURE
    kind = "collective-mismatch" if len(ops) > 1 else "shape-mismatch"
    if kind == "shape-mismatch" and (_calls_of_other_functions(present)  # not one call given other sizes
                                     or _python_and_cpp_calls(present, key, positions, views)):
        kind = "collective-mismatch"
        summary = wording.divergence_summary(kind, key, present, culprits, positions)
        looped = wording.LOOP_RAN_OUT in summary or wording.LATER_TURN in summary
        if looped and wording.CACHED not in summary:
            return kind, culprits, summary, *_loop_cures(summary)
        summary = wording.different_lines_summary(key, present, culprits, positions)
        if wording.DECIDES_ITSELF in summary:
            return kind, culprits, summary, wording.CONDITION_CURE
        if wording.CACHED in summary:
            return kind, culprits, summary, wording.CACHED_CURE
        return kind, culprits, summary
    summary = wording.divergence_summary(kind, key, present, culprits, positions)
    if kind == "collective-mismatch" and wording.CACHED in summary:
        return kind, culprits, summary, wording.CACHED_CURE
    if kind == "collective-mismatch" and wording.IN_A_HANDLER in summary:
        return kind, culprits, summary, wording.LOGGING_CURE
    if kind == "collective-mismatch" and wording.RETURNS_EARLY in summary:
        return kind, culprits, summary, *_returned_early_cures(summary)
    if kind == "collective-mismatch" and (wording.LOOP_RAN_OUT in summary  # a loop ran out first
                                          or wording.LATER_TURN in summary):  # or a turn was skipped
        return kind, culprits, summary, *_loop_cures(summary)
    if kind == "collective-mismatch" and wording.DECIDES_ITSELF in summary:
        return kind, culprits, summary, wording.CONDITION_CURE
    if kind == "collective-mismatch" and any(_cpp_call_in_rank_branch(positions[r], key, views.get(r))
                                             for r in culprits if r in positions):
        return kind, culprits, summary, wording.model_cure(positions[r] for r in culprits if r in positions)
    if kind == "collective-mismatch":
        fsdp = next((cure for r in culprits
                     if r in positions and (cure := _fsdp_call_in_rank_branch(positions[r], key))), None)
        if fsdp is not None:
            return kind, culprits, summary, fsdp
    return kind, culprits, summary


def _repeated_call_kind(key: tuple[str, int], present: dict[int, Op], histories: dict[int, dict],
                        positions: dict[int, Position]):
    """The classification when one line issued its call more times in a row on some ranks
    (``_repeated_call``), or None."""
    repeated = _repeated_call(present, histories, key, positions)
    if repeated is None:
        return None
    culprits, counts, call = repeated
    summary = wording.repeated_call_summary(key, present, counts, call, culprits, positions)
    return "collective-mismatch", culprits, summary, wording.REPEATED_CALL_CURE


def _repeated_call(present: dict[int, Op], histories: dict[int, dict], key: tuple[str, int],
                   positions: dict[int, Position]):
    """Some ranks issue the call they issued last again (the same op, shapes and line, not in a loop
    of the user's), the others a different one after it, neither in a branch on the rank: the line
    issued more collectives on the first (one per item of a dict or list whose keys or length differ
    by rank: accelerate's reduce and gather of a dict, a loop inside a library call).
    (culprits, {rank: the call's count in a row up to ``key``}, the call) or None; the culprits:
    the smaller side, else the ranks that issued more."""
    rows = _runs_before(present, histories, key)
    if any(row is None for row in rows.values()):
        return None
    again = sorted(rank for rank, row in rows.items() if row[2])
    moved_on = sorted(rank for rank, row in rows.items() if not row[2])
    call = rows[again[0]][1] if again else None
    if call is None or not moved_on or any(not _same_call(rows[rank][1], call)
                                           or present[rank].where == call.where for rank in moved_on):
        return None  # the others did not issue that call just before, or issue it again too
    went_to = [(present[rank].file, present[rank].line) if present[rank].file else
               (positions[rank].file, positions[rank].line) for rank in moved_on if rank in positions]
    if _issues_one_per_call(call) or _in_a_loop(call, positions, went_to) or any(
            rank_conditional(op.file, op.line) for op in present.values()):
        return None  # the user's loop (around the call, or a caller) or branch on the rank: their story
    counts = {rank: row[0] for rank, row in rows.items()}
    return (moved_on if len(again) * 2 > len(present) else again), counts, call


def _loop_turns(key: tuple[str, int], present: dict[int, Op], histories: dict[int, dict],
                positions: dict[int, Position]) -> wording.LoopTurns | None:
    """Every rank issued the same call last, inside a loop of the user's; some issue it again, the
    others left that loop and came round an outer loop to a call before it: the loop ran more
    turns on the first (a dict or list with more items on those ranks, fewer batches on the
    others). None otherwise, and where the others went past the loop's end (``wording._left_loop``
    reads that: they may have skipped a call after it)."""
    group, seq = key
    rows = _runs_before(present, histories, key)
    if not rows or any(row is None for row in rows.values()):
        return None
    call = next(iter(rows.values()))[1]
    if not call.file or not call.line or any(not _same_call(row[1], call) for row in rows.values()):
        return None
    stayed = sorted(rank for rank, row in rows.items() if row[2])
    left = sorted(rank for rank in rows if rank not in stayed)
    header = enclosing_loop(call.file, call.line)
    if not stayed or not left or header is None or not in_loop_body(call.file, header, call.line):
        return None
    home = enclosing_function(call.file, call.line)
    sites = wording.call_sites(present, positions)
    came_to = set()
    for rank in left:
        site = sites[rank]
        if site is None or site[0] != call.file or enclosing_function(*site) != home \
                or site[1] >= header or not share_a_loop(call.file, header, site[1]):
            return None  # not round an outer loop to a line before this one
        came_to.add(site[1])
    calls = {rank: None if row[0] is None else row[0] - row[2] for rank, row in rows.items()}  # before #seq
    counted = len(set(calls.values())) == 1 and None not in calls.values() and all(
        seq - 1 - count <= 0 or (group, seq - 1 - count) in histories[rank] for rank, count in calls.items())
    return wording.LoopTurns(left, stayed, call, header, sorted(came_to),
                             next(iter(calls.values())) if counted else None)


def _runs_before(present: dict[int, Op], histories: dict[int, dict], key: tuple[str, int]
                 ) -> dict[int, tuple[int | None, Op, bool] | None]:
    """Each rank's ``_calls_in_a_row`` up to ``key``; for a rank whose calls before died with it
    (gloo aborted it; its call at ``key`` was posted) and that issues the call the others issued
    before, that call again, its count unknown (None)."""
    group, seq = key
    rows: dict[int, tuple[int | None, Op, bool] | None] = {
        rank: _calls_in_a_row(histories.get(rank, {}), group, seq, op) for rank, op in present.items()}
    known = next((row for row in rows.values() if row is not None), None)
    for rank, row in rows.items():
        if row is None and known is not None and (group, seq - 1) not in histories.get(rank, {}) \
                and _same_call(present[rank], known[1]):
            rows[rank] = (None, known[1], True)
    return rows


def _issues_one_per_call(call: Op) -> bool:
    """Does the call's line call the collective itself (``dist.all_reduce(t)``), one per call? Then
    more of them in a row means the line ran more times: a loop, here or in a caller."""
    text = source_line({"file": call.file, "line": call.line})
    return f"{canonical_op(call.op)}(" in text or f"{call.op}(" in text


def _in_a_loop(call: Op, positions: dict[int, Position],
               went_to: list[tuple[str | None, int | None]]) -> bool:
    """Is the call's line, or a line that led a rank to it, inside a loop of the user's that can
    repeat it? Not a loop whose turn also runs a line the other ranks went on to (``went_to``: a
    training loop's backward before its metrics' reduce): a rank going round it would be there first.
    A caller's loop only where the others went to another function: a turn of a loop around the
    function that holds both lines (a launch in a loop of the notebook) runs both."""
    frames = [(call.file, call.line)]
    home = enclosing_function(call.file, call.line)
    if not any(file == call.file and enclosing_function(file, line) == home for file, line in went_to):
        frames += [(file, line) for pos in positions.values() for file, line, _where in pos.callers]
    for file, line in frames:
        header = enclosing_loop(file, line)
        if header is not None and not any(other_file == file and in_loop_body(file, header, other_line)
                                           for other_file, other_line in went_to):
            return True
    return False


def _calls_in_a_row(history: dict, group: str, seq: int, now: Op) -> tuple[int, Op, bool] | None:
    """(how many times in a row the call before #``seq`` of ``group`` was issued, #seq counted when
    it is ``now`` the same call again; that call; whether it is) or None without the one before."""
    before = history.get((group, seq - 1))
    if before is None or not before.where:
        return None
    count, number = 0, seq - 1
    while (earlier := history.get((group, number))) is not None and _same_call(earlier, before):
        count, number = count + 1, number - 1
    again = _same_call(now, before)
    return count + again, before, again


def _same_call(op: Op, other: Op) -> bool:
    return op.where == other.where and op.signature() == other.signature()


def _python_and_cpp_calls(present: dict[int, Op], key: tuple[str, int], positions: dict[int, Position],
                          views: dict[int, RankView]) -> bool:
    """Did some ranks issue collective ``key`` from a Python call and others from C++ (DDP's gradient
    all-reduce, no Python call), as the ranks in it now show? Those are two calls, never one."""
    cpp = [rank for rank in present if rank in positions and positions[rank].op is not None
           and (positions[rank].op.pg, positions[rank].seq) == key and _issued_from_cpp(positions[rank],
                                                                                       views.get(rank))]
    return bool(cpp) and any(present[rank].where and rank not in cpp for rank in present)


def _calls_of_other_functions(present: dict[int, Op]) -> bool:
    """Did the ranks issue one numbered collective from different calls: lines in different functions
    (a thread of their own on some ranks, another path), or in one function but not in different
    branches of one ``if`` (a call under an ``if`` and one after it)? Lines in an ``if rank == 0:``
    and its ``else:`` are one call site's branches, sized differently; and a rooted or object-list op
    is most often written once per branch."""
    if any(canonical_op(op.op) in ROOTS or canonical_op(op.op) in OBJECT_LISTS for op in present.values()):
        return False
    sites = sorted({(op.file, op.line) for op in present.values() if op.file and op.line})
    if len({(file, enclosing_function(file, line)) for file, line in sites}) > 1:
        return True
    # one function: the lines are one call's branches only when they sit in different branches of an
    # if (if/else), not a call under an if and one after it; in a file it cannot read, one call
    return any(enclosing_function(file, line) is not None and not opposite_branches(file, line, other)
               for (file, line), (_file, other) in zip(sites, sites[1:], strict=False))


def split_mismatch(present: dict[int, Op]) -> list[tuple[int, int, int, int]]:
    """The all_to_all_single split sizes that do not pair up, as (sender, receiver, rows sent,
    rows expected): rank i's input split j must equal rank j's output split i, in group ranks
    (the members in order; torch sorts a group's ranks). [] unless every member's call is known
    with its splits (a list not given: equal splits of its tensor's rows)."""
    ops = list(present.values())
    if not ops or any(canonical_op(op.op) not in SPLIT_OPS or op.splits is None for op in ops):
        return []
    members = sorted(present)
    sizes = {rank: _splits(op, len(members)) for rank, op in present.items()}
    if any(found is None for found in sizes.values()):
        return []
    pairs = []
    for i, sender in enumerate(members):
        for j, receiver in enumerate(members):
            sent, expected = sizes[sender][1][j], sizes[receiver][0][i]
            if sent != expected:
                pairs.append((sender, receiver, sent, expected))
    return pairs


def _unpaired_own_splits(positions: dict[int, Position]):
    """Ranks whose own all_to_all_single split sizes do not pair up with themselves (the rows a rank
    sends itself must be the rows it expects from itself), told from each rank's call alone: gloo
    rejects such a call before it sends anything ('enforce fail at gloo/alltoallv.cc:138]
    inLengthPerRank[myRank] == outLengthPerRank[myRank]'), and the rank may leave before a slower
    peer's call is recorded. (culprits, summary) or None."""
    pairs, present = [], {}
    for rank, pos in sorted(positions.items()):
        op = pos.op
        if op is None or op.seq is None or canonical_op(op.op) not in SPLIT_OPS or op.splits is None:
            continue
        members = op.pg_ranks or sorted(positions)
        sizes = _splits(op, len(members)) if rank in members else None
        me = members.index(rank) if sizes else 0
        if sizes and sizes[1][me] != sizes[0][me]:
            pairs.append((rank, rank, sizes[1][me], sizes[0][me]))
            present[rank] = op
    if not pairs:
        return None
    first = present[pairs[0][0]]
    return sorted(present), wording.split_summary((first.pg, first.seq), present, pairs, sorted(present))


def _splits(op: Op, members: int) -> tuple[list[int], list[int]] | None:
    """(output splits, input splits) of a call on ``members`` ranks (None when they cannot be
    told: a list of another length, rows that do not split evenly)."""
    out_rows, outs, ins = op.splits or (None, None, None)
    in_rows = op.shapes[0][0] if op.shapes and op.shapes[0] else None

    def given_or_even(sizes: list | None, rows: int | None) -> list[int] | None:
        if sizes is not None:
            return sizes if len(sizes) == members else None
        return [rows // members] * members if isinstance(rows, int) and rows % members == 0 else None

    outs, ins = given_or_even(outs, out_rows), given_or_even(ins, in_rows)
    return None if outs is None or ins is None else (outs, ins)


def _split_culprits(present: dict[int, Op], pairs: list[tuple[int, int, int, int]]) -> list[int]:
    """Who passed the split sizes that do not pair up: the ranks unlike a strict majority in what
    they passed, else the ranks in the most unmatched pairs."""
    passed: dict[str, list[int]] = {}
    for rank, op in sorted(present.items()):
        passed.setdefault(repr(op.splits), []).append(rank)
    largest = max(passed.values(), key=len)
    if len(largest) * 2 > len(present):
        return [rank for rank in sorted(present) if rank not in largest]
    counts = {rank: sum(rank in pair[:2] for pair in pairs) for rank in present}
    most = max(counts.values())
    return sorted(rank for rank, count in counts.items() if count == most)


def _odd_ones_out(groups: dict[tuple, list[int]], present: dict[int, Op], histories, key,
                  positions: dict[int, Position] | None = None) -> list[int]:
    """Which ranks diverged: those whose list differs from the source rank's in an object-list
    broadcast (the source's objects are the ones sent), then rank-conditional code (around the
    call's line, or, for the collective a rank is in now, around a caller's; but not when they are
    the many and the others came round a loop past their call, ``wording.turn_skipped``: the few
    skipped the call, as 'if not (rank == 1 and bad):' does), then a condition on a per-rank value
    (around the calls of at most half the ranks, when the others came round a loop past them), then
    the ranks whose call runs in a logging handler (where the record passed the logger's level), then
    the ranks that returned early from a call the others are still in (``wording.returned_early``;
    when they are the many, the others), then
    the ranks that came round a loop past the others' call (or, when they are the many and no exit
    of the loop skipped it, the few left in it: 'if step % save_every == 0:' with a save_every of
    its own on one rank), then a strict majority, then history."""
    everyone = sorted(present)
    root = _common_root(present)
    if root in present and all(wording.is_object_list(op) for op in present.values()):
        return [r for r in everyone if present[r].signature() != present[root].signature()]
    now = {rank: pos for rank, pos in (positions or {}).items()  # in it now, at its call's line (not
           if pos.seq == key[1] and pos.op is not None and pos.op.pg == key[0]  # raised from another)
           and rank in present and present[rank].where in (None, pos.where)}
    skipped = wording.turn_skipped(present, positions or {})
    conditional = [r for r in everyone if rank_conditional(present[r].file, present[r].line)
                   or (r in now and rank_branch(now[r]) is not None)]
    skipped_by_few = skipped is not None and len(conditional) * 2 > len(everyone)
    paired = _paired_across_branches(groups, present, conditional)
    if paired:
        return [r for r in everyone if r not in paired]
    if conditional and len(conditional) < len(everyone) and not skipped_by_few:
        return conditional
    # 'if time.time() - last > 30:', 'if loss < best:' around the call: the same order of readings
    deciding = [r for r in everyone if wording.decided_per_rank(present[r].file, present[r].line)]
    decided_by_few = deciding and len(deciding) < len(everyone) and len(deciding) * 2 <= len(everyone)
    if decided_by_few or (deciding and len(deciding) < len(everyone) and skipped is None):
        return deciding
    logged = [rank for rank in everyone if (positions or {}).get(rank) and positions[rank].logged_at]
    if logged and len(logged) < len(everyone):  # a logging handler's call: where the record passed
        return logged
    early = wording.returned_early(present, positions or {})
    if early is not None:  # those past a call the others are in returned from it before their call
        return early.returned if len(early.returned) * 2 <= len(everyone) else early.inside
    if skipped is not None:  # the ranks that came round the loop past the others' call skipped it;
        # unless they are the many and no continue, break or return did: then the few are alone in a
        # call under a condition of their own
        few_in_it = len(skipped.early) * 2 > len(everyone) and not wording.skipped_by_exit(skipped)
        return skipped.late if few_in_it else skipped.early
    largest = max(groups.values(), key=len)
    if len(largest) * 2 > len(everyone):
        return [r for r in everyone if r not in largest]
    novel = [r for r in everyone if not _seen_elsewhere(r, present[r], histories, key)]
    if novel and len(novel) < len(everyone):
        return novel
    return everyone


def _paired_across_branches(groups: dict[tuple, list[int]], present: dict[int, Op],
                            conditional: list[int]) -> list[int]:
    """The ranks of a strict majority that issued one collective from several lines, among them
    every rank whose call is under a branch on the rank: calls alike pair up whatever their line
    (a barrier under 'if local_rank != 0:' with one under 'if rank == 0:', the main-process-first
    idiom), so the odd ones are the others. [] otherwise."""
    largest = max(groups.values(), key=len, default=[])
    if not conditional or len(largest) * 2 <= len(present) or len(largest) == len(present):
        return []
    lines = {present[rank].where for rank in largest}
    return largest if len(lines) > 1 and None not in lines and set(conditional) <= set(largest) else []


def _common_root(present: dict[int, Op]) -> int | None:
    roots = {op.root for op in present.values()}
    return roots.pop() if len(roots) == 1 else None


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


def _all_in_init(positions: dict[int, Position]) -> bool:
    """Does every rank wait in init_process_group (none missing, none ended)?"""
    return bool(positions) and all(p.state == "in-collective" and p.op is not None and p.op.op == INIT_OP
                                   for p in positions.values())


def _asked_for_a_larger_world(positions: dict[int, Position]) -> list[int]:
    """The ranks whose init_process_group waits for a larger world than the launch's: they wait
    for ranks that were never started."""
    count = len(positions)
    return sorted(rank for rank, p in positions.items() if p.op and p.op.world and p.op.world > count)


def _waiting_in_init(positions: dict[int, Position]) -> bool:
    """Does some rank wait in init_process_group (or did it, until its wait was ended)?"""
    return any(p.op is not None and p.op.op == INIT_OP and (p.state == "in-collective" or p.victim)
               for p in positions.values())


def _exited_culprits(positions: dict[int, Position]) -> list[int]:
    """Ranks that ended (not as a victim of another's end) while others still needed them."""
    demand = max((p.seq or 0 for p in positions.values() if p.state == "in-collective" or p.victim),
                 default=0)
    stuck = any(p.state in ("in-collective", "outside-collective") or p.victim for p in positions.values())
    in_init = _waiting_in_init(positions)  # waiting for every rank, those that never issued one too
    culprits = []
    for pos in positions.values():
        if pos.state == "exited" and not pos.victim:
            culprits.append(pos.rank)
        elif pos.state == "finished" and stuck and (demand > (pos.seq or 0) or (in_init and not pos.seq)):
            culprits.append(pos.rank)
    # A rank killed while waiting in a collective after a peer died outside any (gloo can SIGSEGV
    # or SIGABRT when the peer's sockets close) is that death's echo, not a second cause.
    outside = [r for r in culprits if positions[r].state != "exited" or positions[r].op is None]
    return sorted(outside or culprits or _own_errors(positions))


def _cpp_call_in_rank_branch(pos: Position, key: tuple[str, int], view: RankView | None) -> bool:
    """Is the rank in collective ``key``, issued from C++ (DDP's), on a path through a branch on the
    rank (a DDP model's forward under ``if accelerator.is_main_process:``)?"""
    return (_issued_from_cpp(pos, view) and (pos.op.pg, pos.seq) == key) and rank_branch(pos) is not None


def _fsdp_call_in_rank_branch(pos: Position, key: tuple[str, int]) -> str | None:
    """The cure when the rank is in collective ``key``, issued by FSDP (its forward's all-gather, or
    its state dict's), on a path through a branch on the rank (an FSDP model's forward under ``if
    accelerator.is_main_process:``); None otherwise."""
    cure = wording.fsdp_cure(pos.detail)
    if cure is None or pos.op is None or (pos.op.pg, pos.seq) != key or rank_branch(pos) is None:
        return None
    return cure


def _issued_from_cpp(pos: Position, view: RankView | None) -> bool:
    """Is the rank in (or did it fail in) a collective no call the tracer saw issued (DDP's, from
    C++): the Flight Recorder has it, the rank's Python records no call with its number (an async
    call, or any blocking call on NCCL, returns before its collective ends: the records have it)?"""
    op = pos.op
    if view is None or op is None or op.source != "flight-recorder":
        return False
    return not any(call.pg == op.pg and call.seq == op.seq for call in view.python_ops())


def _loop_ran_longer(exited: list[int], positions: dict[int, Position], histories: dict[int, dict]):
    """The loop (its header's 'file:line') the waiting ranks are still in, when every culprit
    finished cleanly and its last collective was the very call, inside that loop, that they wait
    in now, a later number of it: the loop ran more times on them (more batches, a longer list:
    accelerate's split_between_processes without padding). None otherwise."""
    waiting = [p for p in positions.values() if p.rank not in exited and p.op is not None
               and (p.state == "in-collective" or p.victim) and p.file and p.line]
    if not waiting or any(positions[rank].state != "finished" or positions[rank].exit_call
                          for rank in exited):
        return None
    for rank in exited:
        last = histories.get(rank, {}).get((waiting[0].op.pg, positions[rank].seq or 0))
        if last is None or any(not _waited_in(last, p) or (p.seq or 0) <= (positions[rank].seq or 0)
                               for p in waiting):
            return None
    header = enclosing_loop(waiting[0].file, waiting[0].line)
    return None if header is None else f"{Path(waiting[0].file).name}:{header}"


def _waited_in(last: Op, waiting: Position) -> bool:
    """Is a finished rank's last collective the call a waiting rank waits in: the same line, or,
    for one known from the Flight Recorder alone (DDP's, issued from C++: no line), the same op?"""
    if last.where is not None or waiting.op is None:
        return last.where == waiting.where
    return canonical_op(last.op) == canonical_op(waiting.op.op)


def _extra_collectives(positions: dict[int, Position], exited: list[int]) -> list[int]:
    """Ranks that called a collective inside a rank-dependent branch (``if rank == 0:``) after every
    other rank finished its work cleanly: the call is theirs alone, the others did not end early.

    Such a rank waits in the collective, or has failed in it as the others closed their
    connections. Sends and receives are left out: a rank-dependent branch is where they belong.
    """
    calling = [p for p in positions.values() if p.rank not in exited]
    if not exited or any(positions[rank].state != "finished" for rank in exited):
        return []
    if not calling or any(p.op is None or p.op.p2p or not (p.state == "in-collective" or p.victim)
                          or rank_branch(p) is None for p in calling):
        return []
    return sorted(p.rank for p in calling)


def _same_call_as(dead: Position, other: Position) -> bool:
    """Could ``other``'s collective be the one ``dead`` died in? The same line (its own, or the line
    of the user's own file it was called from: a stack read from text counts an installed trainer as
    a library, the tracer as the user's), and the same op unless one issues several (an object list's
    broadcast is a broadcast)."""
    own = other.callers[-1][2] if other.callers else None
    if dead.where not in (other.where, own):
        return False
    names = {canonical_op(dead.op.op), canonical_op(other.op.op)}
    return len(names) == 1 or bool(names & MULTI_OPS)


def _aborted_inside(pos: Position) -> bool:
    """Was the rank killed by SIGABRT inside a collective (its open record, or its dying stack)?"""
    return (pos.state == "exited" and pos.fatal == signal.SIGABRT and pos.op is not None
            and not pos.victim)


def _aborted_on_different_calls(exited: list[int], positions: dict[int, Position]):
    """One rank killed by SIGABRT inside a collective while every other rank was inside one (or
    failed in one as it died), some in a different call (another op, or another line): gloo aborts
    a rank whose collective receives more data than its own call expects ('Received data size
    doesn't match expected size. Is there a distributed collective mismatch in your code?',
    gloo/transport/tcp/pair.cc). With every other rank still in a collective (no peer closed its
    connections first), those calls were paired as one collective.

    (culprits, the dead rank, the ranks in another call) or None. Culprits: the ranks in a branch on
    the rank, else on a value each rank decides for itself, else the fewer side, else every rank."""
    if len(exited) != 1 or not _aborted_inside(positions[exited[0]]):
        return None
    dead = positions[exited[0]]
    others = [p for p in positions.values() if p.rank != dead.rank]
    if not others or any(p.op is None or not (p.state == "in-collective" or p.victim)
                         or (None not in (p.seq, dead.seq) and p.op.pg == dead.op.pg and p.seq != dead.seq)
                         for p in others):
        return None  # some rank was in no collective, or (by their numbers) in another one
    different = [p.rank for p in others if not _same_call_as(dead, p)]
    if not different:
        return None
    present = {p.rank: replace(p.op, shapes=None) for p in positions.values()}  # the dead rank's are unknown
    groups: dict[tuple, list[int]] = {}
    for p in positions.values():
        groups.setdefault((canonical_op(p.op.op), p.where), []).append(p.rank)
    return _odd_ones_out(groups, present, {}, (dead.op.pg, -1), positions), dead.rank, different


def _own_errors(positions: dict[int, Position]) -> list[int]:
    """Ranks that raised inside a collective an error of their own, not of the communication (gloo
    rejecting a rank's split sizes, torch its tensor), when no rank ended otherwise: the cause."""
    return [pos.rank for pos in positions.values()
            if pos.state == "exited" and pos.victim and pos.op is not None and not pos.timed_out
            and pos.op.error and not is_comm_error(wording.short_error(pos.op.error))]


def _p2p_waits(positions: dict[int, Position]):
    """(waiting rank's position, its peer's position) for each rank waiting in a send or recv whose
    peer waits in an operation too (a peer outside any is left to ``_missing_ranks``)."""
    for pos in positions.values():
        op = pos.op
        if pos.state != "in-collective" or op is None or not op.p2p or op.peer not in positions:
            continue
        peer = positions[op.peer]
        if peer.state == "in-collective":
            yield pos, peer


def _facing(pos: Position, peer: Position) -> bool:
    """Does ``peer`` wait in a send or recv with ``pos``'s rank?"""
    return peer.op is not None and peer.op.p2p and peer.op.peer == pos.rank


def _crossed_p2p(positions: dict[int, Position]) -> list[int]:
    """Ranks waiting in a send to a peer that waits in a send to them (or both in a recv): each
    waits for the other to post the match, and neither will."""
    return sorted(pos.rank for pos, peer in _p2p_waits(positions)
                  if _facing(pos, peer) and not (pos.op.batch or peer.op.batch)
                  and wording.receives(peer.op) == wording.receives(pos.op))


def _unanswered_p2p(positions: dict[int, Position]) -> dict[int, int]:
    """Ranks waiting in a send or recv whose peer waits in another operation, not in the matching
    recv or send to them: {waiting rank: its peer} (the peer is the rank that never arrives)."""
    return {pos.rank: peer.rank for pos, peer in _p2p_waits(positions) if not _facing(pos, peer)}


def _first_in_chains(unanswered: dict[int, int]) -> list[int]:
    """The ranks the waits lead to: a peer that itself waits for another is followed to the rank
    that waits for nobody (rank 3 sends to rank 0, which waits to receive from rank 2, which never
    sends: rank 2). In a cycle, its ranks."""
    found = set()
    for peer in unanswered.values():
        passed = set()
        while peer in unanswered and peer not in passed:
            passed.add(peer)
            peer = unanswered[peer]
        found.add(peer)
    return sorted(found)


def _fewer_matches(waiting: Position, peer: int, views: dict[int, RankView]) -> wording.FewerMatches | None:
    """When ``peer`` posted fewer matches for the sends (receives) of ``waiting``'s rank to it than
    that rank made, as their Python records tell: the counts and the peer's last matching call (a
    pipeline stage that skipped a micro-batch's recv); None when the counts agree or are unknown."""
    if waiting.op.batch or peer not in views or waiting.rank not in views:
        return None
    ops = {rank: views[rank].python_ops() for rank in (waiting.rank, peer)}
    if any(len(kept) >= KEPT_OPS for kept in ops.values()):  # the oldest were let go: no count
        return None
    receiving = wording.receives(waiting.op)
    made = _p2p_with(ops[waiting.rank], peer, receiving)
    matched = _p2p_with(ops[peer], waiting.rank, not receiving)
    if not matched or len(matched) >= len(made) or matched[-1].file is None:
        return None
    return wording.FewerMatches(len(matched), len(made), matched[-1])


def _p2p_with(ops: list[Op], peer: int, receiving: bool) -> list[Op]:
    """The single receives (``receiving``) or sends among ``ops`` whose peer is ``peer``."""
    return [op for op in ops
            if op.p2p and not op.batch and op.peer == peer and wording.receives(op) == receiving]


def _skipped_group_collective(positions: dict[int, Position], histories: dict[int, dict]):
    """A rank waits in a collective of one group while other members of that group, which have not
    issued it, wait in a collective of another group that the first, a member of it too, has not
    issued either: the wait is a cycle. When the other group is larger, a subgroup's collective sits
    in a branch some of its ranks skip (as it is when a wait is inside an ``if`` on the rank), and
    the skippers are named; else, the groups as large, the ranks issue the groups' collectives in
    different orders ("crossed"), and the waiter and those ranks are named.
    A group's members are its ranks as recorded (a subgroup's, ``Op.pg_ranks``), and the ranks seen
    issuing its collectives. (those ranks, the waiter's position, each group's ranks, crossed, the
    same call's waits on other subgroups skipped alike: ``_likewise_skipped``) or None."""
    waiting = {rank: pos for rank, pos in positions.items() if pos.state == "in-collective"
               and pos.op is not None and pos.seq is not None and not pos.op.p2p}
    issued: dict[tuple[int, str], int] = {}  # (rank, group) -> the highest number it issued there
    for rank, history in histories.items():
        for group, seq in history:
            issued[(rank, group)] = max(issued.get((rank, group), 0), seq)
    members = _group_members(issued, [*waiting.values()], histories)
    members.setdefault(WORLD_PG, set()).update(positions)  # the default group: every rank of the world

    def not_issued(rank: int, group: str, seq: int) -> bool:  # a member that has not issued it yet
        return rank in members.get(group, ()) and issued.get((rank, group), 0) < seq

    def skippers(pos: Position) -> list[int]:
        return sorted(rank for rank, other in waiting.items() if other.op.pg != pos.op.pg
                      and not_issued(rank, pos.op.pg, pos.seq)
                      and not_issued(pos.rank, other.op.pg, other.seq))

    for pos in sorted(waiting.values(), key=lambda p: (len(members.get(p.op.pg, ())), p.rank)):
        group, ranks = pos.op.pg, skippers(pos)
        if ranks:
            crossed = all(len(members[waiting[rank].op.pg]) == len(members[group])
                          and not rank_conditional(waiting[rank].file, waiting[rank].line) for rank in ranks)
            crossed = crossed and not rank_conditional(pos.file, pos.line)
            likewise = [] if crossed else _likewise_skipped(pos, ranks, waiting, skippers)
            return ranks, pos, {name: sorted(ranks) for name, ranks in members.items()}, crossed, likewise
    cycle = _wait_cycle(waiting, lambda rank, pos: not_issued(rank, pos.op.pg, pos.seq))
    if cycle:  # three or more groups: each rank waits for the next, the last for the first
        return cycle, waiting[cycle[0]], {name: sorted(ranks) for name, ranks in members.items()}, True, []
    return None


def _likewise_skipped(waiter: Position, skipped: list[int], waiting: dict[int, Position],
                      skippers: Callable[[Position], list[int]]) -> list[tuple[list[int], Position]]:
    """The same call's waits on other subgroups, skipped alike (a device mesh's other rows, each
    on a group of its own): (their skippers, the waiting rank), one per group."""
    seen = {waiter.op.pg, *(waiting[rank].op.pg for rank in skipped)}
    found = []
    for other in sorted(waiting.values(), key=lambda pos: pos.rank):
        if other.op.pg in seen or other.where != waiter.where:
            continue
        ranks = [rank for rank in skippers(other) if rank not in skipped]
        if ranks:
            seen.add(other.op.pg)
            found.append((ranks, other))
    return found


def _wait_cycle(waiting: dict[int, Position], holds: Callable[[int, Position], bool]) -> list[int]:
    """The ranks of a cycle of waits, sorted ([] if none): each waits in a collective of its group
    that a member, waiting in another group's collective (``holds(member, waiter)``: it has not
    issued the waiter's), holds up, and so around, back to the first."""
    follows = {rank: [other for other, there in sorted(waiting.items())
                      if there.op.pg != pos.op.pg and holds(other, pos)] for rank, pos in waiting.items()}
    done: set[int] = set()  # explored: no cycle goes through them
    for start in sorted(follows):
        path, choices = [start], [iter(follows[start])]
        while choices:
            step = next(choices[-1], None)
            if step is None:
                done.add(path.pop())
                choices.pop()
            elif step in path:
                return sorted(path[path.index(step):])
            elif step not in done:
                path.append(step)
                choices.append(iter(follows[step]))
    return []


def _group_members(issued: dict[tuple[int, str], int], waiting: list[Position],
                   histories: dict[int, dict]) -> dict[str, set[int]]:
    """Each group's ranks: those recorded with its calls (a subgroup's), and those seen issuing
    its collectives."""
    members: dict[str, set[int]] = {}
    for rank, group in issued:
        members.setdefault(group, set()).add(rank)
    recorded = [pos.op for pos in waiting] + [op for history in histories.values() for op in history.values()]
    for op in recorded:
        if op.pg_ranks:
            members.setdefault(op.pg, set()).update(op.pg_ranks)
    return members


def _missing_ranks(positions: dict[int, Position]) -> list[int]:
    waiting = [p for p in positions.values() if p.state == "in-collective" or p.victim]
    if not waiting:
        return []
    return sorted(p.rank for p in positions.values() if p.state == "outside-collective")
