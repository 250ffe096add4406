"""The partition solvers are exact: checked against brute force over every split, with and
without transfer costs at the cuts."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.costs import Chain
from planner.dp import solve_partition_dp
from planner.memory import MemoryModel, StageShape
from planner.partition import NoneWithin, StageSpec, _Prober, feasible_split, solve_partition


def reference_memory(c: Chain, i: int, j: int, shape: StageShape) -> int:
    """The memory model of DESIGN.md, written out plainly."""
    # the trainable parameters: a gradient and slots each (read from the field, not from the
    # model's own Chain.grads, found by a cold review: the same property on both sides)
    p = int((c.params if c.trainable is None else c.trainable)[i:j].sum())
    X, Xs = int(c.boundary[i]), min(_input_saved(c, i, j), int(c.boundary[i]))
    X = 0 if i == 0 and c.borrowed_input else X
    S = int(c.saved[i:j].sum()) - int(c.shared[i + 1 : j].sum())
    kept = c.zgrad if c.zkept is None else c.zkept  # (zero bubble: of layers whose weights train)
    Z, G = int(kept[i:j].sum()), int(c.grad_in[i])
    Z += c.last_grad if j == c.num_layers else 0  # the last stage of a chain without its loss
    inner = range(i + 1, j)
    remat = _remat(c, i, j)
    live = _backward_live(c, i, j)
    forward = max(
        [int(c.forward_peak[i])] + [int(c.forward_peak[k] + c.boundary[k]) for k in inner]
    )
    P = int(c.zgrad[i:j].max())
    kind = pulled_with(shape.occupancy)
    if kind:
        # B holds the output gradient it pulled (zgrad[j - 1]) beside its activations and its
        # transient (a recomputed one: the larger of its own and its forward's); raised to
        # what a shorter stage from i holds so, where that is more
        # (each shorter stage's B as it walks, not raised to its own shorter ones: B's whole
        # grows with the end through this maximum)
        # B's walk from what it has not let go (_held_b: a ctx keeps some to the stage's end);
        # a recomputed B's forward: the stage's whole, re-run by hand at B's start (_remat)
        z = c.zgrad
        top = max(_held_b(c, i, k) + int(z[k - 1]) + _walked(c, i, k)
                  for k in range(i + 1, j + 1)) - _held_b(c, i, j)  # fmt: skip
        if kind == "paired":
            top = max(top, max(_held(c, i, k) + int(z[k - 1]) + _remat(c, i, k)
                               for k in range(i + 1, j + 1)) - S)  # fmt: skip
        P = top - max(live, _remat(c, i, j) if kind == "paired" else 0)
    loss = int(c.loss_saved[i:j].sum())  # the loss's own: it goes with I, before W
    # (recomputing, the forward that keeps nothing runs without a graph: what its layers keep
    # on a ctx goes with it, and B's re-run makes them once, as the first run did)
    # between I and W: the graph W keeps holds the input, where it needs a gradient, even
    # where only the loss saved it (through views: the loss's tensors go with I)
    # (and on the caller's micro-batch, only the model layers' part of it is left out there)
    Xw = min(_input_saved(c, i, min(j, c.num_model_layers)), Xs) if i < c.num_model_layers else Xs
    lent_w = Xw if i == 0 and c.borrowed_input else 0
    states = [X, X + S - Xs, X + S - Xs + Z + G, S - loss + Z + (X - Xw if G else 0) - lent_w,
              G, P, 0, 0]  # fmt: skip
    # zero bubble's I, from the last layer: the gradients of layers i .. k - 2's outputs are
    # not made yet while k's runs, nor the stage's input gradient G (the first layer's I's)
    input_live = _zero_bubble_input(c, i, j)
    # W: each layer's figure, with what the next layer of the stage saves of it too, where
    # that layer's W has not let it go before this one's (it keeps no gradient for W, a tie
    # names it, or the profile saw its W keep what it saved of its input: w_frees_input):
    # its graph holds those tensors while this one's W lets its own go
    tied = {k for _, layers in c.tied for k in layers}

    def keeps(k: int) -> bool:  # (wherever the stage ends)
        frees = c.w_frees_input is not None and bool(c.w_frees_input[k])
        return int(kept[k]) == 0 or k in tied or not frees

    # ... less what the stage's layers after it let go at their own W, run before it: what
    # each saved that layer l - 1 did not, less what its graph keeps after W and what l + 1
    # shares of it where l + 1 keeps its graph (taken off even past the stage's end); a
    # layer that runs no W (keeps no gradient for it, or tied), or whose next layer hands a
    # value on, lets nothing go
    def freed(k: int) -> int:
        if c.w_kept is None or k in tied or int(kept[k]) == 0:
            return 0
        if c.passes is not None and k + 1 < c.num_layers and c.passes[k + 1]:
            return 0  # (a layer past k + 1 may hold k's tensors: it handed them on)
        held = int(c.shared[k + 1]) if k + 1 < c.num_layers and keeps(k + 1) else 0
        return max(int(c.saved[k]) - int(c.shared[k]) - int(c.w_kept[k]) - held, 0)

    # Layer k's W figure, with what the stage holds besides of what k saved (the profile's W
    # let those go): what k + 1 shares of them where it keeps its graph, and
    # where k + 1 hands on a value k made, of the rest, up to its bytes: a layer of the stage
    # past k + 1 may hold it
    def beside(k: int) -> int:
        if k + 1 >= j:
            return 0
        own = int(c.saved[k]) - int(c.shared[k])
        held = int(c.shared[k + 1]) if keeps(k + 1) else 0
        if c.passes is not None and k + 2 < j:  # (of what it hands on, what k did not)
            held += max(min(own - held, int(c.passes[k + 1]) - int(c.passes[k])), 0)
        return held

    weight = max(int(c.weight_grad_transient[k]) + beside(k)
                 - sum(freed(m) for m in range(k + 1, j)) for k in range(i, j))  # fmt: skip
    transients = [live, remat, forward, input_live, weight, remat]
    held = max(sum(n * b for n, b in zip(t, states + transients)) for t in shape.occupancy)
    # (a stage that trains nothing steps nothing: its frozen weights have no gradient; found
    # by this suite's random chains once the model said so, last session)
    size = p if shape.foreach else int(c.largest_param[i:j].max()) if p else 0
    step = math.ceil(shape.optimizer_step * size)
    return (
        int(c.params[i:j].sum()) + int(c.buffers[i:j].sum()) + p + shape.optimizer_slots * p
        + max(held, step) + shape.reserved
    )  # fmt: skip


def _input_saved(c: Chain, i: int, j: int) -> int:
    """What the stage's layers save of its input: the first's, or while layers only make views
    of it, the most that one of them or the first layer past them saves (less what it shares
    with the layer before: S leaves that out)."""
    last = i
    while c.views is not None and c.views[last] and last + 1 < j:
        last += 1
    after = [int(c.input_saved[k] - c.shared[k]) for k in range(i + 1, last + 1)]
    return max([int(c.input_saved[i]), *after])


def _held(c: Chain, i: int, j: int) -> int:
    """What the layers of [i, j) save, each tensor once."""
    return int(c.saved[i:j].sum()) - int(c.shared[i + 1 : j].sum())


def _held_b(c: Chain, i: int, j: int) -> int:
    """_held, less what a ctx keeps (ctx_late; ctx_prev: of the layer before's saves, where
    that layer is in the stage): B lets those go only at the stage's end."""
    if c.ctx_late is None or c.ctx_prev is None:
        return _held(c, i, j)
    return _held(c, i, j) - int(c.ctx_late[i:j].sum()) - int(c.ctx_prev[i + 1 : j].sum())


def _backward_live(c: Chain, i: int, j: int) -> int:
    """B's walk (_walked), the most over the stage's shorter ends too, so that its total grows
    with the end."""
    return max(_held_b(c, i, k) + _walked(c, i, k) for k in range(i + 1, j + 1)) - _held_b(c, i, j)


def _zero_bubble_input(c: Chain, i: int, j: int) -> int:
    """Zero bubble's I, from the last layer, above the stage's during_i. Layer k makes the
    gradient of the last layer before it that does not hand its input on (r); the kept
    gradients of the layers before r are not made yet, nor the stage's input gradient G (where
    every layer from i to k - 1 hands its input on, k makes G itself). A gradient I lets go (a
    layer without weights that train: Z leaves it out) is alive at k where it is k's own or the
    one k makes, and the stage's pulled one (its last real layer's) at every k before that
    layer. Counted as the most over the stage's ends e <= j, with Z[i, e), less Z[i, j): the
    stage one layer longer may hold less (it lets the pulled one go)."""
    kept = c.zgrad if c.zkept is None else c.zkept
    it = c.input_grad_transient
    through = np.zeros(c.num_layers, dtype=bool) if c.through is None else c.through
    # a layer whose input gradient is a view of its output's, keeping none for W, hands that
    # gradient on too: the same bytes, counted as the one the layer after it makes
    if c.grad_is_view is not None:  # (measured: else a reshape may copy, counted apart)
        through = through | (c.grad_views & (kept == 0))
    wz = np.where(through, 0, c.zgrad - kept)

    def last_real(lo: int, hi: int) -> int | None:  # the last layer in [lo, hi) not handing on
        return next((r for r in range(hi - 1, lo - 1, -1) if not through[r]), None)

    most = None
    for e in range(i + 1, j + 1):
        pulled = last_real(i, e)
        at = []
        for k in range(i, e):
            held = int(it[k]) + int(wz[k])  # its own output's gradient
            r = last_real(i, k)
            if r is not None:  # the gradient k makes, r's; those before it not made yet
                held += int(wz[r]) - int(kept[i:r].sum()) - int(c.grad_in[i])
            if pulled is not None and k < pulled:
                held += int(wz[pulled])  # the pulled one, held to I's end
            at.append(held)
        value = max(at) - int(kept[e:j].sum())
        most = value if most is None else max(most, value)
    assert most is not None
    return most


def _walked(c: Chain, i: int, j: int) -> int:
    """Each layer's backward, less what the layers after it saved: the stage's inner layers'
    with their output gradient autograd's alone (inner_backward, where the profile has it,
    and then on the loss's stage with the loss's scalar gradient beside them), the last one's
    without the output gradient B pulls (zgrad: where it does)."""
    b = c.backward_transient
    inner = b if c.inner_backward is None else c.inner_backward
    loss = c.inner_backward is not None and c.has_loss and j == c.num_layers
    scalar = int(c.boundary[-1]) if loss else 0
    # a stage ending in layers that make views of their input, save nothing, allocate nothing
    # in backward and hand back a gradient of their output's bytes (a flatten) walks as the
    # stage ending before them: the layer before gets the pulled gradient, as a view
    z = c.zgrad
    while (
        j - 1 > i
        and c.views is not None
        and c.views[j - 1]
        and b[j - 1] <= z[j - 1]
        and z[j - 1] == z[j - 2]
        and z[j - 1] > 0
    ):
        j -= 1
    none = np.zeros(c.num_layers, dtype=np.int64)
    late = none if c.ctx_late is None else c.ctx_late
    prev = none if c.ctx_prev is None else c.ctx_prev
    # (less what a ctx keeps: let go at the stage's end; of k's own saves, none is let go yet)
    later = [
        int(c.saved[k + 1 : j].sum()) - int(c.shared[k + 1 : j].sum())
        - int(late[k + 1 : j].sum()) - int(prev[k + 2 : j].sum())
        for k in range(i, j)
    ]  # fmt: skip
    back = [int(inner[k]) + scalar - later[k - i] for k in range(i, j - 1)]
    return max([0, *back, max(int(b[j - 1] - c.zgrad[j - 1]), 0)])


def _remat(c: Chain, i: int, j: int) -> int:
    """A forward keeping what it saves, layer by layer: each layer's peak less what the layers
    after it save, not there yet (inside the stage, with its input while it runs)."""
    f, u = c.forward_transient, c.input_unsaved

    def later(k: int) -> int:
        return int(c.saved[k + 1 : j].sum()) - int(c.shared[k + 1 : j].sum())

    return max([int(f[i]) - later(i)] + [int(f[k] + u[k]) - later(k) for k in range(i + 1, j)])


def pulled_with(occupancy: tuple[tuple[int, ...], ...]) -> str:
    """How B holds its pulled gradient, where every tuple holding one is B's: one gradient, its
    micro-batch's activations, and one transient, B's own ("live") or also its forward's ("paired",
    a recomputed B re-materialising first: stop_live), each with the same counts as the other;
    else "" (a re-materialising forward without B's own too)."""
    occupancy = tuple(t + (0,) * (14 - len(t)) for t in occupancy)
    holding = {t for t in occupancy if t[5]}
    flags = set()
    for t in holding:
        on = [k for k in range(8, 14) if t[k]]
        if t[5] != 1 or not t[1] + t[2] or len(on) != 1 or on[0] not in (8, 13):
            return ""
        flags.add(on[0])
    for t in holding:
        for f in flags:
            if t[:8] + tuple(int(k == f) for k in range(8, 14)) not in holding:
                return ""
    if flags == {13}:
        return ""
    return "paired" if 13 in flags else "live"


def occ(*counts: int, running: int = 0) -> tuple[int, ...]:
    """An occupancy tuple: micro-batches per state, then the transient running (1-6, 0: none:
    live, remat_live, forward_live, input_live, weight_live, stop_live)."""
    counts = counts + (0,) * (8 - len(counts))
    return (*counts, *(int(running == k) for k in range(1, 7)))


def make_chain(L: int, **arrays: np.ndarray) -> Chain:
    """A chain of L layers: the arrays given, zeros for the rest (boundary: ones)."""
    zeros = np.zeros(L, dtype=np.int64)
    fields = dict(
        mb=1, forward=np.zeros(L), backward=np.zeros(L), input_grad=np.zeros(L),
        weight_grad=np.zeros(L), params=zeros, largest_param=zeros, buffers=zeros, saved=zeros,
        shared=zeros, input_saved=zeros, loss_saved=zeros, forward_transient=zeros,
        backward_transient=zeros, input_unsaved=zeros, forward_peak=zeros, input_grad_transient=zeros,
        weight_grad_transient=zeros, zgrad=zeros, grad_in=zeros,
        boundary=np.ones(L + 1, dtype=np.int64), num_model_layers=L,
    )  # fmt: skip
    fields.update(arrays)
    return Chain(**fields)


def brute_force(times, chain, specs, cuts=None) -> float:
    """The smallest max(slowest stage, slowest link) over every split that fits; inf if none."""
    L, K = len(times), len(specs)
    best = math.inf
    for inner in itertools.combinations(range(1, L), K - 1):
        bounds = [0, *inner, L]
        cost = 0.0
        for s, (i, j) in enumerate(zip(bounds[:-1], bounds[1:])):
            if reference_memory(chain, i, j, specs[s].shape) > specs[s].budget:
                break
            cost = max(cost, float(sum(times[i:j])) / specs[s].speed)
            if cuts is not None and s < K - 1:  # the link to stage s + 1
                cost = max(cost, _link(cuts[s], j, bounds[s + 2]))
        else:
            best = min(best, cost)  # a forbidden (inf) cut leaves best as it was
    return best


def _link(row: np.ndarray, j: int, k: int) -> float:
    """A link's cost when the next stage is [j, k): per cut, or per start and end."""
    return float(row[j, k]) if np.ndim(row) == 2 else float(row[j])


def unit_chain(params: list[int], boundary: list[int] | None = None) -> Chain:
    """Layers of forward time 1 ms that hold only their parameters (memory = 2 x params)."""
    L = len(params)
    return make_chain(
        L,
        forward=np.ones(L),
        params=np.array(params),
        boundary=np.array(boundary if boundary is not None else [1] * (L + 1)),
    )


def running_on(counts: list[int], running: int) -> tuple[int, ...]:
    """occ(), with the micro-batch a transient runs on: B and a keeping forward on its
    activations, I on its during_i (StageShape refuses a tuple without)."""
    if running in (1, 2, 6) and counts[1] + counts[2] == 0:
        counts[1] = 1
    if running == 4 and counts[2] == 0:
        counts[2] = 1
    return occ(*counts, running=running)


@st.composite
def problems(draw):
    L = draw(st.integers(1, 12))
    K = draw(st.integers(1, min(L, 5)))
    ints = lambda lo, hi, n: np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)))  # noqa: E731
    saved = ints(0, 40, L)
    shared = np.array(
        [0] + [draw(st.integers(0, int(min(saved[k - 1], saved[k])))) for k in range(1, L)]
    )
    boundary = ints(1, 25, L + 1)
    params = ints(0, 60, L)
    # the last entry may be a loss (what it saves goes with I) and stage 0 may work on the
    # caller's micro-batch (a CPU run)
    loss_saved = np.zeros(L, dtype=np.int64)
    has_loss = L > 1 and draw(st.booleans())
    if has_loss:
        loss_saved[-1] = saved[-1] - shared[-1]
    backward_transient = ints(0, 30, L)
    # an inner layer's backward, its output gradient autograd's alone (measured from another
    # layout than the last layer's figure: either may be the larger), or none in the profile
    inner = ints(0, 30, L) if draw(st.booleans()) else None
    zgrad = ints(0, 20, L)
    through = None
    if L > 1 and draw(st.booleans()):
        through = np.array(draw(st.lists(st.booleans(), min_size=L, max_size=L)))
        through[-1] = False  # (the last entry: the loss, or the last layer)
        zgrad = np.where(through, 0, zgrad)
        through = through if through.any() else None
    # layers that only make views of their input (a transpose, a flatten), or none known; some
    # hand back a view of their output's gradient too (nothing allocated, the same bytes)
    views = None
    if draw(st.booleans()):
        drawn = np.array(draw(st.lists(st.booleans(), min_size=L, max_size=L)))
        aliased = drawn & np.array(draw(st.lists(st.booleans(), min_size=L, max_size=L)))
        aliased[0] = aliased[-1] = False  # (the first layer hands back to no layer before it)
        if through is not None:
            aliased &= ~through  # (a layer that hands its input on has no gradient of its own)
        for k in np.flatnonzero(aliased):
            saved[k] = shared[k] = 0
            shared[k + 1] = 0
            zgrad[k] = zgrad[k - 1]
            backward_transient[k] = min(backward_transient[k], zgrad[k])
        if has_loss:
            loss_saved[-1] = saved[-1] - shared[-1]
        views = drawn & (saved == 0)
    chain = make_chain(
        L,
        forward=ints(1, 9, L).astype(float),
        backward=ints(0, 9, L).astype(float),
        params=params,
        largest_param=np.minimum(params, ints(0, 60, L)),
        # some parameters frozen (no gradient, no optimizer state), or none
        trainable=np.minimum(params, ints(0, 60, L)) if draw(st.booleans()) else None,
        buffers=ints(0, 5, L),
        saved=saved,
        shared=shared,
        # (a part of what the layer saves)
        input_saved=np.minimum(np.minimum(ints(0, 25, L), boundary[:L]), saved),
        forward_transient=ints(0, 30, L),
        stop_transient=ints(0, 30, L) if draw(st.booleans()) else None,
        backward_transient=backward_transient,
        inner_backward=inner,
        views=views,
        # which layers' input gradients were measured views of their output's, or not known
        grad_is_view=None if views is None or not draw(st.booleans()) else aliased,
        input_unsaved=ints(0, 15, L),
        forward_peak=ints(0, 30, L),
        input_grad_transient=ints(0, 30, L),
        weight_grad_transient=ints(0, 30, L),
        zgrad=zgrad,
        # zero bubble keeps only some of them, those of layers whose weights train (or all)
        zkept=np.where(np.array(draw(st.lists(st.booleans(), min_size=L, max_size=L))), zgrad, 0)
        if draw(st.booleans())
        else None,
        # layers that hand their input on (nn.Identity): no gradient of their own
        through=through,
        # whose W lets go what they saved of their input, or not known; and what their graph
        # keeps of their saved tensors after it, or not known
        w_frees_input=np.array(draw(st.lists(st.booleans(), min_size=L, max_size=L)))
        if draw(st.booleans())
        else None,
        w_kept=np.minimum(ints(0, 40, L), saved) if draw(st.booleans()) else None,
        # what custom autograd.Functions keep on a ctx, beyond their input and of it, or none
        **(
            {
                "ctx_held": (held := ints(0, 20, L)),
                # (parts of what the layer's saves count, and of the rest of the layer
                # before's: a profile counts each kept tensor once)
                "ctx_late": (late := np.minimum(ints(0, 20, L), saved - shared)),
                "ctx_prev": np.minimum(
                    ints(0, 20, L), np.concatenate([[0], (saved - shared - late)[:-1]])
                ),
                # (parts of what they keep)
                "ctx_dup": np.minimum(ints(0, 20, L), held),
            }
            if draw(st.booleans())
            else {}
        ),
        # layers that hand a value on unchanged (a tuple's part), or none
        passes=np.where(ints(0, 1, L) > 0, ints(1, 30, L), 0) if draw(st.booleans()) else None,
        grad_in=np.where(np.arange(L) > 0, boundary[:L], 0),
        boundary=boundary,
        loss_saved=loss_saved,
        borrowed_input=draw(st.booleans()),
        last_grad=0 if loss_saved[-1] else draw(st.integers(0, 20)),
        # (the loss is no model layer: never under a checkpoint of its own, test_checkpointed)
        num_model_layers=L - 1 if has_loss else L,
    )
    tuples = st.lists(
        st.builds(
            running_on,
            st.lists(st.integers(0, 3), min_size=6, max_size=6),
            st.integers(0, 6),
        ),
        min_size=1,
        max_size=3,
    )
    specs = []
    for _ in range(K):
        shape = StageShape(
            occupancy=tuple(draw(tuples)),
            optimizer_slots=draw(st.integers(0, 2)),
            reserved=draw(st.integers(0, 10)),
            optimizer_step=draw(st.sampled_from([0.0, 0.5, 2.0])),
            foreach=draw(st.booleans()),
        )
        # From an even share of the whole chain to all of it: most instances fit, not all.
        share = reference_memory(chain, 0, L, shape) / K
        budget = int(share * draw(st.sampled_from([1.0, 1.5, 2.5, K]))) + draw(st.integers(0, 20))
        specs.append(StageSpec(draw(st.sampled_from([0.5, 1.0, 2.0])), budget, shape))
    cuts = None
    if draw(st.sampled_from([True, True, False])):
        # Link s moves boundary[j] units at a drawn cost per unit (free to slow); a quarter of the
        # cut positions are forbidden. Multiples of 1/4 ms: exact after CP-SAT's ns scaling.
        rarely = st.sampled_from([False, False, False, True])
        cuts = []
        # Or (a captured graph's routes) per start j and end k of the next stage: what it
        # receives grows with k, by a drawn amount per layer it takes.
        spans = draw(st.booleans())
        for _ in range(K - 1):
            per_unit = draw(st.sampled_from([0.0, 0.25, 1.0, 2.0, 4.0, 8.0]))
            forbid = np.array(draw(st.lists(rarely, min_size=L + 1, max_size=L + 1)))
            if spans:
                grow = np.concatenate([[0], np.cumsum(ints(0, 6, L))])
                units = chain.boundary[:, None] + np.maximum(grow[None, :] - grow[:, None], 0)
                cuts.append(np.where(forbid[:, None], math.inf, units * per_unit))
            else:
                cuts.append(np.where(forbid, math.inf, chain.boundary * per_unit))
    return chain, specs, cuts


def check_partition(part, times, chain, specs, cuts=None):
    bounds = part.bounds
    assert bounds[0] == 0 and bounds[-1] == len(times) and len(bounds) == len(specs) + 1
    assert all(a < b for a, b in zip(bounds[:-1], bounds[1:])), "an empty stage"
    for s, (i, j) in enumerate(part.stages):
        assert reference_memory(chain, i, j, specs[s].shape) <= specs[s].budget
    links = (
        [_link(cuts[s], j, bounds[s + 2]) for s, j in enumerate(bounds[1:-1])]
        if cuts is not None
        else []
    )
    assert all(math.isfinite(v) for v in links), "a forbidden cut"
    assert part.bottleneck == max(
        [float(sum(times[i:j])) / sp.speed for (i, j), sp in zip(part.stages, specs)] + links
    )


def assert_optimal(part, expected, times, chain, specs, cuts=None):
    """`part` is a valid split with the brute-force optimum, or None when nothing fits."""
    if math.isinf(expected):
        assert part is None
    else:
        assert part is not None
        check_partition(part, times, chain, specs, cuts)
        assert part.bottleneck == expected


@settings(max_examples=120, deadline=None)
@given(problems(), st.booleans())
def test_probe_and_dp_match_brute_force(problem, reach):
    """(`reach`: feasible_split by memory_split first, as on long chains.)"""
    from planner import partition

    chain, specs, cuts = problem
    times = chain.forward + chain.backward
    memory = MemoryModel(chain)
    expected = brute_force(times, chain, specs, cuts)
    kept, partition.REACH_FROM = partition.REACH_FROM, 0 if reach else partition.REACH_FROM
    try:
        assert feasible_split(times, memory, specs, cuts) == math.isfinite(expected)
    finally:
        partition.REACH_FROM = kept
    for solve in (solve_partition, solve_partition_dp):
        assert_optimal(solve(times, memory, specs, cuts), expected, times, chain, specs, cuts)


@settings(max_examples=150, deadline=None)
@given(problems(), st.sampled_from([0.0, 0.5, 0.999, 1.0, 1.001, 1.5, 3.0]))
def test_a_limit_on_the_bottleneck_returns_the_optimum_or_proves_none_within(problem, scale):
    """Brute force: with a limit at or above the optimum the solve returns the split it returns
    without one; below it (or where nothing fits) it raises NoneWithin, from the first probes on
    (the ladder stops at the limit; a limit below the time-alone bound needs no probe)."""
    chain, specs, cuts = problem
    times = chain.forward + chain.backward
    memory = MemoryModel(chain)
    expected = brute_force(times, chain, specs, cuts)
    free = solve_partition(times, memory, specs, cuts)
    limit = scale * (expected if math.isfinite(expected) else 1.0 + float(times.sum()))
    if math.isfinite(expected) and expected <= limit:
        part = solve_partition(times, memory, specs, cuts, limit=limit)
        assert_optimal(part, expected, times, chain, specs, cuts)
        assert part.bounds == free.bounds and part.choices == free.choices
    else:
        with pytest.raises(NoneWithin):
            solve_partition(times, memory, specs, cuts, limit=limit)


@settings(max_examples=150, deadline=None)
@given(problems(), st.floats(0.0, 1.0, exclude_max=True))
def test_a_failed_probe_fails_at_every_bound_below_its_next_bound(problem, where):
    """The bisection jumps past a failed probe to the least bound that lets a stage take one
    more layer or cut at one more link (`next_bound()`): every bound below it fails as well, and
    past it the probe finds the optimum where brute force does."""
    from planner.partition import _Prober

    chain, specs, cuts = problem
    times = chain.forward + chain.backward
    expected = brute_force(times, chain, specs, cuts)
    assume(math.isfinite(expected) and expected > 0)
    prober = _Prober(times, MemoryModel(chain), specs, cuts)
    bound = expected * where  # somewhere below the optimum: the probe fails
    assert prober.probe(bound) is None
    nxt = prober.next_bound()
    assert bound < nxt <= expected
    assert prober.probe(float(np.nextafter(nxt, -math.inf))) is None
    if nxt == expected:
        assert prober.probe(nxt) is not None


@pytest.mark.parametrize("seed", range(4))
def test_probe_matches_dp_on_larger_chains_with_binding_cuts(seed):
    # Float times and cut costs around the stage costs: the two solvers compute the same float
    # expressions, so their optima agree exactly.
    rng = np.random.default_rng(seed)
    L, K = 120, 6
    chain = make_chain(
        L,
        forward=rng.uniform(0.5, 2.0, L),
        backward=rng.uniform(1.0, 4.0, L),
        params=rng.integers(1, 100, L),
        saved=rng.integers(1, 50, L),
        backward_transient=rng.integers(0, 20, L),
        boundary=rng.integers(1, 10, L + 1),
    )
    times = chain.forward + chain.backward
    shape = StageShape(occupancy=(occ(0, 4),), optimizer_slots=1)
    whole = int(MemoryModel(chain).total(0, L, shape)[0])
    specs = [StageSpec(float(rng.choice([0.5, 1.0, 2.0])), whole // 3, shape) for _ in range(K)]
    even = float(times.sum()) / K
    cuts = [np.where(rng.random(L + 1) < 0.2, math.inf, rng.uniform(0, 1.5 * even, L + 1))]
    cuts += [rng.uniform(0, 1.5 * even, L + 1) for _ in range(K - 2)]
    memory = MemoryModel(chain)
    probe = solve_partition(times, memory, specs, cuts)
    dp = solve_partition_dp(times, memory, specs, cuts)
    assert probe is not None and dp is not None
    assert probe.bottleneck == dp.bottleneck
    assert probe.bottleneck > solve_partition(times, memory, specs).bottleneck  # cuts bind
    assert all(math.isfinite(cuts[s][j]) for s, j in enumerate(probe.bounds[1:-1]))


@pytest.mark.parametrize("seed", [5, 10, 11, 12, 14])  # seeds on which the 4-step version hung
def test_runs_of_zero_time_layers_keep_the_probe_exact(seed):
    # Every layer is followed by 6 zero-time ones (all costing the same). Proving the optimum
    # probes one ulp below a stage's cost, where searchsorted and the cost can disagree inside
    # such a run: the probe must step over the whole run (it used to step 4 layers, then loop).
    rng = np.random.default_rng(seed)
    times = np.concatenate([[t, 0, 0, 0, 0, 0, 0] for t in rng.uniform(0.0, 1.0, 8) / 7])
    L, K = len(times), 4
    chain = unit_chain([1] * L)
    specs = [StageSpec(1.0, 10**9, StageShape(occupancy=(occ(),), optimizer_slots=0))] * K
    cuts = [np.where(rng.random(L + 1) < 0.3, math.inf, 0.0) for _ in range(K - 1)]
    memory = MemoryModel(chain)
    for links in (None, cuts):
        probe = solve_partition(times, memory, specs, links)
        dp = solve_partition_dp(times, memory, specs, links)
        assert probe is not None and dp is not None
        assert probe.bottleneck == dp.bottleneck


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=70), st.data())
def test_range_maxima_are_the_slices_maxima(values, data):
    """The sparse table behind every transient and largest-parameter term: the maximum of
    values[i:j] for any 0 <= i < j <= n, at every length (each power of two and between)."""
    from planner.memory import _RangeMax

    n = len(values)
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, n)), min_size=1))
    i = np.array([min(a, b - 1) for a, b in pairs], dtype=np.int64)
    j = np.array([max(a + 1, b) for a, b in pairs], dtype=np.int64)
    got = _RangeMax(np.array(values))(i, j)
    assert got.tolist() == [max(values[a:b]) for a, b in zip(i.tolist(), j.tolist())]


@settings(max_examples=120, deadline=None)
@given(problems())
def test_memory_model_matches_reference_formula(problem):
    chain, specs, _ = problem
    memory = MemoryModel(chain)
    L = chain.num_layers
    i, j = np.array([(i, j) for i in range(L) for j in range(i + 1, L + 1)]).T
    for spec in specs:
        got = memory.total(i, j, spec.shape)
        assert got.tolist() == [reference_memory(chain, a, b, spec.shape) for a, b in zip(i, j)]


def test_greedy_would_strand_a_heavy_layer_but_the_probe_does_not():
    # Device 1 is small; filling device 0 greedily to layer 2 leaves the heavy layer 2 on it.
    chain = make_chain(4, forward=np.ones(4), params=np.array([1, 1, 50, 1]))
    shape = StageShape(occupancy=(occ(),), optimizer_slots=0)
    specs = [StageSpec(1.0, 1000, shape), StageSpec(1.0, 10, shape), StageSpec(1.0, 1000, shape)]
    part = solve_partition(chain.forward, MemoryModel(chain), specs)
    assert part is not None and part.bounds == [0, 1, 2, 4]


def test_equal_layers_split_evenly_at_scale():
    L, K = 4096, 64
    chain = make_chain(
        L,
        forward=np.ones(L),
        backward=np.ones(L),
        params=np.ones(L, dtype=np.int64),
        saved=np.ones(L, dtype=np.int64),
    )
    shape = StageShape(occupancy=(occ(0, 4),), optimizer_slots=2)
    part = solve_partition(
        chain.forward + chain.backward, MemoryModel(chain), [StageSpec(1.0, 10**9, shape)] * K
    )
    assert part is not None
    assert part.bottleneck == 2 * L / K
    assert all(j - i == L // K for i, j in part.stages)


def test_forbidden_even_cuts_cost_one_layer_at_scale():
    # 4096 layers of 2 ms on 64 stages, no cut allowed at a multiple of 64: the even split is gone,
    # and with it every split whose stages all hold <= 64 layers, so the best has a stage of 65.
    L, K = 4096, 64
    chain = unit_chain([1] * L)
    times = 2 * chain.forward
    shape = StageShape(occupancy=(occ(),), optimizer_slots=0)
    link = np.where(np.arange(L + 1) % 64 == 0, math.inf, 0.5)
    part = solve_partition(
        times, MemoryModel(chain), [StageSpec(1.0, 10**9, shape)] * K, [link] * (K - 1)
    )
    assert part is not None
    assert part.bottleneck == 130.0
    assert all(b % 64 for b in part.bounds[1:-1])


def cut_solvers():
    from planner.cpsat import solve_partition_cpsat

    return (solve_partition, solve_partition_dp, solve_partition_cpsat)


def test_a_large_output_on_a_slow_link_moves_the_cut_to_a_cheap_neighbour():
    # 6 equal layers on 2 stages balance at boundary 3, but layer 2's output (boundary[3]) is
    # large: 1000 ms on the link. Cutting one layer earlier or later costs 1 ms and a stage of 4.
    chain = unit_chain([1] * 6, boundary=[1, 1, 1, 1000, 1, 1, 1])
    shape = StageShape(occupancy=(occ(),), optimizer_slots=0)
    specs = [StageSpec(1.0, 10**6, shape)] * 2
    cuts = [chain.boundary * 1.0]
    memory = MemoryModel(chain)
    assert solve_partition(chain.forward, memory, specs).bounds == [0, 3, 6]
    assert brute_force(chain.forward, chain, specs, cuts) == 4.0
    for solve in cut_solvers():
        part = solve(chain.forward, memory, specs, cuts)
        assert part is not None and part.bounds in ([0, 2, 6], [0, 4, 6])
        assert part.bottleneck == 4.0


def test_forbidden_cuts_are_never_chosen():
    # Without cuts the heavy last layer balances the rest at boundary 4 (4 | 4). Boundary 4 is
    # forbidden (a loss glued to its layer), so the best is boundary 3 (3 | 5), all cuts free.
    chain = unit_chain([1] * 5)
    times = np.array([1.0, 1.0, 1.0, 1.0, 4.0])
    shape = StageShape(occupancy=(occ(),), optimizer_slots=0)
    specs = [StageSpec(1.0, 10**6, shape)] * 2
    cuts = [np.array([0.0, 0.0, 0.0, 0.0, math.inf, 0.0])]
    memory = MemoryModel(chain)
    assert solve_partition(times, memory, specs).bounds == [0, 4, 5]
    for solve in cut_solvers():
        part = solve(times, memory, specs, cuts)
        assert part is not None and part.bounds == [0, 3, 5] and part.bottleneck == 5.0


def test_no_split_when_the_only_cut_that_fits_is_forbidden():
    # 2 x 10 bytes per layer, 40 per device: only the cut at boundary 2 fits, and it is forbidden.
    chain = unit_chain([10] * 4)
    shape = StageShape(occupancy=(occ(),), optimizer_slots=0)
    specs = [StageSpec(1.0, 40, shape)] * 2
    cuts = [np.array([0.0, 0.0, math.inf, 0.0, 0.0])]
    memory = MemoryModel(chain)
    assert feasible_split(chain.forward, memory, specs)
    assert solve_partition(chain.forward, memory, specs).bounds == [0, 2, 4]
    assert not feasible_split(chain.forward, memory, specs, cuts)
    for solve in cut_solvers():
        assert solve(chain.forward, memory, specs, cuts) is None


def test_cuts_of_the_wrong_shape_are_refused():
    chain = unit_chain([1] * 4)
    specs = [StageSpec(1.0, 10**6, StageShape(occupancy=(occ(),), optimizer_slots=0))] * 3
    with pytest.raises(ValueError, match="one array per link"):
        solve_partition(chain.forward, MemoryModel(chain), specs, [np.zeros(5)])
    with pytest.raises(ValueError, match="one entry per layer boundary"):
        solve_partition(chain.forward, MemoryModel(chain), specs, [np.zeros(4)] * 2)


def test_cpsat_counts_an_inner_layers_input_gradient_without_the_stages_own():
    """Found by the suite's random chains: CP-SAT counted an inner layer's zero-bubble I on top
    of the stage's input gradient, which the memory model (and brute force) leave out (the
    first layer's I makes it last). Every split at 6 ms ends with the stage [8, 10): 156 bytes
    of its 165 by the model, 167 by CP-SAT's count, which said no split fits."""
    from planner.cpsat import solve_partition_cpsat

    L = 10
    chain = make_chain(
        L, forward=np.ones(L), params=np.array([0, 0, 0, 13, 24, 35, 36, 42, 0, 42]),
        input_grad_transient=np.array([0] * 9 + [11]),
        grad_in=np.array([0, 1, 1, 1, 1, 1, 1, 1, 18, 19]),
        boundary=np.array([23, 1, 1, 1, 1, 1, 1, 1, 18, 19, 1]),
    )  # fmt: skip
    plain = StageShape(occupancy=(running_on([0] * 6, 0),), optimizer_slots=0)
    with_i = StageShape(occupancy=(running_on([0, 1, 1, 0, 1, 0], 4),), optimizer_slots=0)
    specs = [StageSpec(0.5, 96, plain), StageSpec(0.5, 96, plain), StageSpec(0.5, 240, plain),
             StageSpec(0.5, 165, with_i)]  # fmt: skip
    times = chain.forward + chain.backward
    assert brute_force(times, chain, specs) == 6.0
    part = solve_partition_cpsat(times, MemoryModel(chain), specs, None)
    assert part is not None and part.bottleneck == 6.0


@pytest.mark.parametrize("inner", [[40, 1, 0], [60, 1, 0]], ids=["inner = b", "inner > b"])
def test_cpsat_bounds_an_inner_layers_backward_with_the_losss_gradient(inner):
    """CP-SAT bounded B's transient by the largest last-layer figure alone: an inner layer's
    (measured from another gradient layout, it may be larger) with the loss's scalar gradient
    beside it passed that bound, and a split that fits was said to fit nowhere (a review's)."""
    from planner.cpsat import solve_partition_cpsat

    L = 3
    chain = make_chain(
        L, forward=np.ones(L), saved=np.array([4, 4, 0]), backward_transient=np.array([40, 1, 0]),
        inner_backward=np.array(inner), boundary=np.array([4, 4, 4, 8]), num_model_layers=2,
    )  # fmt: skip
    shape = StageShape(occupancy=(running_on([1, 0, 0, 0, 0, 0], 1),), optimizer_slots=0)
    specs = [StageSpec(1.0, 10_000, shape)]
    times = chain.forward + chain.backward
    # (layer 0's inner figure, the loss's 8 bytes beside it, the 8 saved and the 4 of input)
    assert reference_memory(chain, 0, L, shape) == inner[0] + 8 + 8 + 4
    assert brute_force(times, chain, specs) == 3.0
    part = solve_partition_cpsat(times, MemoryModel(chain), specs, None)
    assert part is not None and part.bottleneck == 3.0


def test_zero_bubbles_w_counts_what_the_layer_after_next_may_hold_in_every_solver():
    """Layer 0's W (10 bytes beyond what it saved, 20) was measured with its saved tensors let
    go as it ran; layer 1 hands 16 bytes on, which layer 2 may save and hold to the stage's
    end: W's figure is then 10 + 16, but only where layer 2 is in the stage too. Both solvers
    and brute force agree (the suite's random chains seldom make that term decide a split)."""
    from planner.cpsat import solve_partition_cpsat

    L = 4
    chain = make_chain(
        L, forward=np.array([1.0, 1.0, 1.0, 3.0]), saved=np.array([20, 0, 0, 0]),
        weight_grad_transient=np.array([10, 0, 0, 0]), passes=np.array([0, 16, 0, 0]),
    )  # fmt: skip
    shape = StageShape(occupancy=(occ(running=5),), optimizer_slots=0)
    memory = MemoryModel(chain)
    assert [reference_memory(chain, 0, j, shape) for j in (2, 3)] == [10, 26]
    assert [int(memory.total(0, j, shape)[0]) for j in (2, 3)] == [10, 26]
    times = chain.forward
    for budget, best in [(26, 3.0), (25, 4.0)]:  # [0, 3) then [3, 4]; else [0, 2) [2, 4)
        specs = [StageSpec(1.0, budget, shape)] * 2
        assert brute_force(times, chain, specs) == best
        assert solve_partition(times, memory, specs).bottleneck == best
        part = solve_partition_cpsat(times, memory, specs, None)
        assert part is not None and part.bottleneck == best


@settings(max_examples=60, deadline=None)
@given(problems())
def test_cpsat_matches_brute_force(problem):
    from planner.cpsat import solve_partition_cpsat

    chain, specs, cuts = problem
    # CP-SAT models a chain's links, per cut (captured graphs are solved by the probe and DP),
    # and no tensors kept on a ctx (it refuses those)
    assume(cuts is None or all(np.ndim(c) == 1 for c in cuts))
    assume(chain.ctx_late is None)
    times = chain.forward + chain.backward  # whole milliseconds: exact after scaling
    expected = brute_force(times, chain, specs, cuts)
    part = solve_partition_cpsat(times, MemoryModel(chain), specs, cuts)
    assert_optimal(part, expected, times, chain, specs, cuts)
    if part is not None:
        assert part.extra["optimal"] == 1.0 and part.extra["gap"] == 0.0
        assert part.extra["lower_bound_ms"] == expected


@settings(max_examples=120, deadline=None)
@given(problems(), st.data())
def test_memory_free_means_more_memory_or_more_options_cannot_beat_it(problem, data):
    """`memory_free`: memory lowered no end in the proof nor in the probe that made the split.
    Then unlimited budgets find no smaller bottleneck, and further options that cost at least
    as much per layer (per-stage recomputation), with any memory shapes (here: holding
    nothing but the weights), give the very same split with every stage on option 0."""
    chain, specs, cuts = problem
    times = chain.forward + chain.backward
    memory = MemoryModel(chain)
    part = solve_partition(times, memory, specs, cuts)
    if part is None:
        return
    free = [dataclasses.replace(sp, budget=10**15) for sp in specs]
    unlimited = solve_partition(times, memory, free, cuts)
    # whole milliseconds, like the problem's: sums are exact, so no option looks cheaper than
    # option 0 by a rounding of its prefix sums
    extra = data.draw(st.lists(st.integers(0, 3), min_size=len(times), max_size=len(times)))
    light = [dataclasses.replace(sp.shape, occupancy=(occ(0, 0, 0, 0, 0, 0),)) for sp in specs]
    more = [dataclasses.replace(sp, more=(sh, sp.shape)) for sp, sh in zip(specs, light)]
    table = np.stack([times, times + np.array(extra), times * 2])
    options = solve_partition(table, memory, more, cuts)
    if part.extra["memory_free"] == 1.0:
        assert unlimited.bottleneck == part.bottleneck
        assert options is not None and options.bottleneck == part.bottleneck
        assert options.bounds == part.bounds and options.choices == [0] * len(specs)


class _Tables:
    """A memory model reduced to fixed tables of largest ends (one per stage and option)."""

    def __init__(self, ends: dict[int, list[int]]) -> None:
        self.ends = ends

    def max_ends(self, wanted, cap=None, starts=None):
        return [np.array(self.ends[id(shape)]) for shape, _ in wanted]

    def end_guess(self, shape, budget, start):  # (exact)
        return self.ends[id(shape)][start]


def test_memory_free_is_not_claimed_where_the_split_itself_was_cut_by_memory():
    """Found in review: the proof probe (just below the optimum) saw no memory cut, but the
    probe at the optimum, which makes the split, did; with a cheaper-in-memory option the
    per-stage split differs ([0, 2, 4, 6, 8], option 1 on stage 2). Not memory free, then."""
    never = [[3, 7, 7, 8, 8, 8, 8, 8], [3, 5, 7, 7, 7, 7, 8, 8], [4, 4, 4, 4, 4, 6, 8, 8],
             [4, 8, 8, 8, 8, 8, 8, 8]]  # fmt: skip
    remat = [[7, 7, 8, 8, 8, 8, 8, 8], [5, 7, 7, 8, 8, 8, 8, 8], [7, 7, 7, 7, 8, 8, 8, 8],
             [5, 8, 8, 8, 8, 8, 8, 8]]  # fmt: skip
    shapes = [StageShape(occupancy=(occ(k),), optimizer_slots=0) for k in range(8)]
    tables = _Tables({id(shapes[k]): row for k, row in enumerate(never + remat)})
    times = np.array([3, 3, 3, 1, 2, 2, 5, 1], dtype=float)
    alone = [StageSpec(1.0, 100, shapes[s]) for s in range(4)]
    both = [StageSpec(1.0, 100, shapes[s], more=(shapes[4 + s],)) for s in range(4)]
    part = solve_partition(times, tables, alone)  # type: ignore[arg-type]
    options = solve_partition(  # type: ignore[arg-type]
        np.stack([times, times + np.array([2, 1, 1, 2, 1, 1, 1, 1])]), tables, both
    )
    assert part.bottleneck == options.bottleneck == 6
    assert part.bounds != options.bounds  # the per-stage split differs ...
    assert part.extra["memory_free"] == 0.0  # ... so the never split does not claim it


@settings(max_examples=60, deadline=None)
@given(problems())
def test_max_end_is_the_last_end_that_fits(problem):
    """Against a scan of every end, for every start and each stage's shape and budget. The scan
    asks for each stage's total on its own (as the partition's probes do not), once per shape."""
    chain, specs, _ = problem
    memory = MemoryModel(chain)
    L = chain.num_layers
    totals: dict = {}

    def scan(model: MemoryModel, shape, budget: int) -> list[int]:
        """Per start, its last end that fits (the start itself if none)."""
        if shape not in totals:
            totals[shape] = {
                (i, j): int(model.total(i, j, shape)[0])
                for i in range(L)
                for j in range(i + 1, L + 1)
            }
        table = totals[shape]
        return [
            max((j for j in range(i + 1, L + 1) if table[i, j] <= budget), default=i)
            for i in range(L)
        ]

    for spec in specs:
        assert memory.max_end(spec.shape, spec.budget).tolist() == scan(
            memory, spec.shape, spec.budget
        )
    # many shapes and budgets searched together, and capped: against the scan
    keys = [(sp.shape, b) for sp in specs for b in (sp.budget, sp.budget // 2 + 1, 2 * sp.budget)]
    cap = np.array([min(L, i + 1 + (i * 7) % 3) for i in range(L)])
    wider = np.array([min(L, i + 1 + (i * 5) % 4) for i in range(L)])
    fresh = MemoryModel(chain)
    # a search under a cap, then one past it where ends were cut (starting from what the first
    # found), then one without, then the first again: each answered from what the model kept
    # and searched further, and each exactly the scan's (whose totals the model that searched
    # gives again, one stage at a time)
    runs = []
    for top in (cap, wider, None, cap):
        runs.append((top, fresh.max_ends(keys, cap=top)))
        # what the model keeps is counted as it keeps it (not summed on each call)
        assert fresh._ends_size == sum(found.size for found, _ in fresh._ends.values())
    totals.clear()
    last = [scan(fresh, shape, budget) for shape, budget in keys]
    for top, found in runs:
        for got, want in zip(found, last):
            assert got.tolist() == (want if top is None else np.minimum(want, top).tolist())


def brute_force_options(table, chain, specs, cuts=None) -> float:
    """As brute_force, each stage taking its fastest option that fits (per-stage choice)."""
    L, K = table.shape[1], len(specs)
    best = math.inf
    for inner in itertools.combinations(range(1, L), K - 1):
        bounds = [0, *inner, L]
        cost = 0.0
        for s, (i, j) in enumerate(zip(bounds[:-1], bounds[1:])):
            stage = min(
                (
                    float(sum(row[i:j])) / specs[s].speed
                    for row, shape in zip(table, specs[s].shapes)
                    if reference_memory(chain, i, j, shape) <= specs[s].budget
                ),
                default=math.inf,
            )
            cost = max(cost, stage)
            if cuts is not None and s < K - 1:
                cost = max(cost, _link(cuts[s], j, bounds[s + 2]))
        best = min(best, cost)
    return best


def lighter_by(t: tuple[int, ...], k: int) -> tuple[int, ...]:
    """An occupancy tuple with k fewer micro-batches in each state, but the one a running
    transient works on."""
    counts = [max(0, c - k) for c in t[:6]]
    running = 1 + t[8:].index(1) if 1 in t[8:] else 0
    return tuple(running_on(counts, running))


@settings(max_examples=70, deadline=None)
@given(problems(), st.data())
def test_per_stage_choice_matches_brute_force_over_every_choice(problem, data):
    """Each stage picks among three memory shapes, the heavier in memory the lighter in time
    (as recomputation trades them): the probe and the DP find the brute-force optimum over all
    splits and all per-stage choices, and each stage's reported choice fits and costs that."""
    chain, specs, cuts = problem
    ratios = (1.0, data.draw(st.sampled_from([1.25, 1.5])), 2.0)
    table = np.stack([(chain.forward + chain.backward) * r for r in ratios])
    options = []
    for spec in specs:
        lighter = [
            StageShape(
                occupancy=tuple(lighter_by(t, k) for t in spec.shape.occupancy),
                optimizer_slots=spec.shape.optimizer_slots, reserved=spec.shape.reserved,
                optimizer_step=spec.shape.optimizer_step, foreach=spec.shape.foreach,
            )
            for k in (1, 2)
        ]  # fmt: skip
        options.append(StageSpec(spec.speed, spec.budget, spec.shape, tuple(lighter)))
    memory = MemoryModel(chain)
    expected = brute_force_options(table, chain, options, cuts)
    for solve in (solve_partition, solve_partition_dp):
        part = solve(table, memory, options, cuts)
        if math.isinf(expected):
            assert part is None
            continue
        assert part is not None and part.bottleneck == expected
        for s, ((i, j), x) in enumerate(zip(part.stages, part.choices)):
            assert reference_memory(chain, i, j, options[s].shapes[x]) <= options[s].budget
            assert float(sum(table[x][i:j])) / options[s].speed <= expected


@pytest.mark.parametrize("L", [4, 7, 12])
def test_a_parameter_two_layers_share_is_held_once_per_stage_and_solvers_agree(L):
    """Layers 0 and L - 2 share a 100-byte parameter (tied embeddings); the last layer is slow.
    The best split gives it a stage of its own, which leaves [0, L - 1) with both users of the
    shared parameter: it fits only because a stage holds that parameter once (the probe's
    prefix-sum cap on the ends must not cut it off)."""
    tied = 100
    p = np.ones(L, dtype=np.int64)
    p[0] += tied
    p[L - 2] += tied
    chain = dataclasses.replace(
        unit_chain(list(p)), forward=np.array([1.0] * (L - 1) + [100.0]), tied=((tied, (0, L - 2)),)
    )
    memory = MemoryModel(chain)
    shape = StageShape(occupancy=(occ(),), optimizer_slots=0)
    first = int(memory.total(0, L - 1, shape)[0])
    assert first == 2 * (L - 1 + tied)  # weights and gradients, the shared one once
    specs = [StageSpec(1.0, first, shape)] * 2
    for solve in (solve_partition, solve_partition_dp):
        part = solve(chain.forward, memory, specs)
        assert part is not None and part.bounds == [0, L - 1, L] and part.bottleneck == 100.0


def _grows_with_the_end(memory: MemoryModel, shape: StageShape) -> None:
    L = memory.chain.num_layers
    for i in range(L):
        totals = memory.total(np.full(L - i, i), np.arange(i + 1, L + 1), shape)
        assert (np.diff(totals) >= 0).all(), (i, totals)


def test_a_stage_of_views_holds_its_input_for_w_when_it_takes_the_loss_on():
    """A random draw's counterexample to the test below: a stage of one view layer holds its
    input from I to W (the view's graph reaches it), and held no byte of it once the stage
    took the loss on, which saves a view of it (the loss's tensors go with I, but the view's
    graph still holds the input): zero bubble's figure shrank as the stage grew."""
    L = 3
    last = np.array([0, 0, 1])
    chain = make_chain(L, forward=np.ones(L), saved=last, input_saved=last, loss_saved=last,
                       grad_in=np.array([0, 1, 1]), views=np.array([False, True, False]),
                       num_model_layers=2)  # fmt: skip
    memory = MemoryModel(chain)
    shape = StageShape(occupancy=(occ(0, 0, 0, 1),), optimizer_slots=0)
    for j in (2, 3):
        assert memory.state_bytes(1, j)["between_iw"][0] == 1
        assert memory.total(1, j, shape) == reference_memory(chain, 1, j, shape) == 1
    # the loss alone: nothing of the model's holds its input past I
    assert memory.state_bytes(2, 3)["between_iw"][0] == 0
    # ... and stage 0 on the caller's micro-batch (a red team's): what the loss saves of it
    # was taken off twice, as the loss's and as the caller's (-1 here); the gradients I keeps
    # for W alone remain
    z = np.array([2, 0])
    lent = make_chain(2, forward=np.ones(2), saved=np.array([0, 1]), input_saved=np.array([0, 1]),
                      loss_saved=np.array([0, 1]), grad_in=np.array([0, 1]), zgrad=z, zkept=z,
                      views=np.array([True, False]), num_model_layers=1, borrowed_input=True)  # fmt: skip
    memory = MemoryModel(lent)
    for j in (1, 2):
        assert memory.state_bytes(0, j)["between_iw"][0] == 2
        assert memory.total(0, j, shape) == reference_memory(lent, 0, j, shape) == 2


@settings(max_examples=80, deadline=None)
@given(problems())
def test_a_stage_holds_no_less_as_it_gains_layers(problem):
    """What the partition search rests on: the transients walk the stage (a layer's peak less
    what the layers after it save), so they alone may shrink, but no stage's total does."""
    chain, specs, _ = problem
    memory = MemoryModel(chain)
    for spec in specs:
        _grows_with_the_end(memory, spec.shape)


def test_a_captured_graphs_stage_holds_no_less_as_it_gains_layers():
    """... and with a U-Net's skips (sent on, pulled back, read inside or not), under the
    occupancies of gpipe, 1F1B and zero bubble, with and without recomputation."""
    from planner.costs import chain_at
    from profiler.examples import unet
    from profiler.graph import capture
    from schedules import build_schedule
    from schedules.memory import occupancy
    from tests.conftest import quick_profile

    model = unet(size=8)
    layers = capture(model, model.example_input)
    prof = quick_profile(layers, model.example_input, batch_sizes=[2])
    chain = chain_at(prof, 2)
    memory = MemoryModel(chain)
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for mode in ("never", "always"):
            sched = build_schedule(schedule, 3, 4)
            for occ_ in occupancy(sched, mode):
                _grows_with_the_end(memory, StageShape(occupancy=tuple(occ_), optimizer_slots=1))
    # B's pulled gradient: at least what the stage sends, at most the largest any shorter
    # stage sends (the bound it was before it grew together with B), and below it somewhere
    assert chain.flow is not None
    n = chain.num_layers
    i, k = np.triu_indices(n + 1, 1)
    i, k = i[i < n], k[i < n]
    pulled = memory.state_bytes(i, k)["pulled"]
    sent = chain.flow.sending(chain.zgrad)[i, k]
    envelope = chain.flow.passing(i, k, chain.zgrad)
    assert (sent <= pulled).all() and (pulled <= envelope).all()
    assert (pulled < envelope).any()

    # zero bubble's I at layer l: on top of every gradient but those of what layers i .. l - 2
    # make and no layer from l on reads (a skip read later has its gradient made already);
    # with those of layers i .. l that I lets go (no weights that train: Z leaves them out)
    let_go = (chain.zgrad - chain.kept_grad).astype(np.int64)
    assert let_go.any() and (let_go >= 0).all()  # (the U-Net's ReLUs, pools and concatenations)

    # ... and the gradients I lets go that are alive at l: of what layers i .. l make, and
    # the stage's pulled one (its last layer's), held to I's end; as the most over the ends
    # e <= j, with the kept ones of layers e .. j - 1 taken off (_zero_bubble_input)
    def at_end(a: int, e: int) -> int:
        flow, it = chain.flow, chain.input_grad_transient
        assert flow is not None
        most = int(it[a]) + int(let_go[a]) + int(let_go[e - 1] if e - a > 1 else 0)
        for layer in range(a + 1, e):
            gone = 0
            for b in range(a, layer - 1):
                made = zip(
                    flow.born.tolist(), flow.last.tolist(), (flow.nbytes * flow.grad).tolist()
                )
                early = sum(w for born, last, w in made if born == b and 0 <= last < layer)
                gone += min(early, int(chain.zgrad[b]))
            go = int(let_go[a : layer + 1].sum()) + int(let_go[e - 1] if layer < e - 1 else 0)
            most = max(most, int(it[layer]) - gone + go)
        return most

    def input_live(a: int, j: int) -> int:
        kept = chain.kept_grad
        return max(at_end(a, e) - int(kept[e:j].sum()) for e in range(a + 1, j + 1))

    walked = memory.state_bytes(i, k)["input_live"]
    assert walked.tolist() == [input_live(a, j) for a, j in zip(i.tolist(), k.tolist())]
    largest = np.array(
        [chain.input_grad_transient[a:j].max() + 2 * let_go[a:j].sum() for a, j in zip(i, k)]
    )
    assert (walked <= largest).all() and (walked < largest).any()  # the walk counts less
    # a tuple holding it outside B would not grow with the end: refused
    held = StageShape(occupancy=(occ(0, 1, 0, 0, 0, 1),), optimizer_slots=1)
    with pytest.raises(ValueError, match="pulled gradient outside B"):
        memory.total(0, 2, held)


def test_max_ends_of_a_long_chain_are_the_last_ends_that_fit():
    """The bisection over every start at once, on a chain long enough to be batched by keys:
    exactly the last end that fits, where ends jump about from one start to the next (random
    inputs and saved bytes), under real occupancies, capped or not."""
    from schedules import build_schedule
    from schedules.memory import occupancy

    rng = np.random.default_rng(7)
    L = 700
    chain = make_chain(
        L,
        params=rng.integers(0, 50, L),
        saved=rng.integers(0, 400, L),
        backward_transient=rng.integers(0, 300, L),
        forward_transient=rng.integers(0, 300, L),
        zgrad=rng.integers(0, 100, L),
        boundary=rng.integers(0, 2000, L + 1),
        input_saved=rng.integers(0, 100, L),
    )
    memory = MemoryModel(chain)
    shapes = [
        StageShape(occupancy=tuple(occupancy(build_schedule(name, 4, 8), "never")[s]),
                   optimizer_slots=1)
        for name, s in (("gpipe", 0), ("1f1b", 1), ("zb-h1", 3))
    ]  # fmt: skip
    keys = [(sh, b) for sh in shapes for b in (20_000, 60_000, 150_000)]
    cap = np.minimum(np.arange(L) + 1 + rng.integers(0, 200, L), L)
    i, j = np.triu_indices(L + 1, 1)
    keep = i < L
    i, j = i[keep], j[keep]
    wider = np.minimum(cap + rng.integers(0, 100, L), L)
    lasts = []
    for shape, budget in keys:
        fits = memory.total(i, j, shape) <= budget
        lasts.append(np.arange(L))
        np.maximum.at(lasts[-1], i[fits], j[fits])
    # capped, then a wider cap (searched on from what the first found), then none, then the
    # first cap again (answered from what was kept)
    runs = [(top, memory.max_ends(keys, cap=top)) for top in (cap, wider, None, cap)]
    for top, found in runs:
        for last, got in zip(lasts, found):
            want = last if top is None else np.minimum(last, top)
            assert (got == want).all(), np.nonzero(got != want)[0][:5]
            assert len(set(np.diff(got).tolist())) > 3  # ends that do jump about


def test_occupancy_sums_are_exact_where_a_float_would_round():
    """The stage totals' products of counts and bytes run in float64 only where every sum
    stays below 2^53: odd byte counts past it (a float would round them) take int64."""
    from planner.memory import _most

    rng = np.random.default_rng(3)
    occ = rng.integers(0, 300, (6, 5))
    occ[:, 0] = 1
    small = rng.integers(-(2**40), 2**40, (5, 400))
    assert (_most(occ, small) == (occ @ small).max(axis=0)).all()
    big = small.copy()
    big[0] = 2**53 + 1 + 2 * rng.integers(0, 2**20, 400)
    one = np.zeros_like(occ)
    one[:, 0] = 1  # each tuple counts the one state once: a float's sum is the value itself
    assert (_most(one, big) == big[0]).all()
    # two states at 2^52 and 2^52 + 1: each below 2^53, their sum not (a guard on the largest
    # count alone, not the tuple's sum of counts, would let a float round it)
    pair = np.array([[2**52 + 1], [2**52]])
    assert _most(np.array([[1, 1]]), pair).tolist() == [2**53 + 1]
    none = _most(occ[:, :0], small[:0])  # no state counted: nothing held
    assert none.shape == (400,) and not none.any()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.data())
def test_pair_maxima_are_brute_force(first, data):
    """The table behind a chain's pulled gradient (MemoryModel, `pulled_tight`): the most
    first[l] + second[m] over l < m in [i, j), for every range."""
    from planner.memory import _PairMax

    n = len(first)
    second = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    i, j = np.triu_indices(n + 1, 1)
    got = _PairMax(np.array(first), np.array(second))(i, j)
    pairs = [
        [first[x] + second[y] for x in range(a, b) for y in range(x + 1, b)] for a, b in zip(i, j)
    ]
    assert got.tolist() == [max(p, default=0) for p in pairs]


@functools.cache
def _real_shapes() -> list[StageShape]:
    """Every stage's occupancy that holds a pulled gradient, of every schedule kind and
    recomputation mode, on 2 and 3 devices with 2 to 4 micro-batches: what the planner solves
    with."""
    from schedules import build_schedule, occupancy

    seen = {}
    for name, K, M, mode in itertools.product(
        ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"], [2, 3], [2, 3, 4],
        ["never", "except_last", "always"],
    ):  # fmt: skip
        v = 2 if name == "interleaved-1f1b" else 1
        if v > 1 and M > 2 and M % K:
            continue
        for o in occupancy(build_schedule(name, K * v, M, stages_per_rank=v), mode):
            if any(t[5] for t in o):
                seen.setdefault(o, StageShape(occupancy=o, optimizer_slots=1))
    return list(seen.values())


@settings(max_examples=7, deadline=None)
@given(problems())
def test_stages_of_real_schedules_grow_with_their_end_and_are_the_reference(problem):
    """On the occupancies real schedules make (which count B's pulled gradient the tighter
    ways far more often than drawn ones do): every stage's total is the reference formula's,
    and it never shrinks as the stage takes another layer (what makes the split exact)."""
    chain = problem[0]
    L, memory = chain.num_layers, MemoryModel(chain)
    for shape in _real_shapes():
        for i in range(L):
            total = memory.total(np.full(L - i, i), np.arange(i + 1, L + 1), shape)
            assert (np.diff(total) >= 0).all(), (i, shape.occupancy, total)
            assert total.tolist() == [
                reference_memory(chain, i, j, shape) for j in range(i + 1, L + 1)
            ]


def _fits_somehow(chain: Chain, specs: list[StageSpec], bounds: list[int]) -> bool:
    return all(
        any(reference_memory(chain, i, j, shape) <= spec.budget for shape in spec.shapes)
        for spec, (i, j) in zip(specs, zip(bounds[:-1], bounds[1:]))
    )


@settings(max_examples=300, deadline=None)
@given(problems(), st.booleans(), st.sampled_from([1, 2, 64]))
def test_the_memory_split_by_its_reach_matches_brute_force(problem, options, window):
    """memory_split (feasible_split's way on long chains): decided, its answer is brute
    force's over every split, any option per stage; undecided only where a start in reach fits
    not even one layer, or no cut may go at a position its reach passes. (Its windows of ends
    start as small as one, so that they grow past a stage's end here too.)"""
    from planner import partition
    from planner.partition import memory_split

    chain, specs, cuts = problem
    if options:  # each stage may also take the next stage's shape (per-stage recomputation)
        specs = [
            dataclasses.replace(sp, more=(specs[(s + 1) % len(specs)].shape,))
            for s, sp in enumerate(specs)
        ]
    L, K = len(chain.forward), len(specs)
    # where no cut may go (a link's infinite entries); a link costed per end: anywhere
    allowed = None
    if cuts is not None and all(np.ndim(row) == 1 for row in cuts):
        allowed = np.isfinite(np.array(cuts)).reshape(K - 1, L + 1)
    splits = [[0, *inner, L] for inner in itertools.combinations(range(1, L), K - 1)]
    if allowed is not None:
        splits = [b for b in splits if all(allowed[s][j] for s, j in enumerate(b[1:-1]))]
    fitting = [b for b in splits if _fits_somehow(chain, specs, b)]
    kept, partition.WINDOW = partition.WINDOW, window
    try:
        decided, bounds = memory_split(MemoryModel(chain), specs, L, allowed)
    finally:
        partition.WINDOW = kept
    if not decided:
        one = [
            any(reference_memory(chain, i, i + 1, sh) <= sp.budget for sh in sp.shapes)
            for sp in specs
            for i in range(L)
        ]
        assert not all(one) or (allowed is not None and not allowed.all())
        return
    if bounds is None:
        assert fitting == []
    else:
        assert bounds in splits and _fits_somehow(chain, specs, bounds)


def test_max_ends_asked_from_some_starts_are_exact_there_and_kept():
    """`starts`: each key's ends searched from those starts only, exact there; a later call
    from other starts (or all, or under a wider cap) searches on from what was kept, and
    every answer is the scan's where it was asked."""
    rng = np.random.default_rng(11)
    L = 300
    chain = make_chain(
        L, params=rng.integers(0, 50, L), saved=rng.integers(0, 400, L),
        backward_transient=rng.integers(0, 300, L), boundary=rng.integers(0, 2000, L + 1),
    )  # fmt: skip
    memory = MemoryModel(chain)
    shapes = [StageShape(occupancy=(occ(0, n),), optimizer_slots=1) for n in (1, 3)]
    keys = [(sh, b) for sh in shapes for b in (9_000, 40_000)]
    i, j = np.triu_indices(L + 1, 1)
    keep = i < L
    i, j = i[keep], j[keep]
    lasts = []
    for shape, budget in keys:
        fits = memory.total(i, j, shape) <= budget
        lasts.append(np.arange(L))
        np.maximum.at(lasts[-1], i[fits], j[fits])
    cap = np.minimum(np.arange(L) + 1 + rng.integers(0, 120, L), L)
    fresh = MemoryModel(chain)
    some = [np.sort(rng.choice(L, 40, replace=False)) for _ in keys]
    overlapping = [np.unique(np.concatenate([s[:20], rng.choice(L, 30)])) for s in some]
    # a key asked twice in one call: the union of its starts
    twice = fresh.max_ends([*keys, keys[0]], cap=cap, starts=[*some, overlapping[0]])
    assert all((got[s] == np.minimum(last, cap)[s]).all()
               for got, last, s in zip(twice, lasts, some))  # fmt: skip
    assert (twice[-1][overlapping[0]] == np.minimum(lasts[0], cap)[overlapping[0]]).all()
    searched = sum(int((to > np.arange(L)).sum()) for _, to in fresh._ends.values())
    assert searched <= sum(len(s) for s in some) + len(overlapping[0])  # nothing else
    for top, starts in ((None, overlapping), (cap, None), (None, None)):
        found = fresh.max_ends(keys, cap=top, starts=starts)
        for k, (got, last) in enumerate(zip(found, lasts)):
            want = last if top is None else np.minimum(last, top)
            at = np.arange(L) if starts is None else starts[k]
            assert (got[at] == want[at]).all(), (k, np.nonzero(got[at] != want[at])[0][:5])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=10),
    st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=4),
    st.sampled_from([1.0, 0.1, 1 / 3]),
)
def test_the_time_alone_bounds_bracket_the_best_split_on_time_alone(times, speeds, scale):
    """_time_alone: its first figure is below the best split's bottleneck on time alone
    (brute force), so below every split's with memory and links too; its second, the first
    probe's guess, is at most the optimum's (within 1e-4; it is less where a stage left
    empty would do better: here the heavy layer first stranded a greedy test on a slow
    stage, which claimed no split fits at the optimum)."""
    from planner.partition import _time_alone

    assume(len(speeds) <= len(times))
    least = np.array(times, dtype=float) * scale
    below, about = _time_alone(least, speeds)
    L, K = len(least), len(speeds)
    best = min(
        max(float(least[i:j].sum()) / sp for (i, j), sp in zip(zip(b[:-1], b[1:]), speeds))
        for b in ([0, *inner, L] for inner in itertools.combinations(range(1, L), K - 1))
    )
    if best == 0:
        assert (below, about) == (0.0, 0.0)  # no guess: the solver probes without a bound
        return
    assert below < best and about <= best * (1 + 2e-4)


def _random_chain(
    rng: np.random.Generator, L: int, forward: np.ndarray, backward: np.ndarray, saved: int
) -> Chain:
    """A chain of the given times whose parameters, saved bytes, backward transients and
    boundaries are drawn (saved below `saved`)."""
    return make_chain(
        L, forward=forward, backward=backward, params=rng.integers(1, 100, L),
        saved=rng.integers(1, saved, L), backward_transient=rng.integers(0, 20, L),
        boundary=rng.integers(1, 10, L + 1),
    )  # fmt: skip


def test_a_long_chain_searches_memory_only_from_the_starts_near_its_split(monkeypatch):
    """Near the split time alone makes, a stage may start only within a window a few layers
    wide: the memory tables are searched from those starts, not from every start, where
    memory binds or not, and the split is the one the solver finds from every start's ends."""
    from planner import partition

    rng = np.random.default_rng(2)
    L, K = 3000, 24
    chain = _random_chain(rng, L, rng.lognormal(0.0, 0.5, L), rng.lognormal(0.5, 0.5, L), 50)
    times = chain.forward + chain.backward
    shapes = [StageShape(occupancy=(occ(0, K - s),), optimizer_slots=1) for s in range(K)]
    memory = MemoryModel(chain)
    unlimited = solve_partition(times, memory, [StageSpec(1.0, 10**15, sh) for sh in shapes])
    assert unlimited is not None
    most = max(  # the unlimited split's largest stage
        int(memory.total(i, j, sh)[0]) for (i, j), sh in zip(unlimited.stages, shapes)
    )
    for budget, binds in ((most, False), (most * 9 // 10, True)):
        specs = [StageSpec(1.0, budget, shapes[s]) for s in range(K)]
        fresh = MemoryModel(chain)
        part = solve_partition(times, fresh, specs)
        assert part is not None and (part.bottleneck > unlimited.bottleneck) == binds
        searched = sum(int((to > np.arange(L)).sum()) for _, to in fresh._ends.values())
        assert searched < K * L / (100 if not binds else 10)  # (35 and 1 347 of 72 000)
        # the same split as the solver that searches every start's ends (no first probes)
        with monkeypatch.context() as m:
            m.setattr(partition, "LADDER", ())
            full = MemoryModel(chain)
            whole = solve_partition(times, full, specs)
        assert whole is not None and (whole.bounds, whole.bottleneck) == (
            part.bounds,
            part.bottleneck,
        )
        assert sum(int((to > np.arange(L)).sum()) for _, to in full._ends.values()) == K * L


@pytest.mark.parametrize("seed", range(3))
def test_probe_matches_dp_where_memory_binds_far_from_the_time_alone_split(seed, monkeypatch):
    """Per-stage options of float costs (no option the cheapest at every layer, so the
    windows' sums over the cheapest differ from each option's) and mixed speeds, budgets
    from loose to tight: the first probes near the split time alone makes fail, the windows
    widen, and the probe still finds the DP's optimum, with the split and choices of the
    solver that searches every start."""
    from planner import partition

    rng = np.random.default_rng(seed)
    L, K = 90, 6
    chain = _random_chain(rng, L, rng.uniform(0.5, 2.0, L), rng.uniform(1.0, 4.0, L), 60)
    base = chain.forward + chain.backward
    table = np.stack([base * rng.uniform(1.0, 1.4, L) for _ in range(3)])
    assert all((table[x] > table.min(axis=0)).any() for x in range(3))
    memory = MemoryModel(chain)
    heavy = StageShape(occupancy=(occ(0, 6),), optimizer_slots=1)
    light = [StageShape(occupancy=(occ(0, n),), optimizer_slots=1) for n in (3, 1)]
    whole = int(memory.total(0, L, heavy)[0])
    speeds = rng.choice([0.5, 1.0, 1 / 3, 2.0], K)
    loads: list[int] = []
    reach_to = partition._Prober.reach_to

    def counted(self, cap_bound):
        loads[-1] += 1
        return reach_to(self, cap_bound)

    monkeypatch.setattr(partition._Prober, "reach_to", counted)
    found: list[float] = []
    for part_of in (1.0, 0.4, 0.25, 0.15):
        specs = [StageSpec(float(sp), int(whole * part_of), heavy, tuple(light)) for sp in speeds]
        loads.append(0)
        probe = solve_partition(table, MemoryModel(chain), specs)
        dp = solve_partition_dp(table, memory, specs)
        with monkeypatch.context() as m:
            m.setattr(partition, "LADDER", ())
            full = solve_partition(table, MemoryModel(chain), specs)
        assert (probe is None) == (dp is None) == (full is None)
        if probe is not None:
            assert probe.bottleneck == dp.bottleneck == full.bottleneck  # type: ignore[union-attr]
            assert (probe.bounds, probe.choices) == (full.bounds, full.choices)  # type: ignore[union-attr]
            found.append(probe.bottleneck)
    # no stage runs every layer's cheapest option: the first probe fails, wider ones follow
    assert min(loads) > 1
    assert found[0] < max(found)  # and memory binds: the tighter, the slower


def test_a_window_too_narrow_for_what_a_probe_reaches_is_widened():
    """The windows rest on sums over each layer's cheapest option, which may round unlike an
    option's own: where a probe reaches a start past its stage's window, the tables are
    searched in full and the probe run again, not cut short (here the windows are narrowed
    by hand), and a probe past the bound the tables were made for does the same."""
    from planner.partition import _Prober

    rng = np.random.default_rng(4)
    L, K = 40, 4
    chain = make_chain(
        L, params=rng.integers(1, 100, L), saved=rng.integers(1, 60, L),
        boundary=rng.integers(1, 10, L + 1),
    )  # fmt: skip
    times = rng.uniform(0.5, 2.0, L)
    shape = StageShape(occupancy=(occ(0, 2),), optimizer_slots=1)
    budget = int(MemoryModel(chain).total(0, L, shape)[0]) // 2
    specs = [StageSpec(1.0, budget, shape)] * K
    want = _Prober(times, MemoryModel(chain), specs).probe(float(times.sum()) / 2)
    assert want is not None
    narrow = _Prober(times, MemoryModel(chain), specs, cap_bound=float(times.sum()) / 2)
    narrow._window = [(first, first) for first, _ in narrow._window]  # type: ignore[union-attr]
    narrow._wide = narrow._window
    assert narrow.probe(float(times.sum()) / 2) == want and narrow._window is None
    # memory's guess short (end_guess): the windows time alone gives, not the full tables
    short = _Prober(times, MemoryModel(chain), specs, cap_bound=float(times.sum()) / 2)
    wide = short._wide
    short._window = [(first, first) for first, _ in short._window]  # type: ignore[union-attr]
    loads = short._loads
    assert short.probe(float(times.sum()) / 2) == want and short._window == wide
    assert short._loads == loads + 1
    low = _Prober(times, MemoryModel(chain), specs, cap_bound=float(times.sum()) / 8)
    assert low.probe(float(times.sum()) / 2) == want and low._cap is None


def test_cpsat_counts_a_tight_pulled_gradient_beside_a_recomputed_forward_in_full():
    """Found by the brute-force comparison: B's tight pulled gradient (pulled_paired) is its
    whole less the larger of its own and the re-materialising forward's transients; CP-SAT
    once left those transients free to rise, which lowered the pulled gradient of the tuple
    holding the forward's, and took the first stage 1 byte over its budget. (The forward's
    tuple alone is no B's: the pulled gradient is then the largest, `pulled`.)"""
    from planner.cpsat import solve_partition_cpsat
    from planner.memory import pulled_with

    chain = make_chain(
        5, forward=np.ones(5), backward=np.array([0.0, 0.0, 1.0, 0.0, 4.0]),
        params=np.array([0, 0, 23, 17, 21]), buffers=np.array([0, 1, 5, 2, 2]),
        saved=np.array([0, 0, 0, 0, 21]), input_saved=np.array([1, 0, 0, 1, 1]),
        forward_transient=np.array([0, 0, 0, 1, 1]), backward_transient=np.array([0, 0, 3, 0, 4]),
        input_unsaved=np.array([3, 0, 0, 0, 0]), forward_peak=np.array([0, 0, 2, 18, 0]),
        zgrad=np.array([0, 2, 0, 0, 0]), grad_in=np.array([0, 1, 1, 1, 1]),
    )  # fmt: skip
    both = (running_on([0, 1, 0, 0, 0, 1], 6), running_on([0, 1, 0, 0, 0, 1], 1))
    assert pulled_with(both[:1]) == "pulled"
    first = StageShape(occupancy=both, optimizer_slots=0)
    assert pulled_with(first.occupancy) == "pulled_paired"
    rest = [
        StageSpec(0.5, 52, StageShape(occupancy=(running_on([0, 1, 0, 0, 0, 0], 1),),
                                      optimizer_slots=0)),
        StageSpec(0.5, 44, StageShape(occupancy=(running_on([0] * 6, 0),), optimizer_slots=0)),
    ]  # fmt: skip
    times = chain.forward + chain.backward
    # the only split the later stages allow puts layers 0-2 on the first: 55 bytes
    assert reference_memory(chain, 0, 3, first) == 55
    for budget in (54, 55):
        specs = [StageSpec(0.5, budget, first), *rest]
        part = solve_partition_cpsat(times, MemoryModel(chain), specs)
        assert brute_force(times, chain, specs) == (math.inf if budget == 54 else 10.0)
        assert (part is None) == (budget == 54)


@settings(max_examples=150, deadline=None)
@given(problems(), st.floats(0.5, 1.6))
def test_a_memory_split_whose_weights_cannot_fit_is_decided_before_the_memory_model(problem, tight):
    """Budgets about the weights' share (gradients, optimizer slots, buffers, reserved): where
    the stages from some point on cannot hold the rest's weights, memory_split says so before
    it asks the memory model there, and its answer is brute force's either way."""
    from planner import partition
    from planner.partition import memory_split

    chain, specs, _ = problem
    L, K = len(chain.forward), len(specs)
    memory = MemoryModel(chain)
    specs = [
        dataclasses.replace(
            sp,
            budget=int(tight * int(memory.static_of(np.array([0]), np.array([L]),
                                                     sp.shape.optimizer_slots)[0]) / K)
            + sp.shape.reserved,
        )
        for sp in specs
    ]  # fmt: skip
    splits = [[0, *inner, L] for inner in itertools.combinations(range(1, L), K - 1)]
    fitting = [b for b in splits if _fits_somehow(chain, specs, b)]
    asked: list[int] = []
    reach = partition._reach

    def counted(*a, **k):
        asked.append(1)
        return reach(*a, **k)

    kept, partition._reach = partition._reach, counted
    try:
        decided, bounds = memory_split(memory, specs, L)
    finally:
        partition._reach = kept
    least = partition._weights_need(memory, specs, L)

    # By hand and by brute force: whether some split (stages may be empty) holds every stage's
    # weights, gradients, optimizer slots, buffers and reserved bytes in its budget under one
    # of its options. Where none does, no memory model is asked.
    def weights(i, j, shape):
        g = chain.params if chain.trainable is None else chain.trainable
        p, g, b = chain.params[i:j], g[i:j], chain.buffers[i:j]
        return int((p + (1 + shape.optimizer_slots) * g + b).sum()) + shape.reserved

    some = any(
        all(
            min(weights(i, j, sh) for sh in sp.shapes) <= sp.budget
            for sp, i, j in zip(specs, (0, *inner), (*inner, L))
        )
        for inner in itertools.combinations_with_replacement(range(L + 1), K - 1)
    )
    assert (least[0] > 0) == (not some)
    if not some:  # the whole chain's weights do not fit the stages: no memory model asked
        assert (decided, bounds, asked) == (True, None, [])
    if decided:
        assert (bounds is None) == (fitting == [])
        if bounds is not None:
            assert all(b[s] >= least[s] for b in [bounds] for s in range(K))


@settings(max_examples=40, deadline=None)
@given(problems())
def test_the_guess_of_memorys_end_is_never_below_the_last_end_that_fits(problem):
    """end_guess, on drawn shapes and those of real schedules (which count transients and
    tight pulled gradients that come out below zero): at least max_end from every start."""
    chain, specs, _ = problem
    memory = MemoryModel(chain)
    for spec in specs:
        for shape in [spec.shape, *_real_shapes()]:
            _guess_at_least_the_end(memory, shape, spec.budget)


def _guess_at_least_the_end(memory: MemoryModel, shape: StageShape, budget: int) -> None:
    ends = memory.max_end(shape, budget)
    guess = [memory.end_guess(shape, budget, i) for i in range(memory.chain.num_layers)]
    assert (np.array(guess) >= ends).all(), (shape.occupancy, guess, ends.tolist())


def test_the_guess_leaves_out_what_zero_bubble_keeps_between_i_and_w():
    """Found by a review: on a first stage that borrows its input and holds the loss, what
    zero bubble keeps between I and W comes out below zero (its input's saved part is the
    caller's); a guess that counted the tuple beside the activations fell 1 layer short."""
    chain = make_chain(
        3, forward=np.ones(3), params=np.array([5, 5, 0]), saved=np.array([0, 0, 100]),
        loss_saved=np.array([0, 0, 100]), input_saved=np.array([20, 0, 0]),
        boundary=np.array([20, 1, 1, 1]), borrowed_input=True, num_model_layers=2,
    )  # fmt: skip
    shape = StageShape(occupancy=(occ(0, 1, 0, 1),), optimizer_slots=1)
    memory = MemoryModel(chain)
    assert memory.max_end(shape, 90).tolist() == [3, 2, 2]
    _guess_at_least_the_end(memory, shape, 90)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("guess", ["short", "none", "own"])
def test_a_guess_of_memorys_end_that_falls_short_changes_no_split(seed, guess):
    """The windows the guess narrows are widened where a probe reaches past them: a guess
    that says nothing fits beyond the start, one that says nothing, and the model's own give
    the optimum the DP finds, where memory binds, on chains long enough for windows to matter."""
    rng = np.random.default_rng(seed)
    L, K = 150, 6
    chain = make_chain(
        L, forward=rng.uniform(0.5, 2.0, L), backward=rng.uniform(1.0, 4.0, L),
        params=rng.integers(1, 100, L), saved=rng.integers(1, 80, L),
        backward_transient=rng.integers(0, 20, L), boundary=rng.integers(1, 10, L + 1),
    )  # fmt: skip
    times = chain.forward + chain.backward
    shapes = [StageShape(occupancy=(occ(0, K - s),), optimizer_slots=1) for s in range(K)]
    # and a second option, slower and lighter (as recomputation is): its tables searched only
    # as far as its own time reaches
    light = [StageShape(occupancy=(occ(0, 1),), optimizer_slots=1) for _ in range(K)]
    budget = int(MemoryModel(chain).total(0, L, shapes[0])[0]) // 7
    specs = [StageSpec(1.0, budget, sh, more=(lighter,)) for sh, lighter in zip(shapes, light)]
    times = np.stack([times, times + 0.6 * chain.forward])
    said = {
        "short": lambda self, shape, budget, start: start,
        "none": lambda self, shape, budget, start: L,
        "own": MemoryModel.end_guess,
    }[guess]
    loads = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(MemoryModel, "end_guess", said)
        load = _Prober._load_tables
        widened = lambda p: p._window is None or p._window is p._wide  # noqa: E731
        narrower = lambda p: p._window is not None and p._window != p._wide  # noqa: E731
        m.setattr(_Prober, "_load_tables",
                  lambda p: loads.append((widened(p), narrower(p))) or load(p))  # fmt: skip
        part = solve_partition(times, MemoryModel(chain), specs)
    dp = solve_partition_dp(times, MemoryModel(chain), specs)
    assert part is not None and dp is not None
    assert (part.bounds, part.bottleneck, part.choices) == (dp.bounds, dp.bottleneck, dp.choices)
    free = [dataclasses.replace(sp, budget=10**12) for sp in specs]
    assert part.bottleneck > solve_partition(times, MemoryModel(chain), free).bottleneck
    assert any(w for w, _ in loads) == (guess == "short")  # (which widened the windows)
    if guess == "own":
        assert any(n for _, n in loads)  # (a window narrowed by the guess)


@settings(max_examples=40, deadline=None)
@given(problems(), st.data())
def test_stages_bytes_together_are_each_stages_own(problem, data):
    """stages_bytes (a chain's stages worked out together, as the search checks an
    interleaved split's devices) against stage_bytes of each, on drawn and real shapes."""
    chain = problem[0]
    L = chain.num_layers
    if L > 1 and data.draw(st.booleans()):  # a parameter two layers share (tied embeddings)
        a, b = sorted(data.draw(st.lists(st.integers(0, L - 1), min_size=2, max_size=2,
                                         unique=True)))  # fmt: skip
        nbytes = data.draw(st.integers(1, 50))
        params = chain.params.copy()
        params[[a, b]] += nbytes  # (each user's params include it, as a profile's do)
        chain = dataclasses.replace(
            chain, params=params, tied=((nbytes, (a, b)),),
            copies_keep_state=data.draw(st.booleans()),
        )  # fmt: skip
    memory = MemoryModel(chain)
    shapes = [
        dataclasses.replace(sh, optimizer_step=data.draw(st.sampled_from([0.0, 0.5, 2.0])),
                            foreach=data.draw(st.booleans()), reserved=data.draw(st.integers(0, 9)))
        for sh in [*(spec.shape for spec in problem[1]), *_real_shapes()[:6]]
    ]  # fmt: skip
    i = np.array([data.draw(st.integers(0, L - 1)) for _ in shapes])
    j = np.array([data.draw(st.integers(a + 1, L)) for a in i])
    together = memory.stages_bytes(i, j, shapes)
    assert together == [memory.stage_bytes(a, b, sh) for a, b, sh in zip(i, j, shapes)]


def test_a_tied_parameters_optimizer_state_is_on_its_first_stage_alone():
    """Layers 0 and 4 of 6 share a 100-byte parameter; Adam-like (2 slots). Stage [0, 3) holds
    its weight, gradient and optimizer state: 2 x 103 + 2 x 103 = 412 bytes. Stage [3, 6)
    holds its weight and gradient, but not its optimizer state, which the first stage keeps:
    2 x 103 + 2 x 3 = 212 (the streams program; torchrun keeps it on both: 412)."""
    p = np.ones(6, dtype=np.int64)
    p[[0, 4]] += 100
    shape = StageShape(occupancy=(occ(),), optimizer_slots=2)
    for keep, second in ((False, 212), (True, 412)):
        chain = dataclasses.replace(
            unit_chain(list(p)), tied=((100, (0, 4)),), copies_keep_state=keep
        )
        memory = MemoryModel(chain)
        i, j = np.array([0, 3]), np.array([3, 6])
        together = memory.stages_bytes(i, j, [shape, shape])
        alone = [memory.stage_bytes(0, 3, shape), memory.stage_bytes(3, 6, shape)]
        assert [b.static for b in together] == [b.static for b in alone] == [412, second]


def test_an_optimizer_step_is_charged_for_what_the_tensor_before_still_holds():
    """A one-tensor-at-a-time step (CPU Adam) still holds the tensor before's denominator
    while the next is stepped: step_size is the most of t + carry x (the one before) over the
    stage's tensors in order, the first with none before it (also where the stage begins
    with a layer without parameters): a walk of each stage's tensors, on every stage."""
    tensors = ((8, 2), (8,), (), (4, 4), (6,))
    chain = dataclasses.replace(
        unit_chain([sum(t) for t in tensors]), param_tensors=tensors, step_carry=0.5,
        largest_param=np.array([max(t, default=0) for t in tensors]),
    )  # fmt: skip
    memory = MemoryModel(chain)

    def walked(i: int, j: int) -> int:
        order = [t for layer in tensors[i:j] for t in layer]
        return max([0, *(t + (0.5 * p if k else 0) for k, (p, t) in
                         enumerate(zip([0, *order], order)))])  # fmt: skip

    pairs = [(i, j) for i in range(5) for j in range(i + 1, 6)]
    got = memory.step_size(np.array([i for i, _ in pairs]), np.array([j for _, j in pairs]))
    assert got.tolist() == [walked(i, j) for i, j in pairs]
    assert int(memory.step_size(np.array([0]), np.array([5]))[0]) == 9  # 8 after its bias 2
    # without a carry (or the tensors), the largest, as before
    plain = MemoryModel(dataclasses.replace(chain, step_carry=0.0))
    assert plain.step_size(np.array([0]), np.array([5])).tolist() == [8]
    shape = StageShape(occupancy=(occ(),), optimizer_slots=2, optimizer_step=2.0)
    assert memory.stage_bytes(0, 5, shape).optimizer_step == 18  # ceil(2.0 x 9)
    assert memory.stages_bytes(np.array([0]), np.array([5]), [shape])[0].optimizer_step == 18
    assert int(memory.optimizer_step(0, 5, shape)[0]) == 18


def test_a_devices_second_stage_is_stepped_beside_the_carry_of_its_first():
    """An interleaved device's optimizer steps its first stage's tensors, then its second
    stage's: the second's first tensor is stepped while the first stage's last still holds
    its carry. Found by measuring (LayerNorm, Linear | Linear, LayerNorm on one device: 10%
    over its plan). Each device's step is the walk of its stages' tensors in order, to the byte
    that rounding each stage's ends up may add; with multi-tensor kernels, every stage's at
    once."""
    from schedules.memory import device_step

    tensors = ((8, 2), (8,), (), (4, 4), (6,), (2, 9))
    chain = dataclasses.replace(
        unit_chain([sum(t) for t in tensors]), param_tensors=tensors, step_carry=0.5,
        largest_param=np.array([max(t, default=0) for t in tensors]),
    )  # fmt: skip
    memory = MemoryModel(chain)
    shape = StageShape(occupancy=(occ(),), optimizer_slots=2, optimizer_step=1.5)

    def walked(stages: list[tuple[int, int]]) -> int:
        order = [t for i, j in stages for layer in tensors[i:j] for t in layer]
        return max([0, *(math.ceil(1.5 * (t + (math.ceil(0.5 * p) if k else 0))) for k, (p, t)
                         in enumerate(zip([0, *order], order)))])  # fmt: skip

    # every split into four stages, two per device (stages d and d + 2 on device d)
    for cuts in itertools.combinations(range(1, 6), 3):
        b = [0, *cuts, 6]
        stages = list(itertools.pairwise(b))
        sizes = memory.stages_bytes(np.array(b[:-1]), np.array(b[1:]), [shape] * 4)
        alone = [memory.stage_bytes(i, j, shape) for i, j in stages]
        assert sizes == alone
        for d in range(2):
            got = device_step([sizes[d], sizes[d + 2]])
            assert (
                walked([stages[d], stages[d + 2]]) <= got <= walked([stages[d], stages[d + 2]]) + 1
            )
    # stage (0, 1) ends with its bias 2, stage (1, 3) begins with 8: 8 + 0.5 x 2 = 9, x 1.5
    first, second = memory.stage_bytes(0, 1, shape), memory.stage_bytes(1, 3, shape)
    assert (first.step_tail, second.step_head) == (2, 12)
    assert device_step([first, second]) == 14 >= max(first.optimizer_step, second.optimizer_step)
    # a stage with no tensors between them carries nothing over
    empty = memory.stage_bytes(2, 3, shape)
    assert (empty.step_head, empty.step_tail) == (0, 0)
    assert device_step([first, empty, second]) == 14
    # without a carry nothing crosses; multi-tensor kernels: all at once
    assert device_step([dataclasses.replace(first, step_tail=0), second]) == 12
    assert device_step([dataclasses.replace(x, foreach=True) for x in (first, second)]) == (
        first.optimizer_step + second.optimizer_step
    )


def _lighter_twins(specs: list[StageSpec]) -> list[StageSpec]:
    """Each stage with a second option: its occupancy one micro-batch lighter (at a cost the
    caller's table gives)."""
    return [
        StageSpec(sp.speed, sp.budget, sp.shape, (dataclasses.replace(
            sp.shape, occupancy=tuple(lighter_by(t, 1) for t in sp.shape.occupancy)),))
        for sp in specs
    ]  # fmt: skip


def test_a_hint_leaves_memory_free_as_it_was():
    """A random draw's counterexample to the test below: memory lowered some stage's end from a
    start no split within the bound reaches the end from (the tables searched further, as a
    hint's first probe below the optimum makes them), and `memory_free` said 0 where the solve
    without the hint said 1. Only starts whose stages may reach the end on time alone count."""
    L = 10
    saved = np.zeros(L, dtype=np.int64)
    saved[7], saved[9] = 4, 1
    chain = make_chain(L, forward=np.ones(L), saved=saved, loss_saved=(np.arange(L) == 9) * 1,
                       grad_in=(np.arange(L) > 0) * 1, num_model_layers=9)  # fmt: skip
    none = StageShape(occupancy=(occ(),), optimizer_slots=0)
    w = StageShape(occupancy=(occ(), occ(), occ(0, 0, 0, 1)), optimizer_slots=0)
    specs = [StageSpec(0.5, 0, none), StageSpec(0.5, 0, none), StageSpec(2.0, 0, none),
             StageSpec(0.5, 1, w)]  # fmt: skip
    cuts = [np.zeros(L + 1), np.zeros(L + 1), np.where(np.arange(L + 1) == 9, math.inf, 0.0)]
    table = np.stack([chain.forward * r for r in (1.0, 1.25)])
    options = _lighter_twins(specs)
    memory = MemoryModel(chain)
    plain = solve_partition(table, memory, options, cuts)
    assert plain.bounds == [0, 1, 2, 8, 10] and plain.extra["memory_free"] == 1.0
    hinted = solve_partition(table, memory, options, cuts, hint=plain.bottleneck * 0.999)
    assert (hinted.bounds, hinted.extra) == (plain.bounds, plain.extra)
    assert brute_force(chain.forward, chain, specs, cuts) == plain.bottleneck


@settings(max_examples=80, deadline=None)
@given(problems(), st.data())
def test_a_hint_or_free_only_changes_no_split(problem, data):
    """`hint` (a bottleneck one option's split meets: the search passes a per-stage candidate
    its single-mode twins') only starts the probes lower: the split, its bottleneck, choices
    and `memory_free` are the solve's without it, also from a hint below the optimum (which no
    split meets: the ladder goes on to the limit). `free_only` returns that same split or
    None, and None only where the split is not memory free or memory lowered an end in the
    first probe (above the optimum: a miss, never a wrong split)."""
    chain, specs, cuts = problem
    ratio = data.draw(st.sampled_from([1.25, 1.5]))
    table = np.stack([(chain.forward + chain.backward) * r for r in (1.0, ratio)])
    options = _lighter_twins(specs)
    memory = MemoryModel(chain)
    plain = solve_partition(table, memory, options, cuts)
    one = solve_partition(table[:1], memory, specs, cuts)  # option 0 alone: a valid hint
    hints = [one.bottleneck] if one is not None else []
    if plain is not None:
        hints.append(plain.bottleneck * data.draw(st.sampled_from([0.5, 0.999, 1.0])))

    def same(a, b) -> bool:
        return (a is None and b is None) or (
            a is not None and b is not None and (a.bounds, a.bottleneck, a.choices, a.extra)
            == (b.bounds, b.bottleneck, b.choices, b.extra)
        )  # fmt: skip

    for hint in hints:
        assert same(solve_partition(table, memory, options, cuts, hint=hint), plain), hint
    free = solve_partition(table, memory, options, cuts, free_only=True)
    assert free is None or same(free, plain)
    if plain is None or plain.extra["memory_free"] != 1.0:
        assert free is None or free.extra["memory_free"] != 1.0


def test_free_only_gives_up_at_once_where_memory_binds():
    """Where memory lowers a stage's end the caller (the search's first solve, with the bound
    on each stage's occupancy) has no use for the split: None after one probe, where the solve
    takes several; where memory does not bind, the split."""
    L = 12
    chain = make_chain(L, forward=np.ones(L), backward=np.ones(L),
                       params=np.full(L, 10, dtype=np.int64), saved=np.ones(L, dtype=np.int64))  # fmt: skip
    memory = MemoryModel(chain)
    times = chain.forward + chain.backward
    shape = StageShape(occupancy=(occ(0, 2),), optimizer_slots=1)
    roomy = [StageSpec(1.0, 10**12, shape) for _ in range(3)]
    part = solve_partition(times, memory, roomy)
    assert part.bounds == [0, 4, 8, 12] and part.extra["memory_free"] == 1.0
    assert solve_partition(times, memory, roomy, free_only=True).bounds == part.bounds
    # the middle stage's device holds 3 layers: the first stage then needs 5
    need = reference_memory(chain, 0, 4, shape)
    tight = [StageSpec(1.0, 10**12, shape), StageSpec(1.0, need - 1, shape),
             StageSpec(1.0, 10**12, shape)]  # fmt: skip
    bound = solve_partition(times, memory, tight)
    assert bound is not None and bound.bottleneck == 10.0 and bound.probes > 1
    assert bound.extra["memory_free"] == 0.0
    assert solve_partition(times, memory, tight, free_only=True) is None
