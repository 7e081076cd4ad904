"""What each rank of a job runs: its script's content, Python, torch (CUDA, NCCL) and accelerate.

A multi-node job whose nodes run different code (a stale checkout, a node whose shared filesystem
cached an old copy) or different versions of torch hangs or fails in ways that look like a bug in
the script: the ranks issue different collectives, or the backends disagree. Each rank's watchdog
posts what it runs once, through the job's store (``Board.join``); the leader compares them when it
diagnoses and adds a note, and puts ``SOFTWARE_CURE`` first when the job did not end well.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import stat
import sys
from typing import Any

from helpers.doctor.wording import ranks_text

SOFTWARE_CURE = (
    "Run one copy of the code and one environment on every node: the ranks did not (see the note "
    "below). A script that differs between nodes issues different collectives; torch, NCCL or CUDA "
    "versions that differ can disagree on what a collective sends. Install from one lock file or "
    "image, check out one commit on shared storage, and compare the nodes with the audit: torchrun "
    "... -m helpers.audit --fleet, one report with the differences between nodes (notebook 01).")
_FIELDS = ("script", "python", "torch", "cuda", "nccl", "accelerate")  # in the note's order
_DECISIVE = ("script", "torch", "cuda", "nccl")  # a difference in these leads the fix of a failed job
HASH_CHARS = 12  # of a script's sha256, as the note shows it
HASH_MAX_BYTES = 64 << 20  # a larger script (a zipapp) is not hashed
NOT_INSTALLED = "not installed"


def rank_software(command: list[str]) -> dict[str, str]:
    """What this rank runs (strings; a field it cannot tell is left out): the sha256 of the script
    ``command`` runs (not of a ``-m`` module), Python's, torch's, CUDA's and NCCL's versions as torch
    reports them, accelerate's."""
    found = {"python": sys.version.split()[0]}
    digest = _script_digest(command[0]) if command and command[0] != "-m" else None
    if digest:
        found["script"] = digest
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = str(torch.__version__)
        if torch.version.cuda:
            found["cuda"] = str(torch.version.cuda)
        try:  # NCCL's own version call: no CUDA context (a script may still set CUDA_VISIBLE_DEVICES)
            version = torch.cuda.nccl.version()
            found["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - no NCCL in this build: nothing to compare
            pass
    try:
        found["accelerate"] = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        found["accelerate"] = NOT_INSTALLED
    return found


def _script_digest(path: str) -> str | None:
    """The first ``HASH_CHARS`` of a regular file's sha256, read in chunks; None for what is no
    regular file (a pipe), larger than ``HASH_MAX_BYTES`` or unreadable."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > HASH_MAX_BYTES:
                return None
            return hashlib.file_digest(handle, "sha256").hexdigest()[:HASH_CHARS]
    except OSError:
        return None


def differences(software: dict[int, dict[str, Any]]) -> list[str]:
    """The fields whose values differ between the ranks that posted them (``_FIELDS``' order)."""
    return [name for name in _FIELDS if len(_values(software, name)) > 1]


def decisive(fields: list[str], software: dict[int, dict[str, Any]]) -> bool:
    """Can ``fields`` (``differences``) make collectives disagree: the script, torch, CUDA, NCCL, or
    Python's minor version (a patch release cannot)?"""
    minors = {".".join(value.split(".")[:2]) for value in _values(software, "python")}
    return any(name in _DECISIVE for name in fields) or len(minors) > 1


def _values(software: dict[int, dict[str, Any]], name: str) -> dict[str, list[int]]:
    values: dict[str, list[int]] = {}
    for rank, posted in sorted(software.items()):
        if isinstance(posted, dict) and posted.get(name):
            values.setdefault(str(posted[name]), []).append(rank)
    return values


def differences_note(software: dict[int, dict[str, Any]], script: str = "the script") -> str | None:
    """'The ranks did not run the same software: torch 2.13.0 on ranks 0 and 1, 2.12.1 on ranks 2
    and 3; ...' for every field whose value differs between the ranks that posted one; None when
    they agree (or fewer than two ranks posted)."""
    parts = []
    for name in differences(software):
        label = f"{script}'s content (sha256)" if name == "script" else name
        sides = ", ".join(f"{value} on {ranks_text(ranks).lower()}"
                          for value, ranks in _values(software, name).items())
        parts.append(f"{label} {sides}")
    if not parts:
        return None
    return "The ranks did not run the same software: " + "; ".join(parts) + "."

