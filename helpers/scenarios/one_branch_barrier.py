"""A barrier in one branch only: the main process waits at a barrier the others never reach.

The main process prepares a data file, then calls `accelerator.wait_for_everyone()` *inside*
`if accelerator.is_main_process:` and writes a "ready" marker after it. The other ranks skip the
barrier and poll for the marker, which never comes (VARIANT = "broken"): rank 0 waits in a barrier,
the others in a sleep loop. VARIANT = "fixed" puts the barrier after the branch, on every rank.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime
import os
import tempfile
import time

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": barrier inside the main-process branch; "fixed": barrier after it
ITEMS = 8  # rows in the prepared data
WAIT_S = 600.0  # how long the other ranks poll for the marker before giving up
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, items=ITEMS, wait_s=WAIT_S, pg_timeout_s=PG_TIMEOUT_S):
    """Prepare data on the main process, share it; return the sum each rank read."""
    accelerator = make_accelerator(pg_timeout_s)
    folder = os.path.join(tempfile.gettempdir(), f"one-branch-barrier-{os.environ.get('MASTER_PORT', '0')}")
    data_file, marker = os.path.join(folder, "data.pt"), os.path.join(folder, "ready")
    if accelerator.is_main_process:
        os.makedirs(folder, exist_ok=True)
        torch.save(torch.arange(items, dtype=torch.float32), data_file)
        if variant == "broken":
            accelerator.wait_for_everyone()  # doctor-line: main-barrier
        open(marker, "w").close()
    if variant == "fixed":
        accelerator.wait_for_everyone()
    deadline = time.monotonic() + wait_s
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)  # doctor-line: polling
    total = torch.load(data_file).sum().item()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for path in (data_file, marker):
            os.remove(path)
        os.rmdir(folder)
    return {"rank": accelerator.process_index, "sum": total}


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
