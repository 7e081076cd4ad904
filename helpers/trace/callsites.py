"""Call sites: the user's line of a frame, and how a notebook cell or a file is named.

The call site of an operation is the innermost frame of the user's code (``helpers.sites``: not
torch, accelerate, helpers or the standard library; ``__main__`` and ``helpers.scenarios`` are the
user's). A function defined in a notebook cell shows as ``Cell In[n], line m``, as IPython names it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from helpers.sites import is_user_code

user_files: dict[str, bool] = {}  # file name -> is it user code (the tracer reads it inline)
_labels: dict[str, str] = {}


def is_user_frame(frame: Any) -> bool:
    """Is ``frame`` the user's code (cached per file; the module name decides, see helpers.sites)?"""
    filename = frame.f_code.co_filename
    known = user_files.get(filename)
    if known is None:
        known = is_user_code(filename, frame.f_globals.get("__name__") or "")
        user_files[filename] = known
    return known


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


_sites: dict[tuple[int, int], tuple[Any, str]] = {}  # (id(code), offset) -> (code, text)


def site_json(code: Any, offset: int) -> str:
    """``,"file":...,"line":...,"func":...,"where":...`` for the call at byte ``offset`` of
    ``code`` (a frame's ``f_lasti``; cached per code and offset).

    The tracer notes the offset, not ``f_lineno``: a frame computes its line by scanning its code's
    line table from the start, which costs microseconds in a long function. Keyed by the code
    object's id, kept alive in the entry: hashing a code object hashes its constants, nested
    functions' code included, at every call.
    """
    cached = _sites.get((id(code), offset))
    if cached is not None and cached[0] is code:
        return cached[1]
    line = line_at(code, offset)
    site = (f',"file":{json.dumps(code.co_filename)},"line":{line},"func":{json.dumps(code.co_name)},'
            f'"where":{json.dumps(label(code.co_filename, line))}')
    _sites[(id(code), offset)] = (code, site)
    return site


def line_at(code: Any, offset: int) -> int:
    """The source line of the instruction at byte ``offset`` of ``code`` (what ``f_lineno`` says of
    a frame stopped there; 0 when the instruction has none)."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line or 0
    return 0


def user_frame(frame: Any) -> Any:
    """The innermost user frame at or above ``frame`` (None when every frame is library code)."""
    while frame is not None and not is_user_frame(frame):
        frame = frame.f_back
    return frame


def describe_stack(frame: Any) -> list[dict[str, Any]]:
    """A thread's stack as dicts (outermost first): file, line, function, user code or not."""
    frames = []
    while frame is not None:
        code = frame.f_code
        entry = {"file": code.co_filename, "line": frame.f_lineno, "func": code.co_name,
                 "user": is_user_frame(frame), "where": label(code.co_filename, frame.f_lineno)}
        if code.co_name == "decorator" and code.co_filename.replace("\\", "/").endswith(BATCH_SIZE_FINDER):
            entry["batch_size"] = _batch_size(frame)
        frames.append(entry)
        frame = frame.f_back
    return frames[::-1]


# accelerate's find_executable_batch_size (accelerate/utils/memory.py) runs the function in its
# ``decorator``, lowering its ``batch_size`` and calling again after an out-of-memory error on this
# rank alone; transformers' Trainer uses it with auto_find_batch_size=True (trainer_utils'
# find_executable_batch_size). The ranks' batch sizes tell whether one retried alone.
BATCH_SIZE_FINDER = "accelerate/utils/memory.py"


def _batch_size(frame: Any) -> int | None:
    """The batch size a find_executable_batch_size call runs with now (its ``decorator`` frame's)."""
    try:
        value = frame.f_locals.get("batch_size")
    except Exception:  # noqa: BLE001 - a frame's locals are a hint, never worth a failed state dump
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def traceback_site(tb: Any) -> dict[str, Any] | None:
    """The innermost user frame of a traceback, as a dict (None when there is none)."""
    site = None
    while tb is not None:
        if is_user_frame(tb.tb_frame):
            code = tb.tb_frame.f_code
            site = {"file": code.co_filename, "line": tb.tb_lineno, "func": code.co_name,
                    "where": label(code.co_filename, tb.tb_lineno)}
        tb = tb.tb_next
    return site


def traceback_callers(tb: Any) -> list[list[Any]]:
    """The user frames of a traceback as [file, line, where], outermost first: the calls that led to
    the error (a branch on the rank around one of them tells who alone made the call)."""
    callers = []
    while tb is not None:
        if is_user_frame(tb.tb_frame):
            filename = tb.tb_frame.f_code.co_filename
            callers.append([filename, tb.tb_lineno, label(filename, tb.tb_lineno)])
        tb = tb.tb_next
    half = CALLERS_KEPT // 2  # a deep recursion's: its outermost and innermost frames
    return callers if len(callers) <= CALLERS_KEPT else callers[:half] + callers[-half:]


CALLERS_KEPT = 32  # user frames an exit record keeps


ERROR_CHARS = 800  # an error's text kept in a record
DATALOADER_FILE = "/torch/utils/data/dataloader.py"
DATALOADER_READ = "reading from its DataLoader's worker processes"
_WORKER_ERROR = re.compile(r"^Caught (?P<type>\w+) in (?P<worker>DataLoader worker process \d+)\.\s*"
                           r"Original Traceback \(most recent call last\):\n(?P<trace>.*)", re.DOTALL)
_TRACE_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', re.MULTILINE)


def error_text(error: BaseException) -> str:
    """``Type: message`` of an exception, ``ERROR_CHARS`` at most. An error a DataLoader worker raised
    and torch raised again in the rank ('Caught ValueError in DataLoader worker process 0.' and the
    worker's traceback as text) is said as the worker's own, with the user's line it came from:
    'ValueError: corrupt row 3 (in DataLoader worker process 0, at data.py:12 in __getitem__)'. An
    OSError raised while reading from the workers (a worker killed as the pipe was read) says so."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, (OSError, EOFError)) and _passes_through(error.__traceback__, DATALOADER_FILE):
        text += f" ({DATALOADER_READ})"  # its worker died under it: the pipe to it broke
    found = _WORKER_ERROR.match(str(error))
    if found is not None:
        lines = [line for line in found["trace"].splitlines() if line.strip()]
        last = lines[-1].strip() if lines else found["type"]
        frames = [m for m in _TRACE_FRAME.finditer(found["trace"]) if is_user_code(m["file"])]
        site = ""
        if frames:
            site = f", at {label(frames[-1]['file'], int(frames[-1]['line']))} in {frames[-1]['func']}"
        text = f"{last} (in {found['worker']}{site})"
    return text[:ERROR_CHARS]


def _passes_through(tb: Any, ending: str) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(ending):
            return True
        tb = tb.tb_next
    return False
