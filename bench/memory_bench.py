"""Benchmark of the batch-size explorer. Prints figures measured side by side in one run.

For each built-in model, and for a model built at random from layer types (seeded; the seed is
printed), under one 512 MiB budget on one rank:

1. the exact limit: our search from 65536, then one probe at every size between its answer and the
   smallest size it saw fail (the largest size that fitted there is the limit of this run);
2. both strategies from a start 16x above that limit: probes, distinct sizes, seconds, answer, and
   the gap: the smallest size seen to fail above the answer, in % above it;
3. targets: search within 2% of the limit, in <= 8 probe sizes (repeats of one size count once),
   a failure at most 2% above its answer, and never more than 2% below accelerate's answer.

The random model (``random_model`` in this file, a ``file.py:function`` model like a user's):
token ids -> Embedding -> 2 to 5 layers drawn from Conv1d, GRU, LSTM, Linear, LayerNorm (random
widths, activations between) -> Linear, over a random sequence length. None of the search's
choices knows it.

Run: .venv/bin/python bench/memory_bench.py [--seed N] [model ...]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

from helpers import memory
from helpers.memory import models

BUDGET_MIB = 512
SEED_VARIABLE = "MEMORY_BENCH_SEED"
RANDOM_MODEL = f"{Path(__file__).resolve()}:random_model"


def random_model():
    """A stack of random layer types and widths, from the seed in ``MEMORY_BENCH_SEED``."""
    import torch
    from torch import nn

    rng = random.Random(int(os.environ.get(SEED_VARIABLE, "0")))
    vocab, tokens = rng.choice([1000, 5000, 20000]), rng.choice([32, 64, 128, 256])
    width = rng.choice([16, 32, 64, 96, 128])

    class Recurrent(nn.Module):
        def __init__(self, kind: type, inputs: int, outputs: int) -> None:
            super().__init__()
            self.rnn = kind(inputs, outputs, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    class Conv(nn.Module):
        def __init__(self, inputs: int, outputs: int, kernel: int) -> None:
            super().__init__()
            self.conv = nn.Conv1d(inputs, outputs, kernel, padding=kernel // 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x.transpose(1, 2)).transpose(1, 2)[:, :x.shape[1]]

    layers: list[nn.Module] = [nn.Embedding(vocab, width)]
    for _ in range(rng.randint(2, 5)):
        kind, out = rng.choice(["conv", "gru", "lstm", "linear", "norm"]), rng.choice([16, 32, 64, 128])
        if kind == "conv":
            layers.append(Conv(width, out, rng.choice([3, 5, 7])))
        elif kind in ("gru", "lstm"):
            layers.append(Recurrent(nn.GRU if kind == "gru" else nn.LSTM, width, out))
        elif kind == "linear":
            layers.append(nn.Linear(width, out))
        else:
            layers.append(nn.LayerNorm(width))
            out = width
        if kind in ("conv", "linear"):
            layers.append(rng.choice([nn.ReLU(), nn.GELU(), nn.Tanh()]))
        width = out
    layers.append(nn.Linear(width, rng.choice([2, 8, 32])))
    return nn.Sequential(*layers), lambda batch_size: torch.randint(0, vocab, (batch_size, tokens))


def describe_random_model() -> str:
    """The random model's layers, one line."""
    model, make_batch = random_model()
    names = [type(m).__name__ if type(m).__name__ not in ("Recurrent", "Conv")
             else type(next(m.children())).__name__ for m in model]
    return f"{' -> '.join(names)}, {make_batch(1).shape[1]} tokens"


def exact_limit(model: str) -> tuple[int, int]:
    """(limit, probes spent): search, then every size between its answer and its failure."""
    found = memory.explore(model, BUDGET_MIB, 1 << 16, "search")
    answer = found.search
    limit, spent = answer.found, answer.tries
    for size in range(answer.found + 1, answer.failed_above or answer.found + 1):
        spent += 1
        if memory.probe(model, size, BUDGET_MIB).ok:
            limit = size
    return limit, spent


def gap_percent(strategy) -> float | None:
    """The smallest failure above the answer, in % above it."""
    if not strategy.found or not strategy.failed_above:
        return None
    return 100 * (strategy.failed_above / strategy.found - 1)


def row(model: str, label: str) -> tuple[list[str], list[bool], dict]:
    """Measure one model; return its printed lines, its target checks and its summary."""
    limit, _ = exact_limit(model)
    start = 16 * limit
    started = time.monotonic()
    result = memory.explore(model, BUDGET_MIB, start, "both")
    wall = time.monotonic() - started
    search, baseline = result.search, result.accelerate
    lines = [f"{label}: limit {limit} (exact, this machine), start {start} (16x), both strategies "
             f"{wall:.1f} s"]
    for s in (baseline, search):
        gap = gap_percent(s)
        lines.append(f"  {s.strategy:<10} found {s.found:>5} ({100 * s.found / limit:5.1f}% of limit)  "
                     f"steps {s.tries:>3}  sizes {s.probe_sizes:>3}  gap "
                     f"{'-' if gap is None else f'{gap:.1f}%':>5}  {s.seconds:6.1f} s  [{s.certainty()}]")
    tried = " ".join(f"{p.batch_size}{'' if p.ok else 'x'}" for p in search.probes)
    lines.append(f"  search's probes (x: out of memory): {tried}")
    lines.append(f"  ratios search/accelerate: steps {search.tries / baseline.tries:.2f}, seconds "
                 f"{search.seconds / baseline.seconds:.2f}, answer {search.found / baseline.found:.3f}")
    gap = gap_percent(search)
    checks = [search.found >= 0.98 * limit and search.confirmed, search.probe_sizes <= 8,
              gap is not None and search.failed_above <= search.found + max(1, int(0.02 * search.found)),
              search.found >= 0.98 * baseline.found]
    lines.append(f"  targets: within 2% of limit {_mark(checks[0])}, <= 8 sizes {_mark(checks[1])}, "
                 f"failure <= 2% above {_mark(checks[2])}, >= 98% of accelerate {_mark(checks[3])}")
    summary = {"model": label, "limit": limit, "found": search.found, "sizes": search.probe_sizes,
               "gap": gap, "steps": search.tries, "accelerate sizes": baseline.probe_sizes}
    return lines, checks, summary


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="the random model's seed "
                        "(default: a fresh one, printed)")
    parser.add_argument("models", nargs="*", help="models to measure (default: the built-in ones "
                        "and the random one, 'random')")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    os.environ[SEED_VARIABLE] = str(seed)  # forked probes inherit it
    print(f"batch-size explorer, budget {BUDGET_MIB} MiB, 1 rank, CPU cap on private writable memory")
    all_checks, summaries = [], []
    for name in args.models or [*models.BUILTIN, "random"]:
        if name == "random":
            label = f"random (seed {seed}: {describe_random_model()})"
            lines, checks, summary = row(RANDOM_MODEL, label)
            summary["model"] = f"random, seed {seed}"
        else:
            lines, checks, summary = row(name, name)
        print("\n".join(lines), flush=True)
        all_checks += checks
        summaries.append(summary)
    print("\nsearch, side by side (sizes: distinct probe sizes; gap: failure above the answer)")
    print(f"  {'model':<20} {'limit':>6} {'found':>6} {'sizes':>6} {'gap':>6} {'steps':>6}  accelerate sizes")
    for s in summaries:
        gap = "-" if s["gap"] is None else f"{s['gap']:.1f}%"
        print(f"  {s['model']:<20} {s['limit']:>6} {s['found']:>6} {s['sizes']:>6} {gap:>6} "
              f"{s['steps']:>6}  {s['accelerate sizes']}")
    print(f"{sum(all_checks)}/{len(all_checks)} targets met")
    return 0 if all(all_checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
