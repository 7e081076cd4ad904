"""helpers.ui: the panel's controls feed the same function; errors are shown, never raised."""

from __future__ import annotations

import datetime

import pytest

from helpers import smoke, ui


def test_panel_runs_the_same_function_with_changed_controls(leftovers):
    panel = ui.panel(smoke.run_smoke, {"num_processes": 1, "max_size_mib": 1, "timeout_s": 60.0,
                                       "check_launcher": False}, title="Smoke test")
    assert set(panel.controls) == {"num_processes", "max_size_mib", "timeout_s", "check_launcher"}
    assert panel.controls["num_processes"].description == "num_processes"
    panel.controls["num_processes"].value = 3  # what a person does with the slider
    result = panel.click()
    assert result.world_size == 3 and result.ok
    assert panel.error is None and panel.status.value == "done"
    assert not panel.button.disabled
    leftovers.check()


def test_panel_shows_bad_values_without_raising():
    panel = ui.panel(smoke.run_smoke, {"num_processes": 2, "max_size_mib": 1, "timeout_s": 60.0})
    panel.controls["timeout_s"].value = -1.0
    panel.click()
    assert panel.error.startswith("ValueError: timeout_s must be a number > 0")
    assert "failed" in panel.status.value and not panel.button.disabled


def test_a_panel_with_several_buttons_runs_the_one_clicked(tmp_path):
    def sizes(num_processes: int, label: str) -> str:
        return f"{label}: {num_processes}"

    panel = ui.panel({"First": lambda num_processes: sizes(num_processes, "first"),
                      "Second": lambda num_processes: sizes(num_processes, "second")},
                     {"num_processes": 2})
    assert [b.description for b in panel.buttons.values()] == ["First", "Second"]
    assert panel.button is panel.buttons["First"] and panel.button.button_style == "primary"
    panel.controls["num_processes"].value = 3
    assert panel.click("Second") == "second: 3" and panel.click() == "first: 3"
    panel.buttons["Second"].click()  # what a person does
    assert panel.result == "second: 3" and panel.status.value == "done"
    assert not any(b.disabled for b in panel.buttons.values())


def _upload(panel, name: str, filename: str, content: bytes) -> None:
    """What the browser sends (ipywidgets 8): a tuple of dicts with the name and the bytes."""
    panel.uploads[name].value = ({"name": filename, "type": "application/json", "size": len(content),
                                  "content": memoryview(content),
                                  "last_modified": datetime.datetime.now(datetime.UTC)},)


def test_an_upload_is_saved_atomically_and_fills_in_its_parameter(tmp_path):
    seen = []
    panel = ui.panel(lambda compare_with: seen.append(compare_with), {"compare_with": ""},
                     uploads={"compare_with": tmp_path / "uploads"})
    content = b'{"schema": 1}'
    _upload(panel, "compare_with", "../other machine.json", content)
    saved = tmp_path / "uploads" / "other machine.json"
    assert saved.read_bytes() == content
    assert panel.controls["compare_with"].value == str(saved) == panel.values["compare_with"]
    assert [p.name for p in (tmp_path / "uploads").iterdir()] == ["other machine.json"]  # no temp left
    panel.click()
    assert seen == [str(saved)]
    panel.controls["compare_with"].value = "typed/by/hand.json"
    _upload(panel, "compare_with", "../other machine.json", content)  # the same file, chosen again
    assert panel.values["compare_with"] == str(saved)


def test_an_upload_goes_where_the_current_values_say_and_a_bad_one_is_shown(tmp_path):
    panel = ui.panel(lambda report_dir, compare_with: None, {"report_dir": str(tmp_path / "a"),
                                                             "compare_with": ""},
                     uploads={"compare_with": lambda values: f"{values['report_dir']}/uploads"})
    panel.controls["report_dir"].value = str(tmp_path / "b")
    _upload(panel, "compare_with", "x.json", b"{}")
    assert panel.values["compare_with"] == str(tmp_path / "b" / "uploads" / "x.json")
    _upload(panel, "compare_with", "..", b"{}")  # raised inside a widget callback: shown, not raised
    assert panel.error == "ValueError: upload: '..' is not a file name"
    assert "failed: ValueError" in panel.status.value
    assert panel.values["compare_with"] == str(tmp_path / "b" / "uploads" / "x.json")


def test_save_upload_refuses_names_that_are_not_files(tmp_path):
    with pytest.raises(ValueError, match="upload: '..' is not a file name"):
        ui.save_upload(tmp_path, "..", b"x")
    assert ui.save_upload(tmp_path, "C:\\Users\\me\\report.json", b"x") == tmp_path / "report.json"
