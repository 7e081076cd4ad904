"""The tracer: wraps torch.distributed's Python-level operations and records each call.

Each outermost call is recorded in ``trace-<rank>.jsonl`` (``helpers.rundir``): the op, the process
group and torch's sequence number in it, the input shapes and dtypes, the user's call site and
start time, and its end (completed or raised). A call that has returned by the time its record is
written is one record, its end in it (``"te"``, ``"ok"``); a call still running then has its start
written first and its end (``"ev":"end"``) as it returns. An async call (``async_op=True``, and
isend, irecv, batch_isend_irecv, which always are) ends when its work completes: gloo's p2p works
have no future, so theirs is seen once the user's ``wait()`` has returned (``poll_waited``). The
ops are ``helpers.collectives.OPS``.

The calling thread only notes what it must read at call time (the sequence number, the call site,
the clock) on a queue; the helper thread (``helpers.trace.helper``) writes the queue out every
``FLUSH_S``, ``WRITE_EVERY`` records per ``os.write`` (a write lets go of the GIL, so the main
thread never waits for a whole batch's text). Formatting the records after each collective cost
three to five times what it costs in a batch: a collective leaves the processor's caches cold, and
a record touches many Python objects (bench/doctor_bench.py). What is written survives the rank
being killed, and the file never shows a call as still running once it has returned. The first
call from a line with a tensor of a new size, and a call that makes a line's run of calls in a row
longer than ever (one per key of a dict with an extra key), are written before they run (gloo
aborts a process within milliseconds when the ranks' sizes differ), and the record's text is handed
to ``on_first`` when set (the job's doctor posts it to the job's store: the file dies with the
rank). A rank killed outright (SIGKILL) loses its last ``FLUSH_S`` of calls at most, though a small
call it was in stays known: the calling thread notes it in place (``rundir.CURRENT``, a page that
outlives the process); an exception, an exit and every other record write the queue out first.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import json
import mmap
import operator
import os
import re
import string
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import rundir
from helpers.collectives import ASYNC_OPS, INIT_OP, MULTI_OPS, OBJECT_LISTS, OPS, P2P_OPS, ROOTS, SPLIT_OPS
from helpers.trace.callsites import site_json, user_files, user_frame  # noqa: F401 - user_files: _TRACED_SOURCE's

FLUSH_S = 0.2  # the helper thread writes the queued records this often. Each wake-up costs it about
#               0.2 ms of CPU on a 2-core VM, whatever it writes: at 0.05 that was 6.6 us per traced
#               call of 4 KiB and 9.8 at 1 MiB, at 0.2 1.1 and 5.7 (bench/doctor_bench.py)
QUEUE_MAX = 4096  # queued records past which the calling thread writes them itself (no helper,
#                   or one that cannot keep up: 512 was reached before its tick by loops of 50 us calls)
UNWAITED_KEPT = 256  # async calls without a future polled at once (more stay open in the records)
WRITE_EVERY = 32  # records formatted per write while the queue is written out
_OP, _END = 0, 1  # queued: an op's list [_OP, id, plan, group, seq, blocking, tensors, peer, code,
#                   offset, t, ended, seq_end, on_file, thread] (offset: the call's instruction in the
#                   code, f_lasti, its line looked up when the record is written; ended: its end time,
#                   once it has returned; on_file: its start has left the queue; thread: the calling
#                   thread's ``threading.get_ident()``), an end tuple (_END, id, t, seq_end), or a record dict
_ENDED, _SEQ_END, _ON_FILE, _THREAD = 11, 12, 13, 14  # where an op's list holds its end, whether it is
#                                                   on file, and its thread
_SECONDS = "%.6f"  # a record's times: printf's formatting takes half the time of repr() or format()
_NO_SEQ_END = object()  # an end without "seq_end" (only calls that issue several collectives have one)


def _call_notes(path: Path | None) -> memoryview:
    """Where the calling thread notes a small call in progress (``rundir.CURRENT``): two int64s in a
    shared mapping of ``path`` (its page outlives the process), or in memory of its own when there
    is no file (nothing reads it). A queued record dies with a rank that gloo aborts within
    milliseconds of a size mismatch, and the stack faulthandler dumps then can be cut short by a
    second fault (cpython#116008): the note names the call. The main thread's blocking calls alone
    are noted (an async call returns before it is done; one page serves one thread). In
    bench/doctor_bench.py's turns against the wrapper before (``--against``), the note and its
    checks cost the calling thread 4.0-4.4 us per call at 4 KiB (traced/untraced 1.058-1.059
    against 1.044-1.054); the stores alone 2.5, where ``struct.pack_into`` through a partial cost 15
    (its objects are cold lines after a collective). Large calls (over ``RUN_BYTES``) are not noted:
    at 1 MiB, +0.7 to +1.4 us, within the noise of a run."""
    if path is None:
        place = mmap.mmap(-1, rundir.CURRENT.size)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, rundir.CURRENT.size)
            place = mmap.mmap(fd, rundir.CURRENT.size)
        finally:
            os.close(fd)
    return memoryview(place).cast("q")


class Tracer:
    """Writes one rank's records; wraps torch.distributed; runs the helper thread."""

    def __init__(self, run_dir: Path | None, rank: int):
        """``run_dir`` None: the records go to an anonymous in-memory file (read back through
        ``fd``), nothing is written to disk and nothing is left if the process is killed."""
        self.run_dir, self.rank = (Path(run_dir) if run_dir is not None else None), rank
        if run_dir is None:
            self.fd = os.memfd_create(f"helpers-records-rank{rank}", os.MFD_CLOEXEC)
        else:
            self.fd = os.open(rundir.trace_path(run_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                              0o600)
        self.ids = itertools.count(1)
        self.helper: Any = None  # helpers.trace.helper.Helper, once started
        self.originals: dict[tuple[Any, str], Callable] = {}
        self.written = 0  # queued items written so far (the helper thread sees motion)
        self.running: list[list] = []  # blocking calls written before they returned, maybe returned since
        self.queue: collections.deque = collections.deque()  # records not written yet, in order
        self.lock = threading.RLock()  # one writer at a time (re-entrant: a signal handler's call)
        self.started_on_file = 0  # the highest op id whose start record has left the queue
        self.unwaited: collections.deque = collections.deque()  # (op id, weak ref to its work)
        self.on_first: Callable[[str], None] | None = None  # told each first call's record text
        self.closed = False
        self.joined = False  # init_process_group returned (through torch.distributed's own name)
        self.notes = _call_notes(rundir.current_path(run_dir, rank) if run_dir is not None else None)
        self.main_thread = threading.main_thread().ident  # the thread whose calls are noted in place

    def write(self, record: dict[str, Any], wait: bool = True) -> bool:
        """Write the queue, then ``record`` (it is on file when this returns True); ``wait=False``:
        nothing (False) when another thread is writing (see ``flush``)."""
        return self._drain_locked([json.dumps(record, separators=(",", ":"), default=str) + "\n"], wait)

    def flush(self, wait: bool | float = True) -> None:
        """Write the queued records out (the helper thread does every ``FLUSH_S``).

        ``wait=False`` (the helper and watchdog threads): when another thread is writing, leave it
        to that thread; never wait on a lock the main thread may hold in a signal handler. A number:
        wait that many seconds at most for the writer (records read back at once need its write).
        """
        self._drain_locked([], wait)

    def _drain_locked(self, after: list[str], wait: bool | float) -> bool:
        if isinstance(wait, bool):
            taken = self.lock.acquire(blocking=wait)
        else:  # seconds
            taken = self.lock.acquire(timeout=wait)
        if not taken:
            return False
        try:
            self._drain(after)
        finally:
            self.lock.release()
        return True

    def close(self) -> None:
        """Write the queue and close the file; what is queued later is dropped."""
        with self.lock:
            self._drain([])
            self.closed = True
            os.close(self.fd)

    def _drain(self, after: list[str]) -> None:
        """Holding ``lock``: format the queue in order and append it, then ``after``.

        It writes every ``WRITE_EVERY`` records: the write lets go of the GIL, so a rank's main
        thread coming back from a collective waits for a few records' text at most, not for the
        whole batch. An item that cannot be described is written as a bare record naming the
        error, and a failed write drops those records: the tracer never breaks the user's call or
        its own thread.
        """
        queue = self.queue
        if self.closed:
            queue.clear()
            return
        texts, running = [], [item for item in self.running if item[_ENDED] is None]
        previous: list | None = None  # the last op formatted, and its op texts
        head = tail = ""
        written = 0
        while queue:
            item = queue.popleft()
            written += 1
            if type(item) is not list:
                texts.append(_record_text(item))
            else:
                item[_ON_FILE] = True  # before its end is read: see ``_wrap``
                if item[1] > self.started_on_file:
                    self.started_on_file = item[1]
                if item[5] and item[_ENDED] is None:  # blocking, not returned yet
                    running.append(item)
                if previous is not None and _same_call(item, previous):  # a loop's next call
                    texts.append(_op_line(item, head, tail))
                else:
                    try:
                        head, tail = _item_texts(item)
                        texts.append(_op_line(item, head, tail))
                        previous = item
                    except Exception:  # noqa: BLE001 - written as a bare record naming the error
                        previous = None
                        texts.append(_record_text(item))
            if len(texts) >= WRITE_EVERY:
                _write_all(self.fd, "".join(texts).encode())
                texts = []
        self.written += written
        self.running = running
        texts += after
        if texts:
            _write_all(self.fd, "".join(texts).encode())

    def in_blocking_call(self) -> bool:
        """Is a blocking call written as running still running (as of the last write)?"""
        return any(item[_ENDED] is None for item in self.running)

    def _ended(self, op_id: int, wait: bool = True) -> None:
        """An end was queued: write it now if its start has left the queue (no call shows as
        running after it returned); else when the queue is long (no helper thread). A start still
        queued leaves with its end: ``_drain`` empties the queue in one pass."""
        if self.started_on_file >= op_id or len(self.queue) > QUEUE_MAX:
            self.flush(wait)

    def _watch_async(self, op_id: int, work: Any) -> None:
        """An async call's work (a list of them from ``batch_isend_irecv``): its end is queued
        when its future completes, or, without one, once it has been waited for (``poll_waited``)."""
        self.queue.append({"ev": "enq", "id": op_id, "t": time.time()})
        works = list(work) if isinstance(work, (list, tuple)) else [work]
        try:
            futures = [each.get_future() for each in works]
        except Exception:  # noqa: BLE001 - gloo's p2p work has no future: polled (``poll_waited``)
            if len(self.unwaited) < UNWAITED_KEPT:
                try:
                    self.unwaited.append((op_id, [weakref.ref(each) for each in works]))
                except TypeError:  # not a torch work: nothing to poll
                    pass
            self._ended(op_id)
            return
        if not futures:
            return

        def done(fut: Any) -> None:
            error = None
            try:
                for each in (fut.value() if len(futures) > 1 else [fut]):
                    each.value()
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"[:800]
            record = {"ev": "end", "id": op_id, "t": time.time(), "ok": error is None}
            if error:
                record["error"] = error
            self.queue.append(record)
            self._ended(op_id, wait=False)  # torch's thread: never held up by the writer's lock

        if len(futures) > 1:
            import torch.futures

            torch.futures.collect_all(futures).add_done_callback(done)
        else:
            futures[0].add_done_callback(done)

    def poll_waited(self) -> None:
        """Queue the end of each async call without a future (gloo's isend and irecv) that has
        completed since the last look (the helper thread, every ``FLUSH_S``).

        gloo marks such a work completed once the user's ``wait()`` has returned, not when the data
        has moved: until then the call is open, and a rank stuck in ``wait()`` shows as waiting
        in its send or recv. A work the script let go of ends as ``"dropped"``. Only weak
        references are held: the queue never keeps a work, or its tensor, alive.
        """
        unwaited = self.unwaited
        for _ in range(len(unwaited)):  # the main thread may append meanwhile: only what was there
            op_id, refs = unwaited.popleft()
            works = [ref() for ref in refs]
            try:
                dropped = any(work is None for work in works)
                completed = dropped or all(work.is_completed() for work in works)
            except Exception:  # noqa: BLE001 - a work torch can no longer tell about: dropped
                dropped = completed = True
            if dropped:
                self.queue.append({"ev": "end", "id": op_id, "t": time.time(), "ok": None, "dropped": True})
            elif completed:
                self.queue.append({"ev": "end", "id": op_id, "t": time.time(), "ok": True})
            else:
                unwaited.append((op_id, refs))

    def forget_queue(self) -> None:
        """In a forked child: the queued records are the parent's to write, and the lock may have
        been held by a thread that does not exist here."""
        self.queue.clear()
        self.unwaited.clear()
        self.running = []
        self.lock = threading.RLock()
        self.notes = _call_notes(None)  # the parent's file is the parent's
        self.main_thread = threading.get_ident()  # the thread that forked

    def patch(self) -> None:
        """Wrap the operations in ``torch.distributed`` and ``distributed_c10d`` (internal calls too;
        those one of them makes, all_gather_object's all_gather, are part of its record), and
        ``init_process_group`` (``_wrap_init``)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        originals = {name: getattr(c10d, name, None) or getattr(dist, name, None) for name in OPS}
        bodies = [inspect.unwrap(fn) for fn in originals.values() if fn is not None]
        _inner_codes.update(id(body.__code__) for body in bodies if hasattr(body, "__code__"))
        originals[INIT_OP] = getattr(c10d, INIT_OP, None)
        originals[DESTROY_OP] = getattr(c10d, DESTROY_OP, None)
        for name, original in originals.items():
            if original is None or getattr(original, "_helpers_traced", False):
                continue
            if name == INIT_OP:
                wrapped = _wrap_init(original)
            elif name == DESTROY_OP:
                wrapped = _wrap_destroy(original)
            else:
                wrapped = _wrap(name, original, _Plan(name, original))
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self.originals[(module, name)] = original
                    setattr(module, name, wrapped)

    def unpatch(self) -> None:
        """Put the original functions back."""
        for (module, name), original in self.originals.items():
            setattr(module, name, original)
        self.originals.clear()


def _wrap_init(original: Callable) -> Callable:
    """``init_process_group`` traced: recorded as the call before the group's first collective
    (sequence number 0), on file before it runs and its end as it returns. Ranks wait in it for each
    other (gloo connects every pair of ranks there, with the group's timeout: 30 minutes unless
    set), so a rank that never reaches it, stuck in its data or a download, leaves the others waiting
    there as in a collective, and the doctor names it ("rank-missing"). ``helpers.launch`` sets up
    its ranks' group with the original (``__wrapped__``): no user waits there."""

    @functools.wraps(original)
    def traced_init(*args: Any, **kwargs: Any) -> Any:
        tracer = current
        if tracer is None:
            return original(*args, **kwargs)
        op_id = next(tracer.ids)
        frame = user_frame(sys._getframe(1))
        site = site_json(frame.f_code, frame.f_lasti) if frame is not None else ""
        world = _world_asked(args, kwargs)
        world_text = f',"world":{world}' if world is not None else ""
        tracer._drain_locked([f'{{"ev":"op","id":{op_id},"op":"{INIT_OP}","pg":"0","seq":0{site}{world_text},'
                              f'"t":{_SECONDS % time.time()}}}\n'], True)
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            tracer.write({"ev": "end", "id": op_id, "t": time.time(), "ok": False,
                          "error": f"{type(exc).__name__}: {exc}"[:800]})
            raise
        tracer.joined = True
        tracer.write({"ev": "end", "id": op_id, "t": time.time(), "ok": True})
        return result

    traced_init._helpers_traced = True  # type: ignore[attr-defined]
    return traced_init


DESTROY_OP = "destroy_process_group"


def _wrap_destroy(original: Callable) -> Callable:
    """``destroy_process_group`` traced: the default group's destruction is recorded (``"ev":
    "destroy"``, on file before it runs) with the user's line. A rank that destroys it while the
    others still issue collectives fails them ('Connection closed by peer'), wherever it goes next."""

    @functools.wraps(original)
    def traced_destroy(*args: Any, **kwargs: Any) -> Any:
        tracer = current
        if tracer is not None and (args[0] if args else kwargs.get("group")) is None:
            frame = user_frame(sys._getframe(1))
            site = site_json(frame.f_code, frame.f_lasti) if frame is not None else ""
            tracer._drain_locked([f'{{"ev":"destroy"{site},"t":{_SECONDS % time.time()}}}\n'], True)
        return original(*args, **kwargs)

    traced_destroy._helpers_traced = True  # type: ignore[attr-defined]
    return traced_destroy


_URL_WORLD = re.compile(r"[?&]world_size=(\d{1,9})\b")


def _world_asked(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The world size ``init_process_group`` waits for: its ``world_size`` argument (the fourth), else
    its ``init_method``'s (``tcp://host:port?world_size=8``), else the ``WORLD_SIZE`` it reads from
    the environment; None when none is a number."""
    asked = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
    method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    if asked == -1 and isinstance(method, str):
        found = _URL_WORLD.search(method)
        asked = int(found[1]) if found else -1
    try:
        size = operator.index(asked)  # an int, a numpy integer (not a float or a string)
    except TypeError:
        size = -1
    if size > 0 and not isinstance(asked, bool):
        return size
    text = os.environ.get("WORLD_SIZE", "").strip()
    return int(text) if text.isdecimal() and text.isascii() and int(text) > 0 else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # a full disk or a closed file: these records are lost, the user's call is not
        pass


def _record_text(item: Any) -> str:
    """One queued item as its record's JSON line (a bare record naming the error if it fails)."""
    try:
        return _format(item)
    except Exception as exc:  # noqa: BLE001 - an argument torch took that the record cannot describe
        if type(item) is not list:
            return ""
        return json.dumps({"ev": "op", "id": item[1], "op": item[2].name, "seq": item[4], "t": item[10],
                           "unrecorded": f"{type(exc).__name__}: {exc}"[:200]}) + "\n"


def _format(item: Any) -> str:
    """An op (with its end, ``"te"``, when it has returned), an end, or a record dict as a line."""
    kind = type(item)
    if kind is tuple:
        _kind, op_id, t, seq_end = item
        extra = "" if seq_end is _NO_SEQ_END else f',"seq_end":{json.dumps(seq_end)}'
        return f'{{"ev":"end","id":{op_id},"t":{_SECONDS % t},"ok":true{extra}}}\n'
    if kind is not list:
        return json.dumps(item, separators=(",", ":"), default=str) + "\n"
    head, tail = _item_texts(item)
    return _op_line(item, head, tail)


def _item_texts(item: list) -> tuple[str, str]:
    """A queued op's texts but its id, sequence number and times (``_op_texts``)."""
    return _op_texts(item[2], item[3], item[5], item[6], item[7], item[8], item[9])


def _op_line(item: list, head: str, tail: str) -> str:
    """An op's line from its op texts (``_op_texts``): its id, sequence number, times and end."""
    op_id, seq, t, ended, seq_end = item[1], item[4], item[10], item[_ENDED], item[_SEQ_END]
    if item[_THREAD] != _main_thread:  # another thread's call (the main thread's: no key)
        tail += f',"thread":"{item[_THREAD]}"'
    if ended is not None:
        tail += f',"te":{_SECONDS % ended},"ok":true'
        if seq_end is not _NO_SEQ_END:
            tail += f',"seq_end":{json.dumps(seq_end)}'
    seq_text = "null" if seq is None else seq
    return f'{{"ev":"op","id":{op_id},{head},"seq":{seq_text}{tail},"t":{_SECONDS % t}}}\n'


def _same_call(item: list, previous: list) -> bool:
    """Does an op's text but its id, sequence number and times match the op before it (the same
    op, group, mode, compared argument, peer and call site)? The next call of a loop most often:
    its op texts are reused without a lookup. A tensor's shape is read as the record is written,
    as for any record (``_op_texts``)."""
    return (item[2] is previous[2] and item[3] is previous[3] and item[6] is previous[6]
            and item[8] is previous[8] and item[9] == previous[9] and item[7] is previous[7]
            and item[5] is previous[5])


_texts: dict[tuple, tuple[Any, Any, str, str]] = {}  # a call's key -> (code, group, head, tail)
_TEXTS_KEPT = 4096  # distinct calls cached (a loop with ever-new shapes must not grow memory)


def _op_texts(plan: _Plan, group: Any, blocking: bool, tensors: Any, peer: Any, code: Any,
              offset: int) -> tuple[str, str]:
    """An op record's text but its id, sequence number and time: what is before ``"seq"`` (op and
    group) and after it (shapes, dtypes, peer, async flag, call site).

    Cached per call site, group, shapes, peer and mode: a training loop repeats a few, and
    formatting each record anew cost the helper thread about 10 us per call inside a rank. Keyed
    by the group's and the code's ids, kept alive in the entry and checked on a hit (hashing a code
    object hashes its constants at every call).
    """
    try:
        key: Any = (plan, id(group), id(code), offset, _shapes_key(tensors), peer, blocking)
        cached = _texts.get(key)
    except TypeError:  # an unhashable shape or peer (not a tensor's, not a rank): described, not cached
        key, cached = None, None
    if cached is not None and cached[0] is code and cached[1] is group:
        return cached[2], cached[3]
    head = f'"op":"{plan.name}",{_group_json(group)}'
    tail = plan.fields(blocking, tensors, peer) + (site_json(code, offset) if code is not None else "")
    if key is not None:
        if len(_texts) >= _TEXTS_KEPT:
            _texts.clear()
        _texts[key] = (code, group, head, tail)
    return head, tail


def _shapes_key(value: Any) -> Any:
    """What a record says of the compared argument, as a dict key: each tensor's shape and dtype."""
    if isinstance(value, (list, tuple)):  # its length too: a list of objects is described by it
        return (len(value), *((v.shape, v.dtype) for v in value if hasattr(v, "shape")))
    shape = getattr(value, "shape", None)
    return None if shape is None else (shape, getattr(value, "dtype", None))


current: Tracer | None = None  # the tracer of this process, once installed


_main_thread = threading.main_thread().ident  # the main thread's id: its calls' records name no thread


def _forget_in_child() -> None:
    global _main_thread
    _main_thread = threading.get_ident()  # the thread that forked is the child's main thread
    if current is not None:
        current.forget_queue()


os.register_at_fork(after_in_child=_forget_in_child)


def _wrap(name: str, original: Callable, plan: _Plan) -> Callable:
    """``original`` traced: each outermost call of it is recorded.

    The wrapper queues what only the moment of the call knows (the group's sequence number, the
    user's call site, the clock) and the two arguments the record describes (the compared tensor
    and the peer; never the outputs, which the queue must not keep alive); the helper thread
    writes the records. A blocking call's end goes into its queued item (one record for both, when
    the call has ended by the time the helper writes it). It is one function that reads the
    arguments inline, on purpose: a collective leaves the processor's caches cold, and there each
    Python call costs microseconds (bench/doctor_bench.py, section 2).

    After a collective, what costs is the number of distinct objects the wrapper touches, each a
    cold cache line, more than the instructions it runs: each part of it (the frame, the sequence
    number, the signature check, the queued item, the end) cost 3-5 us of the calling thread's CPU
    at 1 MiB on 2 gloo ranks, and any of them 0.2-0.4 us warm. So it touches as few as it can:
    it is made per op from ``_TRACED_SOURCE`` and takes the op's own parameters (the interpreter
    binds the arguments: no tuple and dict per call to look into); the op's flags and the item's
    indices are literals in its text, not globals or closure cells; the default group is a plain
    attribute of torch's ``_world``; the sequence number comes from the unbound pybind method (no
    bound method made); the user's line is checked before torch's inner calls; and a call with the
    signature of the op's previous call (a loop's next) skips the lookup of its signature; its end
    reads whether its start is on file from its own item (``_ON_FILE``: 0.5-1.3 us). In turns
    with the ``*args, **kwargs`` wrapper it replaced, in the same 2 gloo ranks (3 launches), the
    calling thread's CPU per traced call fell from 15.0-17.0 to 9.8-11.5 us at 1 MiB and from
    11.1-15.0 to 7.2-10.0 us at 4 KiB, and traced/untraced at 1 MiB from 1.037-1.052 to
    1.017-1.030 (the bench's 'wrapper us/call'; absolute figures move with what else runs in the
    turns: 23.8 against 16.6 us in a run with other variants).

    Two ways to make it cheaper were measured against it, in turns, and not kept: this same
    common call written in C (vectorcall; 0.9 against 1.4 us warm) and launching a blocking call
    with ``async_op=True`` to record it while the collective runs. The C version was within 0.003
    of this one at 1 MiB: the time goes on the objects a record touches (frame, code, group,
    queue) after a collective has left the caches cold, not on the interpreter. The async launch
    gained about 0.01 once; built again on gloo groups alone (where torch's blocking path is the
    same launch and ``wait()``), a loop's repeated call launched first and recorded before its
    wait, it gained nothing in the bench's turns (``--against``): traced/untraced 1.023 and 1.033
    against 1.025 and 1.020 at 1 MiB, CPU 11.1-11.5 against 10.3-10.6 us per call (gloo's thread
    shares the rank's core, so the record's CPU does not hide behind the transfer). It also
    changes what the backend does elsewhere: torch passes ``asyncOp`` on, NCCL keeps
    an async call's tensors until ``wait()`` (``TensorShelf`` in ProcessGroupNCCL.hpp), and in a
    ``_coalescing_manager`` an async call returns ``_IllegalWork``, whose ``wait()`` raises.

    The largest single piece is the sequence number. Against a stand-in that returns a constant, in
    turns at 1 MiB on 2 gloo ranks, it cost 0.004-0.017 of the call. Not for letting go of the GIL
    (torch binds it with ``py::gil_scoped_release``, torch/csrc/distributed/c10d/init.cpp): the
    group's ``rank()`` or ``size()`` in its place cost as much, and a bound method kept per group
    no less; a pybind call on the group costs that much after a collective. It stays: the doctor
    matches the records with each other and with the Flight Recorder's entries by it, and counting
    calls here would miss the collectives torch issues from C++ (DDP's), which advance the same
    number.

    What the rest costs, in the bench's turns at 1 MiB on 2 gloo ranks: the caller's line and the
    sequence number alone ('site+seq', what any record of the call needs first) cost 5.5-6.1 us of
    CPU and 0.99-1.01 of the call; the whole wrapper 11-16 us and 1.02-1.04. The record's own part
    is spread over its pieces, none over 2 us: taken out one at a time, the end 1.5-2 us, the
    signature check 1, the id, the byte count or the call site's code and offset under 1 each, the
    queued item with its end 2.5; a loop's repeated call kept in place in a list of the op's own
    instead of a new item, 1.2.

    A loop's repeated calls counted instead of recorded was built and measured, and not kept: a call
    with the previous traced call's op, group, line, byte count and peer at the next sequence number
    only added one to that call's item (no id, clock, item or queue), and the helper thread wrote
    the count each ``FLUSH_S`` as one record that the doctor expanded into the calls. In the
    bench's turns made streaks of 8 calls per mode (a loop's), against this wrapper in the same 2
    gloo ranks (3 launches): CPU per call 7.9-9.2 against 8.4-9.9 us at 1 MiB, traced/untraced
    1.031-1.059 against 1.025-1.048, the helper thread's 1.0-2.2 against 3 us per call; and a call
    that is not a repeat paid 1.5-2 us more (the previous call's item touched again). What is left
    after a collective is the caller's line and the sequence number, which any record needs.
    """
    namespace: dict[str, Any] = {}
    source = "\n" * (_TRACED_LINE - 1) + _traced_text(plan.argument_texts())
    exec(compile(source, __file__, "exec"), globals(), namespace)  # noqa: S102 - the text above
    traced = namespace["make"](original, plan, sys._getframe, time.time, _default_world(), _sequence_reader(),
                               _inner_codes, threading.get_ident)
    functools.update_wrapper(traced, original)
    traced.__defaults__ = plan.defaults
    traced._helpers_traced = True  # type: ignore[attr-defined]
    return traced


# The traced function, made per op by ``_wrap``: ``$params`` is the op's own parameters (its
# defaults set after) and ``$call`` passes them on, or ``*args, **kwargs`` where its signature
# cannot be copied; the arguments the record describes are read as ``$group``, ``$async_op``,
# ``$compared`` and ``$peer``; the op's flags and this module's constants are written in as
# literals (``_traced_text``): after a collective, each read of a global or a closure's cell is a
# cold cache line (bench/doctor_bench.py's 'wrapper us/call'). Its frames show these lines of
# this file.
_TRACED_LINE = sys._getframe().f_lineno + 1  # the first line of the text below, in this file
_TRACED_SOURCE = """def make(original, plan, caller, now, world, sequence, inner, thread):
    seen, computed = plan.seen, plan.computed

    def traced($params):
        tracer = current
        if tracer is None:
            return original($call)
        try:
            frame = caller(1)
        except ValueError:  # called with no Python frame above (from C, first in a thread)
            frame = None
        if frame is not None:
            code = frame.f_code
            if user_files.get(code.co_filename) is not True:  # the user's own line calls it: the rest skipped
                if id(code) in inner:  # called by a traced op of torch's (all_gather_object's all_gather)
                    return original($call)
                frame = user_frame(frame)
        op_id = next(tracer.ids)
        group = $group
        pg = group if group is not None else world._default_pg
        try:  # never with None: the unbound method would take it for a null group and crash
            seq = sequence(pg) + 1 if pg is not None else None
        except Exception:  # not a group: torch raises its own error
            seq = None
        blocking = not ($async_op or $always_async)
        tensors = $compared
        peer = $peer
        code, offset = (frame.f_code, frame.f_lasti) if frame is not None else (None, 0)
        queue = tracer.queue
        item = [$OP, op_id, plan, group, seq, blocking, tensors, peer, code, offset, now(), None,
                _NO_SEQ_END, False, thread()]
        queue.append(item)
        nbytes = getattr(tensors, "nbytes", None)
        last = plan.last
        signature = noted = None  # noted: the id of the first call like it, when it is noted in place
        try:
            if code is last[1] and offset == last[2] and group is last[0] and nbytes == last[3]:
                first = False  # the op's last call again (a loop's next): no signature to look up
                if last[4]:  # small: written first when its line runs it more times in a row than ever
                    if seq != plan.run_seq + 1:  # (a dict reduced one tensor at a time, with a key
                        plan.start_run(seq)  # more on this rank); another collective came between
                    plan.run_seq = seq if seq is not None else -2
                    first = seq == plan.run_limit and plan.longer()
                    noted = last[5]
            else:
                signature = (id(group), id(code), offset, nbytes)
                known = seen.get(signature)  # the id of the first call from this site with this many bytes
                first = known is None
                if not first:
                    plan.arrive(signature, (group, code, offset, nbytes), seq, known)
                    if type(nbytes) is int and nbytes <= $RUN_BYTES:
                        noted = known
        except Exception:  # an unhashable or odd "nbytes" (not a tensor's): a first every time
            first = True
        if first:
            noted = None
            tracer.flush()  # on file before the call: gloo aborts the process at once on a size mismatch
            if tracer.on_first is not None:  # and posted where the job's doctor reads it (job.py)
                tracer.on_first(_record_text(item))
            plan.remember(signature, op_id)  # once on file: another thread's same call may skip its write
            if signature is not None:
                plan.arrive(signature, (group, code, offset, nbytes), seq, op_id)
        elif noted is not None:  # a small call: its record may still be queued if gloo aborts the rank
            if blocking and item[$THREAD] == tracer.main_thread:  # (an async call returns at once)
                notes = tracer.notes  # (rundir.CURRENT)
                notes[1] = noted
                notes[0] = seq if seq is not None else -1
            else:
                noted = None
        try:
            result = original($call)
        except BaseException as exc:
            if noted is not None:
                notes[0] = 0  # its record is written next
            tracer.write({"ev": "end", "id": op_id, "t": now(), "ok": False,
                          "error": f"{type(exc).__name__}: {exc}"[:800]})
            item[$ENDED] = now()  # after its start left the queue: it is no longer running
            raise
        if not blocking and result is not None:
            tracer._watch_async(op_id, result)
            return result
        if $multi and seq is not None:
            item[$SEQ_END] = _sequence(group if group is not None else world._default_pg)
        item[$ENDED] = now()  # its end, if the helper has not written the start yet
        if noted is not None:
            notes[0] = 0  # returned
        if item[$ON_FILE]:  # it has (see ``Tracer._drain``)
            queue.append(($END, op_id, item[$ENDED], item[$SEQ_END]))
            tracer.flush()
        elif len(queue) > $QUEUE_MAX:  # no helper thread
            tracer.flush()
        return result

    return traced
"""


_inner_codes: set[int] = set()  # ids of the code of torch's traced ops: the calls they make are theirs


def _traced_text(arguments: dict[str, str]) -> str:
    """``_TRACED_SOURCE`` for an op: its ``arguments`` (``_Plan.argument_texts``), and the
    constants the queue's items are read by, as literals."""
    return string.Template(_TRACED_SOURCE).substitute(
        arguments, OP=_OP, END=_END, ENDED=_ENDED, SEQ_END=_SEQ_END, ON_FILE=_ON_FILE, THREAD=_THREAD,
        QUEUE_MAX=QUEUE_MAX, RUN_BYTES=RUN_BYTES)


def _sequence_reader() -> Callable[[Any], int]:
    """torch's ``ProcessGroup._get_sequence_number_for_group`` as a function of the group: called
    so, no bound method is made and looked up per call. Never to be called with None: pybind11
    passes it on as a null group, and the process dies (SIGSEGV)."""
    import torch.distributed as dist

    method = getattr(getattr(dist, "ProcessGroup", None), "_get_sequence_number_for_group", None)
    return method if method is not None else operator.methodcaller("_get_sequence_number_for_group")


class _PublicWorld:
    """The default group under torch's public name, where torch has no ``_world._default_pg``."""

    @property
    def _default_pg(self) -> Any:
        import torch.distributed.distributed_c10d as c10d

        return c10d.GroupMember.WORLD


def _default_world() -> Any:
    """An object whose ``_default_pg`` is the default process group (None before
    ``init_process_group``): torch's ``_world``, read as a plain attribute at every traced call
    (``_get_default_group()`` costs three Python calls), or its public spelling in another torch."""
    import torch.distributed.distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    return world if world is not None and hasattr(world, "_default_pg") else _PublicWorld()


_ABSENT = (1 << 30, "\0")  # where a parameter an op lacks would be: read as None, no test per call


class _Plan:
    """Where one op keeps its arguments, so a call is described without ``inspect`` per call."""

    def __init__(self, name: str, fn: Callable):
        compared, peer = OPS[name]
        self.name = name
        signature = inspect.signature(fn)
        params = list(signature.parameters)
        root = ROOTS.get(name)
        if peer is None and root in params:  # a rooted collective's root, read where a peer would be
            peer = (params.index(root), root)
        # where each argument is, as (position, keyword): read inline by ``_wrap``'s wrapper
        self.group = (params.index("group"), "group") if "group" in params else _ABSENT
        self.async_op = (params.index("async_op"), "async_op") if "async_op" in params else _ABSENT
        self.compared, self.peer_at = compared or _ABSENT, peer or _ABSENT
        self.has_peer = peer is not None
        self.peer_field = "peer" if name in P2P_OPS else "root"  # a p2p op's peer, a collective's root
        self.p2p = name in P2P_OPS
        self.always_async = name in ASYNC_OPS  # returns a work to wait on, with no async_op to say so
        self.multi = name in MULTI_OPS
        self.objects = name in OBJECT_LISTS  # its compared argument is a list of objects: its length
        # read into the peer's place: all_to_all_single's split sizes, a batch's sends and receives
        self.computed = _split_sizes if name in SPLIT_OPS else _batch_parts if name == BATCH_OP else None
        self.computed_field = "batch" if name == BATCH_OP else "splits"
        self.seen: dict[tuple, int] = {}  # (group, code, offset, nbytes) of the calls made: the first's id
        # the last call's (group, code, offset, nbytes, whether its run is followed and it is noted
        # in place: small tensors, the id of the first call with its signature)
        self.last: tuple = (None, None, None, None, False, 0)
        # the last call's run of calls in a row (at consecutive sequence numbers): its site, the
        # site's longest run before, the run's last number, and the number that makes it longer
        self.site: tuple | None = None
        self.longest, self.run_seq, self.run_limit = 1, -2, -1
        self.runs: dict[tuple, int] = {}  # each site's longest run (at most RUNS_KEPT)
        copied = _passes_arguments_through(fn, signature)
        self.params, self.defaults = _copied_signature(signature, self) if copied else (None, None)

    def argument_texts(self) -> dict[str, str]:
        """What ``_TRACED_SOURCE`` leaves open, for this op: the traced function takes the op's own
        parameters and reads the arguments by name (the interpreter binds them: no tuple and dict
        per call, no test of where each one is); ``*args, **kwargs`` where the signature cannot be
        copied, each argument read by position or keyword."""
        if self.params is not None:
            call = ", ".join(self.params)
            texts = {name: where[1] if where is not _ABSENT else "None" for name, where in self._places()}
            texts.update(params=call, call=call, **self._flags())
            if self.computed is not None:
                texts["peer"] = f"computed(({call},), {{}})"
            return texts
        texts = {name: (f"(args[{where[0]}] if len(args) > {where[0]} else kwargs.get({where[1]!r}))"
                        if where is not _ABSENT else "None") for name, where in self._places()}
        texts.update(params="*args, **kwargs", call="*args, **kwargs", **self._flags())
        if self.computed is not None:
            texts["peer"] = "computed(args, kwargs)"
        return texts

    def _flags(self) -> dict[str, str]:
        return {"always_async": repr(self.always_async), "multi": repr(self.multi)}

    def _places(self) -> list[tuple[str, tuple[int, str]]]:
        return [("group", self.group), ("async_op", self.async_op), ("compared", self.compared),
                ("peer", self.peer_at)]

    def arrive(self, signature: tuple, last: tuple, seq: int | None, first_id: int) -> None:
        """A call from another site than the last one's (``last``: its group, code, offset and byte
        count; ``first_id``: the id of the first call with its signature): its run starts. Followed
        for small tensors only (a metric's): followed at every size, the run's reads and write cost
        1.1-1.9 us of CPU per call at 1 MiB in bench/doctor_bench.py's turns against the wrapper
        before (0.004-0.019 of the call); gated, -0.3 to +1.1 us (noise)."""
        nbytes = last[3]
        small = type(nbytes) is int and nbytes <= RUN_BYTES
        self.last, self.site = (*last, small, first_id), signature
        self.longest = self.runs.get(signature, 1) if small else 1  # (small: a hashable signature)
        self.start_run(seq)
        self.run_seq = seq if seq is not None else -2

    def start_run(self, seq: int | None) -> None:
        """The last call's site starts a run at number ``seq``: the number that would make it
        longer than the site's longest (none past RUNS_KEPT)."""
        self.run_limit = seq + self.longest if seq is not None and self.longest < RUNS_KEPT else -1

    def longer(self) -> bool:
        """The last call's site issued it more times in a row than ever before: one call more in a
        row than the other ranks make (a dict with an extra key on this rank, reduced one tensor at
        a time) meets another collective, and gloo aborts the process. True (write it first)."""
        self.longest += 1
        self.run_limit = self.run_limit + 1 if self.longest < RUNS_KEPT else -1
        if len(self.runs) >= _SEEN_KEPT:
            self.runs.clear()
        self.runs[self.site] = self.longest
        return True

    def remember(self, signature: tuple | None, op_id: int) -> None:
        """Note a call's signature (the group, the code and the call's offset in it, the compared
        tensor's bytes) and its id: the wrapper writes the first call of each before it runs.

        Bytes, not shapes: gloo aborts the process when the ranks' byte counts differ, and
        ``nbytes`` is one attribute where shape and dtype are two objects to make and hash.
        """
        if signature is None:  # one that could not be looked up
            return
        if len(self.seen) >= _SEEN_KEPT:
            self.seen.clear()
        try:
            self.seen[signature] = op_id
        except TypeError:  # unhashable: never remembered
            pass

    def fields(self, blocking: bool, tensors: Any, peer: Any) -> str:
        """The call's record fields after the sequence number, as JSON text: p2p flag, shapes,
        dtypes, peer (a rooted collective's root) and async flag."""
        fields = ',"p2p":true' if self.p2p else ""
        fields += _objects_json(tensors) if self.objects else _tensors_json(tensors)
        if self.has_peer:
            fields += f',"{self.peer_field}":{json.dumps(_integer(peer))}'
        elif self.computed is not None:
            fields += f',"{self.computed_field}":{json.dumps(peer)}'
        if not blocking:
            fields += ',"async":true'
        return fields


def _copied_signature(signature: inspect.Signature, plan: _Plan) -> tuple[list[str] | None, tuple | None]:
    """The parameter names and defaults the traced function takes for an op with ``signature``
    (``_TRACED_SOURCE``), or (None, None) where they cannot be copied: a parameter that is not
    positional-or-keyword, an argument the record describes that is not where
    ``helpers.collectives.OPS`` says, or a name the function itself uses, unless the function reads
    that parameter into that very name (``group = group``: it passes on what it was given)."""
    names = list(signature.parameters)
    roles = {"group": plan.group, "tensors": plan.compared, "peer": plan.peer_at}
    if plan.computed is not None:
        del roles["peer"]  # a split op's or a batch's peer is computed, not read
    read_as_itself = {local for local, where in roles.items() if where[1] == local}
    parameters = signature.parameters.values()
    if (any(each.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for each in parameters)
            or (set(names) & _traced_names()) - read_as_itself
            or any(where is not _ABSENT and where[1] not in names[where[0]:where[0] + 1]
                   for where in (plan.group, plan.async_op, plan.compared, plan.peer_at))):
        return None, None
    defaults = tuple(each.default for each in parameters if each.default is not inspect.Parameter.empty)
    return names, defaults


_PASS_THROUGH = [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def _passes_arguments_through(fn: Callable, innermost: inspect.Signature) -> bool:
    """Does each wrapper in front of ``fn``'s innermost function (the ``__wrapped__`` chain that
    ``inspect.signature`` follows) take that function's parameters, or ``*args, **kwargs``, as
    torch's own decorators do? Another tool's wrapper of other parameters, installed before the
    tracer, would not take the innermost function's parameters given by position. ``innermost``:
    ``inspect.signature(fn)``, the innermost function's."""
    try:
        for _depth in range(64):  # a chain that never ends: not followed
            wrapped = getattr(fn, "__wrapped__", None)
            if wrapped is None:
                return True
            own = inspect.signature(fn, follow_wrapped=False)
            if own != innermost and [each.kind for each in own.parameters.values()] != _PASS_THROUGH:
                return False
            fn = wrapped
    except (TypeError, ValueError):  # a signature that cannot be read
        return False
    return False


@functools.cache
def _traced_names() -> frozenset[str]:
    """Every name the traced function's text uses (a parameter of the same name would hide it)."""
    texts = dict.fromkeys(("group", "async_op", "compared", "peer", "always_async", "multi"), "None")
    texts.update(params="*args, **kwargs", call="*args, **kwargs")
    make = compile(_traced_text(texts), __file__, "exec").co_consts[0]
    traced = next(each for each in make.co_consts if getattr(each, "co_name", None) == "traced")
    return frozenset(make.co_varnames + make.co_names + traced.co_varnames + traced.co_names
                     + traced.co_freevars)


def _split_sizes(args: tuple, kwargs: dict) -> list | None:
    """all_to_all_single's ``[output rows, output_split_sizes, input_split_sizes]`` (a list given as
    None: equal splits), as plain ints: the queue keeps neither the output nor torch's objects."""
    try:
        output = args[0] if args else kwargs.get("output")
        outs = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
        ins = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        rows = int(output.shape[0]) if getattr(output, "ndim", 0) else None
        return [rows, _ints(outs), _ints(ins)]
    except (TypeError, ValueError, AttributeError, IndexError):  # torch will say what is wrong
        return None


BATCH_OP = "batch_isend_irecv"


def _batch_parts(args: tuple, kwargs: dict) -> list | None:
    """batch_isend_irecv's ``[["send" or "recv", peer], ...]``, one per P2POp, as plain values."""
    try:
        ops = args[0] if args else kwargs.get("p2p_op_list")
        return [["recv" if "recv" in getattr(op.op, "__name__", "") else "send", int(op.peer)] for op in ops]
    except (TypeError, ValueError, AttributeError):  # torch will say what is wrong
        return None


def _ints(sizes: Any) -> list[int] | None:
    return None if sizes is None else [int(n) for n in sizes]


def _integer(value: Any) -> Any:
    """A rank given as numpy's or torch's integer, as an int (anything else as it is)."""
    try:
        return operator.index(value)
    except TypeError:
        return value


def _sequence(group: Any) -> int | None:
    """torch's sequence number of ``group`` (collectives and p2p both count; None without a group)."""
    try:
        return group._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001 - no group yet (None): torch will raise its own error
        return None


_SEEN_KEPT = 4096  # call signatures kept per op (``_Plan.remember``)
RUNS_KEPT = 64  # a site's runs of calls in a row written before they run, up to this length
RUN_BYTES = 64 * 1024  # runs are followed for calls with tensors of this many bytes at most


def _objects_json(value: Any) -> str:
    """``,"shapes":[[n]],"dtypes":["object"]`` for a list of n objects ("" for anything else)."""
    if not isinstance(value, (list, tuple)):
        return ""
    return f',"shapes":[[{len(value)}]],"dtypes":["object"]'


def _tensors_json(value: Any) -> str:
    """``,"shapes":[...],"dtypes":[...]`` for a tensor or a list of them ("" for anything else)."""
    if isinstance(value, (list, tuple)):
        tensors = [v for v in value if hasattr(v, "shape")]
    elif getattr(value, "shape", None) is not None:
        tensors = [value]
    else:
        return ""
    return (f',"shapes":{[list(t.shape) for t in tensors]},'
            f'"dtypes":[{",".join(_dtype_json(t.dtype) for t in tensors)}]')


_dtypes: dict[Any, str] = {}


def _dtype_json(dtype: Any) -> str:
    text = _dtypes.get(dtype)
    if text is None:
        text = _dtypes[dtype] = json.dumps(str(dtype).replace("torch.", ""))
    return text


_groups: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, its text), as ``_texts``


PLAIN_GROUP_DESCS = ("", "undefined", "default_pg")  # torch's descriptions that say nothing of a group


def _group_json(group: Any) -> str:
    """``"pg":"1","pg_ranks":[2,3]``: a group's name and, for a subgroup, its global ranks (the
    doctor knows a group's members before each has issued a collective there) and its description
    when torch gave one (``"pg_desc":"mesh_dp"``, a DeviceMesh dimension's); ``"pg":"0"`` for the
    default group; ``"pg_outside":true`` for the placeholder ``new_group`` gives the ranks it leaves
    out (torch skips a call on it with a warning; its ranks, as torch keeps them, are another group's).
    Cached per group, kept alive in the entry and checked on a hit."""
    if group is None:
        return '"pg":"0"'
    if type(group) is int:  # new_group's placeholder for the ranks it leaves out (NON_GROUP_MEMBER)
        return '"pg":"?","pg_outside":true'
    cached = _groups.get(id(group))
    if cached is not None and cached[0] is group:
        return cached[1]
    try:
        name = str(group.group_name)
    except Exception:  # noqa: BLE001
        name = "?"
    text = f'"pg":{json.dumps(name)}'
    try:
        import torch.distributed as dist

        if group is not dist.group.WORLD:
            ranks = [int(rank) for rank in dist.get_process_group_ranks(group)]
            text += f',"pg_ranks":{json.dumps(ranks, separators=(",", ":"))}'
            desc = str(getattr(group, "group_desc", "") or "")
            if desc not in PLAIN_GROUP_DESCS:  # init_device_mesh's 'mesh_dp'
                text += f',"pg_desc":{json.dumps(desc)}'
    except Exception:  # noqa: BLE001 - not a group torch knows: its own error comes with the call
        pass
    if len(_groups) >= _TEXTS_KEPT:  # groups made anew every step must not grow memory
        _groups.clear()
    _groups[id(group)] = (group, text)
    return text
