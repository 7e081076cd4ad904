"""Notebook 02's "your job is hung right now" section and its panel, against one real plain torchrun
job hung on purpose (``repro.start_hung_job``), shared by the module and stopped at its end.

The last test plays a kernel killed with SIGKILL: torchrun dies with it, its ranks (in sessions of
their own) are orphaned, and the process-group timeout ends them by themselves.
"""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from helpers import doctor, params, repro

DEADLINE_S = 15.0  # the job's process-group timeout: the tests before the last take about a second


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    cfg = params.validate(symptom="hangs-at-eval", num_processes=2, stall_s=5.0,
                          out_dir=str(tmp_path_factory.mktemp("live")))
    job = repro.start_hung_job(cfg, deadline_s=DEADLINE_S)
    try:
        yield job, cfg
    finally:
        repro.stop_job(job)
        assert not repro.job_processes(job.script)


def test_the_job_is_plain_torchrun_hung_with_its_deadline_and_temp_folder(live):
    job, _cfg = live
    ranks = doctor.find_ranks(str(job.pid))
    assert sorted(rank.pid for rank in ranks) == sorted(job.rank_pids) and len(ranks) == 2
    assert all(job.script in rank.cmdline and "--pg-timeout-s 15" in rank.cmdline for rank in ranks)
    assert all(psutil.Process(pid).environ()["TMPDIR"] == str(job.folder / "tmp") for pid in job.rank_pids)
    assert "torch.distributed.run" in " ".join(psutil.Process(job.pid).cmdline())  # no doctor inside
    shown = job._repr_html_()
    assert "torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port" in shown
    assert str(job.pid) in shown and all(str(pid) in shown for pid in job.rank_pids)
    assert f"--master-port {job.port}" in job.command
    assert job.command.endswith("uneven_eval_broken.py --pg-timeout-s 15")


def test_attach_names_the_culprit_saves_the_json_and_the_replay_expects_the_same(live):
    job, cfg = live
    attached = repro.attach_to(job)
    found = attached.diagnosis
    assert (found.verdict, found.kind) == ("hang", "collective-mismatch"), found.text()
    assert set(job.expected["ranks"]) <= set(found.ranks) == {0, 1}  # two ranks: no majority
    saved = json.loads(job.attach_json.read_text())
    assert set(saved["stacks"]) == {"0", "1"} and saved["kind"] == "collective-mismatch"
    script = repro.replay_from(attached, cfg)
    assert script.path.endswith("attach/attached_replay.py")
    assert script.expected == {"kind": "collective-mismatch", "verdicts": [], "ranks": [0, 1]}
    check = repro.attach_check(job, attached, None, repro.JobStopped("stopped"))
    assert check.ok and check.named_culprit, check.problems


def test_the_attach_panel_lists_the_job_and_attach_shows_its_diagnosis(live):
    import ipywidgets

    job, _cfg = live
    panel = repro.attach_panel()
    control = panel.controls["job"]
    assert isinstance(control, ipywidgets.Dropdown) and control.value == "auto"
    ours = [(label, value) for label, value in control.options if str(job.rank_pids[0]) in label]
    assert len(ours) == 1 and ours[0][0].startswith("uneven_eval_broken.py: 2 of 2 ranks"), control.options
    ours = [value for _label, value in ours]
    control.value = ours[0]  # what a person does with the dropdown
    panel.buttons["Attach"].click()
    assert panel.error is None and panel.status.value == "done", panel.error
    assert panel.result.diagnosis.kind == "collective-mismatch"
    assert sorted(rank.pid for rank in panel.result.ranks) == sorted(job.rank_pids)
    control.value = "auto"
    auto = panel.click("Attach")
    parts = auto.parts if isinstance(auto, repro.Attachments) else [auto]
    assert any(sorted(p.pid for p in part.ranks) == sorted(job.rank_pids) for part in parts)
    panel.click("Refresh")
    assert ours[0] in [value for _label, value in control.options] and not panel.error


def test_a_killed_kernel_orphans_the_ranks_and_the_deadline_ends_them(live):
    job, _cfg = live
    job._proc.send_signal(signal.SIGKILL)  # what PR_SET_PDEATHSIG does to torchrun with the kernel
    job._proc.wait()
    stopped = repro.stop_job(job)
    if stopped.left:  # the truth: stopping torchrun's tree cannot reach ranks it no longer parents
        assert "Still running after the stop" in stopped.message and stopped.left
    started = time.monotonic()
    while repro.job_processes(job.script):
        assert time.monotonic() - started < DEADLINE_S + 30, "orphaned ranks outlived the deadline"
        time.sleep(0.5)
    assert "no process of the job is left" in repro.stop_job(job).message
