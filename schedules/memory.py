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

Transitions, at an action's start (allocations) or its end (frees and hand-offs):

    F(s,m)  start  s = 0: input +1 (its own copy); not recomputed: input -> activations
            end    output pushed to stage s+1: input +1 there
    B(s,m)  start  pulls its output gradient: grad -1 on stage s+1, pulled +1 (s < S-1);
                   recomputed: input -> activations
            end    activations -1; pulled -1; grad +1 (s > 0)
    I(s,m)  start  as B (a recomputed one re-materialises first, as a phase of its own), then
                   activations -> during_i
            end    during_i -> between_iw; grad +1 (s > 0)
    W(s,m)  end    between_iw -1

While an action runs, its device also holds that action's transient, the most one layer adds
above what the states count: `live` for F and B, `remat_live` for the forward that zero bubble
re-materialises at I, `forward_live` for the forward of a recomputed micro-batch (which keeps
nothing), `input_live` for I and `weight_live` for W. One host issues
one action at a time, so a device never holds two transients at once. After the last action,
the optimizer step runs on every device: its temporaries come on top of the weights alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .ir import Action, Kind, Schedule
from .order import canonical_order, schedule_key

STATES = ("input", "activations", "during_i", "between_iw", "grad", "pulled")
IN, ACT, DURING_I, IW, GRAD, PULLED = range(len(STATES))
TRANSIENTS = ("live", "remat_live", "forward_live", "input_live", "weight_live")
LIVE, REMAT_LIVE, FORWARD_LIVE, INPUT_LIVE, WEIGHT_LIVE = range(
    len(STATES), len(STATES) + len(TRANSIENTS)
)

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
    live: int = 0
    remat_live: int = 0
    forward_live: int = 0
    input_live: int = 0
    weight_live: int = 0
    optimizer_step: int = 0  # the optimizer step's temporaries, after the pipeline's step
    foreach: bool = False  # those of a device's stages add up (multi-tensor) or not (one by one)
    static: int = 0

    def per_state(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in STATES)

    def transient(self, which: int) -> int:
        return int(getattr(self, TRANSIENTS[which - LIVE]))

    def held(self, occupancy: Sequence[int]) -> int:
        """Bytes for one occupancy tuple (counts per state, then a flag per transient)."""
        names = STATES + TRANSIENTS
        return sum(n * getattr(self, name) for n, name in zip(occupancy, names))


Changes = tuple[tuple[int, int, int], ...]  # (stage, state, +-1)


@dataclass(frozen=True)
class _Step:
    action: Action
    rank: int
    phases: tuple[tuple[Changes, int], ...]  # in turn: what changes, then the transient running
    end: Changes  # what changes when it ends


_STEPS: dict[tuple, list[_Step]] = {}


def _steps(schedule: Schedule, modes: Sequence[str]) -> list[_Step]:
    """The issue order's state changes, computed once per schedule and recomputation (the
    planner's occupancy, the simulator's replay and its timed levels all walk them)."""
    key = schedule_key(schedule.compute_only(), tuple(modes))
    hit = _STEPS.get(key)
    if hit is None:
        if len(_STEPS) > 256:
            _STEPS.clear()
        hit = _STEPS[key] = _build_steps(schedule, modes)
    return hit


def _build_steps(schedule: Schedule, modes: Sequence[str]) -> list[_Step]:
    S, M, place = schedule.num_stages, schedule.num_microbatches, schedule.placement
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
            else:
                start += [(s, IN, -1), (s, ACT, 1)]
            if s < S - 1:
                end.append((s + 1, IN, 1))
        elif a.kind in (Kind.B, Kind.I):
            if s < S - 1:
                start.append((s + 1, GRAD, -1))
            if rec:
                start += [(s, IN, -1), (s, ACT, 1)]
            if a.kind == Kind.I:
                if rec:  # the re-materialising forward runs before I itself
                    phases.append((tuple(start), REMAT_LIVE))
                    start = []
                running = INPUT_LIVE
                start += [(s, ACT, -1), (s, DURING_I, 1)]
                end += [(s, DURING_I, -1), (s, IW, 1)]
            else:
                if s < S - 1:
                    start.append((s, PULLED, 1))
                    end.append((s, PULLED, -1))
                end.append((s, ACT, -1))
            if s > 0:
                end.append((s, GRAD, 1))
        elif a.kind == Kind.W:
            running = WEIGHT_LIVE
            end.append((s, IW, -1))
        phases.append((tuple(start), running))
        steps.append(_Step(a, place[s], tuple(phases), tuple(end)))
    return steps


def occupancy(schedule: Schedule, recompute: str | Sequence[str]) -> list[Occupancy]:
    """Per stage: every combination of counts (per state, then which transient runs) the stage
    passes through, without those another one dominates. A stage's peak for any StageBytes b is
    max over its tuples of b.held(tuple)."""
    S = schedule.num_stages
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    counts = [[0] * len(STATES) for _ in range(S)]
    seen: list[set[tuple[int, ...]]] = [set() for _ in range(S)]
    idle = (0,) * len(TRANSIENTS)
    for step in _steps(schedule, modes):
        s = step.action.stage
        for changes, running in step.phases:
            for stage, state, d in changes:
                counts[stage][state] += d
            flags = tuple(int(running == k) for k in range(LIVE, LIVE + len(TRANSIENTS)))
            seen[s].add((*counts[s], *flags))
            for stage in {stage for stage, _, d in changes if d > 0 and stage != s}:
                seen[stage].add((*counts[stage], *idle))
        for stage, state, d in step.end:
            counts[stage][state] += d
        for stage in {stage for stage, _, _ in step.end}:
            seen[stage].add((*counts[stage], *idle))
    return [_pareto(p) for p in seen]


@dataclass
class Replay:
    """Device levels along the issue order: `levels[r]` is (step, bytes) after each change on
    rank r, step 2k being the start of order[k] and 2k + 1 its end (-1: before the first);
    `peaks[r]` is the maximum."""

    order: list[Action]
    levels: list[list[tuple[int, int]]]
    peaks: list[int]


def replay(
    schedule: Schedule, recompute: str | Sequence[str], sizes: Sequence[StageBytes]
) -> Replay:
    """Walk the issue order with the bytes of every stage: each device's level and peak."""
    S, R = schedule.num_stages, schedule.num_ranks
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    place = schedule.placement
    per_state = [b.per_state() for b in sizes]
    level = [0] * R
    for s in range(S):
        level[place[s]] += sizes[s].static
    levels = [[(-1, level[r])] for r in range(R)]
    peaks = list(level)
    steps = _steps(schedule, modes)
    for k, step in enumerate(steps):
        s, r = step.action.stage, step.rank
        for changes, running in step.phases:
            changed = {r}
            for stage, state, d in changes:
                level[place[stage]] += d * per_state[stage][state]
                changed.add(place[stage])
            transient = sizes[s].transient(running)
            for rr in changed:
                now = level[rr] + (transient if rr == r else 0)
                levels[rr].append((2 * k, now))
                peaks[rr] = max(peaks[rr], now)
        changed = {r}
        for stage, state, d in step.end:
            level[place[stage]] += d * per_state[stage][state]
            changed.add(place[stage])
        for rr in changed:
            levels[rr].append((2 * k + 1, level[rr]))
            peaks[rr] = max(peaks[rr], level[rr])
    for r in range(R):
        steps_r = [sizes[s].optimizer_step for s in schedule.stages_of(r)]
        foreach = any(sizes[s].foreach for s in schedule.stages_of(r))
        peaks[r] = max(peaks[r], level[r] + (sum(steps_r) if foreach else max(steps_r, default=0)))
    return Replay([st.action for st in steps], levels, peaks)


def timed_levels(
    schedule: Schedule,
    recompute: str | Sequence[str],
    sizes: Sequence[StageBytes],
    when: dict[Action, tuple[float, float]],
) -> list[list[tuple[float, int]]]:
    """Each device's level over simulated time, for drawing: the same changes as `replay`, each
    at its action's start or end in `when` (frees first at a tie). Peaks come from `replay`: on
    one host the issue order, not the clock, decides what coexists."""
    S, R = schedule.num_stages, schedule.num_ranks
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    place = schedule.placement
    per_state = [b.per_state() for b in sizes]
    events: list[list[tuple[float, int]]] = [[] for _ in range(R)]
    for step in _steps(schedule, modes):
        start, end = when[step.action]
        for changes, _ in step.phases:
            for stage, state, d in changes:
                events[place[stage]].append((start, d * per_state[stage][state]))
        for stage, state, d in step.end:
            events[place[stage]].append((end, d * per_state[stage][state]))
    out = []
    for r in range(R):
        level = sum(sizes[s].static for s in schedule.stages_of(r))
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
