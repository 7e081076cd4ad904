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
at most ``EVIDENCE_WAIT_S``, names the ranks that did not answer (native code holding the GIL, or
dead) from their last heartbeat, prints the diagnosis on its stderr and writes the JSON
(``--json``, the doctor's schema). With ``--on-hang stop`` (the default) every rank then ends with
the doctor's exit code (3 hang, 4 crash, 5 mismatch), so every node's agent stops within seconds.

A rank stopped by SIGTERM (its agent tearing the job down, or its agent gone: the parent-death
signal) says so in its heartbeat and names the ranks of its machine that vanished without a word,
then leaves; the leader judges those as killed (e.g. by the OOM killer).
"""

from __future__ import annotations

import atexit
import os
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

from helpers import report, rundir, trace
from helpers.doctor.board import SILENT_S, Board, Seen
from helpers.doctor.diagnosis import EXIT_CODES, Diagnosis, diagnose
from helpers.doctor.records import RankView, fold

TICK_S = 0.25  # how often a watchdog posts its heartbeat and reads the leader's keys
EVIDENCE_WAIT_S = 2.0  # the leader waits this long for the ranks' answers
STOP_ACK_S = 2.0  # on a stop, each rank waits at most this long for every rank to know it
LINGER_S = EVIDENCE_WAIT_S + SILENT_S + 4 * TICK_S  # an ended rank waits this long for a verdict
PY_SPY_S = 2.0  # reading a silent rank of the leader's machine with py-spy
CONNECT_S = 120.0  # reaching the job's store (hosted by rank 0 itself when there is no agent)
KEPT_RECORDS = 256  # trace records kept for an answer
ENDED_BADLY = ("raised", "exited")  # exit statuses that call for a diagnosis at once


@dataclass
class JobEnv:
    """What a launcher tells a rank: its rank, the world, where the job's store is."""

    rank: int
    world: int
    master_addr: str
    master_port: int
    run_id: str
    restart: str

    @classmethod
    def from_environ(cls, env: dict[str, str] | os._Environ) -> JobEnv | None:
        """The launcher's variables (torchrun, accelerate launch); None outside a launcher."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(env.get(name) for name in names):
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                   env.get("TORCHELASTIC_RUN_ID", "job"), env.get("TORCHELASTIC_RESTART_COUNT", "0"))


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
    if options.keep_dir is not None:
        options.keep_dir.mkdir(parents=True, exist_ok=True)
        rundir.clear_rank_record(options.keep_dir, job.rank)
    tracer = trace.install(options.keep_dir, job.rank)
    if options.keep_dir is None:  # the records' in-memory file, read back through its own descriptor
        reader = os.dup(tracer.fd)
    else:  # the tracer's file is open for appending only
        reader = os.open(rundir.trace_path(options.keep_dir, job.rank), os.O_RDONLY)
    watchdog = Watchdog(job, options, reader, parent)
    watchdog.start()
    code, error = run_as_main(command)
    if error is not None:
        traceback.print_exception(error)
    watchdog.ended(_exit_record(code, error))
    _leave(watchdog.code_after_end(code))


def _exit_record(code: int, error: BaseException | None) -> dict[str, Any]:
    record: dict[str, Any] = {"ev": "exit", "t": time.time(), "code": code,
                              "status": "raised" if error else ("finished" if code == 0 else "exited")}
    if error is not None:
        record["error"] = f"{type(error).__name__}: {error}"[:800]
        record.update(trace.traceback_site(error.__traceback__) or {})
    return record


def _leave(code: int) -> NoReturn:
    """End the process now: exit handlers, flushed streams, no interpreter teardown (see
    ``helpers.launch.rank.run_command_rank``: gloo can abort in it)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watchdog(threading.Thread):
    """One rank's watchdog: heartbeats, answers, and the leader's work when this rank leads."""

    def __init__(self, job: JobEnv, options: JobOptions, trace_fd: int, parent: int):
        super().__init__(name="helpers-doctor", daemon=True)
        self.job, self.options, self.trace_fd, self.parent = job, options, trace_fd, parent
        self.view = RankView(job.rank)
        self.records: deque = deque(maxlen=KEPT_RECORDS)
        self.host = socket.gethostname()
        self.board: Board | None = None
        self.beats = 0
        self.exit: dict[str, Any] | None = None
        self.exit_mono: float | None = None
        self.answered = 0
        self.decided = threading.Event()  # a verdict exists (or the store is gone): ended ranks leave
        self.verdict: dict[str, Any] | None = None
        self.signalled: int | None = None
        self.stop_code: int | None = None  # the doctor's exit code, once a stop is under way
        self.lock = threading.Lock()
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
        into this rank's wakeup pipe, and ends it at once, as if the doctor were not there."""
        for undo in (lambda: signal.set_wakeup_fd(-1), lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)):
            try:
                undo()
            except ValueError:  # not the main thread: signals are the main thread's to set
                pass
        for fd in (self.wake_read, self.wake_write, self.trace_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a pending one now ends it

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
            print(f"doctor: rank {self.job.rank} cannot reach the job's store at "
                  f"{self.job.master_addr}:{self.job.master_port} ({exc}); this rank is not watched",
                  file=sys.stderr)
            self.decided.set()
            return
        while True:
            self._wait_tick()
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - mostly: the store went away with its host (an agent)
                print(f"doctor: rank {self.job.rank} stopped watching ({type(exc).__name__}: {exc}; the "
                      f"job's store at {self.job.master_addr}:{self.job.master_port} may have gone with its "
                      "agent)", file=sys.stderr)
                self.decided.set()
                if self.signalled is not None:
                    _leave(128 + self.signalled)
                return

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
        self.board.join(self.heartbeat())

    def _wait_tick(self) -> None:
        import select

        ready = select.select([self.wake_read], [], [], TICK_S)[0]
        if not ready:
            return
        try:
            data = os.read(self.wake_read, 64)
        except BlockingIOError:
            return
        if signal.SIGTERM in data and self.signalled is None:
            self.signalled = signal.SIGTERM

    def _tick(self) -> None:
        board = self.board
        assert board is not None
        self._read_own_records()
        if self.signalled is not None and self.exit is None:
            self._stopped_by_signal()
        board.beat(self.heartbeat())
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
        leader = board.leader(roster, lambda seen: _dead(seen, self.host))
        if leader == self.job.rank and self.verdict is None:
            self._lead(roster)
        if self.signalled is not None and (self.decided.is_set() or self._linger_over()):
            self._leave_on_signal()

    def _read_own_records(self) -> None:
        data = os.pread(self.trace_fd, 1 << 20, self.view.offset)
        while data:
            self.records.extend(fold(self.view, data))
            data = os.pread(self.trace_fd, 1 << 20, self.view.offset)

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
        return {"n": self.beats, "rank": self.job.rank, "host": self.host, "pid": os.getpid(),
                "wait": None if since is None else round(now - since, 3),
                "idle": None if done is None else round(now - done, 3),
                "pending": self.view.pending_seq(), "last": self.view.last_seq(),
                "progress": self.view.progress, "recs": opened + recent, "site": _main_site(),
                "exit": self.exit, "ended_ago": None if self.exit_mono is None
                else round(time.monotonic() - self.exit_mono, 3)}

    def state(self, request: str) -> dict[str, Any]:
        """This rank's answer to the leader: stack, Flight Recorder tail, latest records, end."""
        self._read_own_records()
        state = trace.rank_state(self.job.rank, request)
        state.update(recs=list(self.records), exit=self.exit, host=self.host, pid=os.getpid())
        return state

    # -- how this rank ends -----------------------------------------------------------------

    def ended(self, record: dict[str, Any]) -> None:
        """The script ended (``record``: how): say so, and wait for the verdict when one may come."""
        with self.lock:
            self.exit, self.exit_mono = record, time.monotonic()
        if self.board is None and not self.decided.is_set():
            return  # the store was never reached: nobody to wait for
        self.decided.wait(LINGER_S)

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
            if beat.get("host") == self.host and not beat.get("exit") and not _alive(beat.get("pid")):
                vanished.append(rank)
        return sorted(vanished)

    def _linger_over(self) -> bool:
        if self.exit_mono is None:
            return True
        nobody_gone = not self.exit.get("gone") and not self._vanished_here() if self.exit else True
        return nobody_gone or time.monotonic() - self.exit_mono >= LINGER_S

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
        30 s before it kills them itself."""
        from helpers import procs

        for seen in self.board.read_beats(self.board.roster()).values():
            beat = seen.beat
            if beat.get("host") == self.host and not seen.fresh() and not seen.gone \
                    and beat.get("pid") != os.getpid() and _alive(beat.get("pid")):
                procs.send_signal(int(beat["pid"]), signal.SIGKILL)

    def _keep_state(self) -> None:
        if self.options.keep_dir is None:
            return
        report.atomic_write_json(rundir.state_path(self.options.keep_dir, self.job.rank), self.state("final"))

    # -- leading ----------------------------------------------------------------------------

    def _lead(self, roster: list[int]) -> None:
        board = self.board
        beats = board.read_beats(roster)
        beats[self.job.rank] = Seen(self.heartbeat())
        trigger = _trigger(beats, self.job.world, self.options.stall_s, self.host)
        if trigger is None or not board.claim():
            return
        reason, since_s = trigger
        started = time.monotonic()
        number = board.new_request()
        self.answered = number
        asked = [rank for rank, seen in beats.items() if rank != self.job.rank and not _dead(seen, self.host)]
        answers = board.answers(number, asked, EVIDENCE_WAIT_S)
        answers[self.job.rank] = self.state(str(number))
        beats = board.read_beats(roster)
        stacks = _py_spy_stacks([rank for rank in asked if rank not in answers], beats, self.host)
        diagnosis = _diagnosis(self.job.world, reason, since_s + time.monotonic() - started, answers,
                               beats, self.host, stacks)
        diagnosis.notes.append(f"diagnosed inside the job by rank {self.job.rank} (on {self.host}), "
                               f"through the job's store at {self.job.master_addr}:{self.job.master_port}")
        self._publish(diagnosis)

    def _publish(self, diagnosis: Diagnosis) -> None:
        """Print, write the JSON, tell every rank; then stop the job (``--on-hang stop``)."""
        if diagnosis.verdict != "ok":
            print(diagnosis.text(), file=sys.stderr)
        data = diagnosis.to_dict()
        if self.options.json_path is not None:
            report.atomic_write_json(self.options.json_path, data)
        if self.options.keep_dir is not None:
            report.atomic_write_json(rundir.diagnosis_path(self.options.keep_dir), data)
        finished = diagnosis.evidence.reason == "finished"  # each leaves with its own code (or 5)
        stop = None
        if self.options.on_hang == "stop" and not finished:
            ticking = {rank for rank, seen in self.board.seen.items() if seen.fresh()} | {self.job.rank}
            stop = (diagnosis.exit_code, len(ticking))
            self.stop_code = diagnosis.exit_code  # before any rank can leave and take this one along
        self.board.post_verdict(data, stop)
        self.verdict = data
        self.decided.set()
        if stop is not None:
            self._end_on_stop(*stop, by_leader=True)


def _main_site() -> dict[str, Any] | None:
    """The innermost user frame of the main thread (for a rank that later stops answering)."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident) if main.ident is not None else None
    user = trace.user_frame(frame) if frame is not None else None
    if user is None:
        return None
    code = user.f_code
    return {"file": code.co_filename, "line": user.f_lineno, "func": code.co_name, "user": True,
            "where": trace.label(code.co_filename, user.f_lineno)}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead(seen: Seen, host: str) -> bool:
    """Known gone: it said so, or it is on this machine and its process no longer exists."""
    return seen.gone or (seen.beat.get("host") == host and not _alive(seen.beat.get("pid")))


# ---------------------------------------------------------------------------------------------
# the leader's judgement (pure, on heartbeats)


def _trigger(beats: dict[int, Seen], world: int, stall_s: float, host: str) -> tuple[str, float] | None:
    """Why the leader should diagnose now, and since when (seconds), or None."""
    ends = {rank: seen.beat.get("exit") or {} for rank, seen in beats.items()}
    for rank, end in ends.items():
        if end.get("status") in ENDED_BADLY or end.get("orphaned"):  # orphaned: a lost node
            return "failure", (beats[rank].beat.get("ended_ago") or 0.0) + beats[rank].age()
    vanished = {r for end in ends.values() for r in end.get("gone") or []}
    vanished |= {rank for rank, seen in beats.items() if not ends[rank] and _dead(seen, host)}
    if vanished:
        return "failure", 0.0
    if len(beats) == world and all(end.get("status") == "finished" for end in ends.values()):
        return "finished", 0.0
    running = {rank: seen for rank, seen in beats.items() if not ends[rank]}
    for rank, end in ends.items():
        if end.get("status") != "finished":
            continue
        last = beats[rank].beat.get("last") or 0
        if any((seen.beat.get("pending") or 0) > last for seen in running.values()):
            return "exited", 0.0
    idle = min((seen.beat["idle"] + seen.age() for seen in running.values()
                if seen.beat.get("idle") is not None), default=float("inf"))
    stalls = [min(seen.beat["wait"] + seen.age(), idle) for seen in running.values()
              if seen.beat.get("wait") is not None]
    stalled = [s for s in stalls if s >= stall_s]
    return ("stall", max(stalled)) if stalled else None


def _py_spy_stacks(ranks: list[int], beats: dict[int, Seen], host: str) -> dict[int, list[dict[str, Any]]]:
    """The stacks of this machine's ranks that did not answer, read with py-spy (their Python cannot
    run, but py-spy reads its memory); none where py-spy may not (ptrace rights) or cannot."""
    from helpers.doctor import pyspy

    stacks = {}
    for rank in ranks:
        beat = beats[rank].beat if rank in beats else {}
        if beat.get("host") != host or not isinstance(beat.get("pid"), int) or not _alive(beat["pid"]):
            continue
        try:
            stacks[rank] = [f for f in pyspy.dump_stack(beat["pid"], timeout_s=PY_SPY_S) if not f["native"]]
        except (ValueError, OSError):  # AttachError (no ptrace rights, no py-spy) included
            continue
    return stacks


def _diagnosis(world: int, reason: str, since_s: float, answers: dict[int, dict[str, Any]],
               beats: dict[int, Seen], host: str,
               stacks: dict[int, list[dict[str, Any]]] | None = None) -> Diagnosis:
    """Views from the answers (or the last heartbeat of a rank that did not answer, with its stack
    from py-spy when ``stacks`` has it), diagnosed."""
    views, notes = {}, []
    vanished = {r for seen in beats.values() for r in (seen.beat.get("exit") or {}).get("gone") or []}
    for rank in range(world):
        seen = beats.get(rank)
        if rank in answers:
            views[rank] = _view(rank, answers[rank], answers[rank])
        elif seen is not None:
            view = _view(rank, seen.beat, {"stack": [seen.beat["site"]] if seen.beat.get("site") else [],
                                           "progress": seen.beat.get("progress") or {}, "fr": []})
            dead = rank in vanished or _dead(seen, host) and not seen.beat.get("exit")
            if dead and not seen.beat.get("exit"):
                view.exit, view.ended, view.exit_code = {"ev": "exit", "status": "vanished"}, True, None
                view.state["stack"] = []  # where it was a tick before it died: no evidence of its end
                notes.append(f"rank {rank} ended without a word (no exception, no exit code): killed "
                             "by a signal, e.g. SIGKILL from the OOM killer; its agent's log has the signal")
            elif not seen.beat.get("exit") and rank in (stacks or {}):
                view.state["stack"] = stacks[rank]
                notes.append(f"rank {rank} did not answer in {EVIDENCE_WAIT_S:.0f} s (native code holding "
                             "the GIL): its stack was read with py-spy")
            elif not seen.beat.get("exit"):
                notes.append(f"rank {rank} did not answer in {EVIDENCE_WAIT_S:.0f} s (native code holding "
                             f"the GIL, or a machine that stopped); where it was is from its heartbeat "
                             f"{seen.age():.1f} s old")
            views[rank] = view
    diagnosis = diagnose(views, world, reason, round(since_s, 3))
    diagnosis.notes.extend(notes)
    return diagnosis


def _view(rank: int, source: dict[str, Any], state: dict[str, Any]) -> RankView:
    view = RankView(rank)
    for record in source.get("recs") or []:
        try:
            view.apply(record)
        except (KeyError, TypeError):
            continue
    if source.get("progress"):
        view.apply({"ev": "pg", "pg": source["progress"], "t": time.time()})
    view.state = {key: state.get(key) for key in ("stack", "progress", "fr")}
    end = source.get("exit")
    if end:
        view.exit, view.ended, view.exit_code = end, True, end.get("code")
    return view
