"""helpers.lint: the static check for collective divergence.

Fixtures in tests/fixtures/lint mark every line that must be flagged with ``# expect: CODE``; the
lint must report exactly those (code, cell, line) and nothing else, so the ``*_ok`` fixtures (the
look-alikes) must come out clean.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import collectives, lint, params

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "lint"
SCENARIOS = REPO / "helpers" / "scenarios"
MARKER = re.compile(r"#\s*expect:\s*([A-Z_, ]+)")

# catalog scenarios (file stem) -> the rule that must flag their broken variant
STATIC_SCENARIOS = {"early_stop": "DIVERGENT_BREAK", "main_only_collective": "MAIN_ONLY_COLLECTIVE",
                    "in_order_logging": "MAIN_ONLY_COLLECTIVE", "one_branch_barrier": "ONE_SIDED_BARRIER"}
# catalog scenarios whose bug only shows at run time: every rank runs the same collectives in the code
DYNAMIC_SCENARIOS = {
    "dead_rank": "a rank is killed from outside (as by the OOM killer)",
    "stuck_compute": "one rank's compute loop never converges; no collective is skipped",
    "uneven_eval": "uneven batches come from a dataloader setting (even_batches=False)",
    "variable_gather": "the gathered tensors' shapes differ between ranks",
}


def expected_markers(path: Path) -> set[tuple[int | None, int, str]]:
    """(cell, line, code) of every ``# expect: CODE`` marker in a fixture."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        sources = [(n, "".join(c["source"])) for n, c in enumerate(cells, 1) if c["cell_type"] == "code"]
    else:
        sources = [(None, path.read_text())]
    found = set()
    for cell, source in sources:
        for line, text in enumerate(source.split("\n"), start=1):
            match = MARKER.search(text)
            if match:
                found |= {(cell, line, code.strip()) for code in match.group(1).split(",") if code.strip()}
    return found


# subfolders are packages the fixtures import (evalpkg/): their modules that are neither *_bad nor *_ok
# are helpers, which must come out clean
FIXTURE_FILES = sorted(p for p in FIXTURES.rglob("*") if p.suffix in (".py", ".ipynb")
                       and "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_findings_match_markers(path):
    result = lint.lint_paths(path)
    found = {(f.cell, f.line, f.code) for f in result.findings}
    expected = expected_markers(path)
    assert found == expected, f"unexpected: {sorted(found - expected)}; missed: {sorted(expected - found)}"
    if path.stem.endswith("_bad"):
        assert expected, "a *_bad fixture must mark what it expects"
    else:
        assert not expected and result.ok


def test_every_rule_has_positive_and_negative_fixtures():
    names = {p.name for p in FIXTURE_FILES}
    for code in lint.RULES:
        stem = code.lower()
        assert any(n.startswith(f"{stem}_bad.") for n in names), f"no positive fixture for {code}"
        assert any(n.startswith(f"{stem}_ok.") for n in names), f"no negative fixture for {code}"
        assert any(code == c for p in FIXTURE_FILES for _, _, c in expected_markers(p))


# The look-alikes the issue names, each next to the same code with the bug: the bug is flagged,
# the look-alike is not.
LOOKALIKES = {
    "rank-conditional print": (
        "if accelerator.is_main_process:\n    print(loss)\n",
        "if accelerator.is_main_process:\n    print(accelerator.gather(loss))\n",
        "MAIN_ONLY_COLLECTIVE"),
    "collective in both branches": (
        "if accelerator.is_main_process:\n    x = accelerator.gather(t)\n"
        "else:\n    x = accelerator.gather(t)\n",
        "if accelerator.is_main_process:\n    x = accelerator.gather(t)\nelse:\n    x = t\n",
        "MAIN_ONLY_COLLECTIVE"),
    "barrier in both branches": (
        "if rank == 0:\n    dist.barrier()\nelse:\n    dist.barrier()\n",
        "if rank == 0:\n    dist.barrier()\nelse:\n    print(rank)\n",
        "ONE_SIDED_BARRIER"),
    "break on check_trigger()": (
        "for batch in loader:\n    accelerator.backward(model(batch))\n"
        "    if accelerator.check_trigger():\n        break\n",
        "for batch in loader:\n    accelerator.backward(model(batch))\n"
        "    if model(batch).item() < 0.1:\n        break\n",
        "DIVERGENT_BREAK"),
    "break on a value from accelerator.reduce, through a local variable": (
        "for batch in loader:\n    loss = model(batch)\n    accelerator.backward(loss)\n"
        "    mean = accelerator.reduce(loss, 'mean')\n    value = mean.item()\n"
        "    if value < 0.1:\n        break\n",
        "for batch in loader:\n    loss = model(batch)\n    accelerator.backward(loss)\n"
        "    mean = loss.mean()\n    value = mean.item()\n    if value < 0.1:\n        break\n",
        "DIVERGENT_BREAK"),
    "break on a gathered or broadcast value": (
        "for batch in loader:\n    loss = model(batch)\n    accelerator.backward(loss)\n"
        "    if accelerator.gather(loss).mean() < 0.1 or broadcast(loss) < 0.1:\n        break\n",
        "for batch in loader:\n    loss = model(batch)\n    accelerator.backward(loss)\n"
        "    if loss.mean() < 0.1:\n        break\n",
        "DIVERGENT_BREAK"),
    "accelerator.save on the main process": (
        "if accelerator.is_main_process:\n    accelerator.save(state, 'model.pt')\n",
        "if accelerator.is_main_process:\n"
        "    accelerator.save(accelerator.get_state_dict(model), 'model.pt')\n",
        "MAIN_ONLY_COLLECTIVE"),
    "accelerator.print": (
        "accelerator.print(loss)\nif accelerator.is_main_process:\n    accelerator.print(loss)\n",
        "if accelerator.is_main_process:\n    accelerator.print(accelerator.gather(loss))\n",
        "MAIN_ONLY_COLLECTIVE"),
    "barrier after the rank-only block": (
        "if accelerator.is_main_process:\n    accelerator.save(state, 'a.pt')\n"
        "accelerator.wait_for_everyone()\n",
        "if accelerator.is_main_process:\n    accelerator.save(state, 'a.pt')\n"
        "    accelerator.wait_for_everyone()\n",
        "ONE_SIDED_BARRIER"),
}
PRELUDE = ("import torch.distributed as dist\nfrom accelerate import Accelerator\n"
           "from accelerate.utils import broadcast\naccelerator = Accelerator()\n")


@pytest.mark.parametrize("name", LOOKALIKES)
def test_lookalike_is_clean_and_its_buggy_twin_is_flagged(name):
    clean, buggy, code = LOOKALIKES[name]
    assert lint.lint_source(PRELUDE + clean).findings == []
    assert code in lint.lint_source(PRELUDE + buggy).codes()


def test_finding_fields_and_fix_name_the_notebook():
    result = lint.lint_paths(FIXTURES / "divergent_break_bad.py")
    finding = result.findings[0]
    assert (finding.code, finding.line, finding.cell) == ("DIVERGENT_BREAK", 27, None)
    assert finding.file.endswith("divergent_break_bad.py")
    assert "loss.item() < 0.001" in finding.message and "accelerator.backward" in finding.message
    assert "set_trigger" in finding.fix and "check_trigger" in finding.fix
    assert params.NB_EARLY_STOP in finding.fix  # the notebook's path, as the doctor's fixes name it
    assert finding.where == f"{finding.file}:27"
    for found in lint.lint_paths(FIXTURES / "one_sided_barrier_bad.py").findings:
        assert params.NB_REPRO in found.fix
    api_findings = lint.lint_paths(FIXTURES / "nonexistent_api_bad.py").findings
    fixes = {f.message.split("`")[1]: f.fix for f in api_findings}
    assert fixes["accelerator.set_breakpoint"].startswith("Use `accelerator.set_trigger`.")
    assert params.NB_EARLY_STOP in fixes["accelerator.check_breakpoint"]
    assert fixes["self.accelerator.world_size"] == "Use `self.accelerator.num_processes`."


def test_notebook_findings_name_cell_and_line():
    result = lint.lint_paths(FIXTURES / "notebook_cells_bad.ipynb")
    [finding] = result.findings
    assert (finding.cell, finding.line) == (6, 3)
    assert finding.where.endswith("notebook_cells_bad.ipynb, cell 6, line 3")
    assert "`evaluate()` runs `accelerator.gather_for_metrics` (cell 4, line 3)" in finding.message


def test_result_html_and_json(tmp_path):
    paths = [FIXTURES / f"main_only_collective_{kind}.py" for kind in ("bad", "ok")]
    result = lint.lint_paths(paths)
    page = result._repr_html_()
    count = len(expected_markers(paths[0]))
    assert "<table>" in page and "MAIN_ONLY_COLLECTIVE" in page and f"{count} findings in 2 files" in page
    assert "&lt;" not in lint.lint_source("x = 1")._repr_html_()
    data = json.loads(result.to_json(tmp_path / "r.json"))
    assert data == json.loads((tmp_path / "r.json").read_text())
    assert set(data["findings"][0]) == {"code", "file", "line", "cell", "message", "fix"}


def test_cli_exit_codes_and_json(tmp_path, capsys):
    out = tmp_path / "findings.json"
    assert lint.cli_main([str(FIXTURES / "divergent_break_ok.py")]) == 0
    assert "no divergence found in 1 file" in capsys.readouterr().out
    assert lint.cli_main([str(FIXTURES), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "divergent_break_bad.py:27: DIVERGENT_BREAK" in text and "fix: " in text
    findings = json.loads(out.read_text())["findings"]
    assert {f["code"] for f in findings} == set(lint.RULES)
    assert len(findings) == sum(len(expected_markers(p)) for p in FIXTURE_FILES)


def test_cli_bad_usage_exits_2(tmp_path, capsys):
    assert lint.cli_main([str(tmp_path / "missing.py")]) == 2
    assert f"'{tmp_path / 'missing.py'}' does not exist" in capsys.readouterr().err
    assert lint.cli_main([]) == 2
    assert lint.cli_main([str(tmp_path)]) == 2
    assert "no .py or .ipynb file" in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\nfor x in range(3)\n    print(x)\n")
    assert lint.cli_main([str(broken)]) == 2
    assert f"{broken}:3: syntax error" in capsys.readouterr().err
    notebook = json.loads((FIXTURES / "notebook_cells_bad.ipynb").read_text())
    notebook["cells"][5]["source"] = "x = 1\nif x\n    pass\n"
    (tmp_path / "nb.ipynb").write_text(json.dumps(notebook))
    assert lint.cli_main([str(tmp_path / "nb.ipynb")]) == 2
    assert "nb.ipynb, cell 6, line 2: syntax error" in capsys.readouterr().err
    (tmp_path / "nb.ipynb").write_text("{not json")
    assert lint.cli_main([str(tmp_path / "nb.ipynb")]) == 2
    with pytest.raises(ValueError, match="paths"):
        lint.lint_paths([])


def test_ipython_lines_keep_line_numbers():
    code = "%time x = 1\nif x:\n    !ls\n    y = %env HOME\n    obj?\nfiles = !ls\n%%not-first\nz = 2"
    converted = lint._python_lines(code)
    ast.parse(converted)
    assert converted.split("\n") == ["pass", "if x:", "    pass", "    y = None", "    pass", "files = None",
                                     "pass", "z = 2"]
    assert lint._python_lines("%%bash\nfor x in\n") == "\n\n"
    assert lint._python_lines("%%time\nx = (1 +\n2)") == "\nx = (1 +\n2)"


def test_cli_imports_neither_torch_nor_accelerate():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "helpers", "lint",
                           str(FIXTURES / "cuda_before_launch_bad.ipynb")],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "CUDA_BEFORE_LAUNCH" in proc.stdout
    names = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    modules = {name.split(".")[0] for name in names}
    assert "helpers" in modules and not modules & {"torch", "accelerate", "numpy"}
    assert not names & {"helpers.launch", "helpers.trace", "helpers.doctor"}, "lint stays a light leaf user"


def test_torch_distributed_collectives_are_the_one_table():
    assert set(lint.DIST_COLLECTIVES) == collectives.COLLECTIVES
    assert lint.DIST_COLLECTIVES["monitored_barrier"] == "is a barrier"
    assert lint.DIST_COLLECTIVES["all_to_all_single"] == "is a torch.distributed collective"
    assert not set(lint.DIST_COLLECTIVES) & collectives.P2P_OPS  # one peer: not every rank calls it


def test_two_thousand_lines_in_well_under_a_second():
    unit = "\n".join((FIXTURES / name).read_text() for name in (
        "divergent_break_bad.py", "divergent_break_ok.py", "main_only_collective_bad.py"))
    source = "\n".join([unit] * (2000 // unit.count("\n") + 1))
    assert source.count("\n") >= 2000
    lint.lint_source("x = 1")  # the first call reads accelerate's names: part of the CLI figure, not this one
    start = time.perf_counter()
    result = lint.lint_source(source, "big.py")
    elapsed = time.perf_counter() - start
    assert len(result.findings) > 50
    assert elapsed < 1.0, f"{elapsed:.2f} s for {source.count(chr(10))} lines"


def test_accelerate_names_read_from_source_match_the_installed_package():
    import accelerate
    import accelerate.utils

    api = lint._accelerate_api()
    assert api.version == accelerate.__version__
    public = {name for name in dir(accelerate.Accelerator) if not name.startswith("_")}
    assert public <= api.accelerator, sorted(public - api.accelerator)
    assert {"set_trigger", "check_trigger", "gather_for_metrics", "flag_tensor"} <= api.accelerator
    assert not set(lint.MISREMEMBERED) & (api.accelerator | public)
    for module in (accelerate, accelerate.utils):
        names = {n for n in dir(module) if not n.startswith("_")}
        assert names <= api.modules[module.__name__], sorted(names - api.modules[module.__name__])


# --- the scenario catalog ----------------------------------------------------------------------


class _BakeVariant(ast.NodeTransformer):
    """The script as generated for one variant: ``variant == "broken"`` folded, dead branches dropped."""

    def __init__(self, variant: str):
        self.variant = variant

    def visit_Compare(self, node):
        self.generic_visit(node)
        left, right = node.left, node.comparators[0]
        if isinstance(left, ast.Constant):
            left, right = right, left
        named = isinstance(left, ast.Name) and left.id.lower() == "variant"
        try:
            value = ast.literal_eval(right)
        except ValueError:
            return node
        if len(node.ops) != 1 or not named:
            return node
        op = node.ops[0]
        if isinstance(op, (ast.In, ast.NotIn)):
            return ast.Constant((self.variant in value) == isinstance(op, ast.In))
        if isinstance(op, (ast.Eq, ast.NotEq)):
            return ast.Constant((self.variant == value) == isinstance(op, ast.Eq))
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        short = isinstance(node.op, ast.Or)  # the value that decides the whole expression
        kept = []
        for value in node.values:
            if _is_bool(value):
                if value.value is short:
                    return ast.Constant(short)
                continue
            kept.append(value)
        if not kept:
            return ast.Constant(not short)
        return kept[0] if len(kept) == 1 else ast.BoolOp(node.op, kept)

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and _is_bool(node.operand):
            return ast.Constant(not node.operand.value)
        return node

    def visit_If(self, node):
        self.generic_visit(node)
        if _is_bool(node.test):
            return (node.body if node.test.value else node.orelse) or [ast.Pass()]
        return node

    def visit_IfExp(self, node):
        self.generic_visit(node)
        if _is_bool(node.test):
            return node.body if node.test.value else node.orelse
        return node

    def visit_Assign(self, node):
        self.generic_visit(node)
        if any(isinstance(t, ast.Name) and t.id == "VARIANT" for t in node.targets):
            node.value = ast.Constant(self.variant)
        return node


def _is_bool(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, bool)


def baked(source: str, variant: str) -> str:
    tree = _BakeVariant(variant).visit(ast.parse(source))
    return ast.unparse(ast.fix_missing_locations(tree))


SCENARIO_FILES = sorted(p for p in SCENARIOS.glob("*.py") if not p.name.startswith("_")) \
    if SCENARIOS.is_dir() else []


@pytest.mark.skipif(not SCENARIO_FILES, reason="the scenario catalog (helpers/scenarios) is not there yet")
@pytest.mark.parametrize("path", SCENARIO_FILES, ids=lambda p: p.stem)
def test_catalog_broken_variant_flagged_fixed_variant_clean(path):
    fixed_source, broken_source = baked(path.read_text(), "fixed"), baked(path.read_text(), "broken")
    fixed = lint.lint_source(fixed_source, f"{path.name}[fixed]")
    assert fixed.findings == [], fixed.text()
    broken = lint.lint_source(broken_source, f"{path.name}[broken]")
    if broken_source.replace("'broken'", "'fixed'") == fixed_source or path.stem in DYNAMIC_SCENARIOS:
        # healthy training has no broken variant; dynamic bugs are the doctor's business
        assert path.stem not in STATIC_SCENARIOS
        return
    assert broken.findings, (f"the lint does not flag scenario {path.stem!r}; if its bug cannot be seen "
                             "statically, list it in DYNAMIC_SCENARIOS with the reason")
    expected = STATIC_SCENARIOS.get(path.stem)
    if expected:
        assert expected in broken.codes(), broken.text()


def test_variant_baking_folds_conditions():
    source = ("VARIANT = 'broken'\ndef f(variant=VARIANT, rank=0):\n"
              "    if variant == 'broken' and rank == 1:\n        a()\n    else:\n        b()\n"
              "    if not variant != 'fixed' or rank:\n        c()\n"
              "    x = d() if variant in ('fixed',) else e()\n")
    fixed, broken = baked(source, "fixed"), baked(source, "broken")
    assert "VARIANT = 'fixed'" in fixed
    calls = [n.func.id for n in ast.walk(ast.parse(fixed)) if isinstance(n, ast.Call)]
    assert sorted(calls) == ["b", "c", "d"]
    assert "if rank == 1:" in broken and "if rank:" in broken and "x = e()" in broken


# --- metrics from code the lint cannot read (or reads in another file) -------------------------


def test_accelerate_shipped_scripts_have_no_divergent_break():
    """Real distributed programs that pass accelerate's CI: no DIVERGENT_BREAK (none judged real)."""
    import importlib.util

    root = Path(list(importlib.util.find_spec("accelerate").submodule_search_locations)[0])
    scripts = root / "test_utils" / "scripts"
    result = lint.lint_paths(scripts)
    assert len(result.files) >= 10
    assert "DIVERGENT_BREAK" not in result.codes(), result.text()


def test_opaque_metric_names_the_call_and_the_callee():
    result = lint.lint_paths(FIXTURES / "divergent_break_opaque_bad.py")
    findings = {f.line: f.message for f in result.findings}
    assert "`evaluate(model, val_loader)` (line 17)" in findings[23]
    assert "unless evaluate() reduces across ranks" in findings[23] and "`val_loader`" in findings[23]
    assert "unless compute_metrics() reduces across ranks" in findings[41]
    assert "unless self.evaluate() reduces across ranks" in findings[56]
    assert "unless trainer.evaluate() reduces across ranks" in findings[65]
    # followed into evalpkg/metrics.py: it says where, not "unless"
    assert "`local_loss` (metrics.py, line 6)" in findings[32] and "unless" not in findings[32]


def _chain(folder: Path, depth: int) -> Path:
    """train.py -> m1.score -> ... -> m<depth>.score, which gathers: readable only within the bounds."""
    for level in range(1, depth + 1):
        body = (f"from m{level + 1} import score as inner\n\n\ndef score(model, loader):\n"
                "    return inner(model, loader)\n") if level < depth else (
            "def score(model, loader, accelerator=None):\n"
            "    return sum(accelerator.gather_for_metrics(model(b)) for b in loader)\n")
        (folder / f"m{level}.py").write_text(body)
    script = folder / "train.py"
    script.write_text("from accelerate import Accelerator\nfrom m1 import score\n"
                      "accelerator = Accelerator()\nfor epoch in range(9):\n    for batch in loader:\n"
                      "        accelerator.backward(model(batch))\n"
                      "    if score(model, val_loader) < 0.1:\n        break\n")
    return script


@pytest.mark.parametrize("depth", [1, lint.MAX_FOLLOW_DEPTH, lint.MAX_FOLLOW_DEPTH + 1])
def test_imports_are_followed_within_the_bounds(tmp_path, depth):
    result = lint.lint_paths(_chain(tmp_path, depth))
    if depth <= lint.MAX_FOLLOW_DEPTH:
        assert result.ok, result.text()  # read down to the gather
    else:
        [finding] = result.findings  # the last module is too deep to read: opaque, given the loader
        assert "`score` (m1.py, line 4) returns it without reducing it" in finding.message


def test_packages_relative_imports_and_cycles(tmp_path):
    package = tmp_path / "proj" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .evals import local\n")
    (package / "evals.py").write_text("from . import cycle\n\n\ndef local(model, dl):\n"
                                      "    return [model(b) for b in dl]\n")
    (package / "cycle.py").write_text("from .evals import local\n")
    script = tmp_path / "proj" / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text("import pkg\nfrom accelerate import Accelerator\naccelerator = Accelerator()\n"
                      "def fit(model, loader, eval_dl):\n    for batch in loader:\n"
                      "        accelerator.backward(model(batch))\n"
                      "        if pkg.local(model, eval_dl)[0] < 0.1:\n            break\n")
    [finding] = lint.lint_paths(script).findings  # pkg found one folder up, re-export followed
    assert finding.line == 8 and "`pkg.local` (evals.py, line 4)" in finding.message
    # the same text with no file behind it follows nothing: opaque
    [opaque] = lint.lint_source(script.read_text(), "train.py").findings
    assert "unless pkg.local() reduces across ranks" in opaque.message


def test_a_dataloader_to_len_or_a_loader_wrapper_is_not_a_metric():
    source = PRELUDE + ("def fit(model, loader, val_loader, evaluate):\n"
                        "    steps = len(loader)\n    progress = tqdm(val_loader)\n"
                        "    for step, batch in enumerate(loader):\n"
                        "        accelerator.backward(model(batch))\n"
                        "        if step >= steps - 1 or progress is None:\n            break\n")
    assert lint.lint_source(source).ok
