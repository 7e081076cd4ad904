"""``python -m helpers batch-size``: the explorer from a shell, with a JSON file for scripts.

Flags are the notebook's parameter names (``--memory-budget-mib``), checked by ``helpers.params``;
exit codes follow ``helpers.cli``: 0 found a size, 1 nothing fits or the step failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys

from helpers import cli, report
from helpers.memory.explore import ProbeError, explore


def cli_main(argv: list[str]) -> int:
    """``python -m helpers batch-size --model M --memory-budget-mib B ...``: exit 0 found a size,
    1 nothing fits or the step failed, 2 bad usage."""
    args = cli.parse(_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        result = explore(args.model, args.memory_budget_mib, args.starting_batch_size,
                         args.strategy, args.num_processes)
    except ValueError as exc:
        return cli.usage_error(str(exc))
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return cli.EXIT_PROBLEM
    print(result.summary())
    if args.json:
        report.atomic_write_json(args.json, result.entries())
    found = all(s.found > 0 for s in result.strategies)
    return cli.EXIT_OK if found else cli.EXIT_PROBLEM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m helpers batch-size",
                                     description="Find the largest batch size that fits a memory "
                                                 "budget: accelerate's rule and ours, side by side.")
    cli.add_param(parser, "model", None, required=True)
    cli.add_param(parser, "memory_budget_mib", None, required=True)
    cli.add_param(parser, "starting_batch_size", 4096)
    cli.add_param(parser, "strategy", "both")
    cli.add_param(parser, "num_processes", 1)
    parser.add_argument("--json", metavar="PATH", help="write one JSON entry per strategy to PATH")
    return parser
