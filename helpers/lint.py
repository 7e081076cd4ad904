"""Static check of training scripts and notebooks for collective-divergence bugs.

``python -m helpers lint PATH... [--json PATH]`` reads Python files and notebooks (their code cells)
with :mod:`ast` and never runs them, so it imports neither torch nor accelerate. Every rank of a
distributed job must issue the same collectives in the same order; each rule below finds one way a
script breaks that, before it hangs on a cluster:

- ``MAIN_ONLY_COLLECTIVE``: any other collective inside a branch that only some ranks take;
- ``ONE_SIDED_BARRIER``: a barrier on one side of a rank-dependent if/else (or inside an if without
  else, or after ``if not main: return``) but not on the other;
- ``DIVERGENT_BREAK``: ``break``/``return``/``continue`` in a loop that runs collectives, on a value
  that can differ between ranks (not the result of check_trigger, gather, reduce or broadcast);
- ``DIVERGENT_BRANCH``: a collective on one side of an if on such a value (``if time.time() - last
  > 30: accelerator.reduce(loss)``), which some ranks may not take;
- ``COLLECTIVE_IN_THREAD``: a collective on the default group in a function run as a thread of
  its own (``threading.Thread(target=log_metrics)``) while the file issues collectives outside it;
- ``NONEXISTENT_API``: misremembered accelerate names such as ``set_breakpoint``;
- ``CUDA_BEFORE_LAUNCH``: CUDA (or an ``Accelerator``) touched at top level before
  ``notebook_launcher``, which forks.

The checks are heuristics over one file at a time (a notebook's cells count as one file, run in
order). A call is followed into a function of the same file, or of a module the file imports that
the lint can find next to it (the file's folder and up to ``PARENT_ROOTS`` folders above it, never
site-packages: library code is opaque by design), at most ``MAX_FOLLOW_DEPTH`` imports deep and
``MAX_FOLLOW_FILES`` files per linted file. A function it cannot read (a parameter, a method of an
unknown object, a library call) is opaque: its result differs between ranks when one of its inputs
does (a rank's batch or loss) or is a rank's own data (a dataloader, which each rank reads its own
shard of).
"""

from __future__ import annotations

import argparse
import ast
import bisect
import builtins
import difflib
import functools
import html
import importlib.util
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from helpers import cli, collectives, report
from helpers.params import NB_EARLY_STOP, NB_REPRO, NB_SMOKE

__all__ = ["RULES", "Finding", "LintResult", "LintUsageError", "cli_main", "lint_paths", "lint_source"]

# code -> the remedy, naming the notebook that teaches it (by its path, as the doctor's fixes do)
RULES: dict[str, str] = {
    "MAIN_ONLY_COLLECTIVE": (
        "Call it on every rank, outside the rank-only block, and keep only rank-only work (printing, "
        f"writing files) inside it. {NB_EARLY_STOP} explains why collectives must match on every rank; "
        f"{NB_REPRO} builds a runnable repro."
    ),
    "ONE_SIDED_BARRIER": (
        "Put the barrier after the if/else (or in both branches) so that every rank reaches it. "
        f"{NB_REPRO} builds a runnable repro of this hang."
    ),
    "DIVERGENT_BREAK": (
        "Decide together: the rank that wants to stop calls accelerator.set_trigger(), and every rank "
        "runs `if accelerator.check_trigger(): break`; or reduce the value first (accelerator.reduce or "
        f"gather) so that every rank decides on the same number. {NB_EARLY_STOP} shows the hang and this fix."
    ),
    "DIVERGENT_BRANCH": (
        "Decide the condition alike on every rank: count steps instead of reading the clock (if step % "
        "log_every == 0:), or reduce the value first (accelerator.reduce or gather) so that every rank "
        "takes the same side; or call the collective on every rank and use its result where needed. "
        f"{NB_REPRO} builds a runnable repro."
    ),
    "COLLECTIVE_IN_THREAD": (
        "Issue each process group's collectives from one thread: make the thread a group of its own, "
        "created on every rank in the same order before the thread starts (metrics_group = "
        "dist.new_group(...)), and pass group=metrics_group to its calls; torch pairs calls within a "
        "group, so the two threads' calls never meet. Or hand the values to the main thread and reduce "
        "them there."
    ),
    "NONEXISTENT_API": (
        "Use the existing name the message gives (accelerate's API reference lists every Accelerator "
        f"method); the early-stopping API is set_trigger()/check_trigger() ({NB_EARLY_STOP})."
    ),
    "COLLECTIVE_IN_MAIN_FIRST": (
        "Issue it before or after the main_process_first block, on every rank, and keep only work that "
        "needs no other rank (building a cache, downloading) inside it. The doctor names this hang at run "
        f"time; {NB_REPRO} builds a runnable repro."
    ),
    "CUDA_BEFORE_LAUNCH": (
        "Move it inside the function you pass to notebook_launcher, restart the kernel and run again: "
        "the launcher forks, and the forked ranks cannot use CUDA (or an Accelerator) set up in the "
        f"notebook process. {NB_SMOKE} runs notebook_launcher the safe way."
    ),
}
SAVE_FIX = ("To save: every rank calls wait_for_everyone() and get_state_dict()/save_model(), then "
            "accelerator.save writes the file on the main process only. ")
TRIGGER_FIX = f"The early-stopping API is set_trigger()/check_trigger(), shown in {NB_EARLY_STOP}."

# --- what counts as a collective ------------------------------------------------------------------

# torch.distributed functions every rank of the group must call: the one table (helpers.collectives)
DIST_COLLECTIVES = {
    name: "is a barrier" if name.endswith("barrier") else "is a torch.distributed collective"
    for name in sorted(collectives.COLLECTIVES)
}
# where a torch.distributed collective takes its group by position (torch 2.13's signatures)
GROUP_POSITION = {"barrier": 0, "monitored_barrier": 0, "all_reduce": 2, "broadcast": 2, "all_gather": 2,
                  "all_gather_into_tensor": 2, "all_gather_object": 2, "all_to_all": 2,
                  "broadcast_object_list": 2, "reduce": 3, "gather": 3, "gather_object": 3, "scatter": 3,
                  "scatter_object_list": 3, "reduce_scatter": 3, "reduce_scatter_tensor": 3,
                  "all_to_all_single": 4}
# accelerate.utils functions and Accelerator methods (accelerate/utils/operations.py, accelerator.py)
ACCELERATE_UTIL_COLLECTIVES = {
    "gather": "all-gathers a tensor from every rank",
    "gather_object": "all-gathers a Python object from every rank",
    "reduce": "all-reduces a tensor over every rank",
    "broadcast": "broadcasts a tensor to every rank",
    "broadcast_object_list": "broadcasts objects to every rank",
    "pad_across_processes": "first all-gathers every rank's tensor size",
    "wait_for_everyone": "is a barrier (torch.distributed.barrier)",
}
ACCELERATOR_COLLECTIVES = {
    "gather": "all-gathers a tensor from every rank",
    "gather_for_metrics": "all-gathers a tensor from every rank",
    "reduce": "all-reduces a tensor over every rank",
    "pad_across_processes": "first all-gathers every rank's tensor size",
    "wait_for_everyone": "is a barrier (torch.distributed.barrier)",
    "check_trigger": "all-reduces the trigger flag over every rank",
    "get_state_dict": "gathers the full state dict from every rank under FSDP and DeepSpeed ZeRO-3",
    "save_model": "calls get_state_dict, which gathers from every rank under FSDP and DeepSpeed ZeRO-3",
    "save_state": "waits for every rank (automatic checkpoint naming) and gathers state under FSDP/DeepSpeed",
    "backward": "runs the gradient all-reduce under DDP",
    "main_process_first": "holds a barrier (wait_for_everyone) before and after its block",
    "local_main_process_first": "holds a barrier (wait_for_everyone) before and after its block",
}
_GOES_FIRST = ("main_process_first", "local_main_process_first")  # blocks the main process runs first
# method names too generic to count unless the receiver is an Accelerator
_NEEDS_ACCELERATOR = {"gather", "reduce", "backward", "get_state_dict", "save_model", "save_state"}
BARRIERS = {"accelerate.wait_for_everyone", "torch.distributed.barrier",
            "torch.distributed.monitored_barrier"}  # one op for matching branches: "barrier"
# calls whose result is the same on every rank
SYNCED_METHODS = {"gather", "gather_for_metrics", "reduce", "check_trigger"}
SYNCED_UTILS = {"gather", "gather_object", "reduce", "broadcast"}
# in-place synchronisers: after `dist.all_reduce(t)` every rank holds the same `t`
INPLACE_SYNC = {"all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
                "broadcast_object_list"}

# --- what differs between ranks -------------------------------------------------------------------

RANK_ATTRS = {"is_main_process", "is_local_main_process", "is_last_process", "process_index",
              "local_process_index", "rank", "local_rank", "global_rank", "node_rank"}
RANK_NAMES = RANK_ATTRS | {"is_main", "is_master", "world_rank"}
RANK_CALLS = {"get_rank", "get_local_rank", "get_global_rank", "get_group_rank", "get_node_local_rank",
              "get_ordinal", "get_local_ordinal"}
RANK_ENV = {"RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID",
            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK"}
VARYING_CALLS = {"time.time", "time.time_ns", "time.perf_counter", "time.perf_counter_ns", "time.monotonic",
                 "time.process_time", "os.getpid", "socket.gethostname", "next", "torch.rand", "torch.randn",
                 "torch.randint", "torch.randperm", "torch.rand_like", "torch.randn_like", "torch.normal",
                 "torch.bernoulli", "torch.multinomial", "torch.cuda.memory_allocated",
                 "torch.cuda.max_memory_allocated", "torch.cuda.memory_reserved", "torch.cuda.mem_get_info"}
VARYING_PREFIXES = ("random.", "numpy.random.", "psutil.")
# names of iterables of per-rank data, and of per-rank values
DATA_WORDS = {"loader", "dataloader", "dl", "dataset", "data", "batch", "batches"}
ITEM_WORDS = {"batch", "inputs", "targets", "labels", "loss", "logits", "outputs", "sample"}
RANK_DECORATORS = {"on_main_process", "on_local_main_process", "on_last_process", "on_process",
                   "on_local_process"}

# --- accelerate names people misremember ----------------------------------------------------------

MISREMEMBERED = {
    "set_breakpoint": "set_trigger",
    "check_breakpoint": "check_trigger",
    "all_gather": "gather",
    "all_reduce": "reduce",
    "barrier": "wait_for_everyone",
    "is_main": "is_main_process",
    "is_master": "is_main_process",
    "is_master_process": "is_main_process",
    "is_local_main": "is_local_main_process",
    "rank": "process_index",
    "local_rank": "local_process_index",
    "world_size": "num_processes",
    "gather_metrics": "gather_for_metrics",
}
CUDA_SAFE = {"is_initialized", "device_count", "OutOfMemoryError"}  # do not initialise CUDA
PYTHON_CELL_MAGICS = {"time", "timeit", "capture", "prun"}
# an opaque call reading one of these (by name) gets this rank's own data: a prepared dataloader
LOADER_WORDS = {"loader", "dataloader", "dl", "batches"}
# builtins that read every item of an iterable (len does not: every rank has as many batches)
CONSUMING_BUILTINS = {"list", "tuple", "sorted", "sum", "max", "min", "set", "any", "all"}
# calls whose result stands for the loader itself (names assigned from them are loaders too)
LOADER_WRAPPERS = {"prepare", "prepare_data_loader", "skip_first_batches", "DataLoader", "tqdm", "iter",
                   "cycle", "islice"}
# following calls into other files (see the module docstring)
MAX_FOLLOW_DEPTH = 3
MAX_FOLLOW_FILES = 8
MAX_FOLLOW_BYTES = 1_000_000
PARENT_ROOTS = 2
UNSYNCED = "can differ between ranks (it does not come from check_trigger, gather, reduce or broadcast)"


class LintUsageError(ValueError):
    """Bad input to the lint (a missing file, a syntax error): exit code 2 on the command line."""


@dataclass
class Finding:
    """One problem: its rule code, where it is (``cell`` is set for notebooks) and what to do."""

    code: str
    file: str
    line: int
    message: str
    fix: str
    cell: int | None = None

    @property
    def where(self) -> str:
        """``train.py:12`` or ``nb.ipynb, cell 3, line 4``."""
        if self.cell is None:
            return f"{self.file}:{self.line}"
        return f"{self.file}, cell {self.cell}, line {self.line}"


@dataclass
class LintResult(report.ResultMixin):
    """The findings over the files linted; ``ok`` when there are none."""

    files: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no finding was made."""
        return not self.findings

    def codes(self) -> list[str]:
        """The rule codes found, in order of appearance."""
        return [f.code for f in self.findings]

    def summary(self) -> str:
        """One line: how many findings in how many files."""
        files = f"{len(self.files)} file{'s' * (len(self.files) != 1)}"
        if self.ok:
            return f"no divergence found in {files}"
        count = len(self.findings)
        return f"{count} finding{'s' * (count != 1)} in {files}"

    def text(self) -> str:
        """The findings as compiler-style lines, for the command line."""
        lines = [f"{f.where}: {f.code} {f.message}\n    fix: {f.fix}" for f in self.findings]
        return "\n".join(lines + [self.summary()])

    def _repr_html_(self) -> str:
        rows = [{"where": f.where, "code": f.code, "message": f.message, "fix": f.fix} for f in self.findings]
        table = report.html_table(rows, ["where", "code", "message", "fix"]) if rows else ""
        return f"<p><b>lint:</b> {html.escape(self.summary())}</p>{table}"


# --- public entry points ---------------------------------------------------------------------------


def lint_paths(paths: str | Path | Sequence[str | Path]) -> LintResult:
    """Lint Python files, notebooks and folders (their ``*.py`` and ``*.ipynb``, recursively).

    Raises LintUsageError (a ValueError) for a missing path or a file that does not parse.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise LintUsageError("paths: give at least one Python file, notebook or folder")
    result = LintResult()
    for path in _expand(paths):
        result.files.append(str(path))
        result.findings += _lint_file(path)
    return result


def lint_source(source: str, filename: str = "<source>", notebook: bool = False) -> LintResult:
    """Lint Python source text (or a notebook's JSON text with ``notebook=True``)."""
    parsed = _read_notebook(source, filename) if notebook else _read_python(source, filename)
    path = Path(filename)  # imports are followed only from a file that exists
    project = _Project(path) if path.is_file() else None
    return LintResult(files=[filename], findings=_Module(parsed, project).findings())


def cli_main(argv: Sequence[str]) -> int:
    """``python -m helpers lint PATH... [--json PATH]``: exit 0 clean, 1 findings, 2 bad usage."""
    parser = argparse.ArgumentParser(
        prog="python -m helpers lint",
        description="Static check of training scripts and notebooks for collective divergence "
                    "(nothing is run). Exit 0: clean, 1: findings, 2: bad usage.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files, notebooks or folders")
    parser.add_argument("--json", metavar="PATH", help='write {"findings": [...]} to this file')
    args = cli.parse(parser, list(argv))
    if isinstance(args, int):
        return args
    try:
        result = lint_paths(args.paths)
    except LintUsageError as exc:
        return cli.usage_error(str(exc))
    print(result.text())
    if args.json:
        result.to_json(args.json)
    return cli.EXIT_OK if result.ok else cli.EXIT_PROBLEM


# --- reading files ---------------------------------------------------------------------------------


@dataclass
class _Parsed:
    """A parsed file; a notebook's code cells are joined into one module, line numbers offset."""

    file: str
    tree: ast.Module
    cells: list[tuple[int, int]] | None = None  # (first joined line, cell number) per code cell

    def locate(self, lineno: int) -> tuple[int | None, int]:
        """(cell, line in cell) of a joined line number; cell is None outside notebooks."""
        if self.cells is None:
            return None, lineno
        first, number = max((c for c in self.cells if c[0] <= lineno), default=self.cells[0])
        return number, lineno - first + 1

    def where(self, lineno: int) -> str:
        """``line 12`` or ``cell 3, line 4``, for messages."""
        cell, line = self.locate(lineno)
        return f"line {line}" if cell is None else f"cell {cell}, line {line}"


def _expand(paths: Iterable[str | Path]) -> Iterator[Path]:
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".ipynb") and p.is_file()
                           and not any(part.startswith(".") or part == "__pycache__"
                                       for part in p.relative_to(path).parts))
            if not found:
                raise LintUsageError(f"paths: no .py or .ipynb file under folder '{item}'")
            yield from found
        elif path.is_file():
            yield path
        else:
            raise LintUsageError(f"paths: '{item}' does not exist")


def _lint_file(path: Path) -> list[Finding]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LintUsageError(f"paths: cannot read '{path}': {exc}") from None
    if path.suffix == ".ipynb":
        parsed = _read_notebook(text, str(path))
    else:
        parsed = _read_python(text, str(path))
    return _Module(parsed, _Project(path)).findings()


def _read_python(text: str, file: str) -> _Parsed:
    try:
        return _Parsed(file, ast.parse(text, filename=file))
    except SyntaxError as exc:
        raise LintUsageError(f"{file}:{exc.lineno}: syntax error: {exc.msg}") from None


def _read_notebook(text: str, file: str) -> _Parsed:
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, KeyError, TypeError) as exc:
        raise LintUsageError(f"{file}: not a Jupyter notebook (nbformat 4 JSON): {exc}") from None
    body: list[ast.stmt] = []
    starts: list[tuple[int, int]] = []
    offset = 0
    for number, cell in enumerate(cells, start=1):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        code = _python_lines("".join(source) if isinstance(source, list) else source)
        try:
            tree = ast.parse(code, filename=file)
        except SyntaxError as exc:
            where = f"{file}, cell {number}, line {exc.lineno}"
            raise LintUsageError(f"{where}: syntax error: {exc.msg}") from None
        ast.increment_lineno(tree, offset)
        body += tree.body
        starts.append((offset + 1, number))
        offset += code.count("\n") + 1
    return _Parsed(file, ast.Module(body=body, type_ignores=[]), starts or [(1, 1)])


class _Project:
    """The files that one linted file's imports reach: found on disk, parsed once, within bounds."""

    def __init__(self, origin: Path):
        origin = origin.resolve()
        folders = [origin.parent, *origin.parent.parents][: PARENT_ROOTS + 1]
        # library code is opaque by design: a project's own modules sit next to its scripts
        self.roots = [f for f in folders if f.name not in ("site-packages", "dist-packages")]
        self.modules: dict[Path, _Module | None] = {origin: None}
        self.files_left = MAX_FOLLOW_FILES
        self._found: dict[tuple[Path, str], Path | None] = {}

    def module(self, path: Path, depth: int) -> _Module | None:
        """The parsed module of ``path`` (None past the bounds, or when it does not parse)."""
        if path in self.modules:
            return self.modules[path]
        self.modules[path] = None  # a circular import reads as opaque
        if depth > MAX_FOLLOW_DEPTH or self.files_left <= 0:
            return None
        self.files_left -= 1
        try:
            if path.stat().st_size > MAX_FOLLOW_BYTES:
                return None
            parsed = _read_python(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError, LintUsageError):
            return None
        self.modules[path] = _Module(parsed, self, depth)
        return self.modules[path]

    def find(self, folders: Iterable[Path], dotted: str) -> Path | None:
        """The file of module ``a.b`` under the first folder that has ``a/b.py`` or ``a/b/__init__.py``."""
        for folder in folders:
            key = (folder, dotted)
            if key not in self._found:
                base = folder.joinpath(*dotted.split("."))
                self._found[key] = next((p for p in (base.with_suffix(".py"), base / "__init__.py")
                                         if p.is_file()), None)
            if self._found[key] is not None:
                return self._found[key]
        return None


_MAGIC_LINE = re.compile(r"^(\s*)(%{1,2}[A-Za-z]|!|\?|[\w.]+\?\??\s*$)")  # %magic, !shell, ?x, x?
_MAGIC_ASSIGN = re.compile(r"^(\s*[\w.]+(?:\s*,\s*[\w.]+)*\s*=\s*)[%!]")  # files = !ls


def _python_lines(code: str) -> str:
    """IPython source -> plain Python with the same line numbers: magics and shell lines become ``pass``."""
    lines = code.split("\n")
    first = lines[0].strip()
    if first.startswith("%%"):
        if first[2:].split(" ", 1)[0] not in PYTHON_CELL_MAGICS:  # %%bash, %%writefile: not run as Python
            return "\n" * (len(lines) - 1)
        lines[0] = ""
    for i, line in enumerate(lines):
        if _MAGIC_LINE.match(line):
            lines[i] = _MAGIC_LINE.match(line).group(1) + "pass"
        elif _MAGIC_ASSIGN.match(line):
            lines[i] = _MAGIC_ASSIGN.match(line).group(1) + "None"
    return "\n".join(lines)


# --- small AST helpers -----------------------------------------------------------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_BLOCK_OWNERS = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For,
                 ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, getattr(ast, "TryStar", ast.Try),
                 ast.ExceptHandler, ast.match_case)


def _shallow(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node under ``nodes`` that runs in place: not the bodies of nested defs, classes, lambdas.

    Depth first, not in source order (callers sort by position where order matters).
    """
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES):
            continue
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, ast.AST):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, ast.AST))


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _text(node: ast.AST, limit: int = 70) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _blocks(nodes: Iterable[ast.AST]) -> Iterator[list[ast.stmt]]:
    """Every statement list among ``nodes`` (bodies, else branches, handlers, match cases)."""
    for node in nodes:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _in_order(nodes: Iterable[ast.AST]) -> list:
    """Nodes in source order."""
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


def _returns(stmts: list[ast.stmt]) -> bool:
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Raise))


def _words(text: str) -> set[str]:
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if w}


def _data_like(node: ast.AST) -> bool:
    """An iterable that yields each rank its own data (a dataloader, by its name)."""
    names = (n.id if isinstance(n, ast.Name) else n.attr for n in _shallow([node])
             if isinstance(n, (ast.Name, ast.Attribute)))
    words = {word for name in names for word in _words(name)}
    return bool(words & DATA_WORDS) or any(w.endswith("loader") for w in words)


@dataclass(frozen=True)
class _Op:
    """A collective call: ``key`` must match across branches, ``text`` is the call as written."""

    key: str
    text: str
    why: str


@dataclass
class _Raw:
    code: str
    node: ast.AST
    message: str
    fix: str = ""


@dataclass
class _Loop:
    node: ast.For | ast.AsyncFor | ast.While
    first: tuple[_Op, ast.Call] | None  # the first collective it runs


@dataclass(frozen=True)
class _Source:
    """The call a rank-varying value came from: a function followed, or one the lint cannot read."""

    call: str  # the call as written
    line: int
    callee: str  # its name as written
    data: str = ""  # opaque: the rank's own data it was given (a dataloader)
    where: str = ""  # followed: where the function is

    def clause(self, where: str) -> str:
        if self.data:
            return (f"; it comes from `{self.call}` ({where}), which the lint cannot read and which reads "
                    f"this rank's own `{self.data}`, so each rank gets its own value unless "
                    f"{self.callee}() reduces across ranks")
        return (f"; it comes from `{self.call}` ({where}), and `{self.callee}` ({self.where}) returns it "
                "without reducing it across ranks")


@dataclass
class _Guard:
    node: ast.stmt | ast.ExceptHandler  # the if (match, while) statement, or an except handler
    test: ast.expr
    why: str | None  # the rank-varying part of the test, None when every rank agrees
    depth: int  # enclosing loops when entered
    for_exits: bool = True  # False for a while loop's own test
    source: _Source | None = None  # the call the varying part came from, when known


# --- one file --------------------------------------------------------------------------------------


class _Module:
    """One parsed file: import aliases, Accelerator names, function summaries, and the checks."""

    def __init__(self, parsed: _Parsed, project: _Project | None = None, depth: int = 0):
        self.parsed = parsed
        self.tree = parsed.tree
        self.project, self.depth = project, depth
        self.path = Path(parsed.file).resolve() if project is not None else None
        self._index()
        self.aliases = _import_aliases(self.of(ast.Import, ast.ImportFrom))
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in self.of(ast.FunctionDef, ast.AsyncFunctionDef):
            self.functions.setdefault(node.name, []).append(node)
        # names defined only as methods: a plain call `evaluate(...)` does not run them
        self.methods_only = {name for name, defs in self.functions.items()
                             if all(isinstance(self.scope_of[id(fn)], ast.ClassDef) for fn in defs)}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        for node in self.of(ast.ClassDef):
            self.classes.setdefault(node.name, []).append(node)
        self._targets: dict[int, tuple[_Module, list] | None] = {}
        self.instances, self.loader_names = self._instances_and_loaders()
        # calls each function makes (functions that run on one process only are reported inside)
        self.fn_calls = {name: _in_order(c for fn in defs if not _rank_decorator(fn)
                                         for c in self.calls_in[id(fn)])
                         for name, defs in self.functions.items()}
        self._collectives: dict[int, _Op | None] = {}
        self.accelerators, self.states = self._accelerator_names()
        self.distributed = self._uses_distributed()
        self.rank_names = self._rank_names()
        self.collective_fns = self._summarise(self._direct_collective)
        self.cuda_fns = self._summarise(self._cuda_touch)
        self._returns: dict[tuple, bool] = {}
        # every collective call of the file in source order, to find those under some statements fast
        calls = _in_order(self.of(ast.Call))
        self._all_ops = [(op, call) for call in calls if (op := self.collective(call)) is not None]
        self._positions = [(call.lineno, call.col_offset) for _, call in self._all_ops]

    def _index(self) -> None:
        """One pass over the tree: nodes by type, and the scope (def, lambda, class, module) of each."""
        self.nodes: dict[type, list[ast.AST]] = {}
        self.scope_of: dict[int, ast.AST] = {}
        self.calls_in: dict[int, list[ast.Call]] = {id(self.tree): []}
        stack: list[tuple[ast.AST, ast.AST]] = [(self.tree, self.tree)]
        while stack:
            node, scope = stack.pop()
            self.nodes.setdefault(type(node), []).append(node)
            self.scope_of[id(node)] = scope
            if isinstance(node, ast.Call):
                self.calls_in[id(scope)].append(node)
            inner = scope
            if isinstance(node, _SCOPES):
                inner = node
                self.calls_in[id(node)] = []
            for name in node._fields:
                value = getattr(node, name, None)
                if isinstance(value, ast.AST):
                    stack.append((value, inner))
                elif isinstance(value, list):
                    stack.extend((v, inner) for v in value if isinstance(v, ast.AST))

    def of(self, *types: type) -> list:
        """Every node of these types in the file."""
        return [node for kind in types for node in self.nodes.get(kind, [])]

    # names ----------------------------------------------------------------------------------------

    def canonical(self, node: ast.AST) -> str | None:
        """The dotted name with import aliases resolved: ``dist.barrier`` -> ``torch.distributed.barrier``."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        head = self.aliases.get(head, head)
        return f"{head}.{rest}" if rest else head

    def is_accelerator(self, node: ast.AST) -> bool:
        """Whether ``node`` names an Accelerator (or accelerate state) object."""
        key = _dotted(node)
        if (self.canonical(node) or "").startswith("torch."):  # torch.accelerator: torch's module (2.6+)
            return False
        return bool(key) and (key in self.accelerators or key.endswith(".accelerator"))

    def callee(self, call: ast.Call) -> str | None:
        """The name of a function defined in this file that ``call`` calls, if any."""
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.functions and func.id not in self.aliases \
                and func.id not in self.methods_only:
            return func.id
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id in ("self", "cls") and func.attr in self.functions:
            return func.attr
        return None

    def _accelerator_names(self) -> tuple[set[str], set[str]]:
        """Names of Accelerator objects (``accelerator`` by convention) and of accelerate state objects."""
        accelerators, states = {"accelerator"}, set()
        for node in self.of(ast.Assign, ast.AnnAssign):
            if isinstance(node.value, ast.Call):
                kind = (self.canonical(node.value.func) or "").rsplit(".", 1)[-1]
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if kind == "Accelerator":
                    accelerators.update(filter(None, map(_dotted, targets)))
                elif kind in ("PartialState", "AcceleratorState"):
                    states.update(filter(None, map(_dotted, targets)))
        return accelerators | states, states

    def _uses_distributed(self) -> bool:
        """Whether the file uses accelerate, torch.distributed, DDP or DeepSpeed (``.backward()`` syncs)."""
        modules = ("accelerate", "torch.distributed", "torch.nn.parallel", "deepspeed")
        if any(name.startswith(modules) for name in self.aliases.values()):
            return True
        attrs = {node.attr for node in self.of(ast.Attribute)} | {node.id for node in self.of(ast.Name)}
        return bool(attrs & {"distributed", "DistributedDataParallel"})

    def _rank_names(self) -> set[str]:
        """Variables assigned from a rank-dependent value (``is_main = accelerator.is_main_process``)."""
        names: set[str] = set()
        assigns = [n for n in self.of(ast.Assign, ast.AnnAssign) if n.value]
        while True:
            before = len(names)
            for node in assigns:
                if self.rank_source(node.value, names):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            if len(names) == before:
                return names

    def rank_source(self, expr: ast.AST, extra: set[str] | None = None) -> str | None:
        """The part of ``expr`` that depends on the rank (as text), or None."""
        names = extra if extra is not None else self.rank_names
        for node in _shallow([expr]):
            if isinstance(node, ast.Attribute) and node.attr in RANK_ATTRS:
                return _text(node)
            if isinstance(node, ast.Name) and (node.id in RANK_NAMES or node.id in names):
                return node.id
            if isinstance(node, ast.Call) and (self.canonical(node.func) or "").rsplit(".")[-1] in RANK_CALLS:
                return _text(node)
            if _rank_env_read(node):
                return _text(node)
        return None

    # collectives ----------------------------------------------------------------------------------

    def collective(self, call: ast.Call) -> _Op | None:
        """The collective that ``call`` runs (directly or through a function of this file), or None."""
        if id(call) not in self._collectives:
            op = self._direct_collective(call)
            name = self.callee(call) if op is None else None
            if name in self.collective_fns:
                inner, line, key = self.collective_fns[name]
                op = _Op(key, f"{name}()", f"runs `{inner}` ({self.parsed.where(line)}), a collective")
            elif op is None and name is None and (hit := self.target(call)) is not None:
                mod, fns = hit
                if fns[0].name in mod.collective_fns:
                    inner, line, key = mod.collective_fns[fns[0].name]
                    where = f"{Path(mod.parsed.file).name}, {mod.parsed.where(line)}"
                    op = _Op(key, f"{_dotted(call.func)}()", f"runs `{inner}` ({where}), a collective")
            self._collectives[id(call)] = op
        return self._collectives[id(call)]

    def _direct_collective(self, call: ast.Call) -> _Op | None:
        func = call.func
        if any(k.arg == "in_order" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords):
            return _Op("in_order", _dotted(func) or _text(func),
                       "with in_order=True logs rank by rank with a barrier per rank (accelerate logging.py)")
        text = _dotted(func) or _text(func)
        canon = self.canonical(func) or ""
        name = canon.rsplit(".", 1)[-1] if canon else getattr(func, "attr", "")
        if canon.startswith("torch.distributed.") and name in DIST_COLLECTIVES:
            return _Op(_key(f"torch.distributed.{name}"), text, DIST_COLLECTIVES[name])
        if canon.startswith("accelerate.") and name in ACCELERATE_UTIL_COLLECTIVES:
            return _Op(_key(f"accelerate.{name}"), text, ACCELERATE_UTIL_COLLECTIVES[name])
        if not isinstance(func, ast.Attribute):
            return None
        name = func.attr
        accelerator = self.is_accelerator(func.value)
        if name in ACCELERATOR_COLLECTIVES and (accelerator or name not in _NEEDS_ACCELERATOR):
            key = "backward" if name == "backward" else _key(f"accelerate.{name}")
            return _Op(key, text, ACCELERATOR_COLLECTIVES[name])
        if name == "backward" and self.distributed:
            return _Op("backward", text, ACCELERATOR_COLLECTIVES["backward"])
        return None

    def profile(self, nodes: list[ast.AST]) -> dict[str, list[tuple[_Op, ast.Call]]]:
        """Collectives under ``nodes`` by key, in source order."""
        found: dict[str, list[tuple[_Op, ast.Call]]] = {}
        for op, call in self.ordered(nodes):
            found.setdefault(op.key, []).append((op, call))
        return found

    def ordered(self, nodes: list[ast.AST]) -> list[tuple[_Op, ast.Call]]:
        """Collectives under ``nodes`` that run in place (not in nested defs), in source order."""
        found = []
        for node in nodes:
            scope = self.scope_of[id(node)]
            start = bisect.bisect_left(self._positions, (node.lineno, node.col_offset))
            end = bisect.bisect_right(self._positions, (node.end_lineno, node.end_col_offset))
            found += [pair for pair in self._all_ops[start:end] if self.scope_of[id(pair[1])] is scope]
        return sorted(found, key=lambda p: (p[1].lineno, p[1].col_offset))

    def _summarise(self, direct) -> dict[str, tuple[str, int, str]]:
        """Function name -> (call text, line, key) of the first ``direct`` hit it reaches, transitively.

        Functions decorated to run on one process only are left out: their collectives are
        reported inside them.
        """
        calls = self.fn_calls
        found: dict[str, tuple[str, int, str]] = {}
        for name, fn_calls in calls.items():
            for call in fn_calls:
                hit = direct(call)
                if isinstance(hit, _Op):
                    found[name] = (hit.text, call.lineno, hit.key)
                    break
                if hit:
                    found[name] = (_text(call), call.lineno, "")
                    break
        changed = True
        while changed:
            changed = False
            for name, fn_calls in calls.items():
                if name in found:
                    continue
                hit = next((c for c in map(self.callee, fn_calls) if c in found and c != name), None)
                if hit:
                    found[name], changed = found[hit], True
        return found

    def returns_vary(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, params: frozenset[str] | bool) -> bool:
        """Whether ``fn`` (of this file) can return a different value on each rank, when the parameters
        ``params`` (all of them: True) hold rank-varying values or a rank's own data."""
        key = (id(fn), params)
        if key not in self._returns:
            self._returns[key] = False  # recursion: assume synchronised while computing
            self._returns[key] = _Flow(self, fn, params_vary=params, emit=False).returns_vary
        return self._returns[key]

    # following calls ------------------------------------------------------------------------------

    def _instances_and_loaders(self) -> tuple[dict[str, ast.expr], set[str]]:
        """``x = SomeClass(...)``: x -> the class expression; names that hold a dataloader (assigned
        from ``accelerator.prepare(loader)``, ``DataLoader(...)``, ``tqdm(loader)``...)."""
        instances: dict[str, ast.expr] = {}
        loaders: set[str] = set()
        assigns = [n for n in self.of(ast.Assign) if isinstance(n.value, ast.Call)]
        for node in assigns:
            head = (_dotted(node.value.func) or "").split(".")[0]
            if head in self.classes or head in self.aliases:
                for target in filter(None, map(_dotted, node.targets)):
                    instances[target] = node.value.func
        for _ in range(2):  # loader = accelerator.prepare(train_loader); progress = tqdm(loader)
            for node in assigns:
                call = node.value
                last = (_dotted(call.func) or "").rsplit(".", 1)[-1]
                if last not in LOADER_WRAPPERS:
                    continue
                for target in node.targets:
                    pairs = zip(target.elts, call.args, strict=False) if isinstance(target, ast.Tuple) \
                        else [(target, call.args[0] if call.args else call)]
                    for name, value in pairs:
                        if (last == "DataLoader" or self.loader_like(value, loaders)) and _dotted(name):
                            loaders.add(_dotted(name))
        return instances, loaders

    def loader_like(self, node: ast.AST, names: set[str] | None = None) -> bool:
        """Whether ``node`` names a dataloader (each rank reads its own shard of a prepared one)."""
        node = node.value if isinstance(node, ast.Starred) else node
        if not isinstance(node, (ast.Name, ast.Attribute)):
            return False
        if _dotted(node) in (self.loader_names if names is None else names):
            return True
        words = _words(node.id if isinstance(node, ast.Name) else node.attr)
        return bool(words & LOADER_WORDS) or any(w.endswith("loader") for w in words)

    def target(self, call: ast.Call) -> tuple[_Module, list[ast.FunctionDef | ast.AsyncFunctionDef]] | None:
        """The function (in a module found on disk, or a method of a class the lint can read) that
        ``call`` runs, when ``callee`` does not name one of this file; None when it cannot be read."""
        if id(call) not in self._targets:
            self._targets[id(call)] = None  # recursion
            self._targets[id(call)] = self._target(call)
        return self._targets[id(call)]

    def _target(self, call: ast.Call) -> tuple[_Module, list] | None:
        func = call.func
        dotted = _dotted(func)
        if dotted is None:
            return None
        head = dotted.split(".")[0]
        if head in self.aliases and head not in self.functions:
            return self.imported_function(self.canonical(func) or "")
        if not isinstance(func, ast.Attribute):
            return None
        receiver = _dotted(func.value)
        if receiver in ("self", "cls"):
            scope = self.scope_of.get(id(call))
            is_def = isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
            owner = self.scope_of.get(id(scope)) if is_def else None
            return self.class_method(owner, func.attr) if isinstance(owner, ast.ClassDef) else None
        if receiver in self.instances:
            found = self.find_class(self.instances[receiver])
            return found[0].class_method(found[1], func.attr) if found else None
        return None

    def resolve(self, canon: str) -> tuple[_Module, str] | None:
        """An imported dotted name -> (the module found on disk, the name inside it)."""
        if self.project is None or self.path is None or not canon:
            return None
        level = len(canon) - len(canon.lstrip("."))
        parts = canon.lstrip(".").split(".")
        if level:  # from .evalmod import evaluate: next to this file (its package)
            folder = self.path.parent
            for _ in range(level - 1):
                folder = folder.parent
            folders, shortest = [folder], 0
        else:
            folders, shortest = list(dict.fromkeys([self.path.parent, *self.project.roots])), 1
        for cut in range(len(parts) - 1, shortest - 1, -1):  # the longest module name first
            found = self.project.find(folders, ".".join(parts[:cut])) if cut else \
                next((f / "__init__.py" for f in folders if (f / "__init__.py").is_file()), None)
            if found is not None:
                module = self.project.module(found, self.depth + 1)
                return (module, ".".join(parts[cut:])) if module is not None else None
        return None

    def imported_function(self, canon: str) -> tuple[_Module, list] | None:
        hit = self.resolve(canon)
        if hit is None:
            return None
        module, name = hit
        if "." in name:  # module.SomeClass.method
            cls_name, _, method = name.partition(".")
            found = module.find_class(ast.Name(cls_name))
            return found[0].class_method(found[1], method) if found and "." not in method else None
        defs = [fn for fn in module.functions.get(name, []) if module.scope_of[id(fn)] is module.tree]
        if defs:
            return module, defs
        if name in module.aliases and name not in module.classes:  # re-exported: from .m import evaluate
            return module.imported_function(module.aliases[name])
        return None

    def find_class(self, node: ast.AST) -> tuple[_Module, ast.ClassDef] | None:
        """The class that ``node`` (a name or dotted name) refers to, in this file or one found on disk."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        if dotted in self.classes and dotted not in self.aliases:
            return self, self.classes[dotted][-1]
        if dotted.split(".")[0] not in self.aliases:
            return None
        hit = self.resolve(self.canonical(node) or "")
        if hit is None:
            return None
        module, name = hit
        if name in module.classes:
            return module, module.classes[name][-1]
        if name in module.aliases:
            return module.find_class(ast.Name(name))
        return None

    def class_method(self, cls: ast.ClassDef, name: str, hops: int = 0) -> tuple[_Module, list] | None:
        """The method ``name`` of ``cls`` or of a base class the lint can read."""
        defs = [n for n in cls.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        if defs:
            return self, defs
        if hops >= MAX_FOLLOW_DEPTH:
            return None
        for base in cls.bases:
            found = self.find_class(base)
            if found and found[1] is not cls:
                hit = found[0].class_method(found[1], name, hops + 1)
                if hit:
                    return hit
        return None

    # the checks -----------------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """Every finding of every rule, in source order, one per code and call."""
        raws: list[_Raw] = []
        raws += self._check_rank_branches()
        raws += self._check_rank_decorators()
        for scope in [self.tree, *(fn for defs in self.functions.values() for fn in defs)]:
            raws += _Flow(self, scope).raws
        raws += self._check_goes_first()
        raws += self._check_threads()
        raws += self._check_api()
        raws += self._check_launch_order()
        return self._to_findings(raws)

    def _to_findings(self, raws: list[_Raw]) -> list[Finding]:
        seen, findings = set(), []
        for raw in sorted(raws, key=lambda r: (r.node.lineno, r.node.col_offset, r.code)):
            key = (raw.code, raw.node.lineno, raw.node.col_offset)
            if key in seen:
                continue
            seen.add(key)
            cell, line = self.parsed.locate(raw.node.lineno)
            findings.append(Finding(raw.code, self.parsed.file, line, raw.message,
                                    raw.fix or RULES[raw.code], cell))
        return findings

    def _check_rank_branches(self) -> Iterator[_Raw]:
        """MAIN_ONLY_COLLECTIVE and ONE_SIDED_BARRIER: collectives on one side of a rank-dependent if.

        In a function's (or the file's) own body, ``if not main: return`` followed by a collective
        counts as an if/else; exits from loops are DIVERGENT_BREAK's business.
        """
        scope_bodies = {id(self.tree.body)} | {id(fn.body) for defs in self.functions.values() for fn in defs}
        for block in _blocks(self.of(*_BLOCK_OWNERS)):
            for index, stmt in enumerate(block):
                if isinstance(stmt, ast.If) and self.rank_source(stmt.test):
                    rest = block[index + 1:] if id(block) in scope_bodies else []
                    yield from self._compare_sides(stmt, rest)
        for node in self.of(ast.IfExp):
            if self.rank_source(node.test):
                yield from self._compare_sides(node, [])

    def _compare_sides(self, node: ast.If | ast.IfExp, rest: list[ast.stmt]) -> Iterator[_Raw]:
        if isinstance(node, ast.IfExp):
            taken, other = [node.body], [node.orelse]
        else:
            taken, other = list(node.body), list(node.orelse)
            if _returns(node.body) and not _returns(node.orelse):
                other = other + rest  # guard clause: the other ranks go on with the rest
            elif _returns(node.orelse) and not _returns(node.body):
                taken = taken + rest
        test, truth = node.test, True
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, truth = test.operand, False
        sides = [(self.profile(taken), truth), (self.profile(other), not truth)]
        for (mine, when), (theirs, _) in (sides, sides[::-1]):
            for key in mine.keys() - theirs.keys():
                for op, call in mine[key]:
                    yield self._one_sided(op, call, test, when, node.lineno)

    def _one_sided(self, op: _Op, call: ast.Call, test: ast.expr, when: bool, line: int) -> _Raw:
        where = f"ranks where `{_text(test)}` is {'true' if when else 'false'} ({self.parsed.where(line)})"
        if op.key == "barrier":
            return _Raw("ONE_SIDED_BARRIER", call,
                        f"`{op.text}` {op.why}, reached only on {where}; the other path has no barrier, so "
                        "those ranks never arrive and the ranks waiting in it hang.")
        return _Raw("MAIN_ONLY_COLLECTIVE", call,
                    f"`{op.text}` {op.why}, but it runs only on {where}: the other ranks never call it and "
                    "the job hangs.", self._main_only_fix(op))

    @staticmethod
    def _main_only_fix(op: _Op) -> str:
        saving = op.key in ("accelerate.get_state_dict", "accelerate.save_model", "accelerate.save_state")
        return (SAVE_FIX if saving else "") + RULES["MAIN_ONLY_COLLECTIVE"]

    def _check_goes_first(self) -> Iterator[_Raw]:
        """COLLECTIVE_IN_MAIN_FIRST: a collective inside ``with ...main_process_first():`` (accelerate's,
        transformers' TrainingArguments'): the block runs on the main process while the other ranks
        wait in a barrier (accelerate state.py ``_goes_first``), then on them, so the collective meets
        their barrier. A barrier inside pairs with theirs and hangs nothing (it only lets every rank
        run the block at once): not flagged."""
        for node in self.of(ast.With, ast.AsyncWith):
            first = next((item.context_expr for item in node.items if isinstance(item.context_expr, ast.Call)
                          and getattr(item.context_expr.func, "attr", None) in _GOES_FIRST), None)
            if first is None:
                continue
            for op, call in self.ordered(node.body):
                if getattr(call.func, "attr", None) in _GOES_FIRST or op.key == "barrier":
                    continue  # a nested block: its own finding; a barrier pairs with the others' own
                yield _Raw("COLLECTIVE_IN_MAIN_FIRST", call,
                           f"`{op.text}` {op.why}, inside `with {_text(first)}:` "
                           f"({self.parsed.where(node.lineno)}), which runs its block on the main process "
                           "while the other ranks wait in a barrier: the collective meets that barrier "
                           "and the job hangs.")

    def _check_threads(self) -> Iterator[_Raw]:
        """COLLECTIVE_IN_THREAD: a collective without ``group=`` in a function of this file started as
        a thread (``threading.Thread(target=f)``, ``threading.Timer(s, f)``), while the file issues
        collectives (``backward`` included: DDP's all-reduce) outside what that function reaches. The
        two threads' calls reach the default group in whichever order they run on each rank."""
        starts = [(start, target.id) for start in self.of(ast.Call)
                  if (target := _thread_target(start, self.canonical(start.func))) is not None
                  and target.id in self.functions and target.id not in self.methods_only]
        runs = {name: self._ops_in(self._reached_from(name)) for _, name in starts}
        in_threads = [pair for ops in runs.values() for pair in ops]
        on_default = [pair for pair in self._all_ops
                      if not self.callee(pair[1]) and self._default_group(pair[1])]
        for start, name in starts:
            others = [pair for pair in on_default if pair not in runs[name]]
            if not others or self._joined_alone(start):
                continue  # every collective on the default group runs in that thread, or runs after it
            other_op, other = next((pair for pair in others if pair not in in_threads), others[0])
            for op, call in runs[name]:
                if (op, call) not in on_default:
                    continue  # its own group; a call of a function of the file: flagged inside it
                scope = self.scope_of[id(call)]
                inside = f"`{name}`" if getattr(scope, "name", name) == name else \
                    f"`{scope.name}`, which `{name}` calls,"
                yield _Raw("COLLECTIVE_IN_THREAD", call,
                           f"`{op.text}` {op.why}, in {inside} run as a thread of its own "
                           f"(`{_text(start)}`, {self.parsed.where(start.lineno)}), while this file issues "
                           f"collectives on the same group outside it (`{other_op.text}`, "
                           f"{self.parsed.where(other.lineno)}): the two threads' calls reach the group in "
                           "an order that differs from rank to rank, and the ranks pair different calls "
                           "(a hang, or gloo ending a rank on sizes that differ).")

    def _default_group(self, call: ast.Call) -> bool:
        """Does a collective call run on the default group (no group passed, or ``group=None``)?"""
        group = next((keyword.value for keyword in call.keywords if keyword.arg == "group"), None)
        canon = self.canonical(call.func) or ""
        position = GROUP_POSITION.get(canon.rsplit(".", 1)[-1]) if canon.startswith("torch.distributed.") \
            else None
        if group is None and position is not None and len(call.args) > position:
            group = call.args[position]
        return group is None or (isinstance(group, ast.Constant) and group.value is None)

    def _ops_in(self, names: set[str]) -> list[tuple[_Op, ast.Call]]:
        """The file's collective calls inside the functions named."""
        defs = [fn for name in names for fn in self.functions[name]]
        return [(op, call) for op, call in self._all_ops
                if any(fn.lineno <= call.lineno <= (fn.end_lineno or fn.lineno) for fn in defs)]

    def _joined_alone(self, start: ast.Call) -> bool:
        """Is the thread made by ``start`` (``worker = threading.Thread(...)``) joined in the same
        scope (``worker.join()``) with no collective between the two: its calls, then the others'?"""
        made = next((node.targets[0].id for node in self.of(ast.Assign) if node.value is start
                     and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)), None)
        scope = self.scope_of[id(start)]
        joins = [call.lineno for call in self.calls_in[id(scope)]
                 if _dotted(call.func) == f"{made}.join" and call.lineno > start.lineno]
        if made is None or not joins:
            return False
        return not any(self.scope_of[id(call)] is scope and start.lineno < call.lineno < min(joins)
                       for _op, call in self._all_ops)

    def _reached_from(self, name: str) -> set[str]:
        """The functions of this file that ``name`` runs, itself included (by the names it calls)."""
        reached, todo = {name}, [name]
        while todo:
            for call in self.fn_calls.get(todo.pop(), []):
                callee = self.callee(call)
                if callee is not None and callee not in reached:
                    reached.add(callee)
                    todo.append(callee)
        return reached

    def _check_rank_decorators(self) -> Iterator[_Raw]:
        for defs in self.functions.values():
            for fn in defs:
                decorator = _rank_decorator(fn)
                if decorator is None:
                    continue
                for op, call in self.ordered(fn.body):
                    message = (f"`{op.text}` {op.why}, but `{fn.name}` is decorated with `@{decorator}`, so "
                               "only that process runs it: the other ranks never call it and the job hangs.")
                    yield _Raw("MAIN_ONLY_COLLECTIVE", call, message, self._main_only_fix(op))

    def _check_api(self) -> Iterator[_Raw]:
        """NONEXISTENT_API: attributes of an Accelerator and names of accelerate that do not exist."""
        api = _accelerate_api()
        for node in self.of(ast.Attribute, ast.ImportFrom):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                if self.is_accelerator(node.value) and _dotted(node.value) not in self.states:
                    yield from self._check_accelerator_attr(node, api)
                elif (self.canonical(node.value) or "") in ("accelerate", "accelerate.utils") and api:
                    yield from self._check_module_name(node, self.canonical(node.value), node.attr, api)
            elif isinstance(node, ast.ImportFrom) and node.module in ("accelerate", "accelerate.utils") \
                    and node.level == 0 and api:
                for alias in node.names:
                    yield from self._check_module_name(node, node.module, alias.name, api)

    def _check_accelerator_attr(self, node: ast.Attribute, api: _AccelerateApi | None) -> Iterator[_Raw]:
        attr, text = node.attr, _text(node)
        version = f"accelerate {api.version}'s Accelerator" if api else "an Accelerator"
        right = MISREMEMBERED.get(attr)
        if right is None:
            if api is None or attr.startswith("_") or attr in api.accelerator:
                return
            right = next(iter(difflib.get_close_matches(attr, sorted(api.accelerator), n=1)), "")
        hint = f"; the name is `{right}`." if right else "."
        yield _Raw("NONEXISTENT_API", node, f"`{text}` does not exist: {version} has no `{attr}`{hint}",
                   _api_fix(f"{_dotted(node.value)}.{right}" if right else ""))

    def _check_module_name(self, node: ast.AST, module: str, name: str,
                           api: _AccelerateApi) -> Iterator[_Raw]:
        names = api.modules[module]
        if name in names or name == "*":
            return
        if name in api.accelerator or name in MISREMEMBERED:
            right = f"accelerator.{MISREMEMBERED.get(name, name)}"
            hint = f"; it is an Accelerator method: `{right}`"
        else:
            right = next(iter(difflib.get_close_matches(name, sorted(names), n=1)), "")
            right = right and f"{module}.{right}"
            hint = f"; did you mean `{right}`?" if right else ""
        message = f"`{module}.{name}` does not exist in accelerate {api.version}{hint}."
        yield _Raw("NONEXISTENT_API", node, message, _api_fix(right))

    def _check_launch_order(self) -> Iterator[_Raw]:
        """CUDA_BEFORE_LAUNCH: top-level code touching CUDA or building an Accelerator before the launcher."""
        top = list(_shallow(self.tree.body))
        launches = [n for n in top if isinstance(n, ast.Call)
                    and (self.canonical(n.func) or "").rsplit(".", 1)[-1] == "notebook_launcher"]
        if not launches:
            return
        last = max(launches, key=lambda n: (n.lineno, n.col_offset))
        end = (last.end_lineno or last.lineno, last.end_col_offset or 0)
        devices = self._cuda_device_names(top)
        for node in top:
            if not isinstance(node, (ast.Call, ast.Import, ast.ImportFrom)) or node is last \
                    or (node.lineno, node.col_offset) >= end:
                continue
            reason = self._before_launch(node, devices)
            if reason:
                where = f"at top level before notebook_launcher ({self.parsed.where(last.lineno)})"
                yield _Raw("CUDA_BEFORE_LAUNCH", node, f"{reason}, {where}")

    def _before_launch(self, node: ast.AST, devices: set[str]) -> str | None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "bitsandbytes" for m in modules):
                return ("bitsandbytes initialises the GPU on import, and notebook_launcher refuses to start "
                        "once it is imported (accelerate launchers.py)")
            return None
        if not isinstance(node, ast.Call):
            return None
        touch = self._cuda_touch(node, devices)
        if touch:
            return touch
        canon = self.canonical(node.func) or ""
        if canon.startswith("accelerate") and canon.endswith(".Accelerator"):
            return ("an Accelerator created in the notebook process makes notebook_launcher refuse to start "
                    "('the Accelerator should only be initialized inside your training function', "
                    "accelerate launchers.py)")
        name = self.callee(node)
        if name in self.cuda_fns:
            inner, line, _ = self.cuda_fns[name]
            return f"`{name}()` runs `{inner}` ({self.parsed.where(line)}), which touches CUDA"
        return None

    def _cuda_device_names(self, top: list[ast.AST]) -> set[str]:
        names: set[str] = set()
        for node in top:
            if isinstance(node, ast.Assign) and self._is_cuda_value(node.value, names):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return names

    def _is_cuda_value(self, node: ast.AST, devices: set[str]) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and node.value.startswith("cuda")
        if isinstance(node, ast.Name):
            return node.id in devices
        if isinstance(node, ast.Call) and self.canonical(node.func) == "torch.device" and node.args:
            return self._is_cuda_value(node.args[0], devices)
        return False

    def _cuda_touch(self, call: ast.Call, devices: set[str] | None = None) -> str | None:
        """How ``call`` initialises CUDA, or None."""
        devices = devices or set()
        canon = self.canonical(call.func) or ""
        method = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        device = [k.value for k in call.keywords if k.arg == "device"]
        text = _text(call) if canon.startswith("torch.cuda.") or method in ("cuda", "to") or device else ""
        if canon.startswith("torch.cuda.") and canon.rsplit(".", 1)[-1] not in CUDA_SAFE:
            if canon == "torch.cuda.is_available":
                return (f"`{text}` initialises the CUDA driver (cuInit) unless "
                        "PYTORCH_NVML_BASED_CUDA_CHECK=1 (torch/cuda/__init__.py)")
            return f"`{text}` uses torch.cuda"
        if method == "cuda" and not canon.startswith("torch."):
            return f"`{text}` moves to the GPU"
        values = [*(call.args if method == "to" else []), *device]
        if any(self._is_cuda_value(value, devices) for value in values):
            return f"`{text}` puts a tensor on the GPU"
        return None


def _key(op: str) -> str:
    """What must match across branches: the op, with every kind of barrier as one."""
    return "barrier" if op in BARRIERS else op


def _api_fix(right: str) -> str:
    if not right:
        return RULES["NONEXISTENT_API"]
    trigger = "trigger" in right
    return f"Use `{right}`." + (f" {TRIGGER_FIX}" if trigger else "")


def _thread_target(call: ast.Call, name: str | None) -> ast.Name | None:
    """The function a ``threading.Thread(target=f)`` or ``threading.Timer(s, f)`` call runs, by name."""
    if name == "threading.Thread":
        target = next((k.value for k in call.keywords if k.arg == "target"), None)
    elif name == "threading.Timer":
        target = next((k.value for k in call.keywords if k.arg == "function"),
                      call.args[1] if len(call.args) > 1 else None)
    else:
        return None
    return target if isinstance(target, ast.Name) else None


def _rank_env_read(node: ast.AST) -> bool:
    """``os.environ["RANK"]``, ``os.environ.get("LOCAL_RANK")``, ``os.getenv("RANK")``: the value, not
    ``"RANK" in os.environ`` (set on every rank alike)."""
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("get", "getenv", "pop") and node.args:
        key = node.args[0]
    else:
        return False
    return isinstance(key, ast.Constant) and key.value in RANK_ENV


def _rank_decorator(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr in RANK_DECORATORS:
            return _text(decorator)
    return None


def _import_aliases(imports: Iterable[ast.AST]) -> dict[str, str]:
    """Local name -> what it was imported as: ``dist`` -> ``torch.distributed``."""
    aliases: dict[str, str] = {}
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    aliases[head] = head
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            # relative imports keep their dots: `from .evalmod import evaluate` -> `.evalmod.evaluate`
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                joined = f"{module}.{alias.name}" if node.module else f"{module}{alias.name}"
                aliases[alias.asname or alias.name] = joined
    return aliases


# --- values that differ between ranks, and exits that depend on them -----------------------------


class _Flow:
    """Walk one scope in order, tracking which names may hold a different value on each rank.

    Sources: the rank itself, each rank's batches, timers and random numbers, and anything computed
    from them or assigned under a condition on them. ``x = accelerator.reduce(...)`` (gather,
    check_trigger, ``dist.all_reduce(x)``...) makes ``x`` the same everywhere again. Exits from a
    loop that runs collectives, taken on such a value, are DIVERGENT_BREAK findings.
    """

    def __init__(self, mod: _Module, scope: ast.AST, params_vary: bool | frozenset[str] = False,
                 emit: bool = True):
        # emit=False: only work out whether the scope's return value varies (no findings);
        # params_vary: the parameters given rank-varying values (True: all of them)
        self.mod, self.emit = mod, emit
        self.loops: list[_Loop] = []
        self.guards: list[_Guard] = []
        self.raws: list[_Raw] = []
        self.returns_vary = False
        self.sources: dict[str, _Source] = {}  # varying name -> the call its value came from
        self.call_sources: dict[int, _Source] = {}
        self.function = scope if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        state: set[str] = set()
        self.params: set[str] = set()
        if self.function is not None:  # parameters named like a batch or a loss differ between ranks
            args = self.function.args
            self.params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                                           args.kwarg] if a is not None}
            given = params_vary if isinstance(params_vary, frozenset) else frozenset()
            defaulted = _with_defaults(args)  # best_loss=float("inf"): a setting, whatever its name
            state = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
                     if a is not None and a.arg not in ("self", "cls")
                     and (params_vary is True or a.arg in given
                          or (_words(a.arg) & ITEM_WORDS and a.arg not in defaulted))}
        self.block(scope.body, state)

    # expressions ----------------------------------------------------------------------------------

    def why(self, node: ast.AST | None, state: set[str]) -> str | None:
        """The part of ``node`` that can differ between ranks (as text), or None."""
        if node is None or isinstance(node, ast.Lambda):
            return None
        if isinstance(node, ast.Constant):
            return None
        if _rank_env_read(node):
            return _text(node)
        if isinstance(node, ast.Name):
            hit = node.id in state or node.id in RANK_NAMES or node.id in self.mod.rank_names
            return node.id if hit else None
        if isinstance(node, ast.Attribute):
            key = _dotted(node)
            if (key and key in state) or node.attr in RANK_ATTRS:
                return key or node.attr
            return None if self.mod.is_accelerator(node.value) else self.why(node.value, state)
        if isinstance(node, ast.Call):
            return self.call_why(node, state)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self.comprehension_why(node, state)
        return self.first_why(ast.iter_child_nodes(node), state)

    def comprehension_why(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp,
                          state: set[str]) -> str | None:
        """Like a for loop: items of a dataloader differ, ``[gather(model(b)) for b in loader]`` does not."""
        inner = set(state)
        for gen in node.generators:
            self.iteration(gen.target, gen.iter, inner)
            found = self.first_why(gen.ifs, inner)  # a filter on per-rank data: the length differs
            if found:
                return found
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        return self.first_why(parts, inner)

    def first_why(self, nodes: Iterable[ast.AST], state: set[str]) -> str | None:
        for child in nodes:
            child = child.value if isinstance(child, ast.keyword) else child
            if isinstance(child, ast.comprehension):
                found = self.first_why([child.iter, *child.ifs], state)
            elif isinstance(child, ast.expr):
                found = self.why(child, state)
            else:
                found = None
            if found:
                return found
        return None

    def call_why(self, call: ast.Call, state: set[str]) -> str | None:
        canon = self.mod.canonical(call.func) or ""
        last = canon.rsplit(".", 1)[-1]
        if self.synced(call):
            return None
        if last in RANK_CALLS or canon in VARYING_CALLS or canon.startswith(VARYING_PREFIXES):
            return _text(call)
        args = self.first_why([*call.args, *call.keywords], state)
        name = self.mod.callee(call)
        if name is not None and isinstance(call.func, ast.Name):
            if name in self.params:  # a parameter of the same name hides the function
                name = None
            else:
                defs = [fn for fn in self.mod.functions[name]
                        if not isinstance(self.mod.scope_of[id(fn)], ast.ClassDef)]
        elif name is not None:
            defs = self.mod.functions[name]
        hit = (self.mod, defs) if name is not None else self.mod.target(call)
        if hit is not None:  # a function the lint can read: follow it
            mod, fns = hit
            varying = next((fn for fn in fns if mod.returns_vary(fn, self.bind(fn, call, state))), None)
            if varying is None:
                return None
            callee = name or _dotted(call.func) or varying.name
            where = mod.parsed.where(varying.lineno)
            self.call_sources[id(call)] = _Source(
                _text(call), call.lineno, callee,
                where=where if mod is self.mod else f"{Path(mod.parsed.file).name}, {where}")
            return args or f"{callee}()"
        found = self.why(call.func, state) or args
        if found:
            return found
        data = self.opaque_data(call)
        if data is None:
            return None
        callee = _dotted(call.func) or _text(call.func)
        self.call_sources[id(call)] = _Source(_text(call), call.lineno, callee, data=_text(data))
        return _text(call)

    def opaque_data(self, call: ast.Call) -> ast.expr | None:
        """The dataloader given to a call the lint cannot read (whose result is then this rank's own)."""
        func = call.func
        if isinstance(func, ast.Name) and hasattr(builtins, func.id) and func.id not in CONSUMING_BUILTINS \
                and func.id not in self.mod.functions and func.id not in self.mod.aliases:
            return None  # len(loader): every rank has as many batches
        if isinstance(func, ast.Attribute) and self.mod.is_accelerator(func.value):
            return None  # accelerate's own methods are known (the collectives, prepare...)
        if (_dotted(func) or "").rsplit(".", 1)[-1] in LOADER_WRAPPERS:
            return None  # tqdm(loader), accelerator.prepare(loader): a loader again, not a value
        inputs = [*call.args, *(k.value for k in call.keywords)]
        return next((arg for arg in inputs if self.mod.loader_like(arg)), None)

    def bind(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call,
             state: set[str]) -> frozenset[str] | bool:
        """The parameters of ``fn`` that ``call`` gives a rank-varying value or a dataloader (True: all)."""
        args = fn.args
        positional = [a.arg for a in [*args.posonlyargs, *args.args] if a.arg not in ("self", "cls")]
        named = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        names: set[str] = set()

        def local(node: ast.expr) -> bool:
            return self.mod.loader_like(node) or self.why(node, state) is not None

        for index, arg in enumerate(call.args):
            if isinstance(arg, ast.Starred):
                if local(arg.value):
                    return True
            elif local(arg):
                if index < len(positional):
                    names.add(positional[index])
                elif args.vararg:
                    names.add(args.vararg.arg)
        for keyword in call.keywords:
            if local(keyword.value):
                if keyword.arg is None:
                    return True
                if keyword.arg in named:
                    names.add(keyword.arg)
                elif args.kwarg:
                    names.add(args.kwarg.arg)
        return frozenset(names)

    def source_of(self, node: ast.AST | None, state: set[str]) -> _Source | None:
        """The call a rank-varying value in ``node`` came from, when it is known."""
        if node is None:
            return None
        for inner in _shallow([node]):
            if isinstance(inner, ast.Call) and id(inner) in self.call_sources:
                return self.call_sources[id(inner)]
            key = _dotted(inner) if isinstance(inner, (ast.Name, ast.Attribute)) else None
            if key in state and key in self.sources:
                return self.sources[key]
        return None

    def control_source(self) -> _Source | None:
        return next((g.source for g in reversed(self.guards) if g.why and g.source), None)

    def synced(self, call: ast.Call) -> bool:
        """Whether ``call`` returns the same value on every rank (a gather, reduce, check_trigger...)."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in SYNCED_METHODS:
            return self.mod.is_accelerator(func.value)
        canon = self.mod.canonical(func) or ""
        return canon.startswith("accelerate.") and canon.rsplit(".", 1)[-1] in SYNCED_UTILS

    # statements -----------------------------------------------------------------------------------

    def control(self) -> bool:
        """Is the code under a condition that can differ between ranks (what it assigns differs too)?
        An except handler counts for the exits inside it only: a fallback value it assigns
        (``except OverflowError: perplexity = inf``) is the same wherever the same error is raised."""
        return any(g.why and not isinstance(g.node, ast.ExceptHandler) for g in self.guards)

    def block(self, stmts: list[ast.stmt], state: set[str]) -> set[str]:
        for stmt in stmts:
            state = self.stmt(stmt, state)
        return state

    def stmt(self, node: ast.stmt, state: set[str]) -> set[str]:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            self.assignment(node, state)
        elif isinstance(node, ast.Expr):
            self.effects(node.value, state)
        elif isinstance(node, ast.If):
            return self.branches(node, node.test, [node.body, node.orelse], state)
        elif isinstance(node, ast.Match):
            return self.branches(node, node.subject, [case.body for case in node.cases] + [[]], state)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            return self.loop(node, state)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self.assign(item.optional_vars, self.varies(item.context_expr, state), state)
            return self.block(node.body, state)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            return self.try_block(node, state)
        elif isinstance(node, (ast.Break, ast.Continue, ast.Return)):
            self.exit(node, state)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            state.discard(node.name)
        return state

    def varies(self, node: ast.AST, state: set[str]) -> bool:
        return self.control() or self.why(node, state) is not None

    def assignment(self, node: ast.Assign | ast.AnnAssign | ast.AugAssign, state: set[str]) -> None:
        if node.value is None:
            return
        varies = self.varies(node.value, state)
        if isinstance(node, ast.AugAssign):
            varies = varies or self.why(node.target, state) is not None
        source = None
        if varies:
            source = self.source_of(node.value, state) or self.control_source()
            if isinstance(node, ast.AugAssign):
                source = source or self.source_of(node.target, state)
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            self.assign(target, varies, state, source)

    def assign(self, target: ast.AST, varies: bool, state: set[str], source: _Source | None = None) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.assign(element, varies, state, source)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, varies, state, source)
        elif isinstance(target, ast.Subscript):
            base = _dotted(target.value)
            if base and varies:
                state.add(base)
                self.remember(base, source)
        else:
            key = _dotted(target)
            if key is None:
                return
            if varies:
                state.add(key)
                self.remember(key, source)
            else:
                state.difference_update({k for k in state if k == key or k.startswith(key + ".")})

    def remember(self, key: str, source: _Source | None) -> None:
        if source is not None:
            self.sources[key] = source
        else:
            self.sources.pop(key, None)

    def effects(self, node: ast.expr, state: set[str]) -> None:
        """A call as a statement: in-place synchronisers, and objects fed with rank-varying values."""
        node = node.value if isinstance(node, ast.Await) else node
        if not isinstance(node, ast.Call):
            return
        canon = self.mod.canonical(node.func) or ""
        last = canon.rsplit(".", 1)[-1]
        if canon.startswith(("torch.distributed.", "accelerate.")) and last in INPLACE_SYNC:
            buffers = [*node.args[:1], *(k.value for k in node.keywords[:1])]
            if buffers:
                state.discard(_dotted(buffers[0]) or "")
            return
        func = node.func
        receiver = func.value if isinstance(func, ast.Attribute) else func
        base = _dotted(receiver)
        if base is None or self.mod.is_accelerator(receiver) or base.split(".")[0] in self.mod.aliases \
                or base in self.mod.functions or hasattr(builtins, base):
            return
        if self.control() or self.first_why([*node.args, *node.keywords], state):
            state.add(base)  # early_stopping(val_loss) / stopper.update(val_loss)
            self.remember(base, self.source_of(node, state) or self.control_source())

    def branches(self, node: ast.stmt, test: ast.expr, bodies: list[list[ast.stmt]],
                 state: set[str]) -> set[str]:
        why = self.why(test, state)
        source = self.source_of(test, state) if why else None
        if why and self.emit and isinstance(node, ast.If) and self.mod.rank_source(test) is None:
            self.one_sided(node, why, source)  # a test on the rank itself: MAIN_ONLY_COLLECTIVE's
        self.guards.append(_Guard(node, test, why, len(self.loops), source=source))
        merged: set[str] = set()
        for body in bodies:
            merged |= self.block(body, set(state))
        self.guards.pop()
        return merged

    def one_sided(self, node: ast.If, why: str, source: _Source | None) -> None:
        """DIVERGENT_BRANCH: a collective on one side of an if whose test can differ between ranks
        (the clock, a loss, a batch), a side the other ranks may not take."""
        sides = [self.mod.profile(node.body), self.mod.profile(node.orelse)]
        for mine, theirs in (sides, sides[::-1]):
            for key in mine.keys() - theirs.keys():
                op, call = mine[key][0]
                self.raws.append(_Raw(
                    "DIVERGENT_BRANCH", call,
                    f"`{op.text}` {op.why}, but it runs only where `if {_text(node.test)}` "
                    f"({self.mod.parsed.where(node.lineno)}) takes this side, and `{why}` {UNSYNCED}"
                    f"{self.origin(source)}: ranks that take the other side never call it and the job "
                    "hangs."))

    def try_block(self, node: ast.Try, state: set[str]) -> set[str]:
        merged = self.block(node.body, set(state))
        for handler in node.handlers:
            handled = set(state) | merged
            if handler.name:
                self.assign(ast.Name(handler.name), self.control(), handled)
            caught = _text(handler.type) if handler.type is not None else "Exception"
            raised_alone = not _caught_names(handler) & _ENDINGS  # StopIteration ends every rank's iterator
            self.guards.append(_Guard(handler, handler.type or ast.Name("Exception"),
                                      f"except {caught}" if raised_alone else None, len(self.loops)))
            merged |= self.block(handler.body, handled)
            self.guards.pop()
        merged = self.block(node.orelse, merged)
        return self.block(node.finalbody, merged)

    def loop(self, node: ast.For | ast.AsyncFor | ast.While, state: set[str]) -> set[str]:
        ops = self.mod.ordered(node.body + ([node.test] if isinstance(node, ast.While) else []))
        self.loops.append(_Loop(node, ops[0] if ops else None))
        entry = set(state)
        for _ in range(3):  # loop-carried values: run the body until nothing new varies
            body_state = set(entry)
            if isinstance(node, ast.While):
                why = self.why(node.test, entry)
                self.guards.append(_Guard(node, node.test, why, len(self.loops), for_exits=False,
                                          source=self.source_of(node.test, entry) if why else None))
            else:
                self.iteration(node.target, node.iter, body_state)
            out = self.block(node.body, body_state)
            if isinstance(node, ast.While):
                self.guards.pop()
            if out <= entry:
                break
            entry |= out
        loop = self.loops.pop()
        if isinstance(node, ast.While):
            self.while_exit(node, loop, entry)
        return entry | self.block(node.orelse, set(entry))

    def iteration(self, target: ast.AST, iterable: ast.expr, state: set[str]) -> None:
        """Bind a for-loop target: range/enumerate indices agree across ranks, each rank's batches do not."""
        canon = self.mod.canonical(iterable.func) if isinstance(iterable, ast.Call) else None
        if canon in ("enumerate", "zip") and isinstance(target, ast.Tuple):
            args = iterable.args
            if canon == "enumerate" and len(target.elts) == 2 and args:
                self.assign(target.elts[0], self.control(), state)
                self.iteration(target.elts[1], args[0], state)
                return
            if canon == "zip" and len(target.elts) == len(args):
                for element, arg in zip(target.elts, args, strict=True):
                    self.iteration(element, arg, state)
                return
        uniform = canon == "range" or isinstance(iterable, (ast.List, ast.Tuple, ast.Set))
        varies = self.varies(iterable, state) or (not uniform and (_data_like(iterable)
                                                                    or self.mod.loader_like(iterable)))
        self.assign(target, varies, state)

    def while_exit(self, node: ast.While, loop: _Loop, state: set[str]) -> None:
        why = self.why(node.test, state)
        if self.emit and why and loop.first:
            op, call = loop.first
            self.raws.append(_Raw(
                "DIVERGENT_BREAK", node,
                f"`while {_text(node.test)}` ends a loop that runs collectives (`{op.text}`, "
                f"{self.mod.parsed.where(call.lineno)}) on `{why}`, which {UNSYNCED}"
                f"{self.origin(self.source_of(node.test, state))}: ranks that stay in the "
                f"loop wait forever in `{op.text}`."))

    def origin(self, source: _Source | None) -> str:
        return source.clause(self.mod.parsed.where(source.line)) if source else ""

    def exit(self, node: ast.Break | ast.Continue | ast.Return, state: set[str]) -> None:
        if isinstance(node, ast.Return) and (self.control() or (node.value and self.why(node.value, state))):
            self.returns_vary = True
        if not self.emit:
            return
        word = type(node).__name__.lower()
        if isinstance(node, ast.Return):
            looping = [i for i, loop in enumerate(self.loops) if loop.first]
            if looping:
                self.leave_loop(node, word, self.loops[looping[0]], looping[0] + 1)
            elif self.function is not None:
                self.skip_rest(node, word, self.mod.ordered(self.function.body), 0)
        elif self.loops and self.loops[-1].first:
            if isinstance(node, ast.Break):
                self.leave_loop(node, word, self.loops[-1], len(self.loops))
            else:
                self.skip_rest(node, word, self.mod.ordered(self.loops[-1].node.body), len(self.loops))

    def _guard_clause(self, node: ast.stmt, guard: _Guard) -> bool:
        """``if <rank test>: ...; return`` in the function's own body: _check_rank_branches reports it."""
        if_node = guard.node
        return isinstance(node, ast.Return) and self.function is not None and isinstance(if_node, ast.If) \
            and if_node in self.function.body and node in (if_node.body[-1:] + if_node.orelse[-1:]) \
            and self.mod.rank_source(guard.test) is not None

    def _guard(self, depth: int) -> _Guard | None:
        """The innermost rank-varying condition entered at loop depth ``depth`` or deeper."""
        return next((g for g in reversed(self.guards) if g.why and g.for_exits and g.depth >= depth), None)

    def leave_loop(self, node: ast.stmt, word: str, loop: _Loop, depth: int) -> None:
        guard = self._guard(depth)
        if guard is None or loop.first is None:
            return
        op, call = loop.first
        self.raws.append(_Raw(
            "DIVERGENT_BREAK", node,
            f"`{word}` {self.under(guard)} leaves a loop that runs collectives (`{op.text}`, "
            f"{self.mod.parsed.where(call.lineno)}), and {self.differs(guard)}: ranks that stay in the loop "
            f"wait forever in `{op.text}`."))

    def under(self, guard: _Guard) -> str:
        """"under `if x > 3` (line 7)", or "in `except ValueError:` (line 9)"."""
        if isinstance(guard.node, ast.ExceptHandler):
            return f"in `{guard.why}:` ({self.mod.parsed.where(guard.node.lineno)})"
        return f"under `if {_text(guard.test)}` ({self.mod.parsed.where(guard.test.lineno)})"

    def differs(self, guard: _Guard) -> str:
        """Why the guard's test can differ between ranks."""
        if isinstance(guard.node, ast.ExceptHandler):
            return "an exception can be raised on some ranks alone (out of memory, a bad batch)"
        return f"`{guard.why}` {UNSYNCED}{self.origin(guard.source)}"

    def skip_rest(self, node: ast.stmt, word: str, ops: list[tuple[_Op, ast.Call]], depth: int) -> None:
        guard = self._guard(depth)
        here = (node.lineno, node.col_offset)
        later = [(op, call) for op, call in ops if (call.lineno, call.col_offset) > here]
        if guard is None or not later:
            return
        if self._guard_clause(node, guard):
            return  # `if not main: return` then a collective: MAIN_ONLY_COLLECTIVE or ONE_SIDED_BARRIER
        op, call = later[0]
        self.raws.append(_Raw(
            "DIVERGENT_BREAK", node,
            f"`{word}` {self.under(guard)} skips `{op.text}` ({self.mod.parsed.where(call.lineno)}) on some "
            f"ranks, and {self.differs(guard)}: the ranks that do not skip it wait forever in `{op.text}`."))


def _caught_names(handler: ast.ExceptHandler) -> set[str]:
    """The exception classes an except handler names, by their last name ('StopIteration')."""
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {(_dotted(node) or "").rsplit(".", 1)[-1] for node in types if node is not None}


def _with_defaults(args: ast.arguments) -> set[str]:
    """The names of the parameters given a default value."""
    positional = [*args.posonlyargs, *args.args]
    named = positional[len(positional) - len(args.defaults):] if args.defaults else []
    named += [a for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True) if default is not None]
    return {a.arg for a in named}


_ENDINGS = {"StopIteration", "StopAsyncIteration", "KeyboardInterrupt", "SystemExit", "GeneratorExit"}


# --- accelerate's real names, read from its source without importing it --------------------------


@dataclass(frozen=True)
class _AccelerateApi:
    version: str
    accelerator: frozenset[str]
    modules: dict[str, frozenset[str]]


@functools.lru_cache(maxsize=1)
def _accelerate_api() -> _AccelerateApi | None:
    """The installed accelerate's Accelerator attributes and package names (None when not installed).

    Read with ``ast`` from its source files: importing accelerate would import torch.
    """
    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    try:
        init = (root / "__init__.py").read_text(encoding="utf-8")
        accelerator = ast.parse((root / "accelerator.py").read_text(encoding="utf-8"))
        utils = (root / "utils" / "__init__.py").read_text(encoding="utf-8")
    except (OSError, SyntaxError):
        return None
    version = re.search(r"__version__\s*=\s*[\"']([^\"']+)", init)
    modules = {"accelerate": _package_names(root, init),
               "accelerate.utils": _package_names(root / "utils", utils)}
    return _AccelerateApi(version.group(1) if version else "?", _class_attributes(accelerator, "Accelerator"),
                          modules)


def _class_attributes(tree: ast.Module, name: str) -> frozenset[str]:
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        return frozenset()
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and node in cls.body:
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(names)


def _package_names(folder: Path, init: str) -> frozenset[str]:
    names = {p.stem for p in folder.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    for node in ast.walk(ast.parse(init)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(names)
