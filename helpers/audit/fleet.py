"""The fleet audit: every node's facts gathered on rank 0 with torch.distributed.

Runs under torchrun / accelerate launch (``python -m helpers.audit --fleet --json PATH``): each
node's local rank 0 collects its facts, rank 0 gathers them over gloo (no GPU needed) and writes
one report with the differences across nodes, so a cluster is compared in one run instead of
node by node.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import params, report
from helpers.audit import render
from helpers.audit.diff import DiffResult, Machine, diff_machines
from helpers.audit.facts import collect_facts, utc_now
from helpers.audit.rules import evaluate
from helpers.cli import EXIT_OK, EXIT_PROBLEM


@dataclass
class FleetReport(report.ResultMixin):
    """Every node's facts and findings, and the differences across nodes."""

    nodes: list[dict[str, Any]]
    diff: DiffResult
    schema: int = 1
    collected_at: str = field(default_factory=lambda: utc_now())

    def _repr_html_(self) -> str:
        return f"<p>{len(self.nodes)} node(s)</p>" + render.diff_html(self.diff)

    def html(self) -> str:
        """The self-contained HTML page."""
        return render.fleet_document(self)


def run_fleet(json_path: str | Path, html_path: str | Path | None = None, anonymize: bool = False,
              strict: bool = False, timeout_s: float = 300.0) -> int:
    """Under torchrun / accelerate launch: each node's local rank 0 collects facts, rank 0
    gathers them, writes one fleet report with differences across nodes, and returns the exit
    code (1 with ``strict`` when nodes differ or have error findings)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        payload = _node_payload(anonymize) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        code = EXIT_OK
        if rank == 0:
            fleet = build_fleet([p for p in gathered or [] if p is not None])
            code = _write_fleet(fleet, json_path, html_path, strict)
        codes = [code]
        dist.broadcast_object_list(codes, src=0)
        return int(codes[0])
    finally:
        dist.destroy_process_group()


def _write_fleet(fleet: FleetReport, json_path: str | Path, html_path: str | Path | None,
                 strict: bool) -> int:
    """Rank 0's part: the files, then the exit code."""
    fleet.to_json(params.resolve_path(json_path))
    if html_path:
        report.atomic_write_text(params.resolve_path(html_path), fleet.html())
    problems = not fleet.diff.identical or any(
        f["severity"] == "error" for node in fleet.nodes for f in node["findings"])
    return EXIT_PROBLEM if strict and problems else EXIT_OK


def _node_payload(anonymize: bool) -> dict[str, Any]:
    facts = collect_facts(anonymize=anonymize)
    node = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or os.environ.get("RANK", "0")
    return {"node": int(node), "facts": dict(facts),
            "findings": [report.to_jsonable(f) for f in evaluate(facts)]}


def build_fleet(payloads: list[dict[str, Any]]) -> FleetReport:
    """The fleet report from each node's payload (``node``, ``facts``, ``findings``)."""
    payloads = sorted(payloads, key=lambda p: p["node"])
    nodes = []
    for payload in payloads:
        host = payload["facts"].get("hostname")
        label = f"node{payload['node']}" + (f" ({host})" if host and host != "<host>" else "")
        nodes.append({"label": label, "node": payload["node"], "facts": payload["facts"],
                      "findings": payload["findings"]})
    diff = diff_machines([Machine(n["label"], n["facts"], n["findings"]) for n in nodes])
    return FleetReport(nodes, diff)
