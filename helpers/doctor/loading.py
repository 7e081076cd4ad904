"""A rank that is importing a module is loading code, not waiting for the others: a stall judged
while one is, is looked at again.

Python imports lazily, and torch does so after init_process_group: the first optimizer's
``add_param_group`` (wrapped by ``torch._disable_dynamo``, torch/_compile.py) imports torch._dynamo,
1.3 s on this machine idle and over 4 s beside other jobs on its 2 cores; from a shared file system
read by many nodes at once it takes minutes. The ranks that got past it first wait meanwhile in
their first collective, and at a short ``stall_s`` the late one read as a rank that never came.

So a stall is looked at again ``stall_s`` later when a live rank outside any collective has
importlib's frames on its main thread's stack and that stack is one the doctor has not seen on it
before (the import moves on), ``IMPORT_LOOKS`` times at most per rank. An import that does not move
(a deadlock on the import lock, a module that waits on a network as it is imported, a loop at a
module's top level: its stacks come round again) is diagnosed as any stall, one look later. In a job,
a rank whose doctor has not reported at all is still importing torch or the script's modules (or
never started): it is looked at again as well, ``IMPORT_LOOKS`` times at most, as nothing of it can
show that it moves.

A stall whose evidence, once gathered, shows no rank in a collective any more (``stall_ended``) ended
as it was looked at: the collective that started it completed (a slow ``init_process_group`` while
the ranks start, beside other jobs), and nothing is named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers.doctor.diagnosis import Diagnosis
from helpers.doctor.wording import ranks_text

IMPORT_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
IMPORT_LOOKS = 10  # looks again per rank, at most: an import whose stacks never repeat is named too
NOTES_KEPT = 5  # notes of looks again listed in full in a diagnosis; later ones are counted


def stall_ended(diagnosis: Diagnosis) -> bool:
    """Did the stall end while its evidence was gathered? No rank waits in a collective any more, and
    none ended: no known pattern, every rank outside any collective."""
    return diagnosis.kind == "unknown" and bool(diagnosis.per_rank) and \
        all(entry.state == "outside-collective" for entry in diagnosis.per_rank)


def stall_ended_note(since_s: float | None) -> str:
    """The note a diagnosis made later keeps of a stall that ended as it was looked at."""
    return (f"progress stopped for {since_s or 0.0:.1f} s while a rank waited in a collective, which "
            "then completed while the ranks' stacks were gathered: no rank was waiting any more, nothing "
            "was named")


class LookNotes:
    """The notes of a run's looks again before its diagnosis: the first ``NOTES_KEPT`` in full, then
    how many more and the last (a long job whose slow collectives completed as they were looked at
    would otherwise list every one)."""

    def __init__(self) -> None:
        self.first: list[str] = []
        self.more = 0
        self.last = ""

    def add(self, note: str | None) -> None:
        """Keep ``note`` (None: nothing to keep)."""
        if not note:
            return
        if len(self.first) < NOTES_KEPT:
            self.first.append(note)
        else:
            self.more, self.last = self.more + 1, note

    def lines(self) -> list[str]:
        """The notes for the diagnosis."""
        if not self.more:
            return list(self.first)
        return [*self.first, f"{self.more} more look{'s' if self.more > 1 else ''} like these after them; "
                             f"the last: {self.last}"]


def importing(stack: list[dict[str, Any]]) -> bool:
    """Is this stack (outermost first) inside an import?"""
    return any(frame.get("file") in IMPORT_FILES for frame in stack)


def imported_where(stack: list[dict[str, Any]]) -> str:
    """'train.py:18, loading lazy_module.py:20': the line whose import runs, and the line of the
    innermost module being loaded (the frame importlib runs last)."""
    first = next(i for i, frame in enumerate(stack) if frame.get("file") in IMPORT_FILES)
    last = max(i for i, frame in enumerate(stack) if frame.get("file") in IMPORT_FILES)
    where = _where(stack[first - 1]) if first > 0 else "the rank's start"
    return f"{where}, loading {_where(stack[last + 1])}" if last + 1 < len(stack) else where


def _where(frame: dict[str, Any]) -> str:
    return f"{Path(str(frame.get('file'))).name}:{frame.get('line')}"


class ImportWatch:
    """The stacks seen on each rank while it was importing, and how many looks again it had."""

    def __init__(self) -> None:
        self.seen: dict[int, set[tuple]] = {}
        self.looks: dict[int, int] = {}

    def look(self, diagnosis: Diagnosis, stacks: dict[int, list[dict[str, Any]]], stall_s: float,
             unheard: frozenset[int] = frozenset()) -> tuple[bool, str | None]:
        """Whether to look at the stall again ``stall_s`` later (a rank outside any collective in
        ``diagnosis`` is importing, its stack new: the import has moved on since the earlier
        looks; or a culprit is among the ``unheard``, a job's ranks not heard from yet), and a note
        for the diagnosis (None: no rank was importing or unheard)."""
        starting = self._starting(diagnosis, unheard, stall_s)
        if starting is not None:
            return starting
        moving, still, capped = [], [], []
        for entry in diagnosis.per_rank:
            stack = stacks.get(entry.rank) or []
            if entry.state != "outside-collective" or not importing(stack):
                self.seen.pop(entry.rank, None)  # its import ended: a later one starts afresh
                self.looks.pop(entry.rank, None)
                continue
            if entry.rank not in diagnosis.ranks:  # the diagnosis does not hinge on it
                continue
            key = tuple((frame.get("file"), frame.get("line")) for frame in stack)
            seen = self.seen.setdefault(entry.rank, set())
            if key in seen:
                still.append(entry.rank)
            elif self.looks.get(entry.rank, 0) >= IMPORT_LOOKS:
                capped.append(entry.rank)
            else:
                moving.append(entry.rank)
                self.looks[entry.rank] = self.looks.get(entry.rank, 0) + 1
            seen.add(key)
        if moving:
            return True, (f"no progress for {diagnosis.detected_after_s or 0.0:.1f} s while "
                          f"{_ranks_at(moving, stacks)} importing a module: loading code, not waiting for "
                          f"another rank, so the doctor looked again {stall_s:g} s later (at most "
                          f"{IMPORT_LOOKS} times a rank, while its import moves on)")
        if still:
            return False, (f"{_ranks_at(still, stacks)} importing a module, and its import had not moved "
                           "since the doctor's last look: an import that waits (for the import lock another "
                           "thread holds, a file, the network, another rank) or a loop at a module's top "
                           "level")
        if capped:
            return False, (f"{_ranks_at(capped, stacks)} importing a module, still moving after the "
                           f"doctor had looked again {IMPORT_LOOKS} times: named now")
        return False, None

    def _starting(self, diagnosis: Diagnosis, unheard: frozenset[int],
                  stall_s: float) -> tuple[bool, str] | None:
        """The look again for culprits not heard from yet; None when there is none."""
        culprits = [rank for rank in diagnosis.ranks if rank in unheard]
        if not culprits:
            return None
        who = ranks_text(culprits)
        if all(self.looks.get(rank, 0) >= IMPORT_LOOKS for rank in culprits):
            return False, (f"{who} had still not reported after the doctor had looked again {IMPORT_LOOKS} "
                           "times: named now")
        for rank in culprits:
            self.looks[rank] = self.looks.get(rank, 0) + 1
        since = diagnosis.detected_after_s or 0.0
        return True, (f"no progress for {since:.1f} s while {who.lower()} had not reported yet"
                      " (still starting: importing torch and the script's modules), so "
                      f"the doctor looked again {stall_s:g} s later (at most {IMPORT_LOOKS} times a rank)")


def _ranks_at(ranks: list[int], stacks: dict[int, list[dict[str, Any]]]) -> str:
    """'rank 1 (at train.py:18, loading lazy.py:20) was'."""
    listed = "; ".join(f"rank {rank} (at {imported_where(stacks[rank])})" for rank in ranks)
    return f"{listed} {'was' if len(ranks) == 1 else 'were'}"
