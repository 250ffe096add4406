"""Turn a MODEL name from the command line into a module and a sample input."""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .artifact import InputError
from .limits import ArgumentError

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


USER_ERRORS = (Exception, SystemExit)
"""What a user's factory or module may raise that is reported in one line: anything but Ctrl-C
(a sys.exit() in it too, which would otherwise end the command quietly)."""


def load_model(spec: str) -> nn.Module:
    """`example:NAME`, `package.module:factory` or `path/to/file.py:factory` -> the factory's module."""
    from .examples import EXAMPLES

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise InputError(
            f"MODEL {spec!r}: expected example:NAME, package.module:factory or file.py:factory"
        )
    if where == "example":
        if name not in EXAMPLES:
            raise InputError(
                f"MODEL {spec!r}: no such example; choose one of {', '.join(sorted(EXAMPLES))}"
            )
        factory = EXAMPLES[name]
    else:
        module = _import(where, spec)
        factory = getattr(module, name, None)
        if factory is None or not callable(factory):
            raise InputError(f"MODEL {spec!r}: {where} has no callable named {name!r}")
    try:
        model = factory()
    except USER_ERRORS as e:  # the user's code: report it in one line, whatever it raised
        raise InputError(f"MODEL {spec!r}: the factory raised {type(e).__name__}: {e}") from None
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[1], dict):
        from .graph import CaptureError, with_inputs

        try:
            model = with_inputs(*model)
        except CaptureError as e:
            raise InputError(f"MODEL {spec!r}: {e}") from None
    if not isinstance(model, nn.Module):
        raise InputError(
            f"MODEL {spec!r}: the factory returned {type(model).__name__}, not a torch nn.Module"
        )
    return model


class _Beside(importlib.abc.MetaPathFinder):
    """The modules beside a model's file, importable as `python file.py` has them (found by a
    red team: `import helper` beside the model failed), but only by a name nothing else
    provides: after every other finder, so that a file there named like a package gpipe-plan
    imports later (its own, installed editable, included: a cold review's) hides nothing."""

    def __init__(self) -> None:
        self.folders: list[str] = []

    def add(self, folder: str) -> None:
        if folder not in self.folders:
            self.folders.append(folder)
        if self not in sys.meta_path:
            sys.meta_path.append(self)

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if path is not None:  # (a package's submodule: its package finds it)
            return None
        return importlib.machinery.PathFinder.find_spec(name, self.folders)


_BESIDE = _Beside()


def _import(where: str, spec: str, what: str = "MODEL") -> object:
    """The module `where` (a file.py or a dotted name) that `spec` names; `what` says which
    argument named it in a message (MODEL, or --loss)."""
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise InputError(f"{what} {spec!r}: no such file {where}")
        name = f"_gpipe_user_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise InputError(f"{what} {spec!r}: cannot import {where}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        _BESIDE.add(str(path.resolve().parent))
        try:
            module_spec.loader.exec_module(module)
        except USER_ERRORS as e:
            sys.modules.pop(name, None)
            raise InputError(
                f"{what} {spec!r}: importing {where} raised {type(e).__name__}: {e}"
            ) from None
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise InputError(f"{what} {spec!r}: cannot import {where} ({e})") from None
    except USER_ERRORS as e:
        raise InputError(
            f"{what} {spec!r}: importing {where} raised {type(e).__name__}: {e}"
        ) from None


def sample_input(
    model: nn.Module, input_shape: list[int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """The sample to profile with: a float tensor of `input_shape` (batch first), or the model's
    own `example_input` (resized along the batch when a shape is given for it)."""
    example = getattr(model, "example_input", None)
    if input_shape is None:
        if not isinstance(example, torch.Tensor):
            what = (
                "no example_input"
                if example is None
                else f"an example_input that is a {type(example).__name__}, not the one input "
                "tensor gpipe-plan pipelines"
            )
            raise ArgumentError(
                "input_shape",
                None,
                f"is required: the model carries {what} (give the full input shape, batch "
                "first, e.g. 8,128 for 8 samples of 128 features)",
                missing=True,
            )
        return example if not example.is_floating_point() else example.to(dtype)
    if any(d <= 0 for d in input_shape) or len(input_shape) < 1:
        raise ArgumentError("input_shape", input_shape, "every dimension must be positive")
    numel = math.prod(input_shape)
    check_allocation(numel * torch.empty((), dtype=dtype).element_size(), torch.device("cpu"),
                     f"an input of shape {input_shape}")  # fmt: skip
    if isinstance(example, torch.Tensor) and not example.is_floating_point():
        high = int(example.max().item()) + 1
        return torch.randint(0, max(high, 1), tuple(input_shape), dtype=example.dtype)
    return torch.randn(*input_shape, dtype=dtype)


def in_dtype(model: Any, dtype: str) -> Any:
    """The model (or the module of a (module, keyword inputs) pair) with its floating-point
    parameters and buffers in `dtype`, as `gpipe-plan profile --dtype` measured it."""
    module = model[0] if isinstance(model, tuple) else model
    if dtype not in DTYPES:  # (a file's field allows any torch dtype; profile takes these)
        raise InputError(
            f"dtype {dtype!r}: a model's parameters are profiled in {', '.join(DTYPES)}; "
            "profile and plan again"
        )
    if any(p.is_floating_point() for p in module.parameters()):  # (float32 too: profile casts)
        module.to(DTYPES[dtype])
    return model


def as_layers(model: nn.Module, sample: torch.Tensor) -> nn.Sequential:
    """The model as a sequence of layers: an nn.Sequential as it is, any other module with its
    graph captured on `sample` (profiler/graph.py)."""
    if isinstance(model, nn.Sequential):
        return model
    from .graph import CaptureError, capture

    try:
        return capture(model, sample)
    except CaptureError as e:
        raise InputError(str(e)) from None


def capture_sample(model: nn.Module, input_shape: list[int], dtype: str) -> torch.Tensor:
    """Two samples of the planned input, to capture the graph with as the profile did."""
    example = getattr(model, "example_input", None)
    kind = DTYPES.get(dtype) or getattr(torch, dtype)
    size = torch.empty((), dtype=kind).element_size() * 2 * math.prod(input_shape)
    check_allocation(size, torch.device("cpu"), f"two samples of the plan's input {input_shape}")
    if isinstance(example, torch.Tensor) and list(example.shape[1:]) == list(input_shape):
        two = example[:2] if example.shape[0] >= 2 else torch.cat([example, example])
        # in the planned dtype (a profile made with --dtype): as the profile captured it
        return two.to(kind) if two.is_floating_point() else two
    if kind.is_floating_point:
        return torch.randn(2, *input_shape, dtype=kind)
    return torch.zeros(2, *input_shape, dtype=kind)


def check_allocation(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse at once a tensor larger than the device's whole memory (a typo in a shape or a
    batch size), instead of waiting for the allocator, or the kernel's OOM killer, to say so."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    if nbytes > total:
        raise InputError(
            f"{what} would take {nbytes} bytes, more than the {total} bytes of {device} memory; "
            "use a smaller shape or batch size"
        )


def model_digest(model: nn.Module) -> str:
    """What must match between a profile and the model it is used with: layer types and shapes."""
    h = hashlib.sha256()
    for name, layer in model.named_children():
        h.update(f"{name}:{type(layer).__qualname__};".encode())
        if getattr(layer, "captured_layer", False):  # a captured graph: how it was cut, too
            h.update(f"{layer.unit}:{','.join(layer.crossing)};".encode())
        for pname, p in layer.named_parameters():
            h.update(f"{pname}{tuple(p.shape)}{p.dtype};".encode())
        for bname, b in layer.named_buffers():
            h.update(f"{bname}{tuple(b.shape)}{b.dtype};".encode())
    return h.hexdigest()
