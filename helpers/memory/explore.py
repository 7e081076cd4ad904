"""In the caller: check the inputs before any process starts, then run probes and strategies.

Each probe is one ``helpers.launch`` of fresh forked ranks that run ``helpers.memory.probe`` under
the budget, so an out-of-memory error is genuine and never harms the caller (a notebook kernel).
Inputs are checked first, with one ValueError naming the parameter; a step that fails for a reason
other than memory is a ``ProbeError``. ``explore`` runs accelerate's ``find_executable_batch_size``
and/or our ``Search`` and returns an ``ExploreResult``; ``across_ranks`` does so on ranks with
different budgets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from helpers import params
from helpers.launch import RankError, default_backend, launch
from helpers.memory import models
from helpers.memory.batch_plan import positive_int
from helpers.memory.probe import accelerate_rank, probe_rank
from helpers.memory.results import (
    DEFAULT_REPEATS,
    DEFAULT_TOLERANCE,
    MIB,
    ExploreResult,
    ModelCheck,
    Probe,
    StrategyResult,
    format_mib,
)
from helpers.memory.search import Search, fit_memory

DEVICES = ("auto", "cpu", "cuda")


# ---------------------------------------------------------------------------------------------
# checking the inputs (before any process starts)


def resolve_device(device: str, num_processes: int) -> str:
    """'cpu' or 'cuda'. 'auto' picks CUDA when NVML sees a GPU per rank; never initialises CUDA.

    Raises ValueError when 'cuda' is asked for where it is not available.
    """
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
            f"has {size.parameters:,} parameters ({format_mib(size.parameter_bytes)}); with its gradients "
            f"and AdamW's two moment buffers it needs {format_mib(size.training_bytes)} before any "
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
            f"memory_budget_mib: {len(budgets)} rank(s) with {', '.join(format_mib(b) for b in budgets)} "
            f"need more than this machine's available memory ({format_mib(available)}); the cap would not "
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
    """What every launch of one exploration shares: the checked inputs, the model, the deadline."""

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
    n = setup.check.num_processes
    try:
        # no hang doctor: its tracer thread would allocate inside the capped ranks, and a rank
        # waiting in the one all_reduce for a slower rank's step is not a hang
        return launch(fn, args, num_processes=n, init_group=n > 1, timeout_s=setup.timeout_s)
    except RankError as exc:
        raise ProbeError(f"the training step of {setup.check.model!r} failed for a reason other "
                         f"than memory (rank {exc.rank}: {exc.exc_type}: {exc.exc_message})") from exc


def _probe_once(setup: _Setup, batch_size: int) -> Probe:
    per_rank = _launch(setup, probe_rank,
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
    batch_size = positive_int("batch_size", batch_size)
    setup = _setup(model, memory_budget_mib, num_processes, rank_budgets_mib, device, timeout_s)
    warm_up()
    return _probe_once(setup, batch_size)


def _setup(model: str, memory_budget_mib: int, num_processes: int,
           rank_budgets_mib: Sequence[int] | None, device: str, timeout_s: float) -> _Setup:
    timeout_s = params.check("timeout_s", timeout_s)
    check, factory = _prepare(model, memory_budget_mib, num_processes, rank_budgets_mib, device)
    return _Setup(check, factory, timeout_s)


def _run_accelerate(setup: _Setup, start: int) -> StrategyResult:
    """accelerate's ``find_executable_batch_size`` in every rank (each searching alone)."""
    started = time.monotonic()
    per_rank = _launch(setup, accelerate_rank,
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


def _run_search(setup: _Setup, start: int, repeats: int = DEFAULT_REPEATS,
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
        results.append(_run_accelerate(setup, starting_batch_size))
    if strategy in ("search", "both"):
        results.append(_run_search(setup, starting_batch_size, repeats, tolerance))
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

