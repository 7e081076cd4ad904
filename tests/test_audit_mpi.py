"""MPI facts and findings: hostfiles, passwordless SSH with the real ssh client, the sanity run.

SSH goes to loopback only: 127.0.0.1 (port 22 has no server here, so the connection is refused:
a real "fails" case; where a server answers, the test checks what it answers) and a name that
cannot resolve. The sanity run uses the real mpirun (CI installs openmpi-bin; elsewhere it is
skipped when mpirun is absent).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.audit import mpi
from helpers.audit.diff import load_machine
from helpers.audit.rules import evaluate, is_unknown

PASTED = Path(__file__).parent / "fixtures" / "audit" / "pasted"
needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client on PATH "
                               "(apt-get install openssh-client)")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH "
                                  "(apt-get install openmpi-bin; .ci/run installs it)")


def helpers_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def port_22_open() -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", 22)) == 0


def test_hostfile_formats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# nodes\nnode1 slots=8\nnode2:4\n\nnode3  # spare\nnode1\n")
    facts = mpi.read_hostfile(str(path))
    assert facts["readable"] and facts["hosts"] == ["node1", "node2", "node3"] and not facts["error"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    assert mpi.read_hostfile(str(empty))["error"] == "no host in it"
    missing = mpi.read_hostfile(str(tmp_path / "absent"))
    assert not missing["readable"] and "No such file" in missing["error"]


def test_sanity_command_follows_the_mpi_flavour():
    assert mpi.sanity_command("mpirun", "Intel MPI / MPICH / MVAPICH", "h", 3) == \
        ["mpirun", "-f", "h", "-n", "3", "-ppn", "1", "hostname"]
    ompi = mpi.sanity_command("mpirun", "Open MPI", "h", 2)
    assert ompi[:6] == ["mpirun", "--hostfile", "h", "-n", "2", "--npernode"]


@needs_ssh
def test_ssh_checks_are_real_parallel_and_bounded():
    started = time.monotonic()
    result = mpi.check_ssh(["127.0.0.1", "no-such-host.invalid", "localhost"], deadline_s=8)
    assert time.monotonic() - started < 12
    assert not result["no-such-host.invalid"]["ok"]
    assert "resolve" in result["no-such-host.invalid"]["error"].lower()
    assert result["127.0.0.1"]["local"] and not result["no-such-host.invalid"]["local"]
    if not port_22_open():
        assert not result["127.0.0.1"]["ok"] and "refused" in result["127.0.0.1"]["error"]
    else:  # a server answers: without a key for BatchMode, it refuses the login, never prompts
        assert result["127.0.0.1"]["ok"] or result["127.0.0.1"]["error"]


@needs_ssh
def test_cli_audit_with_a_hostfile_reports_hosts_without_ssh(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("127.0.0.1 slots=1\nno-such-host.invalid slots=1\n")
    result = helpers_cli("audit", "--hostfile", str(hosts), "--strict", "--json", str(tmp_path / "a.json"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[error] MPI_NOT_READY: No passwordless SSH to" in result.stdout
    facts = json.loads((tmp_path / "a.json").read_text())["facts"]
    assert facts["mpi"]["hostfile"]["hosts"] == ["127.0.0.1", "no-such-host.invalid"]
    assert facts["mpi"]["relevant"] == "a hostfile was given"
    assert facts["mpi"]["sanity_command"][-1] == "hostname"


def test_accelerate_config_makes_mpi_relevant(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 2\nuse_cpu: true\n"
        f"mpirun_config:\n  mpirun_hostfile: {tmp_path / 'missing-hostfile'}\n")
    result = helpers_cli("audit", "--json", str(tmp_path / "a.json"), env={"HF_HOME": str(tmp_path)})
    facts = json.loads((tmp_path / "a.json").read_text())["facts"]
    assert facts["mpi"]["relevant"] == "the accelerate config names mpirun_hostfile"
    assert not facts["mpi"]["hostfile"]["readable"]
    assert "cannot be used" in result.stdout


def test_pasted_multi_cpu_config_says_mpi_unknown():
    machine = load_machine(PASTED / "accelerate_env_mpi.txt")
    [finding] = [f for f in machine.findings if f["code"] == "MPI_NOT_READY"]
    assert is_unknown(finding)
    assert not [f for f in evaluate({"mpi": None}) if f.code == "MPI_NOT_READY"]


def test_mpi_sanity_refuses_facts_files():
    result = helpers_cli("audit", "--facts", str(PASTED / "accelerate_env_mpi.txt"), "--mpi-sanity")
    assert result.returncode == 2 and "--mpi-sanity" in result.stderr


def _mpi_processes() -> list[str]:
    names = ("mpirun", "orterun", "orted", "prte", "prted", "hydra_pmi_proxy")
    return [p.info["name"] for p in psutil.process_iter(["name"]) if p.info["name"] in names]


@needs_mpirun
def test_sanity_run_passes_on_loopback_and_leaves_no_process(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("127.0.0.1 slots=1\n")
    before = _mpi_processes()
    result = helpers_cli("audit", "--hostfile", str(hosts), "--mpi-sanity")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MPI sanity run: passed" in result.stdout and socket.gethostname() in result.stdout
    assert _mpi_processes() == before


@needs_mpirun
def test_sanity_run_fails_for_a_host_it_cannot_reach(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("127.0.0.1\nno-such-host.invalid\n")
    before = _mpi_processes()
    result = helpers_cli("audit", "--hostfile", str(hosts), "--mpi-sanity")
    assert result.returncode == 1 and "MPI sanity run: FAILED" in result.stdout
    assert "[error] MPI_NOT_READY: The MPI sanity run failed" in result.stdout
    assert _mpi_processes() == before
