"""CUDA must not be initialised in a process before it forks ranks: remember where it was.

``helpers`` installs the watch on import (stdlib only, so ``python -m helpers lint`` stays light):
it wraps ``torch.cuda._lazy_init`` as soon as ``torch.cuda`` is imported, and the first call that
initialises CUDA is remembered as the user's line. ``check_cuda_not_initialized()`` then refuses to
fork and names that line; ``cuda_init_site()`` gives it to the audit.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from helpers.sites import is_user_code

_init_site: str | None = None


class CudaInitializedError(RuntimeError):
    """CUDA is already initialised in the caller, so forked ranks cannot use it."""


def cuda_init_site() -> str | None:
    """``file:line (code)`` of the call that initialised CUDA in this process (None: not seen)."""
    return _init_site


def watch_cuda_init() -> None:
    """Remember where CUDA gets initialised in this process, so a refusal can name the call.

    Wraps ``torch.cuda._lazy_init`` (C++ paths such as ``tensor.cuda()`` call it too). Does nothing
    until torch is imported; cheap, and safe to call more than once.
    """
    cuda = sys.modules.get("torch.cuda")
    if cuda is None or getattr(cuda._lazy_init, "_helpers_watch", False):
        return
    original = cuda._lazy_init

    def _lazy_init_watched() -> None:
        global _init_site
        if _init_site is None and not cuda.is_initialized():
            _init_site = _user_frame(traceback.extract_stack()[:-1])
        original()

    _lazy_init_watched._helpers_watch = True  # type: ignore[attr-defined]
    cuda._lazy_init = _lazy_init_watched


class _CudaImportHook:
    """Calls ``watch_cuda_init`` right after ``torch.cuda`` is imported, then removes itself."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.cuda":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_then_watch(module: Any) -> None:
            execute(module)
            watch_cuda_init()

        spec.loader.exec_module = exec_then_watch  # type: ignore[method-assign]
        return spec


def install_cuda_watch() -> None:
    """Watch CUDA initialisation now if torch is loaded, else as soon as torch.cuda is imported."""
    if "torch.cuda" in sys.modules:
        watch_cuda_init()
    elif not any(isinstance(finder, _CudaImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CudaImportHook())


def _user_frame(frames: Sequence[traceback.FrameSummary]) -> str:
    for frame in reversed(frames):
        typed = frame.filename.startswith("<") and not frame.filename.startswith("<frozen")
        if typed or is_user_code(frame.filename):  # <stdin>, <ipython-input-...>: typed by the user
            return f"{frame.filename}:{frame.lineno} ({frame.line or frame.name})"
    last = frames[-1]
    return f"{last.filename}:{last.lineno}"


def check_cuda_not_initialized() -> None:
    """Raise CudaInitializedError when CUDA is initialised in this process (forking is unsafe)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    where = f" by {_init_site}" if _init_site else " (the call could not be traced)"
    raise CudaInitializedError(
        f"CUDA was initialised in this process{where}; forked ranks cannot use it. Restart the "
        "kernel and keep torch.cuda.*, .cuda() and .to('cuda') inside the function you launch."
    )
