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

from helpers import redact, report
from helpers.audit import pasted, render
from helpers.audit.facts import normalise
from helpers.audit.rules import evaluate, get, known

ABSENT = "(absent)"
UNKNOWN = "(unknown)"  # the facts do not say (a pasted text, an older facts file): never decides
# per-process or per-node identity: differs by design between the machines of one job
ENV_NOT_COMPARED = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "ROLE_RANK",
                              "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT"})
RELEVANT = (("python", "python.version"), ("torch", "torch.version"), ("torch.cuda", "torch.cuda"),
            ("torch.cudnn", "torch.cudnn"), ("torch.nccl", "torch.nccl"), ("torch.hip", "torch.hip"),
            ("driver.version", "driver.version"), ("driver.cuda", "driver.cuda"),
            ("os.kernel", "os.kernel"), ("os.distro", "os.distro"))
# a JSON object with one of these is a facts file (hand-written ones may hold only a few)
FACT_KEYS = frozenset({"schema", "packages", "gpus", "os", "torch", "driver", "env",
                       "accelerate_config"})
INFORMATIONAL = (("cpu_count", "cpu_count"), ("memory_bytes", "memory_bytes"),
                 ("os.shm_bytes", "os.shm_bytes"), ("numa_nodes", "numa_nodes"))


@dataclass
class Machine:
    """One side of a comparison: a label, its facts and its findings."""

    label: str
    facts: dict[str, Any]
    findings: list[dict[str, Any]]


Source = str | Path | dict[str, Any]


def load_machine(source: Source | Sequence[Source], label: str | None = None) -> Machine:
    """Read one machine from an audit report (``{"facts", "findings"}``), a facts file, the saved
    output of ``python -m torch.utils.collect_env`` or ``accelerate env``, or several of these
    (files of one machine, combined into one set of facts; ``facts["sources"]`` says which fact
    was read from which file). Facts go through ``facts.normalise``; findings are always
    recomputed (the rules are pure functions of the facts, and a report written by an older
    version may hold verdicts its rules got wrong).

    Raises ValueError naming the file, and the key or line, when a file is missing, malformed,
    of no known kind, or contradicts another file of the same machine.
    """
    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise ValueError("no file given")
    facts: dict[str, Any] = {}
    provenance: dict[str, Any] = {}
    described, notes = [], []
    for item in sources:
        name = label or "machine" if isinstance(item, dict) else str(item)
        more, kind = _read_source(item, name)
        try:
            more, more_notes = normalise(more)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        lines = more.pop("_lines", None)
        where = {k: f"{name} {v}" for k, v in (lines or {}).items()} if lines is not None else \
            {k: name for k, _ in pasted.flat_items(more)}
        try:
            pasted.merge_into(facts, more, provenance, where, name)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        described.append({"file": name, "kind": kind,
                          "facts": sorted(where) if lines is not None else "every fact in the file"})
        notes += [f"{name}: {note}" for note in more_notes]
    if len(sources) > 1 or described[0]["kind"] not in ("audit report", "facts"):
        facts["sources"] = described
        facts["provenance"] = provenance
    if notes:
        facts["notes"] = notes
    findings = [report.to_jsonable(f) for f in evaluate(facts)]
    first = sources[0]
    name = label or (Path(first).stem if not isinstance(first, dict) else "machine")
    return Machine(name, facts, findings)


def _read_source(source: Source, name: str) -> tuple[dict[str, Any], str]:
    """(facts, kind) of one file or dict; the facts of pasted texts carry ``_lines``."""
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"no such file: {path} (give an audit report written by "
                             "`python -m helpers audit --json PATH`, a facts file, or the saved "
                             "output of `python -m torch.utils.collect_env` or `accelerate env`)"
                             ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} cannot be read as text: {exc}") from None
        if not text.lstrip().startswith(("{", "[")):
            try:
                facts, lines, kinds = pasted.parse(text)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
            return redact.redact_data({**facts, "_lines": lines}), " + ".join(kinds)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a JSON audit report or facts file: line {exc.lineno} "
                             f"column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name} is not an audit report or facts file (expected a JSON object)")
    if isinstance(data.get("facts"), dict):
        return data["facts"], "audit report"
    if set(data) & FACT_KEYS:
        return data, "facts"
    raise ValueError(f"{name} is not an audit report or facts file (no 'facts' key and none of "
                     f"{', '.join(sorted(FACT_KEYS))})")


def flatten(facts: dict[str, Any]) -> dict[str, tuple[Any, bool]]:
    """fact name -> (value, relevant) for everything a diff compares."""
    flat: dict[str, tuple[Any, bool]] = {}
    for name, path in RELEVANT:
        flat[name] = (get(facts, path) if known(facts, path) else UNKNOWN, True)
    for package, version in sorted((get(facts, "packages", {}) or {}).items()):
        flat[f"packages.{package}"] = (version, True)
    if known(facts, "gpus"):
        gpus = [gpu for gpu in get(facts, "gpus", []) if isinstance(gpu, dict)]
        flat["gpus.count"] = (len(gpus), True)
        models = Counter(gpu.get("name") or "?" for gpu in gpus)
        flat["gpus.models"] = (", ".join(f"{n} x {m}" for m, n in sorted(models.items())) or None,
                               True)
    else:
        flat["gpus.count"] = flat["gpus.models"] = (UNKNOWN, True)
    for name, value in sorted((get(facts, "env", {}) or {}).items()):
        if name not in ENV_NOT_COMPARED:
            flat[f"env.{name}"] = (value, True)
    config = get(facts, "accelerate_config")
    flat["accelerate_config"] = ("present" if isinstance(config, dict) else None, True) \
        if known(facts, "accelerate_config") else (UNKNOWN, True)
    for key, value in _flatten_mapping(config if isinstance(config, dict) else {}):
        flat[f"accelerate_config.{key}"] = (value, True)
    for name, path in INFORMATIONAL:
        flat[name] = (get(facts, path) if known(facts, path) else UNKNOWN, False)
    return flat


def _missing_value(facts: dict[str, Any], name: str) -> str:
    """What a fact another machine has but this one lacks is: absent, or unknown (a section the
    facts do not hold, or hold only in part: ``facts["partial"]``)."""
    head = name.split(".")[0]
    if head in ("packages", "env", "accelerate_config") and (
            not known(facts, head) or head in (facts.get("partial") or [])):
        return UNKNOWN
    return ABSENT


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
    labels = unique_labels([m.label for m in machines])
    flats = [flatten(m.facts) for m in machines]
    names = sorted({name for flat in flats for name in flat}, key=_fact_order)
    rows, identical = [], True
    for name in names:
        values = [_show(flat[name][0]) if name in flat else _missing_value(m.facts, name)
                  for flat, m in zip(flats, machines, strict=True)]
        relevant = any(flat.get(name, (None, False))[1] for flat in flats)
        if len(set(values)) > 1:
            rows.append({"fact": name, **dict(zip(labels, values, strict=True)), "relevant": relevant})
            decided = {value for value in values if value != UNKNOWN}
            identical = identical and not (relevant and len(decided) > 1)
    return DiffResult(labels, rows, _finding_rows(machines, labels), identical)


def diff_reports(paths: Sequence[Source | Sequence[Source]],
                 labels: Sequence[str | None] | None = None) -> DiffResult:
    """``diff_machines`` over files (audit reports, facts, pasted texts), lists of files of one
    machine, or already-loaded dicts."""
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


def unique_labels(labels: list[str], separator: str = "#") -> list[str]:
    """The labels, a repeated one numbered from its second use: ``a, a#2, a#3``."""
    seen: Counter[str] = Counter()
    unique = []
    for label in labels:
        seen[label] += 1
        unique.append(label if seen[label] == 1 else f"{label}{separator}{seen[label]}")
    return unique
