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
    """Our search: fit memory against batch size, predict the limit, close a 2% bracket on it.

    ``measure(batch_size) -> Probe`` runs one probe. The answer fits ``repeats`` times in a row and
    a size at most ``tolerance`` (or 1) larger was seen to fail; or it is ``start`` itself, when
    the start fits reliably; or 0 when batch size 1 does not fit.

    Nothing here knows a model. Above a small batch, training memory is close to affine in the
    batch size (fixed part + per-sample part). After the start and batch size 1 come the geometric
    middle, then a line through the sizes that fitted (least squares, those within a factor 2 of
    the largest) predicts the limit. The search probes below it by the line's uncertainty: a first
    line cannot be checked, so it goes ``SHORT`` of the way; later lines are checked by how far
    the line before missed the newest size, read as curvature. Near the limit it probes a size that
    closes the bracket whichever way it goes and confirms a success there at once (repeats): right
    at the limit the outcome is random from run to run. A failure below the predicted limit is
    taken as the limit lying just below that failure; a second probe in a row that contradicts
    the line turns the step into bisection, so a model far from affine still ends. Repeats of a
    size count as one probe size.
    """

    #: of a long extrapolation from the largest size that fitted, the share a probe goes
    SHORT = 0.75

    def __init__(self, measure: Callable[[int], Probe], start: int, budget_bytes: int,
                 repeats: int = DEFAULT_REPEATS, tolerance: float = DEFAULT_TOLERANCE):
        self.measure, self.start, self.budget = measure, start, budget_bytes
        self.repeats, self.tolerance = repeats, tolerance
        self.probes: list[Probe] = []
        self.outcomes: dict[int, list[bool]] = {}
        self.contradictions = 0  # probes in a row whose outcome the line got wrong

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
            size, predicted, near = self._next(lo, hi)
            ok = self._try(size)
            if ok and near:  # a candidate answer: right at the limit one success proves little
                ok = self._confirm(size)
            wrong = predicted is not None and ok != (size <= predicted)
            self.contradictions = self.contradictions + 1 if wrong else 0

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

    def _closing_from_below(self, lo: int, hi: int) -> int:
        """The smallest size above ``lo`` whose success would certify the boundary below ``hi``."""
        size = max(lo + 1, math.floor(hi / (1 + self.tolerance)) - 1)
        while size + self.gap(size) < hi:
            size += 1
        return size

    def _points(self, below: int) -> dict[int, int]:
        """Measured peak (capped bytes) of each size below ``below`` that always fitted."""
        best: dict[int, int] = {}
        for p in self.probes:
            if p.ok and p.capped_bytes is not None and p.batch_size < below \
                    and all(self.outcomes[p.batch_size]):
                best[p.batch_size] = max(best.get(p.batch_size, 0), p.capped_bytes)
        return best

    @staticmethod
    def _base(points: dict[int, int]) -> list[int]:
        """The sizes a line goes through: those that fitted within a factor 2 of the largest (at
        least the two largest): local enough to follow a curve, wide enough for a coarse
        measurement."""
        ordered = sorted(points)
        sizes = [s for s in ordered if 2 * s >= ordered[-1]] if ordered else []
        return sizes if len(sizes) >= 2 else ordered[-2:]

    def _line(self, points: dict[int, int]) -> MemoryFit | None:
        sizes = self._base(points)
        return _least_squares(sizes, [points[s] for s in sizes])

    def _next(self, lo: int, hi: int) -> tuple[int, int | None, bool]:
        """(the next size to probe, the limit the line predicts (None without a line), whether
        the size is near that limit)."""
        points = self._points(hi)
        line = self._line(points)
        limit = line.limit(self.budget) if line else None
        if limit is not None and self.contradictions >= 2:
            limit = None  # the line was wrong twice in a row here: bisect
        up, down = lo + self.gap(lo), self._closing_from_below(lo, hi)
        if limit is None:
            size = _middle(lo, hi)
        elif limit < up:  # lo is at the predicted limit: the size that would certify it
            size = up
        else:
            target = min(limit, hi - 1)  # a failure below the predicted limit: just below it
            margin = self._uncertainty(points, line, limit) if limit < hi \
                else (1 - self.SHORT) * (target - lo)
            # aim below the limit by the line's uncertainty there, or half a gap: there it
            # should fit and one gap above it fail
            size = round(target - max(self.gap(target) // 2, margin))
            if size < down <= size + self.gap(target) and down <= target:
                size = down  # as likely to fit, and a success closes the bracket
        if down <= up:  # one probe closes the bracket, whatever its outcome
            size = min(max(size, down), up)
        size = min(max(size, lo + 1), hi - 1)
        near = down <= up or (limit is not None and size >= limit - self.gap(limit))
        return size, limit, near

    def _uncertainty(self, points: dict[int, int], line: MemoryFit, limit: float) -> float:
        """How far (in batch sizes) the line's ``limit`` may be off.

        The line without the largest size missed that size by some bytes; taken as curvature
        (memory = a line through two sizes + q x the product of the distances to them), that miss
        gives q, and q gives this line's error at the limit. A first line cannot be checked:
        (1 - SHORT) of its extrapolation, also the most this estimate gives.
        """
        largest = max(points)
        unchecked = (1 - self.SHORT) * (limit - largest)
        rest = {s: b for s, b in points.items() if s != largest}
        before = self._line(rest) if len(rest) >= 2 else None
        if before is None or line.per_sample_bytes <= 0:
            return unchecked
        old, new = self._base(rest), self._base(points)
        miss = abs(points[largest] - before.bytes_at(largest))
        curvature = miss / max(1, (largest - old[0]) * (largest - old[-1]))
        error = curvature * (limit - new[0]) * (limit - largest) / line.per_sample_bytes
        return min(unchecked, error)


def _middle(lo: int, hi: int) -> int:
    if lo >= 1 and hi > 4 * lo:
        return round(math.sqrt(lo * hi))
    return (lo + hi) // 2


def fit_memory(probes: Sequence[Probe], largest: int = 3) -> MemoryFit | None:
    """Fit capped peak against batch size through the ``largest`` biggest sizes that fitted.

    A larger batch needs at least the memory of a smaller one: each size's peak is taken as at least
    any smaller size's (a probe whose peak read low, 49.9 MB at 30 after 61.3 MB at 29 in a CI run,
    otherwise tilts a line through three close sizes: it predicted 43 where 30 was the answer)."""
    best: dict[int, int] = {}
    for p in probes:
        if p.ok and p.capped_bytes is not None and p.rank is None:
            best[p.batch_size] = max(best.get(p.batch_size, 0), p.capped_bytes)
    floor = 0
    for size in sorted(best):
        floor = best[size] = max(best[size], floor)
    sizes = sorted(best)[-largest:]
    return _least_squares(sizes, [best[s] for s in sizes])


def _least_squares(xs: list[int], ys: list[int]) -> MemoryFit | None:
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return MemoryFit(my - slope * mx, slope, len(xs))

