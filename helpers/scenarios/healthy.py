"""Healthy training: every rank does the same collectives in the same order.

A small DDP model is trained for STEPS steps; each step's loss is gathered with
`accelerator.gather_for_metrics`; at the end every rank calls `accelerator.wait_for_everyone()`.
LATE_S makes rank LATE_RANK late by that many seconds once (at step STEP), as a slow batch would:
a rank late by less than the doctor's `stall_s` is not a hang.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime
import time

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "fixed"  # only "fixed": nothing is wrong here
LATE_RANK = 1  # the rank that is late once
LATE_S = 0.0  # by how many seconds
STEP = 1  # at which step
STEPS = 4  # training steps
BATCH = 8  # per-device batch size
FEATURES = 16  # model input width
SEED = 0  # data and weights
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, late_rank=LATE_RANK, late_s=LATE_S, step=STEP, steps=STEPS, batch=BATCH,
         features=FEATURES, seed=SEED, pg_timeout_s=PG_TIMEOUT_S):
    """Train a small DDP model; return the gathered losses and the final weights' sum."""
    accelerator = make_accelerator(pg_timeout_s)
    torch.manual_seed(seed)
    model = torch.nn.Linear(features, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    count = steps * batch * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(count, features), torch.randn(count, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for index, (inputs, targets) in enumerate(loader):
        if index == step and accelerator.process_index == late_rank and late_s > 0:
            time.sleep(late_s)  # a slow batch
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather_for_metrics(loss.detach()[None]).mean().item())
    accelerator.wait_for_everyone()
    weights = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"rank": accelerator.process_index, "losses": losses, "weights": weights}


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
