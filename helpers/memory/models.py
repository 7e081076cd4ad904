"""Models for the batch-size explorer: three small built-in ones and the user's own.

A model is named by the ``model`` parameter: ``"mlp"``, ``"conv"``, ``"transformer"``, or
``"path/to/file.py:function"``. Either way it becomes a *factory*: a function with no arguments
that returns ``(model, make_batch)``, where ``make_batch(batch_size)`` returns the model's input
(a tensor, a tuple of positional inputs, or a dict of keyword inputs). The training loss is the
output's ``.loss`` when it has one (Hugging Face models given labels), else the mean of the output.

The built-in models are ordinary ``torch.nn`` models whose memory grows with the batch like real
ones (activations kept for the backward pass), sized so that under the notebook's default budget
(512 MiB) the largest batch that fits is about 1/16 of the default start (4096).

torch is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import params

Factory = Callable[[], tuple[Any, Callable[[int], Any]]]

# Built-in shapes. The sizes are part of the contract with the notebook's defaults (see the module
# docstring); bench/memory_bench.py measures where each limit lies.
MLP_POSITIONS, MLP_WIDTH, MLP_HIDDEN = 1000, 16, 128
CONV_SIDE, CONV_CHANNELS = 70, 8
TRANSFORMER_TOKENS, TRANSFORMER_WIDTH, TRANSFORMER_HEADS, TRANSFORMER_LAYERS = 320, 64, 4, 2


def build_mlp() -> tuple[Any, Callable[[int], Any]]:
    """A 3-layer MLP (ReLU) applied to each of 1000 positions of 16 features, as a transformer's
    feed-forward block is: activations grow with batch x positions."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(MLP_WIDTH, MLP_HIDDEN), nn.ReLU(),
                          nn.Linear(MLP_HIDDEN, MLP_HIDDEN), nn.ReLU(),
                          nn.Linear(MLP_HIDDEN, MLP_WIDTH))
    return model, lambda batch_size: torch.randn(batch_size, MLP_POSITIONS, MLP_WIDTH)


def build_conv() -> tuple[Any, Callable[[int], Any]]:
    """A small conv net on 3x70x70 images: conv-BatchNorm-ReLU twice, pooling, once more, a
    linear classifier."""
    import torch
    from torch import nn

    def block(inputs: int, outputs: int) -> list:
        return [nn.Conv2d(inputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs), nn.ReLU()]

    c = CONV_CHANNELS
    model = nn.Sequential(*block(3, c), *block(c, c), nn.MaxPool2d(2), *block(c, 2 * c),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))
    return model, lambda batch_size: torch.randn(batch_size, 3, CONV_SIDE, CONV_SIDE)


def build_transformer() -> tuple[Any, Callable[[int], Any]]:
    """A 2-layer transformer encoder (width 64, 4 heads) over sequences of 320 tokens."""
    import torch
    from torch import nn

    layer = nn.TransformerEncoderLayer(TRANSFORMER_WIDTH, TRANSFORMER_HEADS, 2 * TRANSFORMER_WIDTH,
                                       dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, TRANSFORMER_LAYERS, enable_nested_tensor=False)
    return model, lambda batch_size: torch.randn(batch_size, TRANSFORMER_TOKENS, TRANSFORMER_WIDTH)


BUILTIN: dict[str, Factory] = {"mlp": build_mlp, "conv": build_conv, "transformer": build_transformer}
ACCEPTED = f"one of {', '.join(repr(name) for name in BUILTIN)} or 'path/to/file.py:function'"


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``model`` parameter: a built-in name, or a file and a function in it."""

    text: str
    path: Path | None = None
    function: str = ""

    @property
    def builtin(self) -> bool:
        """True for the built-in models."""
        return self.path is None


def parse(text: str) -> ModelRef:
    """Parse the ``model`` parameter; ValueError naming ``model`` when it is neither form."""
    text = params.check("model", text)
    if text in BUILTIN:
        return ModelRef(text)
    file_part, sep, function = text.rpartition(":")
    if not sep or not file_part.endswith(".py") or not function.isidentifier():
        raise ValueError(f"model must be {ACCEPTED}; got {text!r}")
    return ModelRef(text, _locate(file_part), function)


def _locate(file_part: str) -> Path:
    """A relative file is looked for in the working folder (the CLI's), then in the repository
    root (where notebook parameters resolve, whatever folder the kernel started in)."""
    path = Path(file_part).expanduser()
    if path.is_absolute() or (Path.cwd() / path).is_file():
        return path.resolve()
    return params.resolve_path(path)


def load(text: str) -> Factory:
    """The factory for ``model``: one clear ValueError for an unknown name, a missing file, a file
    that does not import, or a missing function. Runs the file's top-level code (as ``import`` does).
    """
    ref = parse(text)
    if ref.builtin:
        return BUILTIN[ref.text]
    if not ref.path.is_file():
        raise ValueError(f"model: file not found: {ref.path} (from {ref.text!r})")
    module = _import_file(ref)
    factory = getattr(module, ref.function, None)
    if not callable(factory):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v)
                         and not n.startswith("_") and v.__module__ == module.__name__)
        raise ValueError(f"model: {ref.path.name} has no function {ref.function!r}; "
                         f"functions defined there: {', '.join(defined) or 'none'}")
    return factory


def _import_file(ref: ModelRef) -> Any:
    name = f"helpers_user_model_{abs(hash(str(ref.path))):x}"
    spec = importlib.util.spec_from_file_location(name, ref.path)
    if spec is None or spec.loader is None:
        raise ValueError(f"model: cannot import {ref.path} as Python")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's file is one clear error
        raise ValueError(f"model: importing {ref.path} failed: {type(exc).__name__}: {exc}") from exc
    sys.modules[name] = module
    return module


def unpack(built: Any, text: str) -> tuple[Any, Callable[[int], Any]]:
    """Check that a factory returned ``(model, make_batch)``; ValueError naming ``model`` if not."""
    if not (isinstance(built, tuple) and len(built) == 2 and callable(built[1])
            and hasattr(built[0], "parameters")):
        raise ValueError(f"model: {text!r} must return (model, make_batch) where model is a "
                         f"torch.nn.Module and make_batch(batch_size) returns its input; "
                         f"got {type(built).__name__}")
    return built


def loss_of(output: Any) -> Any:
    """The training loss: ``output.loss`` when present, else the mean of the output tensor."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if hasattr(output, "mean"):
        return output.float().mean()
    raise TypeError(f"the model's output ({type(output).__name__}) has no .loss and is not a tensor")


def call(model: Any, batch: Any) -> Any:
    """Call ``model`` on a batch: a dict as keywords, a tuple/list as positional inputs."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


@dataclass
class Footprint:
    """What a model needs before any activation: weights, gradients and AdamW's two moments."""

    parameters: int
    parameter_bytes: int
    buffer_bytes: int

    @property
    def training_bytes(self) -> int:
        """Weights + gradients + AdamW's exp_avg and exp_avg_sq (each the size of the weights)."""
        return 4 * self.parameter_bytes + self.buffer_bytes


def footprint(factory: Factory, text: str) -> Footprint:
    """Count the model's parameters by building it on torch's ``meta`` device (no memory used;
    on the CPU when the user's code cannot run on ``meta``).

    Raises ValueError naming ``model`` when the factory fails or returns the wrong thing.
    """
    import torch

    try:
        with torch.device("meta"):
            built = factory()
    except Exception:  # noqa: BLE001 - some code cannot run on meta (loading weights): build for real
        built = _build_for_real(factory, text)
    model, _ = unpack(built, text)
    params_ = list(model.parameters())
    return Footprint(
        parameters=sum(p.numel() for p in params_),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params_),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
    )


def _build_for_real(factory: Factory, text: str) -> Any:
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: one clear error
        raise ValueError(f"model: building {text!r} failed: {type(exc).__name__}: {exc}") from exc
