"""profile_model: run an nn.Sequential layer by layer and measure what the planner needs.

Each layer runs on a detached copy of its input, so its forward and backward are timed alone;
the detached copy shares storage with the previous layer's output, which is what lets us see
exactly which saved tensors two neighbouring layers hold in common.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .artifact import InputError
from .models import model_digest
from .types import LayerProfile, Profile, ProfileMeta, Timing

Value = Any  # a tensor or a tuple of tensors: what flows between layers of an nn.Sequential


def profile_model(
    model: nn.Module,
    sample: torch.Tensor,
    device: str | torch.device = "cpu",
    batch_sizes: list[int] | None = None,
    *,
    repeats: int = 5,
    warmup: int = 2,
    model_spec: str = "<python>",
    progress: bool | None = None,
) -> Profile:
    """Measure every layer of `model` at each micro-batch size (default: powers of two up to the
    sample's batch). The model is moved to `device`; `sample` is batch-first."""
    if not isinstance(model, nn.Sequential):
        raise InputError(
            f"{type(model).__name__} is not an nn.Sequential: gpipe-plan partitions a sequence of "
            "layers; wrap yours in nn.Sequential (graph models are not supported yet)"
        )
    if len(model) == 0:
        raise InputError("the model has no layers")
    if repeats < 1 or warmup < 0:
        raise InputError("--repeats must be at least 1 and --warmup at least 0")
    dev = _device(device)
    if sample.dim() < 1 or sample.shape[0] < 1:
        raise InputError("the sample input needs a batch dimension of at least 1")
    sizes = sorted(set(batch_sizes or _default_sizes(sample.shape[0])))
    if sizes[0] < 1:
        raise InputError(f"batch sizes must be positive, got {sizes[0]}")

    was_training = model.training
    model.to(dev).train()
    model_storages = {t.untyped_storage().data_ptr() for t in _state(model)}
    layers = list(model)
    per_size: dict[int, list[dict[str, Any]]] = {}
    show = sys.stderr.isatty() if progress is None else progress
    with _progress(len(sizes) * len(layers), show) as tick:
        for b in sizes:
            x = _resize(sample, b).to(dev)
            rows = []
            prev_saved: dict[int, torch.Tensor] = {}
            for i, layer in enumerate(layers):
                row, x, prev_saved = _measure_layer(
                    i, layer, x, b, dev, model_storages, prev_saved, repeats, warmup
                )
                rows.append(row)
                tick()
            per_size[b] = rows
    model.train(was_training)

    first = per_size[sizes[0]]
    out = []
    for i, layer in enumerate(layers):
        rows = {b: per_size[b][i] for b in sizes}
        out.append(
            LayerProfile(
                index=i,
                name=str(i),
                type=type(layer).__name__,
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                buffer_bytes=sum(t.numel() * t.element_size() for t in layer.buffers()),
                output_shape=first[i]["output_shape"],
                output_bytes=first[i]["output_bytes"] // sizes[0],
                forward_ms={b: r["forward"] for b, r in rows.items()},
                backward_ms={b: r["backward"] for b, r in rows.items()},
                backward_input_ms={b: r["backward_input"] for b, r in rows.items()},
                backward_weight_ms={b: r["backward_weight"] for b, r in rows.items()},
                saved_bytes={b: r["saved"] for b, r in rows.items()},
                shared_bytes={b: r["shared"] for b, r in rows.items()},
                peak_bytes={b: r["peak"] for b, r in rows.items()},
            )
        )
    return Profile(
        model=model_spec,
        model_digest=model_digest(model),
        device=str(dev),
        device_name=_device_name(dev),
        dtype=str(_model_dtype(model)).removeprefix("torch."),
        input_shape=list(sample.shape[1:]),
        input_dtype=str(sample.dtype).removeprefix("torch."),
        input_bytes=sample[:1].numel() * sample.element_size(),
        batch_sizes=sizes,
        layers=out,
        meta=ProfileMeta(
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__,
            warmup=warmup,
            repeats=repeats,
        ),
    )


def _measure_layer(
    i: int,
    layer: nn.Module,
    x: Value,
    b: int,
    dev: torch.device,
    model_storages: set[int],
    prev_saved: dict[int, torch.Tensor],
    repeats: int,
    warmup: int,
) -> tuple[dict[str, Any], Value, dict[int, torch.Tensor]]:
    # The model's own input needs no gradient; between layers it does (it is a stage boundary).
    inp = _detach(x, requires_grad=i > 0)
    # Saved tensors by storage address. Holding them (and the previous layer's) alive until the
    # next layer is measured keeps the allocator from reusing an address for something else.
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in model_storages:
            saved[ptr] = t
        return t

    try:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(inp)
        _check_output(out)
        _backward(out)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - base
        forward = _time(lambda: layer(inp), dev, repeats, warmup)
        backward = _time_backward(layer, inp, dev, repeats, warmup, "full")
        backward_input = _time_backward(layer, inp, dev, repeats, warmup, "input")
        backward_weight = _time_backward(layer, inp, dev, repeats, warmup, "weight")
    except InputError:
        raise
    except Exception as e:
        shape = _shape_text(inp)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"the model rejected input of shape {shape} at layer {i} ({type(layer).__name__}): {msg}"
        ) from None
    finally:
        for p in layer.parameters():
            p.grad = None

    out_bytes = sum(t.numel() * t.element_size() for t in _tensors(out))
    in_bytes = sum(t.numel() * t.element_size() for t in _tensors(inp)) if i > 0 else 0
    saved_bytes = {ptr: t.untyped_storage().nbytes() for ptr, t in saved.items()}
    saved_total = sum(saved_bytes.values())
    if dev.type != "cuda":
        # Without an allocator to ask: the stash, the output, and in backward the output's and
        # the input's gradients.
        peak = saved_total + 2 * out_bytes + in_bytes
    row = {
        "forward": forward,
        "backward": backward,
        "backward_input": backward_input,
        "backward_weight": backward_weight,
        "saved": saved_total,
        "shared": sum(n for ptr, n in saved_bytes.items() if ptr in prev_saved),
        "peak": max(int(peak), 0),
        "output_shape": [list(t.shape[1:]) for t in _tensors(out)],
        "output_bytes": out_bytes,
    }
    return row, _detach(out, requires_grad=False), saved


def _time(fn: Callable[[], object], dev: torch.device, repeats: int, warmup: int) -> Timing:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        samples.append(_elapsed(fn, dev))
    return Timing(median=statistics.median(samples), min=min(samples), max=max(samples))


def _time_backward(
    layer: nn.Module, inp: Value, dev: torch.device, repeats: int, warmup: int, part: str
) -> Timing:
    """Backward of the layer alone: "full"; "input", the input gradient only (zero-bubble I);
    or "weight", the weight gradients only, run the way the compiled pipe runs W (from the
    layer's output, `inputs=` its parameters)."""
    wrt = [t for t in _tensors(inp) if t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    samples = []
    for k in range(warmup + repeats):
        out = layer(inp)
        roots, grads = _backward_args(out)
        if not roots or (part == "input" and not wrt) or (part == "weight" and not params):
            ms = 0.0
        elif part == "input":
            ms = _elapsed(lambda: torch.autograd.grad(roots, wrt, grads, allow_unused=True), dev)  # noqa: B023
        elif part == "weight":
            ms = _elapsed(lambda: torch.autograd.backward(roots, grads, inputs=params), dev)  # noqa: B023
        else:
            ms = _elapsed(lambda: torch.autograd.backward(roots, grads), dev)  # noqa: B023
        if k >= warmup:
            samples.append(ms)
    for p in params:
        p.grad = None
    return Timing(median=statistics.median(samples), min=min(samples), max=max(samples))


def _elapsed(fn: Callable[[], object], dev: torch.device) -> float:
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _backward_args(out: Value) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    roots = [t for t in _tensors(out) if t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def _backward(out: Value) -> None:
    roots, grads = _backward_args(out)
    if roots:
        torch.autograd.backward(roots, grads)


def _tensors(v: Value) -> list[torch.Tensor]:
    return list(v) if isinstance(v, tuple) else [v]


def _check_output(out: Value) -> None:
    if isinstance(out, torch.Tensor):
        return
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return
    raise InputError(
        f"a layer returned {type(out).__name__}; layers must return a tensor or a tuple of tensors"
    )


def _detach(v: Value, requires_grad: bool) -> Value:
    def one(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        return d.requires_grad_(requires_grad and d.is_floating_point())

    return tuple(one(t) for t in v) if isinstance(v, tuple) else one(v)


def _shape_text(v: Value) -> str:
    return ", ".join(str(tuple(t.shape)) for t in _tensors(v))


def _resize(sample: torch.Tensor, b: int) -> torch.Tensor:
    n = sample.shape[0]
    if b <= n:
        return sample[:b].clone()
    reps = -(-b // n)
    return sample.repeat(reps, *([1] * (sample.dim() - 1)))[:b].clone()


def _default_sizes(n: int) -> list[int]:
    sizes, b = [], 1
    while b < n:
        sizes.append(b)
        b *= 2
    return [*sizes, n]


def _state(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"--device {device!r}: not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise InputError(f"--device {device}: only cpu and cuda[:N] are supported")
    return dev


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@contextmanager
def _progress(total: int, show: bool) -> Iterator[Callable[[], None]]:
    if not show:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="profiling", unit="layer", file=sys.stderr, leave=False) as bar:
        yield lambda: bar.update(1)
