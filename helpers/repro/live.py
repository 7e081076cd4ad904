"""A job hung right now: attach before you kill it (notebook 02), and the panel that lists the jobs.

A real hang is found in a job the doctor did not start: plain ``torchrun`` or ``accelerate launch``,
stuck for an hour. Killing it loses the one thing that tells where each rank is; attaching first
(``helpers.doctor.attach``: py-spy reads each rank's stack, a dump only, the job goes on) keeps it,
as a diagnosis and a JSON that ``build_replay`` turns into a short repro. This module plays that
story on any machine:

- ``start_hung_job(cfg)``: the symptom's catalog scenario (broken variant) under plain ``torchrun``
  in ``cfg.out_dir/attach/``, on a free ``--master-port``, with its temporary files inside that
  folder and torch's process-group timeout (``--pg-timeout-s``) as the job's deadline. It returns
  once py-spy shows every rank hung (the same stacks three polls in a row, some rank waiting in a
  collective), within a bounded wait.
- ``attach_to(job)``: the doctor's diagnosis from the ranks' stacks; the JSON is saved next to the
  script. ``replay_from(attached, cfg)``: that JSON as a replay script.
- ``stop_job(job)``: the whole tree stopped, then every process of this machine searched for the
  job's script: the Note says what is left, truthfully.

The job is never left running: ``stop_job`` in the notebook's section and again in its last cell, a
``weakref.finalize`` (it also runs at interpreter exit) when the kernel ends, and torchrun dies with
the kernel (PR_SET_PDEATHSIG). torchrun starts its workers in sessions of their own, so a SIGKILLed
kernel can orphan them: the process-group timeout bounds their life (each waiting rank raises at the
timeout and exits; a busy rank's compute is capped at the same time).

``attach_panel()``: the torch.distributed jobs running on this machine in a dropdown (found as
``doctor.find_ranks("auto")`` finds them) and an Attach button that shows the diagnosis.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import doctor, params, procs, redact, report
from helpers.doctor import pyspy
from helpers.repro.runs import ReproRun
from helpers.repro.script import ReproScript, build_replay, build_script, out_folder
from helpers.repro.symptoms import get_scenario, get_symptom

JOB_DEADLINE_S = 180.0  # the job's process-group timeout: an orphaned rank ends by itself after it
START_TIMEOUT_S = 120.0  # torch and accelerate imports on a loaded 2-core machine
POLL_S = 0.4
STABLE_POLLS = 3  # the same stacks this many polls in a row: the job is hung, not slow
HANG_KINDS = ("collective-mismatch", "rank-missing")  # scenarios that hang under torchrun (no crash)
FALLBACK_SCENARIO = "uneven-eval"
FOLDER = "attach"  # under out_dir: the job's script, log, temporary files, attach JSON, replay
LOG_TAIL = 3000


def hanging_scenario(symptom: str) -> tuple[str, str]:
    """The symptom's first scenario that hangs under plain torchrun, and a note when none does."""
    for scenario in get_symptom(symptom).scenarios:
        if get_scenario(scenario).expected["torchrun"].kind in HANG_KINDS:
            return scenario, ""
    return FALLBACK_SCENARIO, (f"the scenarios of {symptom!r} crash rather than hang under torchrun: "
                               f"nothing would be left to attach to, so this job runs {FALLBACK_SCENARIO!r}")


@dataclass
class HungJob(report.ResultMixin):
    """A plain torchrun job, hung: the command a user would type, its PIDs, what attaching must find."""

    scenario: str
    script: str  # absolute path: it is in every process of the job's command line
    command: str  # what a user types in the script's folder
    num_processes: int
    port: int
    deadline_s: float
    expected: dict[str, Any]  # kind and culprit ranks attaching should name (catalog, torchrun row)
    pid: int = 0  # torchrun's
    rank_pids: list[int] = field(default_factory=list)
    seconds: float = 0.0  # from the start until py-spy saw it hung
    notes: list[str] = field(default_factory=list)
    _proc: Any = field(default=None, repr=False, metadata={"json": False})
    _finalizer: Any = field(default=None, repr=False, metadata={"json": False})

    @property
    def folder(self) -> Path:
        """The job's folder: script, log, temporary files, the attach JSON and the replay."""
        return Path(self.script).parent

    @property
    def attach_json(self) -> Path:
        """Where ``attach_to`` saves the doctor's JSON."""
        return self.folder / "attached.json"

    @property
    def running(self) -> bool:
        """Not stopped yet (by ``stop_job`` or the finalizer)."""
        return self._finalizer is not None and self._finalizer.alive

    def _repr_html_(self) -> str:
        pids = ", ".join(f"rank {rank}: {pid}" for rank, pid in enumerate(self.rank_pids))
        notes = "".join(f"<p><i>Note: {html.escape(note)}.</i></p>" for note in self.notes)
        state = f"hung after {self.seconds:.1f} s" if self.running else "stopped"
        return (f"<div><b>A plain torchrun job, {html.escape(state)}</b> ({html.escape(self.scenario)}, "
                f"broken variant)<p>What a user would type, in the script's folder:</p>"
                f"<pre>{html.escape(self.command)}</pre><p>torchrun's PID: <code>{self.pid}</code>; the "
                f"ranks' PIDs: <code>{html.escape(pids)}</code>. Its deadline: torch's process-group "
                f"timeout of {self.deadline_s:g} s (<code>--pg-timeout-s</code>) ends every waiting rank "
                f"by itself, also if this kernel dies.</p>{notes}</div>")


def start_hung_job(cfg: params.Config, deadline_s: float = JOB_DEADLINE_S,
                   start_timeout_s: float = START_TIMEOUT_S) -> HungJob:
    """Start the symptom's scenario (broken) under plain torchrun and return once it hangs.

    Raises RuntimeError (the job stopped, its log's tail in the message) when it ends before it
    hangs or does not hang within ``start_timeout_s``.
    """
    scenario, note = hanging_scenario(cfg.symptom)
    num_processes = params.check("num_processes", cfg.num_processes)
    folder = out_folder(cfg.out_dir) / FOLDER
    script = build_script(scenario, "broken", folder, num_processes)
    entry = get_scenario(scenario)
    args = ["--pg-timeout-s", f"{deadline_s:g}"]
    if "COMPUTE_S" in entry.parameters():  # a rank busy in compute gives up at the deadline too
        args += ["--compute-s", f"{deadline_s:g}"]
    port = procs.free_port()
    launcher = ["--nproc-per-node", str(num_processes), "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--max-restarts", "0"]
    expected = {"kind": entry.expected["torchrun"].kind, "ranks": entry.culprit_ranks(num_processes)}
    job = HungJob(scenario, script.path, " ".join(["torchrun", *launcher, Path(script.path).name, *args]),
                  num_processes, port, deadline_s, expected, notes=[note] if note else [])
    tmp = folder / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(folder / "job.log", "wb") as log:
        argv = [sys.executable, "-m", "torch.distributed.run", *launcher, script.path, *args]
        proc = subprocess.Popen(argv, cwd=folder, env={**os.environ, "TMPDIR": str(tmp)},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=procs.death_signal_preexec())
    job.pid, job._proc = proc.pid, proc
    job._finalizer = weakref.finalize(job, _stop, proc, str(tmp))  # also at interpreter exit
    started = time.monotonic()
    try:
        job.rank_pids = wait_until_hung(job, start_timeout_s)
    except BaseException:
        job._finalizer()
        raise
    job.seconds = round(time.monotonic() - started, 1)
    return job


def _stop(proc: subprocess.Popen, tmp: str) -> None:
    """Stop torchrun and every process below it; remove its temporary files."""
    procs.stop_tree(proc)
    shutil.rmtree(tmp, ignore_errors=True)


def wait_until_hung(job: HungJob, timeout_s: float) -> list[int]:
    """Poll until the job's ranks are found and py-spy shows the same hang ``STABLE_POLLS`` times in
    a row; return the ranks' PIDs by rank. No blind sleep: each poll reads the ranks' stacks."""
    deadline = time.monotonic() + timeout_s
    seen: list[Any] = []
    while True:
        code = job._proc.poll()
        if code is not None:
            raise RuntimeError(f"the job ended (exit code {code}) before it hung:\n{_log_tail(job)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the job did not hang within {timeout_s:g} s (stopped):\n{_log_tail(job)}")
        ranks = _ranks_of(job)
        positions = _positions(ranks) if len(ranks) == job.num_processes else None
        seen = [*seen, positions][-STABLE_POLLS:] if positions is not None else []
        if len(seen) == STABLE_POLLS and all(p == seen[0] for p in seen):
            return [rank.pid for rank in ranks]
        time.sleep(POLL_S)


def _ranks_of(job: HungJob) -> list[pyspy.RankProcess]:
    try:
        return doctor.find_ranks(str(job.pid))
    except pyspy.AttachError:
        return []  # torchrun has not started its ranks yet


def _positions(ranks: list[pyspy.RankProcess]) -> tuple[Any, ...] | None:
    """Where each rank is: the collective it waits in, or the user's function it is busy in; None
    while some rank cannot be read yet or no rank waits in a collective (still starting)."""
    found = []
    for rank in ranks:
        try:
            frames = pyspy.dump_stack(rank.pid)
        except pyspy.AttachError:
            return None
        op = pyspy.waiting_op(frames)
        user = next((f["func"] for f in reversed(frames) if f.get("user")), None)
        found.append(("wait", op.op, op.where) if op else ("busy", user))
    return tuple(found) if any(p[0] == "wait" for p in found) else None


def _log_tail(job: HungJob) -> str:
    try:
        text = (job.folder / "job.log").read_text(errors="replace")
    except OSError:
        return "(no log)"
    return redact.for_report(text)[-LOG_TAIL:]


def attach_to(job: HungJob) -> doctor.Attached:
    """Attach to the job (py-spy reads every rank's stack; the job goes on); save the doctor's JSON
    as ``attached.json`` next to the script; return what was found (its diagnosis shows)."""
    if not job.running:
        raise ValueError("job: this job was stopped; start it again with repro.start_hung_job(cfg)")
    [attached, *_] = doctor.attach(str(job.pid))
    attached.to_json(job.attach_json)
    return attached


def replay_from(attached: doctor.Attached, cfg: params.Config) -> ReproScript:
    """The attached hang as a replay script (``attached_replay.py``), built from the saved JSON."""
    folder = out_folder(cfg.out_dir) / FOLDER
    path = folder / "attached.json"
    attached.to_json(path)  # the JSON of this very result (attach_to wrote the same)
    return build_replay(path, folder, "attached_replay.py")


@dataclass(repr=False)  # Note's repr: the message
class JobStopped(report.Note):
    """``stop_job``'s Note, and the PIDs of the job still alive afterwards (none, or it says so)."""

    left: list[int] = field(default_factory=list)


def stop_job(job: HungJob) -> JobStopped:
    """Stop torchrun and its whole tree (SIGTERM, SIGKILL after 2 s), remove its temporary files,
    then look for the job's script in every process's command line on this machine."""
    was_running = job.running
    if job._finalizer is not None:
        job._finalizer()
    left = job_processes(job.script)
    if left:
        return JobStopped(f"Still running after the stop: pids {left} (their command line names "
                          f"{Path(job.script).name}); stop them with `kill {' '.join(map(str, left))}`, "
                          f"or they end at the process-group timeout ({job.deadline_s:g} s)", left)
    done = f"Stopped torchrun (pid {job.pid}) and its ranks" if was_running else "The job was already stopped"
    return JobStopped(f"{done}: no process of the job is left (no command line on this machine names "
                      f"{Path(job.script).name}).")


def job_processes(script: str | Path) -> list[int]:
    """The PIDs of the live processes whose command line holds ``script`` (this one excluded)."""
    import psutil

    needle, found = str(script), []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if needle in " ".join(process.info["cmdline"] or []):
            found.append(process.pid)
    return sorted(found)


@dataclass
class AttachCheck(report.ResultMixin):
    """The section's part of notebook 02's outcome: attaching named the scenario's culprit, the
    replay got the same diagnosis, and no process of the job is left."""

    scenario: str
    expected: dict[str, Any]
    kind: str
    ranks: list[int]
    named_culprit: bool
    replay_as_expected: bool | None
    left: list[int]
    problems: list[str]

    @property
    def ok(self) -> bool:
        """Nothing went wrong."""
        return not self.problems

    def verdict(self) -> str:
        """One sentence."""
        if not self.ok:
            return "; ".join(self.problems)
        replay = ", its replay got the same diagnosis" if self.replay_as_expected else ""
        return (f"attaching to the hung job named {self.kind} with culprit ranks {self.ranks} "
                f"(expected {self.expected['ranks']}){replay}, and no process of it is left")


def attach_check(job: HungJob, attached: doctor.Attached, replayed: ReproRun | None,
                 stopped: JobStopped) -> AttachCheck:
    """Did attaching name the scenario's kind and culprit ranks (with two ranks there is no majority:
    both may be named), did the replay behave the same, and is no process of the job left?"""
    found = attached.diagnosis
    wanted = job.expected
    named = found.kind == wanted["kind"] and set(wanted["ranks"]) <= set(found.ranks)
    problems = []
    if not named:
        problems.append(f"attaching found {found.kind} with culprit ranks {found.ranks}; expected "
                        f"{wanted['kind']} naming ranks {wanted['ranks']}")
    replay_ok = replayed.as_expected if replayed is not None else None
    if replayed is not None and not replay_ok:
        problems.append(replayed.verdict())
    if stopped.left:
        problems.append(stopped.message)
    return AttachCheck(job.scenario, wanted, found.kind, list(found.ranks), named, replay_ok,
                       list(stopped.left), problems)


# ---------------------------------------------------------------------------------------------
# the panel


def running_jobs() -> list[tuple[str, str]]:
    """The torch.distributed jobs on this machine as (label, a rank's PID), one per job."""
    try:
        ranks = doctor.find_ranks("auto")
    except pyspy.AttachError:
        return []
    jobs: dict[str, list[pyspy.RankProcess]] = {}
    for rank in ranks:
        jobs.setdefault(rank.job, []).append(rank)
    found = []
    for job, members in jobs.items():
        script = next((Path(part).name for part in members[0].cmdline.split() if part.endswith(".py")), "?")
        pids = ", ".join(str(m.pid) for m in members)
        label = f"{script}: {len(members)} of {members[0].world_size} ranks (pids {pids}), {job}"
        found.append((label, str(members[0].pid)))
    return found


@dataclass
class Attachments(report.ResultMixin):
    """Every job ``attach("auto")`` found, one diagnosis each."""

    parts: list[doctor.Attached]

    def _repr_html_(self) -> str:
        return "".join(f"<h4>{html.escape(part.job)}</h4>{part._repr_html_()}" for part in self.parts)


def attach_job(job: str = "auto") -> Any:
    """The panel's function: attach to one job (a rank's or torchrun's PID) or to every job ("auto")."""
    if job == "auto" and not running_jobs():
        return report.Note("No torch.distributed job runs on this machine (no process with RANK and "
                           "WORLD_SIZE in its environment that this user can read).")
    found = doctor.attach(job)
    return found[0] if len(found) == 1 else Attachments(found)


def attach_panel():
    """The jobs running on this machine in a dropdown ("auto": every one); Attach shows the diagnosis,
    Refresh lists the jobs again."""
    from helpers import ui

    def refresh(job: str) -> report.Note:
        jobs = running_jobs()
        built.controls["job"].options = [("auto", "auto"), *jobs]
        return report.Note(f"{len(jobs)} torch.distributed job(s) run on this machine.")

    built = ui.panel({"Attach": attach_job, "Refresh": refresh}, {"job": "auto"},
                     choices={"job": [("auto", "auto"), *running_jobs()]}, dropdown=("job",),
                     title="Attach to a job running on this machine")
    return built
