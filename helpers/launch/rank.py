"""Everything that runs inside a rank: forked by ``launch`` or exec'd by ``launch_command``/torchrun.

Before any user code, a rank resets SIGINT/SIGTERM to their defaults, dies with its launcher
(PR_SET_PDEATHSIG, ``helpers.procs``), registers faulthandler on ``STACK_SIGNAL`` (the signal is
blocked across the fork, and across the exec for command ranks, so an early request waits instead
of killing), and installs the hang doctor's tracer when a watcher wants it. When the work ends it
writes its ``RankOutcome`` into the run folder (``helpers.rundir``).

Command ranks start as ``python -m helpers.launch script.py [args]`` (untraced) or
``python -m helpers.trace script.py [args]`` (traced; also what torchrun users run): both call
``run_command_rank``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, NoReturn

from helpers import procs, rundir, trace

STACK_SIGNAL = signal.SIGUSR1
PG_TIMEOUT_MARGIN_S = 30.0  # ranks' process-group timeout past the launcher's deadline


@dataclass
class RankSpec:
    """What one rank needs to know about its run."""

    rank: int
    num_processes: int
    port: int
    run_dir: Path
    parent_pid: int
    init_group: bool
    backend: str
    timeout_s: float
    env: dict[str, str]
    trace: bool = False


def install_stack_dump(path: Path, all_threads: bool = True) -> IO[str]:
    """faulthandler on STACK_SIGNAL, chaining to a handler already installed (never to SIG_DFL).

    ``all_threads=False`` for traced ranks: their helper thread dumps every thread itself, and the
    signal is only the fallback when it does not answer; walking the other threads from the signal
    handler could segfault while that helper runs Python (cpython#116008).
    """
    handle = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the rank's lifetime
    previous = signal.getsignal(STACK_SIGNAL)
    chain = callable(previous)
    if previous == signal.SIG_DFL:  # what faulthandler puts back as the interpreter shuts down: a
        signal.signal(STACK_SIGNAL, signal.SIG_IGN)  # request then must not kill the rank (exit -10)
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=all_threads, chain=chain)
    faulthandler.enable(file=handle, all_threads=True)  # SIGSEGV, SIGABRT...: the stack, then death
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACK_SIGNAL})
    return handle


def rank_environment(spec: RankSpec) -> dict[str, str]:
    """The variables torchrun would give this rank, plus its TMPDIR inside the run folder."""
    env = {
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(spec.rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(spec.num_processes),
        "LOCAL_WORLD_SIZE": str(spec.num_processes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec.port),
        "TMPDIR": str(rundir.tmp_dir(spec.run_dir)),
    }
    if spec.backend == "gloo":
        env["ACCELERATE_USE_CPU"] = "true"
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(spec.env)
    return env


def _reset_accelerate_state() -> None:
    """Forget accelerate state inherited from the caller, so ``Accelerator()`` starts fresh."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    state.AcceleratorState._reset_state(True)
    state.GradientState._reset_state()


_INIT_BARRIER = "TORCH_DIST_INIT_BARRIER"  # torch 2.13: 1 = a store-based barrier ends init_process_group


@contextlib.contextmanager
def _environ_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block, then as it was."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _init_group(spec: RankSpec) -> None:
    import torch
    import torch.distributed as dist

    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
    init = dist.init_process_group  # the tracer's, when installed: the launcher's own is not recorded
    init = init.__wrapped__ if getattr(init, "_helpers_traced", False) else init
    # every rank leaves init connected (torch's store-based barrier after the group is built): else a
    # rank whose first call fails a check of its own leaves while a peer still connects, and that
    # peer's error ('Connection closed by peer' in init) says nothing of where it would have waited
    with _environ_set(_INIT_BARRIER, "1"):  # the user's own new_group calls keep torch's default
        init(
            backend=spec.backend,
            rank=spec.rank,
            world_size=spec.num_processes,
            # past the launcher's deadline, so the launcher stops a hang (with stacks) first
            timeout=datetime.timedelta(seconds=spec.timeout_s + PG_TIMEOUT_MARGIN_S),
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if (world, rank) != (spec.num_processes, spec.rank):
        raise RuntimeError(f"process group mismatch: expected rank {spec.rank} of "
                           f"{spec.num_processes}, torch.distributed says rank {rank} of {world}")


def rank_main(spec: RankSpec, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The body of a forked rank: set up, run ``fn``, write how it ended."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held by the launcher across the fork
    procs.set_parent_death_signal(spec.parent_pid)
    procs.allow_ptrace_by(spec.parent_pid)  # the doctor's py-spy, when this rank cannot answer
    rundir.pid_marker(spec.run_dir, os.getpid()).touch()
    stack_handle = install_stack_dump(rundir.stack_path(spec.run_dir, spec.rank), not spec.trace)
    os.environ.update(rank_environment(spec))
    rundir.tmp_dir(spec.run_dir).mkdir(exist_ok=True)
    tempfile.tempdir = str(rundir.tmp_dir(spec.run_dir))
    _reset_accelerate_state()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if spec.trace:  # the hang doctor's tracer, installed before any user code
        trace.install(spec.run_dir, spec.rank)
    try:
        if spec.init_group:
            _init_group(spec)
        outcome = rundir.RankOutcome(True, fn(*args, **kwargs))
        quiet_child_signals()
        if spec.trace:
            trace.finish("finished")
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        quiet_child_signals()
        outcome = rundir.RankOutcome.failure(exc, traceback.format_exc())
        if spec.trace:
            trace.finish("raised", exc)
    outcome.write(rundir.result_path(spec.run_dir, spec.rank))
    _destroy_group()
    stack_handle.close()


def _destroy_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the rank is ending anyway
            pass


def _run_dir_from_environ() -> Path:
    """The run folder ``HELPERS_TRACE_DIR`` names, made if it is not there yet (every rank of a
    job under torchrun may be first); a clear exit when it is not set."""
    value = os.environ.get(rundir.ENV_DIR)
    if not value:
        sys.exit(f"helpers.trace: set {rundir.ENV_DIR} to the folder for the ranks' records, e.g. "
                 f"{rundir.ENV_DIR}=trace torchrun --nproc-per-node 2 -m helpers.trace train.py")
    run_dir = Path(value)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run_command_rank(argv: list[str], traced: bool) -> NoReturn:
    """Run ``script.py args`` (or ``-m module args``) as ``__main__`` inside a command rank.

    Reads the run folder and rank from the environment (``launch_command`` sets it; under torchrun
    ``HELPERS_TRACE_DIR`` and RANK), installs stack dumps (and the tracer when ``traced``), runs the
    script, records how it ended and ends the process with the script's exit code (an exception
    propagates as usual, after it was recorded).
    """
    run_dir = _run_dir_from_environ()
    rank = int(os.environ.get(rundir.ENV_RANK) or os.environ.get("RANK", "0"))
    stack_handle = install_stack_dump(rundir.stack_path(run_dir, rank), all_threads=not traced)
    if os.environ.get(rundir.ENV_PARENT):  # under helpers.launch
        procs.set_parent_death_signal(int(os.environ[rundir.ENV_PARENT]))
        procs.allow_ptrace_by(int(os.environ[rundir.ENV_PARENT]))
    else:  # under torchrun, which stops ranks with SIGTERM: leave their stacks for a post-mortem
        # every thread's: the kernel hands the signal to any thread, and about 1 stop in 8 it was one
        # of torch's, with no Python frame, so a dump of the interrupted thread alone held nothing.
        # Walking the other threads from the handler can crash the dump while the helper thread
        # runs Python (cpython#116008; see trace.dump_stacks): the rank is being stopped anyway.
        # A second SIGTERM while it writes (torchrun forwarding one the rank got too, as from
        # scancel, which signals every process) ends the dump early: chained, faulthandler's
        # handler takes a nested signal at once (procs.stop_tree stops torchrun first for this)
        faulthandler.register(signal.SIGTERM, file=stack_handle, all_threads=True, chain=True)
        # and stopped the same way when its agent dies without stopping it (SIGKILLed with the
        # notebook kernel that ran it, or by the OOM killer): its workers, in sessions of their
        # own, would otherwise run on, orphaned, holding the port and whatever they wait in. Only
        # under torch's elastic agent (torchrun, accelerate launch), which starts its workers from
        # its main thread: not under a shell that may leave (nohup) or another launcher
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            procs.set_parent_death_signal(os.getppid(), signal.SIGTERM)
    if traced:
        trace.install(run_dir, rank)
    code = _run_as_main(argv, run_dir, rank)
    atexit._run_exitfuncs()  # the script's own exit handlers (logging, trackers) still run
    stack_handle.flush()
    # Recorded: end now, before interpreter teardown, where torch 2.13's gloo aborts in about 1 run
    # in 10 after gather_for_metrics ("terminate called without an active exception") and would
    # turn a finished rank into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_as_main(argv: list[str], run_dir: Path, rank: int) -> int:
    """Run the script or module as ``__main__``; record how it ended; return its exit code."""
    code, error, _exit_call = run_as_main(argv)
    if error is not None:
        formatted = "".join(traceback.format_exception(error))
        rundir.RankOutcome.failure(error, formatted).write(rundir.result_path(run_dir, rank))
        raise error
    if code == 0:
        rundir.RankOutcome(True, 0).write(rundir.result_path(run_dir, rank))
    return code


class Ran(NamedTuple):
    """How a script run as ``__main__`` ended."""

    code: int  # its exit code
    error: BaseException | None  # the exception that escaped it (code 1), never a SystemExit
    exit_call: SystemExit | None  # the SystemExit it ended by (sys.exit(), exit()), its line in its traceback


def run_as_main(argv: list[str]) -> Ran:
    """Run ``script.py args`` (or ``-m module args``) as ``__main__`` and tell the tracer how it
    ended (``trace.finish``)."""
    import runpy

    module = argv[0] == "-m"
    target = argv[1] if module else argv[0]
    sys.argv = argv[1:] if module else list(argv)
    if not module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    error: BaseException | None = None
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except BaseException as exc:  # noqa: BLE001 - the caller re-raises it (SystemExit: its code)
        error = exc
    quiet_child_signals()
    if isinstance(error, SystemExit):
        code = _exit_code(error.code)
        trace.finish("finished" if code == 0 else "exited", exit_call=error)
        return Ran(code, None, error)
    if error is not None:
        trace.finish("raised", error)
        return Ran(1, error, None)
    trace.finish("finished")
    return Ran(0, None, None)


def quiet_child_signals() -> None:
    """The user's code has ended: a SIGCHLD handler it left must not run inside how the rank records
    that end. A DataLoader's raises 'DataLoader worker (pid N) is killed by signal' when one of its
    workers ends (torch/utils/data/_utils/signal_handling.py), and a worker stopped while the rank
    reported its error replaced that error and left no record of the end. Main thread only, where
    Python runs its signal handlers."""
    if threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGCHLD)):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
