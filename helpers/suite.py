"""Run every notebook headless with papermill into a report folder with an index (``make report``).

``reports/<timestamp>/`` gets, per notebook, the executed notebook, its HTML and its result JSON,
plus ``summary.json`` and ``index.html``; ``reports/latest`` points at the newest folder.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import html
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import cli, params, report
from helpers.redact import redact_text, scrub_notebook
from helpers.report import ResultMixin

NOTEBOOK_DIR = params.REPO_ROOT / "notebooks"
REPORTS_DIR = params.REPO_ROOT / "reports"
CELL_TIMEOUT_S = 900
# parameters naming a folder a notebook writes into: inside the report folder unless set with -p
OUTPUT_FOLDER_PARAMETERS = ("report_dir", "out_dir")


@dataclass
class NotebookRun(ResultMixin):
    """One executed notebook: name, outcome, seconds, the error (cell and message) and its files."""

    name: str
    ok: bool
    seconds: float
    error: str | None = None
    notebook: str | None = None
    html: str | None = None
    result: str | None = None


@dataclass
class SuiteResult(ResultMixin):
    """Every notebook's run; ``ok`` when all passed."""

    ok: bool
    out_dir: str
    started: str
    parameters: dict[str, Any] = field(default_factory=dict)
    notebooks: list[NotebookRun] = field(default_factory=list)

    def summary(self) -> str:
        """Plain-text table of the runs."""
        rows = [{"notebook": n.name, "ok": n.ok, "seconds": round(n.seconds, 1),
                 "error": (n.error or "").splitlines()[0] if n.error else ""} for n in self.notebooks]
        verdict = "all notebooks passed" if self.ok else "SOME NOTEBOOKS FAILED"
        return f"{verdict}; report in {self.out_dir}\n\n{report.text_table(rows)}"


def list_notebooks(only: str | None = None) -> list[Path]:
    """The suite's notebooks in order; ``only`` keeps those whose name contains it."""
    found = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [p for p in found if only in p.stem]
        if not found:
            names = ", ".join(p.stem for p in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")))
            raise ValueError(f"only must name a notebook; got {only!r}; notebooks: {names}")
    return found


def declared_parameters(path: Path) -> dict[str, Any]:
    """The parameters a notebook declares in its cell tagged 'parameters' (name -> info)."""
    import papermill

    return papermill.inspect_notebook(str(path))


def parse_value(text: str) -> Any:
    """A ``-p`` value: a Python literal when it parses as one (2, 1.5, True, "x"), else the text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def route_parameters(notebooks: list[Path], given: dict[str, Any],
                     out_dir: Path) -> dict[Path, dict[str, Any]]:
    """Give each notebook the ``-p`` values it declares; a value no notebook declares is an error.

    Each notebook's result JSON, and any folder it writes into (``report_dir``, ``out_dir``), go
    inside the report folder unless ``-p`` sets them.
    """
    declared = {path: declared_parameters(path) for path in notebooks}
    for name in given:
        if not any(name in names for names in declared.values()):
            raise ValueError(f"-p {name}: no notebook of {[p.stem for p in notebooks]} declares "
                             f"a parameter named {name!r}")
    routed = {}
    for path, names in declared.items():
        defaults = {"results_path": str(out_dir / f"{path.stem}.json")}
        defaults |= {name: str(out_dir / f"{path.stem}-files")
                     for name in OUTPUT_FOLDER_PARAMETERS if name in names}
        routed[path] = defaults | {k: v for k, v in given.items() if k in names}
    return routed


def _execute(path: Path, out_dir: Path, values: dict[str, Any]) -> NotebookRun:
    import papermill

    executed = out_dir / path.name
    result_json = Path(values.get("results_path") or out_dir / f"{path.stem}.json")
    started = time.monotonic()
    error = None
    try:
        papermill.execute_notebook(str(path), str(executed), parameters=values, kernel_name="python3",
                                   cwd=str(NOTEBOOK_DIR), progress_bar=False, log_output=False,
                                   execution_timeout=CELL_TIMEOUT_S)
    except papermill.PapermillExecutionError as exc:
        error = f"cell {exc.exec_count}: {exc.ename}: {exc.evalue}"
    except Exception as exc:  # noqa: BLE001 - a broken kernel fails this notebook, not the suite
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    run = NotebookRun(path.stem, error is None, seconds, error and redact_text(error))
    if executed.exists():
        scrub_notebook(executed)  # outputs, papermill's injected parameters, metadata
        run.notebook = executed.name
        run.html = _to_html(executed).name
    if result_json.exists():
        run.result = str(result_json.relative_to(out_dir)) if result_json.is_relative_to(out_dir) \
            else str(result_json)
    return run


def _to_html(executed: Path) -> Path:
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(executed), as_version=4))
    return report.atomic_write_text(executed.with_suffix(".html"), body)


def _index_html(result: SuiteResult) -> str:
    rows = []
    for run in result.notebooks:
        link = f"<a href='{html.escape(run.html)}'>{html.escape(run.name)}</a>" if run.html else run.name
        status = "pass" if run.ok else f"FAIL: {html.escape(run.error or '')}"
        rows.append(f"<tr><td>{link}</td><td>{status}</td><td>{run.seconds:.1f} s</td></tr>")
    verdict = "All notebooks passed" if result.ok else "Some notebooks failed"
    return (f"<!doctype html><meta charset='utf-8'><title>Report {result.started}</title>"
            f"<h1>{verdict}</h1><p>Started {result.started}</p><table border=1 cellpadding=4>"
            f"<tr><th>notebook</th><th>outcome</th><th>time</th></tr>{''.join(rows)}</table>")


def _link_latest(out_dir: Path) -> None:
    latest = out_dir.parent / "latest"
    tmp = out_dir.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(out_dir.name)
    os.replace(tmp, latest)


def run_suite(out_dir: str | Path | None = None, only: str | None = None,
              parameters: dict[str, Any] | None = None,
              on_progress: Callable[[str], None] | None = None) -> SuiteResult:
    """Execute the notebooks headless; write executed notebooks, HTML, summary.json, index.html.

    ``parameters`` go to the notebooks that declare them (ValueError if none does), checked before
    anything runs. Without ``out_dir`` the report goes to ``reports/<timestamp>/`` with a
    ``reports/latest`` link.
    """
    notebooks = list_notebooks(only)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = params.resolve_path(out_dir) if out_dir else REPORTS_DIR / stamp
    routed = route_parameters(notebooks, parameters or {}, target)
    target.mkdir(parents=True, exist_ok=True)
    result = SuiteResult(True, str(target), stamp, {k: redact_text(str(v)) if isinstance(v, str) else v
                                                    for k, v in (parameters or {}).items()})
    progress = on_progress or (lambda line: None)
    for index, path in enumerate(notebooks, 1):
        progress(f"[{index}/{len(notebooks)}] {path.stem} ...")
        run = _execute(path, target, routed[path])
        result.notebooks.append(run)
        result.ok &= run.ok
        progress(f"[{index}/{len(notebooks)}] {path.stem}: {'ok' if run.ok else 'FAILED'} "
                 f"in {run.seconds:.1f} s" + (f" -- {run.error}" if run.error else ""))
    report.atomic_write_json(target / "summary.json", result)
    report.atomic_write_text(target / "index.html", _index_html(result))
    if not out_dir:
        _link_latest(target)
    return result


def cli_main(argv: list[str]) -> int:
    """``python -m helpers report [--out DIR] [--only NAME] [-p name value ...]``."""
    parser = argparse.ArgumentParser(prog="python -m helpers report", description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="DIR", type=cli.path_arg,
                        help="report folder (default reports/<timestamp>)")
    parser.add_argument("--only", metavar="NAME", help="run only notebooks whose name contains NAME")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="set a parameter in the notebooks that declare it")
    args = cli.parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        values = {name: parse_value(text) for name, text in args.p}
        result = run_suite(args.out, args.only, values, on_progress=lambda line: print(line, flush=True))
    except ValueError as exc:
        return cli.usage_error(str(exc))
    print(result.summary())
    return cli.EXIT_OK if result.ok else cli.EXIT_PROBLEM
