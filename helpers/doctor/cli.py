"""``python -m helpers doctor``: run a script under the doctor, attach to a running job, or read dumps;
``python -m helpers.doctor``: the doctor inside a job (``module_main``).

- ``--num-processes N [...] -- script.py [args]``: run it on N local ranks and explain any hang;
- ``--attach PID|auto [--native]``: a job started without us (torchrun, accelerate launch, srun),
  read with py-spy, left running;
- ``--merge node0.json node1.json ...``: the nodes' ``--attach`` files as one diagnosis;
- ``--from-fr DIR``: torch's Flight Recorder dumps, one per rank.

Exit 0 ok, 3 hang, 4 crash, 5 mismatch; 2 bad usage (one message naming the argument).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from helpers import cli, params, report
from helpers.doctor import flight_recorder, pyspy
from helpers.doctor.diagnosis import Diagnosis
from helpers.doctor.runs import command_problem, run_command
from helpers.doctor.watcher import DEFAULT_STALL_S

USAGE = ("usage: python -m helpers doctor --num-processes N [--] script.py [args]\n"
         "       python -m helpers doctor --attach PID|auto [--native] [--json PATH]\n"
         "       python -m helpers doctor --merge node0.json node1.json ... [--json PATH]\n"
         "       python -m helpers doctor --from-fr DIR [--json PATH]")


def cli_main(argv: list[str]) -> int:
    """``python -m helpers doctor ...``: exit 0/3/4/5, 2 on bad usage."""
    if "--" in argv or "--merge" in argv:  # --merge's files: not a script
        split = argv.index("--") if "--" in argv else len(argv)
        options, command = argv[:split], argv[split + 1:]
    else:  # the script from its name on, as `python -m helpers.doctor` takes it
        options, command = split_command(argv, _VALUED | {"--attach", "--from-fr"})
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
        problem = command_problem(command)
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


# ---------------------------------------------------------------------------------------------
# python -m helpers.doctor [options] train.py [args]: inside a job, or on N local ranks

MODULE_USAGE = ("usage: torchrun <its flags> -m helpers.doctor [--stall-s S] [--json PATH] [--keep DIR] "
                "[--on-hang stop|report] train.py [args]\n"
                "       (also under accelerate launch, and srun ... torchrun)\n"
                "       python -m helpers.doctor --num-processes N [options] train.py [args]")
DASHES = "after '--'"
# Inside a job the default is long: a healthy job can hold every rank but one in a barrier for minutes
# (accelerate's main_process_first() while rank 0 tokenises, a checkpoint saved by rank 0 only).
DEFAULT_JOB_STALL_S = 300.0
_VALUED = {"--stall-s", "--json", "--keep", "--on-hang", "--num-processes", "--timeout-s"}


def module_main(argv: list[str]) -> int:
    """``python -m helpers.doctor``: watch this rank of a launcher's job (never returns then), or run
    the script on ``--num-processes N`` local ranks like ``python -m helpers doctor``."""
    from helpers.doctor.job import JobEnv, JobOptions, run_rank

    options, command = split_command(argv)
    args = cli.parse(_module_parser(), options)
    if isinstance(args, int):
        return args
    problem = command_problem(command)
    if problem:
        return cli.usage_error(f"{problem.replace(DASHES, 'after the options')}\n{MODULE_USAGE}")
    job = JobEnv.from_environ(os.environ)
    if args.num_processes is not None:
        if job is not None:
            return cli.usage_error("num_processes: this runs under a launcher (RANK, WORLD_SIZE, "
                                   "MASTER_ADDR, MASTER_PORT are set), which starts the ranks; "
                                   "drop --num-processes")
        stall_s = DEFAULT_STALL_S if args.stall_s is None else args.stall_s
        local = ["--num-processes", str(args.num_processes), "--stall-s", str(stall_s),
                 "--timeout-s", str(args.timeout_s), "--json", args.json, "--keep", args.keep]
        return cli_main([*local, "--", *command])
    if job is None:  # e.g. accelerate launch with a one-process config: nothing to wait for
        print("doctor: no launcher's job here (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set): "
              "running the script as it is, unwatched; give --num-processes N to run it on N local "
              "ranks under the doctor", file=sys.stderr)
        return _run_unwatched(command)
    stall_s = DEFAULT_JOB_STALL_S if args.stall_s is None else args.stall_s
    run_rank(job, JobOptions(stall_s=stall_s, json_path=Path(args.json) if args.json else None,
                             keep_dir=Path(args.keep) if args.keep else None, on_hang=args.on_hang),
             command)


def _run_unwatched(command: list[str]) -> int:
    from helpers.launch.rank import run_as_main

    code, error, _exit_call = run_as_main(command)
    if error is not None:
        raise error
    return code


def split_command(argv: list[str], valued: set[str] = _VALUED) -> tuple[list[str], list[str]]:
    """The doctor's options, and the command from the script (or ``-m module``) on; ``valued``: the
    options that take a value (the next token)."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return argv[:index], argv[index + 1:]
        if token == "-m" or not token.startswith("-"):
            return argv[:index], argv[index:]
        index += 2 if token in valued else 1
    return argv, []


def _module_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.doctor",
        usage=MODULE_USAGE.removeprefix("usage: "),
        description="The hang doctor inside a job: under torchrun, accelerate launch or srun ... torchrun, "
                    "every rank runs the script traced, with a watchdog that talks through the job's own "
                    "c10d store; the lowest live rank names the rank, the collective and the line "
                    "stall_s seconds after the job stops making progress, and ends the job.",
        epilog="Exit: the script's own code; 3 hang, 4 crash, 5 mismatch when the doctor ends the job; "
               "2 bad usage.")
    cli.add_param(parser, "stall_s", None)
    spec = params.SPECS["stall_s"]
    parser._actions[-1].help = (f"{spec.help} ({spec.accepted()}; default {DEFAULT_JOB_STALL_S:g} inside "
                                f"a job, {DEFAULT_STALL_S:g} on local ranks)")
    parser.add_argument("--json", default="", type=cli.path_arg,
                        help="the leading rank writes the diagnosis as JSON here (relative to its "
                             "working folder; on a cluster, shared storage)")
    parser.add_argument("--keep", default="", type=cli.path_arg,
                        help="each rank keeps its trace and state in this folder (and the leader the "
                             "diagnosis), for repro --from-trace")
    cli.add_param(parser, "on_hang", "stop")
    cli.add_param(parser, "num_processes", None)
    cli.add_param(parser, "timeout_s", 3600.0)
    return parser
