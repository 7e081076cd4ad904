"""Benchmark of the doctor on jobs it did not start. Prints figures measured side by side in one run.

- attach end to end (``python -m helpers doctor --attach AGENT``, a fresh process: what a user
  waits for) to a plain torchrun job of 2 ranks and of 8 ranks, hung on purpose (targets <= 2 s and
  <= 3 s); py-spy reads the ranks in parallel;
- ``--from-fr`` on 8 ranks x 2,000 Flight Recorder entries, real dumps from real gloo ranks
  (target <= 2 s).

Run: .venv/bin/python bench/attach_bench.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_attach import Job  # noqa: E402 - the tests' hung torchrun job

from helpers import doctor  # noqa: E402
from helpers.launch import launch  # noqa: E402

ENTRIES = 2000


def attach_seconds(ranks: int, rounds: int = 3) -> tuple[float, str]:
    """Best wall time of the attach CLI on a hung job of ``ranks`` ranks, and its verdict line."""
    with tempfile.TemporaryDirectory() as folder:
        job = Job(Path(folder), nodes=1, per_node=ranks, culprit=ranks - 1)
        try:
            job.wait_ready()
            times, line = [], ""
            for _ in range(rounds):
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--attach",
                                       str(job.agents[0].pid)], capture_output=True, text=True, timeout=120)
                times.append(time.perf_counter() - started)
                line = next((ln for ln in done.stderr.splitlines() if ln.startswith("doctor:")), done.stderr)
            return min(times), line
        finally:
            job.stop()


def _many_collectives(folder: str, count: int) -> None:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(8)
    for _ in range(count):
        dist.all_reduce(tensor)
    Path(folder, f"fr_trace_rank_{dist.get_rank()}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())


def from_fr_seconds() -> tuple[float, int]:
    """Wall time of --from-fr's diagnosis on 8 real dumps of 2,000 entries, and the entries read."""
    with tempfile.TemporaryDirectory() as folder:
        launch(_many_collectives, (folder, ENTRIES), num_processes=8, timeout_s=600,
               env={"TORCH_FR_BUFFER_SIZE": str(ENTRIES)})
        started = time.perf_counter()
        diagnosis = doctor.diagnose_dumps(folder)
        seconds = time.perf_counter() - started
        entries = sum(len(v.state["fr"]) for v in diagnosis.evidence.views.values())
        return seconds, entries


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ok = True
    for ranks, target in ((2, 2.0), (8, 3.0)):
        seconds, line = attach_seconds(ranks)
        ok &= seconds <= target
        print(f"attach, {ranks} ranks: {seconds:.2f} s end to end (target <= {target:g} s): {line}")
    seconds, entries = from_fr_seconds()
    ok &= seconds <= 2.0
    print(f"--from-fr, 8 ranks, {entries} entries: {seconds:.2f} s (target <= 2 s)")
    print("all targets met" if ok else "SOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
