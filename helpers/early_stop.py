"""The early-stop sync demo (notebook 05): one rank stops alone and the others hang; then the fix.

``run_loop(variant=...)`` runs the catalog's ``early-stop`` scenario (``helpers.scenarios``: a real
DDP training loop with a model, an optimizer, a prepared dataloader and ``accelerator.backward``)
on forked ranks under the hang doctor (``helpers.doctor``):

- ``"broken"``: rank ``stop_rank`` leaves the loop at ``stop_step`` on its own; the others' next
  ``backward()`` waits in DDP's gradient all-reduce; the doctor stops the run after ``stall_s``
  seconds and names the rank, the collectives and the lines;
- ``"fixed"``: the same rank calls ``accelerator.set_trigger()``, every rank asks
  ``accelerator.check_trigger()`` each step, and all of them stop at the same step.

``lint_loops()`` shows the static check (``helpers.lint``) finding the same bug before anything
runs. Cross-parameter checks (``stop_rank`` below ``num_processes``) happen here, before any
process starts.

Notebook 05 makes one call per cell: ``check_config``, ``lint_loops``, ``run_broken`` (a ``Note``
when ``show_hang`` is False: whether to skip is decided here, not in the notebook), ``swimlane``,
``run_fixed``, ``run_in_job`` (the broken loop as a multi-node job: one torchrun agent per rank over
127.0.0.1, ``-m helpers.doctor`` inside, and the ``srun`` line for a cluster), and ``outcome`` for the
last cell. The panel calls ``run_loop`` with its widgets' values.
"""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from helpers import params, report
from helpers.report import Note, Outcome

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from helpers.doctor import Diagnosis

__all__ = ["LOOPS", "SKIPPED", "VARIANTS", "ClusterRun", "EarlyStopOutcome", "EarlyStopRun", "LoopCheck",
           "LoopLint", "RankEnd", "check_config", "lint_loops", "outcome", "panel", "run_broken", "run_fixed",
           "run_in_job", "run_loop", "swimlane"]

VARIANTS = ("fixed", "broken")
SCENARIO = "early-stop"
STEPS_AFTER_STOP = 3  # steps the loop would still run after stop_step, so that leaving early diverges
DEADLINE_MARGIN_S = 90.0  # start-up and evidence gathering on top of stall_s
ConfigT = TypeVar("ConfigT", bound=Mapping[str, Any])
SKIPPED = "broken loop: skipped (show_hang is False)"
AMBIGUOUS = ("(At step 0 the other rank waits in forward(), in the broadcast DDP issues on its second "
             "iteration, not in backward(); with 2 ranks neither rank's collective was seen before and "
             "there is no majority, so the doctor names both ranks.)")


# ---------------------------------------------------------------------------------------------
# parameters


def check_config(cfg: ConfigT) -> ConfigT:
    """Cross-parameter checks of validated parameters; returns ``cfg``, or ValueError naming the
    parameter.

    ``num_processes`` must be at least 2 (one rank has nobody to wait for), ``stop_rank`` below
    ``num_processes`` and ``variant`` (when given) one of ``VARIANTS``. Notebook 05:
    ``cfg = early_stop.check_config(params.validate(...))``.
    """
    num_processes = cfg["num_processes"]
    if num_processes < 2:
        raise ValueError(f"num_processes must be at least 2 for the early-stop demo (a single rank "
                         f"has nobody to wait for); got {num_processes}")
    stop_rank = cfg.get("stop_rank", 0)
    if stop_rank >= num_processes:
        raise ValueError(f"stop_rank must be an integer in 0..{num_processes - 1} (a rank below "
                         f"num_processes={num_processes}); got {stop_rank}")
    variant = cfg.get("variant", VARIANTS[0])
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}")
    return cfg


def _validated(num_processes: Any, stop_rank: Any, stop_step: Any, stall_s: Any,
               variant: Any) -> params.Config:
    cfg = params.validate(num_processes=num_processes, stop_rank=stop_rank, stop_step=stop_step,
                          stall_s=stall_s)
    cfg["variant"] = variant
    check_config(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class RankEnd:
    """Where one rank of a completed run left the training loop, and with which weights.

    (Not the launcher's record of how a rank process ended: every rank here returned normally.)
    """

    rank: int
    stopped_at: int | None  # the step at which it left the loop (None: it ran every step)
    steps_trained: int
    weights: float  # sum of the final weights: equal on every rank when DDP kept them in sync


@dataclass(repr=False)
class EarlyStopRun(report.ResultMixin):
    """One run of the early-stop loop under the hang doctor, and whether it went as expected.

    ``ok``: for ``broken``, the doctor diagnosed a hang of the expected kind naming exactly the
    expected culprits (``expected_culprits``); for ``fixed``, every rank finished and stopped at
    ``stop_step``.
    """

    variant: str
    num_processes: int
    stop_rank: int
    stop_step: int
    steps: int
    stall_s: float
    seconds: float
    expected_kind: str
    diagnosis: Diagnosis
    ranks: list[RankEnd] = field(default_factory=list)
    ok: bool = field(init=False)
    outcome: str = field(init=False)

    def __post_init__(self) -> None:
        self.ok = self.diagnosed_right if self.variant == "broken" else self.completed
        self.outcome = self._outcome()

    @property
    def expected_culprits(self) -> list[int]:
        """``[stop_rank]``; on 2 ranks stopping at step 0, both ranks (see ``AMBIGUOUS``)."""
        return expected_culprits(self.num_processes, self.stop_rank, self.stop_step)

    @property
    def diagnosed_right(self) -> bool:
        """The doctor called it a hang of the expected kind and blamed the expected culprits."""
        d = self.diagnosis
        return d.verdict == "hang" and d.kind == self.expected_kind and d.ranks == self.expected_culprits

    @property
    def completed(self) -> bool:
        """Every rank returned, and every rank stopped at ``stop_step``."""
        return (self.diagnosis.verdict == "ok" and len(self.ranks) == self.num_processes
                and all(r.stopped_at == self.stop_step for r in self.ranks))

    @property
    def same_weights(self) -> bool:
        """The ranks ended with the same weights (DDP's all-reduce kept them in step)."""
        return len({round(r.weights, 9) for r in self.ranks}) == 1

    def _outcome(self) -> str:
        head = (f"{self.variant} loop on {self.num_processes} ranks, rank {self.stop_rank} decided "
                f"to stop at step {self.stop_step}: ")
        d = self.diagnosis
        if self.variant == "broken":
            found = f"the doctor found {d.verdict} ({d.kind}) blaming rank(s) {d.ranks}"
            if d.detected_after_s is not None:
                found += f", {d.detected_after_s:.1f} s after progress stopped"
            verdict = "as expected" if self.ok else (
                f"NOT as expected (hang, {self.expected_kind}, rank(s) {self.expected_culprits})")
            note = f" {AMBIGUOUS}" if self.expected_culprits != [self.stop_rank] else ""
            return f"{head}{found}; {verdict}.{note}"
        if not self.ok:
            steps = {r.rank: r.stopped_at for r in self.ranks}
            return f"{head}did NOT complete as expected: {d.verdict} ({d.kind}), stopped at {steps}."
        weights = "the same final weights on every rank" if self.same_weights else "DIFFERENT weights"
        return f"{head}every rank stopped at step {self.stop_step} together, with {weights}."

    def summary(self) -> str:
        """One line: what ran and how it ended."""
        return self.outcome

    def __repr__(self) -> str:
        return f"EarlyStopRun({self.outcome})"

    def rows(self) -> list[dict[str, Any]]:
        """The per-rank table of a completed run (empty for a run that hung)."""
        return [{"rank": r.rank, "stopped at step": r.stopped_at, "steps trained": r.steps_trained,
                 "final weights (sum)": r.weights, "stopped with the others": r.stopped_at == self.stop_step}
                for r in self.ranks]

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.ok else "#c62828"
        head = (f"<p><b style='color:{colour}'>{html.escape(self.variant)}</b> &middot; "
                f"{html.escape(self.outcome)} <small>({self.seconds:.1f} s)</small></p>")
        if self.variant == "broken" or not self.ranks:
            return f"<div>{head}{self.diagnosis._repr_html_()}</div>"
        table = report.html_table(self.rows(), highlight="stopped with the others")
        return f"<div>{head}{table}</div>"

    def plot(self) -> Figure:
        """The doctor's swimlane of this run (matplotlib Figure): each rank's collectives over time."""
        title = f"{self.variant} loop: {self.diagnosis.verdict} ({self.diagnosis.kind})"
        return self.diagnosis.swimlane(title)


def expected_culprits(num_processes: int, stop_rank: int, stop_step: int) -> list[int]:
    """The ranks the doctor must blame: ``[stop_rank]``; both on 2 ranks stopping at step 0."""
    return [0, 1] if num_processes == 2 and stop_step == 0 else [stop_rank]


@dataclass(repr=False)
class ClusterRun(report.ResultMixin):
    """The broken loop as a multi-node job on this machine: one torchrun agent per rank ("node"),
    over 127.0.0.1, each in its own working folder, ``-m helpers.doctor`` inside every rank.

    ``ok``: the leading rank diagnosed the expected kind and culprits, and every agent ended with
    every rank on the doctor's exit code.
    """

    nodes: int
    stop_rank: int
    stall_s: float
    commands: list[str]  # one shell line per node
    agent_codes: list[int | None]  # each agent's exit code (None: stopped at the deadline)
    rank_codes: dict[int, int]  # each rank's exit code, from its agent's summary
    ended_s: float  # when the last agent ended, from the start
    expected_kind: str
    expected_ranks: list[int]
    diagnosis: Diagnosis | None
    srun: str  # the same job on a Slurm cluster
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        d = self.diagnosis
        self.ok = (d is not None and d.kind == self.expected_kind and d.ranks == self.expected_ranks
                   and all(code is not None for code in self.agent_codes)
                   and set(self.rank_codes.values()) == {d.exit_code})

    def summary(self) -> str:
        """One line: what the doctor inside the job found, and how the job ended."""
        d = self.diagnosis
        if d is None:
            return f"{self.nodes}-node job: no diagnosis was written (agents {self.agent_codes})"
        codes = sorted(set(self.rank_codes.values()))
        after = "" if d.detected_after_s is None else f", {d.detected_after_s:.1f} s after progress stopped"
        text = (f"{self.nodes}-node job under -m helpers.doctor: {d.verdict} ({d.kind}) blaming rank(s) "
                f"{d.ranks}{after}; every agent ended {self.ended_s:.1f} s after the start, the ranks "
                f"with exit codes {codes}")
        if not self.ok:
            text += f"; NOT as expected ({self.expected_kind}, rank(s) {self.expected_ranks})"
        return text

    def __repr__(self) -> str:
        return f"ClusterRun({self.summary()})"

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.ok else "#c62828"
        commands = html.escape("\n".join(f"# node {n} (its own folder)\n{line}"
                                         for n, line in enumerate(self.commands)))
        found = self.diagnosis._repr_html_() if self.diagnosis is not None else "<p>no diagnosis</p>"
        return (f"<div><p><b style='color:{colour}'>{html.escape(self.summary())}</b></p>"
                f"<p>The commands (what each node of a cluster runs):</p><pre>{commands}</pre>{found}"
                f"<p>On a Slurm cluster:</p><pre>{html.escape(self.srun)}</pre></div>")


def run_in_job(cfg: Mapping[str, Any]) -> ClusterRun | Note:
    """Notebook 05's cluster step: the broken loop as a ``num_processes``-node job (one rank per
    torchrun agent over 127.0.0.1) under ``-m helpers.doctor``; a ``Note`` when ``show_hang`` is
    False."""
    if not cfg.get("show_hang", True):
        return Note(SKIPPED)
    import shlex
    import tempfile

    from helpers import scenarios
    from helpers.doctor import runs

    values = _loop_values(cfg)
    scenario = scenarios.get(SCENARIO)
    steps = max(scenario.parameters()["STEPS"], values["stop_step"] + STEPS_AFTER_STOP)
    command = scenario.command("broken", diverge_rank=values["stop_rank"], step=values["stop_step"],
                               steps=steps)
    nodes = values["num_processes"]
    with tempfile.TemporaryDirectory(prefix="helpers-cluster-") as folder:
        job = runs.run_job(command, folder, nodes=nodes, per_node=1, stall_s=values["stall_s"],
                           timeout_s=values["stall_s"] + DEADLINE_MARGIN_S + 10 * nodes)
    lines = [shlex.join(["torchrun", *argv[3:]]) for argv in job.commands]  # python -m torch.distributed.run
    return ClusterRun(nodes, values["stop_rank"], values["stall_s"], lines, job.agent_codes, job.rank_codes,
                      round(job.ended_s, 1), scenario.expected["job"].kind,
                      expected_culprits(nodes, values["stop_rank"], values["stop_step"]), job.diagnosis,
                      runs.srun_line("train.py", nodes=nodes, per_node=8, stall_s=values["stall_s"]))


# ---------------------------------------------------------------------------------------------
# running the loop


def run_loop(num_processes: int = 2, stop_rank: int = 1, stop_step: int = 3,
             variant: str = "fixed", stall_s: float = 5.0) -> EarlyStopRun:
    """Run the catalog's early-stop training loop on ``num_processes`` ranks under the hang doctor.

    ``variant="broken"``: rank ``stop_rank`` breaks out alone at ``stop_step``; the doctor stops the
    hang after ``stall_s`` seconds and its diagnosis is returned (no exception). ``"fixed"``:
    set_trigger/check_trigger; every rank stops at ``stop_step``. Bad parameters raise ValueError
    naming the parameter before any process starts; a failure the doctor cannot explain raises.
    """
    from helpers import doctor, scenarios

    cfg = _validated(num_processes, stop_rank, stop_step, stall_s, variant)
    scenario = scenarios.get(SCENARIO)
    steps = max(scenario.parameters()["STEPS"], cfg.stop_step + STEPS_AFTER_STOP)
    kwargs = {"variant": cfg.variant, "diverge_rank": cfg.stop_rank, "step": cfg.stop_step,
              "steps": steps}
    started = time.monotonic()
    diagnosis = doctor.run_function(scenario.load().main, kwargs=kwargs,
                                    num_processes=cfg.num_processes, stall_s=cfg.stall_s,
                                    timeout_s=cfg.stall_s + DEADLINE_MARGIN_S)
    seconds = round(time.monotonic() - started, 2)
    results = diagnosis.results or []
    ranks = [RankEnd(r["rank"], r["stopped_at"],
                         steps if r["stopped_at"] is None else r["stopped_at"] + 1, r["weights"])
             for r in results]
    return EarlyStopRun(cfg.variant, cfg.num_processes, cfg.stop_rank, cfg.stop_step, steps,
                        cfg.stall_s, seconds, scenario.expected["launch"].kind, diagnosis, ranks)


def run_broken(cfg: Mapping[str, Any]) -> EarlyStopRun | Note:
    """Notebook 05's hang step: the broken loop under the doctor, or a ``Note`` when
    ``cfg["show_hang"]`` is False (the step is skipped)."""
    if not cfg.get("show_hang", True):
        return Note(SKIPPED)
    return run_loop(variant="broken", **_loop_values(cfg))


def run_fixed(cfg: Mapping[str, Any]) -> EarlyStopRun:
    """Notebook 05's fix step: the set_trigger/check_trigger loop with the same ranks and step."""
    return run_loop(variant="fixed", **_loop_values(cfg))


def _loop_values(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {name: cfg[name] for name in ("num_processes", "stop_rank", "stop_step", "stall_s")}


def swimlane(run: EarlyStopRun | Note) -> Figure | Note:
    """The swimlane of a run (``EarlyStopRun.plot``), or a ``Note`` when the run was skipped."""
    if isinstance(run, Note):
        return Note("show_hang is False: the broken run was skipped, so there is no swimlane to draw")
    return run.plot()


@dataclass(repr=False)
class EarlyStopOutcome(Outcome):
    """Notebook 05's outcome: the broken run diagnosed right (or skipped) and the fixed run completed.

    Its JSON is ``{"broken": ..., "fixed": ...}``, with ``"broken": null`` when it was skipped.
    """

    broken: EarlyStopRun | None  # None: skipped (show_hang is False)
    fixed: EarlyStopRun
    cluster: ClusterRun | None = None  # the broken loop as a multi-node job (None: skipped)

    @property
    def ok(self) -> bool:  # type: ignore[override]
        """The broken loop hung as expected and was diagnosed right (or was skipped), so was the
        multi-node job, and the fixed loop completed with every rank stopping together."""
        return ((self.broken is None or self.broken.diagnosed_right) and self.fixed.completed
                and (self.cluster is None or self.cluster.ok))

    def verdict(self) -> str:
        """'PASS: ...' or 'FAIL: ...' with what each loop did."""
        broken = f"{SKIPPED}." if self.broken is None else self.broken.summary()
        cluster = "" if self.cluster is None else f" {self.cluster.summary()}."
        return f"{'PASS' if self.ok else 'FAIL'}: {broken} {self.fixed.summary()}{cluster}"

    def __repr__(self) -> str:
        return f"EarlyStopOutcome({self.verdict()})"

    def headline(self) -> str:
        """The broken loop's diagnosis and how fast it came, then how the fixed loop ended."""
        parts = []
        broken = self.broken
        if broken is None:
            parts.append("broken loop skipped")
        else:
            d = broken.diagnosis
            found = f"broken loop: {d.verdict} ({d.kind}) on rank(s) {d.ranks}"
            if d.detected_after_s is not None:
                found += f" found {d.detected_after_s:.1f} s after progress stopped"
            parts.append(found + ("" if broken.diagnosed_right else " (NOT as expected)"))
        fixed = self.fixed
        if fixed.completed:
            parts.append(f"fixed loop: all {fixed.num_processes} ranks stopped at step {fixed.stop_step}"
                         f" in {fixed.seconds:.1f} s")
        else:
            parts.append(f"fixed loop did NOT complete: {fixed.diagnosis.verdict} ({fixed.diagnosis.kind})")
        if self.cluster is not None and self.cluster.diagnosis is not None:
            d = self.cluster.diagnosis
            parts.append(f"{self.cluster.nodes}-node job: {d.kind} on rank(s) {d.ranks}, every agent ended"
                         + ("" if self.cluster.ok else " (NOT as expected)"))
        return "; ".join(parts)


def outcome(broken: EarlyStopRun | Note, fixed: EarlyStopRun,
            cluster: ClusterRun | Note | None = None) -> EarlyStopOutcome:
    """Notebook 05's last cell: ``broken`` from ``run_broken`` (a Note when skipped), ``fixed`` from
    ``run_fixed``, ``cluster`` from ``run_in_job``."""
    return EarlyStopOutcome(None if isinstance(broken, Note) else broken, fixed,
                            None if isinstance(cluster, Note) else cluster)


def panel(cfg: params.Config):
    """Notebook 05's panel: ranks, stop rank, stop step, the fixed/broken toggle, Run."""
    from helpers import ui

    return ui.panel(run_loop, {"num_processes": cfg.num_processes, "stop_rank": cfg.stop_rank,
                               "stop_step": cfg.stop_step, "variant": "fixed", "stall_s": cfg.stall_s},
                    choices={"variant": VARIANTS}, title="Early-stop loop")


# ---------------------------------------------------------------------------------------------
# the static check on the same bug


LOOPS: dict[str, tuple[str, str, bool]] = {
    # name: (what it shows, the loop, should the lint flag it)
    "per-rank break": ("each rank decides on its own loss: the hang of this notebook", """\
for step, (inputs, targets) in enumerate(loader):
    loss = F.mse_loss(model(inputs), targets)
    accelerator.backward(loss)  # under DDP: the gradient all-reduce
    optimizer.step()
    optimizer.zero_grad()
    if loss.item() < threshold:  # this rank's own loss
        break
accelerator.wait_for_everyone()
""", True),
    "set_trigger / check_trigger": ("the fix: any rank sets the trigger, every rank checks it", """\
for step, (inputs, targets) in enumerate(loader):
    loss = F.mse_loss(model(inputs), targets)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if loss.item() < threshold:  # this rank's own loss
        accelerator.set_trigger()
    if accelerator.check_trigger():  # a collective: the same answer on every rank
        break
accelerator.wait_for_everyone()
""", False),
    "reduce the metric": ("the alternative: every rank decides on the same, reduced number", """\
for step, (inputs, targets) in enumerate(loader):
    loss = F.mse_loss(model(inputs), targets)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    mean_loss = accelerator.reduce(loss.detach(), reduction="mean")  # the same on every rank
    if mean_loss.item() < threshold:
        break
accelerator.wait_for_everyone()
""", False),
    "check_breakpoint": ("a name from old docs that never existed", """\
for step, (inputs, targets) in enumerate(loader):
    loss = F.mse_loss(model(inputs), targets)
    accelerator.backward(loss)
    if loss.item() < threshold:
        accelerator.set_trigger()
    if accelerator.check_breakpoint():
        break
""", True),
    "in_order logging on one rank": ("in_order=True is a barrier per rank: a collective", """\
if accelerator.is_main_process:
    logger.info(f"best loss {best:.3f}", main_process_only=False, in_order=True)
accelerator.wait_for_everyone()
""", True),
}


@dataclass
class LoopCheck:
    """One loop as the lint sees it."""

    name: str
    shows: str
    code: str
    flag_expected: bool
    codes: list[str]
    findings: list[Any]  # helpers.lint.Finding

    @property
    def as_expected(self) -> bool:
        """Flagged when it should be, clean when it should be."""
        return bool(self.codes) == self.flag_expected


@dataclass(repr=False)
class LoopLint(report.ResultMixin):
    """The static check (``helpers.lint``) over the demo's own script and typical loops."""

    script: str
    script_findings: list[Any]
    loops: list[LoopCheck]
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ok = all(loop.as_expected for loop in self.loops)

    def summary(self) -> str:
        """One line per loop: flagged or clean."""
        lines = [f"{self.script}: " + (", ".join(f"{f.code} at line {f.line}" for f in self.script_findings)
                                       or "clean")]
        lines += [f"{loop.name}: {', '.join(loop.codes) or 'clean'}" for loop in self.loops]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "LoopLint(\n" + self.summary() + "\n)"

    def _repr_html_(self) -> str:
        script_rows = [{"where": f.where, "code": f.code, "message": f.message} for f in self.script_findings]
        parts = [f"<p><b>lint on the demo's own script</b> <code>{html.escape(self.script)}</code> "
                 f"(nothing is run):</p>",
                 report.html_table(script_rows, ["where", "code", "message"]) if script_rows
                 else "<p>no finding</p>"]
        for loop in self.loops:
            verdict = ", ".join(loop.codes) or "no finding"
            colour = "#c62828" if loop.codes else "#2e7d32"
            if not loop.as_expected:
                verdict += " (NOT what the lint should say)"
            parts.append(f"<h4>{html.escape(loop.name)} <small>({html.escape(loop.shows)})</small>: "
                         f"<span style='color:{colour}'>{html.escape(verdict)}</span></h4>"
                         f"<pre>{html.escape(loop.code)}</pre>")
            for finding in loop.findings:
                parts.append(f"<p><code>line {finding.line}</code> {html.escape(finding.message)}<br>"
                             f"<b>fix:</b> {html.escape(finding.fix)}</p>")
        return "<div>" + "".join(parts) + "</div>"


def lint_loops() -> LoopLint:
    """Lint the early-stop scenario script and the loops in ``LOOPS`` (static: nothing runs)."""
    from helpers import lint, scenarios

    path = scenarios.get(SCENARIO).path
    shown = str(path.relative_to(params.REPO_ROOT))
    script = [dataclasses.replace(f, file=shown) for f in lint.lint_paths(path).findings]
    loops = []
    for name, (shows, code, flag_expected) in LOOPS.items():
        found = lint.lint_source(code, f"{name}.py").findings
        loops.append(LoopCheck(name, shows, code, flag_expected, [f.code for f in found], found))
    return LoopLint(shown, script, loops)
