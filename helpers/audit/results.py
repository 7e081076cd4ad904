"""The audit's result objects: plain dataclasses that render themselves in a notebook.

``AuditOutcome`` is what notebook 01's last cell checks and saves (``helpers.report.Outcome``).

Kept apart from the steps that build them (``helpers.audit.steps``) so that the CLI, the fleet
gather and the notebook share one definition of what a report is, and its JSON layout
(``{"schema": 1, "facts", "findings"}``) is written down once.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from helpers import report
from helpers.audit import render
from helpers.audit.diff import DiffResult
from helpers.audit.rules import SEVERITIES, Finding, is_unknown


@dataclass
class AuditReport(report.ResultMixin):
    """Facts and the findings about them; JSON ``{"schema": 1, "facts", "findings"}``."""

    facts: dict[str, Any]
    findings: list[Finding]
    schema: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, keys in the documented order."""
        return {"schema": self.schema, "facts": report.to_jsonable(self.facts),
                "findings": [report.to_jsonable(f) for f in self.findings]}

    def __repr__(self) -> str:
        counts = self.counts()
        return (f"AuditReport({counts['error']} error(s), {counts['warning']} warning(s), "
                f"{counts['info']} info: {', '.join(f.code for f in self.findings) or 'no findings'})")

    def counts(self) -> dict[str, int]:
        """Number of findings per severity."""
        return {severity: sum(f.severity == severity for f in self.findings)
                for severity in SEVERITIES}

    def errors(self) -> list[Finding]:
        """The error-level findings."""
        return [f for f in self.findings if f.severity == "error"]

    def summary(self) -> str:
        """Plain text for the CLI: counts, then each finding with its evidence and fix."""
        counts = self.counts()
        unknown = sum(is_unknown(f) for f in self.findings)
        lines = [f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"
                 + (f" ({unknown} unknown: facts missing, not judged)" if unknown else "")]
        for f in self.findings:
            lines += [f"[{f.severity}] {f.code}: {f.title}", f"    evidence: {f.evidence}",
                      f"    fix: {f.fix}", f"    source: {f.source}"]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return render.report_html(self)

    def html(self) -> str:
        """The self-contained HTML page."""
        return render.report_document(self)


@dataclass
class ReportFiles(report.ResultMixin):
    """Where a report was written."""

    json_path: str | None
    html_path: str | None

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{label}: <code>{html.escape(path)}</code></li>" for label, path in
                        (("JSON", self.json_path), ("HTML", self.html_path)) if path)
        return f"<p>Report written:</p><ul>{items}</ul>"


@dataclass
class Topology(report.ResultMixin):
    """The GPU topology part of the facts (or why there is none)."""

    topology: dict[str, Any] | None
    gpu_count: int

    def _repr_html_(self) -> str:
        return render.topology_html({"topology": self.topology, "gpus": [{}] * self.gpu_count})


@dataclass
class AuditRun(report.ResultMixin):
    """One complete run (what the widget panel shows): report, files, comparison."""

    report: AuditReport
    files: ReportFiles
    diff: DiffResult | None = None
    min_severity: str = "info"

    def _repr_html_(self) -> str:
        counts = self.report.counts()
        parts = [f"<p><b>{counts['error']} error(s), {counts['warning']} warning(s), "
                 f"{counts['info']} info</b> (showing {self.min_severity} and above)</p>",
                 render.findings_html(self.report.findings, self.min_severity),
                 self.files._repr_html_()]
        if self.diff is not None:
            parts += ["<h4>Comparison</h4>", self.diff._repr_html_()]
        parts.append(render.facts_html(self.report.facts))
        return "".join(parts)


@dataclass
class AuditOutcome(report.Outcome):
    """Notebook 01's outcome: the report was written and, under ``strict``, has no error-level
    finding. Its JSON keeps the keys the notebook wrote before it existed (``report_json``,
    ``report_html``, ``counts``, ``codes``), then ``ok``, ``strict``, ``problems``, ``top`` (the
    most severe findings: severity, code, title) and ``machine`` (host, GPUs, versions)."""

    report_json: str | None
    report_html: str | None
    counts: dict[str, int]
    codes: list[str]
    ok: bool = True
    strict: bool = False
    problems: list[str] = field(default_factory=list)
    top: list[dict[str, str]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)

    def headline(self) -> str:
        """Error and warning counts and the most severe finding, in one line."""
        counts = self.counts
        line = f"{counts.get('error', 0)} error(s), {counts.get('warning', 0)} warning(s)"
        if self.top:
            first = self.top[0]
            line += f"; top: [{first['severity']}] {first['code']}: {first['title']}"
        if not self.ok:
            line += "; " + "; ".join(self.problems)
        return line

    def verdict(self) -> str:
        """One line: where the report is and what it found, or what went wrong."""
        if not self.ok:
            return "; ".join(self.problems)
        counts = self.counts
        found = (f"{counts.get('error', 0)} error(s), {counts.get('warning', 0)} warning(s), "
                 f"{counts.get('info', 0)} info")
        return f"Report written to {self.report_json} ({found}" + \
            ("; strict: no error-level finding)" if self.strict else ")")
