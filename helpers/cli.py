"""Shared pieces of the command line: ``python -m helpers <command>``.

Exit codes: 0 all well, 1 a problem found, 2 bad usage (the message names the argument);
``doctor`` splits 1 into 3 hang, 4 crash, 5 mismatch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from helpers import params

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

# command -> ("module:function", one-line help). The function takes argv and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "smoke": ("helpers.smoke:cli_main", "collective correctness checks and bandwidth on N ranks"),
    "audit": ("helpers.audit:cli_audit", "facts, findings and a report about this machine"),
    "facts": ("helpers.audit:cli_facts", "the raw facts about this machine as JSON"),
    "diff": ("helpers.audit:cli_diff", "differences between audit reports of several machines"),
    "doctor": ("helpers.doctor:cli_main", "run a script on N ranks and explain any hang"),
    "repro": ("helpers.repro:cli_main", "build a minimal script that reproduces a hang"),
    "batch-size": ("helpers.memory:cli_main", "find the largest batch size that fits"),
    "lint": ("helpers.lint:cli_main", "static check of scripts and notebooks for divergence"),
    "report": ("helpers.suite:cli_main", "run every notebook headless into reports/"),
}


def _parse_value(name: str, text: str) -> Any:
    """argparse ``type=`` for a parameter: parse the text, then check it like a notebook value."""
    spec = params.SPECS[name]
    value: Any = text
    if spec.kind in ("int", "float"):
        try:
            value = int(text) if spec.kind == "int" else float(text)
        except ValueError:
            value = text
    elif spec.kind == "bool":
        value = {"true": True, "false": False}.get(text.lower(), text)
    try:
        value = params.check(name, value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path_arg(value) if spec.kind == "path" else value


def path_arg(text: str) -> str:
    """argparse ``type=`` for paths: relative to the current folder, as on any command line.

    (Notebook parameters resolve against the repository root instead; an absolute path is the
    same for both.) An empty value stays empty ("not given").
    """
    from pathlib import Path

    return str(Path(text).expanduser().absolute()) if text else text


def add_param(parser: argparse.ArgumentParser, name: str, default: Any, **kwargs: Any) -> None:
    """Add ``--a-name`` for parameter ``a_name``, validated by ``helpers.params``."""
    spec = params.SPECS[name]
    parser.add_argument(params.cli_flag(name), dest=name, default=default,
                        type=lambda text: _parse_value(name, text),
                        help=f"{spec.help} ({spec.accepted()}; default {default!r})", **kwargs)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """Parse ``argv``; an exit code instead of argparse's ``SystemExit``.

    ``--help`` gives ``EXIT_OK``; bad usage (argparse has printed its message, naming the
    argument) gives ``EXIT_USAGE``. Callers: ``args = cli.parse(parser, argv)``, then
    ``if isinstance(args, int): return args``.
    """
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code in (0, None) else EXIT_USAGE


def usage_error(message: str) -> int:
    """Print ``error: message`` on stderr and return ``EXIT_USAGE``."""
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``python -m helpers <command> ...`` to the module owning the command."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return EXIT_OK if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_USAGE
    module_name, function_name = COMMANDS[command][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"error: command {command!r} is not available in this version", file=sys.stderr)
        return EXIT_USAGE
    return int(getattr(module, function_name)(rest))


def _usage() -> str:
    lines = ["usage: python -m helpers <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Each command takes --help. Exit: 0 ok, 1 problem found, 2 bad usage."]
    return "\n".join(lines)
