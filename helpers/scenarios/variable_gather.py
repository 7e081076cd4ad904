"""A variable-length gather: ranks pass tensors of different sizes to `accelerator.gather`.

Each rank keeps the predictions that pass a filter, so rank DIVERGE_RANK ends up with EXTRA more
items than the others. VARIANT = "broken" gathers them as they are: an all_gather with different
shapes (gloo may hang, crash or silently return wrong data). VARIANT = "fixed" pads them with
`accelerator.pad_across_processes` first and drops the padding after the gather.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": gather as is; "fixed": pad_across_processes, gather, drop padding
DIVERGE_RANK = 1  # the rank that keeps more predictions
ITEMS = 4  # predictions kept on the other ranks
EXTRA = 1  # how many more DIVERGE_RANK keeps
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, diverge_rank=DIVERGE_RANK, items=ITEMS, extra=EXTRA, pg_timeout_s=PG_TIMEOUT_S):
    """Gather every rank's kept predictions; return how many arrived and their sum."""
    accelerator = make_accelerator(pg_timeout_s)
    rank = accelerator.process_index
    kept = items + (extra if rank == diverge_rank else 0)
    predictions = torch.arange(kept, dtype=torch.float32) + 100 * rank
    if variant == "broken":
        gathered = accelerator.gather(predictions)  # doctor-line: gather
    else:
        padded = accelerator.pad_across_processes(predictions, dim=0, pad_index=-1)
        gathered = accelerator.gather(padded)
        gathered = gathered[gathered != -1]
    accelerator.wait_for_everyone()
    return {"rank": rank, "count": gathered.numel(), "sum": gathered.sum().item()}


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
