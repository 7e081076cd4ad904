"""Rules that turn facts into findings. Each rule is a pure function of the facts dict.

A finding has a stable ``code``, a ``severity`` (error | warning | info), a one-line ``title``, the
``evidence`` from the facts, the ``fix`` and the ``source`` it rests on. Rules read facts through
``get`` so that facts from another machine (or an older schema) never crash them; a rule that fails
anyway yields an ``AUDIT_RULE_FAILED`` finding instead of an exception.

A rule is declared once, with its code: ``@rule("CODE")`` over ``def rule_x(facts, found)``, whose
findings come from ``found(severity, title, evidence, fix, source)``. ``RULES`` and ``CODES`` are
read off that registry, so a rule can neither miss its code nor report another one.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from helpers.audit.mpi import hostfile_from_config

SEVERITIES = ("error", "warning", "info")
MIB = 1024 * 1024
SHM_MIN_BYTES = 512 * MIB
RTX40_MIN_DRIVER = "550.40.07"
# the oldest Linux driver of each CUDA major version (NVIDIA CUDA Toolkit release notes, table 2)
CUDA_MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
NCCL_P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
HARD_THROTTLE = ("HwSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown", "SwThermalSlowdown")

SRC_KERNEL = ("accelerate utils/other.py check_os_kernel (warning added for accelerate issue 1929; "
              "the commit says the cause is unclear)")
SRC_CUDA_COMPAT = ("NVIDIA CUDA Compatibility guide, 'Minor Version Compatibility' "
                   "(docs.nvidia.com/deploy/cuda-compatibility)")
SRC_VISIBLE = ("torch/cuda/__init__.py _parse_visible_devices (mirrors the CUDA driver's parsing); "
               "NVIDIA CUDA Programming Guide, 'CUDA Environment Variables'")
SRC_NCCL_ENV = "NCCL User Guide, 'Environment Variables' (docs.nvidia.com/deeplearning/nccl)"
SRC_NVML = "NVML API reference (docs.nvidia.com/deploy/nvml-api)"


@dataclass
class Finding:
    """One verdict about the facts."""

    code: str
    severity: str
    title: str
    evidence: str
    fix: str
    source: str


# ---------------------------------------------------------------------------------------------
# the registry: a rule and its code are declared once, with @rule("CODE")

UNKNOWN_FIX = ("Not judged: run `python -m helpers audit` on that machine itself (or add the "
               "missing output to --facts) to judge it.")
UNKNOWN_SOURCE = "helpers.audit.rules (a fact missing from the facts is unknown, never guessed)"


class Found:
    """What a rule's body calls to build a finding: ``found(severity, title, evidence, fix,
    source)``, or ``found.unknown(what, *facts)`` when facts it needs are missing (an info
    finding whose title starts with "Unknown:", instead of a verdict)."""

    def __init__(self, code: str):
        self.code = code

    def __call__(self, severity: str, title: str, evidence: str, fix: str, source: str) -> Finding:
        return Finding(self.code, severity, title, evidence, fix, source)

    def unknown(self, what: str, *missing_facts: str) -> Finding:
        return Finding(self.code, "info", f"Unknown: {what}",
                       f"not in the facts: {', '.join(missing_facts)}", UNKNOWN_FIX, UNKNOWN_SOURCE)


def is_unknown(finding: Finding | dict[str, Any]) -> bool:
    """Whether a finding says "unknown" rather than judging (see ``Found.unknown``)."""
    title = finding.get("title", "") if isinstance(finding, dict) else finding.title
    return str(title).startswith("Unknown: ")


Check = Callable[[dict[str, Any], Found], list[Finding]]
Rule = Callable[[dict[str, Any]], list[Finding]]
REGISTRY: dict[str, Rule] = {}  # code -> rule, in the order the rules are declared


def rule(code: str) -> Callable[[Check], Rule]:
    """Register a rule under its stable ``code``, the only place that code is spelled.

    The decorated ``check(facts, found)`` builds its findings with ``found(severity, title,
    evidence, fix, source)``, which fills in ``code``; the decorator returns the rule as callers
    use it, ``rule_x(facts) -> list[Finding]``. A code registered twice raises ValueError.
    """
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", code):
        raise ValueError(f"rule code must be UPPER_SNAKE_CASE; got {code!r}")
    if code in REGISTRY:
        raise ValueError(f"rule code {code} is already declared by {REGISTRY[code].__name__}")

    def register(check: Check) -> Rule:
        found = Found(code)

        @functools.wraps(check)
        def judged(facts: dict[str, Any]) -> list[Finding]:
            return check(facts, found)

        REGISTRY[code] = judged
        return judged

    return register


class _Absent:
    """What ``lookup`` returns for a fact that is not there (None is a value: "none")."""


ABSENT = _Absent()


def lookup(facts: dict[str, Any], dotted: str) -> Any:
    """``facts['a']['b']`` for ``'a.b'``; ``ABSENT`` when any step is missing or not a dict."""
    value: Any = facts
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return ABSENT
        value = value[key]
    return value


def get(facts: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """``facts['a']['b']`` for ``'a.b'``; ``default`` when any step is missing or not a dict."""
    value = lookup(facts, dotted)
    return default if value is ABSENT or value is None else value


def known(facts: dict[str, Any], dotted: str) -> bool:
    """Whether the facts hold ``dotted`` at all (a value of None is known: "none").

    ``gpus[].key``: every GPU holds ``key`` (true for an empty list); false when ``gpus`` is missing.
    """
    if "[]." in dotted:
        head, _, key = dotted.partition("[].")
        if not known(facts, head):
            return False
        items = get(facts, head, [])
        return all(key in item for item in items if isinstance(item, dict))
    return lookup(facts, dotted) is not ABSENT


def missing(facts: dict[str, Any], *dotted: str) -> list[str]:
    """The facts among ``dotted`` that ``facts`` does not hold (see ``known``)."""
    return [name for name in dotted if not known(facts, name)]


def parse_version(text: Any) -> tuple[int, ...] | None:
    """'550.40.07' -> (550, 40, 7); '12.4' -> (12, 4); None for anything else."""
    if not isinstance(text, str):
        return None
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def _gpus(facts: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = get(facts, "gpus", [])
    return [gpu for gpu in gpus if isinstance(gpu, dict)] if isinstance(gpus, list) else []


# ---------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES, parsed as the CUDA driver does (torch mirrors it)


@dataclass
class Visibility:
    """Which GPUs a CUDA_VISIBLE_DEVICES value leaves visible, and what is wrong with it."""

    indices: list[int]
    problems: list[str]
    severity: str | None = None


def visible_devices(value: str | None, gpus: list[dict[str, Any]]) -> Visibility:
    """GPUs visible under ``CUDA_VISIBLE_DEVICES=value`` (None: unset) on a machine with ``gpus``.

    Rules as torch's ``_parse_visible_devices``: entries are read in order; a repeated entry hides
    every GPU; an entry that is not a valid index (or UUID, when the list starts with UUIDs) ends
    the list, and entries after it are ignored; an index past the last GPU ends it too.
    """
    count = len(gpus)
    if value is None:
        return Visibility(list(range(count)), [])
    entries = [entry.strip() for entry in value.split(",")]
    if value.strip() == "":
        return Visibility([], ["CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible"],
                          "warning" if count else None)
    uuid_form = entries[0].startswith(("GPU-", "MIG-"))
    chosen: list[Any] = []
    for position, entry in enumerate(entries):
        key = entry if uuid_form else _strtoul(entry)
        if key in chosen:
            return Visibility([], [f"{entry!r} appears twice: the driver then shows no GPU at all"],
                              "error")
        stop = _entry_problem(entry, key, uuid_form, gpus)
        if stop:
            ignored = entries[position + 1:]
            tail = f"; ignored after it: {','.join(ignored)}" if ignored else ""
            return Visibility(_resolve(chosen, uuid_form, gpus), [stop + tail], "error")
        chosen.append(key)
    return Visibility(_resolve(chosen, uuid_form, gpus), [])


def _strtoul(text: str) -> int:
    match = re.match(r"[+]?\d+", text)
    return int(match.group(0)) if match else -1


def _entry_problem(entry: str, key: Any, uuid_form: bool, gpus: list[dict[str, Any]]) -> str | None:
    if uuid_form:
        if not entry.startswith(("GPU-", "MIG-")):
            return f"{entry!r} mixes an index into a list of UUIDs: the list ends there"
        if entry.startswith("GPU-") and gpus and not _uuid_matches(entry, gpus):
            return f"{entry!r} matches no GPU here: the list ends there"
        return None
    if key < 0:
        kind = "a UUID in a list of indices" if entry.startswith(("GPU-", "MIG-")) else "not an index"
        return f"{entry!r} is {kind}: the list ends there"
    if gpus and key >= len(gpus):
        return f"index {key} is out of range (this machine has {len(gpus)} GPUs): the list ends there"
    return None


def _uuid_matches(entry: str, gpus: list[dict[str, Any]]) -> list[int]:
    return [g["index"] for g in gpus if isinstance(g.get("uuid"), str) and g["uuid"].startswith(entry)]


def _resolve(chosen: list[Any], uuid_form: bool, gpus: list[dict[str, Any]]) -> list[int]:
    if not uuid_form:
        return [int(k) for k in chosen]
    found: list[int] = []
    for entry in chosen:
        matches = _uuid_matches(entry, gpus)
        found += matches[:1]
    return found


def visible_gpus(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPUs that CUDA programs on this machine see, after CUDA_VISIBLE_DEVICES."""
    gpus = _gpus(facts)
    by_index = {gpu.get("index"): gpu for gpu in gpus}
    env = get(facts, "env", {})
    indices = visible_devices(env.get("CUDA_VISIBLE_DEVICES"), gpus).indices
    return [by_index[i] for i in indices if i in by_index]


# ---------------------------------------------------------------------------------------------
# the rules


@rule("KERNEL_BELOW_5_5")
def rule_kernel(facts: dict[str, Any], found: Found) -> list[Finding]:
    """Accelerate warns below 5.5 because hangs were reported there."""
    lacking = missing(facts, "os.system", "os.kernel")
    if "os.system" in lacking or (get(facts, "os.system") == "Linux" and lacking):
        return [found.unknown("whether the Linux kernel is below 5.5", *lacking)]
    release = get(facts, "os.kernel", "")
    version = parse_version(release)
    if get(facts, "os.system") != "Linux" or version is None or version[:3] >= (5, 5, 0):
        return []
    gvisor = bool(get(facts, "os.gvisor", False))
    container = bool(get(facts, "os.container.any", False))
    where = (" This is gVisor's fixed kernel number, not a real kernel." if gvisor else
             " In a container this is the host's kernel." if container else "")
    return [found(
        "info" if gvisor else "warning",
        f"Linux kernel {release} is below 5.5, where accelerate warns that processes can hang",
        f"kernel release {release!r}.{where}",
        "Hangs were reported on kernels below 5.5; the cause is unknown. If runs hang, try "
        "NCCL_SHM_DISABLE=1, then NCCL_P2P_DISABLE=1, to narrow it down, and upgrade the (host) "
        "kernel where you can.",
        SRC_KERNEL)]


@rule("TORCH_CUDA_DRIVER_MISMATCH")
def rule_torch_driver(facts: dict[str, Any], found: Found) -> list[Finding]:
    """The driver supports an older CUDA than torch was built with."""
    built, supported = get(facts, "torch.cuda"), get(facts, "driver.cuda")
    built_v, supported_v = parse_version(built), parse_version(supported)
    if not known(facts, "torch.cuda") and (_gpus(facts) or get(facts, "driver.version")):
        return [found.unknown("whether the driver supports torch's CUDA version", "torch.cuda")]
    if built_v and not known(facts, "driver.cuda"):
        return _driver_major_only(facts, found, built, built_v)
    if not built_v or not supported_v or supported_v[:2] >= built_v[:2]:
        return []
    evidence = (f"torch {get(facts, 'torch.version', '?')} is built for CUDA {built}; driver "
                f"{get(facts, 'driver.version', '?')} supports CUDA up to {supported}")
    if supported_v[0] < built_v[0]:
        return [found(
            "error",
            f"The NVIDIA driver is too old for torch's CUDA {built} build",
            evidence + " (a different major version: CUDA will not initialise)",
            f"Install a torch build for CUDA {supported_v[0]}.x (pytorch.org, 'Get started', pick "
            f"the CUDA version) or upgrade the driver to one supporting CUDA {built}.",
            SRC_CUDA_COMPAT)]
    return [found(
        "warning",
        f"The driver supports CUDA {supported}, older than torch's CUDA {built} build",
        evidence + " (same major version: runs through minor version compatibility, with a "
        "limited feature set)",
        "Usually works; if kernels fail to load (PTX errors), upgrade the driver or install a torch "
        f"build for CUDA {supported} or older.",
        SRC_CUDA_COMPAT)]


def _driver_major_only(facts: dict[str, Any], found: Found, built: str,
                       built_v: tuple[int, ...]) -> list[Finding]:
    """Judge by the driver's version when its CUDA version is not in the facts (collect_env)."""
    driver = get(facts, "driver.version")
    driver_v, minimum = parse_version(driver), CUDA_MIN_DRIVER.get(built_v[0])
    if not known(facts, "driver.version"):
        return [found.unknown("whether the driver supports torch's CUDA version",
                              "driver.cuda", "driver.version")] if _gpus(facts) else []
    if driver_v is None or minimum is None:
        return []
    if driver_v < parse_version(minimum):
        return [found(
            "error", f"The NVIDIA driver is too old for torch's CUDA {built} build",
            f"torch {get(facts, 'torch.version', '?')} is built for CUDA {built}; driver {driver} "
            f"is older than {minimum}, the first to support CUDA {built_v[0]}.x",
            f"Install a torch build for an older CUDA (pytorch.org, 'Get started') or upgrade the "
            f"driver to {minimum} or newer.", SRC_CUDA_COMPAT + ", minimum driver versions")]
    return [found.unknown(f"which CUDA {built_v[0]}.x driver {driver} supports (its major version "
                          f"fits torch's CUDA {built})", "driver.cuda")]


@rule("TORCH_CPU_BUILD_WITH_GPUS")
def rule_cpu_build(facts: dict[str, Any], found: Found) -> list[Finding]:
    """A CPU-only torch on a machine with NVIDIA GPUs."""
    gpus = _gpus(facts)
    version = get(facts, "torch.version")
    if gpus and version and missing(facts, "torch.cuda"):
        return [found.unknown("whether torch is a CPU-only build", "torch.cuda")]
    if not gpus or not version or get(facts, "torch.cuda") or get(facts, "torch.hip"):
        return []
    return [found(
        "error",
        f"torch {version} is a CPU-only build, but this machine has {len(gpus)} NVIDIA GPU(s)",
        f"torch.version.cuda is None; NVML lists {len(gpus)} GPU(s), driver "
        f"{get(facts, 'driver.version', '?')} (CUDA {get(facts, 'driver.cuda', '?')})",
        "Install a CUDA build of torch that the driver supports (pytorch.org, 'Get started'); "
        "`pip install torch` from a CPU index or a CPU wheel never uses the GPUs.",
        "torch.version.cuda; pytorch.org/get-started")]


@rule("CUDA_VISIBLE_DEVICES_INVALID")
def rule_visible_devices(facts: dict[str, Any], found: Found) -> list[Finding]:
    """Duplicates, out of range, mixed forms, unknown UUIDs, empty."""
    if not known(facts, "env"):
        return [found.unknown("whether CUDA_VISIBLE_DEVICES selects what it seems to", "env")] \
            if _gpus(facts) else []
    value = get(facts, "env", {}).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return []
    gpus = _gpus(facts)
    result = visible_devices(value, gpus)
    if not result.problems or result.severity is None:
        return []
    shown = ", ".join(f"GPU{i}" for i in result.indices) or "none"
    return [found(
        result.severity,
        f"CUDA_VISIBLE_DEVICES={value!r} does not select what it seems to",
        f"{'; '.join(result.problems)}. GPUs visible: {shown} (of {len(gpus)})",
        "Use one form (indices like 0,1 or full UUIDs from `nvidia-smi -L`), each GPU once, only "
        "GPUs that exist; unset it to see every GPU.",
        SRC_VISIBLE)]


@rule("CUDA_INITIALIZED_BEFORE_LAUNCH")
def rule_cuda_initialized(facts: dict[str, Any], found: Found) -> list[Finding]:
    """CUDA already initialised where ranks are about to be forked."""
    # about the auditing process itself: facts from a file or a paste describe no such process,
    # so a missing value is no verdict either way
    if not get(facts, "torch.initialized_here", False):
        return []
    site = get(facts, "torch.init_site") or "a call that could not be traced"
    return [found(
        "error",
        "CUDA is already initialised in this process: forked ranks (notebook_launcher) will fail",
        f"torch.cuda.is_initialized() is True here; first initialised by {site}",
        "Restart the kernel and keep torch.cuda.*, .cuda() and .to('cuda') inside the function you "
        "launch; nothing may touch CUDA before notebook_launcher forks.",
        "accelerate launchers.py notebook_launcher (forks); torch: CUDA cannot be re-initialised "
        "in a forked subprocess")]


@rule("MIXED_GPU_MODELS")
def rule_mixed_models(facts: dict[str, Any], found: Found) -> list[Finding]:
    """More than one GPU model among the visible GPUs."""
    if missing(facts, "gpus[].name") and _gpus(facts):
        return [found.unknown("whether the GPUs are of one model", "gpus[].name")]
    models = Counter(gpu.get("name") or "?" for gpu in visible_gpus(facts))
    if len(models) < 2:
        return []
    listing = ", ".join(f"{count} x {name}" for name, count in models.most_common())
    return [found(
        "warning", f"{len(models)} different GPU models are visible",
        listing,
        "Data-parallel ranks wait for each other at every gradient all-reduce, so the slowest GPU "
        "sets the pace and the smallest memory sets the batch size; select one model with "
        "CUDA_VISIBLE_DEVICES.",
        "torch DistributedDataParallel docs (synchronous all-reduce in backward)")]


@rule("SHM_TOO_SMALL")
def rule_shm(facts: dict[str, Any], found: Found) -> list[Finding]:
    """/dev/shm below 512 MiB (Docker's default is 64 MB)."""
    if not known(facts, "os.shm_bytes"):
        return [found.unknown("the size of /dev/shm", "os.shm_bytes")]
    size = get(facts, "os.shm_bytes")
    if not isinstance(size, int) or size >= SHM_MIN_BYTES:
        return []
    return [found(
        "warning", f"/dev/shm is {size / MIB:.0f} MiB, below 512 MiB",
        f"/dev/shm size {size} bytes"
        + (" (inside a container)" if get(facts, "os.container.any", False) else ""),
        "NCCL and DataLoader workers use shared memory; start the container with --shm-size=8g "
        "(or --ipc=host), or remount /dev/shm larger.",
        "DeepSpeed ds_report (warns under 512 MiB); Docker's default shm size is 64 MB; "
        "NCCL User Guide, 'Troubleshooting: Docker'")]


@rule("NCCL_ENV_SUSPICIOUS")
def rule_nccl_env(facts: dict[str, Any], found: Found) -> list[Finding]:
    """P2P/IB/SHM disabled, bad NCCL_P2P_LEVEL, missing socket interfaces."""
    if not known(facts, "env"):
        return [found.unknown("the NCCL variables", "env")]
    env = get(facts, "env", {})
    findings = []
    rtx40_expected = bool(_rtx40_old_driver(facts))
    if env.get("NCCL_P2P_DISABLE") == "1" and not rtx40_expected:
        nvlink = any((gpu.get("nvlink") or {}).get("active") for gpu in _gpus(facts))
        findings.append(_nccl(found,
            "warning", "NCCL_P2P_DISABLE=1: GPU-to-GPU transfers go through host memory",
            "NCCL_P2P_DISABLE=1" + (" on GPUs with active NVLink" if nvlink else ""),
            "Expect much lower intra-node bandwidth. Unset it unless it works around a hang you "
            "have confirmed (then say why next to where it is set)."))
    if env.get("NCCL_IB_DISABLE") == "1" and not rtx40_expected:
        ib = get(facts, "network.infiniband", [])
        findings.append(_nccl(found,
            "warning" if ib else "info",
            "NCCL_IB_DISABLE=1: inter-node traffic uses TCP sockets, not InfiniBand/RoCE",
            f"NCCL_IB_DISABLE=1; InfiniBand devices here: {', '.join(ib) or 'none'}",
            "Unset it on clusters with InfiniBand/RoCE; keep it only while diagnosing."))
    if env.get("NCCL_SHM_DISABLE") == "1":
        findings.append(_nccl(found,
            "info", "NCCL_SHM_DISABLE=1: the shared-memory transport is off",
            "NCCL_SHM_DISABLE=1", "Fine while narrowing down a hang; unset it afterwards."))
    level = env.get("NCCL_P2P_LEVEL")
    if level is not None and level.upper() not in NCCL_P2P_LEVELS and not re.fullmatch(r"[0-5]", level):
        findings.append(_nccl(found,
            "warning", f"NCCL_P2P_LEVEL={level!r} is not a level NCCL knows",
            f"NCCL_P2P_LEVEL={level!r}; accepted: {', '.join(NCCL_P2P_LEVELS)}",
            "Use one of LOC, NVL, PIX, PXB, PHB, SYS, or unset it and let NCCL choose."))
    interfaces = get(facts, "network.interfaces", [])
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        missing = _missing_interfaces(env.get(name), interfaces)
        if missing:
            findings.append(_nccl(found,
                "error", f"{name}={env[name]!r} names no interface of this machine",
                f"{name}={env[name]!r}; interfaces here: {', '.join(interfaces) or 'none'}",
                f"Set {name} to an interface listed by `ip -br link` (a prefix such as eth matches "
                "eth0, eth1; '=' means the exact name), or unset it."))
    return findings


def _nccl(found: Found, severity: str, title: str, evidence: str, fix: str) -> Finding:
    return found(severity, title, evidence, fix, SRC_NCCL_ENV)


def _missing_interfaces(value: str | None, interfaces: list[str]) -> bool:
    """True when an include-list of interface prefixes matches none of ``interfaces``."""
    if not value or not interfaces or value.startswith("^"):
        return False  # unset, unknown interfaces, or an exclude list
    exact = value.startswith("=")
    names = [n.strip() for n in value.lstrip("=").split(",") if n.strip()]
    match = (lambda n, i: n == i) if exact else (lambda n, i: i.startswith(n))
    return not any(match(n, i) for n in names for i in interfaces)


def _rtx40_old_driver(facts: dict[str, Any]) -> list[str]:
    gpus = visible_gpus(facts)
    names = [gpu.get("name") or "" for gpu in gpus]
    driver = parse_version(get(facts, "driver.version"))
    if len(gpus) < 2 or driver is None or not any("RTX 40" in n for n in names):
        return []
    return names if driver < parse_version(RTX40_MIN_DRIVER) else []


FR_DUMP_FILES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # the older name second
FR_SIZES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
SRC_FR = ("torch ProcessGroupNCCL.hpp (TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE, "
          "TORCH_NCCL_DEBUG_INFO_PIPE_FILE); nvidia-resiliency-ext release notes "
          "(TORCH_INCLUDE_STACK_TRACE=0)")


@rule("NO_FLIGHT_RECORDER_DUMP")
def rule_flight_recorder_dump(facts: dict[str, Any], found: Found) -> list[Finding]:
    """On a GPU machine: the next NCCL timeout would leave no Flight Recorder dump where it can be read."""
    if not visible_gpus(facts):
        return []
    if not known(facts, "env"):
        return [found.unknown("the Flight Recorder variables", "env")]
    env = get(facts, "env", {})
    size = next((env[name] for name in FR_SIZES if name in env), None)
    missing = []
    if size == "0":
        missing.append(f"{next(n for n in FR_SIZES if n in env)}=0 turns the Flight Recorder off")
    if str(env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "")).lower() not in ("1", "true"):
        missing.append("TORCH_NCCL_DUMP_ON_TIMEOUT is not set to 1 (set it: its default is not the "
                       "same in every torch version)")
    if not any(env.get(name) for name in FR_DUMP_FILES):
        missing.append("TORCH_FR_DUMP_TEMP_FILE is not set (the dumps then go to each node's own /tmp)")
    if not missing:
        return []
    return [found(
        "info", "The next NCCL timeout would leave no Flight Recorder dump to read",
        "; ".join(missing),
        "Set, before the job starts (they are read when the process group is created): "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_FR_DUMP_TEMP_FILE=/shared/fr/rank_ on shared storage "
        "(one file per rank; `python -m helpers doctor --from-fr /shared/fr` names the rank, the "
        "collective and the line); TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/shared/fr/pipe_ lets you ask a "
        "live job for a dump by writing to <prefix><rank>.pipe; TORCH_INCLUDE_STACK_TRACE=0, because "
        "the watchdog takes Python stacks under the GIL and can deadlock when the training thread "
        "holds it (NVIDIA's production setting).",
        SRC_FR)]


@rule("RTX40_P2P_DRIVER")
def rule_rtx40(facts: dict[str, Any], found: Found) -> list[Finding]:
    """RTX 4000-series GPUs with a driver older than 550.40.07."""
    names = _rtx40_old_driver(facts)
    rtx40 = [g for g in visible_gpus(facts) if "RTX 40" in str(g.get("name"))]
    if not names and len(rtx40) >= 2 and not known(facts, "driver.version"):
        return [found.unknown("whether the driver is recent enough for RTX 4000-series P2P",
                              "driver.version")]
    if not names:
        return []
    env = get(facts, "env", {})
    both_set = env.get("NCCL_P2P_DISABLE") == "1" and env.get("NCCL_IB_DISABLE") == "1"
    shown = (f"NCCL_P2P_DISABLE={env.get('NCCL_P2P_DISABLE')!r}, "
             f"NCCL_IB_DISABLE={env.get('NCCL_IB_DISABLE')!r}" if known(facts, "env") else
             "NCCL_P2P_DISABLE and NCCL_IB_DISABLE unknown (the environment is not in the facts)")
    return [found(
        "info" if both_set else "warning",
        f"RTX 4000-series GPUs with driver {get(facts, 'driver.version')} (< {RTX40_MIN_DRIVER}): "
        "P2P and IB must be disabled",
        f"{len(names)} x {names[0]}; {shown}",
        "Upgrade the driver to 550.40.07 or newer. Otherwise `accelerate launch` and "
        "notebook_launcher set NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 for you; under plain "
        "torchrun set both yourself (Accelerator() refuses to start without them).",
        "accelerate utils/environment.py check_cuda_p2p_ib_support; accelerate state.py")]


@rule("ACCELERATE_CONFIG_MISMATCH")
def rule_accelerate_config(facts: dict[str, Any], found: Found) -> list[Finding]:
    """The accelerate config asks for what this machine lacks."""
    error = get(facts, "accelerate_config_error")
    path = get(facts, "accelerate_config_path", "the accelerate config")
    if error:
        return [found("warning",
                        "The accelerate config file cannot be read", f"{path}: {error}",
                        "Fix or recreate it with `accelerate config`; `accelerate launch` fails "
                        "on it too.", "accelerate commands/config/config_args.py")]
    if not known(facts, "accelerate_config"):
        return [found.unknown("whether the accelerate config fits this machine", "accelerate_config")]
    config = get(facts, "accelerate_config")
    if isinstance(config, dict) and not config.get("use_cpu") and missing(facts, "gpus"):
        return [found.unknown("whether the accelerate config fits the GPUs", "gpus")]
    if not isinstance(config, dict) or not _gpus(facts) or config.get("use_cpu"):
        return []
    if not known(facts, "env"):
        evidence_note = " (CUDA_VISIBLE_DEVICES unknown: every listed GPU counted as visible)"
    else:
        evidence_note = ""
    return [found(severity, title, f"{path}: {evidence}{evidence_note}", fix,
                    "accelerate commands/config/config_args.py; torch.cuda.is_bf16_supported "
                    "(compute capability 8.0+)")
            for severity, title, evidence, fix in _config_problems(config, visible_gpus(facts))]


def _config_problems(config: dict[str, Any], gpus: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    problems = []
    kind = str(config.get("distributed_type", ""))
    machines = max(1, _int(config.get("num_machines"), 1))
    processes = _int(config.get("num_processes"), 1)
    per_machine = -(-processes // machines)
    multi = kind in ("MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM")
    if multi and per_machine > len(gpus):
        problems.append(("error", f"num_processes={processes} needs {per_machine} GPUs per machine; "
                         f"{len(gpus)} visible", f"distributed_type={kind}, num_processes="
                         f"{processes}, num_machines={machines}",
                         "Lower num_processes to the number of visible GPUs (accelerate config, or "
                         "--num_processes), or make more GPUs visible."))
    if kind == "MULTI_GPU" and len(gpus) == 1:
        problems.append(("warning", "distributed_type is MULTI_GPU but one GPU is visible",
                         "distributed_type=MULTI_GPU with 1 visible GPU",
                         "Choose 'No distributed training' in `accelerate config` for one GPU."))
    if str(config.get("mixed_precision", "")).lower() == "bf16":
        old = [g for g in gpus if (parse_version(g.get("compute_capability")) or (99,)) < (8, 0)]
        if old:
            problems.append(("error", "mixed_precision is bf16 but some GPUs have no bf16 support",
                             ", ".join(f"GPU{g.get('index')} {g.get('name')} (compute "
                                       f"{g.get('compute_capability')})" for g in old),
                             "Use mixed_precision: fp16 on GPUs before compute capability 8.0 "
                             "(V100, T4), or bf16 only on Ampere and newer."))
    return problems


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


@rule("PORT_IN_USE")
def rule_port(facts: dict[str, Any], found: Found) -> list[Finding]:
    """The rendezvous port (MASTER_PORT or 29500) is taken."""
    if not known(facts, "network.rendezvous_port"):
        return [found.unknown("whether the rendezvous port is free", "network.rendezvous_port")]
    port = get(facts, "network.rendezvous_port", {})
    if port.get("free") is not False:
        return []
    holder = port.get("holder") or "a process this audit cannot see"
    return [found(
        "warning", f"Rendezvous port {port.get('port')} is already in use",
        f"port {port.get('port')} ({port.get('source')}) is held by {holder}",
        "Another run (or a stale one) holds it: stop it, or give this run another port "
        "(accelerate launch --main_process_port, torchrun --master-port, or MASTER_PORT).",
        "torch distributed run.py (--master-port defaults to 29500)")]


@rule("OMP_THREADS_OVERSUBSCRIBED")
def rule_omp(facts: dict[str, Any], found: Found) -> list[Finding]:
    """OMP_NUM_THREADS x local ranks exceeds the usable CPUs."""
    if not known(facts, "env"):
        return [found.unknown("whether OMP_NUM_THREADS oversubscribes the CPUs", "env")]
    env = get(facts, "env", {})
    value = env.get("OMP_NUM_THREADS")
    if value is None:
        return []
    cpus = _int(get(facts, "cpu_count"), 0)
    if not value.strip().isdigit() or int(value) < 1:
        return [found("warning",
                        f"OMP_NUM_THREADS={value!r} is not a positive integer",
                        f"OMP_NUM_THREADS={value!r}", "Set it to a whole number such as 1 or "
                        "(CPUs / ranks per machine).", "OpenMP specification, OMP_NUM_THREADS")]
    ranks, why = _local_ranks(facts)
    threads = int(value)
    if not cpus or threads * ranks <= cpus:
        return []
    return [found(
        "warning",
        f"{ranks} ranks x OMP_NUM_THREADS={threads} = {threads * ranks} threads on {cpus} CPUs",
        f"OMP_NUM_THREADS={threads}; {ranks} local ranks ({why}); {cpus} usable CPUs",
        f"Set OMP_NUM_THREADS to at most {max(1, cpus // ranks)} (CPUs / ranks per machine); "
        "oversubscribed threads make every rank slower and stretch collectives.",
        "torch distributed run.py (sets OMP_NUM_THREADS=1 for several ranks when unset)")]


def _local_ranks(facts: dict[str, Any]) -> tuple[int, str]:
    env = get(facts, "env", {})
    if _int(env.get("LOCAL_WORLD_SIZE"), 0) > 0:
        return int(env["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    config = get(facts, "accelerate_config", {})
    if isinstance(config, dict) and _int(config.get("num_processes"), 0) > 0:
        machines = max(1, _int(config.get("num_machines"), 1))
        return -(-int(config["num_processes"]) // machines), "accelerate config num_processes"
    visible = len(visible_gpus(facts))
    return (visible, "one per visible GPU") if visible else (1, "one rank")


@rule("PCIE_LINK_DEGRADED")
def rule_pcie(facts: dict[str, Any], found: Found) -> list[Finding]:
    """A link narrower than its maximum (or slower: maybe idle power saving)."""
    lacking = missing(facts, "gpus[].pcie_width", "gpus[].pcie_gen")
    if lacking and _gpus(facts):
        return [found.unknown("the GPUs' PCIe links", *lacking)]
    findings = []
    for gpu in _gpus(facts):
        width, gen = gpu.get("pcie_width") or {}, gpu.get("pcie_gen") or {}
        name = f"GPU{gpu.get('index')} ({gpu.get('name')})"
        if _below(width):
            findings.append(found(
                "warning",
                f"{name} runs its PCIe link at x{width['current']} of x{width['max']}",
                f"PCIe width current x{width['current']}, max x{width['max']}; generation "
                f"{gen.get('current')} of {gen.get('max')}",
                "A narrower link cuts host<->GPU and PCIe P2P bandwidth: reseat the card or riser, "
                "check the slot's wiring and BIOS lane settings.", SRC_NVML
                + " nvmlDeviceGetCurrPcieLinkWidth"))
        elif _below(gen):
            findings.append(found(
                "info",
                f"{name} runs PCIe generation {gen['current']} of {gen['max']}",
                f"PCIe generation current {gen['current']}, max {gen['max']}",
                "GPUs lower the link generation when idle to save power; check again under load "
                "(nvidia-smi -q -d PCIE). If it stays low under load, check slot and BIOS.",
                "nvidia-smi(1), 'GPU Link Info' (current values may be reduced when the GPU is "
                "not in use)"))
    return findings


def _below(link: dict[str, Any]) -> bool:
    current, maximum = link.get("current"), link.get("max")
    return isinstance(current, int) and isinstance(maximum, int) and 0 < current < maximum


@rule("GPU_THROTTLED")
def rule_throttle(facts: dict[str, Any], found: Found) -> list[Finding]:
    """Clocks held down by hardware slowdown, thermal limits or power brake."""
    if missing(facts, "gpus[].throttle_reasons") and _gpus(facts):
        return [found.unknown("whether the GPUs are throttled", "gpus[].throttle_reasons")]
    findings = []
    for gpu in _gpus(facts):
        reasons = [r for r in gpu.get("throttle_reasons") or [] if r in HARD_THROTTLE]
        if reasons:
            findings.append(found(
                "warning",
                f"GPU{gpu.get('index')} ({gpu.get('name')}) is throttled: {', '.join(reasons)}",
                f"NVML clock event reasons: {', '.join(gpu.get('throttle_reasons'))}",
                "Check cooling and power (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER); one "
                "slow GPU stalls every rank at each collective.",
                SRC_NVML + " nvmlDeviceGetCurrentClocksEventReasons"))
    return findings


@rule("ECC_ERRORS")
def rule_ecc(facts: dict[str, Any], found: Found) -> list[Finding]:
    """Uncorrectable memory errors (since boot: error; ever: warning)."""
    if missing(facts, "gpus[].ecc") and _gpus(facts):
        return [found.unknown("the GPUs' ECC error counts", "gpus[].ecc")]
    findings = []
    for gpu in _gpus(facts):
        ecc = gpu.get("ecc") or {}
        volatile = _int(ecc.get("volatile_uncorrected"), 0)
        aggregate = _int(ecc.get("aggregate_uncorrected"), 0)
        if not volatile and not aggregate:
            continue
        findings.append(found(
            "error" if volatile else "warning",
            f"GPU{gpu.get('index')} ({gpu.get('name')}) has uncorrectable ECC memory errors",
            f"uncorrected ECC errors: {volatile} since the driver loaded, {aggregate} over the "
            f"GPU's lifetime; corrected since load: {ecc.get('volatile_corrected')}",
            "Uncorrectable errors crash or corrupt runs: drain the GPU, check `nvidia-smi -q -d "
            "ECC,PAGE_RETIREMENT` and dmesg for Xid 48/63/64, reset or replace it.",
            SRC_NVML + " nvmlDeviceGetTotalEccErrors"))
    return findings


@rule("GPU_QUERY_FAILED")
def rule_gpu_errors(facts: dict[str, Any], found: Found) -> list[Finding]:
    """NVML could not query a GPU (e.g. 'GPU is lost')."""
    if missing(facts, "gpus[].error") and _gpus(facts):
        return [found.unknown("whether every GPU answers NVML queries", "gpus[].error")]
    return [found(
        "error", f"GPU{gpu.get('index')} could not be queried: {gpu['error']}",
        f"NVML, GPU index {gpu.get('index')}: {gpu['error']}",
        "A lost GPU fails every job scheduled on it: check dmesg for Xid errors (79: fallen off the "
        "bus) and have the node drained and the GPU reset or replaced.", SRC_NVML)
        for gpu in _gpus(facts) if gpu.get("error")]


@rule("NVML_UNAVAILABLE")
def rule_nvml(facts: dict[str, Any], found: Found) -> list[Finding]:
    """NVML could not be used (no driver, no pynvml, driver not loaded)."""
    if not known(facts, "driver.error") and not get(facts, "driver.version"):
        return [found.unknown("whether NVML (the driver's library) works", "driver.error")]
    error = get(facts, "driver.error")
    if not error:
        return []
    hints = get(facts, "driver.device_nodes", []) or get(facts, "torch.cuda_available", False)
    missing_module = "not installed" in error
    if not hints and not missing_module:
        return []  # a machine without NVIDIA GPUs: NO_GPU says so
    return [found(
        "warning",
        "GPU facts unavailable: " + error,
        f"{error}; /dev/nvidia* nodes: {', '.join(hints) if isinstance(hints, list) and hints else 'none'}",
        "Install nvidia-ml-py (pip) to read GPU facts." if missing_module else
        "This machine shows signs of NVIDIA GPUs: check `nvidia-smi`, and that the driver is "
        "installed and loaded (lsmod | grep nvidia).", SRC_NVML + " nvmlInit")]


@rule("NO_GPU")
def rule_no_gpu(facts: dict[str, Any], found: Found) -> list[Finding]:
    """CPU-only; the distributed checks run on gloo."""
    if _gpus(facts) or get(facts, "torch.cuda_available", False):
        return []
    if not known(facts, "gpus"):
        return [found.unknown("whether this machine has NVIDIA GPUs", "gpus")]
    return [found(
        "info", "No NVIDIA GPU here: distributed checks run on CPU with gloo",
        f"NVML: {get(facts, 'driver.error') or 'no GPUs'}; torch.cuda.is_available() = "
        f"{get(facts, 'torch.cuda_available', False)}",
        "Nothing to fix for learning and CI: the notebooks reproduce hangs and OOMs on CPU ranks. "
        "Run this audit on the GPU machines themselves to judge them.",
        "helpers.launch.default_backend; torch.distributed (gloo runs on CPU)")]


@rule("TORCH_PROBE_FAILED")
def rule_torch_probe(facts: dict[str, Any], found: Found) -> list[Finding]:
    """Torch could not be imported (or CUDA hung) in the probe child."""
    if not known(facts, "torch.probe") and not get(facts, "torch.version"):
        return [found.unknown("whether torch imports", "torch.probe", "torch.version")]
    error = get(facts, "torch.probe.error")
    if not error:
        return []
    return [found(
        "error", "Importing torch (and asking CUDA) failed in a fresh process",
        error, "Run `python -c 'import torch; print(torch.cuda.is_available())'` to see the full "
        "error; reinstall torch for this Python, or look for a hung driver (nvidia-smi).",
        "helpers.audit.facts TORCH_PROBE")]


@rule("HOSTNAME_UNRESOLVED")
def rule_hostname(facts: dict[str, Any], found: Found) -> list[Finding]:
    """This machine's own name does not resolve."""
    if not known(facts, "network.hostname_resolves"):
        return [found.unknown("whether this machine's host name resolves",
                              "network.hostname_resolves")]
    if get(facts, "network.hostname_resolves", True) is not False:
        return []
    return [found(
        "warning", "This machine's host name does not resolve",
        f"getaddrinfo({get(facts, 'network.hostname')!r}): {get(facts, 'network.resolve_error')}",
        "Multi-node rendezvous advertises host names: add the name to /etc/hosts or DNS, or pass "
        "IP addresses (MASTER_ADDR, --rdzv-endpoint).",
        "torch elastic rendezvous docs (c10d endpoint host names)")]


SRC_MPI = ("accelerate troubleshooting guide, 'MPI' (passwordless SSH; the mpirun hostname sanity "
           "check); accelerate utils/launch.py _get_mpirun_args")


@rule("MPI_NOT_READY")
def rule_mpi(facts: dict[str, Any], found: Found) -> list[Finding]:
    """mpirun missing, the hostfile unreadable, hosts without passwordless SSH, a failed sanity run."""
    config = get(facts, "accelerate_config")
    wants = isinstance(config, dict) and (str(config.get("distributed_type")) == "MULTI_CPU" or
                                          bool(hostfile_from_config(config)))
    if not known(facts, "mpi"):
        return [found.unknown("whether MPI (mpirun, the hostfile, SSH) is ready", "mpi")] \
            if wants else []
    mpi = get(facts, "mpi")
    if not isinstance(mpi, dict):
        return []
    findings = []
    if not mpi.get("mpirun") and (wants or mpi.get("hostfile")):
        findings.append(found(
            "error", "mpirun (or mpiexec) is not on PATH",
            f"MPI is relevant here because {mpi.get('relevant')}; neither mpirun nor mpiexec found",
            "Install an MPI (Open MPI: apt-get install openmpi-bin; or Intel MPI / MPICH) on every "
            "host and put its bin folder on PATH; accelerate launch raises 'mpirun or mpiexec were "
            "not found' otherwise.", SRC_MPI))
    hostfile = mpi.get("hostfile") or {}
    if hostfile and hostfile.get("error"):
        findings.append(found(
            "error", f"The MPI hostfile {hostfile.get('path')} cannot be used",
            f"{hostfile.get('path')} ({hostfile.get('source')}): {hostfile.get('error')}",
            "Write one host per line (Open MPI: 'host slots=N'; Intel MPI / MPICH: 'host:N') and "
            "point mpirun_hostfile at it (accelerate config, or --mpirun_hostfile).", SRC_MPI))
    ssh = mpi.get("ssh") or {}
    failing = {host: r for host, r in ssh.items() if isinstance(r, dict) and not r.get("ok")}
    if failing:
        remote = [h for h, r in failing.items() if not r.get("local")]
        findings.append(found(
            "error" if remote else "warning",
            f"No passwordless SSH to {len(failing)} of {len(ssh)} host(s): "
            + ", ".join(failing),
            "; ".join(f"ssh -o BatchMode=yes {host} true: {r.get('error')}"
                      for host, r in failing.items()),
            "mpirun starts ranks on the other hosts over SSH and hangs or fails without it: "
            "ssh-keygen, then ssh-copy-id to every host of the hostfile (from every host that "
            "launches), and check with `ssh -o BatchMode=yes HOST true`."
            + (" (This machine's own address needs it only when another host launches.)"
               if not remote else ""), SRC_MPI))
    sanity = mpi.get("sanity") or {}
    if sanity.get("ran") is not None and not sanity.get("ok"):
        findings.append(found(
            "error", "The MPI sanity run failed",
            f"{' '.join(sanity.get('command') or [])}: {sanity.get('error')}",
            "Fix SSH and the hostfile first; the run must print one host name per host.", SRC_MPI))
    command = mpi.get("sanity_command")
    if not findings and command:
        ran = sanity.get("ok")
        findings.append(found(
            "info", "MPI sanity run " + ("passed" if ran else "is ready to try"),
            f"{mpi.get('version') or 'mpirun'}; {len(ssh)} host(s) reachable by passwordless SSH",
            ("Nothing to fix." if ran else f"Run it: `{' '.join(command)}` (or `python -m helpers "
             "audit --mpi-sanity`); it must print one host name per host."), SRC_MPI))
    return findings


# Every rule above, in the order declared: derived from the registry, so no list can miss one.
RULES: tuple[Rule, ...] = tuple(REGISTRY.values())
CODES: tuple[str, ...] = tuple(REGISTRY)


def evaluate(facts: dict[str, Any]) -> list[Finding]:
    """Every rule over ``facts`` (normalised first, see ``facts.normalise``); findings sorted by
    severity (errors first), then code."""
    from helpers.audit.facts import normalise  # facts -> render -> rules: imported when judging

    try:
        facts, _ = normalise(facts)
    except ValueError:
        pass  # odd facts: the rules read them through get() and never crash
    findings: list[Finding] = []
    for check in REGISTRY.values():
        try:
            findings += check(facts)
        except Exception as exc:  # noqa: BLE001 - odd facts from another machine never crash
            findings.append(Finding("AUDIT_RULE_FAILED", "warning", f"{check.__name__} failed",
                                    f"{type(exc).__name__}: {exc}", "Report this facts file as a "
                                    "bug of helpers.audit.", "helpers.audit.rules"))
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.code, f.title))
