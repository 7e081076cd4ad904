"""``python -m helpers audit | facts | diff`` and ``python -m helpers.audit [--fleet]``.

Thin: parse with ``helpers.cli.parse``, call the same steps as notebook 01, print a summary.
Exit codes (``helpers.cli.EXIT_*``): 0 ok; 1 error-level findings with ``--strict`` (audit,
fleet) or differing machines (diff); 2 bad usage, with a message naming the argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from helpers import params, report
from helpers.audit import mpi, render
from helpers.audit.diff import diff_reports, load_machine
from helpers.audit.facts import collect_facts
from helpers.audit.fleet import run_fleet
from helpers.audit.steps import anonymize_facts, judge, sources_summary, write_report
from helpers.cli import EXIT_OK, EXIT_PROBLEM, parse, path_arg, usage_error


def _audit_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Facts, findings and a report about "
                                     "this machine. Secrets are always redacted.")
    parser.add_argument("--facts", metavar="PATH", type=path_arg, action="append",
                        help="judge a facts file, an audit report, or the saved output of "
                        "`python -m torch.utils.collect_env` or `accelerate env`, instead of "
                        "collecting facts here; repeat it to combine files of one machine")
    parser.add_argument("--json", metavar="PATH", type=path_arg, help="write the JSON report here")
    parser.add_argument("--html", metavar="PATH", type=path_arg,
                        help="write the self-contained HTML report here")
    parser.add_argument(params.cli_flag("report_dir"), dest="report_dir", metavar="DIR", type=path_arg,
                        help="write audit.json and audit.html into this folder")
    parser.add_argument("--strict", action="store_true", help=params.SPECS["strict"].help)
    parser.add_argument("--anonymize", action="store_true", help=params.SPECS["anonymize"].help)
    parser.add_argument("--hostfile", metavar="PATH", type=path_arg,
                        help="an MPI hostfile to check (default: the accelerate config's "
                        "mpirun_hostfile): readable, passwordless SSH to each host")
    parser.add_argument("--mpi-sanity", action="store_true",
                        help="also run `mpirun ... -n <hosts> -ppn 1 hostname` over the hostfile "
                        f"(deadline {mpi.SANITY_TIMEOUT_S:g} s); exit 1 when it fails")
    return parser


def cli_audit(argv: list[str]) -> int:
    """``python -m helpers audit [--facts PATH ...] [--json PATH] [--html PATH] [--strict] [--anonymize]``."""
    args = parse(_audit_parser("python -m helpers audit"), argv)
    if isinstance(args, int):
        return args
    if args.facts and (args.mpi_sanity or args.hostfile):
        return usage_error("--mpi-sanity/--hostfile: they check this machine; drop --facts")
    if args.facts:
        try:
            machine = load_machine(args.facts)
        except ValueError as exc:
            return usage_error(f"--facts: {exc}")
        facts = anonymize_facts(machine.facts) if args.anonymize else machine.facts
    else:
        facts = collect_facts(anonymize=args.anonymize, hostfile=args.hostfile)
    sanity = None
    if args.mpi_sanity:
        if not isinstance(facts.get("mpi"), dict):
            return usage_error("--mpi-sanity: no MPI here to check (no mpirun on PATH, no "
                               "--hostfile, no MULTI_CPU accelerate config)")
        sanity = facts["mpi"]["sanity"] = mpi.run_sanity(facts["mpi"])
    result = judge(facts)
    print(result.summary())
    for line in sources_summary(facts):
        print(line)
    files = write_report(result, args.report_dir, args.json, args.html)
    for path in (files.json_path, files.html_path):
        if path:
            print(f"wrote {path}")
    if sanity is not None:
        print(f"MPI sanity run: {'passed' if sanity['ok'] else 'FAILED: ' + str(sanity['error'])}"
              + (f"\n{sanity['output'].rstrip()}" if sanity["output"].strip() else ""))
        if not sanity["ok"]:
            return EXIT_PROBLEM
    return EXIT_PROBLEM if args.strict and result.errors() else EXIT_OK


def cli_facts(argv: list[str]) -> int:
    """``python -m helpers facts [--json PATH] [--anonymize]``: the raw facts as JSON."""
    parser = argparse.ArgumentParser(prog="python -m helpers facts",
                                     description="The raw facts about this machine (redacted).")
    parser.add_argument("--json", metavar="PATH", type=path_arg,
                        help="write them here instead of printing")
    parser.add_argument("--anonymize", action="store_true", help=params.SPECS["anonymize"].help)
    args = parse(parser, argv)
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
    """``python -m helpers diff A.json B.txt,B2.txt [...] [--live] [--json PATH] [--html PATH]``.

    Each REPORT is one machine: an audit report, a facts file, a saved collect_env or accelerate
    env output, or several of them joined by commas (files of one machine). ``--live`` adds this
    machine, audited now. Exit 0 when the relevant facts are identical (facts unknown on one side
    never differ), 1 when they differ, 2 on bad usage.
    """
    parser = argparse.ArgumentParser(prog="python -m helpers diff", description="Differences "
                                     "between audit reports or facts files of several machines.")
    parser.add_argument("paths", nargs="*", metavar="REPORT",
                        help="audit reports, facts files or saved collect_env / accelerate env "
                        "outputs; FILE,FILE for several files of one machine")
    parser.add_argument("--live", action="store_true",
                        help="compare with this machine, audited now")
    parser.add_argument("--json", metavar="PATH", type=path_arg,
                        help="write the differences as JSON here")
    parser.add_argument("--html", metavar="PATH", type=path_arg, help="write them as an HTML table here")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    machines: list = [[path_arg(p) for p in group.split(",") if p] for group in args.paths]
    labels: list = [None] * len(machines)
    if args.live:
        machines.append(collect_facts())
        labels.append("this machine")
    if len(machines) < 2:
        return usage_error(f"REPORT: give at least two machines to compare (files, or one file "
                           f"and --live); got {len(machines)}")
    try:
        diff = diff_reports(machines, labels=labels)
    except ValueError as exc:
        return usage_error(f"REPORT: {exc}")
    print(diff.summary())
    if args.json:
        diff.to_json(params.resolve_path(args.json))
    if args.html:
        report.atomic_write_text(params.resolve_path(args.html), render.diff_document(diff))
    return EXIT_OK if diff.identical else EXIT_PROBLEM


def _fleet_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m helpers.audit --fleet", description="Run "
                                     "under torchrun / accelerate launch on every node: rank 0 "
                                     "writes one fleet report.")
    parser.add_argument("--fleet", action="store_true", required=True)
    parser.add_argument("--json", metavar="PATH", type=path_arg,
                        required=True, help="fleet report JSON (rank 0)")
    parser.add_argument("--html", metavar="PATH", type=path_arg, help="fleet report HTML (rank 0)")
    parser.add_argument("--anonymize", action="store_true", help=params.SPECS["anonymize"].help)
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when nodes differ or have error-level findings")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m helpers.audit [--fleet] ...``: the audit, or the fleet gather under torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--fleet" not in argv:
        return cli_audit(argv)
    args = parse(_fleet_parser(), argv)
    if isinstance(args, int):
        return args
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return usage_error("--fleet: run me under torchrun or accelerate launch (RANK and "
                           "WORLD_SIZE are not set)")
    return run_fleet(args.json, args.html, args.anonymize, args.strict)
