"""The tracer inside each rank: what it records, and that it changes nothing."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import marker_line

from helpers import doctor, procs, scenarios, sites, trace
from helpers.launch import RankExited, Run, launch, launch_command
from helpers.sites import is_user_code

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return marker_line(__file__, marker)


def _many_ops():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tensor = torch.ones(4, dtype=torch.float64)
    dist.all_reduce(tensor)  # line: all_reduce
    dist.broadcast(torch.zeros(2, 3), src=0)  # line: broadcast
    gathered = [None, None]
    dist.all_gather_object(gathered, {"rank": rank})  # line: object
    work = dist.all_reduce(torch.ones(2), async_op=True)  # line: async
    work.wait()
    if rank == 0:
        dist.send(torch.ones(3), dst=1)  # line: send
    else:
        dist.recv(torch.zeros(3), src=0)  # line: recv
    try:
        dist.broadcast(torch.ones(1), src=7)  # line: bad
    except (ValueError, RuntimeError):
        pass
    dist.barrier()  # line: barrier
    if rank == 1:  # no flush asked for: the helper thread writes the queue within FLUSH_S
        _wait_until(lambda: _ended_on_file(rank, "barrier"), "rank 1's barrier ended")
        os.kill(os.getpid(), signal.SIGKILL)  # what is on file must survive this
    return gathered


def _records_on_file(rank: int) -> list[dict]:
    """Inside a traced rank: the complete records in ``rank``'s trace file so far."""
    from helpers import rundir
    from helpers.trace import tracer

    text = rundir.trace_path(tracer.current.run_dir, rank).read_text()
    return [json.loads(line) for line in text.split("\n")[:-1]]


def _ends(records: list[dict]) -> dict[int, dict]:
    """Each ended call's end, by op id: an end record, or the op record's own (``te``), written
    when the call had returned before its record left the queue."""
    ends = {r["id"]: {"t": r["te"], "ok": r["ok"], **({"seq_end": r["seq_end"]} if "seq_end" in r else {})}
            for r in records if r["ev"] == "op" and "te" in r}
    ends.update((r["id"], r) for r in records if r["ev"] == "end")
    return ends


def _ended_on_file(rank: int, op: str) -> bool:
    records = _records_on_file(rank)
    ids = {r["id"] for r in records if r["ev"] == "op" and r["op"] == op}
    return bool(ids & set(_ends(records)))


def _wait_until(condition, what: str, within_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; past ``within_s`` it is a failure."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        time.sleep(0.005)


def test_records_every_call_once_with_site_shapes_and_outcome(tmp_path, leftovers):
    with pytest.raises(RankExited):
        launch(_many_ops, num_processes=2, timeout_s=60, watchers=[doctor.Doctor(30, keep_dir=tmp_path)])
    for rank in (0, 1):
        records = [json.loads(line) for line in (tmp_path / f"trace-{rank}.jsonl").read_text().splitlines()]
        ops = [r for r in records if r["ev"] == "op"]
        ends = _ends(records)
        names = [r["op"] for r in ops]
        assert names == ["all_reduce", "broadcast", "all_gather_object", "all_reduce",
                         "send" if rank == 0 else "recv", "broadcast", "barrier"], names
        first = ops[0]
        assert first["shapes"] == [[4]] and first["dtypes"] == ["float64"] and first["pg"] == "0"
        assert first["where"] == f"{HERE}:{_line('all_reduce')}" and first["func"] == "_many_ops"
        assert ops[1]["shapes"] == [[2, 3]] and ops[1]["where"] == f"{HERE}:{_line('broadcast')}"
        assert ops[2]["where"] == f"{HERE}:{_line('object')}" and "shapes" not in ops[2]
        assert ends[ops[2]["id"]]["seq_end"] > ops[2]["seq"]  # it issued inner collectives, recorded once
        assert ops[3]["async"] and any(r["ev"] == "enq" and r["id"] == ops[3]["id"] for r in records)
        assert ends[ops[3]["id"]]["ok"] is True
        assert ops[4]["p2p"] and ops[4]["peer"] == (1 if rank == 0 else 0)
        assert ends[ops[5]["id"]]["ok"] is False and ops[5]["where"] == f"{HERE}:{_line('bad')}"
        seqs = [r["seq"] for r in ops if not r.get("p2p")]
        assert seqs == sorted(seqs) and seqs[0] == 1
        assert ends[ops[-1]["id"]]["ok"] is True
    found = json.loads((tmp_path / "diagnosis.json").read_text())
    assert (found["kind"], found["ranks"]) == ("rank-exited", [1])
    leftovers.check()


def _p2p_works_waited_for():
    import torch
    import torch.distributed as dist

    from helpers import trace

    rank = dist.get_rank()
    name = "isend" if rank == 0 else "irecv"
    post = dist.isend if rank == 0 else dist.irecv
    work = post(torch.ones(3), 1 - rank)  # line: posted
    trace.flush()
    open_before_wait = not _ended_on_file(rank, name)
    work.wait()
    _wait_until(lambda: _ended_on_file(rank, name), f"rank {rank}'s {name} ended once waited for")
    peer = 1 - rank
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), peer),
                                    dist.P2POp(dist.irecv, torch.zeros(2), peer)])
    for each in works:
        each.wait()
    _wait_until(lambda: _ended_on_file(rank, "batch_isend_irecv"), "the batch ended once waited for")
    if rank == 0:
        kept = dist.isend(torch.ones(2), dst=1)  # never waited for: let go of once received
    else:
        kept = dist.irecv(torch.zeros(2), src=0)
        kept.wait()
        _wait_until(lambda: len(_ends(_records_on_file(rank))) == 3, "the irecv ended once waited for")
    dist.barrier()
    del kept
    _wait_until(lambda: len(_ends(_records_on_file(rank))) == 4, "every call ended")
    return open_before_wait, _records_on_file(rank)


def test_an_isend_or_irecv_ends_once_waited_for_not_when_posted(tmp_path, leftovers):
    """gloo's p2p works have no future: the helper thread sees them complete after ``wait()``, so
    a rank stuck in ``wait()`` shows as in its send or recv; a work let go of ends as dropped."""
    results = launch(_p2p_works_waited_for, num_processes=2, timeout_s=60,
                     watchers=[doctor.Doctor(30, keep_dir=tmp_path)])
    for rank, (open_before_wait, records) in enumerate(results):
        ops, ends = [r for r in records if r["ev"] == "op"], _ends(records)
        assert [r["op"] for r in ops] == ["isend" if rank == 0 else "irecv", "batch_isend_irecv",
                                          "isend" if rank == 0 else "irecv", "barrier"]
        assert open_before_wait, "a posted work that nobody waited for yet is still open"
        assert all(r.get("async") for r in ops[:3]) and ops[0]["where"] == f"{HERE}:{_line('posted')}"
        assert [ends[r["id"]]["ok"] for r in ops] == [True, True, None if rank == 0 else True, True]
        assert ends[ops[2]["id"]].get("dropped") is (True if rank == 0 else None)
        assert ops[1]["batch"] == [["send", 1 - rank], ["recv", 1 - rank]]  # the batch's parts, each peer
    leftovers.check()


def _small_calls_noted_in_place():
    import torch
    import torch.distributed as dist

    from helpers import rundir, trace
    from helpers.trace import tracer

    rank = dist.get_rank()
    note = rundir.current_path(tracer.current.run_dir, rank)
    seen = []
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.ones(1))  # line: metric noted
        seen.append(rundir.CURRENT.unpack_from(note.read_bytes()))

    def unnoted(async_op: bool) -> None:  # each line's second and third calls are noted unless...
        for _ in range(3):
            dist.all_reduce(torch.ones(2 ** 17))  # 512 KiB: large (RUN_BYTES)
            work = dist.all_reduce(torch.ones(2), async_op=async_op)  # async: it returns before it is done
            if work is not None:
                work.wait()

    unnoted(async_op=True)
    other = threading.Thread(target=unnoted, args=(False,))
    other.start()  # another thread's calls (the main thread's are the doctor's)
    other.join()
    seen.append(rundir.CURRENT.unpack_from(note.read_bytes()))
    trace.flush()
    return seen, _records_on_file(rank)


def test_a_small_call_is_noted_in_place_by_the_first_call_like_it_and_cleared_on_return(tmp_path, leftovers):
    # what the doctor reads when a rank died with the call's record still queued (read_current)
    results = launch(_small_calls_noted_in_place, num_processes=2, timeout_s=60,
                     watchers=[doctor.Doctor(30, keep_dir=tmp_path)])
    for seen, records in results:
        first = next(r["id"] for r in records if r["ev"] == "op" and r["line"] == _line("metric noted"))
        assert seen[0] == (0, 0), seen  # the first call from a line is written before it runs instead
        assert seen[1:] == [(0, first)] * 3, (seen, first)  # noted, then its number cleared on return
    assert sorted(p.name for p in tmp_path.glob("current-*")) == ["current-0.bin", "current-1.bin"]
    leftovers.check()


def _killed_as_a_slow_call_returns():
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:  # rank 0's barrier is on file while it waits for this rank
        _wait_until(lambda: any(r["ev"] == "op" and r["op"] == "barrier" for r in _records_on_file(0)),
                    "rank 0's barrier on file while it waits")
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # at once: its barrier must not read as still running


def test_a_call_on_file_while_it_runs_has_its_end_written_as_it_returns(tmp_path, leftovers):
    with pytest.raises(RankExited):
        launch(_killed_as_a_slow_call_returns, num_processes=2, timeout_s=60,
               watchers=[doctor.Doctor(30, keep_dir=tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "trace-0.jsonl").read_text().splitlines()]
    barrier = next(r for r in records if r["ev"] == "op" and r["op"] == "barrier")
    assert any(r["ev"] == "end" and r["id"] == barrier["id"] and r["ok"] for r in records), records
    leftovers.check()


def _call_traced(tracer, name, plan, *args):
    """One call of a stand-in for op ``name``, through the tracer's wrapper, with ``tracer`` as the
    process's tracer (not installed: no helper thread, nothing patched)."""
    from helpers.trace import tracer as tracing

    installed, tracing.current = tracing.current, tracer
    try:
        return tracing._wrap(name, lambda *args, **kwargs: "ran", plan)(*args)
    finally:
        tracing.current = installed


def test_queued_records_are_written_in_order_without_a_helper_thread(tmp_path):
    import torch.distributed as dist

    from helpers.trace.tracer import QUEUE_MAX, Tracer, _Plan

    tracer = Tracer(tmp_path, 0)  # no helper thread, no process group
    plan = _Plan("barrier", dist.barrier)
    path = tmp_path / "trace-0.jsonl"
    on_file = []
    try:
        for number in range(QUEUE_MAX + 2):  # past QUEUE_MAX queued calls the caller writes them
            _call_traced(tracer, "barrier", plan)
            if number < 2:
                on_file.append(len(path.read_text().splitlines()))
        assert on_file == [2, 2]  # the first call from a line is on file at once, the next is queued
        assert len(path.read_text().splitlines()) > QUEUE_MAX
        tracer.flush()
        records = [json.loads(line) for line in path.read_text().splitlines()]
    finally:
        os.close(tracer.fd)
    # the first call: its start written before it ran, then its end; the others: one record each,
    # with their end, as they had returned when the queue was written
    assert [(r["ev"], r["id"], "te" in r) for r in records] == [("op", 1, False), ("end", 1, False)] + [
        ("op", i, True) for i in range(2, QUEUE_MAX + 3)]
    assert all(r["ok"] and r["te"] >= r["t"] for r in records[2:])
    assert records[0]["op"] == "barrier" and records[0]["seq"] is None  # no group: no number


def test_a_loop_written_in_one_batch_keeps_each_calls_shapes_and_mode(tmp_path):
    """The writer reuses an op's texts for the next call when it is the same call (a loop): calls
    that differ in their tensor or mode, queued together, each keep their own."""
    import torch
    import torch.distributed as dist

    from helpers.trace.tracer import Tracer, _Plan

    tracer = Tracer(tmp_path, 0)  # no helper thread: the queue is written when flushed
    plan = _Plan("all_reduce", dist.all_reduce)
    small, large = torch.ones(2), torch.ones(3, 4)
    calls = [(small, False), (small, False), (large, False), (large, True), (small, False)]
    try:
        for _ in range(3):
            for tensor, async_op in calls:
                _call_traced(tracer, "all_reduce", plan, tensor, None, None, async_op)
        tracer.flush()
        records = [json.loads(line) for line in (tmp_path / "trace-0.jsonl").read_text().splitlines()]
    finally:
        os.close(tracer.fd)
    ops = [(r["shapes"], r.get("async", False)) for r in records if r["ev"] == "op"]
    assert ops == [([list(tensor.shape)], async_op) for tensor, async_op in calls] * 3
    assert len({r["id"] for r in records if r["ev"] == "op"}) == 3 * len(calls)


def test_a_call_from_another_thread_names_its_thread_and_the_main_threads_calls_do_not(tmp_path):
    """The doctor tells two threads' calls on one group apart from the records alone (a rank that
    died leaves no Flight Recorder)."""
    import torch.distributed as dist

    from helpers.trace.tracer import Tracer, _Plan

    tracer = Tracer(tmp_path, 0)  # no helper thread: the queue is written when flushed
    plan = _Plan("barrier", dist.barrier)
    idents = []

    def metrics():
        idents.append(threading.get_ident())
        _call_traced(tracer, "barrier", plan)

    try:
        _call_traced(tracer, "barrier", plan)
        thread = threading.Thread(target=metrics)
        thread.start()
        thread.join()
        _call_traced(tracer, "barrier", plan)
        tracer.flush()
        records = [json.loads(line) for line in (tmp_path / "trace-0.jsonl").read_text().splitlines()]
    finally:
        os.close(tracer.fd)
    assert [r.get("thread") for r in records if r["ev"] == "op"] == [None, str(idents[0]), None]


def _exits_at_once():
    import torch.distributed as dist

    dist.barrier()  # queued, not yet written
    os._exit(0)


def test_os_exit_writes_the_queued_records_first(tmp_path, leftovers):
    with pytest.raises(RankExited):  # ended without a result: the doctor's rank-exited
        launch(_exits_at_once, num_processes=2, timeout_s=60, watchers=[doctor.Doctor(30, keep_dir=tmp_path)])
    for rank in (0, 1):
        records = [json.loads(line) for line in (tmp_path / f"trace-{rank}.jsonl").read_text().splitlines()]
        barrier = [r["id"] for r in records if r["ev"] == "op" and r["op"] == "barrier"]
        assert barrier and barrier[-1] in _ends(records), records
    leftovers.check()


def _exits_while_states_are_written(folder: str):
    path = Path(folder) / "state-0.json"  # as under torchrun with --keep: the folder is the user's
    big = {"stack": [], "padding": "x" * 5_000_000}

    def keep_writing():
        while True:
            trace.save_state(path, big)

    threading.Thread(target=keep_writing, daemon=True).start()
    _wait_until(path.exists, "the first state file")
    _wait_until(lambda: any(path.parent.glob(".*.tmp")), "the next write under way")
    os._exit(0)  # while the next write is under way, as a rank ends while its helper writes


def test_an_exit_during_a_state_write_leaves_no_temporary_file(tmp_path, leftovers):
    with pytest.raises(RankExited):
        launch(_exits_while_states_are_written, (str(tmp_path),), num_processes=1, timeout_s=60,
               init_group=False, watchers=[doctor.Doctor(30)])
    assert json.loads((tmp_path / "state-0.json").read_text())["padding"].startswith("x")
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    leftovers.check()


def test_what_a_record_cannot_describe_neither_breaks_the_call_nor_the_writer(tmp_path):
    import numpy as np
    import torch.distributed as dist

    from helpers.trace.tracer import Tracer, _Plan

    class ShapeOnly:  # has a shape, no dtype: its record cannot say what it is
        shape = (2,)
        nbytes = []  # and an unhashable size: no signature to remember

    tracer = Tracer(tmp_path, 0)
    try:
        assert _call_traced(tracer, "send", _Plan("send", dist.send), ShapeOnly(), np.int64(1)) == "ran"
        _call_traced(tracer, "send", _Plan("send", dist.send), None, np.int64(1))
        tracer.flush()
        records = [json.loads(line) for line in (tmp_path / "trace-0.jsonl").read_text().splitlines()]
        assert records[0]["op"] == "send" and "AttributeError" in records[0]["unrecorded"]
        assert records[2]["peer"] == 1  # numpy's integer as a rank
        assert [r["ev"] for r in records] == ["op", "end", "op", "end"]
        busy = threading.Thread(target=tracer.lock.acquire)  # another thread holds the lock for good
        busy.start()
        busy.join()
        tracer.queue.append({"ev": "x"})
        tracer.flush(wait=False)  # returns at once: the holder writes
        assert not tracer.write({"ev": "y"}, wait=False) and len(tracer.queue) == 1
    finally:
        tracer.lock = threading.RLock()
        tracer.close()
    tracer.queue.append({"ev": "late"})
    tracer.flush()  # after close: dropped, no error
    lines = (tmp_path / "trace-0.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[-1]) == {"ev": "x"}  # close wrote what was queued


def test_tracer_leaves_results_unchanged(leftovers):
    healthy = scenarios.get("healthy").load()
    traced = doctor.run_function(healthy.main, num_processes=2, stall_s=10).results
    plain = launch(healthy.main, num_processes=2, timeout_s=60)
    assert traced == plain
    assert traced[0]["losses"] == traced[1]["losses"] and len(traced[0]["losses"]) == 4
    leftovers.check()


def test_notebook_cells_are_named_like_ipython_does(leftovers):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("import time\nimport torch.distributed as dist\n\ndef cell_fn():\n"
                       "    if dist.get_rank() == 1:\n        time.sleep(60)\n    dist.barrier()\n",
                       store_history=True)
        number = shell.execution_count - 1
        with pytest.raises(doctor.HangDetected) as info:
            doctor.launch(shell.user_ns["cell_fn"], num_processes=2, timeout_s=30, stall_s=1.5)
    finally:
        InteractiveShell.clear_instance()
    found = info.value.diagnosis
    assert found.per_rank[0].location == f"Cell In[{number}], line 7", found.text()
    assert found.per_rank[1].location == f"Cell In[{number}], line 6", found.text()
    leftovers.check()


class _SignalAtOnce:
    """Sends the stack signal to every rank at the first tick: before any rank could register."""

    def __init__(self) -> None:
        self.sent = False

    def poll(self, run: Run) -> None:
        if not self.sent:
            for proc in run.processes.values():
                os.kill(proc.pid, signal.SIGUSR1)
            self.sent = True


@pytest.mark.parametrize("starter", [launch_command, doctor.launch_command], ids=["plain", "traced"])
def test_an_early_stack_request_cannot_kill_a_command_rank(starter, tmp_path, leftovers):
    # both kinds of command rank start with the stack signal blocked until faulthandler is set up
    script = tmp_path / "quick.py"
    script.write_text("import torch.distributed as dist\nprint('ran', flush=True)\n")
    watcher = _SignalAtOnce()
    codes = starter([str(script)], num_processes=2, timeout_s=120, watchers=[watcher])
    assert watcher.sent and codes == [0, 0]
    leftovers.check()


def test_user_code_is_told_apart_from_libraries():
    # with the module name (inside a rank): a package the user installed still counts as theirs
    assert is_user_code("/anywhere/site-packages/x.py", "__main__")
    assert is_user_code("/repo/helpers/scenarios/early_stop.py", "helpers.scenarios.early_stop")
    assert is_user_code("/home/me/train.py", "train")
    assert is_user_code("/venv/site-packages/mytrainer/loop.py", "mytrainer.loop")
    assert not is_user_code("/x/torch/nn/parallel/distributed.py", "torch.nn.parallel.distributed")
    assert not is_user_code("/x/accelerate/state.py", "accelerate.state")
    assert not is_user_code("/repo/helpers/launch/runner.py", "helpers.launch.runner")
    # the doctor's own entry point runs as __main__ below the script (python -m helpers.doctor)
    assert not is_user_code(sites.HELPERS_DIR + "doctor/__main__.py", "__main__")
    assert is_user_code(sites.SCENARIOS_DIR + "dead_rank.py", "__main__")
    assert not is_user_code(os.path.join(sites.STDLIB[0], "contextlib.py"), "contextlib")
    # torch 2.13's deprecation wrapper around all_gather_into_tensor, between the user's call and torch's
    assert not is_user_code("/venv/site-packages/typing_extensions.py", "typing_extensions")
    # from a path alone (stack text, tracebacks): site-packages is a library
    assert is_user_code("/home/me/train.py") and is_user_code("/repo/helpers/scenarios/healthy.py")
    assert not is_user_code("/venv/site-packages/mytrainer/loop.py")
    assert not is_user_code("/repo/helpers/doctor/watcher.py")
    assert not is_user_code(os.path.join(sites.STDLIB[0], "contextlib.py"))
    assert not is_user_code("<frozen runpy>")
    assert is_user_code("/home/me/accelerate/examples/nlp_example.py")  # a clone is the user's code
    assert trace.label("/a/b/train.py", 57) == "train.py:57"


def test_run_script_runs_the_script_as_main(tmp_path, leftovers):
    script = tmp_path / "as_main.py"
    script.write_text("import sys\nassert __name__ == '__main__'\n"
                      "sys.exit(3 if sys.argv[1:] == ['x'] else 0)\n")
    with pytest.raises(RankExited) as info:
        doctor.launch_command([str(script), "x"], num_processes=1, timeout_s=120)
    assert info.value.exit_code == 3
    assert sys.executable
    leftovers.check()


def test_init_process_group_is_recorded_as_the_call_before_the_first_collective(tmp_path, leftovers):
    # what torchrun runs in each rank (-m helpers.trace), as one rank: the folder is made if missing
    import subprocess

    script = tmp_path / "one_rank.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "dist.all_reduce(torch.ones(2))\n"
                      "dist.destroy_process_group()\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(procs.free_port()), "HELPERS_TRACE_DIR": str(tmp_path / "not" / "yet")}
    done = subprocess.run([sys.executable, "-m", "helpers.trace", str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "not" / "yet" / "trace-0.jsonl").read_text().splitlines()
    ops = [json.loads(line) for line in lines if '"ev":"op"' in line]
    assert [(op["op"], op["seq"], op["where"]) for op in ops] == [
        ("init_process_group", 0, "one_rank.py:2"), ("all_reduce", 1, "one_rank.py:3")]
    assert json.loads(lines[2]) == {"ev": "end", "id": 1, "t": json.loads(lines[2])["t"], "ok": True}
    del env["HELPERS_TRACE_DIR"]
    done = subprocess.run([sys.executable, "-m", "helpers.trace", str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "set HELPERS_TRACE_DIR to the folder" in done.stderr, done.stderr
    leftovers.check()


def test_a_call_site_is_named_by_its_line_from_the_instruction_offset():
    import sys

    from helpers.trace.callsites import line_at, site_json

    def called():  # as the tracer's wrapper sees its caller: stopped at the call
        caller = sys._getframe(1)
        return caller.f_code, caller.f_lasti, caller.f_lineno

    code, offset, line = called()
    assert line_at(code, offset) == line
    code, offset, line = (
        called())  # a call on another line than its statement's first
    assert line_at(code, offset) == line
    site = json.loads("{" + site_json(code, offset)[1:] + "}")
    assert site["line"] == line and site["func"] == code.co_name
    assert line_at(code, 1 << 30) == 0  # past the code: no line


def test_a_call_with_no_python_frame_above_it_is_recorded_without_a_site(tmp_path):
    import _thread

    import torch.distributed as dist

    from helpers.trace import tracer as tracing

    tracer = tracing.Tracer(tmp_path, 0)
    ran = threading.Lock()
    ran.acquire()
    plan = tracing._Plan("barrier", dist.barrier)
    traced = tracing._wrap("barrier", lambda *args, **kwargs: ran.release(), plan)
    installed, tracing.current = tracing.current, tracer
    try:
        _thread.start_new_thread(traced, ())  # the wrapper is the thread's first Python frame
        assert ran.acquire(timeout=30)
        tracer.flush()
    finally:
        tracing.current = installed
        os.close(tracer.fd)
    op = json.loads((tmp_path / "trace-0.jsonl").read_text().splitlines()[0])
    assert op["op"] == "barrier" and "where" not in op


def test_the_traced_function_takes_the_ops_own_parameters_or_reads_args_and_kwargs_alike(tmp_path):
    """Where an op's signature can be copied, the traced function takes its parameters (and
    defaults) and passes them on; where it cannot (a keyword-only parameter, a wrapper in front of
    the op that takes other parameters), it takes ``*args, **kwargs``. All record the same call
    alike, given by position or by keyword."""
    import torch

    from helpers.trace import tracer as tracing

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):  # torch's order
        return (tensor, dst, group, tag, group_dst)

    def send_keyword_only(tensor, dst=None, group=None, tag=0, *, group_dst=None):
        return (tensor, dst, group, tag, group_dst)

    @functools.wraps(send)  # another tool's wrapper, installed before the tracer: other parameters
    def rewrapped(tensor, dst=None, **options):
        return send(tensor, dst, **options)

    functions = {"copied": send, "fallback": send_keyword_only, "rewrapped": rewrapped}
    plans = {form: tracing._Plan("send", function) for form, function in functions.items()}
    assert plans["copied"].params == ["tensor", "dst", "group", "tag", "group_dst"]
    assert plans["fallback"].params is None and plans["rewrapped"].params is None  # the latter reads as send
    traced = {form: tracing._wrap("send", function, plans[form]) for form, function in functions.items()}
    assert traced["copied"].__wrapped__ is send and traced["copied"].__name__ == "send"
    tensor = torch.ones(3)
    records: dict[str, list] = {}
    installed = tracing.current
    for form, function in traced.items():
        (tmp_path / form).mkdir()
        tracer = tracing.current = tracing.Tracer(tmp_path / form, 0)
        try:
            assert function(tensor, 1) == (tensor, 1, None, 0, None)  # defaults passed on
            assert function(tensor, dst=2, tag=5) == (tensor, 2, None, 5, None)
            assert function(tensor=tensor, dst=3) == (tensor, 3, None, 0, None)
            tracer.flush()
        finally:
            tracing.current = installed
            tracer.close()
        lines = (tmp_path / form / "trace-0.jsonl").read_text().splitlines()
        ops = [record for record in map(json.loads, lines) if record["ev"] == "op"]
        records[form] = [{key: op[key] for key in ("op", "peer", "shapes")} for op in ops]
    assert records["copied"] == records["fallback"] == records["rewrapped"] == [
        {"op": "send", "peer": peer, "shapes": [[3]]} for peer in (1, 2, 3)]


def test_only_a_calls_first_size_from_its_line_is_written_before_it_runs(tmp_path):
    """The first call from a line with a tensor of a new size is on file before it runs (gloo
    aborts on a size mismatch); a loop's next call, and a size the line has used before, are not."""
    import torch
    import torch.distributed as dist

    from helpers.trace.tracer import Tracer, _Plan

    tracer = Tracer(tmp_path, 0)  # no helper thread: only a first call is written at once
    firsts: list[dict] = []
    tracer.on_first = lambda text: firsts.append(json.loads(text))
    plan = _Plan("all_reduce", dist.all_reduce)
    sizes = [2, 2, 3, 3, 2, 3, 4]
    try:
        for size in sizes:
            _call_traced(tracer, "all_reduce", plan, torch.ones(size))
    finally:
        tracer.close()
    assert [first["shapes"] for first in firsts] == [[[2]], [[3]], [[4]]]
    assert [first["id"] for first in firsts] == [1, 3, 7]


def _runs_of_one_line() -> list[int]:
    import json

    import torch
    import torch.distributed as dist

    from helpers.trace import tracer as tracing
    from helpers.trace.tracer import RUN_BYTES

    posted: list[int] = []
    tracing.current.on_first = lambda text: posted.append(json.loads(text)["seq"])
    for count in (2, 3, 2, 70):  # a dict reduced one tensor at a time, one key more in the second
        dist.barrier()  # another collective between the runs: the next run starts anew
        for _ in range(count):
            dist.all_reduce(torch.ones(1))
    large = torch.ones(RUN_BYTES // 4 + 1)  # a large tensor's runs are not followed (their cost)
    for count in (1, 3):
        dist.barrier()
        for _ in range(count):
            dist.all_reduce(large)
    return posted


def test_a_call_that_makes_its_lines_run_longer_than_ever_is_written_before_it_runs(leftovers):
    """A line's call one more time in a row than it ever ran (a dict reduced with an extra key) is on
    file and posted before it runs: gloo aborts the rank when it meets the others' next collective.
    A loop of the same call at each next number: only its first RUNS_KEPT calls; a large tensor's
    runs are not followed."""
    from helpers.trace.tracer import RUNS_KEPT

    [posted] = launch(_runs_of_one_line, num_processes=1, timeout_s=60, watchers=[doctor.Doctor(30)])
    # barrier #1 and all_reduce #2 (first from their lines), #3 (a run of 2), #7 (3), then the long
    # run's 4th to its RUNS_KEPT-th call (#15 on); the second barrier line's first (#82) and the
    # large tensor's first call (#83) alone
    assert posted == [1, 2, 3, 7, *range(15, 12 + RUNS_KEPT), 82, 83], posted
    leftovers.check()


def _recurse(depth: int) -> None:
    if depth == 0:
        raise ValueError("bottom")  # line: recursion bottom
    _recurse(depth - 1)


def test_an_errors_callers_keep_the_outermost_and_innermost_frames_of_a_deep_recursion():
    from helpers.trace.callsites import CALLERS_KEPT, traceback_callers

    with pytest.raises(ValueError) as info:
        _recurse(200)  # line: recursion top
    callers = traceback_callers(info.value.__traceback__)
    assert len(callers) == CALLERS_KEPT
    assert (callers[0][1], callers[-1][1]) == (_line("recursion top"), _line("recursion bottom"))


def test_the_error_that_ends_a_thread_is_kept_once_however_often_the_hook_is_installed(monkeypatch):
    # a kernel that installs the tracer for each launch must not chain the hook into itself
    from helpers.trace import helper

    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(helper, "_thread_errors", [])
    helper.note_thread_errors()
    first = threading.excepthook
    helper.note_thread_errors()
    assert threading.excepthook is first
    thread = threading.Thread(target=lambda: {}["missing"], name="prefetch")
    thread.start()
    thread.join()
    [error] = helper._thread_errors
    assert (error["thread"], error["error"]) == ("prefetch", "KeyError: 'missing'"), error
    assert helper.rank_state(0, "test")["thread_errors"] == [error]
