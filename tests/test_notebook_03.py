"""Notebook 03 headless with papermill: other parameters work, bad ones stop at validation."""

from __future__ import annotations

import json
import time

import papermill
import pytest
from conftest import notebook_text_outputs, run_notebook


def test_runs_with_three_ranks_and_writes_results(tmp_path, leftovers):
    results = tmp_path / "smoke.json"
    nb = run_notebook("03_smoke_test.ipynb", tmp_path, {
        "num_processes": 3, "max_size_mib": 1, "timeout_s": 60, "results_path": str(results)})
    data = json.loads(results.read_text())
    assert data["ok"] and data["world_size"] == 3
    text = notebook_text_outputs(nb)
    assert "PASS: 8 collectives correct on 3 ranks" in text
    assert any("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])), \
        "the bandwidth plot must be an ordinary cell output"
    leftovers.check()


@pytest.mark.parametrize("name, value, message", [
    ("num_processes", 0, "num_processes must be an integer in 1..64; got 0"),
    ("num_processes", "two", "num_processes must be an integer in 1..64; got 'two'"),
    ("timeout_s", -1, "timeout_s must be a number > 0"),
])
def test_bad_parameters_fail_fast_naming_the_parameter(tmp_path, name, value, message, leftovers):
    started = time.monotonic()
    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_notebook("03_smoke_test.ipynb", tmp_path, {name: value})
    assert info.value.ename == "ValueError"
    assert message in info.value.evalue
    assert time.monotonic() - started < 30
    leftovers.check()
