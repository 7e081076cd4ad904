"""make report's landing page and --combine's fleet page, opened in a real (headless) Chromium.

The folders come from real runs (the session fixture ``report_runs``); each page is loaded from
disk with the network cut off (the pages must be self-contained), checked for its headline rows
as a person sees them (rendered text, not the HTML source), and saved as a screenshot to
reports/screenshots/report_index.png and report_fleet.png.
"""

from __future__ import annotations

import json
from typing import Any

from conftest import ReportRuns

from helpers import report

from .conftest import SCREENSHOTS

LAPTOP = {"width": 1280, "height": 800}


def _open(chromium: Any, path: Any) -> tuple[Any, list[str]]:
    """The page at ``path`` in a fresh context that refuses every network request; the requests."""
    context = chromium.new_context(viewport=LAPTOP)
    asked: list[str] = []

    def refuse(route: Any) -> None:
        asked.append(route.request.url)
        route.abort()

    context.route("http*://**", refuse)
    page = context.new_page()
    page.goto(path.as_uri())
    return page, asked


def _rows(page: Any, table: str) -> list[str]:
    return page.locator(f"table.{table} tbody tr").all_inner_texts()


def test_landing_page_in_chromium(report_runs: ReportRuns, chromium: Any):
    summary = json.loads((report_runs.node_a / "summary.json").read_text())
    page, asked = _open(chromium, report_runs.node_a / "index.html")
    try:
        assert page.locator("h1").inner_text().endswith("All 2 notebooks passed")
        rows = _rows(page, "notebooks")
        assert len(rows) == len(summary["notebooks"]) == 2
        for row, run in zip(rows, summary["notebooks"], strict=True):
            assert run["name"] in row and run["headline"] in " ".join(row.split()), row
        assert summary["machine"]["torch"] in page.locator("dl.machine").inner_text()
        assert page.locator("table.findings tbody tr").count() >= 1
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= LAPTOP["width"], f"the page is {width} px wide: a laptop scrolls sideways"
        report.atomic_write_bytes(SCREENSHOTS / "report_index.png", page.screenshot(full_page=True))
    finally:
        page.context.close()
    assert not asked, f"the page asked the network for {asked}"


def test_fleet_page_in_chromium(report_runs: ReportRuns, chromium: Any):
    fleet = json.loads((report_runs.fleet / "summary.json").read_text())
    page, asked = _open(chromium, report_runs.fleet / "index.html")
    try:
        rows = _rows(page, "fleet")
        assert len(rows) == len(fleet["reports"]) == 3
        assert rows[0].split()[0] == "FAIL" and "broken" in rows[0], "failed machines first"
        for row, entry in zip(rows, fleet["reports"], strict=True):
            flat = " ".join(row.split())
            assert entry["label"] in flat
            for run in entry["notebooks"]:
                assert " ".join((run["headline"] or run["error"]).split()) in flat, (entry["label"], run)
        highlighted = page.locator("table.differences td.diff").all_inner_texts()
        assert "WARN" in highlighted, highlighted
        report.atomic_write_bytes(SCREENSHOTS / "report_fleet.png", page.screenshot(full_page=True))
    finally:
        page.context.close()
    assert not asked, f"the page asked the network for {asked}"
