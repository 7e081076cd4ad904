"""Differences between machines: audit reports or facts files, side by side.

Compared (the *relevant* facts, which decide the exit code): Python, package versions, torch's
CUDA/cuDNN/NCCL versions, driver and its CUDA version, kernel and distribution, GPU count and
models, environment values and the accelerate config. Shown when they differ but never deciding:
CPU count, memory, /dev/shm. Never compared: times, host names, per-process identity variables.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import report
from helpers.audit import render
from helpers.audit.rules import evaluate, get

ABSENT = "(absent)"
# per-process or per-node identity: differs by design between the machines of one job
ENV_NOT_COMPARED = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "ROLE_RANK",
                              "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT"})
RELEVANT = (("python", "python.version"), ("torch", "torch.version"), ("torch.cuda", "torch.cuda"),
            ("torch.cudnn", "torch.cudnn"), ("torch.nccl", "torch.nccl"), ("torch.hip", "torch.hip"),
            ("driver.version", "driver.version"), ("driver.cuda", "driver.cuda"),
            ("os.kernel", "os.kernel"), ("os.distro", "os.distro"))
INFORMATIONAL = (("cpu_count", "cpu_count"), ("memory_bytes", "memory_bytes"),
                 ("os.shm_bytes", "os.shm_bytes"), ("numa_nodes", "numa_nodes"))


@dataclass
class Machine:
    """One side of a comparison: a label, its facts and its findings."""

    label: str
    facts: dict[str, Any]
    findings: list[dict[str, Any]]


def load_machine(source: str | Path | dict[str, Any], label: str | None = None) -> Machine:
    """Read an audit report (``{"facts", "findings"}``) or a facts file; findings are recomputed
    for facts files (the rules are pure functions of the facts).

    Raises ValueError naming the file when it is missing or is neither kind of JSON.
    """
    if isinstance(source, dict):
        data, name = source, label or "machine"
    else:
        path = Path(source)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"no such file: {path} (give an audit report written by "
                             "`python -m helpers audit --json PATH` or notebook 01)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a JSON audit report or facts file: {exc}") from None
        name = label or path.stem
    if not isinstance(data, dict):
        raise ValueError(f"{name} is not an audit report or facts file (expected a JSON object)")
    if isinstance(data.get("facts"), dict):
        facts, findings = data["facts"], data.get("findings")
    elif "schema" in data and "packages" in data:
        facts, findings = data, None
    else:
        raise ValueError(f"{name} is not an audit report or facts file (no 'facts' and no "
                         "'schema'/'packages' keys)")
    if not isinstance(findings, list):
        findings = [report.to_jsonable(f) for f in evaluate(facts)]
    return Machine(name, facts, findings)


def flatten(facts: dict[str, Any]) -> dict[str, tuple[Any, bool]]:
    """fact name -> (value, relevant) for everything a diff compares."""
    flat: dict[str, tuple[Any, bool]] = {}
    for name, path in RELEVANT:
        flat[name] = (get(facts, path), True)
    for package, version in sorted((get(facts, "packages", {}) or {}).items()):
        flat[f"packages.{package}"] = (version, True)
    gpus = [gpu for gpu in get(facts, "gpus", []) if isinstance(gpu, dict)]
    flat["gpus.count"] = (len(gpus), True)
    models = Counter(gpu.get("name") or "?" for gpu in gpus)
    flat["gpus.models"] = (", ".join(f"{n} x {m}" for m, n in sorted(models.items())) or None, True)
    for name, value in sorted((get(facts, "env", {}) or {}).items()):
        if name not in ENV_NOT_COMPARED:
            flat[f"env.{name}"] = (value, True)
    config = get(facts, "accelerate_config")
    flat["accelerate_config"] = ("present" if isinstance(config, dict) else None, True)
    for key, value in _flatten_mapping(config if isinstance(config, dict) else {}):
        flat[f"accelerate_config.{key}"] = (value, True)
    for name, path in INFORMATIONAL:
        flat[name] = (get(facts, path), False)
    return flat


def _flatten_mapping(mapping: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in sorted(mapping.items(), key=lambda kv: str(kv[0])):
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            items += _flatten_mapping(value, name + ".")
        else:
            items.append((name, json.dumps(value) if isinstance(value, list) else value))
    return items


@dataclass
class DiffResult(report.ResultMixin):
    """Facts and findings that differ across machines (machines as columns)."""

    machines: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    finding_rows: list[dict[str, Any]] = field(default_factory=list)
    identical: bool = True

    def summary(self) -> str:
        """Plain-text tables for the CLI."""
        if not self.rows and not self.finding_rows:
            return f"No differences between {', '.join(self.machines)}."
        parts = []
        verdict = "identical" if self.identical else "DIFFERENT"
        parts.append(f"Relevant facts are {verdict} across {', '.join(self.machines)}.")
        if self.rows:
            parts.append(report.text_table(self.rows, ["fact", *self.machines, "relevant"]))
        if self.finding_rows:
            parts.append("Findings that differ:\n"
                         + report.text_table(self.finding_rows, ["code", *self.machines]))
        return "\n\n".join(parts)

    def _repr_html_(self) -> str:
        return render.diff_html(self)


def diff_machines(machines: Sequence[Machine]) -> DiffResult:
    """Compare machines; ``identical`` is True when no relevant fact differs."""
    labels = _unique([m.label for m in machines])
    flats = [flatten(m.facts) for m in machines]
    names = sorted({name for flat in flats for name in flat}, key=_fact_order)
    rows, identical = [], True
    for name in names:
        values = [_show(flat.get(name, (ABSENT, True))[0]) for flat in flats]
        relevant = any(flat.get(name, (None, False))[1] for flat in flats)
        if len(set(values)) > 1:
            rows.append({"fact": name, **dict(zip(labels, values, strict=True)), "relevant": relevant})
            identical = identical and not relevant
    return DiffResult(labels, rows, _finding_rows(machines, labels), identical)


def diff_reports(paths: Sequence[str | Path | dict[str, Any]],
                 labels: Sequence[str] | None = None) -> DiffResult:
    """``diff_machines`` over files (audit reports or facts) or already-loaded dicts."""
    if len(paths) < 2:
        raise ValueError(f"paths must name at least two audit reports or facts files; got {len(paths)}")
    labels = list(labels) if labels else [None] * len(paths)
    return diff_machines([load_machine(p, lab) for p, lab in zip(paths, labels, strict=True)])


def _finding_rows(machines: Sequence[Machine], labels: list[str]) -> list[dict[str, Any]]:
    per_machine = [{_finding_key(f): f.get("severity", "?") for f in m.findings} for m in machines]
    keys = sorted({key for found in per_machine for key in found})
    rows = []
    for key in keys:
        values = [found.get(key, "") for found in per_machine]
        if len(set(values)) > 1:
            rows.append({"code": key, **dict(zip(labels, values, strict=True))})
    return rows


def _finding_key(finding: dict[str, Any]) -> str:
    code = finding.get("code", "?")
    return code if code not in ("NCCL_ENV_SUSPICIOUS", "PCIE_LINK_DEGRADED", "GPU_THROTTLED",
                                "ECC_ERRORS", "GPU_QUERY_FAILED") else \
        f"{code}: {finding.get('title', '')}"


def _show(value: Any) -> str:
    if value is None:
        return ABSENT
    return str(value)


def _fact_order(name: str) -> tuple[int, str]:
    order = ("python", "torch", "driver", "os", "gpus", "packages", "env", "accelerate_config")
    head = name.split(".")[0]
    return (order.index(head) if head in order else len(order), name)


def _unique(labels: list[str]) -> list[str]:
    seen: Counter[str] = Counter()
    unique = []
    for label in labels:
        seen[label] += 1
        unique.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return unique
