"""Notebook 02 headless (papermill): symptom -> script -> doctor -> fix -> replay -> contrast -> report
-> a plain torchrun job hung right now, attached to, replayed and stopped.

Run with ``symptom = "shape-mismatch-error"`` (the defaults run under nbval in ``make test``), so the
debug-mode contrast runs too, and with secret-bearing variables in the kernel's environment: neither
the executed notebook nor report.md may show them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
from conftest import notebook_text_outputs, run_notebook

from helpers import params

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "audit"))
from secret_env import SECRET_ENV, leaks  # noqa: E402

NOTEBOOK = "02_minimal_repro_builder.ipynb"


def test_notebook_parameters_are_the_documented_ones():
    """papermill reads each parameter's type, default and help (no quote in a comment breaks it)."""
    import papermill

    found = papermill.inspect_notebook(str(REPO / "notebooks" / NOTEBOOK))
    assert {name: p["default"] for name, p in found.items()} == {
        "symptom": '"hangs-at-eval"', "num_processes": "2", "stall_s": "5", "out_dir": '"reports/repro"',
        "from_trace": '""', "results_path": '""'}
    for name, parameter in found.items():
        assert parameter["help"] and parameter["inferred_type_name"] in ("str", "int", "float"), name
        assert name in params.SPECS


def test_notebook_shape_mismatch_end_to_end(tmp_path, leftovers):
    out_dir = tmp_path / "repro"
    results = tmp_path / "result.json"
    nb = run_notebook(NOTEBOOK, tmp_path, {"symptom": "shape-mismatch-error", "out_dir": str(out_dir),
                                           "results_path": str(results), "stall_s": 4.0},
                      timeout=240, env=SECRET_ENV)
    text = notebook_text_outputs(nb)
    assert not leaks(text), leaks(text)
    # the outcome JSON the last cell wrote
    outcome = json.loads(results.read_text())
    assert outcome["ok"] is True, outcome["problems"]
    assert outcome["broken"]["diagnosis"]["kind"] == "shape-mismatch"
    assert outcome["fixed"]["diagnosis"]["verdict"] == "ok"
    assert "(shape-mismatch), culprit ranks" in outcome["headline"], outcome["headline"]
    assert outcome["headline"].endswith("as expected; fixed variant passed"), outcome["headline"]
    # every step shows its result as ordinary output: the script, the diagnosis, the swimlane image,
    # the replay, the contrast of debug modes, the report
    assert "variable_gather_broken.py" in text and "Expected under the doctor" in text
    assert "shape-mismatch" in text and "as expected" in text
    assert any("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))
    assert "variable_gather_broken_replay.py" in text
    assert "DistributedOperationException" in text and "Input shapes" in text
    assert "Detected mismatch between collectives on ranks" in text
    assert "ACCELERATE_DEBUG_MODE=1 torchrun --nproc-per-node 2" in text
    report_md = (out_dir / "report.md").read_text()
    assert not leaks(report_md), leaks(report_md)
    assert "## Reproduction: variable_gather_broken.py" in report_md
    assert "The fixed variant (variable_gather_fixed.py) finishes on every rank." in report_md
    assert json.loads((out_dir / "diagnosis.json").read_text())["kind"] == "shape-mismatch"
    assert not list((REPO / "notebooks").glob("*.py")), "nothing is written into notebooks/"
    # the hung torchrun job: shape mismatches crash, so the section attaches to uneven-eval instead
    assert "crash rather than hang under torchrun" in text
    assert "torchrun --nproc-per-node 2 --master-addr 127.0.0.1" in text
    assert "Read from stacks alone (py-spy)" in text and "attached_replay.py" in text
    assert "no process of the job is left" in text
    attach = outcome["attach"]
    assert attach["named_culprit"] and attach["replay_as_expected"] and attach["left"] == [], attach
    assert (attach["scenario"], attach["kind"]) == ("uneven-eval", "collective-mismatch")
    assert json.loads((out_dir / "attach" / "attached.json").read_text())["source"] == "py-spy"
    job_script = str(out_dir / "attach" / "uneven_eval_broken.py")
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if job_script in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes of the hung job left after the notebook: {left}"
    assert not (out_dir / "attach" / "tmp").exists(), "the job's temporary files are removed"
    leftovers.check()
