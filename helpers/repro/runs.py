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

import html
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import doctor, params, procs, redact, report, rundir
from helpers.report import Note
from helpers.repro import replay
from helpers.repro.script import DEFAULT_OUT_DIR, ReproScript, build_replay, build_script, expected_text
from helpers.repro.symptoms import get_symptom

RUN_TIMEOUT_S = 180.0
LOG_TAIL = 4000  # characters of a run's output kept in results

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
    rundir.clear_record(keep)
    argv = [sys.executable, "-m", "helpers", "doctor", "--num-processes", str(num_processes),
            "--stall-s", str(stall_s), "--timeout-s", str(timeout_s), "--keep", str(keep),
            "--", script.name, *(args or [])]
    code, output, seconds = procs.run_process(argv, timeout_s + 30, procs.python_env(env), cwd=script.parent)
    if not rundir.diagnosis_path(keep).is_file():
        raise RuntimeError(f"the doctor wrote no diagnosis for {script.name} (exit "
                           f"{'none: past the deadline' if code is None else code}):\n"
                           f"{redact.for_report(output)[-LOG_TAIL:]}")
    return load_diagnosis(keep), output, seconds


def load_diagnosis(keep_dir: str | Path) -> doctor.Diagnosis:
    """The ``Diagnosis`` in a kept folder, with the evidence its swimlane plot reads."""
    recording = replay.load_recording(keep_dir)
    result = doctor.Diagnosis.from_dict(recording.diagnosis)
    dumps = [(view.state or {}).get("t") for view in recording.views.values()]
    detected_at = max([t for t in dumps if isinstance(t, (int, float))], default=None)
    stall_start = (detected_at - result.detected_after_s
                   if detected_at and result.detected_after_s and result.verdict == "hang" else None)
    result.evidence = doctor.Evidence(
        views=recording.views,
        histories={rank: doctor.history(view) for rank, view in recording.views.items()},
        detected_at=detected_at, stall_start=stall_start)
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
    script = Path(script).resolve()
    port = str(procs.free_port())
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
        code, output, seconds = procs.run_process(argv, timeout_s, run_env, cwd=script.parent)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    started = len(set(re.findall(r"'rank': (\d+)", output))) or None
    outcome, how = classify(code, output, all_ranks_done=started == num_processes)
    command = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *shown, script.name, *(args or [])])
    return Standalone(launcher, command, code, outcome, how, headline(output), seconds,
                      redact.for_report(output)[-LOG_TAIL:], started)


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
    # torchrun's root cause of a rank killed by a signal, when the other ranks were stopped before
    # they could report the lost peer (the agent saw the death first)
    re.compile(r"(Signal \d+ \(SIG\w+\) received by PID \d+)"),
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
            return redact.for_report(line)[:400]
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
    diagnosis: doctor.Diagnosis

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


def contrast_debug_modes(script: str | Path, num_processes: int = 2, pg_timeout_s: float = 10.0,
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


# ---------------------------------------------------------------------------------------------
# a generated script under the doctor, as notebook 02 runs it


@dataclass
class ReproRun(report.ResultMixin):
    """A generated script run under the hang doctor: its diagnosis, and whether it is the expected one."""

    script: str
    name: str
    variant: str
    num_processes: int
    stall_s: float
    diagnosis: doctor.Diagnosis  # with the evidence its swimlane reads
    expected: dict[str, Any]
    trace_dir: str
    seconds: float
    output_tail: str = ""
    fix: str = ""

    @property
    def as_expected(self) -> bool:
        """Kind, culprit ranks and (when the expectation names some) verdict are the expected ones."""
        found, wanted = self.diagnosis, self.expected
        verdicts = wanted.get("verdicts") or []
        return (found.kind == wanted.get("kind") and (not verdicts or found.verdict in verdicts)
                and sorted(found.ranks) == sorted(wanted.get("ranks") or []))

    def verdict(self) -> str:
        """One sentence: what the doctor found and whether that was expected."""
        found = self.diagnosis
        head = (f"{Path(self.script).name}: {found.verdict} ({found.kind}), culprit ranks {found.ranks}, "
                f"in {self.seconds:.1f} s")
        if self.as_expected:
            return f"{head}: as expected."
        return f"{head}: NOT as expected ({expected_text(self.expected)})."

    def __repr__(self) -> str:
        return f"ReproRun({self.verdict()!r})"

    def swimlane(self):
        """The doctor's swimlane plot of this run (a matplotlib Figure)."""
        return self.diagnosis.swimlane()

    def plot(self):
        """The swimlane (the widget panel shows a result's plot)."""
        return self.swimlane()

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.as_expected else "#c62828"
        fixed = self.variant == "fixed" and self.fix
        fix = f"<p><b>The fix in this variant:</b> {html.escape(self.fix)}</p>" if fixed else ""
        return (f"<div><p style='color:{colour}'><b>{html.escape(self.verdict())}</b></p>{fix}"
                f"{self.diagnosis._repr_html_()}</div>")


def run_script(script: ReproScript, stall_s: float = 5.0, timeout_s: float = RUN_TIMEOUT_S,
               env: dict[str, str] | None = None) -> ReproRun:
    """Run a generated script under ``python -m helpers doctor`` (in a child process); return the run.

    The doctor's record is kept next to the script (``<script>-trace/``, ready for ``build_replay``);
    the ranks' output goes to ``<script>.log``, secrets removed.
    """
    stall_s = params.check("stall_s", stall_s)
    timeout_s = params.check("timeout_s", timeout_s)
    path = Path(script.path)
    keep = path.with_name(path.stem + "-trace")
    diagnosis, output, seconds = run_under_doctor(path, None, script.num_processes, stall_s,
                                                  timeout_s, keep, env)
    cleaned = redact.for_report(output)
    report.atomic_write_text(path.with_suffix(".log"), cleaned)
    return ReproRun(str(path), script.name, script.variant, script.num_processes, stall_s, diagnosis,
                    script.expected, str(keep), seconds, cleaned[-LOG_TAIL:], script.fix)


def run_fix(script: ReproScript, stall_s: float = 5.0, timeout_s: float = RUN_TIMEOUT_S) -> ReproRun | Note:
    """Build the fixed variant of a scenario script (same parameters, same folder) and run it."""
    if script.variant == "replay":
        return Note("A replay has no fixed variant: fix the original script (the diagnosis says how), "
                    "record it again with the doctor and check that it finishes.")
    overrides = {name.lower(): value for name, value in script.parameters.items()}
    fixed = build_script(script.name, "fixed", Path(script.path).parent, script.num_processes, **overrides)
    return run_script(fixed, stall_s, timeout_s)


def replay_of(run: ReproRun) -> ReproScript | Note:
    """The replay of a run's kept record: how a user's own script becomes a short repro."""
    if run.variant == "replay":
        return Note("This run already is a replay.")
    path = Path(run.script)
    return build_replay(run.trace_dir, path.parent, f"{path.stem}_replay.py")


def debug_contrast(symptom: str, num_processes: int = 2, out_dir: str | Path = DEFAULT_OUT_DIR,
                   stall_s: float = 5.0, pg_timeout_s: float = 10.0) -> Any:
    """For a shape mismatch: the same script plain, with ACCELERATE_DEBUG_MODE=1, with
    TORCH_DISTRIBUTED_DEBUG=DETAIL (torchrun) and under the doctor, side by side.

    Other symptoms get a Note (their collectives match in shape: the debug modes do not apply).
    """
    if get_symptom(symptom).name != "shape-mismatch-error":
        return Note("The debug-mode contrast is about shape mismatches: run this notebook with "
                    "symptom = \"shape-mismatch-error\" to see it.")
    script = build_script("variable-gather", "broken", out_dir, num_processes)
    return contrast_debug_modes(script.path, num_processes, pg_timeout_s, stall_s)

