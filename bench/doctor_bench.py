"""Benchmark of the hang doctor. Prints figures measured side by side in one run.

1. Detection: for each broken catalog scenario on 2 gloo ranks, the seconds from the stall to the
   doctor's diagnosis (``stall_s`` = 2), next to what torch gives by default: its process-group
   timeout (30 min gloo, 10 min NCCL) and what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports under
   plain torchrun (run with a 10 s process-group timeout so the bench ends; wall seconds include
   about as much start-up as the doctor's run).
2. Tracer overhead on 2 gloo ranks, each pinned to a core of its own (unpinned, the noise floor
   swung 0.69-1.14 on a 2-core VM): untraced, traced and untraced all_reduces of 4 KiB and 1 MiB
   taking turns call by call in the same ranks, medians per mode: traced/untraced next to
   untraced/untraced (the noise floor), a busy control, a call behind only the caller's line and
   the sequence number (what any record needs first: traced minus it is the record's own cost),
   the calling thread's CPU per call traced minus untraced (steadier than the ratios: what a change
   to the wrapper is judged by), and the helper thread's CPU per traced call added as an upper
   bound; the targets are issue 12's. The Flight Recorder (on throughout) is measured at launch
   granularity.
3. The wrapper's own CPU time per call, on one rank (target <= 20 microseconds), and where its
   time went on 2 ranks: a call's record text made right after the collective vs in a batch.

Run: .venv/bin/python bench/doctor_bench.py [--quick] [--overhead-only] [--against REV]
(--overhead-only: section 2 alone; --against REV: section 2 also takes turns with the wrapper of
``helpers/trace/tracer.py`` at git revision REV, in the same ranks, with a tracer and helper thread
of its own: a change to the wrapper measured side by side with what it replaces)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from helpers import doctor, launch, scenarios

STALL_S = 2.0
SIZES = {"4 KiB": 1024, "1 MiB": 256 * 1024}  # float32 elements
ROUNDS, CALLS = 60, 40
SIZES_TARGET = {"4 KiB": 1.10, "1 MiB": 1.03}  # traced/untraced step time, issue 12
TARGET_WRAPPER_US = 20.0
BUSY_US = 10.0  # a control: that much plain CPU before each call, no tracer (about the wrapper's cost)


# ---------------------------------------------------------------------------------------------
# 1. detection


def detection_rows(quick: bool) -> list[str]:
    import torch.distributed.constants as constants

    gloo_s = constants.default_pg_timeout.total_seconds()
    nccl = constants.default_pg_nccl_timeout  # None in a torch built without NCCL
    nccl_text = f"{nccl.total_seconds():.0f} s" if nccl else "600 s (this torch has no NCCL; 10 min per c10d)"
    lines = [f"torch's default process-group timeout: gloo {gloo_s:.0f} s, NCCL {nccl_text}",
             f"{'scenario':<22}{'doctor kind':<21}{'doctor s':>9}{'wall s':>8}{'x gloo':>10}"
             f"{'DETAIL wall s':>15}  DETAIL says"]
    for scenario in scenarios.SCENARIOS:
        if scenario.id == "healthy":
            continue
        started = time.monotonic()
        found = doctor.run_function(scenario.load().main, kwargs={"variant": "broken"}, num_processes=2,
                                    stall_s=STALL_S, timeout_s=120)
        wall = time.monotonic() - started
        detail_wall, said = (None, "(skipped: --quick)") if quick else detail_run(scenario)
        after = found.detected_after_s or 0.0
        # a hang waits for torch's timeout; a crash ends at once with or without the doctor
        faster = f"{gloo_s / max(after, 1e-3):.0f}" if found.verdict == "hang" else "(crash)"
        detail = "-" if detail_wall is None else f"{detail_wall:.1f}"
        lines.append(f"{scenario.id:<22}{found.kind:<21}{after:>9.2f}{wall:>8.1f}{faster:>10}"
                     f"{detail:>15}  {said}")
    return lines


def detail_run(scenario: scenarios.Scenario) -> tuple[float, str]:
    """Plain torchrun with TORCH_DISTRIBUTED_DEBUG=DETAIL: wall seconds and its first telling line."""
    with tempfile.TemporaryDirectory(prefix="helpers-bench-") as scratch:
        env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TMPDIR": scratch}
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                "0", "--master-port", str(launch.free_port()),
                *scenario.command("broken", pg_timeout_s=10)]
        started = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - started
    return wall, _telling_line(done.stdout + done.stderr)


_TELLING = [re.compile(p) for p in (
    r"Detected mismatch[^\n]*", r"Ranks? [\d, ]+failed to pass monitoredBarrier[^\n]*",
    r"Received data size[^\n]*", r"Timed out[^\n]*", r"Connection (?:reset|closed)[^\n]*")]
_DIED = re.compile(r"exitcode\s*:\s*-\d+ \(pid: \d+\)\s*\((SIG\w+)\)")


def _telling_line(output: str) -> str:
    """The first line that says something, most telling kind first; else how the ranks died."""
    for pattern in _TELLING:
        found = pattern.search(output)
        if found:
            text = re.sub(r"\[/[^\]]+\] ", "", found.group(0))
            return text if len(text) <= 110 else text[:107] + "..."
    signals = sorted(set(_DIED.findall(output)))
    if signals:
        return f"no message: the ranks died by {', '.join(signals)}"
    return "(nothing: the run ended without an error)"


# ---------------------------------------------------------------------------------------------
# 2. tracer overhead


def _interleaved_calls(sizes: dict[str, int], rounds: int, calls: int,
                       against: str | None = None) -> dict[str, dict]:
    """Inside a rank: each call's seconds by (size, mode), the modes taking turns call by call
    (their order rotating), and the helper thread's CPU seconds per traced call.

    Turn by turn, so that what the machine does meanwhile falls on every mode alike (blocks of
    calls per mode swung 0.88-1.20 between two untraced blocks on this 2-core VM). The helper
    thread runs as it does under the doctor and writes the traced calls' records; its CPU time is
    reported apart, for the medians leave out the calls it happens to delay."""
    import torch
    import torch.distributed as dist

    from helpers import trace
    from helpers.trace.helper import Helper

    _pin_rank(dist.get_rank())
    tracer = trace.install(os.environ["TMPDIR"], dist.get_rank())
    traced = dist.all_reduce
    tracer.unpatch()
    untraced = dist.all_reduce
    tracer.patch()

    def busy(tensor: object) -> None:
        _spin(BUSY_US * 1e-6)
        untraced(tensor)

    modes = {"untraced": untraced, "traced": traced, "untraced again": untraced, "busy": busy,
             SITE_SEQ: _site_and_sequence(untraced)}
    other = _other_tracer(against, untraced) if against else None
    if other is not None:
        modes[AGAINST] = other[0]
    names = list(modes)
    clock = time.pthread_getcpuclockid(tracer.helper.ident)
    found: dict[str, dict] = {}
    for size, count in sizes.items():
        tensor = torch.ones(count)
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}  # the calling thread's CPU seconds
        helper_started = time.clock_gettime(clock)
        for round_ in range(rounds):
            dist.barrier()
            for call in range(calls):
                for turn in range(len(names)):
                    name = names[(call + round_ + turn) % len(names)]
                    started, started_cpu = time.perf_counter(), time.thread_time()
                    modes[name](tensor)
                    cpu[name].append(time.thread_time() - started_cpu)
                    times[name].append(time.perf_counter() - started)
        trace.flush()  # what the helper has not written yet is this size's work
        helper_s = time.clock_gettime(clock) - helper_started
        found[size] = {"times": times, "cpu": {name: _trimmed_mean(spent) for name, spent in cpu.items()},
                       "helper_interleaved": helper_s / (rounds * calls),
                       "helper_per_call": _helper_cpu_all_traced(tensor, clock, rounds * calls // 4)}
    if other is not None:
        _set_helper(other[1], Helper, on=False)
        other[1].close()
    trace.finish("finished")
    return found


AGAINST = "traced at REV"  # the mode of --against's wrapper
SITE_SEQ = "site+seq"  # the mode that does only what any record of the call needs first


def _site_and_sequence(untraced: Any) -> Any:
    """``untraced`` behind what the tracer's wrapper does before it records anything, and what any
    per-call record needs: the caller's line (its frame, code and offset; whether its file is the
    user's) and the collective's sequence number. Traced minus this is the record's own cost."""
    from helpers.trace import tracer as tracer_module
    from helpers.trace.callsites import user_files

    caller, sequence = sys._getframe, tracer_module._sequence_reader()
    world = tracer_module._default_world()

    def site_and_sequence(tensor: object) -> object:
        frame = caller(1)
        code = frame.f_code
        user_files.get(code.co_filename)
        found = (code, frame.f_lasti, sequence(world._default_pg) + 1)
        del found
        return untraced(tensor)

    return site_and_sequence


def _other_tracer(path: str, untraced: Any) -> tuple[Any, Any]:
    """``all_reduce`` wrapped by the tracer module at ``path`` (another revision's tracer.py), with
    a tracer and helper thread of its own (its queued items need not be this revision's); and
    that tracer."""
    import importlib.util

    import torch.distributed as dist

    from helpers.trace.helper import Helper

    spec = importlib.util.spec_from_file_location("helpers_bench_other_tracer", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    folder = os.path.join(os.environ["TMPDIR"], "against")
    os.makedirs(folder, exist_ok=True)
    module.current = module.Tracer(folder, dist.get_rank())
    _set_helper(module.current, Helper, on=True)
    return module._wrap("all_reduce", untraced, module._Plan("all_reduce", untraced)), module.current


def _tracer_at(revision: str, folder: str) -> str:
    """``helpers/trace/tracer.py`` at git ``revision``, written into ``folder``; its path."""
    text = subprocess.run(["git", "show", f"{revision}:helpers/trace/tracer.py"], capture_output=True,
                          text=True, check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    path = os.path.join(folder, "tracer_at_revision.py")
    with open(path, "w") as file:
        file.write(text)
    return path


def against_rows(by_rank: list[dict], revision: str) -> list[str]:
    """Each rank's traced/untraced and wrapper CPU, this revision's and ``revision``'s, side by side."""
    lines = [f"this revision's wrapper against {revision}'s, in the same turns (medians; CPU as above):",
             f"{'size':<8}{'rank':>5}{'traced/untraced':>17}{f'{revision[:10]}/untraced':>22}"
             f"{'wrapper us/call':>17}{f'{revision[:10]} us/call':>20}"]
    for name in SIZES:
        for rank, found in enumerate(by_rank):
            times, cpu = found[name]["times"], found[name]["cpu"]
            base = _median(times["untraced"])
            lines.append(f"{name:<8}{rank:>5}{_median(times['traced']) / base:>17.3f}"
                         f"{_median(times[AGAINST]) / base:>22.3f}"
                         f"{1e6 * (cpu['traced'] - cpu['untraced']):>17.1f}"
                         f"{1e6 * (cpu[AGAINST] - cpu['untraced']):>20.1f}")
    return lines


def _helper_cpu_all_traced(tensor: object, clock: int, calls: int, blocks: int = 3) -> float:
    """The helper thread's CPU seconds per call while every call is traced, as under the doctor:
    the median of ``blocks`` blocks of calls.

    Measured apart: in the turns above, its work that comes with time (a wake-up every
    ``FLUSH_S``, the progress note every ``POLL_S``) falls on four calls per traced call. The
    median, not one block: a rank that waited over ``AUTO_STATE_S`` in the barrier before has its
    state written once, unasked (50 ms of the helper's CPU, 85 us per call in one block), which is
    no cost per call."""
    import torch.distributed as dist

    from helpers import trace

    per_call = []
    for _block in range(blocks):
        dist.barrier()
        started = time.clock_gettime(clock)
        for _ in range(calls // blocks):
            dist.all_reduce(tensor)
        flushed = time.thread_time()
        trace.flush()  # the helper's work left at the end, done here: counted as the helper's
        spent = time.clock_gettime(clock) - started + time.thread_time() - flushed
        per_call.append(spent / (calls // blocks))
    return _median(per_call)


def _pin_rank(rank: int) -> None:
    """This rank's main thread (and the threads it starts, the tracer's helper thread among them)
    on one core of its own; gloo's threads, started with the process group, are left free: pinned
    with the main thread they would make each collective about twice as slow."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _set_helper(tracer: object, helper_class: type, on: bool) -> None:
    running = tracer.helper is not None  # type: ignore[attr-defined]
    if on and not running:
        tracer.helper = helper_class(tracer)  # type: ignore[attr-defined]
        tracer.helper.start()  # type: ignore[attr-defined]
    elif not on and running:
        tracer.helper.stop()  # type: ignore[attr-defined]
        tracer.helper = None  # type: ignore[attr-defined]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _trimmed_mean(values: list[float], cut: float = 0.01) -> float:
    """The mean of ``values`` without the largest ``cut`` of them (rare events, not per-call costs)."""
    ordered = sorted(values)[:max(1, round(len(values) * (1 - cut)))]
    return sum(ordered) / len(ordered)


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of paired ratios: each round against the round next to it in time."""
    return _median([a / b for a, b in zip(numerators, denominators, strict=True)])


def _overhead_row(found: dict) -> tuple[float, str]:
    """One rank's figures for one size: its bound (traced plus the helper's CPU, over untraced)
    and the row's columns."""
    times, helper = found["times"], found["helper_per_call"]
    helper_text = f"{1e6 * helper:.1f} ({1e6 * found['helper_interleaved']:.1f})"
    modes = ("untraced", "traced", "untraced again", "busy", SITE_SEQ)
    base, traced, again, busy, site = (_median(times[mode]) for mode in modes)
    bound = (traced + helper) / base
    cpu = found["cpu"]
    own, floor, site_cpu = (1e6 * (cpu[mode] - cpu["untraced"])
                            for mode in ("traced", "untraced again", SITE_SEQ))
    own_text = f"{own:.1f} ({floor:+.1f})"
    site_text = f"{site / base:.3f} ({site_cpu:.1f} us)"
    return bound, (f"{1e6 * base:>13.1f}{1e6 * traced:>11.1f}{traced / base:>17.3f}{again / base:>19.3f}"
                   f"{busy / base:>15.3f}{site_text:>20}{own_text:>17}{helper_text:>22}{bound:>13.3f}")


def _fr_env(stacks: bool = False) -> dict[str, str]:
    """The Flight Recorder as ``trace.install`` sets it (the bench installs after the process group
    exists, too late for these variables, so launch sets them); ``stacks``: as before, per-entry
    Python stacks captured."""
    from helpers import trace

    return {"TORCH_FR_BUFFER_SIZE": trace.FR_BUFFER_SIZE,
            "TORCH_INCLUDE_STACK_TRACE": "1" if stacks else trace.FR_STACK_TRACE}


def overhead_rows(quick: bool, against: tuple[str, str] | None = None) -> list[str]:
    """Section 2; ``against``: (revision, path of its tracer.py) to take turns with as well."""
    rounds = 6 if quick else ROUNDS
    by_rank = launch.launch(_interleaved_calls, (SIZES, rounds, CALLS, against[1] if against else None),
                            num_processes=2, timeout_s=600, env=_fr_env())
    lines = [f"wrapper on/off, call by call in the same 2 ranks ({rounds} rounds of {CALLS} calls per mode, "
             "the modes taking turns; Flight Recorder on throughout, as the tracer sets it): medians of "
             f"each mode's calls; 'busy' spins {BUSY_US:.0f} us of plain CPU before an untraced call, a "
             "control for what any per-call CPU costs on this machine; 'site+seq' does only what any "
             "record of a call needs first, and what the wrapper does before it records: the caller's "
             "line and the collective's sequence number (its CPU per call in brackets; traced minus "
             "it is the record's own cost); the helper thread's CPU per traced "
             "call, which the medians leave out (measured in a block where every call is traced; in the "
             "turns, where its wake-ups fall on four calls per traced call, in brackets), is added in the "
             "last column, as if it all delayed the calls (an upper bound). Each rank's own medians (the "
             "two ranks' traced/untraced have differed by 0.02 in one run, more than the noise floor); "
             "'wrapper us/call': the calling thread's CPU per call, traced minus untraced, means of all "
             "but each mode's slowest 1% (untraced again minus untraced in brackets, its noise floor; "
             "what the 1% leaves out is rare: a full garbage collection, 60-90 ms once in a run, lands "
             "in any mode's call): steadier than the ratios, it tells changes to the wrapper apart that "
             "their noise hides; the target is judged on the worse bound:",
             f"{'size':<8}{'rank':>5}{'untraced us':>13}{'traced us':>11}{'traced/untraced':>17}"
             f"{'untraced/untraced':>19}{'busy/untraced':>15}{'site+seq/untraced':>20}{'wrapper us/call':>17}"
             f"{'helper us/call':>22}"
             f"{'with helper':>13}"
             "  target"]
    for name, target in SIZES_TARGET.items():
        rows = [_overhead_row(found[name]) for found in by_rank]
        verdict = "met" if max(bound for bound, _text in rows) <= target else "MISSED"
        for rank, (_bound, text) in enumerate(rows):
            judged = f"  <= {target:.2f}: {verdict}" if rank == len(rows) - 1 else ""
            lines.append(f"{name:<8}{rank:>5}{text}{judged}")
    if against:
        lines += against_rows(by_rank, against[0])
    lines += flight_recorder_rows(max(6, rounds // 2))
    return lines


def _untraced_calls(sizes: dict[str, int], rounds: int, calls: int) -> dict[str, list[float]]:
    """Inside a rank (no tracer): each call's seconds by size."""
    import torch
    import torch.distributed as dist

    _pin_rank(dist.get_rank())
    times: dict[str, list[float]] = {}
    for size, count in sizes.items():
        tensor = torch.ones(count)
        for _round in range(rounds):
            dist.barrier()
            for _ in range(calls):
                started = time.perf_counter()
                dist.all_reduce(tensor)
                times.setdefault(size, []).append(time.perf_counter() - started)
    return times


def flight_recorder_rows(rounds: int) -> list[str]:
    """Flight Recorder off, on (as the tracer sets it: no per-entry stacks) and on with stacks
    (torch's default): alternating launches (its settings are fixed per process)."""
    envs = {"off": {"TORCH_FR_BUFFER_SIZE": "0"}, "on": _fr_env(), "on+stacks": _fr_env(stacks=True),
            "off again": {"TORCH_FR_BUFFER_SIZE": "0"}}
    modes = list(envs)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for index in range(3):
        for mode in modes[index:] + modes[:index]:
            runs[mode].append(launch.launch(_untraced_calls, (SIZES, rounds, CALLS), num_processes=2,
                                            timeout_s=600, env=envs[mode])[0])
    lines = ["Flight Recorder off/on, alternating launches (3 launches per mode, each the median of its "
             "calls; paired by round; 'on' as the tracer sets it, 'on+stacks' with torch's default "
             "per-entry stack capture):",
             f"{'size':<8}{'off us/call':>13}{'on us/call':>12}{'on+stacks us/call':>19}{'on/off':>9}"
             f"{'on+stacks/off':>15}{'off/off':>9}"]
    for name in SIZES:
        off, on, stacks, again = ([_median(run[name]) for run in runs[mode]] for mode in modes)
        lines.append(f"{name:<8}{1e6 * _median(off):>13.1f}{1e6 * _median(on):>12.1f}"
                     f"{1e6 * _median(stacks):>19.1f}{_median_ratio(on, off):>9.3f}"
                     f"{_median_ratio(stacks, off):>15.3f}{_median_ratio(again, off):>9.3f}")
    return lines


# ---------------------------------------------------------------------------------------------
# 3. the wrapper's own CPU time


def _wrapper_cpu(calls: int) -> dict[str, float]:
    """Inside one rank: CPU seconds per call, untraced and traced (tiny all_reduce): the calling
    thread's, and the whole process's (the helper thread writing the queue included)."""
    import torch
    import torch.distributed as dist

    from helpers import trace

    tensor = torch.ones(4)
    tracer = trace.install(os.environ["TMPDIR"], dist.get_rank())
    results: dict[str, list[float]] = {}
    for _round in range(3):
        for mode in ("untraced", "traced"):
            (tracer.patch if mode == "traced" else tracer.unpatch)()
            started, process = time.thread_time(), time.process_time()
            for _ in range(calls):
                dist.all_reduce(tensor)
            trace.flush()  # what is still queued is this mode's work
            results.setdefault(mode, []).append((time.thread_time() - started) / calls)
            results.setdefault(f"{mode} process", []).append((time.process_time() - process) / calls)
    trace.finish("finished")
    return {mode: min(values) for mode, values in results.items()}


def wrapper_rows() -> tuple[list[str], bool]:
    cpu = launch.launch(_wrapper_cpu, (5000,), num_processes=1, timeout_s=600, env=_fr_env())[0]
    own = 1e6 * (cpu["traced"] - cpu["untraced"])
    whole = 1e6 * (cpu["traced process"] - cpu["untraced process"])
    ok = own <= TARGET_WRAPPER_US
    verdict = "met" if ok else "MISSED"
    return ([f"wrapper CPU per call on 1 rank: untraced {1e6 * cpu['untraced']:.1f} us, traced "
             f"{1e6 * cpu['traced']:.1f} us, wrapper's own {own:.1f} us "
             f"(target <= {TARGET_WRAPPER_US:.0f} us: {verdict}); the process's, the helper thread "
             f"writing the records included: {whole:.1f} us"], ok)


def _record_text_cpu(sizes: dict[str, int], rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """Inside a rank: thread CPU seconds to make one call's record text right after each
    all_reduce (as the tracer did per call until its records were queued) and in a batch of
    ``calls`` (as the helper thread writes the queue), by size (medians over ``rounds``)."""
    import torch
    import torch.distributed as dist

    from helpers import trace
    from helpers.trace.helper import Helper
    from helpers.trace.tracer import _OP, RUNS_KEPT, _record_text

    _pin_rank(dist.get_rank())
    tracer = trace.install(os.environ["TMPDIR"], dist.get_rank())
    _set_helper(tracer, Helper, on=False)  # the queue stays as the calls left it
    found = {}
    for name, count in sizes.items():
        tensor = torch.ones(count)
        tracer.patch()
        for _ in range(RUNS_KEPT + 1):  # a line's first call, and its runs' first RUNS_KEPT lengths,
            dist.all_reduce(tensor)  # are written at once; the next is queued
        item = next(i for i in tracer.queue if type(i) is list and i[0] == _OP)  # as the tracer made it
        tracer.flush()
        after, batched = [], []
        tracer.unpatch()
        for _round in range(rounds):
            spent = 0.0
            for _ in range(calls):
                dist.all_reduce(tensor)
                started = time.thread_time()
                _record_text(item)
                spent += time.thread_time() - started
            after.append(spent / calls)
            started = time.thread_time()
            for _ in range(calls):
                _record_text(item)
            batched.append((time.thread_time() - started) / calls)
        found[name] = (_median(after), _median(batched))
    _set_helper(tracer, Helper, on=True)
    trace.finish("finished")
    return found


def record_text_rows(quick: bool) -> list[str]:
    found = launch.launch(_record_text_cpu, (SIZES, 6 if quick else 20, CALLS), num_processes=2,
                          timeout_s=600, env=_fr_env())[0]
    lines = ["where the wrapper's time went: one call's record text (JSON), thread CPU on 2 gloo ranks, "
             "made right after each all_reduce (as every call did before the records were queued) vs "
             f"{CALLS} in a row (as the helper thread writes the queue): a collective leaves the caches cold"]
    for name, (after, batched) in found.items():
        lines.append(f"  {name}: after each all_reduce {1e6 * after:.1f} us, in a batch "
                     f"{1e6 * batched:.1f} us ({after / batched:.1f}x)")
    return lines


def _overhead_only(quick: bool, against: tuple[str, str] | None = None) -> int:
    print("== 2. tracer overhead, 2 gloo ranks ==")
    for line in overhead_rows(quick, against):
        print(line, flush=True)
    return 0


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    if "--against" in argv:
        revision = (argv[argv.index("--against") + 1:] or [""])[0]
        if not revision or revision.startswith("--"):
            print("bench: --against needs a git revision (e.g. --against HEAD~3)", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="helpers-bench-") as folder:
            try:
                path = _tracer_at(revision, folder)
            except subprocess.CalledProcessError as exc:
                print(f"bench: --against {revision}: git cannot show helpers/trace/tracer.py there: "
                      f"{exc.stderr.strip()}", file=sys.stderr)
                return 2
            return _overhead_only(quick, (revision, path))
    if "--overhead-only" in argv:
        return _overhead_only(quick)
    print("== 1. seconds from the stall to a diagnosis ==")
    for line in detection_rows(quick):
        print(line, flush=True)
    print("\n== 2. tracer overhead, 2 gloo ranks ==")
    for line in overhead_rows(quick):
        print(line, flush=True)
    print("\n== 3. wrapper cost ==")
    lines, ok = wrapper_rows()
    for line in lines + record_text_rows(quick):
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
