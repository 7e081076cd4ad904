"""Benchmark of the smoke test. Prints figures measured side by side in one run.

1. busbw of helpers' all_reduce timing against a bare torch.distributed loop at the same sizes,
   interleaved in the same ranks (target ratio >= 0.9);
2. seconds of a 2-rank smoke test with max_size_mib=16, end to end (target <= 10 s here).

Run: .venv/bin/python bench/smoke_bench.py
"""

from __future__ import annotations

import statistics
import time

from helpers import smoke
from helpers.launch import launch

SIZES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB
ROUNDS = 5


def _bare_loop(size_bytes: int, iters: int) -> float:
    """What people write: warm up, then time a loop of all_reduce calls, divide."""
    import torch
    import torch.distributed as dist

    buffer = torch.ones(size_bytes // 4)
    for _ in range(smoke.WARMUP_ITERS):
        dist.all_reduce(buffer)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    return (time.perf_counter() - start) / iters


def _side_by_side() -> list[tuple[int, float, float]]:
    import torch
    import torch.distributed as dist

    rows = []
    for size in SIZES:
        ours, bare = [], []
        for _ in range(ROUNDS):  # interleaved, so drift hits both alike
            ours.append(smoke._time_op("all_reduce", size, smoke._iters_for(size), torch.device("cpu")))
            bare.append(_bare_loop(size, smoke._iters_for(size)))
        times = torch.tensor([statistics.median(ours), statistics.median(bare)], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        rows.append((size, *times.tolist()))
    return rows


def main() -> None:
    rows = launch(_side_by_side, num_processes=2, timeout_s=300)[0]
    print("all_reduce on 2 gloo ranks: busbw of helpers.smoke vs a bare torch.distributed loop")
    print(f"{'bytes':>10}  {'helpers GB/s':>12}  {'bare GB/s':>10}  {'ratio':>6}")
    ratios = []
    for size, ours, bare in rows:
        ours_bw = smoke.bandwidth_gbps("all_reduce", size, ours, 2)[1]
        bare_bw = smoke.bandwidth_gbps("all_reduce", size, bare, 2)[1]
        ratios.append(ours_bw / bare_bw)
        print(f"{size:>10}  {ours_bw:>12.3f}  {bare_bw:>10.3f}  {ratios[-1]:>6.2f}")
    print(f"geometric mean ratio helpers/bare: {statistics.geometric_mean(ratios):.2f} (target >= 0.9)")
    started = time.monotonic()
    result = smoke.run_smoke(2, max_size_mib=16, timeout_s=120)
    seconds = time.monotonic() - started
    print(f"2-rank smoke test, max_size_mib=16, end to end: {seconds:.1f} s (target <= 10 s); "
          f"{result.verdict()}")


if __name__ == "__main__":
    main()
