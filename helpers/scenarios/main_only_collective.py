"""A collective inside `if accelerator.is_main_process`: the main process waits alone.

Each epoch every rank scores its shard; VARIANT = "broken" averages the scores with
`accelerator.reduce` inside `if accelerator.is_main_process:`, so rank 0 enters an all_reduce the
other ranks never call, while they wait in the next `accelerator.wait_for_everyone()`.
VARIANT = "fixed" calls `accelerator.reduce` on every rank and only prints on the main process.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": reduce on the main process only; "fixed": reduce on every rank
EPOCHS = 2  # evaluation rounds
SEED = 0  # the scores
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, epochs=EPOCHS, seed=SEED, pg_timeout_s=PG_TIMEOUT_S):
    """Score each epoch on every rank; return the mean scores the main process saw."""
    accelerator = make_accelerator(pg_timeout_s)
    torch.manual_seed(seed + accelerator.process_index)
    means = []
    for _epoch in range(epochs):
        score = torch.rand(4).mean()
        if variant == "broken":
            if accelerator.is_main_process:
                mean = accelerator.reduce(score, reduction="mean")  # doctor-line: main-only
                means.append(mean.item())
        else:
            mean = accelerator.reduce(score, reduction="mean")
            if accelerator.is_main_process:
                means.append(mean.item())
        accelerator.wait_for_everyone()  # doctor-line: others
    return {"rank": accelerator.process_index, "means": means}


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
