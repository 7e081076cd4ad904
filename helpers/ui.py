"""The shared widget panel: controls built from the same parameters, buttons, the same functions.

Model/gui split: ``Panel`` keeps the values in a plain dict (``panel.values``) and calls
``run(**values)`` -- the very function the headless cells call -- so everything it does also works
without widgets. The only module of helpers that imports ipywidgets or IPython.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from helpers import params, report

Folder = str | Path | Callable[[dict[str, Any]], str | Path]  # where an upload goes
TOGGLE_MAX = 3  # choices shown as toggle buttons up to this many, else a dropdown


def _widget_for(name: str, value: Any, choices: Sequence[Any] | None = None, dropdown: bool = False):
    """The control for one parameter: numeric choices slide, a few choices toggle, more drop down
    (``dropdown``: always, for a list that changes, such as the jobs running now). A choice may be a
    (label, value) pair."""
    import ipywidgets as widgets

    spec = params.SPECS.get(name)
    style = {"description_width": "initial"}
    common = {"description": name, "style": style}
    options = list(choices or (spec.choices if spec and spec.kind == "choice" else None) or [])
    if options and all(isinstance(o, int | float) and not isinstance(o, bool) for o in options):
        return widgets.SelectionSlider(options=options, value=value, continuous_update=False, **common)
    if options and len(options) <= TOGGLE_MAX and not dropdown:
        return widgets.ToggleButtons(options=options, value=value, **common)
    if options:
        return widgets.Dropdown(options=options, value=value, **common)
    if isinstance(value, bool):
        return widgets.Checkbox(value=value, indent=False, **common)
    if isinstance(value, int) and spec and spec.high is not None and spec.high - (spec.low or 0) <= 64:
        return widgets.IntSlider(value=value, min=int(spec.low or 0), max=int(spec.high), **common)
    if isinstance(value, int):
        return widgets.IntText(value=value, **common)
    if isinstance(value, float):
        return widgets.FloatText(value=value, **common)
    return widgets.Text(value=str(value), **common)


class Panel:
    """Controls for ``defaults`` (name -> starting value), one button per action, an output area.

    ``run`` is a function, or a dict of button label -> function (the first is the main one);
    a click calls it with the validated values, displays the result and keeps it in
    ``panel.result``. Errors (bad values included) are shown in the output area, never raised into
    the kernel. The buttons are disabled while a run is in progress. ``uploads`` maps a path
    parameter to a folder (or a function of the current values giving one): an upload control next
    to it saves the chosen file there (atomically) and puts the saved file's path into the parameter.
    ``dropdown`` names parameters whose choices always drop down (never toggle buttons).
    """

    def __init__(self, run: Callable[..., Any] | dict[str, Callable[..., Any]], defaults: dict[str, Any],
                 choices: dict[str, Sequence[Any]] | None = None, title: str = "",
                 button: str = "Run", show: Callable[[Any], None] | None = None,
                 uploads: dict[str, Folder] | None = None, dropdown: Sequence[str] = ()):
        import ipywidgets as widgets

        self.actions = dict(run) if isinstance(run, dict) else {button: run}
        self.show_fn = show
        self.values: dict[str, Any] = dict(defaults)
        self.result: Any = None
        self.error: str | None = None
        self.controls = {name: _widget_for(name, value, (choices or {}).get(name), name in dropdown)
                         for name, value in defaults.items()}
        for name, control in self.controls.items():
            control.observe(self._on_change(name), names="value")
        self.uploads = {name: self._upload_control(name, folder) for name, folder in (uploads or {}).items()}
        self.buttons = {label: self._button(label, index == 0) for index, label in enumerate(self.actions)}
        self.button = next(iter(self.buttons.values()))  # the main one
        self.status = widgets.HTML(value="")
        self.output = widgets.Output()
        header = [widgets.HTML(f"<b>{title}</b>")] if title else []
        rows = [widgets.VBox([control, self.uploads[name]]) if name in self.uploads else control
                for name, control in self.controls.items()]
        self.widget = widgets.VBox(header + rows + [widgets.HBox([*self.buttons.values(), self.status]),
                                                    self.output])
        self.widget.add_class("helpers-panel")

    def _button(self, label: str, main: bool):
        import ipywidgets as widgets

        button = widgets.Button(description=label, button_style="primary" if main else "",
                                icon="play" if main else "")
        button.on_click(lambda _button: self.click(label))
        return button

    def _upload_control(self, name: str, folder: Folder):
        import ipywidgets as widgets

        upload = widgets.FileUpload(accept=".json", multiple=False, description=f"upload {name}",
                                    layout=widgets.Layout(width="auto"))
        upload.observe(lambda _change: self._on_upload(name, folder, upload), names="value")
        return upload

    def _on_upload(self, name: str, folder: Folder, upload: Any) -> None:
        files = upload.value
        if not files:
            return
        try:
            target = folder(self.values) if callable(folder) else folder
            saved = save_upload(target, files[0]["name"], bytes(files[0]["content"]))
        except (OSError, ValueError) as exc:
            self.output.clear_output()
            with self.output:
                self._show_failure(exc)
            return
        finally:
            upload.value = ()  # choosing the same file again must count as a new upload
        self.controls[name].value = str(saved)  # the observer copies it into self.values
        self.status.value = f"uploaded {saved.name}"

    def _on_change(self, name: str) -> Callable[[dict], None]:
        def update(change: dict) -> None:
            self.values[name] = change["new"]
        return update

    def click(self, label: str | None = None) -> Any:
        """Run one action (the main one by default) with the current values; return the result."""
        action = self.actions[label] if label is not None else next(iter(self.actions.values()))
        self._set_busy(True)
        self.status.value = "running..."
        self.output.clear_output()
        self.error = None
        failed = ""
        try:
            # caught inside the `with`: in a kernel, Output.__exit__ swallows exceptions (it shows
            # the traceback and returns True), so an except outside it would never run there
            with self.output:
                try:
                    self.result = action(**self.values)
                    (self.show_fn or show)(self.result)
                except Exception as exc:  # noqa: BLE001 - shown to the person, never kills the kernel
                    failed = self._show_failure(exc)
            if not failed:
                self.status.value = "done"
        finally:
            self._set_busy(False)
        return self.result

    def _show_failure(self, exc: Exception) -> str:
        """Keep and print the error (a ValueError's message, else the traceback); mark the status."""
        failed = type(exc).__name__
        self.error = f"{failed}: {exc}"
        print(self.error if isinstance(exc, ValueError | OSError) else traceback.format_exc())
        self.status.value = f"<span style='color:#b00'>failed: {failed}</span>"
        return failed

    def _set_busy(self, busy: bool) -> None:
        for button in self.buttons.values():
            button.disabled = busy

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def show(result: Any) -> None:
    """Display a result and, when it has one, its plot (the default of every panel)."""
    from IPython.display import display

    display(result)
    if hasattr(result, "plot"):
        display(result.plot())


def save_upload(folder: str | Path, filename: str, content: bytes) -> Path:
    """Write an uploaded file into ``folder`` (relative to the repository root) atomically.

    Only the file's own name is kept (no folders from the browser); returns the saved path.
    """
    name = Path(filename.replace("\\", "/")).name
    if name in ("", ".", ".."):
        raise ValueError(f"upload: {filename!r} is not a file name")
    return report.atomic_write_bytes(params.resolve_path(folder) / name, content)


def panel(run: Callable[..., Any] | dict[str, Callable[..., Any]], defaults: dict[str, Any],
          **kwargs: Any) -> Panel:
    """Build a ``Panel`` (see its docstring); display it by leaving it last in a cell."""
    return Panel(run, defaults, **kwargs)
