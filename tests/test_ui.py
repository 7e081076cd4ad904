"""helpers.ui: the panel's controls feed the same function; errors are shown, never raised."""

from __future__ import annotations

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
