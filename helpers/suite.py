"""Run every notebook headless with papermill into a report folder with an index (``make report``).

``reports/<timestamp>/`` gets, per notebook, the executed notebook, its HTML and its result JSON,
plus ``summary.json`` and ``index.html`` (the landing page: machine, each notebook's headline,
top findings, failures); ``reports/latest`` points at the newest folder. ``--combine`` puts the
report folders of many machines on one fleet page (``helpers.suite_pages``).

Kernels talk to papermill over IPC sockets in a private folder, not TCP: the supported way to
silence ipykernel's "running over TCP without encryption" warning, and nothing to eavesdrop on.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import cli, params, report, suite_pages
from helpers.redact import redact_text, scrub_notebook
from helpers.report import ResultMixin

NOTEBOOK_DIR = params.REPO_ROOT / "notebooks"
REPORTS_DIR = params.REPO_ROOT / "reports"
CELL_TIMEOUT_S = 900
# parameters naming a folder a notebook writes into: inside the report folder unless set with -p
OUTPUT_FOLDER_PARAMETERS = ("report_dir", "out_dir")
AUDIT_NOTEBOOK = "01_environment_audit"
KERNEL_LOG_LEVEL = "CRITICAL"


@dataclass
class NotebookRun(ResultMixin):
    """One executed notebook: name, outcome, seconds, its headline (from its result JSON), the
    error (one line; and for a failed cell: its number, first source line, ename and evalue) and
    its files (relative to the report folder)."""

    name: str
    ok: bool
    seconds: float
    error: str | None = None
    notebook: str | None = None
    html: str | None = None
    result: str | None = None
    headline: str | None = None
    cell: int | None = None  # execution count of the cell that failed
    cell_source: str | None = None  # its line that raised (else its first line)
    ename: str | None = None
    evalue: str | None = None
    kernel_log: str | None = None  # what the kernel wrote to its standard error, when it did


@dataclass
class SuiteResult(ResultMixin):
    """Every notebook's run; ``ok`` when all passed."""

    ok: bool
    out_dir: str
    started: str
    parameters: dict[str, Any] = field(default_factory=dict)
    notebooks: list[NotebookRun] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)  # host, GPUs, versions (from the audit)
    findings: list[dict[str, str]] = field(default_factory=list)  # the audit's top findings
    audit_report: str | None = None  # the audit's report JSON, relative to the report folder
    seconds: float = 0.0

    def summary(self) -> str:
        """Plain-text table of the runs."""
        rows = [{"notebook": n.name, "ok": n.ok, "seconds": round(n.seconds, 1),
                 "error": (n.error or "").splitlines()[0] if n.error else ""} for n in self.notebooks]
        verdict = "all notebooks passed" if self.ok else "SOME NOTEBOOKS FAILED"
        return f"{verdict}; report in {self.out_dir}\n\n{report.text_table(rows)}"


def list_notebooks(only: str | None = None) -> list[Path]:
    """The suite's notebooks in order; ``only`` keeps those whose name contains it (or, separated
    by commas, any of its parts: ``01,03``); each part must name a notebook."""
    every = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if not only:
        return every
    parts = [part.strip() for part in only.split(",") if part.strip()]
    for part in parts or [only]:
        if not any(part in p.stem for p in every):
            names = ", ".join(p.stem for p in every)
            raise ValueError(f"only must name a notebook; got {part!r}; notebooks: {names}")
    return [p for p in every if any(part in p.stem for part in parts)]


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


def kernel_config(ipc_dir: Path, stderr_path: Path | None = None) -> Any:
    """Configuration for papermill's kernel manager and client: IPC sockets inside ``ipc_dir``,
    and the kernel's own log kept off the report's output (its standard error, with
    ``stderr_path``, in that file).

    ipykernel warns on every start over TCP that the traffic is unencrypted and names IPC
    transport as the remedy; IPC sockets are files only this user can reach (``ipc_dir`` is
    0700). The kernel's log (not the cells' output, which the executed notebook keeps; a dead
    kernel still fails the notebook) otherwise prints lines such as "KeyboardInterrupt caught in
    kernel" that say nothing about the notebook's outcome.
    """
    from traitlets.config import Config

    return Config({"KernelManager": {"transport": "ipc", "ip": str(ipc_dir / "k")},
                   "NotebookClient": {"extra_arguments": [f"--IPKernelApp.log_level={KERNEL_LOG_LEVEL}"],
                                      "kernel_manager_class": _kernel_manager_class()},
                   "KernelStderrManager": {"stderr_path": str(stderr_path) if stderr_path else ""}})


@functools.cache
def _kernel_manager_class() -> type:
    """jupyter_client's KernelManager with the kernel's standard error sent to a file (its
    ``stderr_path``; made once, on first use: jupyter_client loads only when a report runs).

    What a kernel writes there is not a cell's output (ipykernel sends that to the notebook) but
    what comes before and after the cells: libzmq once aborted a kernel as it exited, after every
    cell had run ("Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)", in 2 of 5 full
    test runs; libzmq#3715: its poll saw a closed descriptor). It goes into the report folder, not
    into the report's own progress output.
    """
    from jupyter_client.manager import KernelManager
    from traitlets import Unicode

    class KernelStderrManager(KernelManager):
        stderr_path = Unicode("", config=True, help="file the kernel's standard error goes to")

        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            if not self.stderr_path:
                return await super()._async_launch_kernel(kernel_cmd, **kw)
            with open(self.stderr_path, "ab") as stderr:  # the kernel keeps its own copy
                return await super()._async_launch_kernel(kernel_cmd, stderr=stderr, **kw)

    return KernelStderrManager


def _execute(path: Path, out_dir: Path, values: dict[str, Any], ipc_dir: Path) -> NotebookRun:
    import papermill

    executed = out_dir / path.name
    kernel_stderr = ipc_dir / f"{path.stem}.stderr"
    result_json = Path(values.get("results_path") or out_dir / f"{path.stem}.json")
    started = time.monotonic()
    run = NotebookRun(path.stem, True, 0.0)
    try:
        papermill.execute_notebook(str(path), str(executed), parameters=values, kernel_name="python3",
                                   cwd=str(NOTEBOOK_DIR), progress_bar=False, log_output=False,
                                   execution_timeout=CELL_TIMEOUT_S,
                                   config=kernel_config(ipc_dir, kernel_stderr))
    except papermill.PapermillExecutionError as exc:
        run.ok, run.cell, run.ename = False, exc.exec_count, exc.ename
        run.evalue, run.cell_source = redact_text(str(exc.evalue)), redact_text(failed_line(exc))
        run.error = redact_text(f"cell {exc.exec_count}: {exc.ename}: {exc.evalue}")
    except Exception as exc:  # noqa: BLE001 - a broken kernel fails this notebook, not the suite
        run.ok, run.ename, run.evalue = False, type(exc).__name__, redact_text(str(exc))
        run.error = redact_text(f"{type(exc).__name__}: {exc}")
    run.seconds = time.monotonic() - started
    if executed.exists():
        scrub_notebook(executed)  # outputs, papermill's injected parameters, metadata
        run.notebook = executed.name
        run.html = _to_html(executed).name
    run.kernel_log = _keep_kernel_stderr(kernel_stderr, out_dir / f"{path.stem}-kernel.log")
    if run.kernel_log and not run.ok and run.cell is None:  # the kernel itself failed: say where it spoke
        run.error = f"{run.error} (the kernel's standard error: {run.kernel_log})"
    if result_json.exists():
        run.result = _relative(result_json, out_dir)
        run.headline = read_result(result_json).get("headline")
    return run


def _keep_kernel_stderr(source: Path, target: Path) -> str | None:
    """The kernel's standard error, redacted, as ``target`` in the report folder (its name; None
    when the kernel wrote nothing there)."""
    try:
        text = source.read_text(errors="replace")
    except OSError:
        return None
    if not text.strip():
        return None
    report.atomic_write_text(target, redact_text(text))
    return target.name


ANSI = re.compile(r"\x1b\[[0-9;]*m")
ARROW = re.compile(r"^-*>\s*\d+\s(.*)$")


def failed_line(exc: Any) -> str:
    """The line of the failed cell that raised (IPython marks it ``----> N`` in the traceback's
    first frame), else the cell's first non-empty line."""
    for entry in exc.traceback or []:
        for line in ANSI.sub("", str(entry)).splitlines():
            match = ARROW.match(line.strip())
            if match and match.group(1).strip():
                return match.group(1).strip()
    return next((line for line in (exc.source or "").splitlines() if line.strip()), "")


def read_result(path: Path) -> dict[str, Any]:
    """A notebook's result JSON (secrets redacted); {} when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    from helpers.redact import redact_data

    return redact_data(data)


def _relative(path: Path, out_dir: Path) -> str:
    return str(path.relative_to(out_dir)) if path.is_relative_to(out_dir) else str(path)


def machine_here() -> dict[str, Any]:
    """This machine in a few fields when the audit did not run: host, Python and package versions
    (no GPU query: that is the audit's job)."""
    import platform
    import socket
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"host": socket.gethostname(), "anonymized": False,
            "gpus": "not collected (the audit did not run)", "torch": version("torch"), "cuda": None,
            "accelerate": version("accelerate"), "driver": None,
            "python": platform.python_version(), "kernel": platform.release()}


def _add_audit(result: SuiteResult, target: Path) -> None:
    """The machine, the top findings and the report file from the audit's result JSON."""
    audit = next((run for run in result.notebooks if run.name == AUDIT_NOTEBOOK and run.result), None)
    data = read_result(target / audit.result) if audit else {}
    result.machine = data.get("machine") or machine_here()
    result.findings = list(data.get("top") or [])
    report_json = data.get("report_json")
    if report_json and Path(report_json).is_file():
        result.audit_report = _relative(Path(report_json), target)


def _to_html(executed: Path) -> Path:
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(executed), as_version=4))
    return report.atomic_write_text(executed.with_suffix(".html"), body)


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
    started = time.monotonic()
    ipc_dir = Path(tempfile.mkdtemp(prefix="helpers-kernels-"))  # 0700: the kernels' sockets
    try:
        for index, path in enumerate(notebooks, 1):
            progress(f"[{index}/{len(notebooks)}] {path.stem} ...")
            run = _execute(path, target, routed[path], ipc_dir)
            result.notebooks.append(run)
            result.ok &= run.ok
            progress(f"[{index}/{len(notebooks)}] {path.stem}: {'ok' if run.ok else 'FAILED'} "
                     f"in {run.seconds:.1f} s" + (f" -- {run.error or run.headline}"
                                                  if run.error or run.headline else ""))
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    result.seconds = time.monotonic() - started
    _add_audit(result, target)
    report.atomic_write_json(target / "summary.json", result)
    report.atomic_write_text(target / "index.html", suite_pages.landing_page(result.to_dict()))
    if not out_dir:
        _link_latest(target)
    return result


def cli_main(argv: list[str]) -> int:
    """``python -m helpers report [--out DIR] [--only NAME] [-p name value ...]``, or
    ``python -m helpers report --combine DIR [DIR ...] --out DIR`` (the fleet page)."""
    parser = argparse.ArgumentParser(prog="python -m helpers report", description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="DIR", type=cli.path_arg,
                        help="report folder (default reports/<timestamp>); with --combine: the fleet folder")
    parser.add_argument("--only", metavar="NAME", help="run only notebooks whose name contains NAME "
                        "(several: 01,03)")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="set a parameter in the notebooks that declare it")
    parser.add_argument("--combine", nargs="+", metavar="DIR", type=cli.path_arg,
                        help="combine report folders of many machines into one fleet page (needs --out)")
    args = cli.parse(parser, argv)
    if isinstance(args, int):
        return args
    if args.combine:
        return _combine_main(args)
    try:
        values = {name: parse_value(text) for name, text in args.p}
        result = run_suite(args.out, args.only, values, on_progress=lambda line: print(line, flush=True))
    except ValueError as exc:
        return cli.usage_error(str(exc))
    print(result.summary())
    return cli.EXIT_OK if result.ok else cli.EXIT_PROBLEM


def _combine_main(args: argparse.Namespace) -> int:
    if not args.out:
        return cli.usage_error("--combine needs --out DIR: the folder for the fleet page")
    if args.only or args.p:
        return cli.usage_error("--combine runs no notebook: --only and -p do not apply")
    try:
        fleet = suite_pages.combine(args.combine, args.out)
    except ValueError as exc:
        return cli.usage_error(str(exc))
    failed = [e["label"] for e in fleet["reports"] if not e["ok"]]
    print(f"{len(fleet['reports'])} machines; " + (f"FAILED: {', '.join(failed)}" if failed
                                                   else "every machine passed every notebook"))
    if fleet.get("identical") is False:
        print("relevant facts differ between machines (see the page)")
    print(f"fleet page: {Path(args.out) / suite_pages.INDEX}")
    return cli.EXIT_OK if fleet["ok"] else cli.EXIT_PROBLEM
