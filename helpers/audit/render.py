"""HTML for the audit: findings, facts summary, topology, diffs and the self-contained report page.

Everything shown is escaped; the data was redacted before it got here.
"""

from __future__ import annotations

import html
import json
from typing import Any

from helpers import report
from helpers.audit.rules import get

SEVERITY_COLORS = {"error": "#f8d0d0", "warning": "#fbe9c0", "info": "#dde9f7"}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top;
         max-width: 30em; overflow-wrap: anywhere; }
th { background: #f2f2f2; }
td.diff { background: #fbe9c0; font-weight: 600; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""
MIB = 1024 * 1024


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _size(value: Any) -> str:
    if not isinstance(value, int):
        return "unknown"
    return f"{value / (1024 * MIB):.1f} GiB" if value >= 1024 * MIB else f"{value / MIB:.0f} MiB"


def findings_html(findings: list[Any], min_severity: str = "info") -> str:
    """The findings table, sorted by severity, colored, with evidence, fix and source."""
    order = ("error", "warning", "info")
    keep = order[: order.index(min_severity) + 1] if min_severity in order else order
    rows = [report.to_jsonable(f) for f in findings]
    rows = [row for row in rows if row.get("severity") in keep]
    if not rows:
        return f"<p>No findings at severity {_e(min_severity)} or above.</p>"
    body = []
    for row in rows:
        color = SEVERITY_COLORS.get(row.get("severity"), "#fff")
        cells = "".join(f"<td>{_e(row.get(c))}</td>" for c in
                        ("code", "title", "evidence", "fix", "source"))
        body.append(f'<tr style="background:{color}"><td><b>{_e(row.get("severity"))}</b></td>'
                    f"{cells}</tr>")
    head = "".join(f"<th>{c}</th>" for c in ("severity", "code", "title", "evidence", "fix", "source"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def summary_rows(facts: dict[str, Any]) -> list[dict[str, str]]:
    """The facts worth a glance, as (fact, value) rows."""
    gpus = [g for g in get(facts, "gpus", []) if isinstance(g, dict)]
    models = sorted({g.get("name") or "?" for g in gpus})
    container = get(facts, "os.container", {}) or {}
    port = get(facts, "network.rendezvous_port", {}) or {}
    port_state = "in use by this job" if port.get("in_job") else \
        "free" if port.get("free") else f"IN USE ({port.get('holder') or '?'})"
    rows = [
        ("host", get(facts, "hostname")),
        ("OS", f"{get(facts, 'os.distro', '?')}, kernel {get(facts, 'os.kernel', '?')}"),
        ("container", "yes" + (" (gVisor)" if get(facts, "os.gvisor") else "")
         if container.get("any") else "no"),
        ("/dev/shm", _size(get(facts, "os.shm_bytes"))),
        ("CPUs usable / total", f"{get(facts, 'cpu_count')} / {get(facts, 'cpu_count_total')}"),
        ("memory", _size(get(facts, "memory_bytes"))),
        ("NUMA nodes", get(facts, "numa_nodes")),
        ("Python", get(facts, "python.version")),
        ("torch", f"{get(facts, 'torch.version')} (CUDA build {get(facts, 'torch.cuda', 'none')}, "
                  f"cuDNN {get(facts, 'torch.cudnn', 'none')}, NCCL {get(facts, 'torch.nccl', 'none')})"),
        ("CUDA available / initialised here", f"{get(facts, 'torch.cuda_available', False)} / "
                                              f"{get(facts, 'torch.initialized_here', False)}"),
        ("accelerate", get(facts, "packages.accelerate", "not installed")),
        ("driver", f"{get(facts, 'driver.version')} (CUDA {get(facts, 'driver.cuda')})"
         if get(facts, "driver.version") else get(facts, "driver.error", "unknown")),
        ("GPUs", f"{len(gpus)}: {', '.join(models)}" if gpus else "none"),
        ("rendezvous port", f"{port.get('port')} ({port.get('source')}): {port_state}"),
        ("accelerate config", get(facts, "accelerate_config_path") if
         get(facts, "accelerate_config") else f"none ({get(facts, 'accelerate_config_path')})"),
        ("variables collected", len(get(facts, "env", {}) or {})),
    ]
    return [{"fact": k, "value": "" if v is None else str(v)} for k, v in rows]


def gpu_rows(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per GPU: identity, memory, links, health."""
    rows = []
    for gpu in get(facts, "gpus", []):
        gen, width = gpu.get("pcie_gen") or {}, gpu.get("pcie_width") or {}
        ecc = gpu.get("ecc") or {}
        nvlink = gpu.get("nvlink") or {}
        rows.append({
            "index": gpu.get("index"), "name": gpu.get("name"),
            "memory": _size(gpu.get("memory_bytes")),
            "compute": gpu.get("compute_capability"),
            "PCIe gen": f"{gen.get('current')}/{gen.get('max')}",
            "PCIe width": f"x{width.get('current')}/x{width.get('max')}",
            "NVLink": f"{nvlink.get('active')}/{nvlink.get('links')}" if nvlink else "none",
            "ECC uncorrected": ecc.get("volatile_uncorrected"),
            "throttle": ", ".join(gpu.get("throttle_reasons") or []),
            "persistence": gpu.get("persistence_mode"),
            "MIG": (gpu.get("mig") or {}).get("current"),
            "error": gpu.get("error"),
        })
    return rows


def topology_html(facts: dict[str, Any]) -> str:
    """The GPU topology matrix, or a line saying why there is none."""
    topology = get(facts, "topology")
    if not topology:
        count = len(get(facts, "gpus", []))
        return f"<p>No GPU topology: {'no GPUs here' if not count else 'a single GPU'}.</p>"
    parts = []
    if topology.get("matrix"):
        labels = topology["labels"]
        rows = [{"": label, **dict(zip(labels, row, strict=True))}
                for label, row in zip(labels, topology["matrix"], strict=True)]
        parts.append(report.html_table(rows, ["", *labels]))
        parts.append("<p>NV = NVLink; PIX = same PCIe switch; PXB = several PCIe switches; "
                     "PHB = same PCIe host bridge; NODE = same NUMA node; SYS = across NUMA nodes "
                     "(slowest).</p>")
    if topology.get("nvidia_smi"):
        parts.append(f"<pre>{_e(topology['nvidia_smi'])}</pre>")
    return "".join(parts)


def facts_html(facts: dict[str, Any]) -> str:
    """Facts summary, GPUs and the collected variables."""
    parts = ["<h4>Facts</h4>", report.html_table(summary_rows(facts), ["fact", "value"])]
    gpus = gpu_rows(facts)
    if gpus:
        parts += ["<h4>GPUs</h4>", report.html_table(gpus)]
    env = get(facts, "env", {}) or {}
    if env:
        rows = [{"variable": k, "value": v} for k, v in env.items()]
        parts += ["<details><summary>Variables that shape distributed runs "
                  f"({len(env)})</summary>", report.html_table(rows), "</details>"]
    return "".join(parts)


def report_html(report_obj: Any, min_severity: str = "info") -> str:
    """Findings then facts: what a notebook shows for an AuditReport."""
    counts = report_obj.counts()
    head = (f"<p><b>{counts['error']} error(s), {counts['warning']} warning(s), "
            f"{counts['info']} info</b></p>")
    return (head + findings_html(report_obj.findings, min_severity) + sources_html(report_obj.facts)
            + facts_html(report_obj.facts))


def sources_html(facts: dict[str, Any]) -> str:
    """Which facts were read from which file (facts from files), and what was inferred."""
    rows = []
    for source in get(facts, "sources", []) or []:
        read = source.get("facts")
        rows.append(f"<li><code>{_e(source.get('file'))}</code> ({_e(source.get('kind'))}): "
                    f"{_e(', '.join(read) if isinstance(read, list) else read)}</li>")
    rows += [f"<li>note: {_e(note)}</li>" for note in get(facts, "notes", []) or []]
    return f"<p>Facts read from files (any other fact is unknown):</p><ul>{''.join(rows)}</ul>" \
        if rows else ""


def report_document(report_obj: Any) -> str:
    """The whole report as one self-contained HTML page (no external files, no scripts)."""
    facts = report_obj.facts
    raw = json.dumps(report_obj.to_dict(), indent=2)
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>Environment audit: {_e(get(facts, 'hostname'))}</title><style>{STYLE}</style></head>"
        f"<body><h1>Environment audit</h1><p>{_e(get(facts, 'hostname'))}, collected "
        f"{_e(get(facts, 'collected_at'))}</p><h2>Findings</h2>{report_html(report_obj)}"
        f"<h2>Topology</h2>{topology_html(facts)}"
        f"<details><summary>Raw JSON</summary><pre>{_e(raw)}</pre></details></body></html>\n"
    )


def diff_html(diff: Any) -> str:
    """Differences with machines as columns; differing values highlighted."""
    if not diff.rows and not diff.finding_rows:
        return f"<p>No differences between {_e(', '.join(diff.machines))}.</p>"
    verdict = "identical" if diff.identical else "<b>different</b>"
    parts = [f"<p>Relevant facts are {verdict} across {_e(', '.join(diff.machines))}.</p>"]
    if diff.rows:
        parts.append(_diff_table(diff.rows, "fact", diff.machines, show_relevant=True))
    if diff.finding_rows:
        parts.append("<h4>Findings that differ</h4>")
        parts.append(_diff_table(diff.finding_rows, "code", diff.machines))
    return "".join(parts)


def _diff_table(rows: list[dict[str, Any]], key: str, machines: list[str],
                show_relevant: bool = False) -> str:
    head = f"<th>{_e(key)}</th>" + "".join(f"<th>{_e(m)}</th>" for m in machines)
    head += "<th>relevant</th>" if show_relevant else ""
    body = []
    for row in rows:
        values = [row.get(m) for m in machines]  # highlighted: differs from the first machine
        cells = "".join(f"<td{' class=diff' if v != values[0] else ''}>{_e(v)}</td>" for v in values)
        extra = f"<td>{'yes' if row.get('relevant') else 'no'}</td>" if show_relevant else ""
        body.append(f"<tr><td>{_e(row.get(key))}</td>{cells}{extra}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def fleet_document(fleet: Any) -> str:
    """A fleet report page: the diff across nodes first, then each node's findings."""
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>Fleet audit</title>"
             f"<style>{STYLE}</style></head><body><h1>Fleet audit: {len(fleet.nodes)} node(s)</h1>",
             "<h2>Differences across nodes</h2>", diff_html(fleet.diff)]
    for node in fleet.nodes:
        parts.append(f"<h2>{_e(node['label'])}</h2>")
        parts.append(findings_html(node["findings"]))
    parts.append("</body></html>\n")
    return "".join(parts)


def diff_document(diff: Any) -> str:
    """``python -m helpers diff --html``'s page: the differences table alone, self-contained."""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><style>{STYLE}</style></head>"
            f"<body><h1>Differences</h1>{diff_html(diff)}</body></html>\n")
