"""Process lifetime of N ranks started from a notebook or a script.

``launch(fn, num_processes=N)`` forks N ranks (also for one rank), creates a real process group in
each (gloo on machines without GPUs, NCCL where every rank has its own GPU), runs ``fn`` in every
rank and returns the ranks' return values as a list ordered by rank.

Guarantees, whatever happens (success, an exception in a rank, a hang past the deadline, a killed
rank, KeyboardInterrupt in the caller, the caller killed with SIGKILL):
- every rank has SIGINT/SIGTERM at their defaults and dies with its parent (PR_SET_PDEATHSIG);
- each rank's Python stacks can be dumped on request: a traced rank's helper thread writes them
  holding the GIL; otherwise faulthandler on ``STACK_SIGNAL`` (blocked across the fork so an early
  signal cannot kill a rank before the handler is registered);
- the run ends with every child and grandchild gone (SIGTERM, SIGKILL within 2 s), and the run's
  temporary folder removed: torch.distributed's and torchelastic's temporary files go inside it.

Why not accelerate's ``notebook_launcher``: it returns nothing, runs with ``/tmp/torchelastic_*``
left behind, turns Ctrl-C into an exception that ``except Exception`` swallows, and leaves blocked
ranks running when the caller is killed. Notebook 03 still exercises it, in a guarded child.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from helpers import params, trace
from helpers.cuda_watch import CudaInitializedError, check_cuda_not_initialized  # noqa: F401

STACK_SIGNAL = signal.SIGUSR1
KILL_GRACE_S = 2.0
STACK_WAIT_S = 2.0
HELPER_STACK_WAIT_S = 2.0  # a traced rank's helper thread answers in milliseconds unless starved
PG_TIMEOUT_MARGIN_S = 30.0
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------
# errors


class LaunchError(RuntimeError):
    """A distributed run did not complete; ``stacks`` maps rank -> dumped Python stacks.

    ``diagnosis`` is the hang doctor's explanation (``helpers.doctor.Diagnosis``) when it watched.
    """

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = stacks or {}
        self.diagnosis: Any = None


class RankError(LaunchError):
    """A rank raised: names the rank, the exception type and carries its traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n\n{tb}")
        self.rank, self.exc_type, self.exc_message, self.traceback = rank, exc_type, message, tb


class RankExited(LaunchError):
    """A rank ended without returning a result (killed by a signal, os._exit, segfault)."""

    def __init__(self, rank: int, exit_code: int | None):
        super().__init__(f"rank {rank} ended without a result: {describe_exit(exit_code)}")
        self.rank, self.exit_code = rank, exit_code


class LaunchTimeout(LaunchError):
    """The run passed its deadline; every rank's stack was captured before it was stopped."""


def describe_exit(exit_code: int | None) -> str:
    """'exit code 3', 'killed by SIGKILL' (negative codes are signals, as subprocess reports)."""
    if exit_code is None:
        return "still running"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"


# ---------------------------------------------------------------------------------------------
# the run: what a watcher sees


@dataclass
class Run:
    """A run in progress: its ranks, its folder and its clock. Watchers read it each tick."""

    num_processes: int
    run_dir: Path
    started: float
    deadline: float
    processes: dict[int, multiprocessing.Process] = field(default_factory=dict)
    exit_codes: dict[int, int | None] = field(default_factory=dict)

    def live_ranks(self) -> list[int]:
        """Ranks whose process is still running."""
        return [rank for rank, proc in self.processes.items() if proc.exitcode is None]

    def stack_file(self, rank: int) -> Path:
        """Where rank ``rank`` appends its Python stacks."""
        return trace.stack_path(self.run_dir, rank)

    def request_stacks(self) -> dict[int, str]:
        """Ask every live rank for all its threads' Python stacks; return them by rank.

        A traced rank's helper thread writes them itself, holding the GIL. Other ranks, and those
        whose helper has not answered within ``HELPER_STACK_WAIT_S`` (code stuck in C holding the
        GIL, or a starved machine), get ``STACK_SIGNAL``: faulthandler run from a signal handler
        can crash a process while another of its threads runs Python (cpython#116008), so it is
        the fallback, and in traced ranks it dumps only the interrupted (main) thread.
        """
        ranks = self.live_ranks()
        sizes = {rank: _size(self.stack_file(rank)) for rank in ranks}
        asked = [rank for rank in ranks if trace.ask(self.run_dir, rank, trace.STACKS_REQUEST)]
        _wait_for_growth(self, {rank: sizes[rank] for rank in asked}, HELPER_STACK_WAIT_S)
        silent = {rank: sizes[rank] for rank in ranks if _size(self.stack_file(rank)) == sizes[rank]}
        for rank in silent:
            _signal(self.processes[rank].pid, STACK_SIGNAL)
        _wait_for_growth(self, silent, STACK_WAIT_S)
        return {rank: self.stack_file(rank).read_text(errors="replace")[sizes[rank]:] for rank in ranks}


class Watcher(Protocol):
    """Something that looks at a run each tick (the hang doctor) and may stop it by raising.

    Optional hooks: ``explain(run, error) -> LaunchError`` when launch itself stops the run (a rank
    failed, the deadline passed): attach an explanation, return the error to raise;
    ``finish(run, results)`` after every rank returned: may still raise.
    """

    def poll(self, run: Run) -> None:
        """Inspect ``run``; raise (a LaunchError subclass) to stop it."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_for_growth(run: Run, sizes: dict[int, int], wait_s: float) -> None:
    """Wait until each asked rank's stack file grew and stopped growing (faulthandler done)."""
    if not sizes:
        return
    end = time.monotonic() + wait_s
    last = dict(sizes)
    while time.monotonic() < end:
        time.sleep(0.05)
        now = {rank: _size(run.stack_file(rank)) for rank in sizes}
        done = all(now[r] > sizes[r] and now[r] == last[r] for r in sizes)
        if done or all(run.processes[r].exitcode is not None for r in sizes):
            return
        last = now


# ---------------------------------------------------------------------------------------------
# inside a rank


@dataclass
class _RankSpec:
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


def _set_parent_death_signal(parent_pid: int) -> None:
    """Die with the parent (Linux). If the parent already died, die now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _install_stack_dump(path: Path, all_threads: bool = True):
    """faulthandler on STACK_SIGNAL, chaining to a handler already installed (never to SIG_DFL).

    ``all_threads=False`` for traced ranks: their helper thread dumps every thread itself, and the
    signal is only the fallback when it does not answer; walking the other threads from the signal
    handler could segfault while that helper runs Python (cpython#116008).
    """
    handle = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the rank's lifetime
    previous = signal.getsignal(STACK_SIGNAL)
    chain = callable(previous)
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=all_threads, chain=chain)
    faulthandler.enable(file=handle, all_threads=True)  # SIGSEGV, SIGABRT...: the stack, then death
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACK_SIGNAL})
    return handle


def _rank_environment(spec: _RankSpec) -> dict[str, str]:
    env = {
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(spec.rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(spec.num_processes),
        "LOCAL_WORLD_SIZE": str(spec.num_processes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec.port),
        "TMPDIR": str(spec.run_dir / "tmp"),
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


def _init_group(spec: _RankSpec) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
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


def _rank_main(spec: _RankSpec, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _set_parent_death_signal(spec.parent_pid)
    (spec.run_dir / f"pid-{os.getpid()}").touch()
    stack_handle = _install_stack_dump(trace.stack_path(spec.run_dir, spec.rank), not spec.trace)
    os.environ.update(_rank_environment(spec))
    (spec.run_dir / "tmp").mkdir(exist_ok=True)
    tempfile.tempdir = str(spec.run_dir / "tmp")
    _reset_accelerate_state()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if spec.trace:  # the hang doctor's tracer, installed before any user code
        trace.install(spec.run_dir, spec.rank)
    try:
        if spec.init_group:
            _init_group(spec)
        outcome: tuple = ("ok", fn(*args, **kwargs))
        if spec.trace:
            trace.finish("finished")
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        outcome = ("error", type(exc).__name__, str(exc), traceback.format_exc(), time.time())
        if spec.trace:
            trace.finish("raised", exc)
    _write_outcome(spec.run_dir / f"result-{spec.rank}.pkl", outcome)
    _destroy_group()
    stack_handle.close()


def _write_outcome(path: Path, outcome: tuple) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001
        data = pickle.dumps(("error", "PicklingError",
                             f"the rank's return value cannot be sent back: {exc}", "", time.time()))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _destroy_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the rank is ending anyway
            pass


# ---------------------------------------------------------------------------------------------
# in the caller


def free_port() -> int:
    """A TCP port free on loopback now (so two notebooks never collide on 29500)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend(num_processes: int) -> str:
    """'nccl' when this machine has a GPU per rank, else 'gloo'. Never initialises CUDA here.

    The GPU count comes from NVML (pynvml), as ``torch.cuda.device_count`` would initialise the
    CUDA driver in the caller and break forking.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: CPU
        return "gloo"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return "nccl" if count >= num_processes else "gloo"


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    num_processes: int = 2,
    timeout_s: float = 60.0,
    init_group: bool = True,
    backend: str | None = None,
    env: dict[str, str] | None = None,
    watchers: Sequence[Watcher] = (),
    tick_s: float = 0.1,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``num_processes`` forked ranks; return their values by rank.

    ``init_group=False`` starts the ranks without a process group (for code that creates its own,
    such as accelerate's ``notebook_launcher`` in a guarded child). ``env`` adds variables inside
    the ranks. Raises RankError (a rank raised), RankExited (a rank died), LaunchTimeout (past
    ``timeout_s``; carries every rank's stack), CudaInitializedError (refused before forking), or
    whatever a watcher raises; in every case nothing is left running.

    ``watchers`` look at the run each tick (``Watcher``); none by default. The hang doctor is one:
    ``helpers.doctor.launch`` runs ``fn`` under it, and its errors carry ``.diagnosis``.
    """
    num_processes = params.check("num_processes", num_processes)
    timeout_s = params.check("timeout_s", timeout_s)
    check_cuda_not_initialized()
    backend = backend or default_backend(num_processes)
    if init_group:
        import torch.distributed  # noqa: F401 - imported once here, not once per forked rank
    run_dir = Path(tempfile.mkdtemp(prefix="helpers-run-"))
    now = time.monotonic()
    run = Run(num_processes, run_dir, now, now + timeout_s)
    janitor = start_janitor(run_dir)
    try:
        _start_ranks(run, fn, args, kwargs or {}, init_group, backend, timeout_s, env or {},
                     _traced(watchers))
        return _watch(run, watchers, tick_s)
    finally:
        stop_ranks(run)
        shutil.rmtree(run_dir, ignore_errors=True)
        stop_janitor(janitor)


def launch_command(
    command: Sequence[str],
    *,
    num_processes: int = 2,
    timeout_s: float = 3600.0,
    env: dict[str, str] | None = None,
    watchers: Sequence[Watcher] = (),
    tick_s: float = 0.1,
    backend: str | None = None,
) -> list[int]:
    """Run a command as ``num_processes`` local ranks with the environment torchrun gives.

    ``command`` is ``["script.py", *args]`` or ``["-m", "module", *args]`` (run by this Python with
    the tracer and stack dumps installed first, the script as ``__main__``), or another program (run
    as is). Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    and, without a GPU per rank, ACCELERATE_USE_CPU=true. Same watch loop, deadline, watchers and
    cleanup as ``launch``; returns the ranks' exit codes (all 0; a failure raises as in ``launch``).
    """
    num_processes = params.check("num_processes", num_processes)
    timeout_s = params.check("timeout_s", timeout_s)
    backend = backend or default_backend(num_processes)
    run_dir = Path(tempfile.mkdtemp(prefix="helpers-run-"))
    now = time.monotonic()
    run = Run(num_processes, run_dir, now, now + timeout_s)
    janitor = start_janitor(run_dir)
    try:
        _start_commands(run, list(command), backend, env or {}, _traced(watchers))
        return _watch(run, watchers, tick_s)
    finally:
        stop_ranks(run)
        shutil.rmtree(run_dir, ignore_errors=True)
        for proc in run.processes.values():
            proc.close_sentinel()  # type: ignore[attr-defined]
        stop_janitor(janitor)


def _traced(watchers: Sequence[Watcher]) -> bool:
    """Does a hang doctor watch (then the ranks record their collectives for it)?"""
    return any(getattr(w, "wants_trace", False) for w in watchers)


def _make_fifos(run: Run, traced: bool) -> None:
    """The run's tmp folder, and the FIFOs on which traced ranks take the doctor's requests."""
    (run.run_dir / "tmp").mkdir(exist_ok=True)
    if traced:
        for rank in range(run.num_processes):
            os.mkfifo(run.run_dir / f"ctl-{rank}", 0o600)


_JANITOR = """
import os, shutil, signal, sys
run_dir = sys.argv[1]
sys.stdin.buffer.read()  # EOF: the launcher and every rank holding the pipe have ended
for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
    if name.startswith("pid-"):
        try:
            os.kill(int(name[4:]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
shutil.rmtree(run_dir, ignore_errors=True)
"""


def start_janitor(run_dir: Path) -> subprocess.Popen:
    """A tiny process that removes ``run_dir`` (and kills listed ranks) once the launcher is gone.

    It waits for EOF on a pipe whose write end only the launcher (and its forked ranks) hold, so
    the folder is removed even when the launcher is killed with SIGKILL and cannot clean up.
    """
    return subprocess.Popen([sys.executable, "-S", "-c", _JANITOR, str(run_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop_janitor(janitor: subprocess.Popen) -> None:
    """Close the janitor's pipe after a normal cleanup and reap it."""
    janitor.stdin.close()  # type: ignore[union-attr]
    janitor.wait(timeout=10)


def _start_ranks(run: Run, fn, args, kwargs, init_group, backend, timeout_s, env, traced=False) -> None:
    context = multiprocessing.get_context("fork")
    port = free_port()
    _make_fifos(run, traced)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL})
    try:
        for rank in range(run.num_processes):
            spec = _RankSpec(rank, run.num_processes, port, run.run_dir, os.getpid(), init_group,
                             backend, timeout_s, env, traced)
            proc = context.Process(target=_rank_main, args=(spec, fn, args, kwargs),
                                   name=f"helpers-rank-{rank}", daemon=False)
            proc.start()
            run.processes[rank] = proc
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class _CommandProcess:
    """A rank started as a command, with the parts of multiprocessing.Process the watch loop uses."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close_sentinel(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def _command_argv(command: list[str], traced: bool) -> list[str]:
    if command and (command[0] == "-m" or command[0].endswith(".py")):
        return [sys.executable, "-m", "helpers.trace", *command] if traced else [sys.executable, *command]
    return command


def _start_commands(run: Run, command: list[str], backend: str, env: dict[str, str],
                    traced: bool) -> None:
    port = free_port()
    _make_fifos(run, traced)
    argv = _command_argv(command, traced)
    package_root = str(Path(__file__).resolve().parent.parent)
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    # blocked across fork and exec: a stack request arriving before faulthandler is set up waits
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL}) if traced else None
    try:
        for rank in range(run.num_processes):
            spec = _RankSpec(rank, run.num_processes, port, run.run_dir, os.getpid(), False,
                             backend, 0.0, env, traced)
            rank_env = {**os.environ, **_rank_environment(spec), "PYTHONPATH": python_path,
                        "HELPERS_TRACE_DIR": str(run.run_dir), "HELPERS_TRACE_RANK": str(rank),
                        "HELPERS_PARENT_PID": str(os.getpid())}
            popen = subprocess.Popen(argv, env=rank_env, stdin=subprocess.DEVNULL)
            (run.run_dir / f"pid-{popen.pid}").touch()  # for the janitor
            run.processes[rank] = _CommandProcess(popen)  # type: ignore[assignment]
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _watch(run: Run, watchers: Sequence[Watcher], tick_s: float) -> list[Any]:
    """The one watch loop: results, failures, deadline and watchers (the hang doctor).

    A failure launch notices itself goes through the watchers' ``explain`` first; after a run
    that went well, their ``finish``.
    """
    try:
        values = _watch_loop(run, watchers, tick_s)
    except LaunchError as error:
        if error.diagnosis is not None:
            raise
        explained = _explain(run, watchers, error)
        if explained is error:
            raise
        raise explained from None
    for watcher in watchers:
        finish = getattr(watcher, "finish", None)
        if finish is not None:
            finish(run, values)
    return values


def _explain(run: Run, watchers: Sequence[Watcher], error: LaunchError) -> LaunchError:
    for watcher in watchers:
        explain = getattr(watcher, "explain", None)
        if explain is not None:
            error = explain(run, error)
    return error


def _watch_loop(run: Run, watchers: Sequence[Watcher], tick_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    pending = dict(run.processes)
    while pending:
        remaining = run.deadline - time.monotonic()
        if remaining <= 0:
            stacks = run.request_stacks()
            raise LaunchTimeout(_timeout_message(run, stacks), stacks)
        sentinels = {proc.sentinel: rank for rank, proc in pending.items()}
        ready = multiprocessing.connection.wait(list(sentinels), timeout=min(remaining, tick_s))
        for sentinel in ready:
            rank = sentinels[sentinel]
            proc = pending.pop(rank)
            proc.join()
            run.exit_codes[rank] = proc.exitcode
            results[rank] = _read_outcome(run, rank, proc.exitcode)
        for watcher in watchers:
            watcher.poll(run)
    return [results[rank] for rank in range(run.num_processes)]


def _read_outcome(run: Run, rank: int, exit_code: int | None) -> Any:
    path = run.run_dir / f"result-{rank}.pkl"
    if not path.exists():
        raise RankExited(rank, exit_code)
    outcome = pickle.loads(path.read_bytes())
    if outcome[0] == "error":
        raise _first_error(run)
    return outcome[1]


def _first_error(run: Run) -> RankError:
    """The earliest exception among the ranks that reported one: the cause, not its echoes.

    When one rank raises and exits, its peers fail moments later ("Connection closed by peer");
    their reports may be read first, so the time each exception was raised decides.
    """
    errors = []
    for path in run.run_dir.glob("result-*.pkl"):
        outcome = pickle.loads(path.read_bytes())
        if outcome[0] == "error":
            rank = int(path.stem.split("-")[1])
            errors.append((outcome[4], rank, outcome[1:4]))
    _, rank, (exc_type, message, tb) = min(errors)
    return RankError(rank, exc_type, message, tb)


def _timeout_message(run: Run, stacks: dict[int, str]) -> str:
    elapsed = time.monotonic() - run.started
    limit = run.deadline - run.started
    lines = [f"the run passed its deadline (timeout_s={limit:g}; {elapsed:.1f} s elapsed); ranks "
             f"still running: {run.live_ranks()}. Their Python stacks:"]
    for rank, text in sorted(stacks.items()):
        lines.append(f"--- rank {rank} ---\n{text.strip() or '(no stack dumped)'}")
    return "\n".join(lines)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_ranks(run: Run) -> None:
    """Stop every rank and its descendants: SIGTERM, then SIGKILL after ``KILL_GRACE_S``."""
    import psutil

    victims: list[psutil.Process] = []
    for proc in run.processes.values():
        if proc.exitcode is None:
            try:
                parent = psutil.Process(proc.pid)
                victims += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    for victim in victims:
        _quietly(victim.terminate)
    _, alive = psutil.wait_procs(victims, timeout=KILL_GRACE_S)
    for victim in alive:
        _quietly(victim.kill)
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    for rank, proc in run.processes.items():
        proc.join(timeout=KILL_GRACE_S)
        run.exit_codes.setdefault(rank, proc.exitcode)


def _quietly(action: Callable[[], Any]) -> None:
    import psutil

    try:
        action()
    except psutil.NoSuchProcess:
        pass
