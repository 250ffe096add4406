"""The same partition problem as an integer program, solved by OR-tools CP-SAT.

An independent second solver: it cross-checks the probe in the tests and, for `--solver cp-sat`,
re-solves the chosen candidate and reports CP-SAT's own lower bound and gap. Layer k goes to
stage stage_of[k], which starts at 0, ends at S - 1 and steps by 0 or 1 (contiguous, none empty).
With x[k][s] = (stage_of[k] == s) and first[k][s] = "k opens stage s", every quantity of the
memory model (planner/memory.py) is linear, e.g.

    X_s = sum_k boundary[k] first[k][s]      S_s = sum_k saved[k] x[k][s]
                                                   - sum_k shared[k] (x[k][s] - first[k][s])
    later_s[k] = sum_{k' > k} saved[k'] x[k'][s] - shared[k'] (x[k'][s] - first[k'][s])
    remat_s >= fwd[k] first[k][s] + (fwd + unsaved)[k] (x[k][s] - first[k][s]) - later_s[k]
    live_s >= remat_s,  bwd[k] (x[k][s] + x[k+1][s] - 1) - later_s[k],
              (bwd - zgrad)[k] (k ends stage s)                                 for every k

and the stage fits when, for each occupancy tuple, weights + sum of counts x state bytes + its
transient + reserved <= budget, and weights + the optimizer step's temporaries + reserved too.

With cuts, first[k][s] (s >= 1) also places the link between stages s - 1 and s at boundary k:

    bottleneck >= cuts[s - 1][k] first[k][s],    first[k][s] = 0 where cuts[s - 1][k] is inf

Times and cuts are scaled to integers (nanoseconds; coarser only where int64 would overflow) and speeds to thousandths, so the optimum is
exact for the scaled costs; the reported bottleneck is recomputed in floating point from the split.
Imported only when CP-SAT runs: ortools is a heavy import.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from profiler.limits import INT64_SAFE

from .costs import Chain
from .memory import MemoryModel, pulled_with
from .partition import Partition, StageSpec, cut_table, split_cuts, stage_costs

TIME_SCALE = 1e6  # ms -> ns
SPEED_SCALE = 1000  # speeds in thousandths of the slowest stage's, at least


def _suffix(m: object, terms: list, name: str, top: int) -> list:
    """after[k] = terms[k + 1] + ... + terms[L - 1], as integer variables (O(L) constraints)."""
    after = [0] * len(terms)
    for k in range(len(terms) - 2, -1, -1):
        var = m.new_int_var(0, max(top, 0), f"{name}{k}")  # type: ignore[attr-defined]
        m.add(var == after[k + 1] + terms[k + 1])  # type: ignore[attr-defined]
        after[k] = var
    return after


def _transients(m: object, c: Chain, x: list, first: list, s: int, L: int) -> tuple:
    """live_s, remat_s and input_s, layer by layer as the model walks them: a forward's layer
    k on top of what the stage's layers before it saved (the full activations less later[k],
    what its layers after k save); a backward's layer k after those have let theirs go (the
    stage's last layer without the output gradient it pulls); zero bubble's I at layer k
    before the output gradients of its layers before k - 1 are made (early[k]). A layer
    outside the stage gives a bound of at most 0."""
    f, b, u, z, it = (c.forward_transient, c.backward_transient, c.input_unsaved, c.zgrad,
                      c.input_grad_transient)  # fmt: skip
    ib, sc = _inner(c)
    inner = [x[k][s] - first[k][s] for k in range(L)]
    own = [int(c.saved[k]) * x[k][s] - int(c.shared[k]) * inner[k] for k in range(L)]
    later = _suffix(m, own, f"later{s}_", int(c.saved.sum()))
    made = [int(z[k]) * x[k][s] for k in range(L)]
    grad_in = sum(int(c.grad_in[k]) * first[k][s] for k in range(L))  # (the stage's input's)
    before = [0] * L  # sum of made[0 .. k - 2]
    for k in range(2, L):
        var = m.new_int_var(0, int(z.sum()), f"early{s}_{k}")  # type: ignore[attr-defined]
        m.add(var == before[k - 1] + made[k - 2])  # type: ignore[attr-defined]
        before[k] = var
    wz = (z - c.kept_grad).astype(np.int64)  # the output gradients I lets go

    def top(*arrays: np.ndarray) -> int:
        return int(max(max(a.max() for a in arrays), 0))

    remat = m.new_int_var(0, top(f, f + u), f"remat{s}")  # type: ignore[attr-defined]
    # (an inner layer's figure, from another gradient layout, may pass the last layer's; the
    # loss's scalar gradient comes on top of it: a bound of b alone made the model infeasible
    # where the split fits, found by a review)
    live = m.new_int_var(0, top(b, ib + sc), f"live{s}")  # type: ignore[attr-defined]
    inp = m.new_int_var(0, top(it) + int(z.sum()), f"input{s}")  # type: ignore[attr-defined]
    # a recomputed B's forward, re-run by hand at its start: as remat (the stage's whole
    # forward; kept apart for _tight_pulled's sign)
    st = f
    stop = m.new_int_var(0, top(f, f + u), f"stop{s}")  # type: ignore[attr-defined]
    # live and stop are exactly the largest of their bounds (each at most 0 where it does not
    # apply: `off` takes a condition's bound below 0): a tight pulled gradient counts them
    # with a minus sign (_tight_pulled), where a solver free to raise them would undercount
    off = top(f, f + u, st, st + u) + 1
    # an inner layer's backward is one only where the stage goes on past the layers after it
    # whose input gradient is a view of their output's (MemoryModel._backward_live): past[k]
    g = c.grad_views
    past = [next((r for r in range(k + 1, L) if not g[r]), L) for k in range(L)]
    lives, stops = [0], [0]
    for k in range(L):
        whole_k = int(f[k]) * first[k][s] + int(f[k] + u[k]) * inner[k] - later[k]
        m.add(remat >= whole_k)  # type: ignore[attr-defined]
        if k + 1 < L:  # k + 1 in the stage: k runs whole
            stops.append(whole_k - off * (1 - x[k + 1][s]))
        # layer k ends the stage when k + 1 is not in it (or k is the last layer)
        ends = x[k][s] - (x[k + 1][s] if k + 1 < L else 0)
        stops.append(int(st[k]) * first[k][s] + int(st[k] + u[k]) * inner[k] - off * (1 - ends))
        # (an inner layer's I runs before the stage's input gradient, which during_i counts,
        # is made: the first layer's I makes it last, as the memory model counts it)
        if not wz.any() and not c.hands_grad_on.any():
            m.add(inp >= int(it[k]) * first[k][s])  # type: ignore[attr-defined]
            m.add(inp >= int(it[k]) * inner[k] - before[k] - grad_in)  # type: ignore[attr-defined]
        # (as if k ended it, though a later layer does: the most over shorter ends too, as the
        # model's, whose totals grow with the end)
        lives.append(int(max(b[k] - z[k], 0)) * x[k][s] - later[k])
        if past[k] < L:  # an inner layer's, its output gradient autograd's alone
            on = x[past[k]][s] + x[k][s] - 1
            lives.append(int(ib[k]) * on - later[k])
            if sc:  # (on the loss's stage: its scalar gradient beside it)
                lives.append(int(ib[k] + sc) * (on + x[L - 1][s] - 1) - later[k])
    if wz.any() or c.hands_grad_on.any():
        _let_go_input(m, c, x, first, s, L, inp, grad_in)
    m.add_max_equality(live, lives)  # type: ignore[attr-defined]
    m.add_max_equality(stop, stops)  # type: ignore[attr-defined]
    return live, remat, inp, later, stop


def _let_go_input(
    m: object, c: Chain, x: list, first: list, s: int, L: int, inp: object, grad_in: object
) -> None:
    """Zero bubble's I where it lets gradients go or layers hand their input on (memory.py's
    _let_go_input_live): the most over the stage's ends e <= j of I's transient with Z[i, e),
    less Z[i, j). With KP the kept gradients' prefix sums, wz those let go, f[l] = it[l] +
    wz[l], a[l] = f[l] + wz[made[l]] - KP[made[l]] (made[l]: the last layer before l that
    does not hand its gradient on: Chain.hands_grad_on) and b[m] = wz[m] + KP[m + 1] (0 where
    m hands it on), per end e = m + 1 and layer l, where `lead` says every layer from the
    stage's first to l - 1 hands its gradient on (the first layer's is always so):
        lead l = m:        it[l] + zgrad[l]          - Z
        lead l < m:        f[l] - KP[i] + b[m]       - Z
        other l = m:       a[m] + KP[m + 1] - G      - Z
        other l < m:       a[l] + b[m] - G           - Z
    the pairs through running maxima of f and a over the stage's layers before m."""
    it = c.input_grad_transient.astype(np.int64)
    kept = c.kept_grad.astype(np.int64)
    through = c.hands_grad_on  # (those make no gradient: Chain.let_go_grad)
    zg = np.where(through, kept, c.zgrad).astype(np.int64)
    wz = c.let_go_grad.astype(np.int64)
    kp = np.concatenate([[0], np.cumsum(kept)])
    made = c.gradient_made
    f = it + wz
    a = np.array([f[k] + (wz[made[k]] - kp[made[k]] if made[k] >= 0 else 0) for k in range(L)])
    b = np.where(through, 0, wz + kp[1:])
    Z = sum(int(kept[k]) * x[k][s] for k in range(L) if kept[k])
    KPi = sum(int(kp[k]) * first[k][s] for k in range(1, L) if kp[k])
    top_f = int(max(f.max(), 0))
    top_a = int(max(a.max(), 0))
    low_a = -(int(abs(a).max()) + int(b.max()) + 1)
    lead: list = []  # per layer: in the stage, every layer before it there hands on
    best_f: object = None  # the most f[l] over the stage's lead layers before m (0: none)
    best_a: object = None  # the most a[l] over its other layers before m (or `low_a`)
    for k in range(L):
        if k == 0 or not through[k - 1]:
            lead_k = first[k][s]
        else:
            lead_k = m.new_bool_var(f"lead{s}_{k}")  # type: ignore[attr-defined]
            m.add(lead_k <= x[k][s])  # type: ignore[attr-defined]
            m.add(lead_k >= first[k][s])  # type: ignore[attr-defined]
            m.add(lead_k <= first[k][s] + lead[k - 1])  # type: ignore[attr-defined]
            m.add(lead_k >= lead[k - 1] + x[k][s] - 1)  # type: ignore[attr-defined]
        lead.append(lead_k)
        other = x[k][s] - lead_k
        m.add(inp >= int(it[k] + zg[k]) * lead_k - Z)  # type: ignore[attr-defined]
        m.add(inp >= int(a[k] + kp[k + 1]) * other - grad_in - Z)  # type: ignore[attr-defined]
        off = 1 - x[k][s]
        if best_f is not None:
            m.add(inp >= best_f - KPi + int(b[k]) * x[k][s] - Z - top_f * off)  # type: ignore[attr-defined]
        if best_a is not None:
            m.add(inp >= best_a + int(b[k]) * other - grad_in - Z  # type: ignore[attr-defined]
                  - top_a * (1 - other))  # fmt: skip
        if k + 1 < L:
            var = m.new_int_var(0, top_f, f"bestf{s}_{k}")  # type: ignore[attr-defined]
            m.add(var >= int(f[k]) * lead_k)  # type: ignore[attr-defined]
            if best_f is not None:
                m.add(var >= best_f)  # type: ignore[attr-defined]
            best_f = var
            var = m.new_int_var(low_a, top_a, f"besta{s}_{k}")  # type: ignore[attr-defined]
            m.add(var >= int(a[k]) - (top_a - low_a) * (1 - other))  # type: ignore[attr-defined]
            if best_a is not None:
                m.add(var >= best_a)  # type: ignore[attr-defined]
            best_a = var


def _input_saved(
    m: object, c: Chain, x: list, first: list, s: int, L: int, model_only: bool = False
) -> list:
    """Per layer k, the part of stage s's input its layers save where k opens it (0 where k
    does not): k's own, or through the layers after it that only make views (Chain.views), the
    most any of them or the first past them saves, as far as the stage reaches (each step up,
    where layer q is in the stage too: `reach` at most both, the solver free to raise it).
    `model_only`: the loss past the views left out (MemoryModel.input_saved)."""
    cap = np.maximum(c.input_saved - c.shared, 0).astype(np.int64)  # (MemoryModel._alias_saved)
    end = min(L, c.num_model_layers) if model_only else L
    out = []
    for k in range(L):
        most = int(min(c.input_saved[k], c.boundary[k]))
        terms = [most * first[k][s]]
        q = k
        while c.views is not None and c.views[q] and q + 1 < end:
            q += 1
            gain = int(min(cap[q], c.boundary[k])) - most
            if gain > 0:
                reach = m.new_bool_var(f"xs{s}_{k}_{q}{'w' if model_only else ''}")  # type: ignore[attr-defined]
                m.add_implication(reach, first[k][s])  # type: ignore[attr-defined]
                m.add_implication(reach, x[q][s])  # type: ignore[attr-defined]
                terms.append(gain * reach)
                most += gain
        out.append(sum(terms))
    return out


def _inner(c: Chain) -> tuple[np.ndarray, int]:
    """Each layer's backward inside a stage, its output gradient autograd's alone, and the
    loss's scalar gradient beside the inner layers of its stage (MemoryModel._inner_backward,
    _loss_grad)."""
    b = c.backward_transient.astype(np.int64)
    if c.inner_backward is None:
        return b, 0
    sc = int(c.boundary[-1]) if c.has_loss else 0
    return c.inner_backward.astype(np.int64), sc


def _tight_pulled(m: object, c: Chain, x: list, first: list, s: int, L: int, S: object,
                  later: list, live: object, remat: object | None) -> object:  # fmt: skip
    """The pulled gradient of a stage whose every tuple holding one is B's (planner/memory.py,
    pulled_with): what makes B's whole, S + pulled + its transient, the most any stage from
    the same start and ending at a layer k of this one holds so. Such a stage's B holds what
    its layers through k saved, then k's output gradient and the largest backward of a layer
    before k (those through it saved, and its transient), or k's own backward. `remat`: B
    re-materialises too (its transient is the larger of live and stop, the stage's forward),
    and holds a layer l's whole forward peak (the first layer's without its input) beside the
    output gradient of a later layer, or k's beside its own."""
    b, z, f, u = c.backward_transient, c.zgrad, c.forward_transient, c.input_unsaved
    st = f  # (B re-materialises the stage's whole forward)
    ib, sc = _inner(c)
    most = int(max(b.max(), ib.max() + sc))  # (an inner layer's figure may pass b: _inner)
    top = int(c.saved.sum()) + int(np.maximum(b, f + u).max()) + 2 * int(z.max()) + most + sc + 1
    whole = m.new_int_var(0, top, f"bwhole{s}")  # type: ignore[attr-defined]
    before = forward = None  # the largest backward before k, forward up to k, in the stage
    for k in range(L):
        upto = S - later[k]  # what the stage's layers through k save
        m.add(whole >= upto + int(max(b[k], z[k]))).only_enforce_if(x[k][s])  # type: ignore[attr-defined]
        inner = [x[k][s], first[k][s].Not()]  # k - 1 is in the stage too
        if remat is not None:
            m.add(whole >= upto + int(st[k] + z[k])).only_enforce_if([x[k][s], first[k][s]])  # type: ignore[attr-defined]
            m.add(whole >= upto + int(st[k] + u[k] + z[k])).only_enforce_if(inner)  # type: ignore[attr-defined]
            if forward is not None:
                m.add(whole >= forward + int(z[k])).only_enforce_if(inner)  # type: ignore[attr-defined]
            var = m.new_int_var(0, top, f"fwd{s}_{k}")  # type: ignore[attr-defined]
            m.add(var >= upto + int(f[k])).only_enforce_if(first[k][s])  # type: ignore[attr-defined]
            m.add(var >= upto + int(f[k] + u[k])).only_enforce_if(inner)  # type: ignore[attr-defined]
            if forward is not None:
                m.add(var >= forward).only_enforce_if(inner)  # type: ignore[attr-defined]
            forward = var
        if k == 0:
            continue
        var = m.new_int_var(0, top, f"bwd{s}_{k}")  # type: ignore[attr-defined]
        m.add(var >= S - later[k - 1] + int(ib[k - 1])).only_enforce_if(inner)  # type: ignore[attr-defined]
        if before is not None:
            m.add(var >= before).only_enforce_if(inner)  # type: ignore[attr-defined]
        pulled = int(z[k]) + (sc if k == L - 1 else 0)  # (the loss's: its scalar gradient too)
        if not c.grad_views[k]:  # (as the layer before it: MemoryModel._pairs_b)
            m.add(whole >= var + pulled).only_enforce_if(inner)  # type: ignore[attr-defined]
        before = var
    if remat is None:
        return whole - S - live
    # exactly the larger (B's two tuples add each one to the same pulled gradient)
    both = m.new_int_var(0, top, f"blive{s}")  # type: ignore[attr-defined]
    m.add_max_equality(both, [live, remat])  # type: ignore[attr-defined]
    return whole - S - both


def _fit_memory(m: object, memory: MemoryModel, spec: StageSpec, x: list, first: list, s: int,
                L: int) -> None:  # fmt: skip
    """Constrain stage s to its budget under the memory model, as linear expressions."""
    c, shape = memory.chain, spec.shape
    cap = min(int(spec.budget), _held_bound(c, shape))  # a budget past all it could hold: same

    def over(values: np.ndarray, var: list) -> object:
        return sum(int(values[k]) * var[k][s] for k in range(L) if values[k])

    inner = [[x[k][s] - first[k][s]] for k in range(L)]  # k in the stage, not its first layer
    p = over(c.grads, x)  # (the trainable ones: their gradients, optimizer slots and step)
    weights = over(c.params, x) + (1 + shape.optimizer_slots) * p + over(c.buffers, x)
    held = c.boundary[:L].copy()
    if c.borrowed_input:  # stage 0 on the caller's micro-batch: none of it is the stage's
        held[0] = 0
    X = over(held, first)
    opened = _input_saved(m, c, x, first, s, L)  # per opening layer k: Xs where k opens s
    Xs = sum(opened)
    S = over(c.saved, x) - sum(int(c.shared[k]) * inner[k][0] for k in range(L) if c.shared[k])
    Z = over(c.kept_grad, x) + int(c.last_grad) * x[L - 1][s]  # (last_grad: the last stage's)
    G = over(c.grad_in, first)

    def largest(first_values: np.ndarray, inner_values: np.ndarray, name: str) -> object:
        top = int(max(first_values.max(), inner_values.max(), 0))
        var = m.new_int_var(0, top, f"{name}{s}")  # type: ignore[attr-defined]
        for k in range(L):
            if first_values[k] or inner_values[k]:
                m.add(var >= int(first_values[k]) * first[k][s]  # type: ignore[attr-defined]
                      + int(inner_values[k]) * inner[k][0])  # fmt: skip
        return var

    live, remat, inp, later, stop = _transients(m, c, x, first, s, L)
    kind = "pulled" if shape.bound else pulled_with(shape.occupancy)
    if kind != "pulled":
        both = stop if kind == "pulled_paired" else None
        pulled = _tight_pulled(m, c, x, first, s, L, S, later, live, both)
    else:
        pulled = largest(c.zgrad, c.zgrad, "pulled")
    # (early and late: 0, a chain has no routes past the next stage)
    loss = over(c.loss_saved, x)
    # (W's graph holds the input, where it needs a gradient: all but what the stage saves,
    # and what the loss alone saves of it, through views, too)
    if c.has_loss and c.views is not None:
        kept_w = _input_saved(m, c, x, first, s, L, model_only=True)
    else:
        kept_w = opened
    unsaved = sum(int(c.boundary[k]) * first[k][s] - kept_w[k] for k in range(L) if c.grad_in[k])
    lent_w = kept_w[0] if c.borrowed_input else 0  # (the loss's part went with `loss`)
    states = [X, X + S - Xs, X + S - Xs + Z + G, S - loss + Z + unsaved - lent_w, G,
              pulled, 0, 0]  # fmt: skip

    transients = [
        live,
        remat,
        largest(c.forward_peak, c.forward_peak + c.boundary[:L], "forward"),
        inp,
        _weight(m, c, x, inner, s, L),
        stop,
    ]
    for t in shape.occupancy:
        held = sum(n * v for n, v in zip(t, states + transients) if n)
        m.add(weights + held + shape.runtime + shape.reserved <= cap)  # type: ignore[attr-defined]
    if shape.optimizer_step:
        size = p if shape.foreach else largest(c.largest_param, c.largest_param, "param")
        # per_byte x size, rounded up as the model does; per_byte as a fraction of integers
        # (exact for the measured ratios, which have small denominators)
        # (the denominator is kept small enough for num x size to stay inside int64)
        top = max(int(c.params.sum()), cap, 1) * (int(shape.optimizer_step) + 1)
        ratio = Fraction(shape.optimizer_step).limit_denominator(
            max(1, min(1 << 20, INT64_SAFE // top))
        )
        num, den = ratio.numerator, ratio.denominator
        step = m.new_int_var(0, max(cap, 0), f"step{s}")  # type: ignore[attr-defined]
        m.add(step * den >= num * size)  # type: ignore[attr-defined]
        m.add(weights + step + shape.reserved <= cap)  # type: ignore[attr-defined]


def _weight(m: object, c: Chain, x: list, inner: list, s: int, L: int) -> object:
    """W's transient (MemoryModel.state_bytes' weight_live): each layer's figure, with what it
    shares with the next layer where that one is in the stage too (inner[k + 1]) and runs no W
    of its own (Chain.keeps_graph_through_w), less what the stage's layers after it let go at
    their W, run before its own (Chain.w_freed)."""
    w = c.weight_grad_transient.astype(np.int64)
    # (and where k + 1 hands on a value k made and a layer past it is in the stage too,
    # `passed`: MemoryModel._weight_passed)
    nxt, passed = c.w_beside()
    top = int(max((w + nxt + passed).max(), 0))
    var = m.new_int_var(0, top, f"weight{s}")  # type: ignore[attr-defined]
    # less what the stage's layers after k let go at their own W before k's (Chain.w_freed)
    freed = c.w_freed
    after = _suffix(m, [int(freed[k]) * x[k][s] for k in range(L)], f"wfreed{s}_",
                    int(freed.sum())) if freed.any() else [0] * L  # fmt: skip
    for k in range(L):
        if w[k] or nxt[k]:
            shared = int(nxt[k]) * inner[k + 1][0] if nxt[k] else 0
            m.add(var >= int(w[k]) * x[k][s] + shared - after[k])  # type: ignore[attr-defined]
        if passed[k] and k + 2 < L:
            # both k + 1 and k + 2 inner layers of the stage (so k is in it): exactly, as
            # the solver sets `both` no higher than it must
            both = m.new_bool_var(f"wpass{s}_{k}")  # type: ignore[attr-defined]
            m.add(both >= inner[k + 1][0] + inner[k + 2][0] - 1)  # type: ignore[attr-defined]
            held = int(nxt[k]) * inner[k + 1][0] if nxt[k] else 0
            m.add(var >= int(w[k]) * x[k][s] + held + int(passed[k]) * both - after[k])  # type: ignore[attr-defined]
    return var


def _held_bound(c: Chain, shape: object) -> int:
    """More than any stage can hold under `shape`: every layer's weights and, per micro-batch
    counted in its worst occupancy tuple, every state's bytes and the largest transient."""
    weights = (2 + shape.optimizer_slots) * int(c.params.sum()) + int(c.buffers.sum())  # type: ignore[attr-defined]
    per_mb = sum(int(a.sum()) for a in (c.boundary, c.saved, c.zgrad, c.grad_in, c.input_unsaved))
    ib, sc = _inner(c)
    transient = sc + max(int(a.max()) for a in (c.forward_transient, c.backward_transient, ib,
                    c.forward_peak, c.input_grad_transient, c.weight_grad_transient, c.boundary))  # fmt: skip
    count = max((sum(t) for t in shape.occupancy), default=1)  # type: ignore[attr-defined]
    step = math.ceil(shape.optimizer_step * int(c.params.sum()))  # type: ignore[attr-defined]
    return weights + count * (per_mb + 6 * transient) + step + shape.runtime + shape.reserved + 1  # type: ignore[attr-defined]


def solve_partition_cpsat(
    times: np.ndarray,
    memory: MemoryModel,
    stages: list[StageSpec],
    cuts: Sequence[np.ndarray] | None = None,
    *,
    time_limit_s: float = 20.0,
    workers: int = 1,
) -> Partition | None:
    """`time_limit_s`: for the whole call, building the model included."""
    from ortools.sat.python import cp_model

    started = time.perf_counter()
    L, S = len(times), len(stages)
    if not 1 <= S <= L:
        raise ValueError(f"cannot split {L} layers into {S} non-empty stages")
    if memory.chain.ctx_late is not None:  # (the search says so and keeps the probe's split)
        raise ValueError(
            "CP-SAT does not model what a custom autograd.Function keeps on its ctx "
            "(Chain.ctx_late): solve with solve_partition"
        )
    links = cut_table(cuts, L, S)
    # three digits for the slowest stage too (speeds run from 0.001)
    speed_scale = SPEED_SCALE * max(1.0, 1.0 / min(st.speed for st in stages))
    speed = [max(1, int(round(st.speed * speed_scale))) for st in stages]
    # ns, unless the horizon x speed would leave int64: then coarser, as fine as fits
    worst = max(float(np.sum(times)), max((float(np.max(r[np.isfinite(r)], initial=0)) for r in
                (cuts or [])), default=0.0), 1e-9)  # fmt: skip
    scale = min(TIME_SCALE, 2.0**60 / (worst * speed_scale * max(speed)))
    t = [int(round(float(v) * scale)) for v in times]
    m = cp_model.CpModel()
    stage_of = [m.new_int_var(0, S - 1, f"stage_of{k}") for k in range(L)]
    m.add(stage_of[0] == 0)
    m.add(stage_of[L - 1] == S - 1)
    step = [m.new_bool_var(f"step{k}") for k in range(L - 1)]  # layer k + 1 opens a new stage
    for k in range(L - 1):
        m.add(stage_of[k + 1] == stage_of[k] + step[k])
    x = [[m.new_bool_var(f"x{k}_{s}") for s in range(S)] for k in range(L)]
    first = [[m.new_bool_var(f"first{k}_{s}") for s in range(S)] for k in range(L)]
    for k in range(L):
        m.add_exactly_one(x[k])
        m.add(sum(s * x[k][s] for s in range(S)) == stage_of[k])
        for s in range(S):
            if k == 0:
                m.add(first[0][s] == x[0][s])
            else:  # first = x AND step[k-1]
                m.add_implication(first[k][s], x[k][s])
                m.add_implication(first[k][s], step[k - 1])
                m.add_bool_or([first[k][s], x[k][s].Not(), step[k - 1].Not()])
    # link[s - 1][k]: ns of the transfer when stages s - 1 and s meet at boundary k; None: forbidden
    link = [
        [None if math.isinf(v) else round(v * scale) for v in row.tolist()]
        for row in (links if links is not None else ())
    ]
    horizon = max([sum(t) * round(speed_scale)] + [v for row in link for v in row if v is not None])
    bottleneck = m.new_int_var(0, horizon, "bottleneck")  # ns
    for s, row in enumerate(link, start=1):
        for k in range(1, L):
            if row[k] is None:
                m.add(first[k][s] == 0)
            elif row[k]:
                m.add(bottleneck >= row[k] * first[k][s])
    for s, spec in enumerate(stages):
        if time.perf_counter() - started > time_limit_s:  # (building alone took it all)
            raise RuntimeError(
                f"building CP-SAT's model ran past its {time_limit_s:.3g} s ({s} of {S} stages)"
            )
        busy = sum(t[k] * x[k][s] for k in range(L))
        m.add(busy * round(speed_scale) <= bottleneck * speed[s])
        _fit_memory(m, memory, spec, x[:], first, s, L)
    m.minimize(bottleneck)
    solver = cp_model.CpSolver()
    # (what building the model took comes off the solver's time; 10 ms at least)
    solver.parameters.max_time_in_seconds = max(
        time_limit_s - (time.perf_counter() - started), 0.01
    )
    solver.parameters.num_workers = workers
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            return None
        raise RuntimeError(
            f"CP-SAT found no split within {time_limit_s:.3g} s ({solver.status_name(status)})"
        )
    owner = [solver.value(v) for v in stage_of]
    bounds = [0] + [k for k in range(1, L) if owner[k] != owner[k - 1]] + [L]
    costs = stage_costs(np.asarray(times, dtype=np.float64), bounds, [st.speed for st in stages])
    # The objective is an integer (ns) that CP-SAT reports as a float, which can land a hair off:
    # round the value found, and round the bound up (no integer below it is feasible).
    found = round(solver.objective_value) / scale
    bound = math.ceil(solver.best_objective_bound - 1e-6) / scale
    return Partition(
        bounds=bounds,
        bottleneck=max(costs + split_cuts(links, bounds)),
        extra={
            "optimal": float(status == cp_model.OPTIMAL),
            "lower_bound_ms": bound,
            "gap": (found - bound) / found if found > 0 else 0.0,
        },
    )
