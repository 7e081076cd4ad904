"""helpers.launch inside a real Jupyter kernel: interrupt and restart leave no rank behind."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import KernelManager

HANG = """
import os, time
from pathlib import Path
from helpers.launch import launch

def hang(pid_dir):
    Path(pid_dir, str(os.getpid())).touch()
    while True:
        time.sleep(0.05)

launch(hang, ({pid_dir!r},), num_processes=2, timeout_s=300)
"""


@pytest.fixture
def kernel():
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    yield manager, client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def _start_hang(client, pid_dir: Path) -> tuple[str, list[int]]:
    pid_dir.mkdir()
    msg_id = client.execute(HANG.format(pid_dir=str(pid_dir)))
    deadline = time.monotonic() + 60
    while len(list(pid_dir.iterdir())) < 2:  # a condition with a deadline, not a sleep
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    return msg_id, [int(p.name) for p in pid_dir.iterdir()]


def _assert_gone(pids: list[int]) -> None:
    procs = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, f"ranks left running: {alive}"


def _reply(client, msg_id: str) -> dict:
    while True:
        msg = client.get_shell_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def test_interrupt_then_restart_leave_no_rank(kernel, tmp_path, leftovers):
    manager, client = kernel
    msg_id, pids = _start_hang(client, tmp_path / "first")
    manager.interrupt_kernel()
    reply = _reply(client, msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    _assert_gone(pids)

    _, pids = _start_hang(client, tmp_path / "second")
    manager.restart_kernel(now=False)  # what JupyterLab's "Restart Kernel" does
    _assert_gone(pids)
    client.stop_channels()
    manager.shutdown_kernel(now=True)
    leftovers.check()
