"""The one table of torch.distributed operations, and the other names they go by.

The tracer wraps every op in ``OPS``; the doctor compares ranks' collectives by ``canonical_op``
(the Flight Recorder says ``gloo:allreduce`` where Python said ``all_reduce``); the repro builder
replays each canonical op; the lint flags ``COLLECTIVES`` (every op all ranks of a group must call)
in rank-dependent code. ``tests/test_architecture.py`` checks those tables against this one.

To support a new op: add it to ``OPS`` (and ``P2P_OPS`` when it has one peer), its other spellings
to ``ALIASES``, and a line to ``helpers.repro.replay.OP_CODE`` when a replay can issue it.
"""

from __future__ import annotations

# op -> (compared tensor argument, peer argument): (position, name) pairs, None when absent.
# The compared tensor is the one every rank must pass with the same shape and dtype.
OPS: dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None]] = {
    "all_reduce": ((0, "tensor"), None),
    "broadcast": ((0, "tensor"), None),
    "reduce": ((0, "tensor"), None),
    "all_gather": ((1, "tensor"), None),
    "all_gather_into_tensor": ((1, "input_tensor"), None),
    "all_gather_single": ((1, "input_tensor"), None),
    "_all_gather_base": ((1, "input_tensor"), None),
    "all_gather_object": (None, None),
    "all_gather_coalesced": (None, None),
    "all_reduce_coalesced": (None, None),
    "broadcast_object_list": ((0, "object_list"), None),
    "reduce_scatter": ((0, "output"), None),
    "reduce_scatter_tensor": ((1, "input"), None),
    "reduce_scatter_single": ((1, "input"), None),
    "_reduce_scatter_base": ((1, "input"), None),
    "all_to_all": (None, None),
    "all_to_all_single": ((1, "input"), None),
    "gather": ((0, "tensor"), None),
    "gather_object": (None, None),
    "scatter": ((0, "tensor"), None),
    "scatter_object_list": (None, None),
    "barrier": (None, None),
    "monitored_barrier": (None, None),
    "send": ((0, "tensor"), (1, "dst")),
    "recv": ((0, "tensor"), (1, "src")),
    "isend": ((0, "tensor"), (1, "dst")),
    "irecv": ((0, "tensor"), (1, "src")),
    "send_object_list": ((0, "object_list"), (1, "dst")),
    "recv_object_list": ((0, "object_list"), (1, "src")),
    "batch_isend_irecv": (None, None),
}
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
                     "batch_isend_irecv"})
# rooted collectives -> the argument naming their root (a global rank every rank must agree on)
ROOTS = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src",
         "broadcast_object_list": "src", "gather_object": "dst", "scatter_object_list": "src"}
# ops whose split sizes are recorded (``"splits"``: the output's rows, output_split_sizes and
# input_split_sizes): rank i's input split j must equal rank j's output split i
SPLIT_OPS = frozenset({"all_to_all_single"})
# ops that return a work to wait on, always (they have no async_op argument)
ASYNC_OPS = frozenset({"isend", "irecv", "batch_isend_irecv"})
# ops that issue several inner collectives (the Flight Recorder sees those, not the call)
MULTI_OPS = frozenset({"all_gather_coalesced", "all_reduce_coalesced", "batch_isend_irecv",
                       *(name for name in OPS if name.endswith(("_object", "_object_list")))})
# every rank of the group must call these; new_group is no op but all ranks must call it too
COLLECTIVES = frozenset({*(name for name in OPS if name not in P2P_OPS), "new_group"})

# other spellings (the Flight Recorder's profiling names, deprecated and private functions)
ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "monitored_barrier": "barrier",
    "all_reduce_barrier": "barrier",  # NCCL's barrier in the Flight Recorder (torch's FR analyzer, types.py)
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "alltoall": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
}
# collectives whose compared tensors must have the same shape and dtype on every rank
SHAPE_CHECKED = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                           "reduce_scatter_tensor", "barrier", "broadcast_object_list"})
# Ops whose compared argument is a list of Python objects: recorded by its length, as shape [n] of
# dtype "object". torch sends a tensor of the objects' byte sizes, one per item, so the ranks' lists
# must be as long (gloo aborts the process on a broadcast of sizes that differ).
OBJECT_LISTS = frozenset({"broadcast_object_list", "send_object_list", "recv_object_list"})
# the default group's setup, recorded as the call before its first collective (sequence number 0):
# ranks wait in it for each other (gloo connects every pair of ranks there), so a rank that never
# reaches it leaves the others waiting as in a collective
INIT_OP = "init_process_group"
# collectives that end on no rank before every rank of the group has joined them (each rank's
# output needs every rank's input): one rank's completed call says every rank issued it
ALL_JOIN = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                      "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                      "barrier"})
# the Flight Recorder's dtype names -> torch's
FR_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
             "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
             "Bool": "bool"}


def canonical_op(name: str) -> str:
    """One name per collective whatever recorded it: 'gloo:allreduce' -> 'all_reduce'."""
    name = name.split(":", 1)[-1]
    return ALIASES.get(name, name)
