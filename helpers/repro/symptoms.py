"""Symptoms -> scenarios: what the user sees, mapped to the doctor's catalog (``helpers.scenarios``)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from helpers import params, report, scenarios


@dataclass(frozen=True)
class Symptom:
    """What a user sees, the catalog scenarios that reproduce it (most likely first), the cause."""

    name: str
    sees: str
    scenarios: tuple[str, ...]
    cause: str


SYMPTOMS: dict[str, Symptom] = {s.name: s for s in (
    Symptom("hangs-at-eval",
            "training steps run, then every rank stops at evaluation: no error, no progress, until "
            "the process-group timeout (10 min on NCCL, 30 min on gloo) ends the job",
            ("uneven-eval", "main-only-collective", "in-order-logging"),
            "ranks issue different collectives at eval: one rank has fewer batches (even_batches=False), "
            "or a metric is reduced or logged in order on the main process only"),
    Symptom("hangs-at-save",
            "the job stops when it saves a checkpoint or prepares files on the main process",
            ("main-only-collective", "one-branch-barrier"),
            "a collective (gather, reduce; get_state_dict under FSDP or DeepSpeed ZeRO-3) or "
            "wait_for_everyone() called inside `if accelerator.is_main_process`"),
    Symptom("hangs-after-early-stop",
            "one rank decides to stop (early stopping, a max-steps check on its own loss) and the "
            "others hang in their next step",
            ("early-stop",),
            "the ranks leave the loop at different steps; set_trigger()/check_trigger() makes them agree"),
    Symptom("shape-mismatch-error",
            "a gather crashes (SIGABRT, 'Received data size doesn't match expected size'), hangs, or "
            "returns wrong data silently",
            ("variable-gather",),
            "ranks pass tensors of different shapes to one collective; pad them first"),
    Symptom("nccl-timeout",
            "after the process-group timeout (10 min on NCCL by default) the job dies with a timeout "
            "error naming a collective",
            ("stuck-compute", "dead-rank"),
            "some rank never reached the collective the others wait in: stuck in compute or data "
            "loading, or dead"),
    Symptom("one-rank-crashes",
            "one rank dies (killed, out of memory) and the others fail with 'Connection reset by "
            "peer' or wait until the timeout",
            ("dead-rank",),
            "the dead rank's own cause (its exit code, dmesg for the out-of-memory killer)"),
)}


def get_symptom(symptom: str) -> Symptom:
    """The symptom named ``symptom`` (ValueError naming the accepted ones otherwise)."""
    params.check("symptom", symptom)
    return SYMPTOMS[symptom]


def scenario_ids() -> list[str]:
    """The catalog's scenario ids, in the catalog's order."""
    return [entry.id for entry in scenarios.SCENARIOS]


def get_scenario(scenario_id: str) -> Any:
    """The catalog scenario with this id (ValueError naming the known ids otherwise)."""
    if not isinstance(scenario_id, str):
        raise ValueError(f"scenario must be a scenario id (a string); got {scenario_id!r}")
    return scenarios.get(scenario_id)


@dataclass
class SymptomTable(report.ResultMixin):
    """The documented table: symptom -> what you see -> catalog scenarios -> the usual cause."""

    rows: list[dict[str, str]]
    selected: str = ""

    def _repr_html_(self) -> str:
        body = []
        for row in self.rows:
            style = ' style="background:#fff3cd"' if row["symptom"] == self.selected else ""
            cells = "".join(f"<td>{html.escape(row[c])}</td>" for c in self.columns())
            body.append(f"<tr{style}>{cells}</tr>")
        head = "".join(f"<th>{c}</th>" for c in self.columns())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"

    @staticmethod
    def columns() -> list[str]:
        """The table's columns."""
        return ["symptom", "what you see", "scenarios", "usual cause"]

    def text(self) -> str:
        """The table as plain text."""
        return report.text_table(self.rows, self.columns())


def symptom_table(selected: str = "") -> SymptomTable:
    """Every symptom, what it looks like, the scenarios that reproduce it; ``selected`` highlighted."""
    if selected:
        get_symptom(selected)
    rows = [{"symptom": s.name, "what you see": s.sees, "scenarios": ", ".join(s.scenarios),
             "usual cause": s.cause} for s in SYMPTOMS.values()]
    return SymptomTable(rows, selected)
