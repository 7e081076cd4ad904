"""What notebook 04's cells call besides the explorer itself: its widget panel and its choices.

The notebook only narrates, sets parameters and displays; decisions it needs (which budgets the
slider offers, which models the toggle shows) are made here, where they are tested.
"""

from __future__ import annotations

import functools

from helpers import params
from helpers.memory import models
from helpers.memory.explore import explore


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

