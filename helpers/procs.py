"""Process-tree lifetime: children die with their parent, and a tree is stopped whole.

Used by every place that starts processes: ``helpers.launch`` (forked and exec'd ranks), the repro
builder's runs, and torchrun runs under the doctor. torchrun starts its workers in sessions of
their own (``start_new_session=True``), so stopping torchrun alone can leave them running: the
tree is walked (psutil) and every member stopped, SIGTERM first, SIGKILL after ``KILL_GRACE_S``.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from helpers import params

KILL_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1
_PR_SET_PTRACER = 0x59616D61  # Yama's prctl ('Yama')


def set_parent_death_signal(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Get ``sig`` (SIGKILL) when the parent dies, Linux's PR_SET_PDEATHSIG. If the parent already
    died, die now.

    Call it in the child: a forked rank, or a started program that knows its parent's pid.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def allow_ptrace_by(pid: int) -> None:
    """Let process ``pid`` and its descendants read this process with ptrace (py-spy), where
    Yama's ``kernel.yama.ptrace_scope`` is 1 (Ubuntu's default), which otherwise allows only this
    process's own ancestors. The launcher's (or torchrun agent's) descendants are the doctor's
    py-spy and the job's other ranks, the same user's processes. Nothing where Yama is not loaded
    (prctl fails) or forbids it (scope 2 or 3); root needs no leave."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, int(pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def death_signal_preexec() -> Callable[[], Any] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child die with the caller.

    Prepared in the caller: between fork and exec the child only makes one ctypes call (no import,
    no lock), which keeps it safe when the caller has threads. None where prctl is not available.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def send_signal(pid: int, sig: int) -> None:
    """``os.kill`` that ignores a process that is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tree_of(pids: Iterable[int]) -> list[Any]:
    """The processes ``pids`` and all their descendants (psutil objects), this process excluded."""
    import psutil

    members: list[psutil.Process] = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            members += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return [member for member in members if member.pid != os.getpid()]


def stop_processes(victims: list[Any], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM every process in ``victims``, SIGKILL those still alive after ``grace_s``; wait."""
    import psutil

    for victim in victims:
        _quietly(victim.terminate)
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for victim in alive:
        _quietly(victim.kill)
    psutil.wait_procs(alive, timeout=grace_s)


def stop_tree(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S, forwards: bool = False) -> None:
    """Stop ``proc`` and all its descendants (see ``stop_processes``), then reap ``proc``.

    ``forwards``: ``proc`` stops its own children on SIGTERM (torchrun's agent does). It alone is
    signalled first, and what is left of its tree ``grace_s`` later: a child signalled by both
    would get its second SIGTERM a few milliseconds after the first, as faulthandler writes its
    stack, and die with the dump cut short (the chained handler takes a nested signal at once).
    """
    victims = tree_of([proc.pid])  # before the root may end: its children then belong to nobody
    if forwards and victims and victims[0].pid == proc.pid:
        import psutil

        _quietly(victims[0].terminate)
        psutil.wait_procs(victims[:1], timeout=grace_s)
        victims = [victim for victim in victims if victim.is_running()]
    stop_processes(victims, grace_s)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _quietly(action: Callable[[], Any]) -> None:
    import psutil

    try:
        action()
    except psutil.NoSuchProcess:
        pass


def run_process(argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
                cwd: str | Path | None = None, forwards: bool = False) -> tuple[int | None, str, float]:
    """Run ``argv``; return (exit code, or None past the deadline; its output; seconds).

    The child dies with the caller (PR_SET_PDEATHSIG). Past ``timeout_s``, or on KeyboardInterrupt
    (re-raised), the child and every descendant are stopped (``stop_tree``; ``forwards``: the
    child stops its own children on SIGTERM, as torchrun does).
    """
    [(code, output, seconds)] = Started([argv], env, [cwd], forwards).wait(timeout_s)
    return code, output, seconds


def run_processes(argvs: list[list[str]], timeout_s: float, env: dict[str, str] | None = None,
                  cwds: list[str | Path | None] | None = None) -> list[tuple[int | None, str, float]]:
    """Run several programs at once (one job's agents, one per node); each as ``run_process``:
    (exit code or None past the shared deadline, output, seconds until it ended)."""
    return Started(argvs, env, cwds).wait(timeout_s)


class Started:
    """Programs started together, each dying with the caller, their output kept in temp files."""

    def __init__(self, argvs: list[list[str]], env: dict[str, str] | None = None,
                 cwds: list[str | Path | None] | None = None, forwards: bool = False):
        self.t0 = time.monotonic()
        self.forwards = forwards  # each program stops its own children on SIGTERM (``stop_tree``)
        self.sinks = [tempfile.TemporaryFile() for _ in argvs]
        self.procs: list[subprocess.Popen] = []
        try:
            for argv, cwd, sink in zip(argvs, cwds or [None] * len(argvs), self.sinks, strict=True):
                self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sink,
                                                   stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                                   preexec_fn=death_signal_preexec()))
        except BaseException:
            self._finish({})
            raise

    def wait(self, timeout_s: float) -> list[tuple[int | None, str, float]]:
        """Wait until all ended or ``timeout_s`` (from the start) passed; stop the rest with their
        trees (also on KeyboardInterrupt, re-raised). (exit code or None, output, seconds) each."""
        ended: dict[int, tuple[int | None, float]] = {}
        try:
            deadline = self.t0 + timeout_s
            while len(ended) < len(self.procs) and time.monotonic() < deadline:
                for index, proc in enumerate(self.procs):
                    if index not in ended and proc.poll() is not None:
                        ended[index] = (proc.returncode, time.monotonic() - self.t0)
                running = [p for i, p in enumerate(self.procs) if i not in ended]
                if running:
                    try:  # a bounded wait on one that runs; the others are polled again after it
                        running[0].wait(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
        finally:
            for index, proc in enumerate(self.procs):  # reaped by the last bounded wait
                if index not in ended and proc.poll() is not None:
                    ended[index] = (proc.returncode, time.monotonic() - self.t0)
            outputs = self._finish(ended)
        now = time.monotonic() - self.t0
        return [(ended[i][0] if i in ended else None, outputs[i], round(ended.get(i, (None, now))[1], 3))
                for i in range(len(self.procs))]

    def _finish(self, ended: dict[int, Any]) -> list[str]:
        for index, proc in enumerate(self.procs):
            if index not in ended:  # still running (deadline, Ctrl-C): never after a wait reaped it
                stop_tree(proc, forwards=self.forwards)
        outputs = []
        for sink in self.sinks:
            sink.seek(0)
            outputs.append(sink.read().decode("utf-8", errors="replace"))
            sink.close()
        return outputs


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the repository importable, so ``python -m helpers...`` runs from any
    folder (a child's working folder is often the user's script's)."""
    path = os.pathsep.join(filter(None, [str(params.REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


PORT_FLOOR = 20000  # free_port's ports lie between this and the kernel's ephemeral range


def free_port() -> int:
    """A TCP port free on loopback now (so two notebooks never collide on 29500), below the kernel's
    ephemeral range: the kernel gives ports of that range to every outgoing connection (a gloo
    pair's, a store client's), and one of another job took such a port between this check and
    torchrun's bind (EADDRINUSE, once in a test run of parallel jobs)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(PORT_FLOOR, low) if low > PORT_FLOOR else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken, or still in TIME_WAIT: another
                continue
            return sock.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # none free below the range
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
