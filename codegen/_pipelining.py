# ---------------------------------------------------------------------------------------------
# gpipe-plan on torch.distributed.pipelining's runtime: this rank's PipelineStages, built from
# the plan's split (no tracing), and the plan's schedule given to torch's runtime as the CSV it
# loads (its compute_only layout; torch adds the sends and receives itself).
# ---------------------------------------------------------------------------------------------
from __future__ import annotations  # emit: drop

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous: torch's runtime sends
    the gradient autograd makes for a stage's input as it is, and a send needs a contiguous
    tensor (a cat's backward makes slices; found by a red team: "input tensor has to be
    contiguous", every rank stopped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous(value: Any) -> Any:
    """A stage's output, each tensor contiguous (sent as it is, and its gradient received into
    a buffer shaped like it: a strided view made a strided buffer, which no receive takes)."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, tuple):
        return tuple(_contiguous(v) for v in value)
    return value


class Chained(nn.Module):
    """A stage's layers in turn. torch's runtime hands a stage what the one before returned as
    separate positional tensors; the first layer takes them back as the tuple it was."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any) -> Any:
        args = tuple(
            _ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
            for a in args
        )
        value = args[0] if len(args) == 1 else args
        for layer in self.layers:
            value = layer(value)
        return _contiguous(value)


class Recomputed(nn.Module):
    """A stage that keeps only its input for backward and runs again inside it, under torch's
    checkpoint: at the first saved tensor backward reads, not at its start as the plan counts
    it (the streams and torchrun programs re-run by hand). The reentrant checkpoint re-runs at
    the start, but torch's runtime asks autograd.grad for the stage's input gradients, which
    it refuses."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False)


def tied_across(
    layers: list[nn.Module], stages: list[tuple[int, int]], ranks: list[int]
) -> str | None:
    """Why torch's runtime would train this split wrongly, or None: a parameter that layers
    of stages on two ranks share (tied weights) becomes a copy per rank there, each trained on
    its own stage's gradient alone (torch's PipelineStage sums no gradients across ranks)."""
    owner: dict[int, int] = {}
    for s, (a, b) in enumerate(stages):
        for layer in layers[a:b]:
            for name, p in layer.named_parameters():
                if not p.requires_grad:  # (a frozen copy per rank trains nothing apart)
                    continue
                first = owner.setdefault(id(p), s)
                if ranks[first] != ranks[s]:
                    return (
                        f"stages {first} and {s} share a parameter ({name} of "
                        f"{type(layer).__name__}: tied weights) on ranks {ranks[first]} and "
                        f"{ranks[s]}; torch.distributed.pipelining's runtime would train a copy "
                        "on each rank apart: use --target torchrun"
                    )
    return None


def torch_pipeline(
    layers: list[nn.Module],
    stages: list[tuple[int, int]],
    ranks: list[int],
    recompute: list[str],
    schedule_csv: str,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    rank: int,
    device: torch.device,
) -> tuple[list[Any], Any]:
    """This rank's PipelineStages over `layers` split at `stages` (stage s on rank ranks[s]),
    and torch's schedule runtime loaded with `schedule_csv`: (stages, schedule). Call
    schedule.step(x) on the first stage's rank, schedule.step(target=y, losses=[]) on the
    last's, schedule.step() elsewhere."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    refusal = tied_across(layers, stages, ranks)
    if refusal is not None:
        raise ValueError(refusal)
    for layer in layers:  # (as out_of_place in codegen/_runtime.py: a stage's input is a
        if getattr(layer, "inplace", None) is True:  # tensor autograd does not let change)
            layer.inplace = False
    built = []
    for s, (a, b) in enumerate(stages):
        if ranks[s] != rank:
            continue
        module: nn.Module = Chained(layers[a:b]).to(device)
        if recompute[s] == "always":
            module = Recomputed(module)
        built.append(PipelineStage(module, s, len(stages), device))
    schedule = _PipelineScheduleRuntime(built, n_microbatches=microbatches, loss_fn=loss_fn)
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(schedule_csv)
        schedule._load_csv(path, "compute_only")
    finally:
        os.unlink(path)
    return built, schedule
