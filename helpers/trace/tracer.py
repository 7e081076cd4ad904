"""The tracer: wraps torch.distributed's Python-level operations and records each call.

Each outermost call appends two records to ``trace-<rank>.jsonl`` (``helpers.rundir``): the op,
the process group and torch's sequence number in it, the input shapes and dtypes, the user's call
site and start time; then its end (completed or raised). Records are appended with one
``os.write`` each, so they survive the rank being killed. The ops are ``helpers.collectives.OPS``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import rundir
from helpers.collectives import MULTI_OPS, OPS, P2P_OPS
from helpers.trace.callsites import site_json, user_frame


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
        site = site_json(frame.f_code, frame.f_lineno) if frame is not None else ""
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


current: Tracer | None = None  # the tracer of this process, once installed
_local = threading.local()


def _wrap(name: str, original: Callable, plan: _Plan) -> Callable:
    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        tracer = current
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
        self.multi = name in MULTI_OPS

    def sequence(self, args: tuple, kwargs: dict) -> int | None:
        """torch's sequence number of the group the call uses (collectives and p2p both count)."""
        return _sequence(_argument(args, kwargs, self.group))

    def describe(self, args: tuple, kwargs: dict) -> tuple[str, bool, int | None]:
        """The call's record fields as JSON text (group, sequence number, shapes, dtypes, peer,
        async flag), whether it blocks, and its sequence number.

        Only the sequence number is new at every call: the group's name and the shapes' text are
        cached (a training loop repeats the same few shapes), which halves this function's cost.
        """
        group = _argument(args, kwargs, self.group)
        seq = _sequence(group)
        seq = None if seq is None else seq + 1
        fields = f'"pg":"{_group_name(group)}","seq":{"null" if seq is None else seq}'
        if self.p2p:
            fields += ',"p2p":true'
        fields += _tensors_json(_argument(args, kwargs, self.compared))
        if self.peer is not None:
            fields += f',"peer":{json.dumps(_argument(args, kwargs, self.peer))}'
        blocking = not _argument(args, kwargs, self.async_op)
        if not blocking:
            fields += ',"async":true'
        return fields, blocking, seq


def _sequence(group: Any) -> int | None:
    try:
        if group is None:
            group = _default_group()
        return group._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001 - no group yet: torch will raise its own error
        return None


_shapes: dict[tuple, str] = {}  # (shape, dtype) per tensor -> their record text
_SHAPES_KEPT = 4096  # distinct shape lists cached (a loop with ever-new shapes must not grow memory)


def _tensors_json(value: Any) -> str:
    """``,"shapes":[...],"dtypes":[...]`` for a tensor or a list of them ("" for anything else)."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        tensors = [v for v in value if hasattr(v, "shape")]
    elif hasattr(value, "shape"):
        tensors = [value]
    else:
        return ""
    try:
        key = tuple((t.shape, t.dtype) for t in tensors)
        text = _shapes.get(key)
    except TypeError:  # an unhashable shape (not a tensor): described, not cached
        key, text = None, None
    if text is None:
        text = (f',"shapes":{[list(t.shape) for t in tensors]},'
                f'"dtypes":[{",".join(_dtype_json(t.dtype) for t in tensors)}]')
        if key is not None:
            if len(_shapes) >= _SHAPES_KEPT:
                _shapes.clear()
            _shapes[key] = text
    return text


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
