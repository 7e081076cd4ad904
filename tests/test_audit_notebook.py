"""Notebook 01 run headless with papermill: parameters, errors, secrets, comparison, strict."""

from __future__ import annotations

import copy
import datetime
import json
import sys
from pathlib import Path

import papermill
import pytest
from conftest import notebook_text_outputs, run_notebook

from helpers import audit, params, redact

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
sys.path.insert(0, str(FIXTURES))
from secret_env import NOT_COLLECTED, SECRET_ENV, leaks  # noqa: E402

NOTEBOOK = "01_environment_audit.ipynb"


def test_secret_bearing_environment_and_parameter(tmp_path):
    """20+ secrets in the kernel's environment and one passed as a parameter: the outputs never
    show them, and after scrub_notebook the whole executed file is clean (injected cell, metadata)."""
    results = tmp_path / "results.json"
    nb = run_notebook(NOTEBOOK, tmp_path, {"report_dir": str(tmp_path / "audit"),
                                           "results_path": str(results),
                                           "hf_token": SECRET_ENV["HF_TOKEN"]},
                      env=SECRET_ENV, timeout=120)
    outputs = notebook_text_outputs(nb)
    assert leaks(outputs) == []
    assert "NO_GPU" in outputs and "<th>severity</th>" in outputs
    assert "No comparison" in outputs and "No GPU topology" in outputs
    assert not [name for name in NOT_COLLECTED if name in outputs]
    for written in (tmp_path / "audit" / "audit.json", tmp_path / "audit" / "audit.html", results):
        assert leaks(written.read_text()) == [], written
    result = json.loads(results.read_text())
    assert result["codes"] == ["NO_GPU"] and result["counts"]["error"] == 0
    executed = tmp_path / NOTEBOOK
    assert SECRET_ENV["HF_TOKEN"] in executed.read_text()  # papermill recorded the parameter
    assert redact.scrub_notebook(executed) > 0
    assert leaks(executed.read_text()) == []


def test_bad_compare_with_stops_at_validation(tmp_path):
    with pytest.raises(papermill.PapermillExecutionError) as failure:
        run_notebook(NOTEBOOK, tmp_path, {"report_dir": str(tmp_path / "audit"),
                                          "compare_with": str(tmp_path / "missing.json")}, timeout=120)
    assert failure.value.ename == "ValueError"
    assert "compare_with" in failure.value.evalue and "no such file" in failure.value.evalue
    assert not (tmp_path / "audit").exists()  # nothing ran


def test_compare_anonymize_and_strict(tmp_path):
    """Compared with a GPU node's facts; anonymised; strict fails on an error-level finding
    (a CUDA_VISIBLE_DEVICES with a repeated entry), after the report was written and shown."""
    with pytest.raises(papermill.PapermillExecutionError) as failure:
        run_notebook(NOTEBOOK, tmp_path, {"report_dir": str(tmp_path / "audit"),
                                          "compare_with": str(FIXTURES / "healthy_8gpu.json"),
                                          "anonymize": True, "strict": True},
                     env={"CUDA_VISIBLE_DEVICES": "0,0"}, timeout=120)
    assert failure.value.ename == "AssertionError"
    assert "CUDA_VISIBLE_DEVICES_INVALID" in failure.value.evalue
    import nbformat

    nb = nbformat.read(str(tmp_path / NOTEBOOK), as_version=4)
    outputs = notebook_text_outputs(nb)
    assert "Relevant facts are <b>different</b>" in outputs
    assert "healthy_8gpu" in outputs and "gpus.models" in outputs
    report = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert report["facts"]["hostname"] == "<host>"
    assert report["findings"][0]["code"] == "CUDA_VISIBLE_DEVICES_INVALID"


def test_widget_panel_filters_reruns_compares_an_upload_and_exports(tmp_path):
    """The notebook's panel (no kernel needed): severity filter, re-run, upload, export, bad path."""
    cfg = params.validate(report_dir=str(tmp_path / "p"), compare_with="", anonymize=False)
    panel = audit.panel(cfg)
    assert list(panel.buttons) == ["Re-run audit", "Export"]
    assert panel.controls["min_severity"].options == ("info", "warning", "error")
    content = (FIXTURES / "healthy_8gpu.json").read_bytes()
    panel.uploads["compare_with"].value = ({"name": "node-7.json", "type": "application/json",
                                            "size": len(content), "content": memoryview(content),
                                            "last_modified": datetime.datetime.now(datetime.UTC)},)
    assert panel.values["compare_with"] == str(tmp_path / "p" / "uploads" / "node-7.json")
    result = panel.click("Re-run audit")
    assert panel.error is None and result.min_severity == "warning"
    assert "No findings at severity warning" in result._repr_html_()  # NO_GPU is info
    assert result.diff is not None and not result.diff.identical
    assert (tmp_path / "p" / "audit.json").is_file() and (tmp_path / "p" / "audit.html").is_file()

    exported = panel.click("Export")
    assert panel.error is None and exported.json_path == str(tmp_path / "p" / "export" / "audit.json")
    shared = json.loads(Path(exported.json_path).read_text())
    assert shared["facts"]["hostname"] == "<host>"
    assert json.loads((tmp_path / "p" / "audit.json").read_text())["facts"]["hostname"] != "<host>"

    panel.controls["compare_with"].value = str(tmp_path / "missing.json")
    panel.click()
    assert panel.error.startswith("ValueError: compare_with: no such file")
    panel.click("Export")  # a stale compare_with does not block an export
    assert panel.error is None and Path(panel.result.json_path).is_file()


def test_outcome_ok_strict_missing_files_and_saved_json(tmp_path):
    """The notebook's last cell (no kernel needed): ok when both report files exist; under strict,
    error-level findings fail it; the saved JSON keeps the keys the notebook wrote before."""
    facts = copy.deepcopy(json.loads((FIXTURES / "healthy_8gpu.json").read_text()))
    facts["torch"]["cuda"] = None  # TORCH_CPU_BUILD_WITH_GPUS: an error
    verdicts = audit.judge(facts)
    files = audit.write_report(verdicts, tmp_path / "audit")

    relaxed = audit.outcome(params.validate(strict=False), verdicts, files)
    assert relaxed.ok and "1 error(s)" in relaxed.verdict() and files.json_path in relaxed.verdict()
    saved = json.loads(relaxed.save(str(tmp_path / "results.json")).read_text())
    assert list(saved)[:4] == ["report_json", "report_html", "counts", "codes"]
    assert saved["report_json"] == str(tmp_path / "audit" / "audit.json")
    assert saved["report_html"] == str(tmp_path / "audit" / "audit.html")
    assert saved["counts"] == {"error": 1, "warning": 0, "info": 0}
    assert saved["codes"] == ["TORCH_CPU_BUILD_WITH_GPUS"] and saved["ok"] is True
    assert relaxed.save("") is None  # results_path empty: nothing written

    strict = audit.outcome(params.validate(strict=True), verdicts, files)
    assert not strict.ok
    assert strict.verdict().startswith("error-level findings: TORCH_CPU_BUILD_WITH_GPUS: ")
    healthy = audit.judge(json.loads((FIXTURES / "healthy_8gpu.json").read_text()))
    assert audit.outcome(params.validate(strict=True), healthy, files).ok

    (tmp_path / "audit" / "audit.html").unlink()
    missing = audit.outcome(params.validate(strict=False), verdicts, files)
    assert not missing.ok and missing.verdict() == "the report was not written"
    nowhere = audit.outcome(params.validate(strict=False), verdicts, audit.write_report(verdicts))
    assert not nowhere.ok and nowhere.report_json is None
