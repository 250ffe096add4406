"""profile_model: run an nn.Sequential layer by layer and measure what the planner needs.

Each layer runs on a detached copy of its input, so its forward and backward are measured alone;
the detached copy shares storage with the previous layer's output, which is what lets us see
exactly which saved tensors two neighbouring layers hold in common. The loss, when there is one,
is measured the same way as a layer after the last. Times come from profiler/timing.py
(identical layers timed together until stable); memory is read off the allocator
(profiler/memtrack.py), exactly, on CPU as on CUDA.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .artifact import InputError
from .limits import MAX_BATCH, MAX_LAYERS, ArgumentError, real, whole
from .losses import LossFn, LossLayer, resolve_loss
from .memtrack import owned_by, trace_allocations
from .models import as_layers, check_allocation, model_digest
from .overhead import autograd_call_ms, runtime_overhead
from .timing import _tensors, time_layers
from .types import (
    CTX_FIELDS,
    LATER_PER_SIZE,
    PER_SIZE,
    LayerProfile,
    OptimizerStep,
    Profile,
    ProfileMeta,
    TiedParameter,
)

Value = Any  # a tensor or a tuple of tensors: what flows between layers of an nn.Sequential
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


def profile_model(
    model: nn.Module,
    sample: torch.Tensor,
    device: str | torch.device = "cpu",
    batch_sizes: list[int] | None = None,
    *,
    repeats: int = 5,
    warmup: int = 2,
    max_repeats: int | None = None,
    time_budget_s: float = 30.0,
    model_spec: str = "<python>",
    progress: bool | None = None,
    loss_fn: str | LossFn | None = None,
    threads: int | None = None,
    overhead: bool = True,
) -> Profile:
    """Measure every layer of `model` at each micro-batch size (default: powers of two up to the
    sample's batch). The model is moved to `device`; `sample` is batch-first. `max_repeats`: the
    most timed rounds (default 100, or `repeats` where more). `loss_fn`: "mse",
    "cross_entropy", "pkg.mod:fn" or a callable(output, target); None takes the model's own
    `example_loss` if it has one. `threads`: intra-op threads while measuring (as the pipeline
    will run: one per rank under torchrun on CPU). `overhead`: also measure what the pipeline
    runtime adds per action and per step (profiler/overhead.py; on the CPU only: on a GPU the
    runtime's host work overlaps the kernels it queues)."""
    if not isinstance(sample, torch.Tensor) or sample.dim() < 1 or sample.shape[0] < 1:
        raise ArgumentError("sample", type(sample).__name__, "expected a tensor, batch first")
    if not isinstance(model, nn.Module):
        raise ArgumentError("model", type(model).__name__, "expected a torch nn.Module")
    model = as_layers(model, sample)
    if len(model) == 0:
        raise InputError("the model has no layers")
    if len(model) > MAX_LAYERS:
        raise ArgumentError("model", f"{len(model)} layers", f"more than {MAX_LAYERS} layers")
    whole(repeats, "repeats", 1, 10_000)
    whole(warmup, "warmup", 0, 1000)
    if max_repeats is None:
        max_repeats = max(repeats, 100)
    whole(max_repeats, "max_repeats", 1, 100_000)
    if max_repeats < repeats:
        raise ArgumentError("max_repeats", max_repeats, f"fewer than repeats ({repeats})")
    real(time_budget_s, "time_budget_s", 0, 86400)
    if threads is not None:
        whole(threads, "threads", 1, 1024)
    dev = _device(device)
    if batch_sizes is not None:
        if not isinstance(batch_sizes, list | tuple) or not 1 <= len(batch_sizes) <= 64:
            raise ArgumentError("batch_sizes", batch_sizes, "expected a list of 1 to 64 sizes")
        for b in batch_sizes:
            whole(b, "batch_sizes", 1, MAX_BATCH)
    sizes = sorted(set(batch_sizes or _default_sizes(sample.shape[0])))
    per_sample = sample[:1].numel() * sample.element_size()
    check_allocation(per_sample * sizes[-1], dev, f"the input at batch size {sizes[-1]}")
    loss = resolve_loss(loss_fn, model)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)

    was_training = model.training
    model.to(dev).train()
    kept: _Snapshot | None = None
    model_storages = {t.untyped_storage().data_ptr() for t in _state(model)}
    layers = list(model)
    # Layers that change their input in place (ReLU(inplace=True), common in CNNs) are measured
    # writing a new tensor, as the pipeline runs them (codegen/_runtime.py, out_of_place): any
    # layer may begin a stage, whose input autograd does not let change. Given back after.
    in_place = [layer for layer in layers if getattr(layer, "inplace", None) is True]
    for layer in in_place:
        layer.inplace = False
    per_size: dict[int, list[dict[str, Any]]] = {}
    show = sys.stderr.isatty() if progress is None else progress
    try:
        kept = _Snapshot(model, dev)
        # what one autograd call costs whatever it computes: a stage makes one for all its
        # layers, so each layer's backward is measured without it (the runtime's cost adds it)
        call_ms = autograd_call_ms(dev) if overhead and dev.type == "cpu" else 0.0
        with _progress(len(sizes) * (len(layers) + 1), show) as tick:
            for b in sizes:
                per_size[b] = _measure_size(
                    layers, loss, _resize(sample, b).to(dev), dev, model_storages, tick,
                    repeats, warmup, max_repeats, time_budget_s / len(sizes), call_ms,
                )  # fmt: skip
        runtime = runtime_overhead(dev, call_ms=call_ms) if overhead and dev.type == "cpu" else None
    except BaseException:
        if kept is not None:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                kept.restore()
        raise
    else:
        kept.restore()
    finally:
        torch.set_num_threads(saved_threads)
        model.train(was_training)
        for layer in in_place:
            layer.inplace = True

    first = per_size[sizes[0]]

    captured = bool(getattr(model, "captured", False))

    def entry(i: int, layer: nn.Module, name: str, kind: str) -> LayerProfile:
        rows = {b: per_size[b][i] for b in sizes}
        per = {f: {b: r[f] for b, r in rows.items()} for f in PER_SIZE + LATER_PER_SIZE}
        if not captured:  # (a chain's layer hands nothing on)
            per["passed_sum_bytes"] = None
        if not any(any(per[f].values()) for f in CTX_FIELDS):  # (only where a ctx keeps any)
            per.update(dict.fromkeys(CTX_FIELDS))
        return LayerProfile(
            index=i,
            name=name,
            type=kind,
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            largest_param_bytes=max(
                (_alloc(p.numel() * p.element_size(), dev) for p in layer.parameters()), default=0
            ),
            buffer_bytes=sum(t.numel() * t.element_size() for t in layer.buffers()),
            output_shape=first[i]["output_shape"],
            output_bytes=first[i]["output_bytes"] // sizes[0],
            crossing=list(getattr(layer, "crossing", [])),
            crossing_bytes=[n // sizes[0] for n in first[i]["crossing_bytes"]]
            if hasattr(layer, "crossing")
            else [],
            crossing_grad=first[i]["crossing_grad"] if hasattr(layer, "crossing") else [],
            reads=list(layer.reads) if hasattr(layer, "reads") else None,
            passed_bytes=first[i]["passed_bytes"] // sizes[0],
            views_input=all(per_size[b][i]["views"] for b in sizes),
            weight_grad_frees_input=all(per_size[b][i]["w_frees_input"] for b in sizes),
            input_grad_is_view=all(per_size[b][i]["grad_alias"] for b in sizes),
            param_tensor_bytes=[
                _alloc(p.numel() * p.element_size(), dev)
                for p in layer.parameters()
                if p.requires_grad
            ],
            **per,
        )

    out = [
        entry(
            i,
            layer,
            getattr(layer, "unit", str(i)),
            getattr(layer, "unit_type", type(layer).__name__),
        )
        for i, layer in enumerate(layers)
    ]
    loss_entry = None
    if loss is not None:
        loss_entry = entry(len(layers), nn.Module(), "loss", loss.name)
    return Profile(
        model=model_spec,
        model_digest=model_digest(model),
        device=str(dev),
        device_name=_device_name(dev),
        dtype=str(_model_dtype(model)).removeprefix("torch."),
        input_shape=list(sample.shape[1:]),
        input_dtype=str(sample.dtype).removeprefix("torch."),
        input_bytes=sample[:1].numel() * sample.element_size(),  # the planner rounds per batch
        batch_sizes=sizes,
        layers=out,
        loss=loss_entry,
        optimizer_step=_optimizer_steps(model, dev),
        captured=captured,
        tied=_tied(layers),
        runtime=runtime,
        meta=ProfileMeta(
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__,
            warmup=warmup,
            repeats=repeats,
            threads=threads or saved_threads,
        ),
    )


def _whole(got: tuple[int, ...], batch: tuple[int, ...]) -> bool:
    """Whether some tensor's leading size (`got`, of a value's tensors) is the batch's, or a
    whole multiple of it (also where either has no tensor of a dimension or more)."""
    if not got or not batch:
        return True
    return any(n > 0 and n % batch[0] == 0 for n in got)


def _batch_of(v: Value) -> tuple[int, ...]:
    """The leading sizes of a value's tensors of a dimension or more."""
    return tuple(
        int(t.shape[0]) for t in _tensors(v) if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def _measure_size(
    layers: list[nn.Module],
    loss: Any,
    x: Value,
    dev: torch.device,
    model_storages: set[int],
    tick: Callable[[], None],
    repeats: int,
    warmup: int,
    max_repeats: int,
    budget_s: float,
    call_ms: float = 0.0,
) -> list[dict[str, Any]]:
    """Every layer (and the loss) at one micro-batch size: memory first, one layer at a time,
    then all the timings together."""
    rows, inputs, measured = [], [], list(layers)
    tied = _shared_ids(layers)
    layouts: dict[int, list[_Layout | None]] = {}
    prev_saved: dict[int, torch.Tensor] = {}
    # Storages that some earlier layer saves and that still cross the cut: a captured graph's
    # skip, passed from layer to layer, is already counted where it was saved.
    saved_before: set[int] = set()
    batch, changed = _batch_of(x), None  # (the first layer whose output's batch is another)
    trains = False  # whether a layer before this one has a parameter that trains
    for i, layer in enumerate(layers):
        # the model's own input needs no gradient, nor does any before the first layer that
        # trains (a frozen prefix: the runtime's stages there keep nothing for backward)
        inp = _detach(x, requires_grad=trains)
        trains = trains or any(p.requires_grad for p in layer.parameters())
        # zero bubble keeps each layer's output gradient from I to W (the last one's too: the
        # last stage's W starts there)
        kept = "both"
        row, x, saved = _memory(
            i, layer, inp, dev, model_storages, prev_saved, kept, saved_before, layouts, tied
        )
        saved_before = {
            ptr for ptr in map(_storage, _tensors(x)) if ptr in saved_before or ptr in saved
        }
        _ctx_prev(row, rows)
        prev_saved = saved
        rows.append(row)
        inputs.append(inp)
        if _whole(_batch_of(x), batch):
            changed = None  # (a layer that puts the batch first again: the last break counts)
        elif changed is None:
            changed = (i, type(layer).__name__, _batch_of(x))
        tick()
    if changed is not None and not _whole(_batch_of(x), batch):
        # (found by a red team: the loss then broadcast over targets of another batch, and
        # `measure` ran it with torch's warning). A whole multiple is a batch flattened with
        # another dimension (a language model's tokens): its micro-batches' rows are its own
        i, kind, got = changed
        raise InputError(
            f"layer {i} ({kind}) turns a batch of {batch[0]} samples into {got[0]}: a pipeline "
            "splits the batch into micro-batches, so the model's output must keep its input's "
            "batch first (or a whole multiple of it, flattened): put it first again before the "
            "model's last layer"
        )
    if loss is not None:
        try:
            target = loss.make_target(x)
        except Exception as e:
            raise InputError(
                f"the loss {loss.name} cannot make a target for the model's output "
                f"({_shape_text(x)}): {_first_line(e)}"
            ) from None
        loss_layer = LossLayer(loss, target)
        inp = _detach(x, requires_grad=True)
        row, _, _ = _memory(
            len(layers), loss_layer, inp, dev, model_storages, prev_saved, "input",
            saved_before, layouts, tied,
        )  # fmt: skip
        _ctx_prev(row, rows)
        rows.append(row)
        inputs.append(inp)
        measured.append(loss_layer)
    # Inside a stage a layer's backward starts from the gradient the next layer made, laid
    # out as that layer's backward lays it out (a transposing layer hands back a transposed
    # one), not from a dense gradient: some backwards copy it into their own layout first.
    # The layouts are found from the loss back, each layer's from the one its next layer got
    # (fed a gradient laid out like its own output instead, a transpose before a convolution
    # handed back a dense one where the run's was not: the convolution before it ran one
    # activation over its plan). A stage's last layer gets the gradient of what it sent,
    # laid out as the receiver's input: dense under torchrun, the output's own strides where
    # the streams target copies it over. The layer's transients are measured again from each
    # layout that is not dense: the inner figure is the chained layout's, the last layer's
    # backward the most of the received ones', the others the most of all.
    for i in reversed(range(len(layers))):
        layer, given = layers[i], layouts.get(i + 1)
        nxt = inputs[i + 1] if i + 1 < len(inputs) else None
        own = _own_layouts(nxt) if i + 1 < len(layers) else None
        try:
            layouts[i] = _input_layouts(layer, inputs[i], given or [])
            again = {
                name: _transient(
                    layer, inputs[i], dev, "both", lay, packs=rows[i]["packs"], tied=tied
                )
                for name, lay in (("chained", given), ("received", own))
                if lay
                and _strided_otherwise(nxt, lay)
                and not (name == "received" and lay == given)
            }
            if "chained" in again and own == given:  # (the same layout: measured once)
                again["received"] = again["chained"]
        except Exception as e:
            raise InputError(
                f"the model rejected a gradient at layer {i} ({type(layer).__name__}): "
                f"{_first_line(e)}"
            ) from None
        # a view of the output's gradient from every layout it may be given (from a transposed
        # one, a reshape copies: a stage's unflatten before a Linear over a transpose ran one
        # gradient over its plan under zero bubble, found by a red team)
        rows[i]["grad_alias"] = rows[i]["grad_alias"] and all(
            f["grad_alias"] for f in again.values()
        )
        for key, field in _FIGURES.items():
            if key == "inner":
                if "chained" in again:
                    rows[i][field] = again["chained"][key]
            else:
                got = [
                    f[key] for name, f in again.items() if key != "backward" or name != "chained"
                ]
                rows[i][field] = max([rows[i][field], *got])
    try:
        timings = time_layers(
            measured, inputs, dev, warmup=warmup, min_repeats=repeats, max_repeats=max_repeats,
            time_budget_s=budget_s, call_ms=call_ms,
        )  # fmt: skip
    except InputError:
        raise
    except Exception as e:
        raise InputError(
            f"timing the layers failed: {type(e).__name__}: {_first_line(e)}"
        ) from None
    tick()
    for row, t in zip(rows, timings):
        row.update(
            forward_ms=t.forward,
            backward_ms=t.backward,
            backward_input_ms=t.backward_input,
            backward_weight_ms=t.backward_weight,
        )
    return rows


class _Snapshot:
    """What profiling changes in the caller's model, to give back afterwards: it runs the model
    in training mode (BatchNorm's running statistics move, a forward may replace, fill or add a
    buffer), sets the gradients aside (they stay where they are while the profile makes its
    own), and draws from the random streams."""

    def __init__(self, model: nn.Module, dev: torch.device) -> None:
        self.buffers = [
            (module, dict(module._buffers), set(module._non_persistent_buffers_set), {
                name: t.detach().to("cpu", copy=True)
                for name, t in module._buffers.items()
                if t is not None
            })
            for module in model.modules()
        ]  # fmt: skip
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (dev, torch.cuda.get_rng_state(dev)) if dev.type == "cuda" else None
        for p, _ in self.grads:  # the profile's backwards must not add into them
            p.grad = None

    def restore(self) -> None:
        with torch.no_grad():
            for module, held, transient, values in self.buffers:
                # the tensors themselves, in their order (state_dict's), none added since
                module._buffers.clear()
                module._buffers.update(held)
                module._non_persistent_buffers_set.clear()
                module._non_persistent_buffers_set.update(transient)
                for name, t in held.items():
                    if t is not None and not _same(t.detach().cpu(), values[name]):
                        t.copy_(values[name])  # (only what changed: an inference tensor
                        # cannot be written)
        for p, g in self.grads:
            p.grad = g
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng[1], self.cuda_rng[0])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _shared_ids(layers: list[nn.Module]) -> frozenset[int]:
    """The parameters (ids) two layers use (tied): zero bubble's I takes their gradient, through
    each layer of a stage that uses one (_transient)."""
    return frozenset(ptr for ptr, (_, ks) in _users(layers).items() if len(ks) > 1)


def _tied(layers: list[nn.Module]) -> list[TiedParameter]:
    """Parameters that several layers use, with those layers."""
    return [
        TiedParameter(bytes=p.numel() * p.element_size(), layers=ks, frozen=not p.requires_grad)
        for p, ks in _users(layers).values()
        if len(ks) > 1
    ]


def _users(layers: list[nn.Module]) -> dict[int, tuple[nn.Parameter, list[int]]]:
    """Each parameter (by id) and the layers that use it."""
    users: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for k, layer in enumerate(layers):
        for p in layer.parameters():
            users.setdefault(id(p), (p, []))[1].append(k)
    return users


def _memory(
    i: int,
    layer: nn.Module,
    inp: Value,
    dev: torch.device,
    model_storages: set[int],
    prev_saved: dict[int, torch.Tensor],
    kept: str,
    saved_before: set[int],
    grad_layouts: dict[int, list[_Layout | None]],
    tied: frozenset[int] = frozenset(),
) -> tuple[dict[str, Any], Value, dict[int, torch.Tensor]]:
    """What layer i saves, shares with layer i - 1, saves of its own input, and allocates
    beyond that while it runs; and its output (the next layer's input). Records in
    `grad_layouts[i]` the strides of the gradient it makes for each input."""
    # Saved tensors by storage address. Holding them (and the previous layer's) alive until the
    # next layer is measured keeps the allocator from reusing an address for something else.
    saved: dict[int, torch.Tensor] = {}
    packs = [0]  # every tensor autograd saves, the weights too: what a checkpoint counts

    def pack(t: torch.Tensor) -> torch.Tensor:
        packs[0] += 1
        ptr = t.untyped_storage().data_ptr()
        if ptr not in model_storages:
            saved[ptr] = t
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(inp)
        _check_output(out)
        hooked = set(saved)  # (what the hooks saw: what a checkpoint's re-run makes again)
        held = {  # (as a node's attribute: no hook sees them)
            t.untyped_storage().data_ptr(): t
            for t in _held_by_ctx(out)
            if t.untyped_storage().data_ptr() not in model_storages
        }
        for ptr, t in held.items():
            saved.setdefault(ptr, t)
        # how the gradient of each input is laid out as the layer's backward makes it (the
        # layer before receives it so; .grad may be laid out again to match the input)
        made: dict[int, _Layout] = {}
        hooks = [
            t.register_hook(lambda g, k=k: made.__setitem__(k, _Layout.of(g)))
            for k, t in enumerate(_tensors(inp))
            if t.requires_grad
        ]
        try:
            _backward(out)
        finally:
            for h in hooks:
                h.remove()
        grad_layouts[i] = [made.get(k) for k in range(len(_tensors(inp)))]
        for t in _tensors(inp):
            t.grad = None  # a stage input's gradient is made once, never added into
        extra = _transient(layer, inp, dev, kept, packs=packs[0], tied=tied)
    except InputError:
        raise
    except Exception as e:
        if isinstance(layer, LossLayer):  # (the loss's own failure, not the model's)
            raise InputError(
                f"the loss {layer.loss.name} failed on the model's output of shape "
                f"{_shape_text(inp)}: {type(e).__name__}: {_first_line(e)}"
            ) from None
        if "leaf Variable that requires grad is being used in an in-place" in str(e):
            # (found by a review: ReLU(inplace=True) as a layer of its own, common in CNNs)
            raise InputError(
                f"layer {i} ({type(layer).__name__}) changes its input in place: a stage may "
                "begin at any layer after the first, and there its input is a tensor autograd "
                "does not let change; make that layer write a new tensor, or put it inside the "
                "module before it"
            ) from None
        raise InputError(
            f"the model rejected input of shape {_shape_text(inp)} at layer {i} "
            f"({type(layer).__name__}): {_first_line(e)}"
        ) from None
    finally:
        for p in layer.parameters():
            p.grad = None
        for t in _tensors(inp):
            t.grad = None

    nbytes = {ptr: _alloc(t.untyped_storage().nbytes(), dev) for ptr, t in saved.items()}
    in_ptrs = {t.untyped_storage().data_ptr(): t for t in _tensors(inp)}
    # A captured graph's layer in a pipeline holds only the inputs it reads: the others pass
    # it by as None (unless its stage received them for a later layer)
    read = _read_by(layer, _tensors(inp))
    used = in_ptrs if read is None else {t.untyped_storage().data_ptr(): t for t in read}
    in_bytes = {ptr: _alloc(t.untyped_storage().nbytes(), dev) for ptr, t in used.items()}
    # Inside a stage, the layer's input stays alive while its forward runs; where neither this
    # layer nor the previous one saves it, the stage does not count it among its saved tensors.
    earlier = prev_saved.keys() | saved_before
    unsaved_in = sum(n for ptr, n in in_bytes.items() if ptr not in saved and ptr not in earlier)
    ctx_bytes = {ptr: _alloc(t.untyped_storage().nbytes(), dev) for ptr, t in held.items()}
    row = {
        "ctx_held_bytes": sum(n for ptr, n in ctx_bytes.items() if ptr not in in_ptrs),
        "ctx_input_bytes": sum(n for ptr, n in ctx_bytes.items() if ptr in in_ptrs),
        # what this layer's saves count (none the layer before saved) that its ctx keeps; what
        # the layer before's saves count that this one's ctx keeps (and its own does not) is
        # the caller's to find (_measure_size)
        "ctx_late_bytes": sum(n for ptr, n in ctx_bytes.items() if ptr not in earlier),
        "ctx_ptrs": ctx_bytes,
        "counted": {ptr for ptr in saved if ptr not in earlier},
        # what its ctx keeps that a hook saves too (a checkpoint's re-run makes those again,
        # beside the first): beyond its input, and of its input (the caller adds the part the
        # layer before saved)
        "ctx_dup_bytes": sum(
            n for ptr, n in ctx_bytes.items() if ptr in hooked and ptr not in in_ptrs
        ),
        "ctx_dup_input_bytes": sum(
            n for ptr, n in ctx_bytes.items() if ptr in in_ptrs and ptr in hooked
        ),
        "ctx_input_unhooked": {
            ptr: n for ptr, n in ctx_bytes.items() if ptr in in_ptrs and ptr not in hooked
        },
        "hooked": hooked,
        "saved_bytes": sum(nbytes.values()),
        "shared_bytes": sum(n for ptr, n in nbytes.items() if ptr in earlier),
        "input_saved_bytes": sum(n for ptr, n in nbytes.items() if ptr in in_ptrs),
        "forward_transient_bytes": extra["forward"],
        "backward_transient_bytes": extra["backward"],
        "input_unsaved_bytes": unsaved_in if i > 0 else 0,
        "forward_peak_bytes": extra["no_grad"],
        "input_grad_transient_bytes": extra["input"],
        "weight_grad_transient_bytes": extra["weight"],
        "stop_transient_bytes": extra["stop"],
        "passed_sum_bytes": extra["summed"],
        "inner_backward_transient_bytes": extra["inner"],
        "tied_first_backward_bytes": extra["first"],
        "w_frees_input": not extra["w_keeps_input"],
        "weight_grad_kept_bytes": extra["w_kept"],
        "grad_alias": bool(extra["grad_alias"]),
        "packs": packs[0],
        "output_shape": [list(t.shape[1:]) for t in _tensors(out)],
        # per micro-batch as computed; the planner rounds what crosses a cut at its own size
        "output_bytes": sum(t.numel() * t.element_size() for t in _tensors(out)),
        "crossing_bytes": [t.numel() * t.element_size() for t in _tensors(out)],
        "crossing_grad": [t.is_floating_point() for t in _tensors(out)],
        # its outputs are its input's storage (views, or the input handed on) and it saves
        # nothing: a later layer that saves one saves the stage's input, where a stage opens
        # here. Only from a contiguous input, as every target receives one (torchrun's buffers
        # are dense: from a transposed one, a view layer may hand the next a dense view that
        # it saved, where from a dense one it hands a transposed view that the next layer
        # copies: the plan took the input off twice, 18% under; found by a review)
        "views": bool(_tensors(out))
        and not saved
        and all(t.is_contiguous() for t in _tensors(inp))
        and all(_storage(t) in in_ptrs for t in _tensors(out)),
        "passed_bytes": sum(
            t.numel() * t.element_size()
            for t in _tensors(out)
            if any(t is u for u in _tensors(inp))
        ),
    }
    return row, _detach(out, requires_grad=False), saved


def _ctx_prev(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Sets row's figures that read the layer before's: what that layer's saves count (its
    `counted` storages) that this layer's ctx keeps and that layer's own ctx does not (its
    ctx_late_bytes has those), and the part of its input its ctx keeps that the layer before's
    hooks saved (ctx_dup_input_bytes)."""
    before = rows[-1] if rows else {"counted": set(), "ctx_ptrs": {}, "hooked": set()}
    row["ctx_prev_bytes"] = sum(
        n
        for ptr, n in row["ctx_ptrs"].items()
        if ptr in before["counted"] and ptr not in before["ctx_ptrs"]
    )
    row["ctx_dup_input_bytes"] += sum(
        n for ptr, n in row["ctx_input_unhooked"].items() if ptr in before["hooked"]
    )


def _held_by_ctx(out: Value) -> list[torch.Tensor]:
    """Tensors a custom autograd.Function's forward kept as attributes of its ctx (`ctx.x =
    x`, not ctx.save_for_backward), in the graph behind `out`: its node holds them until the
    graph goes, and no saved-tensor hook sees them (a red team's model ran 5-20% over its
    plan). Found on the nodes' own attributes and inside what those hold (containers and
    objects, a few levels down); only tensors with a storage of their own (a sparse one has
    none: left out, as before)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def look(value: Any, depth: int) -> None:
        if id(value) in seen or depth > _CTX_DEPTH:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.layout == torch.strided and not value.is_nested:
                found.setdefault(id(value), value)
        elif isinstance(value, dict):
            for v in list(value.values()):
                look(v, depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for v in list(value):
                look(v, depth + 1)
        elif isinstance(value, (nn.Module, torch.autograd.graph.Node)):
            return  # (a module's tensors are the model's; another node is walked as a node)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for v in list(vars(value).values()):
                look(v, depth + 1)

    nodes: set[int] = set()
    todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in nodes:
            continue
        nodes.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            for value in list(vars(node).values()):
                look(value, 1)
        todo += [nxt for nxt, _ in node.next_functions]
    return list(found.values())


_CTX_DEPTH = 4  # levels below a ctx's attributes searched for tensors


def _slice(t: torch.Tensor) -> bool:
    """Whether t is part of a larger tensor's memory (the runtime's _own_memory copies it)."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Layout(NamedTuple):
    """How a gradient lies in memory: its strides, and where it is a view of a larger tensor
    (a concatenation's backward hands out slices of its input's gradient), where it starts in
    that storage and how many elements the storage holds: the view keeps all of them alive."""

    stride: tuple[int, ...]
    offset: int = 0
    storage: int = 0  # (elements; 0: the view's own span)

    @classmethod
    def of(cls, g: torch.Tensor) -> _Layout:
        storage = g.untyped_storage().nbytes() // g.itemsize
        if storage <= _span(g.shape, g.stride()):  # (its own: compares equal to a copy's)
            return cls(tuple(g.stride()))
        return cls(tuple(g.stride()), g.storage_offset(), storage)

    def ones(self, shape: torch.Size, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        """Ones laid out so, in a storage of the view's own span."""
        return torch.empty_strided(shape, self.stride, dtype=dtype, device=dev).fill_(1)

    def whole(self, shape: torch.Size, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        """Ones laid out so, in a storage as large as the one the view keeps alive."""
        span = _span(shape, self.stride)
        if self.storage <= span:
            return self.ones(shape, dtype, dev)
        base = torch.empty(self.storage, dtype=dtype, device=dev)
        offset = min(self.offset, self.storage - span)
        return base.as_strided(shape, self.stride, offset).fill_(1)


def _span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """The elements a view of this shape and these strides reaches, from its first."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _input_layouts(
    layer: nn.Module, inp: Value, given: list[_Layout | None]
) -> list[_Layout | None]:
    """How the layer's backward lays out the gradient it makes for each input (None: none
    made), from output gradients laid out as `given` (dense where it says nothing)."""
    ins = _tensors(inp)
    wrt = [t for t in ins if t.requires_grad]
    outs = _tensors(layer(inp))
    at = [k for k, t in enumerate(outs) if t.requires_grad]
    if not wrt or not at:
        return [None] * len(ins)
    grads = []
    for k in at:
        t, lay = outs[k], given[k] if k < len(given) else None
        if lay is None or len(lay.stride) != t.dim():
            grads.append(torch.ones(t.shape, dtype=t.dtype, device=t.device))
        else:
            grads.append(lay.ones(t.shape, t.dtype, t.device))
    made = torch.autograd.grad([outs[k] for k in at], wrt, grads, allow_unused=True)
    by = {id(t): g for t, g in zip(wrt, made)}
    return [_Layout.of(by[id(t)]) if by.get(id(t)) is not None else None for t in ins]


_FIGURES = {  # _transient's figures, as a profile's row names them
    "forward": "forward_transient_bytes",
    "backward": "backward_transient_bytes",
    "no_grad": "forward_peak_bytes",
    "input": "input_grad_transient_bytes",
    "weight": "weight_grad_transient_bytes",
    "stop": "stop_transient_bytes",
    "summed": "passed_sum_bytes",
    "inner": "inner_backward_transient_bytes",
    "first": "tied_first_backward_bytes",
}


def _own_layouts(v: Value) -> list[_Layout | None] | None:
    """Each tensor's strides where a copy keeps them (non-overlapping and dense), else None:
    a copy has its own storage."""
    if v is None:
        return None
    return [_Layout(tuple(t.stride())) if _dense_strides(t) else None for t in _tensors(v)]


def _dense_strides(t: torch.Tensor) -> bool:
    """Whether t's elements fill its storage span once each, in some order of dimensions."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def _strided_otherwise(v: Value, layouts: list[_Layout | None]) -> bool:
    """Whether some gradient laid out as `layouts` is not what a dense tensor of v's shape is:
    other strides, or a view of a larger storage."""
    if v is None:
        return False
    return any(
        s is not None
        and (
            s.stride != torch.empty(0, device="meta").new_empty(t.shape).stride()
            or s.storage > t.numel()
        )
        for t, s in zip(_tensors(v), layouts)
    )


class _Seed(torch.autograd.Function):
    """A scalar in place of a layer's output, whose backward makes that output's gradient (ones,
    laid out as given): held by autograd alone, as a stage's inner layer gets its output
    gradient from the next layer's backward, and let go once the nodes that read it have run.
    Where the next layer's backward makes it as a slice of a larger gradient (a
    concatenation's), the slice keeps all of that alive until this layer's backward is done:
    the seed's gradient is such a slice (a stage's layer before a concatenation held 32 768
    bytes over its plan, 15 360 over its stage's: found by a review)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, lay: _Layout | None) -> torch.Tensor:
        ctx.like = (t.shape, lay, t.dtype, t.device)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape, lay, dtype, device = ctx.like
        if lay is None:
            return torch.ones(shape, dtype=dtype, device=device), None
        return lay.whole(shape, dtype, device), None


class _StopForward(Exception):
    """Raised out of a saved-tensor hook to end a forward where a checkpoint's re-run ends."""


def _read_by(layer: nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The input tensors a captured graph's layer reads (the others it only hands on), or None
    where the layer does not say (a Sequential's: it reads what it is given)."""
    names, reads = getattr(layer, "inputs", None), set(getattr(layer, "reads", ()))
    if not names or len(names) != len(tensors):
        return None
    return [t for n, t in zip(names, tensors) if n in reads]


def _transient(
    layer: nn.Module,
    inp: Value,
    dev: torch.device,
    kept: str,
    layouts: list[_Layout | None] | None = None,
    *,
    packs: int = 0,
    tied: frozenset[int] = frozenset(),
) -> dict[str, int]:
    """What the layer allocates beyond what the planner counts as kept, read off the allocator,
    in each way a pipeline runs it: a forward that keeps nothing (recomputation); a forward, its
    output dropped (a pipeline keeps only its gradient edge), and a backward from a gradient of
    ones; again a forward, then zero bubble's I (input gradient, graph kept) and W (weight
    gradients). Every weight's .grad is there beforehand, so the temporary gradient added into
    it is counted, as it is in every micro-batch but the first. Gradients zero bubble keeps from
    I to W are counted by the planner and left out here (`kept`: "both" the output's and the
    input's, as for every layer; "input" only the input's, for the loss). `layouts`: the
    strides of each output's gradient, as the next layer makes it (default: dense)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    wrt = [t for t in _tensors(inp) if t.requires_grad]
    ins = {id(t) for t in _tensors(inp)}
    read = {id(t) for t in _read_by(layer, _tensors(inp)) or ()}
    # A captured graph's layer hands a skip on unchanged: its gradient passes through as well,
    # one tensor alive while this layer's backward runs, not one made here and one taken in.
    passed: list[torch.Tensor] = []

    strides: list[_Layout | None] = []  # each root's gradient's layout (None: dense)
    seen = [0]

    def stop_at_last(t: torch.Tensor) -> torch.Tensor:
        # torch's checkpoint re-runs a layer's forward only until it has every tensor the
        # first run saved back (early stop): it raises out of the hook of the last one
        seen[0] += 1
        if seen[0] >= packs:
            raise _StopForward
        return t

    def forward(seed: bool = False) -> tuple[list[Any], list[tuple[torch.Size, torch.dtype]]]:
        outs = _tensors(layer(inp))
        passed[:] = [t for t in outs if id(t) in ins and t.requires_grad]
        at = [k for k, t in enumerate(outs) if t.requires_grad and id(t) not in ins]
        given = list(layouts or [])
        strides[:] = [given[k] if k < len(given) else None for k in at]
        roots = [outs[k] for k in at]
        if seed:  # scalars whose backward makes each root's gradient (_Seed)
            return [_Seed.apply(t, s) for t, s in zip(roots, strides)], []
        return [get_gradient_edge(t) for t in roots], [(t.shape, t.dtype) for t in roots]

    def ones(like: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        return [
            lay.ones(shape, dtype, dev)
            if lay is not None
            else torch.ones(shape, dtype=dtype, device=dev)
            for (shape, dtype), lay in zip(like, strides)
        ]

    with trace_allocations() as trace:
        with owned_by("no_grad"), torch.no_grad():
            layer(inp)
        with owned_by("forward"):
            edges, like = forward()
        with owned_by("backward"):
            if edges:
                torch.autograd.backward(edges, ones(like))
        edges_made = bool(edges)
        # again with the output's gradient held by autograd alone, as a stage's inner layer
        # gets it (the next layer's backward makes it): let go once the nodes that read it
        # have run (a stage's last layer holds the one it pulled to the end: the figure above)
        for t in wrt:
            t.grad = None
        with owned_by("forward_seeded"):
            seeds, _ = forward(seed=True)
        with owned_by("inner"):
            if seeds:
                torch.autograd.backward(seeds)
        del seeds
        for t in wrt:
            t.grad = None
        # what the layer's graph saves (not its weights), each wrapped: still referenced after
        # W (a node W does not run, off every way to a parameter), the stage holds it while
        # the layers before run their W: what it saved of its input (MemoryModel.
        # _weight_shared), and the rest (Chain.w_freed)
        in_storages = {_storage(t) for t in _tensors(inp)}
        own = {_storage(t) for t in [*layer.parameters(), *layer.buffers()]}
        wrapped: list[tuple[weakref.ref, int, int]] = []  # (holder, storage, bytes)

        def pack(t: torch.Tensor) -> Any:
            ptr = _storage(t)
            if ptr in own:
                return t
            held = _Held(t)
            wrapped.append((weakref.ref(held), ptr, _alloc(t.untyped_storage().nbytes(), dev)))
            return held

        def unpack(h: Any) -> torch.Tensor | None:
            return h.tensor if isinstance(h, _Held) else h

        with owned_by("forward2"), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            edges, like = forward()
        # the inputs it works on: not one it only hands on, but one it reads and hands on too
        # (a skip's source read by the next layer: its I went unmeasured, and zero bubble's
        # first stage of a U-Net-like model ran 42% over its plan: found by a sweep)
        used = [t for t in wrt if id(t) in read or all(t is not u for u in passed)]
        # and a parameter another layer uses too: I takes its gradient (the planner counts
        # that gradient; the rest of its way there is this figure: a stage's first layer,
        # whose input needs none, ran 16 KiB over its plan at I where it measured nothing,
        # found by a red team)
        shared = [p for p in params if id(p) in tied]
        made: list[torch.Tensor] = []  # those whose gradient it makes (kept, counted apart)
        alias = False  # its input gradient is the output gradient's own storage (a view)
        with owned_by("input"):
            if edges and (used or shared):
                seed = ones(like)
                got = torch.autograd.grad(
                    edges, [*used, *shared], seed, retain_graph=True, allow_unused=True
                )
                made = [t for t, g in zip([*used, *shared], got) if g is not None]
                given = {_storage(g) for g in seed}
                mine = [g for g in got[: len(used)] if g is not None]
                alias = bool(mine) and all(_storage(g) in given for g in mine)
                del seed
                # the runtime takes each out of a larger gradient (a cat's) as it is made,
                # the larger one still there (_Owned: what I keeps for W is its own memory)
                owned = [g.clone() for g in got[: len(used)] if g is not None and _slice(g)]
                del got, owned
        with owned_by("weight"):
            if edges and params:
                torch.autograd.backward(edges, ones(like), inputs=params)
        # (no W: the graph stays whole until the stage's W ends)
        ran = bool(edges and params)
        alive = {ptr: n for r, ptr, n in wrapped if not ran or r() is not None}
        keeps_input = not ran or bool(alive.keys() & in_storages)
        w_kept = sum(alive.values())
        # (a saved output's holder and its node hold each other through C++, where the
        # collector cannot see: let go of the tensors here, or the graph outlives the profile)
        for ref, _, _ in wrapped:
            held = ref()
            if held is not None:
                held.tensor = None
        wrapped.clear()
        del edges
        # where it reads a value it hands on and the stage received that value's gradient
        # (a later stage reads it too), the runtime holds the received part: autograd cannot
        # add into it and makes the sum as a new tensor (_received_sums in the planner)
        both = [t for t in passed if id(t) in read]
        if both and edges_made:
            held = [torch.ones_like(t) for t in both]
            for t in wrt:
                t.grad = None
            with owned_by("forward3"):
                edges, like = forward()
            with owned_by("summed"):
                torch.autograd.backward([*edges, *both], [*ones(like), *held])
            del edges
            for t in wrt:
                t.grad = None
        # where it uses a parameter another layer uses too: again, that parameter without a
        # gradient yet, as a stage's copy of it is in its first backward: the gradient the
        # backward makes stays, from where it is made (a table added at a layer's end: before
        # the layer's peak, which the figure above does not see: a red team's stage ran the
        # table's bytes, 4-6%, over its plan under GPipe and 1F1B)
        if shared and edges_made:
            for p in shared:
                p.grad = None
            for t in wrt:
                t.grad = None
            with owned_by("forward4"):
                edges, like = forward()
            with owned_by("first"):
                torch.autograd.backward(edges, ones(like))
            del edges
            for t in wrt:
                t.grad = None
        with owned_by("stop"):
            if packs:
                try:
                    with torch.autograd.graph.saved_tensors_hooks(stop_at_last, lambda t: t):
                        layer(inp)
                except _StopForward:
                    pass
    out_kept = sum(_alloc(shape.numel() * dtype.itemsize, dev) for shape, dtype in like)
    out_kept *= kept == "both"
    passed_grad = sum(_alloc(t.numel() * t.element_size(), dev) for t in passed)
    # (not one it only passes by: a value it reads for nothing but handing it on, as a
    # captured layer may the model's input for a later residual, gets no gradient here, and
    # taking its bytes off ran a stage 4 KiB over its plan at I: found by a red team)
    in_kept = sum(_alloc(t.numel() * t.element_size(), dev) for t in made)
    where = _device_key(dev)
    steps = trace.levels(lambda owner, device: "all" if device == where else None).get("all", [])
    span = {name: (start, end) for start, end, name in trace.ranges}

    def before(name: str) -> int:
        return next((level for t, level in reversed(steps) if t < span[name][0]), 0)

    def peak(name: str) -> int:
        start, end = span[name]
        return max((level for t, level in steps if start <= t <= end), default=before(name))

    kept_bytes = before("backward")  # what the forward left: its saved tensors
    forward = max(peak("forward") - kept_bytes, 0)
    # up to its last save, beyond what it saves (all saved by then); a layer that saves
    # nothing stops nowhere: its whole forward
    saves = kept_bytes - before("forward")
    stop = max(peak("stop") - before("stop") - saves, 0) if packs else forward
    backward = max(peak("backward") - kept_bytes, 0) + passed_grad
    summed = 0
    if "summed" in span:  # (the held parts are in its `before`: passed_grad counts them)
        summed = max(peak("summed") - before("summed") + passed_grad - backward, 0)
    inner = max(peak("inner") - before("inner"), 0) + passed_grad if edges_made else backward
    first = 0  # (what keeping the shared parameters' new gradients adds to its peak)
    if "first" in span:
        first = max(peak("first") - before("first") - (peak("backward") - kept_bytes), 0)
    # (at most the backward's, but for the larger gradient a slice it is given keeps alive)
    wider = sum(
        _alloc(max(lay.storage - shape.numel(), 0) * dtype.itemsize, dev)
        for (shape, dtype), lay in zip(like, strides)
        if lay is not None
    )
    return {
        "inner": min(inner, backward + wider),
        "first": first,
        "summed": summed,
        "stop": min(stop, forward),
        "forward": forward,
        "backward": backward,
        "no_grad": max(peak("no_grad") - before("no_grad"), 0),
        "input": max(peak("input") - before("input") - out_kept - in_kept, 0)
        if used or shared
        else 0,
        "weight": max(peak("weight") - before("weight") - out_kept, 0) if params else 0,
        "w_keeps_input": int(keeps_input),
        "w_kept": w_kept,
        "grad_alias": int(alias),
    }


class _Held:
    """A saved tensor, wrapped so that a weak reference tells whether the graph still holds it
    (_transient)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-12),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-12, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-12),
}


def _optimizer_steps(model: nn.Module, dev: torch.device) -> dict[str, OptimizerStep]:
    """Each optimizer's temporaries per byte of parameters, measured on a copy of the model's
    largest parameter: multi-tensor (foreach) kernels make them for every tensor at once."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    if not params:
        return {}
    big = max(params, key=lambda p: p.numel())
    nbytes = _alloc(big.numel() * big.element_size(), dev)
    out = {}
    for name, make in OPTIMIZERS.items():
        p = nn.Parameter(big.detach().clone())
        p.grad = torch.ones_like(p)
        peak = _step_peak(make, [p])
        _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
        carry = None
        if not foreach:
            # one tensor after another: what the step of the tensor before still holds while
            # this one's runs (Adam's denominator lives until the next is made: a stage of
            # bias-free layers, its weights stepped back to back, read 7% over its plan)
            pair = [nn.Parameter(big.detach().clone()) for _ in range(2)]
            for q in pair:
                q.grad = torch.ones_like(q)
            carry = max(_step_peak(make, pair) - peak, 0) / nbytes
        out[name] = OptimizerStep(foreach=bool(foreach), per_byte=peak / nbytes, carry=carry)
    return out


def _step_peak(make: Callable[[list[nn.Parameter]], Any], params: list[nn.Parameter]) -> int:
    """The most an optimizer step over `params` allocates beyond its state (its second step:
    the first makes the state)."""
    opt = make(params)
    opt.step()
    with trace_allocations() as trace:
        opt.step()
    return max(trace.peaks(lambda o, d: "all").values(), default=0)


def _backward(out: Value) -> None:
    roots = [t for t in _tensors(out) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


def _alloc(nbytes: int, dev: torch.device) -> int:
    """Bytes the device allocates for `nbytes`: CUDA rounds up to its block size."""
    if dev.type == "cuda":
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


def _device_key(dev: torch.device) -> str:
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _check_output(out: Value) -> None:
    if isinstance(out, torch.Tensor):
        return
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return
    leaves = torch.utils._pytree.tree_leaves(out)
    if not isinstance(out, tuple | list) and leaves and leaves != [out]:
        if all(isinstance(t, torch.Tensor) for t in leaves):
            return  # a structure of tensors (a library's output class): the model's output
    raise InputError(
        f"a layer returned {type(out).__name__}; layers must return a tensor or a tuple of tensors"
    )


def _detach(v: Value, requires_grad: bool) -> Value:
    def one(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        return d.requires_grad_(requires_grad and d.is_floating_point())

    if isinstance(v, torch.Tensor):
        return one(v)
    if isinstance(v, tuple):
        return tuple(one(t) for t in v)
    return torch.utils._pytree.tree_map_only(torch.Tensor, one, v)


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
        raise ArgumentError("device", device, f"not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError("device", device, "CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArgumentError(
                "device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise ArgumentError("device", device, "only cpu and cuda[:N] are supported")
    elif dev.index not in (None, 0):  # (torch takes cpu:1 as the one CPU: said, not silent)
        raise ArgumentError("device", device, "the CPU is one device: give cpu")
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
