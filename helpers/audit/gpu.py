"""The NVIDIA driver and GPUs through NVML, and ``nvidia-smi topo -m``: the GPU part of the facts.

Apart from the rest of ``helpers.audit.facts`` because it is the one part that needs a GPU to run
for real: the NVML module is injectable (``gpu_facts(nvml=...)``), so tests drive every path here
with a fake (tests/fixtures/audit/fake_nvml.py), and on a machine without a driver every failure
becomes a fact ("not available here"), never an exception.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

NVIDIA_SMI_TIMEOUT_S = 5.0
# NVML clock event ("throttle") reason bits -> names (nvml.h, nvmlClocksEventReason*)
THROTTLE_REASONS = {
    0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown",
    0x10: "SyncBoost", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown", 0x100: "DisplayClockSetting",
}
# nvmlDeviceGetTopologyCommonAncestor levels -> the labels of `nvidia-smi topo -m`
TOPOLOGY_LABELS = {0: "INT", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def gpu_facts(nvml: Any = None) -> dict[str, Any]:
    """Driver, per-GPU facts and the NVML topology; every NVML failure becomes a fact."""
    driver: dict[str, Any] = {"version": None, "cuda": None, "error": None,
                              "device_nodes": sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*")),
                              "nvml_module": None}
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            driver["error"] = "pynvml is not installed (pip install nvidia-ml-py)"
            return {"driver": driver, "gpus": [], "nvml_topology": None}
    driver["nvml_module"] = getattr(nvml, "__name__", type(nvml).__name__)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        driver["error"] = _init_error(nvml, exc)
        return {"driver": driver, "gpus": [], "nvml_topology": None}
    try:
        driver["version"] = _text(nvml.nvmlSystemGetDriverVersion())
        driver["cuda"] = _cuda_version_text(_quiet(nvml, nvml.nvmlSystemGetCudaDriverVersion))
        count = nvml.nvmlDeviceGetCount()
        handles: dict[int, Any] = {}
        gpus = [_one_gpu(nvml, index, handles) for index in range(count)]
        topology = _nvml_topology(nvml, handles)
    except nvml.NVMLError as exc:
        driver["error"] = f"NVML failed: {exc}"
        return {"driver": driver, "gpus": [], "nvml_topology": None}
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return {"driver": driver, "gpus": gpus, "nvml_topology": topology}


def _init_error(nvml: Any, exc: Exception) -> str:
    value = getattr(exc, "value", None)
    if value == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
        return "no NVIDIA driver here (NVML library libnvidia-ml.so not found)"
    if value == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
        return "the NVIDIA kernel driver is not loaded"
    return f"NVML could not start: {exc}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version_text(value: Any) -> str | None:
    """12040 -> '12.4' (NVML's encoding: 1000 * major + 10 * minor)."""
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


class _GpuLost(Exception):
    pass


def _quiet(nvml: Any, fn: Any, *args: Any) -> Any:
    """Call an NVML query; None when the GPU or driver does not support it."""
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15):
            raise _GpuLost(str(exc)) from None
        return None


def _one_gpu(nvml: Any, index: int, handles: dict[int, Any]) -> dict[str, Any]:
    gpu: dict[str, Any] = {"index": index, "name": None, "error": None}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        handles[index] = handle
        gpu.update(_gpu_identity(nvml, handle))
        gpu.update(_gpu_links(nvml, handle))
        gpu.update(_gpu_health(nvml, handle))
    except _GpuLost:
        gpu["error"] = "GPU is lost (NVML_ERROR_GPU_IS_LOST)"
        handles.pop(index, None)
    except nvml.NVMLError as exc:
        lost = getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15)
        gpu["error"] = "GPU is lost (NVML_ERROR_GPU_IS_LOST)" if lost else f"NVML query failed: {exc}"
        handles.pop(index, None)
    return gpu


def _gpu_identity(nvml: Any, handle: Any) -> dict[str, Any]:
    memory = _quiet(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    pci = _quiet(nvml, nvml.nvmlDeviceGetPciInfo, handle)
    capability = _quiet(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    uuid = _quiet(nvml, nvml.nvmlDeviceGetUUID, handle)
    return {
        "name": _text(nvml.nvmlDeviceGetName(handle)),
        "uuid": _text(uuid) if uuid is not None else None,
        "pci_bus_id": _text(pci.busId) if pci is not None else None,
        "memory_bytes": int(memory.total) if memory is not None else None,
        "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
    }


def _gpu_links(nvml: Any, handle: Any) -> dict[str, Any]:
    active = supported = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _quiet(nvml, nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break
        supported += 1
        active += int(bool(state))
    return {
        "pcie_gen": {"current": _quiet(nvml, nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                     "max": _quiet(nvml, nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)},
        "pcie_width": {"current": _quiet(nvml, nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
                       "max": _quiet(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)},
        "nvlink": {"active": active, "links": supported} if supported else None,
    }


def _gpu_health(nvml: Any, handle: Any) -> dict[str, Any]:
    reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = _quiet(nvml, reasons_fn, handle)
    mig = _quiet(nvml, nvml.nvmlDeviceGetMigMode, handle)
    persistence = _quiet(nvml, nvml.nvmlDeviceGetPersistenceMode, handle)
    return {
        "ecc": _ecc(nvml, handle),
        "throttle_reasons": [name for bit, name in THROTTLE_REASONS.items() if mask and mask & bit],
        "persistence_mode": bool(persistence) if persistence is not None else None,
        "mig": {"current": bool(mig[0]), "pending": bool(mig[1])} if mig else None,
    }


def _ecc(nvml: Any, handle: Any) -> dict[str, Any] | None:
    mode = _quiet(nvml, nvml.nvmlDeviceGetEccMode, handle)
    if mode is None:
        return None
    counts = {"enabled": bool(mode[0])}
    uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    corrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    volatile, aggregate = getattr(nvml, "NVML_VOLATILE_ECC", 0), getattr(nvml, "NVML_AGGREGATE_ECC", 1)
    for key, kind, counter in (("volatile_uncorrected", uncorrected, volatile),
                               ("aggregate_uncorrected", uncorrected, aggregate),
                               ("volatile_corrected", corrected, volatile)):
        counts[key] = _quiet(nvml, nvml.nvmlDeviceGetTotalEccErrors, handle, kind, counter)
    return counts


def _nvml_topology(nvml: Any, handles: dict[int, Any]) -> dict[str, Any] | None:
    """GPU-to-GPU paths in `nvidia-smi topo -m` terms: NV (NVLink), PIX, PXB, PHB, NODE, SYS."""
    indices = sorted(handles)
    if len(indices) < 2:
        return None
    nvlink_cap = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    matrix = []
    for i in indices:
        row = []
        for j in indices:
            if i == j:
                row.append("X")
                continue
            status = _quiet(nvml, nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], nvlink_cap)
            if status == ok:
                row.append("NV")
                continue
            level = _quiet(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
            row.append(TOPOLOGY_LABELS.get(level, "?") if level is not None else "?")
        matrix.append(row)
    return {"labels": [f"GPU{i}" for i in indices], "matrix": matrix}


def start_nvidia_smi_topo() -> subprocess.Popen | None:
    """Start `nvidia-smi topo -m` in the background (None without nvidia-smi); see finish_topology."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return None
    try:
        return subprocess.Popen([path, "topo", "-m"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError:
        return None


def finish_topology(facts: dict[str, Any], smi: subprocess.Popen | None) -> dict[str, Any] | None:
    """The topology: NVML's matrix and, when nvidia-smi exists, its `topo -m` text."""
    topology = facts.pop("nvml_topology", None)
    text = None
    if smi is not None:
        try:
            text, _ = smi.communicate(timeout=NVIDIA_SMI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            smi.kill()
            smi.communicate()
            text = f"(nvidia-smi topo -m gave no answer within {NVIDIA_SMI_TIMEOUT_S:g} s)"
    if topology is None and not text:
        return None
    return {**(topology or {}), "nvidia_smi": text}
