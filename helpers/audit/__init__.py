"""The environment audit: facts about a machine, findings with fixes, reports, diffs and fleets.

Today people paste ``accelerate env`` and ``python -m torch.utils.collect_env`` into chat and
compare them by eye. The audit collects the facts (``facts``, NVML in ``gpu``), judges them with
rules (``rules``), redacts secrets (``helpers.redact``), writes a JSON and a self-contained HTML
report (``results``, ``render``), compares machines (``diff``) and gathers a whole fleet under
torchrun (``fleet``: ``python -m helpers.audit --fleet --json PATH``).

This module is the facade: notebook 01, the CLI and other features use only the names in
``__all__``. Command line: ``python -m helpers audit | facts | diff`` (``cli_audit``,
``cli_facts``, ``cli_diff``). Exit codes: 0 ok; 1 error-level findings with ``--strict`` (audit)
or differing machines (diff); 2 bad usage.
"""

from __future__ import annotations

from helpers.audit.cli import cli_audit, cli_diff, cli_facts, main
from helpers.audit.diff import DiffResult, diff_reports, load_machine
from helpers.audit.facts import Facts, collect_facts
from helpers.audit.fleet import FleetReport, build_fleet, run_fleet
from helpers.audit.render import summary_rows
from helpers.audit.results import AuditOutcome, AuditReport, AuditRun, ReportFiles, Topology
from helpers.audit.rules import CODES, RULES, Finding
from helpers.audit.steps import (
    anonymize_facts,
    check_before_launch,
    check_config,
    compare,
    export_audit,
    judge,
    outcome,
    panel,
    run_audit,
    topology,
    write_report,
)

__all__ = ["CODES", "RULES", "AuditOutcome", "AuditReport", "AuditRun", "DiffResult", "Facts",
           "Finding", "FleetReport", "ReportFiles", "Topology", "anonymize_facts", "build_fleet",
           "check_before_launch", "check_config", "cli_audit", "cli_diff", "cli_facts",
           "collect_facts", "compare", "diff_reports", "export_audit", "judge", "load_machine",
           "main", "outcome", "panel", "run_audit", "run_fleet", "summary_rows", "topology",
           "write_report"]
