"""Batch-size exploration under a real memory cap: the largest batch that fits, in a few probes.

A *probe* runs one training step (forward, backward, optimizer step, zero_grad) at one batch size
in a fresh forked child under a real memory budget, so that an out-of-memory error is genuine and
never harms the caller:

- on the CPU the child caps its own private writable memory (``RLIMIT_DATA``) at its baseline plus
  the budget, after torch is loaded; torch's allocator then raises its genuine "DefaultCPUAllocator:
  can't allocate memory" error, which accelerate's ``should_reduce_batch_size`` recognises (oneDNN
  and NNPACK are turned off in the child so that every allocation goes through torch's allocator);
- on a GPU the child limits torch's caching allocator with
  ``torch.cuda.set_per_process_memory_fraction`` (the whole GPU when the budget is larger), and
  torch raises its genuine "CUDA out of memory" error.

Each probe records ok / out of memory, the peak memory (CPU: peak resident memory above the
child's baseline; GPU: ``torch.cuda.max_memory_allocated``), for a step that fitted the peak of
what the cap follows (CPU: address space, where every tensor is its own mapping; GPU: memory
reserved by the caching allocator) and its seconds.

Two strategies run on the same model and budget:

- ``accelerate``: accelerate's own ``find_executable_batch_size`` with its default rule (x0.9 per
  out-of-memory error), in one child per rank, as a training script runs it. Its answer is the first
  size that succeeded once; each rank searches alone.
- ``search``: fits memory against batch size from the successful probes, predicts the largest
  batch under the budget and narrows down to the boundary. Its answer fits in ``repeats`` fresh
  processes in a row and a size at most 2% (or 1) larger was seen to fail. With several ranks every
  rank probes each size and the ranks agree on the outcome with one ``all_reduce(MIN)``, so they
  all end with the same answer: the largest size that fits on every rank.

``explore`` runs them and returns an ``ExploreResult`` (table, plot, JSON). ``effective_batch``
turns the answer into per-device batch sizes and accumulation steps that keep a global batch.

This module is the facade: notebook 04, the CLI, the tests and the bench use the names in
``__all__``. Where each part lives:

- ``results``: the result types (``Probe``, ``StrategyResult``, ``ExploreResult``, ...) and plots;
- ``search``: the pure ``Search`` algorithm and the memory fit (no process, no torch);
- ``explore``: input checks and, in the caller, the launches: ``probe``, ``explore``, ``across_ranks``;
- ``probe``: what runs inside a probe's child process (the caps, one training step);
- ``models``: the built-in models and the user's ``path/to/file.py:function``;
- ``batch_plan``: effective-batch arithmetic;
- ``notebook``: notebook 04's own steps (validation, demo arguments, outcome, panel);
- ``cli``: ``python -m helpers batch-size``.

Imports flow one way: models <- probe <- explore; results <- search <- explore; batch_plan <-
explore; explore <- notebook, cli. Outside the package only the leaves (params, report, cli) and
``helpers.launch``; never ``helpers.doctor`` or another feature. torch, accelerate, matplotlib and
ipywidgets (``helpers.ui``) are imported inside the functions that need them.

Two names are both a function here and a module of this package: ``probe`` and ``explore``. The
facade binds the functions (``memory.probe(...)``, ``memory.explore(...)``), as notebook 04 calls
them; import from the modules with ``from helpers.memory.probe import probe_rank``.
"""

from __future__ import annotations

from helpers.memory import models
from helpers.memory.batch_plan import BatchPlan, EffectiveBatchAdvice, effective_batch, plan_devices
from helpers.memory.cli import cli_main
from helpers.memory.explore import (
    DEVICES,
    ProbeError,
    across_ranks,
    check_model,
    explore,
    probe,
    resolve_device,
    warm_up,
)
from helpers.memory.notebook import (
    across_ranks_arguments,
    across_ranks_demo,
    batch_advice,
    budget_choices,
    check_config,
    model_choices,
    outcome,
    panel,
)
from helpers.memory.results import (
    DEFAULT_REPEATS,
    DEFAULT_TOLERANCE,
    MIB,
    BatchSizeOutcome,
    ExploreResult,
    MemoryFit,
    ModelCheck,
    Probe,
    StrategyResult,
)
from helpers.memory.search import Search, fit_memory

__all__ = [
    # notebook 04's steps and the CLI
    "check_config", "check_model", "probe", "explore", "across_ranks", "across_ranks_demo",
    "across_ranks_arguments", "effective_batch", "batch_advice", "outcome", "panel", "cli_main",
    "warm_up", "budget_choices", "model_choices",
    # result types
    "Probe", "StrategyResult", "MemoryFit", "ModelCheck", "ExploreResult", "BatchPlan",
    "EffectiveBatchAdvice", "BatchSizeOutcome", "ProbeError",
    # the parts, for tests and the bench
    "Search", "fit_memory", "plan_devices", "resolve_device", "models",
    "MIB", "DEFAULT_REPEATS", "DEFAULT_TOLERANCE", "DEVICES",
]
