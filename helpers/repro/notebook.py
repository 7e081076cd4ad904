"""Notebook 02's steps: validate, build, run, outcome, and the widget panel."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from helpers import params, report
from helpers.report import Note
from helpers.repro import replay
from helpers.repro.issue import IssueFiles, write_report
from helpers.repro.live import AttachCheck
from helpers.repro.runs import ReproRun, run_fix, run_script
from helpers.repro.script import DEFAULT_OUT_DIR, ReproScript, build_replay, build_script
from helpers.repro.symptoms import get_scenario, get_symptom, scenario_ids


def check_config(cfg: params.Config) -> params.Config:
    """What ``params.validate`` cannot check: ``from_trace`` is a readable record, ``out_dir`` a folder."""
    out_dir = params.resolve_path(cfg.get("out_dir", DEFAULT_OUT_DIR))
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir must be a folder; {out_dir} is a file")
    if cfg.get("from_trace"):
        replay.load_recording(cfg.from_trace)
    return cfg


def build_for(cfg: params.Config) -> ReproScript:
    """The notebook's script: the replay of ``from_trace`` when set, else the broken variant of the
    symptom's first scenario."""
    if cfg.get("from_trace"):
        return build_replay(cfg.from_trace, cfg.out_dir)
    scenario = get_symptom(cfg.symptom).scenarios[0]
    return build_script(scenario, "broken", cfg.out_dir, cfg.num_processes)


@dataclass
class ReproOutcome(report.Outcome):
    """The notebook's outcome: the bug diagnosed as expected, the fix passing, the report written,
    and (``attach``) attaching to the hung torchrun job named the scenario's culprit."""

    ok: bool
    broken: ReproRun
    fixed: ReproRun | None
    report_md: str
    problems: list[str]
    attach: AttachCheck | None = None

    def verdict(self) -> str:
        """One line for the last cell."""
        if self.ok:
            fixed = "; the fixed variant passed" if self.fixed else ""
            attach = f"; {self.attach.verdict()}" if self.attach else ""
            return f"Reproduced: {self.broken.verdict().rstrip('.')}{fixed}{attach}. Report: {self.report_md}"
        return "Not reproduced: " + "; ".join(self.problems)

    def headline(self) -> str:
        """The scenario, what the doctor found in how long, whether expected, and the fix's run."""
        broken, found = self.broken, self.broken.diagnosis
        line = (f"{broken.name}: {found.verdict} ({found.kind}), culprit ranks {found.ranks}, "
                f"in {broken.seconds:.1f} s, " + ("as expected" if broken.as_expected else "NOT as expected"))
        if self.fixed is not None:
            fixed_ok = self.fixed.diagnosis.verdict == "ok" and self.fixed.as_expected
            line += "; fixed variant " + (
                "passed" if fixed_ok else f"FAILED ({self.fixed.diagnosis.verdict})")
        return line


def outcome(broken: ReproRun, fixed: ReproRun | Note | None, files: IssueFiles | None = None,
            attach: AttachCheck | None = None) -> ReproOutcome:
    """Did the broken run get its expected diagnosis, the fixed one pass and (``attach``, from
    ``repro.attach_check``) attaching to the hung job name its culprit, leaving no process?"""
    problems = []
    if not broken.as_expected:
        problems.append(broken.verdict())
    fixed_run = fixed if isinstance(fixed, ReproRun) else None
    if fixed_run is not None and not (fixed_run.diagnosis.verdict == "ok" and fixed_run.as_expected):
        problems.append(fixed_run.verdict())
    if attach is not None:
        problems += attach.problems
    return ReproOutcome(not problems, broken, fixed_run, files.report_md if files else "", problems, attach)


ACTIONS = ("build", "run", "show fix", "export")
BUTTONS = {"Build": "build", "Run": "run", "Show fix": "show fix", "Export": "export"}


def explore(symptom: str = "hangs-at-eval", scenario: str = "auto", action: str = "build",
            num_processes: int = 2, stall_s: float = 5.0, diverge_rank: int = 1, step: int = 2,
            out_dir: str = DEFAULT_OUT_DIR) -> Any:
    """The widget panel's function: build, run, show the fix of, or export a scenario's repro.

    ``scenario="auto"`` takes the symptom's first scenario; ``diverge_rank`` and ``step`` apply to
    the scenarios that have them (the others say they ignored them).
    """
    get_symptom(symptom)
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}; got {action!r}")
    chosen = get_symptom(symptom).scenarios[0] if scenario == "auto" else scenario
    entry = get_scenario(chosen)
    names = {name.lower() for name in entry.parameters()}
    knobs = {k: v for k, v in {"diverge_rank": diverge_rank, "step": step}.items() if k in names}
    ignored = sorted({"diverge_rank", "step"} - set(knobs))
    variant = "fixed" if action == "show fix" or "broken" not in entry.variants else "broken"
    script = build_script(chosen, variant, out_dir, num_processes, **knobs)
    if ignored:
        script.notes.append(f"{chosen} has no {' or '.join(ignored)}: ignored")
    if action == "build":
        return script
    run = run_script(script, stall_s)
    if action in ("run", "show fix"):
        return run
    fixed = run_fix(script, stall_s) if variant == "broken" else None
    return write_report(run, fixed)


def panel(cfg: params.Config):
    """Notebook 02's panel: symptom, scenario and knobs; Build, Run, Show fix and Export buttons."""
    from helpers import ui

    actions = {label: functools.partial(explore, action=action) for label, action in BUTTONS.items()}
    return ui.panel(actions, {"symptom": cfg.symptom, "scenario": "auto",
                              "num_processes": cfg.num_processes, "stall_s": cfg.stall_s,
                              "diverge_rank": 1, "step": 2, "out_dir": cfg.out_dir},
                    choices={"scenario": ["auto", *scenario_ids()]}, title="Minimal repro builder")
