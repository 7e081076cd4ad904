"""Benchmark of the environment audit. Prints figures measured side by side in one run.

1. wall seconds of `python -m helpers audit --json` (target < 3 s on this machine), against the
   two commands people paste today, `accelerate env` and `python -m torch.utils.collect_env`,
   run interleaved, median of RUNS each;
2. where the audit's time goes: the torch child (started first) against everything else;
3. scrub_notebook on a large executed notebook (500 cells, 2 MB of images, secrets in outputs).

Run: .venv/bin/python bench/audit_bench.py
"""

from __future__ import annotations

import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = 5
TARGET_S = 3.0
BIN = Path(sys.executable).parent


def wall(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   timeout=120)
    return time.perf_counter() - started


def side_by_side(folder: Path) -> dict[str, float]:
    commands = {
        "helpers audit": [sys.executable, "-m", "helpers", "audit", "--json", str(folder / "a.json")],
        "accelerate env": [str(BIN / "accelerate"), "env"],
        "torch collect_env": [sys.executable, "-m", "torch.utils.collect_env"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(RUNS):  # interleaved, so machine load hits all three alike
        for name, command in commands.items():
            times[name].append(wall(command))
    return {name: statistics.median(values) for name, values in times.items()}


def breakdown() -> tuple[float, float, float]:
    """(total, torch child, the rest while the child ran) of one in-process collection."""
    from helpers import audit

    started = time.perf_counter()
    facts = audit.collect_facts()
    total = time.perf_counter() - started
    child = facts["torch"]["probe"]["seconds"] or 0.0
    return total, child, total - child


def scrub_figure(folder: Path) -> tuple[float, int, float]:
    import nbformat

    from helpers import redact

    image = base64.b64encode(os.urandom(4000)).decode()
    nb = nbformat.v4.new_notebook()
    for index in range(500):
        outputs = [nbformat.v4.new_output("stream", name="stdout",
                                          text=f"step {index} loss 0.1\nurl https://u:pw{index}xyz@h/\n"),
                   nbformat.v4.new_output("display_data", data={"image/png": image,
                                                                "text/plain": "<Figure>"})]
        nb.cells.append(nbformat.v4.new_code_cell(f"x = {index}", outputs=outputs))
    path = folder / "big.ipynb"
    nbformat.write(nb, str(path))
    size_mb = path.stat().st_size / 1e6
    started = time.perf_counter()
    count = redact.scrub_notebook(path)
    return time.perf_counter() - started, count, size_mb


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="helpers-audit-bench-") as tmp:
        folder = Path(tmp)
        medians = side_by_side(folder)
        audit_s = medians["helpers audit"]
        print(f"wall seconds, median of {RUNS} interleaved runs (this machine, {os.cpu_count()} CPUs):")
        for name, seconds in medians.items():
            print(f"  {name:<18} {seconds:6.2f} s   ratio to helpers audit {seconds / audit_s:5.2f}")
        total, child, rest = breakdown()
        print(f"one collection in-process: {total:.2f} s = torch child {child:.2f} s (import + CUDA "
              f"query, in parallel) + {rest:.2f} s for process start, waiting and the rest")
        seconds, count, size_mb = scrub_figure(folder)
        print(f"scrub_notebook: {size_mb:.1f} MB, 500 cells, {count} secrets removed in {seconds:.2f} s")
    ok = audit_s < TARGET_S
    print(f"target: `python -m helpers audit` under {TARGET_S:g} s: {audit_s:.2f} s "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
