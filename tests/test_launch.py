"""helpers.launch: results by rank, named failures, deadlines with stacks, nothing left behind.

Ranks are real forked processes with a real gloo group. Each outcome is followed by a psutil check
that no child process, listening port or temp folder remains.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import marker_line

from helpers import cuda_watch, doctor, procs
from helpers import launch as launch_module
from helpers.launch import (
    CudaInitializedError,
    LaunchTimeout,
    RankError,
    RankExited,
    launch,
)


def _rank_and_world(offset):
    import torch
    import torch.distributed as dist

    value = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": value.item(),
            "pid": os.getpid(), "env_rank": int(os.environ["RANK"])}


def test_results_come_back_ordered_by_rank(leftovers):
    results = launch(_rank_and_world, (10,), num_processes=3, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["env_rank"] for r in results] == [0, 1, 2]
    assert {r["world"] for r in results} == {3}
    assert {r["sum"] for r in results} == {0 + 1 + 2 + 30}
    assert len({r["pid"] for r in results}) == 3
    leftovers.check()


def test_one_rank_is_forked_too(leftovers):
    [result] = launch(_rank_and_world, (0,), num_processes=1, timeout_s=60)
    assert result["world"] == 1 and result["pid"] != os.getpid()
    leftovers.check()


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad batch on purpose")
    dist.barrier()  # rank 0 would wait forever for rank 1


def test_raising_rank_is_named_with_type_and_traceback(leftovers):
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank_one, num_processes=2, timeout_s=60)
    error = info.value
    assert (error.rank, error.exc_type) == (1, "ValueError")
    assert "rank 1 raised ValueError: bad batch on purpose" in str(error)
    assert "_raise_on_rank_one" in error.traceback
    assert time.monotonic() - started < 20, "the failure must end the run, not the deadline"
    leftovers.check()


def _hang_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)  # the user's compute loop that never ends
    dist.barrier()


def test_deadline_stops_a_hang_with_every_rank_stack(leftovers):
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_rank_one, num_processes=2, timeout_s=3)
    elapsed = time.monotonic() - started
    stacks = info.value.stacks
    assert set(stacks) == {0, 1}
    assert "in barrier" in stacks[0] and "_hang_on_rank_one" in stacks[0]
    assert "_hang_on_rank_one" in stacks[1] and "barrier" not in stacks[1]
    assert "timeout_s=3" in str(info.value)
    assert elapsed < 3 + 2 + 2 + 5, f"stopping took {elapsed:.1f} s"
    leftovers.check()


def _kill_myself_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_killed_rank_is_named_with_its_signal(leftovers):
    with pytest.raises(RankExited) as info:
        launch(_kill_myself_on_rank_zero, num_processes=2, timeout_s=60)
    assert info.value.rank == 0 and info.value.exit_code == -signal.SIGKILL
    assert "rank 0 ended without a result: killed by SIGKILL" in str(info.value)
    leftovers.check()


def test_unpicklable_result_is_an_error_not_a_hang(leftovers):
    with pytest.raises(RankError, match="cannot be sent back"):
        launch(lambda: (lambda: None), num_processes=1, init_group=False, timeout_s=30)
    leftovers.check()


def test_bad_parameters_fail_before_any_process_starts(leftovers):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="num_processes must be an integer in 1..64; got 0"):
        launch(_rank_and_world, (0,), num_processes=0)
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        launch(_rank_and_world, (0,), timeout_s=-1)
    assert psutil.Process().children(recursive=True) == before


def test_refuses_to_fork_when_cuda_is_initialised(monkeypatch, leftovers):
    # This machine has no GPU: is_initialized is the one thing faked, to reach the refusal.
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_watch, "_init_site", "notebook.py:12 (model.cuda())")
    with pytest.raises(CudaInitializedError, match=r"initialised in this process by notebook.py:12"):
        launch(_rank_and_world, (0,), num_processes=2)
    leftovers.check()


def test_cuda_init_site_names_the_users_line(monkeypatch):
    import torch

    cuda_watch.install_cuda_watch()
    monkeypatch.setattr(cuda_watch, "_init_site", None)
    with pytest.raises((AssertionError, RuntimeError)):  # no CUDA here: the real init fails
        torch.cuda._lazy_init()
    site = cuda_watch.cuda_init_site()
    assert site is not None and site.startswith(f"{__file__}:")
    assert "torch.cuda._lazy_init()" in site


def test_busy_default_port_does_not_collide(leftovers):
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            blocker.bind(("127.0.0.1", 29500))
        except OSError:
            pass  # already taken by someone else: even better
        else:
            blocker.listen()
        results = launch(_rank_and_world, (0,), num_processes=2, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    leftovers.check()


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_can_be_bound():
    # outgoing connections take ports of that range: one took a job's port between check and bind
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [procs.free_port() for _ in range(50)]
    assert all(procs.PORT_FLOOR <= port < low for port in ports), ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def _flag_handler_and_dump():
    os.kill(os.getpid(), launch_module.STACK_SIGNAL)  # must neither kill us nor lose the handler
    return Path(os.environ["FLAG_FILE"]).read_text()


def test_stack_signal_chains_to_a_handler_already_installed(tmp_path, leftovers):
    flag = tmp_path / "flag"
    flag.write_text("not called")
    previous = signal.signal(launch_module.STACK_SIGNAL, lambda *_: flag.write_text("called"))
    try:
        [seen] = launch(_flag_handler_and_dump, num_processes=1, init_group=False, timeout_s=30,
                        env={"FLAG_FILE": str(flag)})
    finally:
        signal.signal(launch_module.STACK_SIGNAL, previous)
    assert seen == "called"
    leftovers.check()


def test_stack_signal_without_previous_handler_does_not_kill(leftovers):
    assert launch(lambda: (os.kill(os.getpid(), launch_module.STACK_SIGNAL), "alive")[1],
                  num_processes=2, init_group=False, timeout_s=30) == ["alive", "alive"]
    leftovers.check()


def _signal_after_faulthandler_let_go() -> str:
    import faulthandler

    faulthandler.unregister(launch_module.STACK_SIGNAL)  # as at interpreter shutdown
    os.kill(os.getpid(), launch_module.STACK_SIGNAL)  # a stack request arriving then
    return "alive"


def test_a_stack_request_as_a_rank_shuts_down_does_not_kill_it(leftovers):
    # faulthandler puts back the signal's earlier disposition as the interpreter shuts down: a rank
    # that had raised and written its exit record was killed by a late request (exit -10, not 1)
    assert launch(_signal_after_faulthandler_let_go, num_processes=1, init_group=False,
                  timeout_s=30) == ["alive"]
    leftovers.check()


def _churn_until(flag: str) -> str:
    """A side thread runs Python nonstop (frames pushed and popped) while the main one polls."""
    import json
    import threading

    def one(value: int) -> int:
        return value + 1

    def churn() -> None:
        while True:
            total = 0
            for _ in range(100):
                total = one(total)
            json.loads('{"a": [1, 2, 3], "b": {"c": "d"}}')

    threading.Thread(target=churn, name="churn", daemon=True).start()
    Path(f"{flag}.ready-{os.environ['RANK']}").touch()
    while not os.path.exists(flag):  # the launcher's prober creates it when done
        time.sleep(0.05)
    return "alive"


class _StackProber:
    """Once every rank churns, asks for their stacks ``rounds`` times, then lets them finish."""

    wants_trace = True  # the ranks get the hang doctor's helper thread

    def __init__(self, flag: Path, rounds: int):
        self.flag, self.rounds, self.dumps = flag, rounds, []

    def poll(self, run) -> None:
        ready = all(Path(f"{self.flag}.ready-{rank}").exists() for rank in range(run.num_processes))
        if not ready or self.flag.exists():
            return
        for _ in range(self.rounds):
            self.dumps.append(run.request_stacks())
        self.flag.touch()


def test_traced_ranks_dump_their_stacks_without_a_signal(tmp_path, leftovers):
    # faulthandler dumping from a signal handler while another thread runs Python can kill the
    # rank with SIGSEGV (cpython#116008); a traced rank's helper thread dumps under the GIL instead
    signalled = tmp_path / "signalled"
    prober = _StackProber(tmp_path / "stop", rounds=10)
    previous = signal.signal(launch_module.STACK_SIGNAL, lambda *_: signalled.touch())
    try:  # the ranks inherit this handler; faulthandler chains to it when a signal comes
        results = launch(_churn_until, (str(prober.flag),), num_processes=2, init_group=False,
                         timeout_s=60, watchers=[prober])
    finally:
        signal.signal(launch_module.STACK_SIGNAL, previous)
    assert results == ["alive", "alive"]
    assert not signalled.exists()
    assert len(prober.dumps) == 10
    for dump in prober.dumps:
        assert set(dump) == {0, 1}
        assert all("in churn" in text and "in _churn_until" in text for text in dump.values())
    leftovers.check()


def _stuck_in_c_holding_the_gil():
    import re

    # exponential backtracking, and re keeps the GIL all along
    re.match(r"(a*)*b", "a" * 40)  # line: regex


def test_a_traced_rank_stuck_in_c_holding_the_gil_still_shows_its_stack(leftovers):
    # its helper thread cannot run: the doctor reads it with py-spy (else the launcher signals it)
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        doctor.launch(_stuck_in_c_holding_the_gil, num_processes=1, timeout_s=2)
    assert "in _stuck_in_c_holding_the_gil" in info.value.stacks[0]
    regex = f"{Path(__file__).name}:{marker_line(__file__, 'regex')}"
    found = info.value.diagnosis
    assert found.per_rank[0].location == regex
    # read with py-spy, which root may always use; elsewhere the signal's stack says where it is
    stuck = (f"in native code holding the GIL at {regex}" if any("py-spy" in note for note in found.notes)
             else f"at {regex}")
    assert found.summary == ("No rank was waiting in a collective: all were computing, or stuck "
                             f"outside torch.distributed (their stacks say where). rank 0: "
                             f"outside-collective {stuck}.")
    assert time.monotonic() - started < 20
    leftovers.check()


# ---------------------------------------------------------------------------------------------
# the launching process interrupted or killed: run launch in a separate Python


_HANGING_LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from helpers.launch import launch

    def hang(pid_dir):
        Path(pid_dir, str(os.getpid())).touch()
        while True:
            time.sleep(0.05)

    try:
        launch(hang, (sys.argv[1],), num_processes=2, timeout_s=120, init_group=False)
    except KeyboardInterrupt:
        print("KeyboardInterrupt re-raised", flush=True)
        raise
""")


def _start_hanging_launcher(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # SIGINT at its default, as in a terminal: a command started in the background (`make test &`)
    # inherits it ignored, and Python then installs no KeyboardInterrupt handler at all
    proc = subprocess.Popen([sys.executable, "-c", _HANGING_LAUNCHER, str(pid_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while len(list(pid_dir.iterdir())) < 2:  # wait for a condition, with a deadline
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    return proc, [int(p.name) for p in pid_dir.iterdir()]


def _stacks_and_signals(pid: int) -> str:
    """py-spy's dump and the signal masks of ``pid`` and its descendants (for a failure message)."""
    from helpers.doctor.pyspy import py_spy

    text = []
    for member in procs.tree_of([pid]):
        dump = subprocess.run([py_spy(), "dump", "--pid", str(member.pid)], capture_output=True,
                              text=True, timeout=30)
        status = Path(f"/proc/{member.pid}/status").read_text().splitlines()
        text += [f"--- {member.pid} {member.cmdline()[:3]}", dump.stdout + dump.stderr,
                 *[line for line in status if line.startswith(("State", "Sig"))]]
    return "\n".join(text)


def _run_dirs() -> set[str]:
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "helpers-run-*")))


def _assert_gone(pids: list[int]) -> None:
    procs = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"ranks left running: {alive}"


def test_keyboard_interrupt_stops_ranks_and_is_re_raised(tmp_path, leftovers):
    proc, pids = _start_hanging_launcher(tmp_path)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # say where the launcher is stuck, then leave nothing behind
        where = _stacks_and_signals(proc.pid)
        procs.stop_processes(procs.tree_of([proc.pid]))
        proc.communicate()
        raise AssertionError(f"the launcher did not end within 30 s of SIGINT:\n{where}") from None
    assert "KeyboardInterrupt re-raised" in out
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    _assert_gone(pids)
    leftovers.check()


def test_launcher_killed_with_sigkill_leaves_nothing(tmp_path, leftovers):
    dirs_before = _run_dirs()
    proc, pids = _start_hanging_launcher(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    _assert_gone(pids)  # PR_SET_PDEATHSIG
    deadline = time.monotonic() + 10
    while _run_dirs() - dirs_before and time.monotonic() < deadline:  # the janitor's cleanup
        time.sleep(0.05)
    assert not _run_dirs() - dirs_before
    leftovers.check()


_FORWARDING_PARENT = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)

def forward(signum, frame):  # as torchrun's agent does: stop the workers, wait for them, leave
    child.send_signal(signal.SIGTERM)
    child.wait(30)
    os._exit(0)

signal.signal(signal.SIGTERM, forward)
child.wait()
"""

_COUNTING_CHILD = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("ready", flush=True)
info = signal.sigtimedwait({signal.SIGTERM}, 60)
with open(sys.argv[1], "w") as handle:
    handle.write(str(info.si_pid if info else None))
"""


def test_a_tree_whose_root_forwards_sigterm_gets_it_from_the_root_alone(tmp_path, leftovers):
    # a worker signalled by the stop and by torchrun a few ms apart dies as faulthandler writes its
    # stack on the first, the dump cut short: the root is stopped first, the rest after its grace
    sender = tmp_path / "sender"
    proc = subprocess.Popen([sys.executable, "-c", _FORWARDING_PARENT, _COUNTING_CHILD, str(sender)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        procs.stop_tree(proc, forwards=True)
    finally:
        procs.stop_processes(procs.tree_of([proc.pid]))
        proc.stdout.close()
    assert sender.read_text() == str(proc.pid), "the child's first SIGTERM came from the stop, not its parent"
    leftovers.check()
