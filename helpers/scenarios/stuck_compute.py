"""A rank stuck in compute: one rank never converges while the others wait in an all_reduce.

Each step every rank refines its state until it converges, then the ranks average a metric with
`accelerator.reduce`. On rank DIVERGE_RANK at step STEP the refinement never reaches TOLERANCE
(VARIANT = "broken"): it loops (up to COMPUTE_S seconds) while the others wait in the all_reduce.
VARIANT = "fixed" caps the refinement at MAX_ITERS iterations.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime
import time

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": refine until converged (never, on DIVERGE_RANK); "fixed": cap iterations
DIVERGE_RANK = 1  # the rank whose refinement never converges
STEP = 1  # the step at which it gets stuck
STEPS = 3  # steps
MAX_ITERS = 50  # the fixed variant's cap on refinement iterations
COMPUTE_S = 600.0  # safety: the stuck loop gives up after this many seconds
SEED = 0  # the states
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, diverge_rank=DIVERGE_RANK, step=STEP, steps=STEPS, max_iters=MAX_ITERS,
         compute_s=COMPUTE_S, seed=SEED, pg_timeout_s=PG_TIMEOUT_S):
    """Refine a state and average a metric each step; return the averages."""
    accelerator = make_accelerator(pg_timeout_s)
    torch.manual_seed(seed + accelerator.process_index)
    state, averages = torch.rand(32, 32), []
    for index in range(steps):
        never = variant == "broken" and index == step and accelerator.process_index == diverge_rank
        tolerance = -1.0 if never else 1e-3  # a norm is never below -1
        state = refine(state, tolerance, max_iters if variant == "fixed" else None, compute_s)
        metric = accelerator.reduce(state.norm(), reduction="mean")  # doctor-line: others
        averages.append(metric.item())
    return {"rank": accelerator.process_index, "averages": averages}


def refine(state, tolerance, max_iters, compute_s):
    """Shrink ``state`` until its norm is below ``tolerance`` (or the caps are reached)."""
    deadline, iters = time.monotonic() + compute_s, 0
    while (state := state * 0.5).norm() > tolerance and time.monotonic() < deadline:  # doctor-line: loop
        iters += 1
        if max_iters is not None and iters >= max_iters:
            break
    return state


def make_accelerator(pg_timeout_s):
    """An Accelerator on the GPUs, or on CPU with gloo where there are none."""
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    handlers = [InitProcessGroupKwargs(timeout=timeout)] if pg_timeout_s else []
    return Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=handlers)


def parse_args(argv=None):
    """Command-line overrides of the UPPER_CASE parameters above (`--diverge-rank 0` ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in list(globals().items()):
        if name.isupper():
            parser.add_argument("--" + name.lower().replace("_", "-"), type=type(value), default=value)
    return vars(parser.parse_args(argv))


if __name__ == "__main__":
    main(**parse_args())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
