"""The loss a profile measures: built in by name, or the user's own function.

The loss is part of the last stage: its time adds to that stage's forward and backward, and what
it saves for backward (cross-entropy keeps a log-softmax the size of the logits) stays on the
last device for every micro-batch in flight. A profile measures it like one more layer.

    mse            mean squared error against a target shaped like the output
    cross_entropy  classes on the last dimension (a language model's tokens x vocabulary
                   flattened), integer targets
    (both read a library model's named outputs' `logits`, else their first value)
    pkg.mod:fn     fn(output, target) -> scalar; profiled with fn.make_target(output) when the
    file.py:fn     function has one, else a random target shaped like the output
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .artifact import InputError
from .limits import ArgumentError

LossFn = Callable[[Any, Any], torch.Tensor]


def read_out(out: Any) -> Any:
    """What a built-in loss reads of a model's output: a library model's named outputs (a
    Hugging Face ModelOutput, a mapping) give their `logits`, else their first value (found by
    a red team: cross_entropy on GPT-2 was refused); anything else as it is."""
    if isinstance(out, Mapping) and not isinstance(out, torch.Tensor):
        if "logits" in out:
            return out["logits"]
        return next(iter(out.values()), out)
    return out


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(read_out(out), target)


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = read_out(out)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _float_target(out: Any) -> Any:
    return torch.randn_like(out) if isinstance(out, torch.Tensor) else None


def _mse_target(out: Any) -> Any:
    return _float_target(read_out(out))  # (a user's own loss gets the output as it is)


def _class_target(out: torch.Tensor) -> torch.Tensor:
    out = read_out(out)
    return torch.randint(0, out.shape[-1], out.shape[:-1], device=out.device)


BUILT_IN: dict[str, tuple[LossFn, Callable[[Any], Any]]] = {
    "mse": (mse, _mse_target),
    "cross_entropy": (cross_entropy, _class_target),
}


@dataclass(frozen=True)
class Loss:
    name: str
    fn: LossFn
    make_target: Callable[[Any], Any]


def resolve_loss(spec: str | LossFn | None, model: nn.Module | None = None) -> Loss | None:
    """`spec` as a Loss; None takes the model's own `example_loss`, if it has one."""
    if spec is None:
        spec = getattr(model, "example_loss", None)
        if spec is None:
            return None
    if callable(spec):
        name = getattr(spec, "__qualname__", type(spec).__name__)
        return Loss(name, spec, getattr(spec, "make_target", _float_target))
    if spec in BUILT_IN:
        fn, target = BUILT_IN[spec]
        return Loss(spec, fn, target)
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name:
        raise ArgumentError(
            "loss_fn",
            spec,
            f"choose {', '.join(BUILT_IN)}, or name a function as package.module:fn or file.py:fn",
        )
    from .models import _import

    fn = getattr(_import(where, spec, "loss"), name, None)
    if fn is None or not callable(fn):
        raise ArgumentError("loss_fn", spec, f"{where} has no callable named {name!r}")
    return Loss(spec, fn, getattr(fn, "make_target", _float_target))


class LossLayer(nn.Module):
    """The loss as a layer the profiler can measure: output -> loss(output, target)."""

    def __init__(self, loss: Loss, target: Any) -> None:
        super().__init__()
        self.loss = loss
        self.target = target

    def forward(self, out: Any) -> torch.Tensor:
        # the pipeline copies the target onto the last stage inside its forward (so nothing
        # holds it between forward and backward), a recomputed one's too: measured so
        value = self.loss.fn(out, _copied(self.target))
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(
                f"the loss {self.loss.name} returned {shape}, not a scalar tensor; "
                "it must average over the samples it is given"
            )
        return value


def _copied(target: Any) -> Any:
    """A fresh copy of every tensor of `target`, as the runtime makes it (codegen/_runtime.py)."""
    if isinstance(target, torch.Tensor):
        return target.clone()
    if isinstance(target, (tuple, list)):
        return type(target)(_copied(t) for t in target)
    return target
