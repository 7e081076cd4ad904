"""Per-rank record of every torch.distributed operation a rank issues, for the hang doctor.

``install(run_dir, rank)`` runs inside a rank before user code. It

- wraps the Python-level operations of ``torch.distributed`` (all_reduce ... recv, the ``*_object``
  ones and the deprecated aliases; the outermost call is recorded once) so that each call appends
  to ``trace-<rank>.jsonl``: the op, the process group and torch's sequence number in it, the input
  shapes and dtypes, the user's call site, start and end times, and whether it completed or raised;
- turns on torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``), which also records collectives
  issued from C++ (DDP's broadcasts in ``forward()`` and its gradient all-reduce in ``backward()``,
  which never pass through Python), and starts a helper thread that
  * notes the process groups' progress (last collective enqueued and completed) every ``POLL_S``;
  * on request (a line written to the FIFO ``ctl-<rank>``) writes ``state-<rank>.json``: the main
    thread's Python stack and the Flight Recorder's latest entries.

Records are appended with one ``os.write`` each, so they survive the rank being killed.
The call site is the first frame outside torch, accelerate, helpers and the standard library;
``__main__`` (the script being run) and ``helpers.scenarios`` are user code; a function defined in
a notebook cell shows as ``Cell In[n], line m``.

``python -m helpers.trace script.py [args]`` runs a script as one rank of ``helpers.launch``'s
``launch_command``: tracer and stack dumps installed first, then the script as ``__main__``.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import itertools
import json
import os
import select
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

POLL_S = 0.2  # how often the helper thread notes the process groups' progress
STACKS_REQUEST = "stacks"  # the request line for every thread's stack (others ask for a state)
AUTO_STATE_S = 1.0  # stuck this long in one collective: write the state once, unasked
FR_BUFFER_SIZE = "256"  # Flight Recorder entries kept per rank (unless the user set a size)
FR_TAIL = 64  # entries written to state-<rank>.json
ENV_DIR, ENV_RANK, ENV_PARENT = "HELPERS_TRACE_DIR", "HELPERS_TRACE_RANK", "HELPERS_PARENT_PID"

# op -> (compared tensor argument, peer argument): (position, name) pairs, None when absent.
# The compared tensor is the one every rank must pass with the same shape and dtype.
OPS: dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None]] = {
    "all_reduce": ((0, "tensor"), None),
    "broadcast": ((0, "tensor"), None),
    "reduce": ((0, "tensor"), None),
    "all_gather": ((1, "tensor"), None),
    "all_gather_into_tensor": ((1, "input_tensor"), None),
    "all_gather_single": ((1, "input_tensor"), None),
    "_all_gather_base": ((1, "input_tensor"), None),
    "all_gather_object": (None, None),
    "all_gather_coalesced": (None, None),
    "all_reduce_coalesced": (None, None),
    "broadcast_object_list": (None, None),
    "reduce_scatter": ((0, "output"), None),
    "reduce_scatter_tensor": ((1, "input"), None),
    "reduce_scatter_single": ((1, "input"), None),
    "_reduce_scatter_base": ((1, "input"), None),
    "all_to_all": (None, None),
    "all_to_all_single": (None, None),
    "gather": ((0, "tensor"), None),
    "gather_object": (None, None),
    "scatter": ((0, "tensor"), None),
    "scatter_object_list": (None, None),
    "barrier": (None, None),
    "monitored_barrier": (None, None),
    "send": ((0, "tensor"), (1, "dst")),
    "recv": ((0, "tensor"), (1, "src")),
    "isend": ((0, "tensor"), (1, "dst")),
    "irecv": ((0, "tensor"), (1, "src")),
    "send_object_list": (None, (1, "dst")),
    "recv_object_list": (None, (1, "src")),
    "batch_isend_irecv": (None, None),
}
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
                     "batch_isend_irecv"})

_USER_PACKAGES = ("helpers.scenarios",)
_SKIPPED_PACKAGES = frozenset({"torch", "accelerate", "helpers"})
_STDLIB = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def trace_path(run_dir: Path, rank: int) -> Path:
    """The rank's record of operations (JSON lines)."""
    return Path(run_dir) / f"trace-{rank}.jsonl"


def state_path(run_dir: Path, rank: int) -> Path:
    """Where the rank writes its stack and Flight Recorder entries on request."""
    return Path(run_dir) / f"state-{rank}.json"


def control_path(run_dir: Path, rank: int) -> Path:
    """The FIFO on which the rank's helper thread takes requests."""
    return Path(run_dir) / f"ctl-{rank}"


def stack_path(run_dir: Path, rank: int) -> Path:
    """Where the rank's Python stacks are appended: on request, and on a fatal signal."""
    return Path(run_dir) / f"stack-{rank}.txt"


def ask(run_dir: Path, rank: int, request: str) -> bool:
    """Send a request line to the rank's helper thread; False when the rank is not listening.

    ``STACKS_REQUEST`` asks for every thread's stack; any other line for a state dump tagged with it.
    """
    try:
        fd = os.open(control_path(run_dir, rank), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, f"{request}\n".encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# call sites


_user_file: dict[str, bool] = {}
_labels: dict[str, str] = {}


def _is_user_frame(frame: Any) -> bool:
    filename = frame.f_code.co_filename
    known = _user_file.get(filename)
    if known is None:
        module = frame.f_globals.get("__name__") or ""
        known = _is_user_module(module, filename)
        _user_file[filename] = known
    return known


def _is_user_module(module: str, filename: str) -> bool:
    if module == "__main__" or module.startswith(_USER_PACKAGES):
        return True
    if module.split(".")[0] in _SKIPPED_PACKAGES or filename.startswith("<frozen"):
        return False
    return not (filename.startswith(_STDLIB) and "site-packages" not in filename)


def label(filename: str, line: int) -> str:
    """``train.py:57``, or ``Cell In[5], line 3`` for code typed in a notebook cell."""
    prefix = _labels.get(filename)
    if prefix is None:
        prefix = _cell_name(filename) or os.path.basename(filename) + ":"
        _labels[filename] = prefix
    return f"{prefix}{line}"


def _cell_name(filename: str) -> str | None:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    compiler = getattr(shell, "compile", None)
    if compiler is None or not hasattr(compiler, "format_code_name"):
        return None
    named = compiler.format_code_name(filename)
    return f"{named[0]} {named[1]}, line " if named else None


_sites: dict[tuple[Any, int], str] = {}


def _site_json(code: Any, line: int) -> str:
    """``,"file":...,"line":...,"func":...,"where":...`` for a call site (cached per code and line)."""
    site = _sites.get((code, line))
    if site is None:
        site = (f',"file":{json.dumps(code.co_filename)},"line":{line},"func":{json.dumps(code.co_name)},'
                f'"where":{json.dumps(label(code.co_filename, line))}')
        _sites[(code, line)] = site
    return site


def user_frame(frame: Any) -> Any:
    """The innermost user frame at or above ``frame`` (None when every frame is library code)."""
    while frame is not None and not _is_user_frame(frame):
        frame = frame.f_back
    return frame


def describe_stack(frame: Any) -> list[dict[str, Any]]:
    """A thread's stack as dicts (outermost first): file, line, function, user code or not."""
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append({"file": code.co_filename, "line": frame.f_lineno, "func": code.co_name,
                       "user": _is_user_frame(frame), "where": label(code.co_filename, frame.f_lineno)})
        frame = frame.f_back
    return frames[::-1]


def traceback_site(tb: Any) -> dict[str, Any] | None:
    """The innermost user frame of a traceback, as a dict (None when there is none)."""
    site = None
    while tb is not None:
        if _is_user_frame(tb.tb_frame):
            code = tb.tb_frame.f_code
            site = {"file": code.co_filename, "line": tb.tb_lineno, "func": code.co_name,
                    "where": label(code.co_filename, tb.tb_lineno)}
        tb = tb.tb_next
    return site


# ---------------------------------------------------------------------------------------------
# the tracer


class Tracer:
    """Writes one rank's records; wraps torch.distributed; runs the helper thread."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = Path(run_dir), rank
        self.fd = os.open(trace_path(run_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.ids = itertools.count(1)
        self.helper: _Helper | None = None
        self.originals: dict[tuple[Any, str], Callable] = {}
        self.calls = 0  # Python-level calls started or ended (the helper sees motion)
        self.open_sync = 0  # blocking calls in progress

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (one ``os.write``: it survives the process being killed)."""
        os.write(self.fd, (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode())

    def call(self, name: str, fn: Callable, args: tuple, kwargs: dict, plan: _Plan) -> Any:
        """Record and run one outermost torch.distributed call.

        The hot path: records are JSON written with preformatted pieces (``json.dumps`` per call
        would triple the wrapper's cost), one ``os.write`` each.
        """
        op_id = next(self.ids)
        fields, blocking, seq = plan.describe(args, kwargs)
        frame = user_frame(sys._getframe(2))
        site = _site_json(frame.f_code, frame.f_lineno) if frame is not None else ""
        os.write(self.fd, f'{{"ev":"op","id":{op_id},"op":"{name}",{fields}{site},"t":{time.time()!r}}}\n'
                 .encode())
        self.calls += 1
        self.open_sync += blocking
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            self.write({"ev": "end", "id": op_id, "t": time.time(), "ok": False,
                        "error": f"{type(exc).__name__}: {exc}"[:800]})
            raise
        finally:
            self.calls += 1
            self.open_sync -= blocking
        if not blocking and result is not None:
            self._watch_async(op_id, result)
        elif plan.multi and seq is not None:
            self.write({"ev": "end", "id": op_id, "t": time.time(), "ok": True,
                        "seq_end": plan.sequence(args, kwargs)})
        else:
            os.write(self.fd, f'{{"ev":"end","id":{op_id},"t":{time.time()!r},"ok":true}}\n'.encode())
        return result

    def _watch_async(self, op_id: int, work: Any) -> None:
        self.write({"ev": "enq", "id": op_id, "t": time.time()})
        try:
            future = work.get_future()
        except Exception:  # noqa: BLE001 - gloo's p2p work has no future: enqueue is all we know
            return

        def done(fut: Any) -> None:
            error = None
            try:
                fut.value()
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"[:800]
            record = {"ev": "end", "id": op_id, "t": time.time(), "ok": error is None}
            if error:
                record["error"] = error
            self.write(record)

        future.add_done_callback(done)

    def patch(self) -> None:
        """Wrap the operations in ``torch.distributed`` and ``distributed_c10d`` (internal calls too)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in OPS:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None or getattr(original, "_helpers_traced", False):
                continue
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


_tracer: Tracer | None = None
_local = threading.local()


def _wrap(name: str, original: Callable, plan: _Plan) -> Callable:
    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer
        if tracer is None or getattr(_local, "inside", False):
            return original(*args, **kwargs)
        _local.inside = True
        try:
            return tracer.call(name, original, args, kwargs, plan)
        finally:
            _local.inside = False

    traced._helpers_traced = True  # type: ignore[attr-defined]
    return traced


class _Plan:
    """Where one op keeps its arguments, so a call is described without ``inspect`` per call."""

    def __init__(self, name: str, fn: Callable):
        compared, peer = OPS[name]
        params = list(inspect.signature(fn).parameters)
        self.compared, self.peer = compared, peer
        self.group = (params.index("group"), "group") if "group" in params else None
        self.async_op = (params.index("async_op"), "async_op") if "async_op" in params else None
        self.p2p = name in P2P_OPS
        self.multi = name.endswith(("_object", "_object_list")) or name in (
            "all_gather_coalesced", "all_reduce_coalesced", "batch_isend_irecv")

    def sequence(self, args: tuple, kwargs: dict) -> int | None:
        """torch's sequence number of the group the call uses (collectives and p2p both count)."""
        group = _argument(args, kwargs, self.group)
        try:
            if group is None:
                group = _default_group()
            return group._get_sequence_number_for_group()
        except Exception:  # noqa: BLE001 - no group yet: torch will raise its own error
            return None

    def describe(self, args: tuple, kwargs: dict) -> tuple[str, bool, int | None]:
        """The call's record fields as JSON text (group, sequence number, shapes, dtypes, peer,
        async flag), whether it blocks, and its sequence number."""
        seq = self.sequence(args, kwargs)
        seq = None if seq is None else seq + 1
        group = _argument(args, kwargs, self.group)
        fields = f'"pg":"{_group_name(group)}","seq":{"null" if seq is None else seq}'
        if self.p2p:
            fields += ',"p2p":true'
        tensors = _tensors(_argument(args, kwargs, self.compared))
        if tensors is not None:
            fields += (f',"shapes":{[list(t.shape) for t in tensors]},'
                       f'"dtypes":[{",".join(_dtype_json(t.dtype) for t in tensors)}]')
        if self.peer is not None:
            fields += f',"peer":{json.dumps(_argument(args, kwargs, self.peer))}'
        blocking = not _argument(args, kwargs, self.async_op)
        if not blocking:
            fields += ',"async":true'
        return fields, blocking, seq


_dtypes: dict[Any, str] = {}


def _dtype_json(dtype: Any) -> str:
    text = _dtypes.get(dtype)
    if text is None:
        text = _dtypes[dtype] = json.dumps(str(dtype).replace("torch.", ""))
    return text


_c10d: Any = None


def _default_group() -> Any:
    global _c10d
    if _c10d is None:
        import torch.distributed.distributed_c10d as c10d

        _c10d = c10d
    return _c10d._get_default_group()


def _argument(args: tuple, kwargs: dict, where: tuple[int, str] | None) -> Any:
    if where is None:
        return None
    index, name = where
    return args[index] if index < len(args) else kwargs.get(name)


def _tensors(value: Any) -> list | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [v for v in value if hasattr(v, "shape")]
    return [value] if hasattr(value, "shape") else None


_group_names: dict[int, str] = {}


def _group_name(group: Any) -> str:
    if group is None:
        return "0"
    name = _group_names.get(id(group))
    if name is None:
        try:
            name = str(group.group_name)
        except Exception:  # noqa: BLE001
            name = "?"
        _group_names[id(group)] = name
    return name


# ---------------------------------------------------------------------------------------------
# the helper thread: progress notes and state dumps on request


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
    """The latest Flight Recorder entries, trimmed to what the doctor reads."""
    dump = flight_recorder(True) or {}
    tail = []
    for entry in (dump.get("entries") or [])[-limit:]:
        item = {key: entry.get(key) for key in _FR_FIELDS}
        group = entry.get("process_group") or ["?"]
        item["pg"] = str(group[0])
        tail.append(item)
    return tail


class _Helper(threading.Thread):
    def __init__(self, tracer: Tracer):
        super().__init__(name="helpers-trace", daemon=True)
        self.tracer = tracer
        self.stopping = threading.Event()
        self.wake_read, self.wake_write = os.pipe()  # stop() wakes the select at once
        self.fifo: int | None = None
        path = control_path(tracer.run_dir, tracer.rank)
        if path.exists():
            # read-write, so that the FIFO never reports end-of-file while nobody writes
            self.fifo = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def run(self) -> None:
        last: dict[str, list[int]] = {}
        pending = b""
        motion: tuple = ()
        still_since, written = time.time(), False
        while not self.stopping.is_set():
            watched = [self.wake_read] + ([self.fifo] if self.fifo is not None else [])
            ready = [fd for fd in select.select(watched, [], [], POLL_S)[0] if fd == self.fifo]
            if self.stopping.is_set():
                break
            progress = group_progress()
            if progress and progress != last:
                self.tracer.write({"ev": "pg", "t": time.time(), "pg": progress})
                last = progress
            if ready:
                pending += _read_available(self.fifo)
                *requests, pending = pending.split(b"\n")
                self._answer([request.decode(errors="replace") for request in requests])
            now = (progress, self.tracer.calls)
            if now != motion:
                motion, still_since, written = now, time.time(), False
            elif not written and time.time() - still_since >= AUTO_STATE_S and self._waiting(progress):
                write_state(self.tracer, "auto")  # for a post-mortem if nobody asks in time
                written = True

    def _answer(self, requests: list[str]) -> None:
        if STACKS_REQUEST in requests:
            dump_stacks(self.tracer)
        states = [request for request in requests if request != STACKS_REQUEST]
        if states:
            write_state(self.tracer, states[-1])  # only the latest matters

    def _waiting(self, progress: dict[str, list[int]]) -> bool:
        return self.tracer.open_sync > 0 or any(enq > done for enq, done in progress.values())

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


def dump_stacks(tracer: Tracer) -> None:
    """Append every thread's Python stack to stack-<rank>.txt, from this thread, holding the GIL.

    faulthandler run from a signal handler reads the other threads' frames without the GIL and can
    crash the process (SIGSEGV) when one of them runs Python meanwhile (cpython#116008), as this
    helper thread often does; here every other thread is paused outside Python code.
    """
    with open(stack_path(tracer.run_dir, tracer.rank), "a") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)


def write_state(tracer: Tracer, request: str, extra: dict[str, Any] | None = None) -> None:
    """Write state-<rank>.json: main thread's stack, Flight Recorder tail, group progress."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident) if main.ident is not None else None
    state = {"request": request, "rank": tracer.rank, "t": time.time(),
             "stack": describe_stack(frame) if frame is not None else [],
             "progress": group_progress(), "fr": flight_recorder_tail()}
    state.update(extra or {})
    path = state_path(tracer.run_dir, tracer.rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# public entry points (inside a rank)


def install(run_dir: str | Path, rank: int) -> Tracer:
    """Trace this rank's torch.distributed calls into ``run_dir``; call before user code runs.

    Also turns on torch's Flight Recorder (unless the user chose a buffer size) and starts the
    helper thread. Safe to call once per process; returns the tracer.
    """
    global _tracer
    if _tracer is not None:
        return _tracer
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE",
                                                                  FR_BUFFER_SIZE))
    tracer = Tracer(Path(run_dir), rank)
    tracer.patch()
    tracer.write({"ev": "hello", "rank": rank, "pid": os.getpid(), "t": time.time()})
    tracer.helper = _Helper(tracer)
    tracer.helper.start()
    _tracer = tracer
    return tracer


def finish(status: str, error: BaseException | None = None) -> None:
    """Write the rank's last records: how it ended, its final progress and Flight Recorder tail.

    ``status`` is "finished" (the work ended normally) or "raised" (``error`` escaped it).
    """
    global _tracer
    tracer = _tracer
    if tracer is None:
        return
    record: dict[str, Any] = {"ev": "exit", "status": status, "t": time.time(), "pg": group_progress()}
    if error is not None:
        record["error"] = f"{type(error).__name__}: {error}"[:800]
        site = traceback_site(error.__traceback__)
        if site:
            record.update(site)
    tracer.write(record)  # first: a launcher may stop this process any moment now
    if tracer.helper is not None:
        tracer.helper.stop()
    write_state(tracer, "final")
    tracer.unpatch()
    os.close(tracer.fd)
    _tracer = None


def run_script(argv: list[str]) -> NoReturn:
    """Run ``script.py args`` (or ``-m module args``) as ``__main__`` inside a traced rank.

    Reads the run folder and rank from the environment ``launch_command`` sets, installs stack
    dumps and the tracer, runs the script, records how it ended and ends the process with the
    script's exit code (an exception propagates as usual, after it was recorded).
    """
    import runpy

    from helpers import launch

    run_dir = Path(os.environ[ENV_DIR])
    rank = int(os.environ.get(ENV_RANK) or os.environ.get("RANK", "0"))
    stack_handle = launch._install_stack_dump(stack_path(run_dir, rank), all_threads=False)
    if os.environ.get(ENV_PARENT):  # under helpers.launch
        launch._set_parent_death_signal(int(os.environ[ENV_PARENT]))
    else:  # under torchrun, which stops ranks with SIGTERM: leave their stacks for a post-mortem
        import signal

        # only the thread the signal interrupts (the main one): walking the others' stacks from a
        # signal handler can segfault while the helper thread runs Python (see dump_stacks)
        faulthandler.register(signal.SIGTERM, file=stack_handle, all_threads=False, chain=True)
    install(run_dir, rank)
    module = argv[0] == "-m"
    target = argv[1] if module else argv[0]
    sys.argv = argv[1:] if module else list(argv)
    if not module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    code = 0
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        finish("finished")
    except SystemExit as exc:
        code = _exit_code(exc.code)
        finish("finished" if code == 0 else "exited")
    except BaseException as exc:
        finish("raised", exc)
        launch._write_outcome(run_dir / f"result-{rank}.pkl",
                              ("error", type(exc).__name__, str(exc), traceback.format_exc(), time.time()))
        raise
    if code == 0:
        launch._write_outcome(run_dir / f"result-{rank}.pkl", ("ok", 0))
    stack_handle.flush()
    # Recorded: end now, before interpreter teardown, where torch 2.13's gloo aborts in about 1 run
    # in 10 after gather_for_metrics ("terminate called without an active exception") and would
    # turn a finished rank into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    from helpers.trace import run_script as _run_script  # the module, not this __main__ copy

    _run_script(sys.argv[1:])
