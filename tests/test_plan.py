"""plan_pipeline: the memory it predicts is the model's formula, it never exceeds a budget that
some split meets, and when none does it says exactly how much memory would be enough."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import measured_step, quick_profile, synthetic_profile
from hypothesis import given, settings
from hypothesis import strategies as st
from test_partition import reference_memory
from torch import nn

from planner import Cluster, InfeasibleError, Plan, plan_pipeline
from planner.costs import OPTIMIZER_SLOTS, chain_at
from planner.memory import StageShape, pulled_with
from planner.search import simulate_stages
from profiler.types import Timing
from schedules import StageBytes, build_schedule, occupancy


def shape_of(plan: Plan, s: int) -> StageShape:
    v = plan.stages_per_device
    sched = build_schedule(plan.schedule, len(plan.stages), plan.microbatches, stages_per_rank=v)
    return StageShape(
        occupancy=occupancy(sched, plan.recompute)[s],
        optimizer_slots=OPTIMIZER_SLOTS[plan.optimizer],
        reserved=plan.cluster.devices[plan.stages[s].rank].reserved_bytes // v,
    )


SCHEDULE_NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MODES = ["never", "except_last", "always"]


def by_hand(
    i: int, j: int, mb: int, *, saved, shared, out, inp, input_saved, transient, L, kind="pulled",
):  # fmt: skip
    """A stage's bytes per state, written out from DESIGN.md's model (no loss here; a CPU
    profile: stage 0 works on the caller's micro-batch, so holds none of its input). `kind`:
    how its occupancy holds a pulled gradient (pulled_with)."""
    X = mb * (0 if i == 0 else out[i - 1])

    def held(e):  # what layers i .. e - 1 save
        return mb * (sum(saved[i:e]) - sum(shared[i + 1 : e]))

    def grad_out(k):  # the gradient B pulls for layer k's output (none for the last's)
        return mb * out[k] if k != L - 1 else 0

    def live(e):  # B's transient, a stage [i, e)
        return max(
            [0]  # (B's re-materialising forward, when it recomputes, runs with stop_live)
            # each layer's backward, less what the layers after it saved, let go by then
            + [
                mb * (transient[k] + 1 - sum(saved[k + 1 : e]) + sum(shared[k + 1 : e]))
                for k in range(i, e - 1)
            ]
            # the last layer's backward without the output gradient B pulls
            + [mb * (transient[e - 1] + 1) - grad_out(e - 1)]
        )

    def remat(e):  # a forward keeping its saves, a stage [i, e): less what comes later
        def later(k):
            return mb * (sum(saved[k + 1 : e]) - sum(shared[k + 1 : e]))

        return max([mb * transient[i] - later(i)]
                   + [mb * (transient[k] + 2) - later(k) for k in range(i + 1, e)])  # fmt: skip

    def b_runs(e):  # B's transient; recomputing, the larger of it and its forward's: the
        # stage's whole, re-run by hand at B's start (torch's checkpoint stopped early, at the
        # last layer's last save, but re-ran after the backward of layers that read nothing)
        return max(live(e), remat(e)) if kind == "pulled_paired" else live(e)

    S = held(j)
    if kind == "pulled":  # the largest output gradient of any of its layers
        pulled = max(grad_out(k) for k in range(i, j))
    else:  # B's gradient, activations and transient: the most any end up to j holds
        pulled = max(held(e) + grad_out(e - 1) + b_runs(e) for e in range(i + 1, j + 1))
        pulled -= S + b_runs(j)
    Xs = mb * input_saved[i]
    Z = mb * sum(out[k] for k in range(i, j))  # the last layer's too: W starts there
    G = X if i > 0 else 0

    return StageBytes(
        input=X,
        activations=X + S - Xs,
        during_i=X + S - Xs + Z + G,
        between_iw=S + Z + (X - Xs if G else 0) - (Xs if i == 0 else 0),
        grad=G,
        pulled=pulled,
        # synthetic transients (conftest): forward t, backward t + 1, unsaved input 2,
        # forward keeping nothing saved + t + 3, I t + 4, W t + 5
        remat_live=remat(j),
        live=live(j),
        forward_live=max(
            [mb * (saved[i] + transient[i] + 3)]
            + [mb * (saved[k] + transient[k] + 3 + out[k - 1]) for k in range(i + 1, j)]
        ),
        input_live=max(  # (an inner layer's I runs before the stage's input gradient G)
            [mb * (transient[i] + 4)]
            + [mb * (transient[k] + 4 - sum(out[i : k - 1])) - G for k in range(i + 1, j)]
        ),
        weight_live=mb * (max(transient[i:j]) + 5),
        stop_live=remat(j),
    )


def test_stage_memory_is_the_formula_term_by_term():
    saved, shared, input_saved = [7, 9, 11, 13, 15, 17], [0, 7, 0, 11, 13, 0], [6, 4, 0, 12, 16, 0]
    out, inp, transient = [4, 8, 12, 16, 20, 24], 6, [13, 21, 14, 27, 15, 3]
    # (what a checkpoint's early stop would run of each layer: no part of the plan now)
    stop = [0, 9, 14, 2, 30, 1]
    prof = synthetic_profile(
        [1, 2, 3, 1, 2, 2], params=[10, 20, 30, 40, 50, 60], saved=saved, shared=shared,
        input_saved=input_saved, transient=transient, output_bytes=out, input_bytes=inp,
        stop=stop,
    )  # fmt: skip
    mb = 4
    for schedule, mode in itertools.product(SCHEDULE_NAMES, MODES):
        plan = plan_pipeline(
            prof, Cluster.uniform(3, "1MiB"), 12, microbatches=3, schedule=schedule,
            recompute=mode, optimizer="momentum",
        )  # fmt: skip
        v = plan.stages_per_device
        sched = build_schedule(schedule, len(plan.stages), 3, stages_per_rank=v)
        occ = occupancy(sched, mode)
        for s, st_ in enumerate(plan.stages):
            i, j = st_.layers
            m = st_.memory
            p = sum(prof.layers[k].param_bytes for k in range(i, j))
            assert (m.params, m.grads, m.optimizer) == (p, p, p)
            hand = by_hand(i, j, mb, saved=saved, shared=shared, out=out, inp=inp,
                           input_saved=input_saved, transient=transient, L=6,
                           kind=pulled_with(occ[s]))  # fmt: skip
            got = st_.state_bytes.model_dump()
            # (step_head, step_tail: a carry's, none here, left out of the plan)
            assert {k: got.get(k, 0) for k in vars(hand) if k != "static"} == {
                k: x for k, x in vars(hand).items() if k != "static"
            }
            per = [hand.input, hand.activations, hand.during_i, hand.between_iw, hand.grad,
                   hand.pulled, hand.early, hand.late, hand.live, hand.remat_live,
                   hand.forward_live, hand.input_live, hand.weight_live,
                   hand.stop_live]  # fmt: skip
            worst = max(sum(n * b for n, b in zip(t, per)) for t in occ[s])
            assert m.total == 3 * p + worst
        for dev in plan.devices:
            assert dev.total <= dev.budget
            if v == 1:
                assert dev.total == plan.stages[dev.stages[0]].memory.total
            else:  # each stage has its own budget share; together they never hold more
                assert dev.total <= sum(plan.stages[k].memory.total for k in dev.stages)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_plan_prediction_is_the_simulator(schedule, mode):
    """One cost model: the plan's time and memory are the simulator's, and what the partition
    balances is what the simulator charges each device."""
    prof = synthetic_profile(
        [1, 2, 3, 1, 2, 2, 1, 1],
        [3, 1, 4, 2, 2, 5, 1, 3],
        saved=[70, 90, 11, 13, 150, 17, 40, 5],
        output_bytes=[40, 8, 12, 16, 20, 24, 8, 8],
        loss={"forward": 0.5, "backward": 0.7, "saved": 30, "transient": 60},
    )
    cluster = Cluster.uniform(4, "1MiB", bandwidth=1e6, latency_ms=0.01)
    M = 8
    plan = plan_pipeline(prof, cluster, 16, microbatches=M, schedule=schedule, recompute=mode)
    tl = simulate_stages(plan.schedule, 4, M, plan.stages)
    # Two computations: each stage's worst moment over its occupancy tuples (planner/memory.py,
    # vectorised), and the simulator's walk through the issue order (schedules/memory.py).
    for dev, peak in zip(plan.devices, tl.peak_memory):
        stages = [plan.stages[k].memory.total for k in dev.stages]
        if plan.stages_per_device == 1:
            assert peak == stages[0]
        else:  # the planner gives each stage its own share; together they hold no more
            assert peak <= sum(stages)
    for r in range(4):
        work = sum(st_.work_ms for st_ in plan.stages if st_.rank == r)
        assert tl.busy[r] == pytest.approx(M * work, rel=1e-12)
    links = [st_.send_ms for st_ in plan.stages[:-1]]
    assert plan.predicted.bottleneck_ms == pytest.approx(
        max([st_.work_ms for st_ in plan.stages] + links), rel=1e-12
    )


def test_gpipe_iteration_time_is_the_closed_form():
    fwd = [1, 3, 2, 2, 5, 1, 1, 2]
    bwd = [4, 1, 1, 6, 1, 2, 2, 1]
    prof = synthetic_profile(fwd, bwd)
    plan = plan_pipeline(
        prof, Cluster.uniform(3, "1GiB"), 8, microbatches=8, schedule="gpipe", recompute="always"
    )
    f = [sum(fwd[i:j]) for i, j in (s.layers for s in plan.stages)]
    b = [sum(bwd[i:j]) for i, j in (s.layers for s in plan.stages)]
    r = f
    M = 8
    expected = (sum(f) + (M - 1) * max(f)) + (
        sum(x + y for x, y in zip(b, r)) + (M - 1) * max(x + y for x, y in zip(b, r))
    )
    assert plan.predicted.iteration_ms == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("K,M", [(2, 1), (2, 4), (4, 4), (4, 16), (3, 7)])
def test_equal_stages_bubble_is_k_minus_1_over_m_plus_k_minus_1(K, M):
    prof = synthetic_profile([1.0] * (2 * K))
    plan = plan_pipeline(
        prof, Cluster.uniform(K, "1GiB"), M, microbatches=M, schedule="gpipe", recompute="never"
    )
    assert plan.predicted.bubble_fraction == pytest.approx((K - 1) / (M + K - 1), rel=1e-12)


@pytest.mark.parametrize("target", ["streams", "torchrun"])
@pytest.mark.parametrize("schedule", ["auto", "interleaved-1f1b"])
def test_a_model_past_the_largest_device_is_told_in_one_line(target, schedule):
    """Found by a red team: a model whose weights need more than a device may have (1 PiB)
    gave a validation traceback from the search for the least memory (a plan made at a budget
    past the limit). It is now an InfeasibleError that says so."""
    big = 2**47  # with its gradient and adam's two slots, 4 of these per layer on a device
    prof = synthetic_profile([1.0] * 8, params=[big] * 8)
    with pytest.raises(InfeasibleError, match="no split fits even in 1 PiB per device"):
        plan_pipeline(
            prof, Cluster.uniform(2, "80GiB"), 8, schedule=schedule, target=target,
            microbatches=2 if schedule != "auto" else "auto",
        )  # fmt: skip


def test_the_time_limit_holds_for_the_least_memory_too():
    """Found by a red team: where no split fits, the search for the least memory ran on past
    --time-limit (69 s against 10 s asked). Past the limit, once one candidate's need is known,
    the rest are left untried, and the message says so: a need that fits, not the least."""
    prof = synthetic_profile(
        [1, 1, 4, 1, 1, 2, 3], params=[50, 10, 300, 20, 10, 90, 40], saved=[30, 8, 40, 5, 60, 9, 12]
    )
    with pytest.raises(InfeasibleError) as full:
        plan_pipeline(prof, Cluster.uniform(3, 200), 8)
    assert "untried" not in str(full.value)
    with pytest.raises(InfeasibleError) as cut:
        plan_pipeline(prof, Cluster.uniform(3, 200), 8, time_limit_s=0)
    assert "the best one found" in str(cut.value) and "candidates not looked at" in str(cut.value)
    need = cut.value.needed_bytes
    assert need >= full.value.needed_bytes
    assert plan_pipeline(prof, Cluster.uniform(3, need), 8).fits  # (what it says fits, fits)


def test_needed_memory_is_exactly_the_least_that_fits():
    prof = synthetic_profile(
        [1, 1, 4, 1, 1, 2, 3], params=[50, 10, 300, 20, 10, 90, 40], saved=[30, 8, 40, 5, 60, 9, 12]
    )
    kwargs = dict(microbatches="auto", schedule="auto", recompute="auto")
    with pytest.raises(InfeasibleError) as info:
        plan_pipeline(prof, Cluster.uniform(3, 200), 8, **kwargs)
    need = info.value.needed_bytes
    assert plan_pipeline(prof, Cluster.uniform(3, need), 8, **kwargs).fits
    with pytest.raises(InfeasibleError):
        plan_pipeline(prof, Cluster.uniform(3, need - 1), 8, **kwargs)


@pytest.mark.parametrize(
    "K, schedule, fwd, params, saved, out",
    [
        (3, "gpipe", [3, 1, 4], [237, 269, 137], [53, 7, 55], [148, 198, 76]),
        (2, "1f1b", [4, 2, 1, 4], [215, 213, 239, 168], [20, 43, 19, 27], [83, 123, 95, 138]),
        # a plan found below the closest one's need holds less than it: 1 337 was said, and
        # `plan` succeeded from 1 298 (found by a cold review)
        (3, "auto", [5, 1, 3], [149, 156, 218], [54, 54, 59], [138, 199, 106]),
        # given the need, the split search let splits fit that the program overran: the need
        # found there was 1 byte (budgets below the devices' own were alike), and at 1 664 it
        # said no split fits (found by fuzzing this session's change)
        (3, "auto", [4, 2, 2, 1, 1], [189, 188, 159, 181, 135], [10, 16, 19, 52, 11],
         [54, 78, 150, 154, 147]),
        # with a loss, the last stage of a plan found below ends past the model's last layer
        # (its plan, made again, left the loss out: a traceback on a captured graph, found by
        # a red team)
        (3, "gpipe", [1, 3, 5, 2], [23, 220, 218, 48], [11, 13, 25, 35], [153, 120, 110, 58]),
    ],
)  # fmt: skip
def test_the_need_stated_for_torchrun_plans_there(K, schedule, fwd, params, saved, out):
    """Found by a red team: where a torchrun program holds more than the split search counts
    (gradients received ahead of their backward, messages in flight), the need stated was the
    split search's, and `plan` there failed again (12 of 200 small cases; 1 873 bytes stated
    here, where the closest plan's devices needed 2.05 KiB). Now `plan` succeeds at the need
    and fails one byte below it."""
    loss = {"forward": 0.5, "saved": 40} if len(fwd) == 4 and schedule == "gpipe" else None
    prof = synthetic_profile(fwd, params=params, saved=saved, output_bytes=out, loss=loss)
    kw = dict(target="torchrun", schedule=schedule)
    with pytest.raises(InfeasibleError) as info:
        plan_pipeline(prof, Cluster.uniform(K, 100), 4, **kw)
    need = info.value.needed_bytes
    closest = info.value.closest
    assert max(d.total for d in closest.devices) <= need  # (the message's figures agree)
    assert f"({need} bytes)" in str(info.value)
    plan = plan_pipeline(prof, Cluster.uniform(K, need), 4, **kw)
    assert plan.fits
    with pytest.raises(InfeasibleError):
        plan_pipeline(prof, Cluster.uniform(K, need - 1), 4, **kw)

    def made(p):
        return p.microbatches, p.schedule, [(st.layers, st.recompute) for st in p.stages]

    if made(plan) == made(closest):  # the same plan: the same bytes on every stage
        assert [st.memory.total for st in plan.stages] == [st.memory.total for st in closest.stages]
    # under a time limit, what is said plans too (not proven the least; before, 60 of 120
    # small cases stated a need at which `plan` failed)
    with pytest.raises(InfeasibleError) as cut:
        plan_pipeline(prof, Cluster.uniform(K, 100), 4, time_limit_s=0, **kw)
    assert plan_pipeline(prof, Cluster.uniform(K, cut.value.needed_bytes), 4, **kw).fits


def test_the_search_for_a_need_that_plans_is_bounded_in_time(monkeypatch):
    """Each try of that search is a whole search, long at a tight budget on a large model: past
    PLANNED_SECONDS it stops with what the closest plan holds, which plans, and says so."""
    from planner import search

    prof = synthetic_profile(
        [3, 1, 4], params=[237, 269, 137], saved=[53, 7, 55], output_bytes=[148, 198, 76]
    )
    kw = dict(target="torchrun", schedule="gpipe")
    with pytest.raises(InfeasibleError) as full:
        plan_pipeline(prof, Cluster.uniform(3, 100), 4, **kw)
    monkeypatch.setattr(search, "PLANNED_SECONDS", 0.0)
    with pytest.raises(InfeasibleError) as cut:
        plan_pipeline(prof, Cluster.uniform(3, 100), 4, **kw)
    assert "the search for the least stopped early: it plans with this" in str(cut.value)
    assert "stopped early" not in str(full.value)
    need = cut.value.needed_bytes
    assert need > full.value.needed_bytes  # (here, the least is below what the closest holds)
    assert plan_pipeline(prof, Cluster.uniform(3, need), 4, **kw).fits


@pytest.mark.parametrize("mixed", [False, True])
def test_candidates_alike_in_memory_need_the_same_least_memory(mixed):
    """The search for the least memory tries only the first of the candidates with the same
    micro-batch size and stage shapes (1F1B and zero bubble past their steady state): each
    of the others, searched here on its own, needs exactly as much (what it fits depends on
    nothing else: not its schedule's name, nor M itself), and the least over every candidate
    so searched is the need the error states, on equal devices and on mixed ones."""
    from planner.search import (
        Candidate,
        _fits_within,
        _least,
        _Problem,
        _stage_specs,
        microbatch_candidates,
    )  # fmt: skip

    prof = synthetic_profile(
        [1, 1, 4, 1, 1, 2, 3], params=[50, 10, 300, 20, 10, 90, 40], saved=[30, 8, 40, 5, 60, 9, 12]
    )
    cluster, batch = Cluster.uniform(3, 200), 12
    if mixed:
        cluster = Cluster.model_validate(
            {"devices": [{"name": "big", "memory_bytes": 10**6},
                         {"name": "mid", "memory_bytes": 3000},
                         {"name": "small", "memory_bytes": 50}]}
        )  # fmt: skip
    with pytest.raises(InfeasibleError) as info:
        plan_pipeline(prof, cluster, batch, schedule="auto", recompute="auto")
    problem = _Problem(prof, cluster, batch, "adam")
    needs: dict[tuple, set[int]] = {}
    least_of_all = None
    for m in microbatch_candidates(batch, 3):
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            leasts: dict[str, int] = {}
            for recompute in ("never", "except_last", "always", "per_stage"):
                cand = Candidate(m, schedule, recompute)
                _stage_specs(problem, cand)
                key = (problem.costs(cand).mb, tuple(map(tuple, problem.shapes[(cand, "exact")])))
                least = _least(_fits_within(problem, cand), None)
                assert least is not None
                needs.setdefault(key, set()).add(least)
                least_of_all = least if least_of_all is None else min(least_of_all, least)
                leasts[recompute] = least
            # the per-stage candidate needs no more than never's or except_last's (_infeasible
            # skips those where it was tried)
            assert leasts["per_stage"] <= min(leasts["never"], leasts["except_last"])
    assert all(len(found) == 1 for found in needs.values())
    assert len(needs) < sum(1 for _ in microbatch_candidates(batch, 3)) * 12  # some are alike
    assert info.value.needed_bytes == least_of_all


def test_on_mixed_devices_the_need_is_the_small_ones_and_exact():
    """Found by a user trial: with one small device beside large ones the message asked for
    the large ones' need on every device (14.9 MiB where 1.8 MiB on the small one fitted).
    The need is now what every device with less must have, the others as they are."""
    prof = synthetic_profile(
        [1, 1, 4, 1, 1, 2, 3], params=[50, 10, 300, 20, 10, 90, 40], saved=[30, 8, 40, 5, 60, 9, 12]
    )

    def cluster(small: int) -> Cluster:
        return Cluster.model_validate(
            {
                "devices": [
                    {"name": "big", "memory_bytes": 10**6},
                    {"name": "mid", "memory_bytes": 3000},
                    {"name": "small", "memory_bytes": small},
                ]
            }  # fmt: skip
        )

    with pytest.raises(InfeasibleError) as info:
        plan_pipeline(prof, cluster(50), 8)
    need = info.value.needed_bytes
    assert 50 < need < 3000 and "small; the others as they are" in str(info.value)
    assert plan_pipeline(prof, cluster(need), 8).fits
    with pytest.raises(InfeasibleError):
        plan_pipeline(prof, cluster(need - 1), 8)
    # what the old message asked for, the same memory on every device, is far more
    with pytest.raises(InfeasibleError) as uniform:
        plan_pipeline(prof, Cluster.uniform(3, 50), 8)
    assert uniform.value.needed_bytes > need
    assert "per device" in str(uniform.value)
    # every device below the need: all raised, none "as they are" (found by a red team)
    with pytest.raises(InfeasibleError) as all_small:
        plan_pipeline(prof, Cluster.model_validate({"devices": [
            {"name": "a", "memory_bytes": 40}, {"name": "b", "memory_bytes": 60},
            {"name": "c", "memory_bytes": 50}]}), 8)  # fmt: skip
    assert "per device" in str(all_small.value) and "as they are" not in str(all_small.value)


def test_heterogeneous_cluster_gets_more_layers_on_the_faster_device():
    prof = synthetic_profile([1.0] * 12)
    cluster = Cluster.model_validate(
        {
            "devices": [
                {"name": "big", "memory_bytes": "1GiB", "speed": 2.0},
                {"name": "small", "memory_bytes": "1GiB", "speed": 1.0},
            ]
        }  # fmt: skip
    )
    plan = plan_pipeline(prof, cluster, 4, microbatches=4, schedule="gpipe", recompute="never")
    assert [s.layers for s in plan.stages] == [(0, 8), (8, 12)]


def test_auto_keeps_the_fastest_candidate():
    prof = synthetic_profile([1, 3, 2, 2, 5, 1, 1, 2], [4, 1, 1, 6, 1, 2, 2, 1])
    cluster = Cluster.uniform(4, "1MiB")
    best = plan_pipeline(prof, cluster, 16)
    every = [
        plan_pipeline(prof, cluster, 16, microbatches=m, schedule=s, recompute=r).predicted.iteration_ms
        for m in (1, 2, 4, 8, 16) for s in SCHEDULE_NAMES for r in MODES
        if s != "interleaved-1f1b" or m <= 4 or m % 4 == 0
    ]  # fmt: skip
    assert best.predicted.iteration_ms <= min(every)


def test_plan_is_deterministic_apart_from_meta():
    prof = synthetic_profile([1, 2, 3, 4, 5, 6, 7, 8])
    a = plan_pipeline(prof, Cluster.uniform(4, "1MiB"), 16)
    b = plan_pipeline(prof, Cluster.uniform(4, "1MiB"), 16)
    assert a.canonical_json(with_meta=False) == b.canonical_json(with_meta=False)
    assert a.digest() == b.digest()


def test_plan_names_the_installed_version():
    """The plan's tool_version is the one constant pyproject.toml reads as the package's
    version: the installed metadata and the plan agree."""
    from importlib.metadata import version

    plan = plan_pipeline(synthetic_profile([1, 2, 3, 4]), Cluster.uniform(2, "1MiB"), 4)
    assert plan.meta.tool_version == version("gpipe-plan")
    assert plan.meta.tool_version.count(".") == 2


def test_tight_memory_turns_recomputation_on():
    prof = synthetic_profile([1.0] * 8, saved=[1000] * 8, params=[10] * 8)
    roomy = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, schedule="gpipe")
    assert roomy.recompute == "never"
    tight = plan_pipeline(prof, Cluster.uniform(2, 20_000), 8, schedule="gpipe", checkpoint=())
    assert tight.recompute != "never" and tight.fits
    # or layers under checkpoints of their own, where those are faster
    auto = plan_pipeline(prof, Cluster.uniform(2, 20_000), 8, schedule="gpipe")
    assert (auto.recompute != "never" or auto.checkpointed) and auto.fits
    assert auto.predicted.iteration_ms <= tight.predicted.iteration_ms


@st.composite
def small_problems(draw):
    L = draw(st.integers(2, 8))
    K = draw(st.integers(1, min(L, 4)))
    lists = lambda lo, hi: draw(st.lists(st.integers(lo, hi), min_size=L, max_size=L))  # noqa: E731
    prof = synthetic_profile(
        [float(x) for x in lists(1, 9)],
        params=lists(0, 400),
        saved=lists(0, 200),
        output_bytes=lists(1, 50),
    )
    budget = draw(st.integers(100, 6000))
    M = draw(st.integers(1, 4))
    return (
        prof,
        K,
        budget,
        M,
        draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"])),
        draw(st.sampled_from(MODES)),
    )


@settings(max_examples=110, deadline=None)
@given(small_problems())
def test_plan_fits_whenever_some_split_fits(problem):
    prof, K, budget, M, schedule, mode = problem
    L = len(prof.layers)
    cluster = Cluster.uniform(K, budget)
    kw = dict(microbatches=M, schedule=schedule, recompute=mode, optimizer="adam")
    probe_plan = plan_pipeline(prof, Cluster.uniform(K, 2**40), 4 * M, **kw)
    shape = {s: shape_of(probe_plan, s) for s in range(K)}
    chain = chain_at(prof, 4)
    some_split_fits = any(
        all(
            reference_memory(chain, i, j, shape[s]) <= budget
            for s, (i, j) in enumerate(zip([0, *c], [*c, L]))
        )
        for c in itertools.combinations(range(1, L), K - 1)
    )
    try:
        plan = plan_pipeline(prof, cluster, 4 * M, **kw)
    except InfeasibleError:
        assert not some_split_fits
    else:
        assert some_split_fits and plan.fits
        assert all(st_.layers[0] < st_.layers[1] for st_ in plan.stages)
        assert np.all(np.diff([s.layers[0] for s in plan.stages]) > 0)


@pytest.mark.parametrize("solver", ["dp", "cp-sat"])
def test_other_solvers_agree_with_the_probe(solver):
    prof = synthetic_profile(
        [1, 3, 2, 2, 5, 1, 1, 2, 4, 1],
        [4, 1, 1, 6, 1, 2, 2, 1, 2, 2],
        saved=[30, 8, 40, 5, 60, 9, 12, 7, 3, 9],
    )
    kw = dict(microbatches=4, schedule="1f1b", recompute="never")
    probe = plan_pipeline(prof, Cluster.uniform(3, 2500), 8, **kw)
    other = plan_pipeline(prof, Cluster.uniform(3, 2500), 8, solver=solver, **kw)
    assert other.predicted.bottleneck_ms == probe.predicted.bottleneck_ms
    assert other.solver.method == solver and other.solver.optimal
    if solver == "cp-sat":
        assert other.solver.lower_bound_ms == pytest.approx(probe.predicted.bottleneck_ms, rel=1e-9)
        assert other.solver.gap == 0.0


def test_a_plan_whose_runtime_or_smaller_micro_batches_were_edited_is_refused():
    """Found by a review: a torchrun plan on a CPU whose stage's RNG state was edited, or
    state_bytes_rest added to a plan whose batch splits evenly (or a state larger than
    state_bytes'), validated (a resealed edit passes the digest). A plan made before the RNG state was
    counted (none on any stage) is still read."""
    profile = synthetic_profile([1.0] * 8, sizes=(1, 2, 4))
    run = plan_pipeline(profile, Cluster.uniform(2, "1GiB"), 8, microbatches=4, target="torchrun")
    uneven = plan_pipeline(profile, Cluster.uniform(2, "1GiB"), 7, microbatches=3)
    assert run.stages[0].state_bytes.runtime == torch_rng_state()
    assert uneven.stages[0].state_bytes_rest is not None
    Plan.model_validate(run.model_dump())  # (as made: valid)
    Plan.model_validate(uneven.model_dump())

    def edited(plan: Plan, edit) -> dict:
        data = plan.model_dump()
        edit(data)
        return data

    def no_rng(d: dict) -> None:  # (as a plan made before it was counted)
        for stage in d["stages"]:
            stage["memory"]["total"] -= stage["memory"]["runtime"] or 0
            stage["state_bytes"]["runtime"] = stage["memory"]["runtime"] = None

    Plan.model_validate(edited(run, no_rng))

    def less_rng(d: dict) -> None:
        st = d["stages"][0]
        st["state_bytes"]["runtime"] -= 1000
        if st["memory"]["runtime"]:
            st["memory"]["runtime"] -= 1000
            st["memory"]["total"] -= 1000

    def rng_on_streams(d: dict) -> None:
        d["stages"][0]["state_bytes"]["runtime"] = torch_rng_state()

    def late_on_torchrun(d: dict) -> None:  # (lowers the peak check simulates)
        d["stages"][1]["state_bytes"]["late_grad"] = 1000

    def at_end_without_late(d: dict) -> None:
        d["stages"][1]["state_bytes"]["late_grad_at_end"] = True

    def late_live_without_late(d: dict) -> None:
        d["stages"][1]["state_bytes"]["late_live"] = 1000

    even = plan_pipeline(profile, Cluster.uniform(2, "1GiB"), 8, microbatches=4)

    def rest_on_even(d: dict) -> None:
        d["stages"][1]["state_bytes_rest"] = dict(d["stages"][1]["state_bytes"])

    def rest_larger(d: dict) -> None:
        st = d["stages"][1]
        st["state_bytes_rest"]["activations"] = st["state_bytes"]["activations"] + 1

    def rest_transient_larger(d: dict) -> None:
        st = d["stages"][1]
        st["state_bytes_rest"]["live"] = st["state_bytes"]["live"] + 1

    for plan, edit, says in ((run, less_rng, "runtime"), (even, rng_on_streams, "runtime"),
                             (run, late_on_torchrun, "late_grad"),
                             (even, at_end_without_late, "late_grad_at_end without"),
                             (even, late_live_without_late, "late_live 1000 without"),
                             (even, rest_on_even, "state_bytes_rest"),
                             (uneven, rest_larger, "state_bytes_rest")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            Plan.model_validate(edited(plan, edit))
    # (its working memory may be larger: a convolution on a CPU takes more at one sample)
    Plan.model_validate(edited(uneven, rest_transient_larger))


def torch_rng_state() -> int:
    import torch

    return torch.get_rng_state().numel()


def test_a_byte_figure_past_the_profiled_sizes_is_never_below_the_largests():
    """Past the largest profiled size a byte figure is the larger of the line through the last
    two sizes and its share per sample at the largest beyond the layer's weights, in
    proportion to the size: a CPU convolution's workspace measured 92 448 and 94 784 bytes at
    one and two samples (the line: 99 456 at four) and 173 056 at four. A weight's gradient,
    which a backward's figure holds, is not scaled (a cold review: scaled whole, a
    Linear(1024, 2048)'s made a plan 3x its run). Times keep the line, floored at the
    largest's."""
    prof = synthetic_profile([1.0, 1.0], params=[100, 1_000_000], sizes=(1, 2))
    conv, linear = prof.layers
    conv.backward_transient_bytes = {1: 92_448, 2: 94_784}  # nearly flat: in proportion
    conv.forward_transient_bytes = {1: 1_000, 2: 3_000}  # steeper than proportion: the line
    conv.input_grad_transient_bytes = {1: 92_448, 2: 91_136}  # fell: in proportion
    conv.forward_ms = {1: Timing(median=2.0, min=2.0, max=2.0),
                       2: Timing(median=1.0, min=1.0, max=1.0)}  # fmt: skip
    linear.backward_transient_bytes = {1: 1_000_100, 2: 1_000_300}  # its weight's gradient
    for mb, backward, input_grad in ((3, 142_126, 136_654), (4, 189_468, 182_172),
                                     (8, 378_836, 364_244)):  # fmt: skip
        chain = chain_at(prof, mb)
        # 100 (the conv's weights) + (94 784 - 100) x mb / 2, and (91 136 - 100) x mb / 2
        assert chain.backward_transient[0] == backward
        assert chain.input_grad_transient[0] == input_grad
        assert chain.forward_transient[0] == 2_000 * mb - 1_000
        assert chain.forward[0] == 1.0  # (the line goes to 0 at 3: floored at 2's)
        # the line, 1 000 300 + 200 x (mb - 2), above 1 000 000 + 300 x mb / 2
        assert chain.backward_transient[1] == 1_000_300 + 200 * (mb - 2)
    chain = chain_at(prof, 2)  # (measured sizes as measured)
    assert (chain.backward_transient[0], chain.input_grad_transient[0]) == (94_784, 91_136)


def test_a_convolutions_workspace_past_the_profiled_sizes_is_planned_above_its_run():
    """A red team's model: two convolutions with batch norm, profiled at 1 and 2 samples, run
    at 4 and 8. Their workspaces hardly grew from 1 to 2 samples (or fell, with one thread),
    the line through them said little more at 4, and the run held 18-20% more than its plan
    (2.4x on an interleaved device). Measured now: never above the plan on two threads; on
    one (a machine of one core), 48 bytes (0.02%) above at 4 samples: its first convolution's
    workspace at 4 lies 896 bytes above the line through 1 and 2, which no extension of two
    sizes can know. Held to 0.1%."""

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        m = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
        )  # fmt: skip
        m.example_input = torch.randn(4, 3, 16, 16)
        return m

    m = model()
    prof = quick_profile(m, m.example_input, batch_sizes=[1, 2])
    for batch in (4, 8):
        plan = plan_pipeline(prof, Cluster.uniform(1, "256MiB"), batch, microbatches=1,
                             schedule="gpipe", recompute="never")  # fmt: skip
        for d in measured_step(model(), plan).devices:
            assert d.measured_peak_bytes <= d.predicted_peak_bytes * 1.001, (batch, d)
