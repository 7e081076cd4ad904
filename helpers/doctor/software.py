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
import sys
from pathlib import Path
from typing import Any

from helpers.doctor.wording import ranks_text

SOFTWARE_CURE = (
    "Run one copy of the code and one environment on every node: the ranks above did not (see the "
    "note). A script that differs between nodes issues different collectives; torch, NCCL or CUDA "
    "versions that differ can disagree on what a collective sends. Install from one lock file or "
    "image, check out one commit on shared storage, and compare the nodes with the audit: torchrun "
    "... -m helpers.audit --fleet, one report with the differences between nodes (notebook 01).")
_FIELDS = ("script", "python", "torch", "cuda", "nccl", "accelerate")  # in the note's order
HASH_CHARS = 12  # of a script's sha256, as the note shows it


def rank_software(command: list[str]) -> dict[str, str]:
    """What this rank runs (strings; a field it cannot tell is left out): the sha256 of the script
    ``command`` runs (not of a ``-m`` module), Python's, torch's, CUDA's and NCCL's versions as torch
    reports them, accelerate's."""
    found = {"python": sys.version.split()[0]}
    if command and command[0] != "-m":
        try:
            found["script"] = hashlib.sha256(Path(command[0]).read_bytes()).hexdigest()[:HASH_CHARS]
        except OSError:
            pass
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
        pass
    return found


def differences_note(software: dict[int, dict[str, Any]], script: str = "the script") -> str | None:
    """'The ranks did not run the same software: torch 2.13.0 on ranks 0 and 1, 2.12.1 on ranks 2
    and 3; ...' for every field whose value differs between the ranks that posted one; None when
    they agree (or fewer than two ranks posted)."""
    parts = []
    for name in _FIELDS:
        values: dict[str, list[int]] = {}
        for rank, posted in sorted(software.items()):
            if isinstance(posted, dict) and posted.get(name):
                values.setdefault(str(posted[name]), []).append(rank)
        if len(values) > 1:
            label = f"{script}'s content (sha256)" if name == "script" else name
            sides = ", ".join(f"{value} on {ranks_text(ranks).lower()}" for value, ranks in values.items())
            parts.append(f"{label} {sides}")
    if not parts:
        return None
    return "The ranks did not run the same software: " + "; ".join(parts) + "."

