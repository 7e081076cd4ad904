"""Benchmark of the doctor inside real jobs (``torchrun ... -m helpers.doctor``). Prints figures
measured side by side in one run.

1. Across nodes: two torchrun agents (and two ``accelerate launch`` agents) over 127.0.0.1, 2 ranks
   each; rank 3, on the second node, never reaches a barrier. From the moment the last other rank
   entered it (progress stopped; each rank writes the time), the seconds until the leader's JSON
   was written (target <= stall_s + 3) and until every node's agent had ended (target <= stall_s +
   10), next to what the job gets without the doctor: gloo's 1,800 s process-group timeout.
2. A real accelerate DDP training loop on 2 gloo ranks under torchrun, doctor off and on, runs
   interleaved (off, on, off, on, ...): the median step time of each, on/off (target <= 1.03) next
   to off/off (the noise floor).

Run: .venv/bin/python bench/job_bench.py [--quick] [--ddp-only]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from helpers import procs
from helpers.doctor import runs

STALL_S = 5.0
HANG = textwrap.dedent("""\
    import os, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for _ in range(3):
        dist.barrier()
    if dist.get_rank() == 3:
        time.sleep(3600)
    with open(f"entered-{dist.get_rank()}", "w") as handle:
        handle.write(repr(time.time()))
    dist.barrier()
    """)
TRAIN = textwrap.dedent("""\
    import json, sys, time
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.randn(64, 512)
    times = []
    for step in range(int(sys.argv[1])):
        started = time.perf_counter()
        loss = model(data).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    if accelerator.is_main_process:
        with open(sys.argv[2], "w") as handle:
            json.dump(times[20:], handle)
    """)


def across_nodes(launcher: str, folder: Path) -> list[str]:
    """One hung two-node job under the doctor: seconds from the stall to the JSON and to the end."""
    script = folder / "hang.py"
    script.write_text(HANG)
    started_wall = time.time()
    outcome = runs.run_job([str(script)], folder / launcher, nodes=2, per_node=2, stall_s=STALL_S,
                           timeout_s=300, launcher=launcher)
    entered = [float(p.read_text()) for d in outcome.node_dirs for p in d.glob("entered-*")]
    if len(entered) != 3 or outcome.diagnosis is None:
        return [f"{launcher}: the job did not hang as planned ({len(entered)} ranks entered)"]
    stall = max(entered)
    written = max((d / runs.JOB_JSON).stat().st_mtime for d in outcome.node_dirs
                  if (d / runs.JOB_JSON).exists())
    ended = started_wall + outcome.ended_s - stall
    culprit = outcome.diagnosis.ranks
    return [f"{launcher:<11}{outcome.diagnosis.kind:<14}{str(culprit):<9}{written - stall:>13.2f}"
            f"{STALL_S + 3:>9.0f}{ended:>15.2f}{STALL_S + 10:>9.0f}{1800 / max(ended, 1e-3):>12.0f}"]


def step_times(folder: Path, doctor: bool, steps: int) -> float:
    """Median step time (seconds) of one 2-rank torchrun run, doctor on or off."""
    script = folder / "train.py"
    script.write_text(TRAIN)
    out = folder / f"times-{time.monotonic_ns()}.json"
    inner = ["-m", "helpers.doctor", "--stall-s", "60"] if doctor else []
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(procs.free_port()), "--max-restarts", "0", *inner, str(script), str(steps), str(out)]
    code, output, _seconds = procs.run_process(argv, 600, procs.python_env({"OMP_NUM_THREADS": "1"}), folder)
    if code != 0:
        raise RuntimeError(f"training run failed ({code}):\n{output[-2000:]}")
    return statistics.median(json.loads(out.read_text()))


def ddp_rows(folder: Path, rounds: int, steps: int) -> list[str]:
    off, on, off_again = [], [], []
    for _ in range(rounds):  # interleaved: each on-run between two off-runs in time
        off.append(step_times(folder, False, steps))
        on.append(step_times(folder, True, steps))
        off_again.append(step_times(folder, False, steps))
    ratio = statistics.median(o / b for o, b in zip(on, off, strict=True))
    noise = statistics.median(a / b for a, b in zip(off_again, off, strict=True))
    return [f"median step: off {statistics.median(off) * 1e3:.2f} ms, "
            f"on {statistics.median(on) * 1e3:.2f} ms ({rounds} rounds x {steps} steps, 2 gloo ranks, "
            "accelerate DDP)",
            f"on/off {ratio:.3f} (target <= 1.03); off/off {noise:.3f} (noise floor)"]


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    if "--ddp-only" in argv:
        with tempfile.TemporaryDirectory(prefix="helpers-job-bench-") as scratch:
            for line in ddp_rows(Path(scratch), 2 if quick else 4, 200 if quick else 400):
                print(line, flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="helpers-job-bench-") as scratch:
        folder = Path(scratch)
        print(f"1. across nodes: 2 agents x 2 ranks over 127.0.0.1, culprit rank 3 on the second node, "
              f"stall_s = {STALL_S:g}")
        print(f"{'launcher':<11}{'kind':<14}{'culprit':<9}{'JSON after s':>13}{'target':>9}"
              f"{'all ended s':>15}{'target':>9}{'x gloo 1800':>12}")
        for launcher in runs.LAUNCHERS:
            for line in across_nodes(launcher, folder):
                print(line, flush=True)
        print("\n2. accelerate DDP step time, doctor off vs on (interleaved runs)")
        for line in ddp_rows(folder, 2 if quick else 4, 200 if quick else 400):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
