"""The steps notebook 01 calls, one per cell, and the whole audit in one call for its panel.

Each step takes plain values (or ``cfg``) and returns a result object from
``helpers.audit.results``; nothing here prints. The CLI (``helpers.audit.cli``) calls the same
steps, so a notebook run and ``python -m helpers audit`` write the same report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import params, redact, report
from helpers.audit.diff import DiffResult, diff_reports, load_machine
from helpers.audit.facts import collect_facts, cuda_state_here
from helpers.audit.results import AuditOutcome, AuditReport, AuditRun, ReportFiles, Topology
from helpers.audit.rules import Finding, evaluate, rule_cuda_initialized

REPORT_NAME = "audit"
EXPORT_FOLDER = "export"  # inside report_dir: the anonymised copy to share
UPLOAD_FOLDER = "uploads"  # inside report_dir: reports uploaded through the panel


def judge(facts: dict[str, Any]) -> AuditReport:
    """Apply every rule to ``facts``; findings sorted by severity (errors first)."""
    return AuditReport(dict(facts), evaluate(facts))


def sources_summary(facts: dict[str, Any]) -> list[str]:
    """Lines saying which facts were read from which file, and what was inferred (notes)."""
    lines = []
    for source in facts.get("sources") or []:
        read = source.get("facts")
        listed = ", ".join(read) if isinstance(read, list) else str(read)
        lines.append(f"read from {source.get('file')} ({source.get('kind')}): {listed or 'nothing'}")
    lines += [f"note: {note}" for note in facts.get("notes") or []]
    return lines


def check_before_launch() -> list[Finding]:
    """CUDA_INITIALIZED_BEFORE_LAUNCH for *this* process, cheaply (no facts collected).

    Call it right before forking ranks (notebook_launcher, helpers.launch): a non-empty list
    means the launch will fail. Uses helpers.cuda_watch's record of where CUDA was initialised.
    """
    return rule_cuda_initialized({"torch": cuda_state_here()})


def check_config(cfg: params.Config) -> params.Config:
    """Check what ``params.validate`` cannot: ``compare_with`` names a readable audit report,
    ``report_dir`` is not a file. Raises ValueError naming the parameter; returns ``cfg``."""
    report_dir = params.resolve_path(cfg.get("report_dir", "reports/audit"))
    if report_dir.exists() and not report_dir.is_dir():
        raise ValueError(f"report_dir must be a folder; {report_dir} is a file")
    compare_with = cfg.get("compare_with", "")
    if compare_with:
        try:
            load_machine(params.resolve_path(compare_with))
        except ValueError as exc:
            raise ValueError(f"compare_with: {exc}") from None
    return cfg


def write_report(result: AuditReport, report_dir: str | Path | None = None,
                 json_path: str | Path | None = None, html_path: str | Path | None = None
                 ) -> ReportFiles:
    """Write the JSON and HTML report atomically; ``report_dir`` gives both as audit.json/.html.

    Relative paths resolve against the repository root (``params.resolve_path``).
    """
    if report_dir:
        folder = params.resolve_path(report_dir)
        json_path = json_path or folder / f"{REPORT_NAME}.json"
        html_path = html_path or folder / f"{REPORT_NAME}.html"
    written_json = written_html = None
    if json_path:
        target = params.resolve_path(json_path)
        result.to_json(target)
        written_json = str(target)
    if html_path:
        written_html = str(report.atomic_write_text(params.resolve_path(html_path), result.html()))
    return ReportFiles(written_json, written_html)


def topology(facts: dict[str, Any]) -> Topology:
    """The topology part of the facts, for display."""
    return Topology(facts.get("topology"), len(facts.get("gpus") or []))


def compare(report_json: str | Path | None, compare_with: str) -> DiffResult | report.Note:
    """Diff this machine's report with ``compare_with``; a Note when no comparison is asked."""
    if not compare_with:
        return report.Note("No comparison: set compare_with to the path of another machine's "
                           "audit.json.")
    if not report_json:
        return report.Note("No comparison: this run wrote no JSON report.")
    this, other = Path(report_json), params.resolve_path(compare_with)
    return diff_reports([this, other], labels=["this machine", other.stem])


def run_audit(report_dir: str = "reports/audit", compare_with: str = "", strict: bool = False,
              anonymize: bool = False, min_severity: str = "info") -> AuditRun:
    """Collect, judge, write the report and compare: the whole audit in one call (the panel's).

    ``strict`` only matters to callers that turn error findings into a failure (the CLI's exit
    code, the notebook's last cell); the run itself never raises on findings.
    """
    cfg = check_config(params.validate(report_dir=report_dir, compare_with=compare_with,
                                       strict=strict, anonymize=anonymize,
                                       min_severity=min_severity))
    result = judge(collect_facts(anonymize=cfg.anonymize))
    files = write_report(result, cfg.report_dir)
    diff = compare(files.json_path, cfg.compare_with) if cfg.compare_with else None
    return AuditRun(result, files, diff if isinstance(diff, DiffResult) else None, cfg.min_severity)


def export_audit(report_dir: str = "reports/audit", **_ignored: Any) -> ReportFiles:
    """A fresh audit to share outside the team, always anonymised (host and user names, home
    folders; secrets are redacted in every report), written to ``report_dir``/export/.

    Takes the panel's other values too, and ignores them.
    """
    folder = params.check("report_dir", report_dir)
    result = judge(collect_facts(anonymize=True))
    return write_report(result, Path(folder) / EXPORT_FOLDER)


def panel(cfg: params.Config):
    """Notebook 01's panel: severity filter, re-run, compare by path or upload, export."""
    from helpers import ui  # the only ipywidgets importer; the CLI never loads it

    return ui.panel({"Re-run audit": run_audit, "Export": export_audit},
                    {"report_dir": cfg.report_dir, "compare_with": cfg.compare_with,
                     "anonymize": cfg.anonymize, "min_severity": "warning"},
                    title="Environment audit",
                    uploads={"compare_with": lambda values: Path(values["report_dir"]) / UPLOAD_FOLDER})


def outcome(cfg: params.Config, result: AuditReport, files: ReportFiles) -> AuditOutcome:
    """Notebook 01's last cell: ``ok`` when both report files exist and, with ``cfg.strict``,
    ``result`` has no error-level finding; ``problems`` says what is wrong otherwise."""
    problems = []
    if not all(path and Path(path).is_file() for path in (files.json_path, files.html_path)):
        problems.append("the report was not written")
    strict = bool(cfg.get("strict", False))
    if strict and result.errors():
        problems.append("error-level findings: " + "; ".join(
            f"{f.code}: {f.title}" for f in result.errors()))
    return AuditOutcome(files.json_path, files.html_path, result.counts(),
                        [f.code for f in result.findings], ok=not problems, strict=strict,
                        problems=problems, top=top_findings(result), machine=machine(result.facts))


TOP_FINDINGS = 5


def top_findings(result: AuditReport, limit: int = TOP_FINDINGS) -> list[dict[str, str]]:
    """The most severe findings (errors, then warnings, then info; in the rules' order within a
    severity), as ``{"severity", "code", "title"}``."""
    rank = {severity: i for i, severity in enumerate(("error", "warning", "info"))}
    ordered = sorted(result.findings, key=lambda f: rank.get(f.severity, len(rank)))
    return [{"severity": f.severity, "code": f.code, "title": f.title} for f in ordered[:limit]]


def machine(facts: dict[str, Any]) -> dict[str, Any]:
    """Which machine this is, in a few fields: host (``<host>`` when anonymised), GPUs, the torch,
    accelerate, CUDA and driver versions, Python and the kernel."""
    gpus = [g for g in facts.get("gpus") or [] if isinstance(g, dict)]
    names = sorted({str(g.get("name") or "?") for g in gpus})
    torch = facts.get("torch") if isinstance(facts.get("torch"), dict) else {}
    driver = facts.get("driver")
    return {"host": facts.get("hostname"), "anonymized": bool(facts.get("anonymized")),
            "gpus": f"{len(gpus)} x {', '.join(names)}" if gpus else "none (CPU only)",
            "torch": torch.get("version") or (facts.get("packages") or {}).get("torch"),
            "cuda": torch.get("cuda"),
            "accelerate": (facts.get("packages") or {}).get("accelerate"),
            "driver": driver.get("version") if isinstance(driver, dict) else None,
            "python": (facts.get("python") or {}).get("version"),
            "kernel": (facts.get("os") or {}).get("kernel")}


def anonymize_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """Host names, user names and home folders replaced, for facts read from a file."""
    identity = redact.local_identity()
    hostnames = identity["hostnames"] + [str(facts.get("hostname") or ""),
                                         str((facts.get("network") or {}).get("hostname") or "")]
    cleaned = redact.anonymize_data(facts, hostnames, identity["users"], identity["homes"])
    cleaned.update(hostname="<host>", anonymized=True)
    return cleaned
