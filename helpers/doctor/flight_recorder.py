"""Post-mortem from torch's Flight Recorder dumps: the doctor's diagnosis in plain words.

A dump is what ``torch._C._distributed_c10d._dump_fr_trace()`` returns (a pickle), or what NCCL
writes at a timeout with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and ``TORCH_FR_DUMP_TEMP_FILE=<prefix>``
(one file per rank, ``<prefix><rank>``). Each holds the rank's latest collectives: torch's sequence
number, the op (``gloo:all_reduce``), input sizes and dtypes, whether it finished (``retired``) and,
in the pickle, the Python frames that issued it. Dumps carry no rank: it is the file name's last
number.

torch's own analyzer (``torchfrtrace``) fails on gloo dumps with ``KeyError: ('0', 0)`` (gloo's
``pg_config`` is keyed by an empty name); this reader keys groups by the entries' own
``process_group`` and works on both. The first sequence number that some ranks issued and others
did not is the hang; the first at which ranks issued different ops or shapes is a mismatch.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

from helpers.doctor.diagnosis import Diagnosis, diagnose
from helpers.doctor.records import Op, RankView, fr_op
from helpers.sites import is_user_code

FR_NOTE = ("Read from Flight Recorder dumps: each rank's recorded collectives (sequence numbers, ops, "
           "sizes, dtypes, where they were issued); where a rank that never issued a collective is "
           "now is not in a dump.")


def read_dumps(folder: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's dump in ``folder`` by rank; a ValueError naming ``from_fr`` and the bad file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"from_fr must be a folder of Flight Recorder dumps; {folder} "
                         f"{'is a file' if folder.exists() else 'does not exist'}")
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        dump = _load(path)
        if dump is None:
            continue
        rank = _rank_of(path)
        if rank in dumps:
            raise ValueError(f"from_fr: two dumps for rank {rank} in {folder} (the rank is the last "
                             f"number of each file's name: {path.name})")
        dumps[rank] = dump
    if not dumps:
        raise ValueError(f"from_fr: {folder} holds no Flight Recorder dump (pickles with 'entries')")
    return dumps


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = pickle.loads(path.read_bytes())
    except Exception:  # noqa: BLE001 - not a pickle: another file in the folder
        return None
    return data if isinstance(data, dict) and isinstance(data.get("entries"), list) else None


def _rank_of(path: Path) -> int:
    numbers = re.findall(r"\d+", path.name.removesuffix(".pkl"))
    if not numbers:
        raise ValueError(f"from_fr: {path} has no rank number in its name (NCCL writes <prefix><rank>)")
    return int(numbers[-1])


def _site(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost user frame of an entry's frames (innermost first, as torch records them)."""
    for frame in frames or []:
        filename = frame.get("filename") or ""
        if is_user_code(filename):
            line = int(frame.get("line") or 0)
            return {"file": filename, "line": line, "where": f"{Path(filename).name}:{line}"}
    return None


def _entries(dump: dict[str, Any]) -> list[dict[str, Any]]:
    """The dump's collectives, trimmed to what the doctor reads, the user's line attached, and the
    thread that issued each where torch recorded it (``thread_id``: Python's ``threading.get_ident()``)
    with whether it is the main thread (its frames do not start in threading's ``_bootstrap``) and
    whether the dump shows it in flight (not retired)."""
    kept = []
    for entry in dump["entries"]:
        if entry.get("is_p2p"):
            continue
        group = entry.get("process_group") or ["0"]
        frames = entry.get("frames") or []
        item = {**{k: entry.get(k) for k in ("record_id", "collective_seq_id", "profiling_name",
                                              "input_sizes", "input_dtypes", "retired",
                                              "time_created_ns", "time_discovered_completed_ns",
                                              "is_p2p")},
                "pg": str(group[0]), "site": _site(frames), "in_flight": not entry.get("retired")}
        if entry.get("thread_id") is not None and frames:
            item["thread"] = str(entry["thread_id"])
            item["main"] = (frames[-1].get("name"), Path(frames[-1].get("filename") or "").name) != (
                "_bootstrap", "threading.py")
        kept.append(item)
    return kept


def views_from_dumps(dumps: dict[int, dict[str, Any]]) -> dict[int, RankView]:
    """One view per rank. A rank that issued a collective some other rank never issued waits in it."""
    entries = {rank: _entries(dump) for rank, dump in dumps.items()}
    last = {rank: {(e["pg"], e["collective_seq_id"]) for e in rank_entries}
            for rank, rank_entries in entries.items()}
    _retire_matched(entries)
    views = {}
    for rank, rank_entries in entries.items():
        view = RankView(rank)
        view.state = {"request": "flight-recorder", "fr": rank_entries, "stack": []}
        waiting = _first_unmatched(rank_entries, last, rank)
        if waiting is not None:
            op: Op = fr_op(waiting)
            view.open[1] = view.ops[1] = op
            view.order.append(1)
        views[rank] = view
    return views


def _retire_matched(entries: dict[int, list[dict[str, Any]]]) -> None:
    """An entry every other rank issued too (or went past) is over, whatever its ``retired`` says:
    gloo and NCCL mark completion asynchronously, so a dump taken just after an op may not show it."""
    highest = {rank: {} for rank in entries}
    for rank, rank_entries in entries.items():
        for entry in rank_entries:
            seqs = highest[rank]
            seqs[entry["pg"]] = max(seqs.get(entry["pg"], 0), entry["collective_seq_id"])
    for rank, rank_entries in entries.items():
        others = [seqs for other, seqs in highest.items() if other != rank]
        for entry in rank_entries:
            if others and all(seqs.get(entry["pg"], 0) >= entry["collective_seq_id"] for seqs in others):
                entry["retired"] = True


def _first_unmatched(entries: list[dict[str, Any]], issued: dict[int, set], rank: int) -> dict | None:
    """This rank's earliest collective that another rank never issued (None: all were matched)."""
    others = [keys for other, keys in issued.items() if other != rank]
    for entry in sorted(entries, key=lambda e: (e["pg"], e["collective_seq_id"])):
        key = (entry["pg"], entry["collective_seq_id"])
        if any(key not in keys and _within_window(key, keys) for keys in others):
            return entry
    return None


def _within_window(key: tuple[str, int], keys: set) -> bool:
    """Is ``key`` past what the other rank recorded (not merely older than its ring buffer)?"""
    seqs = [seq for pg, seq in keys if pg == key[0]]
    return not seqs or key[1] > min(seqs)


def diagnose_dumps(folder: str | Path, world_size: int | None = None) -> Diagnosis:
    """The doctor's diagnosis from a folder of Flight Recorder dumps (one per rank)."""
    dumps = read_dumps(folder)
    world = world_size or max(dumps) + 1
    diagnosis = diagnose(views_from_dumps(dumps), world, "timeout", None, unseen_missing=True)
    diagnosis.notes.append(FR_NOTE)
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        diagnosis.notes.append(f"No dump for ranks {missing}: they are shown as unseen.")
    return diagnosis
