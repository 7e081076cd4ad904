"""The leader's judgement inside a job (``helpers.doctor.job``): pure functions on heartbeats and
answers, plus what "this machine" and "still alive" mean.

``trigger`` says whether, and since when, the leading rank should diagnose; ``diagnosis`` builds
``RankView``s from the ranks' answers (or the last heartbeat of a rank that did not answer, its stack
read with py-spy when ``py_spy_stacks`` could) and calls the doctor's ``diagnose()``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from helpers.doctor.board import Seen
from helpers.doctor.diagnosis import Diagnosis, diagnose
from helpers.doctor.records import WORLD_PG, RankView

EVIDENCE_WAIT_S = 2.0  # the leader waits this long for the ranks' answers
PY_SPY_S = 2.0  # reading a silent rank of the leader's machine with py-spy
ENDED_BADLY = ("raised", "exited")  # exit statuses that call for a diagnosis at once


def machine_id(host: str) -> str:
    """This machine as the doctor tells machines apart: the host name, the boot and the PID
    namespace (two containers with host networking share a host name, not their process ids)."""
    parts = [host]
    for path, read in (("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
                       ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(read(path))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def create_time(pid: int) -> float | None:
    """When process ``pid`` started (psutil), so a reused pid is not taken for the rank."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def still_runs(beat: dict[str, Any]) -> bool:
    """The process a heartbeat names still runs (same pid and start time; on this machine)."""
    pid = beat.get("pid")
    if not isinstance(pid, int):
        return True
    born = create_time(pid)
    return born is not None and (beat.get("born") is None or abs(born - beat["born"]) < 0.5)


def is_gone(seen: Seen, machine: str) -> bool:
    """Known gone: it said so, or it is on this machine and its process no longer exists."""
    return seen.gone or (seen.beat.get("machine") == machine and not still_runs(seen.beat))


def should_diagnose(beats: dict[int, Seen], world: int, stall_s: float,
                    machine: str) -> tuple[str, float] | None:
    """Why the leader should diagnose now, and since when (seconds), or None."""
    ends = {rank: seen.beat.get("exit") or {} for rank, seen in beats.items()}
    for rank, end in ends.items():
        if end.get("status") in ENDED_BADLY or end.get("orphaned"):  # orphaned: a lost node
            return "failure", (beats[rank].beat.get("ended_ago") or 0.0) + beats[rank].age()
    vanished = {r for end in ends.values() for r in end.get("gone") or []}
    vanished |= {rank for rank, seen in beats.items() if not ends[rank] and is_gone(seen, machine)}
    if vanished:
        return "failure", 0.0
    if len(beats) == world and all(end.get("status") == "finished" for end in ends.values()):
        return "finished", 0.0
    running = {rank: seen for rank, seen in beats.items() if not ends[rank]}
    for rank, end in ends.items():
        if end.get("status") != "finished" or len(beats) < world:  # a rank yet to join may be importing
            continue
        last = beats[rank].beat.get("last") or 0
        pending = [seen.beat.get("pending") for seen in running.values()]
        # another rank waits in a collective it never issued (0: in init_process_group, which it
        # never reached either)
        if any(number is not None and (number > last or number == last == 0) for number in pending):
            return "exited", 0.0
    idle = min((seen.beat["idle"] + seen.age() for seen in running.values()
                if seen.beat.get("idle") is not None), default=float("inf"))
    stalls = [min(seen.beat["wait"] + seen.age(), idle) for seen in running.values()
              if seen.beat.get("wait") is not None]
    stalled = [s for s in stalls if s >= stall_s]
    return ("stall", max(stalled)) if stalled else None


def py_spy_stacks(ranks: list[int], beats: dict[int, Seen], machine: str) -> dict[int, list[dict[str, Any]]]:
    """The stacks of this machine's ranks that did not answer, read with py-spy in parallel (their
    Python cannot run, but py-spy reads its memory); none where py-spy may not (ptrace rights)."""
    from helpers.doctor import pyspy

    local = {rank: beats[rank].beat["pid"] for rank in ranks if rank in beats
             and beats[rank].beat.get("machine") == machine and isinstance(beats[rank].beat.get("pid"), int)
             and still_runs(beats[rank].beat)}
    return pyspy.read_stacks(local, timeout_s=PY_SPY_S)


def diagnose_answers(world: int, reason: str, since_s: float, answers: dict[int, dict[str, Any]],
               beats: dict[int, Seen], machine: str,
               stacks: dict[int, list[dict[str, Any]]] | None = None,
               first_calls: dict[int, dict[str, Any]] | None = None) -> Diagnosis:
    """Views from the answers (or the last heartbeat of a rank that did not answer, with its stack
    from py-spy when ``stacks`` has it, and its latest first call from ``first_calls`` when that is
    newer than the heartbeat: a rank gloo aborted on a size mismatch posted it just before), diagnosed.
    A rank with neither is placed as not heard from yet (``RankView.unheard``), not as ended."""
    views, notes, silent_ends = {}, [], []
    vanished = {r for seen in beats.values() for r in (seen.beat.get("exit") or {}).get("gone") or []}
    floor = _completed_by_all(answers)
    for rank in range(world):
        seen = beats.get(rank)
        if rank in answers:
            views[rank] = view_from(rank, answers[rank], answers[rank])
        elif seen is not None:
            call = (first_calls or {}).get(rank)
            beat = _with_first_call(seen.beat, call)
            view = view_from(rank, beat, {"stack": [seen.beat["site"]] if seen.beat.get("site") else [],
                                          "progress": seen.beat.get("progress") or {}, "fr": []})
            if beat is not seen.beat:  # it took its latest first call, known from its start alone
                view.posted = call["id"]
            dead = rank in vanished or (is_gone(seen, machine) and not seen.beat.get("exit"))
            if dead and not seen.beat.get("exit"):
                view.exit, view.ended, view.exit_code = {"ev": "exit", "status": "vanished"}, True, None
                view.state["stack"] = []  # where it was a tick before it died: no evidence of its end
                silent_ends.append(rank)
            elif not seen.beat.get("exit") and rank in (stacks or {}):
                view.state["stack"], view.silent = stacks[rank], True
                if not _in_torch_distributed(stacks[rank]):  # its last beat caught it in a call that returned
                    _returned_since_beat(view, floor)
                notes.append(f"rank {rank} did not answer in {EVIDENCE_WAIT_S:.0f} s (native code holding "
                             "the GIL): its stack was read with py-spy")
            elif not seen.beat.get("exit"):
                notes.append(f"rank {rank} did not answer in {EVIDENCE_WAIT_S:.0f} s (native code holding "
                             f"the GIL, or a machine that stopped); where it was is from its heartbeat "
                             f"{seen.age():.1f} s old")
            views[rank] = view
        else:  # it never posted a heartbeat: not known to have ended (``diagnose`` would take it so)
            views[rank] = RankView(rank, unheard=True)
    diagnosis = diagnose(views, world, reason, round(since_s, 3))
    diagnosis.notes.extend(notes + [_silent_end_note(rank, diagnosis.kind) for rank in silent_ends])
    return diagnosis


def _silent_end_note(rank: int, kind: str) -> str:
    """What a rank that ended without a word (no exception, no exit code) was most likely killed by:
    gloo's abort when the ranks' collectives disagree in size, else any signal."""
    if kind in ("shape-mismatch", "collective-mismatch"):
        how = ("most likely gloo's abort (SIGABRT), which ends a rank whose collective receives more "
               "data than its own call expects, as in the mismatch above")
    else:
        how = "SIGKILL from the OOM killer, gloo's or NCCL's abort (SIGABRT), a segfault"
    return (f"rank {rank} ended without a word (no exception, no exit code): killed by a signal, {how}; "
            "its agent's log has the signal, and its stack where it died")


def _in_torch_distributed(frames: list[dict[str, Any]]) -> bool:
    """Is a stack (py-spy's frames) inside torch.distributed's Python, where a blocking call waits?"""
    return any("/torch/distributed/" in (frame.get("file") or "").replace("\\", "/") for frame in frames)


def _completed_by_all(answers: dict[int, dict[str, Any]]) -> int:
    """The highest number of the default group that every rank that answered has completed (0 when
    none answered): every rank of the world took part in each of those collectives."""
    done = []
    for answer in answers.values():
        try:
            done.append(int((answer.get("progress") or {})[WORLD_PG][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            return 0
    return max(min(done, default=0), 0)


def _returned_since_beat(view: RankView, floor: int = 0) -> None:
    """A rank whose stack, read after its last heartbeat, is outside torch.distributed: the blocking
    calls that heartbeat showed open have returned, their collectives completed, and so have the
    default group's collectives up to ``floor``, which the others completed with it (a rank that
    went on from its last note, taken long before, into native code holding the GIL: its helper
    thread could note no progress since)."""
    progress = dict(view.progress)
    if floor and WORLD_PG in progress:
        enqueued, done = progress[WORLD_PG]
        progress[WORLD_PG] = [max(enqueued, floor), max(done, floor)]
    for op_id, op in list(view.open.items()):
        if op.async_:  # an isend or irecv stays open until its wait() returns, outside torch's Python
            continue
        del view.open[op_id]
        if op.seq is not None and op.pg in progress:
            enqueued, done = progress[op.pg]
            progress[op.pg] = [enqueued, max(done, op.seq)]
    view.progress = progress


def _with_first_call(beat: dict[str, Any], call: dict[str, Any] | None) -> dict[str, Any]:
    """``beat`` with ``call`` (a first call's record) among its records when the beat predates it."""
    records = beat.get("recs") or []
    known = max((record.get("id") or 0 for record in records if isinstance(record, dict)), default=0)
    if not call or not isinstance(call.get("id"), int) or call["id"] <= known:
        return beat
    return {**beat, "recs": [*records, call]}


def view_from(rank: int, source: dict[str, Any], state: dict[str, Any]) -> RankView:
    view = RankView(rank)
    for record in source.get("recs") or []:
        try:
            view.apply(record)
        except (KeyError, TypeError):
            continue
    if source.get("progress"):
        view.apply({"ev": "pg", "pg": source["progress"], "t": time.time()})
    view.state = {key: state.get(key) for key in ("stack", "progress", "fr", "thread_errors")}
    view.workers = state.get("workers") or []
    view.node = source.get("node") if isinstance(source.get("node"), int) else None
    end = source.get("exit")
    if end:
        view.exit, view.ended, view.exit_code = end, True, end.get("code")
    return view
