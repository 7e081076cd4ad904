"""The doctor inside real jobs: ``torchrun ... -m helpers.doctor train.py`` and ``accelerate launch``,
two agents over 127.0.0.1 (the commands a two-node cluster runs), each in its own working folder.

Every test runs a real job, culprit on the second node, and checks afterwards that no process of the
job is left on either "node" (psutil, by the script's unique path) and no temp folder either. The
catalog's one-agent jobs run two at a time (``catalog_jobs``): such a job mostly waits on its stall.
Two-node jobs do not gain from it: four ranks and two agents starting keep both cores busy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import result_of, run_each

from helpers import doctor, procs, scenarios
from helpers.doctor import EXIT_CODES, job, leader, runs, wording
from helpers.doctor.board import Board, Seen

FIXTURE = Path(__file__).parent / "fixtures" / "job" / "job_script.py"
STALL_S = 4.0
TIMEOUT_S = 150.0
KEYS = {"verdict", "kind", "ranks", "summary", "fix", "detected_after_s", "per_rank"}


def _line(marker: str, name: str = FIXTURE.name) -> str:
    """'job_script.py:N': the line of a fixture (``name``, beside job_script.py) with that marker."""
    number = next(n for n, text in enumerate(FIXTURE.with_name(name).read_text().splitlines(), 1)
                  if f"# doctor-line: {marker}" in text)
    return f"{name}:{number}"


@pytest.fixture
def script(tmp_path):
    """The job's script at a path of its own, so that its processes can be found and counted."""
    copy = tmp_path / "script" / FIXTURE.name
    copy.parent.mkdir()
    shutil.copyfile(FIXTURE, copy)
    return copy


def _left(script: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if str(script) in " ".join(p.info["cmdline"] or [])]


# Two nodes of two ranks where the case needs more than one rank per node (the echoes of a death on
# its own node, a leader's successor, the named cases); elsewhere two nodes of one rank
# (ALONE), the culprit rank 1 on the second node: a fresh rank costs 2.5 s of CPU to import torch
ALONE = {"culprit": 1, "per_node": 1}


def _run(script: Path, folder: Path, mode: str, culprit: int = 3, launcher: str = "torchrun",
         per_node: int = 2, **env: str) -> runs.JobRun:
    outcome = runs.run_job([str(script)], folder, nodes=2, per_node=per_node, stall_s=STALL_S,
                           timeout_s=TIMEOUT_S, launcher=launcher,
                           env={"MODE": mode, "CULPRIT": str(culprit), **env})
    assert all(code is not None for code in outcome.agent_codes), "an agent ran past the deadline"
    assert not _left(script), "job processes left"
    return outcome


def _json(outcome: runs.JobRun, world: int = 4) -> dict:
    found = [d / runs.JOB_JSON for d in outcome.node_dirs if (d / runs.JOB_JSON).is_file()]
    logs = "\n".join(output[-3000:] for output in outcome.outputs)
    assert len(found) == 1, f"one leader writes one JSON: {found}\n{logs}"
    data = json.loads(found[0].read_text())
    assert KEYS <= set(data) and [r["rank"] for r in data["per_rank"]] == list(range(world)), data
    return data


def test_a_hang_on_the_second_node_is_named_and_every_rank_ends_with_exit_3(script, tmp_path, leftovers):
    # each rank has started a process of its own: ended with the rank, not left under PID 1 (``_run``)
    outcome = _run(script, tmp_path, "hang", HELPER_CHILD="1")
    data = _json(outcome)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("hang", "rank-missing", [3]), data
    assert STALL_S <= data["detected_after_s"] <= STALL_S + 3
    places = {r["rank"]: (r["state"], r["op"], r["location"]) for r in data["per_rank"]}
    assert places[3] == ("outside-collective", None, _line("sleep"))
    assert all(places[rank] == ("in-collective", "barrier", _line("barrier")) for rank in (0, 1, 2))
    assert (outcome.node_dirs[0] / runs.JOB_JSON).is_file()  # the leader, rank 0, in its own folder
    assert outcome.rank_codes == {0: 3, 1: 3, 2: 3, 3: 3}, outcome.outputs[0][-2000:]
    assert "doctor: hang (rank-missing)" in outcome.outputs[0]  # the leader's stderr
    assert "doctor: rank 3 stopped: hang" in outcome.outputs[1]
    # a rank whose barrier failed as the others left says so in a line, not a traceback blaming a
    # "remote worker crashing" (gloo's words)
    assert not any("run_as_main" in output for output in outcome.outputs), outcome.outputs
    leftovers.check()


def test_a_rank_that_never_reaches_init_process_group_is_named_while_the_others_wait_in_it(script, tmp_path,
                                                                                          leftovers):
    # gloo's init_process_group waits for every rank (30 minutes unless set): before the group exists
    # the doctor coordinates through the job's store all the same
    outcome = _run(script, tmp_path, "before-init", **ALONE)
    data = _json(outcome, world=2)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("hang", "rank-missing", [1]), data
    assert STALL_S <= data["detected_after_s"] <= STALL_S + 3
    places = {r["rank"]: (r["state"], r["op"], r["location"]) for r in data["per_rank"]}
    assert places[1] == ("outside-collective", None, _line("before-init"))
    assert places[0] == ("in-collective", "init_process_group", _line("init"))
    assert f"never reached the init_process_group that rank 0 entered at {_line('init')}" \
        in data["summary"], data["summary"]
    assert data["fix"].startswith("init_process_group waits for every rank of the world"), data["fix"]
    assert outcome.rank_codes == {0: 3, 1: 3}, outcome.outputs[0][-2000:]
    leftovers.check()


def test_a_rank_that_ends_cleanly_before_init_process_group_is_named_at_once(script, tmp_path, leftovers):
    outcome = _run(script, tmp_path, "done-before-init", **ALONE)
    data = _json(outcome, world=2)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), data
    assert data["per_rank"][1]["state"] == "finished"
    assert data["detected_after_s"] < STALL_S  # not a stall: rank 3 will never join
    leftovers.check()


def test_a_rank_whose_dataloader_worker_is_stuck_names_the_workers_line(script, tmp_path, leftovers):
    # the rank's own watchdog reads its DataLoader worker with py-spy as it answers the leader; the
    # worker sent a batch first, through a socket in a multiprocessing temp folder ("pymp-*") that
    # is gone with the job, though the worker is stopped by SIGTERM, which runs no exit handler
    temp = tmp_path / "temp"
    temp.mkdir()
    outcome = _run(script, tmp_path, "loader", TMPDIR=str(temp), **ALONE)
    assert not list(temp.glob("pymp-*")), sorted(temp.iterdir())
    data = _json(outcome, world=2)
    assert (data["kind"], data["ranks"]) == ("rank-missing", [1]), data
    assert f"rank 1 is waiting for a batch from its DataLoader's worker processes at {_line('loader')} " \
           "(worker pid " in data["summary"], data["summary"]
    assert f"is sleeping at {_line('dataset')} in __getitem__)" in data["summary"], data["summary"]
    assert data["fix"].startswith("Its DataLoader's worker processes have not delivered")
    leftovers.check()


def test_a_rank_that_raises_is_diagnosed_before_the_job_is_torn_down(script, tmp_path, leftovers):
    outcome = _run(script, tmp_path, "raise", **ALONE)
    data = _json(outcome, world=2)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("crash", "rank-exited", [1]), data
    culprit = data["per_rank"][1]
    assert (culprit["state"], culprit["exit_code"], culprit["location"]) == ("exited", 1, _line("raise"))
    assert "ValueError: a bad batch" in data["summary"]
    assert outcome.rank_codes == {0: 4, 1: 4}
    assert "ValueError: a bad batch" in outcome.outputs[1]  # the rank's own traceback is still printed
    leftovers.check()


def test_a_killed_rank_is_named_not_its_echoes(script, tmp_path, leftovers):
    # SIGKILL (as the OOM killer does): rank 3 says nothing; its agent stops rank 2 with SIGTERM, the
    # first node's ranks fail with "Connection reset by peer". Rank 3 could not remove its
    # multiprocessing temp folder: the ranks of its machine that leave after it do
    temp = tmp_path / "temp"
    temp.mkdir()
    outcome = _run(script, tmp_path, "kill", TMPDIR=str(temp))
    assert not list(temp.glob("pymp-*")), sorted(temp.iterdir())
    data = _json(outcome)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("crash", "rank-exited", [3]), data
    assert outcome.rank_codes[3] == -9
    assert any("rank 3 ended without a word" in note for note in data["notes"]), data["notes"]
    assert "killed (no exception and no exit code, e.g. SIGKILL; a fatal signal" in data["summary"], data
    assert "in its log) after its last collective" in data["summary"], data
    # its last beat showed it in its first all_reduce; the others' later all_reduces say it went on
    assert (data["per_rank"][3]["op"], data["per_rank"][3]["location"]) == (None, _line("steps")), data
    leftovers.check()


def test_a_dead_leader_hands_over_to_the_next_lowest_live_rank(script, tmp_path, leftovers):
    # rank 0, the leader, is killed; rank 1 (its agent is stopping it) or rank 2 leads
    outcome = _run(script, tmp_path, "kill", culprit=0)
    data = _json(outcome)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [0]), data
    assert any("by rank 1" in note or "by rank 2" in note for note in data["notes"]), data["notes"]
    leftovers.check()


def test_a_rank_that_finishes_early_is_named_at_once(script, tmp_path, leftovers):
    outcome = _run(script, tmp_path, "early", **ALONE)
    data = _json(outcome, world=2)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), data
    assert data["per_rank"][1]["state"] == "finished"
    assert data["detected_after_s"] < STALL_S  # not a stall: rank 3 will never issue the barrier
    assert set(outcome.rank_codes.values()) == {EXIT_CODES[data["verdict"]]}
    leftovers.check()


def test_a_healthy_job_with_a_late_rank_is_left_alone_and_exits_0(script, tmp_path, leftovers):
    outcome = _run(script, tmp_path, "late", LATE_S="1.0")  # late, but by less than stall_s
    assert outcome.agent_codes == [0, 0], outcome.outputs[0][-3000:]
    data = _json(outcome)
    assert (data["verdict"], data["kind"]) == ("ok", "ok")
    assert "doctor: ok" not in outcome.outputs[0]  # a healthy job prints nothing of the doctor's
    assert not any("ran the script alone" in output for output in outcome.outputs)
    leftovers.check()


def _importing_job(tmp_path: Path, mode: str) -> tuple[Path, runs.JobRun]:
    """importing_script.py as two nodes of one rank, stall_s 3: the last rank, alone on the second
    node, imports lazy_module.py (steps of 1.2 s) while rank 0 waits in an all_reduce."""
    folder = tmp_path / "script"
    folder.mkdir()
    for name in ("importing_script.py", "lazy_module.py"):
        shutil.copyfile(FIXTURE.with_name(name), folder / name)
    script = folder / "importing_script.py"
    outcome = runs.run_job([str(script)], tmp_path / "job", nodes=2, per_node=1, stall_s=3.0,
                           timeout_s=TIMEOUT_S, env={"MODE": mode, "STEP_S": "1.2"})
    assert not _left(script), "job processes left"
    return script, outcome


def test_a_rank_whose_import_fails_while_the_leader_waits_to_look_again_is_named_at_once(tmp_path,
                                                                                          leftovers):
    # the leader looks at the stall once (rank 1 importing, on the second node: helpers/doctor/
    # loading.py) 3-4 s in and waits stall_s to look again; the import fails meanwhile (4.8 s in):
    # the failure is not held for that look (torchrun tears the job down). The leader said why it
    # waited.
    _script, outcome = _importing_job(tmp_path, "fails")
    assert "was importing a module" in outcome.outputs[0]
    data = _json(outcome, world=2)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("crash", "rank-exited", [1]), data
    assert data["per_rank"][1]["location"] == _line("fails", "lazy_module.py"), data
    assert data["detected_after_s"] < 1.5, data  # held, it waits out the look: 1.8 s or more
    assert any("looked again" in note for note in data["notes"]), data["notes"]
    leftovers.check()


def test_a_rank_that_starts_late_is_waited_for_and_the_job_ends_well(tmp_path, leftovers):
    # rank 1, alone on the second node, takes 5 s before Python runs anything (a sitecustomize that
    # sleeps: a slow shared file system), while rank 0 waits in init_process_group: its doctor has
    # not reported, so the leader looks again each stall_s rather than name it as ended
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '1':\n    time.sleep(5.0)\n")
    script = tmp_path / "train.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "dist.all_reduce(torch.ones(2))\n"
                      "dist.destroy_process_group()\n")
    path = os.pathsep.join([str(slow), procs.python_env()["PYTHONPATH"]])
    outcome = runs.run_job([str(script)], tmp_path / "job", nodes=2, per_node=1, stall_s=2.0,
                           timeout_s=TIMEOUT_S, env={"PYTHONPATH": path})
    assert outcome.agent_codes == [0, 0], outcome.outputs[0][-3000:]
    assert "rank 1 had not reported yet" in outcome.outputs[0], outcome.outputs[0][-3000:]
    data = _json(outcome, world=2)
    assert data["verdict"] == "ok", data
    assert any("rank 1 had not reported yet" in note for note in data["notes"]), data["notes"]
    leftovers.check()


def test_ranks_that_each_ran_alone_are_told_so_once_per_node(tmp_path, leftovers):
    # without a GPU, a plain Accelerator() under torchrun makes a process group of the world and then
    # runs each rank as the only process; a script that never joins a group runs alone too
    script = tmp_path / "alone.py"
    script.write_text("import os\n"
                      "if os.environ['MODE'] == 'accelerate':\n"
                      "    from accelerate import Accelerator\n"
                      "    print('processes', Accelerator().num_processes)\n")
    for mode, why in (("accelerate", wording.ALONE_IN_ACCELERATE), ("plain", wording.ALONE_WITHOUT_GROUP)):
        outcome = runs.run_job([str(script)], tmp_path / mode, stall_s=STALL_S, timeout_s=TIMEOUT_S,
                               env={"MODE": mode, "CUDA_VISIBLE_DEVICES": ""})  # no GPU, as here
        assert outcome.agent_codes == [0, 0], outcome.outputs[1][-3000:]
        for node, first_rank in enumerate((0, 2)):
            notes = [line for line in outcome.outputs[node].splitlines() if "ran the script alone" in line]
            assert len(notes) == 1, outcome.outputs[node][-3000:]
            assert notes[0].startswith(f"doctor: note: rank {first_rank} of 4 ran the script alone ({why}): ")
        assert "Accelerator(cpu=True)" in notes[0]
        data = _json(outcome)  # the JSON, for a report or CI that reads no log, says it too
        leaders = wording.RAN_ALONE.format(rank=0, world=4, why=why)
        assert data["verdict"] == "ok" and leaders in data["notes"], data
    leftovers.check()


def test_nodes_that_run_different_copies_of_the_script_are_told_so(tmp_path, monkeypatch, leftovers):
    # each agent runs train.py from its own working folder, as nodes without shared storage do: the
    # second node's copy is an older one; the job itself is healthy, and the JSON says what differed
    healthy = ("import torch, torch.distributed as dist\n"
               "dist.init_process_group('gloo')\n"
               "dist.all_reduce(torch.ones(2))\n"
               "dist.destroy_process_group()\n")
    for node, header in ((0, ""), (1, "# the copy from last week\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "train.py").write_text(header + healthy)
    monkeypatch.chdir(tmp_path / "node0")  # where the command's path is checked before the launch
    outcome = runs.run_job(["train.py"], tmp_path, stall_s=STALL_S, timeout_s=TIMEOUT_S)
    assert outcome.agent_codes == [0, 0], outcome.outputs[1][-3000:]
    data = _json(outcome)
    digests = [hashlib.sha256((tmp_path / f"node{node}" / "train.py").read_bytes()).hexdigest()[:12]
               for node in (0, 1)]
    assert data["verdict"] == "ok" and data["notes"][0] == (
        f"The ranks did not run the same software: train.py's content (sha256) {digests[0]} on ranks 0 "
        f"and 1, {digests[1]} on ranks 2 and 3."), data
    leftovers.check()


def test_a_script_that_changes_its_working_folder_leaves_the_json_where_the_job_was_started(tmp_path,
                                                                                           leftovers):
    # --json and --keep are relative to the folder a rank started in, as the README says, even when
    # the script moves to another folder first (a data folder, a run folder of its own)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    script = tmp_path / "moves.py"
    script.write_text("import os, time, torch.distributed as dist\n"
                      f"os.chdir({str(moved)!r})\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 3:\n"
                      "    time.sleep(60)\n"
                      "dist.barrier()\n")
    outcome = runs.run_job([str(script)], tmp_path / "job", stall_s=STALL_S, timeout_s=TIMEOUT_S, keep=True)
    assert _json(outcome)["ranks"] == [3]
    assert not list(moved.iterdir()), list(moved.iterdir())
    assert (outcome.node_dirs[1] / runs.JOB_KEEP).is_dir()
    leftovers.check()


def test_a_rank_that_finished_before_init_waits_for_every_rank_to_join_before_it_is_judged():
    # CI under load: rank 1 was still importing (its watchdog not yet on the board) when rank 3 ended
    # before init_process_group; judged at once, rank 1 was named "ended, nothing of it seen" too
    in_init = {"pending": 0, "last": 0, "wait": 0.5, "machine": "here", "pid": os.getpid()}
    beats = {0: Seen(in_init), 2: Seen(in_init),
             3: Seen({"last": 0, "exit": {"status": "finished"}, "machine": "elsewhere"})}
    assert leader.should_diagnose(beats, 4, STALL_S, "here") is None
    beats[1] = Seen({"pending": None, "last": None, "wait": None, "machine": "here", "pid": os.getpid()})
    assert leader.should_diagnose(beats, 4, STALL_S, "here") == ("exited", 0.0)


def _op_record(op_id: int, seq: int, name: str = "all_reduce", line: int = 5, done: bool = True) -> dict:
    record = {"ev": "op", "id": op_id, "op": name, "pg": "0", "seq": seq, "t": 10.0 + op_id,
              "file": "train.py", "line": line, "where": f"train.py:{line}",
              "shapes": None if name == "barrier" else [[4]]}
    return {**record, "te": 10.5 + op_id, "ok": True} if done else record


def test_a_posted_call_the_other_ranks_completed_does_not_hold_its_rank_in_it():
    # CI under load: rank 3 posted its 5th all_reduce before it ran (a loop's run longer than ever),
    # completed it and was killed after the loop; its last beat was older. The others completed #5
    # and wait in barrier #6: rank 3 got through #5 (no rank leaves an all_reduce before all joined)
    others = [_op_record(i, i) for i in range(1, 6)] + [_op_record(6, 6, "barrier", 7, done=False)]
    answers = {rank: {"recs": others, "stack": [], "progress": {"0": [6, 5]}, "fr": []} for rank in range(3)}
    beats = {rank: Seen({"n": 5, "machine": "here", "pid": os.getpid()}) for rank in range(3)}
    beats[3] = Seen({"n": 2, "machine": "there", "pid": 1, "recs": [_op_record(1, 1, done=False)],
                     "site": {"file": "train.py", "line": 5, "where": "train.py:5"}, "progress": {}})
    posted = {3: _op_record(5, 5, done=False)}
    found = leader.diagnose_answers(4, "stall", 5.0, answers, beats, "here", {}, posted)
    assert (found.kind, found.ranks) == ("rank-missing", [3]), found.summary
    assert (found.per_rank[3].state, found.per_rank[3].op) == ("outside-collective", None), found.per_rank[3]


def test_a_silent_rank_whose_last_progress_note_is_stale_is_placed_outside_any_collective():
    # l4 of a blind batch, 1 run in 3-4: rank 3's helper thread noted DDP's first broadcasts enqueued
    # and none completed, then the rank went on and hung in a regex holding the GIL: no note since.
    # Read with py-spy, it is in its own code; the others completed #8 with it: "unknown" before
    init = {**_op_record(0, 0, "init_process_group", 3, done=False), "te": 10.2, "ok": True}
    waiting = {"recs": [init, _op_record(9, 9, line=72, done=False)], "stack": [], "progress": {"0": [9, 8]},
               "fr": []}
    answers = {rank: waiting for rank in range(3)}
    beats = {rank: Seen({"n": 5, "machine": "here", "pid": os.getpid()}) for rank in range(3)}
    beats[3] = Seen({"n": 9, "machine": "there", "pid": 1, "recs": [init], "progress": {"0": [2, -1]},
                     "site": {"file": "train.py", "line": 44, "where": "train.py:44"}})
    stacks = {3: [{"file": "train.py", "line": 44, "func": "tokens", "user": True, "where": "train.py:44"}]}
    found = leader.diagnose_answers(4, "stall", 5.0, answers, beats, "here", stacks, {})
    assert (found.kind, found.ranks) == ("rank-missing", [3]), found.summary
    assert (found.per_rank[3].state, found.per_rank[3].location) == ("outside-collective", "train.py:44")


def test_a_rank_never_heard_from_is_placed_as_starting_and_looked_at_again_not_named_as_ended():
    # CI under load, notebook 05's 3-node job at stall_s 3: rank 1 was still importing torch (its
    # doctor not yet on the board) while ranks 0 and 2 waited in init_process_group; it was named
    # "ended, nothing of it seen" and the job was stopped, though it would have joined
    from helpers.doctor import loading

    init = _op_record(0, 0, "init_process_group", 3, done=False)
    answers = {rank: {"recs": [init], "stack": [], "progress": {}, "fr": []} for rank in (0, 2)}
    beats = {rank: Seen({"n": 5, "machine": "here", "pid": os.getpid()}) for rank in (0, 2)}
    found = leader.diagnose_answers(3, "stall", 3.5, answers, beats, "here", {}, {})
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.summary
    assert (found.per_rank[1].state, found.per_rank[1].exit_code) == ("outside-collective", None)
    assert f"rank 1 is {wording.UNHEARD}" in found.summary, found.summary
    watch = loading.ImportWatch()
    looks = [watch.look(found, {}, 3.0, frozenset({1})) for _ in range(loading.IMPORT_LOOKS + 1)]
    assert [again for again, _note in looks] == [True] * loading.IMPORT_LOOKS + [False]
    assert looks[0][1].startswith("no progress for 3.5 s while rank 1 had not reported yet"), looks[0]
    assert "had still not reported after the doctor had looked again" in looks[-1][1], looks[-1]
    # a rank heard from is not held for: the diagnosis stands
    assert loading.ImportWatch().look(found, {}, 3.0, frozenset()) == (False, None)


def test_a_stall_whose_collective_every_rank_left_as_the_stacks_came_is_not_named():
    # CI under load, notebook 05's job: rank 0 waited in init_process_group past stall_s while the
    # others started; when their stacks came, every rank had left it and was importing torch._dynamo
    # (the first optimizer): "hang (unknown)", and the job was stopped
    from helpers.doctor import loading

    init = {**_op_record(0, 0, "init_process_group", 3, done=False), "te": 10.2, "ok": True}
    site = [{"file": "/job/train.py", "line": 9, "func": "main", "user": True, "where": "train.py:9"}]
    answers = {rank: {"recs": [init], "stack": site, "progress": {"0": [0, 0]}, "fr": []}
               for rank in range(3)}
    beats = {rank: Seen({"n": 5, "machine": "here", "pid": os.getpid()}) for rank in range(3)}
    found = leader.diagnose_answers(3, "stall", 3.4, answers, beats, "here", {}, {})
    assert found.kind == "unknown" and loading.stall_ended(found), found.summary
    answers[2]["recs"] = [init, _op_record(1, 1, line=10, done=False)]  # one still waits: a hang to name
    found = leader.diagnose_answers(3, "stall", 3.4, answers, beats, "here", {}, {})
    assert not loading.stall_ended(found), found.summary


GLOO_PEER_GONE = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                  "error [127.0.0.1]:27044: Connection reset by peer. This is typically caused by a remote "
                  "worker hanging or bugs in the application.")


def test_a_posted_call_gloo_aborted_its_rank_in_stays_its_place_though_torch_counts_it_completed():
    # CI under load (the size-mismatch job): rank 2 posted its 5th all_reduce of 1 float and gloo
    # aborted it there; its last beat was from init. Rank 0's all_reduce of 8 failed; rank 1's end was
    # not on file, only torch's progress [5, 5], which counts a failed collective as completed; then
    # torchrun's SIGTERM stopped both. The table showed no call for any rank
    def stopped(progress_only: bool, stack: list[dict]) -> dict:
        last = [_op_record(5, 5, done=False)]
        if not progress_only:
            last.append({"ev": "end", "id": 5, "t": 16.0, "ok": False, "error": GLOO_PEER_GONE})
        records = [_op_record(i, i) for i in range(1, 5)] + [{**last[0], "shapes": [[8]]}] + last[1:]
        exit_record = {"ev": "exit", "t": 16.1, "status": "stopped", "code": -15,
                       "by": "SIGTERM from its launcher", "orphaned": False, "gone": [2]}
        return {"recs": records, "stack": stack, "progress": {"0": [5, 5]}, "fr": [], "exit": exit_record}

    def frame(file: str, line: int, user: bool) -> dict:
        return {"file": file, "line": line, "func": "f", "user": user, "where": f"{Path(file).name}:{line}"}

    in_call = [frame("/job/train.py", 5, True), frame("/venv/torch/distributed/c10d_logger.py", 53, False)]

    answers = {0: stopped(progress_only=False, stack=[]), 1: stopped(progress_only=True, stack=in_call)}
    beats = {rank: Seen({"n": 5, "machine": "here", "pid": os.getpid(), **answers[rank]}) for rank in (0, 1)}
    init = {**_op_record(0, 0, "init_process_group", 3, done=False), "te": 10.2, "ok": True}
    beats[2] = Seen({"n": 1, "machine": "there", "pid": 1, "progress": {}, "recs": [init]})
    posted = {2: {**_op_record(5, 5, done=False), "shapes": [[1]]}}
    found = leader.diagnose_answers(3, "failure", 1.0, answers, beats, "here", {}, posted)
    assert (found.kind, found.ranks) == ("shape-mismatch", [2]), found.summary
    assert [(report.op, report.seq, report.shapes) for report in found.per_rank] == [
        ("all_reduce", 5, [[8]]), ("all_reduce", 5, [[8]]), ("all_reduce", 5, [[1]])], found.per_rank
    # each guard alone keeps the posted call open: no rank's record shows #5 ended well (both known
    # from progress), or one's shows it ended well and another's that it failed
    def ended_well(answer: dict) -> dict:  # a progress note, then the end's record: it ended well
        answer["recs"] += [{"ev": "pg", "pg": {"0": [5, 5]}, "t": 15.9}, {"ev": "end", "id": 5, "t": 16.0,
                                                                          "ok": True}]
        return answer

    by_progress = {rank: stopped(progress_only=True, stack=in_call) for rank in (0, 1)}
    well_and_failed = {0: stopped(False, in_call), 1: ended_well(stopped(True, []))}
    for case in (by_progress, well_and_failed):
        found = leader.diagnose_answers(3, "failure", 1.0, case, beats, "here", {}, posted)
        assert found.per_rank[2].shapes == [[1]], found.per_rank[2]
    # one rank's record shows it ended well, none that it failed: rank 2 got through it
    well = {0: stopped(True, in_call), 1: ended_well(stopped(True, []))}
    found = leader.diagnose_answers(3, "failure", 1.0, well, beats, "here", {}, posted)
    assert found.per_rank[2].op is None, found.per_rank[2]
    # stopped in its own code after the call returned (its end's record not written): placed there
    answers[1] = stopped(progress_only=True, stack=[frame("/job/train.py", 9, True)])
    found = leader.diagnose_answers(3, "failure", 1.0, answers, beats, "here", {}, posted)
    assert (found.per_rank[1].op, found.per_rank[1].location) == (None, "train.py:9"), found.per_rank[1]


def test_ranks_that_run_the_same_software_get_no_note():
    import torch  # noqa: F401 - loaded in every rank before its watchdog posts what it runs

    from helpers.doctor import software

    same = software.rank_software([__file__])
    assert set(same) >= {"python", "script", "torch"}
    assert software.differences_note({0: same, 1: dict(same), 2: {}}) is None  # a rank that posted nothing
    assert "torch 2.13.0 on rank 0, 2.12.1 on rank 1" in software.differences_note(
        {0: {"torch": "2.13.0"}, 1: {"torch": "2.12.1"}})
    # a node without accelerate differs from one with it; a Python patch release alone does not lead
    # the fix of a failed job (it cannot make collectives disagree), another minor version does
    posted = {0: {"accelerate": "1.16.0", "python": "3.11.4"}, 1: {"accelerate": software.NOT_INSTALLED,
                                                                   "python": "3.11.9"}}
    assert software.differences(posted) == ["python", "accelerate"]
    assert "accelerate 1.16.0 on rank 0, not installed on rank 1" in software.differences_note(posted)
    assert not software.decisive(software.differences(posted), posted)
    posted[1]["python"] = "3.12.1"
    assert software.decisive(software.differences(posted), posted)


def test_reading_what_the_ranks_run_does_not_wait_for_a_rank_that_posted_nothing():
    # a rank of an older doctor posts no such key: the leader's read must not wait out the store's
    # timeout (it would miss its own heartbeats meanwhile)
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", procs.free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    board = Board(dist.PrefixStore("helpers-doctor/test/0/", store), 0)
    board.join({"n": 1}, {"torch": "2.13.0"})
    started = time.monotonic()
    assert board.software([0, 1]) == {0: {"torch": "2.13.0"}}
    assert time.monotonic() - started < 2.0


def test_a_forked_child_stopped_with_sigterm_is_not_its_rank(script, tmp_path, leftovers):
    # DataLoader workers are forked children: their SIGTERM must neither wake the rank's watchdog
    # nor keep the doctor's handler (the child dies at once, as without the doctor)
    outcome = _run(script, tmp_path, "child", **ALONE)
    assert outcome.agent_codes == [0, 0], outcome.outputs[1][-3000:]
    assert _json(outcome, world=2)["verdict"] == "ok"
    leftovers.check()


def test_a_scripts_own_sigterm_handler_decides_what_sigterm_does(script, tmp_path, leftovers):
    outcome = _run(script, tmp_path, "own-term", **ALONE)
    assert outcome.agent_codes == [0, 0], outcome.outputs[1][-3000:]
    leftovers.check()


def test_a_sys_exit_in_the_loop_on_the_second_node_is_named_with_its_branch(script, tmp_path, leftovers):
    # rank 1 leaves through sys.exit(0) in its fourth step: exit code 0, yet no loop ran out
    outcome = _run(script, tmp_path, "exit-early", **ALONE)
    data = _json(outcome, world=2)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), data["summary"]
    exit_line = _line("exit-early")
    loop = FIXTURE.read_text().splitlines().index("    for step in range(5):") + 1
    assert data["summary"].startswith(
        f"Rank 1 left through sys.exit(0) at {exit_line}, inside the loop at {FIXTURE.name}:{loop} (under "
        "'if MODE == 'exit-early' and step == 3 and "), data["summary"]
    branch = int(exit_line.rsplit(":", 1)[1]) - 1
    assert f" at {FIXTURE.name}:{branch}, a branch on the rank)" in data["summary"], data["summary"]
    assert "ran out first" not in data["summary"]
    assert data["fix"].startswith(wording.LOOP_EXIT_CURE), data["fix"]
    leftovers.check()


def test_a_script_that_ends_with_os_exit_is_a_healthy_end(script, tmp_path, leftovers):
    # os._exit skips Python's teardown: the doctor still hears how each rank ended (no "killed")
    outcome = _run(script, tmp_path, "os-exit", **ALONE)
    assert outcome.agent_codes == [0, 0], outcome.outputs[0][-3000:]
    leftovers.check()


def test_sigterm_while_a_rank_runs_its_exit_handlers_ends_it(script, tmp_path, leftovers):
    # rank 1 has finished and its exit handler hangs; rank 0 then fails, and the agent stops rank 1
    # with SIGTERM: that ends it, as without the doctor, not torchrun's SIGKILL 30 s later (the
    # handler ran inside the rank's own leaving and waited for it)
    env = {"MODE": "exit-handler", "CULPRIT": "1", "READY_FILE": str(tmp_path / "ready")}
    outcome = runs.run_job([str(script)], tmp_path, nodes=1, per_node=2, stall_s=STALL_S, timeout_s=TIMEOUT_S,
                           env=env)
    assert not _left(script), "job processes left"
    crash = EXIT_CODES["crash"]  # rank 0's exit 1 after its last collective: the doctor stops the job
    assert outcome.rank_codes[0] == crash, outcome.outputs[0][-3000:]
    assert outcome.rank_codes[1] in (crash, 128 + signal.SIGTERM), outcome.outputs[0][-3000:]  # not -9
    leftovers.check()


def test_a_job_torchrun_restarts_keeps_each_runs_diagnosis(script, tmp_path, leftovers):
    # --max-restarts 1 on one agent: rank 1 raises in the first run, torchrun starts the job again and
    # the second run ends well; the first run's crash is still kept. (The restart ends at once, often
    # before its watchdogs reach the store: then no verdict is written for it, nor needed.)
    options = ["--stall-s", str(STALL_S), "--json", runs.JOB_JSON]
    command = runs.job_commands([str(script)], 1, 2, procs.free_port(), options)[0]
    command[command.index("--max-restarts") + 1] = "1"
    node = tmp_path / "node0"
    node.mkdir()
    outcome = runs.Job([command], [node], {"MODE": "raise-first", "CULPRIT": "1"}).wait(TIMEOUT_S)
    assert outcome.agent_codes == [0], outcome.outputs[0][-3000:]  # the restart ran, and ended well
    first = json.loads((node / "doctor.restart-0.json").read_text())
    assert (first["verdict"], first["kind"], first["ranks"]) == ("crash", "rank-exited", [1]), first
    assert "the first run only" in first["summary"]
    assert any(note.startswith("restart 0 of at most 1") for note in first["notes"]), first["notes"]
    assert not _left(script)
    leftovers.check()


def test_kill_9_of_the_agent_that_hosts_the_store_still_leaves_nothing(script, tmp_path, leftovers):
    # node 0's agent hosts the job's store: with it gone nobody can diagnose, but every rank ends
    # (gloo's barrier may never notice that its peers died: the waiting rank ends itself at stall_s)
    started = runs.start_job([str(script)], tmp_path, stall_s=8.0, env={"MODE": "hang", "CULPRIT": "3"})
    try:
        _wait_for_watchdogs(started, 4)
        started.agents[0].send_signal(signal.SIGKILL)
    finally:
        outcome = started.wait(TIMEOUT_S)
    assert outcome.agent_codes[0] == -9 and outcome.agent_codes[1] is not None, outcome.outputs[1][-3000:]
    assert outcome.agent_seconds[1] < 60, "not torch's 30-minute timeout"
    assert not _left(script), "no rank may run on without its store"
    leftovers.check()


def test_a_rank_whose_python_cannot_answer_is_named_after_a_bounded_wait(script, tmp_path, leftovers):
    # native code holding the GIL: the rank's watchdog cannot run; the leader names it from its last
    # heartbeat, and the rank is killed at the stop (SIGTERM cannot reach its Python either), with
    # the process it started
    outcome = _run(script, tmp_path, "gil", HELPER_CHILD="1")
    data = _json(outcome)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("hang", "rank-missing", [3]), data
    assert any("rank 3 did not answer" in note and "GIL" in note for note in data["notes"])
    if any("py-spy" in note for note in data["notes"]):  # root here; ptrace rights elsewhere
        assert data["per_rank"][3]["location"] == _line("gil")
    assert data["detected_after_s"] <= STALL_S + leader.EVIDENCE_WAIT_S + leader.PY_SPY_S + 1
    assert max(outcome.agent_seconds) < 60  # not torchrun's 30 s SIGTERM grace on top of it
    leftovers.check()


def test_a_rank_whose_python_stops_right_after_a_collective_is_placed_by_its_stack(script, tmp_path,
                                                                                    leftovers):
    # its last heartbeat caught it inside the all_reduce before: py-spy's stack says where it is now
    outcome = _run(script, tmp_path, "gil-step", **ALONE)
    data = _json(outcome, world=2)
    if not any("py-spy" in note for note in data["notes"]):
        pytest.skip("py-spy may not read the rank here (ptrace rights)")
    assert (data["verdict"], data["kind"], data["ranks"]) == ("hang", "rank-missing", [1]), data
    culprit = data["per_rank"][1]
    assert (culprit["state"], culprit["op"]) == ("outside-collective", None)
    assert culprit["location"] == _line("native-step")
    assert f"rank 1 is in native code holding the GIL at {_line('native-step')}" in data["summary"]
    assert data["per_rank"][0]["location"] == _line("steps")
    leftovers.check()


def test_a_rank_gloo_aborts_on_a_size_mismatch_is_named_with_its_size(script, tmp_path, leftovers):
    # on 3 ranks gloo aborts rank 2 (SIGABRT) within milliseconds of its all_reduce of 1 float
    # against the others' 8, before its next heartbeat: the record it posted before the call is the
    # evidence (one node: on 4 ranks gloo's ring let the smaller rank finish instead)
    outcome = runs.run_job([str(script)], tmp_path, nodes=1, per_node=3, stall_s=STALL_S, timeout_s=TIMEOUT_S,
                           env={"MODE": "size", "CULPRIT": "2"})
    assert not _left(script), "job processes left"
    data = _json(outcome, world=3)
    assert (data["kind"], data["ranks"]) == ("shape-mismatch", [2]), data
    assert outcome.rank_codes[2] == -signal.SIGABRT, outcome.rank_codes
    assert data["per_rank"][2]["shapes"] == [[1]] and data["per_rank"][0]["shapes"] == [[8]]
    assert data["per_rank"][2]["location"] == _line("steps")
    said = "rank 2 ended without a word (no exception, no exit code): killed by a signal, most likely gloo's"
    assert any(note.startswith(said) for note in data["notes"]), data["notes"]
    # faulthandler on the aborted rank's stderr: where its Python was (gloo aborts from a thread of
    # its own, so the main thread's stack is one of the threads dumped, not the current one)
    log = "".join(outcome.outputs)
    dump = re.search(r"^Fatal Python error: Aborted$(.*?)^Extension modules", log, re.MULTILINE | re.DOTALL)
    line = _line("steps").split(":")[1]
    assert dump and f'job_script.py", line {line} in ' in dump.group(1), log[-3000:]
    leftovers.check()


def test_calls_that_differ_along_the_nodes_are_said_to_with_the_cure_to_compare_them(script, tmp_path,
                                                                                      leftovers):
    # p8 of a blind batch: each node read a width from a file of its own (its working folder), and the
    # all_reduce's sizes differed between the nodes, alike within each
    for node, width in ((0, 8), (1, 12)):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "config.json").write_text(json.dumps({"width": width}))
    data = _json(_run(script, tmp_path, "node-config"))
    assert data["kind"] == "shape-mismatch", data
    assert ("The calls split along the nodes: the ranks of each node issued the same call, and the nodes did "
            "not (node 0: ranks 0 and 1; node 1: ranks 2 and 3).") in data["summary"], data["summary"]
    assert "-m helpers.audit --fleet" in data["fix"], data["fix"]
    leftovers.check()


def test_a_dict_key_of_one_ranks_own_is_named_on_another_node_though_gloo_aborted_that_rank(script, tmp_path,
                                                                                              leftovers):
    # uD s2: rank 3's third all_reduce from accelerate's reduce meets the others' DDP all-reduce, and
    # gloo aborts rank 3 before its next heartbeat. A call one more in a row than its line ever made
    # is posted to the store before it runs: the leader on node 0 has it
    outcome = _run(script, tmp_path, "rare-key", launcher="accelerate")
    data = _json(outcome)
    assert (data["kind"], data["ranks"]) == ("collective-mismatch", [3]), data
    assert outcome.rank_codes[3] == -signal.SIGABRT, outcome.rank_codes
    # (rank 2, stopped by its agent as rank 3 died, may have answered before it reached the DDP call)
    said = data["summary"]
    assert said.startswith(f"Ranks issued all_reduce at {_line('rare reduce')} a different number of "
                           "times in a row: ranks 0"), said
    assert f" 2 times, then all_reduce at {_line('rare backward')} as collective #" in said, said
    # its earlier calls of the run known from a heartbeat, or only the one it posted
    assert re.search(r"; rank 3 (once more|3 times, the last) as collective #", said), said
    assert data["fix"].startswith(wording.REPEATED_CALL_CURE)
    leftovers.check()


def test_kill_9_of_one_agent_ends_the_job_on_both_nodes(script, tmp_path, leftovers):
    started = runs.start_job([str(script)], tmp_path, stall_s=30.0, env={"MODE": "hang", "CULPRIT": "3"})
    try:
        _wait_for_watchdogs(started, 4)
        started.agents[1].send_signal(signal.SIGKILL)  # the second node's agent
    finally:
        outcome = started.wait(TIMEOUT_S)
    assert outcome.agent_codes[1] == -9 and outcome.agent_codes[0] is not None
    assert not _left(script), "the killed agent's ranks must not run on with parent PID 1"
    data = _json(outcome)
    # the lost node's ranks are the cause (the one outside any collective first), not node 0's
    assert data["verdict"] == "crash" and data["ranks"] and set(data["ranks"]) <= {2, 3}, data
    assert "its agent died" in data["summary"]
    leftovers.check()


def test_keep_leaves_each_nodes_records_and_the_leaders_diagnosis(script, tmp_path, leftovers):
    outcome = runs.run_job([str(script)], tmp_path, stall_s=STALL_S, timeout_s=TIMEOUT_S, keep=True,
                           env={"MODE": "hang", "CULPRIT": "3"})
    first, second = (d / runs.JOB_KEEP for d in outcome.node_dirs)
    assert sorted(p.name for p in first.glob("trace-*")) == ["trace-0.jsonl", "trace-1.jsonl"]
    assert sorted(p.name for p in second.glob("trace-*")) == ["trace-2.jsonl", "trace-3.jsonl"]
    assert {p.name for p in second.glob("state-*")} == {"state-2.json", "state-3.json"}
    kept = json.loads((first / "diagnosis.json").read_text())
    assert kept == json.loads((outcome.node_dirs[0] / runs.JOB_JSON).read_text())
    assert kept["ranks"] == [3]
    merged = tmp_path / "merged"  # the nodes' folders side by side (shared storage): a post-mortem
    for folder in (first, second):
        shutil.copytree(folder, merged, dirs_exist_ok=True)
    again = doctor.diagnose_dir(merged, 4, stopped=True)  # the doctor stopped every rank
    assert (again.kind, again.ranks) == ("rank-missing", [3]), again.text()
    leftovers.check()


def test_on_hang_report_writes_the_diagnosis_and_leaves_the_job_to_torch(script, tmp_path, leftovers):
    started = runs.start_job([str(script)], tmp_path, stall_s=STALL_S, on_hang="report",
                             env={"MODE": "hang", "CULPRIT": "3"})
    written = started.node_dirs[0] / runs.JOB_JSON
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not written.exists():
            assert time.monotonic() < deadline and all(a.poll() is None for a in started.agents)
            time.sleep(0.1)  # polling another process's output, bounded by the deadline
        assert json.loads(written.read_text())["ranks"] == [3]
        for _ in range(int(3 / job.TICK_S)):  # a few ticks later the job still runs, as asked
            assert all(agent.poll() is None for agent in started.agents)
            time.sleep(job.TICK_S)
    finally:
        outcome = started.wait(0)  # stopped here, with every tree: torch's timeout is 30 minutes
    assert outcome.agent_codes == [None, None]
    assert not _left(script)
    leftovers.check()


def _wait_for_watchdogs(started: runs.Job, world: int) -> None:
    """Until every rank's watchdog is on the roster in the job's store (read as the ranks read it)."""
    port = int(started.commands[0][started.commands[0].index("--master-port") + 1])
    deadline, board = time.monotonic() + TIMEOUT_S, None
    while True:
        assert time.monotonic() < deadline and all(a.poll() is None for a in started.agents)
        try:
            board = board or Board.connect("127.0.0.1", port, "none", "0", rank=-1, timeout_s=2)
            if board.store.check(["roster"]) and len(board.roster()) >= world:
                return
        except Exception:  # noqa: BLE001 - the agent's store is not up yet
            board = None
        time.sleep(0.1)  # polling another process's state, bounded by the deadline


def test_under_accelerate_launch_on_two_machines(script, tmp_path, leftovers):
    outcome = _run(script, tmp_path, "hang", launcher="accelerate")
    assert outcome.commands[1][:5] == [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                                       "--num_machines"]
    data = _json(outcome)
    assert (data["verdict"], data["kind"], data["ranks"]) == ("hang", "rank-missing", [3]), data
    assert data["per_rank"][0]["location"] == _line("barrier")
    leftovers.check()


CATALOG = [s.id for s in scenarios.SCENARIOS]


@pytest.fixture(scope="module")
def catalog_jobs(tmp_path_factory) -> dict[str, Any]:
    """Every catalog scenario as a job of one agent of two ranks, two jobs at a time (a job mostly
    waits: on its stall, its teardown), then a leftovers check over them all."""
    def run(scenario_id: str, folder: Path) -> runs.JobRun:
        scenario = scenarios.get(scenario_id)
        return runs.run_job(scenario.command(scenario.variants[0]), folder, nodes=1, per_node=2,
                            stall_s=2.0, timeout_s=TIMEOUT_S)

    return run_each(run, CATALOG, tmp_path_factory, "job", at_once=2)


@pytest.mark.parametrize("scenario_id", CATALOG)
def test_the_catalog_under_the_doctor_in_a_job(scenario_id, catalog_jobs):
    # one agent of two ranks (the catalog's expectations are for two ranks; the multi-node cases
    # are above): the agent that hosts the store outlives a rank that gloo aborts
    from tests.test_scenarios import check_diagnosis

    scenario, outcome = scenarios.get(scenario_id), result_of(catalog_jobs, scenario_id)
    data = _json(outcome, world=2)
    aborted = -6 in outcome.rank_codes.values()
    if scenario.id == "variable-gather" and data["kind"] == "rank-exited":
        # gloo aborted one rank (SIGABRT) within milliseconds of the mismatched call, before its
        # heartbeat carried the shape (the catalog's notes): the doctor names the rank that died
        assert data["verdict"] == "crash" and len(data["ranks"]) == 1 and aborted
    else:
        check_diagnosis({key: data[key] for key in KEYS}, scenario, "job", 2, stall_s=2.0)
    if data["verdict"] != "ok" and scenario.id != "dead-rank":
        allowed = {EXIT_CODES[data["verdict"]]} | ({-6, 143} if scenario.id == "variable-gather" else set())
        assert set(outcome.rank_codes.values()) <= allowed, outcome.rank_codes
    assert all(code is not None for code in outcome.agent_codes)


# ---------------------------------------------------------------------------------------------
# the command line


def test_without_a_launcher_the_script_runs_as_it_is(tmp_path):
    # accelerate launch with a one-process config sets no RANK: nothing to wait for, nothing to watch
    script = tmp_path / "one.py"
    script.write_text("import sys\nprint('ran', sys.argv[1:])\nsys.exit(7)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run([sys.executable, "-m", "helpers.doctor", str(script), "--x"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 7 and "ran ['--x']" in done.stdout
    assert "unwatched" in done.stderr and "--num-processes" in done.stderr


def test_without_a_launcher_num_processes_runs_the_local_doctor(tmp_path, leftovers):
    out = tmp_path / "d.json"
    done = subprocess.run([sys.executable, "-m", "helpers.doctor", "--num-processes", "2", "--stall-s", "2",
                           "--json", str(out), str(FIXTURE)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MODE": "hang", "CULPRIT": "1"}, cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert (data["kind"], data["ranks"]) == ("rank-missing", [1])
    leftovers.check()


@pytest.mark.parametrize("argv, message", [
    (["--stall-s", "0", "x.py"], "stall_s"),
    (["--on-hang", "later", "x.py"], "on_hang"),
    (["--stall-s", "3"], "command"),
    (["missing.py"], "not found"),
])
def test_bad_usage_is_one_message_naming_the_argument(argv, message):
    done = subprocess.run([sys.executable, "-m", "helpers.doctor", *argv], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_options_end_where_the_script_begins():
    from helpers.doctor.cli import split_command

    assert split_command(["--stall-s", "5", "train.py", "--stall-s", "9"]) == \
        (["--stall-s", "5"], ["train.py", "--stall-s", "9"])
    assert split_command(["--json=x.json", "-m", "pkg.train", "-v"]) == \
        (["--json=x.json"], ["-m", "pkg.train", "-v"])
    assert split_command(["--keep", "k", "--", "train.py"]) == (["--keep", "k"], ["train.py"])


def test_the_srun_line_runs_torchrun_with_the_doctor_on_every_node():
    line = runs.srun_line("train.py --epochs 3", nodes=4, per_node=8, stall_s=60)
    assert line.startswith("srun --nodes 4 --ntasks-per-node 1 ")
    assert "torchrun --nnodes 4 --nproc-per-node 8" in line and "-m helpers.doctor --stall-s 60" in line
    assert "--rdzv-backend c10d" in line and "train.py --epochs 3" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_without_ptrace_rights_a_silent_rank_keeps_its_heartbeat_position(tmp_path):
    # the leader may not read a rank it does not own with py-spy: no stack, no error, no hang
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (f"import socket\nfrom helpers.doctor import leader\nfrom helpers.doctor.board import Seen\n"
                f"beats = {{3: Seen({{'machine': 'here', 'pid': {sleeper.pid}}})}}\n"
                f"print(leader.py_spy_stacks([3], beats, 'here'))\n")
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                               "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                              env={**os.environ, "HOME": "/"})
        assert done.returncode == 0 and done.stdout.strip() == "{}", done.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_ranks_answer_carries_the_errors_that_ended_its_threads_to_the_leaders_view():
    # a rank waiting on a queue whose thread died is told that thread's error in a job too (o8 of a
    # blind batch): the leader's view keeps it from the rank's answer
    error = {"thread": "prefetch-e0", "error": "RuntimeError: too long", "where": "train.py:27",
             "func": "collate"}
    frame = {"file": "/x/train.py", "line": 65, "where": "train.py:65", "func": "main", "user": True}
    answer = {"stack": [frame], "thread_errors": [error]}
    view = leader.view_from(3, {"recs": []}, answer)
    assert view.state["thread_errors"] == [error]
