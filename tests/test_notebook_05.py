"""Notebook 05 headless with papermill: other ranks, stop rank and step; show_hang off; bad stop_rank."""

from __future__ import annotations

import json
import time

import papermill
import pytest
from conftest import notebook_text_outputs, run_notebook

NOTEBOOK = "05_early_stop_sync.ipynb"


def _images(nb: dict) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb["cells"] for out in cell.get("outputs", []))


def test_three_ranks_with_the_last_rank_stopping_at_step_1(tmp_path, leftovers):
    results = tmp_path / "early_stop.json"
    started = time.monotonic()
    nb = run_notebook(NOTEBOOK, tmp_path, {"num_processes": 3, "stop_rank": 2, "stop_step": 1,
                                           "stall_s": 3.0, "results_path": str(results)})
    data = json.loads(results.read_text())
    broken, fixed = data["broken"], data["fixed"]
    assert broken["ok"] and fixed["ok"]
    diagnosis = broken["diagnosis"]
    verdict = (diagnosis["verdict"], diagnosis["kind"], diagnosis["ranks"])
    assert verdict == ("hang", "collective-mismatch", [2])
    ops = [(r["rank"], r["op"]) for r in diagnosis["per_rank"]]
    assert ops == [(0, "all_reduce"), (1, "all_reduce"), (2, "barrier")]
    assert diagnosis["detected_after_s"] < 3.0 + 3
    assert [(r["rank"], r["stopped_at"]) for r in fixed["ranks"]] == [(0, 1), (1, 1), (2, 1)]
    assert data["headline"].startswith("broken loop: hang (collective-mismatch) on rank(s) [2] found ")
    assert "s after progress stopped; fixed loop: all 3 ranks stopped at step 1 in " in data["headline"]
    text = notebook_text_outputs(nb)
    assert "broken loop on 3 ranks, rank 2 decided to stop at step 1" in text
    assert "every rank stopped at step 1 together" in text
    assert "issued by DDP inside backward()" in text  # the diagnosis table is an ordinary output
    assert "DIVERGENT_BREAK" in text and "NONEXISTENT_API" in text  # the lint ran before the loop
    assert _images(nb) == 1, "the swimlane is a cell output"
    cluster = data["cluster"]  # the same loop as a 3-node job, the doctor inside every rank
    assert cluster["ok"] and cluster["nodes"] == 3 and cluster["rank_codes"] == {"0": 3, "1": 3, "2": 3}
    assert (cluster["diagnosis"]["kind"], cluster["diagnosis"]["ranks"]) == ("collective-mismatch", [2])
    assert all(" -m helpers.doctor " in line and "--master-addr 127.0.0.1" in line
               for line in cluster["commands"])
    assert "srun --nodes 3" in text and "3-node job under -m helpers.doctor: hang" in text
    assert "3-node job: collective-mismatch on rank(s) [2], every agent ended" in data["headline"]
    assert time.monotonic() - started < 150
    leftovers.check()


def test_show_hang_false_runs_only_the_fixed_loop(tmp_path, leftovers):
    results = tmp_path / "fixed.json"
    nb = run_notebook(NOTEBOOK, tmp_path, {"stop_rank": 0, "stop_step": 4, "show_hang": False,
                                           "results_path": str(results)})
    data = json.loads(results.read_text())
    assert data["broken"] is None and data["cluster"] is None and data["fixed"]["ok"]
    assert data["headline"].startswith("broken loop skipped; fixed loop: all 2 ranks stopped at step 4")
    assert [r["stopped_at"] for r in data["fixed"]["ranks"]] == [4, 4]
    text = notebook_text_outputs(nb)
    assert "the broken run was skipped" in text and "broken loop: skipped" in text
    assert _images(nb) == 0
    leftovers.check()


def test_bad_stop_rank_stops_at_validation(tmp_path, leftovers):
    started = time.monotonic()
    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_notebook(NOTEBOOK, tmp_path, {"num_processes": 2, "stop_rank": 2})
    message = "stop_rank must be an integer in 0..1 (a rank below num_processes=2); got 2"
    assert info.value.ename == "ValueError" and message in info.value.evalue
    assert "cfg = early_stop.check_config(params.validate(" in info.value.source, \
        "the validation cell must be the one that stops"
    assert time.monotonic() - started < 60
    leftovers.check()
