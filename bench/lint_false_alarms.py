"""False alarms of ``helpers.lint`` on real code that is correct, read finding by finding.

Corpora: accelerate's shipped test scripts (``accelerate/test_utils/scripts/``, recursively: real
distributed programs that pass accelerate's CI), the scenario catalog's fixed variants (rendered as
``repro.build_script`` writes them), the ``*_ok`` fixtures with their helper modules, and the
repository's notebooks. Every finding printed here is one to read: on these corpora each is a false
alarm unless judged otherwise (``JUDGED_REAL``). Also counts how often the lint met a call it could
not read that was given a dataloader (the opaque rule), and how often it followed a call into
another file, so that a clean figure says the rule was exercised.

    python bench/lint_false_alarms.py
"""

from __future__ import annotations

import ast
import sys
import tempfile
import time
from pathlib import Path

from helpers import lint

REPO = Path(__file__).resolve().parent.parent
JUDGED_REAL: set[tuple[str, int]] = set()  # (file name, line) of findings read and judged real bugs


def accelerate_scripts() -> list[Path]:
    import importlib.util

    spec = importlib.util.find_spec("accelerate")
    root = Path(list(spec.submodule_search_locations)[0]) / "test_utils" / "scripts"
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def scenario_fixed_variants(folder: Path) -> list[Path]:
    """Each scenario's fixed variant as ``repro.build_script`` writes it: the constant VARIANT = "fixed"
    baked in, the ``if variant == "broken":`` branches still in the text."""
    from helpers import scenarios
    from helpers.repro import script

    return [Path(script.build_script(entry.id, "fixed", out_dir=folder).path)
            for entry in scenarios.SCENARIOS if "fixed" in entry.variants]


def scenario_folded_variants(folder: Path) -> list[Path]:
    """The same, folded as tests/test_lint.py lints them: dead ``variant == "broken"`` branches dropped."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_lint import SCENARIO_FILES, baked

    paths = []
    for source in SCENARIO_FILES:
        path = folder / f"{source.stem}_folded.py"
        path.write_text(baked(source.read_text(), "fixed"))
        paths.append(path)
    return paths


def dead_lines(path: Path) -> set[int]:
    """Lines under ``if variant == "broken":`` (dead in a fixed variant, whose VARIANT is "fixed")."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) \
                and test.left.id.lower() == "variant" and isinstance(test.comparators[0], ast.Constant) \
                and test.comparators[0].value == "broken":
            lines.update(range(node.body[0].lineno, node.body[-1].end_lineno + 1))
    return lines


def ok_fixtures() -> list[Path]:
    root = REPO / "tests" / "fixtures" / "lint"
    return sorted(p for p in root.rglob("*") if p.suffix in (".py", ".ipynb") and "__pycache__" not in p.parts
                  and not p.stem.endswith("_bad"))


def counting() -> dict[str, int]:
    """Wrap the lint's opaque rule and its cross-file following to count how often they fire."""
    counts = {"opaque calls given a dataloader": 0, "calls followed into another file": 0}
    opaque, target = lint._Flow.opaque_data, lint._Module._target

    def opaque_data(self, call):
        found = opaque(self, call)
        counts["opaque calls given a dataloader"] += found is not None
        return found

    def _target(self, call):
        found = target(self, call)
        counts["calls followed into another file"] += found is not None and found[0] is not self
        return found

    lint._Flow.opaque_data, lint._Module._target = opaque_data, _target
    return counts


def main() -> int:
    counts = counting()
    lint.lint_source("x = 1")  # reads accelerate's names once, outside the timings
    false_alarms = 0
    with tempfile.TemporaryDirectory(prefix="lint-fa-") as tmp:
        (Path(tmp) / "rendered").mkdir()
        corpora = {"accelerate test_utils/scripts": accelerate_scripts(),
                   "scenario fixed, rendered": scenario_fixed_variants(Path(tmp) / "rendered"),
                   "scenario fixed, folded": scenario_folded_variants(Path(tmp)),
                   "fixtures (*_ok and helpers)": ok_fixtures(),
                   "notebooks/*.ipynb": sorted((REPO / "notebooks").glob("*.ipynb"))}
        print(f"{'corpus':<32} {'files':>5} {'lines':>6} {'findings':>8} {'DIVERGENT':>9} {'false':>5} "
              f"{'dead':>5} {'ms':>6}")
        for name, paths in corpora.items():
            before = dict(counts)
            start = time.perf_counter()
            result = lint.lint_paths(paths)
            elapsed = time.perf_counter() - start
            lines = sum(p.read_text(encoding="utf-8").count("\n") for p in paths)
            dead = {(f.file, f.line) for f in result.findings if f.line in dead_lines(Path(f.file))}
            wrong = [f for f in result.findings
                     if (Path(f.file).name, f.line) not in JUDGED_REAL and (f.file, f.line) not in dead]
            false_alarms += len(wrong)
            divergent = result.codes().count("DIVERGENT_BREAK")
            print(f"{name:<32} {len(paths):>5} {lines:>6} {len(result.findings):>8} {divergent:>9} "
                  f"{len(wrong):>5} {len(dead):>5} {elapsed * 1000:>6.0f}")
            print("    " + ", ".join(f"{k}: {counts[k] - before[k]}" for k in counts))
            for finding in result.findings:
                kind = "dead code for this variant" if (finding.file, finding.line) in dead else "FALSE ALARM"
                print(f"    [{kind}] {finding.where}: {finding.code} {finding.message[:160]}")
    print(f"false alarms: {false_alarms} (dead: findings inside `if variant == \"broken\":` of a rendered "
          "fixed variant, code the lint cannot know is dead)")
    return 0 if false_alarms == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
