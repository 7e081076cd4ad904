"""JupyterLab on loopback and Debian's Chromium driven by playwright, for the browser tests.

Without Chromium or the playwright package the tests skip, saying how to enable them;
``HELPERS_REQUIRE_BROWSER=1`` (set by .ci/run) turns that into a failure. Nothing is downloaded:
playwright drives the Chromium already installed (``executable_path``).

The server serves a temporary copy of notebooks/ (so the tree stays clean) and keeps its
configuration, runtime files and workspaces in a temporary folder too. Everything started here is
stopped at the end of the module, and the suite's ``Leftovers`` check proves it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from conftest import NOTEBOOKS, REPO, Leftovers

from helpers.launch import free_port

TOKEN = "helpers-browser-tests"
DEBIAN_CHROMIUM = "/usr/bin/chromium"
# the network is closed: without the background-networking flags Chromium keeps retrying
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 2000}
SCREENSHOTS = REPO / "reports" / "screenshots"
ENABLE_HINT = ("to run them install Debian's Chromium and the test extras: "
               "`sudo apt-get install chromium` and `.venv/bin/pip install -e '.[test]'` "
               "(another Chromium: HELPERS_CHROMIUM=/path/to/chromium)")

# JupyterLab user settings: every cell stays in the page (no virtual scrolling), no news
# pop-up, no autosave writing behind the test's back.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def find_chromium() -> str | None:
    """HELPERS_CHROMIUM, else `chromium` on PATH, else Debian's /usr/bin/chromium; None if none."""
    named = os.environ.get("HELPERS_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    if shutil.which("chromium"):
        return shutil.which("chromium")
    return DEBIAN_CHROMIUM if os.access(DEBIAN_CHROMIUM, os.X_OK) else None


def missing_browser_parts() -> list[str]:
    """What the browser tests need and this machine lacks (empty: all there)."""
    missing = []
    if find_chromium() is None:
        missing.append("Chromium (no `chromium` on PATH, HELPERS_CHROMIUM unset or not executable)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package")
    return missing


def require_browser() -> str:
    """The Chromium to use; skips (fails under HELPERS_REQUIRE_BROWSER=1) when something is missing."""
    missing = missing_browser_parts()
    if not missing:
        return str(find_chromium())
    message = f"browser tests need {' and '.join(missing)}; {ENABLE_HINT}"
    if os.environ.get("HELPERS_REQUIRE_BROWSER") == "1":
        pytest.fail(f"HELPERS_REQUIRE_BROWSER=1 and {message}", pytrace=False)
    pytest.skip(message)


class JupyterLab:
    """A JupyterLab server on 127.0.0.1 with a fixed token, serving a copy of notebooks/.

    ``workdir`` holds the copy (``root``), the server's config, runtime and data folders and
    whatever the notebooks write. ``stop()`` shuts the server down through its API (kernels
    included) and kills what is left of its process tree after a deadline.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.root = workdir / "notebooks"
        self.port = free_port()
        self.log: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def url(self, path: str) -> str:
        """Address of ``path`` on the server, token included."""
        return f"http://127.0.0.1:{self.port}{path}?token={TOKEN}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Copy the notebooks, write the settings, start the server and wait until it serves."""
        shutil.copytree(NOTEBOOKS, self.root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        for name, values in LAB_SETTINGS.items():
            path = self.workdir / "config" / "lab" / "user-settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.proc = subprocess.Popen(self._command(), env=self._env(), cwd=self.workdir,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_log, name="jupyterlab-log", daemon=True).start()
        if not self._ready.wait(timeout_s) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"JupyterLab did not start within {timeout_s:.0f} s; its log ends:\n"
                               + "\n".join(self.log[-30:]))

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "jupyterlab", "--no-browser",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}",
                   f"--ServerApp.root_dir={self.root}", "--LabApp.expose_app_in_browser=True"]
        return command + (["--allow-root"] if os.geteuid() == 0 else [])

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(JUPYTER_CONFIG_DIR=str(self.workdir / "config"),
                   JUPYTER_RUNTIME_DIR=str(self.workdir / "runtime"),
                   JUPYTER_DATA_DIR=str(self.workdir / "data"),
                   # torch's per-user cache (torchinductor_<user>, made on the first optimizer
                   # step) is kept across runs; here it lives with the server, not in TMPDIR
                   TORCHINDUCTOR_CACHE_DIR=str(self.workdir / "torchinductor"),
                   # kernels run this interpreter (the venv's), whatever PATH says
                   PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
        return env

    def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if "is running at:" in line:
                self._ready.set()
        self._ready.set()  # the server exited: nobody should wait any longer

    def api(self, method: str, path: str) -> Any:
        """Call the server's REST API; the decoded JSON answer (None when empty)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         headers={"Authorization": f"token {TOKEN}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read()
        return json.loads(body) if body else None

    def processes(self) -> list[psutil.Process]:
        """The server's descendants now (kernels and whatever they started)."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True) if self.proc else []
        except psutil.NoSuchProcess:
            return []

    def shut_down_kernels(self, timeout_s: float = 30.0) -> list[psutil.Process]:
        """End every session and its kernel; return the processes still alive after the deadline."""
        tree = self.processes()
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        _gone, alive = psutil.wait_procs(tree, timeout=timeout_s)
        return alive

    def prepare(self, name: str, values: dict[str, Any]) -> Path:
        """Copy notebooks/<name> into the root with ``values`` injected after its parameters cell.

        Injected as papermill does (a cell tagged ``injected-parameters``); ``{workdir}`` in a
        string value becomes this server's work folder.
        """
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        index = next(i for i, cell in enumerate(nb.cells)
                     if "parameters" in cell.metadata.get("tags", []))
        lines = [f"{key} = {_fill(value, self.workdir)!r}\n" for key, value in values.items()]
        nb.cells.insert(index + 1, nbformat.v4.new_code_cell(
            "# Parameters (fast values for the browser test)\n" + "".join(lines),
            metadata={"tags": ["injected-parameters"]}))
        path = self.root / name
        nbformat.write(nb, path)
        return path

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down through the API; after ``timeout_s`` kill the server and its descendants."""
        if self.proc is None or self.proc.poll() is not None:
            return
        tree = self.processes()
        try:
            self.api("POST", "/api/shutdown")
            self.proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            for proc in tree:
                _kill(proc)
            self.proc.kill()
            self.proc.wait(10)
        psutil.wait_procs(tree, timeout=10)


def _fill(value: Any, workdir: Path) -> Any:
    return value.format(workdir=workdir) if isinstance(value, str) else value


def _kill(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


@pytest.fixture(scope="module")
def nothing_left() -> Iterator[Leftovers]:
    """Snapshot before the server and the browser start; after both stopped, nothing of theirs remains.

    Processes that are still exiting get 15 s; anything alive after that is a leftover.
    """
    snapshot = Leftovers()
    yield snapshot
    psutil.wait_procs(snapshot.new_children(), timeout=15)
    snapshot.check()


@pytest.fixture(scope="module")
def lab(nothing_left: Leftovers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    """A running JupyterLab serving a temporary copy of notebooks/ (stopped afterwards)."""
    require_browser()
    server = JupyterLab(tmp_path_factory.mktemp("jupyterlab"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def chromium(nothing_left: Leftovers) -> Iterator[Any]:
    """Debian's Chromium, headless, launched by playwright with a fresh profile (closed afterwards)."""
    executable = require_browser()
    from playwright.sync_api import sync_playwright

    driver = sync_playwright().start()
    try:
        browser = driver.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS,
                                         headless=True)
        try:
            yield browser
        finally:
            browser.close()
    finally:
        driver.stop()


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:
    """A page in a fresh browser context (own cookies and storage); closed after the test."""
    context = chromium.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    try:
        yield context.new_page()
    finally:
        context.close()
