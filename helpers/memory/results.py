"""What the batch-size explorer finds, as plain data: probes, strategies, the fit, tables, plots.

Everything here is a dataclass that renders itself (``_repr_html_``, ``summary()``, ``plot()``) and
turns into JSON; nothing starts a process. The search (``helpers.memory.search``) and the
orchestration (``helpers.memory.explore``) build these; the notebook and the CLI only show them.
matplotlib is imported inside ``plot()``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from helpers.report import Outcome, ResultMixin, html_table, text_table, to_jsonable

MIB = 1 << 20
DEFAULT_REPEATS = 3
DEFAULT_TOLERANCE = 0.02


@dataclass
class Probe:
    """One training step at one batch size under the budget (or one accelerate attempt)."""

    batch_size: int
    ok: bool
    peak_bytes: int | None  # CPU: peak RSS above baseline; GPU: torch.cuda.max_memory_allocated
    seconds: float
    capped_bytes: int | None = None  # fitted steps: peak CPU address space / GPU reserved memory
    error: str | None = None  # the out-of-memory message when not ok
    rank: int | None = None  # accelerate attempts: the rank that made it; None: all ranks together

    def row(self) -> dict[str, Any]:
        """The probe as a table row (MiB)."""
        return {"batch size": self.batch_size, "fits": self.ok, "peak MiB": _mib_value(self.peak_bytes),
                "capped MiB": _mib_value(self.capped_bytes), "seconds": round(self.seconds, 2),
                "error": self.error or ""}

    def _repr_html_(self) -> str:
        return html_table([self.row()], highlight="fits")


@dataclass
class StrategyResult:
    """What one strategy found, with every probe it made."""

    strategy: str  # "search" or "accelerate"
    found: int  # 0: nothing fits
    probes: list[Probe]
    budget_bytes: int
    per_rank_found: list[int]
    successes: int  # successful probes at ``found`` (accelerate: 1, it stops at the first)
    confirmed: bool  # fits reliably: ``repeats`` successes in a row in fresh processes
    failed_above: int | None  # smallest size above ``found`` seen to fail
    seconds: float
    note: str = ""

    @property
    def agreed(self) -> bool:
        """True when every rank ended with the same batch size."""
        return len(set(self.per_rank_found)) <= 1

    @property
    def tries(self) -> int:
        """Training steps attempted (per rank; ranks run side by side)."""
        counts = _per_rank(self.probes, len)
        return max(counts.values(), default=0)

    @property
    def probe_sizes(self) -> int:
        """Distinct batch sizes tried (repeats of one size count once; per rank)."""
        counts = _per_rank(self.probes, lambda probes: len({p.batch_size for p in probes}))
        return max(counts.values(), default=0)

    def certainty(self) -> str:
        """How sure the answer is, in words."""
        if self.found == 0:
            return "nothing fits"
        text = f"fits {self.successes}/{self.successes} in fresh processes" if self.confirmed \
            else f"succeeded {self.successes}x"
        if self.failed_above:
            text += f"; {self.failed_above} (+{100 * (self.failed_above / self.found - 1):.1f}%) failed"
        return text

    def entry(self) -> dict[str, Any]:
        """The CLI's JSON entry for this strategy."""
        data = to_jsonable(self)
        data.update(tries=self.tries, probe_sizes=self.probe_sizes, agreed=self.agreed)
        return data


def _per_rank(probes: list[Probe], count: Callable[[list[Probe]], int]) -> dict[Any, int]:
    groups: dict[Any, list[Probe]] = {}
    for probe in probes:
        groups.setdefault(probe.rank, []).append(probe)
    return {rank: count(group) for rank, group in groups.items()}


@dataclass
class MemoryFit:
    """Peak memory ~ intercept + per_sample x batch size, from successful probes."""

    intercept_bytes: float
    per_sample_bytes: float
    points: int

    def bytes_at(self, batch_size: float) -> float:
        """Predicted peak at ``batch_size``."""
        return self.intercept_bytes + self.per_sample_bytes * batch_size

    def limit(self, budget_bytes: int) -> int | None:
        """Largest batch size predicted to stay under ``budget_bytes`` (None: no usable slope)."""
        if self.per_sample_bytes <= 0:
            return None
        return max(0, math.floor((budget_bytes - self.intercept_bytes) / self.per_sample_bytes))


@dataclass
class ModelCheck(ResultMixin):
    """The model and budget checked before any probe: parameters and the model's own footprint."""

    model: str
    parameters: int
    parameter_bytes: int
    footprint_bytes: int  # weights + gradients + AdamW's two moments (+ buffers)
    budget_bytes: int
    rank_budgets_bytes: list[int]
    num_processes: int
    device: str

    def rows(self) -> list[dict[str, Any]]:
        """The check as table rows."""
        return [
            {"what": "model", "value": self.model},
            {"what": "parameters", "value": f"{self.parameters:,}"},
            {"what": "weights", "value": format_mib(self.parameter_bytes)},
            {"what": "weights + gradients + AdamW moments", "value": format_mib(self.footprint_bytes)},
            {"what": "budget per rank", "value": ", ".join(format_mib(b) for b in self.rank_budgets_bytes)},
            {"what": "left for activations", "value": format_mib(min(self.rank_budgets_bytes)
                                                           - self.footprint_bytes)},
            {"what": "ranks", "value": self.num_processes},
            {"what": "device", "value": self.device},
        ]

    def _repr_html_(self) -> str:
        return html_table(self.rows(), ["what", "value"])

    def summary(self) -> str:
        """Plain-text table."""
        return text_table(self.rows(), ["what", "value"])


@dataclass
class ExploreResult(ResultMixin):
    """Both strategies on one model and budget: answers, probes, the memory fit."""

    model: str
    device: str
    budget_bytes: int
    rank_budgets_bytes: list[int]
    starting_batch_size: int
    num_processes: int
    footprint_bytes: int
    strategies: list[StrategyResult]
    fit: MemoryFit | None
    seconds: float
    repeats: int = DEFAULT_REPEATS
    tolerance: float = DEFAULT_TOLERANCE

    def strategy(self, name: str) -> StrategyResult | None:
        """The result of strategy ``name`` ("search" or "accelerate"), None when it did not run."""
        return next((s for s in self.strategies if s.strategy == name), None)

    @property
    def search(self) -> StrategyResult | None:
        """Our search's result."""
        return self.strategy("search")

    @property
    def accelerate(self) -> StrategyResult | None:
        """accelerate's ``find_executable_batch_size`` result."""
        return self.strategy("accelerate")

    @property
    def answer(self) -> int:
        """The batch size to use: search's answer when it ran, else accelerate's (rank 0)."""
        chosen = self.search or self.accelerate
        return min(chosen.per_rank_found) if chosen else 0

    @property
    def ok(self) -> bool:
        """search found a size that fits reliably, within the tolerance of or above accelerate's
        (when only accelerate ran: it found a size)."""
        search, baseline = self.search, self.accelerate
        if search is None:
            return baseline is not None and baseline.found > 0
        if not search.confirmed or search.found == 0:
            return False
        return baseline is None or search.found >= (1 - self.tolerance) * baseline.found

    def entries(self) -> list[dict[str, Any]]:
        """The CLI's JSON: one entry per strategy."""
        return [s.entry() for s in self.strategies]

    def comparison_rows(self) -> list[dict[str, Any]]:
        """One row per strategy: answer, certainty, cost."""
        return [{"strategy": s.strategy, "found": s.found, "certainty": s.certainty(),
                 "sizes tried": s.probe_sizes, "steps": s.tries, "seconds": round(s.seconds, 1),
                 "per rank": ", ".join(str(f) for f in s.per_rank_found),
                 "ranks agree": s.agreed} for s in self.strategies]

    def probe_rows(self) -> list[dict[str, Any]]:
        """Every probe of every strategy, in order."""
        rows = []
        for s in self.strategies:
            for i, p in enumerate(s.probes, 1):
                rows.append({"strategy": s.strategy, "#": i, "rank": "all" if p.rank is None else p.rank,
                             "batch size": p.batch_size, "fits": p.ok,
                             "peak MiB": _mib_value(p.peak_bytes),
                             "capped MiB": _mib_value(p.capped_bytes),
                             "seconds": round(p.seconds, 2), "error": _short(p.error)})
        return rows

    def fit_text(self) -> str:
        """The memory model in words."""
        if self.fit is None:
            return "no fit (fewer than two sizes fitted)"
        limit = self.fit.limit(min(self.rank_budgets_bytes))
        return (f"peak ~ {format_mib(self.fit.intercept_bytes)} + {self.fit.per_sample_bytes / MIB:.3f} MiB "
                f"x batch size (from {self.fit.points} sizes); predicted limit under "
                f"{format_mib(min(self.rank_budgets_bytes))}: {limit}")

    def verdict(self) -> str:
        """One line: the answers side by side."""
        parts = [f"{s.strategy}: {s.found} ({s.certainty()}; {s.probe_sizes} sizes, {s.tries} steps, "
                 f"{s.seconds:.1f} s)" for s in self.strategies]
        return " | ".join(parts)

    def summary(self) -> str:
        """Plain-text report for the CLI."""
        head = (f"model {self.model} on {self.device}, budget "
                f"{', '.join(format_mib(b) for b in self.rank_budgets_bytes)} per rank, "
                f"{self.num_processes} rank(s), start {self.starting_batch_size}")
        cols = ["strategy", "found", "certainty", "sizes tried", "steps", "seconds", "per rank",
                "ranks agree"]
        return "\n".join([head, "", text_table(self.comparison_rows(), cols), "", self.fit_text()])

    def _repr_html_(self) -> str:
        cols = ["strategy", "found", "certainty", "sizes tried", "steps", "seconds", "per rank",
                "ranks agree"]
        probe_cols = ["strategy", "#", "rank", "batch size", "fits", "peak MiB", "capped MiB",
                      "seconds", "error"]
        return (f"<p><b>{self.model}</b> on {self.device}; budget "
                f"{', '.join(format_mib(b) for b in self.rank_budgets_bytes)} per rank; "
                f"{self.num_processes} rank(s); start {self.starting_batch_size}</p>"
                + html_table(self.comparison_rows(), cols, highlight="ranks agree")
                + f"<p>{self.fit_text()}</p>"
                + f"<details><summary>every probe ({len(self.probe_rows())})</summary>"
                + html_table(self.probe_rows(), probe_cols, highlight="fits") + "</details>")

    def plot(self):
        """Two panels (matplotlib Figure): left, the batch size of every try of each strategy;
        right, memory against batch size near the limit: fitted probes, OOMs, the fit, the budget."""
        import matplotlib.pyplot as plt

        fig, (tries, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.2),
                                               gridspec_kw={"width_ratios": [1, 1.2]})
        _plot_tries(tries, self.strategies)
        _plot_memory(memory_ax, self)
        fig.suptitle(f"{self.model} on {self.device}: budget "
                     f"{min(self.rank_budgets_bytes) / MIB:.0f} MiB, start {self.starting_batch_size}")
        fig.tight_layout()
        plt.close(fig)
        return fig


@dataclass
class BatchSizeOutcome(Outcome):
    """Notebook 04's outcome: the explorer's answer holds, and ranks searching together agreed.

    Saved flat: every key of the explore result's JSON stays at the top level (readers of the
    results file from before this outcome existed keep working), plus ``ok``, ``problems`` and
    ``across_ranks`` (the agreement, or None when that step did not run).
    """

    ok: bool
    explored: ExploreResult
    ranks: ExploreResult | None
    problems: list[str]

    def verdict(self) -> str:
        """One line: the answers side by side, the ranks' agreement, and any problem first."""
        line = self.explored.verdict() + self._ranks_text()
        return line if self.ok else "NOT OK: " + "; ".join(self.problems) + " | " + line

    def headline(self) -> str:
        """The batch size found, how sure, how close to the limit (the smallest size seen to fail),
        and accelerate's answer beside it."""
        explored = self.explored
        chosen = explored.search or explored.accelerate
        if chosen is None:
            return "no strategy ran"
        budget = format_mib(min(explored.rank_budgets_bytes)) if explored.rank_budgets_bytes else "?"
        line = (f"batch size {explored.answer} ({chosen.strategy}) for {explored.model} under {budget}"
                f" per rank: {chosen.certainty()}")
        if explored.search is not None and explored.accelerate is not None:
            line += f"; accelerate found {explored.accelerate.found}"
        search = self.ranks.search if self.ranks is not None else None
        if search is not None:
            line += f"; {self.ranks.num_processes} ranks " + (
                f"agreed on {search.found}" if search.agreed else f"ended with {_per_rank_text(search)}")
        return line if self.ok else "NOT OK: " + "; ".join(self.problems) + " | " + line

    def _ranks_text(self) -> str:
        search = self.ranks.search if self.ranks is not None else None
        if search is None:
            return ""
        agreed = f"agreed on {search.found}" if search.agreed else f"ended with {_per_rank_text(search)}"
        others = "".join(f"; {s.strategy} per rank {_per_rank_text(s)}"
                         for s in self.ranks.strategies if s is not search)
        return f" | {self.ranks.num_processes} ranks: search {agreed}{others}"

    def across_ranks_entry(self) -> dict[str, Any] | None:
        """The across-ranks step in the results file: budgets, and what each strategy's ranks found."""
        if self.ranks is None:
            return None
        search = self.ranks.search
        return {"num_processes": self.ranks.num_processes,
                "rank_budgets_bytes": self.ranks.rank_budgets_bytes,
                "starting_batch_size": self.ranks.starting_batch_size,
                "agreed": search.agreed if search else None,
                "strategies": [{"strategy": s.strategy, "found": s.found,
                                "per_rank_found": s.per_rank_found, "agreed": s.agreed,
                                "confirmed": s.confirmed} for s in self.ranks.strategies]}

    def to_dict(self) -> dict[str, Any]:
        """The explore result's JSON with ``ok``, ``problems`` and ``across_ranks`` added."""
        data = self.explored.to_dict()
        data.update(ok=self.ok, problems=self.problems, across_ranks=self.across_ranks_entry())
        return data

    def _repr_html_(self) -> str:
        return f"<p>{html.escape(self.verdict())}</p>"


def _per_rank_text(strategy: StrategyResult) -> str:
    return ", ".join(str(found) for found in strategy.per_rank_found)


_COLORS = {"search": "tab:blue", "accelerate": "tab:orange"}


def _plot_tries(ax: Any, strategies: list[StrategyResult]) -> None:
    for s in strategies:
        probes = [p for p in s.probes if p.rank in (None, 0)]
        steps = list(range(1, len(probes) + 1))
        color = _COLORS.get(s.strategy, "gray")
        ax.plot(steps, [p.batch_size for p in probes], color=color, alpha=0.5)
        ax.scatter([i for i, p in zip(steps, probes, strict=True) if p.ok],
                   [p.batch_size for p in probes if p.ok], color=color, marker="o", zorder=3)
        ax.scatter([i for i, p in zip(steps, probes, strict=True) if not p.ok],
                   [p.batch_size for p in probes if not p.ok], color=color, marker="x", zorder=3)
        ax.plot([], [], color=color, label=f"{s.strategy}: {s.found} after {len(probes)} steps")
    ax.scatter([], [], color="gray", marker="x", label="out of memory")
    _log2_y(ax)
    ax.set_xlabel("training step tried")
    ax.set_ylabel("batch size")
    ax.set_title("every try")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _log2_y(ax: Any) -> None:
    """A base-2 log y scale labelled with plain numbers (1, 4, 16, ...): readable batch sizes, and
    no mathtext (drawn from the widget panel in JupyterLab, mathtext tick labels such as
    ``$\\mathdefault{2^{0}}$`` failed with a pyparsing ParseException; the cause is not known)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _plot_memory(ax: Any, result: ExploreResult) -> None:
    budget = min(result.rank_budgets_bytes) / MIB
    found = [s.found for s in result.strategies] + [s.failed_above or 0 for s in result.strategies]
    right = max(max(found) * 1.4, 8)
    search = result.search
    if search is not None:
        near = [p for p in search.probes if p.batch_size <= right]
        fits = [p for p in near if p.ok and p.capped_bytes is not None]
        ooms = [p for p in near if not p.ok]
        ax.scatter([p.batch_size for p in fits], [p.capped_bytes / MIB for p in fits],
                   color=_COLORS["search"], zorder=3, label="search: fits")
        ax.scatter([p.batch_size for p in ooms], [budget * 1.05] * len(ooms), marker="x",
                   color="tab:red", zorder=3, label="search: out of memory")
    if result.fit is not None:
        ax.plot([0, right], [result.fit.bytes_at(0) / MIB, result.fit.bytes_at(right) / MIB], "--",
                color=_COLORS["search"], alpha=0.6,
                label=f"fit: {round(result.fit.intercept_bytes / MIB)} MiB + "
                      f"{result.fit.per_sample_bytes / MIB:.2f} MiB x batch")
    for s in result.strategies:
        if s.found:
            ax.axvline(s.found, color=_COLORS.get(s.strategy, "gray"), linestyle=":",
                       label=f"{s.strategy} answer {s.found}")
    ax.axhline(budget, color="black", linewidth=1, label=f"budget {budget:.0f} MiB")
    ax.set_xlim(0, right)
    ax.set_ylim(0, budget * 1.3)
    ax.set_xlabel("batch size per rank")
    ax.set_ylabel("MiB above the baseline (fitted steps)")
    ax.set_title("memory against batch size, near the limit")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def format_mib(value: float) -> str:
    """``value`` bytes as '12.3 MiB' (tables and error messages)."""
    return f"{value / MIB:.1f} MiB"


def _mib_value(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _short(text: str | None, limit: int = 90) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else text[: limit - 3] + "..."

