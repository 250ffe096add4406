"""The issue order and what each device holds along it (schedules/order.py, memory.py), and where
a torchrun rank may let go of what it sent (schedules/comm.py): hand-derived cases, and the two
ways of computing a peak (occupancy tuples, the replay) against each other."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    Costs,
    StageBytes,
    build_schedule,
    canonical_order,
    issue_order,
    memory,
    occupancy,
    replay,
    simulate,
)
from schedules.memory import STATES, TRANSIENTS, peaks

FLAGS = (0, 0, 0, 0, 0, 0)  # no transient running
LIVE = (1, 0, 0, 0, 0, 0)
REMAT = (0, 1, 0, 0, 0, 0)
STOP = (0, 0, 0, 0, 0, 1)  # a recomputed B's forward: a checkpoint's, which stops early


def test_issue_order_follows_a_unit_cost_run():
    # 1f1b, K = 2, M = 3, F = 1 and B = 2: rank 0 runs F0 [0,1] F1 [1,2], rank 1 F0 [1,2]
    # B0 [2,4]; then 0B0 and 1F1 both start at 4 (lower rank first), 1B1 [5,7], 0F2 [6,7], ...
    order = canonical_order(build_schedule("1f1b", 2, 3))
    assert " ".join(map(str, order)) == "0F0 0F1 1F0 1B0 0B0 1F1 1B1 0F2 0B1 1F2 1B2 0B2"


def test_occupancy_of_1f1b_by_hand():
    # per state: input, activations, during_i, between_iw, grad, pulled, early, late; then
    # the transients.
    # Stage 0 holds two micro-batches' activations while its first backward runs, and pulls the
    # gradient it consumes; stage 1 holds the next micro-batch's input (pushed at 0F1) and its
    # own gradient for stage 0 to pull.
    # A forward runs with remat_live (what a forward that keeps its saves adds), B with live.
    occ = occupancy(build_schedule("1f1b", 2, 3), "never")
    assert occ[0] == (
        (0, 2, 0, 0, 0, 0, 0, 0, *REMAT),  # 0F1 (and 0F2, with mb 1 still held)
        (0, 2, 0, 0, 0, 1, 0, 0, *LIVE),  # 0B0
    )
    assert occ[1] == (
        (1, 0, 0, 0, 1, 0, 0, 0, *FLAGS),  # after 1B0: mb 1 pushed in, mb 0's input gradient
        (1, 1, 0, 0, 0, 0, 0, 0, *REMAT),  # 1F0 running, mb 1 waiting
        (1, 1, 0, 0, 0, 0, 0, 0, *LIVE),  # 1B0 running, mb 1 waiting
        (2, 0, 0, 0, 0, 0, 0, 0, *FLAGS),  # two inputs pushed before 1F0 runs
    )


def test_recomputed_gpipe_keeps_inputs_and_rematerialises_one():
    M = 4
    occ = occupancy(build_schedule("gpipe", 2, M), "always")
    # the first backward: every other micro-batch kept as its input, one re-materialised
    # (first by a checkpoint's forward, beside the pulled gradient, then backward itself runs)
    assert (M - 1, 1, 0, 0, 0, 1, 0, 0, *STOP) in occ[0]
    assert not any(t[5] and t[9] for t in occ[0])  # (not a forward that runs whole)
    assert (M - 1, 1, 0, 0, 0, 1, 0, 0, *LIVE) in occ[0]
    # not recomputing, B re-materialises nothing: no forward's transient beside a pulled one
    kept = occupancy(build_schedule("gpipe", 2, M), "never")[0]
    assert [t for t in kept if t[5]] == [(0, M, 0, 0, 0, 1, 0, 0, *LIVE)]
    # a recomputed forward keeps nothing: it runs with the forward_live transient
    assert any(t[8:] == (0, 0, 1, 0, 0, 0) for t in occ[0])


@st.composite
def sized(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
    K, M = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["never", "except_last", "always"]))
    b = st.integers(0, 1000)
    sizes = [
        StageBytes(
            input=draw(b),
            activations=draw(b),
            during_i=draw(b),
            between_iw=draw(b),
            grad=draw(b),
            pulled=draw(b),
            early=draw(b),
            late=draw(b),
            live=draw(b),
            remat_live=draw(b),
            forward_live=draw(b),
            input_live=draw(b),
            weight_live=draw(b),
            stop_live=draw(b),
            optimizer_step=draw(b),
            static=draw(b),
        )  # fmt: skip
        for _ in range(K)
    ]
    sched = build_schedule(name, K, M)
    sched.routes = draw(_routes(K))
    return sched, mode, sizes


def _routes(S):
    """Some chain of S stages plus skips: every stage sends to the next, some further on."""
    skips = [(s, t) for t in range(S) for s in range(t - 1)]
    chain = [(s, s + 1) for s in range(S - 1)]
    return (
        st.lists(st.sampled_from(skips), unique=True).map(lambda x: chain + x)
        if skips
        else (st.just(chain))
    )


@settings(max_examples=150, deadline=None)
@given(sized())
def test_occupancy_peak_is_the_replayed_peak(case):
    """One stage per device: the worst occupancy tuple (what the planner maximises over) gives
    exactly the peak of walking the issue order action by action."""
    sched, mode, sizes = case
    occ = occupancy(sched, mode)
    played = replay(sched, mode, sizes)
    for s, b in enumerate(sizes):
        worst = max(max(b.held(t) for t in occ[s]), b.optimizer_step)
        assert played.peaks[s] == b.static + worst
    # and a step leaves nothing behind
    assert [levels[-1][1] for levels in played.levels] == [b.static for b in sizes]


def _drawn(name, R, M, data):
    """A schedule of `name` on R ranks and M micro-batches with drawn per-stage modes and
    skips, and those modes; None where interleaved 1F1B cannot run M."""
    v = 2 if name == "interleaved-1f1b" else 1
    if v == 2 and M > R and M % R:
        return None
    sched = build_schedule(name, R * v, M, stages_per_rank=v)
    S = sched.num_stages
    modes = data.draw(st.lists(st.sampled_from(["never", "except_last", "always"]),
                               min_size=S, max_size=S))  # fmt: skip
    sched.routes = data.draw(_routes(S))
    return sched, modes


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    st.integers(1, 5),
    st.integers(1, 9),
    st.data(),
)
def test_occupancy_bound_is_at_least_every_tuple_and_reached_where_it_is_exact(name, R, M, data):
    """The planner's first solve counts memory by occupancy_bound, which needs no issue order:
    every state count and transient of every tuple along the issue order is at most the
    bound's, per-stage recomputation and skips included. A state entered and left within one
    action (the gradient B pulls) counts once, not once per micro-batch; within one phase (a
    first stage's input, which its forward turns into activations), not at all."""
    from schedules.memory import occupancy_bound

    drawn = _drawn(name, R, M, data)
    if drawn is None:
        return
    sched, modes = drawn
    S = sched.num_stages
    exact, bound = occupancy(sched, modes), occupancy_bound(sched, modes)
    assert len(bound) == S
    for s in range(S):
        (top,) = bound[s]
        assert all(all(x <= y for x, y in zip(t, top)) for t in exact[s])
        # nothing is counted that no look ever sees
        for k in range(len(top)):
            assert top[k] == 0 or any(t[k] > 0 for t in exact[s])
    if name == "gpipe" and modes[0] == "never" and S > 1:
        input_, activations, pulled = bound[0][0][0], bound[0][0][1], bound[0][0][5]
        assert (input_, activations, pulled) == (0, M, 1)


def _bound_action_by_action(sched, modes) -> list:
    """occupancy_bound as its rule says, summed over every action of the program: each action's
    net gain per state (losses left out), plus the most any one action's phases reach past its
    own net gain; a transient where one of the stage's actions runs it."""
    from schedules.memory import LIVE as FIRST
    from schedules.memory import TRANSIENTS, _build_events
    from schedules.order import program_arrays

    S, NS = sched.num_stages, len(memory.STATES)
    ev = _build_events(sched, modes, program_arrays(sched))
    gained, beyond = np.zeros((S, NS), dtype=np.int64), np.zeros((S, NS), dtype=np.int64)
    phases: dict[tuple[int, int, int], dict[int, int]] = {}  # (action, stage, state): per phase
    for seq, stage, state, d in zip(ev.change_seq, ev.change_stage, ev.change_state,
                                    ev.change_delta):  # fmt: skip
        per = phases.setdefault((int(seq) // 4, int(stage), int(state)), {})
        per[int(seq) % 4] = per.get(int(seq) % 4, 0) + int(d)
    for (_, stage, state), per in phases.items():
        run, reach = 0, -(10**9)
        for phase in sorted(per):
            run += per[phase]
            reach = max(reach, run)
        gained[stage, state] += max(run, 0)
        beyond[stage, state] = max(beyond[stage, state], reach - max(run, 0))
    flags = np.zeros((S, len(TRANSIENTS)), dtype=np.int64)
    for stage, running in zip(ev.snap_stage, ev.snap_running):
        if running >= 0:
            flags[stage, running - FIRST] = 1
    rows = np.concatenate([gained + beyond, flags], axis=1)
    return [(tuple(int(n) for n in row),) for row in rows]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    st.integers(1, 5),
    st.integers(1, 9),
    st.data(),
)
def test_occupancy_bound_from_one_action_of_each_type_is_the_sum_over_every_action(
    name, R, M, data
):
    """occupancy_bound turns one action of each type (kind, stage, recomputed or not) into
    events and counts its gains as often as the program has such actions: the same tuples as
    the rule summed action by action, per-stage recomputation and skips included."""
    from schedules.memory import _bound_of

    drawn = _drawn(name, R, M, data)
    if drawn is None:
        return
    sched, modes = drawn
    assert _bound_of(sched, modes) == _bound_action_by_action(sched, modes)


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    st.integers(1, 5),
    st.integers(1, 9),
    st.data(),
)
def test_occupancy_floor_tuples_are_each_below_a_tuple_of_the_issue_order(name, R, M, data):
    """occupancy_floor proves that no split fits without the issue order: each of its tuples
    is at most some exact tuple in every entry (the own states' counts and the transient are
    the issue order's at that look; what arrives from other stages counts none), per-stage
    recomputation and skips included. And it is not empty: each stage's activations show."""
    from schedules.memory import occupancy_floor

    drawn = _drawn(name, R, M, data)
    if drawn is None:
        return
    sched, modes = drawn
    S = sched.num_stages
    exact, floor = occupancy(sched, modes), occupancy_floor(sched, modes)
    assert len(floor) == S
    for s in range(S):
        assert floor[s]
        for t in floor[s]:
            assert any(all(x <= y for x, y in zip(t, e)) for e in exact[s]), (s, t)
    # 1F1B's first stage holds its warm-up's activations when its first backward runs
    if name == "1f1b" and modes[0] == "never" and S > 1:
        assert max(t[1] for t in floor[0]) == min(S, M)


def test_interleaved_device_holds_no_more_than_its_stages_apart():
    sched = build_schedule("interleaved-1f1b", 4, 4, stages_per_rank=2)
    sizes = [StageBytes(input=3, activations=10, grad=2, live=5, static=100)] * 4
    occ = occupancy(sched, "never")
    played = replay(sched, "never", sizes)
    for r in range(2):
        apart = sum(
            max(sizes[s].held(t) for t in occ[s]) + sizes[s].static for s in sched.stages_of(r)
        )
        assert played.peaks[r] <= apart


def _walked_occupancy(sched, mode):
    """The occupancy as first written: walk the issue order's steps one by one in Python (the
    production code reads the same transitions as arrays)."""
    S = sched.num_stages
    modes = [mode] * S if isinstance(mode, str) else list(mode)
    counts = [[0] * len(memory.STATES) for _ in range(S)]
    seen: list[set] = [set() for _ in range(S)]
    for step in memory._steps(sched, modes):
        s = step.action.stage
        for changes, running in step.phases:
            for stage, state, d in changes:
                counts[stage][state] += d
            flags = tuple(
                int(running == k) for k in range(memory.LIVE, memory.LIVE + len(memory.TRANSIENTS))
            )
            seen[s].add((*counts[s], *flags))
            for stage in {stage for stage, _, d in changes if d > 0 and stage != s}:
                seen[stage].add((*counts[stage], *FLAGS))
        for stage, state, d in step.end:
            counts[stage][state] += d
        for stage in {stage for stage, _, _ in step.end}:
            seen[stage].add((*counts[stage], *FLAGS))
    keep = []
    for tuples in seen:
        kept: list[tuple] = []
        for t in sorted(tuples, reverse=True):
            if not any(all(x >= y for x, y in zip(q, t)) for q in kept):
                kept.append(t)
        keep.append(tuple(sorted(kept)))
    return keep


MODES = ("never", "except_last", "always")


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    K=st.integers(1, 5),
    M=st.integers(1, 12),
    modes=st.lists(st.sampled_from(MODES), min_size=10, max_size=10),
    data=st.data(),
)
def test_array_occupancy_and_peaks_equal_the_step_by_step_walk(name, K, M, modes, data):
    """The arrays the planner uses against the walk: the same Pareto tuples per stage, the same
    peaks as `replay` for random bytes, and the sorted issue order the same as issue_order's
    choice among ready actions (per-stage recomputation modes mixed)."""
    v = 2 if name == "interleaved-1f1b" else 1
    if v > 1 and M > K and M % K:
        return
    sched = build_schedule(name, K * v, M, stages_per_rank=v)
    S = K * v
    sched.routes = data.draw(_routes(S))
    mode = modes[:S] if data.draw(st.booleans()) else modes[0]
    unit = Costs([1.0] * S, [2.0] * S, input_grad=[1.0] * S, weight_grad=[1.0] * S)
    start = {sp.action: sp.start for sp in simulate(sched, unit, memory=False).spans}
    assert canonical_order(sched, mode) == issue_order(sched.compute_only(), start)
    assert occupancy(sched, mode) == _walked_occupancy(sched, mode)
    # a stage's tuples depend on its own recomputation alone (per-stage plans rely on it)
    mixed = modes[:S]
    assert occupancy(sched, mixed) == [occupancy(sched, mixed[s])[s] for s in range(S)]
    n = st.integers(0, 1000)
    sizes = []
    for _ in range(S):
        # a tied copy's gradient, made at its first B or W's start, end, or inside its walk
        late = data.draw(st.sampled_from([0, 0, 1, 500]))
        made = data.draw(st.sampled_from(["start", "end", "inside"])) if late else "start"
        sizes.append(StageBytes(
            *(data.draw(n) for _ in range(14)),
            optimizer_step=data.draw(n),
            foreach=data.draw(st.booleans()),
            static=data.draw(n),
            runtime=data.draw(n),
            late_grad=late,
            late_grad_at_end=made == "end",
            late_live=late + data.draw(n) if made == "inside" else 0,
        ))  # fmt: skip
    assert peaks(sched, mode, sizes) == replay(sched, mode, sizes).peaks
    # a batch split unevenly: the micro-batches from `larger` on weigh bytes of their own
    smaller = [
        dataclasses.replace(b, **{name: data.draw(n) for name in STATES + TRANSIENTS})
        for b in sizes
    ]
    larger = data.draw(st.integers(0, M))
    walked = replay(sched, mode, sizes, smaller=smaller, larger=larger).peaks
    assert peaks(sched, mode, sizes, smaller=smaller, larger=larger) == walked
    if larger == M:  # (none smaller)
        assert walked == replay(sched, mode, sizes).peaks


def test_every_b_of_a_stage_holds_its_pulled_gradient_alike_and_floors_hold_none():
    """A stage whose every tuple holding a pulled gradient is one B's counts a tighter one
    (planner/memory.py, pulled_with): B's own transient alone without recomputation, and with
    it, paired with the forward's. The floor that proves no split fits must never count more
    than the stage: its tuples hold no pulled gradient, whichever way the stage counts it."""
    from planner.memory import pulled_with
    from schedules.memory import occupancy_floor

    for name, K, M, mode in itertools.product(
        ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"], [2, 3, 4], [1, 2, 3, 4, 8], MODES
    ):
        v = 2 if name == "interleaved-1f1b" else 1
        if v > 1 and M > 2 and M % K:
            continue
        sched = build_schedule(name, K * v, M, stages_per_rank=v)
        assert not any(t[5] for stage in occupancy_floor(sched, mode) for t in stage)
        exact = occupancy(sched, mode)
        kinds = [pulled_with(t) for t in exact]
        if name == "zb-h1" and mode == "never":  # I pulls the gradient into during_i
            assert not any(t[5] for stage in exact for t in stage)
        elif name == "zb-h1":  # ... recomputing, beside its re-run first: no B's, the largest
            held = [any(t[5] for t in stage) for stage in exact]
            assert not held[-1] and all(k == "pulled" for k, h in zip(kinds, held) if h), kinds
            assert all(held[:-1]) if mode == "always" else any(held[:-1]) or M == 1, held
        elif mode == "never":
            assert kinds == ["pulled_tight"] * len(kinds), kinds
        elif mode == "always":  # (the last stage pulls none)
            assert kinds[:-1] == ["pulled_paired"] * (len(kinds) - 1), kinds


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), max_size=30).map(sorted), max_size=5))
def test_unique_of_runs_equals_numpys(runs):
    """The bound's grouping (_unique_runs, a stable sort over runs already in order) gives
    np.unique's values and inverse: on increasing runs, and on the same runs reversed."""
    import numpy as np

    from schedules.memory import _unique_runs

    keys = np.array([k for run in runs for k in run][::-1] + [k for run in runs for k in run],
                    dtype=np.int64)  # fmt: skip
    values, at = _unique_runs(keys)
    want, inverse = np.unique(keys, return_inverse=True)
    assert values.tolist() == want.tolist() and at.tolist() == inverse.ravel().tolist()


def _with_inputs_posted_ahead(sched, modes, sizes, t):
    """The replayed levels of stage t's device with every micro-batch's input held from the
    step's start (its receive posted then), as the torchrun program holds them: at each step,
    the inputs whose sender's forward has not yet ended (when replay counts them) are added."""
    played = replay(sched, modes, sizes)
    pushed = {a.microbatch: 2 * k + 1 for k, a in enumerate(played.order)
              if a.stage == t - 1 and a.kind.name == "F"}  # fmt: skip
    r = sched.placement[t]
    return played.peaks[r], max(
        level + sizes[t].input * sum(1 for end in pushed.values() if end > step)
        for step, level in played.levels[r]
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_receives_posted_ahead_raise_no_peak(data):
    """comm.preposted admits a stage only where holding every input from the start keeps its
    device under the peak the plan counts: checked against the replay itself, with drawn bytes
    and modes (gpipe; 1F1B and zero bubble with no more micro-batches than stages, where some
    ranks run every forward first too)."""
    from schedules.comm import preposted

    K, M = data.draw(st.integers(2, 4)), data.draw(st.integers(1, 6))
    kinds = ["gpipe", "1f1b", "zb-h1"] if M <= K else ["gpipe"]
    sched = build_schedule(data.draw(st.sampled_from(kinds)), K, M)
    modes = data.draw(st.lists(st.sampled_from(["never", "except_last", "always"]),
                               min_size=K, max_size=K))  # fmt: skip
    b = st.integers(0, 1000)
    sizes = [StageBytes(**{n: data.draw(b) for n in (
        "input", "activations", "grad", "pulled", "live", "remat_live", "forward_live",
        "stop_live", "static")}) for _ in range(K)]  # fmt: skip
    costs = Costs([1.0] * K, [1.0] * K, recompute=modes, memory=sizes)
    for t in preposted(sched, costs):
        peak, held = _with_inputs_posted_ahead(sched, modes, sizes, t)
        assert held <= peak, (t, modes[t], sizes[t])


def test_receives_posted_ahead_would_raise_this_peak():
    """The rule is needed: a stage whose input outweighs what its forward keeps (not physical,
    but the bytes are the profile's) would hold more with its inputs posted ahead."""
    from schedules.comm import preposted

    sched = build_schedule("gpipe", 2, 4)
    sizes = [StageBytes(), StageBytes(input=10, activations=8, remat_live=1)]
    costs = Costs([1.0] * 2, [1.0] * 2, memory=sizes)
    assert preposted(sched, costs) == set()
    peak, held = _with_inputs_posted_ahead(sched, ["never"] * 2, sizes, 1)
    assert held > peak


def test_steady_schedules_occupancy_stops_growing_past_the_stage_count():
    """1F1B's and zero bubble's exact occupancy and floor are the same for every micro-batch
    count from K + 1 on (each further micro-batch repeats the steady state), the interleaved
    schedule's from 3 rounds on: the planner reads them there (planner/search.py
    `_occupancy`). GPipe's grows with M, as it must; the
    bound above (occupancy_bound) is not read this way, since it differs."""
    from planner.search import _occupancy
    from schedules.memory import occupancy_floor

    for name, K, mode in itertools.product(
        ("1f1b", "zb-h1"), (1, 2, 3, 5, 8), ("never", "always", "except_last")
    ):
        for made in (occupancy, occupancy_floor):
            at = made(build_schedule(name, K, K + 1), mode)
            for M in range(K + 2, 3 * K + 4):
                assert made(build_schedule(name, K, M), mode) == at, (name, K, mode, M)
        # and the planner's tables at a large M are those of the schedule itself
        direct = occupancy(build_schedule(name, K, 4 * K + 3), mode)
        assert _occupancy(name, K, 4 * K + 3, mode) == direct
    # the interleaved schedule (two stages on each of R devices; counts past R are multiples
    # of R) from three rounds on
    for R, mode in itertools.product((1, 2, 3, 4, 6), ("never", "always", "except_last")):

        def inter(M, R=R):
            return build_schedule("interleaved-1f1b", 2 * R, M, stages_per_rank=2)

        for made in (occupancy, occupancy_floor):
            at = made(inter(3 * R), mode)
            for M in range(4 * R, 7 * R, R):
                assert made(inter(M), mode) == at, ("interleaved", R, mode, M)
        assert _occupancy("interleaved-1f1b", R, 7 * R, mode) == occupancy(inter(7 * R), mode)
    # stages recomputing each their own way: each stage's tuples are its own mode's (the
    # planner reads them from the one-mode tables), from K + 1 on too
    for name in ("1f1b", "zb-h1"):
        mixed = ["always", "never", "except_last", "never", "always"]
        at = occupancy(build_schedule(name, 5, 6), mixed)
        for M in (7, 11, 17):
            assert occupancy(build_schedule(name, 5, M), mixed) == at, (name, M)
        assert at == [_occupancy(name, 5, 17, mode)[s] for s, mode in enumerate(mixed)]
    # deep pipelines, as the planner meets them (a few counts each)
    for name, K in (("1f1b", 32), ("zb-h1", 64)):
        at = occupancy(build_schedule(name, K, K + 1), "except_last")
        for M in (K + 2, 2 * K + 3, 3 * K):
            assert occupancy(build_schedule(name, K, M), "except_last") == at, (name, K, M)
    at = occupancy(build_schedule("interleaved-1f1b", 32, 48, stages_per_rank=2), "never")
    assert occupancy(build_schedule("interleaved-1f1b", 32, 80, stages_per_rank=2), "never") == at
    # a count below K + 1 is its own (the warm-up does not fill), and GPipe's keeps growing
    assert occupancy(build_schedule("1f1b", 4, 3), "never") != occupancy(
        build_schedule("1f1b", 4, 5), "never"
    )
    assert occupancy(build_schedule("gpipe", 3, 5), "never") != occupancy(
        build_schedule("gpipe", 3, 6), "never"
    )


def test_an_interleaved_devices_optimizer_steps_add_up_only_when_multi_tensor():
    """Found by a cold review: counting a device's largest stage's step alone, also for a
    multi-tensor (foreach) optimizer, passed every test, since drawn steps were never a device's
    peak. With every state at 0, each device's peak is its static bytes and its stages' steps:
    together where the optimizer steps all tensors at once, the larger one where it goes one
    parameter at a time."""
    sched = build_schedule("interleaved-1f1b", 4, 4)  # 2 devices, stages 0 and 2 on the first
    zero = dict.fromkeys(("activations", "during_i", "between_iw"), 0)  # (default: 1 each)
    for foreach in (False, True):
        sizes = [
            StageBytes(**zero, optimizer_step=1000 * (s + 1), foreach=foreach, static=7)
            for s in range(4)
        ]
        got = peaks(sched, "never", sizes)
        steps = [[1000, 3000], [2000, 4000]]  # per device, its stages'
        want = [14 + (sum(x) if foreach else max(x)) for x in steps]
        assert got == want, (foreach, got)
