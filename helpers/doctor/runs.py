"""Running things under the doctor: a function or a script on local ranks, or plain torchrun.

``launch``/``launch_command`` are ``helpers.launch``'s with a ``Doctor`` watching; ``run_function``
and ``run_command`` return the diagnosis instead of raising; ``run_torchrun`` runs a script under
plain torchrun with the tracer, for comparing with what torchrun users get; ``run_job`` runs a
multi-node job on this machine (one torchrun or accelerate launch agent per node, over 127.0.0.1,
each in its own working folder: the commands a cluster runs) with ``-m helpers.doctor`` inside.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import launch as launching
from helpers import procs, rundir
from helpers.doctor.diagnosis import Diagnosis
from helpers.doctor.postmortem import diagnose_dir
from helpers.doctor.watcher import DEFAULT_STALL_S, Doctor
from helpers.launch import LaunchError


def launch(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
           stall_s: float = DEFAULT_STALL_S, keep_dir: str | Path | None = None,
           watchers: Sequence[launching.Watcher] = (), **options: Any) -> list[Any]:
    """``helpers.launch.launch`` under the hang doctor: a stall, a dead rank or mismatched
    collectives stop the run with an error whose ``.diagnosis`` says which rank, which collective
    and which line (``HangDetected``, the rank's ``RankError``/``RankExited``, ``MismatchDetected``).
    ``options`` are ``launch``'s (num_processes, timeout_s, env, ...)."""
    return launching.launch(fn, args, kwargs, watchers=[Doctor(stall_s, keep_dir), *watchers], **options)


def launch_command(command: Sequence[str], *, stall_s: float = DEFAULT_STALL_S,
                   keep_dir: str | Path | None = None, watchers: Sequence[launching.Watcher] = (),
                   **options: Any) -> list[int]:
    """``helpers.launch.launch_command`` under the hang doctor (see ``launch``)."""
    return launching.launch_command(command, watchers=[Doctor(stall_s, keep_dir), *watchers], **options)


def run_command(command: list[str], num_processes: int = 2, stall_s: float = DEFAULT_STALL_S,
                timeout_s: float = 3600.0, keep_dir: str | Path | None = None,
                env: dict[str, str] | None = None) -> Diagnosis:
    """Run a script on ``num_processes`` local ranks under the doctor; return its diagnosis."""
    doctor = Doctor(stall_s, keep_dir=keep_dir)
    try:
        launching.launch_command(command, num_processes=num_processes, timeout_s=timeout_s,
                              watchers=[doctor], env=env)
    except LaunchError as error:
        if error.diagnosis is None:
            raise
        return error.diagnosis
    assert doctor.diagnosis is not None
    return doctor.diagnosis


def run_function(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, num_processes: int = 2,
                 stall_s: float = DEFAULT_STALL_S, timeout_s: float = 300.0,
                 keep_dir: str | Path | None = None) -> Diagnosis:
    """Run ``fn`` on ``num_processes`` forked ranks under the doctor; return its diagnosis.

    The ranks' return values are in ``diagnosis.results`` when every rank finished.
    """
    doctor = Doctor(stall_s, keep_dir=keep_dir)
    try:
        results = launching.launch(fn, args, kwargs, num_processes=num_processes, timeout_s=timeout_s,
                                watchers=[doctor])
    except LaunchError as error:
        if error.diagnosis is None:
            raise
        return error.diagnosis
    assert doctor.diagnosis is not None
    doctor.diagnosis.results = results
    return doctor.diagnosis


def run_torchrun(command: list[str], trace_dir: str | Path, num_processes: int = 2,
                 timeout_s: float = 600.0) -> tuple[int | None, Diagnosis, str]:
    """Run a script under plain torchrun with the tracer (``-m helpers.trace``), then diagnose.

    For comparing with what torchrun users get: a hang lasts until torch's process-group timeout.
    Returns torchrun's exit code (None: stopped at ``timeout_s``, with every worker), the diagnosis
    from ``trace_dir`` and torchrun's output.
    """
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="helpers-torchrun-") as scratch:
        env = procs.python_env({rundir.ENV_DIR: str(trace_dir), "TMPDIR": scratch})
        env.pop(rundir.ENV_PARENT, None)
        argv = torchrun_argv(command, num_processes)
        # torchrun starts its workers in sessions of their own: past the deadline the whole tree
        # is stopped (procs.run_process), not torchrun alone; torchrun first, which stops its
        # workers with one SIGTERM each (their stacks written whole)
        code, output, _seconds = procs.run_process(argv, timeout_s, env, forwards=True)
    exit_codes = torchrun_exit_codes(output)
    return code, diagnose_dir(trace_dir, num_processes, exit_codes, stopped=code is None), output


def torchrun_argv(command: list[str], num_processes: int) -> list[str]:
    """Plain torchrun on this machine running ``command`` (a script and its arguments) traced."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_processes),
            "--max-restarts", "0", "--master-port", str(procs.free_port()), "-m", "helpers.trace", *command]


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exit_codes(output: str) -> dict[int, int]:
    """The failed ranks' exit codes from torchrun's error summary ("rank : 1 ... exitcode : -9")."""
    return {int(rank): int(code) for rank, code in _TORCHRUN_FAILURE.findall(output)}




# ---------------------------------------------------------------------------------------------
# a multi-node job on this machine, the doctor inside

JOB_JSON = "doctor.json"  # the leader's --json, relative to its node's working folder
JOB_KEEP = "doctor-record"  # each node's --keep folder (its ranks' records; the leader's diagnosis)
LAUNCHERS = ("torchrun", "accelerate")


@dataclass
class JobRun:
    """How a job under ``-m helpers.doctor`` ended on each node."""

    commands: list[list[str]]  # one agent per node
    agent_codes: list[int | None]  # each agent's exit code (None: stopped at the deadline)
    agent_seconds: list[float]  # when each agent ended, from the start
    outputs: list[str]
    rank_codes: dict[int, int]  # the failed ranks' exit codes, from the agents' summaries
    diagnosis: Diagnosis | None  # the leader's JSON (None: no diagnosis was written)
    node_dirs: list[Path] = field(default_factory=list)

    @property
    def ended_s(self) -> float:
        """When the last agent ended, from the start."""
        return max(self.agent_seconds)


def job_commands(command: Sequence[str], nodes: int, per_node: int, port: int, doctor_options: Sequence[str],
                 launcher: str = "torchrun", python: str = sys.executable) -> list[list[str]]:
    """Each node's launcher command with ``-m helpers.doctor`` inside (addresses: 127.0.0.1)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher: {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    inner = ["-m", "helpers.doctor", *doctor_options, *command]
    if launcher == "torchrun":
        return [[python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
                 str(per_node), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                 str(port), "--max-restarts", "0", *inner] for node in range(nodes)]
    return [[python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(nodes),
             "--num_processes", str(nodes * per_node), "--machine_rank", str(node), "--main_process_ip",
             "127.0.0.1", "--main_process_port", str(port), "--max_restarts", "0", *inner]
            for node in range(nodes)]


def srun_line(script: str, nodes: int = 2, per_node: int = 8, stall_s: float = DEFAULT_STALL_S,
              json_path: str = "doctor.json") -> str:
    """The same job on a Slurm cluster: one torchrun agent per node, the doctor inside each rank."""
    torchrun = (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
                f"--rdzv-endpoint \"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)\":29500 "
                f"--rdzv-id \"$SLURM_JOB_ID\" -m helpers.doctor --stall-s {stall_s:g} --json {json_path} "
                f"{script}")
    return f"srun --nodes {nodes} --ntasks-per-node 1 bash -c {shlex.quote(torchrun)}"


def run_job(command: Sequence[str], folder: str | Path, nodes: int = 2, per_node: int = 2,
            stall_s: float = DEFAULT_STALL_S, timeout_s: float = 300.0, launcher: str = "torchrun",
            on_hang: str = "stop", env: dict[str, str] | None = None, keep: bool = False) -> JobRun:
    """Run ``command`` as a ``nodes`` x ``per_node`` job on this machine under the doctor.

    Each node's agent runs in ``folder/node<N>`` (the leader writes ``JOB_JSON`` in its own; with
    ``keep``, each node's ranks keep their records in ``JOB_KEEP`` there); past ``timeout_s`` every
    agent is stopped with its whole tree.
    """
    return start_job(command, folder, nodes, per_node, stall_s, launcher, on_hang, env, keep).wait(timeout_s)


class Job:
    """A multi-node job started on this machine (``start_job``): its agents run; ``wait()`` ends it."""

    def __init__(self, commands: list[list[str]], node_dirs: list[Path], env: dict[str, str]):
        self.commands, self.node_dirs = commands, node_dirs
        self.scratch = tempfile.TemporaryDirectory(prefix="helpers-job-")
        env = procs.python_env({"TMPDIR": self.scratch.name, "OMP_NUM_THREADS": "1", **env})
        for name in (rundir.ENV_PARENT, rundir.ENV_DIR, rundir.ENV_RANK):
            env.pop(name, None)
        try:
            self.processes = procs.Started(commands, env, node_dirs)
        except BaseException:
            self.scratch.cleanup()
            raise

    @property
    def agents(self) -> list[Any]:
        """The agents' processes (``subprocess.Popen``), one per node."""
        return self.processes.procs

    def wait(self, timeout_s: float) -> JobRun:
        """Wait for every agent (stopping them all with their trees past ``timeout_s``); the outcome."""
        try:
            ended = self.processes.wait(timeout_s)
        finally:
            self.scratch.cleanup()
        outputs = [output for _code, output, _s in ended]
        codes: dict[int, int] = {}
        for output in outputs:
            codes.update(torchrun_exit_codes(output))
        found = [path for path in (d / JOB_JSON for d in self.node_dirs) if path.is_file()]
        diagnosis = Diagnosis.from_dict(json.loads(found[0].read_text())) if found else None
        return JobRun(self.commands, [c for c, _o, _s in ended], [s for _c, _o, s in ended], outputs, codes,
                      diagnosis, self.node_dirs)


def start_job(command: Sequence[str], folder: str | Path, nodes: int = 2, per_node: int = 2,
              stall_s: float = DEFAULT_STALL_S, launcher: str = "torchrun", on_hang: str = "stop",
              env: dict[str, str] | None = None, keep: bool = False) -> Job:
    """Start ``command`` as a ``nodes`` x ``per_node`` job on this machine under the doctor (see
    ``run_job``); the caller must ``wait()`` on it."""
    from helpers import params
    stall_s = params.check("stall_s", stall_s)
    on_hang = params.check("on_hang", on_hang)
    for name, value in (("nodes", nodes), ("per_node", per_node)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
            raise ValueError(f"{name}: {value!r} is not an integer in 1..64")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher: {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    problem = command_problem(list(command))
    if problem:
        raise ValueError(problem.replace("after '--'", "as the command"))
    folder = Path(folder)
    node_dirs = [folder / f"node{node}" for node in range(nodes)]
    for node_dir in node_dirs:
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / JOB_JSON).unlink(missing_ok=True)
    options = ["--stall-s", str(stall_s), "--json", JOB_JSON, "--on-hang", on_hang]
    options += ["--keep", JOB_KEEP] if keep else []
    commands = job_commands(command, nodes, per_node, procs.free_port(), options, launcher)
    extra = {"ACCELERATE_USE_CPU": "true"} if launcher == "accelerate" else {}
    return Job(commands, node_dirs, {**extra, **(env or {})})


def command_problem(command: list[str]) -> str | None:
    """What is wrong with a command to run (no script, a missing script), or None."""
    if not command:
        return "command: give the script to run after '--' (or --attach, --merge, --from-fr)"
    if command[0] == "-m":
        return None if len(command) > 1 else "command: '-m' needs a module name"
    if command[0].endswith(".py") and not Path(command[0]).is_file():
        return f"command: script {command[0]!r} not found"
    return None
