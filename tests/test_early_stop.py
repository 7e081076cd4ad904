"""helpers.early_stop: the notebook 05 loop on real ranks under the doctor, its checks and its lint."""

from __future__ import annotations

import json
import time

import pytest

from helpers import early_stop, params, report, scenarios
from helpers.doctor import Diagnosis, RankReport

SCRIPT = scenarios.get("early-stop")


@pytest.mark.parametrize("values, message", [
    ({"num_processes": 2, "stop_rank": 2}, "stop_rank must be an integer in 0..1 (a rank below "
                                           "num_processes=2); got 2"),
    ({"num_processes": 3, "stop_rank": 7}, "stop_rank must be an integer in 0..2"),
    ({"num_processes": 1, "stop_rank": 0}, "num_processes must be at least 2"),
    ({"stop_step": 101}, "stop_step must be an integer in 0..100; got 101"),
    ({"stop_rank": -1}, "stop_rank must be an integer in 0..63; got -1"),
    ({"variant": "half-fixed"}, "variant must be one of 'fixed', 'broken'; got 'half-fixed'"),
])
def test_bad_parameters_are_refused_before_any_process_starts(values, message, leftovers):
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        early_stop.run_loop(**values)
    assert message in str(info.value)
    assert time.monotonic() - started < 1.0, "refused before anything was launched"
    leftovers.check()


def test_check_config_on_a_notebook_config():
    cfg = params.validate(num_processes=3, stop_rank=2, stop_step=0, stall_s=5, show_hang=True,
                          results_path="")
    assert early_stop.check_config(cfg) is cfg  # fine: rank 2 of 3
    cfg["stop_rank"] = 3
    with pytest.raises(ValueError, match=r"^stop_rank must be an integer in 0\.\.2 .*got 3$"):
        early_stop.check_config(cfg)


def test_broken_loop_is_diagnosed_with_the_stopping_rank(leftovers):
    run = early_stop.run_loop(num_processes=2, stop_rank=0, stop_step=1, variant="broken", stall_s=2)
    d = run.diagnosis
    assert (d.verdict, d.kind, d.ranks) == ("hang", "collective-mismatch", [0]), d.text()
    assert run.ok and run.diagnosed_right and not run.completed
    where = {entry.rank: (entry.op, entry.location) for entry in d.per_rank}
    assert where[0] == ("barrier", SCRIPT.location("early-rank")), d.text()  # wait_for_everyone()
    assert where[1] == ("all_reduce", SCRIPT.location("training")), d.text()  # DDP inside backward()
    assert d.detected_after_s is not None and d.detected_after_s < 2 + 3
    assert "as expected" in run.summary() and "rank 0" in run.summary()
    html = run._repr_html_()
    assert "barrier" in html and "collective-mismatch" in html
    figure = run.plot()
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["rank 0 (culprit)", "rank 1"]
    data = json.loads(run.to_json())
    assert data["ok"] is True and data["diagnosis"]["ranks"] == [0] and data["variant"] == "broken"
    leftovers.check()


def test_fixed_loop_stops_every_rank_at_the_same_step(leftovers):
    # stop_step 5 is past the scenario's 6 default steps minus one: the loop is lengthened
    run = early_stop.run_loop(num_processes=2, stop_rank=1, stop_step=5, variant="fixed", stall_s=5)
    assert run.diagnosis.verdict == "ok", run.diagnosis.text()
    assert run.steps == 8 and run.ok and run.completed and run.same_weights
    steps = [(r["rank"], r["stopped at step"], r["steps trained"]) for r in run.rows()]
    assert steps == [(0, 5, 6), (1, 5, 6)]
    assert "every rank stopped at step 5 together" in run.summary()
    assert run._repr_html_().count("<tr>") == 3  # header + one row per rank
    leftovers.check()


def _diagnosis(verdict: str, kind: str, ranks: list[int]) -> Diagnosis:
    return Diagnosis(verdict, kind, ranks, "summary", "fix", 1.0,
                     [RankReport(0, "in-collective"), RankReport(1, "in-collective")])


@pytest.mark.parametrize("verdict, kind, ranks", [
    ("hang", "collective-mismatch", [0]),  # the wrong rank
    ("hang", "rank-missing", [1]),  # the wrong kind
    ("crash", "collective-mismatch", [1]),  # not a hang
])
def test_a_wrong_diagnosis_is_not_accepted(verdict, kind, ranks):
    run = early_stop.EarlyStopRun("broken", 2, 1, 3, 6, 5.0, 1.0, "collective-mismatch",
                                  _diagnosis(verdict, kind, ranks))
    assert not run.ok and not run.diagnosed_right
    assert "NOT as expected (hang, collective-mismatch, rank(s) [1])" in run.summary()


def test_two_ranks_stopping_at_step_0_expect_both_ranks_named():
    run = early_stop.EarlyStopRun("broken", 2, 1, 0, 6, 5.0, 1.0, "collective-mismatch",
                                  _diagnosis("hang", "collective-mismatch", [0, 1]))
    assert run.ok and run.expected_culprits == [0, 1] and "names both ranks" in run.summary()
    three = early_stop.EarlyStopRun("broken", 3, 1, 0, 6, 5.0, 1.0, "collective-mismatch",
                                    _diagnosis("hang", "collective-mismatch", [0, 1]))
    assert not three.ok and three.expected_culprits == [1]


def test_a_fixed_run_with_ranks_at_different_steps_is_not_completed():
    ranks = [early_stop.RankEnd(0, 3, 4, 1.0), early_stop.RankEnd(1, None, 6, 2.0)]
    run = early_stop.EarlyStopRun("fixed", 2, 1, 3, 6, 5.0, 1.0, "collective-mismatch",
                                  _diagnosis("ok", "ok", []), ranks)
    assert not run.ok and not run.completed and not run.same_weights
    assert "did NOT complete" in run.summary()


def test_skipped_broken_run_is_a_note_and_the_outcome_is_ok(tmp_path, leftovers):
    cfg = early_stop.check_config(params.validate(num_processes=2, stop_rank=1, stop_step=2, stall_s=5,
                                                  show_hang=False, results_path=str(tmp_path / "r.json")))
    broken = early_stop.run_broken(cfg)  # nothing runs
    assert isinstance(broken, report.Note) and broken.message == early_stop.SKIPPED
    cluster = early_stop.run_in_job(cfg)  # nothing runs either
    assert isinstance(cluster, report.Note)
    assert isinstance(early_stop.swimlane(broken), report.Note)
    fixed = early_stop.run_fixed(cfg)  # real ranks
    result = early_stop.outcome(broken, fixed, cluster)
    assert isinstance(result, report.Outcome) and result.ok, result.verdict()
    assert result.verdict().startswith(f"PASS: {early_stop.SKIPPED}. fixed loop on 2 ranks")
    data = json.loads(result.save(cfg.results_path).read_text())
    # as notebook 05 always wrote, the multi-node job, and the one-line headline make report shows
    assert list(data) == ["broken", "fixed", "cluster", "headline"] and data["broken"] is None
    assert data["cluster"] is None
    assert data["fixed"]["ok"] is True and [r["stopped_at"] for r in data["fixed"]["ranks"]] == [2, 2]
    leftovers.check()


def test_outcome_fails_when_the_broken_run_is_diagnosed_wrong():
    ranks = [early_stop.RankEnd(0, 3, 4, 1.0), early_stop.RankEnd(1, 3, 4, 1.0)]
    fixed = early_stop.EarlyStopRun("fixed", 2, 1, 3, 6, 5.0, 1.0, "collective-mismatch",
                                    _diagnosis("ok", "ok", []), ranks)
    wrong = early_stop.EarlyStopRun("broken", 2, 1, 3, 6, 5.0, 1.0, "collective-mismatch",
                                    _diagnosis("hang", "rank-missing", [1]))
    assert early_stop.outcome(report.Note("skipped"), fixed).ok
    result = early_stop.outcome(wrong, fixed)
    assert not result.ok and result.verdict().startswith("FAIL: broken loop")
    assert "NOT as expected" in result.verdict()


def test_lint_flags_the_broken_loops_and_none_of_the_fixes():
    result = early_stop.lint_loops()
    assert result.ok, result.summary()
    codes = {loop.name: loop.codes for loop in result.loops}
    assert codes == {"per-rank break": ["DIVERGENT_BREAK"], "set_trigger / check_trigger": [],
                     "reduce the metric": [], "check_breakpoint": ["NONEXISTENT_API"],
                     "in_order logging on one rank": ["MAIN_ONLY_COLLECTIVE"]}
    # the demo's own script: only the broken branch's `break`, not the one after check_trigger()
    lines = SCRIPT.path.read_text().splitlines()
    [finding] = result.script_findings
    assert finding.code == "DIVERGENT_BREAK" and finding.file == "helpers/scenarios/early_stop.py"
    assert lines[finding.line - 1].strip().startswith("break  # only this rank leaves the loop")
    html = result._repr_html_()
    assert "check_breakpoint" in html and "NOT what the lint should say" not in html


def test_the_panel_switches_to_the_broken_loop_and_refuses_a_bad_stop_rank(leftovers):
    import ipywidgets

    from helpers import params

    panel = early_stop.panel(params.validate(num_processes=2, stop_rank=1, stop_step=2, stall_s=2.0))
    assert isinstance(panel.controls["variant"], ipywidgets.ToggleButtons)
    assert panel.controls["variant"].options == ("fixed", "broken") and list(panel.buttons) == ["Run"]
    panel.controls["stop_rank"].value = 2  # what a person does with the slider
    panel.click()
    assert panel.error.startswith("ValueError: stop_rank must be an integer in 0..1")
    panel.controls["stop_rank"].value = 0
    panel.controls["variant"].value = "broken"  # the fixed/broken toggle
    result = panel.click()
    assert panel.error is None and panel.status.value == "done"
    assert result.variant == "broken" and result.diagnosis.ranks == [0] and result.ok
    leftovers.check()
