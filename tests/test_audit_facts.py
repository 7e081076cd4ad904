"""Facts: the real collection on this machine, NVML paths with a fake NVML, config, port, probe."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import sys
import types
from pathlib import Path

import pynvml
import pytest

from helpers import audit, cuda_watch
from helpers.audit import facts as audit_facts
from helpers.audit import gpu as audit_gpu
from helpers.audit.rules import evaluate

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "audit"))
import fake_nvml  # noqa: E402


@pytest.fixture(scope="module")
def facts():
    """One real collection for the whole module (a torch child costs ~2 s).

    ``torch_before``: whether torch was already imported (other tests of a session may do it).
    """
    torch_before = "torch" in sys.modules
    collected = audit.collect_facts()
    collected.torch_before = torch_before
    return collected


def test_facts_schema(facts):
    assert facts["schema"] == 1
    assert isinstance(facts["os"]["kernel"], str) and facts["os"]["kernel"]
    assert isinstance(facts["os"]["shm_bytes"], int)
    assert facts["packages"]["torch"] == importlib.metadata.version("torch")
    assert facts["packages"]["accelerate"] == importlib.metadata.version("accelerate")
    assert "transformers" not in facts["packages"] or isinstance(facts["packages"]["transformers"], str)
    for key in ("cuda", "nccl"):
        assert facts["torch"][key] is None or isinstance(facts["torch"][key], str)
    assert facts["driver"]["version"] is None or isinstance(facts["driver"]["version"], str)
    assert facts["driver"]["cuda"] is None or isinstance(facts["driver"]["cuda"], str)
    assert isinstance(facts["gpus"], list)
    assert isinstance(facts["env"], dict)
    assert facts["accelerate_config"] is None or isinstance(facts["accelerate_config"], dict)
    assert isinstance(facts["cpu_count"], int) and facts["cpu_count"] >= 1
    assert isinstance(facts["memory_bytes"], int) and facts["memory_bytes"] > 0
    json.dumps(facts)  # plain JSON all the way down


def test_facts_on_this_cpu_machine(facts):
    assert facts["torch"]["probe"]["ok"], facts["torch"]["probe"]
    assert facts["torch"]["version"] == importlib.metadata.version("torch")
    assert facts["torch"]["cuda_available"] is False
    assert facts["torch"]["distributed"]["gloo"] is True
    assert facts["torch"]["initialized_here"] is False
    assert facts["gpus"] == [] and facts["driver"]["error"]
    assert [f.code for f in evaluate(facts)] == ["NO_GPU"]
    assert facts.torch_before or "torch" not in sys.modules  # the caller never imported torch


def test_torch_version_is_read_without_importing_torch():
    torch_before = "torch" in sys.modules
    static = audit_facts._static_torch_version()
    assert static["__version__"] == importlib.metadata.version("torch")
    assert "cuda" in static and (torch_before or "torch" not in sys.modules)


def test_env_is_only_the_relevant_prefixes(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = audit_facts.relevant_env()
    assert env["NCCL_DEBUG"] == "INFO" and env["WORLD_SIZE"] == "2"
    assert "SOME_UNRELATED_VARIABLE" not in env and "PATH" not in env and "HOME" not in env


# ---------------------------------------------------------------------------------------------
# NVML with a fake


def test_fake_nvml_matches_pynvml():
    names = [n for n in dir(fake_nvml.FakeNVML) if n.startswith("nvml")]
    names += [n for n in dir(fake_nvml) if n.startswith("NVML_")]
    assert [n for n in names if not hasattr(pynvml, n)] == []
    for name in (n for n in dir(fake_nvml) if n.startswith("NVML_")):
        real = getattr(pynvml, name)
        assert getattr(fake_nvml, name) == (real[0] if isinstance(real, tuple) else real), name


def test_eight_gpus_two_models(facts):
    gpu = audit_gpu.gpu_facts(fake_nvml.eight_gpus_two_models())
    assert gpu["driver"] == {**gpu["driver"], "version": "550.54.15", "cuda": "12.4", "error": None}
    assert [g["name"] for g in gpu["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 4 + ["Tesla V100-SXM2-32GB"] * 4
    first = gpu["gpus"][0]
    assert first["memory_bytes"] == 80 << 30 and first["compute_capability"] == "9.0"
    assert first["pcie_gen"] == {"current": 5, "max": 5} and first["nvlink"] == {"active": 18, "links": 18}
    assert gpu["gpus"][5]["pcie_width"] == {"current": 8, "max": 16}
    assert gpu["gpus"][2]["ecc"]["volatile_uncorrected"] == 3
    assert gpu["gpus"][6]["throttle_reasons"] == ["GpuIdle", "HwThermalSlowdown"]
    assert gpu["nvml_topology"]["matrix"][0] == ["X", "NV", "NV", "NV", "SYS", "SYS", "SYS", "SYS"]
    merged = {**facts, "driver": gpu["driver"], "gpus": gpu["gpus"],
              "topology": gpu["nvml_topology"], "torch": {**facts["torch"], "cuda": "12.4"}}
    found = {(f.code, f.severity) for f in evaluate(merged)}
    assert {("MIXED_GPU_MODELS", "warning"), ("PCIE_LINK_DEGRADED", "warning"),
            ("ECC_ERRORS", "error"), ("GPU_THROTTLED", "warning")} <= found
    assert not {code for code, _ in found} & {"NO_GPU", "AUDIT_RULE_FAILED", "TORCH_CPU_BUILD_WITH_GPUS"}
    # the real torch here is a CPU build: with these GPUs that is an error of its own
    assert ("TORCH_CPU_BUILD_WITH_GPUS", "error") in {(f.code, f.severity) for f in evaluate(
        {**merged, "torch": facts["torch"]})}


@pytest.mark.parametrize(("error", "text"), [
    (fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver"),
    (fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED, "not loaded"),
    (999, "NVML could not start"),
])
def test_nvml_init_failures_are_facts(error, text):
    nvml = fake_nvml.FakeNVML(init_error=error)
    gpu = audit_gpu.gpu_facts(nvml)
    assert text in gpu["driver"]["error"] and gpu["gpus"] == []


def test_lost_gpu_is_a_finding_and_the_rest_is_read(facts):
    nvml = fake_nvml.eight_gpus_two_models()
    nvml.gpus[3].lost = True
    gpu = audit_gpu.gpu_facts(nvml)
    assert gpu["gpus"][3]["error"].startswith("GPU is lost")
    assert gpu["gpus"][4]["name"] == "Tesla V100-SXM2-32GB"
    assert gpu["nvml_topology"]["labels"] == [f"GPU{i}" for i in (0, 1, 2, 4, 5, 6, 7)]
    assert nvml.calls[-1] == "shutdown"
    found = evaluate({**facts, "driver": gpu["driver"], "gpus": gpu["gpus"]})
    assert [f.severity for f in found if f.code == "GPU_QUERY_FAILED"] == ["error"]


def test_nvml_failing_midway_is_a_fact():
    nvml = fake_nvml.eight_gpus_two_models()
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(fake_nvml.NVMLError(999))
    gpu = audit_gpu.gpu_facts(nvml)
    assert gpu["driver"]["error"].startswith("NVML failed") and gpu["gpus"] == []
    assert nvml.calls == ["init", "shutdown"]


def test_pynvml_missing_is_a_finding(monkeypatch, facts):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    gpu = audit_gpu.gpu_facts()
    assert "not installed" in gpu["driver"]["error"]
    found = evaluate({**facts, "driver": gpu["driver"]})
    assert [(f.code, f.severity) for f in found if f.code == "NVML_UNAVAILABLE"] == \
        [("NVML_UNAVAILABLE", "warning")]


def test_collect_facts_takes_the_nvml_parameter():
    collected = audit.collect_facts(nvml=fake_nvml.eight_gpus_two_models(), probe_timeout_s=60)
    assert len(collected["gpus"]) == 8 and collected["topology"]["labels"][0] == "GPU0"
    assert {"TORCH_CPU_BUILD_WITH_GPUS", "MIXED_GPU_MODELS", "ECC_ERRORS"} <= \
        {f.code for f in evaluate(collected)}


# ---------------------------------------------------------------------------------------------
# accelerate config, port, probe, CUDA state


def test_accelerate_config_default_location(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_CONFIG_FILE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    path = tmp_path / "accelerate" / "default_config.yaml"
    assert audit_facts.accelerate_config_facts()["accelerate_config"] is None
    path.parent.mkdir()
    path.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: bf16\n")
    found = audit_facts.accelerate_config_facts()
    assert found["accelerate_config"] == {"distributed_type": "MULTI_GPU", "num_processes": 4,
                                          "mixed_precision": "bf16"}
    assert found["accelerate_config_path"] == str(path)
    path.write_text("distributed_type: [unclosed\n")
    broken = audit_facts.accelerate_config_facts()
    assert broken["accelerate_config"] is None and "Error" in broken["accelerate_config_error"]


def test_accelerate_config_override_json(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"num_processes": 2}))
    monkeypatch.setenv("ACCELERATE_CONFIG_FILE", str(path))
    found = audit_facts.accelerate_config_facts()
    assert found["accelerate_config"] == {"num_processes": 2}
    assert found["accelerate_config_source"] == "ACCELERATE_CONFIG_FILE"


def test_port_in_use_names_the_holder(monkeypatch):
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name, raising=False)
        held = audit_facts.rendezvous_port_facts()
        assert held["port"] == port and held["source"] == "MASTER_PORT" and held["free"] is False
        assert held["holder"] is None or f"pid {os.getpid()}" in held["holder"]
        monkeypatch.setenv("RANK", "0")
        assert audit_facts.rendezvous_port_facts()["in_job"] is True
    monkeypatch.delenv("RANK")
    assert audit_facts.rendezvous_port_facts()["free"] is True


def test_probe_timeout_kills_the_child(monkeypatch, leftovers):
    monkeypatch.setattr(audit_facts, "TORCH_PROBE", "import time; time.sleep(60)")
    probe = audit_facts._start_torch_probe()
    result = audit_facts.torch_facts(probe, timeout_s=0.5)
    assert "longer than 0.5 s" in result["probe"]["error"]
    assert result["version"] == importlib.metadata.version("torch")  # read without importing torch
    assert probe.process.poll() is not None
    leftovers.check()


def test_probe_failure_is_a_finding(monkeypatch, facts):
    monkeypatch.setattr(audit_facts, "TORCH_PROBE", "raise SystemExit('torch is broken here')")
    result = audit_facts.torch_facts(audit_facts._start_torch_probe(), timeout_s=30)
    assert "exited with code 1" in result["probe"]["error"]
    assert "torch is broken here" in result["probe"]["error"]
    found = evaluate({**facts, "torch": result})
    assert "TORCH_PROBE_FAILED" in {f.code for f in found}


def test_cuda_initialised_here_is_read_from_the_cuda_watch(monkeypatch):
    """No GPU here: stand in for an initialised torch.cuda (only the flag, nothing else)."""
    assert audit.check_before_launch() == []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(cuda_watch, "_init_site", "nb.ipynb:4 (model.cuda())")
    [finding] = audit.check_before_launch()
    assert finding.code == "CUDA_INITIALIZED_BEFORE_LAUNCH" and finding.severity == "error"
    assert "nb.ipynb:4 (model.cuda())" in finding.evidence
    assert audit_facts.cuda_state_here() == {"initialized_here": True,
                                             "init_site": "nb.ipynb:4 (model.cuda())"}
