"""Any model as a sequence of layers: capture its graph with torch.export, group the graph's
nodes into layers (one per call of a module that is not a mere container, with the loose
operations between calls joining the call before them), and make each layer a module that takes
every value live across the cut before it and returns every value live across the cut after it.

    model (any nn.Module, one tensor input)  ->  CapturedModel (an nn.Sequential of GraphLayer)

The rest of gpipe-plan then sees an nn.Sequential whose layers pass tuples: a skip connection
is one more tensor crossing each cut it spans, so profiling, planning, schedules and both
compiled targets work unchanged. What crosses a cut: tensors (integer ones without gradients)
and sizes (a symbolic batch size travels as a 0-dim int64 tensor). A cut where anything else
would cross (a tuple, a list) is not offered: its two layers become one.

Self-contained on purpose (torch only): emitted pipeline programs inline this file, so that they
capture the model exactly as the profile did.
"""

from __future__ import annotations  # emit: drop

import contextlib
import copy
import io
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class CaptureError(ValueError):
    """The model's graph cannot be captured or cut; the message says where and what to do."""


class GraphLayer(nn.Module):
    """A run of the captured graph: the values live before it in, the values live after it out
    (one tensor as itself, several as a tuple). `unit` and `unit_type` name the module it runs."""

    captured_layer = True  # codegen/_numerics.py `replaying` restores its buffers after a replay

    def __init__(
        self,
        gm: fx.GraphModule,
        unit: str,
        unit_type: str,
        crossing: list[str],
        out_spec: Any,
        inputs: list[str] | None = None,
        reads: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.gm = gm
        self.unit = unit
        self.unit_type = unit_type
        self.crossing = crossing  # names of the values it returns
        self.inputs = inputs if inputs is not None else []  # names of the values it takes
        # the inputs it uses; the others it only hands on (None in, None out: a pipeline sends
        # a value straight to the stage that reads it, not through the stages between)
        self.reads = reads if reads is not None else list(self.inputs)
        self.out_spec = out_spec  # the last layer: how the model's own output is shaped
        # (path in gm, the model's module that owns it, its name there) for each buffer: moving
        # the layer to a device gives it new buffer tensors, which the model must hold too
        self.__dict__["owners"] = []

    def _apply(self, fn: Any, recurse: bool = True) -> GraphLayer:
        super()._apply(fn, recurse)
        self.__dict__.pop("gm_eval", None)  # built on the old tensors
        for path, owner, name in self.__dict__["owners"]:
            owner._buffers[name] = self.gm.get_buffer(path)
        return self

    def forward(self, x: Any) -> Any:
        gm = self.gm
        if not self.training:
            if "gm_eval" not in self.__dict__:
                self.__dict__["gm_eval"] = _for_eval(self.gm)  # not a submodule: same weights
            gm = self.__dict__["gm_eval"]
        out = gm(*(x if isinstance(x, tuple) else (x,)))
        if self.out_spec is not None:
            return torch.utils._pytree.tree_unflatten(list(out), self.out_spec)
        return out[0] if len(out) == 1 else tuple(out)


# The graph is captured in training mode; in eval mode these run as they would in the module.
_TRAINING_ARG = {
    torch.ops.aten.batch_norm.default: 5,
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
}


def _for_eval(gm: fx.GraphModule) -> fx.GraphModule:
    """The same layer as evaluation runs it: batch norm on its running statistics (which it
    leaves alone), no dropout."""
    g = copy.deepcopy(gm.graph)
    for n in list(g.nodes):
        k = _TRAINING_ARG.get(n.target)  # type: ignore[arg-type]
        if k is not None and len(n.args) > k:
            n.args = (*n.args[:k], False, *n.args[k + 1 :])
        elif n.target is torch.ops.aten.add_.Tensor and not n.users:
            first = n.args[0]
            if isinstance(first, fx.Node) and str(first.target).endswith("num_batches_tracked"):
                g.erase_node(n)
    return fx.GraphModule(gm, g)


class CapturedModel(nn.Sequential):
    """The model's graph as layers. Its parameters and buffers are the model's own objects."""

    captured = True


class WithInputs(nn.Module):
    """A model called with fixed keyword inputs besides its one tensor: model(x, **inputs)."""

    def __init__(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.inputs = inputs
        for attr in ("example_input", "example_loss"):
            if hasattr(model, attr):
                setattr(self, attr, getattr(model, attr))

    def forward(self, x: torch.Tensor) -> Any:
        return self.model(x, **self.inputs)


def with_inputs(model: Any, inputs: dict[str, Any]) -> nn.Module:
    """What a MODEL factory may return besides a module: (module, keyword inputs), e.g.
    (GPT2LMHeadModel(cfg), {"use_cache": False}). Keyword inputs are settings, the same for
    every sample: tensors (per-sample inputs) are refused."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"the factory returned ({type(model).__name__}, ...), not a module")
    bad = [k for k, v in inputs.items() if not isinstance(k, str) or isinstance(v, torch.Tensor)]
    if bad:
        raise CaptureError(
            f"keyword inputs {bad} are tensors (or not names): only settings can be fixed; "
            "gpipe-plan pipelines models with one tensor input"
        )
    return WithInputs(model, dict(inputs))


def capture(model: nn.Module, sample: torch.Tensor) -> CapturedModel:
    """`model`'s graph (exported on `sample`, batch dimension left free) as a CapturedModel whose
    output equals model(x) for any batch size."""
    gm, out_spec = _export(model, sample)
    try:
        runs = _runs(gm, model)
        _out_of_place(gm, runs)
        while True:
            layers, bad = _layers(gm, runs, model, out_spec)
            if bad is None:
                break
            runs[bad - 1] = (runs[bad - 1][0], runs[bad - 1][1] + runs[bad][1])
            del runs[bad]
    except CaptureError:
        raise
    except Exception as e:  # a graph this code does not know how to cut: one line
        raise CaptureError(
            f"cannot cut the graph of {type(model).__name__} into layers "
            f"({type(e).__name__}: {e}); pass an nn.Sequential"
        ) from None
    captured = CapturedModel(*layers)
    for attr in ("example_input", "example_loss"):
        if hasattr(model, attr):
            setattr(captured, attr, getattr(model, attr))
    return captured


def _export(model: nn.Module, sample: torch.Tensor) -> tuple[fx.GraphModule, Any]:
    if not isinstance(sample, torch.Tensor) or sample.dim() < 1:
        raise CaptureError("capturing a graph needs a sample input tensor, batch first")
    if not hasattr(torch.export, "Dim") or not hasattr(torch.export.Dim, "AUTO"):
        raise CaptureError(
            f"capturing {type(model).__name__}'s graph needs torch 2.6 or later (this is "
            f"{torch.__version__}); upgrade torch, or pass an nn.Sequential"
        )
    if sample.shape[0] < 2:  # a batch of one would fix the batch size into the graph
        sample = torch.cat([sample, sample])
    was = model.training
    model.train()
    try:
        with _quiet():
            ep = torch.export.export(
                model, (sample,), dynamic_shapes=({0: torch.export.Dim.AUTO},), strict=False
            )
    except Exception as e:  # whatever export raises: one line, with where it stopped
        raise CaptureError(_why(model, e)) from None
    finally:
        model.train(was)
    gm = ep.module()
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise CaptureError(
            f"{type(model).__name__}.forward takes {len(inputs)} tensors; gpipe-plan pipelines "
            "models with one tensor input (wrap the others into the model, or pass them as one)"
        )
    val = inputs[0].meta.get("val")
    if isinstance(val, torch.Tensor) and not isinstance(val.shape[0], torch.SymInt):
        raise CaptureError(
            f"{type(model).__name__}'s graph fixes the batch size at {val.shape[0]} (forward "
            "depends on it, e.g. a view with a literal batch size); write x.shape[0] or -1 instead"
        )
    spec = ep.call_spec.out_spec
    return gm, (None if spec is not None and spec.is_leaf() else spec)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export logs warnings and graph listings while it works: keep them off the user's
    terminal (a failure is reported in one line instead)."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logger.setLevel(level)


def _why(model: nn.Module, e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    where = next((ln for ln in lines if ln.startswith("File ") and "torch/" not in ln), "")
    head = lines[0] if lines else type(e).__name__
    if len(head) > 200:
        head = head[:200] + "..."
    name = type(model).__name__
    if "data-dependent" in str(e) or "DataDependent" in type(e).__name__:
        hint = (
            "make forward free of control flow that depends on tensor values (torch.cond), or "
            "pass an nn.Sequential"
        )
    elif isinstance(e, TypeError) and "argument" in head:
        hint = f"gpipe-plan calls {name}(x) with one input tensor; give the others defaults"
    else:
        hint = "capture needs a forward that torch.export can trace, or pass an nn.Sequential"
    at = f"; at {where}" if where else ""
    return f"cannot capture the graph of {name} with torch.export ({type(e).__name__}: {head}{at}); {hint}"


def _unit(node: fx.Node, model: nn.Module, opened: set[str]) -> tuple[str, str] | None:
    """The module call a node belongs to: the outermost module on its stack that is not the
    model itself, not a container (Sequential, ModuleList, ModuleDict) and not `opened`."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        if not path or path in opened:
            continue
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(mod, _CONTAINERS):
            return path, type(mod).__name__
    return None


Run = tuple[tuple[str, str] | None, list[fx.Node]]

OPEN_ABOVE = 0.5  # a module call with more than this share of the graph is opened up


def _runs(gm: fx.GraphModule, model: nn.Module) -> list[Run]:
    """The graph's operations in order, cut into runs of one module call each; operations of no
    module (the model's own forward) join the run before them (the first run, at the start).
    A module that holds most of the graph (a library model's body inside its head, such as
    GPT2Model inside GPT2LMHeadModel) is opened: its own calls become the layers."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]  # (call_module: the guard)
    opened: set[str] = set()
    while True:
        units = [_unit(n, model, opened) for n in ops]
        counts: dict[tuple[str, str], int] = {}
        for u in units:
            if u is not None:
                counts[u] = counts.get(u, 0) + 1
        big = max(counts, key=counts.__getitem__, default=None)
        if big is None or counts[big] <= OPEN_ABOVE * len(ops):
            break
        deeper = any(
            u == big and _unit(n, model, opened | {big[0]}) not in (None, big)
            for n, u in zip(ops, units)
        )
        if not deeper:
            break
        opened.add(big[0])
    runs: list[Run] = []
    for n, u in zip(ops, units):
        if not runs:
            runs.append((u, [n]))
        elif u is None or u == runs[-1][0]:
            runs[-1][1].append(n)
        elif runs[-1][0] is None:
            runs[-1] = (u, runs[-1][1] + [n])
        else:
            runs.append((u, [n]))
    if not runs:
        raise CaptureError(f"{type(model).__name__}'s graph has no operations")
    return runs


def _out_of_place(gm: fx.GraphModule, runs: list[Run]) -> None:
    """An in-place operation on a value made by an earlier layer (`nn.ReLU(inplace=True)` as
    a module call of its own) would write into what the pipeline hands over as a leaf: it runs
    out of place instead, and every later use of the value takes its result."""
    where = {n: k for k, (_, nodes) in enumerate(runs) for n in nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k, (_, nodes) in enumerate(runs):
        for n in nodes:
            schema = getattr(n.target, "_schema", None)
            if schema is None or not n.args or not isinstance(n.args[0], fx.Node):
                continue
            first = schema.arguments[0].alias_info if schema.arguments else None
            a = n.args[0]
            if first is None or not first.is_write or a.op == "get_attr" or where.get(a, -1) == k:
                continue
            name = schema.name.split("::")[-1]
            packet = getattr(torch.ops.aten, name.rstrip("_"), None) if name.endswith("_") else None
            functional = getattr(packet, n.target._overloadname, None) if packet else None
            if functional is None:
                raise CaptureError(
                    f"{n.name} ({name}) writes in place into a value an earlier layer made, and "
                    "has no out-of-place form; avoid it at a module boundary"
                )
            n.target = functional
            for u in list(a.users):
                if u is not n and order[u] > order[n]:
                    u.replace_input_with(a, n)


def _kind(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor"
    if isinstance(val, torch.SymInt | int):
        return "size"
    return "other"


def _constant(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """A value computed from parameters and literals alone, by pure operations: each layer that
    needs it computes it again rather than receive it."""
    if node not in memo:
        if node.op == "get_attr":
            memo[node] = True
        elif node.op != "call_function" or node.is_impure():
            memo[node] = False
        else:
            memo[node] = all(_constant(a, memo) for a in node.all_input_nodes)
    return memo[node]


def _layers(
    gm: fx.GraphModule, runs: list[Run], model: nn.Module, out_spec: Any
) -> tuple[list[GraphLayer], int | None]:
    """One GraphLayer per run; or the index of the first cut where a value that is neither a
    tensor nor a size would cross (the caller merges its two runs and tries again)."""
    where: dict[fx.Node, int] = {}
    for k, (_, nodes) in enumerate(runs):
        for n in nodes:
            where[n] = k
    memo: dict[fx.Node, bool] = {}
    L = len(runs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], list | tuple) else [output.args[0]]
    outs = [n for n in outs if isinstance(n, fx.Node)]
    values = [
        n
        for n in gm.graph.nodes
        if (n.op == "placeholder" or n in where) and not _constant(n, memo)
    ]
    born = {n: where.get(n, -1) for n in values}
    uses = {n: sorted({where[u] for u in n.users if u in where} | ({L} if n in outs else set()))
            for n in values}  # fmt: skip
    # Tensors (and anything else) cross every cut from where they are made to their last use.
    live: list[list[fx.Node]] = [[] for _ in range(L + 1)]
    for n in values:
        if _kind(n) != "size":
            for c in range(born[n] + 1, max(uses[n], default=-1) + 1):
                live[c].append(n)
    # Sizes cross only up to the last layer that cannot compute them from its own inputs.
    dims = [_dims(live[c]) for c in range(L + 1)]
    size_memo: dict[tuple[fx.Node, int], bool] = {}
    for n in values:
        if _kind(n) == "size":
            need = [k for k in uses[n] if k > born[n] and not _derivable(n, dims[k], size_memo, k)]
            for c in range(born[n] + 1, max(need, default=-1) + 1):
                live[c].append(n)
    live[L] = outs
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for c in range(1, L):
        if any(_kind(n) == "other" for n in live[c]):
            return [], c
        live[c].sort(key=order.__getitem__)
    attrs = _attributes(gm, model)
    layers = []
    for k, (unit, nodes) in enumerate(runs):
        name, kind = unit if unit is not None else ("ops", "ops")
        spec = out_spec if k == L - 1 else None
        g = _subgraph(live[k], nodes, live[k + 1], memo, dims[k], size_memo, k)
        crossing = [n.name for n in live[k + 1]]
        placeholders = [p for p in g.nodes if p.op == "placeholder"]
        returned = {n.name for n in live[k + 1]} if k == L - 1 else set()
        reads = [
            p.name
            for p in placeholders
            if p.name in returned or any(u.op != "output" for u in p.users)
        ]
        inputs = [p.name for p in placeholders]
        here = any(n.op == "get_attr" and n.target == HERE for n in g.nodes)
        gm = fx.GraphModule({**attrs, HERE: torch.empty(0)} if here else attrs, g)
        if here:  # a buffer (moved with the layer), left out of the state dict
            gm._buffers.pop(HERE, None)
            gm.__dict__.pop(HERE, None)
            gm.register_buffer(HERE, torch.empty(0), persistent=False)
        layer = GraphLayer(gm, name, kind, crossing, spec, inputs, reads)
        for path, buf in layer.gm.named_buffers():
            mod_path, _, leaf = path.rpartition(".")
            try:
                owner = model.get_submodule(mod_path) if mod_path else model
            except AttributeError:
                continue
            if owner._buffers.get(leaf) is buf:
                layer.__dict__["owners"].append((path, owner, leaf))
        layers.append(layer)
    return layers, None


def _dims(inputs: list[fx.Node]) -> dict[str, tuple[fx.Node, int]]:
    """Each symbolic size among these tensors' dimensions -> (a tensor, its dimension)."""
    out: dict[str, tuple[fx.Node, int]] = {}
    for n in inputs:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    out.setdefault(str(size), (n, d))
    return out


def _derivable(
    n: fx.Node, dims: dict[str, tuple[fx.Node, int]], memo: dict[tuple[fx.Node, int], bool], k: int
) -> bool:
    """Whether a layer with tensors of these sizes can compute size `n` itself: it is one of
    their dimensions, or pure arithmetic on such sizes and literals."""
    key = (n, k)
    if key not in memo:
        if str(n.meta.get("val")) in dims:
            memo[key] = True
        elif n.op == "call_function" and not n.is_impure() and n.all_input_nodes:
            memo[key] = all(
                _kind(a) == "size" and _derivable(a, dims, memo, k) for a in n.all_input_nodes
            )
        else:
            memo[key] = False
    return memo[key]


def _attributes(gm: fx.GraphModule, model: nn.Module) -> dict[str, Any]:
    """What the graph's get_attr nodes name: the model's own parameters and buffers (so the
    layers train the model itself), and export's constants where the model has none."""
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        target = str(n.target)
        mod_path, _, leaf = target.rpartition(".")
        try:
            owner = model.get_submodule(mod_path) if mod_path else model
            attrs[target] = getattr(owner, leaf)
        except AttributeError:
            obj: Any = gm
            for part in target.split("."):
                obj = getattr(obj, part)
            attrs[target] = obj
    return attrs


def _as_size(t: torch.Tensor) -> int:
    return int(t.item())


def _as_tensor(n: int) -> torch.Tensor:
    return torch.tensor(int(n), dtype=torch.int64)


def _subgraph(
    inputs: list[fx.Node],
    nodes: list[fx.Node],
    outputs: list[fx.Node],
    memo: dict[fx.Node, bool],
    dims: dict[str, tuple[fx.Node, int]],
    size_memo: dict[tuple[fx.Node, int], bool],
    k: int,
) -> fx.Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        p = placeholders[n] = g.placeholder(n.name)
        p.meta = dict(n.meta)
        if _kind(n) != "size":
            env[n] = p

    def need(a: fx.Node) -> fx.Node:
        if a not in env:
            if a in placeholders:  # a size that came in: read where it is used
                env[a] = g.call_function(_as_size, (placeholders[a],))
            elif a.op == "get_attr":
                env[a] = g.get_attr(str(a.target))
            elif _kind(a) == "size" and str(a.meta.get("val")) in dims:
                t, d = dims[str(a.meta.get("val"))]
                env[a] = g.call_function(torch.ops.aten.sym_size.int, (env[t], d))
            elif _constant(a, memo) or (_kind(a) == "size" and _derivable(a, dims, size_memo, k)):
                for b in a.all_input_nodes:
                    need(b)
                env[a] = g.node_copy(a, lambda b: env[b])
            else:
                raise CaptureError(f"value {a.name} is used before the layer that needs it")
        return env[a]

    for n in nodes:
        for a in n.all_input_nodes:
            need(a)
        env[n] = g.node_copy(n, lambda b: env[b])
    result = []
    for n in outputs:
        if n in placeholders:  # handed on as it came
            result.append(placeholders[n])
            continue
        v = need(n)
        result.append(g.call_function(_as_tensor, (v,)) if _kind(n) == "size" else v)
    g.output(tuple(result))
    _on_the_layers_device(g)
    return g


_MOVES = (torch.ops.aten._to_copy.default, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout)


def _on_the_layers_device(g: fx.Graph) -> None:
    """What the model makes "on the device of x" (torch.arange(n, device=x.device)), the capture
    wrote down as the device it ran on: make it, instead, where the layer's inputs are, as the
    model would on the GPU its stage runs on. (A move the model asks for, .to(d), stays.)"""
    made = [
        n for n in g.nodes
        if n.op == "call_function" and n.target not in _MOVES
        and isinstance(n.kwargs.get("device"), torch.device)
    ]  # fmt: skip
    if not made:
        return
    with g.inserting_before(made[0]):  # a buffer of no bytes, which goes where the layer goes
        here = g.call_function(torch.ops.prim.device.default, (g.get_attr(HERE),))
    for n in made:
        n.update_kwarg("device", here)


HERE = "_here"  # the buffer of a layer that makes tensors on its own device (see above)


__all__ = ["CaptureError", "CapturedModel", "GraphLayer", "capture", "with_inputs"]  # emit: drop
