"""Generated scripts and replays really run: under the hang doctor, and standalone as a user runs them.

- every scenario's broken script gets the catalog's kind and culprit ranks under the doctor, and the
  replay built from the doctor's record of it gets the same kind and culprit ranks;
- every broken script, run standalone with plain ``torchrun --nproc-per-node 2`` and a short
  process-group timeout, fails as the catalog says (hang, crash, or wrong data);
- every fixed script completes under torchrun and under the doctor (one process per rank for all of
  them: tests/fixtures/repro/run_scripts.py), and ``accelerate launch --multi_gpu`` starts 2 ranks.

Runs go a few at a time (the machine has 2 cores); each test ends with a leftovers check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import in_parallel

from helpers import procs, repro, scenarios
from helpers.repro import runs as repro_run

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "fixtures" / "repro" / "run_scripts.py"
BROKEN = [s for s in scenarios.SCENARIOS if "broken" in s.variants]
STALL_S = 4.0
PG_TIMEOUT_S = 6.0
TORCHRUN_OUTCOME = {"hang": "hang", "crash": "crash", "mismatch": "finished"}  # catalog verdict -> seen


def cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers", "repro", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_broken_scripts_get_their_kind_under_the_doctor_and_replays_get_the_same(tmp_path, leftovers):
    # the first scenario and its replay go through the command line (which also writes diagnosis.json
    # and report.md), the others through the same functions in this process; all a few at a time
    first = BROKEN[0]

    def run(entry):
        folder = tmp_path / entry.id
        if entry is first:
            done = cli("--scenario", entry.id, "--out-dir", str(folder), "--run", "--stall-s", str(STALL_S))
            assert done.returncode == 0 and "as expected" in done.stdout, done.stdout + done.stderr
            for name in ("report.md", "diagnosis.json", f"{entry.module}_broken.py"):
                assert (folder / name).is_file(), name
            return _run_from_cli(folder, entry)
        return repro.run_script(repro.build_script(entry.id, "broken", folder, 2), STALL_S)

    runs = dict(zip([e.id for e in BROKEN], in_parallel(run, BROKEN), strict=True))
    problems = [f"{run.verdict()}\n{run.diagnosis.text()}\n{run.output_tail[-2500:]}"
                for run in runs.values() if not run.as_expected]
    assert not problems, "\n".join(problems)

    def replay(entry):
        folder = tmp_path / "replays" / entry.id
        if entry is first:
            done = cli("--from-trace", runs[entry.id].trace_dir, "--out-dir", str(folder), "--run",
                       "--stall-s", str(STALL_S))
            assert done.returncode == 0, done.stdout + done.stderr
            return _run_from_cli(folder, None)
        return repro.run_script(repro.build_replay(runs[entry.id].trace_dir, folder), STALL_S)

    replayed = dict(zip([e.id for e in BROKEN], in_parallel(replay, BROKEN), strict=True))
    different = []
    for entry in BROKEN:
        original, again = runs[entry.id].diagnosis, replayed[entry.id].diagnosis
        if (again.kind, sorted(again.ranks)) != (original.kind, sorted(original.ranks)):
            different.append(f"{entry.id}: original {original.kind} {original.ranks}: {original.summary}\n"
                             f"  replay {again.kind} {again.ranks}: {again.summary}\n"
                             f"{replayed[entry.id].output_tail[-1500:]}")
        assert Path(replayed[entry.id].script).read_text().count("\n") < 200
    assert not different, "\n".join(different)
    leftovers.check()


def _run_from_cli(folder: Path, entry) -> repro.ReproRun:
    """The run the command line made in ``folder``, read back as a ReproRun."""
    if entry is None:
        script, name, variant, expected = folder / "replay.py", "replay", "replay", {}
    else:
        script, name, variant = folder / f"{entry.module}_broken.py", entry.id, "broken"
        values = repro.check_scenario_parameters(entry, {}, 2)
        expected = repro.scenario_expectation(entry, "broken", 2, values)
    trace = script.with_name(script.stem + "-trace")
    diagnosis = repro_run.load_diagnosis(trace)
    assert json.loads((folder / "diagnosis.json").read_text())["kind"] == diagnosis.kind
    return repro.ReproRun(str(script), name, variant, 2, STALL_S, diagnosis, expected, str(trace), 0.0)


def test_broken_scripts_fail_standalone_under_torchrun_as_the_catalog_says(tmp_path, leftovers):
    scripts = [repro.build_script(entry.id, "broken", tmp_path, 2) for entry in BROKEN]

    def run(script):
        return repro_run.run_standalone(script.path, ["--pg-timeout-s", str(PG_TIMEOUT_S)], 2, "torchrun",
                                        timeout_s=120)

    results = in_parallel(run, scripts)
    wrong = []
    for entry, result in zip(BROKEN, results, strict=True):
        allowed = {TORCHRUN_OUTCOME[v] for v in entry.expected["torchrun"].verdicts}
        if result.outcome not in allowed or result.exit_code is None:
            wrong.append(f"{entry.id}: {result.outcome} ({result.how}; {result.message}) not in {allowed}\n"
                         f"{result.output_tail[-1500:]}")
        elif result.outcome != "finished":
            assert result.message, entry.id  # the line that matters was found
        if result.outcome == "hang":
            assert result.seconds < PG_TIMEOUT_S + 60, (entry.id, result.seconds)
    assert not wrong, "\n".join(wrong)
    leftovers.check()


def test_fixed_scripts_complete_under_torchrun_and_the_doctor_and_accelerate_launch_starts_n_ranks(
        tmp_path, leftovers):
    fixed = [repro.build_script(entry.id, "fixed", tmp_path, 2) for entry in scenarios.SCENARIOS]
    names = [Path(script.path).name for script in fixed]
    runner = Path(shutil.copy(RUNNER, tmp_path / "run_scripts.py"))

    def standalone(_):
        return repro_run.run_standalone(runner, names, 2, "torchrun", timeout_s=180)

    def doctor(_):
        return repro_run.run_under_doctor(runner, names, 2, stall_s=15, timeout_s=180)

    def accelerate(_):
        return repro_run.run_standalone(fixed[0].path, [], 2, "accelerate", timeout_s=120)

    torchrun_run, (diagnosis, output, _s), accelerate_run = in_parallel(
        lambda run: run(None), [standalone, doctor, accelerate])
    assert torchrun_run.outcome == "finished", torchrun_run.output_tail
    for name in names:  # every rank of every script printed its result
        assert torchrun_run.output_tail.count(f"== {name}") == 2 or name in torchrun_run.output_tail
    assert torchrun_run.ranks_started == 2
    assert diagnosis.verdict == "ok" and diagnosis.kind == "ok", diagnosis.text()
    assert all(entry.state == "finished" for entry in diagnosis.per_rank), diagnosis.text()
    assert output.count("'rank': ") == 2 * len(names), output[-3000:]
    assert accelerate_run.outcome == "finished", accelerate_run.output_tail
    assert accelerate_run.ranks_started == 2, accelerate_run.output_tail
    leftovers.check()


def test_a_run_past_its_deadline_is_stopped_with_everything_it_started(tmp_path, leftovers):
    """A hanging script under plain torchrun (torch's 30-minute gloo timeout) stopped at our deadline:
    the launcher, its ranks and its temporary files are gone."""
    script = repro.build_script("one-branch-barrier", "broken", tmp_path, 2)
    result = repro_run.run_standalone(script.path, [], 2, "torchrun", timeout_s=12)
    assert result.exit_code is None and result.outcome == "hang", result.output_tail
    assert result.how == "still running at the deadline (stopped)"
    assert result.seconds < 12 + 2 * procs.KILL_GRACE_S + 5
    leftovers.check()
