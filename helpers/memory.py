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
What runs inside the children (the caps, the training step) lives in ``helpers.memory_probe``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from helpers import memory_probe, models, params
from helpers.report import ResultMixin, html_table, text_table

MIB = 1 << 20
DEFAULT_REPEATS = 3
DEFAULT_TOLERANCE = 0.02
DEVICES = ("auto", "cpu", "cuda")


# ---------------------------------------------------------------------------------------------
# results


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
        from helpers.report import to_jsonable

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
            {"what": "weights", "value": _mib(self.parameter_bytes)},
            {"what": "weights + gradients + AdamW moments", "value": _mib(self.footprint_bytes)},
            {"what": "budget per rank", "value": ", ".join(_mib(b) for b in self.rank_budgets_bytes)},
            {"what": "left for activations", "value": _mib(min(self.rank_budgets_bytes)
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
        return (f"peak ~ {_mib(self.fit.intercept_bytes)} + {self.fit.per_sample_bytes / MIB:.3f} MiB "
                f"x batch size (from {self.fit.points} sizes); predicted limit under "
                f"{_mib(min(self.rank_budgets_bytes))}: {limit}")

    def verdict(self) -> str:
        """One line: the answers side by side."""
        parts = [f"{s.strategy}: {s.found} ({s.certainty()}; {s.probe_sizes} sizes, {s.tries} steps, "
                 f"{s.seconds:.1f} s)" for s in self.strategies]
        return " | ".join(parts)

    def summary(self) -> str:
        """Plain-text report for the CLI."""
        head = (f"model {self.model} on {self.device}, budget "
                f"{', '.join(_mib(b) for b in self.rank_budgets_bytes)} per rank, "
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
                f"{', '.join(_mib(b) for b in self.rank_budgets_bytes)} per rank; "
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


def _mib(value: float) -> str:
    return f"{value / MIB:.1f} MiB"


def _mib_value(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def _short(text: str | None, limit: int = 90) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# checking the inputs (before any process starts)


def resolve_device(device: str, num_processes: int) -> str:
    """'cpu' or 'cuda'. 'auto' picks CUDA when NVML sees a GPU per rank; never initialises CUDA.

    Raises ValueError when 'cuda' is asked for where it is not available.
    """
    from helpers.launch import default_backend

    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))}; got {device!r}")
    has_gpus = default_backend(num_processes) == "nccl"
    if device == "cuda" and not has_gpus:
        raise ValueError(f"device='cuda' is not available here: NVML finds no NVIDIA GPU for each of "
                         f"the {num_processes} rank(s) on this machine; use device='cpu' (a real cap "
                         f"address-space cap) or run where GPUs are")
    if device == "auto":
        return "cuda" if has_gpus else "cpu"
    return device


def _rank_budgets(memory_budget_mib: int, num_processes: int,
                  rank_budgets_mib: Sequence[int] | None) -> list[int]:
    if rank_budgets_mib is None:
        return [memory_budget_mib * MIB] * num_processes
    if len(rank_budgets_mib) != num_processes:
        raise ValueError(f"rank_budgets_mib must list one budget per rank ({num_processes}); "
                         f"got {len(rank_budgets_mib)}")
    return [params.check("memory_budget_mib", value) * MIB for value in rank_budgets_mib]


def _prepare(model: str, memory_budget_mib: int, num_processes: int,
             rank_budgets_mib: Sequence[int] | None, device: str) -> tuple[ModelCheck, models.Factory]:
    cfg = params.validate(model=model, memory_budget_mib=memory_budget_mib,
                          num_processes=num_processes)
    budgets = _rank_budgets(cfg.memory_budget_mib, cfg.num_processes, rank_budgets_mib)
    device = resolve_device(device, cfg.num_processes)
    factory = models.load(cfg.model)
    size = models.footprint(factory, cfg.model)
    if size.training_bytes >= min(budgets):
        raise ValueError(
            f"memory_budget_mib={min(budgets) // MIB} is below the model's own footprint: {cfg.model!r} "
            f"has {size.parameters:,} parameters ({_mib(size.parameter_bytes)}); with its gradients "
            f"and AdamW's two moment buffers it needs {_mib(size.training_bytes)} before any "
            f"activation. Use memory_budget_mib of at least {size.training_bytes // MIB + 16}.")
    if device == "cpu":
        _check_machine_memory(budgets)
    check = ModelCheck(cfg.model, size.parameters, size.parameter_bytes, size.training_bytes,
                       min(budgets), budgets, cfg.num_processes, device)
    return check, factory


def _check_machine_memory(budgets: list[int]) -> None:
    import psutil

    available = psutil.virtual_memory().available
    if sum(budgets) > available:
        raise ValueError(
            f"memory_budget_mib: {len(budgets)} rank(s) with {', '.join(_mib(b) for b in budgets)} "
            f"need more than this machine's available memory ({_mib(available)}); the cap would not "
            f"be what stops the run. Lower memory_budget_mib or num_processes.")


def check_model(model: str = "mlp", memory_budget_mib: int = 512, num_processes: int = 1, *,
                rank_budgets_mib: Sequence[int] | None = None, device: str = "auto") -> ModelCheck:
    """Check the model and the budget before any probe; one clear ValueError for each bad input.

    Errors name the parameter: an unknown model name, a missing file or function, a budget below
    the model's own footprint (weights, gradients, AdamW's moments), a budget the machine lacks.
    """
    return _prepare(model, memory_budget_mib, num_processes, rank_budgets_mib, device)[0]


# ---------------------------------------------------------------------------------------------
# in the caller: running probes and strategies


class ProbeError(RuntimeError):
    """A probe failed for a reason other than memory (the model or its batch is broken)."""


@dataclass
class _Setup:
    check: ModelCheck
    factory: models.Factory
    timeout_s: float

    @property
    def budgets(self) -> list[int]:
        return self.check.rank_budgets_bytes


def warm_up() -> None:
    """Load, once in the caller, what a first training step imports lazily (torch's optimizer
    machinery pulls in hundreds of modules, ~1 s): forked probes then share it and their baseline
    holds libraries only. CPU only: the caller never touches CUDA. Like any first optimizer step,
    it imports torch._dynamo, which creates torch's per-user cache folder (``torchinductor_<user>``
    in the temp folder) when it does not exist yet."""
    import accelerate.utils.memory  # noqa: F401 - imported by every probe
    import torch

    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.zeros(1, 2)).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _launch(setup: _Setup, fn: Callable[..., Any], args: tuple) -> list[Any]:
    from helpers.launch import RankError, launch

    n = setup.check.num_processes
    try:
        # no hang doctor: its tracer thread would allocate inside the capped ranks, and a rank
        # waiting in the one all_reduce for a slower rank's step is not a hang
        return launch(fn, args, num_processes=n, init_group=n > 1, timeout_s=setup.timeout_s)
    except RankError as exc:
        raise ProbeError(f"the training step of {setup.check.model!r} failed for a reason other "
                         f"than memory (rank {exc.rank}: {exc.exc_type}: {exc.exc_message})") from exc


def _probe_once(setup: _Setup, batch_size: int) -> Probe:
    per_rank = _launch(setup, memory_probe.probe_rank,
                       (setup.factory, setup.check.model, batch_size, setup.budgets, setup.check.device))
    ok = all(r["ok"] for r in per_rank)
    if any(r["agreed"] != ok for r in per_rank):
        raise RuntimeError(f"ranks disagree after all_reduce(MIN): {per_rank}")
    errors = [f"rank {r['rank']}: {r['error']}" if len(per_rank) > 1 else r["error"]
              for r in per_rank if r["error"]]
    return Probe(batch_size, ok, _max(r["peak"] for r in per_rank),
                 max(r["seconds"] for r in per_rank), _max(r["capped"] for r in per_rank),
                 "; ".join(errors) or None)


def _max(values: Any) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def probe(model: str = "mlp", batch_size: int = 64, memory_budget_mib: int = 512,
          num_processes: int = 1, *, rank_budgets_mib: Sequence[int] | None = None,
          device: str = "auto", timeout_s: float = 300.0) -> Probe:
    """One training step at ``batch_size`` under the budget, in fresh child process(es).

    An out-of-memory error gives ``ok=False`` with torch's genuine message; the caller is never
    harmed. Bad inputs raise ValueError before any process starts; ProbeError when the step fails
    for a reason other than memory.
    """
    batch_size = _positive("batch_size", batch_size)
    setup = _setup(model, memory_budget_mib, num_processes, rank_budgets_mib, device, timeout_s)
    warm_up()
    return _probe_once(setup, batch_size)


def _setup(model, memory_budget_mib, num_processes, rank_budgets_mib, device, timeout_s) -> _Setup:
    timeout_s = params.check("timeout_s", timeout_s)
    check, factory = _prepare(model, memory_budget_mib, num_processes, rank_budgets_mib, device)
    return _Setup(check, factory, timeout_s)


def run_accelerate(setup: _Setup, start: int) -> StrategyResult:
    """accelerate's ``find_executable_batch_size`` in every rank (each searching alone)."""
    started = time.monotonic()
    per_rank = _launch(setup, memory_probe.accelerate_rank,
                       (setup.factory, setup.check.model, start, setup.budgets, setup.check.device))
    probes = [Probe(a["batch_size"], a["ok"], a["peak"], a["seconds"], None, a["error"], r["rank"])
              for r in per_rank for a in r["attempts"]]
    found = per_rank[0]["found"]
    notes = sorted({f"rank {r['rank']}: {r['note']}" for r in per_rank if r["note"]})
    return StrategyResult("accelerate", found, probes, min(setup.budgets),
                          [r["found"] for r in per_rank], successes=1 if found else 0,
                          confirmed=False, failed_above=_failed_above(probes, found),
                          seconds=time.monotonic() - started, note="; ".join(notes))


def _failed_above(probes: list[Probe], found: int) -> int | None:
    above = [p.batch_size for p in probes if not p.ok and p.batch_size > found]
    return min(above) if above else None


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


def run_search(setup: _Setup, start: int, repeats: int = DEFAULT_REPEATS,
               tolerance: float = DEFAULT_TOLERANCE) -> StrategyResult:
    """Our search, every rank probing each size and agreeing on the outcome."""
    started = time.monotonic()
    search = Search(lambda size: _probe_once(setup, size), start, min(setup.budgets), repeats,
                    tolerance)
    found, note = search.run()
    successes = search.outcomes.get(found, []).count(True) if found else 0
    return StrategyResult("search", found, search.probes, min(setup.budgets),
                          [found] * setup.check.num_processes, successes,
                          confirmed=found > 0 and successes >= repeats,
                          failed_above=_failed_above(search.probes, found),
                          seconds=time.monotonic() - started, note=note)


def explore(model: str = "mlp", memory_budget_mib: int = 512, starting_batch_size: int = 4096,
            strategy: str = "both", num_processes: int = 1, *,
            rank_budgets_mib: Sequence[int] | None = None, repeats: int = DEFAULT_REPEATS,
            tolerance: float = DEFAULT_TOLERANCE, device: str = "auto",
            timeout_s: float = 300.0) -> ExploreResult:
    """Find the largest batch size that fits the budget, with accelerate's rule and/or ours.

    ``rank_budgets_mib`` gives each rank its own budget (one card with less free memory);
    by default every rank has ``memory_budget_mib``. ``timeout_s`` bounds each launch (one probe,
    or accelerate's whole search). Bad inputs raise ValueError before any process starts.
    """
    starting_batch_size = params.check("starting_batch_size", starting_batch_size)
    strategy = params.check("strategy", strategy)
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats must be an integer >= 1; got {repeats!r}")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
        raise ValueError(f"tolerance must be a number in 0..1; got {tolerance!r}")
    setup = _setup(model, memory_budget_mib, num_processes, rank_budgets_mib, device, timeout_s)
    warm_up()
    started = time.monotonic()
    results = []
    if strategy in ("accelerate", "both"):
        results.append(run_accelerate(setup, starting_batch_size))
    if strategy in ("search", "both"):
        results.append(run_search(setup, starting_batch_size, repeats, tolerance))
    search = next((r for r in results if r.strategy == "search"), None)
    check = setup.check
    return ExploreResult(check.model, check.device, check.budget_bytes, check.rank_budgets_bytes,
                         starting_batch_size, check.num_processes, check.footprint_bytes, results,
                         fit_memory(search.probes) if search else None,
                         time.monotonic() - started, repeats, tolerance)


def across_ranks(model: str = "mlp", memory_budget_mib: int = 128, starting_batch_size: int = 1024,
                 num_processes: int = 2, *, shortfall: float = 0.1, timeout_s: float = 300.0,
                 device: str = "auto") -> ExploreResult:
    """Both strategies on ``num_processes`` ranks where the last rank has ``shortfall`` less memory
    (as when another process holds memory on one GPU): accelerate's ranks each search alone and
    can end with different batch sizes; ours agree on the minimum with one collective per probe."""
    num_processes = params.check("num_processes", num_processes)
    budget = params.check("memory_budget_mib", memory_budget_mib)
    if not (isinstance(shortfall, (int, float)) and 0 <= shortfall < 1):
        raise ValueError(f"shortfall must be a number in 0..1; got {shortfall!r}")
    budgets = [budget] * (num_processes - 1) + [max(16, round(budget * (1 - shortfall)))]
    return explore(model, budget, starting_batch_size, "both", num_processes,
                   rank_budgets_mib=budgets, timeout_s=timeout_s, device=device)


def budget_choices(current: int) -> list[int]:
    """Budgets offered by the notebook's panel (MiB), including the current one."""
    return sorted({64, 128, 256, 512, 1024, 2048, current})


def model_choices(current: str) -> list[str]:
    """Models offered by the notebook's panel: the built-in ones and the current one."""
    return list(dict.fromkeys([*models.BUILTIN, current]))


def panel(cfg: params.Config):
    """Notebook 04's panel: model, budget slider, starting batch size, strategy, Run."""
    import functools

    from helpers import ui

    return ui.panel(functools.partial(explore, num_processes=cfg.num_processes),
                    {"model": cfg.model, "memory_budget_mib": cfg.memory_budget_mib,
                     "starting_batch_size": cfg.starting_batch_size, "strategy": cfg.strategy},
                    choices={"model": model_choices(cfg.model),
                             "memory_budget_mib": budget_choices(cfg.memory_budget_mib)},
                    title="Batch-size explorer")


# ---------------------------------------------------------------------------------------------
# effective batch size


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


def _positive(name: str, value: Any) -> int:
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
    advice = EffectiveBatchAdvice(_positive("per_device_batch_size", per_device_batch_size),
                                  _positive("devices", devices),
                                  _positive("accumulation_steps", accumulation_steps),
                                  _positive("max_per_device", max_per_device))
    for target in targets:
        advice.plans.append(plan_devices(advice.reference_global, _positive("targets", target),
                                         advice.max_per_device))
    return advice


# ---------------------------------------------------------------------------------------------
# command line


def cli_main(argv: list[str]) -> int:
    """``python -m helpers batch-size --model M --memory-budget-mib B ...``: exit 0 found a size,
    1 nothing fits or the step failed, 2 bad usage."""
    from helpers import cli, report

    parser = argparse.ArgumentParser(prog="python -m helpers batch-size",
                                     description="Find the largest batch size that fits a memory "
                                                 "budget: accelerate's rule and ours, side by side.")
    cli.add_param(parser, "model", None, required=True)
    cli.add_param(parser, "memory_budget_mib", None, required=True)
    cli.add_param(parser, "starting_batch_size", 4096)
    cli.add_param(parser, "strategy", "both")
    cli.add_param(parser, "num_processes", 1)
    parser.add_argument("--json", metavar="PATH", help="write one JSON entry per strategy to PATH")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return cli.EXIT_OK if exc.code in (0, None) else cli.EXIT_USAGE
    try:
        result = explore(args.model, args.memory_budget_mib, args.starting_batch_size,
                         args.strategy, args.num_processes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return cli.EXIT_PROBLEM
    print(result.summary())
    if args.json:
        report.atomic_write_json(args.json, result.entries())
    found = all(s.found > 0 for s in result.strategies)
    return cli.EXIT_OK if found else cli.EXIT_PROBLEM
