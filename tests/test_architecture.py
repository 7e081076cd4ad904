"""The shape of ``helpers``: imports flow one way, contracts have one home, light things stay light.

The import graph is read from the source (every import, also inside functions), so a lazy import
cannot hide a circle. Entry points (``__main__.py``) are outside the graph: they may call down
into anything. helpers/README.md draws the same map.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli, collectives, rundir
from helpers.repro import replay

PACKAGE = Path(__file__).resolve().parent.parent / "helpers"

# a concern may import its own layer (without a circle) and the layers below it, never above
LAYERS = [
    {"params", "sites", "collectives", "rundir", "procs", "redact", "report", "cuda_watch", "cli", "ui",
     "scenarios"},
    {"trace"},
    {"launch"},
    {"doctor"},
    {"audit", "lint", "memory", "smoke", "repro", "early_stop"},
    {"suite", "suite_pages"},
]
LAYER_OF = {concern: index for index, layer in enumerate(LAYERS) for concern in layer}


def _modules() -> dict[str, Path]:
    """Every module of helpers by dotted name, entry points left out."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The helpers modules ``path`` imports, anywhere in the file."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name.startswith("helpers")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("helpers"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                targets.add(submodule if submodule in modules else node.module)
    return targets


def _concern(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "helpers"


def _concern_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        source = _concern(name)
        targets = {_concern(target) for target in _imported(path, modules)}
        graph.setdefault(source, set()).update(targets - {source})
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target] if target in path else [node, target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_circle_between_concerns():
    graph = _concern_graph()
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_flow_down_the_layers():
    graph = _concern_graph()
    unknown = set(graph) - set(LAYER_OF) - {"helpers"}
    assert not unknown, f"concerns missing from LAYERS (and from helpers/README.md): {unknown}"
    upward = sorted((source, target) for source, targets in graph.items() for target in targets
                    if source in LAYER_OF and LAYER_OF.get(target, -1) > LAYER_OF[source])
    assert not upward, f"imports up the layers: {upward}"


def test_launch_never_imports_the_doctor():
    modules = _modules()
    for name, path in modules.items():
        if _concern(name) == "launch":
            assert not {t for t in _imported(path, modules) if _concern(t) == "doctor"}, name


def test_light_commands_load_nothing_heavy():
    # `python -m helpers lint` and `facts` start in a fraction of a second: no torch, no launcher
    code = ("import sys, helpers.lint, helpers.cli, helpers.audit; "
            "print(' '.join(m for m in ('torch', 'helpers.launch', 'helpers.trace', 'helpers.doctor', "
            "'multiprocessing', 'ipywidgets') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_one_op_table():
    from helpers import lint
    from helpers.trace import tracer

    assert tracer.OPS is collectives.OPS and tracer.P2P_OPS is collectives.P2P_OPS
    assert set(lint.DIST_COLLECTIVES) == set(collectives.COLLECTIVES)
    # every op a replay can issue is a canonical name the doctor compares by
    canonical = {collectives.canonical_op(name) for name in collectives.OPS}
    assert set(replay.OP_CODE) <= canonical, set(replay.OP_CODE) - canonical
    # and every alias lands on an op of the table
    assert set(collectives.ALIASES.values()) <= set(collectives.OPS)
    assert collectives.canonical_op("gloo:alltoall_base") == "all_to_all_single"


def test_run_folder_names_are_spelled_in_one_module():
    # the run folder's file names are a persisted format: only helpers/rundir.py spells them
    spellings = ("trace-{", "state-{", "stack-{", "result-{", "ctl-{", "pid-{", '"diagnosis.json"',
                 "trace-*", "state-*", "stack-*", "result-*", '"pid-"', '"ctl-"')
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "rundir.py" or "scenarios" in path.parts:
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(PACKAGE)}: {s}" for s in spellings if s in text]
    assert not offenders, offenders
    assert rundir.trace_path("/r", 3) == Path("/r/trace-3.jsonl")
    assert rundir.result_path("/r", 0) == Path("/r/result-0.pkl")


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_answers_help_and_bad_usage_the_same_way(command, capsys):
    # one argparse helper (cli.parse): --help is 0, bad usage 2 with argparse's message, no SystemExit
    assert cli.main([command, "--help"]) == cli.EXIT_OK
    assert cli.main([command, "--no-such-flag"]) == cli.EXIT_USAGE
    assert f"python -m helpers {command}: error: " in capsys.readouterr().err
