"""Judging what people paste into issues: collect_env and accelerate env texts, old facts files.

The texts are real: produced here by the real tools (live, and committed under
tests/fixtures/audit/pasted/), or written in the exact format those tools print for GPU machines
and older versions (torch/utils/collect_env.py ``env_info_fmt``, accelerate/commands/env.py).
The CLI runs in a subprocess for its exit codes.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.audit import pasted
from helpers.audit.diff import diff_reports, load_machine
from helpers.audit.facts import normalise
from helpers.audit.rules import evaluate, is_unknown

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
PASTED = FIXTURES / "pasted"
HEALTHY = json.loads((FIXTURES / "healthy_8gpu.json").read_text())
VENV_BIN = Path(sys.executable).parent


def helpers_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers", *args], capture_output=True, text=True,
                          timeout=timeout)


def verdicts(facts_or_machine) -> dict[str, list[str]]:
    """code -> severities of the findings that judge (unknowns left out)."""
    findings = facts_or_machine.findings if hasattr(facts_or_machine, "findings") else [
        f.__dict__ for f in evaluate(facts_or_machine)]
    out: dict[str, list[str]] = {}
    for finding in findings:
        if not is_unknown(finding):
            out.setdefault(finding["code"], []).append(finding["severity"])
    return out


def unknowns(machine) -> set[str]:
    return {f["code"] for f in machine.findings if is_unknown(f)}


# ---------------------------------------------------------------------------------------------
# the real tools, run here


def test_live_collect_env_parses_to_this_machine():
    import torch

    out = subprocess.run([sys.executable, "-m", "torch.utils.collect_env"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    facts, lines, kinds = pasted.parse(out)
    assert kinds == [pasted.COLLECT_ENV]
    assert facts["torch"]["version"] == torch.__version__
    assert facts["os"]["kernel"] == platform.release() and facts["os"]["system"] == "Linux"
    assert facts["python"]["version"] == platform.python_version()
    assert facts["torch"]["cuda_available"] is torch.cuda.is_available()
    assert facts["packages"]["torch"] == torch.__version__ and facts["partial"] == ["packages"]
    assert lines["torch.version"] == "line 2"


def test_live_accelerate_env_parses_its_config(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 4\n"
        "mixed_precision: bf16\ngpu_ids: 0,1,2,3\n")
    accelerate = shutil.which("accelerate", path=str(VENV_BIN)) or "accelerate"
    out = subprocess.run([accelerate, "env"], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "HF_HOME": str(tmp_path)}).stdout
    facts, _, kinds = pasted.parse(out)
    import accelerate as acc

    assert kinds == [pasted.ACCELERATE_ENV]
    assert facts["packages"]["accelerate"] == acc.__version__
    config = facts["accelerate_config"]
    assert config["distributed_type"] == "MULTI_GPU" and config["num_processes"] == 4
    assert config["mixed_precision"] == "bf16" and config["gpu_ids"] == "0,1,2,3"
    assert facts["os"]["kernel"] == platform.release()


# ---------------------------------------------------------------------------------------------
# GPU machines and older wordings


def test_torch20_collect_env_on_8_a100():
    facts, lines, _ = pasted.parse((PASTED / "collect_env_8xa100_torch20.txt").read_text())
    assert [g["index"] for g in facts["gpus"]] == list(range(8))
    assert {g["name"] for g in facts["gpus"]} == {"NVIDIA A100-SXM4-80GB"}
    assert facts["driver"] == {"version": "525.105.17"} and facts["torch"]["cuda"] == "11.7"
    assert facts["torch"]["hip"] is None and facts["os"]["distro"] == "Ubuntu 20.04.6 LTS"
    assert facts["os"]["kernel"] == "5.4.0-150-generic" and facts["cpu_count_total"] == 128
    assert "driver.cuda" not in lines  # collect_env never prints it: unknown, not guessed


def test_accelerate_027_wording_and_space_indented_config():
    facts, _, _ = pasted.parse((PASTED / "accelerate_env_027.txt").read_text())
    assert facts["torch"] == {"version": "2.0.1+cu117", "cuda_available": True,
                              "device_name": "NVIDIA A100-SXM4-80GB"}
    assert facts["accelerate_config"]["num_processes"] == 16
    assert facts["accelerate_config"]["use_cpu"] is False
    assert facts["accelerate_config"]["tpu_env"] == []


def test_a_markdown_paste_of_an_rtx4090_pair_gets_rtx40_p2p_driver():
    machine = load_machine(PASTED / "collect_env_2x4090_torch24.md")
    assert verdicts(machine) == {"RTX40_P2P_DRIVER": ["warning"]}
    [finding] = [f for f in machine.findings if f["code"] == "RTX40_P2P_DRIVER"]
    assert "unknown (the environment is not in the facts)" in finding["evidence"]
    assert {"NCCL_ENV_SUSPICIOUS", "SHM_TOO_SMALL", "TORCH_CUDA_DRIVER_MISMATCH"} <= unknowns(machine)


def test_accelerate_env_not_found_config_is_unknown():
    machine = load_machine(PASTED / "accelerate_env_no_config.txt")
    assert "accelerate_config" not in machine.facts
    assert "ACCELERATE_CONFIG_MISMATCH" in unknowns(machine)


def test_both_texts_in_one_file_and_unknown_words():
    text = (PASTED / "collect_env_cpu_torch213.txt").read_text() + "\n" + \
        (PASTED / "accelerate_env_mpi.txt").read_text()
    facts, _, kinds = pasted.parse(text)
    assert kinds == [pasted.COLLECT_ENV, pasted.ACCELERATE_ENV]
    # "CUDA used to build PyTorch: Could not collect" and "GPU models ...: Could not collect"
    assert "cuda" not in facts["torch"] and "gpus" not in facts and "driver" not in facts
    assert facts["accelerate_config"]["mpirun_config"]["mpirun_hostfile"] == "/etc/mpi/hostfile"


def test_cpu_build_unknown_when_collect_env_could_not_collect():
    text = (PASTED / "collect_env_2x4090_torch24.md").read_text().replace(
        "CUDA used to build PyTorch: 12.1", "CUDA used to build PyTorch: Could not collect")
    facts, _, _ = pasted.parse(text)
    found = {f.code: f for f in evaluate(facts)}
    assert is_unknown(found["TORCH_CPU_BUILD_WITH_GPUS"])
    none = pasted.parse(text.replace("Could not collect", "None", 1))[0]
    assert {f.code: f.severity for f in evaluate(none)}["TORCH_CPU_BUILD_WITH_GPUS"] == "error"


def test_driver_older_than_the_cuda_major_is_an_error_without_driver_cuda():
    text = (PASTED / "collect_env_2x4090_torch24.md").read_text().replace(
        "Nvidia driver version: 535.104.05", "Nvidia driver version: 470.199.02")
    facts, _, _ = pasted.parse(text)
    assert verdicts(facts)["TORCH_CUDA_DRIVER_MISMATCH"] == ["error"]


# ---------------------------------------------------------------------------------------------
# the CLI: several files of one machine, provenance, exit codes


def test_cli_combines_files_of_one_machine_and_says_where_each_fact_came_from(tmp_path):
    a, b = PASTED / "collect_env_8xa100_torch20.txt", PASTED / "accelerate_env_027.txt"
    result = helpers_cli("audit", "--facts", str(a), "--facts", str(b), "--strict",
                         "--json", str(tmp_path / "r.json"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "num_processes=16 needs 16 GPUs per machine; 8 visible" in result.stdout
    assert f"read from {a} (torch collect_env): " in result.stdout
    assert f"read from {b} (accelerate env): accelerate_config" in result.stdout
    facts = json.loads((tmp_path / "r.json").read_text())["facts"]
    assert facts["provenance"]["gpus"] == f"{a} line 18"
    assert facts["provenance"]["accelerate_config"] == f"{b} line 13"
    assert [s["kind"] for s in facts["sources"]] == ["torch collect_env", "accelerate env"]
    assert "CUDA_VISIBLE_DEVICES unknown" in result.stdout
    html = helpers_cli("audit", "--facts", str(a), "--html", str(tmp_path / "r.html"))
    assert html.returncode == 0 and f"<code>{a}</code> (torch collect_env)" in \
        (tmp_path / "r.html").read_text()


def test_old_facts_without_index_are_judged_right(tmp_path):
    old = copy.deepcopy(HEALTHY)
    for gpu in old["gpus"]:
        del gpu["index"]
    del old["os"]["system"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    machine = load_machine(path)
    assert verdicts(machine) == {}  # 8 visible, not 0: no ACCELERATE_CONFIG_MISMATCH
    assert any("without 'index', taken in list order" in n for n in machine.facts["notes"])
    result = helpers_cli("audit", "--facts", str(FIXTURES / "old_rtx4090_pair.json"))
    assert result.returncode == 0 and "[warning] RTX40_P2P_DRIVER" in result.stdout
    assert "[warning] KERNEL_BELOW_5_5" in result.stdout and "os.system: Linux" in result.stdout


def test_normalise_infers_only_what_is_unambiguous():
    facts, notes = normalise({"os": {"kernel": "23.1.0"}, "gpus": []})
    assert "system" not in facts["os"] and notes == []  # Darwin's or Linux's: unknown
    facts, _ = normalise({"os": {"kernel": "4.18.0-513.el8.x86_64"}})
    assert facts["os"]["system"] == "Linux"
    assert normalise(normalise(HEALTHY)[0]) == (normalise(HEALTHY)[0], [])


@pytest.mark.parametrize(("name", "content", "message"), [
    ("broken.json", '{"schema": 1,\n "gpus": [\n}', "broken.json is not a JSON audit report or "
     "facts file: line 3 column 1"),
    ("gpus.json", '{"schema": 1, "gpus": "eight"}', "gpus.json: key 'gpus' must be a list"),
    ("index.json", '{"schema": 1, "gpus": [{"index": 0}, {"name": "x"}]}',
     "key 'gpus[1].index' is missing while other GPUs have one"),
    ("env.json", '{"schema": 1, "env": {"NCCL_DEBUG": ["WARN"]}}', "key 'env.NCCL_DEBUG' must be text"),
    ("cuda.txt", "PyTorch version: 2.3.0\nIs CUDA available: maybe\n",
     "cuda.txt: line 2: 'Is CUDA available: maybe' (expected Yes, No, True or False)"),
    ("acc.txt", "- `Accelerate` version: 0.30.1\n- PyTorch version (GPU?): 2.3.0\n",
     "acc.txt: line 2: '- PyTorch version (GPU?): 2.3.0'"),
    ("notes.txt", "my GPUs are slow\n", "notes.txt: not a JSON audit report or facts file, nor"),
])
def test_malformed_files_exit_2_naming_file_and_key_or_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    result = helpers_cli("audit", "--facts", str(path))
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_files_that_contradict_each_other_exit_2(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text((PASTED / "accelerate_env_027.txt").read_text().replace(
        "Linux-5.4.0-150-generic", "Linux-6.8.0-45-generic"))
    result = helpers_cli("audit", "--facts", str(PASTED / "collect_env_8xa100_torch20.txt"),
                         "--facts", str(other))
    assert result.returncode == 2 and "os.kernel = '6.8.0-45-generic'" in result.stderr
    assert "collect_env_8xa100_torch20.txt line 14 says '5.4.0-150-generic'" in result.stderr


# ---------------------------------------------------------------------------------------------
# diff: unknown never differs


def test_diff_pasted_against_facts_unknown_never_decides():
    paste = [PASTED / "collect_env_8xa100_torch20.txt", PASTED / "accelerate_env_027.txt"]
    same = copy.deepcopy(HEALTHY)
    same["torch"].update(version="2.0.1+cu117", cuda="11.7")
    same["python"]["version"] = "3.10.11"
    same["os"].update(kernel="5.4.0-150-generic", distro="Ubuntu 20.04.6 LTS")
    same["driver"]["version"] = "525.105.17"
    same["gpus"] = [{**g, "name": "NVIDIA A100-SXM4-80GB"} for g in same["gpus"]]
    same["packages"] = {"torch": "2.0.1", "numpy": "1.24.3", "accelerate": "0.27.2",
                        "triton": "2.0.0", "transformers": "4.44.0"}
    same["accelerate_config"] = load_machine(paste).facts["accelerate_config"]
    same.update(env={})
    result = diff_reports([paste, same], labels=["pasted", "live"])
    rows = {row["fact"]: row for row in result.rows}
    assert rows["packages.transformers"]["pasted"] == "(unknown)"
    assert rows["driver.cuda"]["pasted"] == "(unknown)"
    assert result.identical, [r for r in result.rows if "(unknown)" not in r.values()]
    same["packages"]["numpy"] = "2.0.0"
    assert not diff_reports([paste, same]).identical


def test_diff_cli_with_comma_groups_and_live():
    group = f"{PASTED / 'collect_env_cpu_torch213.txt'},{PASTED / 'accelerate_env_no_config.txt'}"
    result = helpers_cli("diff", group, str(PASTED / "collect_env_2x4090_torch24.md"))
    assert result.returncode == 1 and "DIFFERENT" in result.stdout
    live = helpers_cli("diff", str(PASTED / "collect_env_2x4090_torch24.md"), "--live")
    assert live.returncode == 1 and "this machine" in live.stdout
    alone = helpers_cli("diff", group)
    assert alone.returncode == 2 and "at least two machines" in alone.stderr


@pytest.mark.parametrize(("platform_line", "expected"), [
    ("Linux-5.15.0-105-generic-x86_64-with-glibc2.35",
     {"os.system": "Linux", "os.kernel": "5.15.0-105-generic", "os.machine": "x86_64"}),
    ("Linux-5.15.133.1-microsoft-standard-WSL2-x86_64-with-glibc2.35",
     {"os.system": "Linux", "os.kernel": "5.15.133.1-microsoft-standard-WSL2", "os.machine": "x86_64"}),
    ("Linux-5.4.143.bsk.7-amd64-x86_64-with-debian-10.13",
     {"os.system": "Linux", "os.kernel": "5.4.143.bsk.7-amd64", "os.machine": "x86_64"}),
    ("Linux-6.8.0-1008-aws-aarch64-with-glibc2.39",
     {"os.system": "Linux", "os.kernel": "6.8.0-1008-aws", "os.machine": "aarch64"}),
    ("macOS-14.1.1-arm64-arm-64bit", {"os.system": "Darwin"}),
    ("Windows-10-10.0.19045-SP0", {"os.system": "Windows"}),
    ("Could not collect", {}),
])
def test_platform_lines_of_every_os(platform_line, expected):
    assert pasted._platform(platform_line) == expected


def test_rocm_and_single_line_gpu_wordings():
    base = (PASTED / "collect_env_2x4090_torch24.md").read_text()
    rocm = base.replace("GPU models and configuration: \nGPU 0: NVIDIA GeForce RTX 4090\n"
                        "GPU 1: NVIDIA GeForce RTX 4090\n",
                        "GPU models and configuration: AMD Instinct MI250X / MI250 (gfx90a)\n")
    assert rocm != base and "gpus" not in pasted.parse(rocm)[0]  # one name, no count: unknown, not one GPU
    single = base.replace("GPU models and configuration: \nGPU 0:", "GPU models and configuration: GPU 0:")
    single = single.replace("GPU 1: NVIDIA GeForce RTX 4090\n", "")
    assert pasted.parse(single)[0]["gpus"] == [{"index": 0, "name": "NVIDIA GeForce RTX 4090"}]


def test_string_indices_are_numbers():
    facts, notes = normalise({"gpus": [{"index": "1", "name": "b"}, {"index": "0", "name": "a"}]})
    assert [g["index"] for g in facts["gpus"]] == [1, 0] and len(notes) == 2
