"""The environment audit: facts about a machine, findings with fixes, reports, diffs and fleets.

Today people paste ``accelerate env`` and ``python -m torch.utils.collect_env`` into chat and
compare them by eye. The audit collects the facts (``helpers.audit.facts``), judges them with
rules (``helpers.audit.rules``), redacts secrets (``helpers.redact``), writes a JSON and a
self-contained HTML report, compares machines (``helpers.audit.diff``) and gathers a whole fleet
under torchrun (``python -m helpers.audit --fleet --json PATH``).

Command line: ``python -m helpers audit | facts | diff`` (see ``cli_audit``, ``cli_facts``,
``cli_diff``). Exit codes: 0 ok; 1 error-level findings with ``--strict`` (audit) or differing
machines (diff); 2 bad usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import cli, params, redact, report
from helpers.audit.diff import DiffResult, Machine, diff_machines, diff_reports, load_machine
from helpers.audit.facts import Facts, collect_facts, utc_now
from helpers.audit.render import summary_rows
from helpers.audit.rules import CODES, SEVERITIES, Finding, evaluate, rule_cuda_initialized

__all__ = ["AuditReport", "AuditRun", "DiffResult", "Facts", "Finding", "FleetReport", "CODES",
           "check_before_launch", "check_config", "collect_facts", "compare", "diff_reports",
           "judge", "run_audit", "run_fleet", "summary_rows", "topology", "write_report"]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
REPORT_NAME = "audit"
EXPORT_FOLDER = "export"  # inside report_dir: the anonymised copy to share
UPLOAD_FOLDER = "uploads"  # inside report_dir: reports uploaded through the panel


# ---------------------------------------------------------------------------------------------
# results


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
        lines = [f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"]
        for f in self.findings:
            lines += [f"[{f.severity}] {f.code}: {f.title}", f"    evidence: {f.evidence}",
                      f"    fix: {f.fix}", f"    source: {f.source}"]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from helpers.audit.render import report_html

        return report_html(self)

    def html(self) -> str:
        """The self-contained HTML page."""
        from helpers.audit.render import report_document

        return report_document(self)


@dataclass
class ReportFiles(report.ResultMixin):
    """Where a report was written."""

    json_path: str | None
    html_path: str | None

    def _repr_html_(self) -> str:
        import html

        items = "".join(f"<li>{label}: <code>{html.escape(path)}</code></li>" for label, path in
                        (("JSON", self.json_path), ("HTML", self.html_path)) if path)
        return f"<p>Report written:</p><ul>{items}</ul>"


@dataclass
class Note(report.ResultMixin):
    """A one-line message shown in place of a result (e.g. 'no comparison requested')."""

    message: str

    def _repr_html_(self) -> str:
        import html

        return f"<p><i>{html.escape(self.message)}</i></p>"


@dataclass
class Topology(report.ResultMixin):
    """The GPU topology part of the facts (or why there is none)."""

    topology: dict[str, Any] | None
    gpu_count: int

    def _repr_html_(self) -> str:
        from helpers.audit.render import topology_html

        return topology_html({"topology": self.topology, "gpus": [{}] * self.gpu_count})


@dataclass
class AuditRun(report.ResultMixin):
    """One complete run (what the widget panel shows): report, files, comparison."""

    report: AuditReport
    files: ReportFiles
    diff: DiffResult | None = None
    min_severity: str = "info"

    def _repr_html_(self) -> str:
        from helpers.audit.render import facts_html, findings_html

        counts = self.report.counts()
        parts = [f"<p><b>{counts['error']} error(s), {counts['warning']} warning(s), "
                 f"{counts['info']} info</b> (showing {self.min_severity} and above)</p>",
                 findings_html(self.report.findings, self.min_severity), self.files._repr_html_()]
        if self.diff is not None:
            parts += ["<h4>Comparison</h4>", self.diff._repr_html_()]
        parts.append(facts_html(self.report.facts))
        return "".join(parts)


@dataclass
class FleetReport(report.ResultMixin):
    """Every node's facts and findings, and the differences across nodes."""

    nodes: list[dict[str, Any]]
    diff: DiffResult
    schema: int = 1
    collected_at: str = field(default_factory=lambda: utc_now())

    def _repr_html_(self) -> str:
        from helpers.audit.render import diff_html

        return f"<p>{len(self.nodes)} node(s)</p>" + diff_html(self.diff)

    def html(self) -> str:
        """The self-contained HTML page."""
        from helpers.audit.render import fleet_document

        return fleet_document(self)


# ---------------------------------------------------------------------------------------------
# the steps the notebook calls


def judge(facts: dict[str, Any]) -> AuditReport:
    """Apply every rule to ``facts``; findings sorted by severity (errors first)."""
    return AuditReport(dict(facts), evaluate(facts))


def check_before_launch() -> list[Finding]:
    """CUDA_INITIALIZED_BEFORE_LAUNCH for *this* process, cheaply (no facts collected).

    Call it right before forking ranks (notebook_launcher, helpers.launch): a non-empty list
    means the launch will fail. Uses helpers.launch's record of where CUDA was initialised.
    """
    from helpers.audit.facts import cuda_state_here

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


def compare(report_json: str | Path | None, compare_with: str) -> DiffResult | Note:
    """Diff this machine's report with ``compare_with``; a Note when no comparison is asked."""
    if not compare_with:
        return Note("No comparison: set compare_with to the path of another machine's audit.json.")
    if not report_json:
        return Note("No comparison: this run wrote no JSON report.")
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
    from helpers import ui

    return ui.panel({"Re-run audit": run_audit, "Export": export_audit},
                    {"report_dir": cfg.report_dir, "compare_with": cfg.compare_with,
                     "anonymize": cfg.anonymize, "min_severity": "warning"},
                    title="Environment audit",
                    uploads={"compare_with": lambda values: Path(values["report_dir"]) / UPLOAD_FOLDER})


def anonymize_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """Host names, user names and home folders replaced, for facts read from a file."""
    identity = redact.local_identity()
    hostnames = identity["hostnames"] + [str(facts.get("hostname") or ""),
                                         str((facts.get("network") or {}).get("hostname") or "")]
    cleaned = redact.anonymize_data(facts, hostnames, identity["users"], identity["homes"])
    cleaned.update(hostname="<host>", anonymized=True)
    return cleaned


# ---------------------------------------------------------------------------------------------
# fleet: every node's facts gathered on rank 0 with torch.distributed


def run_fleet(json_path: str | Path, html_path: str | Path | None = None, anonymize: bool = False,
              strict: bool = False, timeout_s: float = 300.0) -> int:
    """Under torchrun / accelerate launch: each node's local rank 0 collects facts, rank 0
    gathers them, writes one fleet report with differences across nodes, and returns the exit
    code (1 with ``strict`` when nodes differ or have error findings)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        payload = _node_payload(anonymize) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        code = EXIT_OK
        if rank == 0:
            fleet = build_fleet([p for p in gathered or [] if p is not None])
            fleet.to_json(params.resolve_path(json_path))
            if html_path:
                report.atomic_write_text(params.resolve_path(html_path), fleet.html())
            problems = not fleet.diff.identical or any(
                f["severity"] == "error" for node in fleet.nodes for f in node["findings"])
            code = EXIT_PROBLEM if strict and problems else EXIT_OK
        codes = [code]
        dist.broadcast_object_list(codes, src=0)
        return int(codes[0])
    finally:
        dist.destroy_process_group()


def _node_payload(anonymize: bool) -> dict[str, Any]:
    facts = collect_facts(anonymize=anonymize)
    node = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or os.environ.get("RANK", "0")
    return {"node": int(node), "facts": dict(facts),
            "findings": [report.to_jsonable(f) for f in evaluate(facts)]}


def build_fleet(payloads: list[dict[str, Any]]) -> FleetReport:
    """The fleet report from each node's payload (``node``, ``facts``, ``findings``)."""
    payloads = sorted(payloads, key=lambda p: p["node"])
    nodes = []
    for payload in payloads:
        host = payload["facts"].get("hostname")
        label = f"node{payload['node']}" + (f" ({host})" if host and host != "<host>" else "")
        nodes.append({"label": label, "node": payload["node"], "facts": payload["facts"],
                      "findings": payload["findings"]})
    diff = diff_machines([Machine(n["label"], n["facts"], n["findings"]) for n in nodes])
    return FleetReport(nodes, diff)


# ---------------------------------------------------------------------------------------------
# command line


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or bad usage (2, message already printed)
        return int(exc.code or 0)


def _usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _audit_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Facts, findings and a report about "
                                     "this machine. Secrets are always redacted.")
    parser.add_argument("--facts", metavar="PATH", type=cli.path_arg,
                        help="judge a facts file (or audit report) "
                        "instead of collecting facts here")
    parser.add_argument("--json", metavar="PATH", type=cli.path_arg, help="write the JSON report here")
    parser.add_argument("--html", metavar="PATH", type=cli.path_arg,
                        help="write the self-contained HTML report here")
    parser.add_argument(params.cli_flag("report_dir"), dest="report_dir", metavar="DIR", type=cli.path_arg,
                        help="write audit.json and audit.html into this folder")
    parser.add_argument("--strict", action="store_true", help=params.SPECS["strict"].help)
    parser.add_argument("--anonymize", action="store_true", help=params.SPECS["anonymize"].help)
    return parser


def cli_audit(argv: list[str]) -> int:
    """``python -m helpers audit [--facts PATH] [--json PATH] [--html PATH] [--strict] [--anonymize]``."""
    args = _parse(_audit_parser("python -m helpers audit"), argv)
    if isinstance(args, int):
        return args
    if args.facts:
        try:
            machine = load_machine(args.facts)
        except ValueError as exc:
            return _usage_error(f"--facts: {exc}")
        facts = anonymize_facts(machine.facts) if args.anonymize else machine.facts
    else:
        facts = collect_facts(anonymize=args.anonymize)
    result = judge(facts)
    print(result.summary())
    files = write_report(result, args.report_dir, args.json, args.html)
    for path in (files.json_path, files.html_path):
        if path:
            print(f"wrote {path}")
    return EXIT_PROBLEM if args.strict and result.errors() else EXIT_OK


def cli_facts(argv: list[str]) -> int:
    """``python -m helpers facts [--json PATH] [--anonymize]``: the raw facts as JSON."""
    parser = argparse.ArgumentParser(prog="python -m helpers facts",
                                     description="The raw facts about this machine (redacted).")
    parser.add_argument("--json", metavar="PATH", type=cli.path_arg,
                        help="write them here instead of printing")
    parser.add_argument("--anonymize", action="store_true", help=params.SPECS["anonymize"].help)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    facts = collect_facts(anonymize=args.anonymize)
    if args.json:
        path = report.atomic_write_json(params.resolve_path(args.json), facts)
        print(f"wrote {path} ({len(facts.get('gpus') or [])} GPU(s), "
              f"{len(facts.get('env') or {})} variables)")
    else:
        print(json.dumps(facts, indent=2))
    return EXIT_OK


def cli_diff(argv: list[str]) -> int:
    """``python -m helpers diff A.json B.json [C.json ...] [--json PATH] [--html PATH]``.

    Exit 0 when the relevant facts are identical, 1 when they differ, 2 on bad usage.
    """
    parser = argparse.ArgumentParser(prog="python -m helpers diff", description="Differences "
                                     "between audit reports or facts files of several machines.")
    parser.add_argument("paths", nargs="+", metavar="REPORT", type=cli.path_arg,
                        help="audit reports or facts files")
    parser.add_argument("--json", metavar="PATH", type=cli.path_arg,
                        help="write the differences as JSON here")
    parser.add_argument("--html", metavar="PATH", type=cli.path_arg, help="write them as an HTML table here")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    if len(args.paths) < 2:
        return _usage_error(f"REPORT: give at least two files to compare; got {len(args.paths)}")
    try:
        diff = diff_reports(args.paths)
    except ValueError as exc:
        return _usage_error(f"REPORT: {exc}")
    print(diff.summary())
    if args.json:
        diff.to_json(params.resolve_path(args.json))
    if args.html:
        from helpers.audit.render import STYLE

        page = f"<!DOCTYPE html><html><head><meta charset='utf-8'><style>{STYLE}</style></head>" \
               f"<body><h1>Differences</h1>{diff._repr_html_()}</body></html>\n"
        report.atomic_write_text(params.resolve_path(args.html), page)
    return EXIT_OK if diff.identical else EXIT_PROBLEM


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.audit [--fleet] ...``: the audit, or the fleet gather under torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--fleet" not in argv:
        return cli_audit(argv)
    parser = argparse.ArgumentParser(prog="python -m helpers.audit --fleet", description="Run "
                                     "under torchrun / accelerate launch on every node: rank 0 "
                                     "writes one fleet report.")
    parser.add_argument("--fleet", action="store_true", required=True)
    parser.add_argument("--json", metavar="PATH", type=cli.path_arg,
                        required=True, help="fleet report JSON (rank 0)")
    parser.add_argument("--html", metavar="PATH", type=cli.path_arg, help="fleet report HTML (rank 0)")
    parser.add_argument("--anonymize", action="store_true", help=params.SPECS["anonymize"].help)
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when nodes differ or have error-level findings")
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return _usage_error("--fleet: run me under torchrun or accelerate launch (RANK and "
                            "WORLD_SIZE are not set)")
    return run_fleet(args.json, args.html, args.anonymize, args.strict)

