"""Notebook 04 headless with papermill: a small budget runs every section; bad inputs stop early."""

from __future__ import annotations

import json
import time

import papermill
import pytest
from conftest import notebook_text_outputs, run_notebook

from helpers import memory

NOTEBOOK = "04_batch_size_explorer.ipynb"


@pytest.fixture(autouse=True, scope="module")
def _torch_optimizer_loaded():
    """The kernel's first optimizer step imports torch._dynamo, which creates torch's per-user
    cache folder in the temp folder; create it here first, so it is not counted as a leftover."""
    memory.warm_up()


def test_small_budget_runs_every_section_and_writes_results(tmp_path, leftovers):
    results = tmp_path / "sizes.json"
    nb = run_notebook(NOTEBOOK, tmp_path, {"memory_budget_mib": 64, "starting_batch_size": 512,
                                           "results_path": str(results)})
    data = json.loads(results.read_text())
    search, baseline = (next(s for s in data["strategies"] if s["strategy"] == name)
                        for name in ("search", "accelerate"))
    assert search["confirmed"] and search["found"] >= 0.98 * baseline["found"]
    assert data["budget_bytes"] == 64 << 20 and len(baseline["probes"]) > 10
    assert data["ok"] is True and data["problems"] == []
    assert data["headline"].startswith(f"batch size {search['found']} (search) for mlp under 64.0 MiB")
    assert f"accelerate found {baseline['found']}" in data["headline"]
    assert "2 ranks agreed on" in data["headline"]
    assert data["across_ranks"]["agreed"] is True and data["across_ranks"]["num_processes"] == 2
    assert data["across_ranks"]["rank_budgets_bytes"][0] == 16 << 20  # a quarter of 64 MiB
    text = notebook_text_outputs(nb)
    assert "DefaultCPUAllocator: can't allocate memory" in text  # the first try's genuine error
    assert "fits 3/3 in fresh processes" in text
    assert "2 rank(s)" in text  # the across-ranks section ran on two ranks
    assert "keeps global" in text  # the effective-batch advice
    outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
    assert any("image/png" in out.get("data", {}) for out in outputs), "the plot is a cell output"
    assert f"search: {search['found']}" in text  # the outcome line
    leftovers.check()


@pytest.mark.parametrize("name, value, message", [
    ("model", "missing/model.py:build", "model: file not found"),
    ("starting_batch_size", 0, "starting_batch_size must be an integer in 1..16777216; got 0"),
])
def test_bad_inputs_stop_at_validation(tmp_path, name, value, message, leftovers):
    started = time.monotonic()
    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_notebook(NOTEBOOK, tmp_path, {name: value})
    assert info.value.ename == "ValueError" and message in info.value.evalue
    assert "cfg = memory.check_config(params.validate(" in info.value.source, \
        "the validation cell must be the one that stops"
    assert time.monotonic() - started < 60
    leftovers.check()
