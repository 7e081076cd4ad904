"""`in_order` logging on the main process only: an ordered log is a collective.

`get_logger(__name__).info(msg, main_process_only=False, in_order=True)` makes every process log
in turn, with a barrier after each turn: every rank must call it. VARIANT = "broken" calls it inside
`if accelerator.is_main_process:`, so rank 0 waits in a barrier while the others are already in the
next step's `accelerator.reduce`. VARIANT = "fixed" calls it on every rank.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.logging import get_logger

VARIANT = "broken"  # "broken": ordered log inside `if is_main_process`; "fixed": on every rank
STEPS = 4  # steps
LOG_EVERY = 2  # log every this many steps
SEED = 0  # the losses
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)

logger = get_logger(__name__, log_level="INFO")


def main(variant=VARIANT, steps=STEPS, log_every=LOG_EVERY, seed=SEED, pg_timeout_s=PG_TIMEOUT_S):
    """Average a loss across ranks each step and log it in order; return the averages."""
    accelerator = make_accelerator(pg_timeout_s)
    torch.manual_seed(seed + accelerator.process_index)
    averages = []
    for step in range(1, steps + 1):
        loss = accelerator.reduce(torch.rand(()), reduction="mean")  # doctor-line: others
        averages.append(loss.item())
        if step % log_every == 0:
            message = f"step {step}: loss {loss.item():.4f}"
            if variant == "broken":
                if accelerator.is_main_process:
                    logger.info(message, main_process_only=False, in_order=True)  # doctor-line: log
            else:
                logger.info(message, main_process_only=False, in_order=True)
    return {"rank": accelerator.process_index, "averages": averages}


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
