"""The job's blackboard: what the doctor's watchdogs tell each other through the job's c10d store.

torchrun's agent (also under ``accelerate launch`` and ``srun ... torchrun``) hosts a TCPStore at
MASTER_ADDR:MASTER_PORT that outlives the ranks; the ranks' process group uses it too. The doctor
keeps its keys under ``helpers-doctor/<run id>/<restart>/`` so they never meet torch's::

    roster          "0,1,3,": the ranks whose watchdog started (appended); roster_n: how many
    hb/<rank>       a rank's heartbeat (JSON): a counter, host and pid, where it is, how long it has
                    waited, its open collectives' records, and how it ended
    call/<rank>     the record of the rank's latest first call from a line with a tensor of a new size,
                    posted before it runs (gloo aborts a process at once when the ranks' sizes
                    differ, before its next heartbeat); "null" until then
    claim           the rank that is diagnosing now
    req             the leader's request counter; state/<rank>/<n>: a rank's answer to request n
    verdict         the diagnosis (JSON), once made, and the stop: every rank ends with that exit
                    code, once all that still tick know it
    stopped         how many ranks know the stop

No sockets, servers or files of the doctor's own between nodes. Every call is bounded (the store's
timeout) and only keys known to exist are read, so no call waits for a key that never comes.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PREFIX = "helpers-doctor"
STORE_TIMEOUT_S = 5.0  # any one store call
SILENT_S = 3.0  # a heartbeat unchanged this long: that rank's Python does not answer (or it died)


@dataclass
class Seen:
    """One rank's heartbeat as this rank last read it, and when (this machine's clock) it changed."""

    beat: dict[str, Any]
    changed: float = field(default_factory=time.monotonic)

    def age(self) -> float:
        """Seconds since the heartbeat last changed, on this machine's clock (no clock is shared)."""
        return time.monotonic() - self.changed

    @property
    def gone(self) -> bool:
        """The rank said it is leaving (its last heartbeat)."""
        return bool(self.beat.get("gone"))

    def fresh(self) -> bool:
        """Its watchdog still ticks: it can lead, answer and act on a stop."""
        return not self.gone and self.age() < SILENT_S


class Board:
    """The doctor's keys in the job's store, for one rank."""

    def __init__(self, store: Any, rank: int):
        self.store, self.rank = store, rank
        self.seen: dict[int, Seen] = {}
        self._roster: list[int] = []

    @classmethod
    def connect(cls, host: str, port: int, run_id: str, restart: str, rank: int,
                timeout_s: float = STORE_TIMEOUT_S) -> Board:
        """A client of the job's store under the doctor's prefix (raises when it cannot connect)."""
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.PrefixStore(f"{PREFIX}/{run_id}/{restart}/", store), rank)

    # -- heartbeats -------------------------------------------------------------------------

    def join(self, heartbeat: dict[str, Any], software: dict[str, str] | None = None) -> None:
        """Post the first heartbeat and what this rank runs (``software.rank_software``), then put this
        rank on the roster (so every rank on the roster has a heartbeat to read)."""
        self.beat(heartbeat)
        self.store.set(f"software/{self.rank}", json.dumps(software or {}))
        self.store.set(f"call/{self.rank}", "null")
        self.store.append("roster", f"{self.rank},")
        self.store.add("roster_n", 1)

    def roster(self) -> list[int]:
        """The ranks whose watchdog started, sorted (read again only when their count changed)."""
        if int(self.store.add("roster_n", 0)) != len(self._roster):
            text = self.store.get("roster").decode()
            self._roster = sorted({int(part) for part in text.split(",") if part})
        return self._roster

    def beat(self, heartbeat: dict[str, Any]) -> None:
        """Post this rank's heartbeat."""
        self.store.set(f"hb/{self.rank}", json.dumps(heartbeat, separators=(",", ":"), default=str))

    def post_call(self, record_text: str) -> None:
        """Post the record (JSON text) of a call about to run for the first time with its size."""
        self.store.set(f"call/{self.rank}", record_text)

    def first_calls(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """The latest first-call record of each of ``ranks`` (on the roster) that posted one."""
        found = self._read_json({rank: f"call/{rank}" for rank in ranks})
        return {rank: record for rank, record in found.items() if isinstance(record, dict)}

    def software(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """What each of ``ranks`` (on the roster) posted that it runs, as it joined."""
        keys = {rank: f"software/{rank}" for rank in ranks}
        if keys and not self.store.check(list(keys.values())):  # a rank that posted none (an older
            keys = {rank: key for rank, key in keys.items() if self.store.check([key])}  # doctor): no wait
        found = self._read_json(keys)
        return {rank: posted for rank, posted in found.items() if isinstance(posted, dict)}

    def _read_json(self, keys: dict[int, str]) -> dict[int, Any]:
        """The JSON value of each rank's key (all present: a missing key waits out the store's
        timeout), in one call; a value that is no JSON is left out."""
        if not keys:
            return {}
        found = {}
        for rank, value in zip(keys, self.store.multi_get(list(keys.values())), strict=True):
            try:
                found[rank] = json.loads(value)
            except ValueError:
                continue
        return found

    def read_beats(self, ranks: list[int]) -> dict[int, Seen]:
        """Read the heartbeats of ``ranks`` (on the roster); note which changed since last read."""
        if not ranks:
            return {}
        values = self.store.multi_get([f"hb/{rank}" for rank in ranks])
        for rank, value in zip(ranks, values, strict=True):
            try:
                beat = json.loads(value)
            except ValueError:
                continue
            known = self.seen.get(rank)
            if known is None or known.beat.get("n") != beat.get("n"):
                self.seen[rank] = Seen(beat)
            else:
                known.beat = beat
        return {rank: self.seen[rank] for rank in ranks if rank in self.seen}

    def leader(self, roster: list[int], dead: Callable[[Seen], bool] = lambda seen: False) -> int:
        """The lowest rank whose watchdog still ticks (read from the lowest up, a few at a time).

        This rank counts itself as ticking; ``dead`` says a rank is known gone (its process no
        longer exists). Ranks below it are read, 8 at a time, until one is fresh, so a rank that does
        not lead reads a few heartbeats a tick, however large the job.
        """
        below = [rank for rank in roster if rank < self.rank]
        for start in range(0, len(below), 8):
            batch = self.read_beats(below[start:start + 8])
            for rank in below[start:start + 8]:
                if rank in batch and batch[rank].fresh() and not dead(batch[rank]):
                    return rank
        return self.rank

    # -- requests and answers -----------------------------------------------------------------

    def request(self) -> int:
        """The latest request number (0: none yet)."""
        return int(self.store.add("req", 0))

    def new_request(self) -> int:
        """Ask every rank for its state; returns the request number."""
        return int(self.store.add("req", 1))

    def answer(self, number: int, state: dict[str, Any]) -> None:
        """Post this rank's state for request ``number``."""
        self.store.set(f"state/{self.rank}/{number}", json.dumps(state, separators=(",", ":"), default=str))

    def answers(self, number: int, ranks: list[int], wait_s: float,
                meanwhile: Callable[[], None] = lambda: None) -> dict[int, dict[str, Any]]:
        """The states posted for request ``number`` by ``ranks``, waiting up to ``wait_s``;
        ``meanwhile`` runs about every quarter second (the waiting rank's own heartbeat)."""
        keys = {rank: f"state/{rank}/{number}" for rank in ranks}
        end = time.monotonic() + wait_s
        present: list[int] = []
        next_beat = time.monotonic() + 0.25
        while True:
            present = [rank for rank in ranks if rank in present or self.store.check([keys[rank]])]
            if len(present) == len(ranks) or time.monotonic() >= end:
                break
            if time.monotonic() >= next_beat:
                meanwhile()
                next_beat = time.monotonic() + 0.25
            time.sleep(0.05)  # polling the store: a bounded wait for other processes
        return self._read_json({rank: keys[rank] for rank in present})

    # -- the verdict and the stop ---------------------------------------------------------------

    def claim(self) -> bool:
        """Become the rank that diagnoses, unless a rank that still ticks already is."""
        mine = str(self.rank).encode()
        held = self.store.compare_set("claim", "", mine)
        if held == mine:
            return True
        holder = int(held.decode())
        seen = self.seen.get(holder)
        if seen is not None and not seen.fresh():  # it stopped ticking while diagnosing: take over
            return self.store.compare_set("claim", held, mine) == mine
        return False

    def verdict(self) -> tuple[dict[str, Any], tuple[int, int] | None] | None:
        """The diagnosis some rank posted, and its stop: (exit code, how many ranks will end), or
        None when the job is left running; None before any verdict."""
        if not self.store.check(["verdict"]):
            return None
        posted = json.loads(self.store.get("verdict"))
        stop = posted.get("stop")
        return posted["diagnosis"], (tuple(stop) if stop else None)

    def post_verdict(self, data: dict[str, Any], stop: tuple[int, int] | None
                     ) -> tuple[dict[str, Any], tuple[int, int] | None]:
        """Tell every rank the diagnosis and, with one key so that no rank sees one without the
        other, the stop: every rank ends with that exit code. The first verdict posted wins: returns
        the one that stands (``data`` itself when it is this rank's) and its stop."""
        mine = json.dumps({"diagnosis": data, "stop": stop}, default=str).encode()
        held = self.store.compare_set("verdict", "", mine)
        if held == mine:
            return data, stop
        posted = json.loads(held)
        return posted["diagnosis"], (tuple(posted["stop"]) if posted.get("stop") else None)

    def stopping(self, expected: int, wait_s: float) -> bool:
        """Count this rank as ending on the stop, and wait (at most ``wait_s``) until the ``expected``
        ranks have: nobody leaves before every rank knows, since the first rank to leave makes its
        agent stop the others, and the agent that hosts the store takes it along. False: some
        rank never counted itself (its Python does not run)."""
        end = time.monotonic() + wait_s
        count = int(self.store.add("stopped", 1))
        while count < expected and time.monotonic() < end:
            time.sleep(0.02)  # polling the store: a bounded wait for other processes
            count = int(self.store.add("stopped", 0))
        return count >= expected
