"""Early-stop divergence: one rank leaves the training loop alone and the others hang.

Rank DIVERGE_RANK decides at step STEP that its loss has converged and breaks out of the loop
(VARIANT = "broken"); the other ranks go on training, so their next backward() waits inside DDP's
gradient all-reduce while the early rank waits in `accelerator.wait_for_everyone()`.
VARIANT = "fixed" uses `accelerator.set_trigger()` / `accelerator.check_trigger()`, so every rank
stops at the same step.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime

import torch
from accelerate import Accelerator, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": the rank breaks out alone; "fixed": set_trigger/check_trigger
DIVERGE_RANK = 1  # the rank whose loss "converges" first
STEP = 2  # the step at which it decides to stop
STEPS = 6  # training steps per rank when nobody stops early
BATCH = 8  # per-device batch size
FEATURES = 16  # model input width
SEED = 0  # data and weights
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, diverge_rank=DIVERGE_RANK, step=STEP, steps=STEPS, batch=BATCH,
         features=FEATURES, seed=SEED, pg_timeout_s=PG_TIMEOUT_S):
    """Train a small DDP model; return the step each rank stopped at and its final weights' sum."""
    accelerator = make_accelerator(pg_timeout_s)
    torch.manual_seed(seed)
    model = torch.nn.Linear(features, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    count = steps * batch * accelerator.num_processes
    data = torch.utils.data.TensorDataset(torch.randn(count, features), torch.randn(count, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    stopped_at = None
    for index, (inputs, targets) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)  # doctor-line: training
        optimizer.step()
        optimizer.zero_grad()
        converged = accelerator.process_index == diverge_rank and index == step
        if variant == "broken":
            if converged:
                stopped_at = index
                break  # only this rank leaves the loop
        else:
            if converged:
                accelerator.set_trigger()
            if accelerator.check_trigger():  # a collective: every rank learns about the stop
                stopped_at = index
                break
    accelerator.wait_for_everyone()  # doctor-line: early-rank
    weights = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"rank": accelerator.process_index, "stopped_at": stopped_at, "weights": weights}


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
