"""The minimal repro builder: from a symptom, or a recorded hang, to a script anyone can run.

Maintainers ask for "a descriptive post with your configuration and reproducible code"; a real
training script needs its model, its data and its cluster. This module turns

- a symptom (``SYMPTOMS``: hangs at eval, at save, after early stopping, ...) into scenarios of the
  doctor's catalog (``helpers.scenarios``, one table);
- a scenario into a standalone script (``build_script``): a few dozen lines importing only torch and
  accelerate, ``Accelerator(cpu=not torch.cuda.is_available())``, its parameters baked in, and a
  comment block saying what it shows and how to launch it on N ranks (torchrun, ``accelerate launch
  --multi_gpu``, the doctor), CPU included;
- a run kept by the hang doctor (``python -m helpers doctor --keep DIR -- train.py``) into a replay
  (``build_replay``; see ``helpers.repro_replay``) that issues the recorded collectives with dummy
  tensors and fails the same way;

runs them under the doctor (``run_script``), contrasts what plain runs and the debug modes show for
a shape mismatch (``debug_contrast``) and writes an issue-ready ``report.md`` (``write_report``:
summary, environment from the audit with secrets, host names and home folders removed, the script,
the launch command, the diagnosis, versions).

CLI: ``python -m helpers repro --list`` | ``--scenario ID [--variant broken|fixed] [--num-processes N]
[--out-dir DIR] [--param NAME=VALUE ...] [--run]`` | ``--from-trace DIR --out-dir DIR2 [--run]``.
Exit 0: written (and, with ``--run``, the run behaved as expected: the broken variant diagnosed as the
catalog says, the fixed one ok, the replay as the recorded run); 1: it did not; 2: bad usage.
"""

from __future__ import annotations

import argparse
import ast
import functools
import html
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import cli, params, report

DEFAULT_OUT_DIR = "reports/repro"
RUN_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------------------------
# symptoms -> scenarios


@dataclass(frozen=True)
class Symptom:
    """What a user sees, the catalog scenarios that reproduce it (most likely first), the cause."""

    name: str
    sees: str
    scenarios: tuple[str, ...]
    cause: str


SYMPTOMS: dict[str, Symptom] = {s.name: s for s in (
    Symptom("hangs-at-eval",
            "training steps run, then every rank stops at evaluation: no error, no progress, until "
            "the process-group timeout (10 min on NCCL, 30 min on gloo) ends the job",
            ("uneven-eval", "main-only-collective", "in-order-logging"),
            "ranks issue different collectives at eval: one rank has fewer batches (even_batches=False), "
            "or a metric is reduced or logged in order on the main process only"),
    Symptom("hangs-at-save",
            "the job stops when it saves a checkpoint or prepares files on the main process",
            ("main-only-collective", "one-branch-barrier"),
            "a collective (gather, reduce; get_state_dict under FSDP or DeepSpeed ZeRO-3) or "
            "wait_for_everyone() called inside `if accelerator.is_main_process`"),
    Symptom("hangs-after-early-stop",
            "one rank decides to stop (early stopping, a max-steps check on its own loss) and the "
            "others hang in their next step",
            ("early-stop",),
            "the ranks leave the loop at different steps; set_trigger()/check_trigger() makes them agree"),
    Symptom("shape-mismatch-error",
            "a gather crashes (SIGABRT, 'Received data size doesn't match expected size'), hangs, or "
            "returns wrong data silently",
            ("variable-gather",),
            "ranks pass tensors of different shapes to one collective; pad them first"),
    Symptom("nccl-timeout",
            "after the process-group timeout (10 min on NCCL by default) the job dies with a timeout "
            "error naming a collective",
            ("stuck-compute", "dead-rank"),
            "some rank never reached the collective the others wait in: stuck in compute or data "
            "loading, or dead"),
    Symptom("one-rank-crashes",
            "one rank dies (killed, out of memory) and the others fail with 'Connection reset by "
            "peer' or wait until the timeout",
            ("dead-rank",),
            "the dead rank's own cause (its exit code, dmesg for the out-of-memory killer)"),
)}


def get_symptom(symptom: str) -> Symptom:
    """The symptom named ``symptom`` (ValueError naming the accepted ones otherwise)."""
    params.check("symptom", symptom)
    return SYMPTOMS[symptom]


def scenario_ids() -> list[str]:
    """The catalog's scenario ids, in the catalog's order."""
    from helpers import scenarios

    return [entry.id for entry in scenarios.SCENARIOS]


def get_scenario(scenario_id: str) -> Any:
    """The catalog scenario with this id (ValueError naming the known ids otherwise)."""
    from helpers import scenarios

    if not isinstance(scenario_id, str):
        raise ValueError(f"scenario must be a scenario id (a string); got {scenario_id!r}")
    return scenarios.get(scenario_id)


@dataclass
class SymptomTable(report.ResultMixin):
    """The documented table: symptom -> what you see -> catalog scenarios -> the usual cause."""

    rows: list[dict[str, str]]
    selected: str = ""

    def _repr_html_(self) -> str:
        body = []
        for row in self.rows:
            style = ' style="background:#fff3cd"' if row["symptom"] == self.selected else ""
            cells = "".join(f"<td>{html.escape(row[c])}</td>" for c in self.columns())
            body.append(f"<tr{style}>{cells}</tr>")
        head = "".join(f"<th>{c}</th>" for c in self.columns())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

    @staticmethod
    def columns() -> list[str]:
        """The table's columns."""
        return ["symptom", "what you see", "scenarios", "usual cause"]

    def text(self) -> str:
        """The table as plain text."""
        return report.text_table(self.rows, self.columns())


def symptom_table(selected: str = "") -> SymptomTable:
    """Every symptom, what it looks like, the scenarios that reproduce it; ``selected`` highlighted."""
    if selected:
        get_symptom(selected)
    rows = [{"symptom": s.name, "what you see": s.sees, "scenarios": ", ".join(s.scenarios),
             "usual cause": s.cause} for s in SYMPTOMS.values()]
    return SymptomTable(rows, selected)


# ---------------------------------------------------------------------------------------------
# scripts


@dataclass
class ReproScript(report.ResultMixin):
    """A generated script: what it is, where it is, how to launch it, what should happen."""

    name: str  # scenario id, or "replay"
    variant: str  # broken | fixed | replay
    path: str
    num_processes: int
    parameters: dict[str, Any]
    commands: list[str]
    text: str
    expected: dict[str, Any]  # kind, verdicts (empty: any), ranks: under the doctor
    shows: str = ""
    fix: str = ""
    notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"ReproScript({self.name!r}, {self.variant!r}, {Path(self.path).name!r}, {self.lines} lines)"

    @property
    def lines(self) -> int:
        """How many lines the script has."""
        return len(self.text.splitlines())

    def _repr_html_(self) -> str:
        commands = "".join(f"<li><code>{html.escape(c)}</code></li>" for c in self.commands)
        notes = "".join(f"<p><i>Note: {html.escape(note)}.</i></p>" for note in self.notes)
        return (f"<div><b>{html.escape(Path(self.path).name)}</b> &middot; {self.lines} lines &middot; "
                f"{html.escape(self.name)} ({html.escape(self.variant)})"
                f"<p>{html.escape(self.shows)}</p><p>Launch on {self.num_processes} ranks:</p>"
                f"<ul>{commands}</ul><p>Expected under the doctor: "
                f"{html.escape(expected_text(self.expected))}</p>{notes}<details open><summary>the script"
                f"</summary><pre>{html.escape(self.text)}</pre></details></div>")


def expected_text(expected: dict[str, Any]) -> str:
    """'collective-mismatch (hang), culprit ranks [1]' from an expectation."""
    verdicts = "/".join(expected.get("verdicts") or []) or "any verdict"
    return f"{expected.get('kind')} ({verdicts}), culprit ranks {expected.get('ranks')}"


def launch_commands(script_name: str, num_processes: int) -> list[str]:
    """Ways verified to start N ranks, GPUs or CPU (FACTS.md: plain `accelerate launch` starts one)."""
    return [f"torchrun --nproc-per-node {num_processes} {script_name}",
            f"accelerate launch --multi_gpu --num_processes {num_processes} {script_name}",
            f"python -m helpers doctor --num-processes {num_processes} -- {script_name}"]


def build_script(scenario: str, variant: str = "broken", out_dir: str | Path = DEFAULT_OUT_DIR,
                 num_processes: int = 2, **parameters: Any) -> ReproScript:
    """Write a standalone script of a catalog scenario, its parameters baked in; return it.

    ``parameters`` are the scenario's UPPER_CASE constants by their lower-case names
    (``diverge_rank=0, step=3``; ``pg_timeout_s=60`` makes a hang end after 60 s). The script
    imports only torch and accelerate and starts with a comment block saying what it shows, what
    to expect and how to launch it. Bad values raise ValueError naming the parameter.
    """
    entry = get_scenario(scenario)
    variant = params.check("variant", variant)
    num_processes = params.check("num_processes", num_processes)
    if variant not in entry.variants:
        raise ValueError(f"scenario {entry.id!r} has no {variant} variant: it is healthy training "
                         f"(variants: {', '.join(entry.variants)})")
    values = check_parameters(entry, parameters, num_processes)
    folder = _out_folder(out_dir)
    path = folder / f"{entry.module}_{variant}.py"
    expected = scenario_expectation(entry, variant, num_processes, values)
    text = render_scenario(entry, variant, values, num_processes, path.name, expected)
    report.atomic_write_text(path, text)
    return ReproScript(entry.id, variant, str(path), num_processes, values,
                       launch_commands(path.name, num_processes), text, expected, entry.shows, entry.fix)


def _out_folder(out_dir: str | Path) -> Path:
    folder = params.resolve_path(params.check("out_dir", out_dir))
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"out_dir must be a folder; {folder} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def check_parameters(entry: Any, given: dict[str, Any], num_processes: int) -> dict[str, Any]:
    """The scenario's parameters (UPPER_CASE -> value) with ``given`` (lower-case names) checked in."""
    defaults = {name: value for name, value in entry.parameters().items() if name != "VARIANT"}
    known = ", ".join(name.lower() for name in defaults)
    values = dict(defaults)
    for name, value in given.items():
        upper = name.upper()
        if upper not in defaults:
            raise ValueError(f"{name} is not a parameter of scenario {entry.id!r}; its parameters: {known}")
        values[upper] = _checked_value(name, value, defaults[upper], num_processes)
    return values


def _checked_value(name: str, value: Any, default: Any, num_processes: int) -> Any:
    kind = type(default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        raise ValueError(f"{name} must be {_noun(kind)}; got {value!r} ({type(value).__name__})")
    if kind in (int, float) and value < 0:
        raise ValueError(f"{name} must be {_noun(kind)} >= 0; got {value!r}")
    if name.lower().endswith("_rank") and value >= num_processes:
        raise ValueError(f"{name} must be a rank in 0..{num_processes - 1} (num_processes={num_processes}); "
                         f"got {value!r}")
    return value


def _noun(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "True or False"}.get(kind, str(kind))


def scenario_expectation(entry: Any, variant: str, num_processes: int, values: dict[str, Any]) -> dict:
    """What the doctor must say about this script (the catalog's row for the CLI launcher)."""
    if variant == "fixed":
        return {"kind": "ok", "verdicts": ["ok"], "ranks": []}
    expected = entry.expected["cli"]
    overrides = {name.lower(): value for name, value in values.items()}
    return {"kind": expected.kind, "verdicts": list(expected.verdicts),
            "ranks": entry.culprit_ranks(num_processes, **overrides)}


_MARKER = re.compile(r"[ \t]*# doctor-line: [\w-]+")
_MAIN_CALL = "    main(**parse_args())\n"


def render_scenario(entry: Any, variant: str, values: dict[str, Any], num_processes: int,
                    script_name: str, expected: dict[str, Any]) -> str:
    """The scenario's source with VARIANT and parameters replaced, its markers removed, a header."""
    source = entry.path.read_text()
    body = _bake(source, {"VARIANT": variant, **values})
    body = _MARKER.sub("", body)
    body = body.replace(_MAIN_CALL, "    print(main(**parse_args()), flush=True)\n")
    return _scenario_header(entry, variant, values, num_processes, script_name, expected) + body


def _bake(source: str, values: dict[str, Any]) -> str:
    """Replace the values of top-level UPPER_CASE assignments (comments kept)."""
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in values and node.value.lineno == node.value.end_lineno:
                edits.append((node.value.lineno - 1, node.value.col_offset, node.value.end_col_offset,
                              _python_literal(values[name])))
    for line, start, end, text in sorted(edits, reverse=True):
        raw = lines[line].encode()
        lines[line] = (raw[:start] + text.encode() + raw[end:]).decode()
    return "".join(lines)


def _python_literal(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _scenario_header(entry: Any, variant: str, values: dict[str, Any], num_processes: int,
                     script_name: str, expected: dict[str, Any]) -> str:
    shown = ", ".join(f"{name} = {_python_literal(value)}" for name, value in values.items()
                      if name != "PG_TIMEOUT_S")
    if variant == "broken":
        torchrun = entry.expected["torchrun"].verdicts
        what = " or ".join(_VERDICT_WORDS[v] for v in torchrun if v in _VERDICT_WORDS)
        outcome = (f"Expected: it {what} (torchrun, accelerate launch); `python -m helpers doctor` names "
                   f"it: {expected_text(expected)}.")
        fix = f"The fix (variant \"fixed\"): {entry.fix}." if entry.fix else None
    else:
        outcome = "Expected: every rank finishes and prints its result."
        fix = f"This is the fixed variant: {entry.fix}." if entry.fix else None
    first = next((name for name in values if name != "PG_TIMEOUT_S"), "PG_TIMEOUT_S")
    flag = "--" + first.lower().replace("_", "-")
    lines = [f"Minimal repro: {entry.shows}.",
             f"Scenario {entry.id!r} (helpers.scenarios), variant {variant!r}; parameters baked in "
             f"below: {shown} (edit them, or override them on the command line: {flag} VALUE ...).",
             outcome, fix, "",
             f"Launch it on {num_processes} ranks (one GPU per rank, or CPUs with gloo where there is "
             "no GPU):",
             *[f"  {command}" + ("   (names a hang in seconds)" if "doctor" in command else "")
               for command in launch_commands(script_name, num_processes)],
             "Without GPUs, `accelerate launch` without --multi_gpu starts ONE process.",
             "Add --pg-timeout-s 60 to make a hang end after 60 s instead of torch's default "
             "(30 min on gloo, 10 on NCCL)."]
    from helpers.repro_replay import comment

    return "\n".join(comment(line) for line in lines if line is not None) + "\n"


_VERDICT_WORDS = {"hang": "hangs until torch's process-group timeout", "crash": "crashes",
                  "mismatch": "finishes with wrong data"}


# ---------------------------------------------------------------------------------------------
# replays


def build_replay(from_trace: str | Path, out_dir: str | Path = DEFAULT_OUT_DIR,
                 name: str = "replay.py") -> ReproScript:
    """Write a replay of a run kept with ``python -m helpers doctor --keep DIR``; return it.

    Each rank issues the collectives it issued in the recorded run (ops, shapes, dtypes, order)
    with dummy tensors and stops where it was; run under the doctor it gets the same kind and
    culprit ranks. ValueError (naming ``from_trace``) for a missing folder or a corrupt record.
    """
    from helpers import repro_replay

    params.check("from_trace", from_trace)
    if not str(from_trace):
        raise ValueError("from_trace must name a folder kept by `python -m helpers doctor --keep DIR`; "
                         "got ''")
    recording = repro_replay.load_recording(from_trace)
    plan = repro_replay.plan_replay(recording)
    folder = _out_folder(out_dir)
    path = folder / name
    text = repro_replay.render_replay(plan, path.name)
    report.atomic_write_text(path, text)
    diagnosis = recording.diagnosis
    expected = {"kind": diagnosis["kind"], "verdicts": [], "ranks": list(diagnosis["ranks"])}
    shows = (f"a replay of a recorded run on {plan.num_processes} ranks: "
             f"{diagnosis.get('verdict')} ({diagnosis['kind']})")
    return ReproScript("replay", "replay", str(path), plan.num_processes, {},
                       launch_commands(path.name, plan.num_processes), text, expected,
                       clean(shows), clean(str(diagnosis.get("fix") or "")), list(plan.notes))


def clean(text: str) -> str:
    """Text fit for a report: secrets, home folders, user and host names replaced."""
    from helpers.repro_run import clean_output

    return clean_output(text)


# ---------------------------------------------------------------------------------------------
# runs


@dataclass
class Note(report.ResultMixin):
    """A step that does not apply here, and why."""

    message: str

    def __repr__(self) -> str:
        return f"Note({self.message!r})"

    def _repr_html_(self) -> str:
        return f"<p><i>{html.escape(self.message)}</i></p>"


@dataclass
class ReproRun(report.ResultMixin):
    """A generated script run under the hang doctor: its diagnosis, and whether it is the expected one."""

    script: str
    name: str
    variant: str
    num_processes: int
    stall_s: float
    diagnosis: Any  # helpers.diagnosis.Diagnosis (with the evidence its swimlane reads)
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
    from helpers import repro_run

    stall_s = params.check("stall_s", stall_s)
    timeout_s = params.check("timeout_s", timeout_s)
    path = Path(script.path)
    keep = path.with_name(path.stem + "-trace")
    diagnosis, output, seconds = repro_run.run_under_doctor(path, None, script.num_processes, stall_s,
                                                            timeout_s, keep, env)
    cleaned = repro_run.clean_output(output)
    report.atomic_write_text(path.with_suffix(".log"), cleaned)
    return ReproRun(str(path), script.name, script.variant, script.num_processes, stall_s, diagnosis,
                    script.expected, str(keep), seconds, cleaned[-repro_run.LOG_TAIL:], script.fix)


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
    from helpers import repro_run

    if get_symptom(symptom).name != "shape-mismatch-error":
        return Note("The debug-mode contrast is about shape mismatches: run this notebook with "
                    "symptom = \"shape-mismatch-error\" to see it.")
    script = build_script("variable-gather", "broken", out_dir, num_processes)
    return repro_run.debug_contrast(script.path, num_processes, pg_timeout_s, stall_s)


# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class ReportFiles(report.ResultMixin):
    """Where the report went, and its summary paragraph."""

    report_md: str
    diagnosis_json: str
    summary: str

    def _repr_html_(self) -> str:
        return (f"<div><p>{html.escape(self.summary)}</p><ul>"
                f"<li><code>{html.escape(self.report_md)}</code>: paste it into an issue</li>"
                f"<li><code>{html.escape(self.diagnosis_json)}</code>: the doctor's diagnosis</li>"
                "</ul></div>")


def write_report(run: ReproRun, fixed: ReproRun | Note | None = None, out_dir: str | Path | None = None,
                 facts: dict[str, Any] | None = None) -> ReportFiles:
    """Write ``report.md`` (ready for an accelerate or torch issue) and ``diagnosis.json``.

    The environment comes from the audit (``helpers.audit_facts``), anonymised; every secret,
    home folder, user and host name is replaced in the whole text.
    """
    from helpers.audit import collect_facts

    folder = _out_folder(out_dir) if out_dir else Path(run.script).parent
    facts = facts if facts is not None else collect_facts(anonymize=True)
    summary = report_summary(run, fixed)
    text = clean(report_markdown(run, fixed, facts, summary))
    markdown = report.atomic_write_text(folder / "report.md", text)
    diagnosis = report.atomic_write_json(folder / "diagnosis.json", run.diagnosis)
    return ReportFiles(str(markdown), str(diagnosis), clean(summary))


def report_summary(run: ReproRun, fixed: ReproRun | Note | None) -> str:
    """The report's first paragraph."""
    found = run.diagnosis
    script = Path(run.script)
    what = SCRIPT_WHAT.get(run.variant, "This script")
    text = (f"{what} ({script.name}, {_line_count(script)} lines, only torch and accelerate) reproduces "
            f"a {found.verdict} of {run.num_processes}-rank training with Accelerate, on CPUs (gloo) as "
            f"well as on GPUs. The hang doctor (`python -m helpers doctor`) diagnoses it as "
            f"{found.kind}, culprit ranks {found.ranks}: {found.summary}")
    if isinstance(fixed, ReproRun):
        state = "finishes on every rank" if fixed.diagnosis.verdict == "ok" else \
            f"does not pass either ({fixed.diagnosis.verdict}: {fixed.diagnosis.kind})"
        text += f" The fixed variant ({Path(fixed.script).name}) {state}."
    return text


SCRIPT_WHAT = {"broken": "This minimal script", "replay": "This replay of a recorded run",
               "fixed": "This fixed script"}


def _line_count(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def report_markdown(run: ReproRun, fixed: ReproRun | Note | None, facts: dict[str, Any], summary: str) -> str:
    """report.md's text (before redaction)."""
    from helpers.audit import summary_rows

    script = Path(run.script)
    rows = [row for row in summary_rows(facts)
            if row["fact"] not in ("rendezvous port", "host", "variables collected")]
    env = facts.get("env") or {}
    variables = ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())) or "none set"
    lines = [f"# Minimal repro: {run.diagnosis.kind} ({run.diagnosis.verdict}) on {run.num_processes} ranks",
             "", summary, "", "## Environment", "", "| fact | value |", "|---|---|"]
    lines += [f"| {_cell(row['fact'])} | {_cell(row['value'])} |" for row in rows]
    lines += ["", f"Distributed-related environment variables: {variables}", "",
              f"## Reproduction: {script.name}", "", "```python", script.read_text().rstrip(), "```", "",
              "Launch (each starts the ranks on GPUs, or on CPUs with gloo; the diagnosis below comes "
              "from the last one):", "", "```",
              *launch_commands(script.name, run.num_processes), "```", "",
              "## What happens", "", "```", run.diagnosis.text(), "```"]
    if isinstance(fixed, ReproRun):
        lines += ["", f"With the fix ({Path(fixed.script).name}): {fixed.diagnosis.verdict} "
                      f"({fixed.diagnosis.kind}). {fixed.diagnosis.summary}"]
    lines += ["", "## Versions", ""]
    lines += [f"- {name}: {value}" for name, value in _versions(facts)]
    lines += ["", "_Written by `python -m helpers repro` (the multi-GPU troubleshooting notebooks, "
                  "notebook 02)._", ""]
    return "\n".join(lines)


def _cell(value: str) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _versions(facts: dict[str, Any]) -> list[tuple[str, str]]:
    packages = facts.get("packages") or {}
    torch = facts.get("torch") or {}
    os_facts = facts.get("os") or {}
    found = [("Python", (facts.get("python") or {}).get("version")),
             ("torch", torch.get("version") or packages.get("torch")),
             ("accelerate", packages.get("accelerate")),
             ("CUDA (torch build)", torch.get("cuda")), ("NCCL", torch.get("nccl")),
             ("OS", f"{os_facts.get('distro')}, kernel {os_facts.get('kernel')}")]
    found += [(name, version) for name, version in sorted(packages.items())
              if name in ("transformers", "deepspeed", "numpy") and version]
    return [(name, str(value)) for name, value in found if value]


# ---------------------------------------------------------------------------------------------
# the notebook's steps


def check_config(cfg: params.Config) -> params.Config:
    """What ``params.validate`` cannot check: ``from_trace`` is a readable record, ``out_dir`` a folder."""
    from helpers import repro_replay

    out_dir = params.resolve_path(cfg.get("out_dir", DEFAULT_OUT_DIR))
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir must be a folder; {out_dir} is a file")
    if cfg.get("from_trace"):
        repro_replay.load_recording(cfg.from_trace)
    return cfg


def build_for(cfg: params.Config) -> ReproScript:
    """The notebook's script: the replay of ``from_trace`` when set, else the broken variant of the
    symptom's first scenario."""
    if cfg.get("from_trace"):
        return build_replay(cfg.from_trace, cfg.out_dir)
    scenario = get_symptom(cfg.symptom).scenarios[0]
    return build_script(scenario, "broken", cfg.out_dir, cfg.num_processes)


@dataclass
class Outcome(report.ResultMixin):
    """The notebook's outcome: the bug diagnosed as expected, the fix passing, the report written."""

    ok: bool
    broken: ReproRun
    fixed: ReproRun | None
    report_md: str
    problems: list[str]

    def verdict(self) -> str:
        """One line for the last cell."""
        if self.ok:
            fixed = "; the fixed variant passed" if self.fixed else ""
            return f"Reproduced: {self.broken.verdict().rstrip('.')}{fixed}. Report: {self.report_md}"
        return "Not reproduced: " + "; ".join(self.problems)


def outcome(broken: ReproRun, fixed: ReproRun | Note | None, files: ReportFiles | None = None) -> Outcome:
    """Did the broken run get its expected diagnosis and the fixed one pass?"""
    problems = []
    if not broken.as_expected:
        problems.append(broken.verdict())
    fixed_run = fixed if isinstance(fixed, ReproRun) else None
    if fixed_run is not None and not (fixed_run.diagnosis.verdict == "ok" and fixed_run.as_expected):
        problems.append(fixed_run.verdict())
    return Outcome(not problems, broken, fixed_run, files.report_md if files else "", problems)


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


# ---------------------------------------------------------------------------------------------
# command line


def cli_main(argv: list[str]) -> int:
    """``python -m helpers repro ...``: exit 0 written (and as expected), 1 not as expected, 2 usage."""
    from helpers.cli import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if args.list:
        print(list_text())
        return EXIT_OK
    try:
        script = _cli_script(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {script.path} ({script.lines} lines); launch it with:")
    print("\n".join(f"  {command}" for command in script.commands))
    if not args.run:
        if args.json:
            script.to_json(params.resolve_path(args.json))
        return EXIT_OK
    run = run_script(script, args.stall_s, args.timeout_s)
    files = write_report(run)
    print(run.diagnosis.text())
    print(run.verdict())
    print(f"wrote {files.diagnosis_json} and {files.report_md}")
    if args.json:
        run.to_json(params.resolve_path(args.json))
    return EXIT_OK if run.as_expected else EXIT_PROBLEM


def _parser() -> argparse.ArgumentParser:
    from helpers.cli import add_param

    parser = argparse.ArgumentParser(
        prog="python -m helpers repro",
        description="Build a standalone script that reproduces a multi-GPU hang: from a catalog "
                    "scenario, a symptom, or a run kept by `python -m helpers doctor --keep DIR`.",
        epilog="Exit: 0 written (with --run: the run behaved as expected), 1 it did not, 2 bad usage.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--list", action="store_true", help="list the scenarios: id, then what it shows")
    source.add_argument("--scenario", help="a scenario id (see --list)")
    add_param(source, "symptom", None)
    add_param(source, "from_trace", None)
    add_param(parser, "variant", "broken")
    add_param(parser, "num_processes", 2)
    add_param(parser, "out_dir", DEFAULT_OUT_DIR)
    add_param(parser, "stall_s", 5.0)
    add_param(parser, "timeout_s", RUN_TIMEOUT_S)
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a scenario parameter, e.g. --param diverge_rank=0 (repeatable)")
    parser.add_argument("--run", action="store_true",
                        help="run it under the doctor; write diagnosis.json and report.md next to it")
    parser.add_argument("--json", default="", type=cli.path_arg,
                        help="write the result (script, or run with --run) as JSON")
    return parser


def _cli_script(args: argparse.Namespace) -> ReproScript:
    if args.from_trace is not None:
        if args.param:
            raise ValueError("--param applies to catalog scenarios, not to --from-trace")
        return build_replay(args.from_trace, args.out_dir)
    scenario = args.scenario or get_symptom(args.symptom).scenarios[0]
    values = dict(_parse_param(text) for text in args.param)
    return build_script(scenario, args.variant, args.out_dir, args.num_processes, **values)


def _parse_param(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--param must be NAME=VALUE (e.g. diverge_rank=0); got {text!r}")
    value: Any = raw
    for kind in (int, float):
        try:
            value = kind(raw)
            break
        except ValueError:
            continue
    return name.strip().replace("-", "_"), value


def list_text() -> str:
    """One scenario per line: its id first, then what it shows (and when it has no broken variant)."""
    from helpers import scenarios

    width = max(len(s.id) for s in scenarios.SCENARIOS) + 2
    lines = []
    for entry in scenarios.SCENARIOS:
        extra = "" if "broken" in entry.variants else " (no broken variant: healthy training)"
        lines.append(f"{entry.id:<{width}}{entry.shows}{extra}")
    return "\n".join(lines)
