"""The shared widget panel: controls built from the same parameters, a Run button, the same function.

Model/gui split: ``Panel`` keeps the values in a plain dict (``panel.values``) and calls
``run(**values)`` -- the very function the headless cells call -- so everything it does also works
without widgets. The only module of helpers that imports ipywidgets or IPython.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

from helpers import params


def _widget_for(name: str, value: Any, choices: Sequence[Any] | None = None):
    import ipywidgets as widgets

    spec = params.SPECS.get(name)
    style = {"description_width": "initial"}
    common = {"description": name, "style": style}
    options = choices or (spec.choices if spec and spec.kind == "choice" else None)
    if options:
        return widgets.Dropdown(options=list(options), value=value, **common)
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
    """Controls for ``defaults`` (name -> starting value), a Run button, an output area.

    ``run(**values)`` is called with the validated values on each click; its result is displayed
    and kept in ``panel.result``. Errors (bad values included) are shown in the output area,
    never raised into the kernel. The button is disabled while a run is in progress.
    """

    def __init__(self, run: Callable[..., Any], defaults: dict[str, Any],
                 choices: dict[str, Sequence[Any]] | None = None, title: str = "",
                 button: str = "Run", show: Callable[[Any], None] | None = None):
        import ipywidgets as widgets

        self.run_fn, self.show_fn = run, show
        self.values: dict[str, Any] = dict(defaults)
        self.result: Any = None
        self.error: str | None = None
        self.controls = {name: _widget_for(name, value, (choices or {}).get(name))
                         for name, value in defaults.items()}
        for name, control in self.controls.items():
            control.observe(self._on_change(name), names="value")
        self.button = widgets.Button(description=button, button_style="primary", icon="play")
        self.button.on_click(lambda _button: self.click())
        self.status = widgets.HTML(value="")
        self.output = widgets.Output()
        header = [widgets.HTML(f"<b>{title}</b>")] if title else []
        self.widget = widgets.VBox(header + list(self.controls.values())
                                   + [widgets.HBox([self.button, self.status]), self.output])
        self.widget.add_class("helpers-panel")

    def _on_change(self, name: str) -> Callable[[dict], None]:
        def update(change: dict) -> None:
            self.values[name] = change["new"]
        return update

    def click(self) -> Any:
        """Run once with the current values (what the Run button does); return the result."""

        self.button.disabled = True
        self.status.value = "running..."
        self.output.clear_output()
        self.error = None
        failed = ""
        try:
            # caught inside the `with`: in a kernel, Output.__exit__ swallows exceptions (it shows
            # the traceback and returns True), so an except outside it would never run there
            with self.output:
                try:
                    self.result = self.run_fn(**self.values)
                    (self.show_fn or show)(self.result)
                except Exception as exc:  # noqa: BLE001 - shown to the person, never kills the kernel
                    failed, self.error = type(exc).__name__, f"{type(exc).__name__}: {exc}"
                    print(self.error if isinstance(exc, ValueError) else traceback.format_exc())
            self.status.value = (f"<span style='color:#b00'>failed: {failed}</span>" if failed
                                 else "done")
        finally:
            self.button.disabled = False
        return self.result

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def show(result: Any) -> None:
    """Display a result and, when it has one, its plot (the default of every panel)."""
    from IPython.display import display

    display(result)
    if hasattr(result, "plot"):
        display(result.plot())


def panel(run: Callable[..., Any], defaults: dict[str, Any], **kwargs: Any) -> Panel:
    """Build a ``Panel`` (see its docstring); display it by leaving it last in a cell."""
    return Panel(run, defaults, **kwargs)
