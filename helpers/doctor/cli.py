"""``python -m helpers doctor --num-processes N [...] -- script.py [args]``: exit 0/3/4/5, 2 on usage."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from helpers import cli, params
from helpers.doctor.runs import run_command
from helpers.doctor.watcher import DEFAULT_STALL_S

USAGE = "usage: python -m helpers doctor --num-processes N -- script.py [args]"


def cli_main(argv: list[str]) -> int:
    """``python -m helpers doctor --num-processes N [...] -- script.py [args]``: exit 0/3/4/5, 2."""
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1:]
    else:
        options, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m helpers doctor",
        description="Run a script on N local ranks with torchrun's environment and explain any hang.",
        epilog="Exit: 0 ok, 3 hang, 4 crash, 5 mismatch, 2 bad usage.")
    cli.add_param(parser, "num_processes", 2)
    cli.add_param(parser, "stall_s", DEFAULT_STALL_S)
    cli.add_param(parser, "timeout_s", 3600.0)
    parser.add_argument("--json", default="", type=cli.path_arg,
                        help="write the diagnosis as JSON to this path")
    parser.add_argument("--keep", default="", type=cli.path_arg,
                        help="keep traces, stacks and the diagnosis in this folder")
    args = cli.parse(parser, options)
    if isinstance(args, int):
        return args
    problem = _command_problem(command)
    if problem:
        return cli.usage_error(f"{problem}\n{USAGE}")
    diagnosis = run_command(command, args.num_processes, args.stall_s, args.timeout_s,
                            keep_dir=params.resolve_path(args.keep) if args.keep else None)
    print(diagnosis.text(), file=sys.stderr)
    if args.json:
        diagnosis.to_json(params.resolve_path(args.json))
    return diagnosis.exit_code


def _command_problem(command: list[str]) -> str | None:
    if not command:
        return "command: give the script to run after '--'"
    if command[0] == "-m":
        return None if len(command) > 1 else "command: '-m' needs a module name"
    if command[0].endswith(".py") and not Path(command[0]).is_file():
        return f"command: script {command[0]!r} not found"
    return None
