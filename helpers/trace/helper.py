"""A traced rank's helper thread: the records' writer, progress notes, state dumps and stacks.

It writes the tracer's queued records every ``FLUSH_S`` (``helpers.trace.tracer``); it notes the
process groups' progress (torch's Flight Recorder: last collective enqueued and completed) every
``POLL_S``; on a request line written to the FIFO ``ctl-<rank>`` it writes
``state-<rank>.json`` (the main thread's Python stack and the Flight Recorder's latest entries),
or, for ``STACKS_REQUEST``, appends every thread's stack to ``stack-<rank>.txt`` holding the GIL.
The Flight Recorder also records collectives issued from C++ (DDP's broadcasts in ``forward()``
and its gradient all-reduce in ``backward()``), which no Python wrapper sees.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from helpers import report, rundir
from helpers.trace.callsites import describe_stack, error_text, traceback_site
from helpers.trace.tracer import FLUSH_S, PLAIN_GROUP_DESCS

POLL_S = 0.2  # how often the helper thread notes the process groups' progress
STACKS_REQUEST = "stacks"  # the request line for every thread's stack (others ask for a state)
AUTO_STATE_S = 1.0  # stuck this long in one collective: write the state once, unasked
FR_TAIL = 64  # entries written to state-<rank>.json


def ask(run_dir: str | Path, rank: int, request: str) -> bool:
    """Send a request line to the rank's helper thread; False when the rank is not listening.

    ``STACKS_REQUEST`` asks for every thread's stack; any other line for a state dump tagged with it.
    """
    try:
        fd = os.open(rundir.control_path(run_dir, rank), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, f"{request}\n".encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def flight_recorder(include_entries: bool) -> dict[str, Any] | None:
    """torch's Flight Recorder for every process group in this process (None when unavailable)."""
    try:
        import torch

        dump = torch._C._distributed_c10d._dump_fr_trace_json
        return json.loads(dump(include_entries, False))
    except Exception:  # noqa: BLE001 - older torch, or no process group: Python records only
        return None


def group_progress() -> dict[str, list[int]]:
    """Per process group: [last collective enqueued, last completed] (torch's sequence numbers)."""
    dump = flight_recorder(False) or {}
    progress = {}
    for name, status in (dump.get("pg_status") or {}).items():
        try:
            progress[name] = [int(status["last_enqueued_collective"]),
                              int(status["last_completed_collective"])]
        except (KeyError, ValueError):
            continue
    return progress


_FR_FIELDS = ("record_id", "collective_seq_id", "p2p_seq_id", "is_p2p", "profiling_name",
              "input_sizes", "input_dtypes", "output_sizes", "state", "retired", "time_created_ns")


def flight_recorder_tail(limit: int = FR_TAIL) -> list[dict[str, Any]]:
    """The latest Flight Recorder entries, trimmed to what the doctor reads, each with the id of
    the thread that issued it ("thread": torch records Python's ``threading.get_ident()``; not its
    name, as a thread that ended leaves its id to the next one) and whether that is the main thread."""
    dump = flight_recorder(True) or {}
    main = str(threading.main_thread().ident)
    tail = []
    for entry in (dump.get("entries") or [])[-limit:]:
        item = {key: entry.get(key) for key in _FR_FIELDS}
        if entry.get("thread_id") is not None:
            item["thread"] = str(entry["thread_id"])
            item["main"] = item["thread"] == main
        group = entry.get("process_group") or ["?"]
        item["pg"] = str(group[0])
        if len(group) > 1 and group[1] not in PLAIN_GROUP_DESCS:  # 'mesh_dp': the DeviceMesh dimension's
            item["pg_desc"] = str(group[1])
        tail.append(item)
    return tail


class Helper(threading.Thread):
    """The helper thread of one traced rank (a daemon; ``stop()`` ends it)."""

    def __init__(self, tracer: Any):
        super().__init__(name="helpers-trace", daemon=True)
        self.tracer = tracer
        self.stopping = threading.Event()
        self.wake_read, self.wake_write = os.pipe()  # stop() wakes the select at once
        self.fifo: int | None = None
        self.last: dict[str, list[int]] = {}  # the progress last noted
        self.pending = b""  # a request line not complete yet
        self.motion: tuple = ()  # (progress, records written) when last seen moving
        self.still_since, self.written = time.time(), False  # the state written since it stopped
        path = rundir.control_path(tracer.run_dir, tracer.rank) if tracer.run_dir is not None else None
        if path is not None and path.exists():
            # read-write, so that the FIFO never reports end-of-file while nobody writes
            self.fifo = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def run(self) -> None:
        next_poll, reported = 0.0, False
        while not self.stopping.is_set():
            watched = [self.wake_read] + ([self.fifo] if self.fifo is not None else [])
            ready = [fd for fd in select.select(watched, [], [], FLUSH_S)[0] if fd == self.fifo]
            if self.stopping.is_set():
                break
            try:
                self.tracer.poll_waited()
                self.tracer.flush(wait=False)  # never wait on the main thread's lock (signal handlers)
                if ready or time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + POLL_S
                    self._poll(ready)
            except Exception:  # noqa: BLE001 - this thread writes the records: it must not end
                if not reported:  # once: it may fail at every tick
                    traceback.print_exc()
                    reported = True

    def _poll(self, ready: list[int]) -> None:
        """Note progress, answer requests, and write the state once when stuck (every POLL_S)."""
        sampled, progress = time.time(), group_progress()  # the note's time is when it was taken
        if progress and progress != self.last and self.tracer.write(
                {"ev": "pg", "t": sampled, "pg": progress}, wait=False):
            self.last = progress
        if ready:
            self.pending += _read_available(self.fifo)
            *requests, self.pending = self.pending.split(b"\n")
            self._answer([request.decode(errors="replace") for request in requests])
        now = (progress, self.tracer.written)
        if now != self.motion:
            self.motion, self.still_since, self.written = now, time.time(), False
        elif not self.written and time.time() - self.still_since >= AUTO_STATE_S and self._waiting(progress):
            write_state(self.tracer, "auto")  # for a post-mortem if nobody asks in time
            self.written = True

    def _answer(self, requests: list[str]) -> None:
        if STACKS_REQUEST in requests:
            dump_stacks(self.tracer)
        states = [request for request in requests if request != STACKS_REQUEST]
        if states:
            write_state(self.tracer, states[-1])  # only the latest matters

    def _waiting(self, progress: dict[str, list[int]]) -> bool:
        return self.tracer.in_blocking_call() or any(enq > done for enq, done in progress.values())

    def stop(self) -> None:
        self.stopping.set()
        os.write(self.wake_write, b"x")
        self.join(timeout=2 * POLL_S + 1)
        for fd in (self.fifo, self.wake_read, self.wake_write):
            if fd is not None:
                os.close(fd)
        self.fifo = None


def _read_available(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def dump_stacks(tracer: Any) -> None:
    """Append every thread's Python stack to stack-<rank>.txt, from this thread, holding the GIL.

    faulthandler run from a signal handler reads the other threads' frames without the GIL and can
    crash the process (SIGSEGV) when one of them runs Python meanwhile (cpython#116008), as this
    helper thread often does; here every other thread is paused outside Python code.
    """
    if tracer.run_dir is None:
        return
    with open(rundir.stack_path(tracer.run_dir, tracer.rank), "a") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)


def rank_state(rank: int, request: str) -> dict[str, Any]:
    """This rank's state: the main thread's stack, the Flight Recorder tail, group progress, and the
    errors that ended threads of its own (``note_thread_errors``)."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident) if main.ident is not None else None
    state = {"request": request, "rank": rank, "t": time.time(),
             "stack": describe_stack(frame) if frame is not None else [],
             "progress": group_progress(), "fr": flight_recorder_tail()}
    if _thread_errors:
        state["thread_errors"] = list(_thread_errors)
    return state


THREAD_ERRORS_KEPT = 4
_thread_errors: list[dict[str, Any]] = []  # the last errors that ended a thread: its name, error and line


def note_thread_errors() -> None:
    """Keep the error that ends a thread of this process (``threading.excepthook``: a prefetching
    thread that raised leaves the main thread waiting on its queue forever) for ``rank_state``; the
    hook before it still runs (Python's prints the traceback). Once per process, however often the
    tracer is installed."""
    previous = threading.excepthook
    if getattr(previous, "noted_by_helpers", False):
        return

    def noted(args: Any) -> None:
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            site = traceback_site(args.exc_traceback) or {}
            _thread_errors.append({"thread": args.thread.name if args.thread is not None else "?",
                                   "error": error_text(args.exc_value), "t": time.time(),
                                   **{key: site.get(key) for key in ("file", "line", "where", "func")}})
            del _thread_errors[:-THREAD_ERRORS_KEPT]
        previous(args)

    noted.noted_by_helpers = True  # type: ignore[attr-defined]
    threading.excepthook = noted


def write_state(tracer: Any, request: str, extra: dict[str, Any] | None = None) -> None:
    """Write state-<rank>.json (``rank_state``); nothing for a tracer without a folder."""
    if tracer.run_dir is None:
        return
    state = rank_state(tracer.rank, request)
    state.update(extra or {})
    save_state(rundir.state_path(tracer.run_dir, tracer.rank), state)


_state_writes = threading.Lock()
_ending = threading.Event()  # the process is about to end: no state write starts


def _new_state_lock() -> None:
    global _state_writes
    _state_writes = threading.Lock()  # a forked child is not the parent: no write of its is under way


os.register_at_fork(after_in_child=_new_state_lock)


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Write a state file atomically, one write at a time, none once the process ends (``settle``)."""
    with _state_writes:
        if not _ending.is_set():
            report.atomic_write_text(path, json.dumps(state, default=str))


def settle(timeout_s: float = 1.0) -> None:
    """Just before the process ends (``os._exit``): start no state write, and let one under way
    finish (bounded), so that no temporary file is cut off before its rename."""
    _ending.set()
    if _state_writes.acquire(timeout=timeout_s):
        _state_writes.release()
