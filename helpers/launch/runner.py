"""The launcher: N ranks started, watched and stopped, whatever happens.

``launch`` forks ranks that run a function; ``launch_command`` starts ranks that run a script. Both
share one watch loop (results, failures, the deadline, the watchers) and one cleanup: every rank
and descendant stopped (``helpers.procs``), the run folder removed (``helpers.rundir``), and a
janitor process that does both even when the launcher itself is killed with SIGKILL.

Watchers (``Watcher``) are the extension point: the hang doctor is one, passed in by its caller
(``helpers.doctor.launch``); this module never imports it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from helpers import params, procs, rundir, trace
from helpers.cuda_watch import check_cuda_not_initialized
from helpers.launch.errors import LaunchError, LaunchTimeout, RankError, RankExited
from helpers.launch.rank import STACK_SIGNAL, RankSpec, rank_environment, rank_main

STACK_WAIT_S = 2.0
HELPER_STACK_WAIT_S = 2.0  # a traced rank's helper thread answers in milliseconds unless starved


SilentReader = Callable[[dict[int, int]], dict[int, str]]  # {rank: pid} -> {rank: stack text} it read


class RankProcess(Protocol):
    """One rank's process as the watch loop sees it: a forked ``multiprocessing.Process`` or a
    started command (``CommandProcess``)."""

    pid: int | None

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...


@dataclass
class Run:
    """A run in progress: its ranks, its folder and its clock. Watchers read it each tick."""

    num_processes: int
    run_dir: Path
    started: float
    deadline: float
    processes: dict[int, RankProcess] = field(default_factory=dict)
    exit_codes: dict[int, int | None] = field(default_factory=dict)

    def live_ranks(self) -> list[int]:
        """Ranks whose process is still running."""
        return [rank for rank, proc in self.processes.items() if proc.exitcode is None]

    def stack_file(self, rank: int) -> Path:
        """Where rank ``rank`` appends its Python stacks."""
        return rundir.stack_path(self.run_dir, rank)

    def request_stacks(self, read_silent: SilentReader | None = None) -> dict[int, str]:
        """Ask every live rank for all its threads' Python stacks; return them by rank.

        A traced rank's helper thread writes them itself, holding the GIL. Other ranks, and those
        whose helper has not answered within ``HELPER_STACK_WAIT_S`` (code stuck in C holding the
        GIL, or a starved machine), are read by ``read_silent`` when given (the doctor's: py-spy,
        from outside the process), and the rest get ``STACK_SIGNAL``. The signal is the last
        resort: it interrupts the system call a rank is in (a native ``sleep()`` returns early, and
        the rank runs on), and faulthandler run from a signal handler can crash a process while
        another of its threads runs Python (cpython#116008); in traced ranks it dumps only the
        interrupted (main) thread. What ``read_silent`` read is appended to the rank's stack file.
        """
        ranks = self.live_ranks()
        sizes = {rank: _size(self.stack_file(rank)) for rank in ranks}
        asked = [rank for rank in ranks if trace.ask(self.run_dir, rank, trace.STACKS_REQUEST)]
        _wait_for_growth(self, {rank: sizes[rank] for rank in asked}, HELPER_STACK_WAIT_S)
        silent = {rank: sizes[rank] for rank in ranks if _size(self.stack_file(rank)) == sizes[rank]}
        pids = {rank: self.processes[rank].pid for rank in silent if self.processes[rank].pid}
        for rank, text in (read_silent(pids) if read_silent is not None and pids else {}).items():
            with open(self.stack_file(rank), "a") as handle:
                handle.write(text)
            silent.pop(rank, None)
        for rank in silent:
            procs.send_signal(self.processes[rank].pid, STACK_SIGNAL)
        _wait_for_growth(self, silent, STACK_WAIT_S)
        return {rank: self.stack_file(rank).read_text(errors="replace")[sizes[rank]:] for rank in ranks}


class Watcher:
    """Something that looks at a run each tick (the hang doctor) and may stop it by raising.

    Subclass it and override what you need (any object with a ``poll`` method also works: the
    other hooks are optional). ``wants_trace``: the ranks install the tracer (the
    doctor's record of every collective) before user code.
    """

    wants_trace = False

    def poll(self, run: Run) -> None:
        """Inspect ``run``; raise (a LaunchError subclass) to stop it."""

    def explain(self, run: Run, error: LaunchError) -> LaunchError:
        """When launch itself stops the run (a rank failed, the deadline passed): attach an
        explanation and return the error to raise."""
        return error

    def finish(self, run: Run, results: list[Any]) -> None:
        """After every rank returned; may still raise."""


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
    with _run_folder(num_processes, timeout_s) as run:
        _start_ranks(run, fn, args, kwargs or {}, init_group, backend, timeout_s, env or {},
                     _traced(watchers))
        return _watch(run, watchers, tick_s)


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

    ``command`` is ``["script.py", *args]`` or ``["-m", "module", *args]`` (run by this Python
    through the in-rank bootstrap, ``helpers.launch.rank``: stack dumps, parent-death signal and the
    rank's outcome, plus the tracer when a watcher wants it; the script as ``__main__``), or another
    program (run as is). Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and, without a GPU per rank, ACCELERATE_USE_CPU=true. Same watch loop, deadline, watchers and
    cleanup as ``launch``; returns the ranks' exit codes (all 0; a failure raises as in ``launch``).
    """
    num_processes = params.check("num_processes", num_processes)
    timeout_s = params.check("timeout_s", timeout_s)
    backend = backend or default_backend(num_processes)
    with _run_folder(num_processes, timeout_s) as run:
        _start_commands(run, list(command), backend, env or {}, _traced(watchers))
        return _watch(run, watchers, tick_s)


@contextlib.contextmanager
def _run_folder(num_processes: int, timeout_s: float) -> Iterator[Run]:
    """A run with its folder and janitor; on the way out every rank is stopped and all removed."""
    run_dir = Path(tempfile.mkdtemp(prefix="helpers-run-"))
    now = time.monotonic()
    run = Run(num_processes, run_dir, now, now + timeout_s)
    janitor = start_janitor(run_dir)
    try:
        yield run
    finally:
        stop_ranks(run)
        shutil.rmtree(run_dir, ignore_errors=True)
        for proc in run.processes.values():
            if isinstance(proc, CommandProcess):
                proc.close_sentinel()
        stop_janitor(janitor)


def _traced(watchers: Sequence[Watcher]) -> bool:
    """Does a hang doctor watch (then the ranks record their collectives for it)?"""
    return any(getattr(w, "wants_trace", False) for w in watchers)


def _make_fifos(run: Run, traced: bool) -> None:
    """The run's tmp folder, and the FIFOs on which traced ranks take the doctor's requests."""
    rundir.tmp_dir(run.run_dir).mkdir(exist_ok=True)
    if traced:
        for rank in range(run.num_processes):
            os.mkfifo(rundir.control_path(run.run_dir, rank), 0o600)


_JANITOR = """
import os, shutil, signal, sys
run_dir, prefix = sys.argv[1], sys.argv[2]
sys.stdin.buffer.read()  # EOF: the launcher and every rank holding the pipe have ended
for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
    if name.startswith(prefix):
        try:
            os.kill(int(name[len(prefix):]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
shutil.rmtree(run_dir, ignore_errors=True)
"""


def start_janitor(run_dir: Path) -> subprocess.Popen:
    """A tiny process that removes ``run_dir`` (and kills listed ranks) once the launcher is gone.

    It waits for EOF on a pipe whose write end only the launcher (and its forked ranks) hold, so
    the folder is removed even when the launcher is killed with SIGKILL and cannot clean up.
    """
    return subprocess.Popen([sys.executable, "-S", "-c", _JANITOR, str(run_dir), rundir.PID_PREFIX],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop_janitor(janitor: subprocess.Popen) -> None:
    """Close the janitor's pipe after a normal cleanup and reap it."""
    janitor.stdin.close()  # type: ignore[union-attr]
    janitor.wait(timeout=10)


def _start_ranks(run: Run, fn, args, kwargs, init_group, backend, timeout_s, env, traced=False) -> None:
    context = multiprocessing.get_context("fork")
    port = procs.free_port()
    _make_fifos(run, traced)
    # SIGINT too: a Ctrl-C between a fork and its bookkeeping would leave a rank that no cleanup
    # stops (and multiprocessing's exit joins it forever); held here, it lands after the loop
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL, signal.SIGINT})
    try:
        for rank in range(run.num_processes):
            spec = RankSpec(rank, run.num_processes, port, run.run_dir, os.getpid(), init_group,
                            backend, timeout_s, env, traced)
            proc = context.Process(target=rank_main, args=(spec, fn, args, kwargs),
                                   name=f"helpers-rank-{rank}", daemon=False)
            proc.start()
            run.processes[rank] = proc
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class CommandProcess:
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
        """Close the pidfd (after the run)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def _command_argv(command: list[str], traced: bool) -> list[str]:
    """Python scripts and modules run through the in-rank bootstrap (stack dumps, parent-death
    signal, outcome; the tracer when traced); other programs run as they are."""
    if command and (command[0] == "-m" or command[0].endswith(".py")):
        return [sys.executable, "-m", "helpers.trace" if traced else "helpers.launch", *command]
    return command


def _start_commands(run: Run, command: list[str], backend: str, env: dict[str, str],
                    traced: bool) -> None:
    port = procs.free_port()
    _make_fifos(run, traced)
    argv = _command_argv(command, traced)
    # blocked across fork and exec: a stack request arriving before faulthandler is set up waits
    bootstrapped = argv[:3] == [sys.executable, "-m", "helpers.trace" if traced else "helpers.launch"]
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL}) if bootstrapped else None
    try:
        for rank in range(run.num_processes):
            spec = RankSpec(rank, run.num_processes, port, run.run_dir, os.getpid(), False,
                            backend, 0.0, env, traced)
            rank_env = {**procs.python_env(), **rank_environment(spec),
                        rundir.ENV_DIR: str(run.run_dir), rundir.ENV_RANK: str(rank),
                        rundir.ENV_PARENT: str(os.getpid())}
            popen = subprocess.Popen(argv, env=rank_env, stdin=subprocess.DEVNULL)
            rundir.pid_marker(run.run_dir, popen.pid).touch()  # for the janitor
            run.processes[rank] = CommandProcess(popen)
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
        if hasattr(watcher, "finish"):
            watcher.finish(run, values)
    return values


def _explain(run: Run, watchers: Sequence[Watcher], error: LaunchError) -> LaunchError:
    for watcher in watchers:
        if hasattr(watcher, "explain"):  # a Watcher, or any object with a poll method
            error = watcher.explain(run, error)
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
    outcome = rundir.RankOutcome.read(rundir.result_path(run.run_dir, rank))
    if outcome is None:
        raise RankExited(rank, exit_code)
    if not outcome.ok:
        raise first_error(run.run_dir)
    return outcome.value


def rank_failure(run_dir: Path, rank: int, exit_code: int | None) -> RankError | RankExited | None:
    """The error a rank ended with: RankError (it raised), RankExited (it wrote no outcome: it
    died), None (it returned)."""
    outcome = rundir.RankOutcome.read(rundir.result_path(run_dir, rank))
    if outcome is None:
        return RankExited(rank, exit_code)
    if outcome.ok:
        return None
    return RankError(rank, outcome.exc_type, outcome.message, outcome.traceback)


def first_error(run_dir: Path) -> RankError:
    """The earliest exception among the ranks that reported one: the cause, not its echoes.

    When one rank raises and exits, its peers fail moments later ("Connection closed by peer");
    their reports may be read first, so the time each exception was raised decides. A ValueError
    when no rank reported one.
    """
    errors = []
    for rank in rundir.outcome_ranks(run_dir):
        outcome = rundir.RankOutcome.read(rundir.result_path(run_dir, rank))
        if outcome is not None and not outcome.ok:
            errors.append((outcome.t, rank, outcome))
    if not errors:
        raise ValueError(f"no rank in {run_dir} reported an exception")
    _, rank, outcome = min(errors, key=lambda item: item[:2])
    return RankError(rank, outcome.exc_type, outcome.message, outcome.traceback)


def _timeout_message(run: Run, stacks: dict[int, str]) -> str:
    elapsed = time.monotonic() - run.started
    limit = run.deadline - run.started
    lines = [f"the run passed its deadline (timeout_s={limit:g}; {elapsed:.1f} s elapsed); ranks "
             f"still running: {run.live_ranks()}. Their Python stacks:"]
    for rank, text in sorted(stacks.items()):
        lines.append(f"--- rank {rank} ---\n{text.strip() or '(no stack dumped)'}")
    return "\n".join(lines)


def stop_ranks(run: Run) -> None:
    """Stop every rank and its descendants: SIGTERM, then SIGKILL after ``procs.KILL_GRACE_S``."""
    live = [proc.pid for proc in run.processes.values() if proc.exitcode is None and proc.pid]
    procs.stop_processes(procs.tree_of(live))
    for rank, proc in run.processes.items():
        proc.join(timeout=procs.KILL_GRACE_S)
        run.exit_codes.setdefault(rank, proc.exitcode)
