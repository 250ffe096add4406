"""The partition solvers are exact: checked against brute force over every split."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs import Chain
from planner.dp import solve_partition_dp
from planner.memory import MemoryModel, StageShape
from planner.partition import StageSpec, solve_partition


def reference_memory(c: Chain, i: int, j: int, shape: StageShape) -> int:
    """The memory model of DESIGN.md, written out plainly."""
    p = int(c.params[i:j].sum())
    saved = int(c.saved[i:j].sum()) - int(c.shared[i + 1 : j].sum())
    entering = int(c.boundary[i])
    stash = max(a * entering + b * saved for a, b in shape.stash)
    live = int(c.transient[i:j].max())
    return (
        p
        + int(c.buffers[i:j].sum())
        + p
        + shape.optimizer_slots * p
        + stash
        + live
        + shape.reserved
    )


def brute_force(times, chain, specs) -> float:
    L, K = len(times), len(specs)
    best = math.inf
    for cuts in itertools.combinations(range(1, L), K - 1):
        bounds = [0, *cuts, L]
        cost = 0.0
        for s, (i, j) in enumerate(zip(bounds[:-1], bounds[1:])):
            if reference_memory(chain, i, j, specs[s].shape) > specs[s].budget:
                break
            cost = max(cost, float(sum(times[i:j])) / specs[s].speed)
        else:
            best = min(best, cost)
    return best


@st.composite
def problems(draw):
    L = draw(st.integers(1, 12))
    K = draw(st.integers(1, min(L, 5)))
    ints = lambda lo, hi, n: np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)))  # noqa: E731
    saved = ints(0, 40, L)
    shared = np.array(
        [0] + [draw(st.integers(0, int(min(saved[k - 1], saved[k])))) for k in range(1, L)]
    )
    chain = Chain(
        mb=1,
        forward=ints(1, 9, L).astype(float),
        backward=ints(0, 9, L).astype(float),
        input_grad=np.zeros(L),
        weight_grad=np.zeros(L),
        params=ints(0, 60, L),
        buffers=ints(0, 5, L),
        saved=saved,
        shared=shared,
        transient=ints(0, 30, L),
        boundary=ints(1, 25, L + 1),
    )
    specs = [
        StageSpec(
            speed=draw(st.sampled_from([0.5, 1.0, 2.0])),
            budget=draw(st.integers(20, 700)),
            shape=StageShape(
                stash=tuple(
                    draw(
                        st.lists(
                            st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=3
                        )
                    )
                ),
                optimizer_slots=draw(st.integers(0, 2)),
                reserved=draw(st.integers(0, 10)),
            ),
        )
        for _ in range(K)
    ]
    return chain, specs


def check_partition(part, times, chain, specs):
    bounds = part.bounds
    assert bounds[0] == 0 and bounds[-1] == len(times) and len(bounds) == len(specs) + 1
    assert all(a < b for a, b in zip(bounds[:-1], bounds[1:])), "an empty stage"
    for s, (i, j) in enumerate(part.stages):
        assert reference_memory(chain, i, j, specs[s].shape) <= specs[s].budget
    assert part.bottleneck == max(
        float(sum(times[i:j])) / sp.speed for (i, j), sp in zip(part.stages, specs)
    )


def assert_optimal(part, expected, times, chain, specs):
    """`part` is a valid split with the brute-force optimum, or None when nothing fits."""
    if math.isinf(expected):
        assert part is None
    else:
        assert part is not None
        check_partition(part, times, chain, specs)
        assert part.bottleneck == expected


@settings(max_examples=400, deadline=None)
@given(problems())
def test_probe_and_dp_match_brute_force(problem):
    chain, specs = problem
    times = chain.forward + chain.backward
    memory = MemoryModel(chain)
    expected = brute_force(times, chain, specs)
    for solve in (solve_partition, solve_partition_dp):
        assert_optimal(solve(times, memory, specs), expected, times, chain, specs)


@settings(max_examples=200, deadline=None)
@given(problems())
def test_memory_model_matches_reference_formula(problem):
    chain, specs = problem
    memory = MemoryModel(chain)
    L = chain.num_layers
    i, j = np.array([(i, j) for i in range(L) for j in range(i + 1, L + 1)]).T
    for spec in specs:
        got = memory.total(i, j, spec.shape)
        assert got.tolist() == [reference_memory(chain, a, b, spec.shape) for a, b in zip(i, j)]


def test_greedy_would_strand_a_heavy_layer_but_the_probe_does_not():
    # Device 1 is small; filling device 0 greedily to layer 2 leaves the heavy layer 2 on it.
    chain = Chain(
        mb=1,
        forward=np.array([1.0, 1.0, 1.0, 1.0]),
        backward=np.zeros(4),
        input_grad=np.zeros(4),
        weight_grad=np.zeros(4),
        params=np.array([1, 1, 50, 1]),
        buffers=np.zeros(4, dtype=np.int64),
        saved=np.zeros(4, dtype=np.int64),
        shared=np.zeros(4, dtype=np.int64),
        transient=np.zeros(4, dtype=np.int64),
        boundary=np.ones(5, dtype=np.int64),
    )
    shape = StageShape(stash=((0, 1),), optimizer_slots=0)
    specs = [StageSpec(1.0, 1000, shape), StageSpec(1.0, 10, shape), StageSpec(1.0, 1000, shape)]
    part = solve_partition(chain.forward, MemoryModel(chain), specs)
    assert part is not None and part.bounds == [0, 1, 2, 4]


def test_equal_layers_split_evenly_at_scale():
    L, K = 4096, 64
    chain = Chain(
        mb=1,
        forward=np.ones(L),
        backward=np.ones(L),
        input_grad=np.ones(L) / 2,
        weight_grad=np.ones(L) / 2,
        params=np.ones(L, dtype=np.int64),
        buffers=np.zeros(L, dtype=np.int64),
        saved=np.ones(L, dtype=np.int64),
        shared=np.zeros(L, dtype=np.int64),
        transient=np.zeros(L, dtype=np.int64),
        boundary=np.ones(L + 1, dtype=np.int64),
    )
    shape = StageShape(stash=((0, 4),), optimizer_slots=2)
    part = solve_partition(
        chain.forward + chain.backward, MemoryModel(chain), [StageSpec(1.0, 10**9, shape)] * K
    )
    assert part is not None
    assert part.bottleneck == 2 * L / K
    assert all(j - i == L // K for i, j in part.stages)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_cpsat_matches_brute_force(problem):
    from planner.cpsat import solve_partition_cpsat

    chain, specs = problem
    times = chain.forward + chain.backward  # whole milliseconds: exact after scaling
    expected = brute_force(times, chain, specs)
    part = solve_partition_cpsat(times, MemoryModel(chain), specs)
    assert_optimal(part, expected, times, chain, specs)
    if part is not None:
        assert part.extra["optimal"] == 1.0 and part.extra["gap"] == 0.0
