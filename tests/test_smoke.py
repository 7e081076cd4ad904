"""helpers.smoke: formulas, real collectives on 1-3 gloo ranks, CLI exit codes, two torchrun nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import params, report, smoke
from helpers.launch import free_port


def test_bus_factors_follow_nccl_tests():
    assert smoke.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert smoke.bus_factor("all_gather_into_tensor", 4) == pytest.approx(0.75)
    assert smoke.bus_factor("reduce_scatter_tensor", 2) == pytest.approx(0.5)
    assert smoke.bus_factor("broadcast", 8) == 1.0
    assert smoke.bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="op must be one of"):
        smoke.bus_factor("all_to_all", 2)


def test_bandwidth_is_bytes_over_time_in_gb_per_s():
    algbw, busbw = smoke.bandwidth_gbps("all_reduce", 2 * 10**9, 2.0, 2)
    assert (algbw, busbw) == (pytest.approx(1.0), pytest.approx(1.0))


def test_message_sizes_are_powers_of_two_up_to_the_max():
    sizes = smoke.message_sizes(1)
    assert sizes[0] == 1024 and sizes[-1] == 2**20 and len(sizes) == 11
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))


def test_wrong_counts_differing_elements():
    assert smoke._wrong(torch.tensor([1.0, 2, 3]), torch.tensor([1.0, 2, 3])) == 0
    assert smoke._wrong(torch.tensor([1.0, 9, 9]), torch.tensor([1.0, 2, 3])) == 2
    assert smoke._wrong(torch.zeros(5), torch.zeros(3)) == 5


def _check_result(result: smoke.SmokeResult, ranks: int) -> None:
    assert result.ok, result.summary()
    assert result.world_size == ranks and result.backend == "gloo" and result.device == "cpu"
    assert [c["op"] for c in result.checks] == [
        "all_reduce_sum", "all_reduce_max", "all_gather", "all_gather_into_tensor",
        "reduce_scatter_tensor", "broadcast", "barrier", "all_gather_object"]
    assert all(c["wrong"] == 0 for c in result.checks)
    assert [r["rank"] for r in result.ranks] == list(range(ranks))
    ops = {row["op"] for row in result.bandwidth}
    assert ops == set(smoke.BANDWIDTH_OPS)
    for row in result.bandwidth:
        assert row["seconds"] > 0
        assert row["busbw_GBps"] == pytest.approx(
            row["algbw_GBps"] * smoke.bus_factor(row["op"], ranks))


@pytest.mark.parametrize("ranks", [1, 3])
def test_smoke_passes_on_gloo_ranks(ranks, leftovers):
    result = smoke.run_smoke(ranks, max_size_mib=1, timeout_s=60, check_launcher=False)
    _check_result(result, ranks)
    assert ("trivial" in result.verdict()) == (ranks == 1)
    leftovers.check()


def test_smoke_on_two_ranks_flags_notebook_launchers_cpu_trap(leftovers):
    result = smoke.run_smoke(2, max_size_mib=1, timeout_s=60)
    _check_result(result, 2)
    launcher = result.launcher
    # accelerate 1.15 named the missing GPUs "CUDAs"; 1.16 says "CPUs": the trap below is the same
    assert launcher.printed in ("Launching training on 2 CUDAs.", "Launching training on 2 CPUs.")
    assert launcher.cpu_trap and launcher.plain_world_sizes == [1, 1]
    assert launcher.cpu_world_sizes == [2, 2]
    assert "CPU trap" in launcher.summary()
    html = result._repr_html_()
    assert "PASS" in html and "all_gather_object" in html
    leftovers.check()  # includes /tmp/torchelastic_*: notebook_launcher's folder is removed


def test_a_launcher_check_past_its_deadline_keeps_the_stacks(leftovers):
    launcher = smoke.check_notebook_launcher(3, timeout_s=0.01)  # the child has no time to start
    assert not launcher.ok and launcher.error.startswith("the run passed its deadline")
    assert "--- rank 0 ---" in launcher.details and "\n" not in launcher.error
    result = smoke.SmokeResult(False, 3, "gloo", "cpu", [], [], [], 1.0, launcher)
    assert launcher.details in result.summary()  # what notebook 03 prints
    leftovers.check()


def test_the_result_is_notebook_03s_outcome(tmp_path, leftovers):
    path = tmp_path / "smoke.json"
    cfg = smoke.check_config(params.validate(num_processes=2, max_size_mib=1, timeout_s=60,
                                             results_path=str(path)))
    result = smoke.run_smoke(cfg.num_processes, cfg.max_size_mib, cfg.timeout_s, check_launcher=False)
    assert isinstance(result, report.Outcome) and result.ok, result.summary()
    assert result.verdict() == "PASS: 8 collectives correct on 2 ranks (gloo, cpu)"
    assert result.save(cfg.results_path) == path and result.save("") is None
    data = json.loads(path.read_text())
    assert list(data) == ["ok", "world_size", "backend", "device", "checks", "bandwidth", "ranks",
                          "seconds", "launcher", "error", "headline"]  # notebook 03's keys, + headline
    assert data["ok"] is True and data["world_size"] == 2 and data["error"] is None
    leftovers.check()


def test_a_group_of_another_size_than_asked_is_a_failure():
    assert smoke._group_size_problem(2, 2) is None
    problem = smoke._group_size_problem(2, 1)
    assert problem == "num_processes=2 asked, but the process group has 1 rank"
    result = smoke.SmokeResult(False, 1, "gloo", "cpu", [], [], [], 1.0, error=problem)
    assert result.verdict() == f"FAIL: {problem}"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers", "smoke", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_writes_json_and_exits_0(tmp_path, leftovers):
    out = tmp_path / "smoke.json"
    proc = _cli("--num-processes", "2", "--max-size-mib", "1", "--no-launcher-check", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["world_size"] == 2 and data["backend"] == "gloo"
    assert {"op", "ok", "wrong"} <= set(data["checks"][0])
    assert {"op", "bytes", "seconds", "algbw_GBps", "busbw_GBps"} <= set(data["bandwidth"][0])
    leftovers.check()


def test_cli_exits_1_when_the_run_times_out(leftovers):
    proc = _cli("--num-processes", "2", "--timeout-s", "0.2", "--no-launcher-check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "deadline" in proc.stdout
    leftovers.check()


@pytest.mark.parametrize("args, named", [
    (["--num-processes", "two"], "--num-processes"),
    (["--max-size-mib", "0"], "--max-size-mib"),
    (["--timeout-s", "-1"], "--timeout-s"),
])
def test_cli_bad_usage_exits_2_naming_the_argument(args, named):
    proc = _cli(*args)
    assert proc.returncode == 2
    assert named in proc.stderr and "must be" in proc.stderr


def test_torchrun_entry_point_exits_2_on_bad_usage_and_0_on_help():
    bad = subprocess.run([sys.executable, "-m", "helpers.smoke", "--max-size-mib", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--max-size-mib" in bad.stderr
    shown = subprocess.run([sys.executable, "-m", "helpers.smoke", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "usage: python -m helpers.smoke" in shown.stdout


def test_two_torchrun_nodes_on_loopback(tmp_path, leftovers):
    port = str(free_port())
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # torchrun's own temp folders stay in tmp_path
    out = tmp_path / "nodes.json"
    agents = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                          "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                          "127.0.0.1", "--master-port", port, "-m", "helpers.smoke",
                          "--max-size-mib", "1", "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    assert [a.returncode for a in agents] == [0, 0], outputs
    data = json.loads(out.read_text())
    assert data["ok"] and data["world_size"] == 2
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    leftovers.check()
