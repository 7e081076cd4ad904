"""The doctor on jobs it did not start: attach with py-spy to plain torchrun jobs, merge nodes, read
torch's Flight Recorder dumps. Every job here is a real torchrun job over loopback, hung on purpose,
and is stopped with its whole tree at the end of its test module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from helpers import doctor, procs
from helpers.doctor import pyspy
from helpers.launch import launch

HANG = textwrap.dedent("""\
    import os, pathlib, time
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    class Stuck:
        def __len__(self):
            return 2

        def __getitem__(self, index):
            pathlib.Path(os.environ["READY_DIR"], "worker-in-getitem").touch()
            while True:  # line: worker
                time.sleep(0.05)

    def main():
        dist.init_process_group("gloo")
        pathlib.Path(os.environ["READY_DIR"], f"ready-{dist.get_rank()}").touch()
        if dist.get_rank() == int(os.environ.get("CULPRIT", "1")):
            for batch in DataLoader(Stuck(), num_workers=1):  # line: culprit (its worker never delivers)
                pass
        dist.barrier()  # line: barrier

    if __name__ == "__main__":
        main()
    """)
START_S = 120.0  # torch imports on a loaded 2-core machine


def _line(marker: str) -> int:
    return next(n for n, text in enumerate(HANG.splitlines(), 1) if f"# line: {marker}" in text)


class Job:
    """A plain torchrun job (one or several agents) that hangs: rank CULPRIT never reaches the barrier,
    waiting for its DataLoader's worker, stuck in the dataset."""

    def __init__(self, folder: Path, nodes: int = 1, per_node: int = 2, culprit: int = 1):
        self.folder, self.world = folder, nodes * per_node
        self.script = folder / "hang_job.py"
        self.script.write_text(HANG)
        port = procs.free_port()
        env = {**os.environ, "READY_DIR": str(folder), "CULPRIT": str(culprit), "TMPDIR": str(folder)}
        self.agents = []
        for node in range(nodes):
            work = folder / f"node{node}"
            work.mkdir()
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                    "--nproc-per-node", str(per_node), "--node-rank", str(node), "--master-addr",
                    "127.0.0.1", "--master-port", str(port), "--max-restarts", "0", str(self.script)]
            self.agents.append(subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL))

    def wait_ready(self) -> None:
        """Until every rank created its group (a file each) and the culprit's DataLoader worker is in
        the dataset; then the job hangs for good."""
        deadline = time.monotonic() + START_S
        worker = self.folder / "worker-in-getitem"
        while len(list(self.folder.glob("ready-*"))) < self.world or not worker.exists():
            assert time.monotonic() < deadline, "the job's ranks did not start"
            assert all(agent.poll() is None for agent in self.agents), "an agent ended early"
            time.sleep(0.1)

    def ranks(self) -> list[psutil.Process]:
        return [p for agent in self.agents for p in psutil.Process(agent.pid).children()
                if str(self.script) in " ".join(p.cmdline())]

    def stop(self) -> None:
        """Stop every agent with its whole tree; nothing of the job may be left."""
        for agent in self.agents:
            procs.stop_tree(agent)
        left = [p.pid for p in psutil.process_iter(["cmdline"])
                if str(self.script) in " ".join(p.info["cmdline"] or [])]
        assert not left, f"job processes left: {left}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    running = Job(tmp_path_factory.mktemp("job"))
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def _snapshot(job: Job) -> list[tuple[int, float]]:
    return sorted((p.pid, p.create_time()) for p in job.ranks())


def test_attach_by_the_agent_names_the_culprit_and_leaves_the_job_running(job):
    before = _snapshot(job)
    [found] = doctor.attach(str(job.agents[0].pid))
    diagnosis = found.diagnosis
    assert (diagnosis.verdict, diagnosis.kind, diagnosis.ranks) == ("hang", "rank-missing", [1]), \
        diagnosis.text()
    assert diagnosis.per_rank[0].op == "barrier"
    assert diagnosis.per_rank[0].location == f"{job.script.name}:{_line('barrier')}"
    assert diagnosis.per_rank[1].location == f"{job.script.name}:{_line('culprit')}"
    worker = f"is sleeping in a loop at {job.script.name}:{_line('worker')} in __getitem__)"
    assert worker in diagnosis.summary, diagnosis.summary  # its DataLoader worker, read with py-spy too
    assert any("sequence numbers" in note for note in diagnosis.notes)  # what stacks cannot tell
    assert _snapshot(job) == before, "attaching must leave the same processes"
    assert all(p.status() != psutil.STATUS_STOPPED for p in job.ranks())


def test_attach_by_a_rank_and_auto_find_the_same_job(job):
    rank_pid = job.ranks()[0].pid
    [by_rank] = doctor.attach(str(rank_pid))
    assert sorted(p.pid for p in by_rank.ranks) == sorted(p.pid for p in job.ranks())
    found = [part for part in doctor.attach("auto") if part.job == by_rank.job]
    assert len(found) == 1 and found[0].diagnosis.ranks == [1]


def test_attach_cli_writes_the_doctors_json(job, tmp_path):
    out = tmp_path / "node.json"
    done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--attach", str(job.agents[0].pid),
                           "--native", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr  # a hang
    data = json.loads(out.read_text())
    assert {"verdict", "kind", "ranks", "per_rank", "summary", "fix", "detected_after_s"} <= set(data)
    assert [entry["rank"] for entry in data["per_rank"]] == [0, 1]
    assert {"rank", "location", "state", "op", "exit_code"} <= set(data["per_rank"][0])
    assert set(data["stacks"]) == {"0", "1"} and data["native"] is True
    assert any(frame["native"] for frame in data["stacks"]["0"]), "--native reads C++ frames"


def test_two_agents_attached_one_by_one_then_merged(tmp_path):
    # two torchrun agents over 127.0.0.1, the same commands a two-node cluster runs; the culprit is
    # rank 3, on the second node
    two = Job(tmp_path, nodes=2, per_node=2, culprit=3)
    try:
        two.wait_ready()
        files = []
        for node, agent in enumerate(two.agents):
            files.append(tmp_path / f"node-{node}.json")
            done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--attach", str(agent.pid),
                                   "--json", str(files[-1])], capture_output=True, text=True, timeout=120)
            assert done.returncode in (0, 3), done.stderr
        first = json.loads(files[0].read_text())
        assert first["ranks"] == [] and [p["state"] for p in first["per_rank"]][2:] == ["unseen"] * 2
        merged = tmp_path / "job.json"
        done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--merge", *map(str, files),
                               "--json", str(merged)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, done.stderr
        data = json.loads(merged.read_text())
        assert (data["kind"], data["ranks"]) == ("rank-missing", [3]), data["summary"]
        assert data["per_rank"][3]["location"] == f"{two.script.name}:{_line('culprit')}"
    finally:
        two.stop()


def _init_hang_attached() -> pyspy.Attached:
    """What py-spy read of a real job (torch 2.13, gloo): rank 0 in init_process_group, rank 1
    sleeping before it; diagnosed."""
    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"

    def frame(file: str, line: int, func: str, user: bool) -> dict:
        return {"file": file, "line": line, "func": func, "native": False, "user": user,
                "where": f"{Path(file).name}:{line}"}

    waiting = [frame("/job/train.py", 7, "<module>", True), frame(c10d, 1713, "init_process_group", False),
               frame(c10d, 1850, "_new_process_group_helper", False)]
    sleeping = [frame("/job/train.py", 6, "<module>", True)]
    stacks = {0: waiting, 1: sleeping}
    return pyspy.Attached(pyspy.diagnose_stacks(stacks, 2, native=False), "vm", 2, "a job", [], stacks)


def test_stacks_of_ranks_in_init_process_group_name_the_rank_that_never_reached_it():
    found = _init_hang_attached().diagnosis
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.summary
    assert found.summary.startswith("Rank 1 never reached the init_process_group that rank 0 entered at "
                                    "train.py:7"), found.summary


def test_a_rank_stuck_before_init_process_group_is_replayed_stuck_before_it(tmp_path, leftovers):
    # the replay's rank 1 stays busy before its Accelerator() sets up the group, as the original
    from helpers import repro

    _init_hang_attached().to_json(tmp_path / "a.json")
    script = repro.build_replay(tmp_path / "a.json", tmp_path / "out")
    assert script.expected == {"kind": "rank-missing", "verdicts": [], "ranks": [1]}
    run = repro.run_script(script, stall_s=3.0, timeout_s=120)
    assert run.as_expected, run.verdict()
    assert run.diagnosis.per_rank[0].op == "init_process_group", run.diagnosis.text()
    leftovers.check()


def test_bad_targets_exit_2_saying_what_to_do(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cases = [("999999", "no process with pid 999999"),
                 (str(sleeper.pid), "is not a torch.distributed rank"),
                 ("twelve", "give a process id or 'auto'")]
        for target, message in cases:
            done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--attach", target],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 2 and message in done.stderr, (target, done.stderr)
    finally:
        sleeper.kill()
        sleeper.wait()


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                           "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                          env={**os.environ, "HOME": "/"})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_no_ptrace_permission_is_explained(job):
    # a user who does not own the job: neither its environment nor py-spy's ptrace are allowed
    pid = job.ranks()[0].pid
    done = _as_nobody(f"from helpers.doctor import pyspy\ntry:\n    pyspy.find_ranks('{pid}')\n"
                      f"except pyspy.AttachError as e:\n    print(e)\n")
    assert "no permission to read pid" in done.stdout and "SYS_PTRACE" in done.stdout, done.stderr
    done = _as_nobody(f"from helpers.doctor import pyspy\ntry:\n    pyspy.dump_stack({pid})\n"
                      f"except pyspy.AttachError as e:\n    print(e)\n")
    assert "no permission to read pid" in done.stdout, done.stdout + done.stderr
    assert "kernel.yama.ptrace_scope" in done.stdout and "--cap-add SYS_PTRACE" in done.stdout


def test_merge_refuses_files_that_are_not_attach_results(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"verdict": "hang"}')
    done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--merge", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"merge: {bad} is not a file written by" in done.stderr


# ---------------------------------------------------------------------------------------------
# Flight Recorder dumps from real gloo ranks


def _dump_after_a_missed_all_reduce(folder: str) -> None:
    """Rank 0 enters a 4th all_reduce that rank 1 never issues; after gloo's (short) timeout both
    write torch's Flight Recorder dump, as NCCL would at its timeout."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank, tensor = dist.get_rank(), torch.ones(4)
    for _ in range(3):
        dist.all_reduce(tensor)
    if rank == 0:
        try:
            dist.all_reduce(tensor)  # line: missed
        except RuntimeError:
            pass
    Path(folder, f"fr_trace_rank_{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    if rank == 1:
        time.sleep(4)  # rank 0 times out first
    dist.destroy_process_group()


def test_from_fr_names_the_missing_rank_and_the_line(tmp_path):
    launch(_dump_after_a_missed_all_reduce, (str(tmp_path),), num_processes=2, init_group=False,
           timeout_s=120, env={"TORCH_FR_BUFFER_SIZE": "2000"})
    diagnosis = doctor.diagnose_dumps(tmp_path)
    assert (diagnosis.verdict, diagnosis.kind, diagnosis.ranks) == ("hang", "rank-missing", [1])
    assert diagnosis.per_rank[0].op == "all_reduce" and diagnosis.per_rank[0].seq == 4
    missed = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                  if "# line: missed" in text)
    assert diagnosis.per_rank[0].location == f"{Path(__file__).name}:{missed}"
    done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--from-fr", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "collective #4" in done.stderr, done.stderr


def _nccl_entry(seq: int, size: int, thread: str, line: int, in_thread: bool) -> dict:
    """One entry as torch 2.13's Flight Recorder dumps it under NCCL after its watchdog's timeout:
    still in flight, issued by Python thread ``thread`` (``threading.get_ident()``) from train.py."""
    frames = [{"name": "all_reduce", "filename": "/site-packages/torch/distributed/distributed_c10d.py",
               "line": 3245}, {"name": "metrics" if in_thread else "<module>", "filename": "/job/train.py",
                               "line": line}]
    if in_thread:  # how a thread's stack ends (threading.py's run, _bootstrap_inner, _bootstrap)
        frames += [{"name": name, "filename": "/usr/lib/python3.11/threading.py", "line": 1000}
                   for name in ("run", "_bootstrap_inner", "_bootstrap")]
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"), "thread_name": "python",
            "thread_id": thread, "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "nccl:all_reduce", "time_created_ns": 1_000_000_000 * seq,
            "input_sizes": [[size]], "input_dtypes": ["Float"], "output_sizes": [[size]], "state": "started",
            "retired": False, "timeout_ms": 600000, "is_p2p": False, "frames": frames}


def test_from_fr_names_collectives_of_two_threads_in_flight_on_one_group(tmp_path):
    # NCCL cannot run here: dumps shaped as its watchdog writes them (fields as a gloo dump of this
    # torch has them, tests/test_attach.py's real ones). Each rank's metrics thread and main thread
    # issued all_reduces on the default group in a different order; NCCL paired 1 float with 8 and hung
    import pickle

    order = {0: [(1, "977", 13, True), (8, "140", 19, False)],
             1: [(8, "150", 19, False), (1, "988", 13, True)]}
    for rank, calls in order.items():
        entries = [_nccl_entry(seq, size, thread, line, in_thread)
                   for seq, (size, thread, line, in_thread) in enumerate(calls, 1)]
        dump = {"version": "2.10", "entries": entries}
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    found = doctor.diagnose_dumps(tmp_path)
    assert found.kind == "collective-mismatch", found.text()
    assert ("Rank 0 issued collectives on the default group from 2 threads: all_reduce at train.py:19 (the "
            "main thread) and all_reduce at train.py:13 (another thread); so did rank 1") in found.summary, \
        found.summary
    # the same calls, the thread's over before the main thread's began (a thread that was joined):
    # no evidence that two threads raced
    for rank in order:
        path = tmp_path / f"nccl_trace_rank_{rank}"
        dump = pickle.loads(path.read_bytes())
        dump["entries"][0].update(retired=True, state="completed", time_discovered_completed_ns=1_500_000_000)
        path.write_bytes(pickle.dumps(dump))
    assert "threads" not in doctor.diagnose_dumps(tmp_path).summary


def test_from_fr_refuses_a_folder_without_dumps(tmp_path):
    (tmp_path / "notes.txt").write_text("no pickle here")
    done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--from-fr", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "holds no Flight Recorder dump" in done.stderr


def test_a_hang_found_by_attach_becomes_a_replay_with_the_same_diagnosis(job, tmp_path):
    from helpers import repro

    [found] = doctor.attach(str(job.agents[0].pid))
    found.to_json(tmp_path / "attached.json")
    script = repro.build_replay(tmp_path / "attached.json", tmp_path / "out")
    assert script.expected == {"kind": "rank-missing", "verdicts": [], "ranks": [1]}
    run = repro.run_script(script, stall_s=3.0, timeout_s=120)
    assert run.as_expected, run.verdict()


def test_a_folder_of_dumps_becomes_a_replay(tmp_path):
    from helpers.repro import replay

    launch(_dump_after_a_missed_all_reduce, (str(tmp_path),), num_processes=2, init_group=False,
           timeout_s=120)
    plan = replay.plan_replay(replay.load_recording(tmp_path))
    assert [len(rank.steps) for rank in plan.ranks] == [4, 3]
    assert [rank.end for rank in plan.ranks] == ["wait", "busy"]


def test_accelerates_own_data_loop_script_hangs_where_it_does(tmp_path):
    # accelerate's shipped test script hangs on CPU ranks: join_uneven_inputs does nothing there, so
    # rank 0 goes on into DDP's forward while rank 1 waits in wait_for_everyone()
    import accelerate

    script = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_distributed_data_loop.py"
    source = script.read_text().splitlines()
    forward = next(n for n, text in enumerate(source, 1) if "output = ddp_model(batch[0].float())" in text)
    barrier = next(n for n, text in enumerate(source, 1) if n > forward and "wait_for_everyone()" in text)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", str(procs.free_port()), "--max-restarts", "0", str(script)],
                             cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline, found = time.monotonic() + 240, None
        hang = f"{script.name}:{barrier}"  # not an earlier wait_for_everyone() of the script's (under
        while time.monotonic() < deadline and agent.poll() is None:  # load one was caught with rank 0
            try:  # still in its prepare())
                [found] = doctor.attach(str(agent.pid))
            except (doctor.AttachError, ValueError):
                found = None  # ranks not started yet
            if found and found.diagnosis.per_rank[1].location == hang:
                break
            time.sleep(0.5)
        assert found is not None and found.diagnosis.per_rank[1].location == hang, "never reached the hang"
        diagnosis = found.diagnosis
        assert found.diagnosis.per_rank[1].op == "barrier"
        assert (diagnosis.kind, diagnosis.ranks) == ("rank-missing", [0]), diagnosis.text()
        assert diagnosis.per_rank[0].location == f"{script.name}:{forward}"
    finally:
        procs.stop_tree(agent)


def test_attach_to_an_accelerate_launch_agent(tmp_path):
    # accelerate launch runs torch's elastic agent inside its own process: the ranks are its children
    script = tmp_path / "hang_job.py"
    script.write_text(HANG)
    env = {**os.environ, "READY_DIR": str(tmp_path), "CULPRIT": "0", "TMPDIR": str(tmp_path)}
    agent = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                              "--num_processes", "2", "--num_machines", "1", "--main_process_port",
                              str(procs.free_port()), str(script)], cwd=tmp_path, env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_S
        while len(list(tmp_path.glob("ready-*"))) < 2:
            assert time.monotonic() < deadline and agent.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        [found] = doctor.attach(str(agent.pid))
        assert (found.diagnosis.kind, found.diagnosis.ranks) == ("rank-missing", [0]), found.text()
        assert found.diagnosis.per_rank[1].location == f"{script.name}:{_line('barrier')}"
    finally:
        procs.stop_tree(agent)
