"""``python -m helpers repro ...``: build (and run) a minimal repro from the command line."""

from __future__ import annotations

import argparse
from typing import Any

from helpers import cli, params, scenarios
from helpers.repro.issue import write_report
from helpers.repro.runs import RUN_TIMEOUT_S, run_script
from helpers.repro.script import DEFAULT_OUT_DIR, ReproScript, build_replay, build_script
from helpers.repro.symptoms import get_symptom


def cli_main(argv: list[str]) -> int:
    """``python -m helpers repro ...``: exit 0 written (and as expected), 1 not as expected, 2 usage."""
    args = cli.parse(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.list:
        print(list_text())
        return cli.EXIT_OK
    try:
        script = _cli_script(args)
    except ValueError as exc:
        return cli.usage_error(str(exc))
    print(f"wrote {script.path} ({script.lines} lines); launch it with:")
    print("\n".join(f"  {command}" for command in script.commands))
    if not args.run:
        if args.json:
            script.to_json(params.resolve_path(args.json))
        return cli.EXIT_OK
    run = run_script(script, args.stall_s, args.timeout_s)
    files = write_report(run)
    print(run.diagnosis.text())
    print(run.verdict())
    print(f"wrote {files.diagnosis_json} and {files.report_md}")
    if args.json:
        run.to_json(params.resolve_path(args.json))
    return cli.EXIT_OK if run.as_expected else cli.EXIT_PROBLEM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m helpers repro",
        description="Build a standalone script that reproduces a multi-GPU hang: from a catalog "
                    "scenario, a symptom, or a run kept by `python -m helpers doctor --keep DIR`.",
        epilog="Exit: 0 written (with --run: the run behaved as expected), 1 it did not, 2 bad usage.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--list", action="store_true", help="list the scenarios: id, then what it shows")
    source.add_argument("--scenario", help="a scenario id (see --list)")
    cli.add_param(source, "symptom", None)
    cli.add_param(source, "from_trace", None)
    cli.add_param(parser, "variant", "broken")
    cli.add_param(parser, "num_processes", 2)
    cli.add_param(parser, "out_dir", DEFAULT_OUT_DIR)
    cli.add_param(parser, "stall_s", 5.0)
    cli.add_param(parser, "timeout_s", RUN_TIMEOUT_S)
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
    width = max(len(s.id) for s in scenarios.SCENARIOS) + 2
    lines = []
    for entry in scenarios.SCENARIOS:
        extra = "" if "broken" in entry.variants else " (no broken variant: healthy training)"
        lines.append(f"{entry.id:<{width}}{entry.shows}{extra}")
    return "\n".join(lines)
