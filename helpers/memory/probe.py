"""What runs inside a probe's child process: the memory cap, one training step, the outcome.

``helpers.memory.explore`` forks children with ``helpers.launch`` and calls ``probe_rank`` (one
training step at one batch size) or ``accelerate_rank`` (accelerate's ``find_executable_batch_size``)
in them. Nothing here runs in the caller: the caps change process-wide settings (resource limits,
glibc's malloc thresholds, torch's oneDNN switch, the CUDA memory fraction).
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from typing import Any

from helpers.memory import models

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
_MALLOC_THRESHOLD_BYTES = 128 * 1024  # glibc's default starting mmap threshold


def _proc_status() -> dict[str, int]:
    wanted = ("VmPeak", "VmSize", "VmHWM", "VmRSS", "VmData")
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in wanted:
                values[key] = int(rest.split()[0]) * 1024
    return values


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _steady_malloc() -> int:
    """Make glibc's malloc account for memory the same way in every probe; return the free heap
    bytes this process inherited (already writable: usable without growing the data size).

    By default glibc raises its mmap threshold as large blocks are freed (up to 32 MiB) and keeps
    freed blocks below it in the heap, so how much address space a step takes depends on what the
    process did before: on the caller's history for a forked child, on earlier attempts for
    accelerate's loop. Fixing the threshold at 128 KiB makes every large tensor its own mapping,
    returned on free: memory use then follows the live tensors. No-op without glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim, mallinfo2 = libc.mallopt, libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError):
        return 0
    mallopt(_M_MMAP_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
    trim(0)
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


class CpuCap:
    """Caps this process's private writable memory at its current size plus ``budget_bytes``.

    The limit is ``RLIMIT_DATA`` (Linux >= 4.7 counts every private writable mapping, and memory
    made writable later, against it), set after torch is loaded, so the budget covers the model,
    the optimizer state and the activations, not the libraries. ``RLIMIT_AS`` would not do in a
    process forked from a Jupyter kernel: glibc's per-thread malloc arenas inherited from the
    kernel reserve hundreds of MiB of address space that malloc can make usable without growing
    it. Free heap memory inherited from the caller is taken off the limit, as it can be used
    without growing the data size. ``release()`` restores the old limit.
    """

    def __init__(self, budget_bytes: int):
        self.inherited_free = _steady_malloc()
        status = _proc_status()
        self.base_vm, self.base_rss = status["VmSize"], status["VmRSS"]
        self.old = resource.getrlimit(resource.RLIMIT_DATA)
        hard = self.old[1]
        limit = status["VmData"] + budget_bytes - self.inherited_free
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        self.vm_valid = True  # VmPeak counts from the fork (the kernel resets it there)
        self.rss_valid = self._reset_rss_peak()

    @staticmethod
    def _reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
            return True
        except OSError:
            return False

    def reset_peak(self) -> None:
        """Start a new peak (between accelerate's attempts); the address-space peak cannot be reset."""
        self.rss_valid = self._reset_rss_peak()
        self.vm_valid = False

    def peaks(self) -> tuple[int | None, int | None]:
        """(peak RSS above baseline, peak address space above baseline); None where unknown."""
        status = _proc_status()
        rss = status["VmHWM"] - self.base_rss if self.rss_valid else None
        vm = status["VmPeak"] - self.base_vm if self.vm_valid else None
        return rss, vm

    def release(self) -> None:
        """Restore the limit this process had before."""
        resource.setrlimit(resource.RLIMIT_DATA, self.old)


class CudaCap:
    """Limits torch's caching allocator on this rank's GPU to ``budget_bytes``.

    ``torch.cuda.set_per_process_memory_fraction(budget / total)``: the whole GPU when the budget
    is larger. Runs in a forked child only: the caller never initialises CUDA.
    """

    def __init__(self, budget_bytes: int):
        import torch

        self.index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(self.index)
        total = torch.cuda.get_device_properties(self.index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), self.index)
        torch.cuda.reset_peak_memory_stats(self.index)
        self.base_allocated = torch.cuda.memory_allocated(self.index)
        self.base_reserved = torch.cuda.memory_reserved(self.index)

    def reset_peak(self) -> None:
        """Start a new peak (between accelerate's attempts)."""
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.index)

    def peaks(self) -> tuple[int | None, int | None]:
        """(max_memory_allocated, max_memory_reserved) above the baseline."""
        import torch

        return (torch.cuda.max_memory_allocated(self.index) - self.base_allocated,
                torch.cuda.max_memory_reserved(self.index) - self.base_reserved)

    def release(self) -> None:
        """Lift the limit again."""
        import torch

        torch.cuda.set_per_process_memory_fraction(1.0, self.index)


def make_cap(device: str, budget_bytes: int) -> CpuCap | CudaCap:
    """The budget for this process on ``device`` ("cpu" or "cuda"); call ``release()`` after."""
    if device == "cuda":
        return CudaCap(budget_bytes)
    _only_torch_allocates()
    return CpuCap(budget_bytes)


def _only_torch_allocates() -> None:
    """Turn oneDNN and NNPACK off in this (child) process, so every allocation goes through
    torch's allocator and fails with its error.

    Both allocate buffers themselves. Under a cap oneDNN's convolutions fail with "could not
    create a primitive" and NNPACK's with "posix_memalign failed", errors accelerate's
    ``should_reduce_batch_size`` does not recognise, and oneDNN's memory use varies from run to
    run. On a GPU every allocation goes through torch's caching allocator.
    """
    import torch

    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for memory exhaustion: what accelerate's ``should_reduce_batch_size`` recognises, plus
    Python's MemoryError, C++'s bad_alloc and errno 12 ("Cannot allocate memory", as from
    ``posix_memalign``), which a cap can also produce."""
    from accelerate.utils.memory import should_reduce_batch_size

    if isinstance(exc, Exception) and should_reduce_batch_size(exc):
        return True
    text = str(exc)
    return isinstance(exc, MemoryError) or any(
        sign in text for sign in ("bad_alloc", "can't allocate memory", "Cannot allocate memory"))


def describe(exc: BaseException) -> str:
    """'RuntimeError: <first line of the message>', as a probe records it."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


def _to_device(batch: Any, device: str) -> Any:
    if device == "cpu":
        return batch
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch.to(device) if hasattr(batch, "to") else batch


def train_step(factory: models.Factory, text: str, batch_size: int, device: str = "cpu") -> None:
    """Build the model, then one training step at ``batch_size``: forward, backward, AdamW step,
    zero_grad. The optimizer's state is created first (zero gradients, one step) so the step sees
    the memory of a steady training step, where AdamW's moments already exist."""
    import torch

    model, make_batch = models.unpack(factory(), text)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    batch = _to_device(make_batch(batch_size), device)
    loss = models.loss_of(models.call(model, batch))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _group_ready() -> None:
    """Wait until every rank's process group is connected (no-op on one rank): a rank that
    finished its search early and exited could otherwise break a peer still connecting (gloo:
    "Connection closed by peer"). The search itself stays each rank's own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _agree(ok: bool, device: str) -> bool:
    """The one collective: all_reduce(MIN) of the outcome, so every rank learns if any failed."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def probe_rank(factory: models.Factory, text: str, batch_size: int, budgets: list[int],
               device: str) -> dict[str, Any]:
    """In a rank: one training step under this rank's budget; then agree with the other ranks.

    Out-of-memory errors become ``ok=False``; any other error propagates (the model is broken).
    """
    cap = make_cap(device, budgets[_rank()])
    started = time.perf_counter()
    error = None
    try:
        try:
            train_step(factory, text, batch_size, device)
        except Exception as exc:  # noqa: BLE001 - classified just below
            if not is_out_of_memory(exc):
                raise
            error = describe(exc)
        seconds = time.perf_counter() - started
        peak, capped = cap.peaks()
    finally:
        cap.release()
    ok = error is None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    agreed = _agree(ok, device) if world > 1 else ok
    # after a failed allocation malloc may reserve address space it never uses: no capped peak
    return {"rank": _rank(), "ok": ok, "agreed": agreed, "peak": peak,
            "capped": capped if ok else None, "seconds": seconds, "error": error}


def accelerate_rank(factory: models.Factory, text: str, start: int, budgets: list[int],
                    device: str) -> dict[str, Any]:
    """In a rank: accelerate's ``find_executable_batch_size`` from ``start``, under the budget.

    Every attempt builds the model and runs the same training step as a probe, in this one
    process, as a training script does. Returns the answer and every attempt.
    """
    import gc

    from accelerate.utils import find_executable_batch_size

    # accelerate runs gc.collect() before each try; objects inherited from the caller (a notebook
    # kernel holds many) are not the training loop's garbage: freeze them, as in a fresh script
    gc.freeze()
    _group_ready()
    rank = _rank()
    cap = make_cap(device, budgets[rank])
    attempts: list[dict[str, Any]] = []

    def train(batch_size: int) -> int:
        cap.reset_peak()
        started = time.perf_counter()
        try:
            train_step(factory, text, batch_size, device)
        except Exception as exc:
            attempts.append(_attempt(batch_size, cap, started, describe(exc)))
            raise
        attempts.append(_attempt(batch_size, cap, started, None))
        return batch_size

    note = ""
    try:
        found = find_executable_batch_size(train, starting_batch_size=start)()
    except Exception as exc:  # noqa: BLE001 - what accelerate gives up with is the finding
        found, note = 0, _gave_up(exc)
    finally:
        cap.release()
    return {"rank": rank, "found": found, "attempts": attempts, "note": note}


def _attempt(batch_size: int, cap: CpuCap | CudaCap, started: float, error: str | None) -> dict:
    peak, _ = cap.peaks()
    return {"batch_size": batch_size, "ok": error is None, "peak": peak,
            "seconds": time.perf_counter() - started, "error": error}


def _gave_up(exc: Exception) -> str:
    from accelerate.utils.memory import should_reduce_batch_size

    if "No executable batch size found" in str(exc):
        return f"accelerate gave up: {exc}"
    if is_out_of_memory(exc) and not should_reduce_batch_size(exc):
        return (f"accelerate stopped: {describe(exc)} is not an error its should_reduce_batch_size "
                f"recognises, so it re-raised it instead of retrying")
    raise exc
