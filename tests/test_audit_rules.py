"""Every audit rule, with crafted facts that trigger it and look-alike facts that must not.

Facts start from two fixtures (a healthy 8 x H100 node, this kind of CPU-only machine) and are
changed by dotted paths. Pure functions: no process, no I/O beyond reading the fixtures.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helpers.audit.rules import CODES, REGISTRY, RULES, evaluate, rule, visible_devices

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
HEALTHY = json.loads((FIXTURES / "healthy_8gpu.json").read_text())
CPU_ONLY = json.loads((FIXTURES / "cpu_only.json").read_text())


def crafted(base: dict, **changes) -> dict:
    """A deep copy of ``base`` with ``a__b=value`` setting ``facts['a']['b']``."""
    facts = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = facts
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return facts


def with_gpu(base: dict, index: int, **fields) -> dict:
    facts = copy.deepcopy(base)
    facts["gpus"][index].update(fields)
    return facts


def codes(facts: dict) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for finding in evaluate(facts):
        found.setdefault(finding.code, []).append(finding.severity)
    return found


def env(base: dict, **variables) -> dict:
    return crafted(base, env={**base["env"], **variables})


def test_fixtures_are_clean():
    assert codes(HEALTHY) == {}
    assert codes(CPU_ONLY) == {"NO_GPU": ["info"]}


def test_every_code_has_a_rule_and_findings_are_complete():
    assert len(RULES) == len(CODES)
    bad = crafted(HEALTHY, os__kernel="5.4.0-150-generic")
    for finding in evaluate(bad):
        assert finding.code in CODES
        assert finding.severity in ("error", "warning", "info")
        assert all([finding.title, finding.evidence, finding.fix, finding.source])


# (code, expected severity, facts that trigger it, look-alike facts that must not)
CASES = [
    ("KERNEL_BELOW_5_5", "warning", crafted(HEALTHY, os__kernel="5.4.0-150-generic"),
     crafted(HEALTHY, os__kernel="5.5.0")),
    ("KERNEL_BELOW_5_5", "info", crafted(HEALTHY, os__kernel="4.4.0", os__gvisor=True),
     crafted(HEALTHY, os__kernel="6.8.0-1008-aws")),
    ("TORCH_CUDA_DRIVER_MISMATCH", "error", crafted(HEALTHY, torch__cuda="12.4", driver__cuda="11.8"),
     crafted(HEALTHY, torch__cuda="11.8", driver__cuda="12.4")),
    ("TORCH_CUDA_DRIVER_MISMATCH", "warning", crafted(HEALTHY, torch__cuda="12.6", driver__cuda="12.2"),
     crafted(HEALTHY, torch__cuda="12.4", driver__cuda="12.4")),
    ("TORCH_CPU_BUILD_WITH_GPUS", "error", crafted(HEALTHY, torch__cuda=None),
     crafted(CPU_ONLY, torch__cuda=None)),
    ("CUDA_VISIBLE_DEVICES_INVALID", "error", env(HEALTHY, CUDA_VISIBLE_DEVICES="0,1,1"),
     env(HEALTHY, CUDA_VISIBLE_DEVICES="0,1,2")),
    ("CUDA_VISIBLE_DEVICES_INVALID", "error", env(HEALTHY, CUDA_VISIBLE_DEVICES="0,9"),
     env(HEALTHY, CUDA_VISIBLE_DEVICES="7")),
    ("CUDA_VISIBLE_DEVICES_INVALID", "error",
     env(HEALTHY, CUDA_VISIBLE_DEVICES="GPU-00000000-aaaa-bbbb-cccc-000000000000,1"),
     env(HEALTHY, CUDA_VISIBLE_DEVICES="GPU-00000000,GPU-00000001")),
    ("CUDA_VISIBLE_DEVICES_INVALID", "warning", env(HEALTHY, CUDA_VISIBLE_DEVICES=""),
     env(CPU_ONLY, CUDA_VISIBLE_DEVICES="")),
    ("CUDA_INITIALIZED_BEFORE_LAUNCH", "error",
     crafted(HEALTHY, torch__initialized_here=True, torch__init_site="nb.ipynb:3 (x.cuda())"),
     crafted(HEALTHY, torch__initialized_here=False, torch__cuda_available=True)),
    ("MIXED_GPU_MODELS", "warning", with_gpu(HEALTHY, 7, name="NVIDIA A100-SXM4-80GB"),
     env(with_gpu(HEALTHY, 7, name="NVIDIA A100-SXM4-80GB"), CUDA_VISIBLE_DEVICES="0,1,2,3")),
    ("SHM_TOO_SMALL", "warning", crafted(HEALTHY, os__shm_bytes=64 * 1000 * 1000),
     crafted(HEALTHY, os__shm_bytes=512 * 1024 * 1024)),
    ("NO_FLIGHT_RECORDER_DUMP", "info",
     crafted(HEALTHY, env={k: v for k, v in HEALTHY["env"].items() if not k.startswith("TORCH_")}),
     env(HEALTHY, TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/shared/fr/rank_", TORCH_FR_DUMP_TEMP_FILE="")),
    ("NO_FLIGHT_RECORDER_DUMP", "info", env(HEALTHY, TORCH_FR_BUFFER_SIZE="0"),
     env(HEALTHY, TORCH_FR_BUFFER_SIZE="2000")),
    ("NCCL_ENV_SUSPICIOUS", "warning", env(HEALTHY, NCCL_P2P_DISABLE="1"),
     env(HEALTHY, NCCL_P2P_DISABLE="0")),
    ("NCCL_ENV_SUSPICIOUS", "warning", env(HEALTHY, NCCL_IB_DISABLE="1"),
     env(HEALTHY, NCCL_IB_HCA="mlx5_0")),
    ("NCCL_ENV_SUSPICIOUS", "warning", env(HEALTHY, NCCL_P2P_LEVEL="NVLINK"),
     env(HEALTHY, NCCL_P2P_LEVEL="NVL")),
    ("NCCL_ENV_SUSPICIOUS", "error", env(HEALTHY, NCCL_SOCKET_IFNAME="eth"),
     env(HEALTHY, NCCL_SOCKET_IFNAME="eno,ib")),
    ("NCCL_ENV_SUSPICIOUS", "error", env(HEALTHY, GLOO_SOCKET_IFNAME="=eno"),
     env(HEALTHY, GLOO_SOCKET_IFNAME="^docker,lo")),
    ("RTX40_P2P_DRIVER", "warning",
     crafted(HEALTHY, driver__version="535.104.05", driver__cuda="12.2", torch__cuda="12.1",
             gpus=[{**g, "name": "NVIDIA GeForce RTX 4090"} for g in HEALTHY["gpus"]]),
     crafted(HEALTHY, driver__version="550.40.07",
             gpus=[{**g, "name": "NVIDIA GeForce RTX 4090"} for g in HEALTHY["gpus"]])),
    ("ACCELERATE_CONFIG_MISMATCH", "error",
     crafted(HEALTHY, accelerate_config={**HEALTHY["accelerate_config"], "num_processes": 16}),
     crafted(HEALTHY, accelerate_config={**HEALTHY["accelerate_config"], "num_processes": 16,
                                         "num_machines": 2})),
    ("ACCELERATE_CONFIG_MISMATCH", "warning",
     env(HEALTHY, CUDA_VISIBLE_DEVICES="3") | {"accelerate_config": {
         **HEALTHY["accelerate_config"], "num_processes": 1}},
     env(HEALTHY, CUDA_VISIBLE_DEVICES="3") | {"accelerate_config": {
         **HEALTHY["accelerate_config"], "num_processes": 1, "distributed_type": "NO"}}),
    ("ACCELERATE_CONFIG_MISMATCH", "warning",
     crafted(HEALTHY, accelerate_config=None, accelerate_config_error="ScannerError: bad yaml"),
     crafted(HEALTHY, accelerate_config=None)),
    ("PORT_IN_USE", "warning",
     crafted(HEALTHY, network__rendezvous_port={"port": 29500, "source": "default",
                                                "in_job": False, "free": False, "holder": "pid 7 (python)"}),
     crafted(HEALTHY, network__rendezvous_port={"port": 29500, "source": "default",
                                                "in_job": True, "free": None, "holder": None})),
    ("OMP_THREADS_OVERSUBSCRIBED", "warning", env(HEALTHY, OMP_NUM_THREADS="24"),
     env(HEALTHY, OMP_NUM_THREADS="12")),
    ("OMP_THREADS_OVERSUBSCRIBED", "warning", env(HEALTHY, OMP_NUM_THREADS="four"),
     env(HEALTHY, OMP_NUM_THREADS="4")),
    ("PCIE_LINK_DEGRADED", "warning", with_gpu(HEALTHY, 5, pcie_width={"current": 8, "max": 16}),
     with_gpu(HEALTHY, 5, pcie_width={"current": 16, "max": 16})),
    ("PCIE_LINK_DEGRADED", "info", with_gpu(HEALTHY, 5, pcie_gen={"current": 1, "max": 5}),
     with_gpu(HEALTHY, 5, pcie_gen={"current": None, "max": 5})),
    ("GPU_THROTTLED", "warning", with_gpu(HEALTHY, 6, throttle_reasons=["GpuIdle", "HwThermalSlowdown"]),
     with_gpu(HEALTHY, 6, throttle_reasons=["GpuIdle", "SwPowerCap"])),
    ("ECC_ERRORS", "error",
     with_gpu(HEALTHY, 2, ecc={"enabled": True, "volatile_uncorrected": 3, "aggregate_uncorrected": 3,
                               "volatile_corrected": 0}),
     with_gpu(HEALTHY, 2, ecc={"enabled": True, "volatile_uncorrected": 0, "aggregate_uncorrected": 0,
                               "volatile_corrected": 12})),
    ("ECC_ERRORS", "warning",
     with_gpu(HEALTHY, 2, ecc={"enabled": True, "volatile_uncorrected": 0, "aggregate_uncorrected": 2,
                               "volatile_corrected": 0}),
     with_gpu(HEALTHY, 2, ecc=None)),
    ("GPU_QUERY_FAILED", "error", with_gpu(HEALTHY, 3, error="GPU is lost (NVML_ERROR_GPU_IS_LOST)"),
     with_gpu(HEALTHY, 3, error=None)),
    ("NVML_UNAVAILABLE", "warning",
     crafted(CPU_ONLY, driver__error="the NVIDIA kernel driver is not loaded",
             driver__device_nodes=["/dev/nvidia0"]),
     crafted(CPU_ONLY, driver__error="no NVIDIA driver here (NVML library libnvidia-ml.so not found)")),
    ("NVML_UNAVAILABLE", "warning",
     crafted(CPU_ONLY, driver__error="pynvml is not installed (pip install nvidia-ml-py)"),
     crafted(CPU_ONLY, driver__error=None)),
    ("NO_GPU", "info", CPU_ONLY, HEALTHY),
    ("TORCH_PROBE_FAILED", "error",
     crafted(HEALTHY, torch__probe={"ok": False, "error": "ImportError: libcudnn.so.9", "seconds": None}),
     crafted(HEALTHY, torch__probe={"ok": True, "error": None, "seconds": 2.0})),
    ("MPI_NOT_READY", "error",
     crafted(HEALTHY, mpi={"relevant": "a hostfile was given", "mpirun": "/usr/bin/mpirun",
                           "hostfile": {"path": "h", "hosts": ["node2"], "error": None},
                           "ssh": {"node2": {"ok": False, "error": "Connection refused",
                                             "local": False}},
                           "sanity_command": ["mpirun", "-f", "h", "-n", "1", "-ppn", "1",
                                              "hostname"]}),
     crafted(HEALTHY, mpi={"relevant": "mpirun is on PATH", "mpirun": "/usr/bin/mpirun",
                           "hostfile": None, "ssh": None, "sanity_command": None})),
    ("MPI_NOT_READY", "error",
     crafted(HEALTHY, mpi={"relevant": "the accelerate config asks for MULTI_CPU", "mpirun": None},
             accelerate_config={"distributed_type": "MULTI_CPU"}),
     crafted(HEALTHY, mpi=None, accelerate_config={"distributed_type": "MULTI_GPU"})),
    ("HOSTNAME_UNRESOLVED", "warning",
     crafted(HEALTHY, network__hostname_resolves=False, network__resolve_error="Name or service not known"),
     crafted(HEALTHY, network__hostname_resolves=None)),
]


@pytest.mark.parametrize(("code", "severity", "trigger", "look_alike"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_rule_triggers_and_spares_look_alikes(code, severity, trigger, look_alike):
    assert severity in codes(trigger).get(code, []), codes(trigger)
    assert code not in codes(look_alike), codes(look_alike)


def test_every_code_is_covered_by_cases():
    assert {case[0] for case in CASES} == set(CODES)


def test_rules_and_codes_are_one_registry_and_each_rule_reports_its_own_code():
    """RULES and CODES are read off @rule: same order, one code per rule, and every finding a
    rule produces (over every triggering case) carries the code it was registered under."""
    assert list(REGISTRY) == list(CODES) and list(REGISTRY.values()) == list(RULES)
    assert len(set(CODES)) == len(CODES)
    for code, check in REGISTRY.items():
        produced = [finding for case in CASES for finding in check(case[2])]
        assert produced, f"{code}: no case triggers its rule"
        assert {finding.code for finding in produced} == {code}, check.__name__


def test_a_code_cannot_be_declared_twice_or_misspelled():
    before = dict(REGISTRY)
    with pytest.raises(ValueError, match="KERNEL_BELOW_5_5 is already declared by rule_kernel"):
        rule("KERNEL_BELOW_5_5")
    with pytest.raises(ValueError, match="UPPER_SNAKE_CASE; got 'no-gpu'"):
        rule("no-gpu")
    assert REGISTRY == before


def test_rtx40_with_workaround_set_is_only_info_and_silences_nccl_warning():
    facts = crafted(HEALTHY, driver__version="535.104.05", driver__cuda="12.2", torch__cuda="12.1",
                    gpus=[{**g, "name": "NVIDIA GeForce RTX 4090"} for g in HEALTHY["gpus"]])
    facts["env"].update(NCCL_P2P_DISABLE="1", NCCL_IB_DISABLE="1")
    assert codes(facts) == {"RTX40_P2P_DRIVER": ["info"]}


def test_bf16_on_pre_ampere_gpus_is_an_error():
    gpus = [{**g, "name": "Tesla V100-SXM2-32GB", "compute_capability": "7.0"} for g in HEALTHY["gpus"]]
    finding = [f for f in evaluate(crafted(HEALTHY, gpus=gpus)) if f.code == "ACCELERATE_CONFIG_MISMATCH"]
    assert [f.severity for f in finding] == ["error"] and "bf16" in finding[0].title
    fp16 = crafted(HEALTHY, gpus=gpus, accelerate_config={**HEALTHY["accelerate_config"],
                                                          "mixed_precision": "fp16"})
    assert "ACCELERATE_CONFIG_MISMATCH" not in codes(fp16)


def test_kernel_wording_follows_facts():
    [finding] = evaluate(crafted(HEALTHY, os__kernel="5.4.0-150-generic"))
    assert "cause is unknown" in finding.fix and "NCCL_SHM_DISABLE=1" in finding.fix
    assert "1929" in finding.source


def test_findings_are_sorted_errors_first():
    facts = env(with_gpu(HEALTHY, 5, pcie_gen={"current": 1, "max": 5}), NCCL_P2P_DISABLE="1")
    facts["torch"]["cuda"] = None
    severities = [f.severity for f in evaluate(facts)]
    assert severities == sorted(severities, key=("error", "warning", "info").index)
    assert severities[0] == "error" and severities[-1] == "info"


def test_odd_facts_never_crash_a_rule():
    odd = {"schema": 1, "gpus": [{"index": 0, "pcie_width": "x16"}, "nonsense"], "env": {},
           "os": {"kernel": 5}, "torch": {"cuda": 12}, "accelerate_config": ["not", "a", "dict"]}
    findings = evaluate(odd)
    failed = [f for f in findings if f.code == "AUDIT_RULE_FAILED"]
    assert all(f.severity == "warning" for f in failed)
    assert evaluate({}) is not None


@pytest.mark.parametrize(("value", "indices", "severity"), [
    (None, list(range(8)), None),
    ("1,0", [1, 0], None),
    (" 2, 3", [2, 3], None),
    ("0,1,0", [], "error"),           # a repeated id: no GPU at all
    ("0,-1,3", [0], "error"),         # a negative entry ends the list
    ("0,8,1", [0], "error"),          # out of range ends the list
    ("0,GPU-00000001", [0], "error"),  # a UUID in a list of indices
    ("GPU-00000003", [3], None),      # a UUID prefix
    ("GPU-00000003,MIG-abc", [3], None),
    ("GPU-deadbeef", [], "error"),
    ("", [], "warning"),
])
def test_visible_devices_follow_the_driver(value, indices, severity):
    result = visible_devices(value, HEALTHY["gpus"])
    assert result.indices == indices
    assert result.severity == severity
    assert bool(result.problems) == (severity is not None)
