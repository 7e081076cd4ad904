"""Attach to a job the doctor did not start: find its ranks, dump their stacks with py-spy, diagnose.

``attach(target)`` takes a torchrun or ``accelerate launch`` agent's PID, any one rank's PID, or
``"auto"`` (every torch.distributed job on this machine). A rank is a process whose environment
(``/proc/PID/environ``) holds RANK and WORLD_SIZE; the ranks of one job share TORCHELASTIC_RUN_ID,
MASTER_ADDR and MASTER_PORT. Each rank's stacks come from ``py-spy dump`` (in parallel, a dump only:
no signal, the process is paused for the few milliseconds of the read and goes on). The main
thread's stack says where each rank is: the torch.distributed call it waits in and the user's line;
with ``native`` the C++ frames too, which show a wait that Python does not (DDP's collectives in
``forward()`` and ``backward()``). The records become the doctor's evidence and the doctor's
reasoning names the culprit (``helpers.doctor.diagnosis``).

What stacks cannot tell, the diagnosis says: torch's sequence numbers (two ranks in the same op may
be at different iterations), shapes and dtypes, and how long the ranks have waited.

On a cluster, attach on every node (``srun --overlap ... --attach auto --json node-N.json``) and
``merge`` the nodes' files into one diagnosis of the whole world.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import redact, report
from helpers.collectives import INIT_OP, OPS
from helpers.doctor.diagnosis import Diagnosis, diagnose
from helpers.doctor.records import Op, RankView
from helpers.doctor.wording import (
    CHILD_FILE,
    DATALOADER_FILE,
    MULTIPROCESSING_FILES,
    POOL_FILES,
    issued_by,
    reads_a_pipe,
    runs_in,
)
from helpers.sites import is_user_code

PY_SPY_TIMEOUT_S = 20.0
WORKERS_S = 1.0  # reading the DataLoader workers of a rank that waits for them
JOB_KEYS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
RANK_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", *JOB_KEYS)
C10D_FILE = "torch/distributed/distributed_c10d.py"
NATIVE_WAIT = ("c10d::", "gloo::", "nccl", "ProcessGroup")
STACKS_ONLY = ("Read from stacks alone (py-spy): torch's sequence numbers, the tensors' shapes and "
               "dtypes, and how long the ranks have waited are not known; two ranks in the same "
               "collective may be at different iterations.")
PTRACE_HELP = (
    "py-spy needs ptrace rights on the ranks: run as the user who owns the job (with "
    "kernel.yama.ptrace_scope = 0: `sysctl kernel.yama.ptrace_scope`) or as root; in Docker start "
    "the container with --cap-add SYS_PTRACE; in Kubernetes add the SYS_PTRACE capability to the "
    "pod's securityContext.")


class AttachError(ValueError):
    """The target cannot be attached to; the message says why and what to do (CLI exit 2)."""


@dataclass
class RankProcess:
    """One rank of a job found on this machine."""

    pid: int
    rank: int
    world_size: int
    local_rank: int | None
    group_rank: int | None
    job: str  # run id @ master address:port
    cmdline: str


@dataclass
class Attached(report.ResultMixin):
    """What attaching found on this machine: the diagnosis, and the stacks it came from."""

    diagnosis: Diagnosis
    host: str
    world_size: int
    job: str
    ranks: list[RankProcess]
    stacks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    seconds: float = 0.0
    native: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The doctor's JSON (``verdict``, ``kind``, ``ranks``, ``per_rank``...), plus this node's
        part: host, world size, job, the ranks found and their stacks (what ``merge`` reads)."""
        data = self.diagnosis.to_dict()
        data.update(source="py-spy", host=self.host, world_size=self.world_size, job=self.job,
                    pids={str(p.rank): p.pid for p in self.ranks},
                    stacks={str(rank): frames for rank, frames in self.stacks.items()},
                    native=self.native, attach_seconds=self.seconds)
        return data

    def text(self) -> str:
        """The diagnosis as text, with the ranks found."""
        found = ", ".join(f"rank {p.rank} (pid {p.pid})" for p in self.ranks)
        return f"attached to {self.job} on {self.host}: {found}\n{self.diagnosis.text()}"

    def _repr_html_(self) -> str:
        return self.diagnosis._repr_html_()


# ---------------------------------------------------------------------------------------------
# finding the ranks


def find_ranks(target: str) -> list[RankProcess]:
    """The ranks of the job ``target`` names (an agent's or a rank's PID), or of every job ("auto").

    Raises AttachError for a PID that does not exist, or a process that is no rank or agent.
    """
    import psutil

    if target == "auto":
        ranks = _all_ranks()
        if not ranks:
            raise AttachError("attach: no torch.distributed rank runs on this machine (no process "
                              "with RANK and WORLD_SIZE in its environment that this user can read)")
        return ranks
    try:
        process = psutil.Process(int(target))
    except ValueError:
        raise AttachError(f"attach: give a process id or 'auto'; got {target!r}") from None
    except psutil.NoSuchProcess:
        raise AttachError(f"attach: no process with pid {target} on this machine") from None
    try:
        process.environ()
    except psutil.AccessDenied:
        raise AttachError(f"attach: no permission to read pid {target} ({_describe(process)}): this "
                          f"user may not read its environment. {PTRACE_HELP}") from None
    own = _as_rank(process)
    if own is not None:
        return [rank for rank in _all_ranks() if rank.job == own.job]
    descendants = _descendants(process)
    below = [rank for rank in _all_ranks() if rank.pid in descendants]
    if below:
        jobs = {rank.job for rank in below}
        return [rank for rank in below if rank.job == sorted(jobs)[0]]
    raise AttachError(f"attach: pid {target} ({_describe(process)}) is not a torch.distributed rank "
                      "(no RANK and WORLD_SIZE in its environment) nor a launcher with ranks below "
                      "it; give the PID of torchrun, accelerate launch or one rank, or 'auto'")


def _all_ranks() -> list[RankProcess]:
    """Every rank on this machine: the top process of each (rank, job): not its DataLoader workers."""
    import psutil

    found: dict[tuple[str, int], RankProcess] = {}
    for process in psutil.process_iter():
        rank = _as_rank(process)
        if rank is None:
            continue
        key = (rank.job, rank.rank)
        if key not in found or _is_ancestor(rank.pid, found[key].pid):
            found[key] = rank
    return sorted(found.values(), key=lambda r: (r.job, r.rank))


def _as_rank(process: Any) -> RankProcess | None:
    import psutil

    try:
        env = process.environ()
        cmdline = " ".join(process.cmdline())
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return None
    if "RANK" not in env or "WORLD_SIZE" not in env or process.pid == os.getpid():
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        return None
    run_id, addr, port = (env.get(key, "?") for key in JOB_KEYS)
    job = f"{run_id}@{addr}:{port}"
    return RankProcess(process.pid, rank, world, _int(env.get("LOCAL_RANK")), _int(env.get("GROUP_RANK")),
                       job, cmdline)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _descendants(process: Any) -> set[int]:
    import psutil

    try:
        return {child.pid for child in process.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _is_ancestor(pid: int, of_pid: int) -> bool:
    import psutil

    try:
        return any(parent.pid == pid for parent in psutil.Process(of_pid).parents())
    except psutil.NoSuchProcess:
        return False


def _describe(process: Any) -> str:
    import psutil

    try:
        return " ".join(process.cmdline())[:120] or process.name()
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return "a process this user cannot read"


# ---------------------------------------------------------------------------------------------
# stacks


def py_spy() -> str:
    """The py-spy program: next to this Python (installed with helpers), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.is_file():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise AttachError("attach: py-spy is not installed; `pip install py-spy` (helpers depends on it)")
    return found


def dump_stack(pid: int, native: bool = False, timeout_s: float = PY_SPY_TIMEOUT_S) -> list[dict[str, Any]]:
    """The main thread's frames of process ``pid`` (outermost first), read by ``py-spy dump``."""
    argv = [py_spy(), "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AttachError(f"attach: py-spy did not read pid {pid} within {timeout_s:g} s") from None
    if done.returncode != 0:
        raise AttachError(_py_spy_problem(pid, done.stderr + done.stdout))
    threads = json.loads(done.stdout)
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), threads[0] if threads else None)
    raw = list(reversed((main or {}).get("frames") or []))
    script = next((f.get("filename") for f in raw if f.get("name") == "<module>"), None)
    return [_frame(f, script) for f in raw]


def read_stacks(pids: dict[int, int], timeout_s: float = PY_SPY_TIMEOUT_S) -> dict[int, list[dict[str, Any]]]:
    """The Python frames of several processes' main threads (``{key: pid}``, outermost first), read
    by py-spy in parallel; a process it could not read (no ptrace rights, ended, no py-spy) is left
    out. Nothing is sent to the processes: each is paused for the milliseconds of its read."""
    def read(pid: int) -> list[dict[str, Any]] | None:
        try:
            return [frame for frame in dump_stack(pid, timeout_s=timeout_s) if not frame["native"]]
        except (ValueError, OSError):  # AttachError (no ptrace rights, no py-spy) included
            return None

    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(pids))) as pool:
        found = dict(zip(pids, pool.map(read, pids.values()), strict=True))
    return {key: frames for key, frames in found.items() if frames is not None}


def children_waited_for(ranks: dict[Any, tuple[int, list[dict[str, Any]]]],
                        timeout_s: float = WORKERS_S) -> dict[Any, list[dict[str, Any]]]:
    """What each waiting rank (``{rank: (pid, main-thread stack)}``) waits for in its child
    processes: for a rank that waits for a batch from a DataLoader (or for a multiprocessing Pool, a
    ProcessPoolExecutor's future), its workers' stacks, read with
    py-spy in parallel (``{"pid": ..., "frames": [...]}``, for ``wording.activity`` to say where a
    worker is stuck; py-spy needs ptrace rights, and a parent may read its own children); for a rank
    in ``subprocess`` or reading a child's pipe on its own line, its children's commands
    (``{"pid": ..., "cmd": ...}``, secrets redacted, cut at ``COMMAND_CHARS``); for a rank in
    multiprocessing otherwise (a Queue's get, a Process's join), how many of its children are alive
    (``[{"alive": n}]``). Ranks that wait for none of these are left out, and so is what cannot be
    read."""
    import psutil

    children: dict[int, Any] = {}  # a DataLoader worker's pid -> its rank
    found: dict[Any, list[dict[str, Any]]] = {}
    for rank, (pid, stack) in ranks.items():
        loader = any(runs_in(frame, file) for frame in stack for file in (DATALOADER_FILE, *POOL_FILES))
        command = any(runs_in(frame, CHILD_FILE) for frame in stack) or reads_a_pipe(stack)
        # a Queue's get, a join: multiprocessing's code innermost (a forked rank's own start is outermost)
        other = bool(stack) and runs_in(stack[-1], MULTIPROCESSING_FILES)
        if not (loader or command or other):
            continue
        try:
            parent = psutil.Process(pid)
            kids = parent.children()
        except psutil.Error:
            continue
        if loader:
            children.update({child.pid: rank for child in kids})
        elif command:
            found[rank] = _commands_of(kids, parent)
        else:
            found[rank] = [{"alive": _alive(kids)}]
    for child, frames in sorted(read_stacks({pid: pid for pid in children}, timeout_s).items()):
        found.setdefault(children[child], []).append({"pid": child, "frames": frames})
    return found


COMMAND_CHARS = 80  # a child's command as the diagnosis says it
COMMANDS_SAID = 2  # the newest children a rank waits for, named
# Python's own helper processes among a rank's children (the resource tracker, a forkserver): none
# could answer a rank; with multiprocessing's spawned workers, none is a command the script ran
_PYTHON_HELPER = re.compile(r"multiprocessing\.(resource_tracker|forkserver)")
_HELPER_PROCESS = re.compile(r"from multiprocessing\.|--multiprocessing-fork|" + _PYTHON_HELPER.pattern)


def _commands_of(kids: list[Any], parent: Any) -> list[dict[str, Any]]:
    """The commands of a rank's children (``_command_of``), the newest first, ``COMMANDS_SAID`` at most."""
    import psutil

    def started(child: Any) -> tuple[float, int]:  # its start (10 ms steps), then its pid, later is newer
        try:
            return child.create_time(), child.pid
        except psutil.Error:
            return 0.0, child.pid

    found = [entry for child in sorted(kids, key=started, reverse=True)
             if (entry := _command_of(child, parent)) is not None]
    return found[:COMMANDS_SAID]


def _alive(kids: list[Any]) -> int:
    """How many of a rank's child processes could still answer it: neither ended (a zombie: dead, not
    yet reaped by its parent's join) nor one of Python's own helpers (the resource tracker, a
    forkserver)."""
    import psutil

    alive = 0
    for child in kids:
        try:
            helper = _PYTHON_HELPER.search(" ".join(child.cmdline()))
            alive += child.status() != psutil.STATUS_ZOMBIE and not helper
        except psutil.Error:
            continue
    return alive


def _command_of(child: Any, parent: Any) -> dict[str, Any] | None:
    """A child process as ``{"pid", "cmd"}``: its command line quoted as a shell would, its secrets
    redacted word by word (``redact.redact_argv``), cut; None when it is gone, cannot be read, is a
    fork of ``parent`` (its command line: a DataLoader's worker kept alive, not the command the rank
    waits for) or one of Python's helper processes (multiprocessing's resource tracker, forkserver,
    spawned workers)."""
    import psutil

    try:
        words = child.cmdline()
        if not words or words == parent.cmdline():
            return None
    except psutil.Error:
        return None
    redacted = [_one_line(word) for word in redact.redact_argv(words)]
    text = shlex.join([Path(redacted[0]).name, *redacted[1:]])
    if _HELPER_PROCESS.search(text):
        return None
    text = re.sub(rf"'([^' ]*{re.escape(redact.REDACTED)}[^' ]*)'", r"\1", text)  # no quotes around it
    return {"pid": child.pid, "cmd": text if len(text) <= COMMAND_CHARS else text[:COMMAND_CHARS - 1] + "…"}


def _one_line(word: str) -> str:
    """A word of a command on one line: a 'python -c' program's lines joined by '; '."""
    return "; ".join(line.strip() for line in word.splitlines() if line.strip()) if "\n" in word else word


def faulthandler_text(frames: list[dict[str, Any]]) -> str:
    """Frames (outermost first) as faulthandler writes a stack, so that the doctor reads them as it
    reads a dump (``helpers.doctor.source.faulthandler_stack``), headed by where they came from."""
    lines = ["# read by py-spy: the rank's helper thread did not answer", "Stack (most recent call first):"]
    lines += [f'  File "{frame["file"]}", line {frame["line"]} in {frame["func"]}'
              for frame in reversed(frames)]
    return "\n".join(lines) + "\n"


def _py_spy_problem(pid: int, text: str) -> str:
    lowered = text.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return f"attach: no permission to read pid {pid} ({text.strip().splitlines()[0]}). {PTRACE_HELP}"
    if "python version" in lowered or "failed to find python" in lowered:
        return (f"attach: py-spy cannot read the Python of pid {pid} ({text.strip().splitlines()[0]}); "
                "upgrade py-spy (`pip install -U py-spy`) to one that supports this Python")
    return f"attach: py-spy failed on pid {pid}: {text.strip()[:300]}"


def _frame(raw: dict[str, Any], script: str | None) -> dict[str, Any]:
    """A py-spy frame in the doctor's shape. The script the rank runs (its ``<module>`` frame) is the
    user's code wherever it lies (accelerate's own test scripts are in site-packages)."""
    filename, line = raw.get("filename") or "?", int(raw.get("line") or 0)
    native = line == 0 and not filename.endswith(".py")
    func = (raw.get("name") or "?").rsplit(".", 1)[-1]  # "DistributedDataParallel.forward" -> "forward"
    user = not native and (filename == script or is_user_code(filename))
    return {"file": filename, "line": line, "func": func, "native": native, "user": user,
            "where": f"{Path(filename).name}:{line}"}


# ---------------------------------------------------------------------------------------------
# stacks -> the doctor's evidence


def view_from_stack(rank: int, frames: list[dict[str, Any]], now: float) -> RankView:
    """A ``RankView`` from one rank's stack: a wait in a collective becomes an open operation."""
    view = RankView(rank)
    python = [f for f in frames if not f.get("native")]
    view.state = {"request": "py-spy", "stack": python, "fr": [], "t": now}
    op = waiting_op(frames)
    if op is not None:
        view.open[1] = view.ops[1] = op
        view.order.append(1)
        op.start = now
    return view


def waiting_op(frames: list[dict[str, Any]]) -> Op | None:
    """The collective a stack waits in: the outermost torch.distributed op on it (init_process_group
    too: ranks wait there for each other), or, where native frames show a wait in c10d with no
    Python op above it, the collective DDP issued from C++."""
    python = [f for f in frames if not f.get("native")]
    ops = [f for f in python if f["file"].endswith(C10D_FILE) and (f["func"] in OPS or f["func"] == INIT_OP)]
    user = next((f for f in reversed(python) if f.get("user")), None)
    if ops:
        name = ops[0]["func"]
    elif any(f.get("native") and any(mark in f["func"] for mark in NATIVE_WAIT) for f in frames):
        name = _cpp_collective(issued_by(python))
    else:
        return None
    site = user or {}
    return Op(op=name, where=site.get("where"), file=site.get("file"), line=site.get("line"), source="stack")


def _cpp_collective(issuer: str) -> str:
    """The name of a collective only native frames show, by who issued it."""
    if "backward" in issuer:
        return "DDP backward() all-reduce"
    if "forward" in issuer:
        return "DDP forward() collective"
    return "C++ collective"


def diagnose_stacks(stacks: dict[int, list[dict[str, Any]]], world_size: int, native: bool,
                    workers: dict[int, list[dict[str, Any]]] | None = None) -> Diagnosis:
    """The doctor's diagnosis from stacks alone; ranks without a stack are unseen (other nodes).
    ``workers``: what the ranks that wait for child processes wait for (``children_waited_for``)."""
    now = time.time()
    views = {rank: view_from_stack(rank, frames, now) for rank, frames in stacks.items()}
    for rank, found in (workers or {}).items():
        views[rank].workers = found
    diagnosis = diagnose(views, world_size, "stall", None, unseen_missing=True)
    diagnosis.notes.append(STACKS_ONLY)
    if not native:
        ddp = [rank for rank, frames in stacks.items() if waiting_op(frames) is None and
               issued_by(frames).startswith("issued by DDP")]
        if ddp:
            diagnosis.notes.append(f"Ranks {ddp} are inside DDP, which issues its collectives from C++: "
                                   "attach with --native to see whether they wait in one.")
    unseen = sorted(set(range(world_size)) - set(stacks))
    if unseen:
        diagnosis.notes.append(f"Ranks {unseen} were not seen (they run on other nodes): attach on every "
                               "node and merge the files (`python -m helpers doctor --merge ...`).")
    return diagnosis


# ---------------------------------------------------------------------------------------------
# entry points


def attach(target: str, native: bool = False) -> list[Attached]:
    """Attach to the job(s) ``target`` names; one ``Attached`` per job (``auto`` may find several)."""
    started = time.monotonic()
    ranks = find_ranks(target)
    with ThreadPoolExecutor(max_workers=min(16, len(ranks))) as pool:
        dumped = list(pool.map(lambda rank: dump_stack(rank.pid, native), ranks))
    jobs: dict[str, tuple[list[RankProcess], dict[int, list[dict[str, Any]]]]] = {}
    for rank, frames in zip(ranks, dumped, strict=True):
        members, stacks = jobs.setdefault(rank.job, ([], {}))
        members.append(rank)
        stacks[rank.rank] = frames
    workers = children_waited_for({(rank.job, rank.rank): (rank.pid, frames)
                                  for rank, frames in zip(ranks, dumped, strict=True)})
    seconds = round(time.monotonic() - started, 3)
    host = socket.gethostname()
    attached = []
    for job, (members, stacks) in jobs.items():
        of_job = {rank: found for (its_job, rank), found in workers.items() if its_job == job}
        attached.append(Attached(diagnose_stacks(stacks, members[0].world_size, native, of_job), host,
                                 members[0].world_size, job, members, stacks, seconds, native))
    return attached


def merge(paths: list[str | Path]) -> Attached:
    """One diagnosis of the whole world from the files ``--attach`` wrote on each node."""
    parts = [_read_part(Path(path)) for path in paths]
    worlds = {part["world_size"] for part in parts}
    if len(worlds) != 1:
        raise AttachError(f"merge: the files are of jobs of different sizes ({sorted(worlds)} ranks)")
    stacks: dict[int, list[dict[str, Any]]] = {}
    for path, part in zip(paths, parts, strict=True):
        for rank, frames in part["stacks"].items():
            if int(rank) in stacks:
                raise AttachError(f"merge: rank {rank} appears twice ({path} and an earlier file)")
            stacks[int(rank)] = frames
    world, native = worlds.pop(), all(part.get("native") for part in parts)
    ranks = [RankProcess(pid, int(rank), world, None, None, part.get("job", "?"), "")
             for part in parts for rank, pid in (part.get("pids") or {}).items()]
    hosts = ", ".join(sorted({str(part.get("host", "?")) for part in parts}))
    return Attached(diagnose_stacks(stacks, world, native), hosts, world, parts[0].get("job", "?"),
                    sorted(ranks, key=lambda r: r.rank), stacks, 0.0, native)


def _read_part(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise AttachError(f"merge: {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise AttachError(f"merge: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("stacks"), dict) or \
            not isinstance(data.get("world_size"), int):
        raise AttachError(f"merge: {path} is not a file written by `python -m helpers doctor --attach "
                          "... --json` (it needs 'stacks' and 'world_size')")
    return data
