"""Validation of notebook and CLI parameters.

One name per parameter everywhere: the notebook variable ``num_processes`` is the CLI flag
``--num-processes``, the widget's label and the name in every error message. A bad value raises
one ``ValueError`` naming the parameter, the value given and what is accepted, before any
process starts.

Each module that owns parameters adds its entries to ``SPECS`` (one table for the whole suite).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# the notebooks, as remedy texts name them (relative to the repository root)
NB_AUDIT = "notebooks/01_environment_audit.ipynb"
NB_REPRO = "notebooks/02_minimal_repro_builder.ipynb"
NB_SMOKE = "notebooks/03_smoke_test.ipynb"
NB_MEMORY = "notebooks/04_batch_size_explorer.ipynb"
NB_EARLY_STOP = "notebooks/05_early_stop_sync.ipynb"


@dataclass(frozen=True)
class Spec:
    """What one parameter accepts: its kind, range or choices, and a one-line help."""

    kind: str  # "int", "float", "bool", "str", "choice", "path"
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: value must be strictly greater than low
    choices: tuple[str, ...] = ()
    empty_ok: bool = True  # for "str" and "path": may the value be ""?

    def accepted(self) -> str:
        """Human description of the accepted values, used in error messages."""
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "bool":
            return "True or False"
        if self.kind in ("str", "path"):
            return "a string" + ("" if self.empty_ok else " (not empty)")
        noun = "an integer" if self.kind == "int" else "a number"
        if self.low is not None and self.high is not None and not self.low_open:
            return f"{noun} in {_fmt(self.low)}..{_fmt(self.high)}"
        if self.low is not None and self.high is not None:
            return f"{noun} > {_fmt(self.low)} and <= {_fmt(self.high)}"
        if self.low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {_fmt(self.low)}"
        return noun


def _fmt(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


SPECS: dict[str, Spec] = {
    # shared by every distributed run
    "num_processes": Spec("int", "ranks to launch", 1, 64),
    "timeout_s": Spec("float", "deadline for the whole run, seconds", 0, 86400, low_open=True),
    "stall_s": Spec("float", "seconds a rank may wait in one collective before it counts as a hang",
                    0, 3600, low_open=True),
    "on_hang": Spec("choice", "after a diagnosis inside a job: end every rank with the doctor's exit "
                              "code, or report and leave the job to torch's timeout",
                    choices=("stop", "report")),
    "results_path": Spec("path", "where to write the notebook's result JSON ('' = do not write)"),
    # environment audit (notebook 01)
    "report_dir": Spec("path", "folder for the audit report (audit.json, audit.html)",
                       empty_ok=False),
    "compare_with": Spec("path", "another machine's audit report JSON to compare with ('' = none)"),
    "strict": Spec("bool", "fail when an error-level finding exists"),
    "anonymize": Spec("bool", "also replace host names, user names and home folders"),
    "min_severity": Spec("choice", "lowest severity of findings to show",
                         choices=("info", "warning", "error")),
    # minimal repro builder (notebook 02); the symptoms are helpers.repro.SYMPTOMS
    "symptom": Spec("choice", "what you see; each symptom maps to catalog scenarios (helpers.repro)",
                    choices=("hangs-at-eval", "hangs-at-save", "hangs-after-early-stop",
                             "shape-mismatch-error", "nccl-timeout", "one-rank-crashes")),
    "variant": Spec("choice", "the scenario's variant: the bug, or the fix", choices=("broken", "fixed")),
    "out_dir": Spec("path", "folder for the generated script, the doctor's record and report.md",
                    empty_ok=False),
    "from_trace": Spec("path", "a folder kept by `python -m helpers doctor --keep DIR` to replay "
                       "('' = build from the symptom)"),
    # smoke test (notebook 03)
    "max_size_mib": Spec("int", "largest message in the bandwidth sweep, MiB", 1, 4096),
    # batch-size explorer (notebook 04)
    "model": Spec("str", "'mlp', 'conv', 'transformer' or 'path/to/file.py:function'",
                  empty_ok=False),
    "memory_budget_mib": Spec("int", "memory one rank may use for training (weights, optimizer, "
                              "activations), MiB", 16, 1 << 20),
    "starting_batch_size": Spec("int", "the batch size to try first (the largest wanted)", 1, 1 << 24),
    "strategy": Spec("choice", "how to search", choices=("search", "accelerate", "both")),
    # early-stop sync demo (notebook 05); stop_rank < num_processes is checked by helpers.early_stop
    "stop_rank": Spec("int", "the rank that decides on its own to stop early (below num_processes)",
                      0, 63),
    "stop_step": Spec("int", "the training step (0-based) at which stop_rank decides to stop", 0, 100),
    "show_hang": Spec("bool", "also run the broken loop and let the hang doctor diagnose its hang"),
}


def check(name: str, value: Any) -> Any:
    """Return ``value`` checked (and normalised, e.g. int -> float) against ``SPECS[name]``.

    Raises ValueError naming the parameter, the value given and what is accepted.
    """
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown parameter {name!r}; known: {', '.join(sorted(SPECS))}")
    checked = _convert(spec, value)
    if checked is _BAD:
        raise ValueError(
            f"{name} must be {spec.accepted()}; got {value!r} ({type(value).__name__})"
        )
    return checked


_BAD = object()


def _convert(spec: Spec, value: Any) -> Any:
    if spec.kind == "bool":
        return value if isinstance(value, bool) else _BAD
    if spec.kind == "choice":
        return value if isinstance(value, str) and value in spec.choices else _BAD
    if spec.kind in ("str", "path"):
        if not isinstance(value, (str, Path)):
            return _BAD
        return str(value) if (str(value) or spec.empty_ok) else _BAD
    return _convert_number(spec, value)


def _convert_number(spec: Spec, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _BAD
    if spec.kind == "int":
        if isinstance(value, float) and not value.is_integer():
            return _BAD
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            return _BAD
    if spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low):
        return _BAD
    if spec.high is not None and value > spec.high:
        return _BAD
    return value


class Config(dict):
    """Validated parameters; read them as attributes (``cfg.num_processes``) or keys."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def subset(self, *names: str) -> dict[str, Any]:
        """The named parameters as plain keyword arguments."""
        return {name: self[name] for name in names}


def validate(**values: Any) -> Config:
    """Check every given parameter and return them as one ``Config``.

    The first bad value raises ValueError (see ``check``); nothing has started yet.
    """
    return Config({name: check(name, value) for name, value in values.items()})


def resolve_path(value: str | Path) -> Path:
    """Resolve a relative path against the repository root, not the kernel's working folder.

    nbval starts kernels in notebooks/, papermill in the caller's folder: the same parameter must
    name the same file from both.
    """
    path = Path(value).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def cli_flag(name: str) -> str:
    """The CLI flag of a parameter: ``num_processes`` -> ``--num-processes``."""
    return "--" + name.replace("_", "-")
