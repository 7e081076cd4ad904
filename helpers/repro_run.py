"""Running repro scripts: under the hang doctor, standalone under torchrun or accelerate launch.

``run_under_doctor`` runs ``python -m helpers doctor --keep DIR --json PATH -- script.py`` in a
child process (the ranks' output goes to a log, not into the caller's cells) and reads the
diagnosis back, with the evidence its swimlane plot needs. ``run_standalone`` runs a script the
way a user would, with plain ``torchrun --nproc-per-node N`` or ``accelerate launch --multi_gpu``,
and says what the user sees: it finished, it hung until torch's process-group timeout, or it
crashed (and the one line that matters). Both have a deadline and leave no process behind: the
child dies with the caller (PR_SET_PDEATHSIG), and on a deadline or Ctrl-C every process it
started is terminated, then killed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import params, redact, report

KILL_GRACE_S = 2.0
DOCTOR_FILES = ("trace-*.jsonl", "state-*.json", "stack-*.txt", "diagnosis.json")
LOG_TAIL = 4000  # characters of a run's output kept in results

# ---------------------------------------------------------------------------------------------
# processes


def _death_signal_setter():
    """A function for the child (between fork and exec) that makes it die with the caller.

    Prepared in the caller: the child only makes one ctypes call (no import, no lock), which keeps
    it safe when the caller has threads. None where prctl is not available (not Linux).
    """
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def run_process(argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
                cwd: str | Path | None = None) -> tuple[int | None, str, float]:
    """Run ``argv``; return (exit code or None past the deadline, output, seconds).

    Past ``timeout_s`` (or on KeyboardInterrupt, re-raised) the process and every descendant are
    terminated, then killed after ``KILL_GRACE_S``.
    """
    started = time.monotonic()
    with tempfile.TemporaryFile() as sink:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, preexec_fn=_death_signal_setter())
        code: int | None = None
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if code is None:  # still running (deadline, Ctrl-C): never after a wait reaped it
                stop_tree(proc)
        sink.seek(0)
        output = sink.read().decode("utf-8", errors="replace")
    return code, output, round(time.monotonic() - started, 3)


def stop_tree(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` and all its descendants (SIGTERM, SIGKILL after KILL_GRACE_S); reap it."""
    import psutil

    victims: list[psutil.Process] = []
    try:
        parent = psutil.Process(proc.pid)
        victims = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    victims = [v for v in victims if v.pid != os.getpid()]
    for victim in victims:
        try:
            victim.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=KILL_GRACE_S)
    for victim in alive:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def _python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, with the repository importable (``-m helpers`` from any folder)."""
    path = os.pathsep.join(filter(None, [str(params.REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def clean_output(text: str) -> str:
    """Output as a person should read it in a report: secrets, home folders and host names replaced."""
    text = redact.redact_text(text)
    text = text.replace(str(params.REPO_ROOT), "<repo>")
    return redact.anonymize_text(text, **redact.local_identity())


# ---------------------------------------------------------------------------------------------
# under the doctor


def run_under_doctor(script: str | Path, args: list[str] | None = None, num_processes: int = 2,
                     stall_s: float = 5.0, timeout_s: float = 120.0, keep_dir: str | Path | None = None,
                     env: dict[str, str] | None = None) -> tuple[Any, str, float]:
    """Run ``script`` on N ranks under ``python -m helpers doctor``; return (diagnosis, output, s).

    The doctor's record is kept in ``keep_dir`` (default: ``<script>-trace`` next to the script),
    ready for ``build_replay``. Raises RuntimeError when the doctor wrote no diagnosis.
    """
    script = Path(script).resolve()
    keep = Path(keep_dir) if keep_dir else script.with_name(script.stem + "-trace")
    clear_record(keep)
    argv = [sys.executable, "-m", "helpers", "doctor", "--num-processes", str(num_processes),
            "--stall-s", str(stall_s), "--timeout-s", str(timeout_s), "--keep", str(keep),
            "--", script.name, *(args or [])]
    code, output, seconds = run_process(argv, timeout_s + 30, _python_env(env), cwd=script.parent)
    if not (keep / "diagnosis.json").is_file():
        raise RuntimeError(f"the doctor wrote no diagnosis for {script.name} (exit "
                           f"{'none: past the deadline' if code is None else code}):\n"
                           f"{clean_output(output)[-LOG_TAIL:]}")
    return load_diagnosis(keep), output, seconds


def clear_record(folder: Path) -> None:
    """Remove a previous doctor record from ``folder`` (only the doctor's own files)."""
    if not folder.is_dir():
        return
    for pattern in DOCTOR_FILES:
        for path in folder.glob(pattern):
            path.unlink()


def load_diagnosis(keep_dir: str | Path) -> Any:
    """The ``Diagnosis`` in a kept folder, with the evidence its swimlane plot reads."""
    from helpers import diagnosis as dx
    from helpers.repro_replay import load_recording

    recording = load_recording(keep_dir)
    data = recording.diagnosis
    fields = {name: data.get(name) for name in ("verdict", "kind", "ranks", "summary", "fix",
                                                "detected_after_s")}
    per_rank = [dx.RankReport(**{k: entry.get(k) for k in ("rank", "state", "op", "seq", "shapes",
                                                             "location", "exit_code")})
                for entry in data["per_rank"]]
    result = dx.Diagnosis(per_rank=per_rank, **fields)
    dumps = [(view.state or {}).get("t") for view in recording.views.values()]
    detected_at = max([t for t in dumps if isinstance(t, (int, float))], default=None)
    stall_start = (detected_at - result.detected_after_s
                   if detected_at and result.detected_after_s and result.verdict == "hang" else None)
    result.evidence = {"views": recording.views,  # type: ignore[attr-defined]
                       "histories": {rank: dx.history(view) for rank, view in recording.views.items()},
                       "detected_at": detected_at, "stall_start": stall_start}
    return result


# ---------------------------------------------------------------------------------------------
# standalone, as a user runs it


@dataclass
class Standalone(report.ResultMixin):
    """What a user sees running a script with plain torchrun or accelerate launch."""

    launcher: str
    command: str
    exit_code: int | None  # None: stopped at the deadline
    outcome: str  # finished | hang | crash
    how: str  # e.g. "ended by torch's process-group timeout", "rank 0 killed by SIGABRT"
    message: str  # the one line that matters
    seconds: float
    output_tail: str = ""
    ranks_started: int | None = None

    def row(self) -> dict[str, Any]:
        """This run as a table row."""
        return {"launcher": self.command, "outcome": self.outcome, "how": self.how,
                "message": self.message, "seconds": self.seconds}

    def _repr_html_(self) -> str:
        return report.html_table([self.row()])


def run_standalone(script: str | Path, args: list[str] | None = None, num_processes: int = 2,
                   launcher: str = "torchrun", env: dict[str, str] | None = None,
                   timeout_s: float = 120.0) -> Standalone:
    """Run ``script`` with plain ``torchrun`` or ``accelerate launch --multi_gpu`` on a free port.

    The launcher's temporary files go to a private folder that is removed afterwards.
    """
    from helpers import launch

    script = Path(script).resolve()
    port = str(launch.free_port())
    if launcher == "torchrun":
        shown = ["torchrun", "--nproc-per-node", str(num_processes)]
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_processes)]
        extra = {"PET_MASTER_PORT": port}
    elif launcher == "accelerate":
        shown = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(num_processes)]
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                str(num_processes), "--main_process_port", port]
        extra = {}
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'accelerate'; got {launcher!r}")
    argv += [script.name, *(args or [])]
    scratch = tempfile.mkdtemp(prefix="helpers-repro-")
    try:
        run_env = {**os.environ, **extra, **(env or {}), "TMPDIR": scratch}
        code, output, seconds = run_process(argv, timeout_s, run_env, cwd=script.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    started = len(set(re.findall(r"'rank': (\d+)", output))) or None
    outcome, how = classify(code, output, all_ranks_done=started == num_processes)
    command = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *shown, script.name, *(args or [])])
    return Standalone(launcher, command, code, outcome, how, headline(output), seconds,
                      clean_output(output)[-LOG_TAIL:], started)


_TEARDOWN_ABORT = "terminate called without an active exception"
_HANG = re.compile(r"Timed out waiting \d+ms|collective operation timeout|failed to pass monitoredBarrier")
_ROOT_CAUSE = re.compile(r"Root Cause.*?^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)", re.S | re.M)


def classify(exit_code: int | None, output: str, all_ranks_done: bool = False) -> tuple[str, str]:
    """finished | hang | crash, and how, from a launcher's exit code and output.

    torchrun names the first rank that failed ("Root Cause (first observed failure)"); the others
    were stopped by it (SIGTERM) and say nothing about the cause. ``all_ranks_done``: every rank
    printed its result, so an abort at interpreter exit came after the work (torch 2.13's gloo
    teardown: "terminate called without an active exception", seen in about 1 run in 10 after
    gather_for_metrics) and the run is reported as finished, with that said.
    """
    if exit_code is None:
        return "hang", "still running at the deadline (stopped)"
    if exit_code == 0:
        return "finished", "every rank ended normally"
    if all_ranks_done and _TEARDOWN_ABORT in output:
        return "finished", ("every rank finished its work; torch then aborted at interpreter exit "
                            f"({_TEARDOWN_ABORT!r}, a gloo teardown crash)")
    if _HANG.search(output):
        return "hang", "ended by torch's process-group timeout"
    root = _ROOT_CAUSE.search(output)
    if root is not None and int(root.group(2)) < 0:
        try:
            name = signal.Signals(-int(root.group(2))).name
        except ValueError:
            name = f"signal {-int(root.group(2))}"
        return "crash", f"rank {root.group(1)} killed by {name}"
    if root is not None:
        return "crash", f"rank {root.group(1)} raised an exception (exit code {root.group(2)})"
    return "crash", "a rank raised an exception"


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?", re.M)
_SOURCE_TAG = re.compile(r"\[/[^\]\s]*:\d+\]\s*")
_DEVICE_TYPES = re.compile(r", TensorDeviceTypes=TensorOptions\((?:[^()]|\([^()]*\))*\)")
_SHAPES = re.compile(r"Input shapes:\s*((?:\n\s*- Process \d+: [^\n]*)+)")
_HEADLINES = (
    re.compile(r"(DistributedOperationException: [^\n]*)"),
    re.compile(r"(Detected mismatch between collectives on ranks\..*?)(?:Collectives differ|$)", re.M),
    re.compile(r"(op\.preamble\.length <= op\.nbytes.*)"),
    re.compile(r"(Timed out waiting \d+ms for \w+ operation to complete)"),
    re.compile(r"(Connection (?:reset|closed) by peer)"),
    re.compile(r"^(\w*(?:Error|Exception): .+)$", re.M),
)


def headline(output: str) -> str:
    """The one line of a failed run that tells what happened (trimmed, without machine paths)."""
    text = _RANK_PREFIX.sub("", output)
    text = _DEVICE_TYPES.sub(", ...", text)
    text = _SOURCE_TAG.sub("", text)
    for pattern in _HEADLINES:
        match = pattern.search(text)
        if match:
            line = " ".join(part.strip() for part in match.group(1).splitlines())
            shapes = _SHAPES.search(text) if pattern is _HEADLINES[0] else None
            if shapes is not None:
                listed = [part.strip(" -") for part in shapes.group(1).strip().splitlines()]
                line += " Input shapes: " + "; ".join(listed)
            return clean_output(line)[:400]
    return ""


# ---------------------------------------------------------------------------------------------
# the debug-mode contrast


DEBUG_MODES = (
    ("plain", {}),
    ("ACCELERATE_DEBUG_MODE=1", {"ACCELERATE_DEBUG_MODE": "1"}),
    ("TORCH_DISTRIBUTED_DEBUG=DETAIL", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
)


@dataclass
class DebugContrast(report.ResultMixin):
    """The same script run plain, in each debug mode, and under the doctor, side by side."""

    script: str
    runs: list[Standalone]
    diagnosis: Any

    def rows(self) -> list[dict[str, Any]]:
        """One row per way of running it: what the user sees, the line that matters, seconds."""
        rows = [{"how": run.command, "what you see": f"{run.outcome}: {run.how}", "message": run.message,
                 "seconds": run.seconds} for run in self.runs]
        d = self.diagnosis
        rows.append({"how": f"python -m helpers doctor -- {Path(self.script).name}",
                     "what you see": f"{d.verdict} ({d.kind}), culprit ranks {d.ranks}",
                     "message": d.summary, "seconds": None})
        return rows

    def text(self) -> str:
        """The table as plain text."""
        return report.text_table(self.rows())

    def _repr_html_(self) -> str:
        return report.html_table(self.rows(), ["how", "what you see", "message", "seconds"])


def debug_contrast(script: str | Path, num_processes: int = 2, pg_timeout_s: float = 10.0,
                   stall_s: float = 5.0, timeout_s: float = 120.0) -> DebugContrast:
    """Run ``script`` plain, with ACCELERATE_DEBUG_MODE=1, with TORCH_DISTRIBUTED_DEBUG=DETAIL (all
    under torchrun, at once) and under the doctor; return what each shows."""
    from concurrent.futures import ThreadPoolExecutor

    args = ["--pg-timeout-s", str(pg_timeout_s)]
    with ThreadPoolExecutor(max_workers=len(DEBUG_MODES) + 1) as pool:
        runs = [pool.submit(run_standalone, script, args, num_processes, "torchrun", env, timeout_s)
                for _label, env in DEBUG_MODES]
        doctor = pool.submit(run_under_doctor, script, None, num_processes, stall_s, timeout_s,
                             Path(script).resolve().with_name(Path(script).stem + "-contrast-trace"))
        results = [future.result() for future in runs]
        diagnosis = doctor.result()[0]
    return DebugContrast(str(script), results, diagnosis)
