"""``python -m helpers doctor``: run a script under the doctor, attach to a running job, or read dumps.

- ``--num-processes N [...] -- script.py [args]``: run it on N local ranks and explain any hang;
- ``--attach PID|auto [--native]``: a job started without us (torchrun, accelerate launch, srun),
  read with py-spy, left running;
- ``--merge node0.json node1.json ...``: the nodes' ``--attach`` files as one diagnosis;
- ``--from-fr DIR``: torch's Flight Recorder dumps, one per rank.

Exit 0 ok, 3 hang, 4 crash, 5 mismatch; 2 bad usage (one message naming the argument).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from helpers import cli, params, report
from helpers.doctor import flight_recorder, pyspy
from helpers.doctor.diagnosis import Diagnosis
from helpers.doctor.runs import run_command
from helpers.doctor.watcher import DEFAULT_STALL_S

USAGE = ("usage: python -m helpers doctor --num-processes N -- script.py [args]\n"
         "       python -m helpers doctor --attach PID|auto [--native] [--json PATH]\n"
         "       python -m helpers doctor --merge node0.json node1.json ... [--json PATH]\n"
         "       python -m helpers doctor --from-fr DIR [--json PATH]")


def cli_main(argv: list[str]) -> int:
    """``python -m helpers doctor ...``: exit 0/3/4/5, 2 on bad usage."""
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1:]
    else:
        options, command = argv, []
    args = cli.parse(_parser(), options)
    if isinstance(args, int):
        return args
    modes = [name for name in ("attach", "merge", "from_fr") if getattr(args, name)]
    if len(modes) > 1 or (modes and command):
        return cli.usage_error(f"give one of --attach, --merge, --from-fr or a script after '--'\n{USAGE}")
    try:
        if args.attach or args.merge:
            return _attach(args)
        diagnosis = _diagnosis(args) if args.from_fr else None
    except ValueError as exc:  # pyspy.AttachError included: bad input, permissions
        return cli.usage_error(str(exc))
    if diagnosis is None:
        problem = _command_problem(command)
        if problem:
            return cli.usage_error(f"{problem}\n{USAGE}")
        diagnosis = run_command(command, args.num_processes, args.stall_s, args.timeout_s,
                                keep_dir=params.resolve_path(args.keep) if args.keep else None)
    return _finish(diagnosis, args.json)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m helpers doctor",
        description="Explain a hang: run a script on N local ranks under the doctor, attach to a job "
                    "that runs now, or read torch's Flight Recorder dumps.",
        epilog="Exit: 0 ok, 3 hang, 4 crash, 5 mismatch, 2 bad usage.")
    cli.add_param(parser, "num_processes", 2)
    cli.add_param(parser, "stall_s", DEFAULT_STALL_S)
    cli.add_param(parser, "timeout_s", 3600.0)
    parser.add_argument("--json", default="", type=cli.path_arg,
                        help="write the diagnosis as JSON to this path")
    parser.add_argument("--keep", default="", type=cli.path_arg,
                        help="keep traces, stacks and the diagnosis in this folder")
    parser.add_argument("--attach", metavar="PID", default="",
                        help="a running job: the PID of torchrun, accelerate launch or one rank, or "
                             "'auto' (every torch.distributed job here); read with py-spy, left running")
    parser.add_argument("--native", action="store_true",
                        help="with --attach: native frames too (shows waits in C++, e.g. DDP's)")
    parser.add_argument("--merge", nargs="+", metavar="FILE", type=cli.path_arg, default=[],
                        help="the --attach files of every node of one job: one diagnosis")
    parser.add_argument("--from-fr", dest="from_fr", metavar="DIR", type=cli.path_arg, default="",
                        help="a folder of torch Flight Recorder dumps (one per rank)")
    return parser


def _attach(args: argparse.Namespace) -> int:
    found = [pyspy.merge(args.merge)] if args.merge else pyspy.attach(args.attach, native=args.native)
    for part in found:
        print(part.text(), file=sys.stderr)
    if args.json:
        data = found[0].to_dict() if len(found) == 1 else {"jobs": [part.to_dict() for part in found]}
        report.atomic_write_json(args.json, data)
    return max(part.diagnosis.exit_code for part in found)


def _diagnosis(args: argparse.Namespace) -> Diagnosis:
    return flight_recorder.diagnose_dumps(args.from_fr)


def _finish(diagnosis: Diagnosis, json_path: str) -> int:
    print(diagnosis.text(), file=sys.stderr)
    if json_path:
        diagnosis.to_json(params.resolve_path(json_path))
    return diagnosis.exit_code


def _command_problem(command: list[str]) -> str | None:
    if not command:
        return "command: give the script to run after '--' (or --attach, --merge, --from-fr)"
    if command[0] == "-m":
        return None if len(command) > 1 else "command: '-m' needs a module name"
    if command[0].endswith(".py") and not Path(command[0]).is_file():
        return f"command: script {command[0]!r} not found"
    return None
