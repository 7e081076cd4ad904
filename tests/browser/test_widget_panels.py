"""Each notebook in a real JupyterLab: all cells run without error, and its widget panel works.

One recipe per notebook: fast parameter values for the copy the server serves, the controls a
person changes, the button they click and the text the panel must then show. A screenshot of
each panel after the click goes to reports/screenshots/NN_name.png.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import NOTEBOOKS

from helpers import report

from .conftest import SCREENSHOTS, JupyterLab

# While code cells run, their prompt reads [*]; when they are done, [n].
CELLS_STARTED_JS = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]
    .some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))"""
CELLS_FINISHED_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')];
  const indicator = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
  return prompts.length > 0 && !prompts.some(e => e.textContent.includes('*'))
    && indicator !== null && indicator.dataset.status === 'idle';
}"""
# What the notebook's model holds (JupyterLab exposes its app with expose_app_in_browser).
CODE_CELLS_JS = """(path) => {
  const panel = [...window.jupyterapp.shell.widgets('main')].find(w => w.context && w.context.path === path);
  return panel.content.widgets.filter(c => c.model.type === 'code').map(c => ({
    count: c.model.executionCount,
    source: c.model.sharedModel.getSource().split('\\n')[0],
    errors: c.model.outputs.toJSON().filter(o => o.output_type === 'error')
      .map(o => o.ename + ': ' + o.evalue)}));
}"""


@dataclass(frozen=True)
class Recipe:
    """How to prove one notebook's panel works: change controls, click, expect text."""

    notebook: str
    fast: dict[str, Any]  # parameter values injected into the served copy ({workdir}: temp folder)
    change: dict[str, Any]  # control name -> new value, set as a person would
    expect: str  # regular expression the panel's output must match after the click
    button: str = ""  # the button's text; "" = the panel's first button
    bad: dict[str, Any] | None = None  # optional first click with a bad value: control -> value
    bad_expect: str = ""  # ... the message the panel must show for it (status "failed: ValueError")
    panel: int = 0  # which panel, when a notebook shows several
    run_all_timeout_s: float = 180.0
    click_timeout_s: float = 120.0


RECIPES = [
    Recipe("01_environment_audit.ipynb", {"report_dir": "{workdir}/audit"},
           change={"min_severity": "info"}, expect=r"showing info and above",
           button="Re-run audit"),
    Recipe("02_minimal_repro_builder.ipynb", {"stall_s": 2.0, "out_dir": "{workdir}/repro"},
           change={"symptom": "hangs-at-save"}, expect=r"main-only-collective"),
    Recipe("03_smoke_test.ipynb", {"max_size_mib": 1, "timeout_s": 60.0},
           bad={"timeout_s": -1}, bad_expect=r"^ValueError: timeout_s must be a number > 0",
           change={"timeout_s": 60, "num_processes": 3},
           expect=r"PASS: \d+ collectives correct on 3 ranks"),
    Recipe("04_batch_size_explorer.ipynb",
           {"memory_budget_mib": 64, "starting_batch_size": 512, "strategy": "search"},
           change={"model": "conv"}, expect=r"conv\s+on\s+cpu"),
    # the broken loop and the two-node job run in nbval and tests/test_notebook_05.py; here the
    # notebook's cells, its fixed loop and its panel
    Recipe("05_early_stop_sync.ipynb", {"stall_s": 2.0, "show_hang": False},
           change={"stop_step": 1}, expect=r"every rank stopped at step 1 together"),
]


def _params() -> list[Any]:
    return [pytest.param(recipe, id=recipe.notebook.split(".")[0],
                         marks=pytest.mark.skipif(not (NOTEBOOKS / recipe.notebook).is_file(),
                                                  reason="notebook not present yet"))
            for recipe in RECIPES]


@pytest.mark.parametrize("recipe", _params())
def test_notebook_runs_and_its_panel_works_in_jupyterlab(recipe: Recipe, lab: JupyterLab, page: Any):
    lab.prepare(recipe.notebook, recipe.fast)
    try:
        open_notebook(page, lab, recipe.notebook)
        run_all_cells(page, recipe.run_all_timeout_s)
        cells = page.evaluate(CODE_CELLS_JS, recipe.notebook)
        errors = [f"{c['source']!r}: {e}" for c in cells for e in c["errors"]]
        assert not errors, f"cells failed in JupyterLab: {errors}"
        not_run = [c["source"] for c in cells if c["count"] is None]
        assert not not_run, f"cells that did not run: {not_run}"
        kernels_for = [s["path"] for s in lab.api("GET", "/api/sessions")]
        assert kernels_for == [recipe.notebook], f"kernels running for {kernels_for}"

        panel = page.locator(".helpers-panel").nth(recipe.panel)
        panel.wait_for(state="visible")
        if recipe.bad:
            check_bad_value_is_refused(panel, recipe)
        for name, value in recipe.change.items():
            set_control(panel, name, value)
        status = click_and_wait(panel, recipe.button, recipe.click_timeout_s)
        output = panel.locator(".widget-output").inner_text()
        assert status == "done", f"the panel says {status!r}; its output:\n{output}"
        assert re.search(recipe.expect, output), f"expected /{recipe.expect}/ in:\n{output}"
        save_screenshot(page, panel, recipe.notebook)
    finally:
        page.context.close()
        alive = lab.shut_down_kernels()
    assert not alive, f"kernel processes left after shutdown: {[p.pid for p in alive]}"


def open_notebook(page: Any, lab: JupyterLab, name: str) -> None:
    """Open ``name`` in a fresh workspace and wait until its kernel is idle."""
    page.goto(lab.url(f"/lab/tree/{name}") + "&reset")
    page.locator(".jp-NotebookPanel .jp-CodeCell").first.wait_for()
    page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for(
        timeout=90_000)


def run_all_cells(page: Any, timeout_s: float) -> None:
    """Run > Run All Cells, as a person would; wait until no cell runs and the kernel is idle."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-hidden)", has_text=re.compile(r"^Run All Cells")).click()
    page.wait_for_function(CELLS_STARTED_JS, timeout=60_000)
    page.wait_for_function(CELLS_FINISHED_JS, timeout=timeout_s * 1000)


def set_control(panel: Any, name: str, value: Any) -> None:
    """Set the panel's control labelled ``name`` as a person would: pick, toggle, type or tick.

    The control must show another value before (else the recipe proves nothing) and ``value``
    after.
    """
    kind, control = find_control(panel, name)
    before = read_control(kind, control)
    assert not _same(before, value), f"{name} already shows {before!r}: change it to another value"
    if kind == "select":
        control.select_option(label=str(value))
    elif kind == "toggle":
        control.locator(".widget-toggle-button", has_text=re.compile(rf"^{re.escape(str(value))}$")).click()
    elif kind == "checkbox":
        control.set_checked(bool(value))
    elif kind == "slider":  # type into the slider's readout
        control.click()
        control.page.keyboard.press("Control+A")
        control.page.keyboard.type(str(value))
        control.page.keyboard.press("Enter")
    else:
        control.fill(str(value))
        control.press("Enter")
    after = read_control(kind, control)
    assert _same(after, value), f"{name} shows {after!r} after setting {value!r}"


def find_control(panel: Any, name: str) -> tuple[str, Any]:
    """The kind ("select", "toggle", "checkbox", "slider", "field") and element of control ``name``."""
    label = panel.page.locator(".widget-label", has_text=re.compile(rf"^{re.escape(name)}$"))
    row = panel.locator(".widget-inline-hbox, .widget-toggle-buttons").filter(has=label)
    if row.count() == 0:  # a checkbox carries its description next to the box
        box = panel.locator(".widget-checkbox").filter(has_text=re.compile(rf"^{re.escape(name)}$"))
        assert box.count() == 1, f"no control named {name!r} in the panel"
        return "checkbox", box.locator("input[type=checkbox]")
    assert row.count() == 1, f"{row.count()} controls named {name!r} in the panel"
    if row.locator("select").count():
        return "select", row.locator("select")
    if row.locator(".widget-toggle-button").count():
        return "toggle", row
    if row.locator(".widget-readout").count():
        return "slider", row.locator(".widget-readout")
    return "field", row.locator("input, textarea").first


def read_control(kind: str, control: Any) -> Any:
    """What the control shows now."""
    if kind == "select":
        return control.evaluate("s => s.options[s.selectedIndex].textContent")
    if kind == "toggle":
        return control.locator(".widget-toggle-button.mod-active").inner_text().strip()
    if kind == "checkbox":
        return control.is_checked()
    if kind == "slider":
        return control.inner_text().strip()
    return control.input_value()


def _same(shown: Any, value: Any) -> bool:
    if isinstance(value, bool) or isinstance(shown, bool):
        return shown == value
    try:
        return float(shown) == float(value)
    except (TypeError, ValueError):
        return str(shown) == str(value)


def click_and_wait(panel: Any, button: str, timeout_s: float) -> str:
    """Click the button and wait for the panel's status to say done or failed; return it."""
    buttons = panel.locator("button.widget-button")
    target = buttons.filter(has_text=button).first if button else buttons.first
    status = panel.locator(".widget-hbox .widget-html-content")
    # blank the status shown by an earlier click: the next "done" or "failed" is this click's
    status.evaluate_all("nodes => nodes.forEach(n => { n.textContent = ''; })")
    target.click()
    final = status.filter(has_text=re.compile(r"^\s*(done|failed)")).first
    final.wait_for(timeout=timeout_s * 1000)
    return final.inner_text().strip()


def check_bad_value_is_refused(panel: Any, recipe: Recipe) -> None:
    """A bad value: the panel says failed and shows the one clear message, not a traceback."""
    for name, value in (recipe.bad or {}).items():
        set_control(panel, name, value)
    status = click_and_wait(panel, recipe.button, recipe.click_timeout_s)
    output = panel.locator(".widget-output").inner_text().strip()
    assert status == "failed: ValueError", f"the panel says {status!r} for {recipe.bad}; output:\n{output}"
    assert re.search(recipe.bad_expect, output), f"expected /{recipe.bad_expect}/ in:\n{output}"
    assert "Traceback" not in output, output


def save_screenshot(page: Any, panel: Any, notebook: str) -> None:
    """The panel as the notebook shows it (its visible part) to reports/screenshots/NN_name.png."""
    panel.evaluate("e => e.scrollIntoView({block: 'start'})")
    box = panel.bounding_box()
    area = page.locator(".jp-NotebookPanel-notebook").first.bounding_box()
    top, bottom = max(box["y"], area["y"]), min(box["y"] + box["height"], area["y"] + area["height"])
    clip = {"x": box["x"], "y": top, "width": box["width"], "height": max(bottom - top, 1)}
    report.atomic_write_bytes(SCREENSHOTS / (notebook.rsplit(".", 1)[0] + ".png"),
                              page.screenshot(clip=clip))
