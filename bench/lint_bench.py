"""How fast ``python -m helpers lint`` reads a 2,000-line training script (target: well under 1 s).

Measured side by side in one run: parsing alone (the floor), the lint in-process, the whole
command line in a fresh interpreter, and, for scale, what a fresh interpreter needs just to
``import torch`` (which the lint never does: checked with ``-X importtime``). Wall time is what a
user waits; CPU time (user + system) is what the work costs, and moves less when the machine is
busy with other jobs.

    python bench/lint_bench.py [--lines 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import ast
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import lint

BUDGET_S = 1.0

# One block of a realistic accelerate training script; {n} makes each copy's names unique.
BLOCK = '''

def evaluate_{n}(model, loader):
    """Validation loss on this rank's shard."""
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in loader:
            outputs = model(**batch)
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(len(batch))))
    model.train()
    return torch.cat(losses).mean().item()


def save_{n}(model, output_dir):
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.save(state, os.path.join(output_dir, "model_{n}.pt"))
        logger.info("saved to %s", output_dir)


def train_{n}(model, optimizer, scheduler, train_loader, eval_loader, args):
    completed, best, patience = 0, float("inf"), 0
    progress = tqdm(range(args.max_steps), disable=not accelerator.is_local_main_process)
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                completed += 1
            if completed % args.log_every == 0:
                logger.info(f"epoch {{epoch}} step {{step}} loss {{loss.item():.4f}}")
            if completed >= args.max_steps:
                break
        val_loss = evaluate_{n}(model, eval_loader)
        if val_loss < best:
            best, patience = val_loss, 0
            save_{n}(model, args.output_dir)
        else:
            patience += 1
        if patience >= args.patience:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            break
        if accelerator.is_main_process and epoch == 0:
            print(accelerator.gather(loss))
    return best
'''

HEADER = '''"""A generated training script for the lint benchmark."""

import logging
import os

import torch
from accelerate import Accelerator
from tqdm import tqdm

accelerator = Accelerator()
logger = logging.getLogger(__name__)
'''


def generate(lines: int) -> str:
    """A training script of at least ``lines`` lines (one seeded bug per block: a main-only gather)."""
    parts, n = [HEADER], 0
    while sum(part.count("\n") for part in parts) < lines:
        parts.append(BLOCK.format(n=n))
        n += 1
    return "".join(parts)


def in_process(fn, repeat: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``fn()``."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def fresh_python(argv: list[str], repeat: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``python ARGV`` in a new interpreter."""
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        walls.append(time.perf_counter() - wall)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{argv} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return statistics.median(walls), statistics.median(cpus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    source = generate(args.lines)
    with tempfile.TemporaryDirectory(prefix="lint-bench-") as folder:
        script = Path(folder) / "train.py"
        script.write_text(source)
        result = lint.lint_source(source, str(script))  # also reads accelerate's names once
        parse = in_process(lambda: ast.parse(source), args.repeat)
        linted = in_process(lambda: lint.lint_source(source, str(script)), args.repeat)
        cli = fresh_python(["-m", "helpers", "lint", str(script)], args.repeat)
        python = fresh_python(["-c", "pass"], args.repeat)
        torch = fresh_python(["-c", "import torch"], min(args.repeat, 3))
        trace = subprocess.run([sys.executable, "-X", "importtime", "-m", "helpers", "lint", str(script)],
                               capture_output=True, text=True).stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in trace.splitlines() if "|" in line}
    heavy = sorted(imported & {"torch", "accelerate", "numpy", "matplotlib"})

    lines = source.count("\n")
    print(f"lint of a generated {lines}-line training script ({len(result.findings)} findings, "
          f"median of {args.repeat})")
    rows = [("ast.parse alone", parse, ""),
            ("lint, in-process", linted, f"{linted[0] / parse[0]:4.1f}x ast.parse"),
            ("python -m helpers lint (CLI)", cli, f"{cli[0] / BUDGET_S:4.2f}x the 1 s budget"),
            ("python -c pass", python, "interpreter start, part of the CLI figure"),
            ("python -c 'import torch'", torch, f"{torch[0] / cli[0]:4.1f}x the whole lint CLI")]
    print(f"  {'':<30} {'wall':>8} {'CPU':>8}")
    for name, (wall, cpu), note in rows:
        print(f"  {name:<30} {wall * 1000:5.0f} ms {cpu * 1000:5.0f} ms   {note}")
    print(f"  heavy modules the CLI imported: {', '.join(heavy) or 'none'}")
    return 0 if cli[0] < BUDGET_S and not heavy and result.findings else 1


if __name__ == "__main__":
    sys.exit(main())
