"""Per-rank record of every torch.distributed operation a rank issues, for the hang doctor.

``install(run_dir, rank)`` runs inside a rank before user code. It

- wraps the Python-level operations of ``torch.distributed`` (all_reduce ... recv, the ``*_object``
  ones and the deprecated aliases; the outermost call is recorded once) so that each call appends
  to ``trace-<rank>.jsonl``: the op, the process group and torch's sequence number in it, the input
  shapes and dtypes, the user's call site, start and end times, and whether it completed or raised;
  ``init_process_group`` too, as the call before the group's first collective (ranks wait there);
- turns on torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``), which also records collectives
  issued from C++ (DDP's broadcasts in ``forward()`` and its gradient all-reduce in ``backward()``,
  which never pass through Python), and starts a helper thread that
  * notes the process groups' progress (last collective enqueued and completed) every ``POLL_S``;
  * on request (a line written to the FIFO ``ctl-<rank>``) writes ``state-<rank>.json``: the main
    thread's Python stack and the Flight Recorder's latest entries.

The calling thread queues each call's record; the helper thread writes the queue every
``FLUSH_S`` (what costs is the record's text after a collective, not the write: see
``helpers.trace.tracer``). What is written survives the rank being killed; a call that outlasts a
flush is on file while it runs; an exception or an exit writes the queue first; a rank killed
outright (SIGKILL) loses at most its last ``FLUSH_S`` of calls, and a small call it was in is noted
in place in ``current-<rank>.bin`` (the doctor names the call a rank died in by it).
The call site is the first frame outside torch, accelerate, helpers and the standard library;
``__main__`` (the script being run) and ``helpers.scenarios`` are user code; a function defined in
a notebook cell shows as ``Cell In[n], line m``.

``python -m helpers.trace script.py [args]`` runs a script as one traced rank: under
``helpers.launch``'s ``launch_command`` or under torchrun (``HELPERS_TRACE_DIR`` names the folder).
The in-rank bootstrap that does it lives in ``helpers.launch.rank``; this package is a leaf
(standard library, torch, ``helpers.rundir``, ``helpers.collectives``, ``helpers.sites``).

Modules: ``callsites`` (the user's line), ``tracer`` (the wrappers and records), ``helper`` (the
helper thread, Flight Recorder, state dumps).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NoReturn

from helpers.trace import tracer as _tracing
from helpers.trace.callsites import (
    describe_stack,
    error_text,
    is_user_frame,
    label,
    traceback_callers,
    traceback_site,
    user_frame,
)
from helpers.trace.helper import (
    FR_TAIL,
    POLL_S,
    STACKS_REQUEST,
    Helper,
    ask,
    dump_stacks,
    flight_recorder,
    flight_recorder_tail,
    group_progress,
    note_thread_errors,
    rank_state,
    save_state,
    settle,
    write_state,
)
from helpers.trace.tracer import FLUSH_S, Tracer

__all__ = ["FLUSH_S", "FR_BUFFER_SIZE", "FR_STACK_TRACE", "FR_TAIL", "POLL_S", "STACKS_REQUEST", "Tracer",
           "ask", "describe_stack", "dump_stacks", "error_fields", "error_text", "finish", "flight_recorder",
           "flight_recorder_tail", "flush", "group_progress", "install", "is_user_frame", "label",
           "rank_state", "save_state", "settle", "traceback_callers", "traceback_site", "user_frame",
           "write_state"]

FR_BUFFER_SIZE = "256"  # Flight Recorder entries kept per rank (unless the user set a size)
# The Flight Recorder gathers a stack for every entry unless told not to: about 15 us of CPU (30 us
# wall) per collective on gloo, more than the whole Python wrapper. TORCH_INCLUDE_STACK_TRACE=0 cuts
# that cost (torch 2.13 still keeps a few frames per entry in its dumps). The doctor takes the
# user's line from the tracer's own records and reads no FR frames of a traced rank, so it sets 0
# unless the user chose.
FR_STACK_TRACE = "0"


def install(run_dir: str | Path | None, rank: int) -> Tracer:
    """Trace this rank's torch.distributed calls into ``run_dir``; call before user code runs.

    Also turns on torch's Flight Recorder (unless the user chose a buffer size), with its per-entry
    stack capture cut down (unless the user chose, see ``FR_STACK_TRACE``), and starts the helper
    thread. ``run_dir`` None (the doctor inside a job): the records stay in memory (the tracer's
    ``fd``) and no state file is written. Safe to call once per process; returns the tracer.
    """
    if _tracing.current is not None:
        return _tracing.current
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE",
                                                                  FR_BUFFER_SIZE))
    os.environ.setdefault("TORCH_INCLUDE_STACK_TRACE", FR_STACK_TRACE)
    tracer = Tracer(Path(run_dir) if run_dir is not None else None, rank)
    tracer.patch()
    tracer.write({"ev": "hello", "rank": rank, "pid": os.getpid(), "t": time.time()})
    tracer.helper = Helper(tracer)
    tracer.helper.start()
    _tracing.current = tracer
    _flush_before_exit()
    note_thread_errors()
    return tracer


_real_exit = os._exit


def _flush_before_exit() -> None:
    """A script's (or a DataLoader worker's) ``os._exit`` writes the queued records first."""
    def exit_after_flush(code: int) -> NoReturn:
        flush()
        settle()
        _real_exit(code)

    os._exit = exit_after_flush


def flush(wait: bool | float = True) -> None:
    """Write this process's queued records now (nothing when no tracer is installed);
    ``wait=False``: unless another thread is writing them; seconds: waiting that long at most for
    it (``Tracer.flush``)."""
    tracer = _tracing.current
    if tracer is not None:
        tracer.flush(wait)


def joined() -> bool:
    """Has this process's ``init_process_group`` returned, as traced (False without a tracer)?"""
    tracer = _tracing.current
    return tracer is not None and tracer.joined


def exit_fields(exit_call: SystemExit | None) -> dict[str, Any]:
    """An exit record's fields for the SystemExit it ended by (``sys.exit()``, ``exit()``): where it
    was raised (``exit_site``, its traceback's innermost user frame) and the user's frames that led
    there (``exit_callers``, outermost first: a sys.exit() in a function called inside a loop);
    none without one."""
    if exit_call is None:
        return {}
    site = traceback_site(exit_call.__traceback__)
    return {"exit_site": site, "exit_callers": traceback_callers(exit_call.__traceback__)} if site else {}


def error_fields(error: BaseException) -> dict[str, Any]:
    """An exit record's fields for the exception that escaped the script: its text (``error``),
    where it was raised (the innermost user frame's ``file``, ``line``, ``where``) and the user's
    frames that led there (``callers``, outermost first)."""
    fields: dict[str, Any] = {"error": error_text(error)}
    site = traceback_site(error.__traceback__)
    if site:
        fields.update(site, callers=traceback_callers(error.__traceback__))
    return fields


def finish(status: str, error: BaseException | None = None, exit_call: SystemExit | None = None) -> None:
    """Write the rank's last records: how it ended, its final progress and Flight Recorder tail.

    ``status`` is "finished" (the work ended normally), "exited" (a non-zero exit code) or "raised"
    (``error`` escaped it). ``exit_call``: the SystemExit that ended it (``sys.exit()``, ``exit()``),
    whose line is recorded as ``exit_site`` (an early stop inside a loop on one rank alone).
    """
    tracer = _tracing.current
    if tracer is None:
        return
    record: dict[str, Any] = {"ev": "exit", "status": status, "t": time.time(), "pg": group_progress()}
    record.update(exit_fields(exit_call))
    if error is not None:
        record.update(error_fields(error))
    tracer.write(record)  # first: a launcher may stop this process any moment now
    if tracer.helper is not None:
        tracer.helper.stop()
    write_state(tracer, "final")
    tracer.unpatch()
    tracer.close()
    _tracing.current = None
