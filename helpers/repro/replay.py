"""Replay of a recorded run: a user's 2,000-line training script becomes a 30-line repro.

``python -m helpers doctor --keep DIR -- train.py`` keeps what the hang doctor saw: each rank's
trace (``trace-<rank>.jsonl``: the Python-level collectives with shapes, dtypes and call sites),
its state dump (``state-<rank>.json``: stack and torch's Flight Recorder entries, which also hold the
collectives DDP issues from C++) and ``diagnosis.json``. ``load_recording(DIR)`` reads them back
strictly (a missing or corrupt file is a ValueError naming it); ``plan_replay`` turns them into one
list of collectives per rank, read the way the doctor reads them (``helpers.doctor.history``), and
where each rank was when the doctor looked; ``render_replay`` writes a standalone script that issues
exactly those collectives (op, shapes, dtypes, order) with zero-filled tensors and no model or data,
then leaves each rank where it was: waiting in its last collective, busy outside any, killed by the
same signal, or raising the same error. Run under the doctor, the replay gets the same kind and
culprit ranks as the original.

What cannot be known is said in the script: collectives on process groups other than the default
one are not replayed; a rank that died before its tracer wrote anything is assumed to have issued
what every other rank completed (the last one excepted when a peer then failed in it); when the
Flight Recorder's window (the latest entries) starts at different points on different ranks, the
common earlier collectives, identical on every rank, are left out.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import params, redact, rundir
from helpers.collectives import INIT_OP, canonical_op
from helpers.doctor import RankView, flight_recorder, history, read_folder
from helpers.doctor.pyspy import view_from_stack

DEFAULT_PG = "0"
MESSAGE_LIMIT = 300  # characters of a recorded error message kept in the replay

# op -> the lines that issue it (``tensor``: zero-filled, recorded shape and dtype)
OP_CODE: dict[str, str] = {
    "all_reduce": "dist.all_reduce(tensor)",
    "broadcast": "dist.broadcast(tensor, src=0)",
    "reduce": "dist.reduce(tensor, dst=0)",
    "all_gather": "dist.all_gather([torch.empty_like(tensor) for _ in range(world)], tensor)",
    "all_gather_into_tensor": "dist.all_gather_into_tensor(tensor.new_empty((world * tensor.numel(),)), "
                              "tensor.flatten())",
    "reduce_scatter_tensor": "dist.reduce_scatter_tensor("
                             "tensor.new_empty((max(1, tensor.numel() // world),)), tensor.flatten())",
    "reduce_scatter": "dist.reduce_scatter(tensor, [torch.empty_like(tensor) for _ in range(world)])",
    "gather": "dist.gather(tensor, [torch.empty_like(tensor) for _ in range(world)] if rank == 0 "
              "else None)",
    "scatter": "dist.scatter(tensor, [torch.empty_like(tensor) for _ in range(world)] if rank == 0 "
               "else None)",
    # ``peer``: the recorded [output rows, output_split_sizes, input_split_sizes], when recorded
    "all_to_all_single": "dist.all_to_all_single(tensor.new_empty((peer[0], *tensor.shape[1:])) if peer "
                         "else torch.empty_like(tensor), tensor, *(peer[1:] if peer else ()))",
    "all_to_all": "dist.all_to_all([torch.empty_like(tensor) for _ in range(world)], "
                  "[tensor.clone() for _ in range(world)])",
    "barrier": "dist.barrier()",
    "all_gather_object": "dist.all_gather_object([None] * world, rank)",
    "broadcast_object_list": "dist.broadcast_object_list([rank] * tensor.numel(), src=0)",  # its length
    "gather_object": "dist.gather_object(rank, [None] * world if rank == 0 else None)",
    "scatter_object_list": "dist.scatter_object_list([None], list(range(world)) if rank == 0 else None)",
    "send": "dist.send(tensor, dst=peer)",
    "recv": "dist.recv(tensor, src=peer)",
    "isend": "dist.isend(tensor, dst=peer).wait()",
    "irecv": "dist.irecv(tensor, src=peer).wait()",
}


# ---------------------------------------------------------------------------------------------
# reading a kept run


@dataclass
class Recording:
    """A run kept by ``python -m helpers doctor --keep DIR``: the doctor's view of every rank."""

    folder: Path
    num_processes: int
    diagnosis: dict[str, Any]
    views: dict[int, RankView]
    peers: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> {record id: p2p peer}

    def state_of(self, rank: int) -> str:
        """Where the doctor found the rank: in-collective, outside-collective, exited, finished."""
        return str(self.diagnosis["per_rank"][rank].get("state") or "outside-collective")

    def exit_code_of(self, rank: int) -> int | None:
        """The rank's exit code in the diagnosis (negative: killed by that signal)."""
        code = self.diagnosis["per_rank"][rank].get("exit_code")
        return int(code) if isinstance(code, int) else None


def load_recording(folder: str | Path) -> Recording:
    """Read what the doctor recorded: a folder kept with ``--keep``, a folder of torch's Flight
    Recorder dumps, or the JSON of ``--attach`` (or ``--merge``). A ValueError names the parameter
    (``from_trace``) and what is wrong."""
    path = params.resolve_path(folder)
    if path.is_file():
        return _from_attach(path)
    if not path.is_dir():
        raise ValueError(f"from_trace must be a folder kept by `python -m helpers doctor --keep DIR -- "
                         f"script.py`, a folder of Flight Recorder dumps or the JSON of `--attach`; "
                         f"{path} does not exist")
    if not rundir.diagnosis_path(path).exists() and not rundir.traced_ranks(path):
        return _from_dumps(path)
    diagnosis = _read_diagnosis(rundir.diagnosis_path(path))
    count = len(diagnosis["per_rank"])
    peers: dict[int, dict[int, int]] = {}
    views = read_folder(path, range(count), strict=True, peers=peers)
    for rank, view in views.items():
        entry = diagnosis["per_rank"][rank]
        if entry.get("state") in ("exited", "finished"):
            view.ended = True
            view.exit_code = 0 if entry.get("state") == "finished" else entry.get("exit_code")
    return Recording(path, count, diagnosis, views, peers)


def _from_dumps(folder: Path) -> Recording:
    """A recording from Flight Recorder dumps: each rank's collectives as it recorded them."""
    try:
        dumps = flight_recorder.read_dumps(folder)
    except ValueError as exc:
        raise ValueError(str(exc).replace("from_fr", "from_trace", 1)) from None
    diagnosis = flight_recorder.diagnose_dumps(folder).to_dict()
    views = flight_recorder.views_from_dumps(dumps)
    missing = sorted(set(range(len(diagnosis["per_rank"]))) - set(views))
    if missing:
        raise ValueError(f"from_trace: {folder} holds no dump for ranks {missing}: a replay needs every rank")
    return Recording(folder, len(diagnosis["per_rank"]), diagnosis, views)


def _from_attach(path: Path) -> Recording:
    """A recording from stacks (``--attach``): each rank issues the collective it waits in, if any.

    Stacks hold no history: the replay starts where the ranks were, which is where the hang is.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"from_trace: {path} is a file but not JSON: {exc}") from None
    stacks = data.get("stacks") if isinstance(data, dict) else None
    if not isinstance(stacks, dict) or not isinstance(data.get("per_rank"), list):
        raise ValueError(f"from_trace: {path} is a file but not the JSON of `python -m helpers doctor "
                         "--attach` (no 'stacks'); give a folder kept with --keep, or a folder of dumps")
    count = len(data["per_rank"])
    missing = sorted(set(range(count)) - {int(rank) for rank in stacks})
    if missing:
        raise ValueError(f"from_trace: {path} has no stacks of ranks {missing} (other nodes): merge every "
                         "node's file first (`python -m helpers doctor --merge ... --json job.json`)")
    views = {}
    for rank, frames in stacks.items():
        view = view_from_stack(int(rank), frames, time.time())
        for op in view.open.values():
            op.seq = 1  # the one collective a stack shows: the first (and only) one replayed
        views[int(rank)] = view
    return Recording(path, count, data, views)


def _read_diagnosis(path: Path) -> dict[str, Any]:
    """The diagnosis JSON, checked: a ValueError naming ``from_trace`` when it is not one."""
    if not path.is_file():
        raise ValueError(f"from_trace: {path.parent} holds no diagnosis.json; keep a run with "
                         "`python -m helpers doctor --keep DIR -- script.py`")
    try:
        diagnosis = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"from_trace: {path} is corrupt: {exc}") from None
    per_rank = diagnosis.get("per_rank") if isinstance(diagnosis, dict) else None
    ok = (isinstance(per_rank, list) and per_rank and all(isinstance(p, dict) for p in per_rank)
          and [p.get("rank") for p in per_rank] == list(range(len(per_rank)))
          and isinstance(diagnosis.get("kind"), str) and isinstance(diagnosis.get("ranks"), list))
    if not ok:
        raise ValueError(f"from_trace: {path} is corrupt: not a doctor's diagnosis (kind, ranks and "
                         "per_rank entries for ranks 0..N-1)")
    return diagnosis


# ---------------------------------------------------------------------------------------------
# the plan: one list of collectives per rank, and where each rank ended


@dataclass
class Step:
    """One operation a rank issued: the op to call, the input's shapes and dtype, its origin."""

    op: str
    shapes: list[list[int]]
    dtype: str
    peer: int | list | None = None  # a p2p op's peer; all_to_all_single's split sizes
    origin: str = ""  # where the original issued it (file:line), or who (C++)
    note: str = ""

    def key(self) -> tuple:
        """What makes two consecutive steps the same line of the script."""
        return (self.op, json.dumps(self.shapes), self.dtype, self.peer, self.origin, self.note)


@dataclass
class RankPlan:
    """Everything one rank does in the replay."""

    rank: int
    steps: list[Step]
    end: str  # wait | busy | finish | signal | exit | raise
    value: Any = None  # the signal number, exit code or error message
    note: str = ""


@dataclass
class ReplayPlan:
    """Every rank's plan, the original diagnosis and what could not be replayed."""

    num_processes: int
    ranks: list[RankPlan]
    diagnosis: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    own_path: dict[int, int] = field(default_factory=dict)  # rank -> first step on a path of its own


def plan_replay(recording: Recording) -> ReplayPlan:
    """Each rank's collectives, read as the doctor reads them, and where the rank ended."""
    ops = {rank: dict(history(view)) for rank, view in recording.views.items()}
    notes: list[str] = []
    other_groups = sum(1 for rank_ops in ops.values() for key in rank_ops if key[0] != DEFAULT_PG)
    if other_groups:
        notes.append(f"{other_groups} operations on other process groups than the default one are "
                     "not replayed")
    ops = {rank: {key[1]: op for key, op in rank_ops.items() if key[0] == DEFAULT_PG}
           for rank, rank_ops in ops.items()}
    rank_notes = _fill_from_peers(recording, ops, notes)
    ops = _common_window(ops, notes)
    p2p = {rank: [(view.ops[i], recording.peers.get(rank, {}).get(i, 0)) for i in view.order
                  if i in view.ops and view.ops[i].p2p] for rank, view in recording.views.items()}
    ranks = []
    for rank in range(recording.num_processes):
        ordered = sorted(ops[rank].items())
        steps = [_step(op) for _seq, op in ordered]
        steps = _with_p2p(steps, [op.start for _seq, op in ordered], p2p.get(rank, []))
        end, value = _end(recording, rank)
        ranks.append(RankPlan(rank, steps, end, value, rank_notes.get(rank, "")))
    return ReplayPlan(recording.num_processes, ranks, recording.diagnosis, notes,
                      own_paths(ranks, recording.diagnosis))


def own_paths(ranks: list[RankPlan], diagnosis: dict[str, Any]) -> dict[int, int]:
    """Where each culprit rank left the others' path: its first step unlike theirs.

    For a mismatch that some ranks (not all) caused, the original's culprits issued their diverging
    collectives on a path of their own (a rank-dependent branch, a loop left early); the replay
    issues those steps from rank-dependent code too, so that it reads, and is diagnosed, the same.
    """
    culprits = [r for r in diagnosis.get("ranks") or [] if isinstance(r, int) and 0 <= r < len(ranks)]
    if diagnosis.get("kind") not in ("collective-mismatch", "shape-mismatch") or \
            not culprits or len(culprits) >= len(ranks):
        return {}
    others = [plan for plan in ranks if plan.rank not in culprits]
    paths = {}
    for rank in culprits:
        steps = ranks[rank].steps
        for index, step in enumerate(steps):
            if any(index >= len(o.steps) or _signature(o.steps[index]) != _signature(step) for o in others):
                paths[rank] = index
                break
    return paths


def _signature(step: Step) -> tuple:
    return (step.op, json.dumps(step.shapes), step.dtype)


def _has_flight_recorder(view: Any) -> bool:
    return bool((view.state or {}).get("fr"))


def _fill_from_peers(recording: Recording, ops: dict[int, dict[int, Any]],
                     notes: list[str]) -> dict[int, str]:
    """Collectives a rank issued but did not record (C++ ones, without its Flight Recorder dump).

    Sequence numbers are contiguous, so the gaps below the highest one a rank is known to have issued
    from Python, or to have completed, are certain and are taken from a rank that recorded them (a
    collective it issued but did not complete stays unknown: it may be the one that diverged). A
    rank with no record at all that died gets what every recorded rank completed (the last one
    excepted when a peer then failed). Returns a note per rank that got some.
    """
    recorded = [r for r, view in recording.views.items() if _has_flight_recorder(view)]
    rank_notes: dict[int, str] = {}
    for rank, view in recording.views.items():
        if _has_flight_recorder(view) or not recorded:
            continue
        completed = [done for _enqueued, done in (view.progress or {}).values()]
        upto = max([*ops[rank], *completed], default=0)
        guessed = upto == 0 and recording.state_of(rank) == "exited"
        if guessed:
            upto = _completed_by_all(recording, ops, recorded)
        missing = [seq for seq in range(1, upto + 1) if seq not in ops[rank]]
        sources = set()
        for seq in missing:
            peer = next((p for p in recorded if seq in ops[p]), None)
            if peer is not None:
                ops[rank][seq] = ops[peer][seq]
                sources.add(peer)
        if not sources:
            continue
        whose = ", ".join(f"rank {p}" for p in sorted(sources))
        if guessed:
            rank_notes[rank] = (f"assumed: rank {rank} died before recording anything; these are the "
                                f"collectives every other rank completed (as {whose} recorded them)")
        else:
            rank_notes[rank] = (f"rank {rank} did not record its collectives issued from C++; "
                                f"{len(missing)} taken from {whose}")
        notes.append(rank_notes[rank])
    return rank_notes


def _completed_by_all(recording: Recording, ops: dict[int, dict[int, Any]], recorded: list[int]) -> int:
    lasts = []
    for rank in recorded:
        done = [seq for seq, op in ops[rank].items() if op.ok]
        last = max(done, default=0)
        failed = (recording.views[rank].exit or {}).get("status") == "raised"
        lasts.append(max(0, last - 1) if failed else last)
    return min(lasts, default=0)


def _common_window(ops: dict[int, dict[int, Any]], notes: list[str]) -> dict[int, dict[int, Any]]:
    """Leave out the earliest collectives when some rank's record starts later (same on every rank)."""
    starts = [min(rank_ops) for rank_ops in ops.values() if rank_ops]
    start = max(starts, default=1)
    if start <= 1:
        return ops
    notes.append(f"the first {start - 1} collectives (before the oldest one every rank's record holds, "
                 "and the same on every rank) are left out")
    return {rank: {seq: op for seq, op in rank_ops.items() if seq >= start} for rank, rank_ops in ops.items()}


def _step(op: Any) -> Step:
    name = op.op
    if " (" in name:  # an object collective's inner operation: "all_gather_object (all_gather)"
        name = name.split(" (", 1)[1].rstrip(")")
    name = canonical_op(name)
    shapes = [list(shape) for shape in (op.shapes or []) if isinstance(shape, list | tuple)]
    dtype = (op.dtypes or ["float32"])[0] or "float32"
    if dtype == "object":  # a list of objects, recorded as shape [its length]: a tensor that long
        dtype = "float32"
    origin = op.where or ("from C++ (DDP, for instance)" if op.source == "flight-recorder" else "")
    note = ""
    if name not in OP_CODE:
        note = f"recorded as {name}: replayed as an all_reduce of the same size"
        name = "all_reduce"
    return Step(name, shapes, dtype, _recorded_splits(name, op), redact.redact_text(origin), note)


def _recorded_splits(name: str, op: Any) -> list | None:
    """all_to_all_single's recorded ``[output rows, output splits, input splits]``: the replay
    passes the same sizes (a rank's own split sizes are the mismatch to reproduce)."""
    splits = getattr(op, "splits", None)
    if name != "all_to_all_single" or not splits or not isinstance(splits[0], int):
        return None
    return list(splits)


def _with_p2p(steps: list[Step], starts: list[float | None], p2p: list[Any]) -> list[Step]:
    """Point-to-point operations (not numbered like collectives) go in by the time they started."""
    placed: list[tuple[float, float, Step]] = [(float(i), 0.0, step) for i, step in enumerate(steps)]
    for op, peer in p2p:
        began = op.start or 0.0
        later = (i for i, start in enumerate(starts) if start is not None and start > began)
        index = next(later, len(starts))
        step = _step(op)
        step.peer = peer
        placed.append((index - 0.5, began, step))
    return [step for _pos, _began, step in sorted(placed, key=lambda item: (item[0], item[1]))]


def _end(recording: Recording, rank: int) -> tuple[str, Any]:
    """Where the rank was when the doctor looked (how it ended, when it had ended)."""
    state = recording.state_of(rank)
    if state == "in-collective":
        return "wait", None
    if state == "outside-collective":  # before init_process_group, when others wait in it
        return (BEFORE_INIT if _waited_in_init(recording) else "busy"), None
    if state == "finished":
        return "finish", None
    code = recording.exit_code_of(rank)
    exit_record = recording.views[rank].exit or {}
    if code is not None and code < 0:
        return "signal", -code
    if exit_record.get("status") == "raised" and exit_record.get("error"):
        return "raise", _message(str(exit_record["error"]))
    return "exit", code if code is not None else 1


BEFORE_INIT = "busy before init"  # a rank busy before it reached init_process_group


def _waited_in_init(recording: Recording) -> bool:
    """Did the doctor find some rank waiting in init_process_group?"""
    return any(entry.get("op") == INIT_OP and entry.get("state") == "in-collective"
               for entry in recording.diagnosis["per_rank"])


def _message(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else "the original rank raised"
    return redact.for_report(first)[:MESSAGE_LIMIT]


# ---------------------------------------------------------------------------------------------
# the script


def render_replay(plan: ReplayPlan, script_name: str) -> str:
    """The replay script's text (ruff-clean, imports only torch and accelerate)."""
    ops = sorted({step.op for rank in plan.ranks for step in rank.steps})
    ends = {rank.end for rank in plan.ranks}
    own_ops = sorted({step.op for rank in plan.ranks if rank.rank in plan.own_path
                      for step in rank.steps[plan.own_path[rank.rank]:]})
    parts = [_header(plan, script_name), _imports(ends), _constants(plan), _issue_function(ops)]
    if plan.own_path:
        parts.append(_own_path_function(own_ops))
    parts += [_main_function(ends, bool(plan.own_path)), _FOOTER]
    return "\n".join(parts)


def _header(plan: ReplayPlan, script_name: str) -> str:
    diagnosis = plan.diagnosis
    n = plan.num_processes
    summary = redact.for_report(str(diagnosis.get("summary") or ""))
    lines = [
        f"Replay of a recorded run on {n} ranks: each rank issues the collectives it issued in the",
        "original (ops, shapes, dtypes, order) with zero-filled tensors, no model and no data, then",
        "stops where it was when the hang doctor looked (see ENDS).",
        f"Original: {diagnosis.get('verdict')} ({diagnosis.get('kind')}), culprit ranks "
        f"{diagnosis.get('ranks')}. {summary}",
        "",
        f"Launch it on {n} ranks (one GPU per rank, or CPUs with gloo where there is no GPU):",
        f"  torchrun --nproc-per-node {n} {script_name}",
        f"  accelerate launch --multi_gpu --num_processes {n} {script_name}",
        f"  python -m helpers doctor --num-processes {n} -- {script_name}   (names the hang in seconds)",
        "Add --pg-timeout-s 60 to make a hang end after 60 s instead of torch's default (30 min on gloo).",
    ]
    lines += [f"Note: {note}." for note in plan.notes]
    docstring = '"""Replay of a recorded run: each rank issues its recorded collectives, then stops there."""'
    return "\n".join(comment(line) for line in lines) + "\n" + docstring + "\n"


def comment(line: str, indent: str = "") -> str:
    """``line`` as a Python comment wrapped at 96 columns (continuation lines indented)."""
    import textwrap

    if not line:
        return indent + "#"
    hanging = "  " if line.startswith("  ") else ""
    wrapped = textwrap.wrap(line, width=96 - len(indent), subsequent_indent=hanging + "  ",
                            break_on_hyphens=False, break_long_words=False) or [line]
    return "\n".join(f"{indent}# {part}" for part in wrapped)


def _imports(ends: set[str]) -> str:
    stdlib = ["argparse", "datetime", "time"]
    if ends & {"signal", BEFORE_INIT}:
        stdlib += ["os"]
    lines = [f"import {name}" for name in sorted(stdlib)]
    lines += ["", "import torch", "import torch.distributed as dist",
              "from accelerate import Accelerator, InitProcessGroupKwargs", ""]
    return "\n".join(lines)


def _constants(plan: ReplayPlan) -> str:
    lines = ["PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)",
             "GAP_S = 0.002  # pause between operations: a tracer tells consecutive calls apart by time"]
    if any(rank.end in ("busy", BEFORE_INIT) for rank in plan.ranks):
        lines.append("BUSY_S = 600.0  # how long a rank that was busy outside any collective stays busy")
    lines += ["", "# Each rank's operations in order: (op, input shapes, dtype[, peer]); the comment says",
              "# where the original issued it. An all_to_all_single's peer is its [output rows,",
              "# output_split_sizes, input_split_sizes] (None: equal splits).", "PLAN = {"]
    for rank in plan.ranks:
        if rank.note:
            lines += [comment(rank.note, indent="    ")]
        lines.append(f"    {rank.rank}: [")
        lines += _step_lines(rank.steps)
        lines.append("    ],")
    lines.append("}")
    lines += ["# Where each rank was when the doctor looked: wait (in its last operation), busy (outside",
              "# any), busy before init (it never reached init_process_group), finish (ended normally),",
              "# signal N (killed), exit N, raise MESSAGE.", "ENDS = {"]
    for rank in plan.ranks:
        name = f"  # {signal.Signals(rank.value).name}" if rank.end == "signal" else ""
        lines.append(_fit(f"    {rank.rank}: ({json.dumps(rank.end)}, {_python(rank.value)}),{name}"))
    lines.append("}")
    if plan.own_path:
        own = ", ".join(f"{rank}: {index}" for rank, index in sorted(plan.own_path.items()))
        lines += ["# Ranks that took a path of their own in the original (the doctor's culprits) and from",
                  "# which step on: those steps are issued from rank-dependent code, as in the original.",
                  f"OWN_PATH = {{{own}}}"]
    return "\n".join(lines) + "\n"


def _python(value: Any) -> str:
    """A value as Python source with double quotes (json for strings, repr otherwise)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _step_lines(steps: list[Step]) -> list[str]:
    lines: list[str] = []
    index = 0
    while index < len(steps):
        run = 1
        while index + run < len(steps) and steps[index + run].key() == steps[index].key():
            run += 1
        step = steps[index]
        literal = f"({json.dumps(step.op)}, {json.dumps(step.shapes)}, {json.dumps(step.dtype)}"
        literal += f", {step.peer})" if step.peer is not None else ")"
        text = f"*[{literal}] * {run}," if run > 1 else f"{literal},"
        said = "; ".join(filter(None, [step.origin, step.note]))
        lines.append(f"        {text}" + (f"  # {said}" if said else ""))
        index += run
    return [_fit(line) for line in lines]


def _fit(line: str, limit: int = 110) -> str:
    """Keep a PLAN line within the line length: shorten its comment, never its data."""
    if len(line) <= limit or "  # " not in line:
        return line
    code, said = line.split("  # ", 1)
    room = limit - len(code) - 4
    return f"{code}  # {said[:max(room - 3, 0)]}..." if room > 10 else code


def _issue_function(ops: list[str]) -> str:
    lines = [
        "",
        "def issue(op, shapes, dtype, peer, device, rank, world):",
        '    """Issue one recorded operation with zero-filled tensors of the recorded shapes and dtype."""',
    ]
    lines += _dispatch(ops, "    ")
    return "\n".join(_wrap_code(line) for line in lines) + "\n"


def _own_path_function(ops: list[str]) -> str:
    lines = [
        "",
        "def issue_on_own_path(op, shapes, dtype, peer, device, rank, world):",
        '    """The same, for the steps a rank took on a path of its own in the original (see OWN_PATH)."""',
    ]
    lines += _dispatch(ops, "    ", test="rank in OWN_PATH and ")
    return "\n".join(_wrap_code(line) for line in lines) + "\n"


def _dispatch(ops: list[str], indent: str, test: str = "") -> list[str]:
    lines = []
    if any("tensor" in OP_CODE[op] for op in ops):
        lines += [
            "kind = getattr(torch, dtype)",
            "parts = [torch.zeros(shape, dtype=kind, device=device) for shape in shapes]",
            "parts = parts or [torch.zeros(1, dtype=kind, device=device)]",
            "tensor = parts[0] if len(parts) == 1 else torch.cat([part.flatten() for part in parts])",
        ]
    for index, op in enumerate(ops):
        keyword = "if" if index == 0 else "elif"
        lines += [f"{keyword} {test}op == {json.dumps(op)}:", f"    {OP_CODE[op]}"]
    return [indent + line for line in lines]


def _wrap_code(line: str, limit: int = 110) -> str:
    if len(line) <= limit or "(" not in line:
        return line
    indent = len(line) - len(line.lstrip())
    head, _, rest = line.partition("(")
    return f"{head}(\n{' ' * (indent + 4)}{rest[:-1]}\n{' ' * indent})"


def _main_function(ends: set[str], own_path: bool) -> str:
    busy = ends & {"busy", BEFORE_INIT}
    lines = [
        "",
        f"def main(pg_timeout_s=PG_TIMEOUT_S, gap_s=GAP_S{', busy_s=BUSY_S' if busy else ''}):",
        '    """Issue this rank\'s recorded operations, then stop where the original stopped."""',
    ]
    if BEFORE_INIT in ends:  # the rank is known from the launcher's environment before the group exists
        lines += [
            f'    if ENDS[int(os.environ.get("RANK", "0"))][0] == {json.dumps(BEFORE_INIT)}:',
            "        deadline = time.monotonic() + busy_s  # as the original: no init_process_group yet",
            "        while time.monotonic() < deadline:",
            "            time.sleep(0.05)",
        ]
    lines += [
        "    timeout = datetime.timedelta(seconds=pg_timeout_s)",
        "    handlers = [InitProcessGroupKwargs(timeout=timeout)] if pg_timeout_s else []",
        "    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=handlers)",
        "    rank, world = accelerator.process_index, accelerator.num_processes",
        "    if world != len(PLAN):",
        '        raise SystemExit(f"this replay needs {len(PLAN)} ranks; it was started on {world}")',
    ]
    if own_path:
        lines += [
            "    for index, (op, shapes, dtype, *peer) in enumerate(PLAN[rank]):",
            "        own = rank in OWN_PATH and index >= OWN_PATH[rank]",
            "        call = issue_on_own_path if own else issue",
            "        call(op, shapes, dtype, peer[0] if peer else None, accelerator.device, rank, world)",
            "        time.sleep(gap_s)",
        ]
    else:
        lines += [
            "    for op, shapes, dtype, *peer in PLAN[rank]:",
            "        issue(op, shapes, dtype, peer[0] if peer else None, accelerator.device, rank, world)",
            "        time.sleep(gap_s)",
        ]
    if ends & {"signal", "exit", "raise"}:
        lines.append("    end, value = ENDS[rank]")
    elif "busy" in ends:
        lines.append("    end = ENDS[rank][0]")
    branches = {
        "busy": ["deadline = time.monotonic() + busy_s",
                 "while time.monotonic() < deadline:  # busy outside any collective, as the original",
                 "    time.sleep(0.05)"],
        "signal": ["os.kill(os.getpid(), value)  # as the original rank was killed"],
        "exit": ["raise SystemExit(value)"],
        "raise": ['raise RuntimeError(f"as the original rank: {value}")'],
    }
    first = True
    for end in ("busy", "signal", "exit", "raise"):
        if end in ends:
            lines.append(f"    {'if' if first else 'elif'} end == {json.dumps(end)}:")
            lines += [f"        {line}" for line in branches[end]]
            first = False
    lines.append('    return {"rank": rank, "operations": len(PLAN[rank])}')
    return "\n".join(lines) + "\n"


_FOOTER = '''
def parse_args(argv=None):
    """Command-line overrides of the UPPER_CASE parameters above (`--pg-timeout-s 60` ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in list(globals().items()):
        if name.isupper() and isinstance(value, float):
            parser.add_argument("--" + name.lower().replace("_", "-"), type=float, default=value)
    return vars(parser.parse_args(argv))


if __name__ == "__main__":
    print(main(**parse_args()), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
'''
