"""The hang doctor: stalls, ok runs, crashes, mismatches, the CLI, display, SIGKILL.

Real ranks with real gloo; the scenario matrix lives in test_scenarios.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import marker_line

from helpers import collectives, doctor, procs, repro, rundir, scenarios
from helpers.doctor import diagnosis as diagnosis_module
from helpers.doctor import postmortem, records, runs, source, wording
from helpers.launch import LaunchTimeout, RankError, RankExited, launch

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return marker_line(__file__, marker)


def _stay_away(seconds: float = 60) -> None:
    """A rank busy elsewhere (bounded: the test's ranks never outlive it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # line: loop
        time.sleep(0.05)


def _failed_run(function, num_processes: int = 2, keep_dir: Path | None = None) -> doctor.Diagnosis:
    """The diagnosis of a run of ``function`` that fails (a rank raises, or ends without a result)."""
    with pytest.raises((RankError, RankExited)) as info:
        doctor.launch(function, num_processes=num_processes, timeout_s=60, stall_s=1.5, keep_dir=keep_dir)
    return info.value.diagnosis


def _hung_run(function, num_processes: int = 2) -> doctor.Diagnosis:
    """The diagnosis of a run of ``function`` that hangs (the doctor stops it after ``stall_s``)."""
    with pytest.raises(doctor.HangDetected) as info:
        doctor.launch(function, num_processes=num_processes, timeout_s=60, stall_s=1.5)
    return info.value.diagnosis


def _skip_barrier_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        _stay_away()
        return
    dist.barrier()  # line: barrier


def test_launch_stops_a_stall_with_a_diagnosis(leftovers):
    started = time.monotonic()
    with pytest.raises(doctor.HangDetected) as info:
        doctor.launch(_skip_barrier_on_rank_one, num_processes=2, timeout_s=60, stall_s=1.5)
    assert isinstance(info.value, LaunchTimeout)
    found = info.value.diagnosis
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [1])
    assert found.per_rank[0].state == "in-collective" and found.per_rank[0].op == "barrier"
    assert found.per_rank[0].location == f"{HERE}:{_line('barrier')}"
    assert found.per_rank[1].state == "outside-collective"
    assert found.per_rank[1].location in (f"{HERE}:{_line('loop')}", f"{HERE}:{_line('loop') + 1}")
    barrier = f"{HERE}:{_line('barrier')}"
    assert f"Rank 1 never reached the barrier that rank 0 entered at {barrier}" in found.summary
    assert f"loop at {HERE}:{_line('loop')}" in found.summary
    assert found.detected_after_s <= 1.5 + 3
    assert time.monotonic() - started < 20
    assert "rank 0" in str(info.value) and set(info.value.stacks) == {0, 1}
    _display(found)
    leftovers.check()


def _pipeline_wired_wrong():
    import torch
    import torch.distributed as dist

    # 16 MiB: a send that returns only once its peer receives it
    rank, tensor, large = dist.get_rank(), torch.zeros(4), torch.zeros(4 * 1024 * 1024)
    if rank == 0:
        dist.send(large, dst=1)  # line: chained send
    elif rank == 1:
        dist.recv(tensor, src=2)  # line: recv
        dist.recv(large, src=0)
    elif rank == 2:
        dist.send(tensor + 2, dst=3)  # to rank 3, not to rank 1
    else:
        dist.recv(tensor, src=2)
    dist.barrier()  # line: pipeline barrier


def test_a_recv_whose_peer_is_in_another_operation_names_the_peer(leftovers):
    # and a send to the rank that waits in that recv is followed there: rank 0 waits for rank 1, which
    # waits for rank 2 (unseen script: rank 0 collected counts with recv from each rank in turn)
    found = _hung_run(_pipeline_wired_wrong, num_processes=4)
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [2]), found.summary
    assert found.per_rank[1].op == "recv" and found.per_rank[1].location == f"{HERE}:{_line('recv')}"
    barrier, recv = f"{HERE}:{_line('pipeline barrier')}", f"{HERE}:{_line('recv')}"
    assert found.summary.startswith(f"Rank 1 waits to receive from rank 2 (recv at {recv}), but rank 2 is in "
                                    f"barrier at {barrier}, with no send to rank 1. Rank 0 waits to send to "
                                    f"rank 1 (send at {HERE}:{_line('chained send')}), but rank 1 waits for "
                                    f"rank 2 itself, in its recv at {recv}. Every send"), found.summary
    leftovers.check()


def _group_picked_by_the_wrong_index():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2])]  # each rank makes both, members or not
    mine = groups[rank % 2] if rank < 2 else groups[1]  # rank 1 takes the group of rank 2
    dist.all_reduce(torch.ones(2), group=mine)  # line: outside its group
    dist.barrier()  # line: after the group's call


def test_a_rank_calling_a_collective_on_a_group_it_is_not_in_is_named(leftovers):
    # unseen script: a 2x2 tensor- x data-parallel grid whose ranks picked their tensor-parallel group
    # by the wrong coordinate; torch skipped the calls of the ranks outside it (a warning), and the
    # members waited. The records said "group ?" on both, which read as groups made in different orders
    found = _hung_run(_group_picked_by_the_wrong_index, num_processes=3)
    assert (found.verdict, found.kind, found.ranks) == ("hang", "collective-mismatch", [1]), found.summary
    at = f"{HERE}:{_line('outside its group')}"
    said = f"Rank 1 called all_reduce at {at} on a group it is not in. torch skips"
    assert found.summary.startswith(said), found.summary
    assert found.summary.endswith(f"(rank 0 waits in all_reduce at {at})."), found.summary
    assert found.fix.startswith(wording.OUTSIDE_GROUP_CURE), found.fix
    leftovers.check()


def _pair_both_send_first():
    import torch
    import torch.distributed as dist

    rank, message = dist.get_rank(), torch.ones(4 * 1024 * 1024)  # 16 MiB: no send returns unmatched
    if rank < 2:
        dist.send(message, dst=1 - rank)  # line: crossed send
        dist.recv(message, src=1 - rank)
    dist.barrier()


def test_two_ranks_each_sending_to_the_other_first_are_a_crossed_pair(leftovers):
    found = _hung_run(_pair_both_send_first, num_processes=3)
    assert (found.verdict, found.kind, found.ranks) == ("hang", "collective-mismatch", [0, 1]), found.summary
    send = f"{HERE}:{_line('crossed send')}"
    assert found.summary.startswith(f"Rank 0 waits to send to rank 1 (send at {send}) while rank 1 waits to "
                                    f"send to rank 0 (send at {send}): each waits for the other"), found
    assert found.fix.startswith(wording.CROSSED_P2P_CURE)
    assert found.per_rank[2].op == "barrier"  # the bystander waits, and is no culprit
    leftovers.check()


def _pipeline_with_a_short_last_batch():
    import torch
    import torch.distributed as dist

    for batch in (torch.ones(8), torch.ones(6)):  # the last batch is short: 3 micro-batches of 2
        if dist.get_rank() == 0:
            micro = batch.split(2)
            for part in micro:
                dist.send(part, dst=1)  # line: stage 0 sends
            for part in micro:
                dist.recv(part, src=1)  # line: stage 0 waits for gradients
        else:
            parts = [torch.empty(2) for _ in range(4)]
            for part in parts:
                dist.recv(part, src=0)  # line: stage 1 receives 4
            for part in parts:
                dist.send(part, dst=0)


def test_two_pipeline_stages_waiting_on_each_other_with_uneven_counts_are_told_the_counts(leftovers):
    # stage 0 sends 3 micro-batches of the short last batch and waits for their gradients; stage 1
    # always receives 4 (m1 of a blind batch): no order of sends and recvs undoes that deadlock
    found = _hung_run(_pipeline_with_a_short_last_batch, num_processes=2)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0, 1]), found.summary
    assert f"a deadlock that {wording.UNEVEN_P2P}" in found.summary, found.summary
    assert (f"Rank 0 sent to rank 1 7 times (send at {HERE}:{_line('stage 0 sends')}, inside the loop at "
            f"{HERE}:{_line('stage 0 sends') - 1}), and rank 1 received from it 8 times.") in found.summary, \
        found.summary
    assert found.fix.startswith(wording.P2P_COUNT_CURE), found.fix
    assert wording.CROSSED_P2P_CURE not in found.fix
    leftovers.check()


def _reduce_to_a_rank_outside_its_group():
    import torch
    import torch.distributed as dist

    alone = dist.new_group([1])  # every rank makes it
    counts = torch.ones(4)
    if dist.get_rank() == 1:
        dist.reduce(counts, dst=0, group=alone)  # line: dst outside the group
    dist.all_reduce(counts)


def test_a_rank_whose_collective_rejected_its_arguments_is_the_culprit_not_an_echo(leftovers):
    # torch's own check raised ValueError naming a ProcessGroup: the rank's error, not the network's
    # (n5 of a blind batch: a reduce to global rank 0 inside a per-node group, "unknown" before)
    found = doctor.run_function(_reduce_to_a_rank_outside_its_group, num_processes=2, stall_s=3.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.text()
    assert "Rank 1 raised ValueError: Global rank 0 is not part of group" in found.summary, found.summary
    assert found.per_rank[1].location == f"{HERE}:{_line('dst outside the group')}"
    leftovers.check()


def _a_mesh_row_alone_reduces_across_nodes():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
    if rank < 2:  # the first row alone
        dist.all_reduce(torch.ones(2), group=columns[rank % 2])  # line: one row's column reduce
    dist.all_reduce(torch.ones(3))


def test_a_subgroup_call_skipped_alike_in_each_column_of_a_mesh_names_every_skipper(leftovers):
    # n4 of a blind batch: a device mesh's cross-node reduce under 'if node == 0:': ranks 0 and 1
    # wait for ranks 2 and 3, each in a group of its own; both skippers are named, not the first alone
    found = _hung_run(_a_mesh_row_alone_reduces_across_nodes, num_processes=4)
    assert (found.kind, found.ranks) == ("collective-mismatch", [2, 3]), found.summary
    assert found.summary.startswith("Rank 2 never issued the all_reduce of group 1 (ranks 0 and 2)"), \
        found.summary
    reduce = _line("one row's column reduce")
    assert (f" Likewise, rank 3 never issued the all_reduce of group 2 (ranks 1 and 3) that rank 1 waits in "
            f"at {HERE}:{reduce}.") in found.summary, found.summary
    leftovers.check()


def _scatter_skips_a_send():
    import torch
    import torch.distributed as dist

    rank, tensor = dist.get_rank(), torch.zeros(4)
    for step in range(2):
        if rank == 0:
            works = [dist.isend(tensor + 1, dst=peer) for peer in (1, 2) if step == 0 or peer == 1]
        else:
            works = [dist.irecv(tensor, src=0)]
        for work in works:
            work.wait()  # line: wait
        dist.all_reduce(tensor)  # line: after p2p


def test_a_rank_in_the_wait_of_an_irecv_whose_send_never_came_names_the_sender(leftovers):
    found = _hung_run(_scatter_skips_a_send, num_processes=3)
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [0])
    wait, after = f"{HERE}:{_line('wait')}", f"{HERE}:{_line('after p2p')}"
    assert (found.per_rank[2].op, found.per_rank[2].location, found.per_rank[2].state) == (
        "irecv", wait, "in-collective")
    assert found.summary.startswith(f"Rank 2 waits to receive from rank 0 (irecv at {wait}), but rank 0 is "
                                    f"in all_reduce at {after}, with no send to rank 2."), found.summary
    leftovers.check()


def _stage_skips_a_micro_batch():
    import torch
    import torch.distributed as dist

    rank, scored = dist.get_rank(), []
    for micro_batch in range(4):  # line: micro-batch loop
        if rank == 1 and micro_batch == 2:  # the last stage has nothing to score in this one
            continue  # line: stage skip
        if rank == 0:
            dist.send(torch.full((4,), float(micro_batch)), dst=1)  # line: stage send
        else:
            activation = torch.empty(4)
            dist.recv(activation, src=0)  # line: stage recv
            scored.append(activation.sum())
    dist.all_reduce(torch.tensor([float(len(scored))]))  # line: stage reduce


def test_a_pipeline_stage_that_skipped_a_recv_is_named_with_the_continue_that_skipped_it(leftovers):
    # an unseen script: the last stage skips a micro-batch; its stage before it blocks in the 4th send
    found = _hung_run(_stage_skips_a_micro_batch, num_processes=2)
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [1]), found.summary
    at = {name: f"{HERE}:{_line(f'stage {name}')}" for name in ("send", "recv", "reduce", "skip")}
    assert found.summary.startswith(
        f"Rank 0 waits to send to rank 1 (send at {at['send']}), but rank 1 is in all_reduce at "
        f"{at['reduce']}, with no recv from rank 0. Every send needs the matching recv on its peer, "
        f"in the same order. Rank 1 received from rank 0 3 times (recv at {at['recv']}, inside the "
        f"loop at {HERE}:{_line('micro-batch loop')}), and rank 0 sent to it 4 times. {wording.LOOP_EXITS}"
        f"the continue at {at['skip']} (if rank == 1 and micro_batch == 2)"), found.summary
    assert found.fix.startswith(wording.LOOP_EXIT_CURE), found.fix
    leftovers.check()


def _batch_without_a_recv_on_one_rank():
    import torch
    import torch.distributed as dist

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    sent, received = torch.ones(4), torch.zeros(4)
    for step in range(3):
        ops = [dist.P2POp(dist.isend, sent, peer)]
        if rank == 0 or step < 2:  # rank 1 posts no irecv in its last step
            ops.append(dist.P2POp(dist.irecv, received, peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # line: batch wait
    dist.barrier()  # line: after the batches


def test_a_batch_isend_irecv_whose_peer_posted_no_match_names_the_peer(leftovers):
    # gloo issues a batch's sends and receives one by one: rank 0's isend to rank 1 is never received
    found = _hung_run(_batch_without_a_recv_on_one_rank)
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.text()
    assert found.summary.startswith(
        f"Rank 0 waits in its batch_isend_irecv (isend to rank 1, irecv from rank 1) at {HERE}:"
        f"{_line('batch wait')}, but rank 1 is in barrier at {HERE}:{_line('after the batches')}"), \
        found.summary
    leftovers.check()


def _ring_rank_forgets_a_send():
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(4):
        ops = [dist.P2POp(dist.isend, torch.ones(4), (rank + 1) % world),
               dist.P2POp(dist.irecv, torch.zeros(4), (rank - 1) % world)]
        if rank == 1 and step == 2:
            ops = ops[1:]  # its send to rank 2, forgotten once
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # line: ring wait


def test_a_rank_that_sent_one_message_fewer_is_named_when_its_peer_is_left_waiting(leftovers):
    found = _failed_run(_ring_rank_forgets_a_send, num_processes=3)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    waiting = found.per_rank[2]
    assert (waiting.op, waiting.location) == ("batch_isend_irecv", f"{HERE}:{_line('ring wait')}")
    assert found.summary.startswith("Rank 1 finished its work while other ranks still needed it (rank 2 in "
                                    f"batch_isend_irecv at {HERE}:{_line('ring wait')})"), found.summary
    leftovers.check()


def _all_gather_into_a_list_of_its_own():
    import torch
    import torch.distributed as dist

    outputs = [torch.zeros(2) for _ in range(3 if dist.get_rank() == 1 else 2)]  # rank 1 counted wrong
    dist.all_gather(outputs, torch.ones(2))  # line: gather list


def test_an_error_of_a_ranks_own_inside_a_collective_makes_it_the_culprit_not_a_victim(leftovers):
    found = _failed_run(_all_gather_into_a_list_of_its_own)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    site = f"{HERE}:{_line('gather list')}"
    assert found.summary.startswith("Rank 1 raised RuntimeError: ProcessGroupGloo::allgather: invalid output "
                                    "tensor list") and site in found.summary, found.summary
    assert "(rank 0 in all_gather" in found.summary and "rank 1 in" not in found.summary
    leftovers.check()


def _gather_a_larger_shard_into_a_tensor():
    import torch
    import torch.distributed as dist

    rows = 3 if dist.get_rank() == 1 else 2  # rank 1's last batch is larger
    dist.all_gather_into_tensor(torch.zeros(4, 4), torch.ones(rows, 4))  # line: gather into tensor


def test_an_error_in_a_deprecated_op_is_placed_at_the_users_line_not_torchs_deprecation_wrapper(tmp_path,
                                                                                                 leftovers):
    # torch 2.13 wraps all_gather_into_tensor in typing_extensions.deprecated: the traceback's
    # innermost frame outside torch was that wrapper's (typing_extensions.py:3140), in the exit record
    # that places an error raised outside the records' calls
    found = _failed_run(_gather_a_larger_shard_into_a_tensor, keep_dir=tmp_path)
    assert found.kind == "shape-mismatch" and 1 in found.ranks, found.summary
    site = f"{HERE}:{_line('gather into tensor')}"
    assert [rank.location for rank in found.per_rank] == [site, site], found.per_rank
    exits = [json.loads(line) for line in (tmp_path / "trace-1.jsonl").read_text().splitlines()
             if '"ev":"exit"' in line]
    assert [record["where"] for record in exits] == [site], exits
    # and the user's frames that led there, outermost first (a branch on the rank around a caller)
    assert [where for _file, _line_number, where in exits[0]["callers"]][-1] == site, exits
    leftovers.check()


def _reduce_a_dict_with_a_key_of_its_own():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    metrics = {"loss": torch.tensor(1.0)}
    if accelerator.process_index == 1:
        metrics["aux_loss"] = torch.tensor(0.5)  # only rank 1's batch had the auxiliary head
    accelerator.reduce(metrics, reduction="mean")  # line: reduce dict
    accelerator.wait_for_everyone()  # line: after reduce


def test_a_dict_reduced_with_a_key_only_one_rank_has_names_that_rank_and_the_repeated_line(leftovers):
    # accelerate reduces a dict one tensor at a time: rank 1's extra key is a second all_reduce from
    # the same line while rank 0 is in the barrier after it (was: rank 0 'took a different path')
    found = _hung_run(_reduce_a_dict_with_a_key_of_its_own)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.summary
    assert found.summary.startswith(
        f"Ranks issued all_reduce at {HERE}:{_line('reduce dict')} a different number of times in a row: "
        f"rank 0 once, then barrier at {HERE}:{_line('after reduce')} as collective #2; rank 1 2 times, the "
        "last as collective #2. Rank 1 issued it more times than rank 0."), found.summary
    assert found.fix.startswith(wording.REPEATED_CALL_CURE)
    leftovers.check()


def _reduce_metrics_with_a_rare_key_each_step():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 8))  # DDP: its gradient all-reduce of 40 floats
    for step in range(3):
        accelerator.backward(model(torch.ones(2, 4)).sum())  # line: backward
        metrics = {"loss": torch.tensor(1.0), "seen": torch.tensor(2.0)}
        if accelerator.process_index == 1 and step == 1:
            metrics["rare"] = torch.tensor(1.0)  # a class only rank 1's batch had
        accelerator.reduce(metrics, reduction="sum")  # line: reduce metrics


def test_a_dict_key_of_one_ranks_own_that_gloo_aborts_is_named_from_the_call_written_before_it_ran(
        leftovers):
    # uD s2: rank 1's third all_reduce from the reduce (1 float) meets the others' DDP all-reduce of
    # 40 floats, and gloo aborts rank 1 within milliseconds. A call one more in a row than the line
    # ever made is on file before it runs: the doctor names the line's extra call, not "killed
    # after its last collective" with the generic fix (the training loop around it cannot repeat
    # the reduce without passing the backward first)
    found = _failed_run(_reduce_metrics_with_a_rare_key_each_step)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.summary
    reduce, backward = f"{HERE}:{_line('reduce metrics')}", f"{HERE}:{_line('backward')}"
    assert found.summary.startswith(
        f"Ranks issued all_reduce at {reduce} a different number of times in a row: rank 0 2 times, then "
        f"all_reduce at {backward} as collective #"), found.summary
    assert "rank 1 3 times, the last as collective #" in found.summary, found.summary
    assert found.fix.startswith(wording.REPEATED_CALL_CURE)
    leftovers.check()


def _gather_inside_main_process_first():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    with accelerator.main_process_first():  # line: goes first
        accelerator.gather(torch.tensor([accelerator.process_index]))  # line: gather inside


def _stats_of(accelerator, values):
    import torch

    return accelerator.reduce({"sum": torch.tensor([float(sum(values))])})  # line: reduce in a helper


def _dataset_built_inside_main_process_first():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    with accelerator.main_process_first():  # line: builds first
        _stats_of(accelerator, [accelerator.process_index])


def test_a_collective_in_a_function_called_inside_main_process_first_is_named_with_the_block(leftovers):
    # n7 of a blind batch: a dataset's feature statistics reduced inside a function the block calls
    found = _hung_run(_dataset_built_inside_main_process_first)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.summary
    assert f"The block at {HERE}:{_line('builds first')} runs on the main process" in found.summary, \
        found.summary
    assert found.fix.startswith(wording.GOES_FIRST_CURE)
    leftovers.check()


def test_a_collective_inside_main_process_first_is_named_against_the_blocks_own_barrier(leftovers):
    found = _hung_run(_gather_inside_main_process_first)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.summary
    header = f"{HERE}:{_line('goes first')}"
    assert found.summary == (
        f"Ranks issued different collectives as collective #1: rank 0 in all_gather at "
        f"{HERE}:{_line('gather inside')} inside the main_process_first block; rank 1 in barrier at "
        f"{header}, that block's own barrier. The block at {header} runs on the main process and on the "
        "others at different times, each side waiting for the other in a barrier at its header, so a "
        "collective inside it meets that barrier."), found.summary
    assert found.fix.startswith(wording.GOES_FIRST_CURE)
    leftovers.check()


def test_a_main_process_first_block_is_found_around_its_lines(tmp_path):
    script = tmp_path / "prepare.py"
    script.write_text("with accelerator.main_process_first():\n"  # 1
                      "    data = load()\n"  # 2
                      "with training_args.main_process_first(desc='tokenize'), open(f) as g:\n"  # 3
                      "    data = data.map(tokenize)\n"  # 4
                      "with torch.no_grad():\n"  # 5
                      "    evaluate()\n")  # 6
    assert [source.goes_first_block(str(script), line) for line in range(1, 7)] == [1, 1, 3, 3, None, None]


def _evaluate_the_ddp_model_on_the_main_process():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
    accelerator.backward(model(torch.randn(4, 8)).sum())

    def evaluate():
        with torch.no_grad():
            return model(torch.randn(4, 8))  # line: eval forward

    if accelerator.is_main_process:
        evaluate()  # line: eval call
    accelerator.wait_for_everyone()  # line: eval barrier


def test_a_ddp_model_run_on_the_main_process_alone_is_named_with_the_caller_in_the_branch(leftovers):
    # DDP broadcasts the buffers (BatchNorm's) in the first forward after a training step: rank 0's
    # evaluation waits in that broadcast, issued from C++, while rank 1 waits in the barrier after
    found = _hung_run(_evaluate_the_ddp_model_on_the_main_process)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.summary
    assert f"rank 0 in broadcast at {HERE}:{_line('eval forward')}, issued by DDP inside forward()" \
        in found.summary, found.summary
    branch = f"{HERE}:{_line('eval call')}"
    assert found.summary.endswith(f"Rank 0 took a different path from rank 1 (rank 0's call at {branch}, "
                                  "inside a branch on the rank)."), found.summary
    assert found.fix.startswith(wording.MODEL_ON_ONE_RANK_CURE)
    leftovers.check()


def _gather_each_of_its_share_of_a_list():
    import torch
    import torch.distributed as dist

    items = ["a", "bb", "ccc", "dddd", "eeeee"]  # 3 for rank 0, 2 for rank 1
    for item in items[dist.get_rank()::dist.get_world_size()]:  # line: share loop
        dist.all_reduce(torch.tensor([float(len(item))]))  # line: share call


def test_a_rank_whose_loop_ran_out_first_is_named_with_the_loop_and_the_uneven_loop_cure(leftovers):
    # rank 1 finished after its 2 items; rank 0 waits in its 3rd call of the same line
    found = _failed_run(_gather_each_of_its_share_of_a_list)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    loop, call = f"{HERE}:{_line('share loop')}", f"{HERE}:{_line('share call')}"
    assert found.summary.endswith(f"The loop at {loop} ran out first on rank 1: its last collective was #2 "
                                  f"at {call}, the call the others still wait in as #3."), found.summary
    assert found.fix.startswith(wording.UNEVEN_LOOP_CURE)
    leftovers.check()


def _all_to_all_with_splits_of_its_own():
    import torch
    import torch.distributed as dist

    splits = [3, 3] if dist.get_rank() == 1 else [2, 2]  # rank 1 computed its splits differently
    sizes = {"output_split_sizes": [2, 2], "input_split_sizes": splits}
    dist.all_to_all_single(torch.zeros(4), torch.ones(sum(splits)), **sizes)  # line: a2a


def test_all_to_all_split_sizes_that_do_not_pair_up_name_the_rank_that_passed_them(tmp_path, leftovers):
    # rank i's input split j must be rank j's output split i: rank 1 sends 3 rows where 2 are expected
    found = _failed_run(_all_to_all_with_splits_of_its_own, keep_dir=tmp_path / "kept")
    assert (found.kind, found.ranks) == ("shape-mismatch", [1]), found.summary
    # the replay passes the recorded split sizes: the same mismatch, the same rank
    again = repro.run_script(repro.build_replay(tmp_path / "kept", tmp_path / "replay"), 1.5).diagnosis
    assert (again.kind, again.ranks) == ("shape-mismatch", [1]), again.summary
    site = f"{HERE}:{_line('a2a')}"
    # rank 0's call is seen unless rank 1 left before rank 0 got out of init_process_group (under
    # load in CI): rank 1's pair with itself is told from its own call alone
    assert found.summary.startswith(f"Ranks called all_to_all_single at {site} (collective #1) "
                                    "with split sizes that do not pair up: "), found.summary
    assert "rank 1 sends 3 rows to rank 1, which expects 2. Rank 1 passed" in found.summary
    assert found.fix.startswith(wording.SPLIT_CURE)
    leftovers.check()


def test_two_threads_are_read_from_a_dead_ranks_own_records_and_its_first_fatal_signal_counts():
    """CI, torch 2.13: gloo aborted rank 0 in its metrics thread's all_reduce; a second fault as
    faulthandler dumped its stacks cut the main thread's short and made its exit status SIGSEGV.
    Its records name the thread of each call; its Flight Recorder died with it."""
    from helpers.doctor.records import RankView

    views = {rank: RankView(rank) for rank in (0, 1)}
    calls = {0: [(1, 15, "977", 1.0), (2, 21, None, 1.1)], 1: [(1, 21, None, 1.0), (2, 15, "977", 1.05)]}
    for rank, ranks_calls in calls.items():
        for seq, line, thread, start in ranks_calls:
            views[rank].apply({"ev": "op", "id": seq, "op": "all_reduce", "pg": "0", "seq": seq, "t": start,
                               "shapes": [[1 if line == 15 else 8]], "dtypes": ["float32"],
                               "where": f"train.py:{line}", "file": "train.py", "line": line,
                               **({"thread": thread} if thread else {})})
    views[0].stack_text = "\n".join([
        "Fatal Python error: Aborted", "", "Thread 0x00007f3d7d4246c0 (most recent call first):",
        '  File "/x/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
        '  File "train.py", line 15 in metrics', "", "Thread 0x00007f3da23d8b80 (most recent call first):",
        '  File "/x/helpers/trace/tracer.py"Fatal Python error: Segmentation fault', ""])
    views[0].ended, views[0].exit_code = True, -signal.SIGSEGV
    views[1].ended, views[1].exit_code = True, 0
    views[1].apply({"ev": "exit", "status": "finished", "t": 2.0})
    found = doctor.diagnose(views, 2, "failure", 0.1)
    assert found.kind == "collective-mismatch", found.text()
    assert "Rank 0 was killed by SIGABRT inside all_reduce" in found.summary, found.summary
    assert found.per_rank[0].exit_code == -signal.SIGSEGV  # the exit status as it was
    assert (found.evidence.positions[0].detail
            == "killed by SIGABRT (then SIGSEGV, a second fault as its stack was dumped)")
    assert ("Rank 0 issued collectives on the default group from 2 threads: all_reduce at train.py:21 "
            "(the main thread) and all_reduce at train.py:15 (another thread)") in found.summary, \
        found.summary
    assert found.fix.startswith(wording.THREADS_CURE), found.fix


_GLOO_SPLIT_CHECK = ("RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/"
                     "alltoallv.cc:138] inLengthPerRank[myRank] == outLengthPerRank[myRank]. ")


def test_split_sizes_a_rank_rejected_alone_are_named_though_its_peer_left_init_as_an_echo():
    # CI, torch 2.13: rank 1 got through init_process_group first, gloo rejected its own split sizes
    # before sending anything, it left; rank 0, still connecting, raised 'Connection closed by peer'
    # (no collective of its own recorded). Was: rank 0's error named the crash
    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    views[0].apply({"ev": "exit", "status": "raised", "t": 2.0, "pg": {},
                    "error": "RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/pytorch/"
                             "third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                             "[127.0.0.1]:43725."})
    views[1].apply({"ev": "op", "id": 1, "op": "all_to_all_single", "pg": "0", "seq": 1, "shapes": [[6]],
                    "dtypes": ["float32"], "splits": [4, [2, 2], [3, 3]], "where": "moe.py:12",
                    "file": "moe.py", "line": 12, "t": 1.5})
    views[1].apply({"ev": "end", "id": 1, "t": 1.6, "ok": False, "error": _GLOO_SPLIT_CHECK})
    views[1].apply({"ev": "exit", "status": "raised", "t": 1.7, "pg": {"0": [1, 1]},
                    "error": _GLOO_SPLIT_CHECK, "where": "moe.py:12", "file": "moe.py", "line": 12})
    for view in views.values():
        view.ended, view.exit_code = True, 1
    found = doctor.diagnose(views, 2, "failure", 0.4)
    assert (found.verdict, found.kind, found.ranks) == ("crash", "shape-mismatch", [1]), found.summary
    assert found.summary.startswith("Ranks called all_to_all_single at moe.py:12 (collective #1) with "
                                    "split sizes that do not pair up: rank 1 sends 3 rows to rank 1, which "
                                    "expects 2. Rank 1 passed split sizes that do not match its own."), \
        found.summary
    assert found.per_rank[0].op == "init_process_group" and found.fix.startswith(wording.SPLIT_CURE)


def test_split_sizes_pair_up_when_each_rank_sends_what_its_peer_expects():
    from helpers.doctor.records import Op

    def call(outs, ins, rows=6):
        rows_in = sum(ins) if ins else rows
        return Op(op="all_to_all_single", seq=1, shapes=[[rows_in]], splits=[rows, outs, ins])

    # a mixture of experts' routing: every rank passes lists of its own, and they pair up
    routed = {0: call([1, 4, 2], [1, 3, 2]), 1: call([3, 1, 0], [4, 1, 1]), 2: call([2, 1, 3], [2, 0, 3])}
    assert diagnosis_module.split_mismatch(routed) == []
    even = {rank: call(None, None) for rank in range(3)}  # no lists: equal splits of 6 rows
    assert diagnosis_module.split_mismatch(even) == []
    routed[2] = call([2, 1, 3], [2, 1, 3])  # rank 2 sends 1 row to rank 1, which expects 0 from it
    assert diagnosis_module.split_mismatch(routed) == [(2, 1, 1, 0)]


def _broadcast_from_its_own_rank():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dist.broadcast(torch.zeros(4), src=1 if rank == 1 else 0)  # line: broadcast root
    dist.barrier()


def test_a_broadcast_with_a_root_of_its_own_names_that_rank(leftovers):
    found = _hung_run(_broadcast_from_its_own_rank, num_processes=3)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.summary
    site = f"{HERE}:{_line('broadcast root')}"
    assert found.summary.startswith(f"Ranks called broadcast at {site} (collective #"), found.summary
    assert "with different roots: ranks 0 and 2 src=0; rank 1 src=1. Rank 1 differs" in found.summary
    assert found.fix.startswith(wording.ROOT_CURE), found.fix
    leftovers.check()


def _ddp_rank_skips_a_layer():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, both):
            return self.second(self.first(x)) if both else self.first(x)

    model = DistributedDataParallel(Net())
    for step in range(4):
        both = not (dist.get_rank() == 1 and step == 1)  # rank 1 skips a layer once
        model(torch.ones(2, 8), both).sum().backward()  # line: ddp step


def test_ddp_parameters_unused_on_one_rank_are_named_with_the_ddp_fix(leftovers):
    found = _failed_run(_ddp_rank_skips_a_layer)
    assert (found.kind, found.ranks) == ("rank-exited", [1])
    assert found.summary.startswith("Rank 1 raised RuntimeError: Expected to have finished reduction in the "
                                    "prior iteration"), found.summary
    waiting = found.per_rank[0]
    assert waiting.location == f"{HERE}:{_line('ddp step')}" and waiting.op == "all_reduce"
    assert found.fix.startswith("DDP: some parameters got no gradient on that rank"), found.fix
    assert "find_unused_parameters=True" in found.fix and found.fix.endswith(doctor.FIXES["rank-exited"])
    leftovers.check()


def _ddp_models_built_differently():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    width = 9 if dist.get_rank() == 1 else 8  # a config read from the rank's own file
    DistributedDataParallel(torch.nn.Linear(width, 4))  # line: ddp wrap


def test_ddp_models_built_differently_name_the_odd_rank_with_the_ddp_fix(leftovers):
    found = _failed_run(_ddp_models_built_differently)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    assert "appears not to match sizes of the same param in process 0" in found.summary, found.summary
    assert found.fix.startswith("DDP found that the ranks built different models"), found.fix
    leftovers.check()


def test_a_known_error_leads_the_fix_only_for_a_culprit_that_raised_it():
    """torch's own first sentences (2.13); a rank that merely waited keeps the kind's fix alone."""
    from helpers.doctor.records import Position

    oom = Position(1, "exited", detail="raised torch.OutOfMemoryError: CUDA out of memory.")
    fix = wording.fix("rank-exited", [oom])
    assert fix.startswith("CUDA ran out of memory on that rank") and wording.NB_MEMORY in fix
    assert fix.endswith(doctor.FIXES["rank-exited"])
    assert wording.fix("rank-exited", [Position(1, "exited", detail="raised ValueError: bad row.")]) == (
        doctor.FIXES["rank-exited"])
    assert wording.fix("rank-missing", []) == doctor.FIXES["rank-missing"]
    # unseen script: DDP with find_unused_parameters=True, a step skipped after its forward on a NaN loss
    twice = Position(1, "exited", detail="raised RuntimeError: Expected to mark a variable ready only once. "
                                         "This error is caused by one of the following reasons: ...")
    assert wording.fix("rank-exited", [twice]).startswith("DDP marked a parameter's gradient ready twice")
    # unseen script: a defaultdict(lambda: ...) of one rank's own in an all_gather_object, as
    # Python 3.11 words each kind of object that cannot be pickled
    for error in ("AttributeError: Can't pickle local object 'summarize.<locals>.<lambda>'",
                  "TypeError: cannot pickle '_thread.lock' object",
                  "_pickle.PicklingError: Can't pickle <function <lambda> at 0x7f>: attribute lookup failed"):
        gather = doctor.Op(op="all_gather_object", seq=14)
        fix = wording.fix("rank-exited", [Position(3, "exited", op=gather, detail=f"raised {error}")])
        assert fix.startswith("An object collective (all_gather_object, "), fix
        # the same words from a DataLoader's spawned workers, no object collective: not that cure
        assert not wording.fix("rank-exited", [Position(3, "exited", detail=f"raised {error}")]).startswith(
            "An object collective")
    # NCCL asked for where it cannot run: a CPU build of torch (as here), or a machine without GPUs
    for error in ("RuntimeError: Distributed package doesn't have NCCL built in",
                  "ValueError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!"):
        fix = wording.fix("rank-exited", [Position(0, "exited", detail=f"raised {error}")])
        assert fix.startswith("The NCCL backend runs on CUDA GPUs only") and "gloo" in fix, fix


def test_a_shape_mismatch_in_a_broadcast_leads_with_the_tensors_each_rank_holds_not_padding():
    # unseen script: rank 0 alone resized its embeddings, then broadcast its state dict
    from helpers.doctor.records import Op, Position

    def culprit(name):
        return Position(0, "in-collective", op=Op(op=name, seq=4, pg="0", shapes=[[104, 16]]))

    assert wording.fix("shape-mismatch", [culprit("broadcast")]).startswith(wording.IN_PLACE_CURE)
    assert wording.fix("shape-mismatch", [culprit("gloo:all_reduce")]).startswith(wording.IN_PLACE_CURE)
    assert wording.fix("shape-mismatch", [culprit("all_gather")]) == doctor.FIXES["shape-mismatch"]


def test_nccl_asked_for_on_a_cpu_build_of_torch_raises_what_the_cure_matches(tmp_path):
    # the first of those sentences is this machine's torch's own (a CPU build, without NCCL)
    import torch.distributed as dist

    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL built in")
    script = tmp_path / "nccl.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")
    done = _doctor_cli("--num-processes", "2", "--stall-s", "2", "--json", str(tmp_path / "d.json"), "--",
                       str(script))
    data = json.loads((tmp_path / "d.json").read_text())
    assert (done.returncode, data["kind"], data["ranks"]) == (4, "rank-exited", [0, 1]), done.stderr[-2000:]
    assert data["fix"].startswith("The NCCL backend runs on CUDA GPUs only"), data["fix"]


def test_a_flight_recorder_entry_belongs_to_the_call_whose_times_hold_it_not_the_next_one():
    """Times seen under load (rank 1 of the fixed in-order-logging script, torch 2.13 gloo): the
    all_reduce after a 49 us barrier started within the clocks' slack of the barrier's entry."""
    from helpers.doctor.records import RankView

    view = RankView(1)
    for op_id, (name, seq, start, end, line) in enumerate([("barrier", 32, 5.045912, 5.045961, 59),
                                                           ("all_reduce", 33, 5.046014, 5.046230, 51)]):
        view.apply({"ev": "op", "id": op_id, "op": name, "pg": "0", "seq": seq, "t": start, "te": end,
                    "ok": True, "where": f"in_order_logging_fixed.py:{line}", "line": line})
    entries = [("gloo:barrier", 32, 5.045930), ("gloo:all_reduce", 33, 5.046037)]
    view.state = {"fr": [{"profiling_name": name, "collective_seq_id": seq, "time_created_ns": int(t * 1e9),
                          "retired": True} for name, seq, t in entries]}
    found = diagnosis_module.history(view)
    assert (found[("0", 32)].op, found[("0", 32)].line) == ("barrier", 59)
    assert (found[("0", 33)].op, found[("0", 33)].line) == ("all_reduce", 51)


def test_a_flight_recorder_entry_after_an_async_call_returned_is_not_that_calls():
    """Times seen under Join (rank 0 of test_ddp_under_joins_uneven_inputs_is_healthy): the shadowing
    rank's async all_reduce of 1 float returned, was waited for, and DDP's gradient all-reduce of 2632
    floats was created from C++ 100 us after the return, before the work's end was noted."""
    from helpers.doctor.records import RankView

    view = RankView(0)
    view.apply({"ev": "op", "id": 70, "op": "all_reduce", "pg": "0", "seq": 109, "t": 8.741361, "async": True,
                "shapes": [[1]], "where": "train.py:7", "line": 7})
    view.apply({"ev": "enq", "id": 70, "t": 8.741607})
    view.apply({"ev": "end", "id": 70, "t": 8.741807, "ok": True})  # the work's end, noted late
    entries = [("gloo:all_reduce", 109, 8.741393, [[1]]), ("gloo:all_reduce", 110, 8.741707, [[2632]])]
    view.state = {"fr": [{"profiling_name": name, "collective_seq_id": seq, "time_created_ns": int(t * 1e9),
                          "input_sizes": sizes, "retired": True} for name, seq, t, sizes in entries]}
    found = diagnosis_module.history(view)
    assert (found[("0", 109)].line, found[("0", 109)].shapes) == (7, [[1]])
    assert (found[("0", 110)].line, found[("0", 110)].shapes) == (None, [[2632]])


def test_a_flight_recorder_entry_is_not_taken_by_a_call_on_another_group():
    """Times seen on rank 0 of a healthy job (p3 of a blind batch): a thread of its own reduced
    metrics on a second group, blocking, and began 74 us after the main thread's async all_reduce of
    a gradient, whose Flight Recorder entry on the default group was created 1.3 ms later, inside the
    thread's call. The entry was taken for that call, with its line and shape, and the job was failed
    as a mismatch with the other ranks, in 2 of 4 runs."""
    from helpers.doctor.records import RankView

    view = RankView(0)
    view.apply({"ev": "op", "id": 999, "op": "all_reduce", "pg": "0", "seq": 857, "t": 4.438745,
                "async": True, "shapes": [[256]], "where": "train.py:59", "line": 59})
    view.apply({"ev": "op", "id": 1000, "op": "all_reduce", "pg": "1", "pg_ranks": [0, 1], "seq": 142,
                "t": 4.438819, "te": 4.442965, "ok": True, "shapes": [[3]], "where": "train.py:27",
                "line": 27, "thread": "7"})
    view.state = {"fr": [{"profiling_name": "gloo:all_reduce", "collective_seq_id": 857, "pg": "0",
                          "time_created_ns": 4_440_088_077, "input_sizes": [[256]], "retired": True}]}
    found = diagnosis_module.history(view)[("0", 857)]
    assert (found.shapes, found.line) != ([[3]], 27), found


def _view_of_calls(calls, fr_threads):
    """A rank's view: Python calls (op, seq, line, start, end) on the default group, and its Flight
    Recorder entries of those numbers, each issued by the thread given (thread id, main thread?)."""
    from helpers.doctor.records import RankView

    view = RankView(0)
    for op_id, (name, seq, line, start, end) in enumerate(calls):
        view.apply({"ev": "op", "id": op_id, "op": name, "pg": "0", "seq": seq, "t": start, "where":
                    f"train.py:{line}", "line": line, **({"te": end, "ok": True} if end is not None else {})})
    view.state = {"fr": [{"pg": "0", "collective_seq_id": call[1], "profiling_name": f"gloo:{call[0]}",
                          "thread": thread, "main": main, "retired": call[4] is not None}
                         for call, (thread, main) in zip(calls, fr_threads, strict=True)]}
    return view


def test_a_rank_known_from_its_records_alone_is_compared_with_ranks_known_from_their_flight_recorder():
    """Seen in a two-node accelerate job: rank 2, under 'if accelerator.is_local_main_process:',
    reduced 1 float as collective #8 while ranks 1 and 3 issued DDP's 9; gloo aborted rank 2 before
    it could answer, so only its record of the call reached the leader. Without p2p ops the two
    sources number collectives alike."""
    from helpers.doctor.records import RankView

    views = {rank: RankView(rank) for rank in range(3)}
    for rank in (0, 1):
        views[rank].state = {"fr": [{"pg": "0", "collective_seq_id": 8, "profiling_name": "gloo:all_reduce",
                                     "input_sizes": [[9]], "input_dtypes": ["Float"], "retired": False}]}
    views[2].apply({"ev": "op", "id": 1, "op": "all_reduce", "pg": "0", "seq": 8, "t": 1.0, "shapes": [[1]],
                    "dtypes": ["float32"], "where": "train.py:22", "file": "train.py", "line": 22})
    histories = {rank: diagnosis_module.history(view) for rank, view in views.items()}
    key, groups, present = diagnosis_module.first_divergence(histories, mixed=True)
    assert key == ("0", 8) and sorted(present) == [0, 1, 2], present
    assert diagnosis_module.first_divergence(histories) is None  # the Flight Recorder's ranks agree


def test_a_rank_known_from_its_records_alone_in_an_object_list_call_is_compared_by_its_lists_length():
    """Seen under torchrun: broadcast_object_list with a list of 2 on rank 0 and of 1 elsewhere; gloo
    aborted ranks 1 and 2, known from their records alone ('broadcast_object_list', a list of 1),
    while the others' Flight Recorder shows the call's first inner collective, the tensor of the
    objects' sizes: one call, not 'different collectives' (all four ranks were blamed)."""
    from helpers.doctor.records import Op

    def recorded(rank: int, length: int) -> Op:
        return Op(op="broadcast_object_list (broadcast)", seq=1, pg="0", shapes=[[length]], dtypes=["int64"],
                  source="flight-recorder", where="cfg.py:18")

    histories = {0: {("0", 1): recorded(0, 2)}, 3: {("0", 1): recorded(3, 1)}}
    for rank in (1, 2):
        histories[rank] = {("0", 1): Op(op="broadcast_object_list", seq=1, pg="0", shapes=[[1]],
                                         dtypes=["object"], where="cfg.py:18")}
    # one call on every rank (the lists' lengths are then compared from the ranks' own records)
    assert diagnosis_module.first_divergence(histories, mixed=True) is None


def test_two_threads_are_evidence_only_when_both_were_in_flight_at_the_end():
    main, other = ("140", True), ("977", False)
    turns = _view_of_calls([("all_reduce", 1, 19, 1.0, None), ("all_reduce", 2, 13, 1.2, None)],
                           [main, other])
    found = diagnosis_module._threads_on_one_group(turns)
    assert {thread: (op.where, is_main) for thread, (op, is_main) in found.items()} == {
        "140": ("train.py:19", True), "977": ("train.py:13", False)}
    # a worker thread joined before the main thread's next call: one after the other, never at once
    joined = _view_of_calls([("all_reduce", 1, 13, 1.0, 1.1), ("barrier", 2, 25, 2.0, None)], [other, main])
    assert diagnosis_module._threads_on_one_group(joined) is None
    # a thread that ran once, long before the end (a setup step), is not the failure's cause
    earlier = _view_of_calls([("barrier", 1, 5, 1.0, None), ("all_reduce", 2, 19, 2.0, 2.1),
                              ("all_reduce", 3, 19, 3.0, None)], [other, main, main])
    assert diagnosis_module._threads_on_one_group(earlier) is None
    # a number two Python calls took (the threads raced reading it) cannot be matched: left out
    raced = _view_of_calls([("all_reduce", 1, 19, 1.0, None), ("all_reduce", 1, 13, 1.2, None)],
                           [main, other])
    assert diagnosis_module._threads_on_one_group(raced) is None


def test_a_dump_names_each_thread_by_the_id_the_flight_recorder_uses(tmp_path):
    import faulthandler
    import threading

    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), release.wait(30)))
    worker.start()
    started.wait(30)
    try:
        with open(tmp_path / "stack.txt", "w+") as handle:
            faulthandler.dump_traceback(handle, all_threads=True)
            handle.seek(0)
            text = handle.read()
    finally:
        release.set()
        worker.join()
    threads = {thread: main for thread, main, _frames in source.faulthandler_threads(text)}
    assert threads[str(worker.ident)] is False
    assert threads[str(threading.main_thread().ident)] is True
    assert source.faulthandler_threads("Thread 0x1 (most recent call first):") == [("1", False, [])]


def _subgroup_member_stays_behind():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    if rank == 3:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # line: behind
            time.sleep(0.05)
        return
    if rank == 2:
        dist.all_reduce(torch.ones(2), group=high)  # line: subgroup
    else:
        dist.all_reduce(torch.ones(2), group=low)
    dist.barrier()  # line: world barrier


def test_ranks_waiting_in_different_operations_are_each_named(leftovers):
    found = _hung_run(_subgroup_member_stays_behind, num_processes=4)
    assert (found.kind, found.ranks) == ("rank-missing", [3])
    assert found.summary.startswith(
        f"Rank 3 never reached the barrier that ranks 0 and 1 entered at {HERE}:{_line('world barrier')} "
        f"(collective #"), found.summary
    assert f"nor the all_reduce that rank 2 entered at {HERE}:{_line('subgroup')}" in found.summary
    leftovers.check()


def _subgroup_collective_skipped():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    pair = dist.new_group([2, 3])
    tensor = torch.ones(2)
    for step in range(3):
        dist.all_reduce(tensor)  # line: world all_reduce
        if rank in (2, 3) and not (rank == 3 and step == 1):
            dist.all_reduce(tensor, group=pair)  # line: pair all_reduce


def test_a_subgroup_collective_one_member_skips_is_named_though_every_rank_waits(leftovers):
    # rank 2 waits in the pair's all_reduce that rank 3 skipped; rank 3 in the next world all_reduce,
    # which rank 2 cannot reach: every rank in a collective, no numbered collective issued by two
    # ranks differently
    found = _hung_run(_subgroup_collective_skipped, num_processes=4)
    assert (found.kind, found.ranks) == ("collective-mismatch", [3]), found.summary
    assert found.summary.startswith(
        f"Rank 3 never issued the all_reduce of group 1 (ranks 2 and 3) that rank 2 waits in at "
        f"{HERE}:{_line('pair all_reduce')} (its collective #2): rank 3 waits in the all_reduce at "
        f"{HERE}:{_line('world all_reduce')} (collective #3 of the default group)"), found.summary
    leftovers.check()


def _subgroup_call_skipped_by_a_continue():
    import torch
    import torch.distributed as dist

    pair = dist.new_group([2, 3])
    for step in range(3):
        dist.all_reduce(torch.ones(2))
        for part in range(2 if dist.get_rank() in (2, 3) else 0):  # line: parts loop
            if dist.get_rank() == 3 and step == 1 and part == 1:  # a parameter without a gradient
                continue  # line: part skip
            dist.all_reduce(torch.ones(2), group=pair)  # line: pair call


def test_a_subgroup_collective_a_continue_skipped_names_the_loop_and_the_continue(leftovers):
    # unseen script: a hand-written hierarchical reducer whose loop over parameters skips one without
    # a gradient on one rank: no branch around the group's call, a continue before it
    found = _hung_run(_subgroup_call_skipped_by_a_continue, num_processes=4)
    assert (found.kind, found.ranks) == ("collective-mismatch", [3]), found.text()
    assert (f"Each waits for the other: the loop at {HERE}:{_line('parts loop')} around that call issued "
            f"fewer of its collectives on rank 3 than on rank 2. In that loop, the continue at "
            f"{HERE}:{_line('part skip')} (if dist.get_rank() == 3") in found.summary, found.summary
    assert found.fix.startswith(wording.LOOP_EXIT_CURE), found.fix
    leftovers.check()


def _subgroup_branch_on_each_ranks_own_loss():
    import torch
    import torch.distributed as dist

    group, _ = dist.new_subgroups(group_size=2)
    x = torch.full((4,), float(dist.get_rank() * 10))
    for _step in range(3):
        local_loss = x.sum().item()  # 80 on rank 2, 120 on rank 3
        if local_loss < 100:
            dist.all_reduce(x, group=group)  # line: own loss
        dist.barrier(group=group)  # line: subgroup barrier


def test_a_subgroups_calls_that_differ_name_the_subgroup_and_a_condition_on_a_loss_of_its_own_name(leftovers):
    # ranks 0 and 1 agree (both below 100) and finish; in the subgroup of ranks 2 and 3, rank 2 takes
    # the branch on its own loss (named local_loss, not loss) and rank 3 waits in the barrier
    found = _hung_run(_subgroup_branch_on_each_ranks_own_loss, num_processes=4)
    assert (found.kind, found.ranks) == ("collective-mismatch", [2]), found.text()
    assert found.summary.startswith("Ranks issued different collectives as collective #1 of group "), \
        found.summary
    assert (f"(ranks 2 and 3): rank 2 in all_reduce at {HERE}:{_line('own loss')}; rank 3 in barrier at "
            f"{HERE}:{_line('subgroup barrier')}.") in found.summary, found.summary
    assert (f"under 'if local_loss < 100:' at {HERE}:{_line('own loss') - 1}, {wording.DECIDES_ITSELF}"
            in found.summary), found.summary
    assert found.fix.startswith(wording.CONDITION_CURE), found.fix
    leftovers.check()


def _data_parallel_sync_skipped_on_one_replica():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank, tensor = dist.get_rank(), torch.ones(4)
    for step in range(3):
        dist.all_reduce(tensor, group=mesh.get_group("tp"))
        if not (rank == 2 and step == 1):
            dist.all_reduce(tensor, group=mesh.get_group("dp"))  # line: dp sync
    dist.barrier()  # line: mesh barrier


def test_a_subgroup_collective_skipped_before_the_first_collective_of_the_world_is_named(leftovers):
    # rank 0 waits in its data-parallel group's third all_reduce; rank 2, its peer there, issued two
    # and waits in the world's first barrier, a group rank 0 has issued nothing in yet: every rank
    # of the world is a member of the default group, issued or not
    found = _hung_run(_data_parallel_sync_skipped_on_one_replica, num_processes=4)
    assert (found.kind, found.ranks) == ("collective-mismatch", [2]), found.text()
    assert found.summary.startswith("Rank 2 never issued the all_reduce of group "), found.summary
    dp_sync, barrier = f"{HERE}:{_line('dp sync')}", f"{HERE}:{_line('mesh barrier')}"
    said = (f"'mesh_dp' (ranks 0 and 2) that rank 0 waits in at {dp_sync} (its collective #3): rank 2 waits "
            f"in the barrier at {barrier} (collective #1 of the default group)")
    assert said in found.summary, found.summary
    assert found.summary.endswith(f"(its call here is under 'if not (rank == 2 and step == 1):' at "
                                  f"{HERE}:{_line('dp sync') - 1}).")
    leftovers.check()


def _wraps_a_second_model_on_rank_zero_alone():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # the student on every rank: a process's first DDP takes about 2.5 s before its first collective
    # here (lazy imports), longer than stall_s, where rank 0 alone would still be on its way
    student = DistributedDataParallel(torch.nn.Linear(2, 1))
    if dist.get_rank() == 0:
        teacher = DistributedDataParallel(torch.nn.Linear(2, 1))  # line: teacher
        teacher(torch.ones(1, 2))
    student(torch.ones(1, 2))
    dist.barrier()


def test_a_model_wrapped_in_ddp_on_one_rank_alone_is_named_by_ddps_constructor(leftovers):
    found = _hung_run(_wraps_a_second_model_on_rank_zero_alone)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert f"at {HERE}:{_line('teacher')}, {wording.DDP_CONSTRUCTOR}" in found.summary, found.summary
    assert found.fix.startswith(wording.PREPARED_ON_ONE_RANK_CURE), found.fix
    leftovers.check()


def _groups_in_opposite_orders():
    import torch
    import torch.distributed as dist

    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    for group in ([first, second] if dist.get_rank() == 0 else [second, first]):
        dist.all_reduce(torch.ones(2), group=group)  # line: crossed groups


def test_two_groups_of_the_same_ranks_used_in_opposite_orders_name_both_ranks(leftovers):
    # each rank's first collective is in a group the other has not reached: no rank outside a
    # collective, no number issued differently, and neither group is the smaller one to blame
    found = _hung_run(_groups_in_opposite_orders)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0, 1]), found.summary
    site = f"{HERE}:{_line('crossed groups')}"
    assert (f"rank 0 in the all_reduce of group 1 (ranks 0 and 1) at {site} (its collective #1 there); "
            f"rank 1 in the all_reduce of group 2 (ranks 0 and 1) at {site}") in found.summary, found.summary
    assert found.fix.startswith(wording.CROSSED_GROUPS_CURE)
    leftovers.check()


def _pair_groups_in_a_ring_of_orders():
    import torch
    import torch.distributed as dist

    pairs = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (1, 2), (0, 2))}
    order = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}[dist.get_rank()]
    for ranks in order:  # each rank starts with the pair that the next rank reaches last
        dist.all_reduce(torch.ones(2), group=pairs[ranks])  # line: ring of pairs


def test_three_pair_groups_waiting_in_a_ring_name_the_ring(leftovers):
    # rank 0 waits for rank 1 in their pair, rank 1 for rank 2 in theirs, rank 2 for rank 0: no two
    # ranks wait for each other, the cycle runs through all three (was: unknown)
    found = _hung_run(_pair_groups_in_a_ring_of_orders, num_processes=3)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0, 1, 2]), found.summary
    site = f"{HERE}:{_line('ring of pairs')}"
    assert (f"rank 0 in the all_reduce of group 1 (ranks 0 and 1) at {site} (its collective #1 there); "
            f"rank 1 in the all_reduce of group 2 (ranks 1 and 2) at {site} (its collective #1 there); "
            f"rank 2 in the all_reduce of group 3 (ranks 0 and 2) at {site}") in found.summary, found.summary
    assert found.fix.startswith(wording.CROSSED_GROUPS_CURE)
    leftovers.check()


def test_a_chain_of_waits_that_ends_outside_any_collective_is_no_cycle():
    from helpers.doctor.records import Position

    def waits_in(rank: int, group: str) -> Position:
        return Position(rank, "in-collective", op=doctor.Op("all_reduce", pg=group, seq=1), seq=1)

    waiting = {0: waits_in(0, "a"), 1: waits_in(1, "b"), 2: waits_in(2, "c")}
    ahead = {0: 1, 1: 2, 2: 0}  # who holds up whom: 1 holds 0, 2 holds 1, 0 holds 2
    assert diagnosis_module._wait_cycle(waiting, lambda rank, pos: ahead[pos.rank] == rank) == [0, 1, 2]
    ahead[2] = 3  # rank 2 waits for a rank outside any collective: a chain, not a cycle
    assert diagnosis_module._wait_cycle(waiting, lambda rank, pos: ahead[pos.rank] == rank) == []


def _side_group_in_a_branch(rank: int, calls: list) -> None:  # the lines the views below cite
    calls.append("world")  # line: world first
    if rank == 0:
        calls.append("side")  # line: side group in a branch
    calls.append("world")  # line: world next


def test_a_side_group_of_every_rank_used_in_a_branch_names_the_rank_that_skipped_it_not_both():
    # new_group([0, 1]) in a world of 2 (a gloo group for objects): as large as the world, but the
    # wait is inside an if on the rank: a branch, not an order
    def record(view, op_id, pg, seq, marker, ended, **extra):
        line = _line(marker)
        view.apply({"ev": "op", "id": op_id, "op": "all_reduce", "pg": pg, "seq": seq, "shapes": [[2]],
                    "dtypes": ["float32"], "t": float(op_id), "file": __file__, "line": line,
                    "where": f"{HERE}:{line}", **extra, **({"te": op_id + 0.5, "ok": True} if ended else {})})

    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    for view in views.values():
        record(view, 1, "0", 1, "world first", True)
    record(views[0], 2, "1", 1, "side group in a branch", False, pg_ranks=[0, 1])
    record(views[1], 2, "0", 2, "world next", False)
    found = doctor.diagnose(views, 2, "stall", 1.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.summary
    assert "a collective of a subgroup inside a branch" in found.summary, found.summary


def _uneven_batches(batches_per_rank: list[int]):
    import torch
    import torch.distributed as dist

    batches = [torch.ones(2)] * batches_per_rank[dist.get_rank()]  # uneven shards: even_batches=False
    for batch in batches:  # line: batches
        dist.all_reduce(batch)
    dist.barrier()  # line: after the loop


def _uneven_hang(batches_per_rank: list[int]):
    with pytest.raises(doctor.HangDetected) as info:
        doctor.launch(_uneven_batches, (batches_per_rank,), num_processes=3, timeout_s=60, stall_s=1.5)
    return info.value.diagnosis


def test_a_rank_whose_loop_ran_out_first_is_said_to_have_left_it(leftovers):
    found = _uneven_hang([3, 2, 3])
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert f"rank 1 in barrier at {HERE}:{_line('after the loop')}" in found.summary, found.summary
    assert found.summary.endswith(
        f". Rank 1 has left the loop at {HERE}:{_line('batches')} that the others are still in: its loop "
        "ran out first (a DataLoader with fewer batches on that rank, as with accelerate's "
        "even_batches=False, a break or a condition that holds on that rank alone, or a collective that "
        "rank skipped inside it, as DDP's no_sync() does)."), found.summary
    assert "took a different path" not in found.summary  # the loop says it better
    assert found.fix.startswith("Give every rank the same number of iterations: keep accelerate's "
                                "even_batches=True"), found.fix
    leftovers.check()


def _train_epoch(batches):
    import torch.distributed as dist

    for batch in batches:  # line: helper batches
        dist.all_reduce(batch)  # line: helper call


def _uneven_batches_in_a_helper():
    import torch
    import torch.distributed as dist

    _train_epoch([torch.ones(2)] * (3 - dist.get_rank()))  # line: train epoch
    dist.barrier()  # line: after the epoch


def test_a_rank_whose_loop_in_a_called_function_ran_out_first_is_said_to_have_left_it(leftovers):
    # the batch loop inside train_epoch(): rank 1 has returned from it, rank 0 is still in its loop
    # (unseen script: gradient accumulation over hand-sharded data, the loop in a helper)
    found = _hung_run(_uneven_batches_in_a_helper)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert (f"Rank 1 has left the loop at {HERE}:{_line('helper batches')} that the others are still in "
            f"(inside the call at {HERE}:{_line('train epoch')}, which that rank has returned from): its "
            "loop ran out first") in found.summary, found.summary
    assert found.fix.startswith("Give every rank the same number of iterations"), found.fix
    leftovers.check()


_DDP_SKIPS_A_BACKWARD = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(4, 1))
for step in range(4):
    loss = None if dist.get_rank() == 1 and step == 2 else model(torch.ones(2, 4)).sum()
    if loss is None:
        continue
    loss.backward()
"""


def test_a_rank_one_ddp_all_reduce_short_names_the_continue_that_skipped_it(tmp_path, leftovers):
    # DDP's all-reduces are issued from C++: the finished rank's last one is known from the Flight
    # Recorder alone, without a line (unseen script: a batch with no labelled tokens skipped)
    done, data = _diagnosed_script(tmp_path, "skip.py", _DDP_SKIPS_A_BACKWARD)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), done.stderr[-3000:]
    assert "The loop at skip.py:7 ran out first on rank 1" in data["summary"], data["summary"]
    assert "the continue at skip.py:10 (if loss is None) skips the rest of its turn" in data["summary"], \
        data["summary"]
    assert data["fix"].startswith(wording.LOOP_EXIT_CURE), data["fix"]
    leftovers.check()


def _main_process_call_after_each_epochs_batches():
    import torch
    import torch.distributed as dist

    for _epoch in range(3):
        for _batch in range(2):
            dist.all_reduce(torch.ones(4))  # line: epoch batches
        if dist.get_rank() == 0:
            dist.barrier()  # line: main process checkpoint


def test_a_main_process_call_after_the_batches_inside_an_epoch_loop_is_no_loop_that_ran_out(leftovers):
    # rank 0's barrier after the batches meets rank 1's all_reduce of the next epoch: rank 1 went
    # round the epoch loop past a call of rank 0's own; no loop ran out (unseen script: save_state()
    # under is_main_process with automatic_checkpoint_naming, whose wait_for_everyone this is)
    found = _hung_run(_main_process_call_after_each_epochs_batches)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert "ran out first" not in found.summary, found.summary
    assert (f"under 'if dist.get_rank() == 0:' at {HERE}:{_line('main process checkpoint') - 1}"
            in found.summary), found.summary
    assert found.fix.startswith("Make every rank issue the same collectives in the same order"), found.fix
    leftovers.check()


def _early_stop_on_each_ranks_own_patience():
    import torch
    import torch.distributed as dist

    bad, patience = 0, 2 - dist.get_rank()  # rank 1 runs out of patience first
    for _epoch in range(5):  # line: epochs
        for _batch in range(2):
            dist.all_reduce(torch.ones(4))  # line: patience batches
        bad += 1
        if bad >= patience:
            break  # line: patience break
    dist.barrier()  # line: after the epochs


def test_a_break_that_leaves_the_epoch_loop_names_that_loop_and_the_break(leftovers):
    found = _hung_run(_early_stop_on_each_ranks_own_patience)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert (f"Rank 1 has left the loop at {HERE}:{_line('epochs')} that the others are still in"
            in found.summary), found.summary
    assert (f"the break at {HERE}:{_line('patience break')} (if bad >= patience) ends the loop"
            in found.summary), found.summary
    leftovers.check()


def test_ranks_whose_loops_ran_out_first_are_named_when_they_are_the_many(leftovers):
    # two of three ranks are past the loop: the odd one out (the culprit) is the rank still in it
    found = _uneven_hang([3, 2, 2])
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert (f". Ranks 1 and 2 have left the loop at {HERE}:{_line('batches')} that rank 0 is still in: "
            "their loops ran out first (a DataLoader with fewer batches on those ranks") in found.summary
    assert f": rank 0 in all_reduce at {HERE}:" in found.summary, found.summary  # the same said once:
    assert f"; ranks 1 and 2 in barrier at {HERE}:{_line('after the loop')}." in found.summary
    leftovers.check()


def test_a_loop_is_said_to_be_left_only_by_a_call_past_its_end_in_its_function(tmp_path):
    from helpers.doctor.source import loop_left

    script = tmp_path / "train.py"
    script.write_text("def train(loader):\n"
                      "    for batch in loader:\n"
                      "        step(batch)\n"
                      "        if batch is None:\n"
                      "            barrier()\n"
                      "    barrier()\n"
                      "\n"
                      "def other():\n"
                      "    barrier()\n")
    assert loop_left(str(script), 3, 6) == 2  # past the loop's end, in train()
    assert loop_left(str(script), 3, 5) is None  # still inside the loop
    assert loop_left(str(script), 3, 9) is None  # in another function
    assert loop_left(str(script), 6, 9) is None  # the first call is in no loop
    assert loop_left(str(tmp_path / "missing.py"), 3, 6) is None


def _skips_a_turn_on_a_bad_loss():
    import math

    import torch
    import torch.distributed as dist

    for step in range(3):  # line: skip loop
        loss = float("nan") if dist.get_rank() == 1 and step == 1 else 1.0  # one rank's batch goes bad
        if math.isnan(loss):
            continue  # line: skip
        dist.all_reduce(torch.tensor([loss]))  # line: skipped call
    dist.barrier()


def test_a_continue_that_skips_a_turn_on_one_rank_is_named_with_its_condition_and_cure(leftovers):
    found = _hung_run(_skips_a_turn_on_a_bad_loss)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert found.summary.endswith(
        f"In that loop, the continue at {HERE}:{_line('skip')} (if math.isnan(loss)) skips the rest of "
        "its turn: it can end a turn on some ranks alone, leaving them fewer collectives than the others."), \
        found.summary
    assert f"left the loop at {HERE}:{_line('skip loop')}" in found.summary, found.summary
    assert found.fix.startswith(wording.LOOP_EXIT_CURE + " " + wording.UNEVEN_LOOP_CURE), found.fix
    leftovers.check()


def _skips_the_rest_of_one_turn():
    import math

    import torch
    import torch.distributed as dist

    for step in range(6):  # line: turn loop
        dist.broadcast(torch.zeros(2), 0)
        loss = float("nan") if dist.get_rank() == 1 and step == 2 else 1.0
        if math.isnan(loss):
            continue  # line: turn skip
        dist.all_reduce(torch.tensor([loss]))  # line: turn call


def test_a_rank_that_skipped_the_rest_of_a_turn_is_named_in_its_next_turn_with_the_continue(leftovers):
    # rank 1 is at the loop's first call again (its broadcast) while rank 0 waits in the all_reduce
    # further down: one rank on each side, and the one that came round is the one that skipped
    found = _hung_run(_skips_the_rest_of_one_turn)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    said = (f"Rank 1 has {wording.LATER_TURN} {HERE}:{_line('turn loop')} again without the all_reduce "
            f"at {HERE}:{_line('turn call')} that rank 0 waits in (its next turn, or the loop run anew). In "
            f"that loop, the continue at {HERE}:{_line('turn skip')} (if math.isnan(loss)) skips the rest")
    assert said in found.summary, found.summary
    assert found.fix.startswith(wording.LOOP_EXIT_CURE), found.fix
    assert wording.UNEVEN_LOOP_CURE not in found.fix  # no loop ran out here
    leftovers.check()


def _turn_ops(script: Path, calls: dict[int, tuple[str, int]]) -> dict:
    """Each rank's call (op, line) at collective #12 of ``script``, as the doctor's records give it."""
    from helpers.doctor.records import Op

    return {rank: Op(op=name, seq=12, pg="0", file=str(script), line=line, where=f"{script.name}:{line}")
            for rank, (name, line) in calls.items()}


def _culprits(present: dict) -> list[int]:
    from helpers.doctor.diagnosis import _odd_ones_out

    groups: dict = {}
    for rank, each in present.items():
        groups.setdefault(each.signature(), []).append(rank)
    return _odd_ones_out(groups, present, {}, ("0", 12), {})


def test_the_ranks_that_came_round_a_loop_past_the_others_call_are_the_culprits(tmp_path):
    # the other side's call sits under a rank condition that most ranks pass: the few that skipped it
    # are the odd ones (4 ranks: 3 wait in the barrier); in a tie the branch on the rank is, as for
    # the catalog's in-order logging under 'if accelerator.is_main_process:'
    script = tmp_path / "train.py"
    script.write_text("for step in range(9):\n"
                      "    all_reduce(t)\n"
                      "    if not (rank == 1 and step == 5):\n"
                      "        barrier()\n")
    for world in (2, 4):
        present = _turn_ops(script, {rank: ("barrier", 4) if rank != 1 else ("all_reduce", 2)
                                     for rank in range(world)})
        assert _culprits(present) == ([1] if world == 4 else [0])
        text = wording.divergence_summary("collective-mismatch", ("0", 12), present, [1], {})
        assert (f"Rank 1 has {wording.LATER_TURN} train.py:1 again without the barrier at train.py:4 that "
                f"{'rank 0 waits' if world == 2 else 'the others wait'} in (its next turn, or the loop run "
                "anew). That call is under 'if not (rank == 1 and step == 5):' at train.py:3.") in text, text
    # two ranks of three skipped with a continue: they are the culprits, not the one that did not;
    # a continue above both calls skips both and is not named, the one between them is
    script = tmp_path / "skip.py"  # (a file's parse is cached by its name)
    script.write_text("for step in range(9):\n"
                      "    if warmup:\n"
                      "        continue\n"
                      "    all_reduce(t)\n"
                      "    if bad:\n"
                      "        continue\n"
                      "    barrier()\n")
    present = _turn_ops(script, {0: ("all_reduce", 4), 1: ("barrier", 7), 2: ("all_reduce", 4)})
    assert _culprits(present) == [0, 2]
    text = wording.divergence_summary("collective-mismatch", ("0", 12), present, [0, 2], {})
    assert "the continue at skip.py:6 (if bad)" in text and "skip.py:3" not in text, text
    # three of four came round past a call under a condition that no exit of the loop decides, the
    # fourth alone in it (unseen script: 'if global_step % save_every == 0:', save_every from its
    # own shard's length): the one is the odd one out, and the cure is the condition's
    script = tmp_path / "save.py"
    script.write_text("for step in range(9):\n"
                      "    all_reduce(t)\n"
                      "    if step % save_every == 0:\n"
                      "        gather_object(state)\n")
    present = _turn_ops(script, {0: ("all_reduce", 2), 1: ("all_reduce", 2), 2: ("all_reduce", 2),
                                 3: ("gather_object", 4)})
    assert _culprits(present) == [3]
    text = wording.divergence_summary("collective-mismatch", ("0", 12), present, [3], {})
    assert "That call is under 'if step % save_every == 0:' at save.py:3." in text, text
    assert diagnosis_module._loop_cures(text) == [wording.CONDITION_CURE]
    # a break out of an inner loop that the outer loop runs again is named too
    script = tmp_path / "inner.py"
    script.write_text("for epoch in range(9):\n"
                      "    while True:\n"
                      "        all_reduce(t)\n"
                      "        if done:\n"
                      "            break\n"
                      "        barrier()\n")
    present = _turn_ops(script, {0: ("all_reduce", 3), 1: ("barrier", 6)})
    text = wording.divergence_summary("collective-mismatch", ("0", 12), present, [0], {})
    assert "the break at inner.py:5 (if done) ends the loop" in text, text


def test_a_call_under_a_condition_on_each_ranks_own_value_taken_by_the_few_makes_them_the_culprits(tmp_path):
    # unseen script: check_trigger() under 'if loss.item() < target:', entered by one rank of three;
    # the others came round the loop past it, as they would past any call they never make
    script = tmp_path / "trigger.py"
    script.write_text("for step in range(9):\n"
                      "    all_reduce(t)\n"
                      "    if loss.item() < target:\n"
                      "        check_trigger()\n")
    present = _turn_ops(script, {0: ("all_reduce", 2), 1: ("all_reduce", 2), 2: ("all_reduce", 4)})
    assert _culprits(present) == [2]
    text = wording.divergence_summary("collective-mismatch", ("0", 12), present, [2], {})
    assert ("Rank 2 took a different path from the others (its call is under 'if loss.item() < target:' at "
            "trigger.py:3, a condition each rank decides for itself)") in text, text
    # entered by the many: the few that came round without it are the odd ones
    present = _turn_ops(script, {0: ("all_reduce", 4), 1: ("all_reduce", 2), 2: ("all_reduce", 4)})
    assert _culprits(present) == [1]


def test_a_call_from_a_helper_under_a_branch_on_the_rank_names_the_branch_around_its_caller(tmp_path):
    # unseen script: accelerator.reduce in a logging helper called under 'if ... is_main_process:';
    # gloo aborted rank 0 in it, its stack (faulthandler's) gives the caller
    from helpers.doctor.records import Position

    script = tmp_path / "logged.py"
    script.write_text("def log(t):\n"
                      "    all_reduce(t)\n"
                      "for step in range(9):\n"
                      "    backward()\n"
                      "    if step % 5 == 0 and rank == 0:\n"
                      "        log(t)\n")
    present = _turn_ops(script, {0: ("all_reduce", 2), 1: ("all_reduce", 4)})
    present[0].shapes, present[1].shapes = [[]], [[169]]
    positions = {0: Position(0, "exited", op=present[0], where="logged.py:2", file=str(script), line=2,
                             callers=[(str(script), 6, "logged.py:6"), (str(script), 2, "logged.py:2")])}
    text = wording.different_lines_summary(("0", 12), present, [0], positions)
    assert text.endswith(" Rank 0's call at logged.py:6 is under 'if step % 5 == 0 and rank == 0:' at "
                         "logged.py:5, a branch on the rank."), text


def test_a_turn_skipped_by_a_return_in_a_function_called_in_the_loop_is_read_from_the_stacks(tmp_path):
    # unseen script: a trainer's log_step() returns early on a non-finite loss before its metric's
    # all_reduce; rank 2 went on to the next step's gradient all_reduce
    from helpers.doctor.diagnosis import _odd_ones_out
    from helpers.doctor.records import Position

    script = tmp_path / "steps.py"
    script.write_text("def log_step(loss):\n"
                      "    if not finite(loss):\n"
                      "        return\n"
                      "    all_reduce(loss)\n"
                      "for step in range(9):\n"
                      "    all_reduce(grads)\n"
                      "    log_step(loss)\n")
    present = _turn_ops(script, {0: ("all_reduce", 4), 1: ("all_reduce", 4), 2: ("all_reduce", 6)})
    name = str(script)
    stacks = {0: [(name, 7, "steps.py:7"), (name, 4, "steps.py:4")], 2: [(name, 6, "steps.py:6")]}
    stacks[1] = stacks[0]
    positions = {rank: Position(rank, "in-collective", op=op, seq=12, where=op.where, file=name, line=op.line,
                                callers=stacks[rank]) for rank, op in present.items()}
    groups: dict = {}
    for rank, each in present.items():
        groups.setdefault(each.signature(), []).append(rank)
    assert _odd_ones_out(groups, present, {}, ("0", 12), positions) == [2]
    text = wording.divergence_summary("collective-mismatch", ("0", 12), present, [2], positions)
    assert (f"Rank 2 has {wording.LATER_TURN} steps.py:5 again without the all_reduce at steps.py:4 (from "
            "the call at steps.py:7) that the others wait in (its next turn, or the loop run anew). On the "
            "way, the return at steps.py:3 (if not finite(loss)) leaves its function before that call, on "
            "some ranks alone when its condition differs between them.") in text, text
    from helpers.doctor.diagnosis import _loop_cures

    assert _loop_cures(text) == [wording.LOOP_EXIT_CURE]


def test_calls_that_are_not_one_turn_of_a_loop_apart_are_no_skipped_turn(tmp_path):
    # a call of the rank's own under a condition in the same turn
    script = tmp_path / "extra.py"
    script.write_text("for step in range(9):\n"
                      "    if rank == 0:\n"
                      "        all_reduce(t)\n"
                      "    barrier()\n")
    assert wording.turn_skipped(_turn_ops(script, {0: ("all_reduce", 3), 1: ("barrier", 4)}), {}) is None
    # a call in the loop's else block (after its last turn), or in a function defined in the loop
    script = tmp_path / "other.py"
    script.write_text("for step in range(9):\n"
                      "    all_reduce(t)\n"
                      "    def report():\n"
                      "        gather(x)\n"
                      "else:\n"
                      "    barrier()\n")
    assert wording.turn_skipped(_turn_ops(script, {0: ("all_reduce", 2), 1: ("barrier", 6)}), {}) is None
    assert wording.turn_skipped(_turn_ops(script, {0: ("all_reduce", 2), 1: ("gather", 4)}), {}) is None


def _scatters_a_list_one_short():
    import torch
    import torch.distributed as dist

    chunks = [torch.zeros(2) for _ in range(dist.get_world_size() - 1)]  # one tensor short
    chunks = chunks if dist.get_rank() == 0 else None
    dist.scatter(torch.empty(2), scatter_list=chunks, src=0)  # line: scatter


def test_a_list_of_the_wrong_length_is_named_on_the_rank_that_passed_it_not_on_its_echoes(leftovers):
    # gloo rejects rank 0's list ('Incorrect input list size 1'): an error about its own arguments,
    # although gloo names itself in it; the others' 'Connection closed by peer' is its echo
    found = _failed_run(_scatters_a_list_one_short)
    assert (found.kind, found.ranks) == ("rank-exited", [0]), found.text()
    assert f"Incorrect input list size 1. at {HERE}:{_line('scatter')}" in found.summary, found.summary
    assert found.fix.startswith("A collective's list of tensors has one tensor per rank"), found.fix
    leftovers.check()


def _sharded_model_evaluated_on_rank_zero_alone():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    if dist.get_rank() == 0:
        with torch.no_grad():
            model(torch.randn(2, 8))  # line: sharded eval
    dist.barrier()


def test_an_fsdp_model_run_on_one_rank_is_named_as_fsdps_all_gather_with_the_sharded_cure(leftovers):
    found = _hung_run(_sharded_model_evaluated_on_rank_zero_alone)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert (f"rank 0 in all_gather_into_tensor at {HERE}:{_line('sharded eval')}, issued by FSDP inside "
            "forward(): the all-gather of its parameters; rank 1 in barrier") in found.summary, found.summary
    assert found.fix.startswith(wording.SHARDED_MODEL_ON_ONE_RANK_CURE), found.fix
    leftovers.check()


def test_a_collective_no_python_call_issued_is_told_by_the_ddp_frames_on_its_stack():
    user = {"file": "/work/train.py", "func": "<module>", "user": True}
    ddp = "/venv/site-packages/torch/nn/parallel/distributed.py"
    def said(func: str, file: str = ddp) -> str:
        return wording.issued_by([user, {"file": file, "func": func}])

    assert said("__init__").startswith("issued by DDP's constructor")
    assert said("_pre_forward").startswith("issued by DDP inside forward()")
    autograd = "/venv/torch/autograd/graph.py"
    assert said("_engine_run_backward", autograd).startswith("issued by DDP inside backward()")
    assert wording.issued_by([user]) == "issued outside Python (no Python wrapper saw it)"


def test_a_call_from_fsdps_code_is_told_by_its_stack_below_the_users_last_frame():
    site = "/site-packages/torch/distributed/"
    user = {"file": "/work/train.py", "func": "<module>", "user": True}
    gather = {"file": f"{site}fsdp/_fully_shard/_fsdp_collectives.py", "func": "foreach_all_gather"}
    reduce = {"file": f"{site}fsdp/_fully_shard/_fsdp_collectives.py", "func": "foreach_reduce"}
    autograd = {"file": "/site-packages/torch/autograd/graph.py", "func": "_engine_run_backward"}
    fsdp1 = {"file": f"{site}fsdp/fully_sharded_data_parallel.py", "func": "forward"}
    state = {"file": f"{site}fsdp/_state_dict_utils.py", "func": "_full_post_state_dict_hook"}
    assert wording.fsdp_call([user, gather], "all_gather_into_tensor") == wording.FSDP_FORWARD
    assert wording.fsdp_call([user, autograd, reduce], "reduce_scatter_tensor").startswith(
        "issued by FSDP inside backward(): the gradients' reduce-scatter")
    assert wording.fsdp_call([user, autograd, gather], "all_gather_into_tensor").startswith(
        "issued by FSDP inside backward()")
    assert wording.fsdp_call([user, fsdp1, state], "_allgather_base") == wording.FSDP_STATE_DICT
    assert wording.fsdp_cure(wording.FSDP_STATE_DICT) == wording.FSDP_STATE_DICT_CURE
    # a user's own collective in a module FSDP1 wraps is the user's: FSDP's frame is above the user's
    moe = {"file": "/work/moe.py", "func": "forward", "user": True}
    assert wording.fsdp_call([user, fsdp1, moe], "all_to_all_single") == ""
    assert wording.fsdp_call([user, {"file": f"{site}distributed_c10d.py", "func": "all_reduce"}],
                             "all_reduce") == ""
    assert wording.fsdp_cure(wording.BY_FSDP) is None  # clip_grad_norm_'s all_reduce: no cure of its own


def _skips_one_of_its_items():
    import torch
    import torch.distributed as dist

    for index in range(3):  # line: items loop
        if dist.get_rank() == 1 and index == 1:  # one rank's item is bad
            continue  # line: item skip
        dist.all_reduce(torch.tensor([float(index)]))


def test_a_rank_that_finished_after_skipping_a_turn_is_named_with_the_continue(leftovers):
    # rank 1 finishes after 2 calls; rank 0 waits in its 3rd: the rank-exited path names the loop's exit
    found = _failed_run(_skips_one_of_its_items)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    assert f"The loop at {HERE}:{_line('items loop')} ran out first on rank 1" in found.summary, found.summary
    assert found.summary.endswith(
        f"In that loop, the continue at {HERE}:{_line('item skip')} (if dist.get_rank() == 1 and index == 1) "
        "skips the rest of its turn: it can end a turn on some ranks alone, leaving them fewer collectives "
        "than the others."), found.summary
    assert found.fix.startswith(wording.LOOP_EXIT_CURE + " " + wording.UNEVEN_LOOP_CURE), found.fix
    leftovers.check()


def test_a_loops_exits_are_its_own_continues_before_the_call_and_every_break_and_return(tmp_path):
    from helpers.doctor.source import loop_exits

    script = tmp_path / "train.py"
    script.write_text("def train(loader):\n"  # 1
                      "    for batch in loader:\n"  # 2
                      "        if batch is None:\n"  # 3
                      "            continue\n"  # 4
                      "        else:\n"  # 5
                      "            if len(batch) > 9:\n"  # 6
                      "                break\n"  # 7
                      "        for part in batch:\n"  # 8
                      "            break\n"  # 9: the inner loop's
                      "        def helper():\n"  # 10
                      "            return 1\n"  # 11: the function's
                      "        try:\n"  # 12
                      "            step(batch)\n"  # 13: the call
                      "        except ValueError:\n"  # 14
                      "            continue\n"  # 15: after the call
                      f"        if batch == {'x' * 80!r}:\n"  # 16: a long test, cut
                      "            return\n"  # 17
                      "    barrier()\n")
    assert loop_exits(str(script), 2, 13) == [
        ("continue", 4, "batch is None"), ("break", 7, "len(batch) > 9"),
        ("return", 17, "batch == " + repr("x" * 80)[:48] + "...")]
    assert loop_exits(str(script), 2, 18) == [
        ("continue", 4, "batch is None"), ("break", 7, "len(batch) > 9"),
        ("continue", 15, "except ValueError"), ("return", 17, "batch == " + repr("x" * 80)[:48] + "...")]
    assert loop_exits(str(script), 8, 9) == [("break", 9, "")]
    other = tmp_path / "other.py"
    other.write_text("while not stop:\n    step()\nwhile True:\n    step()\n")
    assert loop_exits(str(other), 1, 2) == [("while", 1, "not stop")]
    assert loop_exits(str(other), 3, 4) == []  # 'while True' ends only by its break
    matched = tmp_path / "matched.py"
    matched.write_text("for batch in loader:\n    match batch:\n        case None:\n            continue\n"
                       "    try:\n        step(batch)\n    finally:\n        if done:\n            break\n")
    assert loop_exits(str(matched), 1, 6) == [("continue", 4, ""), ("break", 9, "done")]
    nested = tmp_path / "nested.py"
    nested.write_text("def f():\n    for batch in loader:\n        for part in batch:\n"
                      "            if part is None:\n                return\n        step(batch)\n")
    assert loop_exits(str(nested), 2, 6) == [("return", 5, "part is None")]  # it leaves the outer loop too
    chain = tmp_path / "chain.py"
    chain.write_text("for b in loader:\n    if b == 0:\n        continue\n"
                     + "".join(f"    elif b == {i}:\n        continue\n" for i in range(1, 400))
                     + "    step(b)\n")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)  # the chain nests past it: in ast.parse or in the walk, never a crash
    try:
        assert loop_exits(str(chain), 1, 802) == []
    finally:
        sys.setrecursionlimit(limit)
    assert loop_exits(str(script), 3, 13) == []  # no loop there
    assert loop_exits(str(tmp_path / "missing.py"), 2, 13) == []


def test_a_loops_exit_sentence_is_hedged_unless_its_condition_likely_differs_between_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("for step, batch in enumerate(loader):\n"  # 1
                      "    step_(batch)\n"  # 2: the call
                      "    if step >= max_steps:\n"  # 3
                      "        break\n"  # 4
                      "for batch in loader:\n"  # 5
                      "    try:\n"  # 6
                      "        batch = check(batch)\n"  # 7
                      "    except ValueError:\n"  # 8
                      "        continue\n"  # 9
                      "    step_(batch)\n")  # 10: the call
    hedged = wording.loop_exits_text(str(script), 1, 2)
    assert hedged == (" In that loop, the break at train.py:4 (if step >= max_steps) ends the loop: if its "
                      "condition can differ between ranks, it can end a turn on some ranks alone, leaving "
                      "them fewer collectives than the others."), hedged
    told = wording.loop_exits_text(str(script), 5, 10)
    assert told == (" In that loop, the continue at train.py:9 (in except ValueError) skips the rest of its "
                    "turn: it can end a turn on some ranks alone, leaving them fewer collectives than the "
                    "others."), told
    from helpers.doctor.diagnosis import _loop_cures

    assert _loop_cures(f"...ran out first.{hedged}") == [wording.UNEVEN_LOOP_CURE, wording.LOOP_EXIT_CURE]
    assert _loop_cures(f"...ran out first.{told}") == [wording.LOOP_EXIT_CURE, wording.UNEVEN_LOOP_CURE]
    assert _loop_cures("...ran out first.") == [wording.UNEVEN_LOOP_CURE]


def test_a_break_on_a_count_kept_from_each_ranks_own_loss_is_told_not_hedged(tmp_path):
    # unseen script: early stopping on each rank's own validation shard; the break's test names no
    # loss, the count it reads is kept from one
    script = tmp_path / "train.py"
    script.write_text("def fit(loader, patience):\n"  # 1
                      "    best, bad_epochs = float('inf'), 0\n"  # 2
                      "    for epoch in range(12):\n"  # 3
                      "        step_(loader)\n"  # 4: the call
                      "        val_loss = evaluate()\n"  # 5
                      "        if val_loss < best:\n"  # 6
                      "            best, bad_epochs = val_loss, 0\n"  # 7
                      "        else:\n"  # 8
                      "            bad_epochs += 1\n"  # 9
                      "        if bad_epochs >= patience:\n"  # 10
                      "            break\n"  # 11
                      "    for epoch in range(12):\n"  # 12
                      "        step_(loader)\n"  # 13: the call
                      "        if epoch >= patience:\n"  # 14
                      "            break\n")  # 15
    told = wording.loop_exits_text(str(script), 3, 4)
    assert told == (" In that loop, the break at train.py:11 (if bad_epochs >= patience) ends the loop: "
                    "it can end a turn on some ranks alone, leaving them fewer collectives than the "
                    "others."), told
    assert wording.EXIT_HEDGE in wording.loop_exits_text(str(script), 12, 13)  # a count alike on every rank


def _display(found) -> None:
    html = found._repr_html_()
    assert "rank-missing" in html and "<table>" in html and found.summary.split(";")[0][:40] in html
    figure = found.swimlane()
    assert len(figure.axes[0].get_yticks()) == 2
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["rank 0", "rank 1 (culprit)"]
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    assert buffer.getvalue().startswith(b"\x89PNG")
    assert "doctor: hang (rank-missing)" in found.text()


def test_the_swimlane_shows_init_process_group_only_while_ranks_wait_in_it():
    def lanes(init_ended: bool):
        base = time.time() - 20.0
        views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
        for rank, view in views.items():
            view.apply({**_init_record(rank), "t": base + rank})
            if init_ended:
                view.apply({"ev": "end", "id": 1, "t": base + 5.0, "ok": True})
                view.apply({"ev": "op", "id": 2, "op": "barrier", "seq": 1, "t": base + 5.0 + rank})
        axes = doctor.diagnose(views, 2, "stall", 5.0).swimlane().axes[0]
        calls = [patch for patch in axes.patches if patch.get_height() == 0.5]  # a call's box
        return [round(patch.get_x(), 3) for patch in calls], [text.get_text() for text in axes.texts]

    lefts, labels = lanes(init_ended=False)
    assert lefts == [0.0, 1.0] and "init_process_group @ train.py:4" in labels
    lefts, labels = lanes(init_ended=True)  # start-up is not the story: the axis starts at the barrier
    assert lefts == [0.0, 1.0] and not any("init_process_group" in label for label in labels), labels


def test_a_rank_late_by_less_than_stall_s_is_ok(leftovers):
    healthy = scenarios.get("healthy").load()
    found = doctor.run_function(healthy.main, kwargs={"late_s": 2.5}, num_processes=2, stall_s=6.0)
    assert (found.verdict, found.kind) == ("ok", "ok"), found.text()
    assert found.detected_after_s is None
    leftovers.check()


def _uneven_batches_under_join(batches_per_rank: tuple[int, ...]):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
    with Join([model]):  # the ranks out of batches shadow the others' collectives
        for _ in range(batches_per_rank[dist.get_rank()]):
            model(torch.randn(16, 32)).sum().backward()
    dist.all_reduce(torch.ones(2))


def test_ddp_under_joins_uneven_inputs_is_healthy(leftovers):
    # Join's async all_reduces return before their work completes: DDP's gradient all-reduce that
    # the shadowing ranks issue next, from C++, was taken for part of that call, with its shape, and
    # a healthy job was called a shape mismatch and failed (l7 of a blind batch)
    found = doctor.run_function(_uneven_batches_under_join, kwargs={"batches_per_rank": (4, 40)},
                                num_processes=2, stall_s=10.0, timeout_s=90)
    assert (found.verdict, found.kind) == ("ok", "ok"), found.text()
    leftovers.check()


def _barrier_on_rank_zero_only():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(2))
    if dist.get_rank() == 0:
        dist.barrier()  # line: extra


def test_a_collective_only_rank_zero_calls_is_its_extra_call_not_the_others_early_end(leftovers):
    # the others finish cleanly after the common all_reduce; the barrier is under `if rank == 0`
    found = doctor.run_function(_barrier_on_rank_zero_only, num_processes=3, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert found.per_rank[0].location == f"{HERE}:{_line('extra')}"
    extra = f"{HERE}:{_line('extra')}"
    branch = f"'if dist.get_rank() == 0:' at {HERE}:{_line('extra') - 1}"
    assert found.summary.startswith(f"Rank 0 called barrier at {extra} (collective #2) inside the "
                                    f"rank-dependent branch {branch}; ranks 1 and 2 never call it: they "
                                    "finished their work after collective #1."), found.summary
    assert "out of rank-dependent branches" in found.fix
    leftovers.check()


def _object_lists_of_other_lengths():
    import torch.distributed as dist

    objects = [{"lr": 0.1}, {"seed": 1}, {"steps": 10}] if dist.get_rank() == 0 else [None]  # [None] * 3
    dist.broadcast_object_list(objects, src=0)  # line: objects
    return objects


def test_an_object_list_broadcast_with_lists_of_other_lengths_names_the_ranks_unlike_the_source(leftovers):
    # torch broadcasts the objects' sizes, one per item: gloo aborts ranks whose sizes differ
    found = doctor.run_function(_object_lists_of_other_lengths, num_processes=3, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("shape-mismatch", [1, 2]), found.text()
    site = f"{HERE}:{_line('objects')}"
    said = (f"Ranks called broadcast_object_list at {site} (collective #1) with lists of different lengths: "
            "rank 0 a list of 3; ranks 1 and 2 a list of 1. Ranks 1 and 2 differ from the source, rank 0.")
    aborted = [row.rank for row in found.per_rank if row.exit_code == -signal.SIGABRT]
    if aborted:  # gloo aborts a rank that receives more than its call expects: said, with why
        said += f" {wording.ranks_text(aborted)} {'were' if len(aborted) > 1 else 'was'} killed by SIGABRT"
    assert found.summary.startswith(said), found.summary
    assert found.fix.startswith(wording.OBJECT_LIST_CURE)
    assert [entry.shapes for entry in found.per_rank] == [[[3]], [[1]], [[1]]]
    leftovers.check()


def _a_thread_issues_a_collective_on_one_rank():
    import threading

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))  # line: main thread
        return
    thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(8)))  # line: metrics thread
    thread.start()
    thread.join()


def test_one_number_taken_by_calls_from_different_lines_is_a_collective_mismatch_naming_each_line(leftovers):
    # a metrics thread's all_reduce took rank 1's first number: gloo aborts on the sizes, and the
    # fix is not the shapes' (padding) but the order of the calls
    found = doctor.run_function(_a_thread_issues_a_collective_on_one_rank, num_processes=2, stall_s=5.0,
                                timeout_s=60)
    assert found.kind == "collective-mismatch", found.text()
    main, thread = f"{HERE}:{_line('main thread')}", f"{HERE}:{_line('metrics thread')}"
    assert found.summary.startswith(
        f"Ranks called all_reduce as collective #1 from different lines, with different shapes or dtypes: "
        f"rank 0 [4] float32 at {main}; rank 1 [8] float32 at {thread}. On some ranks another call"), \
        found.summary
    assert "pad_across_processes" not in found.fix
    leftovers.check()


def _sized_by_rank(rank: int) -> str:  # the lines the views below say their calls came from
    if rank == 0:
        return "all_reduce of 4"  # line: branch of rank 0
    return "all_reduce of 8"  # line: branch of others


def _a_thread_of_its_own() -> str:
    return "all_reduce of 8"  # line: another function


@pytest.mark.parametrize("op, other_line, kind", [
    ("all_reduce", "branch of others", "shape-mismatch"),  # one function's if/else: sized by rank
    ("broadcast_object_list", "branch of others", "shape-mismatch"),
    ("all_reduce", "another function", "collective-mismatch"),  # another call took the number
])
def test_one_number_from_two_lines_is_a_shape_mismatch_only_within_one_function(op, other_line, kind):
    views = {}
    for rank, (marker, size) in enumerate([("branch of rank 0", 4), (other_line, 8)]):
        views[rank] = view = doctor.RankView(rank)
        view.apply({"ev": "op", "id": 1, "op": op, "pg": "0", "seq": 1, "shapes": [[size]],
                    "dtypes": ["object" if "object" in op else "float32"], "t": 1.0, "file": __file__,
                    "line": _line(marker), "where": f"{HERE}:{_line(marker)}"})
    found = doctor.diagnose(views, 2, "stall", 1.0)
    assert found.kind == kind, found.summary
    if op == "broadcast_object_list":
        assert found.fix.startswith(wording.OBJECT_LIST_CURE)


def _monitored_barrier_rank_two_misses():
    import datetime

    import torch.distributed as dist

    if dist.get_rank() == 2:
        _stay_away()
        return
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=1))


def test_a_monitored_barrier_that_times_out_names_the_rank_that_never_came_not_the_ones_it_failed(leftovers):
    # rank 0 raises "Rank 2 failed to pass monitoredBarrier", rank 1 "received errors ... from rank 0"
    found = doctor.run_function(_monitored_barrier_rank_two_misses, num_processes=3, stall_s=10.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [2]), found.text()
    assert [entry.state for entry in found.per_rank[:2]] == ["exited", "exited"]
    assert found.per_rank[2].location in (f"{HERE}:{_line('loop')}", f"{HERE}:{_line('loop') + 1}")
    # its own timeout argument ended the wait, not the group's: the fix says which to raise
    assert ("Rank 0 stopped waiting at monitored_barrier's own timeout, not the process group's ("
            "RuntimeError: [Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms).") in found.summary, \
        found.summary
    assert found.fix.startswith(wording.MONITORED_TIMEOUT_CURE), found.fix
    leftovers.check()


def test_a_monitored_barrier_of_every_rank_that_timed_out_gets_its_own_timeouts_cure():
    # wait_all_ranks=True words it 'Ranks 2 failed to pass monitoredBarrier in 3000 ms' (unseen script,
    # under torchrun: the slow rank was only loading its shard)
    views = {rank: doctor.RankView(rank) for rank in range(3)}
    errors = {0: "RuntimeError: [Rank 0]: Ranks 2 failed to pass monitoredBarrier in 3000 ms",
              1: "RuntimeError: Rank 1 successfully reached monitoredBarrier, but received errors while "
                 "waiting for send/recv from rank 0."}
    for rank, error in errors.items():
        views[rank].apply({"ev": "op", "id": 1, "op": "monitored_barrier", "pg": "0", "seq": 1, "t": 1.0,
                           "where": "resume.py:11", "file": "resume.py", "line": 11})
        views[rank].apply({"ev": "end", "id": 1, "t": 4.0, "ok": False, "error": error})
        views[rank].apply({"ev": "exit", "status": "raised", "t": 4.1, "error": error})
        views[rank].ended, views[rank].exit_code = True, 1
    found = doctor.diagnose(views, 3, "failure", 3.0)
    assert (found.kind, found.ranks) == ("rank-missing", [2]), found.text()
    assert found.fix.startswith(wording.MONITORED_TIMEOUT_CURE), found.fix


def test_groups_created_in_different_orders_on_different_ranks_are_named_before_anything_else():
    # unseen script: each rank created its own groups first (mine + others), so group 1 is the
    # tensor-parallel pair of each half; torch stopped with no pattern the doctor knew
    views = {rank: doctor.RankView(rank) for rank in range(4)}
    for rank, view in views.items():
        pair = [0, 1] if rank < 2 else [2, 3]
        view.apply({"ev": "op", "id": 1, "op": "all_reduce", "pg": "1", "pg_ranks": pair, "seq": 1, "t": 1.0,
                    "shapes": [[4]], "dtypes": ["float32"], "where": "train.py:12", "file": "train.py",
                    "line": 12})
    found = doctor.diagnose(views, 4, "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0, 1, 2, 3]), found.text()
    assert found.summary.startswith("Group 1 is ranks 0 and 1 on ranks 0 and 1, but ranks 2 and 3 on ranks 2 "
                                    "and 3: the ranks created their process groups in different orders."), \
        found.summary
    assert found.fix.startswith(wording.GROUP_ORDER_CURE), found.fix


def _two_ranks_raise_alike():
    import torch.distributed as dist

    if dist.get_rank() != 0:
        raise ValueError("no shard for this rank")  # line: alike
    dist.barrier()


def test_ranks_that_ended_alike_are_named_in_one_sentence(leftovers):
    found = doctor.run_function(_two_ranks_raise_alike, num_processes=3, stall_s=10.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-exited", [1, 2]), found.text()
    site = f"{HERE}:{_line('alike')}"
    assert found.summary.startswith(f"Ranks 1 and 2 raised ValueError: no shard for this rank at {site} "
                                    "while other ranks still needed them"), found.summary
    leftovers.check()


class _SlowDataset:
    """A dataset whose fourth item takes a minute (a worker stuck in ``__getitem__``)."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 3:
            time.sleep(60)  # line: worker
        return index


def _ranks_waiting_for_other_things():
    import threading

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rank = dist.get_rank()
    if rank == 1:
        for _batch in DataLoader(_SlowDataset(), batch_size=1, num_workers=2):  # line: loader
            pass
    elif rank == 2:
        subprocess.run(["sh", "-c", "sleep 60", "job", "--token=abcdef123456"])  # line: child
    elif rank == 3:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire(timeout=60)  # line: lock
    elif rank == 4:  # a server that accepts the connection and never answers
        with socket.create_server(("127.0.0.1", 0)) as server:
            with socket.create_connection(server.getsockname()) as connection:
                connection.recv(1)  # line: socket
    dist.all_reduce(torch.ones(2))  # line: waited


def _stuck_item(item):
    time.sleep(60 if item == 2 else 0)  # line: pool item
    return item


def _waits_for_a_pool_whose_worker_is_stuck():
    import multiprocessing

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            pool.map(_stuck_item, range(3))  # line: pool map
    dist.all_reduce(torch.ones(2))


def test_a_rank_waiting_for_a_pool_names_the_line_its_busy_worker_is_at(leftovers):
    found = _hung_run(_waits_for_a_pool_whose_worker_is_stuck)
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.text()
    assert re.search(rf"rank 1 is waiting for a multiprocessing pool at {HERE}:{_line('pool map')} "
                     rf"\(worker pid \d+ is sleeping at {HERE}:{_line('pool item')} in _stuck_item\)",
                     found.summary), found.summary
    leftovers.check()


def _two_threads_issue_in_turns_that_differ():
    import threading

    import torch
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    rank = dist.get_rank()

    def issued(count):  # this rank's calls on the group so far: a call counts once it is issued
        deadline = time.monotonic() + 30
        while group._get_sequence_number_for_group() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other thread's call #{count} was never issued")
            time.sleep(0.001)

    def metrics():
        if rank == 1:
            issued(1)  # rank 1: after its main thread's call; rank 0: before it
        dist.all_reduce(torch.ones(1))  # line: metrics of a thread

    thread = threading.Thread(target=metrics, daemon=True)
    thread.start()
    if rank == 0:
        issued(1)
    dist.all_reduce(torch.ones(8))  # line: main of the threads
    thread.join()


def _asks_for_input():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        input("Log this run? [y/N] ")  # line: input
    dist.all_reduce(torch.ones(2))


def _lines_a_rank_may_wait_at(state, path):  # read by the test below, never run
    with state.lock:  # line: with a lock
        pass
    with state._write_mutex:  # line: with a mutex
        pass
    with open(path) as locked:  # line: with a file
        return locked


def test_a_rank_stopped_on_the_with_line_of_a_lock_waits_to_acquire_it():
    # unseen script: a prefetch thread held the lock while it waited on an empty queue, and the main
    # thread stayed on its 'with self.lock:' (the lock's __enter__ is C: no frame below the line)
    def waits(marker: str) -> str | None:
        frame = {"file": __file__, "line": _line(marker), "where": f"{HERE}:{_line(marker)}"}
        return wording.waiting_for(frame, [frame])

    assert waits("with a lock") == waits("with a mutex") == "waiting to acquire a lock"
    assert waits("with a file") is None


def test_a_rank_waiting_outside_torch_is_said_to_wait_for_what_it_waits_for(leftovers):
    # the library frames below the user's line say what it waits for; the DataLoader's cure leads
    # the fix; the DataLoader's worker and the child process end with the run
    found = doctor.run_function(_ranks_waiting_for_other_things, num_processes=5, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [1, 2, 3, 4]), found.text()
    assert f"that rank 0 entered at {HERE}:{_line('waited')}" in found.summary
    assert (f"rank 1 is {wording.DATALOADER_WAIT} at {HERE}:{_line('loader')} (worker pid "
            in found.summary), found.summary  # py-spy read the worker that is busy, not the idle one
    assert f" is sleeping at {HERE}:{_line('worker')} in __getitem__); " in found.summary, found.summary
    assert found.summary.count("worker pid ") == 1, found.summary
    # the command it waits for is named, its secrets redacted
    child = rf"; rank 2 is waiting for a child process at {HERE}:{_line('child')} "
    assert re.search(child + r"\(sh -c 'sleep 60' job --token=<redacted>, pid \d+\); ", found.summary), \
        found.summary
    assert (f"rank 3 is waiting to acquire a lock at {HERE}:{_line('lock')}; "
            f"rank 4 is waiting on the network (a socket) at {HERE}:{_line('socket')}.") in found.summary, \
        found.summary
    assert found.fix.startswith(wording.DATALOADER_CURE)
    assert "subprocess.run(..., timeout=S)" in found.fix, found.fix  # the child's cure follows
    leftovers.check()


def _class_weights(labels: list[int], queue) -> None:
    queue.put([len(labels) / labels.count(c) for c in range(4)])  # a class missing: ZeroDivisionError


def _ranks_waiting_on_a_queue_a_child_fills():
    import multiprocessing

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank:  # rank 1's labels lack a class, so its child dies; rank 2's child is alive and slow
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        target = _class_weights if rank == 1 else time.sleep
        child = context.Process(target=target, args=([0, 1, 2], queue) if rank == 1 else (60,), daemon=True)
        child.start()
        weights = queue.get()  # line: queue get
        child.join()
        print(weights)
    dist.all_reduce(torch.ones(2))


def test_a_rank_waiting_on_a_queue_whose_child_died_is_told_so(leftovers):
    # unseen i1: a class-weights worker raised, and its parent waits in queue.get for ever
    found = doctor.run_function(_ranks_waiting_on_a_queue_a_child_fills, num_processes=3, stall_s=2.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [1, 2]), found.text()
    waits = f"is {wording.MULTIPROCESSING_WAIT} at {HERE}:{_line('queue get')}"
    assert f"rank 1 {waits} ({wording.NONE_ALIVE}); rank 2 {waits}." in found.summary, found.summary
    assert found.fix.startswith("The process the rank waits for through multiprocessing"), found.fix
    leftovers.check()


def _a_rank_reading_a_child_that_waits_for_its_input_to_end():
    import subprocess
    import sys

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        child = subprocess.Popen([sys.executable, "-c", "import json, sys\nprint(json.load(sys.stdin))\n"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        child.stdin.write('{"epoch": 1}')
        child.stdin.flush()  # but not closed: json.load waits for the end of its input
        for line in child.stdout:  # line: pipe
            print(line)
    dist.all_reduce(torch.ones(2))


def test_a_rank_reading_a_childs_output_is_named_with_the_child_and_communicates_cure(leftovers):
    # unseen i5: a pipe's read is C, so the rank's own line is its innermost frame (in a loop)
    found = doctor.run_function(_a_rank_reading_a_child_that_waits_for_its_input_to_end, num_processes=2,
                                stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.text()
    said = (rf"rank 1 is {re.escape(wording.CHILD_PIPE_WAIT)}"
            rf" at {HERE}:{_line('pipe')} \(python\S* -c 'import json, sys; "
            r"print\(json.load\(sys.stdin\)\)', pid \d+\)")  # the program's lines on one line
    assert re.search(said, found.summary), found.summary
    assert found.fix.startswith("The rank reads a command's output"), found.fix
    assert "subprocess.run(..., timeout=S) kills" not in found.fix  # the general child cure does not follow
    leftovers.check()


def test_collectives_from_two_threads_in_a_different_order_on_each_rank_are_named(leftovers):
    # rank 0's metrics thread issues collective #1 and its main thread #2; rank 1 the other way round:
    # gloo pairs 1 float with 8 and aborts a rank, whose dump shows both threads in their calls; the
    # other's Flight Recorder names the thread of each call
    found = doctor.run_function(_two_threads_issue_in_turns_that_differ, num_processes=2, stall_s=2.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0, 1]), found.text()
    main, metrics = f"{HERE}:{_line('main of the threads')}", f"{HERE}:{_line('metrics of a thread')}"
    assert (f"issued collectives on the default group from 2 threads: all_reduce at {main} (the main "
            f"thread) and all_reduce at {metrics} (another thread)") in found.summary, found.summary
    # each rank that issued both calls is named: from its Flight Recorder, or, aborted, from its dying
    # dump or its own records (gloo may abort rank 0 before its main thread issues its call)
    both = [rank for rank, view in found.evidence.views.items()
            if len({op.thread for op in view.python_ops() if op.op == "all_reduce"}) == 2]
    assert 1 in both, found.text()  # its main thread's call came first: it issues both, and returns
    assert all(f"Rank {rank} issued" in found.summary or f"so did rank {rank}" in found.summary
               for rank in both), found.text()
    assert found.fix.startswith(wording.THREADS_CURE)
    leftovers.check()


def test_input_on_a_launched_rank_is_told_why_it_reads_nothing(leftovers):
    # the doctor's ranks read /dev/null: input() raises EOFError, and the cure for a prompt leads the fix
    found = doctor.run_function(_asks_for_input, num_processes=2, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.text()
    assert f"Rank 1 raised EOFError: EOF when reading a line at {HERE}:{_line('input')}" in found.summary
    assert found.fix.startswith("input() on a launched rank"), found.fix
    leftovers.check()


def _metric_error_swallowed_on_one_rank():
    import torch
    import torch.distributed as dist

    for step in range(3):
        dist.all_reduce(torch.ones(8))  # line: grads before the metric
        try:
            positives = 0 if (dist.get_rank() == 1 and step == 1) else 2
            dist.all_reduce(torch.tensor([1.0 / positives]))  # line: swallowed metric
        except Exception:  # noqa: BLE001 - the bug under test: metrics must never stop training
            pass


def test_a_collective_in_a_try_whose_except_swallows_a_ranks_error_is_named_with_that_except(
        leftovers, tmp_path):
    # rank 1's ZeroDivisionError skips the metric's all_reduce there alone; its next all_reduce of 8
    # floats meets rank 0's metric of 1: gloo aborts rank 0, and the calls are read as they differ
    found = _failed_run(_metric_error_swallowed_on_one_rank, keep_dir=tmp_path)
    said = (f"The all_reduce at {HERE}:{_line('swallowed metric')} is in a try whose 'except Exception:' at "
            f"{HERE}:{_line('swallowed metric') + 1} {wording.SWALLOWED}")
    assert found.kind == "collective-mismatch", found.text()
    assert said in found.summary, found.summary
    assert found.fix.startswith(wording.SWALLOW_CURE), found.fix
    leftovers.check()
    # the metric's record was still queued as gloo aborted rank 0, and once in CI its stack dump was
    # cut short by a second fault (SIGSEGV) before the main thread's: the call it noted names it
    dump = rundir.stack_path(tmp_path, 0)
    text = dump.read_text()
    assert text.startswith("Fatal Python error: Aborted"), text
    mine = text.find(f'File "{__file__}"')  # cut before the header of the thread that ran this file's
    cut = max(text.rfind("Thread 0x", 0, mine), text.rfind("Current thread 0x", 0, mine))  # line (the
    dump.write_text(text[:cut] if mine > 0 and cut > 0 else text)  # main thread: listed, or current)
    again = postmortem.diagnose_dir(tmp_path, 2, exit_codes={0: -signal.SIGSEGV})
    assert again.kind == "collective-mismatch" and said in again.summary, again.text()
    assert ("killed by SIGABRT (then SIGSEGV, a second fault as its stack was dumped) inside all_reduce at "
            f"{HERE}:{_line('swallowed metric')}") in again.summary, again.summary
    # a note that disagrees with a whole dump (another line's call): the dump says where it died
    dump.write_text(text)
    rundir.current_path(tmp_path, 0).write_bytes(rundir.CURRENT.pack(4, 1))  # #4 as the grads' call
    whole = postmortem.diagnose_dir(tmp_path, 2, exit_codes={0: -signal.SIGABRT})
    assert f"Rank 0 was killed by SIGABRT inside all_reduce at {HERE}:{_line('swallowed metric')}" \
        in whole.summary, whole.text()


def test_a_shape_mismatch_of_two_ranks_is_found_beside_a_dead_ranks_noted_call_of_unknown_shape():
    # rank 0 died in #2 with its record queued: its call is known from its note, without shapes
    views = {rank: _all_reduces(rank, "/x/train.py", [(5, 4), (7, floats)])
             for rank, floats in ((1, 8), (2, 6))}
    views[0] = _all_reduces(0, "/x/train.py", [(5, 4)], last_done=True)
    views[0].ended, views[0].exit_code = True, -signal.SIGKILL
    views[0].current = records.Op(op="all_reduce", seq=2, where="train.py:7", file="/x/train.py", line=7,
                                  source=records.NOTED)
    found = doctor.diagnose(views, 3, "failure", 5.0)
    assert (found.kind, found.ranks) == ("shape-mismatch", [1, 2]), found.text()
    assert found.per_rank[0].seq == 2 and found.per_rank[0].location == "train.py:7", found.per_rank[0]


def _all_reduces(rank: int, file: str, calls: list[tuple[int, int]],
                 last_done: bool = False, first: int = 1) -> doctor.RankView:
    """A rank's view of its all_reduces of float32 (line, floats), numbered from ``first``, as its
    records say: each ended but its last (unless ``last_done``), which it waits in."""
    view = doctor.RankView(rank)
    for op_id, (line, floats) in enumerate(calls, start=first):
        done = last_done or op_id < first + len(calls) - 1
        view.apply({"ev": "op", "id": op_id, "op": "all_reduce", "pg": "0", "seq": op_id,
                    "shapes": [[floats]], "dtypes": ["float32"], "file": file, "line": line,
                    "where": f"{Path(file).name}:{line}", "t": 10.0 + op_id,
                    **({"te": 10.5 + op_id, "ok": True} if done else {})})
    return view


_METRIC_AFTER_BATCHES = """\
import torch
import torch.distributed as dist
def train(batches, positives):
    for epoch in range(3):
        for batch in batches:
            dist.all_reduce(batch)
        try:
            recall = torch.tensor([1.0 / positives[epoch]])
            dist.all_reduce(recall)
        except ZeroDivisionError:
            print("no positives in this shard")
"""


def test_a_rank_that_skipped_a_swallowed_metric_after_a_batch_loop_is_told_of_the_except_too(tmp_path):
    # rank 3's shard has no positives in epoch 1: its metric skipped, it waits in epoch 2's first
    # batch while the others wait in the metric (as the job's leader read it, k5 of a blind batch)
    path = tmp_path / "train.py"
    path.write_text(_METRIC_AFTER_BATCHES)
    batch, metric = (6, 8), (9, 1)
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), [batch, batch, metric, batch, batch, *(
        [metric] if rank != 3 else [batch])]) for rank in range(4)}, 4, "stall", 5.0)
    assert found.ranks == [3], found.text()
    assert "have left the loop at train.py:5 that rank 3 is still in" in found.summary, found.summary
    assert ("The all_reduce at train.py:9 is in a try whose 'except ZeroDivisionError:' at train.py:10 "
            f"{wording.SWALLOWED}") in found.summary, found.summary
    assert found.fix.startswith(wording.SWALLOW_CURE), found.fix


_STOPS_ON_ITS_OWN_LOSS = """\
import torch
import torch.distributed as dist
def train(batches, losses):
    for epoch in range(9):
        for batch in batches:
            dist.all_reduce(batch)
        if losses[epoch] < 0.1:
            break
    dist.all_reduce(torch.tensor([losses[epoch]]))
"""


def test_a_rank_whose_own_loss_broke_its_loop_is_told_so_when_its_next_call_has_another_shape(tmp_path):
    # rank 1's loss fell under its target after epoch 0: its final all_reduce of 1 float took the
    # number of the others' next batch of 17 (k1 of a blind batch, as the job's leader read it)
    path = tmp_path / "train.py"
    path.write_text(_STOPS_ON_ITS_OWN_LOSS)
    batch, final = (6, 17), (9, 1)
    calls = {rank: [batch, batch, final if rank == 1 else batch] for rank in range(4)}
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), calls[rank]) for rank in range(4)}, 4,
                            "stall", 5.0)
    assert found.ranks == [1], found.text()
    assert "Rank 1 has left the loop at train.py:4 that the others are still in" in found.summary, \
        found.summary
    assert "the break at train.py:8 (if losses[epoch] < 0.1)" in found.summary, found.summary


_METRICS_AFTER_BATCHES = """\
import torch.distributed as dist
def train(batches, metrics, val_batches):
    for epoch in range(3):
        for batch in batches:
            dist.all_reduce(batch)
        for name in sorted(metrics):
            dist.all_reduce(metrics[name])
        for batch in val_batches:
            dist.all_reduce(batch)
"""


def test_a_rank_whose_metric_loop_ran_an_extra_turn_is_named_with_that_loop_not_the_batch_loop(tmp_path):
    # only rank 2's shard has a class the others lack: its dict of per-class metrics has one key more
    # and its loop over it issues a 4th all_reduce while the others have come round to the next
    # epoch's batches (k8 of a blind batch, as the job's leader read it): rank 2 never left the batch
    # loop, so that is not the loop to name
    path = tmp_path / "train.py"
    path.write_text(_METRICS_AFTER_BATCHES)
    batch, metric = (5, 6), (7, 2)
    calls = {rank: [batch, batch, metric, metric, metric, metric if rank == 2 else batch]
             for rank in range(4)}
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), calls[rank]) for rank in range(4)}, 4,
                            "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [2]), found.text()
    assert ("Ranks 0, 1 and 3 have left the loop at train.py:6 after 3 calls of all_reduce at train.py:7 "
            "and come round to train.py:5; rank 2 is still in it, issuing call 4 there: their loops "
            f"{wording.LOOP_RAN_OUT}. Its header ('for name in sorted(metrics):') must give every rank as "
            "many turns.") in found.summary, found.summary
    assert "loop at train.py:4" not in found.summary, found.summary
    assert found.fix.startswith(wording.KEYED_LOOP_CURE), found.fix
    # the calls of rank 2's run of metrics that are not on record: no count is given
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), calls[rank])
                             for rank in range(4)} | {2: _all_reduces(2, str(path), calls[2][-3:], first=4)},
                            4, "stall", 5.0)
    assert ("Ranks 0, 1 and 3 have left the loop at train.py:6 after their calls of all_reduce at train.py:7 "
            "in a row and come round to train.py:5; rank 2 is still in it, issuing it once more") \
        in found.summary, found.summary
    # gloo aborted rank 2: of its records, only its last call reached the job's leader (posted first)
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), calls[rank])
                             for rank in range(4)} | {2: _all_reduces(2, str(path), calls[2][-1:], first=6)},
                            4, "stall", 5.0)
    assert "have left the loop at train.py:6 after their calls" in found.summary, found.summary


def test_a_rank_whose_validation_loop_ran_out_first_is_said_to_have_left_it_not_the_batch_loop(tmp_path):
    # rank 3's validation shard is a batch short: it left the validation loop after 2 reduces and
    # waits in the next epoch's first batch, while the others reduce their 3rd (k6 of a blind batch)
    path = tmp_path / "train.py"
    path.write_text(_METRICS_AFTER_BATCHES)
    batch, val = (5, 6), (9, 2)
    calls = {rank: [batch, batch, val, val, batch if rank == 3 else val] for rank in range(4)}
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), calls[rank]) for rank in range(4)}, 4,
                            "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [3]), found.text()
    assert ("Rank 3 has left the loop at train.py:8 after 2 calls of all_reduce at train.py:9 and come "
            "round to train.py:5; ranks 0, 1 and 2 are still in it, issuing call 3 there: its loop "
            f"{wording.LOOP_RAN_OUT}. Its header ('for batch in val_batches:')") in found.summary, \
        found.summary
    assert found.fix.startswith(wording.UNEVEN_LOOP_CURE), found.fix


_CACHE_ONCE_PER_NODE = """\
import torch.distributed as dist
def load(rank, local_rank, build):
    if local_rank != 0:
        dist.barrier()
    build()
    if rank == 0:
        dist.barrier()
def main(rank, local_rank, build, wrap):
    load(rank, local_rank, build)
    wrap()
"""


def _one_call(rank: int, file: str, op: str, line: int) -> doctor.RankView:
    view = doctor.RankView(rank)
    view.apply({"ev": "op", "id": 1, "op": op, "pg": "0", "seq": 1, "file": file, "line": line,
                "where": f"{Path(file).name}:{line}", "t": 10.0, **({"shapes": [[3]], "dtypes": ["int64"]}
                                                                  if op != "barrier" else {})})
    return view


def test_a_rank_that_skipped_barriers_paired_across_branches_on_the_rank_is_the_odd_one(tmp_path):
    # a cache built once per node: the others wait under 'if local_rank != 0:' for the local main's
    # barrier, which is under 'if rank == 0:': on the second node neither holds on its local main,
    # rank 2, which goes on to DDP's constructor (l5 of a blind batch). The barriers pair up across
    # the branches: rank 2 is the odd one, not rank 0, alone in its branch
    path = tmp_path / "train.py"
    path.write_text(_CACHE_ONCE_PER_NODE)
    calls = {0: ("barrier", 7), 1: ("barrier", 4), 2: ("all_gather", 10), 3: ("barrier", 4)}
    found = doctor.diagnose({rank: _one_call(rank, str(path), *call) for rank, call in calls.items()}, 4,
                            "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [2]), found.text()
    assert ("The others' barriers are each under a branch on the rank ('if rank == 0:' at train.py:6 "
            "for rank 0; 'if local_rank != 0:' at train.py:3 for ranks 1 and 3), and rank 2's call is not: "
            f"none of those branches ran on rank 2. {wording.LOCAL_AND_GLOBAL}") in found.summary, \
        found.summary
    # one rank alone in a barrier under its branch while the others are elsewhere is still the odd one
    calls = {0: ("barrier", 7), 1: ("all_gather", 10), 2: ("all_gather", 10), 3: ("all_gather", 10)}
    found = doctor.diagnose({rank: _one_call(rank, str(path), *call) for rank, call in calls.items()}, 4,
                            "stall", 5.0)
    assert found.ranks == [0], found.text()


_EVAL_EVERY = """\
import torch.distributed as dist
def validate(stats):
    dist.all_reduce(stats)
def train(grads, stats, every):
    for step in range(9):
        dist.all_reduce(grads)
        if (step + 1) % every == 0:
            validate(stats)
train(None, None, 4)
"""


def test_the_call_chain_of_a_rank_gloo_aborted_is_read_from_the_source_to_name_its_condition(tmp_path):
    # rank 3 validates every 3 steps, the others every 4 (each from its own loader's length): gloo
    # aborted rank 3 in the validation's reduce before its stack was read, so the line that called
    # validate() is read from the source, its one caller; rank 2's call, DDP's from C++ in the job,
    # has no line of its own: it is the others' call, alike (l6 of a blind batch)
    path = tmp_path / "train.py"
    path.write_text(_EVAL_EVERY)
    grads, stats = (6, 8), (3, 2)
    views = {rank: _all_reduces(rank, str(path), [grads, grads, grads, stats if rank == 3 else grads])
             for rank in range(4)}
    views[2].ops[4].file = views[2].ops[4].line = views[2].ops[4].where = None
    found = doctor.diagnose(views, 4, "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [3]), found.text()
    assert ("Ranks 0, 1 and 2 have come round to the loop at train.py:5 again without the all_reduce at "
            "train.py:3 (from the call at train.py:8) that rank 3 waits in") in found.summary, found.summary
    assert "That call is under 'if (step + 1) % every == 0:' at train.py:7." in found.summary, found.summary
    assert source.call_chain(str(path), 3) == [9, 8, 3]
    assert source.call_chain(str(path), 6) == [9, 6]


def test_a_call_chain_is_read_from_the_source_only_where_each_function_has_one_caller(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("def log(x):\n    return x\n"  # 1-2: called twice
                    "def step(x):\n    return log(x) + log(x)\n"  # 3-4
                    "def hook(x):\n    return x\n"  # 5-6: passed on, not called
                    "def again(n):\n    return again(n - 1) if n else 0\n"  # 7-8: calls itself
                    "register(hook)\nstep(1)\nagain(2)\n")  # 9-11
    assert source.call_chain(str(path), 2) == []
    assert source.call_chain(str(path), 4) == [10, 4]
    assert source.call_chain(str(path), 6) == []
    assert source.call_chain(str(path), 8) == []
    assert source.call_chain(str(path), 10) == [10]
    assert source.call_chain(str(tmp_path / "missing.py"), 3) == []


_HASHED_OWNER = """\
import torch.distributed as dist
def share(names, world, tensor):
    for name in names:
        owner = hash(name) % world
        dist.broadcast(tensor, owner)
"""


def test_a_root_computed_with_pythons_salted_hash_is_named(tmp_path):
    # each parameter's owner as hash(name) % world: every process salts str's hash its own way, so
    # the ranks pass different roots (m8 of a blind batch)
    path = tmp_path / "train.py"
    path.write_text(_HASHED_OWNER)
    views = {}
    for rank, root in enumerate([1, 3, 0, 0]):
        views[rank] = doctor.RankView(rank)
        views[rank].apply({"ev": "op", "id": 1, "op": "broadcast", "pg": "0", "seq": 1, "shapes": [[1]],
                           "dtypes": ["float32"], "root": root, "file": str(path), "line": 5,
                           "where": "train.py:5", "t": 10.0})
    found = doctor.diagnose(views, 4, "stall", 5.0)
    assert found.kind == "collective-mismatch", found.text()
    assert (f"Its root, owner, is read from 'hash(name) % world': {wording.SALTED_HASH}, so each rank "
            "computes a number of its own") in found.summary, found.summary
    assert source.root_argument(str(path), 5) == "owner"
    other = tmp_path / "other.py"  # (a file's parse is cached by its name)
    other.write_text("import torch.distributed as dist\ndist.all_reduce(t, op)\ndist.broadcast(t, src=2)\n")
    assert source.root_argument(str(other), 2) is None  # all_reduce's second argument is its op
    assert source.root_argument(str(other), 3) == "2"


_ON_MAIN_PROCESS = """\
import torch.distributed as dist
from accelerate import Accelerator
accelerator = Accelerator()
@accelerator.on_main_process
def report(t):
    dist.all_gather([t], t)
def main(t):
    for epoch in range(2):
        dist.broadcast(t, 0)
        report(t)
main(None)
"""


def test_a_collective_in_a_function_accelerate_runs_on_the_main_process_alone_is_a_branch_on_the_rank(
        tmp_path):
    # n1 of a blind batch: gather_for_metrics in a validation report decorated with
    # @accelerator.on_main_process; the others came round to the next epoch's broadcast
    path = tmp_path / "train.py"
    path.write_text(_ON_MAIN_PROCESS)
    views = {}
    for rank in range(3):
        calls = [("broadcast", 9), ("all_gather", 6) if rank == 0 else ("broadcast", 9)]
        views[rank] = doctor.RankView(rank)
        for op_id, (op, line) in enumerate(calls, start=1):
            views[rank].apply({"ev": "op", "id": op_id, "op": op, "pg": "0", "seq": op_id, "shapes": [[2]],
                               "dtypes": ["float32"], "file": str(path), "line": line,
                               "where": f"train.py:{line}", "t": 10.0 + op_id,
                               **({"te": 10.5 + op_id, "ok": True} if op_id == 1 else {})})
    found = doctor.diagnose(views, 3, "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert "(rank 0's call under '@accelerator.on_main_process' at train.py:4)" in found.summary, \
        found.summary
    assert "left the loop" not in found.summary, found.summary
    assert source.rank_condition(str(path), 6) == (4, "accelerator.on_main_process", "@")
    assert source.rank_condition(str(path), 9) is None


def test_a_swallowed_metric_that_four_ranks_went_past_is_named_with_its_except_and_not_as_waited_in():
    # the same script as a 2 x 2 torchrun job under the doctor: gloo paired rank 3's 8 floats with the
    # others' metric of 1 without aborting anyone, the others went on to #5 and rank 3 waits in #4
    # (the records as the job's leader read them)
    grads, metric = (_line("grads before the metric"), 8), (_line("swallowed metric"), 1)
    found = doctor.diagnose({rank: _all_reduces(rank, __file__, [grads, metric, grads, *(
        [metric, grads] if rank != 3 else [grads])]) for rank in range(4)}, 4, "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [3]), found.text()
    assert (f"without the all_reduce at {HERE}:{metric[0]} that the others issued as #4 "
            f"(its next turn, or the loop run anew). The all_reduce at {HERE}:{metric[0]} is in a try whose "
            f"'except Exception:' at {HERE}:{metric[0] + 1} {wording.SWALLOWED}") in found.summary, \
        found.summary
    assert found.fix.startswith(wording.SWALLOW_CURE), found.fix


def _killed_in_a_call_whose_record_is_queued():
    import torch
    import torch.distributed as dist

    from helpers import rundir
    from helpers.trace import tracer

    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    group = dist.distributed_c10d._get_default_group()
    for step in range(3):
        dist.all_reduce(torch.ones(8))
        if dist.get_rank() == 0 and step == 2:  # once rank 1 is in its metric call: its record queued
            noted = rundir.current_path(tracer.current.run_dir, 1)
            expected = group._get_sequence_number_for_group() + 1
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a condition with a deadline
                seq, _first = rundir.CURRENT.unpack_from(noted.read_bytes())
                if seq == expected:
                    os.kill(pids[1], signal.SIGKILL)
                    break
        dist.all_reduce(torch.ones(1))  # line: metric while killed


def test_a_rank_killed_in_a_call_whose_record_was_still_queued_is_named_in_that_call(leftovers):
    # a metric's all_reduce from a line seen before is queued, not written before it runs: the
    # call in progress, noted in place, names it though no stack was dumped (SIGKILL) and the
    # record died with the rank (as when gloo aborts a rank and its stack dump is cut short)
    found = _failed_run(_killed_in_a_call_whose_record_is_queued)
    assert found.ranks == [1], found.text()
    assert f"Rank 1 was killed by SIGKILL inside all_reduce at {HERE}:{_line('metric while killed')}" \
        in found.summary, found.summary
    assert found.per_rank[1].seq == 8, found.per_rank[1]  # all_gather_object's two, then 2 per step
    leftovers.check()


def _destroys_its_group_early():
    import torch
    import torch.distributed as dist

    for step in range(4):
        dist.all_reduce(torch.ones(4))
        if dist.get_rank() == 1 and step == 1:
            dist.destroy_process_group()  # line: destroyed early
            break
    _stay_away()


def test_a_rank_that_destroyed_the_group_while_others_needed_it_is_said_to_have(leftovers):
    found = _failed_run(_destroys_its_group_early)
    assert found.ranks == [1], found.text()
    assert (f", after it destroyed the default process group at {HERE}:{_line('destroyed early')} "
            f"(destroy_process_group, under 'if dist.get_rank() == 1 and step == 1:' at "
            f"{HERE}:{_line('destroyed early') - 1}, a branch on the rank)") in found.summary, found.summary
    leftovers.check()


def _logs_when_its_loss_is_high():
    import torch
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    loss = torch.rand(1)  # 0.50 on rank 0, 0.76 on rank 1
    if loss.item() > 0.6:
        dist.all_reduce(loss)  # line: logged
    dist.all_reduce(torch.ones(9))  # line: grads


def test_a_rank_gloo_aborts_in_a_call_the_others_did_not_make_is_named_with_its_condition(leftovers):
    # rank 1's all_reduce of 1 float is paired with rank 0's of 9: gloo aborts rank 1 (SIGABRT) as
    # more data arrives than its call expects; its condition is on a value each rank computes
    found = _failed_run(_logs_when_its_loss_is_high)
    assert (found.verdict, found.kind, found.ranks) == ("crash", "collective-mismatch", [1]), found.text()
    assert f"Rank 1 was killed by SIGABRT inside all_reduce at {HERE}:{_line('logged')}" in found.summary
    assert f"at {HERE}:{_line('grads')}" in found.summary, found.summary
    assert wording.ABORT_CAUSES in found.summary, found.summary
    assert (f"under 'if loss.item() > 0.6:' at {HERE}:{_line('logged') - 1}, {wording.DECIDES_ITSELF}"
            in found.summary), found.summary
    assert found.fix.startswith(wording.CONDITION_CURE), found.fix
    leftovers.check()


_BRANCHES = """\
def step(rank, loss):
    if rank == 0:
        send(4)
    else:
        send(8)
    if loss > 1.0:
        log(loss)
    grads()
    if rank == 1:
        return first()
    return second()
"""


def test_calls_in_two_branches_of_one_if_are_told_from_a_call_under_an_if_and_one_after_it(tmp_path):
    from helpers.doctor.records import Op

    path = tmp_path / "steps.py"
    path.write_text(_BRANCHES)
    assert source.opposite_branches(str(path), 3, 5) and source.opposite_branches(str(path), 5, 3)
    assert source.opposite_branches(str(path), 10, 11)  # the if's body returns: what follows is its else
    unread = {0: Op("all_reduce", file=str(tmp_path / "gone.py"), line=3),
              1: Op("all_reduce", file=str(tmp_path / "gone.py"), line=5)}
    assert not diagnosis_module._calls_of_other_functions(unread)  # a file it cannot read: one call, as ever
    assert not source.opposite_branches(str(path), 7, 8)  # a call under an if, and one after it
    assert source.enclosing_condition(str(path), 7) == (6, "loss > 1.0", "if")
    assert source.enclosing_condition(str(path), 5) == (2, "rank == 0", "else")
    assert wording.decided_per_rank(str(path), 7) == (6, "loss > 1.0", "if")
    assert wording.decided_per_rank(str(path), 5) is None  # a branch on the rank is named as such


def test_ranks_whose_calls_sit_under_one_branch_are_named_once_with_it(tmp_path):
    from helpers.doctor.records import Op, Position

    path = tmp_path / "node.py"
    path.write_text("import x\nif accelerator.is_local_main_process:\n    accelerator.gather(t)\n"
                    "accelerator.wait_for_everyone()\n")
    ops = {rank: Op("all_gather", seq=9, where="node.py:3", file=str(path), line=3) for rank in (0, 2)}
    ops |= {rank: Op("barrier", seq=9, where="node.py:4", file=str(path), line=4) for rank in (1, 3)}
    positions = {rank: Position(rank, "in-collective", op=op, seq=9, where=op.where, file=op.file,
                                line=op.line) for rank, op in ops.items()}
    assert wording._different_path(ops, [0, 2], positions) == (
        " Ranks 0 and 2 took a different path from the others (the calls of ranks 0 and 2 under "
        "'if accelerator.is_local_main_process:' at node.py:2).")


def test_a_rank_killed_inside_a_collective_is_placed_in_it_from_its_dying_stack(tmp_path):
    # faulthandler's dump at SIGABRT; a dump asked for earlier (no 'Fatal Python error') places no one
    from helpers.doctor.records import Op, Position, RankView

    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    dump = ("Thread 0x01 (most recent call first):\n"
            f'  File "{c10d}", line 3252 in all_reduce\n'
            '  File "/work/train.py", line 17 in <module>\n')
    view = RankView(1)
    view.stack_text = dump
    assert diagnosis_module._dying_call(view) is None
    view.stack_text = "Fatal Python error: Aborted\n\n" + dump
    dying = diagnosis_module._dying_call(view)
    assert (dying.op, dying.where, dying.seq) == ("all_reduce", "train.py:17", None)
    view.stack_text = ("Fatal Python error: Aborted\n\nThread 0x01 (most recent call first):\n"
                       f'  File "{c10d}", line 3300 in broadcast\n'
                       f'  File "{c10d}", line 3500 in broadcast_object_list\n'
                       '  File "/work/train.py", line 9 in <module>\n')
    assert diagnosis_module._dying_call(view).op == "broadcast_object_list"  # the call, not its inner one
    # a trainer installed in site-packages: the tracer's site is its line, the dying stack the user's
    trainer = Position(0, "in-collective", op=Op("all_reduce", seq=3), seq=3, where="trainer.py:2100",
                       callers=[("/work/train.py", 5, "train.py:5")])
    died = Position(1, "exited", op=Op("all_reduce", source="stack"), where="train.py:5", exit_code=-6)
    assert diagnosis_module._same_call_as(died, trainer)
    died.where = "train.py:6"
    assert not diagnosis_module._same_call_as(died, trainer)
    # the ranks' positions in one numbered collective, from different calls: a divergence the
    # histories miss when their sources differ (a dead rank's records, the others' Flight Recorder)
    dead = Position(1, "exited", op=Op("all_reduce", seq=5, shapes=[[]], where="train.py:17"), seq=5,
                    where="train.py:17", exit_code=-6, abnormal=True)
    fr = Op("gloo:all_reduce", seq=5, shapes=[[9]], source="flight-recorder")
    ddp = Position(0, "in-collective", op=fr, seq=5, where="train.py:11")
    key, groups, present = diagnosis_module._numbered_divergence_now({0: ddp, 1: dead})
    assert key == ("0", 5) and len(groups) == 2 and present[0].where == "train.py:11"
    assert diagnosis_module._numbered_divergence_now({0: ddp, 1: Position(1, "exited", exit_code=-6)}) is None
    listed = Op("all_gather_object", seq=5, shapes=[[2]])
    objects = Position(1, "in-collective", op=listed, seq=5, where="a.py:3")
    inner = Op("gloo:all_gather", seq=5, shapes=[[1]], source="flight-recorder")  # its inner collective
    assert diagnosis_module._numbered_divergence_now(
        {0: Position(0, "in-collective", op=inner, seq=5, where="a.py:3"), 1: objects}) is None
    assert wording.aborted_note([dead, Position(2, "exited", op=dead.op, where="train.py:17")]).startswith(
        " Ranks 1 and 2 were killed by SIGABRT inside all_reduce at train.py:17: gloo ends a rank")


def _retries_with_a_smaller_batch_on_one_rank():
    import torch
    import torch.distributed as dist
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.ones(1))  # line: setup
        for step in range(3):
            if dist.get_rank() == 1 and batch_size == 64 and step == 1:  # its allocator gives up
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
            dist.all_reduce(torch.ones(batch_size))  # line: step

    train()


def test_a_rank_that_find_executable_batch_size_retried_alone_is_named_with_the_batch_sizes(leftovers):
    # accelerate lowers the batch size on rank 1 alone and calls train() again there: rank 1 is
    # back in the setup's all_gather while rank 0 waits in the loop's all_reduce
    found = _hung_run(_retries_with_a_smaller_batch_on_one_rank)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert (f"rank 0 in all_reduce at {HERE}:{_line('step')}; rank 1 in all_gather at {HERE}:{_line('setup')}"
            in found.summary), found.summary
    # 57 (x0.9), or 32 (x0.5, an older accelerate)
    lowered = int(found.summary.rsplit("rank 1 at ", 1)[-1].split(" ", 1)[0])
    assert 0 < lowered < 64
    assert found.summary.endswith(
        " The ranks run accelerate's find_executable_batch_size with different batch sizes: rank 0 at 64; "
        f"rank 1 at {lowered} (lowered after an out-of-memory error on that rank, which then called the "
        "function again alone)."), found.summary
    assert found.fix.startswith(wording.BATCH_SIZE_CURE), found.fix
    leftovers.check()


def _ranks_waiting_for_a_file_lock(path: str):
    import fcntl

    import torch
    import torch.distributed as dist
    from filelock import FileLock

    rank = dist.get_rank()
    with open(path, "a") as handle:
        if rank == 0:
            fcntl.flock(handle, fcntl.LOCK_EX)  # held while it waits in the collective
        dist.barrier()
        if rank == 1:
            with FileLock(path):  # line: filelock
                pass
        elif rank == 2:
            fcntl.flock(handle, fcntl.LOCK_EX)  # line: flock
        dist.all_reduce(torch.ones(2))  # line: locked


def test_a_rank_waiting_for_a_file_lock_is_named_at_its_own_line_with_the_locks_cure(leftovers, tmp_path):
    # filelock is an installed package: the rank's place is the user's line that called it, not
    # filelock's polling loop; fcntl.flock called on the user's line is told from the line
    found = doctor.run_function(_ranks_waiting_for_a_file_lock, kwargs={"path": str(tmp_path / "cache.lock")},
                                num_processes=3, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [1, 2]), found.text()
    held = "(filelock: held by another process or another open of the file)"
    assert (f"rank 1 is {wording.FILE_LOCK_WAIT} {held} at {HERE}:{_line('filelock')}; "
            f"rank 2 is {wording.FILE_LOCK_WAIT} at {HERE}:{_line('flock')}."
            ) in found.summary, found.summary
    assert [row["location"] for row in found.rows()][1:] == [f"{HERE}:{_line('filelock')}",
                                                            f"{HERE}:{_line('flock')}"]
    assert found.fix.startswith(wording.FILE_LOCK_CURE), found.fix
    leftovers.check()



def _a_rank_waiting_for_a_store_key_no_rank_set():
    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # rank 1 has nothing to share, and sets no key
        store.set("words/1", "tok")
    if dist.get_rank() == 0:
        for source in range(dist.get_world_size()):
            print(store.get(f"words/{source}"))  # line: store get
    dist.all_reduce(torch.ones(2))


def test_a_rank_waiting_for_a_store_key_is_named_with_the_stores_cure(leftovers):
    # unseen i2: a Store's get blocks in C++, so the rank's line is its innermost frame, inside a
    # loop: the line tells what it waits for, not "in a loop"
    found = doctor.run_function(_a_rank_waiting_for_a_store_key_no_rank_set, num_processes=2, stall_s=2.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [0]), found.text()
    assert f"rank 0 is {wording.STORE_WAIT} at {HERE}:{_line('store get')}" in found.summary, found.summary
    assert found.fix.startswith(wording.STORE_CURE), found.fix
    leftovers.check()

def test_a_rank_in_an_installed_packages_code_is_named_by_that_package_and_the_users_line():
    user = {"file": "/work/train.py", "line": 9, "func": "<module>", "user": True, "where": "train.py:9"}
    package = {"file": "/venv/lib/python3.11/site-packages/mycache/poll.py", "line": 41, "func": "wait_ready",
               "user": True, "where": "poll.py:41"}
    sleep = {"file": "<built-in>", "line": 0, "func": "sleep"}
    assert wording.activity(1, user, [user, package, sleep]) == (
        "sleeping in mycache (wait_ready at poll.py:41), called at train.py:9")
    assert wording.activity(1, user, [user, package]).startswith("running in mycache (wait_ready")
    torch_frame = {"file": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125,
                   "func": "forward", "user": False, "where": "linear.py:125"}
    assert wording.activity(1, user, [user, torch_frame]) == "at train.py:9"  # torch's own: not named
    assert wording.library_below(user, [user, {"file": "/usr/lib/python3.11/json/decoder.py"}]) is None
    assert wording.installed_package("/x/dist-packages/pkg/mod.py") == "pkg"
    assert wording.installed_package("/x/site-packages/six.py") == "six"  # a lone module
    assert wording.installed_package("/work/train.py") is None


class _BadRows:
    """Rows of which rank 1's fourth is corrupt: its worker raises."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        import torch.distributed as dist

        if index == 3 and dist.get_rank() == 1:
            raise ValueError("corrupt row 3")  # line: corrupt
        return index


def _read_rows():
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    for batch in DataLoader(_BadRows(), batch_size=1, num_workers=1):  # line: rows
        dist.all_reduce(torch.as_tensor(batch, dtype=torch.float32))


def _read_rows_and_lose_a_worker():
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rows = iter(DataLoader(list(range(6)), batch_size=1, num_workers=1))
    dist.all_reduce(next(rows).float())
    if dist.get_rank() == 1:  # its worker killed, as by the out-of-memory killer, between two batches:
        psutil.Process().children()[0].kill()  # torch's SIGCHLD handler raises in the rank at once
        _stay_away(10)
    for batch in rows:
        dist.all_reduce(batch.float())


def test_a_dataloader_workers_error_is_said_as_the_workers_and_a_dead_worker_gets_its_cure(leftovers):
    # torch raises the worker's error again in the rank as 'Caught ValueError in DataLoader worker
    # process 0.' with the worker's traceback as text: the record keeps the worker's error and line
    found = _failed_run(_read_rows)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    worker = f"(in DataLoader worker process 0, at {HERE}:{_line('corrupt')} in __getitem__)"
    assert f"Rank 1 raised ValueError: corrupt row 3 {worker} at {HERE}:{_line('rows')}" in found.summary, \
        found.summary
    found = _failed_run(_read_rows_and_lose_a_worker)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    assert "Rank 1 raised RuntimeError: DataLoader worker (pid" in found.summary, found.summary
    assert found.fix.startswith("A DataLoader worker process of that rank died without a Python"), found.fix
    leftovers.check()


_CHILD_ENDS_AS_IT_IS_SAID = """
import os, signal
import torch.distributed as dist


def on_child(signum, frame):  # as torch's DataLoader (torch/utils/data/_utils/signal_handling.py)
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")


class CorruptRow(ValueError):
    def __str__(self):  # read as the rank records its end: a child of the rank ends meanwhile
        os.kill(os.getpid(), signal.SIGCHLD)
        return "corrupt row 3"


def main():
    signal.signal(signal.SIGCHLD, on_child)
    dist.barrier()
    if dist.get_rank() == 1:
        raise CorruptRow()
    dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
"""


def test_a_child_that_ends_while_a_rank_reports_its_error_leaves_the_error_said(tmp_path, leftovers):
    # a DataLoader's SIGCHLD handler raises when a worker ends; one ending while the rank recorded
    # its own error replaced it ('exit code 1, no exit record'): the script's handler is off by then
    script = tmp_path / "rows.py"
    script.write_text(_CHILD_ENDS_AS_IT_IS_SAID)
    namespace: dict = {}
    exec(compile(_CHILD_ENDS_AS_IT_IS_SAID.replace('if __name__ == "__main__"', "if False"), str(script),
                 "exec"), namespace)
    line = _CHILD_ENDS_AS_IT_IS_SAID.splitlines().index("        raise CorruptRow()") + 1
    said = f"Rank 1 raised CorruptRow: corrupt row 3 at rows.py:{line}"
    found = _failed_run(namespace["main"])  # a forked rank (helpers.launch.rank.rank_main)
    assert said in found.summary, found.summary
    done = _doctor_cli("--num-processes", "2", "--stall-s", "2", "--json", str(tmp_path / "d.json"), "--",
                       str(script))  # a script run as __main__ (run_as_main: the job doctor's too)
    data = json.loads((tmp_path / "d.json").read_text())
    assert said in data["summary"], done.stderr[-2000:]
    leftovers.check()


_EXITS_EARLY = """\
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.zeros(4)
for step in range(6):
    if dist.get_rank() == 1 and step == 3:
        sys.exit(1)
    dist.all_reduce(x)
sys.exit(0)
"""


def _diagnosed_script(tmp_path, name: str, text: str, num_processes: int = 2
                      ) -> tuple[subprocess.CompletedProcess, dict]:
    """``text`` written as ``name`` and run on ``num_processes`` ranks under the doctor's CLI: its
    run and JSON."""
    script = tmp_path / name
    script.write_text(text)
    done = _doctor_cli("--num-processes", str(num_processes), "--stall-s", "2", "--json",
                       str(tmp_path / "d.json"), "--", str(script))
    return done, json.loads((tmp_path / "d.json").read_text())


def test_a_sys_exit_inside_the_loop_on_one_rank_is_named_and_one_after_it_on_every_rank_is_not(tmp_path,
                                                                                              leftovers):
    done, data = _diagnosed_script(tmp_path, "stops.py", _EXITS_EARLY)
    script = tmp_path / "stops.py"
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), done.stderr[-3000:]
    assert data["summary"].startswith(
        "Rank 1 left through sys.exit(1) (exit code 1) at stops.py:9, inside the loop at stops.py:7 (under "
        "'if dist.get_rank() == 1 and step == 3:' at stops.py:8, a branch on the rank) while other ranks "
        "still needed it"), data["summary"]
    assert data["fix"].startswith(wording.LOOP_EXIT_CURE), data["fix"]
    script.write_text(_EXITS_EARLY.replace("step == 3", "step == 99"))  # sys.exit(0) past the loop: healthy
    done = _doctor_cli("--num-processes", "2", "--stall-s", "2", "--", str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    leftovers.check()


_EXITS_IN_A_CALLED_FUNCTION = """\
import sys
import torch
import torch.distributed as dist

def validate(step):
    loss = float("inf") if dist.get_rank() == 1 and step == 3 else 1.0
    if loss == float("inf"):
        sys.exit(2)
    dist.all_reduce(torch.tensor([loss]))

dist.init_process_group("gloo")
for step in range(6):
    dist.all_reduce(torch.zeros(4))
    validate(step)
"""


def test_a_sys_exit_in_a_function_called_inside_the_loop_is_named_with_that_call(tmp_path, leftovers):
    # unseen script: a validation pass that exits when its loss is not finite, called each epoch
    done, data = _diagnosed_script(tmp_path, "val.py", _EXITS_IN_A_CALLED_FUNCTION)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), done.stderr[-3000:]
    assert data["summary"].startswith(
        "Rank 1 left through sys.exit(2) (exit code 2) at val.py:8, in a function called at val.py:14, "
        "inside the loop at val.py:12 (under 'if loss == float('inf'):' at val.py:7, a condition each rank "
        "decides for itself) while other ranks still needed it"), data["summary"]
    assert data["fix"].startswith(wording.LOOP_EXIT_CURE), data["fix"]
    leftovers.check()


_TASKS = """\
import sys

SPECS = {"sst2": {}, "wnli": {"status": "deprecated"}}

def check(name):
    if SPECS[name].get("status") == "deprecated":
        sys.exit(0)

def load(name):
    check(name)
    return len(name)
"""

_TIMED_STEPS = """\
import torch
import torch.distributed as dist

class StepTimer:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            return False
        dist.barrier()

dist.init_process_group("gloo")
for step in range(6):
    try:
        with StepTimer():
            dist.all_reduce(torch.ones(2))
            if dist.get_rank() == 1 and step == 2:
                raise ZeroDivisionError("no positives in this batch")
    except ZeroDivisionError:
        pass
"""


def test_a_with_blocks_exit_skipped_on_one_rank_is_named_on_that_rank(tmp_path, leftovers):
    # unseen j4: a timer's __exit__ reduces unless an exception left the block; one rank's block
    # raised (caught outside): its next turn's call meets the others' call in __exit__, whose line
    # (the with's) comes before the block's though it runs after it
    done, data = _diagnosed_script(tmp_path, "timed.py", _TIMED_STEPS)
    assert (data["kind"], data["ranks"]) == ("collective-mismatch", [1]), done.stderr[-3000:]
    assert ("Rank 1 has come round to the loop at timed.py:14 again without the barrier at timed.py:11 (from "
            "the call at timed.py:16) that rank 0 waits in") in data["summary"], data["summary"]
    assert "the return at timed.py:10 (if exc_type is not None) leaves its function" in data["summary"]
    leftovers.check()


_CACHED_COUNTS = """\
import functools
import torch
import torch.distributed as dist

@functools.lru_cache(maxsize=None)
def global_count(label):
    count = torch.tensor([1.0])
    dist.all_reduce(count)
    return count.item()

dist.init_process_group("gloo")
labels = [[0, 1], [0, 0], [0, 0]][dist.get_rank()]
for step in range(3):
    weights = [global_count(label) for label in labels]
    dist.all_reduce(torch.ones(4))
"""


def test_a_collective_in_a_cached_function_is_named_with_its_cache(tmp_path, leftovers):
    # unseen j5: class counts all-reduced in an lru_cache'd function, a miss for each new class: rank
    # 0 sees a class rank 1 does not, and its extra call meets rank 1's next one
    done, data = _diagnosed_script(tmp_path, "counts.py", _CACHED_COUNTS, num_processes=3)
    assert (data["kind"], data["ranks"]) == ("collective-mismatch", [0]), done.stderr[-3000:]
    assert ("Rank 0's call at counts.py:8 is in global_count, cached by functools' lru_cache at counts.py:5, "
            f"{wording.CACHED}") in data["summary"], data["summary"]
    assert data["fix"].startswith(wording.CACHED_CURE), data["fix"]
    leftovers.check()


_CACHED_IN_A_LOOP = """\
import functools
import torch.distributed as dist
@functools.lru_cache(maxsize=None)
def global_count(label):
    dist.all_reduce(label)
def weights(labels):
    for label in labels:
        global_count(label)
def main(batches, grads):
    for labels in batches:
        weights(labels)
        dist.all_reduce(grads)
main(None, None)
"""


def test_a_cached_collective_in_a_loop_of_a_function_is_told_by_its_cache_not_the_loop(tmp_path):
    # j5 of a blind batch as the job's leader read it: rank 2's batch has a class new to it, its
    # cache misses and it issues one more count; its stack never came (gloo aborted it), its callers
    # are read from the source, and the loop over the labels they lead through is not the story
    path = tmp_path / "train.py"
    path.write_text(_CACHED_IN_A_LOOP)
    count, grads = (5, 1), (12, 8)
    found = doctor.diagnose({rank: _all_reduces(rank, str(path), [count, count, grads, *(
        [count] if rank == 2 else [grads])]) for rank in range(4)}, 4, "stall", 5.0)
    assert (found.kind, found.ranks) == ("collective-mismatch", [2]), found.text()
    assert ("Rank 2's call at train.py:5 is in global_count, cached by functools' lru_cache at train.py:3, "
            f"{wording.CACHED}") in found.summary, found.summary
    assert "left the loop" not in found.summary, found.summary
    assert found.fix.startswith(wording.CACHED_CURE), found.fix


_SHARD_CONDITION = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
records = list(range(10)) + [None, None]
per = len(records) // dist.get_world_size()
start = dist.get_rank() * per
local = records[start:start + per]
unlabeled = [r for r in local if r is None]
if unlabeled:
    dist.barrier()
dist.all_reduce(torch.ones(2))
"""


def test_a_condition_on_a_value_computed_from_the_ranks_shard_is_one_each_rank_decides(tmp_path, leftovers):
    # unseen j7: 'if unlabeled:' from a filter of the rank's slice of the records (its start from the
    # rank): only the last rank's slice holds unlabeled records
    done, data = _diagnosed_script(tmp_path, "shard.py", _SHARD_CONDITION, num_processes=3)
    assert (data["kind"], data["ranks"]) == ("collective-mismatch", [2]), done.stderr[-3000:]
    said = f"under 'if unlabeled:' at shard.py:10, {wording.DECIDES_ITSELF}"
    assert said in data["summary"], data["summary"]
    assert data["fix"].startswith(wording.CONDITION_CURE), data["fix"]
    leftovers.check()


_EXITS_IN_A_HELPER = """\
import torch
import torch.distributed as dist
from tasks import SPECS, load

dist.init_process_group("gloo")
scores = []
for name in list(SPECS)[dist.get_rank()::2]:
    scores.append(load(name))
dist.all_reduce(torch.tensor(scores, dtype=torch.float))
"""


def test_a_sys_exit_under_a_condition_in_a_helper_module_is_named_with_the_scripts_call(tmp_path, leftovers):
    # unseen i6: a task registry's check exits (code 0) on a deprecated task, which only rank 1 has;
    # the loop that calls it holds no collective: an early exit of the process, not of a turn
    (tmp_path / "tasks.py").write_text(_TASKS)
    done, data = _diagnosed_script(tmp_path, "probe.py", _EXITS_IN_A_HELPER)
    assert (data["kind"], data["ranks"]) == ("rank-exited", [1]), done.stderr[-3000:]
    assert data["summary"].startswith(
        "Rank 1 left through sys.exit(0) at tasks.py:7, in a function called at probe.py:8, inside the loop "
        "at probe.py:7 while other ranks still needed it"), data["summary"]
    assert data["per_rank"][1]["location"] == "tasks.py:7"
    assert data["fix"].startswith(wording.EARLY_EXIT_CURE), data["fix"]
    leftovers.check()


def test_ranks_all_waiting_in_init_for_a_larger_world_are_told_the_world_they_asked_for(tmp_path, leftovers):
    # a world size from a configuration written for more processes than the launch started: every
    # rank joins, and init_process_group waits for ranks that will never come
    script = tmp_path / "world.py"
    script.write_text("import os\n"
                      "import torch.distributed as dist\n"
                      "CONFIG = {'world_size': 4}\n"
                      "rank = int(os.environ['RANK'])\n"
                      "dist.init_process_group('gloo', world_size=CONFIG['world_size'], rank=rank)\n")
    done = _doctor_cli("--num-processes", "2", "--stall-s", "1.5", "--json", str(tmp_path / "d.json"), "--",
                       str(script))
    data = json.loads((tmp_path / "d.json").read_text())
    assert (done.returncode, data["kind"], data["ranks"]) == (3, "rank-missing", [0, 1]), done.stderr[-2000:]
    assert data["summary"].startswith(
        "All 2 ranks the launch started wait in init_process_group at world.py:5 for a world of 4 processes "
        "(its world_size argument or WORLD_SIZE, on every rank): ranks 2 to 3 were never started."), data
    assert data["fix"].startswith(wording.WORLD_CURE)
    # the right world size, two addresses: no rank is missing, they never connected; said so, hedged
    ports = [procs.free_port(), procs.free_port()]
    script.write_text("import os\n"
                      "import torch.distributed as dist\n"
                      "rank = int(os.environ['RANK'])\n"
                      f"address = 'tcp://127.0.0.1:' + str({ports}[rank])  # one per rank\n"
                      "dist.init_process_group('gloo', init_method=address, world_size=2, rank=rank)\n")
    done = _doctor_cli("--num-processes", "2", "--stall-s", "1.5", "--json", str(tmp_path / "d.json"), "--",
                       str(script))
    data = json.loads((tmp_path / "d.json").read_text())
    assert (done.returncode, data["kind"], data["ranks"]) == (3, "unknown", []), done.stderr[-2000:]
    assert "none asked for more ranks than the launch started: they have not connected" in data["summary"]
    assert data["fix"].startswith(wording.INIT_CONNECT_CURE)
    leftovers.check()


def test_a_communication_error_is_told_from_a_ranks_own_and_from_pythons_pipes():
    is_comm = diagnosis_module.is_comm_error
    assert is_comm("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert is_comm("DistBackendError: NCCL communicator was aborted on rank 1.")
    # the backend names itself in errors about the rank's own arguments too
    assert not is_comm("RuntimeError: ProcessGroupGloo::allgather: invalid output tensor list at index 0 "
                       "(expected length 2, got 3)")
    # Python's own: a DataLoader's pipe to a worker that died
    assert not is_comm("ConnectionResetError: [Errno 104] Connection reset by peer (reading from its "
                       "DataLoader's worker processes)")


def test_what_a_rank_waits_for_is_read_from_the_library_calls_below_its_line():
    def frame(file, func, user=False):
        return {"file": file, "func": func, "line": 3, "user": user, "where": f"{Path(file).name}:3"}

    lib = "/usr/lib/python3.11"
    mine = frame("/work/train.py", "main", user=True)
    queue_get = [frame("/r/runpy.py", "_run_code"), mine, frame(f"{lib}/queue.py", "get"),
                 frame(f"{lib}/threading.py", "wait")]
    assert wording.waiting_for(mine, queue_get) == "waiting on a queue"  # not its Condition's wait
    threads = f"{lib}/threading.py"
    joined = [mine, frame(threads, "join"), frame(threads, "_wait_for_tstate_lock")]
    assert wording.waiting_for(mine, joined) == "waiting for a thread to end"
    assert wording.waiting_for(mine, [frame(threads, "wait"), mine]) is None  # above its line: not its wait


def _creates_a_group_on_rank_zero_alone():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.new_group([0, 1])  # line: new group
    dist.barrier()


def test_a_rank_creating_a_group_the_others_skip_is_said_to_be_in_new_group_with_its_rule(leftovers):
    found = _hung_run(_creates_a_group_on_rank_zero_alone)
    assert (found.kind, found.ranks) == ("rank-missing", [0]), found.text()
    said = f"rank 0 is {wording.NEW_GROUP_WAIT} at {HERE}:{_line('new group')}"
    assert said in found.summary, found.summary
    assert found.fix.startswith("Create every process group on every rank of the job, in the same order"), \
        found.fix
    leftovers.check()


def _native_sleep_on_rank_one():
    import ctypes

    import torch
    import torch.distributed as dist

    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if dist.get_rank() == 1:  # PyDLL keeps the GIL: the helper thread cannot answer
        ctypes.PyDLL(None).sleep(3600)  # line: native
    dist.all_reduce(tensor)
    return "went on"


@pytest.mark.parametrize("reader", ["py-spy", "signal"])
def test_a_rank_in_native_code_holding_the_gil_is_read_from_outside_not_woken(reader, monkeypatch, leftovers):
    """py-spy reads a rank whose helper thread cannot answer, leaving it in its call. Where py-spy
    cannot (no ptrace rights; here its time is cut to nothing), faulthandler's signal ends the
    native sleep early and the ranks finish: the run is then ok, with a note, never 'hang (ok)'."""
    from helpers.doctor import watcher

    if reader == "signal":
        monkeypatch.setattr(watcher, "PY_SPY_S", 0.0)
    found = doctor.run_function(_native_sleep_on_rank_one, num_processes=2, stall_s=1.5, timeout_s=60)
    read = any("read with py-spy" in note for note in found.notes)
    if reader == "py-spy" and not read and os.geteuid() != 0:  # root may always
        pytest.skip("py-spy may not read the ranks here (ptrace rights)")
    if reader == "py-spy":
        assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [1]), found.text()
        assert found.per_rank[1].location == f"{HERE}:{_line('native')}"
        assert f"rank 1 is in native code holding the GIL at {HERE}:{_line('native')}" in found.summary
        assert found.per_rank[0].state == "in-collective"
    else:
        assert not read
        assert (found.verdict, found.kind) == ("ok", "ok"), found.text()
        assert found.results == ["went on", "went on"]
        assert any("went on and finished while their stacks were gathered" in note for note in found.notes)
    leftovers.check()


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad batch on purpose")  # line: raise
    dist.barrier()


def test_a_raising_rank_keeps_its_error_type_and_gets_a_diagnosis(leftovers):
    with pytest.raises(RankError) as info:
        doctor.launch(_raise_on_rank_one, num_processes=2, timeout_s=60)
    found = info.value.diagnosis
    assert info.value.rank == 1
    assert (found.verdict, found.kind, found.ranks) == ("crash", "rank-exited", [1]), found.text()
    assert found.per_rank[1].location == f"{HERE}:{_line('raise')}"
    assert "Rank 1 raised ValueError: bad batch on purpose" in found.summary
    assert any("doctor: crash (rank-exited)" in note for note in info.value.__notes__)
    leftovers.check()


def _truncating_broadcast():
    import torch
    import torch.distributed as dist

    tensor = torch.arange(5.0) if dist.get_rank() == 0 else torch.zeros(10)
    dist.broadcast(tensor, src=0)  # line: broadcast
    return tensor.tolist()


def test_a_run_that_finishes_with_mismatched_shapes_is_a_mismatch(leftovers):
    # gloo fills 5 of the 10 elements on rank 1 and says nothing
    with pytest.raises(doctor.MismatchDetected) as info:
        doctor.launch(_truncating_broadcast, num_processes=2, timeout_s=60)
    found = info.value.diagnosis
    assert (found.verdict, found.kind, found.exit_code) == ("mismatch", "shape-mismatch", 5)
    assert f"broadcast at {HERE}:{_line('broadcast')}" in found.summary
    assert "rank 0 [5] float32; rank 1 [10] float32" in found.summary
    assert info.value.results[1][:5] == [0.0, 1.0, 2.0, 3.0, 4.0]
    leftovers.check()


def test_deadline_before_stall_still_explains(leftovers):
    with pytest.raises(LaunchTimeout) as info:
        doctor.launch(_skip_barrier_on_rank_one, num_processes=2, timeout_s=3, stall_s=30)
    assert not isinstance(info.value, doctor.HangDetected)
    found = info.value.diagnosis
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [1]), found.text()
    leftovers.check()


def test_doctor_can_be_turned_off(leftovers):
    with pytest.raises(LaunchTimeout) as info:
        launch(_skip_barrier_on_rank_one, num_processes=2, timeout_s=3)
    assert info.value.diagnosis is None
    leftovers.check()


# ---------------------------------------------------------------------------------------------
# the command line


def _doctor_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers", "doctor", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    ([], "give the script to run after '--'"),
    (["--num-processes", "0", "--", "x.py"], "num_processes must be an integer in 1..64; got 0"),
    (["--stall-s", "-1", "--", "x.py"], "stall_s must be a number > 0"),
    (["--", "no_such_script.py"], "script 'no_such_script.py' not found"),
    (["--stall-s", "5", "no_such_script.py"], "script 'no_such_script.py' not found"),  # no '--' needed
    (["--attach", "123", "x.py"], "give one of --attach, --merge, --from-fr or a script"),
    (["--bogus", "--", "x.py"], "unrecognized arguments: --bogus"),
])
def test_cli_bad_usage_exits_2_naming_the_argument(args, message, leftovers):
    done = _doctor_cli(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    leftovers.check()


def test_cli_help_names_the_exit_codes():
    done = _doctor_cli("--help")
    assert done.returncode == 0 and "0 ok, 3 hang, 4 crash, 5 mismatch" in done.stdout


def _helpers_run_dirs() -> set[Path]:
    import tempfile

    return set(Path(tempfile.gettempdir()).glob("helpers-run-*"))


def test_killing_the_doctor_kills_its_ranks_and_leaves_nothing(tmp_path, leftovers):
    before = _helpers_run_dirs()
    script = scenarios.get("stuck-compute")
    cli = subprocess.Popen([sys.executable, "-m", "helpers", "doctor", "--num-processes", "2",
                            "--stall-s", "600", "--", *script.command()],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = _wait_for_traced_ranks(cli, before)
    os.kill(cli.pid, signal.SIGKILL)
    cli.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                for p in ranks if _exists(p))
                                            or _helpers_run_dirs() - before):
        time.sleep(0.1)
    assert not [p.pid for p in ranks if _exists(p) and p.status() != psutil.STATUS_ZOMBIE]
    assert not _helpers_run_dirs() - before
    leftovers.check()


def _exists(process: psutil.Process) -> bool:
    try:
        return process.is_running()
    except psutil.NoSuchProcess:
        return False


def _wait_for_traced_ranks(cli: subprocess.Popen, before: set[Path]) -> list[psutil.Process]:
    """The doctor's rank processes, once both have a process group (their trace shows progress)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert cli.poll() is None, "the doctor ended before its ranks started"
        for folder in _helpers_run_dirs() - before:
            traces = [folder / f"trace-{r}.jsonl" for r in range(2)]
            if all(t.exists() and '"ev":"pg"' in t.read_text() for t in traces):
                children = psutil.Process(cli.pid).children()
                ranks = [p for p in children if "helpers.trace" in " ".join(p.cmdline())]
                if len(ranks) == 2:
                    return ranks
        time.sleep(0.1)
    raise AssertionError("the ranks never got a process group")


# ---------------------------------------------------------------------------------------------
# the reasoning, on its own


def test_canonical_names_and_short_errors():
    assert collectives.canonical_op("gloo:all_reduce") == "all_reduce"
    assert collectives.canonical_op("all_gather_single") == "all_gather_into_tensor"
    assert wording.short_error(
        "RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:2. This is typically caused by a remote worker crashing.") == \
        "RuntimeError: Connection closed by peer [127.0.0.1]:2."
    # a store's error carries torch's C++ frames (seen in a rank's log as its agent's store went away)
    assert wording.short_error(
        "DistNetworkError: Broken pipe\nException raised from sendBytes at /pytorch/torch/csrc/distributed/"
        "c10d/Utils.hpp:645 (most recent call first):\nframe #0: c10::Error::Error(...) + 0x98\n") == \
        "DistNetworkError: Broken pipe"


def test_an_op_record_written_after_its_call_returned_closes_the_call():
    view = doctor.RankView(0)
    view.apply({"ev": "op", "id": 1, "op": "all_reduce", "seq": 1, "t": 10.0, "te": 10.5, "ok": True})
    view.apply({"ev": "op", "id": 2, "op": "barrier", "seq": 2, "t": 11.0})  # still running when written
    assert list(view.open) == [2] and view.ops[1].end == 10.5 and view.ops[1].ok is True
    assert view.last_done_t == 10.5 and view.waiting_since() == 11.0 and view.pending_seq() == 2
    view.apply({"ev": "end", "id": 2, "t": 12.0, "ok": True})
    assert not view.open and view.last_done_t == 12.0


def test_an_open_call_the_group_has_since_passed_is_closed_not_shown_as_where_the_rank_waits():
    # a rank SIGKILLed between beats: its first all_reduce on file as running, its ends still queued
    def killed() -> doctor.RankView:
        view = doctor.RankView(3)
        view.apply({"ev": "op", "id": 1, "op": "all_reduce", "pg": "0", "seq": 1, "t": 10.0})
        return view

    by_progress = killed()
    by_progress.apply({"ev": "pg", "pg": {"0": [3, 3]}, "t": 11.0})  # torch's progress: #3 completed
    assert not by_progress.open and by_progress.pending_seq() is None
    behind = killed()
    behind.apply({"ev": "pg", "pg": {"0": [1, 0]}, "t": 11.0})  # still in #1 when noted: stays open
    assert list(behind.open) == [1]

    others = {}
    for rank in range(3):  # the others completed #2 and #3, which no rank leaves before all joined
        view = doctor.RankView(rank)
        for seq in (1, 2, 3):
            view.apply({"ev": "op", "id": seq, "op": "all_reduce", "pg": "0", "seq": seq, "t": 10.0 + seq,
                        "te": 10.5 + seq, "ok": True, "where": "train.py:8"})
        view.apply({"ev": "op", "id": 4, "op": "all_reduce", "pg": "0", "seq": 4, "t": 14.0})
        others[rank] = view
    found = doctor.diagnose({**others, 3: killed()}, 4, "exited", 1.0)
    assert found.per_rank[3].op is None and found.per_rank[3].seq is None, found.per_rank[3]
    assert [found.per_rank[rank].seq for rank in range(3)] == [4, 4, 4]
    # a broadcast's root may end before a receiver joined: it says nothing of the others
    rooted = {0: doctor.RankView(0), 1: killed()}
    rooted[0].apply({"ev": "op", "id": 1, "op": "broadcast", "pg": "0", "seq": 2, "t": 11.0, "te": 11.1,
                     "ok": True})
    doctor.diagnose(rooted, 2, "exited", 1.0)
    assert list(rooted[1].open) == [1]


def test_a_connection_error_before_any_collective_is_the_ranks_own_not_an_echo():
    # torch 2.13, two torchrun agents restarting (--max-restarts 1): gloo's connectFullMesh inside
    # init_process_group refused on two ranks, the other two still in it; no collective issued yet
    error = ("RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/third_party/gloo/gloo/"
             "transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
             "remote=[127.0.0.1]:25987$2")
    for traced in (False, True):  # the tracer records init_process_group (seq 0): ended with the error
        views = {}
        for rank in range(4):
            views[rank] = view = doctor.RankView(rank)
            if traced:
                view.apply(_init_record(rank))
            if rank >= 2:
                if traced:
                    view.apply({"ev": "end", "id": 1, "t": 5.0, "ok": False, "error": error})
                view.apply({"ev": "exit", "t": 5.0, "code": 1, "status": "raised", "error": error,
                            "where": "train.py:4", "file": "train.py", "line": 4})
                view.ended, view.exit_code = True, 1
        found = doctor.diagnose(views, 4, "failure", 0.4)
        assert (found.verdict, found.kind, found.ranks) == ("crash", "rank-exited", [2, 3]), found.summary
        assert "Gloo connectFullMesh failed" in found.summary and "train.py:4" in found.summary


def _init_record(rank: int) -> dict:
    return {"ev": "op", "id": 1, "op": "init_process_group", "pg": "0", "seq": 0, "t": 1.0 + rank,
            "file": "train.py", "line": 4, "where": "train.py:4"}


STORE_TIMEOUT = "DistStoreError: wait timeout after 90000ms, keys: /default_pg/0//cpu//0/1"


@pytest.mark.parametrize("error", [STORE_TIMEOUT, "SignalException: Process 7 got signal: 15"],
                         ids=["timeout", "signal"])
def test_a_rank_that_never_reached_init_process_group_is_named_after_the_others_timed_out_in_it(error):
    # plain torchrun, post-mortem: rank 0 waited in init_process_group for rank 1's address until
    # the group's timeout (or until Slurm's scancel); rank 1 was stuck before it and stopped by
    # torchrun (as its files show)
    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    views[0].apply(_init_record(0))
    views[0].apply({"ev": "pg", "t": 2.0, "pg": {"0": [0, 0]}})  # registered, still in it (an init barrier)
    assert views[0].open, "a group's progress does not end init_process_group"
    views[0].apply({"ev": "end", "id": 1, "t": 91.0, "ok": False, "error": error})
    views[0].apply({"ev": "exit", "t": 91.0, "status": "raised", "error": error, "where": "train.py:4",
                    "file": "train.py", "line": 4})
    views[0].ended, views[0].exit_code = True, 1
    views[1].stack_text = 'Stack (most recent call first):\n  File "/job/train.py", line 3 in <module>\n'
    found = doctor.diagnose(views, 2, "failure", 0.4)  # rank 1: no result, its stack from SIGTERM
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [1]), found.summary
    assert found.summary.startswith("Rank 1 never reached the init_process_group that rank 0 entered at "
                                    "train.py:4"), found.summary
    assert found.evidence.histories == {0: {}, 1: {}}  # the group's setup is no collective to compare
    assert found.fix.startswith(wording.INIT_CURE) and "main_process_first" in found.fix


def test_a_rank_that_ends_cleanly_before_init_process_group_is_named_while_the_others_wait_in_it():
    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    views[0].apply(_init_record(0))
    views[1].apply({"ev": "exit", "t": 2.0, "status": "finished", "where": "train.py:2"})
    views[1].ended, views[1].exit_code = True, 0
    found = doctor.diagnose(views, 2, "exited", 0.0)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    assert "rank 0 in init_process_group at train.py:4" in found.summary, found.summary


def test_a_progress_note_written_after_the_end_of_the_collective_it_saw_running_is_stale():
    # CI under load: the helper thread noted [5 enqueued, 4 done] during the 5th all_reduce, the
    # main thread ended it, and the note was written after the end's record: the rank, asleep in
    # its own code, showed as waiting in a collective "issued outside Python" and nothing was named
    view = doctor.RankView(0)
    view.apply({"ev": "op", "id": 5, "op": "all_reduce", "pg": "0", "seq": 5, "t": 1.0})
    view.apply({"ev": "end", "id": 5, "t": 1.2, "ok": True})
    view.apply({"ev": "pg", "t": 1.3, "pg": {"0": [5, 4]}})
    assert (view.waiting_since(), view.pending_seq(), view.progress) == (None, None, {"0": [5, 5]})
    view.apply({"ev": "op", "id": 6, "op": "barrier", "pg": "0", "seq": 6, "t": 1.4})
    view.apply({"ev": "pg", "t": 1.45, "pg": {"0": [6, 5]}})  # the next one, really waited in
    assert view.pending_seq() == 6
    view.apply({"ev": "end", "id": 6, "t": 1.5, "ok": True})
    # CI: the group destroyed after the barrier, and a note taken during the barrier written after
    # the destroy's record (the rank then failed on its own, and showed as waiting in the barrier)
    view.apply({"ev": "destroy", "t": 2.0})
    view.apply({"ev": "pg", "t": 2.1, "pg": {"0": [6, 5]}})
    assert view.pending_seq() is None
    view.apply({"ev": "op", "id": 7, "op": "init_process_group", "pg": "0", "seq": 0, "t": 3.0})
    view.apply({"ev": "end", "id": 7, "t": 3.1, "ok": True})
    view.apply({"ev": "pg", "t": 3.2, "pg": {"0": [1, 0]}})  # a new group counts from 1 again
    assert view.pending_seq() == 1


def test_ranks_in_init_process_group_get_stall_s_after_the_last_arrival_and_torchs_connect_backoff():
    # make test under two pytest workers: rank 0, which hosts the store, imported torch 15 s after
    # rank 1, whose TCPStore client by then retried every few seconds (torch's backoff: 0.5 s growing
    # 1.5 times a try): both sat in init_process_group 4.3 s, past a stall_s of 4, and a healthy run
    # was named a hang. Now: stall_s after the last arrival, plus 0.75 times the spread and a second
    watcher = doctor.Doctor(stall_s=4.0)
    for rank, arrived in ((0, 115.0), (1, 100.0)):
        watcher.views[rank] = view = doctor.RankView(rank)
        view.apply({"ev": "op", "id": 1, "op": "init_process_group", "pg": "0", "seq": 0, "t": arrived})
    backoff = 0.75 * (15.0 + 1.0)
    assert watcher._stall_start(115.0 + 4.0 + 0.1) is None
    assert watcher._stall_start(115.0 + 4.0 + backoff - 0.1) is None
    assert watcher._stall_start(115.0 + 4.0 + backoff + 0.1) == 100.0  # then it is one
    # a rank that never reaches init_process_group is named once the others had that long
    del watcher.views[0]
    assert watcher._stall_start(100.0 + 4.0 + 0.75 + 0.1) == 100.0
    watcher.views[1].apply({"ev": "end", "id": 1, "t": 101.0, "ok": True})  # past it: no grace
    watcher.views[1].apply({"ev": "op", "id": 2, "op": "barrier", "pg": "0", "seq": 1, "t": 102.0})
    assert watcher._stall_start(102.0 + 4.0 + 0.1) == 102.0
    # a group set up again: the spread is the new arrivals', not the first init's
    for rank, first, again in ((0, 115.0, 200.0), (1, 100.0, 200.5)):
        watcher.views[rank] = view = doctor.RankView(rank)
        view.apply({"ev": "op", "id": 1, "op": "init_process_group", "pg": "0", "seq": 0, "t": first})
        view.apply({"ev": "end", "id": 1, "t": 116.0, "ok": True})
        view.apply({"ev": "op", "id": 2, "op": "init_process_group", "pg": "0", "seq": 0, "t": again})
    assert watcher._stall_start(200.5 + 4.0 + 0.75 * 1.5 + 0.1) == 200.0


def test_a_progress_note_taken_during_a_collective_is_superseded_by_its_end():
    # CI: the helper noted [6 enqueued, 5 done] inside the last barrier; the script then destroyed
    # the group (no later note) and polled a file: it showed as waiting in #6 and was called a hang
    view = doctor.RankView(0)
    view.apply({"ev": "op", "id": 6, "op": "barrier", "pg": "0", "seq": 6, "t": 1.0})
    view.apply({"ev": "pg", "t": 1.1, "pg": {"0": [6, 5]}})
    assert view.pending_seq() == 6
    view.apply({"ev": "end", "id": 6, "t": 1.2, "ok": True})
    assert (view.waiting_since(), view.pending_seq(), view.last_seq()) == (None, None, 6)


def test_the_local_doctor_names_a_rank_stuck_before_init_process_group(tmp_path, leftovers):
    # python -m helpers doctor -- script.py: the script sets up its own group (as accelerate does)
    script = tmp_path / "late_init.py"
    script.write_text("import os, sys, time\n"
                      "import torch.distributed as dist\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    time.sleep(60)  # a download on one rank\n"
                      "dist.init_process_group('gloo')\n")
    found = doctor.run_command([str(script)], num_processes=2, stall_s=2.0, timeout_s=60)
    assert (found.verdict, found.kind, found.ranks) == ("hang", "rank-missing", [1]), found.text()
    assert [(r.state, r.op, r.location) for r in found.per_rank] == [
        ("in-collective", "init_process_group", "late_init.py:5"),
        ("outside-collective", None, "late_init.py:4")]
    leftovers.check()


def test_a_rank_with_no_record_at_all_is_said_to_have_ended_unseen():
    views = {0: doctor.RankView(0)}
    views[0].apply(_init_record(0))
    found = doctor.diagnose(views, 2, "stall", 5.0)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    assert found.summary.startswith("Rank 1 ended, nothing of it seen (no record, no exit code) while"), \
        found.summary


def test_a_connection_error_after_cpp_collectives_is_an_echo_though_the_final_dump_is_missing():
    # CI, plain torchrun, dead-rank: DDP's all-reduce (C++, no Python record) raised 'Connection
    # closed by peer' on rank 0; torchrun's SIGTERM came after its exit record and before its final
    # Flight Recorder dump. The exit record's progress says collectives ran: the dead rank is the cause
    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    views[0].apply({"ev": "exit", "t": 5.0, "status": "raised", "pg": {"0": [6, 6]},
                    "error": "RuntimeError: Connection closed by peer [127.0.0.1]:32663",
                    "where": "dead_rank.py:44", "file": "dead_rank.py", "line": 44})
    views[0].ended, views[0].exit_code = True, -15
    views[1].ended, views[1].exit_code = True, -9
    found = doctor.diagnose(views, 2, "failure", 0.4)
    assert (found.verdict, found.kind, found.ranks) == ("crash", "rank-exited", [1]), found.summary


def test_a_reset_connection_of_the_users_own_before_any_collective_stays_the_ranks_error():
    # a download before the first collective ('Connection reset by peer' from requests), not a peer
    # leaving init_process_group: rank 1 is the cause, rank 0 waits for it
    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    views[0].apply({"ev": "op", "id": 1, "op": "all_reduce", "pg": "0", "seq": 1, "t": 1.0,
                    "where": "train.py:9", "file": "train.py", "line": 9})
    error = "ConnectionError: ('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"
    views[1].apply({"ev": "exit", "status": "raised", "t": 2.0, "error": error,
                    "where": "train.py:4", "file": "train.py", "line": 4})
    views[1].ended, views[1].exit_code = True, 1
    found = doctor.diagnose(views, 2, "failure", 0.1)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.summary
    assert found.per_rank[1].op is None, found.per_rank[1]


def test_a_wait_the_process_groups_timeout_ended_adds_the_timeout_to_the_missing_ranks_cure():
    # torch 2.13 gloo, InitProcessGroupKwargs(timeout=4 s): rank 1 still loads a checkpoint
    error = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
             "Timed out waiting 4000ms for recv operation to complete")
    views = {0: doctor.RankView(0), 1: doctor.RankView(1)}
    site = {"where": "train.py:7", "file": "train.py", "line": 7}
    views[0].apply({"ev": "op", "id": 1, "op": "barrier", "pg": "0", "seq": 1, "t": 1.0, **site})
    views[0].apply({"ev": "end", "id": 1, "t": 5.0, "ok": False, "error": error})
    views[0].apply({"ev": "exit", "status": "raised", "t": 5.0, "error": error, **site})
    views[0].ended, views[0].exit_code = True, 1
    found = doctor.diagnose(views, 2, "failure", 0.1)
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.summary
    assert found.summary.endswith("Rank 0 stopped waiting at the process group's timeout (RuntimeError: "
                                  "Timed out waiting 4000ms for recv operation to complete)."), found.summary
    assert found.fix.startswith(wording.TIMEOUT_CURE)
    # a wait a signal ended (torchrun's SIGTERM) is no timeout
    signalled = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15"
    views[0].apply({"ev": "end", "id": 1, "t": 5.0, "ok": False, "error": signalled})
    views[0].exit["error"] = signalled
    found = doctor.diagnose(views, 2, "failure", 0.1)
    assert "timeout" not in found.summary and not found.fix.startswith(wording.TIMEOUT_CURE), found.summary


def test_first_divergence_names_the_lowest_sequence_number():
    op = doctor.Op
    same = {("0", 1): op("all_reduce", shapes=[[4]], dtypes=["float32"])}
    histories = {
        0: {**same, ("0", 2): op("all_reduce", shapes=[[4]], dtypes=["float32"]),
            ("0", 3): op("barrier")},
        1: {**same, ("0", 2): op("all_reduce", shapes=[[5]], dtypes=["float32"]),
            ("0", 3): op("all_reduce", shapes=[[4]], dtypes=["float32"])},
    }
    key, groups, present = diagnosis_module.first_divergence(histories)
    assert key == ("0", 2) and sorted(groups.values()) == [[0], [1]]
    assert diagnosis_module.first_divergence({0: same, 1: dict(same)}) is None


_RANK_NAMED_OTHERWISE = """\
import torch.distributed as dist


def evaluate(args, accelerator):
    r = dist.get_rank()
    first = r == 0
    rank, world = dist.get_rank(), dist.get_world_size()
    if r == 1:
        dist.barrier()  # line 9: r is the rank
    if first:
        dist.barrier()  # line 11: derived from r
    if world > 1:
        dist.barrier()  # line 13: the world size, not the rank
    if args.local_rank in (-1, 0):
        dist.barrier()  # line 15: the local rank, passed in the arguments (old scripts' main first)
    if accelerator.ranking_enabled:
        dist.barrier()  # line 17: a word that merely starts with 'rank'


def other(response):
    if response.r == 200:
        return  # line 22: another function's 'r' is not the rank


class Trainer:
    def __init__(self, accelerator):
        self.me = accelerator.process_index

    def step(self):
        if self.me == 0:
            dist.barrier()  # line 31: an attribute set from the rank


def setup(local_rank):
    device = torch.device("cuda", local_rank)
    num_ranks = dist.get_world_size()
    if device.type == "cuda" or num_ranks > 1:
        dist.barrier()  # line 38: a value built with the rank, and the world size, are not the rank
    ddp = local_rank != -1
    if ddp or local_rank != -1:
        dist.barrier()  # line 41: 'launched distributed at all', alike on every rank
"""


def test_a_branch_on_a_name_the_script_gave_the_rank_is_rank_conditional(tmp_path):
    script = tmp_path / "evaluate.py"
    script.write_text(_RANK_NAMED_OTHERWISE)
    lines = (9, 11, 13, 15, 17, 22, 31, 38, 41)
    conditional = [line for line in lines if source.rank_conditional(str(script), line)]
    assert conditional == [9, 11, 15, 31]


def test_a_name_read_from_the_launchers_rank_variable_is_the_rank(tmp_path):
    # an unseen script: 'if local_rank == 0 and dropped.item() > 0:' around a subgroup's all_reduce
    script = tmp_path / "stats.py"
    script.write_text("import os\nimport torch.distributed as dist\n\n\ndef main():\n"
                      "    local_rank = int(os.environ.get('LOCAL_RANK', '0'))\n"  # 6
                      "    node = int(os.getenv('GROUP_RANK', 0))\n"  # 7
                      "    size = int(os.environ.get('WORLD_SIZE', '1'))\n"  # 8
                      "    if local_rank == 0:\n        dist.barrier()\n"  # 9, 10
                      "    if node == 1:\n        dist.barrier()\n"  # 11, 12
                      "    if size > 1:\n        dist.barrier()\n")  # 13, 14
    assert [line for line in (10, 12, 14) if source.rank_conditional(str(script), line)] == [10, 12]


def test_the_branch_on_the_rank_around_a_line_is_the_innermost_with_its_test(tmp_path):
    script = tmp_path / "evaluate.py"
    script.write_text(_RANK_NAMED_OTHERWISE + "\n\ndef save(accelerator, flag):\n"  # 44
                      "    if accelerator.is_main_process:\n"  # 45
                      "        if flag:\n"  # 46
                      "            dist.barrier()  # line 47: the rank's branch is the outer one\n"
                      "    else:\n"  # 48
                      "        dist.barrier()  # line 49: its else\n"
                      "    if flag:\n"  # 50
                      "        pass\n"  # 51
                      "    elif accelerator.process_index == 1:\n"  # 52
                      "        dist.barrier()  # line 53: an elif's\n")
    assert source.rank_condition(str(script), 9) == (8, "r == 1", "if")
    assert source.rank_condition(str(script), 31) == (30, "self.me == 0", "if")
    assert source.rank_condition(str(script), 47) == (45, "accelerator.is_main_process", "if")
    assert source.rank_condition(str(script), 49) == (45, "accelerator.is_main_process", "else")
    assert source.rank_condition(str(script), 53) == (52, "accelerator.process_index == 1", "elif")
    assert source.rank_condition(str(script), 13) is None


def test_a_rank_whose_own_call_is_in_a_branch_on_the_rank_is_named_with_that_branch(leftovers):
    found = _hung_run(_main_only_barrier)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    branch = f"{HERE}:{_line('main only') - 1}"
    assert found.summary.endswith(f"Rank 0 took a different path from rank 1 (rank 0's call under 'if "
                                  f"dist.get_rank() == 0:' at {branch})."), found.summary
    leftovers.check()


def _main_only_barrier():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # line: main only
    dist.all_reduce(__import__("torch").ones(1))


def test_a_value_each_rank_computes_is_read_in_names_made_of_parts_not_in_settings():
    for test in ("local_loss < 100", "val_loss_mean > best", "train_accuracy > 0.9", "f1_score > x",
                 "loss.item() > 3", "over.sum() > 0", "mask.any()", "not torch.isfinite(x).all()"):
        assert wording._per_rank_value(test), test
    for test in ("step % log_loss_every == 0", "step % eval_loss_steps == 0", "accelerator.is_main_process",
                 "glossary", "'loss' in logs", "scaler.loss_scale > 1024", "cfg.accuracy_threshold > 0",
                 "step % grad_acc == 0", "use_loss_scaling", "loss_weight > 0", "score_fn is not None",
                 "max(steps, 1) > 2", "len(items) > 0"):
        assert not wording._per_rank_value(test), test


def test_rank_conditional_lines_are_found_in_the_source():
    script = scenarios.get("main-only-collective")
    assert source.rank_conditional(str(script.path), script.line("main-only"))
    assert not source.rank_conditional(str(script.path), script.line("others"))
    loop = scenarios.get("stuck-compute")
    assert source.enclosing_loop(str(loop.path), loop.line("loop")) == loop.line("loop")


_LOOPS_AND_TRIES = """\
import os, sys, traceback
def train(batches, patience):
    for epoch in range(3):
        for batch in batches:
            step(batch)
        if patience < epoch:
            break
    finish()
def evaluate(batches):
    for epoch in range(3):
        for batch in batches:
            step(batch)
    finish()
def metrics(x):
    try:
        reduce(x)
    except Exception:
        pass
    try:
        reduce(x)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    try:
        reduce(x)
    except KeyboardInterrupt:
        pass
    try:
        try:
            reduce(x)
        finally:
            x = None
    except BaseException:
        def later():
            raise
    try:
        reduce(x)
    except (ZeroDivisionError, KeyError):
        print("no positives in this shard")
    try:
        reduce(x)
    except StopIteration:
        pass
"""


def test_the_loop_left_and_a_swallowing_except_are_read_from_the_source_as_they_mean(tmp_path):
    path = tmp_path / "loops.py"
    path.write_text(_LOOPS_AND_TRIES)
    lines = _LOOPS_AND_TRIES.splitlines()

    def at(text: str, nth: int = 0) -> int:
        return [n for n, line in enumerate(lines, 1) if line.strip() == text][nth]

    # a break of the epoch loop's own: the epoch loop; uneven batches alone: the batch loop
    assert source.loop_left(str(path), at("step(batch)"), at("finish()")) == at("for epoch in range(3):")
    batches = at("for batch in batches:", 1)
    assert source.loop_left(str(path), at("step(batch)", 1), at("finish()", 1)) == batches
    # an except that swallows any error; not one that exits, nor one for Ctrl-C; a try of only a
    # finally passes to the try around it, whose nested function's raise is not the handler's own
    swallowing = source.swallowing_handler
    assert swallowing(str(path), at("reduce(x)")) == (at("except Exception:"), "except Exception:")
    assert source.swallowing_handler(str(path), at("reduce(x)", 1)) is None
    assert source.swallowing_handler(str(path), at("reduce(x)", 2)) is None
    assert source.swallowing_handler(str(path), at("reduce(x)", 3)) == (at("except BaseException:"),
                                                                        "except BaseException:")
    # an error named (a metric's division by zero, a missing key) is swallowed too; the end of an
    # iterator is not an error
    named = "except (ZeroDivisionError, KeyError):"
    assert swallowing(str(path), at("reduce(x)", 4)) == (at(named), named)
    assert swallowing(str(path), at("reduce(x)", 5)) is None


_RETRIES = """\
import sys
def main(batches):
    for batch in range(batches):
        all_reduce(batch)
for attempt in range(3):
    try:
        sys.exit(main(2))
    except ConnectionError:
        continue
"""


def test_a_sys_exit_in_a_loop_that_holds_no_collectives_of_its_own_is_no_early_exit(tmp_path):
    # a retry loop around main(): rank 1's batches ran out in main's loop, then sys.exit(main()) ended
    # it; the retry loop holds its collectives only through the call
    path = tmp_path / "retry.py"
    path.write_text(_RETRIES)
    site = {"file": str(path), "line": 7, "where": "retry.py:7"}
    views = {rank: doctor.RankView(rank) for rank in (0, 1)}
    for rank, calls in ((0, 3), (1, 2)):
        for seq in range(1, calls + 1):
            views[rank].apply({"ev": "op", "id": seq, "op": "all_reduce", "pg": "0", "seq": seq,
                               "t": float(seq), "where": "retry.py:4", "file": str(path), "line": 4,
                               **({"te": seq + 0.5, "ok": True} if seq < 3 else {})})
    views[1].apply({"ev": "exit", "status": "finished", "t": 3.0, "exit_site": site})
    views[1].ended, views[1].exit_code = True, 0
    found = doctor.diagnose(views, 2, "stall", 1.0)
    assert (found.kind, found.ranks) == ("rank-exited", [1]), found.text()
    assert "left through" not in found.summary and "ran out first on rank 1" in found.summary, found.summary


def test_diagnosis_json_has_exactly_the_documented_fields():
    entry = doctor.RankReport(rank=0, state="finished", exit_code=0)
    found = doctor.Diagnosis("ok", "ok", [], "fine", "nothing", None, [entry])
    data = json.loads(found.to_json())
    assert list(data) == ["verdict", "kind", "ranks", "summary", "fix", "detected_after_s", "per_rank"]
    assert list(data["per_rank"][0]) == ["rank", "state", "op", "seq", "shapes", "location", "exit_code"]
    found.notes.append("stacks alone: no sequence numbers")  # attach and --from-fr say what is unknown
    assert json.loads(found.to_json())["notes"] == ["stacks alone: no sequence numbers"]


def test_a_rank_dying_inside_a_collective_after_a_peer_died_is_not_a_second_culprit():
    from helpers.doctor.diagnosis import Op, Position, _exited_culprits

    waiting = Op("all_reduce", seq=4)
    positions = {
        0: Position(0, "in-collective", op=waiting, seq=4),
        1: Position(1, "exited", exit_code=-9, abnormal=True),  # killed in its own code
        2: Position(2, "exited", op=waiting, seq=4, exit_code=-11, abnormal=True),  # gloo's echo
    }
    assert _exited_culprits(positions) == [1]
    positions[1] = Position(1, "exited", op=waiting, seq=4, exit_code=-9, abnormal=True)
    assert _exited_culprits(positions) == [1, 2], "with no death outside a collective, name both"


_HANG_FOREVER = """
import os, pathlib, time
import torch.distributed as dist
dist.init_process_group("gloo")
pathlib.Path(os.environ["READY_DIR"], f"ready-{dist.get_rank()}").touch()
if dist.get_rank() == 1:
    while True:
        time.sleep(0.05)  # never reaches the barrier; gloo's own timeout is 30 minutes
dist.barrier()
"""


def test_a_torchrun_run_past_its_deadline_leaves_no_worker(tmp_path, monkeypatch, leftovers):
    # torchrun starts its workers in sessions of their own: stopping torchrun alone orphans them
    script = tmp_path / "hang_forever.py"
    script.write_text(_HANG_FOREVER)
    monkeypatch.setenv("READY_DIR", str(tmp_path))
    code, diagnosis, _output = doctor.run_torchrun([str(script)], tmp_path / "trace", 2, timeout_s=15)
    assert code is None, "the run must be stopped at its deadline"
    assert {p.name for p in tmp_path.glob("ready-*")} == {"ready-0", "ready-1"}, "the workers never ran"
    workers = [p for p in psutil.process_iter(["cmdline"])
               if str(script) in " ".join(p.info["cmdline"] or [])]
    assert not workers, f"workers left running: {[(p.pid, p.info['cmdline']) for p in workers]}"
    found = (diagnosis.verdict, diagnosis.kind, diagnosis.ranks)
    assert found == ("hang", "rank-missing", [1]), diagnosis.text()
    assert diagnosis.per_rank[0].op == "barrier"
    sleep_line = next(n for n, line in enumerate(_HANG_FOREVER.splitlines(), 1) if "time.sleep" in line)
    stack = rundir.stack_path(tmp_path / "trace", 1)
    dumped = stack.read_text() if stack.exists() else "(no stack file)"
    assert diagnosis.per_rank[1].location == f"{script.name}:{sleep_line}", f"{diagnosis.text()}\n{dumped}"
    leftovers.check()


def test_traced_ranks_end_when_torchrun_is_sigkilled(tmp_path, leftovers):
    # the kernel that ran torchrun died, and PR_SET_PDEATHSIG SIGKILLed torchrun: it could not stop
    # its workers, in sessions of their own; rank 1 would have run on forever. They get SIGTERM, as
    # from torchrun (their stacks are dumped, not always whole: see helpers.launch.rank)
    script = tmp_path / "hang_forever.py"
    script.write_text(_HANG_FOREVER)
    env = procs.python_env({rundir.ENV_DIR: str(tmp_path / "trace"), "READY_DIR": str(tmp_path),
                            "TMPDIR": str(tmp_path)})  # torchrun's folder, which its SIGKILL leaves
    env.pop(rundir.ENV_PARENT, None)
    agent = subprocess.Popen(runs.torchrun_argv([str(script)], 2), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    ranks: list[psutil.Process] = []
    try:
        ranks = _wait_for_ranks(agent, tmp_path, str(script))
        agent.kill()
        agent.wait()
        _gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks left running after their agent died: {[p.pid for p in alive]}"
    finally:
        procs.stop_tree(agent)
        procs.stop_processes(ranks)  # what the fix under test failed to end
    leftovers.check()


def _wait_for_ranks(agent: subprocess.Popen, ready_dir: Path, script: str) -> list[psutil.Process]:
    """The two ranks running ``script`` once both wrote their ready file (their group is up)."""
    started = time.monotonic()
    while {p.name for p in ready_dir.glob("ready-*")} != {"ready-0", "ready-1"}:
        assert agent.poll() is None, "torchrun ended before its ranks were up"
        assert time.monotonic() - started < 60, "the ranks never came up"
        time.sleep(0.1)
    ranks = [p for p in psutil.process_iter(["cmdline"])
             if p.pid != agent.pid and script in " ".join(p.info["cmdline"] or [])]
    assert len(ranks) == 2, [p.info["cmdline"] for p in ranks]
    return ranks



def test_a_faulthandler_dump_gives_the_main_threads_frames_and_one_cut_off_gives_none(tmp_path):
    import faulthandler

    with open(tmp_path / "stack.txt", "w+") as handle:
        faulthandler.dump_traceback(handle, all_threads=False)  # line: dumped
        handle.seek(0)
        text = handle.read()
    frames = source.faulthandler_stack(text)
    assert frames[-1]["where"] == f"{HERE}:{_line('dumped')}", frames[-3:]
    assert source.faulthandler_stack(text[text.index("\n") + 1:]) == []  # its header lost: not a dump


# ---------------------------------------------------------------------------------------------
# a rank importing a module (helpers/doctor/loading.py)

IMPORTING = Path(__file__).parent / "fixtures" / "job" / "importing_script.py"
LAZY_MODULE = IMPORTING.with_name("lazy_module.py")


def _fixture_line(path: Path, marker: str) -> str:
    """'name.py:N' of the one line of ``path`` marked ``# doctor-line: <marker>``."""
    found = [number for number, text in enumerate(path.read_text().splitlines(), start=1)
             if f"# doctor-line: {marker}" in text]
    assert len(found) == 1, found
    return f"{path.name}:{found[0]}"


def _importing_run(tmp_path: Path, mode: str, stall_s: float) -> tuple[subprocess.CompletedProcess, dict]:
    out, env = tmp_path / f"{mode}.json", {**os.environ, "MODE": mode, "STEP_S": str(0.6 * stall_s)}
    done = subprocess.run([sys.executable, "-m", "helpers", "doctor", "--num-processes", "2", "--stall-s",
                           str(stall_s), "--json", str(out), "--", str(IMPORTING)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    return done, json.loads(out.read_text())


def test_a_rank_whose_import_moves_on_is_looked_at_again_and_the_run_ends_well(tmp_path, leftovers):
    # rank 1 imports a module that loads for 6 x 0.6 stall_s while rank 0 waits in an all_reduce:
    # each look, stall_s apart, finds it at another step of the module, so it is no hang
    done, data = _importing_run(tmp_path, "moves", stall_s=1.0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (data["verdict"], data["kind"]) == ("ok", "ok"), data
    looked = [note for note in data["notes"] if "looked again" in note]
    assert looked and all(f"at {_fixture_line(IMPORTING, 'import')}, loading lazy_module.py:" in note
                          for note in looked), data["notes"]
    leftovers.check()


def test_a_rank_whose_import_waits_is_named_one_look_later_with_its_modules_line(tmp_path, leftovers):
    done, data = _importing_run(tmp_path, "stuck", stall_s=1.0)
    assert done.returncode == doctor.EXIT_CODES["hang"], done.stderr[-3000:]
    assert (data["kind"], data["ranks"]) == ("rank-missing", [1]), data
    assert data["per_rank"][1]["location"] == _fixture_line(LAZY_MODULE, "stuck"), data["per_rank"]
    assert data["per_rank"][0]["location"] == _fixture_line(IMPORTING, "after"), data["per_rank"]
    assert data["detected_after_s"] >= 2.0  # a look, then one more stall_s with the same stack
    assert any("had not moved" in note for note in data["notes"]), data["notes"]
    leftovers.check()


def _importing_stack(line: int) -> list[dict]:
    return [{"file": "train.py", "line": 18, "func": "<module>"},
            {"file": "<frozen importlib._bootstrap>", "line": 1176, "func": "_find_and_load"},
            {"file": "lazy.py", "line": line, "func": "<module>"}]


def test_an_import_is_looked_at_again_while_its_stack_is_new_at_most_import_looks_times():
    from helpers.doctor import loading

    found = doctor.Diagnosis("hang", "rank-missing", [1], "", "", 2.0, per_rank=[
        doctor.RankReport(0, "in-collective", "all_reduce", 2, None, "train.py:19", None),
        doctor.RankReport(1, "outside-collective", None, None, None, "lazy.py:5", None)])
    watch = loading.ImportWatch()
    again, note = watch.look(found, {1: _importing_stack(5)}, 2.0)
    assert again and "rank 1 (at train.py:18, loading lazy.py:5) was importing" in note, note
    again, note = watch.look(found, {1: _importing_stack(5)}, 2.0)  # the same stack: it waits
    assert not again and "had not moved" in note, note
    again, _note = watch.look(found, {1: _importing_stack(6)}, 2.0)  # moved on again
    assert again
    # its import ended (a stack outside importlib): a later import starts afresh
    assert watch.look(found, {1: [{"file": "lazy.py", "line": 7, "func": "<module>"}]}, 2.0) == (False, None)
    looks = [watch.look(found, {1: _importing_stack(line)}, 2.0)
             for line in range(100, 101 + loading.IMPORT_LOOKS)]
    assert [again for again, _note in looks] == [True] * loading.IMPORT_LOOKS + [False]  # every stack new
    assert "still moving after the doctor had looked again" in looks[-1][1], looks[-1]
    # an importing rank the diagnosis does not name (another rank's mismatch) holds nothing up
    other = doctor.Diagnosis("hang", "collective-mismatch", [0], "", "", 2.0, per_rank=found.per_rank)
    assert loading.ImportWatch().look(other, {1: _importing_stack(5)}, 2.0) == (False, None)
    in_call = doctor.Diagnosis("hang", "rank-missing", [1], "", "", 2.0, per_rank=[
        doctor.RankReport(1, "in-collective", "all_reduce", 2, None, "train.py:19", None)])
    assert loading.ImportWatch().look(in_call, {1: _importing_stack(5)}, 2.0) == (False, None)


def test_the_notes_of_many_looks_again_list_the_first_few_then_count_the_rest():
    # a long healthy job whose slow collectives completed as they were looked at, stall after stall
    from helpers.doctor import loading

    notes = loading.LookNotes()
    notes.add(None)
    assert notes.lines() == []
    for number in range(loading.NOTES_KEPT + 7):
        notes.add(f"look {number}")
    lines = notes.lines()
    assert lines[:loading.NOTES_KEPT] == [f"look {number}" for number in range(loading.NOTES_KEPT)]
    assert lines[loading.NOTES_KEPT:] == [f"7 more looks like these after them; the last: "
                                          f"look {loading.NOTES_KEPT + 6}"]


def test_a_rank_that_caught_its_error_and_destroyed_the_group_in_a_finally_is_told_so(leftovers):
    # unseen script: train() in a try whose 'except Exception:' logs, destroy_process_group() in its
    # finally; rank 1's error ends it as finished (exit 0), and rank 0's next all_reduce fails as the
    # group is gone: caught by the same except, every rank finishes, yet nothing matched. (Each rank
    # then writes its results for a moment: rank 0's failed call has ended when rank 1 finishes,
    # else the doctor names rank 1 as it ends, while rank 0 still waits: the f8 job's case.)
    found = doctor.run_function(_caught_then_destroyed, num_processes=2, stall_s=1.5, timeout_s=60)
    assert (found.verdict, found.kind, found.ranks) == ("mismatch", "rank-exited", [1]), found.text()
    assert found.summary.startswith(f"Every rank finished, but rank 0's all_reduce at {HERE}:"
                                    f"{_line('after the error')} (collective #2) raised"), found.summary
    assert "Rank 1 never issued collective #2: it had left, after it destroyed" in found.summary
    # a collective that raised on every rank alike, caught by the script, leaves nobody out: ok
    again = doctor.run_function(_rejected_then_fallback, num_processes=2, stall_s=1.5, timeout_s=60)
    assert (again.verdict, again.kind) == ("ok", "ok"), again.text()
    said = (f"Its destroy_process_group is in the finally of a try whose 'except Exception:' at "
            f"{HERE}:{_line('caught')} {wording.SWALLOWED_END}: had an error been raised in that try on "
            "rank 1")
    assert said in found.summary, found.summary
    assert found.fix.startswith(wording.SWALLOWED_END_CURE), found.fix
    leftovers.check()


def test_a_loop_that_ran_out_first_on_a_rank_that_may_have_caught_its_error_says_both():
    # unseen script (f8): rank 2's IndexError, caught by an 'except Exception:' that logs, left the
    # loop early; the doctor sees the rank leave the loop, not why: a loop that ran out, or that error
    from helpers.doctor.records import Op

    waiting = diagnosis_module.Position(0, "in-collective", op=Op("all_reduce", seq=9), seq=9, where="t.py:9")
    left = diagnosis_module.Position(1, "finished", seq=8)
    positions = {0: waiting, 1: left}
    plain = wording.loop_ran_longer("t.py:5", [1], positions)
    assert plain == (" The loop at t.py:5 ran out first on rank 1: its last collective was #8 at t.py:9, "
                     "the call the others still wait in as #9."), plain
    caught = wording.loop_ran_longer("t.py:5", [1], positions, caught=True)
    assert caught.startswith(" The loop at t.py:5 ran out first on rank 1, or an error raised in it was "
                             "caught by that except: its last collective was #8"), caught


def _caught_then_destroyed():
    import time

    import torch
    import torch.distributed as dist

    try:
        for step in range(3):
            if dist.get_rank() == 1 and step == 1:
                raise IndexError("position 70 is past the table")
            dist.all_reduce(torch.ones(1))  # line: after the error
    except Exception:  # line: caught
        pass
    finally:
        dist.destroy_process_group()
        time.sleep(1.5)  # its results written


def _rejected_then_fallback():
    import torch
    import torch.distributed as dist

    tensor = torch.ones(2)
    try:  # a list one short: gloo rejects it on every rank alike, before any data moves
        dist.all_gather([torch.zeros(2)], tensor)
    except (RuntimeError, ValueError):
        dist.all_gather([torch.zeros(2) for _ in range(dist.get_world_size())], tensor)


def _warm_start(path):
    import os

    import torch
    import torch.distributed as dist

    if not os.path.isfile(path):  # line: file test
        return 0
    weights = torch.load(path)
    for tensor in weights.values():
        dist.broadcast(tensor, src=0)  # line: warm broadcast
    return 1


def _warm_start_from_a_file_one_node_wrote(folder):
    import os

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    path = os.path.join(folder, f"node{rank}", "stage1.pt")  # each rank's own working folder, as a node's
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if rank == 0:
        torch.save({"w": torch.ones(64), "b": torch.zeros(8)}, path)
    dist.barrier()
    _warm_start(path)  # line: warm start
    dist.all_reduce(torch.ones(2))  # line: after warm start


def test_a_return_before_the_others_collective_on_a_rank_without_the_file_is_named_with_its_test(
        tmp_path, leftovers):
    # rank 1 returned from the warm start: its file test found no checkpoint in its own folder, as a
    # node's ranks find none that another node wrote. The doctor named rank 0, and told of a loop
    # rank 1 had left: the loop over the weights that it never entered (o1 of a blind batch)
    found = doctor.run_function(_warm_start_from_a_file_one_node_wrote, kwargs={"folder": str(tmp_path)},
                                num_processes=2, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert (f"Rank 1 has returned early from the call at {HERE}:{_line('warm start')} that rank 0 is still "
            f"in, at {HERE}:{_line('warm broadcast')} (their broadcast): the return at {HERE}:"
            f"{_line('file test') + 1} (if not os.path.isfile(path)) leaves before "
            f"{HERE}:{_line('warm broadcast')} on the ranks where its condition holds.") in found.summary, \
        found.summary
    assert "reads this node's own filesystem" in found.summary
    assert found.fix.startswith("Decide from a file once, on one rank"), found.fix
    leftovers.check()


def _area_under_curve(labels):
    if len(set(labels)) < 2:
        raise ValueError("Only one class present in y_true")
    return 0.5


def _evaluate(labels):
    import torch
    import torch.distributed as dist

    try:
        auc = _area_under_curve(labels)
        dist.all_reduce(torch.tensor([auc]))  # line: metric reduce
    except ValueError:  # line: swallowing except
        return None
    return auc


def _a_metric_whose_error_is_caught_on_one_rank():
    import torch
    import torch.distributed as dist

    labels = [0, 0] if dist.get_rank() == 0 else [0, 1]  # rank 0's shard holds one class
    for _epoch in range(2):
        dist.all_reduce(torch.ones(4))
        _evaluate(labels)  # line: evaluate
        dist.barrier()  # line: epoch barrier


def test_a_rank_whose_error_an_except_swallowed_is_said_to_have_returned_early_not_the_others_to_come_round(
        leftovers):
    # rank 0's metric raised ValueError in the try and its except returned: it went on to the epoch's
    # barrier. The others were told to have come round the epoch loop without that barrier (o3 of a
    # blind batch)
    found = doctor.run_function(_a_metric_whose_error_is_caught_on_one_rank, num_processes=2, stall_s=2.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert (f"Rank 0 has returned early from the call at {HERE}:{_line('evaluate')} that rank 1 is still in, "
            f"at {HERE}:{_line('metric reduce')} (their all_reduce): the 'except ValueError:' at "
            f"{HERE}:{_line('swallowing except')} swallows what it catches") in found.summary, found.summary
    assert "come round" not in found.summary
    assert found.fix.startswith("Keep collectives out of a try whose except swallows errors"), found.fix
    leftovers.check()


class _Metrics:
    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.records = []

    def log(self, record):
        with self._lock:  # line: lock taken
            self.records.append(record)
            if len(self.records) >= 2:
                self.flush()  # line: flush under the lock

    def flush(self):
        with self._lock:  # line: lock again
            self.records.clear()


def _a_rank_that_takes_its_own_lock_again():
    import torch
    import torch.distributed as dist

    metrics = _Metrics()
    for step in range(3):
        dist.all_reduce(torch.ones(2))
        if dist.get_rank() == 0:
            metrics.log({"step": step})


def test_a_rank_that_takes_a_lock_it_holds_is_told_which_caller_holds_it(leftovers):
    # log() flushes while it holds the lock that flush() takes: rank 0 waits for itself (o5 of a
    # blind batch was told only that it waits to acquire a lock)
    found = doctor.run_function(_a_rank_that_takes_its_own_lock_again, num_processes=2, stall_s=2.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [0]), found.text()
    assert (f"rank 0 is waiting to acquire a lock at {HERE}:{_line('lock again')} (its own thread holds that "
            f"lock: log took self._lock at {HERE}:{_line('lock taken')} and, holding it, called at "
            f"{HERE}:{_line('flush under the lock')} what takes it again at {HERE}:{_line('lock again')})"
            ) in found.summary, found.summary
    assert found.fix.startswith("A threading.Lock is not reentrant"), found.fix
    leftovers.check()


def _padded(length):
    import torch

    out = torch.zeros(4)
    out[:length] = torch.ones(length)  # line: thread raises
    return out


def _prefetch(items, lengths):
    for length in lengths:
        items.put(_padded(length))
    items.put(None)


def _a_rank_whose_prefetching_thread_died():
    import queue
    import threading

    import torch.distributed as dist

    lengths = [2, 3, 6] if dist.get_rank() == 1 else [2, 3, 4]  # rank 1's last is longer than the pad
    items = queue.Queue()
    threading.Thread(target=_prefetch, args=(items, lengths), name="prefetch", daemon=True).start()
    while (batch := items.get()) is not None:  # line: prefetched get
        dist.all_reduce(batch)


def test_a_rank_waiting_on_a_queue_whose_thread_died_is_told_the_threads_error(leftovers):
    # the thread that fills the queue raised: rank 1 waits on it for good (o8 of a blind batch was
    # told only that it waits on a queue)
    found = doctor.run_function(_a_rank_whose_prefetching_thread_died, num_processes=2, stall_s=2.0,
                                timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.text()
    assert (f"rank 1 is waiting on a queue at {HERE}:{_line('prefetched get')} (its thread 'prefetch' ended "
            "with RuntimeError: ") in found.summary, found.summary
    assert f"at {HERE}:{_line('thread raises')} in _padded)" in found.summary, found.summary
    assert found.fix.startswith("A thread of the rank's own ended with an error"), found.fix
    leftovers.check()


def _a_rank_polling_for_a_file_another_node_wrote(folder):
    import os
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    ready = os.path.join(folder, f"node{rank}", "best.ready")  # each rank's own working folder, as a node's
    os.makedirs(os.path.dirname(ready), exist_ok=True)
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        open(ready, "w").close()
    else:
        while not os.path.exists(ready):  # line: file poll
            time.sleep(0.05)
    dist.all_reduce(torch.ones(2))


def test_a_rank_polling_for_a_file_written_on_another_node_is_told_why_it_never_appears(tmp_path, leftovers):
    # q1 of a blind batch: rank 0 wrote a flag into its node's working folder; the other node's ranks
    # poll for it in theirs, told only that they sleep in a loop
    found = doctor.run_function(_a_rank_polling_for_a_file_another_node_wrote,
                                kwargs={"folder": str(tmp_path)}, num_processes=2, stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("rank-missing", [1]), found.text()
    assert (f"rank 1 is sleeping at {HERE}:{_line('file poll') + 1} in a loop at {HERE}:{_line('file poll')} "
            "that waits for a file to appear (while not os.path.exists(ready)).") in found.summary, \
        found.summary
    assert found.fix.startswith("A test of a file's presence reads the node's own filesystem"), found.fix
    leftovers.check()


def _gather_keys(keys):
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(keys) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, keys)  # line: gather keys
    return torch.cat(gathered)


def _negatives_from_every_rank_on_a_random_fraction_of_steps():
    import random

    import torch
    import torch.distributed as dist

    draws = random.Random(1000 + dist.get_rank())  # seeded per rank: each rank draws its own
    for _step in range(3):
        keys = torch.ones(4)
        use_global = draws.random() < 0.3
        if use_global:  # line: random branch
            keys = _gather_keys(keys)
        dist.all_reduce(keys.sum().reshape(1))


def test_a_helpers_collective_called_under_a_random_draw_of_the_ranks_own_names_that_draw(leftovers):
    # q8 of a blind batch: the all_gather is in a helper, the draw around its caller; the story was
    # only that the rank took a different path
    found = doctor.run_function(_negatives_from_every_rank_on_a_random_fraction_of_steps, num_processes=3,
                                stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("collective-mismatch", [1]), found.text()
    assert (f"(its call is under 'if use_global:' at {HERE}:{_line('random branch')}, a condition each rank "
            "decides for itself)") in found.summary, found.summary
    assert found.fix.startswith("Decide a condition around a collective alike on every rank"), found.fix
    leftovers.check()


def _metrics_logged_through_a_handler_that_gathers():
    import logging

    import torch
    import torch.distributed as dist

    class GatheringHandler(logging.Handler):
        def emit(self, record):
            values = [torch.zeros(1) for _ in range(dist.get_world_size())]
            dist.all_gather(values, torch.ones(1))  # line: handler gather

    logger = logging.getLogger("metrics-of-the-test")
    logger.setLevel(logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    logger.addHandler(GatheringHandler())
    for step in range(3):
        dist.all_reduce(torch.ones(2))
        logger.info("step %d", step)  # line: log step


def test_a_collective_in_a_logging_handler_is_named_on_the_ranks_whose_logger_passed_the_record(leftovers):
    # q5 of a blind batch: the ranks whose logger let the record through gathered in the handler; the
    # others, whose level was higher, went on. The others were named, told to have come round the loop
    found = doctor.run_function(_metrics_logged_through_a_handler_that_gathers, num_processes=2,
                                stall_s=2.0, timeout_s=60)
    assert (found.kind, found.ranks) == ("collective-mismatch", [0]), found.text()
    assert (f"The all_gather of rank 0 at {HERE}:{_line('handler gather')} runs in a logging handler, for "
            f"the record logged at {HERE}:{_line('log step')}: logging called that handler on rank 0 alone"
            ) in found.summary, found.summary
    assert found.fix.startswith("Keep collectives out of logging handlers"), found.fix
    leftovers.check()
