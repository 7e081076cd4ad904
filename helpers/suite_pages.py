"""The pages of ``make report``: one machine's landing page, and the fleet page over many machines.

A person opens ``reports/latest/index.html`` to learn whether a machine is healthy without opening
five notebooks: which machine it is, each notebook's outcome and headline (its key figures), the
audit's top findings and, for a failure, the notebook, the cell and the error. ``combine()`` reads
the report folders of many machines (each node of a cluster runs ``make report`` into shared
storage) and writes one fleet page: a row per machine, a column per notebook, machines that failed
a notebook first, and the audit's differences between machines highlighted.

Both pages are built from ``summary.json`` data, never from the run itself, so what the fleet page
shows for a machine is what its own landing page showed. They are self-contained (inline CSS, no
scripts, fonts or images from the network); every text is redacted (``helpers.redact``) and escaped.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from helpers import redact, report
from helpers.audit.diff import unique_labels

SUMMARY = "summary.json"
INDEX = "index.html"
MACHINE_FIELDS = (("host", "host"), ("gpus", "GPUs"), ("torch", "torch"), ("cuda", "CUDA (torch)"),
                  ("accelerate", "accelerate"), ("driver", "driver"), ("python", "Python"),
                  ("kernel", "kernel"))
STYLE = """
:root { --ok: #1b7f3b; --bad: #b3261e; --line: #d7dbe0; --soft: #f4f6f8; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2329;
       margin: 0; background: #fff; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 40px; }
h1 { font-size: 1.55em; margin: 0 0 4px; }
h2 { font-size: 1.15em; margin: 28px 0 8px; }
.sub { color: #5b6570; margin: 0 0 16px; }
.verdict { display: inline-block; white-space: nowrap; padding: 2px 10px; border-radius: 12px; color: #fff;
           font-size: 0.8em; vertical-align: middle; margin-right: 8px; }
.ok { background: var(--ok); } .bad { background: var(--bad); }
table { border-collapse: collapse; width: 100%; margin: 4px 0 8px; }
th, td { border-bottom: 1px solid var(--line); padding: 6px 10px; text-align: left;
         vertical-align: top; overflow-wrap: anywhere; }
th { background: var(--soft); font-weight: 600; font-size: 0.9em; white-space: nowrap; }
table.params, table.findings { width: auto; min-width: 50%; }
td.num { text-align: right; white-space: nowrap; }
td.name { white-space: nowrap; }
tr.failed td { background: #fdeeee; }
td.cellbad { background: #fdeeee; } td.cellok { background: #f1f8f3; }
td.diff { background: #fff1c9; font-weight: 600; }
dl.machine { display: grid; grid-template-columns: max-content 1fr; gap: 2px 18px; margin: 0;
             background: var(--soft); padding: 10px 14px; border-radius: 6px; }
dl.machine dt { color: #5b6570; } dl.machine dd { margin: 0; font-weight: 600; }
.sev { display: inline-block; min-width: 5.5em; font-weight: 600; }
.sev-error { color: var(--bad); } .sev-warning { color: #9a6700; } .sev-info { color: #35608f; }
.fail { border-left: 4px solid var(--bad); background: #fdf5f5; padding: 8px 12px; margin: 8px 0; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 0.88em; }
pre { white-space: pre-wrap; margin: 4px 0 0; }
a { color: #0b57d0; } small { color: #5b6570; }
"""


def _clean(value: Any, anonymize: bool = False) -> str:
    """Text fit for a page: secrets redacted (and host/user names when anonymised), escaped."""
    text = "" if value is None else str(value)
    text = redact.for_report(text) if anonymize else redact.redact_text(text)
    return html.escape(text)


def _document(title: str, body: str) -> str:
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
            f"<body><main>{body}</main></body></html>\n")


def _badge(ok: bool, text: str | None = None) -> str:
    label = html.escape(text or ("pass" if ok else "FAIL"))
    return f"<span class='verdict {'ok' if ok else 'bad'}'>{label}</span>"


def _heading(ok: bool, verdict: str) -> str:
    """The page's title line: a healthy/problems badge and the verdict."""
    return f"<h1>{_badge(ok, 'healthy' if ok else 'problems')} {html.escape(verdict)}</h1>"


def _link(href: str | None, text: str) -> str:
    if not href:
        return ""
    return f"<a href='{html.escape(href, quote=True)}'>{html.escape(text)}</a>"


def machine_label(machine: dict[str, Any], fallback: str) -> str:
    """A machine's name on a page: its host, or ``fallback`` (the folder) when it has none or is
    anonymised."""
    host = str(machine.get("host") or "")
    return fallback if not host or machine.get("anonymized") or host == "<host>" else host


# ---------------------------------------------------------------------------------------------
# one machine


def landing_page(summary: dict[str, Any]) -> str:
    """``index.html`` of one report folder from its ``summary.json`` data."""
    machine = summary.get("machine") or {}
    anonymize = bool(machine.get("anonymized"))
    runs = summary.get("notebooks") or []
    failed = [run for run in runs if not run.get("ok")]
    verdict = (f"All {len(runs)} notebooks passed" if not failed
               else f"{len(failed)} of {len(runs)} notebooks failed")
    host = machine_label(machine, "this machine (anonymised)" if anonymize else "this machine")
    parts = [_heading(not failed, verdict),
             f"<p class='sub'>{_clean(host, anonymize)} &middot; report started "
             f"{_clean(summary.get('started'))}"
             + (f" &middot; {float(summary['seconds']):.0f} s in all" if summary.get("seconds") else "")
             + "</p>",
             "<h2>Machine</h2>", _machine_html(machine, anonymize),
             "<h2>Notebooks</h2>", _notebooks_html(runs, anonymize)]
    if failed:
        parts += ["<h2>Failures</h2>", "".join(_failure_html(run, anonymize) for run in failed)]
    parts += ["<h2>Top findings of the environment audit</h2>",
              _findings_html(summary.get("findings") or [], summary.get("audit_report"), runs, anonymize)]
    if summary.get("parameters"):
        rows = "".join(f"<tr><td><code>{_clean(k)}</code></td>"
                       f"<td><code>{_clean(v, anonymize)}</code></td></tr>"
                       for k, v in summary["parameters"].items())
        parts += ["<h2>Parameters set with -p</h2>", f"<table class='params'><tbody>{rows}</tbody></table>"]
    return _document(f"{verdict}: report {summary.get('started', '')}", "".join(parts))


def _machine_html(machine: dict[str, Any], anonymize: bool) -> str:
    items = []
    for key, label in MACHINE_FIELDS:
        value = machine.get(key)
        if key == "host" and anonymize:
            value = "<host> (anonymised)"
        shown = _clean(value if value else "unknown", anonymize)
        items.append(f"<dt>{html.escape(label)}</dt><dd>{shown}</dd>")
    return f"<dl class='machine'>{''.join(items)}</dl>"


def _notebooks_html(runs: list[dict[str, Any]], anonymize: bool) -> str:
    rows = []
    for run in runs:
        links = " &middot; ".join(x for x in (_link(run.get("html"), "HTML"),
                                              _link(run.get("notebook"), "notebook"),
                                              _link(run.get("result"), "JSON"),
                                              _link(run.get("kernel_log"), "kernel log")) if x)
        headline = run.get("headline") or ("" if run.get("ok") else run.get("error") or "failed")
        rows.append(f"<tr class='{'' if run.get('ok') else 'failed'}'><td>{_badge(bool(run.get('ok')))}</td>"
                    f"<td class='name'>{_clean(run.get('name'))}</td>"
                    f"<td class='headline'>{_clean(headline, anonymize)}</td>"
                    f"<td class='num'>{float(run.get('seconds') or 0):.1f} s</td>"
                    f"<td class='name'>{links}</td></tr>")
    return ("<table class='notebooks'><thead><tr><th>outcome</th><th>notebook</th><th>headline</th>"
            f"<th>time</th><th>open</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _failure_html(run: dict[str, Any], anonymize: bool) -> str:
    where = f"cell {run['cell']}" if run.get("cell") is not None else "before any cell ran"
    source = f" at <code>{_clean(run.get('cell_source'), anonymize)}</code>" if run.get("cell_source") else ""
    message = (f"{run['ename']}: {run.get('evalue')}" if run.get("ename") else run.get("error")) or "failed"
    return (f"<div class='fail'><b>{_clean(run.get('name'))}</b>, {html.escape(where)}{source} "
            f"{_link(run.get('html'), 'open the executed notebook')}"
            f"<pre>{_clean(message, anonymize)}</pre></div>")


def _findings_html(findings: list[dict[str, Any]], audit_report: str | None,
                   runs: list[dict[str, Any]], anonymize: bool) -> str:
    if not any(run.get("name") == "01_environment_audit" for run in runs):
        return "<p><small>The environment audit (01) was not part of this report.</small></p>"
    if not findings:
        return "<p>No findings.</p>"
    items = "".join(f"<tr><td><span class='sev sev-{_clean(f.get('severity'))}'>"
                    f"{_clean(f.get('severity'))}</span></td><td><code>{_clean(f.get('code'))}</code></td>"
                    f"<td>{_clean(f.get('title'), anonymize)}</td></tr>" for f in findings)
    more = ""
    if audit_report:
        page = str(Path(audit_report).with_suffix(".html"))
        more = f"<p><small>Evidence and fixes: {_link(page, 'the audit report')}</small></p>"
    return f"<table class='findings'><tbody>{items}</tbody></table>{more}"


# ---------------------------------------------------------------------------------------------
# many machines


def read_report_folder(folder: str | Path) -> dict[str, Any]:
    """A report folder's ``summary.json``; ValueError naming the folder when it is not one."""
    folder = Path(folder)
    path = folder / SUMMARY
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--combine: {folder} is not a report folder (no {SUMMARY}; "
                         "make one with `python -m helpers report --out DIR`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--combine: {folder} is not a report folder ({SUMMARY}: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("notebooks"), list):
        raise ValueError(f"--combine: {folder} is not a report folder ({SUMMARY} has no 'notebooks' list)")
    return redact.redact_data(data)


def combine(folders: list[str | Path], out_dir: str | Path) -> dict[str, Any]:
    """The fleet summary of report folders; writes ``summary.json`` and ``index.html`` into ``out_dir``.

    ``reports`` has one entry per folder, machines that failed a notebook first; ``differences``
    is the audit's diff over the machines whose audit report is in their folder.
    """
    if not folders:
        raise ValueError("--combine needs at least one report folder")
    out = Path(out_dir)
    loaded = [(Path(folder), read_report_folder(folder)) for folder in folders]
    labels = _labels([(folder, s.get("machine") or {}) for folder, s in loaded])
    entries = [_fleet_entry(folder, summary, label, out)
               for (folder, summary), label in zip(loaded, labels, strict=True)]
    entries.sort(key=lambda e: (e["ok"], ))  # stable: failures first, then the order given
    columns = sorted({run["name"] for _, s in loaded for run in s["notebooks"]})
    diff = _audit_diff(entries)
    fleet = {"ok": all(e["ok"] for e in entries),
             "combined": datetime.datetime.now().isoformat(timespec="seconds"),
             "notebooks": columns, "reports": entries, **diff}
    report.atomic_write_json(out / SUMMARY, fleet)
    report.atomic_write_text(out / INDEX, fleet_page(fleet))
    return fleet


def _fleet_entry(folder: Path, summary: dict[str, Any], label: str, out: Path) -> dict[str, Any]:
    link = os.path.relpath(folder.resolve(), out.resolve())
    audit = summary.get("audit_report")
    return {"label": label, "folder": str(folder), "link": link, "ok": bool(summary.get("ok")),
            "started": summary.get("started"), "machine": summary.get("machine") or {},
            "parameters": summary.get("parameters") or {},
            "failed": [run["name"] for run in summary["notebooks"] if not run.get("ok")],
            "findings": summary.get("findings") or [],
            "audit_report": str(folder / audit) if audit and (folder / audit).is_file() else None,
            "notebooks": [{key: run.get(key) for key in ("name", "ok", "headline", "error", "cell",
                                                         "ename", "evalue", "html", "seconds")}
                          for run in summary["notebooks"]]}


def _audit_diff(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The audit's diff over the machines that have an audit report (two or more)."""
    from helpers.audit.diff import diff_reports

    audited = [e for e in entries if e["audit_report"]]
    if len(audited) < 2:
        return {"compared": [e["label"] for e in audited], "identical": None, "differences": []}
    diff = diff_reports([e["audit_report"] for e in audited], [e["label"] for e in audited])
    rows = [{"fact": row["fact"], "relevant": row["relevant"],
             "values": {label: row.get(label) for label in diff.machines}} for row in diff.rows]
    rows += [{"fact": f"finding {row['code']}", "relevant": True,
              "values": {label: row.get(label) or "-" for label in diff.machines}}
             for row in diff.finding_rows]
    return {"compared": diff.machines, "identical": diff.identical, "differences": rows}


def _labels(machines: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """One unique name per report folder: the host; ``host (folder)`` when hosts repeat; the
    folder when anonymised; ``#2`` ... when even those repeat."""
    names = [folder.resolve().name or str(folder) for folder, _ in machines]
    hosts = [machine_label(machine, name) for (_, machine), name in zip(machines, names, strict=True)]
    counts = Counter(hosts)
    labels = [host if counts[host] == 1 or host == name else f"{host} ({name})"
              for host, name in zip(hosts, names, strict=True)]
    return unique_labels(labels, " #")


def fleet_page(fleet: dict[str, Any]) -> str:
    """The fleet's ``index.html`` from the data ``combine()`` wrote to ``summary.json``."""
    entries, columns = fleet["reports"], fleet["notebooks"]
    failed = [e for e in entries if not e["ok"]]
    verdict = (f"All {len(entries)} machines passed every notebook" if not failed
               else f"{len(failed)} of {len(entries)} machines failed a notebook")
    head = "".join(f"<th>{html.escape(name)}</th>" for name in columns)
    rows = [_fleet_row(entry, columns) for entry in entries]
    parts = [_heading(not failed, verdict),
             f"<p class='sub'>{len(entries)} report folders combined "
             f"{html.escape(str(fleet.get('combined', '')))}</p>",
             f"<h2>Machines</h2><table class='fleet'><thead><tr><th>machine</th>{head}</tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>",
             "<h2>Differences between machines (environment audit)</h2>", _differences_html(fleet)]
    return _document(verdict, "".join(parts))


def _fleet_row(entry: dict[str, Any], columns: list[str]) -> str:
    """One machine's row: its name, GPUs, versions and parameters, then a cell per notebook."""
    by_name = {run["name"]: run for run in entry["notebooks"]}
    machine = entry["machine"]
    anonymize = bool(machine.get("anonymized"))
    cells = [_fleet_cell(entry, by_name.get(name), anonymize) for name in columns]
    about = (f"{_clean(machine.get('gpus') or 'GPUs unknown')}<br><small>torch "
             f"{_clean(machine.get('torch'))} &middot; accelerate "
             f"{_clean(machine.get('accelerate'))}</small>")
    if entry.get("parameters"):
        given = ", ".join(f"{k}={v}" for k, v in entry["parameters"].items())
        about += f"<br><small>-p {_clean(given, anonymize)}</small>"
    return (f"<tr class='{'' if entry['ok'] else 'failed'}'><td class='name'>{_badge(entry['ok'])} "
            f"<b>{_link(entry['link'] + '/' + INDEX, entry['label'])}</b><br>{about}</td>"
            f"{''.join(cells)}</tr>")


def _fleet_cell(entry: dict[str, Any], run: dict[str, Any] | None, anonymize: bool) -> str:
    """One notebook's cell of a machine's row: its headline (or error) and a link."""
    if run is None:
        return "<td><small>not run</small></td>"
    text = run.get("headline") or ("" if run.get("ok") else run.get("error") or "failed")
    link = _link(f"{entry['link']}/{run['html']}", "open") if run.get("html") else ""
    return (f"<td class='{'cellok' if run.get('ok') else 'cellbad'}'>"
            f"{'' if run.get('ok') else _badge(False) + ' '}{_clean(text, anonymize)} "
            f"<small>{link}</small></td>")


def _differences_html(fleet: dict[str, Any]) -> str:
    labels, rows = fleet.get("compared") or [], fleet.get("differences") or []
    if len(labels) < 2:
        return ("<p><small>Fewer than two folders hold an environment audit report: nothing to "
                "compare.</small></p>")
    if not rows:
        return f"<p>No differences between {html.escape(', '.join(labels))}.</p>"
    verdict = ("<p>Only informational facts differ.</p>" if fleet.get("identical")
               else "<p><b>Relevant facts differ</b> (highlighted: values that differ from the most "
               "common one).</p>")
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
    body = []
    for row in rows:
        values = [str(row["values"].get(label)) for label in labels]
        common = Counter(values).most_common(1)[0][0]
        cells = "".join(f"<td class='{'diff' if value != common or len(set(values)) == len(values) else ''}'>"
                        f"{_clean(value)}</td>" for value in values)
        relevant = "" if row.get("relevant") else " <small>(informational)</small>"
        body.append(f"<tr><td><code>{_clean(row['fact'])}</code>{relevant}</td>{cells}</tr>")
    return (f"{verdict}<table class='differences'><thead><tr><th>fact</th>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")
