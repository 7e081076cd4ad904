"""The smoke test a team runs before a long job: are collectives correct, and how fast are they?

Inside ranks (``smoke_rank``): every collective is checked against the exact expected values and
its wrong elements are counted (as nccl-tests' ``#wrong``); then a bandwidth sweep over message
sizes reports time, algbw and busbw with the nccl-tests formulas. The same code runs

- from a notebook or the CLI: ``run_smoke(num_processes=N)`` forks N local ranks (helpers.launch);
- on real clusters: ``torchrun --nnodes 2 --nproc-per-node 2 ... -m helpers.smoke --json PATH``
  (or ``accelerate launch --multi_gpu -m helpers.smoke``); rank 0 writes the JSON.

``run_smoke`` also calls accelerate's own ``notebook_launcher`` the way users call it, in a guarded
child, and reports what its ranks see (the CPU trap: on a machine without GPUs, a plain
``Accelerator()`` under notebook_launcher gives independent world-size-1 copies).

No hang doctor watches the smoke test, by choice: the bandwidth sweep must measure what training
sees, so no tracer or Flight Recorder runs in it (the tracer's budget is 20 µs a call,
bench/doctor_bench.py, a real share of a 1 KiB all_reduce). A hang is still stopped at the deadline,
and its ``LaunchTimeout`` carries every rank's stack. ``SmokeResult`` is notebook 03's outcome
(``helpers.report.Outcome``: ``ok``, ``verdict()``, ``save()``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import cli, params, report
from helpers.report import Outcome, ResultMixin

__all__ = ["BANDWIDTH_OPS", "LauncherCheck", "SmokeResult", "bandwidth_gbps", "bus_factor", "check_config",
           "check_notebook_launcher", "cli_main", "distributed_main", "message_sizes", "panel", "rank_info",
           "run_smoke", "smoke_rank"]

BANDWIDTH_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
MIN_SIZE_BYTES = 1024
WARMUP_ITERS = 2


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw/algbw factor: 2(n-1)/n all_reduce, (n-1)/n gathers/scatters, 1 broadcast."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op must be one of {', '.join(BANDWIDTH_OPS)}; got {op!r}")


def bandwidth_gbps(op: str, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes/s): algbw = bytes / time, busbw = algbw x bus_factor."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, world_size)


def message_sizes(max_size_mib: int) -> list[int]:
    """Powers of two from 1 KiB up to ``max_size_mib`` MiB, in bytes."""
    sizes, size = [], MIN_SIZE_BYTES
    while size <= max_size_mib * 2**20:
        sizes.append(size)
        size *= 2
    return sizes


# ---------------------------------------------------------------------------------------------
# inside a rank (process group already initialised)


def _gather_fn(dist: Any) -> Callable:
    """all_gather_single where torch has it (2.13 deprecates all_gather_into_tensor)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn(dist: Any) -> Callable:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wrong(actual: Any, expected: Any) -> int:
    """Number of elements of ``actual`` that differ from ``expected`` (nccl-tests' #wrong)."""

    actual, expected = actual.cpu(), expected.cpu()
    if actual.shape != expected.shape:
        return max(actual.numel(), expected.numel())
    return int((actual != expected).sum())


def _checks(device: Any) -> list[dict[str, Any]]:
    """Each collective once on exactly representable values; wrong elements counted per rank."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    count = 1024
    base = torch.arange(count, dtype=torch.float32, device=device)

    def mine(r: int) -> Any:  # what rank r contributes: small integers, exact in float32
        return base + r * count

    results: list[tuple[str, int]] = []
    x = mine(rank).clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    results.append(("all_reduce_sum", _wrong(x, sum(mine(r) for r in range(n)))))
    x = mine(rank).clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    results.append(("all_reduce_max", _wrong(x, mine(n - 1))))
    parts = [torch.empty_like(base) for _ in range(n)]
    dist.all_gather(parts, mine(rank))
    results.append(("all_gather", sum(_wrong(parts[r], mine(r)) for r in range(n))))
    out = torch.empty(n * count, device=device)
    _gather_fn(dist)(out, mine(rank))
    results.append(("all_gather_into_tensor", _wrong(out, torch.cat([mine(r) for r in range(n)]))))
    full = torch.arange(n * count, dtype=torch.float32, device=device) + rank
    out = torch.empty(count, device=device)
    _reduce_scatter_fn(dist)(out, full)
    whole = sum(torch.arange(n * count, dtype=torch.float32, device=device) + r for r in range(n))
    results.append(("reduce_scatter_tensor", _wrong(out, whole[rank * count:(rank + 1) * count])))
    wrong = 0
    for root in range(n):
        x = mine(rank).clone()
        dist.broadcast(x, src=root)
        wrong += _wrong(x, mine(root))
    results.append(("broadcast", wrong))
    dist.barrier()
    results.append(("barrier", 0))
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "host": socket.gethostname()})
    results.append(("all_gather_object", sum(objects[r]["rank"] != r for r in range(n))))
    return _sum_wrong_across_ranks(results, device)


def _sum_wrong_across_ranks(results: list[tuple[str, int]], device: Any) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    counts = torch.tensor([wrong for _, wrong in results], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return [{"op": op, "ok": int(wrong) == 0, "wrong": int(wrong)}
            for (op, _), wrong in zip(results, counts.tolist(), strict=True)]


def _time_op(op: str, size_bytes: int, iters: int, device: Any) -> float:
    """Median seconds of one ``op`` on ``size_bytes`` after warm-up (this rank's clock)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    elements = max(size_bytes // 4, n)
    elements -= elements % n
    buffer = torch.ones(elements, dtype=torch.float32, device=device)
    chunk = torch.empty(elements // n, dtype=torch.float32, device=device)
    gather, scatter = _gather_fn(dist), _reduce_scatter_fn(dist)
    calls = {
        "all_reduce": lambda: dist.all_reduce(buffer),
        "all_gather_into_tensor": lambda: gather(buffer, chunk),
        "reduce_scatter_tensor": lambda: scatter(chunk, buffer),
        "broadcast": lambda: dist.broadcast(buffer, src=0),
    }
    call, sync = calls[op], _synchronizer(device)
    times = []
    for i in range(WARMUP_ITERS + iters):
        start = time.perf_counter()
        call()
        sync()
        if i >= WARMUP_ITERS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronizer(device: Any) -> Callable[[], None]:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def _iters_for(size_bytes: int) -> int:
    return 10 if size_bytes < 2**20 else 5


def _bandwidth(max_size_mib: int, device: Any) -> list[dict[str, Any]]:
    """Sweep every op over the sizes; per size the slowest rank's median counts (reduced MAX)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    plan = [(op, size) for op in BANDWIDTH_OPS for size in message_sizes(max_size_mib)]
    medians = [_time_op(op, size, _iters_for(size), device) for op, size in plan]
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = []
    for (op, size), seconds in zip(plan, slowest.tolist(), strict=True):
        algbw, busbw = bandwidth_gbps(op, size, seconds, n)
        rows.append({"op": op, "bytes": size, "seconds": seconds,
                     "algbw_GBps": algbw, "busbw_GBps": busbw})
    return rows


def _device() -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_info() -> dict[str, Any]:
    """Who this rank is: rank, host, pid, device and backend."""
    import torch.distributed as dist

    device = _device()
    name = str(device)
    if device.type == "cuda":
        import torch

        name += f" ({torch.cuda.get_device_name(device)})"
    return {"rank": dist.get_rank(), "host": socket.gethostname(), "pid": os.getpid(),
            "device": name, "backend": dist.get_backend()}


def smoke_rank(max_size_mib: int = 16) -> dict[str, Any]:
    """Run the checks and the bandwidth sweep in this rank; every rank must call it."""
    import torch.distributed as dist

    device = _device()
    info = rank_info()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, info)
    return {"rank": info, "ranks": everyone, "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "device": device.type,
            "checks": _checks(device), "bandwidth": _bandwidth(max_size_mib, device)}


# ---------------------------------------------------------------------------------------------
# accelerate's notebook_launcher, as users call it, in a guarded child


SIBLINGS_WAIT_S = 10.0  # at most this long for notebook_launcher to fork every worker


def _wait_for_siblings() -> None:
    """Wait (bounded) until the launching process has forked every worker (LOCAL_WORLD_SIZE).

    notebook_launcher forks its workers from a process whose TCPStore thread answers the workers
    already started; a worker forked while that thread is inside glibc's getnameinfo inherits the
    resolver's lock held and hangs in init_process_group, for good (py-spy: ``__resolv_context_get``
    under ``c10d::detail::formatSockAddr``; 1 check in about 40 on this machine, with 3 processes
    and a loaded CPU). No worker connects before the last fork, so none can inherit it.
    """
    import psutil

    wanted = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deadline = time.monotonic() + SIBLINGS_WAIT_S
    launcher = psutil.Process(os.getppid())
    while len(launcher.children()) < wanted and time.monotonic() < deadline:
        time.sleep(0.01)


def _report_what_accelerate_sees(out_dir: str) -> None:
    """Runs in each notebook_launcher rank: plain Accelerator view, then the cpu=True view."""
    from accelerate.state import PartialState

    _wait_for_siblings()
    seen = {}
    for label, cpu in (("plain", False), ("cpu=True", True)):
        state = PartialState(cpu=cpu)
        seen[label] = {"num_processes": state.num_processes, "process_index": state.process_index,
                       "distributed_type": str(state.distributed_type).split(".")[-1]}
        if label == "plain":
            PartialState._reset_state()
    rank = os.environ.get("RANK", "0")
    report.atomic_write_json(Path(out_dir) / f"seen-{rank}.json", seen)


def _call_notebook_launcher(num_processes: int, port: int) -> dict[str, Any]:
    """In the guarded child: call notebook_launcher and collect what its ranks saw."""
    import contextlib
    import io
    import tempfile

    from accelerate import notebook_launcher

    out_dir = tempfile.mkdtemp(prefix="seen-")  # inside the run folder (launch sets tempdir)
    log = Path(out_dir) / "launcher.log"
    printed = io.StringIO()
    with open(log, "w") as sink:  # torchelastic's log noise goes here, not into the notebook
        os.dup2(sink.fileno(), 2)
        with contextlib.redirect_stdout(printed):
            notebook_launcher(_report_what_accelerate_sees, args=(out_dir,),
                              num_processes=num_processes, use_port=str(port))
    views = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("seen-*.json"))]
    return {"printed": printed.getvalue().strip(), "views": views}


@dataclass
class LauncherCheck(ResultMixin):
    """What accelerate's notebook_launcher did here, and whether it hit the CPU trap."""

    num_processes: int
    printed: str = ""
    plain_world_sizes: list[int] = field(default_factory=list)
    cpu_world_sizes: list[int] = field(default_factory=list)
    distributed_types: list[str] = field(default_factory=list)
    cpu_trap: bool = False
    ok: bool = False
    error: str | None = None
    details: str = ""  # the whole error when it failed: the stacks of a run past its deadline

    def summary(self) -> str:
        """One sentence a person can act on."""
        if self.error:
            return f"notebook_launcher failed: {self.error}"
        if self.num_processes == 1:
            return "notebook_launcher with 1 process runs the function in the caller; nothing to check"
        if self.cpu_trap:
            return (f"CPU trap: notebook_launcher printed {self.printed!r} but a plain Accelerator() "
                    f"saw world sizes {self.plain_world_sizes} (independent copies). "
                    f"Accelerator(cpu=True) or ACCELERATE_USE_CPU=true gave {self.cpu_world_sizes}.")
        return f"notebook_launcher started {len(self.plain_world_sizes)} ranks that see each other"


def check_notebook_launcher(num_processes: int, timeout_s: float) -> LauncherCheck:
    """Call accelerate's notebook_launcher as users do, in a guarded child; report what ranks saw."""
    from helpers.launch import LaunchError, free_port, launch

    result = LauncherCheck(num_processes=num_processes)
    if num_processes == 1:
        result.ok = True
        return result
    try:
        # no watcher: the child has no process group of ours to trace; its deadline stops a hang
        [seen] = launch(_call_notebook_launcher, (num_processes, free_port()), num_processes=1,
                        timeout_s=timeout_s, init_group=False, env={"ACCELERATE_USE_CPU": "false"},
                        watchers=())
    except LaunchError as exc:
        result.details = str(exc)
        result.error = result.details.splitlines()[0]
        return result
    result.printed = seen["printed"].splitlines()[0] if seen["printed"] else ""
    result.plain_world_sizes = [v["plain"]["num_processes"] for v in seen["views"]]
    result.cpu_world_sizes = [v["cpu=True"]["num_processes"] for v in seen["views"]]
    result.distributed_types = [v["plain"]["distributed_type"] for v in seen["views"]]
    result.cpu_trap = any(size != num_processes for size in result.plain_world_sizes)
    real_group = all(size == num_processes for size in result.cpu_world_sizes)
    result.ok = len(seen["views"]) == num_processes and (real_group or not result.cpu_trap)
    return result


# ---------------------------------------------------------------------------------------------
# the whole smoke test from a notebook or the CLI


def check_config(cfg: params.Config) -> params.Config:
    """Notebook 03's validation step; returns ``cfg``.

    Nothing to check across parameters (``params.validate`` checks each one alone); it exists so
    that every notebook validates the same way: ``cfg = smoke.check_config(params.validate(...))``.
    """
    return cfg


@dataclass
class SmokeResult(Outcome):
    """Verdict, checks, bandwidth and per-rank facts of one smoke test: notebook 03's outcome.

    ``ok``: every collective correct on the ranks asked for, and notebook_launcher's check passed.
    """

    ok: bool
    world_size: int
    backend: str
    device: str
    checks: list[dict[str, Any]]
    bandwidth: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    seconds: float
    launcher: LauncherCheck | None = None
    error: str | None = None

    def verdict(self) -> str:
        """'PASS ...' or 'FAIL ...' in one line."""
        if self.error:
            return f"FAIL: {self.error.splitlines()[0]}"
        bad = [c["op"] for c in self.checks if not c["ok"]]
        if bad:
            return f"FAIL: wrong results from {', '.join(bad)}"
        if self.launcher is not None and not self.launcher.ok:
            return f"FAIL: {self.launcher.summary()}"
        trivial = " (1 rank: trivial)" if self.world_size == 1 else ""
        return (f"PASS: {len(self.checks)} collectives correct on {self.world_size} ranks "
                f"({self.backend}, {self.device}){trivial}")

    def headline(self) -> str:
        """Collectives correct out of checked, ranks, and the peak busbw (all_reduce when measured)."""
        if self.error:
            return self.verdict()
        right = sum(bool(c["ok"]) for c in self.checks)
        line = (f"{right}/{len(self.checks)} collectives correct on {self.world_size} ranks "
                f"({self.backend}, {self.device})")
        peaks = self.peak_busbw()
        op = "all_reduce" if "all_reduce" in peaks else max(peaks, key=peaks.get, default=None)
        if op is not None:
            line += f"; peak busbw {op} {peaks[op]:.3g} GB/s"
        if self.launcher is not None and not self.launcher.ok:
            line += "; notebook_launcher check FAILED"
        return line

    def peak_busbw(self) -> dict[str, float]:
        """The best busbw per op, GB/s."""
        best: dict[str, float] = {}
        for row in self.bandwidth:
            best[row["op"]] = max(best.get(row["op"], 0.0), row["busbw_GBps"])
        return best

    def summary(self) -> str:
        """Plain-text report: verdict, checks table, peak bandwidth, notebook_launcher finding."""
        lines = [self.verdict(), "", report.text_table(self.checks, ["op", "ok", "wrong"])]
        if self.bandwidth:
            peaks = [{"op": op, "peak busbw GB/s": bw} for op, bw in self.peak_busbw().items()]
            lines += ["", report.text_table(peaks)]
        if self.launcher is not None:
            lines += ["", self.launcher.summary()]
            if self.launcher.details:
                lines += ["", self.launcher.details]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        color = "#070" if self.ok else "#b00"
        parts = [f"<p style='color:{color}'><b>{self.verdict()}</b> in {self.seconds:.1f} s</p>",
                 report.html_table(self.checks, ["op", "ok", "wrong"], highlight="ok"),
                 "<p>Ranks</p>", report.html_table(self.ranks)]
        if self.launcher is not None:
            parts.append(f"<p>accelerate notebook_launcher: {self.launcher.summary()}</p>")
        return "\n".join(parts)

    def plot(self):
        """busbw against message size, one line per collective (matplotlib Figure)."""
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for op in BANDWIDTH_OPS:
            rows = [r for r in self.bandwidth if r["op"] == op]
            if rows:
                ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"busbw on {self.world_size} ranks ({self.backend}, {self.device})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        plt.close(fig)
        return fig


def run_smoke(num_processes: int = 2, max_size_mib: int = 16, timeout_s: float = 60.0,
              check_launcher: bool = True) -> SmokeResult:
    """Run the smoke test on ``num_processes`` local ranks; never raises for a failed run.

    Bad parameters raise ValueError before any process starts. A rank error or a run past
    ``timeout_s`` gives a result with ``ok=False`` and the error (stacks included).
    """
    from helpers.launch import LaunchError, launch

    cfg = params.validate(num_processes=num_processes, max_size_mib=max_size_mib, timeout_s=timeout_s)
    started = time.monotonic()
    try:
        # no hang doctor (see the module docstring): the sweep measures untraced collectives
        per_rank = launch(smoke_rank, (cfg.max_size_mib,), num_processes=cfg.num_processes,
                          timeout_s=cfg.timeout_s, watchers=())
    except LaunchError as exc:
        return SmokeResult(False, cfg.num_processes, "", "", [], [], [],
                           time.monotonic() - started, error=str(exc))
    first = per_rank[0]
    launcher = None
    if check_launcher:
        remaining = max(cfg.timeout_s - (time.monotonic() - started), 5.0)
        launcher = check_notebook_launcher(cfg.num_processes, remaining)
    error = _group_size_problem(cfg.num_processes, first["world_size"])
    ok = error is None and all(c["ok"] for c in first["checks"]) and (launcher is None or launcher.ok)
    return SmokeResult(ok, first["world_size"], first["backend"], first["device"], first["checks"],
                       first["bandwidth"], first["ranks"], time.monotonic() - started, launcher, error)


def _group_size_problem(asked: int, world_size: int) -> str | None:
    """Why a group of ``world_size`` ranks is not the ``asked`` one (None when it is)."""
    if world_size == asked:
        return None
    ranks = f"{world_size} rank{'s' * (world_size != 1)}"
    return f"num_processes={asked} asked, but the process group has {ranks}"


def panel(cfg: params.Config):
    """Notebook 03's panel: ranks, largest size, deadline, Run."""
    from helpers import ui

    return ui.panel(run_smoke, {"num_processes": cfg.num_processes, "max_size_mib": cfg.max_size_mib,
                                "timeout_s": cfg.timeout_s}, title="Smoke test")


# ---------------------------------------------------------------------------------------------
# command line: `python -m helpers smoke` (local ranks) and `python -m helpers.smoke` (torchrun)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    cli.add_param(parser, "max_size_mib", 16)
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    return parser


def cli_main(argv: list[str]) -> int:
    """``python -m helpers smoke --num-processes N ...``: exit 0 pass, 1 fail or timeout, 2 usage."""
    parser = _parser("python -m helpers smoke")
    cli.add_param(parser, "num_processes", 2)
    cli.add_param(parser, "timeout_s", 60.0)
    parser.add_argument("--no-launcher-check", action="store_true",
                        help="skip calling accelerate's notebook_launcher")
    args = cli.parse(parser, argv)
    if isinstance(args, int):
        return args
    result = run_smoke(args.num_processes, args.max_size_mib, args.timeout_s,
                       check_launcher=not args.no_launcher_check)
    print(result.summary())
    if args.json:
        result.to_json(args.json)
    return cli.EXIT_OK if result.ok else cli.EXIT_PROBLEM


def distributed_main(argv: list[str] | None = None) -> int:
    """Under torchrun / accelerate launch: the group comes from the environment; rank 0 writes JSON."""
    import datetime

    import torch
    import torch.distributed as dist

    args = cli.parse(_parser("python -m helpers.smoke"), sys.argv[1:] if argv is None else argv)
    if isinstance(args, int):
        return args
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=5))
    started = time.monotonic()
    try:
        mine = smoke_rank(args.max_size_mib)
    finally:
        dist.destroy_process_group()
    if mine["rank"]["rank"] != 0:
        return cli.EXIT_OK
    ok = all(c["ok"] for c in mine["checks"])
    result = SmokeResult(ok, mine["world_size"], mine["backend"], mine["device"], mine["checks"],
                         mine["bandwidth"], mine["ranks"], time.monotonic() - started)
    print(result.summary())
    if args.json:
        result.to_json(args.json)
    return cli.EXIT_OK if ok else cli.EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(distributed_main())
