"""Result objects and how they leave the process: JSON, HTML tables, atomic files.

A result is plain data (a dataclass) with ``to_dict()``/``to_json()`` for the CLI and
``_repr_html_`` for notebooks. Nothing here prints; callers decide what to show.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import params


def to_jsonable(value: Any) -> Any:
    """Convert dataclasses, paths, tuples and sets into JSON-ready data (recursively)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("json", True)}  # metadata={"json": False}: kept out of the JSON
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    return value


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Atomically write UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Atomically write ``obj`` (dataclasses allowed) as indented JSON."""
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")


def html_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
               highlight: str | None = None) -> str:
    """A small HTML table from dict rows; ``highlight`` names a boolean column whose False rows are red."""
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows else []
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = []
    for row in rows:
        style = ' style="background:#fdd"' if highlight and row.get(highlight) is False else ""
        cells = "".join(f"<td>{html.escape(_cell(row.get(c)))}</td>" for c in columns)
        body.append(f"<tr{style}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def text_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """The same table as plain text, for the CLI and logs."""
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows else []
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(str(c))] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class ResultMixin:
    """JSON for dataclass results; subclasses add ``_repr_html_`` and ``summary()``."""

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data."""
        return to_jsonable(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """The result as JSON text; also written atomically to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path:
            atomic_write_text(path, text)
        return text


@dataclass
class Note(ResultMixin):
    """A one-line message shown in place of a result: a step that does not apply here, and why."""

    message: str

    def __repr__(self) -> str:
        return f"Note({self.message!r})"

    def _repr_html_(self) -> str:
        return f"<p><i>{html.escape(self.message)}</i></p>"


class Outcome(ResultMixin):
    """What a notebook's last cell checks and keeps: ``ok``, ``verdict()`` and ``save()``.

    Every notebook ends the same way::

        result = feature.outcome(...)
        result.save(cfg.results_path)
        assert result.ok, result.verdict()
        print(result.verdict())

    Subclasses are dataclasses with an ``ok`` field (or property), a ``verdict()`` sentence and a
    ``headline()``: the key figures in one line, which ``save()`` writes as ``"headline"`` and
    ``make report``'s landing page shows per notebook.
    """

    ok: bool

    def verdict(self) -> str:
        """One line for the last cell: what happened, and whether that is what was expected."""
        raise NotImplementedError

    def headline(self) -> str:
        """The key figures in one short line (the report's landing page); by default the verdict."""
        return self.verdict()

    def save(self, results_path: str | Path) -> Path | None:
        """Write this outcome's JSON (``to_dict()`` and ``"headline"``) atomically to ``results_path``
        (a notebook parameter: relative paths resolve against the repository root); nothing when
        it is empty."""
        if not results_path:
            return None
        data = {**self.to_dict(), "headline": self.headline()}
        return atomic_write_json(params.resolve_path(results_path), data)


KNOWN_NOISE = (
    # accelerate on CPU ranks: it sets the thread count itself and says so once per rank
    r"OMP_NUM_THREADS/MKL_NUM_THREADS unset",
    # torch deprecations that say nothing about the user's problem
    r".*TypedStorage is deprecated",
    r".*`torch.distributed._all_gather_base` is a private function",
    r".*`torch.distributed._reduce_scatter_base` is a private function",
    # Python 3.12+: forking a kernel with threads; helpers.launch forks on purpose, as
    # accelerate's notebook_launcher does, and resets what matters in each rank
    r".*use of fork\(\) may lead to deadlocks",
)


def quiet_known_warnings() -> None:
    """Filter warning noise that says nothing about the user's problem (listed in KNOWN_NOISE)."""
    import warnings

    for pattern in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
