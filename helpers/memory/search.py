"""Our batch-size search, alone: no process, no torch; ``measure(batch_size) -> Probe`` is injected.

Kept apart from the orchestration so that the algorithm can be tested on a simulated memory model
(thousands of searches in a second) and the orchestration can change how a probe runs without
touching it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from helpers.memory.results import DEFAULT_REPEATS, DEFAULT_TOLERANCE, MemoryFit, Probe


class Search:
    """Our search: fit memory against batch size, predict the limit, narrow down to the boundary.

    ``measure(batch_size) -> Probe`` runs one probe. The answer fits ``repeats`` times in a row and
    a size at most ``tolerance`` (or 1) larger was seen to fail; or it is ``start`` itself, when
    the start fits reliably; or 0 when batch size 1 does not fit.
    """

    def __init__(self, measure: Callable[[int], Probe], start: int, budget_bytes: int,
                 repeats: int = DEFAULT_REPEATS, tolerance: float = DEFAULT_TOLERANCE):
        self.measure, self.start, self.budget = measure, start, budget_bytes
        self.repeats, self.tolerance = repeats, tolerance
        self.probes: list[Probe] = []
        self.outcomes: dict[int, list[bool]] = {}
        self.overshot = False
        self.undershot = 0

    def run(self) -> tuple[int, str]:
        """Search; return (answer, note)."""
        nothing = "even batch size 1 runs out of memory under this budget"
        if self._try(self.start) and self._confirm(self.start):
            return self.start, "the starting batch size fits reliably; a larger one may fit too"
        if self.start == 1 or not self._try(1):
            return 0, nothing
        while True:
            lo, hi = self._bracket()
            if lo == 0:
                return 0, nothing
            if hi - lo <= self.gap(lo):
                if self._confirm(lo):
                    return lo, ""
                continue  # lo failed a repeat: it joins the failures, narrow again
            self._try(self._next(lo, hi))

    def gap(self, size: int) -> int:
        """The largest step above ``size`` that still certifies the boundary (2%, at least 1)."""
        return max(1, math.floor(size * self.tolerance))

    def _try(self, batch_size: int) -> bool:
        probe = self.measure(batch_size)
        self.probes.append(probe)
        self.outcomes.setdefault(batch_size, []).append(probe.ok)
        return probe.ok

    def _confirm(self, size: int) -> bool:
        while self.outcomes[size].count(True) < self.repeats:
            if not self._try(size):
                return False
        return True

    def _bracket(self) -> tuple[int, int]:
        """(largest size that never failed below the smallest failure, smallest failure)."""
        hi = min(size for size, seen in self.outcomes.items() if not all(seen))
        good = [size for size, seen in self.outcomes.items() if all(seen) and size < hi]
        return max(good, default=0), hi

    def fit(self) -> MemoryFit | None:
        """Least-squares line through the largest three sizes that fitted."""
        return fit_memory(self.probes)

    def _next(self, lo: int, hi: int) -> int:
        fit = self.fit()
        limit = fit.limit(self.budget) if fit else None
        gap = self.gap(lo)
        if limit is None:
            candidate = _middle(lo, hi)
        elif limit >= hi:  # the fit overshoots: just below the failure once, then halve
            candidate = hi - self.gap(hi) if not self.overshot else _middle(lo, hi)
            self.overshot = True
        elif limit - lo <= gap:  # lo is at (or past) the predicted limit: test the size that
            # certifies it; when such tests keep succeeding the fit is off: halve instead
            candidate = lo + gap if self.undershot < 2 else _middle(lo, hi)
            self.undershot += 1
        else:
            candidate = max(lo + gap, math.floor(limit * (1 - self.tolerance / 2)))
        return min(max(candidate, lo + 1), hi - 1)


def _middle(lo: int, hi: int) -> int:
    if lo >= 1 and hi > 4 * lo:
        return round(math.sqrt(lo * hi))
    return (lo + hi) // 2


def fit_memory(probes: Sequence[Probe], largest: int = 3) -> MemoryFit | None:
    """Fit capped peak against batch size through the ``largest`` biggest sizes that fitted."""
    best: dict[int, int] = {}
    for p in probes:
        if p.ok and p.capped_bytes is not None and p.rank is None:
            best[p.batch_size] = max(best.get(p.batch_size, 0), p.capped_bytes)
    sizes = sorted(best)[-largest:]
    if len(sizes) < 2:
        return None
    xs, ys = sizes, [best[s] for s in sizes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return MemoryFit(my - slope * mx, slope, len(sizes))

