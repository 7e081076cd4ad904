"""Notebook 04's own steps: validation, the demo's derived arguments, the outcome, the panel.

The notebook only narrates, sets parameters and displays. The decisions its cells need (what a
valid configuration is, which budget the across-ranks demo uses, what the effective-batch table
starts from, when the notebook succeeded, which budgets the slider offers) are made here, where
they are documented and tested.
"""

from __future__ import annotations

import functools
from typing import Any

from helpers import params
from helpers.memory import models
from helpers.memory.batch_plan import EffectiveBatchAdvice, effective_batch
from helpers.memory.explore import across_ranks, check_model, explore
from helpers.memory.results import BatchSizeOutcome, ExploreResult, format_mib

DEMO_MIN_RANKS = 2  # agreement needs someone to agree with
DEMO_SCALE = 4  # the across-ranks demo runs at a quarter of the budget and of the start


def check_config(cfg: params.Config) -> params.Config:
    """What ``params.validate`` cannot check, before any probe: the model loads and builds, and
    one rank's budget holds its own footprint on this machine (``check_model``).

    Raises the same ValueError naming the parameter (``model: file not found: ...``,
    ``memory_budget_mib=... is below the model's own footprint``); returns ``cfg`` unchanged.
    """
    check_model(cfg.model, cfg.memory_budget_mib, cfg.num_processes)
    return cfg


def across_ranks_arguments(cfg: params.Config) -> dict[str, Any]:
    """The arguments of notebook 04's across-ranks demo, derived from its parameters.

    A quarter of the budget and of the starting batch size keep it quick: the memory per sample
    is the same, so the ranks run out of memory for the same reason with a quarter of the memory
    per step (at least 16 MiB, the smallest budget accepted, and batch size 1). At least 2 ranks,
    whatever ``num_processes`` says: with one rank there is nothing to agree on.
    """
    return {"model": cfg.model,
            "memory_budget_mib": max(16, cfg.memory_budget_mib // DEMO_SCALE),
            "starting_batch_size": max(1, cfg.starting_batch_size // DEMO_SCALE),
            "num_processes": max(DEMO_MIN_RANKS, cfg.num_processes)}


def across_ranks_demo(cfg: params.Config) -> ExploreResult:
    """Both strategies on at least 2 ranks, the last with 10% less memory (``across_ranks``),
    with the arguments of ``across_ranks_arguments(cfg)``."""
    return across_ranks(**across_ranks_arguments(cfg))


def batch_advice(cfg: params.Config, result: ExploreResult) -> EffectiveBatchAdvice:
    """Notebook 04's effective-batch step: ``starting_batch_size`` read as the global batch wanted
    on one device without accumulation, at most the explorer's answer per device (at least 1, so
    the table still shows how accumulation keeps the global batch when nothing fitted)."""
    return effective_batch(cfg.starting_batch_size, devices=1, accumulation_steps=1,
                           max_per_device=max(1, result.answer))


def outcome(explored: ExploreResult, ranks: ExploreResult | None = None) -> BatchSizeOutcome:
    """Did the notebook get what it teaches? The explorer's answer holds (``explored.ok``: the
    search confirmed a size within the tolerance of accelerate's or above), and on several ranks
    the search's ranks agreed on one confirmed size."""
    problems = []
    if not explored.ok:
        problems.append(f"no reliable batch size for {explored.model} under "
                        f"{format_mib(min(explored.rank_budgets_bytes))}")
    if ranks is not None:
        problems += _rank_problems(ranks)
    return BatchSizeOutcome(not problems, explored, ranks, problems)


def _rank_problems(ranks: ExploreResult) -> list[str]:
    search, n = ranks.search, ranks.num_processes
    if search is None:
        return [f"across {n} ranks: the search did not run"]
    if not search.agreed:
        return [f"across {n} ranks: the search's ranks ended with different sizes "
                f"({', '.join(map(str, search.per_rank_found))})"]
    if not search.confirmed:
        return [f"across {n} ranks: the search's answer {search.found} is not confirmed "
                f"({search.certainty()})"]
    return []


def budget_choices(current: int) -> list[int]:
    """Budgets offered by the notebook's panel (MiB), including the current one."""
    return sorted({64, 128, 256, 512, 1024, 2048, current})


def model_choices(current: str) -> list[str]:
    """Models offered by the notebook's panel: the built-in ones and the current one."""
    return list(dict.fromkeys([*models.BUILTIN, current]))


def panel(cfg: params.Config):
    """Notebook 04's panel: model, budget slider, starting batch size, strategy, Run."""
    from helpers import ui  # ipywidgets: only when a panel is drawn

    return ui.panel(functools.partial(explore, num_processes=cfg.num_processes),
                    {"model": cfg.model, "memory_budget_mib": cfg.memory_budget_mib,
                     "starting_batch_size": cfg.starting_batch_size, "strategy": cfg.strategy},
                    choices={"model": model_choices(cfg.model),
                             "memory_budget_mib": budget_choices(cfg.memory_budget_mib)},
                    title="Batch-size explorer")

