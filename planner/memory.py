"""The memory of a stage: the one place that says what a stage of layers [i, j) holds.

A device holds its stage's weights all the time, and its micro-batches' tensors state by state
as the schedule's issue order moves them (schedules/memory.py). Per micro-batch, for the stage
[i, j) (the loss, when profiled, is the last stage's final layer):

    X   = boundary[i]                  its input (pushed by the previous stage, or our own copy;
                                       0 for stage 0 where it works on the caller's micro-batch,
                                       which then also leaves Xs out of between_iw);
                                       a captured graph's stage receives only the values its
                                       layers read, each from the stage that made it (routing.py)
    E   = the part of X sent by a stage before the previous one: it arrives earlier (`early`),
          and its gradient (the floating part) leaves later (`late`), at that stage's backward
    Xs  = input_saved[i]               the part of X that layer i saves itself (or, where
                                       layers i.. only make views of it, the most that one of
                                       them or the first layer past them saves: input_saved)
    S   = sum saved[i:j] - sum shared[i+1:j]    what its layers save, each tensor once
    Z   = sum zkept[i:j]               zero bubble: the gradients kept from I to W, those W
                                       needs: of each layer output (the stage output's too)
                                       whose layer has weights that train; + last_grad on the
                                       last stage of a chain without its loss. I lets the
                                       others go (input_live counts them while they live)
    G   = grad_in[i]                   its input gradient, until the stages that sent the
                                       input pull it (a captured graph: X's floating part)
    K   = Flow.passing(i, j)           a captured graph's skips: the gradients of what the
                                       stage's inner layers send on, pulled back beside the
                                       totals made inside (routing.py); 0 for a chain
    P                                  the output gradient B pulls and holds while it runs:
                                       zgrad[j-1], raised where P + S + B's transient would
                                       shrink below a shorter stage's (B holds all three, so
                                       they must grow with j together): that transient is
                                       live, or where B re-materialises first (recomputation)
                                       the larger of live and stop_live. Where a stage's
                                       occupancy holds pulled other than in such B's
                                       (pulled_with), P = max zgrad[i:j], the largest boundary
                                       inside. A captured graph's: what the stage sends (its
                                       last layer's output and skips), raised where P + S +
                                       live would shrink below a shorter stage's
    The transients say what an action holds above the states, at its worst layer l. They
    walk the stage as autograd does, so each is relative to the whole activations S, of
    which the layers after l hold later(l) = sum saved[l+1:j] - sum shared[l+1:j]:
    live = max over l < j - 1 of inner_backward[l] - later(l) (its output gradient let go by
           autograd; on the loss's stage with the loss's scalar gradient beside it), and the
           last layer's backward without its output gradient, which B holds as `pulled` (a
           chain's: the most over the stage's shorter ends too, so that totals grow with the
           end; a captured graph's: at least remat_live too where some B of the stage
           re-materialises, see _flow_pulled; where the
           profile has no inner figure, backward[l]): while B runs after any re-materialising,
           layer by layer from the last, each layer's saved tensors let go once it is done
           (a captured graph's backward[l] also loses the gradient of each value l hands on
           that no later layer of the stage reads: routing.py's `unread`; and gains the
           gradients that wait while l runs: of each value the stage makes before l and
           reads after it, not in its last layer: _inner_skips)
    remat_live = max(forward[i], max over i < l < j of forward[l] + input_unsaved[l]) less
           later(l) at that l: while a forward that keeps what it saves runs (F, and zero
           bubble's re-materialising forward at I), before the layers after l saved
    stop_live = remat_live: the forward a recomputed B re-materialises by hand at its start,
           beside the gradient it pulled alone, the stage's whole forward (the runtime's
           _rematerialise, as zero bubble's I). A captured graph's: remat_live, and the sum
           of the gradients later stages send back for one value it makes (_sent_sums)
    input_live = max(input_grad[i], max over i < l < j of input_grad[l] - sum zkept[i:l-1]
           - G): while I runs, from the last layer: the output gradients of the layers
           before l - 1 are not made yet, nor the stage's input gradient (its first
           layer's I makes it, last). A gradient I lets go (not in Z) is alive at l where it
           is l's own or l's input's, and the stage's pulled one at every l (the runtime
           holds it to I's end): a stage ending in such a layer may hold more than the stage
           one layer longer, so input_live is the most over the stage's ends e <= j with Z of
           [i, e), less Z of [i, j) (_let_go_input_live). On a captured graph only those of
           the values they make
           that no layer from l on reads, in the stage or after it (a residual stream's,
           read later, has its gradient made already), plus the largest gradient I sums
           from two parts inside the stage (a new buffer beside the first); plus the
           gradient of each parameter two of the stage's layers share, which I takes (a
           layer's own W would reach it through the other layer too)
    weight_live                        ... while W runs (zero bubble), layer by layer from the
                                       last: the largest layer's, on top of all I keeps less
                                       what the layers after it let go at their W (w_freed),
                                       with what the next layer shares of its saved tensors
                                       where that layer keeps its graph through W
    forward_live = max(forward_peak[i], max over i < l < j of forward_peak[l] + boundary[l])
                                       what a forward that keeps nothing (recomputation) needs:
                                       one layer's working memory and, inside the stage, its input

    state bytes  input X, early E, late E's gradient, activations X + S - Xs,
                 during_i X + S - Xs + Z + G + K, between_iw S - loss + Z (+ X - Xs where G > 0:
                 W's graph holds the input, with Xs the model layers' part, not the loss's
                 through views; the loss's own saved tensors go with I; the skips' pulled
                 gradients are let go when I ends), grad G, pulled P

and the stage's memory is

    params + grads + optimizer slots x (grads but the tied ones a layer before i uses too:
                                        another stage holds their state; under torchrun,
                                        where each rank steps its own copy, all: a rank whose
                                        two stages use one counts its state twice, over)
    (grads: the trainable parameters' bytes; a frozen one has neither gradient nor state)
    + workspace
    + max( max over the stage's occupancy tuples (n per state, then which transient runs) of
               sum n x state bytes + the running transient,
           the optimizer step's temporaries: per_byte x (all its trainable parameters when
               the optimizer runs multi-tensor kernels, else its largest trainable one) )

Every state grows as a stage gains layers at its end, and so does each transient added to the
activations of the micro-batch it runs on (which every occupancy tuple with that transient
counts): the stage's total grows with its end, which is what makes the partition search exact.
All functions take numpy arrays of starts and ends, so the solver evaluates thousands of
candidate stages in one call; scalars work too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from schedules import STATES, StageBytes
from schedules.memory import TRANSIENTS

from .costs import Chain

RECOMPUTE_MODES = ("never", "except_last", "always")
# torch.get_rng_state().numel(): the CPU generator's state (Mersenne Twister, 624 words and
# what goes with them), which the torchrun program holds through a step (a test keeps it
# equal to torch's own)
CPU_RNG_STATE = 5056
N_STATES = len(STATES)
N_TRANSIENTS = len(TRANSIENTS)
PULLED = STATES.index("pulled")


@dataclass(frozen=True)
class StageShape:
    """What a stage's memory depends on besides its layers."""

    occupancy: tuple[tuple[int, ...], ...]  # (count per state..., running), schedules/memory.py
    optimizer_slots: int
    reserved: int = 0
    runtime: int = 0  # what the runtime holds through the step (StageBytes.runtime)
    optimizer_step: float = 0.0  # temporaries per byte of parameters (see the module doc)
    foreach: bool = False
    # `occupancy` is one tuple at least every real one in every entry (occupancy_bound): then
    # a state whose bytes come out negative counts as none, and total() bounds the stage's
    # memory from above (what the search solves with before it knows the issue order)
    bound: bool = False

    def __post_init__(self) -> None:
        # The transients of B and of a forward that keeps what it saves are counted above the
        # activations of the micro-batch they run on, I's above its during_i: a tuple that
        # runs one counts that micro-batch (as every schedule's does), or the stage's total
        # would not grow with its end.
        act, during = STATES.index("activations"), STATES.index("during_i")
        width = N_STATES + N_TRANSIENTS
        if any(len(t) < width for t in self.occupancy):  # (written before the later transients)
            padded = tuple(tuple(t) + (0,) * (width - len(t)) for t in self.occupancy)
            object.__setattr__(self, "occupancy", padded)
        for t in self.occupancy:
            flags = t[N_STATES:]
            b_or_f = flags[0] or flags[1] or flags[5]
            if b_or_f and t[act] + t[during] < 1 or flags[3] and t[during] < 1:
                raise ValueError(f"occupancy {t} runs a transient on no micro-batch's activations")

    def __hash__(self) -> int:
        """The fields' hash, made once: a shape keys the memory tables, and a search hashes it
        millions of times (its occupancy is a tuple per distinct moment of the stage)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def inflight(self) -> int:
        """Micro-batches the stage holds tensors of (beyond an input gradient) at its worst."""
        return max(sum(t[:4]) for t in self.occupancy)


@lru_cache(maxsize=4096)
def pulled_with(occupancy: tuple[tuple[int, ...], ...]) -> str:
    """Which pulled gradient a chain's stage under this occupancy counts: `pulled`, the largest
    output gradient of any of its layers (it grows with the stage's end), unless every tuple
    holding a pulled gradient is one B's: one gradient, its micro-batch's activations, and one
    transient, B's own or, a recomputed B re-materialising first, its forward's (stop_live),
    each with the same counts as the other. Then B's whole (gradient, activations and the larger of
    those transients) is made to grow with the stage's end alone (MemoryModel.state_bytes):
    `pulled_tight` where B only runs its own transient, `pulled_paired` where it re-materialises
    too."""
    pulled, act, during = (STATES.index(k) for k in ("pulled", "activations", "during_i"))
    live, remat = N_STATES, N_STATES + TRANSIENTS.index("stop_live")
    holding = {t for t in occupancy if t[pulled]}
    flags = set()
    for t in holding:
        on = [k for k in range(N_STATES, len(t)) if t[k]]
        if t[pulled] != 1 or not t[act] + t[during] or len(on) != 1 or on[0] not in (live, remat):
            return "pulled"
        flags.add(on[0])
    one = [tuple(int(k == f) for k in range(N_STATES, N_STATES + N_TRANSIENTS)) for f in flags]
    if any(t[:N_STATES] + f not in holding for t in holding for f in one):
        return "pulled"
    if flags == {remat}:  # (a re-materialising forward without its B: B's whole is not there)
        return "pulled"
    return "pulled_paired" if remat in flags else "pulled_tight"


@lru_cache(maxsize=4096)
def _pulled_outside_b(occupancy: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """A tuple of the occupancy holding a pulled gradient while B's transient does not run,
    if any: a captured graph's pulled gradient grows with the stage's end only together with
    B's transient and its micro-batch's activations (MemoryModel._flow_pulled), as every
    schedule's B holds it. (A recomputed B holds it first through its re-materialising
    forward, with the same counts, whose transient a captured graph's `live` covers.)"""
    pulled = STATES.index("pulled")
    b = [N_STATES + TRANSIENTS.index(k) for k in ("live", "remat_live", "stop_live")]
    return next((t for t in occupancy if t[pulled] and not any(t[k] for k in b)), None)


@lru_cache(maxsize=4096)
def _counted(occupancy: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Which states and transients some tuple of the occupancy counts."""
    counted = (np.asarray(occupancy, dtype=np.int64) != 0).any(axis=0)
    counted.setflags(write=False)
    return counted


_EXACT = 2.0**53  # float64 holds every integer below it exactly


def _most(occ: np.ndarray, values: np.ndarray) -> np.ndarray:
    """max over the rows of occ @ values (integers): in float64 (BLAS, about 3x numpy's integer
    product) where every product and partial sum stays below 2^53, so exact; else in int64."""
    if occ.size == 0:
        return np.zeros(values.shape[1], dtype=np.int64)
    floats = values.astype(np.float64)
    reach = float(np.abs(occ).sum(axis=1).max())
    if reach * float(np.abs(floats).max(initial=0.0)) < _EXACT:
        return (occ.astype(np.float64) @ floats).max(axis=0).astype(np.int64)
    return (occ @ values).max(axis=0)


_Spots = tuple[np.ndarray, np.ndarray]


class _RangeMax:
    """O(1) maxima over index ranges [i, j) of one non-negative array (a sparse table)."""

    def __init__(self, values: np.ndarray) -> None:
        n = len(values)
        levels = [values.astype(np.int64)]
        while 2 ** len(levels) <= n:
            prev, half = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-half], prev[half:]))
        width = max(n, 1)
        table = np.zeros((len(levels), width), dtype=np.int64)
        for k, row in enumerate(levels):
            table[k, : len(row)] = row
        self._flat = table.ravel()  # level k's entry i at k * width + i: one gather per end
        # per span 1 .. n: floor(log2(span)), and the row offset and length of its level
        log = np.zeros(width + 1, dtype=np.int64)
        log[1:] = np.frexp(np.arange(1, width + 1))[1] - 1
        self._row = log * width
        self._reach = 1 << log

    def __call__(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self.take(self.spots(i, j))

    def spots(self, i: np.ndarray, j: np.ndarray) -> _Spots:
        """Where the maxima over [i, j) lie in the table: the same for every table of this
        width, so that several tables answer one range for the price of their gathers."""
        span = np.maximum(j - i, 1)
        row = self._row[span]
        return row + i, row + j - self._reach[span]

    def take(self, spots: _Spots) -> np.ndarray:
        return np.maximum(self._flat[spots[0]], self._flat[spots[1]])


class _PairMax:
    """O(1) maxima of first[l] + second[m] over l < m in [i, j), 0 where j - i < 2: a disjoint
    sparse table (a pair's maximum, unlike a plain one, cannot be read off two overlapping
    ranges, so each level keeps, per block, what lies on each side of its middle)."""

    def __init__(self, first: np.ndarray, second: np.ndarray) -> None:
        n = len(first)
        size = 1 << max(1, (max(n, 2) - 1).bit_length())
        low = -(1 << 62)
        a = np.full(size, low, dtype=np.int64)
        z = np.full(size, low, dtype=np.int64)
        a[:n], z[:n] = first, second
        levels = size.bit_length() - 1
        first_at = np.empty((levels, size), dtype=np.int64)
        second_at = np.empty((levels, size), dtype=np.int64)
        best_at = np.empty((levels, size), dtype=np.int64)
        for h in range(levels):
            half = 1 << h
            blocks = size // (2 * half)
            pad = np.full((blocks, 1), low, dtype=np.int64)
            fa, fz = a.reshape(blocks, 2, half), z.reshape(blocks, 2, half)
            # left of the middle, over [p, middle): read from the middle outwards
            la, lz = fa[:, 0, ::-1], fz[:, 0, ::-1]
            sa, sz = np.maximum.accumulate(la, axis=1), np.maximum.accumulate(lz, axis=1)
            after = np.concatenate([pad, sz[:, :-1]], axis=1)  # second's maximum past l
            sb = np.maximum.accumulate(np.maximum(la + after, low), axis=1)
            # right of it, over [middle, q]
            ra, rz = fa[:, 1], fz[:, 1]
            pa, pz = np.maximum.accumulate(ra, axis=1), np.maximum.accumulate(rz, axis=1)
            before = np.concatenate([pad, pa[:, :-1]], axis=1)  # first's maximum before m
            pb = np.maximum.accumulate(np.maximum(before + rz, low), axis=1)
            first_at[h] = np.stack([sa[:, ::-1], pa], axis=1).ravel()
            second_at[h] = np.stack([sz[:, ::-1], pz], axis=1).ravel()
            best_at[h] = np.stack([sb[:, ::-1], pb], axis=1).ravel()
        # flat (one gather per lookup, as _RangeMax), and per lo ^ hi the offset of its level:
        # the one whose block has lo left of its middle and hi right of it
        self._first, self._second, self._best = first_at.ravel(), second_at.ravel(), best_at.ravel()
        self._row = np.zeros(size, dtype=np.int64)
        self._row[1:] = (np.frexp(np.arange(1, size))[1] - 1) * size

    def __call__(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        lo, hi = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64) - 1
        pair = hi > lo
        lo, hi = np.where(pair, lo, 0), np.where(pair, hi, 1)  # (no pair: the answer is 0)
        row = self._row[lo ^ hi]
        at_lo, at_hi = row + lo, row + hi
        across = self._first[at_lo] + self._second[at_hi]
        got = np.maximum(np.maximum(self._best[at_lo], self._best[at_hi]), across)
        return np.where(pair, np.maximum(got, 0), 0)


def _static(
    p: np.ndarray, g: np.ndarray, copied: np.ndarray, buffers: np.ndarray, slots: int | np.ndarray
) -> np.ndarray:
    """A stage's weights (p), gradients of its trainable ones (g), their optimizer slots (not
    for parameters whose state another stage keeps: `copied`) and buffers."""
    return p + g + slots * (g - copied) + buffers


def _once(
    prefix: np.ndarray, tied: list[tuple[int, np.ndarray]], i: np.ndarray, j: np.ndarray
) -> np.ndarray:
    """What the layers of [i, j) add up to in `prefix` (prefix sums), each tied parameter
    (bytes, how many of its users lie before each position) counted once."""
    out = prefix[j] - prefix[i]
    for nbytes, before in tied:
        out = out - nbytes * np.maximum(before[j] - before[i] - 1, 0)
    return out


def _stepped(own: np.ndarray, largest: np.ndarray | None) -> np.ndarray:
    """What a stage's optimizer step is charged for, per its per_byte: the trainable bytes it
    steps itself (`own`: not the tied copies whose state another stage keeps, copied()) with
    a multi-tensor step (`largest` None), else its one-tensor-at-a-time size (`largest`,
    MemoryModel.step_size), none where the copies are all it trains."""
    if largest is None:
        return own
    return np.where(own > 0, largest, 0)


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(values.astype(np.int64))])


def _step_ends_bytes(shape: StageShape, head: int, tail: int) -> dict[str, int]:
    """StageBytes' step_head and step_tail from step_ends (what a device's next stage steps
    beside: schedules.memory.device_step); none with multi-tensor kernels or no carry."""
    if shape.foreach or not tail:
        return {}
    per = shape.optimizer_step
    return {"step_head": math.ceil(per * head), "step_tail": math.ceil(per * tail)}


class MemoryModel:
    """Prefix sums and range-maximum tables over one Chain."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        # per (shape, budget): the ends found from each start, and the ends searched to
        self._ends: dict[tuple[StageShape, int], tuple[np.ndarray, np.ndarray]] = {}
        self._ends_size = 0  # the entries of found ends in _ends (max_ends keeps the count)
        self._one_layer: dict[StageShape, np.ndarray] = {}  # (one_layer)
        self._single: dict[str, np.ndarray] = {}  # (one_layer: each layer's state_bytes)
        self._weights: dict[int, np.ndarray] = {}  # (weights)
        self._guess_prefix: dict[tuple[int, int], np.ndarray] = {}  # (end_guess)
        self._params = _prefix(chain.params)
        self._grads = _prefix(chain.grads)
        # a parameter several layers use: how many of them lie before each position
        self._tied = [
            (nbytes, _prefix(np.isin(np.arange(chain.num_layers), layers).astype(np.int64)))
            for nbytes, layers in chain.tied
        ]
        # ... those that train (a frozen one has no gradient and no optimizer state)
        self._tied_grads = [t for k, t in enumerate(self._tied) if k not in chain.frozen_tied]
        self._buffers = _prefix(chain.buffers)
        self._saved = _prefix(chain.saved)
        self._shared = _prefix(chain.shared)
        self._loss = _prefix(chain.loss_saved)
        self._zgrad = _prefix(chain.zgrad)
        self._zkept = _prefix(chain.kept_grad)
        # the output gradients zero bubble's I lets go (a layer without weights that train):
        # each alive from its making (its reader's I) until its own layer's I is done
        self._let_go = _prefix(chain.zgrad - chain.kept_grad)
        f, b = chain.forward_transient, chain.backward_transient
        # held[l]: what layers 0..l save, each tensor once; while layer l's backward runs the
        # stage still holds its own layers' share of it (those after l have let theirs go)
        self._held = self._saved[1:] - self._shared[1:]
        # ... of which a ctx keeps some (Chain.ctx_late, ctx_prev): B lets those go with the
        # graph, at the stage's end, not as it passes their layer. B's walk counts from the
        # rest: _held_b where layer l ends the stage (what l's ctx keeps of l - 1's saves is
        # not let go by l - 1's backward), _held_inner where l + 1 is in the stage too (nor
        # what l + 1's ctx keeps of l's). The same arrays where no ctx keeps any.
        self._held_b = self._held_inner = self._held
        if chain.ctx_late is not None and chain.ctx_prev is not None:
            own, prev = _prefix(chain.ctx_late), _prefix(chain.ctx_prev)
            self._held_b = self._held - own[1:] - prev[1:]
            self._held_inner = self._held_b - np.append(chain.ctx_prev[1:], 0)
        self._last_backward = np.maximum(b - chain.zgrad, 0).astype(np.int64)
        # B's walk, per start and end: a captured graph's, and a chain's with a tied parameter
        # that trains (two uses in one stage: a gradient part waits between them)
        walk = chain.flow is not None or bool(self._tied_grads)
        self._walk = self._walk_table() if walk else None
        self._flow_pulled_tables: dict[bool, np.ndarray] = {}  # (_flow_pulled, per `tight`)
        # a forward that keeps what it saves, layer by layer: layer l's peak comes on top of
        # what the layers before it saved (and, inside the stage, its input while it runs)
        self._first_remat = (self._held + f).astype(np.int64)
        # zero bubble's I, layer by layer from the last: layer l's peak comes on top of the
        # gradients kept so far: its own output's, those of the layers after it, and its
        # input's, which it makes (the stage's counts all of them: those of layers i .. l - 2
        # are not there yet)
        it = chain.input_grad_transient.astype(np.int64)
        self._first_input_live = it
        before = np.concatenate([[0], self._zgrad[:-2]])[: chain.num_layers]
        self._input_live_values = it - before + self._zgrad[-1]  # (not negative)
        self._flow_input_live = None
        if chain.flow is not None:
            self._flow_input_live = self._flow_input_table()
        elif self._tied_grads:  # (a chain's I, with what waits in it: _chain_input_table)
            self._flow_input_live = self._chain_input_table()
        self._forward_peak = chain.forward_peak.astype(np.int64)

    # The range-maximum tables, each made the first time a state that reads it is asked for
    # (a model made for one feasibility test reads only its occupancy's states)

    @cached_property
    def _largest(self) -> _RangeMax:
        return _RangeMax(self.chain.largest_param)

    @cached_property
    def _step(self) -> tuple[_RangeMax, _RangeMax, np.ndarray] | None:
        """Per layer, for step_size: `inner`, the most of t + carry x (the tensor stepped before
        t) over its parameter tensors t but its first, and that first alone; `cross`, its first
        after the last tensor of the layers before it (0 without either); and per layer the
        first layer from it on that has tensors (n: none). None where the largest alone is the
        figure: no carry, no tensors known, or a tied parameter (stepped once, not where each
        user's list has it)."""
        c = self.chain
        if not c.step_carry or c.param_tensors is None or self._tied_grads:
            return None
        n = c.num_layers
        inner, cross = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        last = 0  # the last tensor of the layers before (none: 0)
        for k, tensors in enumerate(c.param_tensors):
            if not tensors:
                continue
            own = [t + math.ceil(c.step_carry * p) for p, t in zip(tensors, tensors[1:])]
            inner[k] = max([tensors[0], *own])
            cross[k] = tensors[0] + math.ceil(c.step_carry * last) if last else 0
            last = tensors[-1]
        has = np.array([bool(t) for t in c.param_tensors])
        first = np.full(n + 1, n, dtype=np.int64)
        for k in range(n - 1, -1, -1):
            first[k] = k if has[k] else first[k + 1]
        return _RangeMax(inner), _RangeMax(cross), first

    @cached_property
    def _step_ends(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Per layer its first parameter tensor and the carry of its last (step_carry x the
        tensor, as _step counts it), and per end j the last layer before j with tensors (-1:
        none); None where _step is."""
        if self._step is None:
            return None
        c = self.chain
        heads = np.array([t[0] if t else 0 for t in c.param_tensors], dtype=np.int64)
        tails = np.array(
            [math.ceil(c.step_carry * t[-1]) if t else 0 for t in c.param_tensors], dtype=np.int64
        )
        before = np.full(c.num_layers + 1, -1, dtype=np.int64)
        for k, tensors in enumerate(c.param_tensors):
            before[k + 1] = k if tensors else before[k]
        return heads, tails, before

    def step_ends(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For stages [i, j) stepped one tensor at a time with a carry (step_size): the first
        tensor's size, and the carry its last tensor leaves to the next tensor stepped (per
        the optimizer's per_byte, as step_size's); 0 and 0 without tensors or a carry."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        ends = self._step_ends
        if ends is None:
            return np.zeros(i.shape, dtype=np.int64), np.zeros(i.shape, dtype=np.int64)
        heads, tails, before = ends
        first = self._step[2][i]  # type: ignore[index]
        last = before[j]
        has = first < j
        head = np.where(has, heads[np.minimum(first, len(heads) - 1)], 0)
        tail = np.where(has, tails[np.maximum(last, 0)], 0)
        return head, tail

    def step_size(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """What a one-tensor-at-a-time optimizer step over stage [i, j) is charged for, per its
        per_byte: its largest parameter tensor, or, where the step of a tensor still holds
        some of its temporaries while the next is stepped (Chain.step_carry: Adam's
        denominator), the most of t + step_carry x (the tensor before t) over the stage's
        tensors in order, its first with none before it (another optimizer's, or none)."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        step = self._step
        if step is None:
            return self._largest(i, j)
        inner, cross, first = step
        # after the stage's first layer with tensors, each layer's first follows a tensor of
        # the stage's own
        after = first[i] + 1
        crossed = np.where(after < j, cross(np.minimum(after, j - 1), j), 0)
        return np.maximum(inner(i, j), crossed)

    @cached_property
    def _pulled(self) -> _RangeMax:
        return _RangeMax(self.chain.zgrad)

    @cached_property
    def _backward(self) -> _RangeMax:
        """A chain's layers before its stage's last: each one's output gradient is autograd's
        alone (_inner_backward)."""
        return _RangeMax(self._held_inner + self._inner_backward)

    @cached_property
    def _ends_b(self) -> _RangeMax:
        """B's pulled gradient, activations and transient together, a chain's stage from i
        ending at k (see pulled_with): the largest over every k up to an end."""
        c = self.chain
        return _RangeMax(self._held_b + np.maximum(c.backward_transient, c.zgrad))

    @cached_property
    def _pairs_b(self) -> _PairMax:
        """An inner layer l's backward beside the gradient a later m pulled, l < m (with the
        loss's scalar gradient where m is the loss: _loss_grad). Not where m's input gradient
        is a view of its output's (Chain.grad_views): the stage ending at the first of such
        layers holds as much (the same pulled bytes, as the layer before gets it)."""
        pulled = self.chain.zgrad.astype(np.int64).copy()
        pulled[-1] += self._loss_grad
        pulled[self.chain.grad_views] = np.iinfo(np.int64).min // 4
        return _PairMax(self._held_inner + self._inner_backward, pulled)

    @cached_property
    def _loss_grad(self) -> int:
        """The loss's own gradient (a scalar), alive through its stage's backward: what an inner
        layer's figure, whose output gradient autograd lets go, leaves out (0 where the
        profile has no such figure: each layer's then holds its own output's gradient)."""
        c = self.chain
        return int(c.boundary[-1]) if c.has_loss and c.inner_backward is not None else 0

    @cached_property
    def _inner_remat(self) -> _RangeMax:
        c = self.chain
        return _RangeMax(self._held + c.forward_transient + c.input_unsaved)

    @cached_property
    def _pairs_r(self) -> _PairMax:
        """A recomputed B's forward beside the gradient it pulled (pulled_with): a layer l's
        whole forward peak before a later layer m's output gradient, l < m (_ends_r: or m's
        beside its own)."""
        c = self.chain
        q = self._held + c.forward_transient + c.input_unsaved
        return _PairMax(q, c.zgrad.astype(np.int64))

    @cached_property
    def _ends_r(self) -> _RangeMax:
        c = self.chain
        return _RangeMax(self._held + c.forward_transient + c.input_unsaved + c.zgrad)

    @cached_property
    def _let_go_tables(self) -> dict:
        """_let_go_input_live's per-layer values and their maxima over ranges of layers."""
        c = self.chain
        n = c.num_layers
        kp = self._zkept
        # (a layer that hands its gradient on makes none: its output's bytes are counted as
        # the gradient the layer after it makes, the last layer's before it that makes one)
        through = c.hands_grad_on
        zg = np.where(through, c.kept_grad, c.zgrad).astype(np.int64)
        wz = c.let_go_grad.astype(np.int64)
        it = c.input_grad_transient.astype(np.int64)
        real = np.flatnonzero(~through)
        # made[l]: the layer whose output gradient l's I makes (Chain.gradient_made); nxt[i]:
        # the first layer from i that does not hand its input on
        made = c.gradient_made
        after = np.searchsorted(real, np.arange(n + 1), side="left")
        nxt = np.append(real, n)[after]
        shift = int(kp[-1])
        m = np.maximum(made, 0)
        a = it + wz + np.where(made >= 0, wz[m] - kp[m], 0) + shift
        # (a stage ending in layers that hand their input on pulls its last real layer's
        # gradient: those ends add no pair of their own, b = 0, and their pairs are that
        # layer's, already counted, the same KP)
        b = np.where(through, 0, wz + kp[1:])
        f = it + wz
        # last_real[e]: the last layer before e that does not hand its input on (-1: none)
        last_real = np.append(made, real[-1] if len(real) else -1)
        return {
            "nxt": nxt, "made": made, "last_real": last_real, "shift": shift, "b": _RangeMax(b), "f": _RangeMax(f),
            "alone": _RangeMax(it + zg), "fb": _PairMax(f, b), "ab": _PairMax(a, b),
            "a_end": _RangeMax(a + kp[1:]),
        }  # fmt: skip

    def _let_go_input_live(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """A chain's input_live where zero bubble's I lets gradients go (those of layers
        without weights that train, which Z leaves out), or where layers hand their input on.
        At layer l of the stage [i, e), on top of during_i (whose Z holds the kept gradients of
        layers i .. e - 1), I holds: its own output's gradient and the one it makes, its
        input's, where they are let go, and the one the stage pulled where its last layer lets
        it go: the runtime holds that to I's end, so it is alive at every l. The gradient l
        makes is that of the last layer before l that does not hand its input on (made[l]); the
        kept ones of the layers before that are not made yet, nor G. Where every layer from i
        to l - 1 hands its input on, what l makes is G itself (in during_i): l counts as the
        stage's first layer does.

        That stage may hold more than the stage one layer longer (which lets the pulled one
        go once its last layer's I is done), so input_live is the most over the ends e <= j
        of that transient with Z[i, e), less Z[i, j): the totals grow with the end. With KP
        the kept gradients' prefix sums, wz those let go, f[l] = it[l] + wz[l], a[l] = f[l] +
        wz[made[l]] - KP[made[l]] and b[m] = wz[m] + KP[m + 1], per end e = m + 1 and layer l,
        with t the first layer from i that does not hand its input on, that is
            i <= l = m <= t:     it[l] + zgrad[l]              (every layer before l hands on)
            i <= l <= t, l < m:  f[l] - KP[i] + b[m]
            t < l = m:           a[m] + KP[m + 1] - G
            t < l < m:           a[l] + b[m] - G
        less KP[j] - KP[i]. With nothing let go nor handed on, the largest end is the largest
        and t = i: the formula of input_live, with Z."""
        c = self.chain
        tables = self._let_go_tables
        kp = self._zkept
        shift = tables["shift"]
        g = c.grad_in[np.minimum(i, c.num_layers - 1)].astype(np.int64)
        t = np.minimum(tables["nxt"][i], j - 1)  # the last layer counted as a first one
        first = tables["alone"](i, t + 1) + kp[i]
        pairs = tables["fb"](i, t + 1)  # (0 where [i, t] has no two layers)
        beyond = t + 1 < j
        later_b = tables["b"](np.minimum(t + 1, j - 1), j)
        first = np.maximum(first, np.where(t > i, pairs, 0))
        first = np.maximum(first, np.where(beyond, tables["f"](i, t + 1) + later_b, 0))
        lo = np.minimum(t + 1, j - 1)
        ends = tables["a_end"](lo, j) - shift - g + kp[i]
        inner = np.where(beyond, ends, first)
        two = j - t > 2
        inner = np.where(two, np.maximum(inner, tables["ab"](lo, j) - shift - g + kp[i]), inner)
        return np.maximum(first, inner) - kp[j]

    @cached_property
    def _inner_input_live(self) -> _RangeMax:
        return _RangeMax(self._input_live_values)

    @cached_property
    def _weight_live(self) -> _RangeMax:
        return _RangeMax(self.chain.weight_grad_transient)

    @cached_property
    def _weight_shared(self) -> _RangeMax:
        """Layer l's W figure with what it saved that layer l + 1 of its stage shares, where
        l + 1 runs no W of its own (Chain.keeps_graph_through_w, Chain.w_beside): the figure was measured on the layer alone, whose W lets its saved
        tensors go as it runs, and that layer's graph holds those it shares until the stage's
        W ends (a captured convolution-and-ReLU before a pooling layer ran its ReLU output's
        bytes, 16-21%, over its plan under zero bubble: found by a red team). A layer l + 1
        with a W of its own has let them go by then: W runs from the last layer (convolution
        blocks, counted so, 2.6-6.1% under their plan)."""
        c = self.chain
        nxt, _ = c.w_beside()
        # (and the walk: what the layers after l let go before l's W, Chain.w_freed; read
        # as this at l less _w_freed[j] at the stage's end j)
        return _RangeMax(c.weight_grad_transient.astype(np.int64) + nxt + self._w_freed[1:])

    @cached_property
    def _weight_passed(self) -> _RangeMax | None:
        """_weight_shared's figure with, where l + 1 hands on a value l made, what l saved of it
        besides: a layer of the stage past l + 1 may save it too and keep its graph until the
        stage's W ends (read where l + 1 is not the stage's last layer). A tanh's output,
        handed on and read by a layer with no W: the profile's W let it go before the Linear
        under the tanh made its gradient, and the stage ran that output's bytes (1.2-1.4%)
        over its plan (found by a red team). None where no layer hands anything on."""
        c = self.chain
        if c.passes is None:
            return None
        nxt, passed = c.w_beside()
        return _RangeMax(c.weight_grad_transient + nxt + passed + self._w_freed[1:])

    @cached_property
    def _hands_on(self) -> bool:
        """Whether any layer hands its gradient on (Chain.hands_grad_on): asked once, not at
        every state_bytes call of the split search."""
        return bool(self.chain.hands_grad_on.any())

    @cached_property
    def _w_freed(self) -> np.ndarray:
        """Prefix sums of Chain.w_freed: [l] what layers 0 .. l - 1 let go at their W."""
        return _prefix(self.chain.w_freed)

    @cached_property
    def _inner_forward(self) -> _RangeMax:
        return _RangeMax(self.chain.forward_peak + self.chain.boundary[:-1])

    def _walk_table(self) -> np.ndarray:
        """_backward_live(i, k) for every start and end, counting the gradients that wait
        while a layer's backward runs (_b_waits: a tied parameter's part, a captured graph's
        inner skips). A captured graph's layer l's transient also counts no gradient of a
        value it hands on that no layer after it in the stage reads (the stage holds that one
        as pulled, or not at all); a chain's layer hands on only what the next one reads."""
        c = self.chain
        n = c.num_layers
        u = self._unread()
        b = c.backward_transient.astype(np.int64)
        inner = self._inner_backward
        held = self._held
        terms = np.full((n + 1, n + 1), np.iinfo(np.int64).min // 2, dtype=np.int64)
        for k in range(1, n + 1):
            terms[: k - 1, k] = held[: k - 1] + inner[: k - 1] - u[: k - 1, k]
            last = b[k - 1] - c.zgrad[k - 1] - u[k - 1, k]
            terms[k - 1, k] = held[k - 1] + max(int(last), 0)
        # the loss's own gradient (a scalar) stays alive through the stage's backward
        terms[: n - 1, n] += self._loss_grad
        walk = np.maximum.accumulate(terms[::-1], axis=0)[::-1]  # max over l >= i, per end
        waits = self._b_waits()
        if waits:  # per start, from the last: what the layers from there on make waits too
            waiting = np.zeros((n + 1, n + 1), dtype=np.int64)
            for i in range(max(waits), -1, -1):
                for lo, hi, first, past, w in waits.get(i, ()):
                    waiting[lo:hi, first:past] += w
                walk[i] = np.max(terms[i:] + waiting[i:], axis=0)
        ends = np.concatenate([[0], held])[None, :]
        if c.flow is None:  # (a chain's, the most over the stage's shorter ends: _ends_last)
            walk = np.maximum.accumulate(np.maximum(walk, ends), axis=1)
        walk = np.maximum(walk - ends, 0)
        walk.setflags(write=False)
        return walk

    def _unread(self) -> np.ndarray:
        """Flow.unread for a captured graph; none for a chain."""
        c = self.chain
        if c.flow is not None:
            return c.flow.unread()
        return np.zeros((c.num_layers + 1, c.num_layers + 2), dtype=np.int64)

    def late_walk(self, i: int, k: int, use: int, late: int, first: int = 0) -> int:
        """B's transient for a stage [i, k) in its first backward, where a gradient of `late`
        bytes (a tied copy's, StageBytes.late_grad) is made by layer `use`'s backward and
        stays: the walk of _walk_table for this stage, from the last layer, with those bytes
        on top once the walk has passed `use` (i < use < k), at least the re-materialising
        forward's (as `live`, which leaves them to `static`, there from the B's start). Or
        (use == i, the stage's first layer, which makes them inside its own backward) with
        `first` on top of that layer's figure, what keeping them adds to its peak
        (Chain.tied_first), and at least `late` (there at the B's end)."""
        c = self.chain
        assert self._walk is not None and i <= use < k and (use > i or first > 0)
        u = self._unread()
        b = c.backward_transient.astype(np.int64)
        held = self._held
        at = np.arange(i, k)
        vals = (held[at] + self._inner_backward[at] - u[at, k]).astype(np.int64)
        if k == c.num_layers:
            vals += self._loss_grad  # (as in _walk_table)
        vals[-1] = held[k - 1] + max(int(b[k - 1] - c.zgrad[k - 1] - u[k - 1, k]), 0)
        for start, entries in self._b_waits().items():  # (as the table's row i adds them)
            if start >= i:
                for lo, hi, since, past, w in entries:
                    if since <= k < past:
                        vals[max(lo, i) - i : max(min(hi, k), i) - i] += w
        below = int(held[k - 1])  # (the stage's activations: the walk counts what is above)
        remat = int(
            self.state_bytes(np.array([i]), np.array([k]), only={"remat_live"})["remat_live"][0]
        )
        if use == i:
            vals[0] += first
            live = int(self._backward_live(np.array([i]), np.array([k]))[0])
            return max(int(vals.max()) - below, late, remat, live)
        after = max(int(vals[use - i :].max()) - below, 0)  # (from the last layer to use)
        before = max(int(vals[: use - i].max()) - below, 0) + late
        return max(after, before, remat)

    def _b_waits(self) -> dict[int, list[tuple[int, int, int, int, int]]]:
        """What waits in B beside a layer's own figure, per start, as _tied_waits gives it: a
        tied parameter's gradient part, and an inner skip's gradient (_inner_skips)."""
        n = self.chain.num_layers
        waits = self._tied_waits()
        if self.chain.flow is None:
            return waits
        for born, last, w in (x for xs in self._inner_skips().values() for x in xs):
            waits.setdefault(born, []).append((born + 1, last, last + 2, n + 1, w))
        for born, a, b, w in self._received_sums():
            waits.setdefault(born, []).append((a, a + 1, a + 1, b + 1, w))
        for earlier, later, w in self._waiting_parts():
            waits.setdefault(earlier, []).append((later, later + 1, later + 2, n + 1, w))
        return waits

    @cached_property
    def _inner_backward(self) -> np.ndarray:
        """Each layer's backward transient inside a stage, before its last layer: its output's
        gradient, which the next layer's backward made, is autograd's alone and let go once
        the nodes that read it have run (Chain.inner_backward, measured so; a stage's last
        layer holds the gradient it pulled to the end: backward_transient). A last stage
        read one output gradient under its plan on convolution models (a helper's trace)."""
        c = self.chain
        b = c.backward_transient.astype(np.int64)
        if c.inner_backward is None:
            return b
        return c.inner_backward.astype(np.int64)

    def _waiting_parts(self) -> list[tuple[int, int, int]]:
        """Where an inner layer's backward still holds its output's gradient to the end: it reads
        a value that an earlier layer of the stage reads too, and its part of that value's
        gradient waits for the earlier one's. The part may be a view of the output's gradient
        (a concatenation's backward hands out slices), which keeps all of it: its whole
        backward_transient counts, for stages from the earlier reader or before. (earlier
        reader, later reader, what the layer's figure adds back)"""
        c = self.chain
        flow = c.flow
        assert flow is not None
        back = np.maximum(c.backward_transient.astype(np.int64) - self._inner_backward, 0)
        out: dict[int, int] = {}  # per later reader: its latest earlier reader
        for readers, g in zip(flow.readers, flow.grad):
            if g:
                for r, later in zip(readers, readers[1:]):
                    if back[later] > 0:
                        out[later] = max(out.get(later, -1), r)
        return [(r, later, int(back[later])) for later, r in out.items()]

    def _received_sums(self) -> list[tuple[int, int, int, int]]:
        """The gradients B adds up as a new tensor, beside the part a layer's backward made:
        of a value the stage makes and a later stage reads too, at the stage's last reader of
        it. The runtime holds the gradient it received, so autograd cannot add into it (a stage
        that makes a skip's source and reads it next ran one such tensor over its plan under
        GPipe and 1F1B: found by a review). The reader's profile measures what the sum adds
        to its backward (Chain.passed_sum: 0 where its backward peaked before); at most the
        value's gradient. Over where nothing but the reader's saved tensors holds the value
        and its backward lets it go before the sum is made (23% on a review's model). Not for
        a value the stage received and hands on: the runtime adds the two parts after B has
        returned, when the stage's saved tensors are gone (measured: exact). (made at, reader,
        next reader: the stage ends up to there, bytes)"""
        c = self.chain
        flow = c.flow
        assert flow is not None
        out = []
        for born, readers, w in zip(flow.born.tolist(), flow.readers, flow.nbytes * flow.grad):
            if w and born >= 0:
                for a, b in zip(readers, readers[1:]):
                    made = int(w) if c.passed_sum is None else min(int(c.passed_sum[a]), int(w))
                    if made:
                        out.append((born, a, b, made))
        return out

    def _inner_skips(self) -> dict[int, list[tuple[int, int, int]]]:
        """A captured graph's values whose gradient waits in B of a stage that makes them and
        reads them after the next layer (a skip inside the stage), per the layer that makes
        them: (made at, last read at, gradient bytes). In B of a stage [i, k) that makes one
        (i <= made) and reads it, last, before its last layer (last < k - 1), the read's
        backward makes the gradient, and it waits for the maker's backward while the layers
        between run: none of their own figures sees it (each was measured alone; a U-Net's
        middle device read 1.3% over its plan, found by a red team). Not one the stage
        received (where a measured run held nothing more), nor one its last layer reads (a
        part of the pulled gradient, which B holds anyway)."""
        c = self.chain
        flow = c.flow
        assert flow is not None
        n = c.num_layers
        out: dict[int, list[tuple[int, int, int]]] = {}
        for born, readers, w in zip(flow.born.tolist(), flow.readers, flow.nbytes * flow.grad):
            if w and len(readers) and born >= 0:
                last = int(max(readers))
                if born + 1 < last < n - 1:
                    out.setdefault(born, []).append((born, last, int(w)))
        return out

    def _tied_waits(self) -> dict[int, list[tuple[int, int, int, int, int]]]:
        """The parameters that two layers of one stage use (tied weights, an
        embedding and the output head): in B (and zero bubble's I, which makes such a
        parameter's gradient), the later use's backward makes its part of the gradient, and
        autograd keeps it apart until the earlier use's backward adds the other part: it
        waits while the layers between run. None of the layers' own figures sees it (each was
        measured alone; found by a red team, a run 21.8% over its plan with both uses on one
        device). The first such sum, at the stage's last two uses, may be made apart, a
        third tensor (a head's part is a transposed view, which autograd cannot add into);
        later ones add into that sum.

        Per start (the earlier use: a stage from there or before), what waits: (first layer,
        the layer after the last, first end, the end after the last, bytes), as the walk's
        rows and columns take them."""
        n = self.chain.num_layers
        out: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for k, (nbytes, layers) in enumerate(self.chain.tied):
            if k in self.chain.frozen_tied:  # (no gradient)
                continue
            uses = sorted(set(layers))
            after = [*uses[2:], n]  # per pair, the next use (past it, the stage's last pair)
            first = self.chain.tied_first
            for a, b, c in zip(uses, uses[1:], after):
                w = int(nbytes)
                out.setdefault(a, []).append((a, b, b + 1, n + 1, w))
                out[a].append((a, a + 1, b + 1, c + 1, w))  # (the sum at a, made apart)
                if first is not None and first[b] > 0:  # (made before b's own peak: there too)
                    out[a].append((b, b + 1, b + 1, n + 1, min(int(first[b]), w)))
        return out

    def _flow_input_table(self) -> np.ndarray:
        """A captured graph's input_live(i, j) for every start and end: I's layer l runs on
        top of every gradient the stage keeps but those of the values its layers i .. l - 2
        make and only layers before l read (not made yet: I goes from the last layer); each
        layer's at most its zgrad (what the stage counts for it)."""
        c = self.chain
        flow = c.flow
        assert flow is not None
        n = c.num_layers
        # absent[b, l]: the gradient bytes of what layer b makes that no layer from l on reads
        absent = np.zeros((n + 1, n + 2), dtype=np.int64)
        for b, e, w in zip(flow.born.tolist(), flow.last.tolist(), flow.nbytes * flow.grad):
            if w and 0 <= b < n and e >= 0:
                absent[b, min(e + 1, n + 1)] += w
        absent = np.minimum(absent.cumsum(axis=1)[:n, : n + 1], c.zgrad[:, None])
        # gone[i, l] = sum over b in [i, l - 2] of absent[b, l]
        below = np.concatenate([np.zeros((1, n + 1), dtype=np.int64), absent.cumsum(axis=0)])
        layer = np.arange(n + 1)
        top = below[np.clip(layer - 1, 0, n), layer]  # sum over b <= l - 2, per l
        gone = np.maximum(top[None, :] - below[:, :], 0)  # [i, l]: b from i to l - 2
        it = c.input_grad_transient.astype(np.int64)
        at = np.full((n + 1, n + 1), np.iinfo(np.int64).min // 2, dtype=np.int64)
        # (and the gradients I lets go of what layers i .. l make, not yet taken)
        let_go = np.maximum(self._let_go[None, 1:] - self._let_go[:, None], 0)  # [i, l]
        at[:, :n] = it[None, :] - gone[:, :n] + let_go
        rows = np.arange(n)
        at[rows, rows] = it + let_go[rows, rows]  # the stage's first layer: nothing before it
        at = np.triu(at) + np.tril(np.full_like(at, np.iinfo(np.int64).min // 2), -1)
        table = self._each_end(at)
        waits = self._tied_waits()
        if waits:  # a tied parameter's gradient, which zero bubble's I makes, waits as in B's
            waiting = np.zeros((n + 1, n + 1), dtype=np.int64)
            before = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # [l, j]: l < j
            pulled = self._pulled_let_go()
            for i in range(max(waits), -1, -1):
                for lo, hi, first, past, w in waits.get(i, ()):
                    waiting[lo:hi, first:past] += w
                # table[i, j] = max over i <= l < j of at[i, l] + waiting[l, j]
                held = np.where(
                    before[i:],
                    at[i, i:, None] + waiting[i:] + pulled[i:],
                    np.iinfo(np.int64).min // 2,
                )
                table[i, i + 1 :] = np.maximum(table[i, i + 1 :], held.max(axis=0)[i + 1 :])
        table = self._grown(np.where(np.triu(np.ones_like(table, dtype=bool), 1), table, 0))
        # The sum is counted on top of the layers' peaks. Where the value's other readers are
        # a layer of the next stage, autograd makes it once the reader's I has returned, so
        # this is over (12% on a convolution chain with a concatenated skip); where two of
        # them are there, it is alive while an earlier layer's I works, and counting it beside
        # the peaks was 10% under (both found by a sweep and a review). The safe side is kept.
        table = table + self._flow_summed()
        table.setflags(write=False)
        return table

    def _chain_input_table(self) -> np.ndarray:
        """A chain's input_live(i, j) for every start and end, with a tied parameter's parts
        waiting in I as in B (_tied_waits): state_bytes' formula (layer l's I on top of the
        gradients the stage keeps, less those of layers i .. l - 2, not made yet, and of its
        input, made last) per layer, each with what waits while it runs."""
        c = self.chain
        n = c.num_layers
        it = c.input_grad_transient.astype(np.int64)
        low = np.iinfo(np.int64).min // 2
        rows = np.arange(n + 1)[:, None]  # i
        cols = np.arange(n)[None, :]  # l
        # (as _let_go_input_live: l makes the gradient of made[l], the last layer before it
        # that does not hand its input on; where that lies before i, G itself, in during_i,
        # and l counts as the first layer does; the gradients I lets go, not in Z, beside it)
        made = self._let_go_tables["made"][None, :]
        wz = c.let_go_grad.astype(np.int64)
        kp = self._zkept
        m = np.maximum(made, 0)
        inside = it[None, :] + wz[None, :] + wz[m] - (kp[m] - kp[np.minimum(rows, n)])
        inside = inside - c.grad_in[np.minimum(rows, n - 1)].astype(np.int64)
        inside = np.where(made >= rows, inside, it[None, :] + wz[None, :])
        at = np.full((n + 1, n + 1), low, dtype=np.int64)
        at[:, :n] = np.where(cols >= rows, inside, low)
        table = np.maximum(self._each_end(at), 0)
        waits = self._tied_waits()
        before = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # [l, j]: l < j
        if waits:  # (a stage from past every earlier use holds no part waiting)
            waiting = np.zeros((n + 1, n + 1), dtype=np.int64)
            pulled = self._pulled_let_go()
            for i in range(max(waits), -1, -1):
                for lo, hi, first, past, w in waits.get(i, ()):
                    waiting[lo:hi, first:past] += w
                held = np.where(before[i:], at[i, i:, None] + waiting[i:] + pulled[i:], low)
                table[i] = np.maximum(held.max(axis=0), 0)
        table = self._grown(np.where(before, table, 0))
        table.setflags(write=False)
        return table

    def _pulled_let_go(self) -> np.ndarray:
        """[l, e]: the gradient the stage [., e) pulled, where its last real layer r
        (_let_go_tables) lets it go (wz[r]), alive while I runs at an earlier layer l < r (the
        runtime holds it to I's end); 0 elsewhere (from r on it is a layer's own or the one
        the layer makes, which `at` counts)."""
        n = self.chain.num_layers
        wz = self.chain.let_go_grad.astype(np.int64)
        r = self._let_go_tables["last_real"][1:]  # per e - 1
        out = np.zeros((n + 1, n + 1), dtype=np.int64)
        out[:, 1:] = np.where(r >= 0, wz[np.maximum(r, 0)], 0)[None, :]
        rows = np.arange(n + 1)[:, None]
        return np.where(rows < np.append(-1, r)[None, :], out, 0)

    def _each_end(self, at: np.ndarray) -> np.ndarray:
        """table[i, e] = max over i <= l < e of at[i, l], with the pulled gradient the stage
        lets go (its last real layer r's, _let_go_tables) beside every l < r; `at` is very low
        where l < i."""
        n = self.chain.num_layers
        low = np.iinfo(np.int64).min // 2
        running = np.maximum.accumulate(at, axis=1)  # [i, l]: max over l' <= l
        wz = self.chain.let_go_grad.astype(np.int64)
        r = self._let_go_tables["last_real"][1:]  # per e - 1 = 0 .. n - 1
        before_r = np.where(r >= 1, running[:, np.maximum(r - 1, 0)], low)  # [i, e - 1]
        table = np.zeros((n + 1, n + 1), dtype=np.int64)
        table[:, 1:] = np.maximum(
            before_r + np.where(r >= 0, wz[np.maximum(r, 0)], 0), running[:, :n]
        )
        return table

    def _grown(self, table: np.ndarray) -> np.ndarray:
        """table[i, j] raised to the most over the ends i < e <= j of table[i, e] + Z[i, e),
        less Z[i, j) (Z: the kept gradients): a stage whose last layer lets its pulled gradient
        go may hold more in I than the stage one layer longer (_let_go_input_live). Unchanged
        where nothing is let go."""
        if not self._let_go[-1]:
            return table
        n = self.chain.num_layers
        kp = self._zkept
        low = np.iinfo(np.int64).min // 2
        later = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # [i, e]: e > i
        with_z = np.where(later, table + kp[None, :], low)
        return np.where(later, np.maximum.accumulate(with_z, axis=1) - kp[None, :], 0)

    def _flow_summed(self) -> np.ndarray:
        """Per start and end: the largest gradient that I adds up from two or more parts
        inside the stage (a value two of its layers read, or one it makes, reads and sends
        on): autograd makes a new buffer for the sum, beside the part it had. None of the
        layers' own figures sees it (each was measured alone). Read from the first reader
        at or after the start that leaves another reader after it; it grows with the end."""
        c = self.chain
        flow = c.flow
        assert flow is not None
        n = c.num_layers
        marks = np.zeros((n + 1, n + 1), dtype=np.int64)
        starts = np.arange(n)
        for born, readers, w in zip(flow.born.tolist(), flow.readers, flow.nbytes * flow.grad):
            if not w or len(readers) < 2:
                continue
            r = np.asarray(readers, dtype=np.int64)
            a = np.searchsorted(r, starts)  # the first reader at or after each start
            two = len(r) - a >= 2
            # made inside (start <= born): from its first reader on (a reader after the
            # stage sends its part back); made before: once two of its readers are inside
            first = np.where(starts <= born, r[0], r[np.minimum(a + 1, len(r) - 1)]) + 1
            rows = starts[two & (first <= n)]
            cols = first[two & (first <= n)]
            np.maximum.at(marks, (rows, cols), int(w))
        return np.maximum.accumulate(marks, axis=1)

    def _check_pulled(self, shape: StageShape) -> None:
        if self.chain.flow is not None and (t := _pulled_outside_b(shape.occupancy)) is not None:
            raise ValueError(f"occupancy {t} holds a pulled gradient outside B")

    def _flow_pulled(self, tight: bool = False) -> np.ndarray:
        """A captured graph's pulled gradient for every start and end: what the stage sends,
        raised only as far as its total must grow with the end. B holds it together with its
        micro-batch's activations and its own transient (_check_pulled holds every tuple to
        that), so the three together take the largest over the stage's shorter ends, not the
        pulled gradient alone (a stage ending just after a large skip's reader sends less than
        a shorter one would: counted as sent, where the activations and B's walk make up for
        the difference). `tight`: where no B re-materialises first (no recomputation), with
        B's own transient alone (live_flow_tight), not the larger of it and the forward's."""
        found = self._flow_pulled_tables.get(tight)
        if found is None:
            c = self.chain
            n = c.num_layers
            i, k = np.triu_indices(n + 1, 1)
            i, k = i[i < n], k[i < n]
            live = "live_flow_tight" if tight else "live"
            b = self.state_bytes(i, k, only=frozenset({"activations", live}))
            with_b = b["activations"] + b[live]
            joint = np.full((n + 1, n + 1), np.iinfo(np.int64).min // 2, dtype=np.int64)
            joint[i, k] = c.flow.sending(c.zgrad)[i, k] + with_b  # type: ignore[union-attr]
            joint = np.maximum.accumulate(joint, axis=1)
            table = np.zeros((n + 1, n + 1), dtype=np.int64)
            table[i, k] = joint[i, k] - with_b
            table.setflags(write=False)
            found = self._flow_pulled_tables[tight] = table
        return found

    @cached_property
    def _sent_sums(self) -> np.ndarray:
        """A captured graph's recomputed B, per start and end: the gradient of each value the
        stage makes that two or more layers after it read. The gradients it gets back for such
        a value are added up as B begins (the runtime holds the parts: a new tensor), and the
        sum lives through the re-materialising forward, which the layers' figures do not see
        (a dense block's first stage ran 16.7% over its plan, found by a sweep). Counted where
        two readers lie past the end, though both may be in one later stage (then over), and
        the largest over the shorter ends (totals grow with the end)."""
        c = self.chain
        flow = c.flow
        assert flow is not None
        n = c.num_layers
        corners = np.zeros((n + 2, n + 2), dtype=np.int64)
        for born, readers, w in zip(flow.born.tolist(), flow.readers, flow.nbytes * flow.grad):
            if w and born >= 0 and len(readers) >= 2 and readers[-2] > born:
                # starts up to the maker, ends past it up to the second-to-last reader
                corners[0, born + 1] += w
                corners[0, readers[-2] + 1] -= w
                corners[born + 1, born + 1] -= w
                corners[born + 1, readers[-2] + 1] += w
        table = corners.cumsum(axis=0).cumsum(axis=1)[: n + 1, : n + 1]
        table = np.maximum.accumulate(np.triu(table, 1), axis=1)
        table.setflags(write=False)
        return table

    def _backward_live(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """The most B holds above the stage's activations, layer by layer from the last: layer
        l's backward transient, less what the layers after it saved and have let go by then;
        the last one's without its output gradient, which the stage holds as `pulled` (zgrad
        says where one is pulled)."""
        if self._walk is not None:
            return self._walk[i, j]
        # a stage ending in layers whose input gradient is a view of their output's holds what
        # the stage ending before them holds: the layer before gets the pulled gradient (with
        # that layer's own counted apart, the flatten model's middle device was planned 8.8%
        # above what it held under GPipe)
        b = np.maximum(self._views_run[j], i + 1)
        inner = self._backward(i, np.maximum(b - 1, i + 1))
        inner = inner + np.where(j == self.chain.num_layers, self._loss_grad, 0)
        most = np.maximum(np.where(b - i > 1, inner, 0), self._ends_last(i, j))
        return np.maximum(most - self._held_b[j - 1], 0)

    @cached_property
    def _views_run(self) -> np.ndarray:
        return self.chain.views_run

    @cached_property
    def _ends_last(self) -> _RangeMax:
        """A chain's B as if each layer ended the stage (its output gradient held to the end,
        less the pulled part): `live` takes the most over the stage's shorter ends too, so that
        a stage's total never shrinks as it takes another layer (an inner layer's figure,
        whose output gradient autograd lets go, may be below its own as the last one's; the
        split's exactness rests on totals that grow with the end)."""
        return _RangeMax(self._held_b + self._last_backward)

    def input_saved(
        self, i: np.ndarray | int, j: np.ndarray | int, model_only: bool = False
    ) -> np.ndarray:
        """The part of the stage [i, j)'s input that its layers save (Xs, before the cap at X):
        its first layer's, or, where that layer and those after it only make views of the input
        (Chain.views), the most any layer through the first that does not saves of its own
        input, a view of the stage's (a transpose, then a convolution: the stage holds the
        input once, where it was counted twice: 38% over on a review's model), less what it
        shares with a layer before (_alias_saved: `shared` has taken that off already).
        `model_only`: the loss past the views left out (what W's graph keeps)."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        c = self.chain
        own = c.input_saved[i].astype(np.int64)
        if c.views is None:
            return own
        last = np.minimum(self._views_end[i], j - 1)
        if model_only:
            last = np.minimum(last, c.num_model_layers - 1)
        after = self._alias_saved(np.minimum(i + 1, last), np.maximum(last + 1, i + 1))
        return np.maximum(own, np.where(last > i, after, 0))

    @cached_property
    def _views_end(self) -> np.ndarray:
        """Per layer l, the first layer from l on that is no view (Chain.views): its input is
        still a view of l's."""
        views = self.chain.views
        assert views is not None
        end = np.arange(self.chain.num_layers, dtype=np.int64)
        for k in range(len(end) - 2, -1, -1):
            if views[k]:
                end[k] = end[k + 1]
        return end

    @cached_property
    def _alias_saved(self) -> _RangeMax:
        """What each layer saves of its input beyond what it shares with those before it (a
        flatten's output a linear layer saves, that the ReLU before the flatten saved too, is
        in `shared`: a stage opening at the flatten takes it off its saved bytes already, and
        ran 460 bytes over its plan where it was taken off the input too)."""
        c = self.chain
        return _RangeMax(np.maximum(c.input_saved - c.shared, 0))

    def _ranges(self, i: np.ndarray, j: np.ndarray) -> tuple[_Spots, _Spots, np.ndarray]:
        """The table spots of [i, j) and of (i, j) (the layers after the first), and where
        the latter has any: what state_bytes' range maxima share (every table is n wide)."""
        after = self._largest.spots(np.minimum(i + 1, j - 1), j)
        return self._largest.spots(i, j), after, j - i > 1

    def inputs(
        self, i: np.ndarray, j: np.ndarray, start: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per micro-batch, for stages [i, j): what it receives (X), the part with a gradient
        (G), and of each the part sent from before `start`, the previous stage's first layer
        (early E, late: unknown start: i - 1, which counts at least as much). A chain receives
        boundary[i]; a captured graph only the values its layers read (routing.py); stage 0
        the model's input (its own copy, or the caller's: Chain.borrowed_input)."""
        c = self.chain
        if c.flow is None:
            x = c.boundary[i].astype(np.int64)
            return x, c.grad_in[i].astype(np.int64), np.zeros_like(x), np.zeros_like(x)
        first = i == 0
        x = np.where(first, c.boundary[0], c.flow.recv(i, j)).astype(np.int64)
        g = np.where(first, 0, c.flow.recv_grad(i, j)).astype(np.int64)
        before = i - 1 if start is None else np.asarray(start, dtype=np.int64)
        early = np.where(first, 0, c.flow.far(before, i, j)).astype(np.int64)
        late = np.where(first, 0, c.flow.far(before, i, j, grad=True)).astype(np.int64)
        return x, g, early, late

    def state_bytes(
        self,
        i: np.ndarray | int,
        j: np.ndarray | int,
        start: np.ndarray | int | None = None,
        only: frozenset[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Per micro-batch, for stages [i, j): the bytes of each state, `live`, and the parts
        (`saved` S, `loss` its share from the loss function, `z` Z) the breakdown reports.
        `start`: the previous stage's first layer, where known (what arrives early). `only`:
        just these entries (the partition's hot path asks for those its occupancies count)."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        c = self.chain
        out: dict[str, np.ndarray] = {}

        def want(*names: str) -> bool:
            return only is None or not only.isdisjoint(names)

        if want(
            "input", "activations", "during_i", "between_iw", "grad", "early", "late",
            "input_saved",
        ):  # fmt: skip
            x, g, early, late = self.inputs(i, j, None if start is None else np.atleast_1d(start))
            xs = np.minimum(self.input_saved(i, j), x)
            # stage 0 on the caller's own micro-batch (Chain.borrowed_input): not the
            # pipeline's to hold, nor the part of it the first layer saves
            lent = (i == 0) & c.borrowed_input
            x = np.where(lent, 0, x) if c.borrowed_input else x
            out.update(input=x, grad=g, early=early, late=late, input_saved=xs)
        if want(
            "activations", "during_i", "between_iw", "saved", "z", "skips", "loss"
        ):  # fmt: skip
            saved = self._saved[j] - self._saved[i] - (self._shared[j] - self._shared[i + 1])
            z = self._zkept[j] - self._zkept[i]
            if c.last_grad:
                z = z + np.where(j == c.num_layers, c.last_grad, 0)
            skips = 0 if c.flow is None else c.flow.passing(i, j)
            loss = self._loss[j] - self._loss[i]
            out.update(saved=saved, z=z, skips=np.broadcast_to(skips, i.shape), loss=loss)
            if want("activations", "during_i"):
                out["activations"] = x + saved - xs
            if want("during_i"):
                out["during_i"] = out["activations"] + z + g + skips
            if want("between_iw"):
                # the graph kept for W holds the input too, when it needs a gradient (the
                # loss's graph goes with I: W starts from the last layer's output gradient)
                # (what the loss alone saves of it, through views, goes with I too: the
                # graph the views made holds it still)
                xw = xs
                if c.has_loss and c.views is not None:
                    xw = np.minimum(self.input_saved(i, j, model_only=True), xs)
                iw = saved - loss + z + np.where(g > 0, x - xw, 0)
                # (stage 0 on the caller's micro-batch: what its model layers save of it is
                # not the pipeline's; the loss's part went with `loss` already)
                out["between_iw"] = iw - np.where(lent, xw, 0) if c.borrowed_input else iw
        whole, after, inner = self._ranges(i, j)
        if want("pulled"):
            pulled = self._pulled.take(whole) if c.flow is None else self._flow_pulled()[i, j]
            out["pulled"] = pulled
        if c.flow is not None and want("pulled_flow_tight"):
            out["pulled_flow_tight"] = self._flow_pulled(tight=True)[i, j]
        if want(
            "live", "remat_live", "stop_live", "pulled_tight", "pulled_paired", "live_flow_tight"
        ):
            remat = np.where(inner, self._inner_remat.take(after), 0)
            remat = np.maximum(self._first_remat[i], remat)
            # above the stage's activations, all saved by the end
            out["remat_live"] = remat = remat - self._held[j - 1]
            # (B re-materialises by hand at its start: the stage's whole forward; a captured
            # graph's beside the gradients later stages send back for one value it makes)
            stop = remat
            if c.flow is not None and want("stop_live"):  # (its table only where asked for)
                stop = stop + self._sent_sums[i, j]
            out["stop_live"] = stop
            if want("live", "pulled_tight", "pulled_paired", "live_flow_tight"):
                # a captured graph's pulled gradient is raised so that it grows with the
                # stage's end together with B's transient (_flow_pulled): that transient covers
                # the re-materialising forward a recomputed B holds it through too
                live = self._backward_live(i, j)
                out["live"] = live if c.flow is None else np.maximum(remat, live)
                if c.flow is not None:  # (B's own, where no B re-materialises: _flow_pulled)
                    out["live_flow_tight"] = live
            # A chain's B holds the gradient it pulled, its micro-batch's activations and its
            # transient, as much as the most any stage from i ending at k <= j holds so (the
            # largest backward of a layer l < k, on what layers i .. l saved, beside k - 1's
            # output gradient; or k - 1's own backward). `top` is that whole counted from
            # layer 0 (as held is): less held[j - 1] and B's transient, the pulled gradient.
            if want("pulled_tight", "pulled_paired") and self._walk is None:
                # (above the stage's activations: B's walk from held_b)
                top = np.maximum(self._ends_b.take(whole), self._pairs_b(i, j))
                top = top - self._held_b[j - 1]
                if want("pulled_tight"):
                    out["pulled_tight"] = top - out["live"]
                if want("pulled_paired"):
                    # and a recomputed B's forward: a layer l's whole peak (the first layer's
                    # without its input) beside the output gradient of a later layer m, or
                    # m's beside its own (the stage ending at m + 1)
                    later = self._pulled(np.minimum(i + 1, j - 1), j)
                    first = self._first_remat[i] + later
                    ends = np.maximum(self._pairs_r(i + 1, j), self._ends_r.take(after))
                    forward = np.maximum(first, ends)
                    own = self._first_remat[i] + self._zgrad[i + 1] - self._zgrad[i]
                    forward = np.maximum(own, np.where(inner, forward, 0)) - self._held[j - 1]
                    both = np.maximum(out["live"], stop)
                    out["pulled_paired"] = np.maximum(top, forward) - both
        if want("input_live") and self._flow_input_live is not None:
            out["input_live"] = self._flow_input_live[i, j]
        elif want("input_live"):
            if self._let_go[-1] or self._hands_on:
                out["input_live"] = self._let_go_input_live(i, j)
            else:
                later = self._inner_input_live.take(after) - self._zgrad[-1] + self._zgrad[i]
                # (the stage's input gradient G, which during_i counts, is made last, by the
                # first layer's I: an inner layer's I runs before it exists)
                later = later - self.chain.grad_in[i].astype(np.int64)
                first = self._first_input_live[i]
                out["input_live"] = np.maximum(first, np.where(inner, later, 0))
        if want("input_live"):
            # a parameter two of the stage's layers share takes its gradient in I (the
            # runtime's W would reach it through both): its temporary, on top
            for nbytes, before in self._tied_grads:
                both = before[j] - before[i] > 1
                out["input_live"] = out["input_live"] + np.where(both, nbytes, 0)
        if want("weight_live"):
            # (the last layer's shares with no layer of the stage)
            own = self._weight_live(np.maximum(j - 1, i), j)
            shared = self._weight_shared(i, np.maximum(j - 1, i + 1)) - self._w_freed[j]
            out["weight_live"] = np.maximum(own, np.where(j - i > 1, shared, 0))
            if self._weight_passed is not None:  # (and hands on to a layer past the next)
                passed = self._weight_passed(i, np.maximum(j - 2, i + 1)) - self._w_freed[j]
                out["weight_live"] = np.maximum(out["weight_live"], np.where(j - i > 2, passed, 0))
        if want("forward_live"):
            forward = np.where(inner, self._inner_forward.take(after), 0)
            out["forward_live"] = np.maximum(self._forward_peak[i], forward)
        if only is not None and "largest" in only:  # (for the partition: optimizer_step())
            out["largest"] = (
                self._largest.take(whole) if self._step is None else self.step_size(i, j)
            )
        return out if only is None else {k: out[k] for k in only}

    def stage_bytes(
        self,
        i: int,
        j: int,
        shape: StageShape,
        start: int | None = None,
        *,
        known: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
    ) -> StageBytes:
        """The stage [i, j) as the simulator's StageBytes. `known`: its state_bytes and terms,
        where the caller has them already."""
        states, terms = known or (self.state_bytes(i, j, start), self.terms(i, j, shape, start))
        b = self._keyed({k: int(v[0]) for k, v in states.items()}, shape)
        static = sum(int(terms[k][0]) for k in ("params", "grads", "optimizer", "workspace"))
        step = int(terms["optimizer_step_size"][0])
        head, tail = self.step_ends(i, j)
        return StageBytes(
            **{name: b[name] for name in STATES + TRANSIENTS},
            optimizer_step=step,
            foreach=shape.foreach,
            static=static,
            **_step_ends_bytes(shape, int(head[0]), int(tail[0])),
            runtime=shape.runtime,
        )

    def stages_bytes(
        self, i: np.ndarray, j: np.ndarray, shapes: Sequence[StageShape]
    ) -> list[StageBytes]:
        """stage_bytes of a chain's stages [i[s], j[s]) under shapes[s], their states worked
        out together (what a chain's stage receives does not depend on the one before it)."""
        if self.chain.flow is not None:
            raise ValueError("a captured graph's stages receive what the one before them sent")
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        states = {k: v.tolist() for k, v in self.state_bytes(i, j).items()}
        p, g = self.params(i, j), self.grads(i, j)
        # terms(): params and buffers, grads, optimizer slots (beside its workspace)
        weights = (p + g + self._buffers[j] - self._buffers[i]).tolist()
        own = g - self.copied(i, j)
        slots = own.tolist()
        one = not all(s.foreach for s in shapes)
        sizes = {True: own, False: _stepped(own, self.step_size(i, j)) if one else own}
        heads, tails = self.step_ends(i, j)
        out = []
        for s, shape in enumerate(shapes):
            if shape.bound:
                raise ValueError("a bound on the occupancy has no breakdown; use the occupancy")
            self._check_pulled(shape)
            b = self._keyed({k: v[s] for k, v in states.items()}, shape)
            step = int(np.ceil(shape.optimizer_step * sizes[shape.foreach][s]))
            out.append(StageBytes(
                **{name: b[name] for name in STATES + TRANSIENTS},
                optimizer_step=step,
                foreach=shape.foreach,
                static=weights[s] + shape.optimizer_slots * slots[s] + shape.reserved,
                **_step_ends_bytes(shape, int(heads[s]), int(tails[s])),
                runtime=shape.runtime,
            ))  # fmt: skip
        return out

    def terms(
        self,
        i: np.ndarray | int,
        j: np.ndarray | int,
        shape: StageShape,
        start: np.ndarray | int | None = None,
        states: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The breakdown for stages [i, j) (j > i) at the stage's worst moment, in bytes
        (`states`: their state_bytes, where the caller has them)."""
        if shape.bound:
            raise ValueError("a bound on the occupancy has no breakdown; use the occupancy")
        self._check_pulled(shape)
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        p, g = self.params(i, j), self.grads(i, j)
        b = self.state_bytes(i, j, start) if states is None else states
        b = self._keyed(b, shape)
        best = np.full(i.shape, -1, dtype=np.int64)
        parts = {k: np.zeros(i.shape, dtype=np.int64) for k in ("stash", "grad", "live", "loss")}
        z, pulled = b["z"], b["pulled"]
        for t in shape.occupancy:
            n_in, n_act, n_di, n_iw, n_grad, n_pulled, n_early, n_late = t[: len(STATES)]
            stash = n_in * b["input"] + (n_act + n_di) * b["activations"] + n_early * b["early"]
            stash = stash + n_iw * (b["between_iw"] - z)  # (its gradients are in grads)
            grads = (n_di + n_iw) * z + n_di * (b["grad"] + b["skips"]) + n_grad * b["grad"]
            grads = grads + n_pulled * pulled + n_late * b["late"]
            live = sum(on * b[name] for on, name in zip(t[len(STATES) :], TRANSIENTS))
            total = stash + grads + live
            better = total > best
            best = np.where(better, total, best)
            loss = (n_act + n_di) * b["loss"]
            for key, value in (("stash", stash), ("grad", grads), ("live", live), ("loss", loss)):
                parts[key] = np.where(better, value, parts[key])
        step = self.optimizer_step(i, j, shape)
        # the optimizer step, after the pipeline (and the runtime's hold), is the worst moment
        at_step = step > best + shape.runtime
        zero = np.zeros(i.shape, dtype=np.int64)
        return {
            "params": p + self._buffers[j] - self._buffers[i],
            "grads": g,
            "optimizer": shape.optimizer_slots * (g - self.copied(i, j)),
            "stashed_activations": np.where(at_step, zero, parts["stash"] - parts["loss"]),
            "loss": np.where(at_step, zero, parts["loss"]),
            "gradient_buffers": np.where(at_step, zero, parts["grad"]),
            "live_activations": np.where(at_step, zero, parts["live"]),
            "optimizer_step": np.where(at_step, step, zero),
            "runtime": np.where(at_step, zero, shape.runtime),
            "workspace": np.full(i.shape, shape.reserved, dtype=np.int64),
            "optimizer_step_size": step,
        }

    def _pulled_key(self, shape: StageShape) -> str:
        """Which pulled gradient a shape's stages count (pulled_with)."""
        if self.chain.flow is not None and not shape.bound:
            # a captured graph's: with B's own transient where no B re-materialises first
            tight = pulled_with(shape.occupancy) == "pulled_tight"
            return "pulled_flow_tight" if tight else "pulled"
        if self._walk is not None or shape.bound:  # (B walked: what waits in it is not in
            return "pulled"  # the tables pulled_tight and pulled_paired read)
        return pulled_with(shape.occupancy)

    def _keyed(self, b: dict, shape: StageShape) -> dict:
        """state_bytes `b` as `shape` counts them: with its pulled gradient."""
        return self._with_key(b, self._pulled_key(shape))

    @staticmethod
    def _with_key(b: dict, key: str) -> dict:
        """state_bytes `b` as a shape whose pulled gradient is `key` counts them: a captured
        graph's tight one comes with B's own transient as `live` (_flow_pulled)."""
        out = dict(b)
        out["pulled"] = b[key]
        if key == "pulled_flow_tight" and "live_flow_tight" in b:
            out["live"] = b["live_flow_tight"]
        return out

    @staticmethod
    def _key_states(key: str) -> set[str]:
        """The state_bytes entries a shape whose pulled gradient is `key` reads for it."""
        return {key, "live_flow_tight"} if key == "pulled_flow_tight" else {key}

    def optimizer_step(
        self, i: np.ndarray | int, j: np.ndarray | int, shape: StageShape
    ) -> np.ndarray:
        """The temporaries of one optimizer step over the stage's parameters: not those whose
        state another stage keeps (copied(): the streams program steps a tied weight once, as
        the model's own parameter), found by a sweep: an interleaved device whose one tied copy
        was charged its step, 8.7% over."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        own = self.grads(i, j) - self.copied(i, j)
        size = _stepped(own, None if shape.foreach else self.step_size(i, j))
        return np.ceil(shape.optimizer_step * size).astype(np.int64)

    def total(self, i: np.ndarray | int, j: np.ndarray | int, shape: StageShape) -> np.ndarray:
        """What terms() adds up, without the breakdown: the hot path of the partition search."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        return self._totals(i, j, [shape], np.array([0, len(i)]))

    def _totals(
        self,
        i: np.ndarray,
        j: np.ndarray,
        shapes: list[StageShape],
        cut: np.ndarray,
        states: dict[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """total() of [i, j) for many shapes at once: entries cut[g]:cut[g + 1] are shape g's.
        The bytes of each state depend on the layers alone, so they are computed once for all,
        and only those some shape's occupancy counts (`states`: all of them, and `largest`,
        where the caller has them for [i, j))."""
        names = STATES + TRANSIENTS
        counted = np.zeros(len(names), dtype=bool)
        for shape in shapes:
            counted |= _counted(shape.occupancy)
            self._check_pulled(shape)
        cols = np.flatnonzero(counted)
        each = all(sh.foreach for sh in shapes)
        keys = [self._pulled_key(shape) for shape in shapes]
        wanted = frozenset(names[k] for k in cols) | (set() if each else {"largest"})
        if counted[PULLED]:
            wanted |= set().union(*(self._key_states(k) for k in keys))
        b = self.state_bytes(i, j, only=wanted) if states is None else states
        values = np.empty((len(cols), len(i)), dtype=np.int64)
        for row, k in enumerate(cols):
            values[row] = b[names[k]]
        pulled_row = int(np.searchsorted(cols, PULLED))
        p, trained, copied = self.params(i, j), self.grads(i, j), self.copied(i, j)
        largest = None if each else b["largest"]
        out = np.empty(len(i), dtype=np.int64)
        for g, shape in enumerate(shapes):
            lo, hi = int(cut[g]), int(cut[g + 1])
            if lo == hi:
                continue
            occ = np.asarray(shape.occupancy, dtype=np.int64)[:, cols]
            mine = np.maximum(values[:, lo:hi], 0) if shape.bound else values[:, lo:hi]
            if keys[g] != "pulled" and counted[PULLED]:
                mine = mine.copy()
                mine[pulled_row] = b[keys[g]][lo:hi]
                if keys[g] == "pulled_flow_tight" and counted[N_STATES]:  # (and its live)
                    mine[int(np.searchsorted(cols, N_STATES))] = b["live_flow_tight"][lo:hi]
            held = _most(occ, mine)
            own = trained[lo:hi] - copied[lo:hi]
            size = _stepped(own, None if shape.foreach else largest[lo:hi])  # type: ignore[index]
            step = np.ceil(shape.optimizer_step * size).astype(np.int64)  # optimizer_step()
            buffers = self._buffers[j[lo:hi]] - self._buffers[i[lo:hi]]
            static = _static(
                p[lo:hi], trained[lo:hi], copied[lo:hi], buffers, shape.optimizer_slots
            )
            out[lo:hi] = static + np.maximum(held + shape.runtime, step) + shape.reserved
        return out

    def static(self, optimizer_slots: int) -> int:
        """What every split holds in all, whatever its schedule: the weights, their gradients,
        optimizer slots and buffers of the whole model. Each stage's total() is at least its
        own share of these (the rest of it is never negative), and the shares of any split add
        up to at least this (a tied parameter's weight and gradient are held by every stage
        that uses it, its optimizer state by the first, or by every one: copied()): a lower
        bound on the memory of all devices together."""
        n = self.chain.num_layers
        return int(self.static_of(np.array([0]), np.array([n]), optimizer_slots)[0])

    def static_of(
        self, i: np.ndarray, j: np.ndarray, optimizer_slots: int | np.ndarray
    ) -> np.ndarray:
        """The part of total(i, j) that does not depend on the schedule (weights, gradients,
        optimizer slots, per entry or for all, buffers): total() is at least this and the
        shape's reserved bytes."""
        buffers = self._buffers[j] - self._buffers[i]
        return _static(
            self.params(i, j), self.grads(i, j), self.copied(i, j), buffers, optimizer_slots
        )

    def one_layer(self, shape: StageShape) -> np.ndarray:
        """total(i, i + 1) for every i, kept per shape."""
        found = self._one_layer.get(shape)
        if found is None:
            every = np.arange(self.chain.num_layers, dtype=np.int64)
            # each layer's states, computed once for every shape, as shapes ask for them
            names = STATES + TRANSIENTS
            counted = _counted(shape.occupancy)
            wanted = {names[k] for k in np.flatnonzero(counted)} | {"largest"}
            if counted[PULLED]:
                wanted |= self._key_states(self._pulled_key(shape))
            missing = frozenset(wanted - self._single.keys())
            if missing:
                self._single.update(self.state_bytes(every, every + 1, only=missing))
            found = self._one_layer[shape] = self._totals(
                every, every + 1, [shape], np.array([0, len(every)]), self._single
            )
        return found

    def max_end(self, shape: StageShape, budget: int) -> np.ndarray:
        """For every start i: the largest end j with total(i, j) <= budget, or i if even [i, i+1)
        does not fit. Binary search on all starts at once (total grows with j); kept per shape
        and budget, since the search's candidates share them (per-stage recomputation reuses
        every single mode's)."""
        return self.max_ends([(shape, budget)])[0]

    def max_ends(
        self,
        wanted: list[tuple[StageShape, int]],
        cap: np.ndarray | list[np.ndarray] | None = None,
        starts: list[np.ndarray | None] | None = None,
    ) -> list[np.ndarray]:
        """max_end of every (shape, budget), those not known yet searched together: one pass
        of state bytes per bisection step serves them all (a split of 64 stages has 64).
        `cap`: per start, the last end the caller will ask about; each end is then
        min(max_end, cap), found in fewer steps (one, where the cap fits). `starts`: per key,
        the starts (sorted) whose ends the caller will read, None for all; each answer is
        exact there only (elsewhere it may be the start itself, as if nothing fitted).

        What a search finds is kept per shape and budget, with the ends it searched to:
        a later search of the same key (another candidate's, or under a larger cap, or from
        other starts) starts from it, and searches only the starts whose end lay past the cap
        it had (a start never searched counts as searched to itself)."""
        n = self.chain.num_layers
        every = np.arange(n, dtype=np.int64)
        # per key (`cap` may be one per wanted key: a key asked twice takes the larger)
        caps = cap if isinstance(cap, list) else [cap] * len(wanted)
        tops: dict[tuple[StageShape, int], np.ndarray] = {}
        clipped: dict[int, np.ndarray] = {}  # per cap (the partition's: one per option)
        for key, c in zip(wanted, caps):
            top = clipped.get(id(c))
            if top is None:
                top = np.full(n, n, dtype=np.int64) if c is None else np.clip(c, every + 1, n)
                clipped[id(c)] = top
            tops[key] = np.maximum(tops[key], top) if key in tops else top
        kept = self._ends
        asked: dict[tuple[StageShape, int], list[np.ndarray] | None] = {}
        for g, key in enumerate(wanted):
            mine = None if starts is None else starts[g]
            if mine is None:
                asked[key] = None
            elif asked.setdefault(key, []) is not None:
                asked[key].append(mine)  # type: ignore[union-attr]
        known: dict[tuple[StageShape, int], tuple[np.ndarray, np.ndarray]] = {}
        todo = []
        for key, parts in asked.items():
            if parts is None:
                at = every
            elif len(parts) == 1:
                at = np.asarray(parts[0], dtype=np.int64)
            else:
                at = np.flatnonzero(np.bincount(np.concatenate(parts), minlength=n))
            found, to = kept.get(key, (every, every))  # found = min(max_end, to)
            known[key] = (found, to)
            # exact where found < to (max_end itself); known to reach past the cap where not
            top = tops[key]
            search = at[(found[at] >= to[at]) & (top[at] > to[at])]
            if search.size:  # from what is known to fit, up to the cap
                todo.append((key, search, found[search]))
        # (counted as kept, not summed over every key per call: with many budgets, one per
        # device order of --allow-reorder, that sum took a third of the search)
        if self._ends_size + 2 * n * len(todo) > self.KEEP:  # past what is worth keeping
            kept.clear()  # start over
            self._ends_size = 0
        # in batches of about 2^16 entries: larger arrays only spill out of the caches
        batch: list = []
        entries = 0
        for at, item in enumerate(todo):
            batch.append(item)
            entries += len(item[1])
            if entries < (1 << 16) and at + 1 < len(todo):
                continue
            results = self._max_ends(
                [key for key, _, _ in batch],
                np.concatenate([tops[key][search] for key, search, _ in batch]),
                [search for _, search, _ in batch],
                np.concatenate([lo for _, _, lo in batch]),
            )  # fmt: skip
            for (key, search, _), new in zip(batch, results):
                found, to = (x.copy() for x in known[key])
                found[search], to[search] = new, tops[key][search]
                known[key] = (found, to)
            batch, entries = [], 0
        answers = {}
        for key in asked:
            found, to = known[key]
            found.setflags(write=False)
            to.setflags(write=False)
            old = kept.get(key)
            self._ends_size += found.size - (0 if old is None else old[0].size)
            kept[key] = (found, to)
            answers[key] = np.minimum(found, tops[key])
        return [answers[k] for k in wanted]

    KEEP = 1 << 25  # entries of found ends and their limits kept at most (256 MiB)

    def end_guess(self, shape: StageShape, budget: int, start: int) -> int:
        """A guess of max_end(shape, budget) at `start`, without searching: the last end at
        which the stage's weights (their gradients and optimizer slots, and buffers), its
        reserved bytes and the activations of as many micro-batches as the shape holds at
        once (each layer's saved bytes, less what the layer before it saves too) fit.
        Never below max_end: total() is at least those (with buffers, weights are summed
        layer by layer: none is tied). Yet a guess: the partition's windows read it, and see
        where one fell short (a stage reached past it) all the same."""
        n = self.chain.num_layers
        if self._tied:  # (the weights do not add up layer by layer)
            return n
        # Of the tuples that run no transient and hold no pulled gradient (whose tight forms
        # may come out below zero) nor what zero bubble keeps between I and W (below zero on
        # a first stage that borrows its input and holds the loss: a review's), the most
        # activations: every other state they count is bytes held, none below zero.
        act, iw = STATES.index("activations"), STATES.index("between_iw")
        many = max(
            (
                t[act]
                for t in shape.occupancy
                if not t[PULLED] and not t[iw] and not any(t[N_STATES:])
            ),
            default=0,
        )
        key = (shape.optimizer_slots, many)
        prefix = self._guess_prefix.get(key)
        if prefix is None:
            saved = self._saved - self._shared  # each layer's own share, as _held counts it
            prefix = self._guess_prefix[key] = self.weights(shape.optimizer_slots) + many * saved
        room = int(prefix[start]) + budget - shape.reserved
        if start == 0 and self.chain.borrowed_input:  # (the part of the caller's micro-batch
            room += many * int(self.input_saved(0, n)[0])  # its layers save: not held)
        return max(start, min(n, int(np.searchsorted(prefix, room, side="right")) - 1))

    def weights(self, optimizer_slots: int) -> np.ndarray:
        """Prefix sums of each layer's weights, gradients, optimizer slots and buffers: with
        no tied parameters, static_of(i, j) is weights[j] - weights[i] (kept per slot count)."""
        found = self._weights.get(optimizer_slots)
        if found is None:
            found = self._weights[optimizer_slots] = (
                self._params + (1 + optimizer_slots) * self._grads + self._buffers
            )
        return found

    def params(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """The parameter bytes of stages [i, j): a parameter several of its layers use, once."""
        return _once(self._params, self._tied, i, j)

    def grads(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """The trainable parameter bytes of stages [i, j) (each with a gradient and optimizer
        state): a parameter several of its layers use, once."""
        return _once(self._grads, self._tied_grads, i, j)

    def copied(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """The bytes of the tied parameters stages [i, j) use that a layer before i uses too:
        the stage holding that layer (on another device: the runtime's copy, whose gradient
        goes to the model's own parameter before the step; on the same one: that parameter
        itself) keeps their optimizer state, not this one. None where every copy keeps its own
        (Chain.copies_keep_state)."""
        out = np.zeros(np.shape(i), dtype=np.int64)
        if self.chain.copies_keep_state:
            return out
        for nbytes, before in self._tied_grads:
            out = out + np.where((before[i] > 0) & (before[j] > before[i]), nbytes, 0)
        return out

    def _max_ends(
        self,
        keys: list[tuple[StageShape, int]],
        top: np.ndarray,
        starts: list[np.ndarray],
        lo: np.ndarray,
    ) -> list[np.ndarray]:
        """min(max_end, top) per key at its `starts`, where each end is known to fit at lo (or
        lo is the start) and nothing past the cap is known (top and lo: flat, key after key,
        one per start)."""
        n, G = self.chain.num_layers, len(keys)
        shapes = [shape for shape, _ in keys]
        sizes = np.array([len(at) for at in starts], dtype=np.int64)
        budget = np.repeat(np.array([b for _, b in keys], dtype=np.int64), sizes)
        i = np.concatenate(starts)
        # total(i, lo) fits (or lo = i); hi does not, or lies past the cap. The weights,
        # gradients and optimizer slots alone bound the end from above (prefix sums; with tied
        # parameters counted once they do not); a start whose end at the cap fits is done.
        caps = []
        for (shape, b), at in zip(keys, starts):
            weights = self.weights(shape.optimizer_slots)
            if self._tied:
                caps.append(np.full(len(at), n + 1))
            else:
                caps.append(
                    np.searchsorted(weights, weights[at] + (b - shape.reserved), side="right")
                )
        hi = np.minimum(np.maximum(np.concatenate(caps), i + 1), n + 1)
        # min(max_end, top) is top where top fits: where lo reaches it, or where it fits
        lo = np.minimum(lo, top)
        hi = np.where(lo == top, top + 1, hi)
        group = np.repeat(np.arange(G), sizes)

        def probe(idx: np.ndarray, mid: np.ndarray) -> None:
            """Try end mid (strictly between lo and hi) for the entries idx (in group order, as
            _totals wants them): either bound moves there."""
            at = np.searchsorted(group[idx], np.arange(G + 1))
            fits = self._totals(i[idx], mid, shapes, at) <= budget[idx]
            lo[idx[fits]] = mid[fits]
            hi[idx[~fits]] = mid[~fits]

        check = np.flatnonzero((lo < top) & (hi > top))
        if len(check):
            probe(check, top[check])
        hi = np.where(lo == top, top + 1, np.minimum(hi, top))  # past the top: as good as it
        pos = np.arange(len(i))
        while len(pos):
            pos = pos[hi[pos] - lo[pos] > 1]
            if len(pos):
                probe(pos, (lo[pos] + hi[pos]) // 2)
        return np.split(lo, np.cumsum(sizes)[:-1])
