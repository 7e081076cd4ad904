"""The doctor's words: each kind's fix, and the one-paragraph summary of what went wrong.

Sentences only: ``helpers.doctor.diagnosis`` decides the kind and the culprits, this module says
them (rank numbers, ops, the user's ``file:line``, what a rank outside any collective is doing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from helpers import params
from helpers.collectives import OBJECT_LISTS, ROOTS, canonical_op
from helpers.doctor.records import WORLD_PG, Op, Position
from helpers.doctor.source import (
    cached_function,
    enclosing_condition,
    enclosing_function,
    enclosing_loop,
    exits_with_block,
    holding,
    in_loop_body,
    lock_taken_at,
    loop_exits,
    loop_left,
    loop_returned_from,
    mentions_rank,
    rank_condition,
    rank_conditional,
    returns_before,
    root_argument,
    share_a_loop,
    source_line,
    swallowing_finally,
    swallowing_handler,
    values_read,
)
from helpers.sites import installed_package, is_user_code
from helpers.trace.callsites import DATALOADER_FILE, DATALOADER_READ

NB_REPRO, NB_EARLY_STOP, NB_MEMORY = params.NB_REPRO, params.NB_EARLY_STOP, params.NB_MEMORY

FIXES = {
    "ok": "Nothing to fix.",
    "collective-mismatch": (
        "Make every rank issue the same collectives in the same order: take collectives (gather, "
        "reduce, wait_for_everyone, in_order logging) out of rank-dependent branches, and stop loops "
        "on every rank together with accelerator.set_trigger() / accelerator.check_trigger(). "
        f"{NB_EARLY_STOP} teaches the early-stop fix; {NB_REPRO} turns this run into a minimal repro."),
    "shape-mismatch": (
        "Give the collective tensors of the same shape and dtype on every rank: pad with "
        "accelerator.pad_across_processes(...) before gather (drop the padding after), or use "
        "gather_object for ragged data; ACCELERATE_DEBUG_MODE=1 makes accelerate check shapes first. "
        f"{NB_REPRO} reproduces it in a few lines."),
    "rank-missing": (
        "Make the missing ranks reach the same collective: look at where they are (location above): "
        "a rank-dependent branch, a loop that does not end, data loading or a wait. "
        f"{NB_REPRO} builds a minimal repro; {NB_EARLY_STOP} shows how ranks agree to stop."),
    "rank-exited": (
        "Find out why the rank ended: its exit code and log (SIGKILL is often the out-of-memory killer: "
        f"see {NB_MEMORY}; an exception: its traceback). If it finished early, make every rank run "
        f"the same collectives to the end ({NB_EARLY_STOP})."),
    "unknown": (
        "No known pattern: read each rank's stack (kept with --keep DIR) and build a minimal repro with "
        f"{NB_REPRO}."),
}


DATALOADER_WAIT = "waiting for a batch from its DataLoader's worker processes"
POOL_FILES = ("/multiprocessing/pool.py", "/concurrent/futures/")  # a rank waiting there waits for workers
POOL_WAIT = "waiting for a multiprocessing pool"
FUTURE_WAIT = "waiting for a future's result"
# the loop a worker process runs the user's code from, by what the rank waits for: a DataLoader's
# workers, a multiprocessing Pool's, a ProcessPoolExecutor's
_WORKER_LOOPS = {DATALOADER_WAIT: "/torch/utils/data/_utils/worker.py", POOL_WAIT: "/multiprocessing/pool.py",
                 FUTURE_WAIT: "/concurrent/futures/process.py"}
FILE_LOCK_WAIT = "waiting for a file lock"  # a dataset or model cache's, most often (on shared storage)
STDIN_WAIT = "waiting for input on stdin"  # a rank's line calls input()
FILE_POLL = "waits for a file to appear"  # in a summary: a loop whose test is a file's presence
FILE_POLL_CURE = (
    "A test of a file's presence reads the node's own filesystem (a relative path: each agent's own "
    "working folder), so a file written on one node never appears on another unless both mount it. "
    "Do not hand over between ranks through such a file. Send what it "
    "holds with a collective (dist.broadcast_object_list, or the tensors with dist.broadcast), or "
    "write it to storage every node mounts, and wait for it in dist.barrier() after the write rather "
    "than in a polling loop, so that a rank that fails is seen by the others.")
LOCK_WAIT = "waiting to acquire a lock"
QUEUE_WAIT = "waiting on a queue"
THREADING_WAIT = "waiting on a threading Event, Condition or Barrier"
_THREAD_WAITS = (QUEUE_WAIT, THREADING_WAIT)  # what a thread of the rank's own would have filled or set
THREAD_ENDED = "its thread"  # in a summary: a thread of the rank's own that an error ended
SELF_DEADLOCK = "its own thread holds that lock"  # a caller in the same stack took it
MULTIPROCESSING_FILES = "/multiprocessing/"  # a Queue's get, a Pipe's recv, a Process's join
MULTIPROCESSING_WAIT = "waiting on another process (multiprocessing)"
NONE_ALIVE = "none of its child processes is alive"
CHILD_FILE = "/subprocess.py"  # a rank that waits in it waits for a child process it started
CHILD_WAIT = "waiting for a child process"
CHILD_PIPE_WAIT = CHILD_WAIT + " (reading its output through a pipe)"
# 'for line in proc.stdout:', 'proc.stdout.readline()': a pipe's read is C, the user's line is innermost
CHILD_PIPE_LINE = re.compile(r"\.(stdout|stderr)\b(?!\.(write|flush|close)\()")
NEW_GROUP_WAIT = "creating a process group (new_group)"
NETWORK_WAIT = "waiting on the network"
# a torch.distributed Store's get and wait block in C++ (no Python frame below the user's line)
STORE_WAIT = "waiting for a key in a torch.distributed store (get or wait)"

DATALOADER_CURE = (
    "Its DataLoader's worker processes have not delivered the next batch: a worker is slow or stuck "
    "in the dataset's __getitem__ or collate_fn, or died. DataLoader(..., timeout=S) makes the wait "
    "raise after S seconds instead; num_workers=0 loads in the rank itself, where the doctor shows "
    "the dataset's line.")

# errors whose cause is known, by the first sentence a culprit raised (or what it waits for): what to do
# first. Each message is torch's own (2.13): DDP's reducer (reducer.cpp), the DataLoader
# (torch/utils/data/dataloader.py) and the caching allocator (CUDACachingAllocator.cpp).
_PICKLING = re.compile(r"[Cc]an't pickle|cannot pickle")  # pickle's AttributeError, TypeError, PicklingError
KNOWN_ERRORS = [
    (re.compile(re.escape(FILE_POLL)), FILE_POLL_CURE),
    (re.compile(re.escape(THREAD_ENDED) + " '[^']*' ended with"),
     "A thread of the rank's own ended with an error (its traceback is in the rank's log) and the "
     "main thread waits for what it would have delivered, while the other ranks wait in their next "
     "collective. Catch errors in the thread and hand them over: put the exception in the queue and "
     "raise it where it is taken out; or take with a timeout (queue.get(timeout=S)) and check that the "
     "thread is alive."),
    (re.compile(re.escape(SELF_DEADLOCK)),
     "A threading.Lock is not reentrant: a thread that takes it again while holding it waits for itself "
     "forever, and the other ranks wait in their next collective. Use threading.RLock, or split the "
     "function the caller reaches into one that takes the lock and one that runs while it is held "
     "(flush() and _flush_locked()), and call the second under the lock."),
    (re.compile(r"Expected to mark a variable ready only once"),
     "DDP marked a parameter's gradient ready twice in one step on that rank: most often its previous "
     "forward had no backward (a step skipped after the forward, as a continue on a NaN loss does, with "
     "find_unused_parameters=True), or a parameter was used in two reentrant backward passes (activation "
     "checkpointing with use_reentrant=True). Skip a step on every rank together (reduce the skip's "
     "condition first) or run the backward of a zero loss (loss * 0) instead of skipping it; for "
     "checkpointing pass use_reentrant=False."),
    (re.compile(r"Expected to have finished reduction in the prior iteration"),
     "DDP: some parameters got no gradient on that rank in the last step (a branch of the model it "
     "skipped), so its gradient all-reduce never started while the other ranks waited in theirs. Make "
     "every rank use every parameter in every step, or pass find_unused_parameters=True to "
     "DistributedDataParallel (with accelerate: Accelerator(kwargs_handlers="
     "[DistributedDataParallelKwargs(find_unused_parameters=True)]), which costs a graph walk per step)."),
    (re.compile(r"appears not to match (sizes|strides) of the same param in process|"
                r"DDP expects same model across all ranks"),
     "DDP found that the ranks built different models (it compares every parameter's shape with rank "
     "0's as it wraps the model, reducer.cpp's verify_params_across_processes): build the model from "
     "the same configuration on every rank, read once and shared (e.g. broadcast_object_list from "
     "rank 0), not from a rank's own files or arguments."),
    (re.compile(re.escape(DATALOADER_WAIT)), DATALOADER_CURE),
    (re.compile(r"DataLoader worker \(pid.*(exited unexpectedly|is killed by signal)|"
                + re.escape(DATALOADER_READ)),
     "A DataLoader worker process of that rank died without a Python error: killed (often by the "
     "out-of-memory killer: fewer workers, smaller batches) or, in a container, out of shared memory: "
     "the workers hand batches over through /dev/shm, which Docker makes 64 MB unless told otherwise "
     "(run it with --ipc=host or --shm-size, as PyTorch's README says for its own images)."),
    (re.compile(r"EOF when reading a line|" + re.escape(STDIN_WAIT)),
     "input() on a launched rank: no one can answer every rank alike at its standard input. The "
     "doctor's ranks read end-of-file (their stdin is /dev/null); torchrun's ranks share torchrun's own "
     "stdin, started in a session of their own, and a batch job has no terminal; meanwhile the other "
     "ranks wait in their next collective. Take the answer before the launch, the same on every "
     "rank: a command-line argument or an environment variable; a library that prompts for a login "
     "reads its key from the environment (HF_TOKEN for the Hugging Face Hub, WANDB_API_KEY for "
     "Weights & Biases)."),
    (re.compile(r"Incorrect (input|output) list size|invalid (input|output) tensor list|"
                r"requires a single-element (input |output )?(tensor )?list"),
     "A collective's list of tensors has one tensor per rank of its group: scatter's scatter_list on "
     "its source rank (None on the others), gather's gather_list on its destination, all_gather's "
     "tensor_list on every rank; its length is dist.get_world_size(group), which gloo checks on the "
     "rank that passed the list (the others then wait for it)."),
    (re.compile(r"doesn't have NCCL built in|ProcessGroupNCCL is only supported with GPUs"),
     "The NCCL backend runs on CUDA GPUs only, with a CUDA build of torch: this machine lacks one of "
     "them (the error says which). Without GPUs, use gloo: init_process_group('gloo'), or "
     "init_process_group() with no backend, which takes gloo for CPU tensors (and NCCL for CUDA ones "
     "where it exists); "
     "under accelerate, Accelerator(cpu=True). On a cluster, a login node has no GPUs: run the job "
     "on the compute nodes (srun)."),
    (re.compile(re.escape(NEW_GROUP_WAIT)),
     "Create every process group on every rank of the job, in the same order, with the same ranks: "
     "torch's new_group 'requires that all processes in the main group (i.e. all processes that are "
     "part of the distributed job) enter this function, even if they are not going to be members of "
     "the group', and 'groups should be created in the same order in all processes' (its docstring). "
     "Make the groups once, right after init_process_group, outside any branch on the rank, and pick "
     "the one a rank uses afterwards."),
    (re.compile(re.escape(NONE_ALIVE)),
     "The process the rank waits for through multiprocessing (a Queue's get, a Pipe's recv) has "
     "ended, most often by an exception, while the others wait in their next collective: "
     "multiprocessing prints its traceback in the rank's log, after a line 'Process ForkProcess-1:' "
     "(its name). Give the wait a deadline (queue.get(timeout=S) raises queue.Empty) and check "
     "process.exitcode when it passes, or run the work in concurrent.futures.ProcessPoolExecutor, "
     "whose future.result() raises the worker's exception in the rank (BrokenProcessPool when a "
     "worker dies), where the doctor names it."),
    (re.compile(re.escape(CHILD_PIPE_WAIT)),
     "The rank reads a command's output until the command writes more or ends, while the others wait "
     "in their next collective. A command that reads its standard input to the end (json.load("
     "sys.stdin), cat, sort) waits for the end that never comes while the rank's end of the pipe is "
     "open: proc.communicate(input, timeout=S) writes the input, closes the pipe, reads the output and "
     "sets a deadline, as does subprocess.run(..., input=..., timeout=S); Python's subprocess docs "
     "advise communicate() over .stdin.write and .stdout.read, which can deadlock on full pipes."),
    (re.compile(re.escape(CHILD_WAIT) + f"(?!{re.escape(CHILD_PIPE_WAIT.removeprefix(CHILD_WAIT))})"),
     "The rank waits for a command it started, while the others wait in their next collective. Give "
     "the call a deadline: subprocess.run(..., timeout=S) kills the command and raises "
     "TimeoutExpired, an error the doctor names (with shell=True it kills the shell, and what the "
     "shell started may run on: pass the command as a list). Then see why the command does not end: "
     "a prompt nobody answers (ssh and git over ssh: -o BatchMode=yes; git over https: GIT_TERMINAL_PROMPT=0 "
     "makes it fail instead of asking), a slow network copy, or a lock. A command every rank needs "
     "runs best once before the launch, or on the main process inside with "
     "accelerator.main_process_first()."),
    (_PICKLING,  # only for a rank that raised it in an object collective (a DataLoader's spawn says it too)
     "An object collective (all_gather_object, gather_object, broadcast_object_list, accelerate's "
     "gather_object) pickles the object on each rank before it sends anything, and torch requires it "
     "to be picklable (their docstrings): one that is not (a lambda or a function defined inside "
     "another, a defaultdict whose factory is one, a lock, an open file, a generator) raises on that "
     "rank alone while the others wait in the collective. Send plain data: dict(counts) for a "
     "defaultdict, numbers and strings for the rest, or leave the part that cannot be pickled out."),
    (re.compile(r"CUDA out of memory|OutOfMemoryError"),
     f"CUDA ran out of memory on that rank: {NB_MEMORY} finds the largest batch that fits; "
     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True helps when the error says much memory is "
     "reserved but unallocated."),
]


THREADS_CURE = (
    "Issue each process group's collectives from one thread. A thread that needs collectives of its "
    "own (metrics, logging, a background evaluation) gets a group of its own: create it on every rank, "
    "in the same order, with dist.new_group(...) before the thread starts, and pass group= to its "
    "calls; torch pairs calls within a group, so the two threads' calls never meet each other.")
THREADS_MEET = (" Calls from two threads reach the group in whichever order the threads run, which "
                "differs from rank to rank: one rank's call is then paired with another's different call.")

RAN_ALONE = (
    "rank {rank} of {world} ran the script alone ({why}): no collective, nothing shared with the other "
    "ranks. If they were meant to work together: accelerate's Accelerator() on a machine without a GPU "
    "runs distributed only when told to use the CPU (accelerate/state.py): Accelerator(cpu=True), or "
    "ACCELERATE_USE_CPU=true in the launch's environment; a plain torch script calls "
    "torch.distributed.init_process_group itself.")
ALONE_IN_ACCELERATE = "accelerate's state has 1 process"
ALONE_WITHOUT_GROUP = "it never joined a process group"

SPLIT_CURE = (
    "Send each rank the split sizes it will receive before the data: an all_to_all_single of a tensor "
    "of this rank's input_split_sizes gives every rank its output_split_sizes (rank i's input split j "
    "is rank j's output split i); pass both lists to the data's all_to_all_single.")

CROSSED_P2P_CURE = (
    "Order each pair's send and recv oppositely (the lower rank sends first and the higher receives "
    "first), or post both with dist.isend / dist.irecv (or dist.batch_isend_irecv) and then wait on them.")

LOOP_RAN_OUT = "ran out first"  # in a summary: some ranks left a loop the others are still in
LOOP_EXITS = "In that loop, "  # in a summary: the continue, break or return that can end a turn early
LATER_TURN = "come round to the loop at"  # in a summary: ranks skipped the others' call in it
UNDER_GUARD = "That call is under"  # in a summary: the call they skipped sits in an if
EXIT_HEDGE = "if its condition can differ between ranks"  # in it: no exit is likely to differ
LOOP_EXIT_CURE = (
    "Decide each skip and early exit of the loop on every rank together: reduce its condition across "
    "the ranks first, e.g. bad = accelerator.reduce(torch.tensor([float(condition)], "
    "device=accelerator.device), 'sum').item() > 0, and skip (or leave) on every rank when any rank "
    "needs to; to stop early, accelerator.set_trigger() / accelerator.check_trigger() does this.")
EARLY_EXIT_CURE = (
    "sys.exit() ends the rank's process, not the function or the piece of work it is called in: its "
    "remaining collectives never run, and the other ranks wait in them. To skip a piece of work, "
    "return from the function (or raise an error the caller catches) instead, so the rank still "
    "reaches the collectives after it, with an empty result where it has none; to stop the whole "
    "job, decide it on every rank together (reduce the condition across the ranks first) and leave "
    "on every rank.")
_EXIT_EFFECTS = {"continue": "skips the rest of its turn", "break": "ends the loop",
                 "return": "leaves the function"}
MODEL_ON_ONE_RANK_CURE = (
    "The collective is none of your calls: DDP issues its own, a broadcast of the model's buffers "
    "(BatchNorm's statistics) in the first forward after a training step, and the gradients' "
    "all-reduce in backward. A DDP-wrapped model run on one rank alone (evaluation or sampling under "
    "'if accelerator.is_main_process:') waits for the other ranks there: run that on every rank, or "
    "run accelerator.unwrap_model(model) on the one rank.")

PREPARED_ON_ONE_RANK_CURE = (
    "The collective is none of your calls: DDP's constructor (accelerator.prepare of a model, with "
    "several processes) checks and broadcasts the model's parameters with every rank. Prepare the "
    "model on every rank, or leave a model that one rank alone uses (a teacher, an evaluation copy) "
    "out of prepare and move it to accelerator.device yourself.")


def model_cure(culprits: Iterable[Position]) -> str:
    """The cure for a DDP model's own collective on some ranks alone: its constructor's (prepare
    on one rank), else its forward's or backward's (the model run on one rank)."""
    if any(pos.detail == DDP_CONSTRUCTOR for pos in culprits):
        return PREPARED_ON_ONE_RANK_CURE
    return MODEL_ON_ONE_RANK_CURE


REPEATED_CALL_CURE = (
    "Give the call the same structure on every rank: the same keys in the same order and lists of the "
    "same length (a metric that only some batches have: add it as a zero tensor on every rank, not only "
    "where it occurs). accelerate's reduce and gather take a dict or list one tensor at a time, one "
    "collective each.")

UNEVEN_LOOP_CURE = (
    "Give every rank the same number of iterations: keep accelerate's even_batches=True (its default: "
    "the last batch is filled with samples from the start; it applies to a DataLoader given to "
    "accelerator.prepare, which shards it, not to one built per rank by hand, nor to a sampler of your "
    "own that yields a different number of indices per rank: filter the dataset before it is sharded), "
    "or torch's "
    "DistributedSampler (drop_last=False pads with repeated samples, drop_last=True drops the "
    "remainder), and decide a break on every rank "
    "together (accelerator.set_trigger() / accelerator.check_trigger()). For inputs uneven on purpose: "
    "DDP's join (torch.distributed.algorithms.Join; accelerator.join_uneven_inputs([model]) for DDP on "
    "GPUs). If the iterations match, one rank skips a collective inside the loop: decide model.no_sync() "
    "(gradient accumulation) on every rank alike. A list split across the ranks: "
    "accelerator.split_between_processes(items, apply_padding=True) gives every rank as many items.")

INIT_CURE = (
    "init_process_group waits for every rank of the world (gloo until the group's timeout, 30 minutes "
    "unless set), so work only some ranks do before it (a download, preprocessing, a slow import from a "
    "shared filesystem) holds the others there: do it after the group is set up, on the main process "
    "inside accelerator.main_process_first() (the others wait in a barrier for it), or on every rank.")

WORLD_CURE = (
    "Let init_process_group take the world size and the rank from the launcher: call it without "
    "world_size and rank (torchrun, accelerate launch, srun with torchrun and the doctor set "
    "WORLD_SIZE and RANK), or launch as many processes as the script asks for (nodes x processes "
    "per node). A world size read from a configuration written for another machine is the usual "
    "cause; ranks given different init_method addresses wait the same way.")

INIT_CONNECT_CURE = (
    "Check that every rank meets at one address: let the launcher set MASTER_ADDR and MASTER_PORT "
    "(no init_method or port of the script's own), the same on every node. Then the connections "
    "between ranks: gloo binds to the address this machine's host name resolves to (a name that "
    "resolves to 127.0.1.1, as /etc/hosts has it on Debian and Ubuntu, is reached by no other node; "
    "GLOO_SOCKET_IFNAME picks the interface), NCCL to the interface NCCL_SOCKET_IFNAME names; a "
    "firewall between nodes must let the ports through. "
    "TORCH_DISTRIBUTED_DEBUG=DETAIL and, for NCCL, NCCL_DEBUG=INFO log what each rank tries.")

TIMEOUT_CURE = (
    "If the missing rank's work is slow rather than stuck (a checkpoint, a download, a first compile), "
    "give it the time: a longer process-group timeout, set before the group exists (accelerate: "
    "Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=60))]); torch's "
    "defaults: 10 minutes on NCCL, 30 on gloo), or do that work on every rank, or after the collective.")

BATCH_SIZE_CURE = (
    "accelerate's find_executable_batch_size (and transformers' Trainer with auto_find_batch_size=True) "
    "lowers the batch size after an out-of-memory error and calls the function again on that rank "
    "alone, so the ranks go on with different batch sizes and different collectives. With several "
    "processes, give every rank a batch size that fits all of them (found in a run of one process, "
    "then set), or decide a retry together: catch the error yourself, reduce a flag across the ranks "
    "and retry on every rank with the same smaller size.")

STORE_CURE = (
    "A Store's get(key) and wait([key]) block until some process sets the key, up to the store's "
    "timeout: for the default store (dist.distributed_c10d._get_default_store()) that is "
    "init_process_group's timeout, 30 minutes by default with gloo (distributed_c10d.py calls "
    "store.set_timeout(timeout)), while the other ranks wait in their next collective. The rank meant "
    "to set the key skipped its set (under a condition on its own data: nothing to share) or set "
    "another key: set it on every path, an empty value when there is nothing to share, or share the "
    "values with a collective every rank calls (all_gather_object), which needs no keys.")


FILE_LOCK_CURE = (
    "A file lock waits for the process that holds it: find that one with fuser -v FILE or lsof FILE on "
    "the rank's machine (for a lock on shared storage, on every machine that mounts it). When a rank of "
    "this job holds it while it waits in a collective (a cache it fills under its lock), release the "
    "lock before the collective, or let the main process fill the cache alone first: inside with "
    "accelerator.main_process_first(): the others wait in a barrier and then read it. A lock taken with "
    "flock (filelock's FileLock on Unix) ends with its process; filelock's SoftFileLock is the file "
    "itself, which a run killed on another machine can leave behind (recent filelock writes the "
    "holder's pid and host into it): delete it once no run uses it.")

CROSSED_GROUPS_CURE = (
    "Issue the collectives of groups that share ranks in one order on every rank (loop over the groups "
    "in a fixed order, not one that depends on the rank): a rank blocks in each until the group's other "
    "members join it.")

OBJECT_LIST_CURE = (
    "Pass the object-list collective a list of the same length on every rank: the objects on the "
    "source rank, placeholders of the same count elsewhere (object_list = [None] * n).")


def fix(kind: str, culprits: list[Position], cures: list[str] | None = None) -> str:
    """What to do: the kind's fix, after the cure for a culprit's known error when there is one (and
    for crossed sends or recvs, the only collective-mismatch whose culprits wait in p2p ops), and
    after ``cures`` the evidence told (split sizes that do not pair up)."""
    known = [*(cures or []), *(cure for pattern, cure in KNOWN_ERRORS
                               if any(pattern.search(pos.detail or "") and (pattern is not _PICKLING
                                                                            or is_object_op(pos.op))
                                      for pos in culprits))]
    crossed = culprits and all(pos.op is not None and pos.op.p2p for pos in culprits)
    if kind == "collective-mismatch" and crossed and P2P_COUNT_CURE not in known:
        known.append(CROSSED_P2P_CURE)
    if kind == "shape-mismatch" and any(is_object_list(pos.op) for pos in culprits):
        known.append(OBJECT_LIST_CURE)
    elif kind == "shape-mismatch" and any(pos.op is not None and canonical_op(pos.op.op) in _IN_PLACE
                                          for pos in culprits):
        known.append(IN_PLACE_CURE)
    return " ".join([*known, FIXES[kind]])


_IN_PLACE = {"broadcast", "all_reduce", "reduce"}  # each rank's own tensor is written: no padding helps
IN_PLACE_CURE = (
    "A broadcast, all_reduce or reduce writes into each rank's own tensor, so every rank must already "
    "hold one of the same shape and dtype: find where the ranks' tensors came to differ (a model changed "
    "on one rank alone, as resize_token_embeddings under 'if accelerator.is_main_process:', is changed on "
    "every rank, before accelerator.prepare), or send data whose shape differs with broadcast_object_list.")


def is_object_op(op: Op | None) -> bool:
    """Is it an object collective (all_gather_object, broadcast_object_list ...), which pickles?"""
    return op is not None and canonical_op(op.op).endswith(("_object", "_object_list"))


def is_object_list(op: Op | None) -> bool:
    """Is it an op on a list of objects, recorded by its length (``collectives.OBJECT_LISTS``)?"""
    return op is not None and canonical_op(op.op) in OBJECT_LISTS and op.dtypes == ["object"]


def _items(shapes: list | None) -> str:
    count = shapes[0][0] if shapes and shapes[0] else None
    return "a list of unknown length" if count is None else f"a list of {count}"


def shapes_text(shapes: list | None) -> str | None:
    """Shapes as '[2, 3], [4]' (None when unknown)."""
    if shapes is None:
        return None
    return ", ".join("[" + ", ".join(str(d) for d in shape) + "]" for shape in shapes) or "[]"


def short_error(text: str | None) -> str:
    """An exception's first sentence, without gloo's source path: 'RuntimeError: Connection closed ...'."""
    text = re.sub(r"\[[^\]]*/[^\]]*:\d+\] ", "", text or "")
    text = text.split("Exception raised from ", 1)[0]  # torch's C++ frames after a c10::Error's message
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:  # its first line, unless that is only the error's name ('RuntimeError:' then the message)
        text = lines[0] if len(lines[0]) >= 30 else " ".join(lines)
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    return first if len(first) <= 160 else first[:157] + "..."


BY_FSDP = "issued by FSDP"  # a rank's detail: its Python call came from FSDP's code, not the user's
FSDP_FORWARD = f"{BY_FSDP} inside forward(): the all-gather of its parameters"
FSDP_STATE_DICT = f"{BY_FSDP} while it gathers the model's state dict"
SHARDED_MODEL_ON_ONE_RANK_CURE = (
    "The collective is none of your calls: FSDP all-gathers a sharded model's parameters from every "
    "rank in its forward. An FSDP model run on one rank alone (evaluation or sampling under 'if "
    "accelerator.is_main_process:') waits for the other ranks there: run it on every rank, or call "
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
    "full_state_dict=True, cpu_offload=True)) on every rank (a collective: rank 0 alone receives the "
    "full state, the others an empty dict; accelerator.get_state_dict(model) does the same) and run an "
    "unsharded copy on rank 0.")
FSDP_STATE_DICT_CURE = (
    "Under FSDP, taking the model's full state dict is a collective (every rank's shards are "
    "gathered): call accelerator.get_state_dict(model) (or get_model_state_dict) on every rank, not "
    "under 'if accelerator.is_main_process:'; rank 0 alone receives the full state (the others an "
    "empty dict), so save it there.")
_FSDP_CURES = {FSDP_FORWARD: SHARDED_MODEL_ON_ONE_RANK_CURE, FSDP_STATE_DICT: FSDP_STATE_DICT_CURE}


def fsdp_call(stack: list[dict[str, Any]], op: str | None) -> str:
    """What FSDP's code (FSDP1 or ``fully_shard``) was doing when it issued collective ``op`` from
    the user's line (``FSDP_FORWARD``, ``FSDP_STATE_DICT``, its backward's reduce-scatter, or just
    ``BY_FSDP``); '' unless FSDP's code runs below the stack's last user frame (a user's own
    collective in a module FSDP wraps is the user's)."""
    users = [index for index, frame in enumerate(stack)
             if (frame["user"] if "user" in frame else is_user_code(frame.get("file") or ""))]
    inner = stack[users[-1] + 1:] if users else stack
    paths = [(frame.get("file") or "").replace("\\", "/") for frame in inner]
    fsdp = [frame for frame, path in zip(inner, paths, strict=True) if "/torch/distributed/fsdp/" in path]
    if not fsdp:
        return ""
    names = " ".join(f"{frame.get('file')} {frame.get('func')}" for frame in fsdp)
    backward = any("/torch/autograd/" in path for path in paths)
    name = canonical_op((op or "").split(":", 1)[-1])
    if "state_dict" in names:
        return FSDP_STATE_DICT
    if name.startswith("reduce_scatter"):
        return f"{BY_FSDP} inside backward(): the gradients' reduce-scatter"
    if name.startswith("all_gather"):
        return f"{BY_FSDP} inside backward(): the all-gather of its parameters" if backward else FSDP_FORWARD
    return BY_FSDP


def fsdp_cure(detail: str) -> str | None:
    """The cure for a rank that waits alone in a collective FSDP issued (``fsdp_call``), if any."""
    return _FSDP_CURES.get(detail)


_DDP_BACKWARD = "issued by DDP inside backward(): the gradient all-reduce"
DDP_CONSTRUCTOR = "issued by DDP's constructor: its check and broadcast of the model's parameters"


def issued_by(stack: list[dict[str, Any]]) -> str:
    """Who issued a collective that no Python wrapper saw (DDP from C++, most often)."""
    names = {(Path(f["file"]).name, f["func"]) for f in stack}
    if any(func in ("backward", "_engine_run_backward") for _file, func in names):
        return _DDP_BACKWARD
    if ("distributed.py", "__init__") in names:
        return DDP_CONSTRUCTOR
    if any(file == "distributed.py" and func in ("forward", "_pre_forward") for file, func in names):
        return "issued by DDP inside forward(): buffers or bucket order"
    return "issued outside Python (no Python wrapper saw it)"


def activity(rank: int, frame: dict[str, Any], stack: list[dict[str, Any]], silent: bool = False,
             workers: list[dict[str, Any]] | None = None, thread_errors: list[dict[str, Any]] | None = None
             ) -> str:
    """What a rank outside any collective is doing: 'in a loop at train.py:41', 'sleeping at ...',
    'waiting for a child process at ...' (``waiting_for``); ``silent``: its Python could not answer,
    so the call at its line holds the GIL in native code; ``workers``: its DataLoader workers'
    stacks, where a busy one is (``workers_text``), or the commands of the child processes it waits
    for ('waiting for a child process at train.py:9 (git lfs pull, pid 4242)'):
    ``pyspy.children_waited_for``; ``thread_errors``: the errors that ended threads of its own, the
    last one said when the rank waits on a queue or a threading primitive (a thread that would have
    filled it or set it)."""
    if silent:
        return f"in native code holding the GIL at {frame['where']}"
    waits = waiting_for(frame, stack)
    if waits is not None:
        busy = workers_text(workers or [], waits) if waits in _WORKER_LOOPS else ""
        if waits == MULTIPROCESSING_WAIT and any(entry.get("alive") == 0 for entry in workers or []):
            busy = NONE_ALIVE
        if waits.startswith(CHILD_WAIT):
            busy = "; ".join(f"{child['cmd']}, pid {child['pid']}" for child in workers or []
                             if child.get("cmd"))
        if waits == LOCK_WAIT:
            busy = _held_by_its_caller(frame, stack)
        if waits in _THREAD_WAITS and thread_errors:
            busy = _thread_ended(thread_errors[-1])
        return f"{waits} at {frame['where']}" + (f" ({busy})" if busy else "")
    innermost = stack[-1] if stack else frame
    sleeping = innermost.get("func") == "sleep" or "time.sleep" in source_line(frame)
    library = library_below(frame, stack)
    if library is not None:  # a package it called holds it: named, with the user's line that called it
        return f"{'sleeping' if sleeping else 'running'} in {library}, called at {frame['where']}"
    loop = enclosing_loop(frame.get("file"), frame.get("line"))
    where = f"in a loop at {Path(frame['file']).name}:{loop}" if loop is not None else f"at {frame['where']}"
    polled = _polled_file(frame, loop)
    if polled:  # its own line too: the loop's clause is long
        where = f"at {frame['where']} {where}{polled}"
    return f"sleeping {where}" if sleeping else where


def _polled_file(frame: dict[str, Any], loop: int | None) -> str:
    """' that waits for a file to appear (while not os.path.exists(ready))' for a while loop whose
    test is a file's presence; '' otherwise."""
    if loop is None:
        return ""
    test = next((test for keyword, _at, test in loop_exits(frame.get("file"), loop, frame.get("line"))
                 if keyword == "while"), "")
    if not _FILE_TEST.search(test):
        return ""
    return f" that {FILE_POLL} (while {test})"


def library_below(frame: dict[str, Any], stack: list[dict[str, Any]]) -> str | None:
    """"filelock (acquire at _api.py:344)": the innermost frame of an installed package that the
    user's ``frame`` called and that the tracer counted as the user's code (a package of theirs, not
    torch or accelerate: ``helpers.sites``), when one is below it; None otherwise."""
    index = next((i for i, f in enumerate(stack) if f is frame), None)
    called = stack[index + 1:] if index is not None else []
    for below in reversed(called):
        package = installed_package(str(below.get("file", ""))) if below.get("user") else None
        if package is not None:  # a package the tracer counts as the user's (not torch, not accelerate)
            return f"{package} ({below.get('func')} at {Path(below['file']).name}:{below.get('line')})"
    return None


# what a rank waits for when the library code its line called is in one of these files (the first
# match wins: a DataLoader waits on multiprocessing's queue, a child process on selectors)
_WAITS = (
    (DATALOADER_FILE, None, DATALOADER_WAIT),
    ("/filelock/", None, FILE_LOCK_WAIT + " (filelock: held by another process or another open of the file)"),
    (CHILD_FILE, None, CHILD_WAIT),
    ("/torch/distributed/distributed_c10d.py", {"new_group", "new_subgroups", "new_subgroups_by_enumeration",
                                                "split_group"}, NEW_GROUP_WAIT),
    ("/concurrent/futures/", None, FUTURE_WAIT),
    ("/multiprocessing/pool.py", None, POOL_WAIT),
    ("/queue.py", None, QUEUE_WAIT),  # a queue waits on a threading Condition
    ("/threading.py", {"join", "_wait_for_tstate_lock"}, "waiting for a thread to end"),
    ("/threading.py", None, THREADING_WAIT),
    (MULTIPROCESSING_FILES, None, MULTIPROCESSING_WAIT),
    ("/socket.py", None, NETWORK_WAIT),
    ("/ssl.py", None, NETWORK_WAIT),
    ("/http/client.py", None, NETWORK_WAIT),
    ("/selectors.py", None, "waiting on a socket or pipe"),
    ("/torch/cuda/__init__.py", {"synchronize"}, "waiting for the GPU (torch.cuda.synchronize)"),
)
_WAITING_LINES = ((re.compile(r"\b(flock|lockf)\("), FILE_LOCK_WAIT),
                  (re.compile(r"\.acquire\("), LOCK_WAIT),
                  # 'with self.lock:', 'with state_mutex:': a with statement stays on its line while
                  # its __enter__ runs (a threading lock's is C: no frame below)
                  (re.compile(r"^\s*(async\s+)?with\s+[\w.]*(lock|mutex)\w*\s*:", re.IGNORECASE),
                   LOCK_WAIT),
                  (re.compile(r"\.(recv|recv_into|recvfrom|recvmsg|accept)\("), f"{NETWORK_WAIT} (a socket)"),
                  # 'store.get(key)', '_get_default_store().wait([key])', 'self.kv_store.get(...)'
                  (re.compile(r"store\w*(\(\))?\.(get|wait)\(", re.IGNORECASE), STORE_WAIT),
                  (re.compile(r"(^|[^\w.])input\("), STDIN_WAIT),
                  (CHILD_PIPE_LINE, CHILD_PIPE_WAIT))


BY_NODE = "split along the nodes"  # in a summary: each node's ranks alike, the nodes not
BY_NODE_CURE = (
    "Compare the nodes: the environment audit on every node in one report (torchrun ... -m helpers.audit "
    "--fleet --json fleet.json, notebooks/01_environment_audit.ipynb) shows what differs between them; "
    "and read the job's configuration once, on rank 0, and send it to every rank "
    "(dist.broadcast_object_list), rather than on each node from its own files or environment.")


def by_node_text(nodes: dict[int, list[int]]) -> str:
    """' The calls split along the nodes: the ranks of each node issued the same call, and the nodes
    did not (node 0: ranks 0 and 1; node 1: ranks 2 and 3). ...' (``diagnosis._sides_by_node``)."""
    said = [f"node {node}: {ranks_text(sorted(ranks)).lower()}" for node, ranks in sorted(nodes.items())]
    return (f" The calls {BY_NODE}: the ranks of each node issued the same call, and the nodes did not "
            f"({'; '.join(said)}). What differs was most likely read by each node for itself: a file in "
            "its working folder or on its own disk, an environment variable, a package version or a "
            "configuration file that is not the same on every machine.")


def _and(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


def _thread_ended(error: dict[str, Any]) -> str:
    """"its thread 'prefetch' ended with RuntimeError: ... at data.py:27 in collate"."""
    where = f" at {error['where']} in {error.get('func')}" if error.get("where") else ""
    return f"{THREAD_ENDED} '{error.get('thread')}' ended with {str(error.get('error'))[:300]}{where}"


def _held_by_its_caller(frame: dict[str, Any], stack: list[dict[str, Any]]) -> str:
    """'its own thread holds that lock: log took self._lock at metrics.py:31 and, holding it, called
    at metrics.py:34 what takes it again at metrics.py:37' when a caller of ``frame`` in the same
    stack is inside a ``with`` block on the same lock (the same text: 'self._lock'); '' otherwise."""
    lock = lock_taken_at(frame.get("file"), frame.get("line"))
    index = next((i for i, f in enumerate(stack) if f is frame), None)
    if lock is None or not index:
        return ""
    for caller in reversed(stack[:index]):
        header = holding(caller.get("file"), caller.get("line"), lock) if caller.get("user") else None
        if header is not None:
            taken = f"{Path(caller['file']).name}:{header}"
            return (f"{SELF_DEADLOCK}: {caller.get('func')} took {lock} at {taken} and, holding it, called "
                    f"at {caller['where']} what takes it again at {frame['where']}")
    return ""


def waiting_for(frame: dict[str, Any], stack: list[dict[str, Any]]) -> str | None:
    """What the user's ``frame`` waits for, from the library frames it called ('waiting for a child
    process') or, when its line calls C directly, from the line ('waiting to acquire a lock');
    None when it waits for nothing known."""
    index = next((i for i, f in enumerate(stack) if f is frame), None)
    called = stack[index + 1:] if index is not None else []
    for ending, funcs, text in _WAITS:
        if any(runs_in(f, ending, funcs) for f in called):
            return text
    if not called:  # nothing in Python below the user's line: what its line says
        line = source_line(frame)
        return next((text for pattern, text in _WAITING_LINES if pattern.search(line)), None)
    return None


def workers_text(workers: list[dict[str, Any]], waits: str = DATALOADER_WAIT) -> str:
    """Where the busy ones of a rank's worker processes are, in the user's code, for what the rank
    ``waits`` for (a DataLoader's workers, a Pool's, a ProcessPoolExecutor's: ``_WORKER_LOOPS``):
    'worker pid 41 is sleeping at data.py:12 in __getitem__' ('' when none is: an idle worker waits
    in its worker loop for its next item)."""
    parts = []
    for worker in workers:
        frames = worker.get("frames") or []
        loop = max((i for i, f in enumerate(frames) if runs_in(f, _WORKER_LOOPS[waits])), default=None)
        below = frames[loop + 1:] if loop is not None else []
        user = next((f for f in reversed(below) if f.get("user")), None)
        if user is not None:
            parts.append(f"worker pid {worker['pid']} is {activity(-1, user, below)} in {user['func']}")
    return "; ".join(parts)


def reads_a_pipe(stack: list[dict[str, Any]]) -> bool:
    """Does the innermost frame's line read a child's output pipe ('for line in proc.stdout:')?"""
    return bool(stack) and CHILD_PIPE_LINE.search(source_line(stack[-1])) is not None


def runs_in(frame: dict[str, Any], ending: str, funcs: set[str] | None = None) -> bool:
    """Is a stack frame in a file whose path contains ``ending`` (one of ``funcs``, when given)?"""
    path = str(frame.get("file", "")).replace("\\", "/")
    return ending in path and (funcs is None or frame.get("func") in funcs)


def _op_name(op: Op | None) -> str:
    return canonical_op(op.op) if op else "a collective"


def _at_where(op: Op) -> str:
    return f" at {op.where}" if op.where else ""


def _at(pos: Position) -> str:
    return f" at {pos.where}" if pos.where else ""


def ranks_text(ranks: list[int]) -> str:
    """'Rank 1', 'Ranks 0, 2 and 3'."""
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    return "Ranks " + _and([str(r) for r in ranks])


def split_summary(key: tuple[str, int], present: dict[int, Op],
                  pairs: list[tuple[int, int, int, int]], culprits: list[int]) -> str:
    """all_to_all_single's split sizes that do not pair up: who sends how many rows to whom, and how
    many the receiver expects."""
    site = next((op.where for op in present.values() if op.where), None)
    shown = [pair for pair in pairs if pair[0] in culprits or pair[1] in culprits] or pairs
    parts = [f"rank {sender} sends {_rows(sent)} to rank {receiver}, which expects {expected}"
             for sender, receiver, sent, expected in shown[:4]]
    more = f" ({len(shown) - 4} more pairs)" if len(shown) > 4 else ""
    alone = all(sender == receiver for sender, receiver, *_ in shown)  # told from each rank's own call
    whose = ("its own" if len(culprits) == 1 else "their own") if alone else "the others'"
    return (f"Ranks called all_to_all_single{f' at {site}' if site else ''} (collective #{key[1]}) with "
            "split sizes that do not pair up: " + "; ".join(parts) + f"{more}. {ranks_text(culprits)} "
            f"passed split sizes that do not match {whose}. Rank i's input split j must equal rank "
            "j's output split i.")


def repeated_call_summary(key: tuple[str, int], present: dict[int, Op], counts: dict[int, int | None],
                          call: Op, culprits: list[int], positions: dict[int, Position] | None = None) -> str:
    """Some ranks issued one line's collective more times in a row than the others, which went on to
    another call: 'Ranks issued all_reduce at train.py:8 a different number of times in a row: rank
    0 once, then barrier at train.py:9 as collective #2; rank 1 2 times, the last as collective #2.'"""
    said: dict[str, list[int]] = {}  # what the ranks did, and the ranks that did it (one part each)
    for rank, op in sorted(present.items()):
        times = "once" if counts[rank] == 1 else f"{counts[rank]} times"
        if counts[rank] is None:  # its calls before are lost (a rank gloo aborted: only this one posted)
            text = (f"once more as collective #{key[1]}, after the others' last (its earlier calls died "
                    "with it)")
        elif op.where == call.where:
            text = f"{times}, the last as collective #{key[1]}"
        else:
            where, extra = _where_now(op, (positions or {}).get(rank), key[1])
            text = f"{times}, then {_op_name(op)}{' at ' + where if where else ''} as collective #{key[1]}"
            text += extra
        said.setdefault(text, []).append(rank)
    parts = [f"{ranks_text(ranks).lower()} {text}" for text, ranks in said.items()]
    more = "more" if all(present[rank].where == call.where for rank in culprits) else "fewer"
    others = _others_text([rank for rank in present if rank not in culprits])
    return (f"Ranks issued {_op_name(call)}{' at ' + call.where if call.where else ''} a different number of "
            f"times in a row: {'; '.join(parts)}. {ranks_text(culprits)} issued it {more} times than "
            f"{others}. The line issues one collective per item of what it is given (accelerate's reduce "
            "and gather of a dict or a list), and what it is given differs by rank (other keys, another "
            "length).")


def _others_text(others: list[int]) -> str:
    """'the others', or 'rank 0' when there is one."""
    return f"rank {others[0]}" if len(others) == 1 else "the others"


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def different_lines_summary(key: tuple[str, int], present: dict[int, Op], culprits: list[int],
                            positions: dict[int, Position]) -> str:
    """The ranks issued one op, with different shapes, as one numbered collective from different
    lines: not one call given other sizes, but different calls that took the same number."""
    op = next(iter(present.values()))
    said = []
    for rank, each in sorted(present.items()):
        where, extra = _where_now(each, positions.get(rank), key[1])
        text = f"{shapes_text(each.shapes) or 'unknown shape'} {','.join(each.dtypes or [])}".strip()
        said.append((rank, text + (f" at {where}" if where else "") + extra))
    why = (_cached_text(culprits, present, positions)  # its cache missed there: the call's own story
           or _deciding_text(culprits, present, " ", positions) or _rank_branch_text(culprits, present)
           or _caller_branch_text(culprits, present, positions) or _next_turn(present, positions))
    threads = "" if why else (", or a thread of their own issues collectives on the same group, in a "
                              "different order on each rank")
    why = why or swallowed_text(_at_call(each, positions.get(rank), key[1])
                                for rank, each in sorted(present.items()))
    return (f"Ranks called {_op_name(op)} as collective #{key[1]} from different lines, with different "
            "shapes or dtypes: " + "; ".join(_together(said)) + ". On some ranks another call took this "
            f"number: the ranks took different paths{threads}." + why)


CACHED = "which runs its body only when the rank's cache misses"  # in a summary: a cached collective
CACHED_CURE = (
    "A collective inside a cached function (functools.lru_cache, cache, cached_property) runs only "
    "when that rank's cache misses, and each rank misses on keys of its own (its data's): the others "
    "wait for a call it never makes, or meet another call. Take the collective out of the cached "
    "function, or fill the cache for every key on every rank first (one collective over all of them: "
    "all the classes at once), so that later calls are hits everywhere.")


def _cached_text(culprits: list[int], present: dict[int, Op], positions: dict[int, Position]) -> str:
    """' Rank 2's call at train.py:34 is in global_count, cached by functools' lru_cache at
    train.py:31, which runs its body only when the rank's cache misses...' for a culprit whose call
    (or a function on its way there) a functools cache decorates; '' otherwise."""
    for rank in culprits:
        op, pos = present.get(rank), positions.get(rank)
        frames = [(op.file, op.line)] if op is not None and op.file else []
        frames += [(file, line) for file, line, _where in reversed(pos.callers if pos else [])]
        for file, line in frames:
            found = cached_function(file, line)
            if found is not None:
                name, decorator, cache = found
                first = f"{Path(frames[0][0] or '').name}:{frames[0][1]}"  # the call's line, or its caller's
                where = (op.where if op is not None else None) or first
                return (f" Rank {rank}'s call at {where} is in {name}, cached by functools' {cache} at "
                        f"{Path(file).name}:{decorator}, {CACHED}, and each rank misses on keys of its own.")
    return ""


def _caller_branch_text(culprits: list[int], present: dict[int, Op], positions: dict[int, Position]) -> str:
    """' Rank 0's call at train.py:31 is under 'if accelerator.is_main_process:' at train.py:30, a
    branch on the rank.' when a culprit, still at (or killed in) that call, got there through a
    caller under a branch on the rank (the collective in a helper function); '' otherwise."""
    for rank in culprits:
        pos = positions.get(rank)
        if pos is None or pos.op is None or present.get(rank) is None or pos.where != present[rank].where:
            continue
        branch = _branch_site(pos)  # the caller's line in the branch
        caller = next((frame for frame in pos.callers if frame[2] == branch), None) if branch else None
        found = rank_condition(caller[0], caller[1]) if caller is not None else None
        if caller is not None and found is not None:
            return (f" Rank {rank}'s call at {branch} is under {_branch_words(found, caller[0])}, a branch "
                    "on the rank.")
    return ""


def _at_call(op: Op, pos: Position | None, seq: int) -> Position:
    """A rank's position at its call ``op`` (collective ``seq``): where it is, when that is its
    call now; else the call's own site."""
    if pos is not None and pos.op is not None and pos.seq == seq and pos.file:
        return pos
    return Position(pos.rank if pos else -1, "in-collective", op=op, seq=seq, where=op.where, file=op.file,
                    line=op.line)


def _rank_branch_text(culprits: list[int], present: dict[int, Op]) -> str:
    """' Rank 0's call is under 'if accelerator.is_local_main_process:' at train.py:21, a branch on
    the rank.' when the culprits' calls sit under one branch on the rank; '' otherwise."""
    branches = {(op.file, found) for rank in culprits if (op := present.get(rank)) is not None
                and (found := rank_condition(op.file, op.line))}
    if len(branches) != 1:
        return ""
    file, found = branches.pop()
    calls = _calls_of(culprits)
    return (f" {calls[0].upper()}{calls[1:]} {'is' if len(culprits) == 1 else 'are'} under "
            f"{_branch_words(found, file)}, a branch on the rank.")


def _where_now(op: Op, pos: Position | None, seq: int) -> tuple[str | None, str]:
    """A rank's call site for collective ``seq`` (its position's, when it is in that one now and the
    op has none: DDP's) and who issued it (', issued by DDP inside backward(): ...'), or ''."""
    where, extra = op.where, ""
    if pos is not None and pos.op is not None and pos.seq == seq:  # where the rank is now
        where = where or pos.where
        if pos.detail.startswith(("issued", BY_FSDP)):
            extra = f", {pos.detail}"
        elif op.where is None and pos.where and pos.op.source == "flight-recorder":  # no Python call: C++'s
            extra = ", " + issued_from_cpp_at(pos)
    return where, extra


def issued_from_cpp_at(pos: Position) -> str:
    """Who issued a collective no Python call did, from the user's line it came from: DDP's gradient
    all-reduce from a line that calls backward(), else 'issued outside Python'."""
    if "backward(" in source_line({"file": pos.file, "line": pos.line}):
        return _DDP_BACKWARD
    return "issued outside Python (no Python wrapper saw it)"


def _deciding_text(culprits: list[int], present: dict[int, Op], form: str,
                   positions: dict[int, Position] | None = None) -> str:
    """The one condition on a per-rank value around the culprits' calls (``decided_per_rank``; the
    user's line that made a call DDP issued, from ``positions``): form ' ' gives a sentence ('The
    calls of ranks 0 and 3 are under ..., a condition each rank decides for itself.'), form '(' a
    parenthesis (' (their calls are under ...)'); '' when there is none."""
    deciding = {found for rank in culprits if (op := present.get(rank))
                and (found := _deciding_site(op, (positions or {}).get(rank)))}
    if len(deciding) != 1:
        return ""
    file, found = deciding.pop()
    under = f"under {_branch_words(found, file)}, {DECIDES_ITSELF}"
    if form == "(":
        return f" ({'its call is' if len(culprits) == 1 else 'their calls are'} {under})"
    calls = _calls_of(culprits)
    return f" {calls[0].upper()}{calls[1:]} {'is' if len(culprits) == 1 else 'are'} {under}."


def _deciding_site(op: Op, pos: Position | None) -> tuple[str, tuple[int, str, str]] | None:
    """The file and ``decided_per_rank`` condition around a rank's call, else around the innermost
    of the user's lines that led to it (a helper that gathers, called under 'if use_global:' where
    use_global came from random.random()); None when none is."""
    site = _site(op, pos)
    frames = ([site] if site is not None else []) + [(file, line) for file, line, _where
                                                      in reversed(pos.callers if pos is not None else [])]
    for file, line in frames:
        found = decided_per_rank(file, line)
        if found is not None:
            return file, found
    return None


def divergence_summary(kind: str, key: tuple[str, int], present: dict[int, Op], culprits: list[int],
                       positions: dict[int, Position], path: str | None = None) -> str:
    """The ranks disagree at (group, sequence number) ``key``: what each issued, who differs
    (``path``: how the ranks came to differ, when the caller knows; else ``_different_path``)."""
    seq = key[1]
    if kind == "shape-mismatch":
        op = next(iter(present.values()))
        site = next((o.where for o in present.values() if o.where), None)
        where = f" at {site}" if site else ""
        odd = (f"{ranks_text(culprits)} differ{'s' if len(culprits) == 1 else ''} from "
               f"{f'the source, rank {op.root}' if is_object_list(op) else 'the others'}."
               if len(culprits) < len(present)
               else "Every rank must pass the same shape and dtype.")
        if is_object_list(op):
            parts = _together([(r, _items(o.shapes)) for r, o in sorted(present.items())])
            return (f"Ranks called {_op_name(op)}{where} (collective #{seq}) with lists of different "
                    "lengths: " + "; ".join(parts) + ". " + odd)
        parts = _together([(r, f"{shapes_text(o.shapes)} {','.join(o.dtypes or [])}".strip())
                           for r, o in sorted(present.items())])
        return (f"Ranks called {_op_name(op)}{where} (collective #{seq}) with different shapes or dtypes: "
                + "; ".join(parts) + ". " + odd)
    if seq < 0:  # stacks alone: the collective each rank waits in now
        parts = _together([(rank, f"in {_op_name(op)}{' at ' + op.where if op.where else ''}")
                           for rank, op in sorted(present.items())])
        return ("Ranks wait in different collectives: " + "; ".join(parts) + "."
                + _different_path(present, culprits, positions))
    said = []
    for rank, op in sorted(present.items()):
        where, extra = _where_now(op, positions.get(rank), seq)
        said.append((rank, f"in {_op_name(op)}{' at ' + where if where else ''}{extra}"))
    if path is None:
        path = _different_path(present, culprits, positions)
    return (f"Ranks issued different collectives as collective #{seq}{_of_subgroup(present)}: "
            + "; ".join(_together(said)) + "." + path)


def _of_subgroup(present: dict[int, Op]) -> str:
    """' of group 2 (ranks 2 and 3)' when the ranks' calls are a subgroup's; '' for the default group."""
    op = next(iter(present.values()), None)
    if op is None or op.pg == WORLD_PG:
        return ""
    ranks = next((o.pg_ranks for o in present.values() if o.pg_ranks), None)
    return " of " + group_text(op, {op.pg: ranks} if ranks else {})


def _together(said: list[tuple[int, str]]) -> list[str]:
    """'ranks 0, 1 and 3 in all_reduce at train.py:14': the ranks of which the same is said, named
    together (a job of 16 ranks reads as two parts, not 16), in the order of their lowest rank."""
    alike: dict[str, list[int]] = {}
    for rank, text in said:
        alike.setdefault(text, []).append(rank)
    return [f"{ranks_text(ranks).lower()} {text}" for text, ranks in alike.items()]


def _different_path(present: dict[int, Op], culprits: list[int], positions: dict[int, Position]) -> str:
    """' Rank 2 has left the loop at train.py:41 that the others are still in: ...' when one side's
    calls are inside one loop and the other side's come after it, in the same function (the
    culprits on either side: the ranks with more batches may be the fewer): a loop ran out first on
    some ranks, most often a DataLoader with fewer batches. Else ' Rank 2 took a different path
    from the others.' (' The ranks took different paths here.' when every rank is named)"""
    others = sorted(rank for rank in present if rank not in culprits)
    cached = _cached_text(culprits, present, positions)
    if cached:  # its cache missed on that rank alone: any loop it is in is not the story
        return f" {ranks_text(culprits)} took a different path from {_others_text(others)}.{cached}"
    logged = _logged_text(present, culprits, others, positions)
    if logged:  # a logging handler's collective: where the record passed the logger's level
        return logged
    early = returned_early(present, positions)
    if early is not None:  # a return or a swallowed error in a call, before the others' collective
        return returned_early_text(early, present)
    left = _loop_left_text(present, culprits, positions)
    if left:
        return left
    if not others:  # no side is the common path: every rank's call is as likely the odd one
        return " The ranks took different paths here."
    branches = [f"rank {rank}'s call at {branch}" for rank in culprits if rank in positions
                and positions[rank].op is not None and (branch := _branch_site(positions[rank]))]
    inside = f" ({', '.join(branches)}, inside a branch on the rank)" if branches else ""
    if not branches:  # the call's own line in the branch: the branch's test
        tests: dict[str, list[int]] = {}  # the ranks whose call sits under one branch, named together
        for rank in culprits:
            if rank in positions and (test := _own_branch(positions[rank])):
                tests.setdefault(test, []).append(rank)
        said = [f"{_calls_of(ranks)} under {test}" for test, ranks in tests.items()]
        inside = f" ({'; '.join(said)})" if said else ""
    if not inside:  # one condition on a per-rank value around the culprits' calls
        inside = _deciding_text(culprits, present, "(", positions)
    if not inside:  # one side went round its loop without the other side's call
        inside = _next_turn(present, positions)
        if inside:
            return inside
    swallowed = "" if inside else swallowed_text(positions.get(rank) for rank in present)
    return (f" {ranks_text(culprits)} took a different path from {_others_text(others)}{inside}.{swallowed}"
            + ("" if inside else _none_of_their_branches(present, culprits, others)))


IN_A_HANDLER = "runs in a logging handler"  # in a summary: a collective in a handler's emit
LOGGING_CURE = (
    "Keep collectives out of logging handlers: logging runs a handler only for a record that passes "
    "the logger's level and filters, and these often differ by rank (accelerate's get_logger logs on "
    "the main process alone unless told main_process_only=False). Reduce or gather the values in the "
    "training loop, on every rank, then log the result.")


def _logged_text(present: dict[int, Op], culprits: list[int], others: list[int],
                 positions: dict[int, Position]) -> str:
    """' The all_gather of ranks 0 and 2 at train.py:28 runs in a logging handler, for the record
    logged at train.py:91: ...' when the culprits' calls do and the others' do not; '' otherwise."""
    logged = [positions[rank].logged_at for rank in culprits if rank in positions]
    if not others or not logged or not all(logged) or any(positions[r].logged_at for r in others
                                                           if r in positions):
        return ""
    op = present[culprits[0]]
    whose = f"rank {culprits[0]}" if len(culprits) == 1 else ranks_text(culprits).lower()
    return (f" The {_op_name(op)} of {whose}{_at_where(op)} {IN_A_HANDLER}, for the record logged at "
            f"{logged[0]}: logging called that handler on {whose} alone, where the record passed the "
            f"logger's level and filters, and {_others_text(others)} went on without it.")


def _none_of_their_branches(present: dict[int, Op], culprits: list[int], others: list[int]) -> str:
    """' The others' barriers are each under a branch on the rank ('if local_rank != 0:' at
    train.py:34 for ranks 1 and 3; 'if rank == 0:' at train.py:42 for rank 0), and rank 2's
    call is not: none of those branches ran on rank 2.' ('' unless so), with a word on tests of
    the local rank paired with tests of the global one: they agree on the first node alone."""
    tests: dict[tuple[str, int, str, str], list[int]] = {}
    for rank in others:
        op = present[rank]
        found = rank_condition(op.file, op.line) if op.file and op.line else None
        if found is None:
            return ""
        tests.setdefault((op.file or "", *found), []).append(rank)
    if len(tests) < 2 or any(rank_conditional(present[r].file, present[r].line) for r in culprits):
        return ""
    said = [f"{_branch_words((line, test, branch), file)} for {ranks_text(ranks).lower()}"
            for (file, line, test, branch), ranks in tests.items()]
    ops = {_op_name(present[rank]) for rank in others}
    calls = f"{ops.pop()}s" if len(ops) == 1 else "calls"
    theirs = f"{_calls_of(culprits)} {'is' if len(culprits) == 1 else 'are'}"
    text = (f" The others' {calls} are each under a branch on the rank ({'; '.join(said)}), and "
            f"{theirs} not: none of those branches ran on {ranks_text(culprits).lower()}.")
    local = [test for _file, _line, test, _branch in tests if _LOCAL_TEST.search(test)]
    if local and len(local) < len(tests):
        text += f" {LOCAL_AND_GLOBAL}"
    return text


_LOCAL_TEST = re.compile(r"local|LOCAL")
LOCAL_AND_GLOBAL = ("A test of the local rank (the process's index on its node) and one of the global rank "
                    "agree on the first node alone: on a job of several nodes, pair branches that test the "
                    "same one.")


def _loop_left_text(present: dict[int, Op], culprits: list[int], positions: dict[int, Position]) -> str:
    """``_left_loop``'s sentence, the culprits as the leavers or as the stayers, and the except that
    swallows errors around the leavers' call when there is one (the stayers may have skipped it)."""
    sites = {rank: _site(op, positions.get(rank)) for rank, op in present.items()}
    mine = sorted(rank for rank in culprits if rank in present)
    others = sorted(rank for rank in present if rank not in culprits)
    left = (_left_loop(sites, mine, others, "the others", positions)
            or _left_loop(sites, others, mine, ranks_text(mine), positions))
    return left + swallowed_text(positions.get(rank) for rank in present) if left else ""


class LoopTurns(NamedTuple):
    """A loop that ran more turns on some ranks (``diagnosis._loop_turns``)."""

    left: list[int]  # the ranks that left it and came round an outer loop to a call before it
    stayed: list[int]  # the ranks that issue its call once more
    call: Op  # the call every rank issued last, in the loop
    header: int  # the loop's header line (in the call's file)
    came_to: list[int]  # the lines the leavers came round to
    calls: int | None  # the leavers' calls of it in a row, where every rank's run of them is on record


KEYED_LOOP_CURE = (
    "Loop over the same items on every rank: a list fixed for the job (every class or key there can "
    "be, not those present in the rank's own data), with a zero for an item a rank lacks; better, "
    "stack the values into one tensor and reduce it in one call.")
_KEYED = re.compile(r"\.(keys|items|values|unique)\(|\b(sorted|set|dict)\(")


def loop_turns_text(turns: LoopTurns, positions: dict[int, Position]) -> str:
    """' Ranks 0 and 1 have left the loop at train.py:40 after 7 calls of all_reduce at
    train.py:41 and come round to train.py:33; rank 2 is still in it, issuing call 8 there: their
    loops ran out first. Its header ('for name in sorted(metrics):') must give every rank as many
    turns.' (``LoopTurns``), with the loop's exits and a swallowing except around the call."""
    call, several = turns.call, len(turns.left) > 1
    name = Path(call.file or "").name
    came = " and ".join(f"{name}:{line}" for line in turns.came_to)
    if turns.calls is not None:
        made = f"after {turns.calls} calls of {_op_name(call)} at {call.where}"
        again = f"issuing call {turns.calls + 1} there"
    else:
        made = f"after {'their' if several else 'its'} calls of {_op_name(call)} at {call.where} in a row"
        again = "issuing it once more"
    stayed = ranks_text(turns.stayed).replace("Rank", "rank") + (" is" if len(turns.stayed) == 1 else " are")
    header = source_line({"file": call.file, "line": turns.header}).strip()
    header_text = f" Its header ('{header[:80]}') must give every rank as many turns." if header else ""
    theirs = "their loops" if several else "its loop"
    return (f" {ranks_text(turns.left)} {'have' if several else 'has'} left the loop at "
            f"{name}:{turns.header} {made} and come round to {came}; {stayed} still in it, {again}: "
            f"{theirs} {LOOP_RAN_OUT}.{header_text}"
            f"{loop_exits_text(call.file or '', turns.header, call.line or 0)}"
            f"{swallowed_text(positions.get(rank) for rank in turns.left + turns.stayed)}")


def loop_turns_cures(turns: LoopTurns) -> list[str]:
    """``KEYED_LOOP_CURE`` first for a loop over a collection's keys or items (a dict of metrics)."""
    header = source_line({"file": turns.call.file, "line": turns.header})
    return [KEYED_LOOP_CURE] if header.lstrip().startswith("for ") and _KEYED.search(header) else []


class TurnSkipped(NamedTuple):
    """Two sides at two lines of one loop's body (``turn_skipped``)."""

    early: list[int]  # the ranks that came round to the loop again
    late: list[int]  # the ranks that wait further down
    file: str  # the loop's file
    header: int  # the loop's header line
    first: int  # the early side's line in the loop
    call_line: int  # the late side's line in the loop (its call, or the call that leads to it)
    inner: list[tuple[str, int]]  # the late side's frames below that line, outermost first


def turn_skipped(present: dict[int, Op], positions: dict[int, Position]) -> TurnSkipped | None:
    """The early and late ranks when the ranks' calls are at two lines of one loop's body and the
    earlier line's call is unconditional in it: the early side came round to the loop again (its
    next turn, or the loop run anew), past the call the late side waits in (skipped by a continue,
    a break or a return between the two, or by a condition around that call); None otherwise. The
    lines are the calls' own, else where the ranks' stacks part in a function that runs the loop
    (the call the late side waits in made from a function called there)."""
    sites = call_sites(present, positions)
    lines = set(sites.values())
    if None in lines or len(lines) != 2:
        return None
    (file, first), (late_file, call_line) = sorted(lines)  # type: ignore[type-var] - no None left
    if file == late_file and _one_turn_apart(file, first, call_line):
        early = sorted(rank for rank, site in sites.items() if site == (file, first))
        late = sorted(rank for rank in sites if rank not in early)
        return TurnSkipped(early, late, file, enclosing_loop(file, call_line) or 0, first, call_line, [])
    return _turn_skipped_on_stacks(sites, positions)


def call_sites(present: dict[int, Op], positions: dict[int, Position]
                     ) -> dict[int, tuple[str, int] | None]:
    """Each rank's call site (``_site``); for a rank whose site is unknown (DDP's call, issued
    from C++, by a rank that left before its stack was read), the one site of the ranks that issued
    the same collective, op and shapes alike."""
    sites = {rank: _site(op, positions.get(rank)) for rank, op in present.items()}
    for rank, site in sites.items():
        if site is None:
            alike = {sites[other] for other, op in present.items()
                     if sites[other] is not None and op.signature() == present[rank].signature()}
            sites[rank] = alike.pop() if len(alike) == 1 else None
    return sites


def skipped_by_exit(skipped: TurnSkipped) -> bool:
    """Did a continue, break or return skip the late side's call on the early side (not only a
    condition around that call)?"""
    return bool(loop_exits_text(skipped.file, skipped.header, skipped.call_line, after=skipped.first)
                or _returns_before_text(skipped.inner))


def _one_turn_apart(file: str, first: int, call_line: int) -> bool:
    """Are two lines in the body of one loop, the earlier unconditional in it?"""
    header = enclosing_loop(file, call_line)
    if header is None or enclosing_loop(file, first) != header \
            or not in_loop_body(file, header, first) or not in_loop_body(file, header, call_line):
        return False
    guard = enclosing_condition(file, first)
    return guard is None or guard[0] <= header  # else a call of its own in this turn, not the next turn's


def _turn_skipped_on_stacks(sites: dict[int, tuple[str, int] | None], positions: dict[int, Position]
                            ) -> TurnSkipped | None:
    """``turn_skipped`` where the two sides' stacks part, one stack on each side."""
    stacks = _two_stacks(sites, positions)
    if stacks is None:
        return None
    (one, one_ranks), (other, other_ranks) = stacks
    depth = _parting(one, other)
    if depth is None:
        return None
    (first, early, above), (call, late, below) = sorted([(one[depth], one_ranks, one),
                                                         (other[depth], other_ranks, other)])
    called = above[depth + 1] if len(above) > depth + 1 else None
    if exits_with_block(first[0], first[1], called, call[1]):  # the earlier line is a with whose
        (first, early), (call, late, below) = (call, late), (first, early, above)  # __exit__ runs last
    if not _one_turn_apart(first[0], first[1], call[1]):
        return None
    return TurnSkipped(sorted(early), sorted(late), first[0], enclosing_loop(*call) or 0, first[1], call[1],
                       list(below[depth + 1:]))


class ReturnedEarly(NamedTuple):
    """One side returned from a call the other side is still in (``returned_early``)."""

    returned: list[int]  # the ranks past the call, in a later collective
    inside: list[int]  # the ranks still in it
    call: tuple[str, int]  # the call's file and line, in the function both sides' stacks share
    skips: list[str]  # what leaves it before the inside ranks' line: a return, an except that swallows
    tests: list[str]  # those returns' tests


def returned_early(present: dict[int, Op], positions: dict[int, Position]) -> ReturnedEarly | None:
    """The two sides when their stacks part at two lines of one function, one side still inside the
    call at the earlier line and the other past it, and that call's function (or one it calls, on the
    way to the inside side's collective) can leave before it: a return above the line, or an except
    around it that swallows errors ('if not os.path.isfile(path): return 0' on the ranks of a node
    without the file). None otherwise; and when the call runs a loop a break or return can leave (a
    loop that ran out first), or holds the inside side's line under an ``if`` (which may have skipped
    it), or the two lines share a loop whose turn can skip the later one (the earlier side may have
    come round again: ``turn_skipped``)."""
    stacks = _two_stacks(call_sites(present, positions), positions)
    if stacks is None or (depth := _parting(stacks[0][0], stacks[1][0])) is None:
        return None
    (behind, inside), (ahead, returned) = sorted(stacks, key=lambda stack: stack[0][depth][1])
    (file, line), later = behind[depth], ahead[depth][1]
    if len(behind) <= depth + 1 or later <= line or _turn_can_skip(file, line, later) \
            or exits_with_block(file, line, behind[depth + 1], later):  # a with's __exit__ runs last
        return None
    frames = behind[depth + 1:]
    if any(_leaves_its_loop(*frame) or _guarded(*frame) for frame in frames):
        return None
    skips, tests = _early_exits(frames)
    if not skips:
        return None
    return ReturnedEarly(sorted(returned), sorted(inside), (file, line), skips, tests)


def _early_exits(frames: Sequence[tuple[str, int]]) -> tuple[list[str], list[str]]:
    """What can leave each frame's function before its line (``returned_early``): the returns above
    it and an except around it that swallows errors, as clauses; and those returns' tests."""
    skips: list[str] = []
    tests: list[str] = []
    for file, line in frames:
        name = Path(file).name
        for at, test in returns_before(file, line):
            where = "on the ranks where its condition holds" if test else "on every rank that gets there"
            skips.append(f"the return at {name}:{at}{_exit_condition(test)} leaves before {name}:{line} "
                         f"{where}")
            tests.append(test)
        caught = swallowing_handler(file, line)
        if caught is not None:
            skips.append(f"the '{caught[1]}' at {name}:{caught[0]} {SWALLOWED}, so an error raised in "
                         f"its try before {name}:{line} leaves it on the ranks that raised it")
    return skips, tests


def _turn_can_skip(file: str, line: int, later: int) -> bool:
    """Do two lines share a loop whose turn can skip the later one after the earlier one (a
    continue, break or return between them, or a condition around it, inside the loop)?"""
    header = enclosing_loop(file, later)
    if header is None or not share_a_loop(file, line, later):
        return False
    guard = enclosing_condition(file, later)
    return bool(loop_exits_text(file, header, later, after=line)) or (guard is not None and guard[0] > header)


def _guarded(file: str, line: int) -> bool:
    """Is ``line`` under an ``if`` of its own function (what may have skipped it, rather than a
    return or an error)?"""
    guard = enclosing_condition(file, line)
    return guard is not None and guard[0] > (enclosing_function(file, line) or 0)


def _leaves_its_loop(file: str, line: int) -> bool:
    """Is ``line`` in a loop of its function that a break or return can leave?"""
    header = loop_returned_from(file, line)
    return header is not None and any(keyword in ("break", "return")
                                      for keyword, _at, _test in loop_exits(file, header, line))


# a test that reads the filesystem: each node reads its own (a relative path: each agent's working folder)
_FILE_TEST = re.compile(r"\b(os\.path\.(exists|isfile|isdir|getsize)|glob(\.glob)?)\(|"
                        r"\.(exists|is_file|is_dir)\(\)")
RETURNS_EARLY = "returned early from the call at"  # in a summary: ``returned_early``
FILE_TEST = "reads this node's own filesystem"  # in a summary: a skip decided by a file's presence
FILE_TEST_CURE = (
    "Decide from a file once, on one rank, and send the answer to every rank: found = "
    "[os.path.isfile(path)] on rank 0, [None] elsewhere; dist.broadcast_object_list(found, src=0) "
    "(accelerate: accelerate.utils.broadcast_object_list); or keep the file on storage every node "
    "mounts, at a path that is the same on every node (not relative to each agent's working folder).")


def returned_early_text(early: ReturnedEarly, present: dict[int, Op]) -> str:
    """' Ranks 2 and 3 have returned early from the call at train.py:72 that ranks 0 and 1 are still
    in, at train.py:48 (their broadcast): the return at train.py:43 (if not os.path.isfile(path))
    leaves before train.py:48 on the ranks where its condition holds.' (``returned_early``), with a
    word on a test of the filesystem."""
    several, waited = len(early.returned) > 1, present[early.inside[0]]
    stay = "is" if len(early.inside) == 1 else "are"
    at = f", at {waited.where} (their {_op_name(waited)})" if waited.where else ""
    text = (f" {ranks_text(early.returned)} {'have' if several else 'has'} {RETURNS_EARLY} "
            f"{Path(early.call[0]).name}:{early.call[1]} that {ranks_text(early.inside).lower()} {stay} "
            f"still in{at}: {'; '.join(early.skips[:3])}.")
    if any(_FILE_TEST.search(test) for test in early.tests):
        text += (f" A test of a file's presence {FILE_TEST}, and a relative path each agent's own working "
                 "folder: a file one node wrote is missing on the others unless it is on storage they "
                 "all mount.")
    return text


def _two_stacks(sites: dict[int, tuple[str, int] | None], positions: dict[int, Position]
                ) -> list[tuple[tuple[tuple[str, int], ...], list[int]]] | None:
    """The ranks' user frames (outermost first) when they make two stacks, each ending at its ranks'
    call site, with the ranks of each; a rank without a stack joins the one stack at its site. None
    otherwise."""
    stacks: dict[tuple, list[int]] = {}
    unread = []  # ranks without a stack: with those of the ranks at the same line, if one stack
    for rank in sites:
        stack = tuple(_user_frames(positions.get(rank)))
        if not stack:
            unread.append(rank)
        elif stack[-1] != sites[rank]:  # a stack that is not at this call
            return None
        else:
            stacks.setdefault(stack, []).append(rank)
    for rank in unread:
        alike = [stack for stack in stacks if stack[-1] == sites[rank]]
        if len(alike) != 1:
            return None
        stacks[alike[0]].append(rank)
    return list(stacks.items()) if len(stacks) == 2 else None


def _parting(one: Sequence[tuple[str, int]], other: Sequence[tuple[str, int]]) -> int | None:
    """The depth at which two stacks of user frames (outermost first) part, when they part at two
    lines of one function (the same calls above); None otherwise."""
    for depth, (here, there) in enumerate(zip(one, other, strict=False)):
        if here != there:
            same = here[0] == there[0] and enclosing_function(*here) == enclosing_function(*there)
            return depth if same else None
    return None


def _next_turn(present: dict[int, Op], positions: dict[int, Position]) -> str:
    """' Rank 3 has come round to the loop at train.py:5 again without the barrier at train.py:9
    that the others wait in (...). In that loop, the continue at train.py:8 (if ...) skips ...'
    (``turn_skipped``; '' otherwise)."""
    skipped = turn_skipped(present, positions)
    if skipped is None:
        return ""
    early, late, file, header, first, call_line, inner = skipped
    name, several = Path(file).name, len(early) > 1
    waited = present[late[0]]
    at = (f"at {waited.where} (from the call at {name}:{call_line})" if inner and waited.where
          else f"at {name}:{call_line}")
    past = all((pos := positions.get(rank)) is not None and pos.op is not None and pos.op.pg == waited.pg
               and None not in (pos.seq, waited.seq) and pos.seq > waited.seq
               for rank in late)  # paired with the skipping ranks' next call
    waits = f"{'waits' if len(late) == 1 else 'wait'} in" if not past else f"issued as #{waited.seq}"
    text = (f" {ranks_text(early)} {'have' if several else 'has'} {LATER_TURN} {name}:{header} again "
            f"without the {_op_name(waited)} {at} that {_others_text(late)} {waits} (its next turn, or the "
            "loop run anew).")
    guard = enclosing_condition(file, call_line)
    if guard is not None and guard[0] > header:
        text += f" {UNDER_GUARD} {_branch_words(guard, file)}."
    text += _swallowed_at(waited, file, call_line, f"{name}:{call_line}")  # an error caught skipped it
    return text + loop_exits_text(file, header, call_line, after=first) + _returns_before_text(inner)


ON_THE_WAY = "On the way, "  # a return in a function called in the loop, before the call: a skip too


def _returns_before_text(frames: list[tuple[str, int]]) -> str:
    """' On the way, the return at lib.py:47 (if not math.isfinite(loss)) leaves its function before
    that call, ...' for each return above a frame's line in its function, along the frames that
    lead from the loop to the call (a function called in the loop that can leave before its call)."""
    parts = [f"the return at {Path(file).name}:{line}{_exit_condition(test)}"
             for file, call_line in frames for line, test in returns_before(file, call_line)]
    if not parts:
        return ""
    leaves = "each leave their function" if len(parts) > 1 else "leaves its function"
    return (f" {ON_THE_WAY}{' and '.join(parts[:3])} {leaves} before that call, on some ranks alone when "
            f"{'its' if len(parts) == 1 else 'the'} condition differs between them.")


def _calls_of(ranks: list[int]) -> str:
    """"rank 2's call", "the calls of ranks 0 and 2"."""
    return f"rank {ranks[0]}'s call" if len(ranks) == 1 else f"the calls of {ranks_text(ranks).lower()}"


def _left_loop(sites: dict[int, tuple[str, int] | None], leavers: list[int], stayers: list[int],
               stayers_text: str, positions: dict[int, Position]) -> str:
    """``_different_path``'s loop sentence when every leaver's call lies past the end of the loop
    that holds every stayer's call ('' otherwise, and when a leaver's call, still inside an outer
    loop that holds the stayers' too, is under a branch on the rank or a condition each rank decides
    for itself: the stayers may have gone round that outer loop past a call of the leaver's own, as
    with 'if accelerator.is_main_process: accelerator.save_state()' after the batch loop)."""
    if not leavers:
        return ""
    found = (_loop_at_sites(sites, leavers, stayers, positions)
             or _loop_returned_from(leavers, stayers, positions))
    if found is None:
        return ""
    file, header, line, call = found
    several = len(leavers) > 1
    stay = "is" if len(stayers) == 1 and not stayers_text.startswith("the") else "are"
    those = "those ranks" if several else "that rank"
    returned = (f" (inside the call at {Path(call[0]).name}:{call[1]}, which {those} "
                f"{'have' if several else 'has'} returned from)") if call is not None else ""
    return (f" {ranks_text(leavers)} {'have' if several else 'has'} left the loop at "
            f"{Path(file).name}:{header} that {stayers_text.replace('Rank', 'rank')} {stay} still "
            f"in{returned}: {'their loops' if several else 'its loop'} {LOOP_RAN_OUT} (a DataLoader with "
            f"fewer batches on {those}, as with accelerate's even_batches=False, a break or a condition "
            f"that holds on {those} alone, or a collective {those} skipped inside it, as DDP's no_sync() "
            f"does).{loop_exits_text(file, header, line)}")


_LoopLeft = tuple[str, int, int, "tuple[str, int] | None"]  # file, loop header, the stayers' line, the call


def _loop_at_sites(sites: dict[int, tuple[str, int] | None], leavers: list[int], stayers: list[int],
                   positions: dict[int, Position]) -> _LoopLeft | None:
    """The loop every stayer's call is in and every leaver's call, in the same function, lies past
    (``source.loop_left``): (file, its header, the stayers' line, None)."""
    inside = {sites[rank] for rank in stayers}
    if len(inside) != 1 or None in inside or any(sites[rank] is None for rank in leavers):
        return None
    file, line = inside.pop()
    headers = {loop_left(file, line, site[1]) if site[0] == file else None
               for site in (sites[rank] for rank in leavers) if site is not None}
    if len(headers) != 1 or None in headers:
        return None
    if any(share_a_loop(file, line, site[1]) and _in_a_branch(site, positions.get(rank))
           for rank in leavers if (site := sites[rank]) is not None):
        return None
    return file, headers.pop(), line, None


def _loop_returned_from(leavers: list[int], stayers: list[int], positions: dict[int, Position]
                        ) -> _LoopLeft | None:
    """The same read on the ranks' stacks, for a loop in a function the collective is called from:
    where every leaver's user frames part from the stayers' (one stack for all stayers), the leavers
    are past the stayers' line in the same function, and the stayers are inside a loop there, or
    inside a call there whose function (or one it calls) runs a loop the leavers have returned
    from: (the loop's file, its header, the stayers' line in it, that call's file and line)."""
    stacks = {tuple(_user_frames(positions.get(rank))) for rank in stayers}
    if len(stacks) != 1:
        return None
    stay = list(stacks.pop())
    found = {_parted(stay, _user_frames(positions.get(rank))) for rank in leavers}
    return found.pop() if len(found) == 1 and None not in found else None


def _user_frames(pos: Position | None) -> list[tuple[str, int]]:
    return [(file, line) for file, line, _where in pos.callers] if pos is not None else []


def _parted(stay: list[tuple[str, int]], leave: list[tuple[str, int]]) -> _LoopLeft | None:
    """``_loop_returned_from`` for one leaver's frames against the stayers'."""
    depth = _parting(stay, leave)
    if depth is None:
        return None
    (file, line), there = stay[depth], leave[depth]
    if there[1] <= line:
        return None
    if share_a_loop(file, line, there[1]) and any(_under_condition(*frame) for frame in leave[depth:]):
        return None  # a turn ahead past a call of its own (see ``_left_loop``)
    header = loop_left(file, line, there[1])
    if header is not None:
        return file, header, line, None
    for inner in stay[depth + 1:]:
        header = loop_returned_from(*inner)
        if header is not None:
            return inner[0], header, inner[1], stay[depth]
    return None


def loop_exits_text(file: str, header: int, call_line: int, after: int | None = None) -> str:
    """' In that loop, the continue at train.py:13 (if torch.isnan(loss)) skips the rest of its
    turn: it can end a turn on some ranks alone, ...' for the statements that can end a turn of the
    loop before the call at ``call_line`` (``source.loop_exits``), hedged (``EXIT_HEDGE``) when none
    is ``_telling``; '' when there are none. ``after``: only the exits between that line and the call
    (what skipped the call once that line had run; not the loop's own test)."""
    exits = [exit_ for exit_ in loop_exits(file, header, call_line)
             if after is None or (exit_[0] != "while" and after < exit_[1] < call_line)]
    if not exits:
        return ""
    name = Path(file).name
    parts = [f"its test at {name}:{line} ({test}) ends it once false" if keyword == "while" else
             f"the {keyword} at {name}:{line}{_exit_condition(test)} {_EXIT_EFFECTS[keyword]}"
             for keyword, line, test in exits[:3]]
    more = f" (and {len(exits) - 3} more)" if len(exits) > 3 else ""
    each = "each" if len(exits) > 1 else "it"
    hedge = "" if any(_telling(file, *exit_) for exit_ in exits) else f"{EXIT_HEDGE}, "
    return (f" {LOOP_EXITS}{'; '.join(parts)}{more}: {hedge}{each} can end a turn on some ranks alone, "
            "leaving them fewer collectives than the others.")


_PER_RANK = re.compile(r"\b(loss|nan|isnan|isinf|isfinite|time|perf_counter|monotonic|random|rand|"
                       r"randint|batch|grad|norm)\b", re.IGNORECASE)
# a name with such a word as one of its parts: local_loss, val_loss_mean, train_accuracy, f1_score; not
# an attribute (args.loss_type, scaler.loss_scale: a setting's) nor a setting's own name (log_loss_every,
# loss_weight, use_loss_scaling, accuracy_threshold)
_PER_RANK_PART = re.compile(r"(?<![\w.])(?:\w+_)?(loss|losses|accuracy|score)(?:_\w+)?\b", re.IGNORECASE)
_SETTING = re.compile(r"(_(every|steps|interval|freq|frequency|scale|scaling|type|fn|func|weight|weights|"
                      r"threshold|name|mode|kind|coef|factor)$)|^(use|num|max|min)_", re.IGNORECASE)
_STRING = re.compile(r"""(['"]).*?\1""")  # a literal in a test: its words are not values
# a tensor reduced to a value in the test ('if over.sum() > 0:', 'if mask.any():'): the rank's own data
_TENSOR_VALUE = re.compile(r"\.(sum|any|all|item|max|min|mean|numel|count_nonzero)\(|"
                           r"\btorch\.(any|all|isnan|isinf|isfinite|count_nonzero)\(")


def _per_rank_value(test: str) -> bool:
    """Does a condition's text read a value each rank computes for itself (its loss, the clock, a
    random draw, its batch, a tensor it reduces to a number)?"""
    test = _STRING.sub("", test)
    if _PER_RANK.search(test) or _TENSOR_VALUE.search(test):
        return True
    return any(not _SETTING.search(found.group(0)) for found in _PER_RANK_PART.finditer(test))


def _telling(file: str, keyword: str, line: int, test: str) -> bool:
    """Is a loop's exit likely to differ between ranks: a continue (it skips a turn's collectives,
    where uneven data would end the loop instead), or a condition on the rank or on a value each
    rank computes for itself (its loss, the clock, its batch), in its text or in what gives its
    names their values in that function (a patience count kept from each rank's own loss)?
    ``if step >= max_steps: break`` is not: it keeps its sentence, hedged, and the uneven-loop cure
    leads."""
    if keyword == "continue" or mentions_rank(test) or _per_rank_value(test):
        return True
    return any(mentions_rank(text) or _per_rank_value(text) for text in values_read(file, line, test))


def _exit_condition(test: str) -> str:
    """' (if x > 3)', ' (in except ValueError)', or '' for an exit taken unconditionally."""
    if not test:
        return ""
    return f" (in {test})" if test.startswith("except") else f" (if {test})"


def _site(op: Op, pos: Position | None) -> tuple[str, int] | None:
    """The user's file and line of a rank's call (its position's when the op has none: DDP's)."""
    if op.file and op.line:
        return op.file, op.line
    if pos is not None and pos.op is not None and pos.seq == op.seq and pos.file and pos.line:
        return pos.file, pos.line
    return None


GOES_FIRST_CURE = (
    "Take collectives out of a main_process_first block: it runs the block on the main process while "
    "the other ranks wait in a barrier (wait_for_everyone), then on them, so a gather or reduce inside "
    "it meets that barrier. Issue it before or after the block, on every rank.")


def goes_first_summary(key: tuple[str, int], present: dict[int, Op], inside: list[int],
                       header: str) -> str:
    """Ranks inside a ``main_process_first`` block issued a collective while the others wait in
    the block's own barrier at ``header`` ('train.py:12'): the block runs on the main process (per
    node, for ``local_main_process_first``) and on the others at different times, each side
    waiting for the other in a barrier at the header (accelerate state.py ``_goes_first``)."""
    parts = _together([(rank, f"in {_op_name(op)}{' at ' + op.where if op.where else ''}"
                               + (" inside the main_process_first block" if rank in inside
                                  else ", that block's own barrier"))
                              for rank, op in sorted(present.items())])
    return (f"Ranks issued different collectives as collective #{key[1]}: " + "; ".join(parts)
            + f". The block at {header} runs on the main process and on the others at different times, "
            "each side waiting for the other in a barrier at its header, so a collective inside it meets "
            "that barrier.")


ROOT_CURE = (
    "Pass every rank the same root: a global rank written as a number (src=0, dst=0), not one each "
    "rank computes for itself (accelerator.process_index, a node's first rank, the rank that holds the "
    "data); a rank that holds what to send is told to the others first (broadcast its number from rank 0).")


def root_summary(key: tuple[str, int], present: dict[int, Op], culprits: list[int]) -> str:
    """The ranks called one rooted collective with different roots (src or dst)."""
    op = next(iter(present.values()))
    site = next((o.where for o in present.values() if o.where), None)
    argument = ROOTS.get(canonical_op(op.op), "src")
    parts = _together([(rank, f"{argument}={o.root}") for rank, o in sorted(present.items())])
    odd = (f"{ranks_text(culprits)} differ{'s' if len(culprits) == 1 else ''} from the others. "
           if len(culprits) < len(present) else "")
    return (f"Ranks called {_op_name(op)}{' at ' + site if site else ''} (collective #{key[1]}) with "
            f"different roots: {'; '.join(parts)}. {odd}Every rank must pass the same {argument}, a "
            f"global rank ({argument}=0, not {argument}=accelerator.process_index).{_hashed_root(present)}")


SALTED_HASH = "Python salts hash() of a str or bytes per process (PYTHONHASHSEED)"


def _hashed_root(present: dict[int, Op]) -> str:
    """' Its root, owner, is read from 'hash(name) % world': Python salts hash() ...' when the root
    the call passes is computed with hash() ('' otherwise): each rank computes another number."""
    op = next((o for o in present.values() if o.file and o.line), None)
    root = root_argument(op.file, op.line) if op is not None else None
    if root is None:
        return ""
    read = [root, *_read_through(op.file, op.line or 0, root)]
    hashed = next((text for text in read if "hash(" in text), None)
    if hashed is None:
        return ""
    return (f" Its root, {root}, is read from '{hashed}': {SALTED_HASH}, so each rank computes a number of "
            "its own; choose the root from something every rank holds alike (an index in a sorted list, "
            "zlib.crc32 of the name's bytes).")


def exited_summary(culprits: list[int], positions: dict[int, Position]) -> str:
    """How each culprit rank ended, and who still needed it."""
    needing = [p for p in positions.values()
               if (p.state == "in-collective" or p.victim) and p.rank not in culprits]
    finished = [rank for rank in culprits
                if positions[rank].state == "finished" and not positions[rank].exit_call]
    its = "its" if len(finished) == 1 else "their"
    destroyed = _destroyed_text(positions[finished[0]]) if len(finished) == 1 else ""
    sentences = [f"{ranks_text(finished)} finished {its} work{destroyed}"] if finished else []
    sentences += [f"Rank {rank} {_exit_call_text(positions[rank])}" for rank in culprits
                  if positions[rank].state == "finished" and positions[rank].exit_call]
    alike: dict[tuple[str, str | None], list[int]] = {}  # ranks that ended the same way at one line
    for rank in culprits:
        if positions[rank].state != "finished":
            alike.setdefault((positions[rank].detail, positions[rank].where), []).append(rank)
    for ranks in alike.values():
        sentences.append(f"{ranks_text(ranks)} {_ended_how(positions[ranks[0]], len(ranks) > 1)}")
    text = "; ".join(sentences)
    if needing:
        waits = ", ".join(f"rank {p.rank} in {_op_name(p.op)}{_at(p)}" for p in needing)
        text += f" while other ranks still needed {'it' if len(culprits) == 1 else 'them'} ({waits})"
    return text + "." + (_caught_before_destroy(positions[finished[0]]) if len(finished) == 1 else "")


SIZE_ABORT = (
    "gloo ends a rank this way when its collective receives more data than its own call expects (its "
    "log: 'Received data size doesn't match expected size. Is there a distributed collective mismatch "
    "in your code?')")
ABORT_CAUSES = (SIZE_ABORT + ", or when a peer's connection closes under it; NCCL's watchdog, when a "
                "collective times out.")
PAIRED_APART = ("Every other rank was still in a collective, so those calls were paired as one: "
                + SIZE_ABORT + ".")


_RETRIED = "that rank, which then called the function again alone"
_RETRIED_EACH = "those ranks, each of which then called the function again alone"


def batch_sizes_text(sizes: dict[int, int]) -> str:
    """' The ranks run accelerate's find_executable_batch_size with different batch sizes: rank 0 at
    64; rank 1 at 57 (lowered after an out-of-memory error on that rank, ...).'"""
    largest = max(sizes.values())
    parts = _together([(rank, f"at {size}") for rank, size in sorted(sizes.items())])
    lowered = sorted(rank for rank, size in sizes.items() if size < largest)
    return (f" The ranks run accelerate's find_executable_batch_size with different batch sizes: "
            f"{'; '.join(parts)} (lowered after an out-of-memory error on "
            f"{_RETRIED if len(lowered) == 1 else _RETRIED_EACH}).")


def aborted_note(aborted: list[Position]) -> str:
    """' Rank 1 was killed by SIGABRT inside all_reduce at train.py:17: gloo ends a rank this way ...'
    for the ranks killed by SIGABRT inside a collective (those in one call named together)."""
    calls: dict[str, list[int]] = {}
    for pos in aborted:
        calls.setdefault(f"{_op_name(pos.op)}{_at(pos)}", []).append(pos.rank)
    said = [f"{ranks_text(ranks)} {'were' if len(ranks) > 1 else 'was'} killed by SIGABRT inside {call}"
            for call, ranks in calls.items()]
    text = "; ".join([said[0], *(part[0].lower() + part[1:] for part in said[1:])])
    return f" {text}: {ABORT_CAUSES}"


def aborted_summary(dead: int, different: list[int], positions: dict[int, Position],
                    from_cpp: list[int]) -> str:
    """'Rank 1 was killed by SIGABRT inside all_reduce at train.py:17 while rank 0 was in all_reduce at
    train.py:11, issued by DDP inside backward(): ...; those calls were paired as one collective ...'
    (``diagnosis._aborted_on_different_calls``); ``from_cpp``: the ranks whose collective no Python
    call issued (DDP's, from C++)."""
    pos = positions[dead]
    said = []
    for other in sorted(different):
        at = positions[other]
        issued = ", " + issued_from_cpp_at(at) if other in from_cpp else ""
        said.append((other, f"in {_op_name(at.op)}{_at(at)}{issued}"))
    others = (f"while rank {said[0][0]} was {said[0][1]}" if len(said) == 1
              else f"while other ranks were in other calls: {'; '.join(_together(said))}")
    return (f"Rank {dead} was {pos.detail} inside {_op_name(pos.op)}{_at(pos)} {others}. "
            f"{PAIRED_APART}"
            f"{_deciding_condition(pos) or swallowed_text([pos, *map(positions.get, different)])}")


SWALLOWED = "swallows what it catches"  # in a summary: a collective in a try whose except re-raises nothing
SWALLOWED_END = "re-raises nothing"  # in a summary: a rank ended through a finally after such an except
SWALLOWED_END_CURE = (
    "Let an error end the rank that raised it: in the except, re-raise after logging it (raise, or "
    "sys.exit(1)), so that its launcher sees the rank fail and stops the job; caught and followed by "
    "destroy_process_group(), it leaves with exit 0 while the other ranks wait in their next collective.")
SWALLOW_CURE = (
    "Keep collectives out of a try whose except swallows errors: compute the value first (guard the "
    "division by zero, the missing key), then call the collective on every rank outside the try; or, on "
    "an error, reduce a flag across the ranks so that every rank skips the call together.")


def swallowed_text(positions: Iterable[Position | None]) -> str:
    """' The all_reduce at train.py:26 is in a try whose 'except Exception:' at train.py:28 swallows
    what it catches: ...' for the first of these ranks' calls in such a try; '' when none is."""
    for pos in positions:
        if pos is not None and pos.op is not None and pos.file:
            said = _swallowed_at(pos.op, pos.file, pos.line, pos.where)
            if said:
                return said
    return ""


def _swallowed_at(op: Op, file: str, line: int | None, where: str | None) -> str:
    """``swallowed_text`` of one call: ``op`` at ``file``:``line`` (shown as ``where``)."""
    found = swallowing_handler(file, line)
    if found is None:
        return ""
    return (f" The {_op_name(op)}{f' at {where}' if where else ''} is in a try whose '{found[1]}' at "
            f"{Path(file).name}:{found[0]} {SWALLOWED}: an error raised in that try on one rank before the "
            "call (computing its argument, say) skips the call on that rank alone, silently, and it goes "
            "on to its next collective.")


def _deciding_condition(pos: Position) -> str:
    """' Rank 1's call is under 'if time.time() - last > 30:' at train.py:16, a condition each rank
    decides for itself.' (``decided_per_rank``), or '..., a branch on the rank.'; '' otherwise."""
    under = _under_condition(pos.file, pos.line)
    return f" Rank {pos.rank}'s call is {under}." if under else ""


def _under_condition(file: str | None, line: int | None) -> str:
    """"under 'if rank == 1:' at train.py:10, a branch on the rank", or "under 'if loss < best:' at
    ..., a condition each rank decides for itself" for the innermost such ``if`` around a line; ''."""
    on_rank = rank_condition(file, line)
    found = on_rank or decided_per_rank(file, line)
    if found is None:
        return ""
    what = "a branch on the rank" if on_rank else DECIDES_ITSELF
    return f"under {_branch_words(found, file or '')}, {what}"


def decided_per_rank(file: str | None, line: int | None) -> tuple[int, str, str] | None:
    """The innermost ``if`` around a line when its test is on a value each rank computes for itself
    (its loss, the clock, a random draw: ``_PER_RANK``), or on one the function computes from the
    rank's own share of the data ('if unlabeled:' from 'unlabeled = [r for r in local if ...]' from
    'local = records[start:start + per]' from 'start = accelerator.process_index * per':
    ``_read_through``); None otherwise, and for a test on the rank (``rank_condition`` names that
    branch as one on the rank)."""
    found = enclosing_condition(file, line)
    if found is None or mentions_rank(found[1]) or rank_condition(file, line) == found:
        return None
    if _per_rank_value(found[1]) or any(mentions_rank(text) or _per_rank_value(text)
                                        for text in _read_through(file, found[0], found[1])):
        return found
    return None


READ_DEPTH = 4  # assignments followed back from a condition's names (a shard, a filter of it, its length)


def _read_through(file: str | None, line: int, test: str) -> list[str]:
    """The values that give a condition's names their values in its function, followed back
    ``READ_DEPTH`` assignments (``values_read`` of each)."""
    seen: list[str] = []
    frontier = [test]
    for _ in range(READ_DEPTH):
        frontier = [text for each in frontier for text in values_read(file, line, each) if text not in seen]
        seen.extend(frontier)
    return seen


DECIDES_ITSELF = "a condition each rank decides for itself"
CONDITION_CURE = (
    "Decide a condition around a collective alike on every rank: count steps instead of reading the "
    "clock (if step % log_every == 0:), or reduce the condition across the ranks first (flag = "
    "accelerator.reduce(torch.tensor([float(condition)], device=accelerator.device), 'sum').item() > 0) "
    "and take the branch on every rank when any rank would.")


def loop_ran_longer(loop: str, finished: list[int], positions: dict[int, Position],
                    caught: bool = False) -> str:
    """' The loop at gen.py:8 ran out first on rank 1: its last collective was #2 at gen.py:10, the
    call the others still wait in as #3.' ``caught``: the summary says the rank ended through a
    finally after an except that swallows errors (``SWALLOWED_END``), which may have ended the loop
    as well: said so."""
    last = positions[finished[0]]
    waiting = sorted({p.seq for p in positions.values() if p.rank not in finished and p.op and p.seq})
    numbers = " and ".join(f"#{seq}" for seq in waiting)
    where = next((p.where for p in positions.values() if p.rank not in finished and p.where and p.op
                  and (p.state == "in-collective" or p.victim)), None)
    waiting_at = next((p for p in positions.values() if p.rank not in finished and p.where == where), None)
    exits = ""
    if waiting_at is not None and waiting_at.file and waiting_at.line and ":" in loop:
        exits = loop_exits_text(waiting_at.file, int(loop.rsplit(":", 1)[1]), waiting_at.line)
    how = ", or an error raised in it was caught by that except" if caught else ""
    return (f" The loop at {loop} {LOOP_RAN_OUT} on {ranks_text(finished).lower()}{how}: "
            f"{'its' if len(finished) == 1 else 'their'} last collective was #{last.seq} at {where}, "
            f"the call the others still wait in as {numbers}.{exits}")


def _exit_call_text(pos: Position, code: str = "") -> str:
    """"left through sys.exit(0) at train.py:12, inside the loop at train.py:8 (under 'if rank == 1
    and step == 3:' at train.py:10, a branch on the rank)": an early exit in a loop, on this rank."""
    file, line = pos.exit_from or (pos.file, pos.line)
    loop = enclosing_loop(file, line)
    inside = f", inside the loop at {Path(file or '').name}:{loop}" if loop else ""
    if pos.exit_from is not None:  # in a function called there
        inside = f", in a function called at {Path(file).name}:{line}{inside}"
    under = next((said for frame in [(pos.file, pos.line), *pos.exit_callers]
                  if (said := _under_condition(*frame))), "")
    return f"left through {pos.exit_call}{code}{_at(pos)}{inside}{f' ({under})' if under else ''}"


def _ended_how(pos: Position, several: bool) -> str:
    """'raised ValueError: ... at train.py:7', 'was killed by SIGABRT after its last collective at ...'."""
    if pos.exit_call:
        return _exit_call_text(pos, f" ({pos.detail})")
    if pos.detail.startswith("raised"):
        return pos.detail + _at(pos)
    if pos.detail.startswith("killed"):
        killed = pos.detail  # 'killed: no exception and no exit code, ...' reads 'killed (no exception ...)'
        if killed.startswith("killed: "):
            killed = f"killed ({killed.removeprefix('killed: ')})"
        how = f"{'were' if several else 'was'} {killed}"
        if pos.op is not None and pos.where:  # in that call as it died (its open record, or its last stack)
            return f"{how} inside {_op_name(pos.op)}{_at(pos)}"
    else:  # a rank without any record (it ended before its first reached the doctor): no detail
        how = f"ended ({pos.detail})" if pos.detail else "ended, nothing of it seen (no record, no exit code)"
    return how + (f" after {'their' if several else 'its'} last collective{_at(pos)}" if pos.where else "")


def _branch_text(pos: Position) -> str:
    """' (from its call at train.py:41)': the caller that sits in the branch on the rank, when the
    branch is not around the collective's own line."""
    branch = _branch_site(pos)
    return f" (from its call at {branch})" if branch else ""


def _in_a_branch(site: tuple[str, int], pos: Position | None) -> bool:
    """Is a rank's call at ``site`` under a branch on the rank (its own line's, or a caller's, when
    the rank is still there) or under a condition each rank decides for itself?"""
    if _under_condition(*site):
        return True
    return pos is not None and pos.op is not None and (pos.file, pos.line) == site and bool(_branch_site(pos))


def _own_branch(pos: Position) -> str:
    """"'if accelerator.is_main_process:' at train.py:40" (or "the else of 'if ...:' at ...", "'elif
    ...:' at ..."): the branch on the rank around the collective's own line ('' when there is none)."""
    file, line = pos.file or (pos.op and pos.op.file), pos.line or (pos.op and pos.op.line)
    found = rank_condition(file, line) if pos.op is not None else None
    if not found:
        return ""
    return _branch_words(found, file)


def _branch_words(found: tuple[int, str, str], file: str) -> str:
    """"'if x:' at train.py:7", "the else of 'if x:' at ...", "'elif x:' at ...", "'@accelerator.
    on_main_process' at ...": an ``if`` (or a decorator) as ``source.rank_condition`` gives it."""
    at, test, branch = f"{Path(file).name}:{found[0]}", found[1], found[2]
    if branch == "@":  # a decorator that runs its function on some ranks alone
        return f"'@{test}' at {at}"
    if branch == "else":
        return f"the else of 'if {test}:' at {at}"
    return f"'{branch} {test}:' at {at}"


def _branch_site(pos: Position) -> str | None:
    """Where a caller of the rank's collective sits in a branch on the rank, when that is not the
    collective's own line ('train.py:41', where ``evaluate(model)`` is called)."""
    from helpers.doctor.diagnosis import rank_branch  # the diagnosis imports this module

    branch = rank_branch(pos)
    return branch if branch and branch != (pos.where or (pos.op and pos.op.where)) else None


def extra_collective_summary(extra: list[int], positions: dict[int, Position]) -> str:
    """Ranks that called a collective in a rank-dependent branch the others finished without."""
    calls, failures = [], []
    for rank in extra:
        pos = positions[rank]
        seq = f" (collective #{pos.seq})" if pos.seq is not None else ""
        branch = _branch_text(pos)
        calls.append(f"rank {rank} called {_op_name(pos.op)}{_at(pos)}{seq}{branch}")
        if pos.state == "exited" and pos.op.error:
            failures.append(f"Rank {rank} then failed in it as they left: {short_error(pos.op.error)}")
    others = sorted(rank for rank in positions if rank not in extra)
    one = len(others) == 1
    last = max((positions[rank].seq or 0 for rank in others), default=0)
    text = "; ".join(calls)
    own = {_own_branch(positions[rank]) for rank in extra}  # one branch around every call: named
    branch = "a rank-dependent branch"
    if len(own) == 1 and "" not in own:
        named = own.pop()
        branch = named if named.startswith("the else") else f"the rank-dependent branch {named}"
    text = (text[0].upper() + text[1:] + f" inside {branch}; {ranks_text(others).lower()} "
            f"never call{'s' if one else ''} it: {'it' if one else 'they'} finished "
            f"{'its' if one else 'their'} work{f' after collective #{last}' if last else ''}.")
    return " ".join([text, *failures])


def unborn_ranks_summary(culprits: list[int], positions: dict[int, Position]) -> str:
    """Every rank the launch started waits in init_process_group, ``culprits``' calls for a world
    larger than the launch's: they wait for ranks that were never started."""
    count = len(positions)
    asked = max(op.world or 0 for rank in culprits if (op := positions[rank].op) is not None)
    whose = "on every rank" if len(culprits) == count else f"on {ranks_text(culprits).lower()}"
    never = f"rank {count}" if asked == count + 1 else f"ranks {count} to {asked - 1}"
    return (f"{_all_in_init(positions)} for a world of {asked} processes (its world_size argument or "
            f"WORLD_SIZE, {whose}): {never} {'was' if asked == count + 1 else 'were'} never started. "
            "init_process_group returns once world_size ranks have joined.")


def all_in_init_summary(positions: dict[int, Position]) -> str:
    """Every rank the launch started waits in init_process_group, none for a larger world than the
    launch's (as far as their calls say): they have not connected to each other."""
    return (f"{_all_in_init(positions)}, and none asked for more ranks than the launch started: they "
            "have not connected to each other. Either they were told to meet at different addresses "
            "(init_method, MASTER_ADDR or MASTER_PORT set by the script or per node), or the backend "
            "cannot open its connections between them (a network interface, a host name, a firewall).")


def _all_in_init(positions: dict[int, Position]) -> str:
    """'All 4 ranks the launch started wait in init_process_group at train.py:12'."""
    sites = ", ".join(sorted({pos.where for pos in positions.values() if pos.where}))
    return f"All {len(positions)} ranks the launch started wait in init_process_group" + (
        f" at {sites}" if sites else "")


def _destroyed_text(pos: Position) -> str:
    """', after it destroyed the default process group at train.py:10 (destroy_process_group)': the
    others' collectives then fail with 'Connection closed by peer' ('' when it did not)."""
    if not pos.destroyed_at:
        return ""
    under = _under_condition(*pos.destroyed_site) if pos.destroyed_site else ""
    return (f", after it destroyed the default process group at {pos.destroyed_at} (destroy_process_group"
            f"{f', {under}' if under else ''})")


def caught_failure_summary(caught: dict[int, Op], first: Op, left: list[int],
                           positions: dict[int, Position]) -> str:
    """'Every rank finished, but rank 0's all_reduce at train.py:12 (collective #2) raised
    RuntimeError: Connection closed by peer ..., and the script went on: rank 1 never issued
    collective #2 (it had left, after it destroyed ...).' ``first``: the earliest of the failed calls."""
    parts = [f"rank {rank}'s {_op_name(op)}{_at_where(op)}"
             f"{f' (collective #{op.seq})' if op.seq is not None else ''} raised "
             f"{short_error(op.error).rstrip('.')}" for rank, op in sorted(caught.items())]
    text = (f"Every rank finished, but {'; '.join(parts)}, and the script caught the error and went on "
            "(exit 0): the job's result is incomplete.")
    if left:
        they = "it" if len(left) == 1 else "they"
        text += (f" {ranks_text(left)} never issued collective #{first.seq}: {they} had left"
                 f"{_destroyed_text(positions[left[0]]) if len(left) == 1 else ''}.")
        text += _caught_before_destroy(positions[left[0]]) if len(left) == 1 else ""
    return text


def _caught_before_destroy(pos: Position) -> str:
    """' Its destroy_process_group is in the finally of a try whose 'except Exception:' at
    train.py:20 re-raises nothing: ...' ('' when the destroy is not in such a finally)."""
    caught = swallowing_finally(*pos.destroyed_site) if pos.destroyed_site else None
    if caught is None:
        return ""
    return (f" Its destroy_process_group is in the finally of a try whose '{caught[1]}' at "
            f"{Path(pos.destroyed_site[0]).name}:{caught[0]} {SWALLOWED_END}: had an error been raised in "
            f"that try on rank {pos.rank}, it would have left there the same way, ending as if its work "
            "were done (exit 0), with the error in its log alone.")


# a job's rank whose doctor never posted a heartbeat (the leader knows nothing else of it)
UNHEARD = ("not heard from yet: its doctor never reported, so it is still starting (importing torch and "
           "the script's modules) or its process never started")


def missing_summary(missing: list[int], positions: dict[int, Position]) -> str:
    """Which ranks never reached the collective the others wait in, and where they are instead."""
    waiting = [p for p in positions.values() if p.state == "in-collective" or p.victim]
    entered: dict[tuple, list[Position]] = {}  # the ranks waiting in one op at one line
    for pos in waiting:
        entered.setdefault((_op_name(pos.op), pos.where, pos.seq), []).append(pos)
    clauses = []
    for (name, _where, seq), group in entered.items():
        who = ranks_text([p.rank for p in group])
        clause = f"the {name} that {who[0].lower()}{who[1:]} entered{_at(group[0])}"
        clauses.append(clause + (f" (collective #{seq})" if seq else ""))
    text = f"{ranks_text(missing)} never reached " + ", nor ".join(clauses)
    where = []
    for rank in missing:
        pos = positions[rank]
        what = pos.detail or ("outside any collective" if not pos.where else "")
        where.append(f"rank {rank} is {what}".rstrip()
                     + (f" ({pos.where})" if pos.where and pos.where not in what else "")
                     + _destroyed_text(pos))
    given_up = gave_up(positions)
    which = ("monitored_barrier's own timeout, not the process group's" if monitored_timeout(positions)
             else "the process group's timeout")
    ended = (f" {ranks_text(given_up)} stopped waiting at {which} ("
             f"{short_error(positions[given_up[0]].op.error)})." if given_up else "")
    return text + "; " + "; ".join(where) + "." + ended


_TORCH_TIMEOUT = re.compile(r"timed out|timeout|failed to pass monitoredBarrier", re.IGNORECASE)
# torch's monitored_barrier when its own timeout passes ('Rank 1 failed to pass monitoredBarrier in 2000
# ms'; ProcessGroupGloo.cpp): its timeout argument, or with None torch's default for the backend (30
# minutes on gloo; distributed_c10d.py's monitored_barrier: _get_default_timeout), not the group's
_MONITORED = re.compile(r"failed to pass monitoredBarrier in \d+ ms")


def monitored_timeout(positions: dict[int, Position]) -> bool:
    """Did a wait end at ``monitored_barrier``'s own timeout (not a collective's)?"""
    return any(_MONITORED.search(positions[rank].op.error or "") for rank in gave_up(positions))


MONITORED_TIMEOUT_CURE = (
    "monitored_barrier(timeout=...) waits that long for every rank whatever the process group's timeout "
    "(with timeout=None, torch's default for the backend: 30 minutes on gloo, not the group's): if the "
    "missing rank's work is slow rather than stuck, raise that timeout argument, or do the slow work on "
    "every rank, or after the barrier.")


def gave_up(positions: dict[int, Position]) -> list[int]:
    """The ranks whose wait in a collective the process group's timeout ended (not a signal)."""
    return sorted(p.rank for p in positions.values() if p.timed_out and p.op is not None
                  and _TORCH_TIMEOUT.search(p.op.error or ""))


def skipped_group_summary(skipped: list[int], waiter: Position, positions: dict[int, Position],
                          members: dict[str, list[int]],
                          likewise: list[tuple[list[int], Position]] | None = None) -> str:
    """Ranks that did not issue a collective of their group that another member waits in, and
    wait in a collective of another group instead (which the waiting member cannot reach);
    ``members``: each group's ranks, as far as their collectives were seen; ``likewise``: the same
    call's other groups skipped alike (their skippers, the rank that waits there)."""
    return _skipped_group_text(skipped, waiter, positions, members) + "".join(
        f" Likewise, {ranks_text(ranks).lower()} never issued the {_op_name(other.op)} of "
        f"{group_text(other.op, members)} that rank {other.rank} waits in{_at(other)}."
        for ranks, other in likewise or [])


def _skipped_group_text(skipped: list[int], waiter: Position, positions: dict[int, Position],
                        members: dict[str, list[int]]) -> str:
    seq = f" (its collective #{waiter.seq})" if waiter.seq is not None else ""
    own = (f"{ranks_text(skipped)} never issued the {_op_name(waiter.op)} of "
           f"{group_text(waiter.op, members)} that rank {waiter.rank} waits in{_at(waiter)}{seq}")
    instead = []
    for rank in skipped:
        pos = positions[rank]
        number = "" if pos.seq is None else f" (collective #{pos.seq} of {group_text(pos.op, members)})"
        instead.append(f"rank {rank} waits in the {_op_name(pos.op)}{_at(pos)}{number}")
    branch = _own_branch(waiter)  # the branch around the subgroup's call, when it is on the rank
    loop = enclosing_loop(waiter.file, waiter.line) if waiter.file and waiter.line and not branch else None
    exits = loop_exits_text(waiter.file, loop, waiter.line) if loop is not None else ""
    if exits:  # 'for p in model.parameters(): if p.grad is None: continue' before the group's call
        those = ranks_text(skipped).lower()
        return (f"{own}: {'; '.join(instead)}, which rank {waiter.rank} cannot reach while it waits. "
                f"Each waits for the other: the loop at {Path(waiter.file).name}:{loop} around that call "
                f"issued fewer of its collectives on {those} than on rank {waiter.rank}.{exits}")
    branch = f" (its call here is under {branch})" if branch else ""
    return (f"{own}: {'; '.join(instead)}, which rank {waiter.rank} cannot reach while it waits. "
            f"Each waits for the other: a collective of a subgroup inside a branch that not all of "
            f"its ranks take{branch}.")


def crossed_groups_summary(ranks: list[int], positions: dict[int, Position],
                           members: dict[str, list[int]]) -> str:
    """Ranks each waiting in a collective of a group whose other members wait in another group's."""
    parts = []
    for rank in ranks:
        pos = positions[rank]
        number = "" if pos.seq is None else f" (its collective #{pos.seq} there)"
        parts.append(f"rank {rank} in the {_op_name(pos.op)} of {group_text(pos.op, members)}"
                     f"{_at(pos)}{number}")
    return (f"{ranks_text(ranks)} each wait in a collective of a group whose other members have not "
            f"issued it and wait in another group's instead: {'; '.join(parts)}. They issue the "
            "collectives of groups that share ranks in different orders.")


def threads_text(threads: dict[int, dict[str, tuple[Op, bool]]]) -> str:
    """' Rank 0 issued collectives on the default group from 2 threads: all_reduce at a.py:19 (the
    main thread) and all_reduce at a.py:13 (another thread); so did rank 1.' and why that fails.
    ``threads``: by rank, {a thread's id: (its call, whether it is the main thread)}."""
    first = min(threads)
    ordered = sorted(threads[first].values(), key=lambda call: not call[1])  # the main thread first
    calls = [f"{_op_name(op)}{' at ' + op.where if op.where else ''} "
             f"({'the main thread' if main else 'another thread'})" for op, main in ordered]
    listed = _and(calls)
    others = [rank for rank in threads if rank != first]
    also = f"; so did {ranks_text(others).lower()}" if others else ""
    return (f" Rank {first} issued collectives on {group_text(ordered[0][0], {})} from {len(calls)} "
            f"threads: {listed}{also}.{THREADS_MEET}")


def group_order_summary(ranks: list[int], name: str, members: dict[tuple[int, ...], list[int]]) -> str:
    """'Group 1 is ranks 0 and 1 on ranks 0 and 1, but ranks 2 and 3 on ranks 2 and 3: ...'."""
    held = [f"{ranks_text(list(key)).lower()} on {ranks_text(holders).lower()}"
            for key, holders in members.items()]
    return (f"Group {name} is {', but '.join(held)}: the ranks created their process groups in different "
            "orders. torch numbers a group by the order new_group is called, on every rank, members or not, "
            "so groups of different ranks took one name and meet in one another's collectives (some pass, "
            "some wait for ranks that are in another group).")


def outside_group_summary(outsiders: dict[int, Op], positions: dict[int, Position]) -> str:
    """'Rank 1 called all_reduce at tp.py:30 on a group it is not in. torch skips ... (rank 0 waits
    in all_reduce at tp.py:30).': the subgroups' waits follow. Which group is not known: torch hands
    every rank outside a group one placeholder (``GroupMember.NON_GROUP_MEMBER``)."""
    calls = [f"{_op_name(op)}{_at_where(op)}" for _rank, op in sorted(outsiders.items())]
    who = ranks_text(sorted(outsiders))
    same = len(set(calls)) == 1
    text = (f"{who} called {calls[0]} on a group {'it is' if len(outsiders) == 1 else 'they are'} not in"
            if same else "; ".join(f"rank {rank} called {call} on a group it is not in"
                                   for rank, call in zip(sorted(outsiders), calls, strict=True)))
    waiting = [pos for pos in positions.values() if pos.rank not in outsiders and pos.state == "in-collective"
               and pos.op is not None and pos.op.pg != WORLD_PG]
    waits = "; ".join(f"rank {pos.rank} waits in {_op_name(pos.op)}{_at(pos)}" for pos in waiting)
    several = len(outsiders) > 1
    return (f"{text[0].upper()}{text[1:]}. torch skips a collective on a group the rank is not in, with "
            "only a warning ('... which does not belong to the given group'), and returns at once: "
            f"{'those ranks' if several else 'that rank'} went on while the members of "
            f"{'their' if several else 'its'} own group wait" + (f" ({waits})." if waits else "."))


OUTSIDE_GROUP_CURE = (
    "Give each rank a group it is in: dist.new_group(ranks) returns a placeholder, not the group, on the "
    "ranks outside it, so index your list of groups by the rank's own coordinate (the group that holds "
    "dist.get_rank(): rank // group_size for consecutive ranks, rank % group_size for strided ones), or "
    "let dist.new_subgroups() / init_device_mesh() hand every rank its own.")


GROUP_ORDER_CURE = (
    "Create every process group in the same order with the same ranks on every rank, members or not: "
    "loop over one fixed list of groups (for ranks in TP + DP: dist.new_group(ranks)), not the rank's own "
    "groups first; dist.new_subgroups_by_enumeration or init_device_mesh make them all in one call.")


def group_text(op: Op, members: dict[str, list[int]]) -> str:
    """'the default group' (torch names it "0"), 'group 1 (ranks 2 and 3)', "group 1 'mesh_dp'
    (ranks 0 and 2)" (torch's description of a DeviceMesh dimension's group) for an op's group."""
    if op.pg == WORLD_PG:
        return "the default group"
    name = f"{op.pg} '{op.pg_desc}'" if op.pg_desc else op.pg
    ranks = members.get(op.pg)
    return f"group {name} ({ranks_text(ranks).lower()})" if ranks else f"group {name}"


def receives(op: Op) -> bool:
    """Is a p2p op a receive (recv, irecv), not a send (nor a batch of both)?"""
    name = canonical_op(op.op)
    return "recv" in name and name != "batch_isend_irecv"


def _batch_text(op: Op) -> str:
    """' (isend to rank 1, irecv from rank 1)': what a batch_isend_irecv holds; '' for another op."""
    if not op.batch:
        return ""
    parts = [f"isend to rank {peer}" if kind == "send" else f"irecv from rank {peer}"
             for kind, peer in op.batch]
    return f" ({', '.join(parts)})"


def crossed_p2p_summary(crossed: list[int], positions: dict[int, Position],
                        fewer: dict[int, FewerMatches] | None = None) -> str:
    """Pairs of ranks each waiting in a send to the other (or each in a recv from the other);
    ``fewer``: for a waiting rank whose peer posted fewer matches than it made, those counts (not
    a matter of order then: one side's loop ran fewer turns, a pipeline's last batch)."""
    parts = []
    for rank in crossed:
        pos = positions[rank]
        peer = pos.op.peer
        if peer in crossed and peer < rank:
            continue
        verb = "receive from" if receives(pos.op) else "send to"
        other = positions[peer]
        parts.append(f"Rank {rank} waits to {verb} rank {peer} ({_op_name(pos.op)}{_at(pos)}) while rank "
                     f"{peer} waits to {verb} rank {rank} ({_op_name(other.op)}{_at(other)})")
    if fewer:
        counts = "".join(_fewer_matches_text(rank, positions[rank].op.peer, found)
                         for rank, found in sorted(fewer.items()))
        return "; ".join(parts) + f": each waits for the other, a deadlock that {UNEVEN_P2P}.{counts}"
    return ("; ".join(parts) + ": each waits for the other to post the match, a deadlock (a blocking send "
            "need not return before its peer posts the recv).")


UNEVEN_P2P = "no order of sends and receives undoes"  # in a summary: a pair's p2p counts differ
P2P_COUNT_CURE = (
    "Make each pair of ranks post as many receives as the other posts sends, in every step: derive the "
    "loop counts on both sides from one number both hold (the micro-batch count, sent ahead; or a fixed "
    "count, the last batch padded or dropped), not from data one side alone sees.")


class FewerMatches(NamedTuple):
    """A peer that posted fewer receives (sends) for a rank than that rank made sends (receives)."""

    posted: int
    made: int
    last: Op  # the peer's last matching call


def p2p_summary(unanswered: dict[int, int], positions: dict[int, Position],
                fewer: dict[int, FewerMatches] | None = None) -> str:
    """Ranks waiting in a send or recv whose peer is in another operation and posts no match;
    ``fewer``: for a waiting rank, what its peer's records tell of the matches it did post (how
    many, where, and what in the loop around them can skip one)."""
    parts = []  # the waits on a rank that waits for nobody first; those on a waiting rank after them
    for rank, peer in sorted(unanswered.items(), key=lambda item: (item[1] in unanswered, item[0])):
        pos, other = positions[rank], positions[peer]
        if pos.op.batch:  # which of its sends and receives is still open is not known
            parts.append(f"Rank {rank} waits in its {_op_name(pos.op)}{_batch_text(pos.op)}{_at(pos)}, but "
                         f"rank {peer} is in {_op_name(other.op)}{_at(other)}, with no match for all of it")
            continue
        verb, match = ("receive from", "send to") if receives(pos.op) else ("send to", "recv from")
        text = f"Rank {rank} waits to {verb} rank {peer} ({_op_name(pos.op)}{_at(pos)}), but rank {peer} "
        if peer in unanswered:  # it waits for another rank itself: the wait that holds this one is above
            text += f"waits for rank {unanswered[peer]} itself, in its {_op_name(other.op)}{_at(other)}"
        else:
            text += f"is in {_op_name(other.op)}{_at(other)}, with no {match} rank {rank}"
        parts.append(text)
    skips = "".join(_fewer_matches_text(rank, unanswered[rank], found)
                    for rank, found in sorted((fewer or {}).items()))
    return ". ".join(parts) + ". Every send needs the matching recv on its peer, in the same order." + skips


def _fewer_matches_text(rank: int, peer: int, found: FewerMatches) -> str:
    """' Rank 3 received from rank 2 3 times (recv at pp.py:18, inside the loop at pp.py:11), and rank
    2 sent to it 4 times. In that loop, the continue at pp.py:13 (...) skips the rest of its turn...'."""
    last, name = found.last, Path(found.last.file).name
    verb, other = ("received from", "sent to it") if receives(last) else ("sent to", "received from it")
    loop = enclosing_loop(last.file, last.line)
    inside = f", inside the loop at {name}:{loop}" if loop else ""
    exits = loop_exits_text(last.file, loop, last.line) if loop else ""
    return (f" Rank {peer} {verb} rank {rank} {_times(found.posted)} ({_op_name(last)} at {name}:{last.line}"
            f"{inside}), and rank {rank} {other} {_times(found.made)}.{exits}")


def _times(count: int) -> str:
    return "once" if count == 1 else "twice" if count == 2 else f"{count} times"


def unknown_summary(positions: dict[int, Position]) -> str:
    """No known pattern: where every rank is."""
    parts = []
    for pos in positions.values():
        what = pos.state
        if pos.op is not None:
            what += f" {_op_name(pos.op)}"
        detail = pos.detail
        if pos.where and detail.endswith(f" at {pos.where}"):  # 'in native code ... at x.py:5'
            what, detail = f"{what} {detail}", ""
        elif pos.where:
            what += f" at {pos.where}"
        if detail and detail != f"at {pos.where}":
            what += f" ({detail})"
        parts.append(f"rank {pos.rank}: {what}")
    if all(pos.state == "outside-collective" for pos in positions.values()):
        lead = ("No rank was waiting in a collective: all were computing, or stuck outside "
                "torch.distributed (their stacks say where). ")
    else:
        lead = "The run stopped without a recognisable pattern. "
    return lead + "; ".join(parts) + "."
