"""binder/ and environment.yml declare the same dependencies as pyproject.toml, so they cannot drift."""

from __future__ import annotations

import re
import tomllib

from conftest import REPO


def _requirement(line: str) -> tuple[str, str] | None:
    match = re.match(r"^\s*-?\s*([A-Za-z0-9_.\-]+)\s*([<>=!~].*)?$", line)
    if not match or line.strip().startswith(("#", "-e", "--")):
        return None
    return match.group(1).lower().replace("_", "-"), (match.group(2) or "").strip()


def _pyproject() -> dict[str, str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return dict(filter(None, map(_requirement, data["project"]["dependencies"])))


def _pip_section_of_environment_yml() -> dict[str, str]:
    lines = (REPO / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    pip_lines = [line.strip()[2:] for line in lines[start + 1:] if line.strip().startswith("- ")]
    return dict(filter(None, map(_requirement, pip_lines)))


def _binder() -> dict[str, str]:
    lines = (REPO / "binder" / "requirements.txt").read_text().splitlines()
    return dict(filter(None, map(_requirement, lines)))


def test_environment_yml_matches_pyproject():
    assert _pip_section_of_environment_yml() == _pyproject()
    assert "- -e ." in (REPO / "environment.yml").read_text()


def test_binder_matches_pyproject_and_is_cpu_only():
    assert _binder() == _pyproject()
    text = (REPO / "binder" / "requirements.txt").read_text()
    assert "download.pytorch.org/whl/cpu" in text
    assert (REPO / "binder" / "runtime.txt").read_text().strip() == "python-3.11"
    assert "pip install" in (REPO / "binder" / "postBuild").read_text()
