"""The search over (M, schedule, recompute): its prior bound is a true lower bound, and pruning by
it returns exactly the plan an exhaustive search returns."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner.search as search
from planner import Cluster, plan_pipeline
from planner.bounds import prior_bound
from schedules import Costs, build_schedule, simulate
from tests.conftest import synthetic_profile


def _splits(L: int, S: int):
    for cuts in itertools.combinations(range(1, L), S - 1):
        yield [0, *cuts, L]


@settings(max_examples=60, deadline=None)
@given(
    work=st.lists(st.floats(0.0, 5.0), min_size=2, max_size=6),
    ratio=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6),
    schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    M=st.integers(1, 6),
    K=st.integers(1, 3),
)
def test_prior_bound_is_below_every_split_of_every_schedule(work, ratio, schedule, M, K):
    """Brute force: the bound is at most the simulated makespan of every split."""
    v = 2 if schedule == "interleaved-1f1b" else 1
    S = K * v
    L = len(work)
    if S > L or (v > 1 and M > K and M % K):
        return
    f = np.array([w * r for w, r in zip(work, ratio)])  # forward: a share of the layer's work
    b = np.array(work) - f
    i = b / 2
    counted = f if schedule == "zb-h1" else f + b
    bound = prior_bound(np.array(work), counted, M, S, [1.0] * K)
    sched = build_schedule(schedule, S, M, stages_per_rank=v)
    for bounds in _splits(L, S):
        fs = [float(f[x:y].sum()) for x, y in itertools.pairwise(bounds)]
        bs = [float(b[x:y].sum()) for x, y in itertools.pairwise(bounds)]
        iss = [float(i[x:y].sum()) for x, y in itertools.pairwise(bounds)]
        ws = [bb - ii for bb, ii in zip(bs, iss)]
        tl = simulate(sched, Costs(fs, bs, input_grad=iss, weight_grad=ws), memory=False)
        assert bound <= tl.makespan * (1 + 1e-9) + 1e-12, (bounds, bound, tl.makespan)


def test_prior_bound_reaches_the_full_trip_for_one_microbatch():
    # M = 1 on S stages: nothing overlaps, the makespan is every layer's work in turn
    work = np.array([1.0, 2.0, 3.0])
    assert prior_bound(work, work, 1, 3, [1.0, 1.0, 1.0]) == pytest.approx(6.0)


@settings(max_examples=10, deadline=None)
@given(
    forward=st.lists(st.floats(0.1, 4.0), min_size=4, max_size=8),
    backward_ratio=st.floats(0.2, 40.0),
    memory=st.integers(1_500, 6_000),
    K=st.integers(2, 3),
    N=st.sampled_from([3, 4, 6, 8]),
    latency=st.sampled_from([0.0, 0.5, 20.0]),
)
def test_pruned_search_returns_the_exhaustive_plan(forward, backward_ratio, memory, K, N, latency):
    """Also where transfers dominate and backward dwarfs forward (zero bubble's W is then what a
    wrong bound would count on the critical path)."""
    fwd = [round(x, 3) for x in forward]
    profile = synthetic_profile(
        fwd,
        [round(x * backward_ratio, 3) for x in fwd],
        sizes=(1, 2, 4, 8),
        loss={"forward": 0.2, "saved": 16},
    )
    cluster = Cluster.uniform(K, memory, bandwidth=1e6, latency_ms=latency)
    try:
        pruned = plan_pipeline(profile, cluster, N)
    except search.InfeasibleError:
        pruned = None
    with pytest.MonkeyPatch.context() as mp:  # no bound prunes anything: every candidate solved
        mp.setattr(search, "prior_bound", lambda *a: 0.0)
        mp.setattr(search, "_lower_bound", lambda *a: 0.0)
        try:
            full = plan_pipeline(profile, cluster, N)
        except search.InfeasibleError:
            full = None
    assert (pruned is None) == (full is None)
    if full is None:
        return
    assert full.solver.solved == full.solver.candidates and full.solver.pruned == 0
    a, b = json.loads(pruned.canonical_json()), json.loads(full.canonical_json())
    for plan in (a, b):
        plan["solver"].pop("solved"), plan["solver"].pop("pruned")
    assert a == b


def test_zero_bubble_trip_does_not_count_w_on_the_critical_path():
    """Found by review: a fast forward, a slow backward and a high latency, where zb-h1 at M=1
    (105.2 ms) beats everything else; counting W in the trip bound skipped it."""
    profile = synthetic_profile([0.6, 0.24], [11.38, 19.05], sizes=(1, 2, 4, 8))
    cluster = Cluster.uniform(2, "1GB", latency_ms=20.0)
    best = plan_pipeline(profile, cluster, 3)
    forced = plan_pipeline(profile, cluster, 3, microbatches=1, schedule="zb-h1")
    assert best.predicted.iteration_ms <= forced.predicted.iteration_ms


def test_time_limit_returns_a_plan_marked_not_proven():
    profile = synthetic_profile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], sizes=(1, 2, 4, 8))
    plan = plan_pipeline(profile, Cluster.uniform(2, "1MiB"), 8, time_limit_s=0.0)
    assert plan.solver.solved == 1 and not plan.solver.optimal
    assert "time limit" in plan.solver.unproven
