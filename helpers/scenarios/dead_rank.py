"""A dead rank: one process is killed mid-training (as the out-of-memory killer would).

Rank DIVERGE_RANK kills itself with SIGKILL at step STEP (VARIANT = "broken"); the others are in,
or about to enter, DDP's gradient all-reduce and need it. On gloo they fail with "Connection closed
by peer" at once; with NCCL they would wait for the timeout. VARIANT = "fixed" trains to the end.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime
import os
import signal

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": DIVERGE_RANK is killed at STEP; "fixed": nobody is killed
DIVERGE_RANK = 1  # the rank that dies
STEP = 2  # the step at which it dies
STEPS = 5  # training steps
BATCH = 8  # per-device batch size
FEATURES = 16  # model input width
SEED = 0  # data and weights
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, diverge_rank=DIVERGE_RANK, step=STEP, steps=STEPS, batch=BATCH,
         features=FEATURES, seed=SEED, pg_timeout_s=PG_TIMEOUT_S):
    """Train a small DDP model; return the final weights' sum."""
    accelerator = make_accelerator(pg_timeout_s)
    torch.manual_seed(seed)
    model = torch.nn.Linear(features, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    count = steps * batch * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(count, features), torch.randn(count, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for index, (inputs, targets) in enumerate(loader):
        if variant == "broken" and index == step and accelerator.process_index == diverge_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # doctor-line: killed
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)  # doctor-line: training
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()
    weights = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"rank": accelerator.process_index, "weights": weights}


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
