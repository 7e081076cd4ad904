"""helpers.suite (`make report`): parameters, the default folder, secrets, what kernels write.

What a report run writes, its parameter routing and a failing notebook are checked on the shared
runs of tests/test_suite_pages.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import suite


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers", "report", *args], capture_output=True,
                          text=True, timeout=600)


def test_parameter_no_notebook_declares_is_bad_usage(tmp_path):
    proc = _report("--only", "03", "--out", str(tmp_path), "-p", "num_procs", "2")
    assert proc.returncode == 2
    assert "-p num_procs" in proc.stderr and "declares" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_only_must_name_a_notebook():
    with pytest.raises(ValueError, match="only must name a notebook; got 'nope'"):
        suite.list_notebooks("nope")


def test_parse_value_reads_literals():
    assert suite.parse_value("3") == 3 and suite.parse_value("True") is True
    assert suite.parse_value("reports/x") == "reports/x" and suite.parse_value("'two'") == "two"


def test_default_folder_is_timestamped_with_a_latest_link(tmp_path, monkeypatch, leftovers):
    monkeypatch.setattr(suite, "REPORTS_DIR", tmp_path / "reports")
    result = suite.run_suite(only="01")  # the audit: the quickest notebook
    assert result.ok
    latest = tmp_path / "reports" / "latest"
    assert latest.is_symlink() and latest.resolve() == tmp_path / "reports" / result.started
    assert (latest / "summary.json").exists()
    leftovers.check()


def test_report_holds_no_secret_and_keeps_outputs_inside(tmp_path, leftovers):
    secrets = {"HF_TOKEN": "hf_" + "q" * 34, "NCCL_DEBUG_FILE": "/x/sk-" + "z" * 40,
               "MASTER_ADDR": "https://user:hunter2pass@example.org"}
    env = {**os.environ, **secrets}
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "helpers", "report", "--only", "01", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert out / "01_environment_audit-files" / "audit.json" in files, "report_dir goes inside"
    for path in files:
        text = path.read_text(errors="replace")
        for value in ("q" * 34, "z" * 40, "hunter2pass"):
            assert value not in text, f"secret in {path.name}"
    leftovers.check()


def test_what_a_kernel_writes_outside_its_cells_goes_to_its_log_not_the_report_output(
        tmp_path, capfd, leftovers):
    import nbformat

    token = "hf_" + "q" * 34
    late = f"import atexit, os\natexit.register(lambda: os.write(2, b'late words {token}\\n'))"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(late)])
    source = tmp_path / "late.ipynb"
    nbformat.write(notebook, source)
    out, sockets = tmp_path / "out", tmp_path / "sockets"
    out.mkdir()
    sockets.mkdir(mode=0o700)
    run = suite._execute(source, out, {}, sockets)
    assert run.ok and run.kernel_log == "late-kernel.log"
    log = (out / run.kernel_log).read_text()  # as the kernel exited; libzmq may abort after it, and
    assert log.splitlines()[0] == "late words <redacted>", log  # its "Assertion failed" line is logged too
    assert token not in log
    assert "late words" not in capfd.readouterr().err  # the kernel's fd 2 is not the report's
    leftovers.check()
