"""Facts from the texts people paste into issues: ``python -m torch.utils.collect_env`` and
``accelerate env``.

Every GitHub issue about accelerate carries one or both; judging them with the same rules as a live
audit turns "compare by eye" into findings. Pure: text in, ``(facts, provenance)`` out, no I/O.

Only what a text holds becomes a fact. A line that is missing, or says "Could not collect",
"N/A" where that means "unknown", or "Not found", leaves its fact *absent*, and an absent fact is
unknown to the rules (``helpers.audit.rules`` then says "Unknown" instead of judging); a fact that is
present with the value None is known to be none (``CUDA used to build PyTorch: None``: a CPU build).
Lists that a text holds only in part (collect_env lists "relevant" packages only; neither text
lists the environment) are named in ``facts["partial"]``.

Wordings covered: torch 2.0-2.13 collect_env (``env_info_fmt`` in torch/utils/collect_env.py:
"Yes"/"No" or "True"/"False", "No CUDA" when torch sees no CUDA and nvidia-smi gave nothing, GPU
lines from ``nvidia-smi -L`` on the same or the following lines, MIG lines) and accelerate
0.20-1.15 env (accelerate/commands/env.py: "PyTorch version (GPU?): 2.0.1+cu117 (True)" up to
0.34, "PyTorch version" plus "PyTorch accelerator" since 1.x, the config as tab- or
space-indented "- key: value" lines with Python reprs, or "Not found"). Markdown fences and the
leading spaces of a paste are ignored.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from helpers.audit.rules import ABSENT, lookup

COLLECT_ENV = "torch collect_env"
ACCELERATE_ENV = "accelerate env"
UNKNOWN_WORDS = {"could not collect", "not found", "n/a", "unknown", ""}
MACHINES = ("x86_64", "aarch64", "arm64", "ppc64le", "s390x", "i686", "armv7l", "riscv64", "AMD64")
GIB = 1024 ** 3

Provenance = dict[str, int]  # dotted fact name -> line number (1-based) it was read from


def kinds(text: str) -> list[str]:
    """Which pasted outputs ``text`` holds (both when a user pasted both into one file)."""
    found = []
    lines = [_clean(line) for line in text.splitlines()]
    if any(line.startswith("PyTorch version:") for line in lines) and any(
            line.startswith(("Is CUDA available:", "Is debug build:", "CUDA used to build PyTorch:"))
            for line in lines):
        found.append(COLLECT_ENV)
    if any(re.match(r"-\s*`?Accelerate`? version:", line) for line in lines):
        found.append(ACCELERATE_ENV)
    return found


def parse(text: str) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Facts from every pasted output in ``text``: (facts, provenance, kinds found).

    Raises ValueError naming the line when a line the parser knows holds a value it cannot read,
    or when two outputs in the one text disagree; ValueError too when the text holds neither.
    """
    found = kinds(text)
    if not found:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "(empty)")
        raise ValueError("not a JSON audit report or facts file, nor the output of `python -m "
                         f"torch.utils.collect_env` or `accelerate env` (line 1: {first[:60]!r})")
    facts: dict[str, Any] = {}
    provenance: dict[str, str] = {}  # dotted fact -> "line N"
    for kind in found:
        parser = parse_collect_env if kind == COLLECT_ENV else parse_accelerate_env
        more, lines = parser(text)
        merge_into(facts, more, provenance, {k: f"line {n}" for k, n in lines.items()},
                   f"the {kind} part")
    return facts, provenance, found


def _collector() -> tuple[dict[str, Any], Provenance, Any]:
    """Empty facts, their provenance, and ``put(dotted, value, line)`` that fills both."""
    facts: dict[str, Any] = {}
    seen: Provenance = {}

    def put(dotted: str, value: Any, number: int) -> None:
        _set(facts, dotted, value)
        seen[dotted] = number

    return facts, seen, put


# ---------------------------------------------------------------------------------------------
# torch.utils.collect_env


def parse_collect_env(text: str) -> tuple[dict[str, Any], Provenance]:
    """``python -m torch.utils.collect_env`` output -> (facts, provenance)."""
    facts, seen, put = _collector()
    lines = [_clean(line) for line in text.splitlines()]

    gpu_header = None
    for number, line in enumerate(lines, 1):
        key, sep, value = line.partition(":")
        if not sep:
            continue
        value = value.strip()
        if key == "PyTorch version" and _known(value):
            put("torch.version", value, number)
        elif key == "CUDA used to build PyTorch" and _known(value):
            put("torch.cuda", None if value in ("None", "No CUDA") else value, number)
        elif key == "ROCM used to build PyTorch" and value:
            # collect_env writes N/A when torch has no HIP build: a known "none" here
            put("torch.hip", None if value in ("N/A", "None") else value, number)
        elif key == "OS" and _known(value):
            match = re.fullmatch(r"(.*?)\s*\(([^()]+)\)", value)
            put("os.distro", match.group(1) if match else value, number)
            if match:
                put("os.machine", match.group(2), number)
        elif key == "Python version" and _known(value):
            put("python.version", _version_word(value, number, line), number)
        elif key == "Python platform" and _known(value):
            for dotted, part in _platform(value).items():
                put(dotted, part, number)
        elif key == "Is CUDA available":
            put("torch.cuda_available", _yes_no(value, number, line), number)
        elif key == "GPU models and configuration":
            gpu_header = number
            if value == "No CUDA":
                put("gpus", [], number)
                put("driver.error", "nvidia-smi found no NVIDIA GPU (collect_env: No CUDA)", number)
            elif value and not _known(value):
                gpu_header = None
        elif key == "Nvidia driver version" and _known(value) and value != "No CUDA":
            put("driver.version", value, number)
        elif key == "CPU(s)" and value.isdigit() and "cpu_count_total" not in facts:
            put("cpu_count_total", int(value), number)
        elif key == "NUMA node(s)" and value.isdigit():
            put("numa_nodes", int(value), number)
    if gpu_header is not None and "gpus" not in facts:
        gpus = _gpu_lines(lines, gpu_header)
        if gpus:
            put("gpus", gpus, gpu_header)
    packages, first = _pip_packages(lines)
    if packages:
        put("packages", packages, first)
        facts["partial"] = ["packages"]
    return facts, seen


def _gpu_lines(lines: list[str], header: int) -> list[dict[str, Any]]:
    """``GPU 0: NVIDIA A100-SXM4-80GB`` lines on the header's line and after it, until a blank."""
    gpus = []
    candidates = [lines[header - 1].partition(":")[2].strip()] + lines[header:]
    for position, line in enumerate(candidates):
        if not line:
            if position == 0:
                continue
            break
        if line.startswith("MIG "):
            continue
        match = re.fullmatch(r"GPU (\d+): (.+?)(?: \(UUID: [^)]*\))?", line)
        if not match:
            if position == 0 and not gpus:
                # darwin/ROCm form: one device name, without count or index
                return []
            break
        gpus.append({"index": int(match.group(1)), "name": match.group(2).strip()})
    return gpus


def _pip_packages(lines: list[str]) -> tuple[dict[str, str], int]:
    packages: dict[str, str] = {}
    first = 0
    for number, line in enumerate(lines, 1):
        match = re.fullmatch(r"\[pip\d?\] ([A-Za-z0-9_.\-]+)==(\S+)", line)
        if match:
            packages.setdefault(match.group(1).lower().replace("_", "-"), match.group(2))
            first = first or number
    return packages, first


# ---------------------------------------------------------------------------------------------
# accelerate env


def parse_accelerate_env(text: str) -> tuple[dict[str, Any], Provenance]:
    """``accelerate env`` output -> (facts, provenance)."""
    facts, seen, put = _collector()
    lines = [_clean(line) for line in text.splitlines()]

    config_at = None
    for number, line in enumerate(lines, 1):
        match = re.fullmatch(r"-\s*(.+?):\s*(.*)", line)
        if not match:
            continue
        key, value = match.group(1).replace("`", "").strip(), match.group(2).strip()
        if key.lower() == "accelerate version" and _known(value):
            put("packages.accelerate", _version_word(value, number, line), number)
        elif key == "Platform" and _known(value):
            for dotted, part in _platform(value).items():
                put(dotted, part, number)
        elif key == "Python version" and _known(value):
            put("python.version", _version_word(value, number, line), number)
        elif key == "Numpy version" and _known(value):
            put("packages.numpy", _version_word(value, number, line), number)
        elif key == "PyTorch version (GPU?)":
            old = re.fullmatch(r"(\S+)\s*\((True|False)\)", value)
            if not old:
                raise ValueError(f"line {number}: {line!r} (expected 'VERSION (True)' or "
                                 "'VERSION (False)')")
            put("torch.version", old.group(1), number)
            put("packages.torch", old.group(1), number)
            put("torch.cuda_available", old.group(2) == "True", number)
        elif key == "PyTorch version" and _known(value):
            put("torch.version", value, number)
            put("packages.torch", value, number)
        elif key == "PyTorch accelerator" and value:
            # accelerate writes N/A when torch sees no accelerator at all (commands/env.py)
            put("torch.cuda_available", value == "CUDA", number)
        elif key == "System RAM":
            ram = re.fullmatch(r"([\d.]+)\s*GB", value)
            if ram:
                put("memory_bytes", int(float(ram.group(1)) * GIB), number)
        elif key == "GPU type" and _known(value):
            put("torch.device_name", value, number)
        elif key.startswith("Accelerate default config") or key.startswith("Accelerate config passed"):
            config_at = number
            break
    if config_at is not None:
        config = _config_lines(lines, config_at)
        if config is not None:
            put("accelerate_config", config, config_at)
            put("accelerate_config_error", None, config_at)
            put("accelerate_config_source",
                "accelerate env" + (" (--config_file)" if "passed" in lines[config_at - 1] else ""),
                config_at)
    facts["partial"] = ["packages"]
    return facts, seen


def _config_lines(lines: list[str], header: int) -> dict[str, Any] | None:
    """The ``- key: value`` lines after the config header; None for ``Not found``."""
    config: dict[str, Any] = {}
    for line in lines[header:]:
        if not line:
            if config:
                break
            continue
        if line.lower() in UNKNOWN_WORDS:
            return None
        match = re.fullmatch(r"-\s*([A-Za-z_][\w.]*):\s*(.*)", line)
        if not match:
            break  # the paste's next section
        config[match.group(1)] = _literal(match.group(2).strip())
    return config or None


def _literal(text: str) -> Any:
    """A config value as accelerate printed it (``str()`` of the value: True, 8, {'a': 1}, [], or
    text without quotes); plain text when it is not a literal. ``0,1,2,3`` stays text: str() of
    a tuple would have printed parentheses."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    return text if isinstance(value, tuple) and not text.startswith("(") else value


# ---------------------------------------------------------------------------------------------
# shared


def _clean(line: str) -> str:
    """A pasted line without markdown fences, leading spaces or a trailing carriage return."""
    line = line.strip()
    if line.startswith("```"):
        return ""
    return line


def _known(value: str) -> bool:
    return value.strip().lower() not in UNKNOWN_WORDS


def _version_word(value: str, number: int, line: str) -> str:
    match = re.match(r"(\d+(?:\.\d+)+\S*)", value)
    if not match:
        raise ValueError(f"line {number}: {line!r} (expected a version number)")
    return match.group(1)


def _yes_no(value: str, number: int, line: str) -> bool:
    if value in ("True", "Yes"):
        return True
    if value in ("False", "No"):
        return False
    raise ValueError(f"line {number}: {line!r} (expected Yes, No, True or False)")


def _platform(value: str) -> dict[str, str]:
    """``platform.platform()`` text -> os.system, os.kernel (and os.machine) where it says so.

    ``Linux-5.15.0-105-generic-x86_64-with-glibc2.35``: system Linux, kernel 5.15.0-105-generic.
    """
    system, _, rest = value.partition("-")
    if system == "macOS":
        return {"os.system": "Darwin"}
    if system not in ("Linux", "Windows", "Darwin") or not rest:
        return {}
    rest = rest.split("-with-")[0]
    out = {"os.system": system}
    for machine in MACHINES:
        if rest.endswith("-" + machine):
            out["os.machine"] = machine
            rest = rest[: -len(machine) - 1]
            break
    if system != "Windows" and rest:
        out["os.kernel"] = rest
    return out


def _set(facts: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = facts
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def flat_items(facts: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, value) for every leaf, dicts descended into (lists and configs are leaves)."""
    items = []
    for key, value in facts.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("accelerate_config",) and value:
            items += flat_items(value, name + ".")
        else:
            items.append((name, value))
    return items


def merge_into(facts: dict[str, Any], more: dict[str, Any], provenance: dict[str, Any],
               more_provenance: dict[str, Any], where: str) -> None:
    """Add ``more`` to ``facts`` (and its provenance); ValueError when both hold one fact with
    different values (then the texts are not of one machine, or one is stale)."""
    for dotted, value in flat_items(more):
        if dotted == "partial":
            facts["partial"] = sorted(set(facts.get("partial", [])) | set(value))
            continue
        current = lookup(facts, dotted)
        if current is not ABSENT and current != value and _comparable(dotted, current, value):
            was = provenance.get(dotted, "an earlier file")
            raise ValueError(f"{where} says {dotted} = {value!r}, but {was} says {current!r}: are "
                             "they of one machine, and of the same moment?")
        if current is ABSENT or current is None:
            _set(facts, dotted, value)
        source = _source_of(dotted, more_provenance)
        if source is not None:
            provenance.setdefault(dotted, source)


def _source_of(dotted: str, provenance: dict[str, Any]) -> Any:
    """Where ``dotted`` was read: its own entry, or that of the fact holding it (``packages``)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in provenance:
            return provenance[".".join(parts[:end])]
    return None


def _comparable(dotted: str, current: Any, value: Any) -> bool:
    """Whether a difference is a contradiction: a rounded RAM figure against bytes is not, nor
    pip's ``2.0.1`` against torch's own ``2.0.1+cu117``."""
    if dotted == "memory_bytes":
        return False
    if dotted.startswith("packages.") and isinstance(current, str) and isinstance(value, str):
        return current.split("+")[0] != value.split("+")[0]
    return True


