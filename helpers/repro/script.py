"""Scripts: a catalog scenario rendered as a standalone script, or a replay of a recorded run.

The script imports only torch and accelerate, ``Accelerator(cpu=not torch.cuda.is_available())``,
its parameters baked in, and a comment block saying what it shows and how to launch it on N ranks
(torchrun, ``accelerate launch --multi_gpu``, the doctor), CPU included.
"""

from __future__ import annotations

import ast
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import params, redact, report
from helpers.repro import replay
from helpers.repro.symptoms import get_scenario

DEFAULT_OUT_DIR = "reports/repro"


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
    values = check_scenario_parameters(entry, parameters, num_processes)
    folder = out_folder(out_dir)
    path = folder / f"{entry.module}_{variant}.py"
    expected = scenario_expectation(entry, variant, num_processes, values)
    text = render_scenario(entry, variant, values, num_processes, path.name, expected)
    report.atomic_write_text(path, text)
    return ReproScript(entry.id, variant, str(path), num_processes, values,
                       launch_commands(path.name, num_processes), text, expected, entry.shows, entry.fix)


def out_folder(out_dir: str | Path) -> Path:
    """The output folder (a notebook parameter: relative to the repository root), created."""
    folder = params.resolve_path(params.check("out_dir", out_dir))
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"out_dir must be a folder; {folder} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def check_scenario_parameters(entry: Any, given: dict[str, Any], num_processes: int) -> dict[str, Any]:
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
    return "\n".join(replay.comment(line) for line in lines if line is not None) + "\n"


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
    params.check("from_trace", from_trace)
    if not str(from_trace):
        raise ValueError("from_trace must name a folder kept by `python -m helpers doctor --keep DIR`; "
                         "got ''")
    recording = replay.load_recording(from_trace)
    plan = replay.plan_replay(recording)
    folder = out_folder(out_dir)
    path = folder / name
    text = replay.render_replay(plan, path.name)
    report.atomic_write_text(path, text)
    diagnosis = recording.diagnosis
    expected = {"kind": diagnosis["kind"], "verdicts": [], "ranks": list(diagnosis["ranks"])}
    shows = (f"a replay of a recorded run on {plan.num_processes} ranks: "
             f"{diagnosis.get('verdict')} ({diagnosis['kind']})")
    return ReproScript("replay", "replay", str(path), plan.num_processes, {},
                       launch_commands(path.name, plan.num_processes), text, expected,
                       redact.for_report(shows), redact.for_report(str(diagnosis.get("fix") or "")),
                       list(plan.notes))
