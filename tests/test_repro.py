"""The repro builder without running any rank: scripts, replays, reports, bad inputs, the CLI.

The runs themselves (every scenario under torchrun and under the doctor, replays, the debug-mode
contrast) are in test_repro_runs.py; the notebook in test_repro_notebook.py.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import params, repro, scenarios
from helpers.repro import replay as repro_replay

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "repro"
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "audit"))
from secret_env import SECRET_ENV, leaks  # noqa: E402

STDLIB_ALLOWED = {"argparse", "datetime", "os", "signal", "tempfile", "time"}
BROKEN = [s.id for s in scenarios.SCENARIOS if "broken" in s.variants]


def machine_strings() -> list[str]:
    """Strings that would identify the machine that built a script."""
    found = [str(REPO), str(Path.home()), os.environ.get("USER", ""), socket.gethostname(),
             sys.executable, str(Path(sys.executable).parent)]
    return [s for s in found if s and s not in ("/", "root")]


def ruff(paths: list[Path], *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *options, *map(str, paths)],
                          capture_output=True, text=True, cwd=paths[0].parent)


# --- the symptom table -------------------------------------------------------------------------


def test_every_symptom_maps_to_catalog_scenarios_with_a_broken_variant():
    assert tuple(repro.SYMPTOMS) == params.SPECS["symptom"].choices
    ids = set(repro.scenario_ids())
    for symptom in repro.SYMPTOMS.values():
        assert symptom.scenarios and set(symptom.scenarios) <= ids, symptom
        assert "broken" in repro.get_scenario(symptom.scenarios[0]).variants
    table = repro.symptom_table("nccl-timeout")
    assert [row["symptom"] for row in table.rows] == list(repro.SYMPTOMS)
    assert 'background:#fff3cd"><td>nccl-timeout' in table._repr_html_()


# --- generated scripts -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def every_script(tmp_path_factory) -> list[repro.ReproScript]:
    """Every scenario in every variant, on 3 ranks, with a parameter changed where it has one."""
    folder = tmp_path_factory.mktemp("scripts")
    built = []
    for entry in scenarios.SCENARIOS:
        names = {name.lower() for name in entry.parameters()}
        extra = {"diverge_rank": 2} if "diverge_rank" in names else {}
        for variant in entry.variants:
            built.append(repro.build_script(entry.id, variant, folder, 3, **extra))
    return built


def test_scripts_are_ruff_clean_under_the_project_rules_and_ruff_defaults(every_script):
    paths = [Path(s.path) for s in every_script]
    config = str(REPO / "pyproject.toml")
    for options in (("--config", config), ("--isolated",)):
        done = ruff(paths, *options)
        assert done.returncode == 0, done.stdout + done.stderr


def test_scripts_import_only_torch_and_accelerate_and_run_on_cpu_too(every_script):
    for script in every_script:
        tree = ast.parse(script.text)
        modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert modules - STDLIB_ALLOWED <= {"torch", "accelerate"}, (script.name, modules)
        assert "Accelerator(cpu=not torch.cuda.is_available()" in script.text, script.name
        assert "doctor-line" not in script.text, script.name


def test_scripts_hold_no_path_of_the_machine_that_built_them(every_script):
    for script in every_script:
        for needle in machine_strings():
            assert needle not in script.text, (script.name, needle)
        assert Path(script.path).read_text() == script.text


def test_scripts_start_with_what_they_show_and_how_to_launch_them(every_script):
    for script in every_script:
        name = Path(script.path).name
        head = script.text.split('"""', 1)[0]
        assert head.startswith("# Minimal repro: "), name
        for command in (f"torchrun --nproc-per-node 3 {name}",
                        f"accelerate launch --multi_gpu --num_processes 3 {name}",
                        f"python -m helpers doctor --num-processes 3 -- {name}"):
            assert command in head, (name, command)
        assert f'VARIANT = "{script.variant}"' in script.text


def test_parameters_are_baked_in_and_the_expectation_follows_them(every_script):
    early = next(s for s in every_script if s.name == "early-stop" and s.variant == "broken")
    assert "\nDIVERGE_RANK = 2  # " in early.text and early.parameters["DIVERGE_RANK"] == 2
    assert early.expected == {"kind": "collective-mismatch", "verdicts": ["hang", "crash"], "ranks": [2]}
    fixed = next(s for s in every_script if s.name == "early-stop" and s.variant == "fixed")
    assert fixed.expected["kind"] == "ok"
    custom = repro.build_script("early-stop", "broken", Path(early.path).parent / "custom", 2,
                                step=1, pg_timeout_s=7)
    assert "\nSTEP = 1  # " in custom.text and "\nPG_TIMEOUT_S = 7.0  # " in custom.text


# --- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("call, words", [
    (lambda d: repro.build_script("no-such-scenario", out_dir=d), ["scenario", "early-stop"]),
    (lambda d: repro.build_script("healthy", "broken", d), ["no broken variant", "healthy"]),
    (lambda d: repro.build_script("early-stop", "buggy", d), ["variant", "'broken'"]),
    (lambda d: repro.build_script("early-stop", out_dir=d, num_processes=0), ["num_processes"]),
    (lambda d: repro.build_script("early-stop", out_dir=d, divergerank=1), ["divergerank", "diverge_rank"]),
    (lambda d: repro.build_script("early-stop", out_dir=d, step="2"), ["step must be an integer"]),
    (lambda d: repro.build_script("early-stop", out_dir=d, step=-1), ["step must be an integer >= 0"]),
    (lambda d: repro.build_script("early-stop", out_dir=d, diverge_rank=2), ["diverge_rank", "0..1"]),
    (lambda d: repro.symptom_table("slow-training"), ["symptom", "hangs-at-eval"]),
    (lambda d: repro.debug_contrast("slow", out_dir=d), ["symptom"]),
    (lambda d: repro.build_replay(d / "nothing-here", d), ["from_trace", "does not exist"]),
    (lambda d: repro.build_replay("", d), ["from_trace"]),
    (lambda d: repro.build_replay(FIXTURES / "corrupt_record", d),
     ["from_trace", "trace-1.jsonl line 2", "corrupt"]),
    (lambda d: repro.build_replay(FIXTURES / "p2p" / "diagnosis.json", d), ["from_trace", "is a file"]),
    (lambda d: repro.explore(action="launch", out_dir=str(d)), ["action", "build"]),
])
def test_bad_inputs_give_one_clear_error_naming_the_problem(tmp_path, call, words):
    with pytest.raises(ValueError) as error:
        call(tmp_path)
    for word in words:
        assert word in str(error.value), (word, str(error.value))
    assert not list(tmp_path.glob("*.py")), "nothing may be written on bad input"


def test_a_record_without_diagnosis_or_with_a_corrupt_one_is_refused(tmp_path):
    record = tmp_path / "record"
    shutil.copytree(FIXTURES / "p2p", record)
    (record / "diagnosis.json").unlink()
    with pytest.raises(ValueError, match="from_trace: .* holds no diagnosis.json"):
        repro.build_replay(record, tmp_path)
    (record / "diagnosis.json").write_text('{"verdict": "ok", "per_rank": [')
    with pytest.raises(ValueError, match="from_trace: .*diagnosis.json is corrupt"):
        repro.build_replay(record, tmp_path)
    (record / "diagnosis.json").write_text(json.dumps({"kind": "ok", "ranks": [], "per_rank": [{"rank": 0}]}))
    (record / "trace-0.jsonl").unlink()
    with pytest.raises(ValueError, match="holds no trace-0.jsonl"):
        repro.build_replay(record, tmp_path)


def test_notebook_config_check_rejects_a_bad_record_before_anything_runs(tmp_path):
    cfg = params.validate(symptom="hangs-at-eval", num_processes=2, stall_s=5, out_dir=str(tmp_path),
                          from_trace=str(FIXTURES / "corrupt_record"), results_path="")
    with pytest.raises(ValueError, match="corrupt record"):
        repro.check_config(cfg)
    (tmp_path / "a-file").write_text("")
    cfg.update(from_trace="", out_dir=str(tmp_path / "a-file"))
    with pytest.raises(ValueError, match="out_dir must be a folder"):
        repro.check_config(cfg)


# --- replays from records ----------------------------------------------------------------------


def test_replay_plans_each_rank_and_where_it_ended(tmp_path):
    plan = repro_replay.plan_replay(repro_replay.load_recording(FIXTURES / "secret_raise"))
    assert [[s.op for s in rank.steps] for rank in plan.ranks] == [["all_reduce", "barrier"], ["all_reduce"]]
    assert plan.ranks[0].steps[0].shapes == [[8]] and plan.ranks[0].steps[0].dtype == "float32"
    assert (plan.ranks[0].end, plan.ranks[1].end) == ("wait", "raise")
    p2p = repro_replay.plan_replay(repro_replay.load_recording(FIXTURES / "p2p"))
    steps = [[(s.op, s.peer) for s in rank.steps] for rank in p2p.ranks]
    assert steps == [[("all_reduce", None), ("send", 1), ("all_reduce", None)],
                     [("all_reduce", None), ("recv", 0), ("all_reduce", None)]]
    assert {rank.end for rank in p2p.ranks} == {"finish"}


def test_replays_are_ruff_clean_hold_no_secret_and_no_machine_path(tmp_path, monkeypatch):
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    scripts = [repro.build_replay(FIXTURES / record, tmp_path / record) for record in ("secret_raise", "p2p")]
    paths = [Path(s.path) for s in scripts]
    for options in (("--config", str(REPO / "pyproject.toml")), ("--isolated",)):
        done = ruff(paths, *options)
        assert done.returncode == 0, done.stdout + done.stderr
    text = scripts[0].text
    assert not leaks(text) and "/home/alice" not in text and "<redacted>" in text
    assert "raise RuntimeError" in text and '"raise", "RuntimeError: could not log in' in text
    assert scripts[0].expected == {"kind": "rank-exited", "verdicts": [], "ranks": [1]}
    assert '("send", [[4]], "int64", 1)' in scripts[1].text


def test_notebook_builds_the_replay_when_from_trace_is_set(tmp_path):
    cfg = params.validate(symptom="one-rank-crashes", num_processes=2, stall_s=5, out_dir=str(tmp_path),
                          from_trace=str(FIXTURES / "p2p"), results_path="")
    script = repro.build_for(cfg)
    assert script.variant == "replay" and Path(script.path).parent == tmp_path
    assert isinstance(repro.run_fix(script), repro.Note)


# --- the report --------------------------------------------------------------------------------


def test_report_holds_no_secret_and_no_machine_identity(tmp_path, monkeypatch):
    """Secret-bearing variables set while the report is written (the audit collects the environment),
    and a recorded error holding a token and a home folder: none of it reaches report.md."""
    from helpers.repro import runs as repro_run

    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    script = repro.build_replay(FIXTURES / "secret_raise", tmp_path)
    diagnosis = repro_run.load_diagnosis(FIXTURES / "secret_raise")
    run = repro.ReproRun(script.path, "replay", "replay", 2, 5.0, diagnosis, script.expected,
                         str(FIXTURES / "secret_raise"), 1.0)
    files = repro.write_report(run, None, tmp_path)
    text = Path(files.report_md).read_text()
    assert not leaks(text), leaks(text)
    for needle in machine_strings() + ["/home/alice"]:
        assert needle not in text, needle
    assert "## Environment" in text and "## Versions" in text and "```python" in text
    assert "torchrun --nproc-per-node 2 replay.py" in text and "rank-exited" in text
    assert json.loads(Path(files.diagnosis_json).read_text())["kind"] == "rank-exited"


# --- the command line ----------------------------------------------------------------------------


def test_cli_list_gives_one_scenario_id_per_line_first(capsys):
    assert repro.cli_main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == repro.scenario_ids()
    assert "no broken variant" in next(line for line in lines if line.startswith("healthy "))


def test_cli_through_python_m_helpers(tmp_path):
    done = subprocess.run([sys.executable, "-m", "helpers", "repro", "--scenario", "dead-rank",
                           "--num-processes", "3", "--param", "diverge_rank=2", "--out-dir", str(tmp_path),
                           "--json", str(tmp_path / "script.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "torchrun --nproc-per-node 3 dead_rank_broken.py" in done.stdout
    assert "\nDIVERGE_RANK = 2  # " in (tmp_path / "dead_rank_broken.py").read_text()
    assert json.loads((tmp_path / "script.json").read_text())["expected"]["ranks"] == [2]


@pytest.mark.parametrize("argv, words", [
    (["--scenario", "nope"], ["scenario must be one of"]),
    (["--symptom", "nope"], ["symptom must be one of"]),
    (["--scenario", "healthy"], ["no broken variant"]),
    (["--scenario", "early-stop", "--param", "step"], ["--param must be NAME=VALUE"]),
    (["--scenario", "early-stop", "--param", "speed=3"], ["speed is not a parameter"]),
    (["--from-trace", "does/not/exist"], ["from_trace", "does not exist"]),
    (["--from-trace", str(FIXTURES / "corrupt_record")], ["corrupt record"]),
    (["--scenario", "early-stop", "--num-processes", "0"], ["num_processes must be"]),
    ([], ["one of the arguments"]),
])
def test_cli_bad_usage_exits_2_naming_the_problem(tmp_path, capsys, argv, words):
    assert repro.cli_main([*argv, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_panel_builds_the_chosen_scenario_and_says_which_knobs_it_ignored(tmp_path):
    script = repro.explore("hangs-at-save", "auto", "build", 2, 5.0, diverge_rank=0, step=3,
                           out_dir=str(tmp_path))
    assert script.name == "main-only-collective" and script.variant == "broken"
    assert script.notes == ["main-only-collective has no diverge_rank or step: ignored"]
    fixed = repro.explore("one-rank-crashes", "early-stop", "build", 3, 5.0, diverge_rank=2, step=1,
                          out_dir=str(tmp_path))
    assert fixed.parameters["DIVERGE_RANK"] == 2 and fixed.parameters["STEP"] == 1 and not fixed.notes
    assert "Note: " not in fixed._repr_html_() and "Note: main-only" in script._repr_html_()


def test_notebook_panel_has_one_button_per_action(tmp_path):
    from helpers import params

    cfg = params.validate(symptom="hangs-at-save", num_processes=2, stall_s=5.0, out_dir=str(tmp_path))
    panel = repro.panel(cfg)
    assert list(panel.buttons) == ["Build", "Run", "Show fix", "Export"]
    assert "action" not in panel.controls and panel.values["scenario"] == "auto"
    panel.buttons["Build"].click()  # what a person does
    assert panel.error is None and panel.result.name == "main-only-collective"
    assert panel.result.variant == "broken" and Path(panel.result.path).parent == tmp_path


def test_abort_at_interpreter_exit_after_every_rank_finished_is_reported_as_finished():
    from helpers.repro.runs import classify

    output = "{'rank': 0}\n{'rank': 1}\nterminate called without an active exception\n"
    outcome, how = classify(-6, output, all_ranks_done=True)
    assert outcome == "finished" and "aborted at interpreter exit" in how
    assert classify(-6, output, all_ranks_done=False)[0] == "crash"
    assert classify(-6, "{'rank': 0}\n{'rank': 1}\n", all_ranks_done=True)[0] == "crash"


def test_a_rank_killed_before_any_peer_spoke_is_told_by_torchruns_root_cause():
    from helpers.repro.runs import classify, headline

    output = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\n"
              "dead_rank_broken.py FAILED\n"
              "------------------------------------------------------------\n"
              "Root Cause (first observed failure):\n[0]:\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 8815)\n"
              "  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 8815\n")
    assert classify(1, output) == ("crash", "rank 1 killed by SIGKILL")
    assert headline(output) == "Signal 9 (SIGKILL) received by PID 8815"
    assert headline("[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:5\n" + output) == \
        "Connection closed by peer"  # a peer's own words come first
