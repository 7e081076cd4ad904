"""The scenario catalog: each scenario gets its documented kind, culprits and lines.

Under helpers.launch (forked ranks calling ``main``) on 2 and 3 ranks, under
``python -m helpers doctor`` and under plain torchrun on 2 ranks; fixed variants come out ok.
Every run is followed by a leftovers check (the command-line and torchrun runs of every scenario go a
few at a time in a module fixture, checked for leftovers together).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import result_of, run_each

from helpers import doctor, scenarios
from helpers.doctor import EXIT_CODES
from helpers.doctor.source import enclosing_loop

STALL_S = 2.0
IDS = [s.id for s in scenarios.SCENARIOS]
FIXED_IDS = [s.id for s in scenarios.SCENARIOS if "fixed" in s.variants]
# the doctor's JSON; "notes" too where the evidence could not tell something (a rank read with py-spy
# on a starved machine): Diagnosis.to_dict
KEYS = {"verdict", "kind", "ranks", "summary", "fix", "detected_after_s", "per_rank"}
RANK_KEYS = {"rank", "state", "op", "seq", "shapes", "location", "exit_code"}


def check_diagnosis(data: dict, scenario: scenarios.Scenario, launcher: str, num_processes: int,
                    stall_s: float | None = STALL_S) -> None:
    """The diagnosis (as JSON data) matches the catalog row for ``launcher``."""
    expected = scenario.expected[launcher]
    text = json.dumps(data, indent=1)
    assert set(data) - {"notes"} == KEYS and all(set(r) == RANK_KEYS for r in data["per_rank"]), text
    assert data["kind"] == expected.kind, text
    assert data["verdict"] in expected.verdicts, text
    assert data["ranks"] == scenario.culprit_ranks(num_processes), text
    assert [r["rank"] for r in data["per_rank"]] == list(range(num_processes)), text
    culprit_at = scenario.location(scenario.culprit_line)
    others_at = scenario.location(scenario.others_line)
    mismatched = min((r["seq"] for r in data["per_rank"] if r["rank"] in data["ranks"] and r["seq"]),
                     default=None)
    for entry in data["per_rank"]:
        wanted = culprit_at if entry["rank"] in data["ranks"] else others_at
        if data["kind"] == "shape-mismatch" and mismatched and (entry["seq"] or 0) > mismatched:
            continue  # gloo let this rank through the mismatched call as its peer aborted: it failed later
        if wanted:
            assert _at_or_inside_loop(entry["location"], wanted, scenario), text
    if scenario.summary_line:
        assert f" at {scenario.location(scenario.summary_line)} " in data["summary"], text
    if data["verdict"] in ("hang", "crash") and stall_s is not None:
        assert data["detected_after_s"] is not None and data["detected_after_s"] <= stall_s + 3, text


def _at_or_inside_loop(location: str | None, wanted: str, scenario: scenarios.Scenario) -> bool:
    """Is a rank's location the marked line, or, where the marker is on a loop's header, a line in
    that loop's body (a stack sampled at a signal catches a busy loop on whichever line it runs)?"""
    if location == wanted:
        return True
    name, _, line = (location or "").rpartition(":")
    wanted_line = int(wanted.rpartition(":")[2])
    return (name == scenario.path.name and line.isdigit()
            and enclosing_loop(str(scenario.path), int(line)) == wanted_line)


@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("scenario_id", IDS)
def test_scenario_under_launch(scenario_id, num_processes, leftovers):
    scenario = scenarios.get(scenario_id)
    diagnosis = doctor.run_function(scenario.load().main, kwargs={"variant": scenario.variants[0]},
                                    num_processes=num_processes, stall_s=STALL_S, timeout_s=90)
    check_diagnosis(diagnosis.to_dict(), scenario, "launch", num_processes)
    leftovers.check()


@pytest.mark.parametrize("scenario_id", FIXED_IDS)
def test_fixed_variant_is_ok(scenario_id, leftovers):
    scenario = scenarios.get(scenario_id)
    diagnosis = doctor.run_function(scenario.load().main, kwargs={"variant": "fixed"},
                                    num_processes=2, stall_s=4.0, timeout_s=90)
    assert (diagnosis.verdict, diagnosis.kind, diagnosis.ranks) == ("ok", "ok", []), diagnosis.text()
    assert all(entry.state == "finished" for entry in diagnosis.per_rank)
    assert len(diagnosis.results) == 2
    leftovers.check()


def _under_the_cli(scenario_id: str, folder) -> tuple[subprocess.CompletedProcess, dict]:
    scenario, out = scenarios.get(scenario_id), folder / "diagnosis.json"
    done = subprocess.run(
        [sys.executable, "-m", "helpers", "doctor", "--num-processes", "2", "--stall-s", str(STALL_S),
         "--json", str(out), "--", *scenario.command(scenario.variants[0])],
        capture_output=True, text=True, timeout=180)
    return done, json.loads(out.read_text())


def _under_plain_torchrun(scenario_id: str, folder) -> tuple[int | None, Any, str]:
    # torch's timeout ends a hang here; 5 s, as three runs share two cores: a rank started late
    # must not time out the first collective of a healthy run
    scenario = scenarios.get(scenario_id)
    return doctor.run_torchrun(scenario.command(scenario.variants[0], pg_timeout_s=5), folder / "trace", 2,
                               timeout_s=180)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, Any]:
    """Every scenario under the command line, a few at a time (each run mostly waits on a stall)."""
    return run_each(_under_the_cli, IDS, tmp_path_factory, "cli")


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory) -> dict[str, Any]:
    """Every scenario under plain torchrun, a few at a time (each mostly waits on torch's timeout)."""
    return run_each(_under_plain_torchrun, IDS, tmp_path_factory, "torchrun")


@pytest.mark.parametrize("scenario_id", IDS)
def test_scenario_under_the_cli(scenario_id, cli_runs):
    done, data = result_of(cli_runs, scenario_id)
    assert done.returncode == EXIT_CODES[data["verdict"]], done.stderr[-3000:]
    assert f"doctor: {data['verdict']} ({data['kind']})" in done.stderr
    assert "RuntimeWarning" not in done.stderr  # runpy's "found in sys.modules" (-m helpers.trace)
    check_diagnosis(data, scenarios.get(scenario_id), "cli", 2)


@pytest.mark.parametrize("scenario_id", IDS)
def test_scenario_under_plain_torchrun(scenario_id, torchrun_runs):
    code, diagnosis, output = result_of(torchrun_runs, scenario_id)
    assert (code == 0) == (diagnosis.verdict == "ok"), output[-3000:]
    try:
        check_diagnosis(diagnosis.to_dict(), scenarios.get(scenario_id), "torchrun", 2, stall_s=None)
    except AssertionError as error:  # torchrun's own words tell a run that never started its ranks
        raise AssertionError(f"{error}\ntorchrun exited {code}:\n{output[-3000:]}") from error


# ---------------------------------------------------------------------------------------------
# the catalog itself


def test_catalog_lists_every_script_once():
    scripts = {p.stem for p in scenarios.FOLDER.glob("*.py") if p.stem != "__init__"}
    assert {s.module for s in scenarios.SCENARIOS} == scripts
    assert len(set(IDS)) == len(IDS) == 9
    rows = scenarios.table()
    assert {"id", "shows", "variants", "parameters", "launch kind", "cli kind", "torchrun kind",
            "culprit ranks"} <= set(rows[0])
    with pytest.raises(ValueError, match="scenario must be one of early-stop"):
        scenarios.get("nope")


@pytest.mark.parametrize("scenario_id", IDS)
def test_script_is_standalone_with_upper_case_parameters(scenario_id):
    scenario = scenarios.get(scenario_id)
    tree = ast.parse(scenario.path.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - set(sys.stdlib_module_names) <= {"torch", "accelerate"}, imported
    values = scenario.parameters()
    assert values["VARIANT"] in scenario.variants and "PG_TIMEOUT_S" in values
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert [a.arg for a in main.args.args] == [name.lower() for name in values]
    assert "Accelerator(cpu=not torch.cuda.is_available()" in scenario.path.read_text()
    for marker in filter(None, (scenario.culprit_line, scenario.others_line)):
        assert scenario.line(marker) > 0


def test_parameters_are_overridden_from_the_command_line():
    module = scenarios.get("early-stop").load()
    values = module.parse_args(["--variant", "fixed", "--diverge-rank", "0", "--pg-timeout-s", "5"])
    assert values["variant"] == "fixed" and values["diverge_rank"] == 0 and values["pg_timeout_s"] == 5.0
    assert values["steps"] == scenarios.get("early-stop").parameters()["STEPS"]
    assert scenarios.get("early-stop").culprit_ranks(3, diverge_rank=2) == [2]
