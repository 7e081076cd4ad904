"""The doctor inside a job it did not start: ``torchrun ... -m helpers.doctor train.py`` (also under
``accelerate launch`` and ``srun ... torchrun``), across nodes, live.

Each rank runs the script as ``__main__`` under the tracer (``helpers.trace``, records kept in
memory) and a watchdog thread. The watchdogs talk through the job's own c10d store
(``helpers.doctor.board``): every ``TICK_S`` each posts a heartbeat (where it is, how long it has
waited in a collective, its open collectives, how it ended) and acts on the leader's requests.

The lowest rank whose watchdog still ticks leads. It diagnoses, with the same reasoning as the local
doctor (``diagnose()``), when

- some rank has waited ``stall_s`` in a collective while no rank completed one (a hang);
- a rank raised or exited non-zero, or died without a word (a crash); the rank that raised waits
  for the verdict before it exits, so the others are still there to be asked;
- a rank finished while another waits in a collective it never issued (rank missing);
- every rank finished: their collectives are compared (a mismatch exits 5).

It asks every rank for its state (main-thread stack, Flight Recorder tail, latest records), waits
at most ``EVIDENCE_WAIT_S`` (beating meanwhile, so nobody takes over), reads the ranks of its own
machine that did not answer with py-spy (``PY_SPY_S``; native code holding the GIL), places the
others from their last heartbeat, prints the diagnosis on its stderr and writes the JSON
(``--json``, the doctor's schema). The first verdict posted wins. With ``--on-hang stop`` (the
default) every rank then ends with the doctor's exit code (3 hang, 4 crash, 5 mismatch) once every
rank that still ticks knows it, so every node's agent stops within seconds.

A rank stopped by SIGTERM (its agent tearing the job down, or its agent gone: the parent-death
signal) says so in its heartbeat and names the ranks of its machine that vanished without a word,
then leaves; the leader judges those as killed (e.g. by the OOM killer). A script's own SIGTERM
handler decides for itself; a script's ``os._exit`` first says how the rank ended; forked children
(DataLoader workers) keep none of this. "This machine" is the host name, the boot and the PID
namespace; a pid is the rank's only with the rank's start time.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from helpers import procs, redact, report, rundir, trace
from helpers.collectives import INIT_OP
from helpers.doctor import pyspy, software, wording
from helpers.doctor.board import SILENT_S, Board, Seen
from helpers.doctor.diagnosis import EXIT_CODES, Diagnosis, is_comm_error
from helpers.doctor.leader import (
    EVIDENCE_WAIT_S,
    create_time,
    diagnose_answers,
    is_gone,
    machine_id,
    py_spy_stacks,
    should_diagnose,
    still_runs,
)
from helpers.doctor.loading import ImportWatch, LookNotes, stall_ended, stall_ended_note
from helpers.doctor.records import RankView, fold

TICK_S = 0.25  # how often a watchdog posts its heartbeat and reads the leader's keys
STOP_ACK_S = 2.0  # on a stop, each rank waits at most this long for every rank to know it
LINGER_S = EVIDENCE_WAIT_S + SILENT_S + 4 * TICK_S  # an ended rank waits this long for a verdict
ATEXIT_S = 5.0  # the script's exit handlers, when the doctor ends a rank from its watchdog
CHILDREN_GRACE_S = 1.0  # a rank's own child processes, when the doctor ends it: SIGTERM, then SIGKILL
HOLD_S = 4 * TICK_S  # after a look that found nothing wrong: every rank has beaten again since
STORE_FAILURES = 3  # store calls that time out in a row before a watchdog gives up
CONNECT_S = 120.0  # reaching the job's store (hosted by rank 0 itself when there is no agent)
FLUSH_WAIT_S = 0.5  # an answer waits this long at most for the helper thread's write under way
KEPT_RECORDS = 256  # trace records kept for an answer
PUNCH_BYTES = 1 << 20  # the in-memory trace gives back what was read in steps of this much


@dataclass
class JobEnv:
    """What a launcher tells a rank: its rank, the world, where the job's store is."""

    rank: int
    world: int
    master_addr: str
    master_port: int
    run_id: str
    restart: str
    max_restarts: int = 0  # torchrun's --max-restarts: the attempts after the first it may start
    node: int | None = None  # its node's rank in the job (GROUP_RANK: torchrun's --node-rank)

    @classmethod
    def from_environ(cls, env: dict[str, str] | os._Environ) -> JobEnv | None:
        """The launcher's variables (torchrun, accelerate launch); None outside a launcher."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(env.get(name) for name in names):
            return None
        restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
        node = env.get("GROUP_RANK", "")
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                   env.get("TORCHELASTIC_RUN_ID", "job"), env.get("TORCHELASTIC_RESTART_COUNT", "0"),
                   int(restarts) if restarts.isdigit() else 0, int(node) if node.isdigit() else None)


def attempt_path(json_path: str | Path, restart: str) -> Path:
    """Where a run's diagnosis is also kept when torchrun may restart the job: ``doctor.json`` ->
    ``doctor.restart-0.json`` for the first run (often the cause; a restart's may be its aftermath)."""
    path = Path(json_path)
    return path.with_name(f"{path.stem}.restart-{restart}{path.suffix}")


@dataclass
class JobOptions:
    """The doctor's options inside a job (``python -m helpers.doctor --help``)."""

    stall_s: float
    json_path: Path | None
    keep_dir: Path | None
    on_hang: str  # stop | report


def run_rank(job: JobEnv, options: JobOptions, command: list[str]) -> NoReturn:
    """Run ``command`` (``script.py args`` or ``-m module args``) as this rank, watched; never returns."""
    from helpers.launch.rank import run_as_main

    parent = os.getppid()
    procs.allow_ptrace_by(parent)  # the agent's descendants: the leader's py-spy reads a silent rank
    if not faulthandler.is_enabled():  # a fatal signal (gloo's abort, a segfault) prints where Python was:
        # every thread's stack, since gloo aborts from its own thread, which has no Python frame (the
        # trade-off helpers.launch.rank makes too: reading other threads' frames from the handler can
        # crash the dump in rare cases, cpython#116008; the rank was dying anyway)
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    if options.keep_dir is not None:
        options.keep_dir.mkdir(parents=True, exist_ok=True)
        rundir.clear_rank_record(options.keep_dir, job.rank)
    tracer = trace.install(options.keep_dir, job.rank)
    if options.keep_dir is None:  # the records' in-memory file, read back through its own descriptor
        reader = os.dup(tracer.fd)
    else:  # the tracer's file is open for appending only
        reader = os.open(rundir.trace_path(options.keep_dir, job.rank), os.O_RDONLY)
    watchdog = Watchdog(job, options, reader, parent, tracer, command)
    watchdog.start()
    _share_temp_folder()
    _SWEEPS.append(watchdog.remove_vanished_folders)
    os._exit = watchdog.script_exits  # type: ignore[assignment] - a script's own os._exit says so first
    code, error, exit_call = run_as_main(command)
    watchdog.ended(_exit_record(code, error, exit_call))  # before the traceback: SIGTERM may come meanwhile
    said = _said(error) if error is not None else ""
    if error is not None and watchdog.stop_code is not None and _stop_echo(said):
        print(f"doctor: rank {job.rank}'s script then failed as the other ranks left on the doctor's stop "
              f"({said})", file=sys.stderr)
    elif error is not None:
        traceback.print_exception(error)
    watchdog.wait_for_verdict()
    alone = watchdog.ran_alone() if code == 0 else None
    if alone:  # one line per node
        print(f"doctor: note: {wording.RAN_ALONE.format(rank=job.rank, world=job.world, why=alone)}",
              file=sys.stderr)
    # a script that ended because the doctor stopped the job (its collective failed as the other
    # ranks left) leaves as a rank the watchdog ends: with the processes it started
    _leave(watchdog.code_after_end(code), from_main=True, stop_children=watchdog.stop_code is not None)


def _group_is_up() -> bool:
    """Is this process's default process group up now?"""
    import torch.distributed as dist  # imported by the tracer already

    return dist.is_available() and dist.is_initialized()


def _accelerate_processes() -> int | None:
    """The number of processes accelerate's state holds, if the script made one."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}
    return shared.get("num_processes")


def _exit_record(code: int, error: BaseException | None,
                 exit_call: SystemExit | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"ev": "exit", "t": time.time(), "code": code,
                              "status": "raised" if error else ("finished" if code == 0 else "exited")}
    record.update(trace.exit_fields(exit_call))  # where sys.exit() was called (an early stop inside a loop)
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C: stopped on purpose, not a crash to diagnose
        record.update(status="stopped", by="Ctrl-C (KeyboardInterrupt)")
    elif error is not None:
        record.update(trace.error_fields(error))
        record["error"] = redact.redact_text(record["error"])
    return record


_TEMP_FOLDER: list[tuple[int, str]] = []  # (this rank's pid, its multiprocessing folder)
_SWEEPS: list[Any] = []  # called as the rank leaves: the watchdog's removal of dead ranks' folders


def _share_temp_folder() -> None:
    """Make this rank's multiprocessing folder (``pymp-*``, where its sockets go) now, before the
    script starts a process: the processes it starts (DataLoader workers, forked or spawned) take
    it over instead of making their own. Each makes its own otherwise, on the first tensor it sends,
    and only its exit handlers remove it, which a worker stopped by SIGTERM never runs: a job the
    doctor stopped left one folder per worker. This rank removes it as it leaves, whoever stops it
    (``_remove_temp_folder``); a rank killed by SIGKILL cannot, and a rank of its machine that
    leaves after it removes it (``Watchdog.remove_vanished_folders``; its heartbeat names it)."""
    import multiprocessing.util

    try:
        _TEMP_FOLDER.append((os.getpid(), multiprocessing.util.get_temp_dir()))
    except OSError:  # no writable temp folder: the script will say so itself if it needs one
        pass


def _own_temp_folder() -> str | None:
    """This process's multiprocessing folder, made by ``_share_temp_folder``; None in another."""
    return next((folder for owner, folder in _TEMP_FOLDER if owner == os.getpid()), None)


def _remove_temp_folder() -> None:
    """Remove this rank's multiprocessing folder (``_share_temp_folder``), once its children are gone,
    and those of its machine's ranks that died without removing theirs."""
    folder = _own_temp_folder()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        for sweep in _SWEEPS:
            try:
                sweep()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass


def _end_now(code: int) -> NoReturn:
    """End at once: SIGTERM came while this thread was itself ending the process, waiting for the
    script's threads or running its exit handlers (an upload at exit that hangs). The handler runs
    inside that wait; waiting for it there would wait for itself until torchrun's SIGKILL, 30 s
    later. Without the doctor, SIGTERM would have ended the process then too."""
    trace.settle()
    sys.stdout.flush()
    sys.stderr.flush()
    _remove_temp_folder()
    _EXIT(code)


_EXIT = os._exit  # the real one: the script's is wrapped (``Watchdog.script_exits``)
_LEAVING = threading.Lock()
_LEAVER: list[int] = []  # the thread that holds _LEAVING


def _leave(code: int, from_main: bool = False, stop_children: bool = False) -> NoReturn:
    """End the process: exit handlers, flushed streams, no interpreter teardown (see
    ``helpers.launch.rank.run_command_rank``: gloo can abort in it). Once: a second caller waits.

    ``from_main`` (the script ended): first wait for the script's non-daemon threads, as Python's
    own exit does (an async checkpoint writer). From the watchdog (the doctor ends a stuck rank)
    the exit handlers get ``ATEXIT_S``, then the processes the rank started are stopped
    (``stop_own_children``); from the main thread too with ``stop_children`` (the doctor stopped
    the job, and the script's collective failed first: a rank's children outlive it otherwise, as
    torchrun signals only the ranks still running).
    """
    if not _LEAVING.acquire(blocking=False):
        if _LEAVER and _LEAVER[0] == threading.get_ident():
            _end_now(code)  # SIGTERM's handler inside this thread's own leaving (see ``_end_now``)
        threading.Event().wait()  # the first caller ends the process
    _LEAVER.append(threading.get_ident())
    if from_main:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        if stop_children:
            stop_own_children()
    else:
        handlers = threading.Thread(target=atexit._run_exitfuncs, daemon=True)
        handlers.start()
        handlers.join(ATEXIT_S)
        stop_own_children()
    trace.flush(wait=from_main)  # with --keep: the last calls on file (the watchdog never waits)
    trace.settle()  # no state file cut off before its rename
    sys.stdout.flush()
    sys.stderr.flush()
    _remove_temp_folder()
    _EXIT(code)


def stop_own_children() -> None:
    """Stop every process this rank started (a script's helper process, DataLoader workers) that is
    still running, SIGTERM first (``CHILDREN_GRACE_S``).

    Without the doctor, torchrun's agent ends a stuck job with ``os.killpg`` of each worker's
    process group, which takes the worker's children along; but it signals only the workers still
    running, and a rank the doctor ends has exited by then: its children would run on under PID 1.
    """
    try:
        procs.stop_processes(procs.tree_of([os.getpid()]), CHILDREN_GRACE_S)
    except Exception:  # noqa: BLE001 - leaving anyway
        pass


class Watchdog(threading.Thread):
    """One rank's watchdog: heartbeats, answers, and the leader's work when this rank leads."""

    def __init__(self, job: JobEnv, options: JobOptions, trace_fd: int, parent: int, tracer: Any = None,
                 command: list[str] | None = None):
        super().__init__(name="helpers-doctor", daemon=True)
        self.job, self.options, self.trace_fd, self.parent = job, options, trace_fd, parent
        self.tracer = tracer  # helpers.trace's Tracer of this rank: told to post first calls
        # what the rank runs (script.py args, or -m module args): the script's path made absolute
        # now, before the script can change the working folder
        self.command = [os.path.abspath(command[0]), *command[1:]] if command and command[0] != "-m" \
            else list(command or [])
        self.view = RankView(job.rank)
        self.records: deque = deque(maxlen=KEPT_RECORDS)
        self.host = socket.gethostname()
        self.machine = machine_id(self.host)  # "same machine" is this, not the host name alone
        self.born = create_time(os.getpid())
        self.board: Board | None = None
        self.failures = 0  # store calls that failed in a row
        self.punched = 0  # bytes of the in-memory trace already read and given back
        self.beats = 0
        self.site: dict[str, Any] | None = None  # the main thread's user line at the latest beat
        self.exit: dict[str, Any] | None = None
        self.exit_mono: float | None = None
        self.answered = 0
        self.hold_until = 0.0  # the leader's next look, after a trigger that found nothing wrong
        self.imports = ImportWatch()  # a stall while a rank imports is looked at again (loading.py)
        self.stall_hold_until = 0.0  # when that look comes (a failure is not held for it)
        self.looked_again = LookNotes()  # the notes of those looks, for the diagnosis
        self.decided = threading.Event()  # a verdict exists (or the store is gone): ended ranks leave
        self.verdict: dict[str, Any] | None = None
        self.signalled: int | None = None
        self.stop_code: int | None = None  # the doctor's exit code, once a stop is under way
        self.lock = threading.Lock()
        self.exit_posted = threading.Event()  # a heartbeat carrying this rank's end was posted
        self.settled = threading.Event()  # joined the job's store, or gave up reaching it
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self._watch_signals()

    # -- signals ----------------------------------------------------------------------------

    def _watch_signals(self) -> None:
        """SIGTERM (torchrun stopping the job; the parent-death signal when the agent dies) wakes this
        thread at once, even while the main thread waits in C++ and cannot run a Python handler."""
        from helpers import procs

        self.pid = os.getpid()
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        procs.set_parent_death_signal(self.parent, signal.SIGTERM)
        # SIGTERM is blocked across a fork, so that a child stopped before it ran a line (as
        # multiprocessing's terminate() can) never writes into this rank's wakeup pipe
        term = {signal.SIGTERM}
        os.register_at_fork(before=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, term),
                            after_in_parent=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, term),
                            after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        """A forked child (a DataLoader worker) is not the rank: its SIGTERM is its own, not written
        into this rank's wakeup pipe, and ends it at once, as if the doctor were not there (what the
        script itself set before the fork stays)."""
        os._exit = _EXIT
        if self.tracer is not None:  # the store's connection is the rank's
            self.tracer.on_first = None
        try:
            previous = signal.set_wakeup_fd(-1)
            if previous != self.wake_write:
                signal.set_wakeup_fd(previous)
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread: signals are the main thread's to set
            pass
        for fd in (self.wake_read, self.wake_write, self.trace_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a pending one now ends it

    def script_exits(self, code: int) -> NoReturn:
        """The script's ``os._exit(code)``: say how this rank ends (bounded), then end it."""
        trace.flush()  # its last calls, for --keep and the heartbeat below
        if os.getpid() == self.pid and self.board is not None:
            with self.lock:
                if self.exit is None:
                    self.exit = {"ev": "exit", "t": time.time(), "code": code,
                                 "status": "finished" if code == 0 else "exited"}
                    self.exit_mono = time.monotonic()
            self.exit_posted.wait(2 * TICK_S + 1)
        trace.settle()
        _remove_temp_folder()
        _EXIT(code)

    def _on_sigterm(self, signum: int, frame: Any) -> None:  # the main thread, when it can
        if os.getpid() != self.pid:  # a child forked from a thread, which kept this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signalled = signum
        self.decided.wait(LINGER_S + 1)
        _leave(self.stop_code or 128 + signum)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._connect()
        except Exception as exc:  # noqa: BLE001 - no store: the job runs unwatched, as without us
            self._give_up(f"cannot reach the job's store at {self.job.master_addr}:{self.job.master_port} "
                          f"({exc}); this rank is not watched")
        while True:
            self._wait_tick()
            try:
                self._tick()
                self.failures = 0
            except Exception as exc:  # noqa: BLE001 - mostly: the store went away with its host (an agent)
                self.failures += 1
                if _connection_lost(exc) or self.failures >= STORE_FAILURES:
                    where = f"{self.job.master_addr}:{self.job.master_port}"
                    error = wording.short_error(f"{type(exc).__name__}: {exc}")  # not torch's C++ frames
                    self._give_up(f"stopped watching ({error}; the job's store at {where} may have gone "
                                  "with its agent)")

    def _give_up(self, why: str) -> NoReturn:
        """No store: say so once, let ended ranks leave, and still end this rank on SIGTERM (the main
        thread may wait in C++, where the Python handler never runs)."""
        print(f"doctor: rank {self.job.rank} {why}", file=sys.stderr)
        if self.tracer is not None:
            self.tracer.on_first = None
        self.decided.set()
        self.settled.set()
        while True:
            if self.signalled is not None:
                _leave(self.stop_code or 128 + self.signalled)
            self._wait_tick()
            self._end_if_stalled_alone()

    def _end_if_stalled_alone(self) -> None:
        """The store was lost (its host, the first node's agent, ended: that node's ranks went with
        it): a rank that has waited ``stall_s`` in a collective ends itself (``--on-hang stop``), as
        nobody can diagnose or finish the job now, rather than wait for torch's timeout."""
        if self.options.on_hang != "stop" or self.board is None:  # never connected: not ours to end
            return
        self._read_own_records()
        since = self.view.waiting_since()
        if since is not None and time.time() - since >= self.options.stall_s:
            print(f"doctor: rank {self.job.rank} has waited {time.time() - since:.0f} s in a collective and "
                  f"the job's store is gone: ending it (exit {EXIT_CODES['crash']})", file=sys.stderr)
            _leave(EXIT_CODES["crash"])

    def _connect(self) -> None:
        end = time.monotonic() + CONNECT_S
        while True:
            try:
                self.board = Board.connect(self.job.master_addr, self.job.master_port, self.job.run_id,
                                           self.job.restart, self.job.rank)
                break
            except Exception:  # noqa: BLE001 - rank 0 may not host it yet (no agent store)
                if time.monotonic() >= end:
                    raise
                time.sleep(0.5)
        if self.tracer is not None:  # at once: the script runs meanwhile, and may die by SIGKILL soon
            self.tracer.on_first = self._post_first_call
        try:
            posted = software.rank_software(self.command)
        except Exception:  # noqa: BLE001 - what it runs is a note; watching the rank is the job
            posted = {}
        self._read_own_records(wait_s=FLUSH_WAIT_S)  # the calls made before the store was reached
        self.board.join(self.heartbeat(), posted)
        self.settled.set()

    def _post_first_call(self, record_text: str) -> None:
        """The tracer's ``on_first``, in the main thread: post a first call's record before it runs
        (one store call; a store that fails is not asked again, so the script waits on it once)."""
        try:
            self.board.post_call(record_text)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - the store is gone: the watchdog says so
            self.tracer.on_first = None

    def _wait_tick(self) -> None:
        import select

        ready = select.select([self.wake_read], [], [], TICK_S)[0]
        if not ready:
            return
        try:
            data = os.read(self.wake_read, 64)
        except BlockingIOError:
            return
        # only when the handler is still the doctor's: a script's own (a checkpoint on preemption)
        # decides for itself what SIGTERM does
        if signal.SIGTERM in data and self.signalled is None and \
                signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            self.signalled = signal.SIGTERM

    def _tick(self) -> None:
        board = self.board
        assert board is not None
        self._read_own_records()
        if self.signalled is not None and self.exit is None:
            self._stopped_by_signal()
        ending = self.exit is not None
        board.beat(self.heartbeat())
        if ending:
            self.exit_posted.set()
        if self.verdict is None:
            posted = board.verdict()
            if posted is not None:
                self.verdict, stop = posted
                if stop is not None:
                    self._end_on_stop(*stop, by_leader=False)
                self.decided.set()
        number = board.request()
        if number > self.answered:
            board.answer(number, self.state(str(number)))
            self.answered = number
        roster = board.roster()
        leader = board.leader(roster, lambda seen: is_gone(seen, self.machine))
        if leader == self.job.rank and self.verdict is None:
            self._lead(roster)
        if self.signalled is not None and (self.decided.is_set() or self._linger_over()):
            self._leave_on_signal()

    def _read_own_records(self, wait_s: float | None = None) -> None:
        """Fold the trace records written since the last read; the calls not written yet first
        (unless a thread is writing them now: waited for ``wait_s`` at most)."""
        trace.flush(wait=False if wait_s is None else wait_s)
        data = os.pread(self.trace_fd, 1 << 20, self.view.offset)
        while data:
            self.records.extend(fold(self.view, data))
            data = os.pread(self.trace_fd, 1 << 20, self.view.offset)
        if self.options.keep_dir is None and self.view.offset - self.punched >= PUNCH_BYTES:
            self.punched = _give_back(self.trace_fd, self.view.offset)

    # -- what this rank says ----------------------------------------------------------------

    def heartbeat(self) -> dict[str, Any]:
        """This rank's heartbeat: where it is, how long it has waited, how it ended."""
        self.beats += 1
        now = time.time()
        since = self.view.waiting_since()
        done = self.view.last_done_t
        open_ids = set(self.view.open)
        recent = list(self.records)[-8:]
        opened = [r for r in self.records
                  if r.get("ev") == "op" and r.get("id") in open_ids and r not in recent]
        return {"n": self.beats, "rank": self.job.rank, "host": self.host, "machine": self.machine,
                "node": self.job.node, "pid": os.getpid(), "born": self.born,
                "wait": None if since is None else round(now - since, 3),
                "idle": None if done is None else round(now - done, 3),
                "pending": self.view.pending_seq(), "last": self.view.last_seq(),
                "progress": self.view.progress, "recs": opened + recent, "site": self._latest_site(),
                "exit": self.exit, "ended_ago": None if self.exit_mono is None
                else round(time.monotonic() - self.exit_mono, 3), "pymp": _own_temp_folder()}

    def remove_vanished_folders(self) -> None:
        """Remove the multiprocessing folders (``_share_temp_folder``) that this machine's ranks
        named in their heartbeats and could not remove: their processes are gone (SIGKILL, from the
        OOM killer or a memory limit), as last read from the store."""
        for seen in list(self.board.seen.values()) if self.board is not None else ():
            beat, folder = seen.beat, seen.beat.get("pymp")
            if beat.get("machine") == self.machine and isinstance(folder, str) and \
                    Path(folder).name.startswith("pymp-") and not still_runs(beat):
                shutil.rmtree(folder, ignore_errors=True)

    def _latest_site(self) -> dict[str, Any] | None:
        """The main thread's user line now, else the last one seen: a rank that failed and is
        reporting its error runs only this package's code, and where it was is its last user line."""
        self.site = _main_site() or self.site
        return self.site

    def state(self, request: str) -> dict[str, Any]:
        """This rank's answer to the leader: stack, Flight Recorder tail, latest records, end. The
        helper thread may be writing the open call's record under load: its write is waited for."""
        self._read_own_records(wait_s=FLUSH_WAIT_S)
        state = trace.rank_state(self.job.rank, request)
        state.update(recs=list(self.records), exit=self.exit, host=self.host, machine=self.machine,
                     node=self.job.node, pid=os.getpid(), born=self.born)
        if request != "final":  # where its DataLoader's workers are, when it waits for them
            mine = {self.job.rank: (os.getpid(), state["stack"])}
            state["workers"] = pyspy.children_waited_for(mine).get(self.job.rank, [])
        return state

    # -- how this rank ends -----------------------------------------------------------------

    def ended(self, record: dict[str, Any]) -> None:
        """The script ended (``record``: how): the next heartbeat says so. Set before anything else
        runs: a launcher's SIGTERM meanwhile would otherwise record the rank as stopped where it
        was, this package's own exit path."""
        with self.lock:
            self.exit, self.exit_mono = record, time.monotonic()

    def wait_for_verdict(self) -> None:
        """After ``ended``: wait (``LINGER_S`` at most) for the verdict when one may come. A script
        that ended before this rank joined the job's store (before init_process_group, at once)
        joins it first: its end must reach the leader, or the others wait in init for nobody."""
        self.settled.wait(CONNECT_S + TICK_S)
        if self.board is None:
            return  # the store was never reached: nobody to wait for
        self.decided.wait(LINGER_S)

    def ran_alone(self) -> str | None:
        """Why this rank, the first on its node, ran the script on its own in a world of several
        (``alone_reason``); None if it did not, and for the node's other ranks."""
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return None
        return self.alone_reason()

    def alone_reason(self) -> str | None:
        """Why this rank ran the script on its own in a world of several (accelerate's state of one
        process, or no process group ever joined); None if it did not."""
        if self.job.world < 2:
            return None
        # its records as the watchdog read them: a collective, on a group made with the traced name
        # or without it (a device mesh's)
        if any(op.op != INIT_OP for op in list(self.view.ops.values())):  # the watchdog adds to it
            return None
        if _accelerate_processes() == 1:  # accelerate made a group of the world, then used none of it
            return wording.ALONE_IN_ACCELERATE
        if trace.joined() or self.view.ops or _group_is_up():
            return None
        return wording.ALONE_WITHOUT_GROUP

    def code_after_end(self, code: int) -> int:
        """The exit code once the script ended: its own, or the doctor's when a stop is pending."""
        if self.stop_code is not None:
            return self.stop_code
        verdict = self.verdict or {}
        if self.options.on_hang == "stop" and verdict.get("verdict") == "mismatch" and code == 0:
            return EXIT_CODES["mismatch"]
        return code

    def _stopped_by_signal(self) -> None:
        orphaned = os.getppid() != self.parent
        record = {"ev": "exit", "t": time.time(), "status": "stopped", "code": -int(self.signalled or 15),
                  "by": "its agent died (parent-death signal)" if orphaned else "SIGTERM from its launcher",
                  "orphaned": orphaned, "gone": self._vanished_here()}
        with self.lock:
            if self.exit is None:
                self.exit, self.exit_mono = record, time.monotonic()

    def _vanished_here(self) -> list[int]:
        """Ranks of this machine that no longer exist and never said how they ended."""
        vanished = []
        if self.board is not None and self.exit is None:
            self.board.read_beats(self.board.roster())
        for rank, seen in self.board.seen.items() if self.board else ():
            beat = seen.beat
            if beat.get("machine") == self.machine and not beat.get("exit") and not still_runs(beat):
                vanished.append(rank)
        return sorted(vanished)

    def _linger_over(self) -> bool:
        """May a rank stopped by SIGTERM leave? At once, unless ranks of its machine vanished without
        a word (then it waits, at most ``LINGER_S``, for the leader to diagnose them)."""
        if self.exit is None or self.exit_mono is None:
            return True
        someone_vanished = bool(self.exit.get("gone")) or bool(self._vanished_here())
        return not someone_vanished or time.monotonic() - self.exit_mono >= LINGER_S

    def _leave_on_signal(self) -> NoReturn:
        self._final_beat()
        _leave(self.stop_code or 128 + int(self.signalled or 15))

    def _final_beat(self) -> None:
        try:
            beat = self.heartbeat()
            beat["gone"] = True
            self.board.beat(beat)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass

    def _end_on_stop(self, code: int, expected: int, by_leader: bool) -> NoReturn:
        """End this rank with the doctor's exit code (the leader's stop), once every rank knows."""
        self.stop_code = code
        if not by_leader:
            verdict = self.verdict or {}
            print(f"doctor: rank {self.job.rank} stopped: {verdict.get('verdict', '?')} "
                  f"({verdict.get('kind', '?')}), exit {code}; the leading rank has the diagnosis",
                  file=sys.stderr)
        self._keep_state()
        self._final_beat()
        try:
            self.board.stopping(expected, STOP_ACK_S)
            self._kill_stuck_here()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        _leave(code)

    def _kill_stuck_here(self) -> None:
        """SIGKILL the ranks of this machine that cannot act on the stop: their Python does not run
        (native code holding the GIL), so SIGTERM would not end them either; torchrun would wait
        30 s before it kills them itself. Their child processes with them (``stop_own_children``)."""
        for seen in self.board.read_beats(self.board.roster()).values():
            beat = seen.beat
            if beat.get("machine") == self.machine and not seen.fresh() and not seen.gone \
                    and beat.get("pid") != os.getpid() and still_runs(beat):
                for member in procs.tree_of([int(beat["pid"])]):  # listed before the rank dies
                    procs.send_signal(member.pid, signal.SIGKILL)

    def _keep_state(self) -> None:
        if self.options.keep_dir is None:
            return
        try:
            path = rundir.state_path(self.options.keep_dir, self.job.rank)
            trace.save_state(path, self.state("final"))
        except OSError as exc:
            print(f"doctor: rank {self.job.rank} cannot keep its state: {exc}", file=sys.stderr)

    # -- leading ----------------------------------------------------------------------------

    def _lead(self, roster: list[int]) -> None:
        board = self.board
        beats = board.read_beats(roster)
        beats[self.job.rank] = Seen(self.heartbeat())
        trigger = should_diagnose(beats, self.job.world, self.options.stall_s, self.machine)
        if trigger is None or time.monotonic() < self.hold_until or not board.claim():
            return
        reason, since_s = trigger
        if reason == "stall" and time.monotonic() < self.stall_hold_until:
            return
        started = time.monotonic()
        number = board.new_request()
        self.answered = number
        asked = [rank for rank, seen in beats.items()
                 if rank != self.job.rank and not is_gone(seen, self.machine)]
        answers = board.answers(number, asked, EVIDENCE_WAIT_S, self._beat_while_leading)
        answers[self.job.rank] = self.state(str(number))
        beats = board.read_beats(roster)
        silent = [rank for rank in asked if rank not in answers]
        stacks = py_spy_stacks(silent, beats, self.machine)
        first_calls = board.first_calls([rank for rank in beats if rank not in answers])  # dead ones too
        self._beat_while_leading()
        diagnosis = diagnose_answers(self.job.world, reason, since_s + time.monotonic() - started, answers,
                                     beats, self.machine, stacks, first_calls)
        if diagnosis.kind == "ok" and reason != "finished":  # heartbeats a tick old (a rank shown still in
            self.hold_until = time.monotonic() + HOLD_S  # init after it left it): a healthy job is left
            return  # alone; the claim stays this rank's, and the next look reads fresh heartbeats
        if reason == "stall" and stall_ended(diagnosis):  # its collective completed as the stacks came
            self.looked_again.add(stall_ended_note(diagnosis.detected_after_s))
            self.hold_until = time.monotonic() + HOLD_S
            return
        if reason == "stall":  # a rank importing a module: late, not stuck, while its import moves on
            answered = {rank: answer.get("stack") or [] for rank, answer in answers.items()}
            unheard = frozenset(range(self.job.world)) - set(beats) - set(answers)
            again, note = self.imports.look(diagnosis, {**answered, **stacks}, self.options.stall_s, unheard)
            self.looked_again.add(note)
            if again:
                print(f"doctor: {note}", file=sys.stderr)
                self.stall_hold_until = time.monotonic() + self.options.stall_s
                return
        diagnosis.notes.extend(self.looked_again.lines())
        self._compare_software(diagnosis, roster)
        diagnosis.notes.append(f"diagnosed inside the job by rank {self.job.rank} (on {self.host}), "
                               f"through the job's store at {self.job.master_addr}:{self.job.master_port}")
        kept = self._restart_copy()
        if kept is not None:
            diagnosis.notes.append(f"restart {self.job.restart} of at most {self.job.max_restarts} "
                                   f"(torchrun's --max-restarts): this run's diagnosis is also kept in "
                                   f"{kept}, which a restart does not replace")
        self._publish(diagnosis)

    def _compare_software(self, diagnosis: Diagnosis, roster: list[int]) -> None:
        """A note when the ranks did not run the same script or versions; its cure first when the
        job did not end well."""
        try:
            posted = self.board.software(roster)
        except Exception:  # noqa: BLE001 - the store failed: the diagnosis goes out without it
            return
        note = software.differences_note(posted, _script_name(self.command))
        if note:
            diagnosis.notes.insert(0, note)
            if diagnosis.verdict != "ok" and software.decisive(software.differences(posted), posted):
                diagnosis.fix = f"{software.SOFTWARE_CURE} {diagnosis.fix}"

    def _restart_copy(self) -> Path | None:
        """Where this run's diagnosis is also written when torchrun may restart the job, or None."""
        if not self.job.max_restarts or not self.options.json_path:
            return None
        return attempt_path(self.options.json_path, self.job.restart)

    def _beat_while_leading(self) -> None:
        """A heartbeat while gathering evidence, so that no other rank takes over meanwhile."""
        self.board.beat(self.heartbeat())

    def _publish(self, diagnosis: Diagnosis) -> None:
        """Tell every rank (the first verdict posted wins), print, write the JSON; then stop the job
        (``--on-hang stop``)."""
        finished = diagnosis.evidence.reason == "finished"  # each leaves with its own code (or 5)
        alone = self.alone_reason() if finished and diagnosis.verdict == "ok" else None
        if alone:  # the leader's own case stands for the job's: the ranks run one script, one config
            job = self.job
            diagnosis.notes.append(wording.RAN_ALONE.format(rank=job.rank, world=job.world, why=alone))
        data = diagnosis.to_dict()
        stop = None
        if self.options.on_hang == "stop" and not finished:
            ticking = {rank for rank, seen in self.board.seen.items() if seen.fresh()} | {self.job.rank}
            stop = (diagnosis.exit_code, len(ticking))
            self.stop_code = diagnosis.exit_code  # before any rank can leave and take this one along
        posted, stop = self.board.post_verdict(data, stop)
        self.verdict = posted
        if posted is data:  # this rank's verdict: it reports it
            self._report(diagnosis, data)
        self.decided.set()
        if stop is not None:
            self._end_on_stop(*stop, by_leader=True)

    def _report(self, diagnosis: Diagnosis, data: dict[str, Any]) -> None:
        """The diagnosis on this rank's stderr, in ``--json`` and in the ``--keep`` folder; a file that
        cannot be written is said, and does not hold up the stop."""
        if diagnosis.verdict != "ok":
            print(diagnosis.text(), file=sys.stderr)
        paths = [self.options.json_path, self._restart_copy()]
        if self.options.keep_dir is not None:
            paths.append(rundir.diagnosis_path(self.options.keep_dir))
        for path in filter(None, paths):
            try:
                report.atomic_write_json(path, data)
            except OSError as exc:
                print(f"doctor: cannot write the diagnosis to {path}: {exc}", file=sys.stderr)


def _script_name(command: list[str]) -> str:
    """'train.py', or 'the script' for a ``-m`` module."""
    return Path(command[0]).name if command and command[0] != "-m" else "the script"


def _main_site() -> dict[str, Any] | None:
    """The innermost user frame of the main thread (for a rank that later stops answering); None
    where it runs none (before the script, or in this package's own exit path after it)."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident) if main.ident is not None else None
    user = trace.user_frame(frame) if frame is not None else None
    if user is None:
        return None
    code = user.f_code
    return {"file": code.co_filename, "line": user.f_lineno, "func": code.co_name, "user": True,
            "where": trace.label(code.co_filename, user.f_lineno)}


_STORE_ECHO = re.compile(r"DistNetworkError|DistStoreError|failed to recv|got signal")  # the store, a signal


def _stop_echo(said: str) -> bool:
    """Is a script's error (``_said``) what the doctor's stop causes: a collective or the store
    failing as the other ranks leave, or the stop's signal?"""
    return is_comm_error(said) or bool(_STORE_ECHO.search(said))


def _said(error: BaseException) -> str:
    """An exception as its type and its message's first sentence, redacted before it is cut
    (``wording.short_error``: without gloo's source path)."""
    try:
        message = str(error).strip()
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails: its type alone
        message = ""
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return wording.short_error(redact.redact_text(text))


def _connection_lost(error: Exception) -> bool:
    """A store error that will not heal: the connection itself is gone (not a slow reply)."""
    import torch.distributed as dist

    return isinstance(error, (ConnectionError, dist.DistNetworkError)) or "Broken pipe" in str(error)


def _give_back(fd: int, offset: int) -> int:
    """Free the memory of the in-memory trace up to ``offset`` (already read): Linux's fallocate
    PUNCH_HOLE, the file's size unchanged. Returns the offset freed up to."""
    import ctypes

    start = offset - offset % 4096
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate(fd, 0x01 | 0x02, ctypes.c_long(0), ctypes.c_long(start))  # KEEP_SIZE | PUNCH_HOLE
    except (OSError, AttributeError):
        pass
    return start
