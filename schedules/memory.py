"""What each device holds, action by action, when a schedule is issued in its issue order
(schedules/order.py). Costs play no part: the order alone decides who holds what and when.

A micro-batch m on stage s passes through states; each holds bytes on the stage's device (how
many is the planner's business, given here per stage as StageBytes):

    input         the stage input: pushed by the previous stage right after its F (stage 0 takes
                  its own copy at F), or kept alone to be re-materialised later (recomputation)
    activations   the input and everything the stage's layers saved for backward
    during_i      zero bubble, while I runs: the activations, the gradients I keeps for W, and
                  the input gradient it makes
    between_iw    zero bubble, after I and before W: saved activations plus inner and output
                  gradients (a recomputed micro-batch is re-materialised at I and kept to W)
    grad          the input gradient made by B or I, until the previous stage pulls it
    pulled        the output gradient B pulled from the next stage, held while B runs
    early         with routes that skip stages (schedule.routes): what stage t was sent by a
                  stage before t - 1, from the first such sender's F until the previous
                  stage's F ends (from then on it is part of `input`)
    late          the mirror of early: the gradient of what those stages sent, from when the
                  previous stage pulls its own share (at its B or I) until the first far
                  sender's B or I pulls it

Transitions, at an action's start (allocations) or its end (frees and hand-offs):

    F(s,m)  start  s = 0: input +1 (its own copy); not recomputed: input -> activations
            end    output pushed to stage s+1: input +1 there (early -1 there, if it had any);
                   early +1 on each stage whose first far sender is s
    B(s,m)  start  pulls its output gradient: grad -1 on stage s+1, pulled +1 (s < S-1);
                   recomputed: input -> activations, re-materialised as a phase of its own
            end    activations -1; pulled -1; grad +1 (s > 0)
    I(s,m)  start  as B (a recomputed one re-materialises first, as a phase of its own, beside
                   its pulled output gradient: pulled +1, then -1 as I takes it), then
                   activations -> during_i
            end    during_i -> between_iw; grad +1 (s > 0)
    W(s,m)  end    between_iw -1

While an action runs, its device also holds that action's transient, the most one layer adds
above what the states count: `live` for B, `remat_live` for a forward that keeps what it saves
(F, and the forward a recomputed micro-batch re-materialises at zero bubble's I, by hand),
`stop_live` for the forward a recomputed B re-materialises at its start (by hand too: the
stage's whole forward, a captured graph's beside the gradients sent back for one value),
`forward_live` for the forward of a recomputed micro-batch (which keeps nothing), `input_live`
for I and `weight_live` for W.
One host issues one action at a time, so a device never holds two transients at once. After
the last action, the optimizer step runs on every device: its temporaries come on top of the
weights alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .ir import Action, Kind, Schedule
from .order import canonical_order, issue_arrays, kept, program_arrays, schedule_key

STATES = ("input", "activations", "during_i", "between_iw", "grad", "pulled", "early", "late")
IN, ACT, DURING_I, IW, GRAD, PULLED, EARLY, LATE = range(len(STATES))
TRANSIENTS = ("live", "remat_live", "forward_live", "input_live", "weight_live", "stop_live")
LIVE, REMAT_LIVE, FORWARD_LIVE, INPUT_LIVE, WEIGHT_LIVE, STOP_LIVE = range(
    len(STATES), len(STATES) + len(TRANSIENTS)
)
# (stop_live last: a tuple written without its flag reads as not running it)

Occupancy = tuple[tuple[int, ...], ...]  # Pareto set of (count per state..., flag per transient)


def recomputes(mode: str, microbatch: int, num_microbatches: int) -> bool:
    """Whether micro-batch `microbatch` is re-materialised under recomputation `mode`."""
    if mode == "never":
        return False
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < num_microbatches - 1
    raise ValueError(f"unknown recompute mode {mode!r}")


@dataclass(frozen=True)
class StageBytes:
    """Bytes one micro-batch holds on a stage's device in each state, the stage's transients
    while one of its actions runs, and what the stage holds all the time."""

    # By default the simulator counts the micro-batches that hold their activations.
    input: int = 0
    activations: int = 1
    during_i: int = 1
    between_iw: int = 1
    grad: int = 0
    pulled: int = 0
    early: int = 0
    late: int = 0
    live: int = 0
    remat_live: int = 0
    forward_live: int = 0
    input_live: int = 0
    weight_live: int = 0
    stop_live: int = 0
    optimizer_step: int = 0  # the optimizer step's temporaries, after the pipeline's step
    foreach: bool = False  # those of a device's stages add up (multi-tensor) or not (one by one)
    static: int = 0
    # One tensor at a time, where a tensor's step holds some of its temporaries while the next
    # is stepped (Adam's denominator): what the stage's first tensor's step makes, and what its
    # last one's leaves to the next tensor, a later stage's on the same device (device_step)
    step_head: int = 0
    step_tail: int = 0
    # What the runtime itself holds from the step's start to its end, whatever runs: the
    # caller's RNG state (kept to be put back), where it lives on the device (a CPU)
    runtime: int = 0
    # A gradient `static` counts that exists only from the stage's first B or W until the
    # step ends: the streams program's copy of a tied weight, whose gradient goes to the
    # model's own parameter as each step ends (and is made again by the next backward)
    late_grad: int = 0
    # ... made by that action (a B)'s last layer (the stage's first, which uses the copy:
    # nothing runs after it), inside the transient its backward was profiled with (a temporary
    # gradient added into the one there): it exists from the action's end
    late_grad_at_end: bool = False
    # ... or made by a later layer of that action, a B (not the first, which would be the
    # above): it exists from the action's end, and the B's transient is `late_live` instead of
    # `live`, counting it once the B has passed that layer (0: neither; planner MemoryModel)
    late_live: int = 0

    def per_state(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in STATES)

    def transient(self, which: int) -> int:
        return int(getattr(self, TRANSIENTS[which - LIVE]))

    def held(self, occupancy: Sequence[int]) -> int:
        """Bytes for one occupancy tuple (counts per state, then a flag per transient)."""
        names = STATES + TRANSIENTS
        return sum(n * getattr(self, name) for n, name in zip(occupancy, names))


def device_step(mine: Sequence[StageBytes]) -> int:
    """The optimizer step's temporaries on a device holding stages `mine` (in stage order, as
    its optimizer takes their parameters): multi-tensor kernels make every stage's at once;
    one tensor at a time, the most of any stage's own, and of each stage's first tensor
    stepped while the last tensor of the device's stage before it (with tensors) still holds
    its carry (an interleaved device's second stage)."""
    if any(b.foreach for b in mine):
        return sum(b.optimizer_step for b in mine)
    most, carry = 0, 0
    for b in mine:
        most = max(most, b.optimizer_step)
        if b.step_head or b.step_tail:  # (a stage with tensors)
            most = max(most, carry + b.step_head)
            carry = b.step_tail
    return most


Changes = tuple[tuple[int, int, int], ...]  # (stage, state, +-1)


@dataclass(frozen=True)
class _Step:
    action: Action
    rank: int
    phases: tuple[tuple[Changes, int], ...]  # in turn: what changes, then the transient running
    end: Changes  # what changes when it ends


_STEPS: dict[tuple, list[_Step]] = {}


def _once(cache: dict, build: Callable, schedule: Schedule, modes: Sequence[str]) -> Any:
    """build(schedule, modes), kept per schedule and recomputation (at most 256 kept)."""
    return kept(cache, schedule_key(schedule, tuple(modes)), lambda: build(schedule, modes))


def _steps(schedule: Schedule, modes: Sequence[str]) -> list[_Step]:
    """The issue order's state changes, action by action, once per schedule and recomputation:
    `replay` and `timed_levels` walk them; `occupancy` and `peaks` read the same transitions
    as arrays (`_build_events`), and a test holds the two to each other."""
    return _once(_STEPS, _build_steps, schedule, modes)


def _build_steps(schedule: Schedule, modes: Sequence[str]) -> list[_Step]:
    S, M, place = schedule.num_stages, schedule.num_microbatches, schedule.placement
    early = schedule.early_from()
    far: dict[int, list[int]] = {}  # per stage, the stages it is the first far sender of
    for t in range(S):
        far.setdefault(early[t], []).append(t)
    steps = []
    for a in canonical_order(schedule, modes):
        s, m = a.stage, a.microbatch
        rec = recomputes(modes[s], m, M)
        start: list[tuple[int, int, int]] = []
        end: list[tuple[int, int, int]] = []
        phases: list[tuple[Changes, int]] = []
        running = LIVE
        if a.kind == Kind.F:
            if s == 0:
                start.append((s, IN, 1))
            if rec:
                running = FORWARD_LIVE
            else:  # a forward that keeps what it saves: the same as re-materialising
                running = REMAT_LIVE
                start += [(s, IN, -1), (s, ACT, 1)]
            if s < S - 1:
                end.append((s + 1, IN, 1))
                if early[s + 1] >= 0:
                    end.append((s + 1, EARLY, -1))
            end += [(t, EARLY, 1) for t in far.get(s, ())]
        elif a.kind in (Kind.B, Kind.I):
            if s < S - 1:
                start.append((s + 1, GRAD, -1))
                if early[s + 1] >= 0:
                    start.append((s + 1, LATE, 1))
            start += [(t, LATE, -1) for t in far.get(s, ())]
            if rec:
                start += [(s, IN, -1), (s, ACT, 1)]
            if a.kind == Kind.I:
                if rec:  # the re-materialising forward runs before I itself, beside the
                    # output gradient (pulled first; a torchrun rank's came with its receive),
                    # which I then keeps for W (in during_i)
                    if s < S - 1:
                        start.append((s, PULLED, 1))
                    phases.append((tuple(start), REMAT_LIVE))
                    start = [(s, PULLED, -1)] if s < S - 1 else []
                running = INPUT_LIVE
                start += [(s, ACT, -1), (s, DURING_I, 1)]
                end += [(s, DURING_I, -1), (s, IW, 1)]
            else:
                if s < S - 1:
                    start.append((s, PULLED, 1))
                    end.append((s, PULLED, -1))
                if rec:  # the re-materialising forward, beside the pulled gradient
                    phases.append((tuple(start), _b_remat(schedule)))
                    start = []
                end.append((s, ACT, -1))
            if s > 0:
                end.append((s, GRAD, 1))
        elif a.kind == Kind.W:
            running = WEIGHT_LIVE
            end.append((s, IW, -1))
        phases.append((tuple(start), running))
        steps.append(_Step(a, place[s], tuple(phases), tuple(end)))
    return steps


def _b_remat(schedule: Schedule) -> int:
    """The transient of a recomputed B's re-materialising forward (zero bubble's I's: the one
    a forward that keeps what it saves holds; codegen/_runtime.py re-runs both by hand)."""
    return REMAT_LIVE if schedule.name == "zb-h1" else STOP_LIVE


def occupancy(schedule: Schedule, recompute: str | Sequence[str]) -> list[Occupancy]:
    """Per stage: every combination of counts (per state, then which transient runs) the stage
    passes through, without those another one dominates. A stage's peak for any StageBytes b is
    max over its tuples of b.held(tuple)."""
    S = schedule.num_stages
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    ev = _events(schedule, modes)
    counts = ev.counts(ev.change_stage, ev.snap_stage)
    flags = np.zeros((len(ev.snap_stage), len(TRANSIENTS)), dtype=np.int64)
    running = ev.snap_running >= 0
    flags[np.nonzero(running)[0], ev.snap_running[running] - LIVE] = 1
    rows = _distinct(np.concatenate([ev.snap_stage[:, None], counts, flags], axis=1))
    cut = np.searchsorted(rows[:, 0], np.arange(S + 1))
    return [_pareto_array(rows[cut[s] : cut[s + 1], 1:]) for s in range(S)]


def _distinct(rows: np.ndarray) -> np.ndarray:
    """The distinct rows of a non-negative integer array, sorted by their first column. Each row
    read as one number (its entries as digits, each column's base one past its largest) when
    that fits in int64: much faster than np.unique over rows."""
    if not len(rows):
        return rows
    base = rows.max(axis=0) + 1
    if float(np.prod(base.astype(np.float64))) >= 2.0**62:
        return np.unique(rows, axis=0)
    weight = np.cumprod(np.concatenate([base[1:], [1]])[::-1])[::-1]  # first column weighs most
    _, first = np.unique(rows @ weight, return_index=True)
    return rows[first]


def peaks(
    schedule: Schedule,
    recompute: str | Sequence[str],
    sizes: Sequence[StageBytes],
    ahead: dict[Action, int] | None = None,
    after: dict[Action, int] | None = None,
    *,
    smaller: Sequence[StageBytes] | None = None,
    larger: int = 0,
) -> list[int]:
    """Each device's peak over the issue order and the optimizer step after it: what `replay`
    finds, without walking the order in Python (the planner calls this for every plan).
    `smaller`: a batch split unevenly, the bytes of micro-batches `larger` on (one sample
    fewer each: torch.tensor_split makes the first ones the larger); `sizes` those of the
    ones before.
    `ahead`: per compute action, bytes its rank holds beside the states, or short of them
    (comm.receive_offsets: a torchrun program's messages where it posts them), counted at
    every look at that rank during the action, and between two of the rank's own actions at
    the larger of theirs. `after`: the same for the moment right after the action ends (the
    torchrun program's batch of sends and receives then), a look of its own at that rank:
    the states as the action left them, no transient."""
    S, R = schedule.num_stages, schedule.num_ranks
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    place = np.asarray(schedule.placement, dtype=np.int64)
    ev = _events(schedule, modes)
    per_state, trans = _per_state(sizes, S), _transients(sizes, S)
    # Device levels: each change weighs its state's bytes on its stage; one column per device.
    weights = per_state[ev.change_stage, ev.change_state]
    on = ev.snap_running >= 0
    extra = np.zeros(len(ev.snap_stage), dtype=np.int64)
    extra[on] = trans[ev.snap_stage[on], ev.snap_running[on] - LIVE]
    if smaller is not None:  # (the micro-batches from `larger` on weigh their own bytes)
        rest = ev.change_mb >= larger  # type: ignore[operator]
        weights = np.where(rest, _per_state(smaller, S)[ev.change_stage, ev.change_state], weights)
        rest = on & (ev.snap_mb >= larger)  # type: ignore[operator]
        extra[rest] = _transients(smaller, S)[ev.snap_stage[rest], ev.snap_running[rest] - LIVE]
    weights = weights * ev.change_delta
    level = ev.counts(place[ev.change_stage], place[ev.snap_stage], weights)[:, 0]
    late = [b.late_grad for b in sizes]
    if any(late):  # (looks on its device before the stage's first B or W: not made yet)
        first = _first_backward(schedule)
        for s in np.flatnonzero(late):
            b = sizes[s]
            made = 4 * first[s] + (3 if b.late_grad_at_end or b.late_live else 0)  # (3: END)
            extra[(place[ev.snap_stage] == place[s]) & (ev.snap_seq < made)] -= late[s]
            if b.late_live:  # the B's own look, while it walks: late_live for its live
                walk = (ev.snap_stage == s) & (ev.snap_seq // 4 == first[s])
                walk &= ev.snap_running == LIVE
                shift = np.full(len(extra), b.late_live - b.live, dtype=np.int64)
                if smaller is not None:
                    c = smaller[s]
                    shift[ev.snap_mb >= larger] = c.late_live - c.live  # type: ignore[operator]
                extra[walk] += shift[walk]
    static = np.zeros(R, dtype=np.int64)
    np.add.at(static, place, [b.static for b in sizes])
    if ahead:
        extra = extra + _ahead_at_looks(schedule, ev, place, ahead)
    top = np.zeros(R, dtype=np.int64)
    if len(level):
        np.maximum.at(top, place[ev.snap_stage], level + extra)
    if after:
        rank, at = _after_looks(schedule, ev, place, weights, after)
        np.maximum.at(top, rank, at)
    left = np.zeros(R, dtype=np.int64)  # what the states still hold after the last action
    np.add.at(left, place[ev.change_stage], weights)
    out = []
    for r in range(R):
        mine = [sizes[s] for s in schedule.stages_of(r)]
        during = top[r] + sum(b.runtime for b in mine)  # (the optimizer step comes after)
        stepped = left[r] + device_step(mine) - sum(b.late_grad for b in mine)
        out.append(int(static[r] + max(during, stepped, 0)))
    return out


def _first_backward(schedule: Schedule) -> np.ndarray:
    """Per stage, the position in the issue order of its first B or W (past the end: none)."""
    kind, stage, _ = issue_arrays(schedule)
    first = np.full(schedule.num_stages, len(kind), dtype=np.int64)
    at = np.flatnonzero((kind == 1) | (kind == 3))  # (B, W)
    np.minimum.at(first, stage[at], at)
    return first


def _per_state(sizes: Sequence[StageBytes], S: int) -> np.ndarray:
    return np.array([b.per_state() for b in sizes], dtype=np.int64).reshape(S, -1)


def _transients(sizes: Sequence[StageBytes], S: int) -> np.ndarray:
    return np.array(
        [[b.transient(k) for k in range(LIVE, LIVE + len(TRANSIENTS))] for b in sizes],
        dtype=np.int64,
    ).reshape(S, -1)


def _issued(
    schedule: Schedule, figures: dict[Action, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The issue order's kinds and stages, and each action's figure (0 where it has none)."""
    kind, stage, m = issue_arrays(schedule)
    kinds = (Kind.F, Kind.B, Kind.I, Kind.W)
    held = np.fromiter(
        (figures.get(Action(int(s), kinds[int(k)], int(b)), 0) for k, s, b in zip(kind, stage, m)),
        np.int64, len(kind),
    )  # fmt: skip
    return kind, stage, held


def _after_looks(
    schedule: Schedule,
    ev: _Events,
    place: np.ndarray,
    weights: np.ndarray,
    after: dict[Action, int],
) -> tuple[np.ndarray, np.ndarray]:
    """peaks' `after` looks: per compute action with a figure, its rank and that rank's level
    once every change up to the action's end is made, plus the figure."""
    kind, stage, held = _issued(schedule, after)
    ks = np.flatnonzero(held)
    rank = place[stage[ks]]
    span = 4 * len(kind) + 4  # positions: 4 k + phase, 4 k + 3 for the end
    key = place[ev.change_stage] * span + ev.change_seq
    order = np.argsort(key, kind="stable")
    key, run = key[order], np.cumsum(weights[order])
    upto = np.searchsorted(key, rank * span + 4 * ks + 3, side="right") - 1
    before = np.searchsorted(key, rank * span, side="left") - 1  # the rank's own changes only
    level = np.where(upto >= 0, run[np.maximum(upto, 0)], 0)
    level -= np.where(before >= 0, run[np.maximum(before, 0)], 0)
    return rank, level + held[ks]


def _ahead_at_looks(
    schedule: Schedule, ev: _Events, place: np.ndarray, ahead: dict[Action, int]
) -> np.ndarray:
    """peaks' `ahead` at each look: the acting rank's own figure during its action; a look at
    another rank (an end reaching it) takes the larger of that rank's last and next actions'."""
    kind, stage, held = _issued(schedule, ahead)
    acting = place[stage]
    k = ev.snap_seq // 4
    rank = place[ev.snap_stage]
    out = np.zeros(len(k), dtype=np.int64)
    for r in np.unique(rank):
        own = np.flatnonzero(acting == r)
        if not len(own) or not held[own].any():
            continue
        at = np.flatnonzero(rank == r)
        after = np.searchsorted(own, k[at], side="left")  # the next own action (or this one)
        nxt = held[own[np.minimum(after, len(own) - 1)]] * (after < len(own))
        before = np.searchsorted(own, k[at], side="right") - 1  # the last (or this one)
        prv = held[own[np.maximum(before, 0)]] * (before >= 0)
        out[at] = np.maximum(nxt, prv)
    return out


@dataclass(frozen=True)
class _Events:
    """The issue order's state changes as arrays. Position `seq` orders them: 4k + phase for the
    phases of order[k] (changes first, then the look at its stage with its transient), 4k + 3
    for its end. Looks (`snap_*`) are where a peak may sit: the acting stage after each phase,
    and every stage an end touches."""

    change_seq: np.ndarray
    change_stage: np.ndarray
    change_state: np.ndarray
    change_delta: np.ndarray
    snap_seq: np.ndarray
    snap_stage: np.ndarray
    snap_running: np.ndarray  # the transient running there, -1 for none
    change_mb: np.ndarray | None = None  # the micro-batch each change is of
    snap_mb: np.ndarray | None = None  # ... and the one whose transient each look counts

    def counts(
        self, change_group: np.ndarray, snap_group: np.ndarray, weights: np.ndarray | None = None
    ) -> np.ndarray:
        """At every look: per group (stage or device), the running sum of its changes so far,
        one column per state, or one of `weights` (one per change)."""
        n_change = len(self.change_seq)
        group = np.concatenate([change_group, snap_group]).astype(np.int64)
        N = len(group)
        # by group, then position, changes before looks: two stable sorts, by position (the
        # events come in runs already in order, which a stable sort merges) and then by group
        # (a few small integers: a radix sort), 3-4x faster than one sort of a combined key
        seq = np.concatenate([2 * self.change_seq, 2 * self.snap_seq + 1])
        order = np.argsort(seq, kind="stable")
        small = group[order]
        if N and int(small.max()) < 1 << 15 and int(small.min()) >= 0:
            small = small.astype(np.int16)
        order = order[np.argsort(small, kind="stable")]
        # one row per column, one entry per event (rows contiguous: cumsum runs along them)
        packed = weights is None and _fits_packed(
            change_group, self.change_state, self.change_delta
        )
        if packed:  # four states to a row, 15 bits each: a quarter of the rows to sort and sum
            rows = np.zeros((_ROWS, N), dtype=np.int64)
            field = self.change_state % _PER_ROW
            rows[self.change_state // _PER_ROW, np.arange(n_change)] = self.change_delta << (
                _BITS * field
            )
        elif weights is None:
            rows = np.zeros((len(STATES), N), dtype=np.int64)
            rows[self.change_state, np.arange(n_change)] = self.change_delta
        else:
            rows = np.zeros((1, N), dtype=np.int64)
            rows[0, :n_change] = weights
        run = np.cumsum(rows[:, order], axis=1)
        g = group[order]
        # each group's running sum starts from zero: take off what the groups before it added
        starts = np.flatnonzero(np.concatenate([[N > 0], g[1:] != g[:-1]]))
        before = np.zeros((len(rows), len(starts)), dtype=np.int64)
        before[:, 1:] = run[:, starts[1:] - 1]
        run -= np.repeat(before, np.diff(np.append(starts, N)), axis=1)
        at = np.empty(N, dtype=np.int64)
        at[order] = np.arange(N)
        out = run[:, at[n_change:]]
        if packed:  # a group's sum is exact even where the running total wrapped around
            shift = _BITS * (np.arange(len(STATES)) % _PER_ROW)
            out = (out[np.arange(len(STATES)) // _PER_ROW] >> shift[:, None]) & _MASK
        return out.T


_BITS, _PER_ROW = 15, 4
_ROWS, _MASK = -(-len(STATES) // _PER_ROW), (1 << 15) - 1


def _fits_packed(group: np.ndarray, state: np.ndarray, delta: np.ndarray) -> bool:
    """Whether every count stays below 2^15: no group gains that many in one state (the
    count at any moment is at most what it gained)."""
    if not len(group):
        return False
    gains = np.bincount(group * len(STATES) + state, weights=delta > 0)
    return float(gains.max()) < 1 << _BITS


_EVENTS: dict[tuple, _Events] = {}


def _events(schedule: Schedule, modes: Sequence[str]) -> _Events:
    return _once(_EVENTS, _build_events, schedule, modes)


def occupancy_bound(schedule: Schedule, recompute: str | Sequence[str]) -> list[Occupancy]:
    """Per stage, one tuple at least every tuple of `occupancy` in every entry, found without
    the issue order, from the program alone: what the planner solves with first, where memory
    may not bind (planner/search.py).

    Actions are issued one at a time and a look follows a whole phase of one (_Events), so a
    state's count at any look is what the actions done so far changed it by, each its net,
    plus the running action's phases so far: at most the sum of every action's net gain
    (losses left out), plus the most any one action's phases reach beyond its own net gain (a
    state entered and left within one action, as `pulled`, counts once). A transient counts
    where one of the stage's actions runs it."""
    S = schedule.num_stages
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    return _once(_BOUNDS, _bound_of, schedule, modes)


def _bound_of(schedule: Schedule, modes: Sequence[str]) -> list[Occupancy]:
    """occupancy_bound's tuples. What an action changes, phase by phase, depends on its kind,
    its stage and whether it recomputes alone (_build_events' rules): one action of each such
    type is turned into events, its gains counted as many times as the program has actions of
    that type (a test holds this to the same sums over every action)."""
    S, NS = schedule.num_stages, len(STATES)
    kind, stage, m = program_arrays(schedule)
    rec = _recomputed(modes, stage, m, schedule.num_microbatches)
    _, one, times = np.unique((kind.astype(np.int64) * S + stage) * 2 + rec, return_index=True,
                              return_counts=True)  # fmt: skip
    ev = _build_events(schedule, modes, (kind[one], stage[one], m[one]))
    cell = ev.change_stage * NS + ev.change_state
    # one group per action, cell and phase, in that order (seq = 4 k + phase)
    per_phase = (ev.change_seq // 4 * (S * NS) + cell) * 4 + ev.change_seq % 4
    phases, at = _unique_runs(per_phase)
    net = np.bincount(at, weights=ev.change_delta).astype(np.int64)
    action = phases // 4  # (action, cell)
    first = np.flatnonzero(np.concatenate([[True], action[1:] != action[:-1]]))
    run = np.cumsum(net)
    run -= np.repeat(np.concatenate([[0], run[first[1:] - 1]]), np.diff(np.append(first, len(net))))
    reach = np.maximum.reduceat(run, first)  # the most its phases reach
    whole = np.add.reduceat(net, first)
    where = action[first] % (S * NS)
    beyond = np.zeros(S * NS, dtype=np.int64)
    np.maximum.at(beyond, where, reach - np.maximum(whole, 0))
    many = times[action[first] // (S * NS)]  # actions of each type
    gained = np.bincount(where, weights=np.maximum(whole, 0) * many, minlength=S * NS)
    counts = gained.astype(np.int64) + beyond
    flags = np.zeros((S, len(TRANSIENTS)), dtype=np.int64)
    on = ev.snap_running >= 0
    flags[ev.snap_stage[on], ev.snap_running[on] - LIVE] = 1
    rows = np.concatenate([counts.reshape(S, NS), flags], axis=1)
    return [(tuple(int(n) for n in row),) for row in rows]


def _unique_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_inverse=True) for keys that come in a few increasing runs (the
    events, rule by rule): a stable sort merges the runs, 2-3x faster than unique's own."""
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    new = np.concatenate([[True], ranked[1:] != ranked[:-1]]) if len(keys) else np.zeros(0, bool)
    at = np.empty(len(keys), dtype=np.int64)
    at[order] = np.cumsum(new) - 1
    return ranked[new], at


_BOUNDS: dict[tuple, list[Occupancy]] = {}


def occupancy_floor(schedule: Schedule, recompute: str | Sequence[str]) -> list[Occupancy]:
    """Per stage, tuples each at most some tuple of `occupancy` in every entry, found from the
    program alone: a stage's peak for any StageBytes is at least the largest of their held
    bytes (what proves, without the issue order, that no split fits: planner/search.py).

    Activations, during_i and between_iw change only by the stage's own actions, which the
    issue order takes in program order: at each look at a stage after a phase of its own
    action, their counts and the transient running are the issue order's. The states another
    stage's actions change too (input, grad, early, late: bytes that arrive, never negative)
    count none; nor does pulled, whose bytes the planner reads by how the whole occupancy holds
    it (planner/memory.py, pulled_with): a floor's tuples would not tell it the same."""
    S = schedule.num_stages
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    return _once(_FLOORS, _floor_of, schedule, modes)


def _floor_of(schedule: Schedule, modes: Sequence[str]) -> list[Occupancy]:
    S = schedule.num_stages
    arrays = program_arrays(schedule)
    ev = _build_events(schedule, modes, arrays)
    acting = arrays[1]
    # the own states' changes (each made by its stage's own action), and the looks at the
    # acting stage: counted in program order, they are the issue order's
    kept = (ev.change_stage == acting[ev.change_seq // 4]) & np.isin(
        ev.change_state, [ACT, DURING_I, IW]
    )
    ev = dataclasses.replace(
        ev, change_seq=ev.change_seq[kept], change_stage=ev.change_stage[kept],
        change_state=ev.change_state[kept], change_delta=ev.change_delta[kept],
        change_mb=None, snap_mb=None,
    )  # fmt: skip
    own = ev.snap_stage == acting[ev.snap_seq // 4]
    counts = ev.counts(ev.change_stage, ev.snap_stage)[own]
    stage, running = ev.snap_stage[own], ev.snap_running[own]
    flags = np.zeros((len(stage), len(TRANSIENTS)), dtype=np.int64)
    on = running >= 0
    flags[np.nonzero(on)[0], running[on] - LIVE] = 1
    rows = _distinct(np.concatenate([stage[:, None], counts, flags], axis=1))
    cut = np.searchsorted(rows[:, 0], np.arange(S + 1))
    return [_pareto_array(rows[cut[s] : cut[s + 1], 1:]) for s in range(S)]


_FLOORS: dict[tuple, list[Occupancy]] = {}


def _build_events(
    schedule: Schedule,
    modes: Sequence[str],
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> _Events:
    """The same transitions as _build_steps (the module doc), rule by rule over all actions,
    in the issue order, or in the order of `arrays` (kind, stage and micro-batch per action)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    kind, s, m = issue_arrays(schedule) if arrays is None else arrays
    rec = _recomputed(modes, s, m, M)
    k = np.arange(len(kind), dtype=np.int64)
    F, B, I, W = (kind == c for c in range(4))  # noqa: E741
    last = s == S - 1
    # a recomputed B or I re-materialises first, as phase 0: its own changes (I's) and its
    # transient then come at phase 1
    remat = (B | I) & rec
    i_phase = np.where(remat, 1, 0)
    change_parts: list[tuple[np.ndarray, np.ndarray, int, int, np.ndarray]] = []

    def change(
        mask: np.ndarray, pos: np.ndarray | int, stage_off: np.ndarray | int, state: int, d: int
    ) -> None:
        idx = np.nonzero(mask)[0]
        p = pos[idx] if isinstance(pos, np.ndarray) else pos
        off = stage_off[idx] if isinstance(stage_off, np.ndarray) else stage_off
        change_parts.append((4 * k[idx] + p, s[idx] + off, state, d, idx))

    END = 3
    change(F & (s == 0), 0, 0, IN, 1)
    change(F & ~rec, 0, 0, IN, -1)
    change(F & ~rec, 0, 0, ACT, 1)
    change(F & ~last, END, 1, IN, 1)
    early = np.asarray(schedule.early_from() + [-1], dtype=np.int64)
    change(F & ~last & (early[np.minimum(s + 1, S)] >= 0), END, 1, EARLY, -1)
    for t in np.nonzero(early >= 0)[0]:
        change(F & (s == early[t]), END, int(t) - s, EARLY, 1)
    BI = B | I
    change(BI & ~last, 0, 1, GRAD, -1)
    change(BI & ~last & (early[np.minimum(s + 1, S)] >= 0), 0, 1, LATE, 1)
    for t in np.nonzero(early >= 0)[0]:
        change(BI & (s == early[t]), 0, int(t) - s, LATE, -1)
    change(BI & rec, 0, 0, IN, -1)
    change(BI & rec, 0, 0, ACT, 1)
    change(I, i_phase, 0, ACT, -1)
    change(I, i_phase, 0, DURING_I, 1)
    change(I, END, 0, DURING_I, -1)
    change(I, END, 0, IW, 1)
    change(B & ~last, 0, 0, PULLED, 1)
    change(B & ~last, END, 0, PULLED, -1)
    change(I & rec & ~last, 0, 0, PULLED, 1)  # (beside I's re-materialising forward)
    change(I & rec & ~last, i_phase, 0, PULLED, -1)
    change(B, END, 0, ACT, -1)
    change(BI & (s > 0), END, 0, GRAD, 1)
    change(W, END, 0, IW, -1)
    c_seq = np.concatenate([p[0] for p in change_parts])
    c_stage = np.concatenate([p[1] for p in change_parts])
    c_state = np.concatenate([np.full(len(p[4]), p[2], np.int64) for p in change_parts])
    c_delta = np.concatenate([np.full(len(p[4]), p[3], np.int64) for p in change_parts])
    c_acting = np.concatenate([s[p[4]] for p in change_parts])
    # Looks: the acting stage after each phase (with its transient), every stage an end touches,
    # and every other stage a phase adds to (late: a stage's far gradients wait on).
    running = np.select(
        [F & rec, F, B, I, W], [FORWARD_LIVE, REMAT_LIVE, LIVE, INPUT_LIVE, WEIGHT_LIVE], -1
    ).astype(np.int64)
    is_end = c_seq % 4 == END
    looked = is_end | ((c_delta > 0) & (c_stage != c_acting))
    snap_seq = np.concatenate([4 * k + i_phase, 4 * k[remat], c_seq[looked]])
    snap_stage = np.concatenate([s, s[remat], c_stage[looked]])
    again = np.where(B[remat], _b_remat(schedule), REMAT_LIVE).astype(np.int64)
    snap_running = np.concatenate([running, again, np.full(int(looked.sum()), -1)])
    c_mb = np.concatenate([m[p[4]] for p in change_parts])  # (each change: the acting one's)
    snap_mb = np.concatenate([m, m[remat], c_mb[looked]])
    return _Events(
        c_seq, c_stage, c_state, c_delta, snap_seq, snap_stage, snap_running, c_mb, snap_mb
    )


def _recomputed(modes: Sequence[str], s: np.ndarray, m: np.ndarray, M: int) -> np.ndarray:
    """Whether each action (stage s, micro-batch m) runs under its stage's recomputation."""
    code = np.array([("never", "except_last", "always").index(x) for x in modes])[s]
    return (code == 2) | ((code == 1) & (m < M - 1))


def _pareto_array(rows: np.ndarray) -> Occupancy:
    """The distinct rows no other row dominates in every entry, as sorted tuples.

    A row can only be dominated by a different one with a larger sum, so rows go in blocks by
    descending sum: a block's rows that no other row of it strictly dominates are kept (nothing
    later can dominate them, and whatever was dropped before is dominated by a row kept before,
    which has already removed it), and they remove every later row they dominate or equal."""
    rows = rows[np.argsort(-rows.sum(axis=1), kind="stable")]
    alive = np.ones(len(rows), dtype=bool)
    kept = []
    while alive.any():
        idx = np.nonzero(alive)[0][:64]
        block = rows[idx]
        ge = (block[:, None, :] >= block[None, :, :]).all(axis=2)  # ge[a, b]: a >= b
        strictly = ge & ~ge.T
        new = block[~strictly.any(axis=0)]
        kept.append(new)
        alive[idx] = False
        rest = np.nonzero(alive)[0]
        if len(rest) and len(new):
            gone = (new[:, None, :] >= rows[rest][None, :, :]).all(axis=2).any(axis=0)
            alive[rest[gone]] = False
    return tuple(sorted(set(map(tuple, np.concatenate(kept).tolist()))))


@dataclass
class Replay:
    """Device levels along the issue order: `levels[r]` is (step, bytes) after each change on
    rank r, step 2k being the start of order[k] and 2k + 1 its end (-1: before the first);
    `peaks[r]` is the maximum."""

    order: list[Action]
    levels: list[list[tuple[int, int]]]
    peaks: list[int]


def replay(
    schedule: Schedule,
    recompute: str | Sequence[str],
    sizes: Sequence[StageBytes],
    *,
    smaller: Sequence[StageBytes] | None = None,
    larger: int = 0,
) -> Replay:
    """Walk the issue order with the bytes of every stage: each device's level and peak
    (`smaller`, `larger`: as for `peaks`)."""
    S, R = schedule.num_stages, schedule.num_ranks
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    place = schedule.placement
    big = [b.per_state() for b in sizes]
    small = big if smaller is None else [b.per_state() for b in smaller]
    level = [0] * R
    for s in range(S):
        level[place[s]] += sizes[s].static
    levels = [[(-1, level[r])] for r in range(R)]
    peaks = list(level)
    held = [sum(sizes[s].runtime for s in schedule.stages_of(r)) for r in range(R)]
    late = [sizes[s].late_grad for s in range(S)]  # (not made until the stage's B or W)
    level = [level[r] + held[r] - sum(late[s] for s in schedule.stages_of(r)) for r in range(R)]
    steps = _steps(schedule, modes)
    for k, step in enumerate(steps):
        s, r = step.action.stage, step.rank
        made = late[s] and step.action.kind.value in ("B", "W")
        later = sizes[s].late_grad_at_end or sizes[s].late_live  # (from the action's end)
        if made and not later:
            level[r] += late[s]
            late[s] = 0
        rest = smaller is not None and step.action.microbatch >= larger
        per_state, mine = (small, smaller) if rest else (big, sizes)
        for changes, running in step.phases:
            changed = {r}
            for stage, state, d in changes:
                level[place[stage]] += d * per_state[stage][state]
                changed.add(place[stage])
            transient = mine[s].transient(running)  # type: ignore[index]
            if made and late[s] and running == LIVE and mine[s].late_live:
                transient = mine[s].late_live  # (its first B: the late gradient made inside)
            for rr in changed:
                now = level[rr] + (transient if rr == r else 0)
                levels[rr].append((2 * k, now))
                peaks[rr] = max(peaks[rr], now)
        if made and late[s]:  # (made by the action's last layer: there from its end)
            level[r] += late[s]
            late[s] = 0
        changed = {r}
        for stage, state, d in step.end:
            level[place[stage]] += d * per_state[stage][state]
            changed.add(place[stage])
        for rr in changed:
            levels[rr].append((2 * k + 1, level[rr]))
            peaks[rr] = max(peaks[rr], level[rr])
    for r in range(R):
        gone = held[r] + sum(sizes[s].late_grad - late[s] for s in schedule.stages_of(r))
        if gone:  # (the step over: the runtime's and the late gradients let go)
            level[r] -= gone
            levels[r].append((2 * len(steps), level[r]))
        peaks[r] = max(peaks[r], level[r] + device_step([sizes[s] for s in schedule.stages_of(r)]))
    return Replay([st.action for st in steps], levels, peaks)


def timed_levels(
    schedule: Schedule,
    recompute: str | Sequence[str],
    sizes: Sequence[StageBytes],
    when: dict[Action, tuple[float, float]],
    *,
    smaller: Sequence[StageBytes] | None = None,
    larger: int = 0,
) -> list[list[tuple[float, int]]]:
    """Each device's level over simulated time, for drawing: the same changes as `replay`, each
    at its action's start or end in `when` (frees first at a tie). Peaks come from the issue
    order (`peaks`, `replay`): on one host the order, not the clock, decides what coexists."""
    S, R = schedule.num_stages, schedule.num_ranks
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    place = schedule.placement
    big = [b.per_state() for b in sizes]
    small = big if smaller is None else [b.per_state() for b in smaller]
    events: list[list[tuple[float, int]]] = [[] for _ in range(R)]
    late = [b.late_grad for b in sizes]
    for step in _steps(schedule, modes):
        start, end = when[step.action]
        per_state = small if step.action.microbatch >= larger else big
        s = step.action.stage
        if late[s] and step.action.kind.value in ("B", "W"):  # (made by the first of them)
            later = sizes[s].late_grad_at_end or sizes[s].late_live
            events[place[s]].append((end if later else start, late[s]))
            late[s] = 0
        for changes, _ in step.phases:
            for stage, state, d in changes:
                events[place[stage]].append((start, d * per_state[stage][state]))
        for stage, state, d in step.end:
            events[place[stage]].append((end, d * per_state[stage][state]))
    out = []
    for r in range(R):
        mine = [sizes[s] for s in schedule.stages_of(r)]
        # (the runtime's bytes from the step's start; late gradients not made yet)
        level = sum(b.static + b.runtime - b.late_grad for b in mine)
        steps = [(0.0, level)]
        for t, delta in sorted(events[r]):
            level += delta
            steps.append((t, level))
        out.append(steps)
    return out


def _pareto(tuples: set[tuple[int, ...]]) -> Occupancy:
    """Drop tuples that another tuple dominates in every entry: they can never be the peak.
    Sorted descending, a tuple can only be dominated by one already kept."""
    keep: list[tuple[int, ...]] = []
    for t in sorted(tuples, reverse=True):
        if not any(all(x >= y for x, y in zip(q, t)) for q in keep):
            keep.append(t)
    return tuple(sorted(keep))
