# ---------------------------------------------------------------------------------------------
# gpipe-plan pipeline runtime: the helpers a compiled program's straight-line train_step calls.
# Imports only torch. Each call runs one action of the schedule for one (stage, micro-batch):
#
#     forward(s, m)          run stage s on micro-batch m; push its output to stage s + 1
#     backward(s, m)         pull the output gradient; full backward; leave the input gradient
#     backward_input(s, m)   zero-bubble I: the input gradient only (graph kept for W)
#     backward_weight(s, m)  zero-bubble W: the weight gradients, then free the graph
#
# What a stage holds, and for how long, is what the planner counts (schedules/memory.py):
#   - its input, from the moment the previous stage pushes a copy of it until its backward (or
#     I) has made the input gradient (stage 0 copies its micro-batch only from another device;
#     on its own device it works on the caller's, through an alias of its own: see _own);
#   - what autograd saves; never the stage's output itself: once pushed, the output is dropped
#     and backward starts from its gradient edge, so its memory goes unless autograd saved it;
#   - the input gradient, until the previous stage pulls a copy at its own backward (or I);
#   - zero bubble only: from I to W the output gradient and every layer output's gradient.
# The last stage runs the loss as its final layer (re-run with the stage when recomputing) and
# scales each micro-batch's (mean) loss by its share of the mini-batch, so the gradients add up
# to those of the whole mini-batch's mean loss.
# On CUDA each stage has its own compute stream plus send/receive copy streams; events order the
# streams and record_stream tells the allocator which streams still use a tensor, so one host
# thread issues every action and kernels of different stages overlap. On CPU the same calls run
# in order and compute the same numbers. Every action runs inside record_function("gpipe.mem:s"),
# which lets `measure` charge each allocation to the stage that made it.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ._numerics import defer_batch_norm, replaying, restore_rng, save_rng, seed_layer  # emit: drop

Value = Any  # a tensor or a tuple of tensors: what flows between layers of an nn.Sequential
Grads = list  # per tensor of a stage boundary: its gradient, or None where it needs none


class StageError(RuntimeError):
    """An exception inside a stage, naming the action, the stage and the micro-batch."""


class ModelMismatch(ValueError):
    """The model given is not the one this program was planned for (its layers, its routes)."""


def described(e: BaseException) -> str:
    """`Type: message` of an exception, even one whose own str() raises (found by a red team:
    the message was made before the other ranks were told, and a launch hung on it)."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - whatever it raises, the failure is still told
        text = "(its message could not be read)"
    return f"{type(e).__name__}: {text}"


def checkpoint(run: Callable[..., Value], *args: torch.Tensor) -> Value:
    """`run` under torch's non-reentrant checkpoint, whose re-run in backward stops once every
    tensor the first run saved is back (early stop), as the plan counts it: on even where the
    caller turned it off (set_checkpoint_early_stop). Each layer re-seeds itself (seeded), so
    the checkpoint need not keep random states."""
    stop = getattr(_checkpoint, "set_checkpoint_early_stop", None)
    with stop(True) if stop else contextlib.nullcontext():
        return _checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)


def _tensors(v: Value) -> list[torch.Tensor]:
    if isinstance(v, dict):  # a captured graph's stage boundary: value name -> tensor
        return list(v.values())
    return list(v) if isinstance(v, tuple) else [v]


def _like(v: Value, ts: list[torch.Tensor]) -> Value:
    if isinstance(v, dict):
        return dict(zip(v, ts))
    return tuple(ts) if isinstance(v, tuple) else ts[0]


Routes = dict[tuple[int, int], list[str]]
RECEIVED = "received"  # in place of a CUDA event: gradients another rank sent, already ours


def routes_of(layers: list[nn.Module], stages: list[tuple[int, int]]) -> Routes:
    """A captured graph's (sender, receiver) stage -> the names of the values that go straight
    from the stage that makes them to each later stage that reads them (planner/routing.py
    says the same from the profile). Stage 0 holds the model's input."""
    stage_of = [s for s, (a, b) in enumerate(stages) for _ in range(a, b)]
    born: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    for k, layer in enumerate(layers):
        for name in layer.reads:
            if name in born:
                readers[name].add(stage_of[k])
        for name in layer.crossing:
            if name not in born:
                born[name] = stage_of[k]
                readers[name] = set()
    out: Routes = {}
    for name, src in born.items():
        for dst in sorted(readers[name] - {src}):
            out.setdefault((src, dst), []).append(name)
    return out


def _own_memory(g: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient left for the sender that holds no more memory than its own: autograd may
    leave an input's gradient as a view into a larger one (cat's backward narrows its output
    gradient, and at one sample the slice is contiguous, so the leaf keeps the view), which
    would hold the whole buffer until the sender pulls it (a U-Net's last stage held 3% more
    than its plan: found by a red team)."""
    if g is None or g.untyped_storage().nbytes() <= g.numel() * g.element_size():
        return g
    return g.clone()


class _Owned(torch.autograd.Function):
    """The identity, whose backward hands on the gradient in its own memory (`_own_memory`),
    and adds `key` to `seen` where that took a copy."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, key: Any, seen: set[Any] | None) -> torch.Tensor:
        ctx.key, ctx.seen = key, seen
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        own = _own_memory(g)
        if own is not g and ctx.seen is not None:
            ctx.seen.add(ctx.key)
        return own, None, None


_OWNED = _Owned._backward_cls


class _Made(torch.autograd.Function):
    """The identity, on each output of a layer that makes several (zero bubble): the gradient
    autograd gives its node is what the layers after it send back, not also what the layer's
    other outputs, made from this one, send back through it inside the layer."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def _grads(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _trains(layer: nn.Module) -> bool:
    """Whether zero bubble's W has work in the layer (its profile lists trainable tensors)."""
    return any(p.requires_grad for p in layer.parameters())


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    d = t.detach()
    return d.requires_grad_(grad and d.is_floating_point())


def _edges(v: Value) -> list[tuple[int, GradientEdge]]:
    """(position, gradient edge) of each tensor of `v` that autograd reaches."""
    return [
        (k, get_gradient_edge(t))
        for k, t in enumerate(_tensors(v))
        if t is not None and t.requires_grad
    ]


def _handed_on(
    roots: list[Any], grads: list[torch.Tensor] | None, leaves: list[torch.Tensor]
) -> tuple[list[Any], list[torch.Tensor] | None, list[tuple[int, torch.Tensor]]]:
    """Split off the roots that are one of the stage's input `leaves` itself (its layers hand
    that input on untouched): (the other roots, their gradients, (leaf index, gradient) of
    those). Such a gradient is the input's as pulled; through autograd it would be copied, as
    one the caller holds, and zero bubble's W would reach the input again."""
    if grads is None:
        return roots, grads, []
    at = {id(get_gradient_edge(t).node): k for k, t in enumerate(leaves) if t.requires_grad}

    def leaf(e: GradientEdge) -> int | None:  # (zero bubble's layers read through _Owned)
        node = e.node
        while isinstance(node, _OWNED):
            node = node.next_functions[0][0]
        return at.get(id(node))

    passed = [(leaf(e), g) for e, g in zip(roots, grads) if leaf(e) is not None]
    if not passed:
        return roots, grads, []
    kept = [(e, g) for e, g in zip(roots, grads) if leaf(e) is None]
    return [e for e, _ in kept], [g for _, g in kept], passed


Tied = list[tuple[nn.Parameter, list[nn.Parameter]]]


def out_of_place(layers: list[nn.Module]) -> None:
    """Layers that change their input in place (ReLU(inplace=True)) made to write a new
    tensor: a stage's input is a tensor autograd does not let change, and any of them may
    begin a stage. The first too: the caller's batch is left as it was, and the stage holds a
    new tensor as the profile measured it (found by a red team: in place there, the plan said 0
    bytes where the run held a micro-batch). The profile measures them so (profiler/measure.py);
    the values are the same."""
    for layer in layers:
        if getattr(layer, "inplace", None) is True:
            layer.inplace = False


def untie(stages: list[nn.Sequential], ranks: list[int]) -> Tied:
    """Give each device but the first its own copy of a parameter that stages on several
    devices use (tied weights, e.g. an embedding and the output head): (the model's own
    parameter, its copies). A device's stages share one copy. The layers that use a copy are
    themselves copies (sharing every other parameter and buffer): the model stays as it was."""
    first: dict[int, int] = {}
    copies: dict[tuple[int, int], nn.Parameter] = {}
    tied: dict[int, tuple[nn.Parameter, list[nn.Parameter]]] = {}
    for s, st in enumerate(stages):
        for k, layer in enumerate(st):
            memo: dict[int, Any] = {id(t): t for t in (*layer.parameters(), *layer.buffers())}
            foreign = False
            for p in layer.parameters():
                if first.setdefault(id(p), ranks[s]) == ranks[s]:
                    continue
                c = copies.get((id(p), ranks[s]))
                if c is None:
                    c = copies[(id(p), ranks[s])] = nn.Parameter(
                        p.detach().clone(), p.requires_grad
                    )
                    tied.setdefault(id(p), (p, []))[1].append(c)
                memo[id(p)] = c
                foreign = True
            if foreign:
                st[k] = copy.deepcopy(layer, memo)
    return list(tied.values())


def sync_tied(tied: Tied) -> None:
    """Each copy takes the model's parameter as the optimizer left it, frozen or not."""
    with torch.no_grad():
        for p, copies in tied:
            for c in copies:
                c.copy_(p)
                c.requires_grad_(p.requires_grad)


def gather_tied(tied: Tied) -> None:
    """The copies' gradients, summed into the model's parameter: as if it had been used there."""
    with torch.no_grad():
        for p, copies in tied:
            for c in copies:
                if c.grad is None:
                    continue
                g = c.grad.to(p.device)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
                c.grad = None


_UNOWNED = contextlib.nullcontext()


def owner(s: int) -> contextlib.AbstractContextManager[Any]:
    """Allocations inside belong to stage s (see profiler/memtrack.py): a range the profiler
    records, where one is running (else nothing: a range costs about 14 us per action)."""
    if not torch.autograd._profiler_enabled():
        return _UNOWNED
    return torch.profiler.record_function(f"gpipe.mem:{s}")


class PipelineRuntime:
    """Stages, devices, streams and the per-micro-batch state of one step. A compiled program
    subclasses it with the plan's constants and the straight-line train_step and infer."""

    SCHEDULE = "gpipe"
    MICROBATCHES = 1
    STAGES: list[tuple[int, int]] = []  # [start, end) layer range of each stage
    RANKS: list[int] = []  # device position of each stage
    RECOMPUTE: list[str] = []  # each stage's recomputation: never, except_last or always
    CHECKPOINTED: list[int] = []  # layers run under a checkpoint of their own (no RECOMPUTE)
    ROUTES: list[tuple[int, int]] = []  # a captured graph's (sender, receiver) stages, planned
    # per stage, the bytes of trainable parameters the plan counted, where it counted some
    # frozen (the model as profiled; empty: every parameter trains)
    GRADS: list[int] = []
    warned_frozen = False

    def __init__(
        self,
        model: nn.Sequential,
        devices: list[str | torch.device],
        *,
        deferred_batch_norm: bool = False,
    ) -> None:
        layers = list(model)
        if not self.STAGES or self.STAGES[-1][1] != len(layers):
            raise ModelMismatch(
                f"this program splits {self.STAGES[-1][1] if self.STAGES else 0} layers; "
                f"the model has {len(layers)}"
            )
        out_of_place(layers)
        self.devices = [_indexed(torch.device(devices[r])) for r in self.RANKS]
        # The stages hold the model's own layers (and so its own parameters), moved in place;
        # a parameter that stages on several devices use (tied weights) is copied to the others.
        stages = [nn.Sequential(*layers[a:b]) for a, b in self.STAGES]
        self._route(layers)
        self.tied = untie(stages, self.RANKS)
        self.stages = [st.to(d) for st, d in zip(stages, self.devices)]
        # zero bubble: a parameter two layers of one stage share gets its gradient in I, over
        # the whole stage (a layer's own W would also reach it through the other layer)
        self.shared = [_shared_parameters(st) for st in self.stages]
        self.deferred_batch_norm = deferred_batch_norm
        if deferred_batch_norm:
            for st in self.stages:
                defer_batch_norm(st, self.MICROBATCHES)
        self.cuda = any(d.type == "cuda" for d in self.devices)
        if self.cuda:
            self.compute = [torch.cuda.Stream(d) for d in self.devices]
            self.send_streams = [torch.cuda.Stream(d) for d in self.devices]
            self.recv_streams = [torch.cuda.Stream(d) for d in self.devices]
        # Where a stage's computation runs; tests swap in a saved_tensors_hooks context here.
        self.stage_context: Callable[[int], contextlib.AbstractContextManager[Any]] = lambda s: (
            contextlib.nullcontext()
        )
        # When a list: every action appends (what, stage, micro-batch, start, end); `measure`
        # reads it (times in ms; CUDA events until action_times() resolves them).
        self.action_log: list[tuple[str, int, int, Any, Any]] | None = None
        self.rng: Any = None
        self.zero: dict[torch.device, Any] = {}  # CUDA: each GPU's start event, when logging
        self._watch()
        self._reset()

    def _watch(self) -> None:
        """Zero bubble reads each layer input through `_Owned` in the first step, and in later
        steps only those whose gradient came as a slice of a larger one: the others hand on
        the gradient unchanged, and an `_Owned` costs an autograd node each way (a step of a
        16-layer MLP of tiny layers took 1.26x as long with one on every input). Watched again
        once the parameters that train are others (_rewatch)."""
        self.sliced: frozenset[tuple[int, int]] | None = None  # (layer, input); None: watching
        self.seen: set[tuple[int, int]] = set()
        self.watched_for: tuple[bool, ...] | None = None

    def _rewatch(self) -> None:
        """Watch again where the parameters that train are not those the watched step trained:
        an input that needed no gradient then may need one now (a step with the stages
        frozen, then unfrozen, never watched them, and held 19.8% over its plan from then on:
        found by a review)."""
        training = tuple(p.requires_grad for st in self.stages for p in st.parameters())
        if training != self.watched_for:
            self._watch()
            self.watched_for = training

    def _watched(self) -> None:
        """A step has run whole: from now on `_Owned` only where it copied (see _watch)."""
        if self.sliced is None:
            self.sliced = frozenset(self.seen)

    def _read_owned(self, index: int, x: Value) -> Value:
        """Layer `index`'s input, each tensor that needs a gradient read through `_Owned` where
        a slice was seen or the first step is still being watched (_watch)."""
        watching = self.sliced is None
        return _like(
            x,
            [
                _Owned.apply(t, (index, n), self.seen if watching else None)
                if _grads(t) and (watching or (index, n) in self.sliced)  # type: ignore[operator]
                else t
                for n, t in enumerate(_tensors(x))
            ],
        )

    def _route(self, layers: list[nn.Module]) -> None:
        """A captured graph's stages take and give named values, along its routes; an
        nn.Sequential's stages hand one value (a tensor or a tuple) each to the next."""
        S = len(self.STAGES)
        self.routed = bool(layers) and getattr(layers[0], "captured_layer", False)
        self.routes: Routes = routes_of(layers, self.STAGES) if self.routed else {}
        self.receives = [
            [n for (a, b), names in sorted(self.routes.items()) if b == t for n in names]
            for t in range(S)
        ]
        self.gives: list[list[str]] = []
        # per stage, how many stages each value it gives goes to (pull sums their gradients)
        self.readers: list[dict[str, int]] = []
        for s in range(S):
            names: list[str] = []
            count: dict[str, int] = {}
            for (a, _), carried in sorted(self.routes.items()):
                names += [n for n in carried if a == s and n not in names]
                for n in carried if a == s else ():
                    count[n] = count.get(n, 0) + 1
            self.gives.append(names)
            self.readers.append(count)
        self.input_name = layers[0].inputs[0] if self.routed else ""
        if self.routed and self.ROUTES and sorted(self.routes) != sorted(self.ROUTES):
            raise ModelMismatch(
                f"this program was planned to send along stages {sorted(self.ROUTES)}, but "
                f"the model's graph sends along {sorted(self.routes)}: plan it again"
            )

    # -- a step ---------------------------------------------------------------------------

    def begin(self, x: torch.Tensor, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        M, n = self.MICROBATCHES, x.shape[0]
        if n < M:
            raise ValueError(
                f"a batch of {n} cannot be split into {M} micro-batches; pass at least {M} samples"
            )
        self.loss_fn = loss_fn
        self._reset()
        # One draw from the caller's RNG per step; every (layer, micro-batch) forward then runs on
        # its own seed, so dropout masks do not depend on the schedule or on recomputation.
        self.seed = int(torch.randint(0, 2**62, (1,)).item())
        self.rng = save_rng(self.devices)
        self.batch = list(torch.tensor_split(x, M))  # views; stage 0 takes each (_own)
        self.targets = _split_target(y, M)
        self.weights = [c.shape[0] / n for c in self.batch]
        # read at each step: a caller may freeze or unfreeze layers between steps
        sync_tied(self.tied)
        if self.SCHEDULE == "zb-h1":
            self._rewatch()
        training = [trains(st) for st in self.stages]
        self.trains_before = trains_before(training)
        self.check_frozen(range(len(self.stages)))
        self.shared = [_shared_parameters(st) for st in self.stages]
        self._enter_streams()
        if self.cuda and self.action_log is not None:
            # NOTE: CUDA times two events only on one device: each GPU's actions are timed
            # from its own start, all recorded at once here, after the caller's work.
            self.zero = {}
            for s, d in enumerate(self.devices):
                if d not in self.zero:
                    self.zero[d] = torch.cuda.Event(enable_timing=True)
                    self.zero[d].record(self.compute[s])

    def finish(self) -> torch.Tensor:
        """Make the default streams wait for the pipeline, and return the mini-batch loss."""
        self._leave_streams()
        gather_tied(self.tied)
        total = sum(self.losses[m] for m in range(self.MICROBATCHES))
        self._watched()
        self._reset()
        return total  # type: ignore[return-value]

    def _end_rng(self) -> None:
        """Give the caller back its RNG as it was before the step (after its seed draw)."""
        restore_rng(self.rng)
        self.rng = None

    def _reset(self) -> None:
        """Forget the step: every tensor of it is dropped here, or earlier by the actions, and
        the caller's RNG is restored."""
        self._end_rng()
        self.batch: list[torch.Tensor] = []
        self.targets: list[Any] = []
        self.inputs: dict[tuple[int, int], Value] = {}  # a stage's input, arrival to backward
        self.roots: dict[tuple[int, int], list[tuple[int, GradientEdge]]] = {}  # its output's
        self.loss_roots: dict[int, torch.Tensor] = {}  # the last stage's loss, until backward
        self.losses: dict[int, torch.Tensor] = {}  # detached, for the step's total
        self.outgrads: dict[tuple[int, int], tuple[Grads, Any]] = {}  # (grads, CUDA event)
        self.kept: dict[tuple[int, int], tuple[list[Any], Any]] = {}  # zero bubble: I to W
        self.inner: dict[tuple[int, int], list[list[GradientEdge]]] = {}  # layer output edges
        self.inner_grads: dict[tuple[int, int], list[list[torch.Tensor | None]]] = {}

    def check_frozen(self, stages: Iterable[int]) -> None:
        """Warn (once) where one of `stages` trains more parameter bytes than the plan counted
        (GRADS): the gradients and optimizer state of those it counted frozen are not in its
        memory figures (a stage that trained nothing, or one that trains some of its layers:
        a review's, 27% over its plan, unsaid)."""
        if not self.GRADS or self.warned_frozen:
            return
        more = [s for s in stages if trainable_bytes(self.stages[s]) > self.GRADS[s]]
        if more:
            import warnings

            self.warned_frozen = True
            warnings.warn(
                f"stage(s) {more} train parameters the plan counted as frozen (as the model was "
                "when profiled): their gradients and optimizer state are not in its memory "
                "figures; profile and plan the model again",
                stacklevel=3,
            )

    # -- actions --------------------------------------------------------------------------

    def forward(self, s: int, m: int) -> None:
        with self._action("forward", s, m):
            x = _own(self.batch[m], self.devices[s]) if s == 0 else self._take(s, m)
            inp = _like_leaf(x, grad=self.trains_before[s])
            if isinstance(inp, dict) and self.input_name in inp:  # the model's input, sent on:
                inp[self.input_name].requires_grad_(False)  # no gradient goes back for it
            del x
            self.inputs[(s, m)] = inp
            with self.stage_context(s):
                out = self._run(s, m, inp)
            if s == len(self.stages) - 1:
                self.loss_roots[m] = out
                self.losses[m] = out.detach()
                return
            # (a recomputed stage ran this forward without a graph, and finds the roots as
            # it re-materialises: a stage of views alone made views of its input that need a
            # gradient and have no node, and asking for their edges failed: a red team's)
            self.roots[(s, m)] = [] if self._recomputes(s, m) else _edges(out)
            self.push(out, s, m)

    def backward(self, s: int, m: int) -> None:
        with self._action("backward", s, m):
            roots, grads = self._backward_roots(s, m, keep=False)
            inp = self.inputs.pop((s, m))
            ts = _tensors(inp)
            roots, grads, passed = _handed_on(roots, grads, ts)
            if roots:
                torch.autograd.backward(roots, grads)
            del roots, grads
            for k, g in passed:
                others = [h for _, h in passed] + [t.grad for n, t in enumerate(ts) if n != k]
                ts[k].grad = _summed(ts[k].grad, g, others)
                del others
            del passed
            if s > 0:
                self.leave_grad([t.grad for t in ts], s, m, ts)

    def backward_input(self, s: int, m: int) -> None:
        with self._action("backward_input", s, m):
            # (recomputing, re-materialised now: W needs the graph as much as I does)
            roots, grads = self._backward_roots(s, m, keep=True)
            last = s == len(self.stages) - 1
            inputs = _tensors(self.inputs.pop((s, m)))
            wrt = [t for t in inputs if t.requires_grad]
            # (W must not reach the stage's input through an output that is the input itself)
            roots, grads, passed = _handed_on(roots, grads, wrt)
            # Also ask for the gradient of every layer's output that W needs (a layer with
            # weights that train): the same pass computes them, and then W can run each
            # layer's weight gradient on its own. The others' are let go as I goes on.
            inner = self.inner.get((s, m), [])
            trains = [_trains(layer) for layer in self.stages[s]]
            hidden = [e for k, edges in enumerate(inner) if trains[k] for e in edges]
            # The last stage's W starts from its last layer's output gradient, taken here, not
            # from the loss: then the loss's backward runs once, and its graph goes with I.
            # Elsewhere W keeps the roots its last layer made; a value an earlier layer made
            # and the stage sends on (a skip) is that layer's, whose total gradient I returns
            # below: the one pulled for it is let go when I ends.
            # (a value a layer hands on unchanged reaches the roots through the _Owned its
            # reader read it by: not the last layer's own either)
            made = {(id(e.node), e.output_nr) for edges in inner for e in edges}
            own = [
                (e, g)
                for e, g in zip(roots, grads or [])
                if (id(e.node), e.output_nr) not in made and not isinstance(e.node, _OWNED)
            ]
            # The roots' edges are kept to W (not on the last stage, whose loss's graph goes
            # with I): they hold the stage's graph, whose saved tensors the plan counts until
            # W whether or not its last layer trains; their gradients only where it trains,
            # for its W (the rest of I lets them go).
            edges = [] if last else [e for e, _ in own]
            self.kept[(s, m)] = (edges, [g for _, g in own] if not last and trains[-1] else None)
            del own
            got: list[torch.Tensor | None] = []
            shared = self.shared[s]
            if (wrt or hidden or shared) and roots:
                got = list(
                    torch.autograd.grad(
                        roots, wrt + hidden + shared, grads, retain_graph=True, allow_unused=True
                    )
                )
            del roots, grads
            for p, g in zip(shared, got[len(wrt) + len(hidden) :]):
                _accumulate(p, g)
            made_grads = iter(got[len(wrt) : len(wrt) + len(hidden)])
            self.inner_grads[(s, m)] = [
                [next(made_grads) for _ in edges] if trains[k] else []
                for k, edges in enumerate(inner)
            ]
            del made_grads
            del got[len(wrt) :]
            if passed:
                got = got or [None] * len(wrt)
                # (not into a gradient W still reads, one autograd handed back as a view, nor
                # into one it handed back for another input too: x + y's, say)
                keeps = [h for _, h in passed] + list(self.kept[(s, m)][1] or [])
                keeps += [h for hs in self.inner_grads[(s, m)] for h in hs if h is not None]
                for k, g in passed:
                    others = keeps + [h for n, h in enumerate(got) if n != k]
                    got[k] = _summed(got[k], g, others)
                del keeps, others, g
            del passed
            if s > 0:
                it = iter(got[: len(wrt)] if got else [None] * len(wrt))
                grads_in = [next(it) if t.requires_grad else None for t in inputs]
                self.leave_grad(grads_in, s, m, inputs)

    def backward_weight(self, s: int, m: int) -> None:
        with self._action("backward_weight", s, m):
            roots, grads = self.kept.pop((s, m))
            inner = self.inner.pop((s, m))
            # layer by layer, from each layer's output and the gradient I left for it, the
            # last layer first: each layer's graph goes as its W runs, and a tensor two layers
            # save (one's output, the next one's input) goes with the earlier one's W, as the
            # profile measured it (layer alone), not after it
            hidden = self.inner_grads.pop((s, m))
            layers = list(self.stages[s])
            last = s == len(self.stages) - 1
            for k in reversed(range(len(layers))):
                if k == len(layers) - 1 and not last:  # the stage's own roots: its output's
                    outs, gs = (roots, grads) if grads is not None else ([], [])
                else:
                    pairs = list(zip(inner[k], hidden[k]))
                    outs = [e for e, g in pairs if g is not None]
                    gs = [g for _, g in pairs if g is not None]
                layer = layers[k]
                shared = {id(p) for p in self.shared[s]}
                params = [p for p in layer.parameters() if p.requires_grad and id(p) not in shared]
                if outs and params:
                    torch.autograd.backward(outs, gs, inputs=params)

    # -- inference ------------------------------------------------------------------------

    def infer_begin(self, x: torch.Tensor) -> None:
        M = min(self.MICROBATCHES, x.shape[0])
        self.infer_microbatches = M
        self.batch = list(torch.tensor_split(x, M))
        self.inputs, self.outputs = {}, {}
        sync_tied(self.tied)
        self._enter_streams()

    def infer_forward(self, s: int, m: int) -> None:
        if m >= self.infer_microbatches:
            return
        with self._action("forward", s, m), torch.no_grad():
            x = self.batch[m].to(self.devices[0]) if s == 0 else self._take(s, m)
            out = self._apply(s, x) if self.routed else self.stages[s](x)
            if s == len(self.stages) - 1:
                self.outputs[(s, m)] = out
            else:
                self.push(out, s, m)

    def infer_finish(self) -> Value:
        self._leave_streams()
        last = len(self.stages) - 1
        outs = [self.outputs.pop((last, m)) for m in range(self.infer_microbatches)]
        self.inputs, self.outputs, self.batch = {}, {}, []
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        if not isinstance(outs[0], torch.Tensor):  # a library's output class: per field
            return torch.utils._pytree.tree_map(lambda *parts: torch.cat(parts), *outs)
        return torch.cat(outs)

    # -- machinery ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _action(self, what: str, s: int, m: int) -> Iterator[None]:
        log = self.action_log
        self.doing: tuple[str, int, int] | None = (what, s, m)  # (kept where it fails)
        try:
            with owner(s), self._stream(s):
                if log is None:
                    yield
                else:
                    start = self._clock(s)
                    yield
                    log.append((what, s, m, start, self._clock(s)))
        except StageError:
            raise
        except Exception as e:
            self._end_rng()
            raise StageError(f"{what} of stage {s}, micro-batch {m} failed: {described(e)}") from e
        self.doing = None

    def _clock(self, s: int) -> Any:
        if not self.cuda:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.compute[s])
        return event

    def action_times(self) -> list[tuple[str, int, int, float, float]]:
        """The action log with times in ms (on CUDA: since the step began on the action's GPU,
        after waiting for every GPU)."""
        log = self.action_log or []
        if not self.cuda or not log:
            return list(log)
        for d in set(self.devices):  # synchronize() alone waits for the current GPU only
            torch.cuda.synchronize(d)
        zero = [self.zero[d] for d in self.devices]
        return [
            (w, s, m, zero[s].elapsed_time(a), zero[s].elapsed_time(b)) for w, s, m, a, b in log
        ]

    def _recomputes(self, s: int, m: int) -> bool:
        mode = self.RECOMPUTE[s] if self.RECOMPUTE else "never"
        return mode == "always" or (mode == "except_last" and m < self.MICROBATCHES - 1)

    def _run(self, s: int, m: int, inp: Value) -> Value:
        """Stage s's forward on micro-batch m, keeping for backward what the plan says: all it
        saves, or (recomputing) only its input: then it runs without a graph, and B (zero
        bubble's I) runs it again by hand at its start (_rematerialise), as the plan counts it.
        (torch's checkpoint re-runs it at the first saved tensor backward reads, after the
        backward of the stage's last layers that read none, whose gradients it holds through
        the re-run, and keeps what the first run's ctx hold: 12.4% above the plan, measured.)"""
        if not self._recomputes(s, m):
            return self._forward(s, m, inp, keep=self.SCHEDULE == "zb-h1")
        given = [t for t in _tensors(inp) if isinstance(t, torch.Tensor)]
        before = [t._version for t in given]
        with torch.no_grad():
            out = self._forward(s, m, inp)
        if [t._version for t in given] != before:
            raise RuntimeError(
                "the stage's layers change their input in place, so its forward cannot be "
                "run again from it: plan this stage without recomputation"
            )
        return out

    def _rematerialise(self, s: int, m: int, keep: bool) -> None:
        """Stage s's forward on micro-batch m again, now with its graph, from the input it
        kept: on the same seeds, batch norm counting it once. `keep`: for zero bubble's W."""
        replay = replaying(self.stages[s], replay=True, checkpointed=False)
        with self.stage_context(s), replay:
            out = self._forward(s, m, self.inputs[(s, m)], keep=keep)
        if s == len(self.stages) - 1:
            self.loss_roots[m] = out
        else:
            self.roots[(s, m)] = _edges(out)

    def _checkpointed(self, s: int, m: int, index: int, layer: nn.Module, x: Value) -> Value:
        """Layer `index` under a checkpoint of its own: it keeps its input alone, and runs its
        forward again inside its backward, on the same seed, batch norm counting once."""
        calls = [0]

        def run(*args: torch.Tensor) -> Value:
            calls[0] += 1
            seed_layer(self.devices[s], self.seed, index, m)
            with replaying(layer, replay=calls[0] > 1):
                return layer(_like(x, list(args)))

        return checkpoint(run, *_tensors(x))

    def _forward(self, s: int, m: int, inp: Value, keep: bool = False) -> Value:
        """The layers; on the last stage then the loss on a copy of the target made here (so
        nothing holds it between forward and backward), scaled by the micro-batch's share."""
        h = self._layers(s, m, inp, keep)
        if s < len(self.stages) - 1:
            return h
        target = _to(self.targets[m], self.devices[s], copy=True)
        loss = self.loss_fn(h, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(
                f"the loss function returned {shape}, not a scalar tensor: it must reduce "
                "(average) over the samples it is given"
            )
        if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(h)):
            if not loss.is_floating_point() or not loss.requires_grad:
                # (found by a red team: a detached, constant or integer loss was taken, and
                # the step silently computed no gradient)
                raise TypeError(
                    f"the loss function returned a {loss.dtype} tensor without a gradient "
                    "(detached from the output, made without it, or an integer): the step "
                    "would compute no gradient"
                )
        return loss * self.weights[m]

    def _layers(self, s: int, m: int, h: Value, keep: bool = False) -> Value:
        """Each layer on its own seed: dropout masks depend on (step, layer, micro-batch) only,
        not on the schedule, the partition or recomputation. `keep`: remember every inner
        layer output's gradient edge, for a layer-by-layer weight gradient (zero-bubble W)."""
        first = self.STAGES[s][0]
        layers = list(self.stages[s])
        inner = []

        def seeded(k: int, layer: nn.Module, x: Value) -> Value:
            if keep:
                # each layer reads its inputs through `_Owned`: the gradient it makes for one
                # is then in its own memory as soon as it is made, not a slice of a larger one
                # (a cat's) that lives as long as the slice: kept by I for W, or waiting to be
                # summed with another layer's part (after the first step, only where one was)
                x = self._read_owned(first + k, x)
            if first + k in self.CHECKPOINTED and torch.is_grad_enabled():
                out = self._checkpointed(s, m, first + k, layer, x)
            else:
                seed_layer(self.devices[s], self.seed, first + k, m)
                out = layer(x)
            if keep and (k < len(layers) - 1 or s == len(self.stages) - 1):
                # the layer's own outputs: what it hands on unchanged is not its output, and
                # its gradient is kept where it was made (or is the stage's input gradient);
                # on the last stage also the last layer's, which the loss takes
                handed = {id(t) for t in _tensors(x) if t is not None}
                ts = _tensors(out)
                made = {n for n, t in enumerate(ts) if _grads(t) and id(t) not in handed}
                if len(made) > 1:
                    # W takes each output's gradient and runs the layer's backward from all of
                    # them: asked at the output's own node, the gradient of an output the layer
                    # makes another from (h, and tanh(h)) holds that one's part as well, which
                    # W then counted twice (found by a red team: 0.8x off the weight's
                    # gradient). Asked past a node of its own, it holds the later layers' alone.
                    out = _like(out, [_Made.apply(t) if n in made else t for n, t in enumerate(ts)])
                inner.append([e for n, e in _edges(out) if n in made])
            return out

        if self.routed:
            h = self._apply(s, h, seeded)
        else:
            for k, layer in enumerate(layers):
                h = seeded(k, layer, h)
        if keep:
            self.inner[(s, m)] = inner
        return h

    def _apply(
        self, s: int, given: Value, call: Callable[[int, nn.Module, Value], Value] | None = None
    ) -> Value:
        """A captured graph's stage: its layers on the named values it was given (the model's
        input on stage 0); a value it was not sent only passes through a layer, as None. The
        last stage returns the model's output; the others what they send, by name."""
        env: dict[str, Any] = given if isinstance(given, dict) else {self.input_name: given}
        layers = list(self.stages[s])
        out: Value = None
        for k, layer in enumerate(layers):
            args = tuple(env.get(n) for n in layer.inputs)
            x = args if len(args) > 1 else args[0]
            out = call(k, layer, x) if call is not None else layer(x)
            if s < len(self.stages) - 1 or k < len(layers) - 1:
                # what is live after the layer, and nothing else: as a chain hands on
                outs = out if len(layer.crossing) > 1 else (out,)
                env = dict(zip(layer.crossing, outs))
        if s == len(self.stages) - 1:
            return out
        return {n: env[n] for n in self.gives[s]}

    def _backward_roots(
        self, s: int, m: int, keep: bool
    ) -> tuple[list[Any], list[torch.Tensor] | None]:
        """What backward starts from: the loss on the last stage; elsewhere the output's edges,
        with the gradients pulled from stage s + 1. A recomputed stage pulls them first, then
        re-materialises beside them, as the plan counts it (a torchrun rank received them
        before: re-running first would hold them there too), `keep`ing each layer's output
        edges for zero bubble's W."""
        last = s == len(self.stages) - 1
        grads = None if last else self.pull(s, m)
        if self._recomputes(s, m):
            self._rematerialise(s, m, keep=keep)
        if last:
            loss = self.loss_roots.pop(m)
            return ([loss] if loss.requires_grad else []), None  # (nothing trains: no graph)
        pairs = [(e, grads[k]) for k, e in self.roots.pop((s, m)) if grads[k] is not None]
        return [e for e, _ in pairs], [g for _, g in pairs]  # type: ignore[misc]

    # Transport. A cut is always a copy, so each stage owns what it holds. Activations are
    # pushed when made; gradients stay with their maker until the stage before pulls them. On
    # CUDA: the producer's stream records an event; the send stream (source device) and receive
    # stream (destination device) wait for it and copy; the consumer's stream waits for the copy.

    def push(self, value: Value, s: int, m: int) -> None:
        """Stage s's output for micro-batch m becomes stage s + 1's input; a captured graph's
        values go to each stage that reads them, straight away."""
        if not self.routed:
            with owner(s + 1):
                moved = self._move([t.detach() for t in _tensors(value)], s, s + 1, None)
            self.inputs[(s + 1, m)] = _like(value, moved)
            return
        for (a, t), names in sorted(self.routes.items()):
            if a == s:
                with owner(t):
                    moved = self._move([value[n].detach() for n in names], s, t, None)
                self.inputs.setdefault((t, m), {}).update(zip(names, moved))

    def _take(self, t: int, m: int) -> Value:
        """Stage t's input for micro-batch m, all of it arrived (by name, in a fixed order)."""
        if not self.routed:
            return self.inputs.pop((t, m))
        got = self.inputs.pop((t, m), {})  # (a stage may read nothing of the stages before)
        return {n: got[n] for n in self.receives[t]}

    def leave_grad(self, grads: Grads, s: int, m: int, like: list[torch.Tensor]) -> None:
        """The gradient of stage s's input tensors `like` (None where there is none), for
        the stages that sent them to pull."""
        grads = [_own_memory(g) for g in grads]
        made = None
        if self.cuda:
            made = torch.cuda.Event()
            made.record(self.compute[s])
        if self.routed:  # by name: each sender pulls its own
            self.outgrads[(s, m)] = (dict(zip(self.receives[s], grads)), made)
            return
        self.outgrads[(s, m)] = (grads, made)

    def pull(self, s: int, m: int) -> Grads:
        """The gradient of stage s's output for micro-batch m, copied from stage s + 1 (a
        captured graph: from every stage it sent to, summed per value)."""
        if not self.routed:
            grads, made = self.outgrads.pop((s + 1, m))
            moved = iter(self._move([g for g in grads if g is not None], s + 1, s, made))
            return [next(moved) if g is not None else None for g in grads]
        # A value sent to several stages: the first gradient is copied here, the others are
        # added into it in place (on CPU straight from where they are, without a copy), so
        # the stage holds one gradient per value, as the plan's `pulled` counts.
        # Such a sum is laid out densely, as the plan's figures take a received gradient: laid
        # out as its first part (a transposed one, from a reader's backward), the stage's W
        # copied it dense again, one gradient over its plan (found by a red team).
        total: dict[str, torch.Tensor] = {}
        parts = self.readers[s]
        for (a, t), names in sorted(self.routes.items()):
            if a != s:
                continue
            left, made = self.outgrads[(t, m)]
            for n in names:
                g = left.pop(n)
                if g is None:
                    continue
                if n not in total:
                    # (received from another rank: already ours)
                    first = g if made is RECEIVED else self._move([g], t, s, made)[0]
                    if parts[n] > 1 and not first.is_contiguous():
                        first = first.contiguous()
                    total[n] = first
                    del first
                elif not self.cuda:
                    total[n].add_(g.to(total[n].device))
                else:
                    total[n].add_(self._move([g], t, s, made)[0])
                del g
            if not left:
                del self.outgrads[(t, m)]
        return [total.get(n) for n in self.gives[s]]

    def _move(
        self, ts: list[torch.Tensor], src: int, dst: int, produced: Any
    ) -> list[torch.Tensor]:
        b = self.devices[dst]
        if not self.cuda:
            return [t.to(b, copy=True) for t in ts]
        if not ts:  # nothing crosses (a frozen prefix's gradients): nothing to wait for
            return []
        if produced is None:
            produced = torch.cuda.Event()
            produced.record(self.compute[src])
        send, recv = self.send_streams[src], self.recv_streams[dst]
        send.wait_event(produced)
        recv.wait_event(produced)
        # NOTE: a copy between GPUs runs on the source's current stream and syncs with the
        # destination's current stream; make both ours (as torchgpipe's Copy does). On one
        # GPU the receive stream, current last, is the one that runs the copy.
        with torch.cuda.stream(send), torch.cuda.stream(recv):
            out = [t.to(b, non_blocking=True, copy=True) for t in ts]
        copier = send if self.devices[src] != b else recv
        for t in ts:
            t.record_stream(copier)
        copied = torch.cuda.Event()
        copied.record(recv)
        self.compute[dst].wait_event(copied)
        for t in out:
            t.record_stream(recv)
            t.record_stream(self.compute[dst])
        return out

    def _stream(self, s: int) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.compute[s]) if self.cuda else contextlib.nullcontext()

    def _enter_streams(self) -> None:
        if self.cuda:
            for st, d in zip(self.compute, self.devices):
                st.wait_stream(torch.cuda.current_stream(d))

    def _leave_streams(self) -> None:
        if self.cuda:
            for streams in (self.compute, self.send_streams, self.recv_streams):
                for st, d in zip(streams, self.devices):
                    torch.cuda.current_stream(d).wait_stream(st)


def _indexed(d: torch.device) -> torch.device:
    """ "cuda" as the GPU it means now, so that devices compare equal however they are spelt."""
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _own(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch of the caller's input for stage 0: copied from another device; on its own,
    the caller's memory through an alias that is no view (set_ on a fresh tensor), so that an
    in-place first layer bumps only this micro-batch's version counter, not every other's."""
    if _indexed(t.device) != _indexed(device):
        return t.to(device, copy=True)
    # an alias would drop a subclass or a lazy conjugate or sign, and would pass an inference
    # tensor off as one autograd may save
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_conj() or t.is_neg():
        return t.clone()
    if t.is_inference():
        return t.clone()
    try:
        with torch.no_grad():
            return torch.empty(0, dtype=t.dtype, device=t.device).set_(
                t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
            )
    except (RuntimeError, TypeError, NotImplementedError):  # a layout set_ cannot take
        return t.clone()


def trains(stage: nn.Module) -> bool:
    """Whether the stage has a parameter that trains."""
    return any(p.requires_grad for p in stage.parameters())


def trainable_bytes(stage: nn.Module) -> int:
    """The bytes of the stage's parameters that train, each once."""
    return sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)


def trains_before(training: list[bool]) -> list[bool]:
    """Per stage, whether a stage before it trains (`training`: per stage, whether it does):
    only then does its input need a gradient. A frozen prefix (a fine-tuning's backbone) keeps
    nothing for backward, and no gradient goes back to it (planner/costs.py counts a chain's so;
    a captured graph's plan still counts the gradients of what such stages send: over)."""
    return [any(training[:s]) for s in range(len(training))]


def _like_leaf(v: Value, grad: bool) -> Value:
    return _like(v, [_leaf(t, grad) for t in _tensors(v)])


def _split_target(y: Any, M: int) -> list[Any]:
    if isinstance(y, torch.Tensor):
        return list(torch.tensor_split(y, M))
    if isinstance(y, (tuple, list)):
        parts = [_split_target(t, M) for t in y]
        return [type(y)(p[m] for p in parts) for m in range(M)]
    return [y] * M


def _to(y: Any, device: torch.device, copy: bool = False) -> Any:
    if isinstance(y, torch.Tensor):
        return y.to(device, non_blocking=True, copy=copy)
    if isinstance(y, (tuple, list)):
        return type(y)(_to(t, device, copy) for t in y)
    return y


def _shared_parameters(stage: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters that two or more of the stage's layers use: one module that is
    two of them too (children() would name it once; zero bubble's W then went through its
    graph twice, found by a red team)."""
    seen: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for layer in stage if isinstance(stage, nn.Sequential) else stage.children():
        for p in layer.parameters():
            if p.requires_grad:
                seen[id(p)] = seen.get(id(p), 0) + 1
                params[id(p)] = p
    return [params[k] for k, n in seen.items() if n > 1]


def _summed(
    into: torch.Tensor | None, g: torch.Tensor, others: list[torch.Tensor | None]
) -> torch.Tensor:
    """`into` + `g`, the gradient a stage input gets from its layers and the one pulled for it
    where they hand it on: added into `into` where autograd made it for this alone (shares
    memory with none of `others`) and laid out contiguously, else a new tensor (a channels-last
    one too: left so). A third tensor of the input's size,
    beside the two, was what the stage held at its peak, over its plan (found by a red team:
    a layer that reads a wide value and hands it on, alone in its stage, 15-18%)."""
    if into is None:
        return g
    if (
        into.is_sparse
        or g.is_sparse
        or (into.shape, into.dtype, into.device) != (g.shape, g.dtype, g.device)
        or not into.is_contiguous()  # (a sum's gradient, expanded: one element many times)
        or _shares(into, [g, *others])
    ):
        return into + g
    return into.add_(g)


def _shares(t: torch.Tensor, others: list[torch.Tensor | None]) -> bool:
    """Whether t's memory is (part of) one of `others`' (None: no tensor)."""
    if t.numel() == 0:
        return False
    mine = t.untyped_storage().data_ptr()
    return any(o is not None and o.numel() and o.untyped_storage().data_ptr() == mine
               for o in others)  # fmt: skip


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Add a gradient computed by autograd.grad into p.grad, as backward would."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g if g.is_contiguous() else g.contiguous()
    else:
        p.grad.add_(g)
