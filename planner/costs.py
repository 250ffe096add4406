"""Per-layer costs of one micro-batch, read off a Profile at the micro-batch size a plan uses.

Profiles are measured at a few sizes; between them we interpolate linearly, beyond them we
extend the line through the two nearest sizes (time and activation memory are close to affine in
the batch size once past the smallest sizes), past the largest never below what it measured
(a byte figure: nor below its share per sample there beyond the layer's weights, in
proportion to the size).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from profiler.limits import MIN_MS
from profiler.types import CTX_FIELDS, Profile, TiedParameter

from .routing import Flow

OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2}


def at_size(measured: dict[int, float], b: int) -> float:
    """`measured` (size -> value) read at size `b`: exact, interpolated or extended; never < 0."""
    xs = sorted(measured)
    if b in measured:
        return float(measured[b])
    if len(xs) == 1:
        return float(measured[xs[0]]) * b / xs[0]
    k = bisect.bisect_left(xs, b)
    k = min(max(k, 1), len(xs) - 1)
    x0, x1 = xs[k - 1], xs[k]
    y0, y1 = float(measured[x0]), float(measured[x1])
    value = max(y0 + (y1 - y0) * (b - x0) / (x1 - x0), 0.0)
    return max(value, y1) if b > x1 else value  # (past the sizes, as ProfileTable.at's times)


@dataclass(frozen=True)
class Chain:
    """Per-layer costs for micro-batches of `mb` samples (arrays of length L unless noted).

    The profiled loss, when there is one, is the chain's last entry: a layer without weights that
    always ends the last stage (`num_model_layers` excludes it). Times are ms on the profiled
    device; sizes are bytes. `boundary[l]` is what enters layer l (length L + 1: boundary[0] is
    the model input, boundary[L] the output of the last entry).
    """

    mb: int
    forward: np.ndarray
    backward: np.ndarray
    input_grad: np.ndarray  # zero-bubble I: the input gradient alone
    weight_grad: np.ndarray  # zero-bubble W: the weight gradients alone, as the pipe runs them
    params: np.ndarray
    largest_param: np.ndarray  # each layer's largest trainable parameter tensor (the step's)
    buffers: np.ndarray
    saved: np.ndarray
    shared: np.ndarray
    input_saved: np.ndarray  # the part of layer l's input that layer l saves
    loss_saved: np.ndarray  # saved by the loss function (non-zero on the loss entry only)
    forward_transient: np.ndarray  # beyond what it keeps, while its forward runs
    backward_transient: np.ndarray  # ... while its backward runs
    input_unsaved: np.ndarray  # its input, where nothing saves it: alive while its forward runs
    forward_peak: np.ndarray  # a forward keeping nothing for backward: its most above its input
    input_grad_transient: np.ndarray  # zero-bubble I: the most it adds above what is kept
    weight_grad_transient: np.ndarray  # zero-bubble W: the same
    zgrad: np.ndarray  # zero bubble: the gradient of layer l's output kept from I to W
    grad_in: np.ndarray  # the gradient of layer l's input (0 where it needs none)
    boundary: np.ndarray
    num_model_layers: int = -1
    flow: Flow | None = None  # a captured graph: which stage receives which value (routing.py)
    tied: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (bytes, layers using it) per shared
    # Whether every stage that uses a tied parameter keeps its optimizer state (the torchrun
    # program: each rank steps its own copy, with the gradient summed over the ranks), not the
    # first alone (the streams program: one optimizer for the model's own parameter)
    copies_keep_state: bool = False
    # Stage 0 works on the caller's micro-batch where it already lives on the stage's device
    # (a CPU run: the runtime copies it only from another device), so holds none of it.
    borrowed_input: bool = False
    # zero bubble: the part of zgrad kept from I to W, the gradient of a layer whose weights
    # train (W needs no other: the runtime lets the rest go as I goes on); None: all of zgrad
    zkept: np.ndarray | None = None
    # a chain's layers whose output is their input itself (nn.Identity, a dropout at 0): the
    # gradient they are given is the one they give back, so the next layer's I makes the
    # gradient of the layer before them (None: none, or a captured graph, whose routing knows
    # what each layer hands on)
    through: np.ndarray | None = None
    # Zero bubble, a profile without its loss: the last layer's output gradient, which the last
    # stage keeps from I to W (with the loss profiled, zgrad counts it)
    last_grad: int = 0
    checkpointed: tuple[int, ...] = ()  # layers run under their own checkpoint (checkpointed())
    # beyond what it keeps, while its forward runs up to its last save: where the re-run of a
    # layer under a checkpoint of its own ends (None: the whole forward, forward_transient;
    # never more than that). A recomputed stage re-runs whole, by hand.
    stop_transient: np.ndarray | None = None
    # a captured graph's layer that reads a value and hands it on: what its backward makes
    # beyond backward_transient where that value's gradient from a later stage is held apart,
    # their sum (MemoryModel._received_sums; None: not in the profile, the whole gradient)
    passed_sum: np.ndarray | None = None
    # a layer's backward_transient where its output's gradient is autograd's alone (a stage's
    # inner layer: MemoryModel._inner_backward; None: not in the profile)
    inner_backward: np.ndarray | None = None
    # what a layer's backward holds beyond backward_transient at its peak where a parameter
    # another layer uses too has no gradient yet (a stage's copy of a tied weight, in its first
    # backward: the gradient made before the peak stays; None: not in the profile)
    tied_first: np.ndarray | None = None
    # whether a layer's outputs are views of its input and it saves nothing (None: not in the
    # profile): a stage opening with such layers holds its input once where the first layer
    # past them saves a view of it (MemoryModel.input_saved)
    views: np.ndarray | None = None
    # whether a layer's input gradient is measured a view of its output's, from every layout
    # it was given (None: not in the profile): Chain.grad_views, Chain.hands_grad_on
    grad_is_view: np.ndarray | None = None
    # what a layer's graph still holds of its saved tensors once its zero-bubble W has run
    # (None: not in the profile, as if all of them): Chain.w_freed
    w_kept: np.ndarray | None = None
    # What a custom autograd.Function in layer l keeps on its ctx (in `saved` too), beyond its
    # input (ctx_held_bytes): a checkpoint of the layer's own keeps it (None: no layer keeps
    # any so). (A recomputed stage runs its first forward without a graph: nothing kept.)
    ctx_held: np.ndarray | None = None
    # ... what layer l's saves count that its ctx keeps (ctx_late_bytes), and what layer l - 1
    # saved that it keeps (ctx_prev_bytes): B lets those go with the graph, at the stage's end,
    # not as it passes layer l (l - 1, where l is in the stage too)
    ctx_late: np.ndarray | None = None
    ctx_prev: np.ndarray | None = None
    # ... and of what it keeps, what a hook saves too (ctx_dup_bytes): a checkpoint's re-run
    # makes that again
    ctx_dup: np.ndarray | None = None
    # the bytes of what a layer hands on unchanged (a tuple's part), rounded up to the
    # allocator's blocks: what the layer before it made may reach a layer past it (None: no
    # layer hands anything on)
    passes: np.ndarray | None = None
    # whether a layer's zero-bubble W lets go what its graph saved of its input (None: not in
    # the profile, as if it did not): Chain.keeps_graph_through_w
    w_frees_input: np.ndarray | None = None
    # each entry's trainable parameter tensors (bytes), in the order an optimizer steps them
    # (None: not in the profile), and what the step of one still holds while the next is
    # stepped, per byte of the one before and relative to the step's own per byte (the
    # optimizer's carry / per_byte, set by the search for its optimizer: MemoryModel.step_size)
    param_tensors: tuple[tuple[int, ...], ...] | None = None
    step_carry: float = 0.0
    # each entry's trainable parameter bytes: those with a gradient and optimizer state (None:
    # all of params; a frozen backbone's weights have neither), and which tied parameters are
    # frozen (by their place in `tied`)
    trainable: np.ndarray | None = None
    frozen_tied: frozenset[int] = frozenset()

    @property
    def grads(self) -> np.ndarray:
        """Each entry's trainable parameter bytes (its gradients' and each optimizer slot's)."""
        return self.params if self.trainable is None else self.trainable

    @property
    def kept_grad(self) -> np.ndarray:
        """zkept, or zgrad where none is given."""
        return self.zgrad if self.zkept is None else self.zkept

    @property
    def hands_grad_on(self) -> np.ndarray:
        """Per layer: whether the gradient its backward gives back is, in memory, the one it is
        given: a layer that hands its input on (`through`), or one whose input gradient is a
        view of its output's (`grad_views`) and which keeps none for W (it has no weights).
        Zero bubble's I makes nothing there: the layer before it gets the gradient the layer
        after it made."""
        through = np.zeros(self.num_layers, dtype=bool) if self.through is None else self.through
        if self.grad_is_view is None:  # (not measured: a reshape may copy, counted apart)
            return through
        return through | (self.grad_views & (self.kept_grad == 0))

    @property
    def let_go_grad(self) -> np.ndarray:
        """Per layer: its output gradient where zero bubble's I lets it go (no weights that
        train: Z leaves it out), 0 where those bytes are another layer's too (hands_grad_on:
        counted as the gradient the layer after it makes, that of the last layer before it
        that makes its own)."""
        return np.where(self.hands_grad_on, 0, self.zgrad - self.kept_grad)

    @property
    def keeps_graph_through_w(self) -> np.ndarray:
        """Per layer: whether zero bubble's W leaves what the layer's graph saved of its input
        alone until the stage's W ends. W runs layer by layer from the last, each layer's graph
        going as its own W runs, where the profile saw it go (`w_frees_input`: not a node off
        every way to a parameter); a layer keeping no gradient for W (no weights that train)
        runs none, nor does one whose weights two layers of its stage share (their gradient is
        I's). (Any layer a tie names counts so: on the safe side where the other use lies in
        another stage.)"""
        keeps = self.kept_grad == 0
        if self.w_frees_input is None:
            keeps = np.ones(self.num_layers, dtype=bool)
        else:
            keeps |= ~self.w_frees_input
        for _, layers in self.tied:
            keeps[[k for k in layers if k < self.num_layers]] = True
        return keeps

    def w_beside(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layer l: what its zero-bubble W figure leaves out but the stage may hold while
        it runs. The figure was measured on the layer alone, whose W let its saved tensors go
        as it ran: (what layer l + 1 shares of them where l + 1 keeps its graph through W
        (keeps_graph_through_w: a captured convolution-and-ReLU before a pooling layer ran its
        ReLU output's bytes, 16-21%, over its plan, found by a red team), and where l + 1 hands
        on a value l made, what l saved of the rest besides, which a layer of the stage past
        l + 1 may save and keep (a tanh's output, let go in the profile before the Linear under
        it made its gradient: 1.2-1.4% under)). (That l + 1 shares l's input, which the
        profile's W held anyway, is counted too: taking it off left a red team's stage 41%
        under its plan, where it had been 16% under, from a cause not traced.)"""
        shared = np.where(self.keeps_graph_through_w, self.shared, 0)
        nxt = np.concatenate([shared[1:], [0]])
        own = self.saved - self.shared
        passed = np.zeros(self.num_layers, dtype=np.int64)
        if self.passes is not None:  # (of what l + 1 hands on, the part l made: not handed on
            # by l too, a skip that goes past both, of which l saved nothing; a test of a
            # captured model's plan read 64 KiB above its run without this)
            made = np.maximum(np.concatenate([self.passes[1:], [0]]) - self.passes, 0)
            passed = np.minimum(np.maximum(own - nxt, 0), made)
        return nxt.astype(np.int64), passed.astype(np.int64)

    @property
    def w_freed(self) -> np.ndarray:
        """Per layer l: what its own zero-bubble W surely lets go of the tensors the stage
        counts as l's (saved less what it shares with l - 1), before the layers before it run
        theirs: less all its graph still holds (w_kept) and what layer l + 1 shares of them
        where l + 1 keeps its graph (keeps_graph_through_w; taken off even where l ends its
        stage). Nothing where l runs no W (no weights that train, or tied ones), nor where
        l + 1 hands a value on (`passes`: a layer past l + 1 may save l's tensors, and hold
        them through l's W: found by a red team, 6 KiB under), nor on a captured graph (the
        same, by its routes), nor where the profile has no w_kept."""
        n = self.num_layers
        if self.w_kept is None or self.flow is not None:
            return np.zeros(n, dtype=np.int64)
        keeps = self.keeps_graph_through_w
        nxt = np.concatenate([np.where(keeps, self.shared, 0)[1:], [0]])
        own = self.saved - self.shared - self.w_kept - nxt
        runs = self.kept_grad > 0
        for _, layers in self.tied:
            runs[[k for k in layers if k < n]] = False
        if self.passes is not None:
            runs &= np.concatenate([self.passes[1:], [0]]) == 0
        return np.where(runs, np.maximum(own, 0), 0).astype(np.int64)

    @property
    def gradient_made(self) -> np.ndarray:
        """Per layer l: the last layer before l that does not hand its gradient on (-1: none),
        whose output gradient l's backward makes (`hands_grad_on`)."""
        n = self.num_layers
        real = np.flatnonzero(~self.hands_grad_on)
        at = np.searchsorted(real, np.arange(n), side="left") - 1
        return np.where(at >= 0, real[np.maximum(at, 0)], -1)

    @property
    def grad_views(self) -> np.ndarray:
        """Per layer: whether its input gradient is a view of its output gradient (a flatten,
        a reshape): it makes views of its input and saves nothing (`views`), its backward
        allocates nothing beyond the output gradient it is given, and the two gradients are
        the same bytes. A chain's stage that ends in such layers holds, in B, what the stage
        ending before them holds: the gradient the last other layer gets is the pulled one."""
        if self.views is None or self.flow is not None:
            return np.zeros(self.num_layers, dtype=bool)
        z = self.zgrad
        same = np.concatenate([[False], z[1:] == z[:-1]])
        views = self.views & (self.backward_transient <= z) & same & (z > 0)
        return views if self.grad_is_view is None else views & self.grad_is_view

    @property
    def views_run(self) -> np.ndarray:
        """Per end j (0..L): the first of the grad_views layers that end layers [.., j), j
        where layer j - 1 is none."""
        ends = np.arange(self.num_layers + 1, dtype=np.int64)
        opens = np.concatenate([[True], ~self.grad_views])  # (j: layer j - 1 is none, or j = 0)
        return np.maximum.accumulate(np.where(opens, ends, 0))

    @property
    def stop(self) -> np.ndarray:
        """stop_transient, or forward_transient where the profile has none."""
        if self.stop_transient is None:
            return self.forward_transient
        return np.minimum(self.stop_transient, self.forward_transient)

    @property
    def num_layers(self) -> int:
        return len(self.forward)

    @property
    def has_loss(self) -> bool:
        return self.num_layers > self.num_model_layers


LATER_FALLBACK = {"stop_transient_bytes": "forward_transient_bytes"}
ZERO_WHEN_ABSENT = CTX_FIELDS  # (figures only some entries have: 0 where absent)
TIED_CHAIN_LAYERS = 1024  # (chain(): where a chain's tied parameters are counted once)


def _walkable(tied: list[TiedParameter], layers: int) -> bool:
    """Whether the memory model walks a chain's stages with its tied parameters' waiting
    gradient parts: its tables are (layers + 1)^2, each made again from every layer where a
    tied parameter has a later use (a module a chain reuses in every layer: cubic), so up to
    TIED_CHAIN_LAYERS layers and 2^28 entries in all."""
    rows = max((sorted(t.layers)[-2] + 1 for t in tied), default=0)
    return layers <= TIED_CHAIN_LAYERS and rows * (layers + 2) ** 2 <= 2**28


ALLOCATION_ROUND = {"cuda": 512}  # the CUDA caching allocator hands out multiples of 512 bytes


class ProfileTable:
    """A profile's per-size measurements as (entries x sizes) arrays, made once, so reading them
    at any micro-batch size is a few vector operations (as `at_size` does one value at a time)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.layers = profile.layers + ([profile.loss] if profile.loss is not None else [])
        self.sizes = sorted(profile.batch_sizes)
        self._tables: dict[str, np.ndarray] = {}

    def _table(self, attr: str, timing: bool) -> np.ndarray:
        if attr not in self._tables:
            # a figure later profiles add: the one it refines where a profile has none
            instead = LATER_FALLBACK.get(attr, attr)
            rows = [getattr(x, attr) or getattr(x, instead) for x in self.layers]
            if attr in ZERO_WHEN_ABSENT:
                rows = [dict.fromkeys(self.sizes, 0) if r is None else r for r in rows]
            shape = (len(rows), len(self.sizes))
            if all(list(r) == self.sizes for r in rows):  # as the validator orders them
                # (iterated in C: no generator frame per value, 1.3x faster on 10 000 layers)
                values = itertools.chain.from_iterable(map(dict.values, rows))
                flat = np.fromiter(
                    map(attrgetter("median"), values) if timing else values,
                    dtype=np.float64,
                    count=shape[0] * shape[1],
                )
                self._tables[attr] = flat.reshape(shape)
            else:  # a map edited since: by key (4x slower on 10 000 layers)
                self._tables[attr] = np.array(
                    [[(r[b].median if timing else r[b]) for b in self.sizes] for r in rows],
                    dtype=np.float64,
                ).reshape(shape)
            if timing:  # a time below a nanosecond, which no timer measures, is read as 0
                # (subnormal ones stopped a bisection of the split's time from moving)
                table = self._tables[attr]
                table[(table > 0) & (table < MIN_MS)] = 0.0
        return self._tables[attr]

    def measured(self, attr: str) -> bool:
        """Whether every entry has `attr` (a figure later profiles add), asked once per profile
        (chain_at reads it per micro-batch size: 10 000 entries each time)."""
        key = f"measured:{attr}"
        if key not in self._tables:
            self._tables[key] = np.array(all(getattr(x, attr) is not None for x in self.layers))
        return bool(self._tables[key])

    def flags(self, attr: str) -> np.ndarray:
        """A per-entry flag (None read as False), made once."""
        key = f"flags:{attr}"
        if key not in self._tables:
            self._tables[key] = np.array([bool(getattr(x, attr)) for x in self.layers])
        return self._tables[key]

    def fixed(self, attr: str) -> np.ndarray:
        """A per-entry value that does not depend on the size (parameters, output per sample)."""
        if attr not in self._tables:
            self._tables[attr] = np.array([getattr(x, attr) for x in self.layers], dtype=np.int64)
        return self._tables[attr]

    def at(self, attr: str, b: int, *, timing: bool = False) -> np.ndarray:
        """Every entry's `attr` at size b: exact, interpolated or extended; never < 0."""
        y, xs = self._table(attr, timing), self.sizes
        if b in xs:
            return y[:, xs.index(b)].copy()
        if len(xs) == 1:
            return y[:, 0] * b / xs[0]
        k = min(max(bisect.bisect_left(xs, b), 1), len(xs) - 1)
        x0, x1 = xs[k - 1], xs[k]
        y0, y1 = y[:, k - 1], y[:, k]
        value = np.maximum(y0 + (y1 - y0) * (b - x0) / (x1 - x0), 0.0)
        if b > x1:
            # Past the largest size, never below what was measured there; a byte figure never
            # below its share per sample there either, in proportion to the size, but for as
            # much as the layer's weights (a weight's gradient, which a backward's figure
            # holds, does not grow with the batch: scaled, a Linear(1024, 2048)'s made a plan
            # 3x its run). What a small size measures as fixed need not stay so: a CPU
            # convolution's workspace measured 92 448 and 94 784 bytes at one and two
            # samples, and 173 056 at four, where the line said 99 456 (a red team's run held
            # 20% more than its plan, 2.4x on an interleaved device).
            value = np.maximum(value, y1)
            if not timing:
                fixed = np.minimum(self.fixed("param_bytes"), y1)
                value = np.maximum(value, fixed + (y1 - fixed) * (b / x1))
        return value


def chain_at(profile: Profile | ProfileTable, mb: int) -> Chain:
    """The profile's layers (and loss) as arrays, read at micro-batch size `mb`."""
    table = profile if isinstance(profile, ProfileTable) else ProfileTable(profile)
    profile, layers = table.profile, table.layers
    L = len(profile.layers)
    unit = ALLOCATION_ROUND.get(profile.device.split(":")[0], 1)

    def times(attr: str) -> np.ndarray:
        return table.at(attr, mb, timing=True)

    def sizes(attr: str) -> np.ndarray:
        return np.round(table.at(attr, mb)).astype(np.int64)

    saved = sizes("saved_bytes")
    backward_transient = sizes("backward_transient_bytes")
    summed = profile.captured and table.measured("passed_sum_bytes")
    inner = table.measured("inner_backward_transient_bytes")
    first = table.measured("tied_first_backward_bytes")
    boundary = np.concatenate([[profile.input_bytes], table.fixed("output_bytes")]) * mb
    boundary = -(-boundary // unit) * unit  # rounded up to the allocator's blocks
    n = len(layers)
    # Zero bubble keeps, from I to W, the gradient of every layer output inside a stage and of
    # the stage's own output; on the last stage that of the last model layer's output too (W
    # starts there, and the loss's graph goes with I). Without a profiled loss that layer ends
    # the chain, and zgrad (also what B pulls) stays 0 there: `last_grad` counts it instead.
    # A skip handed on unchanged is one tensor, and so is its gradient: kept where it is made.
    passed = table.fixed("passed_bytes") * mb
    kept = np.maximum(boundary[1 : n + 1] - (-(-passed // unit) * unit), 0)
    # The model's input needs no gradient, nor does a value before the first layer that trains
    # (a frozen prefix: the runtime hands its stages inputs that need none, and its profile
    # measured them so), where the profile lists the trainable tensors (else: the weights)
    tensors = _known_tensors(table)
    trains = np.cumsum(
        [bool(t) for t in tensors] if tensors is not None else table.fixed("param_bytes") > 0
    ).astype(bool)
    zgrad = np.where(trains, kept, 0)
    hands_on = (kept == 0) & (boundary[1 : n + 1] > 0) & trains
    hands_on[L if n > L else L - 1 :] = False
    zgrad[L if n > L else L - 1 :] = 0
    # ... of which W needs those of the layers with weights that train (the runtime's _trains)
    own = (
        np.array([bool(t) for t in tensors])
        if tensors is not None
        else table.fixed("param_bytes") > 0
    )
    grad_in = np.where(np.concatenate([[False], trains[:-1]]), boundary[:n], 0)
    # A chain's tied parameters are counted once per stage where the memory model can walk B
    # with them (_walkable); past that each layer counts its own (over: two uses in one stage
    # hold one weight)
    ties = profile.captured or _walkable(profile.tied, L)
    shared = np.minimum(sizes("shared_bytes"), saved)
    loss_saved = np.zeros(n, dtype=np.int64)
    if n > L:  # what the loss function alone saves (a tensor a layer saves too is that layer's)
        loss_saved[L] = saved[L] - shared[L]
    # ... and no backward runs there: none of its layers has a gradient to make (a profile
    # measures them so; one edited, or with its times evened out, is read so too: the search's
    # bounds count every backward on the way back, which stops at a frozen prefix)

    def backward(attr: str) -> np.ndarray:
        return np.where(trains, times(attr), 0.0)

    return Chain(
        mb=mb,
        forward=times("forward_ms"),
        backward=backward("backward_ms"),
        input_grad=backward("backward_input_ms"),
        weight_grad=backward("backward_weight_ms"),
        params=table.fixed("param_bytes"),
        largest_param=_largest_trainable(table),
        buffers=table.fixed("buffer_bytes"),
        saved=saved,
        shared=shared,
        input_saved=sizes("input_saved_bytes"),
        loss_saved=loss_saved,
        forward_transient=sizes("forward_transient_bytes"),
        stop_transient=sizes("stop_transient_bytes"),
        passed_sum=sizes("passed_sum_bytes") if summed else None,
        inner_backward=sizes("inner_backward_transient_bytes") if inner else None,
        tied_first=sizes("tied_first_backward_bytes") if first else None,
        backward_transient=backward_transient,
        input_unsaved=sizes("input_unsaved_bytes"),
        forward_peak=sizes("forward_peak_bytes"),
        input_grad_transient=sizes("input_grad_transient_bytes"),
        weight_grad_transient=sizes("weight_grad_transient_bytes"),
        zgrad=zgrad,
        zkept=np.where(own, zgrad, 0),
        through=None if profile.captured or not hands_on.any() else hands_on,
        grad_in=grad_in,
        boundary=boundary,
        num_model_layers=L,
        flow=Flow.of(profile.layers, n > L, mb, unit) if profile.captured else None,
        views=table.flags("views_input") if table.flags("views_input").any() else None,
        passes=-(-passed // unit) * unit if (passed > 0).any() else None,
        # (a captured graph's stages are counted from their routes: there only as saved)
        **(
            dict(
                ctx_held=sizes("ctx_held_bytes"),
                ctx_late=sizes("ctx_late_bytes"),
                ctx_prev=sizes("ctx_prev_bytes"),
                ctx_dup=sizes("ctx_dup_bytes"),
            )
            if table.flags("ctx_held_bytes").any() and not profile.captured
            else {}
        ),
        w_kept=sizes("weight_grad_kept_bytes")
        if table.measured("weight_grad_kept_bytes")
        else None,
        grad_is_view=table.flags("input_grad_is_view")
        if table.measured("input_grad_is_view")
        else None,
        w_frees_input=table.flags("weight_grad_frees_input")
        if table.measured("weight_grad_frees_input")
        else None,
        tied=tuple((t.bytes, tuple(t.layers)) for t in profile.tied) if ties else (),
        borrowed_input=profile.device.split(":")[0] == "cpu",
        # (kept for W only where the layer trains: the runtime keeps no other)
        last_grad=int(kept[L - 1]) if n == L and trains[L - 1] and own[L - 1] else 0,
        param_tensors=(
            tuple(tuple(x.param_tensor_bytes) for x in layers)  # type: ignore[arg-type]
            if all(x.param_tensor_bytes is not None for x in layers)
            else None
        ),
        trainable=_trainable(table),
        frozen_tied=frozenset(k for k, t in enumerate(profile.tied) if t.frozen)
        if ties
        else frozenset(),
    )


def _known_tensors(table: ProfileTable) -> list[list[int]] | None:
    """Each entry's trainable parameter tensors, where the profile lists them for all."""
    if any(x.param_tensor_bytes is None for x in table.layers):
        return None
    return [list(x.param_tensor_bytes) for x in table.layers]  # type: ignore[arg-type]


def _trainable(table: ProfileTable) -> np.ndarray | None:
    """Each entry's trainable parameter bytes: what its listed tensors add up to, never above
    its parameter bytes (the tensors are listed as the allocator rounds them, the parameter
    bytes not: a layer all of whose parameters train counts them as before). None where the
    profile does not list them, or where every parameter trains."""
    tensors = _known_tensors(table)
    if tensors is None:
        return None
    params = table.fixed("param_bytes")
    out = np.minimum(np.array([sum(t) for t in tensors], dtype=np.int64), params)
    return None if np.array_equal(out, params) else out


def _largest_trainable(table: ProfileTable) -> np.ndarray:
    """Each entry's largest trainable parameter tensor (what a step one tensor at a time
    works on), or its largest parameter where the profile does not list them."""
    tensors = _known_tensors(table)
    if tensors is None:
        return table.fixed("largest_param_bytes")
    return np.array([max(t, default=0) for t in tensors], dtype=np.int64)


def checkpointed(chain: Chain, layers: tuple[int, ...]) -> Chain:
    """The chain with `layers` each run under its own activation checkpoint (the runtime wraps
    each in torch.utils.checkpoint): what such a layer keeps from its forward to its backward is
    its input alone, and its backward runs its forward again first. The planner then plans the
    rest as it does any chain, without whole-stage recomputation.

    Per checkpointed layer l (input x_l, `boundary[l]` bytes):
    - it keeps x_l (the checkpoint holds its inputs through the placeholders of what the layer
      saves: a layer that saves nothing keeps nothing), shared with layer l - 1 where that one
      saves its output: read as the part of what l saves of its own input that l - 1 saves too
      (none where l saves none of its input, which may count it twice; none where l - 1 is
      checkpointed as well: then l - 1 keeps only x_{l-1});
    - its forward keeps nothing: the most it allocates is its forward's peak without grad;
    - its backward first makes again what it saves beyond x_l, its forward's transient with the
      output gradient beside it, then runs its backward on top of those saved tensors;
    - its backward takes its forward's time as well.
    A plain layer after a checkpointed one shares nothing with it, and its input, where it
    saves none of it itself, is alive only while its forward runs.

    A sequential chain only (a captured graph's layers read values from further back)."""
    if not layers:
        return chain
    if chain.flow is not None:
        raise ValueError("checkpointed layers need a sequential model, not a captured graph")
    n = chain.num_model_layers
    if not all(0 <= k < n for k in layers):
        raise ValueError(f"checkpointed layers must be model layers 0 .. {n - 1}")
    on = np.zeros(chain.num_layers, dtype=bool)
    on[list(layers)] = True
    before = np.concatenate([[False], on[:-1]])  # its previous layer is checkpointed
    saved_in = np.minimum(chain.input_saved, chain.boundary[:-1])
    # (a checkpoint keeps its input where the layer saves any tensor for backward, a weight
    # too, which `saved` leaves out: a frozen layer with weights whose input needs a gradient
    # saves its weight alone, found by a cold review: 2.1% under on frozen Linears)
    saves = (chain.saved > 0) | ((chain.params > 0) & (chain.grad_in > 0))
    keeps = np.where(saves, chain.boundary[:-1], 0).astype(np.int64)
    kept_by_previous = np.where(before, 0, np.minimum(chain.shared, np.minimum(saved_in, keeps)))
    # what it saves beyond its input (not what a ctx keeps: the first ones stay, B reads them;
    # but a hook's copy of those is made again beside them)
    ctx = 0 if chain.ctx_held is None else chain.ctx_held
    dup = 0 if chain.ctx_dup is None else chain.ctx_dup
    rest = np.maximum(chain.saved - saved_in - ctx + dup, 0)
    # What the next layer's ctx keeps of a checkpointed layer's output: counted at that layer
    # now (its saves no longer share it), and let go late there (ctx_late), not here
    late, prev = chain.ctx_late, chain.ctx_prev
    if late is not None and prev is not None:
        moved = np.where(before, prev, 0)
        late, prev = late + moved, prev - moved
    grad_out = chain.boundary[1:].astype(np.int64)
    # (its re-run ends once it has saved all it saves: a checkpoint's early stop)
    again = np.maximum(chain.stop + grad_out, chain.backward_transient) + rest
    return dataclasses.replace(
        chain,
        backward=np.where(on, chain.backward + chain.forward, chain.backward),
        # (and what its ctx keeps beyond its input: a checkpoint cannot let that go)
        saved=np.where(on, keeps + (0 if chain.ctx_held is None else chain.ctx_held), chain.saved),
        input_saved=np.where(on, keeps, chain.input_saved),
        shared=np.where(on, kept_by_previous, np.where(before, 0, chain.shared)),
        # (what a ctx keeps is made in that forward too: kept, in `saved`, not above it)
        forward_transient=np.where(
            on, np.maximum(chain.forward_peak - ctx, 0), chain.forward_transient
        ),
        stop_transient=np.where(on, np.maximum(chain.forward_peak - ctx, 0), chain.stop),
        backward_transient=np.where(on, again, chain.backward_transient),
        inner_backward=(
            None if chain.inner_backward is None else np.where(on, again, chain.inner_backward)
        ),
        views=None if chain.views is None else chain.views & ~on,
        input_unsaved=np.where(
            on,
            np.where(keeps > 0, 0, chain.input_unsaved),
            np.where(before, np.maximum(chain.boundary[:-1] - saved_in, 0), chain.input_unsaved),
        ),
        # the loss's own share: all it saves, where the last layer keeps only its input
        loss_saved=np.where(before & (np.arange(len(on)) >= n), chain.saved, chain.loss_saved),
        checkpointed=tuple(int(k) for k in np.flatnonzero(on)),
        ctx_late=late,
        ctx_prev=prev,
    )


def checkpoint_gain(chain: Chain) -> np.ndarray:
    """Per model layer: by how many bytes the stage holding it and its neighbours keeps less
    for backward with that layer alone under its own checkpoint (negative: more). What it
    saves, less what it shares with the layer before and the layer after shares with it,
    against what the checkpoint keeps, less what the layer before shares of that."""
    n = chain.num_model_layers
    nxt = np.append(chain.shared[1:], 0)  # what layer l + 1 shares with l
    plain = chain.saved - chain.shared - nxt
    ck = checkpointed(chain, tuple(range(0, n, 2)))  # every layer with a plain predecessor...
    ck2 = checkpointed(chain, tuple(range(1, n, 2)))  # ... in one of the two
    alone = np.where(
        np.arange(chain.num_layers) % 2 == 0, ck.saved - ck.shared, ck2.saved - ck2.shared
    )
    return (plain - alone)[:n]
