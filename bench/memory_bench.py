"""Benchmark of the batch-size explorer. Prints figures measured side by side in one run.

For each built-in model under a 512 MiB budget on one rank:

1. the exact limit: our search from 4096, then one probe at every size between its answer and the
   smallest size it saw fail (the largest size that fitted there is the limit of this run);
2. both strategies from a start 16x above that limit: probes, distinct sizes, seconds, answer;
3. targets: search within 2% of the limit, in <= 8 probe sizes (repeats of one size count once),
   and never more than 2% below accelerate's answer.

Run: .venv/bin/python bench/memory_bench.py [model ...]
"""

from __future__ import annotations

import sys
import time

from helpers import memory
from helpers.memory import models

BUDGET_MIB = 512


def exact_limit(model: str) -> tuple[int, int]:
    """(limit, probes spent): search, then every size between its answer and its failure."""
    found = memory.explore(model, BUDGET_MIB, 4096, "search")
    answer = found.search
    limit, spent = answer.found, answer.tries
    for size in range(answer.found + 1, answer.failed_above or answer.found + 1):
        spent += 1
        if memory.probe(model, size, BUDGET_MIB).ok:
            limit = size
    return limit, spent


def row(model: str) -> tuple[list[str], list[bool]]:
    """Measure one model; return its printed lines and its target checks."""
    limit, _ = exact_limit(model)
    start = 16 * limit
    started = time.monotonic()
    result = memory.explore(model, BUDGET_MIB, start, "both")
    wall = time.monotonic() - started
    search, baseline = result.search, result.accelerate
    lines = [f"{model}: limit {limit} (exact, this machine), start {start} (16x), both strategies "
             f"{wall:.1f} s"]
    for s in (baseline, search):
        lines.append(f"  {s.strategy:<10} found {s.found:>5} ({100 * s.found / limit:5.1f}% of limit)  "
                     f"steps {s.tries:>3}  sizes {s.probe_sizes:>3}  {s.seconds:6.1f} s  "
                     f"[{s.certainty()}]")
    lines.append(f"  ratios search/accelerate: steps {search.tries / baseline.tries:.2f}, seconds "
                 f"{search.seconds / baseline.seconds:.2f}, answer {search.found / baseline.found:.3f}")
    checks = [search.found >= 0.98 * limit and search.confirmed, search.probe_sizes <= 8,
              search.found >= 0.98 * baseline.found]
    lines.append(f"  targets: within 2% of limit {_mark(checks[0])}, <= 8 sizes {_mark(checks[1])}, "
                 f">= 98% of accelerate {_mark(checks[2])}")
    return lines, checks


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(names: list[str]) -> int:
    print(f"batch-size explorer, budget {BUDGET_MIB} MiB, 1 rank, CPU cap on private writable memory")
    all_checks = []
    for name in names or list(models.BUILTIN):
        lines, checks = row(name)
        print("\n".join(lines), flush=True)
        all_checks += checks
    print(f"{sum(all_checks)}/{len(all_checks)} targets met")
    return 0 if all(all_checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
