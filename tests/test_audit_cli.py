"""`python -m helpers audit | facts | diff`: real processes, real files, secrets scanned."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import audit
from helpers.audit.diff import diff_reports

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
sys.path.insert(0, str(FIXTURES))
from secret_env import NOT_COLLECTED, SECRET_ENV, leaks  # noqa: E402

HEALTHY = json.loads((FIXTURES / "healthy_8gpu.json").read_text())


def helpers_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "helpers", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def write_facts(path: Path, facts: dict) -> Path:
    path.write_text(json.dumps(facts))
    return path


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """One real `python -m helpers audit` under a secret-bearing environment and accelerate config."""
    tmp = tmp_path_factory.mktemp("audit-cli")
    hf_home = tmp / "hf"
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text(
        "distributed_type: MULTI_GPU\nnum_processes: 2\n"
        f"hub_token: {SECRET_ENV['HF_TOKEN']}\n"
        f"tracking_uri: {SECRET_ENV['MASTER_ADDR']}\n")
    env = {**SECRET_ENV, "HF_HOME": str(hf_home)}
    result = helpers_cli("audit", "--json", str(tmp / "a.json"), "--html", str(tmp / "a.html"), env=env)
    return tmp, result


def test_audit_writes_reports_and_exits_0(secret_run):
    tmp, result = secret_run
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp / "a.json").read_text())
    assert list(report) == ["schema", "facts", "findings"] and report["schema"] == 1
    assert {"code", "severity", "title", "evidence", "fix", "source"} == set(report["findings"][0])
    assert report["facts"]["accelerate_config"]["num_processes"] == 2
    html = (tmp / "a.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html and "src=" not in html
    assert "NO_GPU" in result.stdout and "wrote" in result.stdout


def test_no_secret_in_any_output(secret_run):
    tmp, result = secret_run
    outputs = {"stdout": result.stdout, "stderr": result.stderr,
               **{p.name: p.read_text() for p in tmp.iterdir() if p.is_file()}}
    for name, text in outputs.items():
        assert leaks(text) == [], name
    facts = json.loads((tmp / "a.json").read_text())["facts"]
    assert not set(NOT_COLLECTED) & set(facts["env"])
    assert facts["env"]["HF_TOKEN"] == "<redacted>"
    assert facts["accelerate_config"]["hub_token"] == "<redacted>"
    assert facts["env"]["MASTER_ADDR"] == "https://trainer:<redacted>@10.1.2.3"


def test_facts_cli_prints_json_and_never_imports_torch_here():
    """`python -m helpers facts` prints the facts; torch is imported only in the probe child."""
    code = ("import sys; from helpers import cli; code = cli.main(['facts']); "
            "print('TORCH_IMPORTED', 'torch' in sys.modules, code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    printed, _, flag = out.stdout.rpartition("TORCH_IMPORTED")
    assert flag.split() == ["False", "0"], out.stderr
    facts = json.loads(printed)
    assert facts["schema"] == 1 and facts["torch"]["version"] and facts["torch"]["probe"]["ok"]


def test_facts_cli_and_anonymize(tmp_path):
    home = tmp_path / "home" / "ada"
    home.mkdir(parents=True)
    result = helpers_cli("facts", "--anonymize", "--json", str(tmp_path / "f.json"),
                         env={"HOME": str(home), "USER": "ada", "HF_HOME": str(home / ".hf"),
                              "TORCH_HOME": str(home / "torch")})
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "f.json").read_text()
    facts = json.loads(text)
    assert facts["hostname"] == "<host>" and facts["anonymized"] is True
    hostname = socket.gethostname()
    assert not re.search(rf"(?<![\w.-]){re.escape(hostname)}(?![\w-])", text)
    assert str(home) not in text and facts["env"]["TORCH_HOME"] == "~/torch"


def test_strict_exit_codes(tmp_path):
    bad = copy.deepcopy(HEALTHY)
    bad["torch"]["cuda"] = None  # TORCH_CPU_BUILD_WITH_GPUS: an error
    path = write_facts(tmp_path / "bad.json", bad)
    assert helpers_cli("audit", "--facts", str(path)).returncode == 0
    strict = helpers_cli("audit", "--facts", str(path), "--strict", "--report-dir", str(tmp_path / "r"))
    assert strict.returncode == 1 and "TORCH_CPU_BUILD_WITH_GPUS" in strict.stdout
    assert json.loads((tmp_path / "r" / "audit.json").read_text())["findings"][0]["severity"] == "error"
    good = write_facts(tmp_path / "good.json", HEALTHY)
    assert helpers_cli("audit", "--facts", str(good), "--strict").returncode == 0


def test_audit_anonymizes_facts_from_another_machine(tmp_path):
    path = write_facts(tmp_path / "node.json", HEALTHY)
    result = helpers_cli("audit", "--facts", str(path), "--anonymize", "--json", str(tmp_path / "o.json"))
    text = (tmp_path / "o.json").read_text()
    assert result.returncode == 0 and "gpu-node-01" not in text and "/home/ada" not in text


@pytest.mark.parametrize(("args", "message"), [
    (["audit", "--facts", "/nonexistent/facts.json"], "--facts: no such file"),
    (["audit", "--no-such-flag"], "unrecognized arguments"),
    (["diff", "only-one.json"], "at least two"),
    (["diff", str(FIXTURES / "healthy_8gpu.json"), str(FIXTURES / "fake_nvml.py")], "not a JSON"),
    (["diff", str(FIXTURES / "healthy_8gpu.json"), "/nonexistent.json"], "no such file"),
])
def test_bad_usage_exits_2_naming_the_argument(args, message):
    result = helpers_cli(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_importing_the_audit_stays_light_and_below_the_other_features():
    """helpers.audit imports leaves only: no torch, widgets or NVML, and no launch/trace/doctor/repro."""
    code = "import sys, helpers.audit; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60, check=True).stdout.split())
    forbidden = {"torch", "ipywidgets", "IPython", "matplotlib", "pynvml", "helpers.ui",
                 "helpers.launch", "helpers.trace", "helpers.doctor", "helpers.repro"}
    assert loaded & forbidden == set()


def test_fleet_needs_a_launcher():
    result = subprocess.run([sys.executable, "-m", "helpers.audit", "--fleet", "--json", "x.json"],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert result.returncode == 2 and "torchrun" in result.stderr


# ---------------------------------------------------------------------------------------------
# diff


def test_diff_identical_and_different(tmp_path):
    a = write_facts(tmp_path / "a.json", HEALTHY)
    same = copy.deepcopy(HEALTHY)
    same.update(hostname="gpu-node-02", collected_at="2027-01-01T00:00:00+00:00", cpu_count=64)
    same["env"]["RANK"] = "1"
    b = write_facts(tmp_path / "b.json", same)
    result = helpers_cli("diff", str(a), str(b))
    assert result.returncode == 0, result.stdout
    assert "cpu_count" in result.stdout and "hostname" not in result.stdout
    other = copy.deepcopy(HEALTHY)
    other["os"]["kernel"] = "5.4.0-150-generic"
    other["env"]["NCCL_P2P_DISABLE"] = "1"
    other["packages"]["accelerate"] = "0.34.2"
    other["gpus"][7]["name"] = "NVIDIA A100-SXM4-80GB"
    c = write_facts(tmp_path / "c.json", other)
    result = helpers_cli("diff", str(a), str(b), str(c), "--json", str(tmp_path / "d.json"),
                         "--html", str(tmp_path / "d.html"))
    assert result.returncode == 1
    diff = json.loads((tmp_path / "d.json").read_text())
    facts = {row["fact"]: row for row in diff["rows"]}
    assert facts["os.kernel"]["c"] == "5.4.0-150-generic" and facts["os.kernel"]["relevant"]
    assert facts["env.NCCL_P2P_DISABLE"]["a"] == "(absent)"
    assert facts["packages.accelerate"]["c"] == "0.34.2"
    assert "gpus.models" in facts and facts["cpu_count"]["relevant"] is False
    codes = {row["code"] for row in diff["finding_rows"]}
    assert {"KERNEL_BELOW_5_5", "MIXED_GPU_MODELS"} <= codes
    assert 'class=diff' in (tmp_path / "d.html").read_text()


def test_diff_accepts_reports_and_facts(tmp_path):
    report = audit.judge(HEALTHY)
    a = tmp_path / "report.json"
    report.to_json(a)
    b = write_facts(tmp_path / "facts.json", HEALTHY)
    result = diff_reports([a, b])
    assert result.identical and result.rows == [] and result.finding_rows == []
    assert result.machines == ["report", "facts"]
    twice = diff_reports([a, a])
    assert twice.machines == ["report", "report#2"]
