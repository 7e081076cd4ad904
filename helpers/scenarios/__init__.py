"""The scenario catalog: small scripts that hang (or not) the way real training code does.

Each scenario is one standalone script in this folder that imports only torch and accelerate, keeps
its parameters as UPPER_CASE constants near the top (overridable on the command line:
``--variant fixed --diverge-rank 0``), has ``main(**parameters)`` and runs unchanged under
``torchrun``, ``accelerate launch --multi_gpu``, ``python -m helpers doctor`` and, as a function,
under ``helpers.launch``. ``SCENARIOS`` is the one table: what each shows, its variants and
parameters, the doctor's expected kind and verdict per launcher, and the culprit ranks.

Launchers: ``launch`` (``helpers.launch`` forks ranks that call ``main``), ``cli``
(``python -m helpers doctor -- script.py``), ``torchrun`` (plain torchrun; the doctor reads the
traces afterwards, the hang ending at torch's process-group timeout instead of at ``stall_s``) and
``job`` (``torchrun ... -m helpers.doctor``: the doctor inside the job, two agents over loopback).
The kind names the first divergence, so it can differ by launcher (see each row's ``notes``).
Lines marked ``# doctor-line: <name>`` are where the doctor must place a rank (the culprits at
``culprit_line``, the others at ``others_line``; a killed rank has no line; a rank that got past
the mismatched collective is placed where it is now, and the summary names ``summary_line``).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parent
LAUNCHERS = ("launch", "cli", "torchrun", "job")


@dataclass(frozen=True)
class Expected:
    """The doctor's expected kind for the broken variant under one launcher, and allowed verdicts."""

    kind: str
    verdicts: tuple[str, ...]


# Ranks waiting in different collectives usually hang on gloo; with 3 ranks a rank sometimes dies
# (SIGSEGV or SIGABRT) when mismatched messages arrive: seen in 1 of several full runs of
# uneven-eval (last rank in barrier, others in all_gather). The kind and culprits are the same.
MISMATCHED_WAIT = ("hang", "crash")


def _same(kind: str, *verdicts: str) -> dict[str, Expected]:
    return {launcher: Expected(kind, verdicts) for launcher in LAUNCHERS}


@dataclass(frozen=True)
class Scenario:
    """One row of the catalog."""

    id: str
    module: str
    shows: str
    expected: dict[str, Expected]
    culprits: Callable[[int, dict[str, Any]], list[int]]
    culprit_rule: str  # the culprit rule in words, for the table
    culprit_line: str | None  # doctor-line marker where the doctor places the culprit ranks
    others_line: str | None = None  # ... and the other ranks (None: not checked)
    summary_line: str | None = None  # a marker whose location the summary must name
    variants: tuple[str, ...] = ("broken", "fixed")
    fix: str = ""
    notes: str = ""
    parameter_help: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """The standalone script."""
        return FOLDER / f"{self.module}.py"

    def load(self) -> Any:
        """The script as a module (its ``main`` runs one rank's work)."""
        return importlib.import_module(f"helpers.scenarios.{self.module}")

    def parameters(self) -> dict[str, Any]:
        """The UPPER_CASE parameters and their defaults, read from the script's source."""
        values = {}
        for node in ast.parse(self.path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id.isupper():
                    values[target.id] = ast.literal_eval(node.value)
        return values

    def culprit_ranks(self, num_processes: int, **overrides: Any) -> list[int]:
        """The ranks the doctor must blame for the broken variant on ``num_processes`` ranks."""
        values = {name.lower(): value for name, value in self.parameters().items()}
        values.update(overrides)
        return self.culprits(num_processes, values)

    def line(self, marker: str) -> int:
        """The line number of ``# doctor-line: <marker>`` in the script."""
        for number, text in enumerate(self.path.read_text().splitlines(), start=1):
            if re.search(rf"# doctor-line: {re.escape(marker)}\b", text):
                return number
        raise ValueError(f"{self.path.name} has no '# doctor-line: {marker}'")

    def location(self, marker: str | None) -> str | None:
        """``script.py:LINE`` of a marker, as the doctor reports locations (None for None)."""
        return None if marker is None else f"{self.path.name}:{self.line(marker)}"

    def command(self, variant: str = "broken", **overrides: Any) -> list[str]:
        """The script and its flags: ``[path, "--variant", "broken", "--diverge-rank", "1"]``."""
        argv = [str(self.path), "--variant", variant]
        for name, value in overrides.items():
            argv += ["--" + name.replace("_", "-"), str(value)]
        return argv

    def row(self) -> dict[str, Any]:
        """This scenario as a table row."""
        kinds = {f"{launcher} kind": f"{e.kind} ({'/'.join(e.verdicts)})"
                 for launcher, e in self.expected.items()}
        return {"id": self.id, "shows": self.shows, "variants": ", ".join(self.variants),
                "parameters": ", ".join(name for name in self.parameters() if name != "VARIANT"),
                **kinds, "culprit ranks": self.culprit_rule, "script": self.path.name}


def _diverge(n: int, p: dict[str, Any]) -> list[int]:
    return [p["diverge_rank"] % n]


def _shape_culprits(n: int, p: dict[str, Any]) -> list[int]:
    # with two ranks there is no majority: each rank's shape is as good as the other's
    return list(range(n)) if n == 2 else [p["diverge_rank"] % n]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "early-stop", "early_stop",
        "one rank leaves a DDP training loop early (its own convergence test); the others' next "
        "backward() waits in DDP's gradient all-reduce, the early rank in wait_for_everyone()",
        _same("collective-mismatch", *MISMATCHED_WAIT), _diverge, "DIVERGE_RANK", "early-rank", "training",
        fix="accelerator.set_trigger() on the rank that wants to stop, accelerator.check_trigger() "
            "on every rank (notebook 05)",
        notes="the DDP all-reduce is issued from C++: seen by the Flight Recorder, not by a Python "
              "wrapper; under torchrun it ends at the process-group timeout (30 min on gloo)"),
    Scenario(
        "main-only-collective", "main_only_collective",
        "accelerator.reduce inside `if accelerator.is_main_process`: rank 0 waits in an all_reduce, "
        "the others in the next wait_for_everyone()",
        _same("collective-mismatch", *MISMATCHED_WAIT), lambda n, p: [0], "0 (main process)",
        "main-only", "others",
        fix="call the collective on every rank; print on the main process only"),
    Scenario(
        "variable-gather", "variable_gather",
        "accelerator.gather of tensors with different lengths per rank",
        _same("shape-mismatch", "crash", "hang", "mismatch"), _shape_culprits,
        "DIVERGE_RANK on 3+ ranks; both ranks on 2 (no majority)", None, None, "gather",
        fix="accelerator.pad_across_processes before gather, drop the padding after",
        notes="on gloo the mismatched all_gather aborts the process (SIGABRT, 'Received data size "
              "doesn't match expected size'); NCCL may hang or return garbage. The doctor inside a "
              "job (job) may instead name the aborted rank (rank-exited): it died within "
              "milliseconds of the call, before its heartbeat carried the mismatched shape"),
    Scenario(
        "uneven-eval", "uneven_eval",
        "an evaluation loader with even_batches=False: the last rank runs out of batches and waits "
        "in wait_for_everyone() while the others wait in gather_for_metrics",
        _same("collective-mismatch", *MISMATCHED_WAIT), lambda n, p: [n - 1], "the last rank",
        "short-rank", "gather",
        fix="keep accelerate's even_batches=True and use gather_for_metrics"),
    Scenario(
        "one-branch-barrier", "one_branch_barrier",
        "wait_for_everyone() inside `if accelerator.is_main_process`: rank 0 waits in a barrier, the "
        "others poll for a file it writes after the barrier",
        _same("rank-missing", "hang"), lambda n, p: list(range(1, n)), "every rank but 0", "polling",
        "main-barrier",
        fix="call wait_for_everyone() after the branch, on every rank"),
    Scenario(
        "in-order-logging", "in_order_logging",
        "logger.info(..., main_process_only=False, in_order=True) on the main process only: an "
        "ordered log is a barrier per rank",
        _same("collective-mismatch", *MISMATCHED_WAIT), lambda n, p: [0], "0 (main process)", "log", "others",
        fix="call in_order logging on every rank (or log on the main process without in_order)"),
    Scenario(
        "dead-rank", "dead_rank",
        "a rank is killed mid-training (SIGKILL, as the out-of-memory killer does)",
        _same("rank-exited", "crash"), _diverge, "DIVERGE_RANK", None, "training",
        fix="find why the rank died (dmesg for the OOM killer, notebook 04 for memory)",
        notes="on gloo the survivors fail at once with 'Connection reset by peer'; the doctor names "
              "the dead rank, not them"),
    Scenario(
        "stuck-compute", "stuck_compute",
        "a rank stuck in a compute loop that never converges while the others wait in an all_reduce",
        _same("rank-missing", "hang"), _diverge, "DIVERGE_RANK", "loop", "others",
        fix="bound the loop (MAX_ITERS) or make the stop condition reachable on every rank"),
    Scenario(
        "healthy", "healthy",
        "healthy DDP training (gather_for_metrics, wait_for_everyone); LATE_S makes one rank late "
        "once: late by less than stall_s is not a hang",
        _same("ok", "ok"), lambda n, p: [], "none", None, variants=("fixed",)),
)


def get(scenario_id: str) -> Scenario:
    """The scenario with this id (ValueError naming the known ids otherwise)."""
    for scenario in SCENARIOS:
        if scenario.id == scenario_id:
            return scenario
    raise ValueError(f"scenario must be one of {', '.join(s.id for s in SCENARIOS)}; got {scenario_id!r}")


def table() -> list[dict[str, Any]]:
    """The catalog as rows (id, what it shows, variants, parameters, kinds per launcher, culprits)."""
    return [scenario.row() for scenario in SCENARIOS]


def run_main(scenario_id: str, **parameters: Any) -> Any:
    """Run one rank's work of a scenario (its ``main``); for ``helpers.launch(run_main, ...)``."""
    return get(scenario_id).load().main(**parameters)


if __name__ == "__main__":  # pragma: no cover - a quick look at the table
    from helpers import report

    print(report.text_table(table(), ["id", "launch kind", "culprit ranks"]), file=sys.stderr)
