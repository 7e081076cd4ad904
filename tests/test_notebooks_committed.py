"""Every notebook is committed clean and follows the anatomy papermill and nbval rely on."""

from __future__ import annotations

import json

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
