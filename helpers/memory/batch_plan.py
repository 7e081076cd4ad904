"""Effective-batch arithmetic: keep a reference run's global batch on other device counts.

Global batch = per-device batch x devices x gradient accumulation steps. Pure integer arithmetic,
independent of how the per-device limit was found (the explorer's answer, or a number you know).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from helpers.report import ResultMixin, html_table, text_table


@dataclass
class BatchPlan:
    """Per-device batch and accumulation steps for a number of devices."""

    devices: int
    per_device_batch_size: int
    accumulation_steps: int
    global_batch_size: int
    keeps_global: bool


@dataclass
class EffectiveBatchAdvice(ResultMixin):
    """How to keep a reference run's global batch on other device counts."""

    reference_per_device: int
    reference_devices: int
    reference_accumulation: int
    max_per_device: int
    plans: list[BatchPlan] = field(default_factory=list)

    @property
    def reference_global(self) -> int:
        """per-device batch x devices x accumulation steps."""
        return self.reference_per_device * self.reference_devices * self.reference_accumulation

    def rows(self) -> list[dict[str, Any]]:
        """One row per device count."""
        return [{"devices": p.devices, "per-device batch": p.per_device_batch_size,
                 "accumulation steps": p.accumulation_steps, "global batch": p.global_batch_size,
                 "keeps global": p.keeps_global,
                 "learning rate": "unchanged" if p.keeps_global else
                 f"x{p.global_batch_size / self.reference_global:.3g} (linear rule) or re-tune"}
                for p in self.plans]

    def note(self) -> str:
        """The reference in words."""
        return (f"reference: {self.reference_per_device} per device x {self.reference_devices} "
                f"device(s) x {self.reference_accumulation} accumulation step(s) = global batch "
                f"{self.reference_global}; at most {self.max_per_device} fits per device")

    def _repr_html_(self) -> str:
        return f"<p>{self.note()}</p>" + html_table(self.rows(), highlight="keeps global")

    def summary(self) -> str:
        """Plain-text table."""
        return self.note() + "\n" + text_table(self.rows())


def positive_int(name: str, value: Any) -> int:
    """``value`` when it is an integer >= 1 (not a bool); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    return value


def plan_devices(global_batch: int, devices: int, max_per_device: int) -> BatchPlan:
    """Per-device batch and accumulation for ``devices`` that keep ``global_batch`` if possible:
    the fewest accumulation steps whose per-device batch divides exactly and fits."""
    for steps in range(1, global_batch + 1):
        per_device, rest = divmod(global_batch, devices * steps)
        if per_device == 0:
            break
        if rest == 0 and per_device <= max_per_device:
            return BatchPlan(devices, per_device, steps, global_batch, True)
    per_device = max(1, min(max_per_device, global_batch // devices))
    steps = max(1, round(global_batch / (devices * per_device)))
    return BatchPlan(devices, per_device, steps, per_device * devices * steps, False)


def effective_batch(per_device_batch_size: int, devices: int = 1, accumulation_steps: int = 1, *,
                    max_per_device: int, targets: Sequence[int] = (1, 2, 4, 8)) -> EffectiveBatchAdvice:
    """Keep the global batch (per-device batch x devices x accumulation steps) of a reference run
    on each device count in ``targets``, with at most ``max_per_device`` per device."""
    advice = EffectiveBatchAdvice(positive_int("per_device_batch_size", per_device_batch_size),
                                  positive_int("devices", devices),
                                  positive_int("accumulation_steps", accumulation_steps),
                                  positive_int("max_per_device", max_per_device))
    for target in targets:
        advice.plans.append(plan_devices(advice.reference_global, positive_int("targets", target),
                                         advice.max_per_device))
    return advice


