"""Every notebook is committed clean and follows the anatomy papermill and nbval rely on."""

from __future__ import annotations

import json
import re

import papermill
import pytest
from conftest import NOTEBOOKS

ALL = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks():
    assert ALL, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_anatomy(path, caplog):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    declared = papermill.inspect_notebook(str(path))
    assert "results_path" in declared
    assert "Unable to parse" not in caplog.text
    for name, info in declared.items():
        assert info["inferred_type_name"] != "None", f"{name} needs a type annotation"
        assert info["help"], f"{name} needs a help comment"
    title = "".join(nb["cells"][0]["source"])
    assert nb["cells"][0]["cell_type"] == "markdown" and title.startswith("# ")


def _code_cells(nb: dict) -> list[str]:
    return ["".join(cell["source"]) for cell in nb["cells"] if cell["cell_type"] == "code"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_one_validation_shape_and_one_ending(path):
    """The cell after the parameters validates them in one shape; the last cell ends in one shape."""
    cells = _code_cells(json.loads(path.read_text()))
    declared = set(papermill.inspect_notebook(str(path)))
    validation = cells[1]
    match = re.search(r"cfg = (\w+)\.check_config\(params\.validate\((.*?)\)\)\ncfg$", validation, re.S)
    assert match, f"{path.name}: the validation cell is `cfg = X.check_config(params.validate(...))`, `cfg`"
    passed = set(re.findall(r"(\w+)=\1\b", match.group(2)))
    assert passed == declared, f"{path.name}: every parameter validated (missing {declared - passed})"
    ending = ["result.save(cfg.results_path)", "assert result.ok, result.verdict()",
              "print(result.verdict())"]
    assert cells[-1].splitlines()[-3:] == ending, f"{path.name}: the last cell's ending"
    assert re.match(r"result = \w+\.outcome\(", cells[-1]) or path.name.startswith("03_"), cells[-1]
