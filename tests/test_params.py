"""Parameter validation: one clear error naming the parameter, the value and what is accepted."""

import pytest

from helpers import params
from helpers.cli import main as cli


@pytest.mark.parametrize("value", [0, 65, -1, "two", 2.5, True, None])
def test_num_processes_rejects_with_the_parameter_named(value):
    with pytest.raises(ValueError) as info:
        params.check("num_processes", value)
    message = str(info.value)
    assert message.startswith("num_processes must be an integer in 1..64")
    assert repr(value) in message


@pytest.mark.parametrize("value", [1, 2, 64, 3.0])
def test_num_processes_accepts_integers_in_range(value):
    assert params.check("num_processes", value) == int(value)
    assert isinstance(params.check("num_processes", value), int)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "60"])
def test_timeout_must_be_positive_number(value):
    with pytest.raises(ValueError, match=r"^timeout_s must be a number > 0"):
        params.check("timeout_s", value)


def test_timeout_accepts_int_and_returns_float():
    assert params.check("timeout_s", 60) == 60.0


def test_validate_returns_attribute_config_and_stops_at_first_bad_value():
    cfg = params.validate(num_processes=3, max_size_mib=8)
    assert (cfg.num_processes, cfg["max_size_mib"]) == (3, 8)
    with pytest.raises(ValueError, match="max_size_mib must be an integer in 1..4096"):
        params.validate(num_processes=3, max_size_mib=0)


def test_unknown_parameter_is_an_error():
    with pytest.raises(ValueError, match="unknown parameter 'num_procs'"):
        params.check("num_procs", 2)


def test_relative_paths_resolve_against_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert params.resolve_path("reports/x.json") == params.REPO_ROOT / "reports" / "x.json"
    assert params.resolve_path(tmp_path / "a") == tmp_path / "a"


def test_cli_bad_flag_exits_2_naming_the_argument(capsys):
    assert cli(["smoke", "--num-processes", "0"]) == 2  # an exit code, not argparse's SystemExit
    err = capsys.readouterr().err
    assert "--num-processes" in err and "num_processes must be an integer in 1..64" in err


def test_cli_unknown_command_exits_2(capsys):
    assert cli(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_cli_paths_are_relative_to_the_current_folder(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "helpers", "facts", "--json", "here.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "here.json").exists()
    assert not (params.REPO_ROOT / "here.json").exists()
