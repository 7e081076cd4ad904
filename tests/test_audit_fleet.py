"""Fleet audit: two real torchrun agents on loopback (static rendezvous), one report on rank 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.launch import free_port

DEADLINE_S = 120
SECRET = "hf_SecretFleetToken1234567890abcd"


def start_agent(node_rank: int, port: int, out: Path, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "helpers.audit", "--fleet", "--json", str(out / "fleet.json"),
               "--html", str(out / "fleet.html")]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def wait_all(agents: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for every agent until the deadline; kill the process groups of any still running."""
    end = time.monotonic() + DEADLINE_S
    results = []
    try:
        for agent in agents:
            output, _ = agent.communicate(timeout=max(1, end - time.monotonic()))
            results.append((agent.returncode, output))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.communicate()
    return results


def test_fleet_report_across_two_agents(tmp_path, leftovers):
    out = tmp_path / "out"
    scratch = tmp_path / "scratch"  # torchrun's own torchelastic_* folders land here
    scratch.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "HF_TOKEN"))}
    base["TMPDIR"] = str(scratch)
    port = free_port()
    agents = [start_agent(0, port, out, base),
              start_agent(1, port, out, {**base, "NCCL_P2P_DISABLE": "1", "HF_TOKEN": SECRET})]
    results = wait_all(agents)
    for code, output in results:
        assert code == 0, output[-3000:]
    fleet = json.loads((out / "fleet.json").read_text())
    labels = [node["label"] for node in fleet["nodes"]]
    assert [node["node"] for node in fleet["nodes"]] == [0, 1] and len(set(labels)) == 2
    rows = {row["fact"]: row for row in fleet["diff"]["rows"]}
    assert fleet["diff"]["identical"] is False
    assert rows["env.NCCL_P2P_DISABLE"][labels[0]] == "(absent)"
    assert rows["env.NCCL_P2P_DISABLE"][labels[1]] == "1"
    assert rows["env.HF_TOKEN"][labels[1]] == "<redacted>"
    assert "packages.torch" not in rows and "os.kernel" not in rows  # same machine, same facts
    for node in fleet["nodes"]:
        assert node["facts"]["network"]["rendezvous_port"]["in_job"] is True
        assert "PORT_IN_USE" not in {f["code"] for f in node["findings"]}
    html = (out / "fleet.html").read_text()
    assert "class=diff" in html and "NCCL_P2P_DISABLE" in html
    for text in [html, (out / "fleet.json").read_text()] + [output for _, output in results]:
        assert SECRET not in text
    assert {p.name.split("_")[0] for p in scratch.iterdir()} <= {"torchelastic"}
    leftovers.check()
