"""make report's pages from real runs: the landing page, the failure, --combine's fleet page.

The runs are real (``python -m helpers report`` executing the notebooks with papermill), shared by
every test here and by tests/browser through the session fixture ``report_runs`` (conftest.py).
"""

from __future__ import annotations

import html
import json
import re
import socket
from pathlib import Path

from conftest import REPORT_RUNS, ReportRuns, helpers_report

from helpers import suite_pages
from helpers.audit import AuditOutcome
from helpers.smoke import SmokeResult

NOISE = ("without encryption", "IPKernelApp", "KeyboardInterrupt", "Warning", "WARNING")


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def _page(folder: Path) -> str:
    return (folder / "index.html").read_text()


def test_report_output_is_progress_and_result_only(report_runs: ReportRuns):
    for name in REPORT_RUNS:
        proc = report_runs.output[name]
        assert proc.stderr == "", f"{name} wrote to stderr:\n{proc.stderr}"
        for line in proc.stdout.splitlines():
            assert not any(word in line for word in NOISE), f"noise in {name}'s output: {line!r}"
    lines = report_runs.output["node_a"].stdout.splitlines()
    assert lines[0] == "[1/2] 01_environment_audit ..."
    assert lines[3].startswith("[2/2] 03_smoke_test: ok in ")
    assert "8/8 collectives correct on 2 ranks" in lines[3]


def test_a_report_writes_every_file_and_routes_its_parameters(report_runs: ReportRuns):
    out = report_runs.node_b  # -p num_processes 3 -p max_size_mib 1 -p anonymize True
    assert "[2/2] 03_smoke_test: ok" in report_runs.output["node_b"].stdout
    summary = _summary(out)
    assert summary["parameters"] == {"num_processes": 3, "max_size_mib": 1, "anonymize": True}
    run = next(run for run in summary["notebooks"] if run["name"] == "03_smoke_test")
    assert (run["ok"], run["error"]) == (True, None) and run["seconds"] > 0
    for name in ("03_smoke_test.ipynb", "03_smoke_test.html", "03_smoke_test.json", "index.html"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "03_smoke_test.json").read_text())["world_size"] == 3
    assert "03_smoke_test.html" in _page(out)


def test_every_result_json_has_a_headline_and_summary_repeats_it(report_runs: ReportRuns):
    for folder in (report_runs.node_a, report_runs.node_b):
        summary = _summary(folder)
        assert summary["ok"] is True
        for run in summary["notebooks"]:
            saved = json.loads((folder / run["result"]).read_text())
            assert saved["headline"] and run["headline"] == saved["headline"]
    runs = {run["name"]: run for run in _summary(report_runs.node_b)["notebooks"]}
    assert re.fullmatch(r"\d+/\d+ collectives correct on 3 ranks \(gloo, cpu\); peak busbw all_reduce "
                        r"[\d.e+-]+ GB/s", runs["03_smoke_test"]["headline"])
    assert re.match(r"\d+ error\(s\), \d+ warning\(s\)", runs["01_environment_audit"]["headline"])


def test_landing_page_shows_machine_headlines_findings_and_links(report_runs: ReportRuns):
    folder = report_runs.node_a
    summary, page = _summary(folder), _page(folder)
    machine = summary["machine"]
    assert machine["host"] == socket.gethostname()
    assert f"<dd>{html.escape(machine['host'])}</dd>" in page
    for key in ("torch", "accelerate", "python"):
        assert machine[key] and f"<dd>{html.escape(machine[key])}</dd>" in page, key
    assert "All 2 notebooks passed" in page
    for run in summary["notebooks"]:
        assert html.escape(run["headline"]) in page, run["name"]
        for link in (run["html"], run["notebook"], run["result"]):
            assert f"href='{link}'" in page and (folder / link).is_file(), link
    audit = json.loads((folder / summary["audit_report"]).read_text())
    top = summary["findings"][0]
    assert top["code"] in [f["code"] for f in audit["findings"]]
    assert f"<code>{top['code']}</code>" in page and html.escape(top["title"]) in page
    # self-contained: no script, no stylesheet, font or image fetched from anywhere
    assert "<script" not in page and not re.search(r"(src|href)=['\"]?(https?:)?//", page)


def test_anonymised_audit_anonymises_the_page(report_runs: ReportRuns):
    summary, page = _summary(report_runs.node_b), _page(report_runs.node_b)
    assert summary["machine"]["host"] == "<host>" and summary["machine"]["anonymized"] is True
    assert "&lt;host&gt; (anonymised)" in page
    assert f">{html.escape(socket.gethostname())}<" not in page


def test_failing_notebook_names_notebook_cell_and_parameter(report_runs: ReportRuns):
    proc = report_runs.output["broken"]
    assert proc.returncode == 1
    assert re.search(r"03_smoke_test: FAILED in [\d.]+ s -- cell \d+: ValueError: num_processes must be",
                     proc.stdout), proc.stdout
    summary = _summary(report_runs.broken)
    [run] = summary["notebooks"]
    assert summary["ok"] is False and "ValueError" in run["error"]
    assert run["ok"] is False and isinstance(run["cell"], int) and run["ename"] == "ValueError"
    assert run["evalue"].startswith("num_processes must be") and "validate" in run["cell_source"]
    page = _page(report_runs.broken)
    assert "1 of 1 notebooks failed" in page and "<h2>Failures</h2>" in page
    assert f"cell {run['cell']}" in page and html.escape(run["evalue"]) in page
    assert "the audit did not run" in page  # machine facts from here, no GPU query


def test_combine_puts_machines_side_by_side_failed_first(report_runs: ReportRuns):
    proc = report_runs.output["fleet"]
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one machine failed a notebook
    assert "FAILED: " in proc.stdout and "fleet page: " in proc.stdout
    fleet = _summary(report_runs.fleet)
    assert [Path(e["folder"]).name for e in fleet["reports"]] == ["broken", "node_a", "node_b"]
    assert fleet["notebooks"] == ["01_environment_audit", "03_smoke_test"]
    assert fleet["reports"][0]["failed"] == ["03_smoke_test"]
    assert fleet["reports"][2]["label"] == "node_b"  # anonymised: the folder's name
    assert fleet["reports"][1]["parameters"]["num_processes"] == 2
    assert fleet["reports"][2]["parameters"]["num_processes"] == 3
    page = _page(report_runs.fleet)
    assert page.count("<tr class=") == 3, "one row per machine"
    assert page.index("node_b") > page.index(html.escape(fleet["reports"][1]["label"])) > page.index("broken")
    for entry in fleet["reports"]:
        own = {run["name"]: run for run in _summary(Path(entry["folder"]))["notebooks"]}
        for run in entry["notebooks"]:
            shown = run["headline"] or run["error"]
            assert shown == (own[run["name"]]["headline"] or own[run["name"]]["error"])
            assert html.escape(shown) in page
            if run.get("html"):
                assert (report_runs.fleet / entry["link"] / run["html"]).is_file()
    # the audit's diff: node_b ran with NCCL_DEBUG set (see conftest.REPORT_ENV)
    assert fleet["compared"] == [fleet["reports"][1]["label"], "node_b"] and fleet["identical"] is False
    row = next(r for r in fleet["differences"] if r["fact"] == "env.NCCL_DEBUG")
    assert row["values"]["node_b"] == "WARN"
    assert "<code>env.NCCL_DEBUG</code>" in page and "<td class='diff'>WARN</td>" in page


def test_combine_refuses_a_folder_that_is_not_a_report(report_runs: ReportRuns, tmp_path):
    proc = helpers_report("--combine", str(report_runs.node_a), str(tmp_path), "--out", str(tmp_path / "f"))
    assert proc.returncode == 2 and f"{tmp_path} is not a report folder" in proc.stderr
    proc = helpers_report("--combine", str(report_runs.node_a))
    assert proc.returncode == 2 and "--combine needs --out" in proc.stderr
    assert not (tmp_path / "f").exists()


def test_pages_escape_and_redact_what_they_show():
    secret = "hf_" + "k" * 34
    summary = {"ok": False, "started": "now", "machine": {"host": "<b>h</b>"}, "parameters": {"x": secret},
               "findings": [{"severity": "error", "code": "C", "title": "<img src=x>"}],
               "notebooks": [{"name": "01_environment_audit", "ok": False, "seconds": 1.0,
                              "headline": f"<script>alert(1)</script> {secret}", "cell": 4,
                              "cell_source": "cfg = x", "ename": "ValueError", "evalue": f"bad {secret}"}]}
    page = suite_pages.landing_page(summary)
    assert "<script>" not in page and "<img" not in page and "<b>h</b>" not in page
    assert "&lt;script&gt;" in page and "k" * 34 not in page and "cell 4" in page


def test_outcome_headlines_carry_the_key_figures():
    audit = AuditOutcome("a.json", "a.html", {"error": 1, "warning": 2, "info": 0}, ["X"],
                         top=[{"severity": "error", "code": "SHM_SMALL", "title": "/dev/shm is 64 MiB"}])
    assert audit.headline() == "1 error(s), 2 warning(s); top: [error] SHM_SMALL: /dev/shm is 64 MiB"
    checks = [{"op": "all_reduce", "ok": True}, {"op": "broadcast", "ok": False}]
    bandwidth = [{"op": "all_reduce", "busbw_GBps": 1.5}, {"op": "all_reduce", "busbw_GBps": 2.25}]
    smoke = SmokeResult(True, 2, "gloo", "cpu", checks, bandwidth, [], 1.0)
    assert smoke.headline() == ("1/2 collectives correct on 2 ranks (gloo, cpu); "
                                "peak busbw all_reduce 2.25 GB/s")
