"""Shared test fixtures: leftover checks (psutil) and running notebooks with papermill."""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"

# Every process the tests start (ranks, kernels, torchrun agents, their temp folders) uses this
# session's own temp folder, so a leftover is ours, whatever else runs on the machine.
SESSION_TMP = Path(tempfile.mkdtemp(prefix="helpers-tests-"))
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = str(SESSION_TMP)
_OWNER_PID = os.getpid()


@atexit.register
def _remove_session_temp_folder() -> None:
    """Also when no test ran (a usage error, a script importing a test module); never in a fork."""
    if os.getpid() == _OWNER_PID:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def _temp_entries() -> set[str]:
    """Everything in the session's temp folder but pytest's own tmp_path tree."""
    return {p for p in glob.glob(os.path.join(SESSION_TMP, "*"))
            if not os.path.basename(p).startswith("pytest-of-")}


def _listening_ports(pids: set[int]) -> set[tuple[int, int]]:
    found = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.pid in pids and conn.status == psutil.CONN_LISTEN:
            found.add((conn.pid, conn.laddr.port))
    return found


class Leftovers:
    """Snapshot of children, listening ports and temp entries; ``check()`` asserts none were added."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.children = {p.pid for p in self.me.children(recursive=True)}
        self.temp = _temp_entries()
        self.ports = _listening_ports({self.me.pid})

    def new_children(self) -> list[psutil.Process]:
        """Children (any depth) that did not exist at the snapshot and are still alive."""
        alive = []
        for proc in self.me.children(recursive=True):
            if proc.pid not in self.children and proc.is_running() and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        return alive

    def check(self) -> None:
        """Assert no new child process, listening port of ours, or temp folder remains."""
        children = self.new_children()
        assert not children, f"child processes left: {[(p.pid, p.cmdline()) for p in children]}"
        ports = _listening_ports({self.me.pid}) - self.ports
        assert not ports, f"listening ports left: {ports}"
        temp = _temp_entries() - self.temp
        assert not temp, f"temp entries left: {sorted(temp)}"


def in_parallel(function: Callable, items: Iterable, at_once: int = 3) -> list:
    """``function`` over ``items``, ``at_once`` at a time (threads); results in order.

    For runs that mostly wait (a stall, a process-group timeout, a launcher's teardown): on this
    2-core machine a few overlap without slowing each other much; an exception is raised as is.
    """
    with ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(function, items))


def run_each(run: Callable[[Any, Path], Any], keys: list, tmp_path_factory: pytest.TempPathFactory,
             prefix: str, at_once: int = 3) -> dict:
    """``run(key, folder)`` for every key, each in a folder of its own, ``at_once`` at a time, then a
    leftovers check over them all: a module fixture that runs a parametrized test's cases together.
    Each key maps to its result, or to its exception, which ``result_of`` raises in that key's test."""
    folders = [tmp_path_factory.mktemp(f"{prefix}-{key}") for key in keys]
    left = Leftovers()

    def kept(pair: tuple[Any, Path]) -> Any:
        try:
            return run(*pair)
        except Exception as exc:  # noqa: BLE001 - handed to the test of this key, which raises it
            return exc

    results = in_parallel(kept, list(zip(keys, folders, strict=True)), at_once)
    left.check()
    return dict(zip(keys, results, strict=True))


def result_of(results: dict, key: Any) -> Any:
    """A key's result from ``run_each`` (its exception raised)."""
    if isinstance(results[key], BaseException):
        raise results[key]
    return results[key]


@pytest.fixture
def leftovers() -> Leftovers:
    """Take a snapshot before the test; call ``leftovers.check()`` at its end."""
    return Leftovers()


def run_notebook(name: str, out_dir: Path, parameters: dict | None = None, timeout: int = 300,
                 env: dict[str, str] | None = None) -> dict:
    """Execute notebooks/<name> with papermill into ``out_dir``; return the executed notebook.

    Raises papermill.PapermillExecutionError when a cell fails. ``env`` sets variables in the
    kernel (the kernel inherits this process's environment).
    """
    import nbformat
    import papermill

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        output = out_dir / name
        papermill.execute_notebook(
            str(NOTEBOOKS / name), str(output), parameters=parameters or {},
            kernel_name="python3", cwd=str(out_dir), progress_bar=False,
            execution_timeout=timeout, log_output=False,
        )
        return nbformat.read(str(output), as_version=4)
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def notebook_text_outputs(nb: dict) -> str:
    """All text a notebook's cells produced (stream, plain text, HTML, errors), joined."""
    parts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            parts.append(text if isinstance(text, str) else "".join(text))
            for key in ("text/plain", "text/html"):
                data = out.get("data", {}).get(key)
                if data:
                    parts.append(data if isinstance(data, str) else "".join(data))
            if out.get("output_type") == "error":
                parts.append(out.get("ename", "") + ": " + out.get("evalue", ""))
    return "\n".join(parts)


@pytest.fixture(scope="session", autouse=True)
def _session_temp_folder():
    """Remove the session's temp folder at the end (pytest's tmp_path trees live inside it)."""
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    yield
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


def marker_line(path: str | Path, marker: str) -> int:
    """The number of the one line in ``path`` that ends with ``# line: <marker>`` (a marker on two
    lines is an error: a test written later must not move an earlier test's expected line)."""
    found = [number for number, text in enumerate(Path(path).read_text().splitlines(), start=1)
             if text.rstrip().endswith(f"# line: {marker}")]
    assert len(found) == 1, f"{len(found)} lines marked {marker!r} in {path}: {found}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# real `make report` runs, shared by tests/test_suite_pages.py and tests/browser/


@dataclass
class ReportRuns:
    """Three real report folders and their fleet page (``python -m helpers report`` each time).

    ``node_a``: audit and smoke test on 2 ranks; ``node_b``: the same on 3 ranks, anonymised;
    ``broken``: the smoke test with a bad ``num_processes`` (fails at its validation cell);
    ``fleet``: ``--combine`` over the three. ``output`` holds each command's stdout + stderr.
    """

    node_a: Path
    node_b: Path
    broken: Path
    fleet: Path
    output: dict[str, subprocess.CompletedProcess]


REPORT_RUNS = {
    "node_a": ["--only", "01,03", "-p", "num_processes", "2", "-p", "max_size_mib", "1"],
    "node_b": ["--only", "01,03", "-p", "num_processes", "3", "-p", "max_size_mib", "1",
               "-p", "anonymize", "True"],
    "broken": ["--only", "03", "-p", "num_processes", "0"],
}


# what differs between the "machines" besides the parameters: an NCCL variable the audit diffs
REPORT_ENV = {"node_b": {"NCCL_DEBUG": "WARN"}}


def helpers_report(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m helpers report ARGS`` in a child (``env`` added); stdout and stderr kept apart."""
    return subprocess.run([sys.executable, "-m", "helpers", "report", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def report_runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> ReportRuns:
    """Run the three reports and combine them once per test session (about 75 s on 2 cores): the
    first pytest worker to ask runs them in the folder the workers share, a later one (its test
    files may land on the other worker) waits for that and reads the same folders."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    root, done = shared / "report-runs", shared / "report-runs.json"
    with FileLock(str(shared / "report-runs.lock")):
        if not done.is_file():
            before = Leftovers()
            output = {name: helpers_report(*args, "--out", str(root / name), env=REPORT_ENV.get(name))
                      for name, args in REPORT_RUNS.items()}
            output["fleet"] = helpers_report("--combine", *(str(root / name) for name in REPORT_RUNS),
                                             "--out", str(root / "fleet"))
            kept = {name: [proc.returncode, proc.stdout, proc.stderr] for name, proc in output.items()}
            before.check()  # the reports' kernels and ranks are gone
            done.write_text(json.dumps(kept))
    output = {name: subprocess.CompletedProcess([name], code, out, err)
              for name, (code, out, err) in json.loads(done.read_text()).items()}
    return ReportRuns(root / "node_a", root / "node_b", root / "broken", root / "fleet", output)
