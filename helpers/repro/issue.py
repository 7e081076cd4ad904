"""The issue report: ``report.md`` ready for an accelerate or torch issue, and ``diagnosis.json``.

Summary, environment from the audit (secrets, host names and home folders removed), the script,
the launch command, the diagnosis, versions.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import audit, redact, report, rundir
from helpers.report import Note
from helpers.repro.runs import ReproRun
from helpers.repro.script import launch_commands, out_folder


@dataclass
class IssueFiles(report.ResultMixin):
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
                 facts: dict[str, Any] | None = None) -> IssueFiles:
    """Write ``report.md`` (ready for an accelerate or torch issue) and ``diagnosis.json``.

    The environment comes from the audit (``helpers.audit``), anonymised; every secret,
    home folder, user and host name is replaced in the whole text.
    """
    folder = out_folder(out_dir) if out_dir else Path(run.script).parent
    facts = facts if facts is not None else audit.collect_facts(anonymize=True)
    summary = report_summary(run, fixed)
    text = redact.for_report(report_markdown(run, fixed, facts, summary))
    markdown = report.atomic_write_text(folder / "report.md", text)
    diagnosis = report.atomic_write_json(rundir.diagnosis_path(folder), run.diagnosis.to_dict())
    return IssueFiles(str(markdown), str(diagnosis), redact.for_report(summary))


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
    script = Path(run.script)
    rows = [row for row in audit.summary_rows(facts)
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
