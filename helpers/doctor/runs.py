"""Running things under the doctor: a function or a script on local ranks, or plain torchrun.

``launch``/``launch_command`` are ``helpers.launch``'s with a ``Doctor`` watching; ``run_function``
and ``run_command`` return the diagnosis instead of raising; ``run_torchrun`` runs a script under
plain torchrun with the tracer, for comparing with what torchrun users get.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable, Sequence
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
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_processes),
                "--max-restarts", "0", "--master-port", str(procs.free_port()),
                "-m", "helpers.trace", *command]
        # torchrun starts its workers in sessions of their own: past the deadline the whole tree
        # is stopped (procs.run_process), not torchrun alone
        code, output, _seconds = procs.run_process(argv, timeout_s, env)
    exit_codes = torchrun_exit_codes(output)
    return code, diagnose_dir(trace_dir, num_processes, exit_codes, stopped=code is None), output


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exit_codes(output: str) -> dict[int, int]:
    """The failed ranks' exit codes from torchrun's error summary ("rank : 1 ... exitcode : -9")."""
    return {int(rank): int(code) for rank, code in _TORCHRUN_FAILURE.findall(output)}


