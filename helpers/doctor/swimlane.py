"""The doctor's swimlane plot: one lane per rank, collectives as boxes over time, divergence marked.

``swimlane(diagnosis)`` returns a matplotlib ``Figure`` made with pyplot and closed at once, so a
kernel displays it as an image (pyplot loads the inline backend) and no pyplot state is left.
Boxes are the Python-level calls the tracer saw (start to end; still open at the diagnosis: drawn
to the right edge, hatched); collectives issued from C++ (DDP) appear as ticks at the time the
Flight Recorder created them. Culprit lanes are red, the stall's start is a dashed line.
"""

from __future__ import annotations

import time
from typing import Any

from helpers.collectives import INIT_OP

MAX_BOXES = 40  # the latest calls per rank that get a box


def swimlane(diagnosis: Any, title: str | None = None):
    """A Figure of the ranks' collectives over time, for a ``helpers.doctor.Diagnosis``."""
    import matplotlib.pyplot as plt

    evidence = diagnosis.evidence
    views, histories = evidence.views, evidence.histories
    ranks = [entry.rank for entry in diagnosis.per_rank]
    origin, end = _time_range(evidence, views, histories)
    figure = plt.figure(figsize=(10, 1.0 + 0.7 * max(1, len(ranks))), layout="constrained")
    plt.close(figure)
    ax = figure.add_subplot()
    for lane, rank in enumerate(ranks):
        culprit = rank in diagnosis.ranks
        ax.axhspan(lane - 0.45, lane + 0.45, color="#fdecea" if culprit else "#f5f5f5", zorder=0)
        _draw_calls(ax, lane, views.get(rank), origin, end, culprit)
        _draw_cpp_ticks(ax, lane, histories.get(rank) or {}, origin)
        _draw_end(ax, lane, diagnosis.per_rank[lane], views.get(rank), origin, end)
    stall = evidence.stall_start
    if stall:
        ax.axvline(stall - origin, color="#c62828", linestyle="--", linewidth=1)
        ax.text(stall - origin, len(ranks) - 0.4, " progress stopped", color="#c62828", fontsize=8)
    labels = [f"rank {r}{' (culprit)' if r in diagnosis.ranks else ''}" for r in ranks]
    ax.set_yticks(range(len(ranks)), labels)
    ax.set_ylim(-0.6, len(ranks) - 0.3)
    ax.invert_yaxis()
    ax.set_xlim(0, max(end - origin, 1e-3) * 1.02)
    ax.set_xlabel("seconds since the first traced call")
    ax.set_title(title or f"{diagnosis.verdict}: {diagnosis.kind}", fontsize=10)
    return figure


def _time_range(evidence: Any, views: dict, histories: dict) -> tuple[float, float]:
    """From the first traced call (start-up is not the story) to when the doctor stopped the run.

    The wait itself must show: the axis ends at the diagnosis, not where progress stopped.
    """
    starts = [op.start for v in views.values() for op in _shown(v) if op.start]
    starts += [op.start for h in histories.values() for op in h.values() if op.start]
    ends = [op.end for v in views.values() for op in _shown(v) if op.end]
    ends += [v.exit["t"] for v in views.values() if getattr(v, "exit", None)]
    origin = min(starts, default=evidence.started or time.time())
    end = evidence.detected_at or max(ends + starts, default=origin + 1)
    return origin, max(end, max(ends + starts, default=end))


def _shown(view: Any) -> list:
    """The calls a lane shows: init_process_group only while ranks wait in it (or it failed), as
    start-up is not the story unless the hang is there."""
    return [op for op in view.python_ops() if op.op != INIT_OP or op.end is None or op.ok is False]


def _draw_calls(ax: Any, lane: int, view: Any, origin: float, end: float, culprit: bool) -> None:
    if view is None:
        return
    for op in _shown(view)[-MAX_BOXES:]:
        if op.start is None:
            continue
        finish = op.end if op.end is not None else end
        open_ = op.end is None
        failed = op.ok is False
        colour = "#e57373" if (open_ and culprit) or failed else "#ffb74d" if open_ else "#64b5f6"
        ax.barh(lane, max(finish - op.start, (end - origin) * 0.004), left=op.start - origin, height=0.5,
                color=colour, edgecolor="#333333", linewidth=0.5, hatch="//" if open_ else None, zorder=2)
        if open_ or failed:
            label = op.op + (f" @ {op.where}" if op.where else "")
            ax.text(op.start - origin, lane - 0.3, label, fontsize=7, va="bottom", zorder=3)


def _draw_cpp_ticks(ax: Any, lane: int, history: dict, origin: float) -> None:
    ticks = [op for op in history.values()
             if op.source == "flight-recorder" and op.where is None and op.start]
    for op in ticks[-MAX_BOXES:]:
        ax.plot([op.start - origin] * 2, [lane - 0.25, lane + 0.25], color="#6a1b9a", linewidth=1, zorder=3)
    if ticks:
        last = ticks[-1]
        ax.text(last.start - origin, lane + 0.42, f"{last.op.split(':')[-1]} (C++)", fontsize=7,
                color="#6a1b9a", zorder=3)


def _draw_end(ax: Any, lane: int, entry: Any, view: Any, origin: float, end: float) -> None:
    if entry.state not in ("exited", "finished"):
        if entry.state == "outside-collective" and entry.location:
            ax.text(end - origin, lane, f"{entry.location} ", fontsize=7, ha="right", va="center", zorder=3)
        return
    when = (getattr(view, "exit", None) or {}).get("t") or end
    marker, colour = ("o", "#2e7d32") if entry.state == "finished" else ("X", "#c62828")
    ax.plot([when - origin], [lane], marker=marker, color=colour, markersize=9, zorder=4)
