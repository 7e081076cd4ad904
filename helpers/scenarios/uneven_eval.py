"""Uneven evaluation batches: one rank runs out of batches and leaves the eval loop first.

The evaluation loader is prepared with `even_batches=False` and holds one batch fewer than
`num_processes * BATCHES`, so the last rank gets one batch less. Each batch's predictions are
gathered with `accelerator.gather_for_metrics`: the other ranks wait in that gather while the short
rank already waits in `accelerator.wait_for_everyone()` after the loop (VARIANT = "broken").
VARIANT = "fixed" keeps accelerate's default `even_batches=True`: every rank gets the same number of
batches and `gather_for_metrics` drops the duplicated samples.

Runs unchanged under torchrun, `accelerate launch --multi_gpu`, `python -m helpers doctor` and, as
`main(**parameters)`, under helpers.launch. Imports only torch and accelerate.
"""

import argparse
import datetime

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs

VARIANT = "broken"  # "broken": even_batches=False; "fixed": accelerate's default even_batches=True
BATCHES = 3  # evaluation batches per rank (the last rank gets one fewer)
BATCH = 4  # per-device batch size
FEATURES = 8  # model input width
SEED = 0  # data and weights
PG_TIMEOUT_S = 0.0  # process-group timeout, seconds (0: torch's default, 30 min on gloo)


def main(variant=VARIANT, batches=BATCHES, batch=BATCH, features=FEATURES, seed=SEED,
         pg_timeout_s=PG_TIMEOUT_S):
    """Evaluate a small model; return how many predictions were gathered and their sum."""
    accelerator = make_accelerator(pg_timeout_s, even_batches=variant != "broken")
    torch.manual_seed(seed)
    model = torch.nn.Linear(features, 1)
    count = (accelerator.num_processes * batches - 1) * batch
    data = torch.utils.data.TensorDataset(torch.randn(count, features))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=batch))
    model = accelerator.prepare(model)
    model.eval()
    predictions = []
    with torch.no_grad():
        for (inputs,) in loader:
            outputs = model(inputs)
            predictions.append(accelerator.gather_for_metrics(outputs))  # doctor-line: gather
    accelerator.wait_for_everyone()  # doctor-line: short-rank
    gathered = torch.cat(predictions)
    return {"rank": accelerator.process_index, "count": gathered.numel(), "sum": gathered.sum().item()}


def make_accelerator(pg_timeout_s, even_batches):
    """An Accelerator on the GPUs, or on CPU with gloo where there are none."""
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    handlers = [InitProcessGroupKwargs(timeout=timeout)] if pg_timeout_s else []
    return Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=handlers,
                       dataloader_config=DataLoaderConfiguration(even_batches=even_batches))


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
