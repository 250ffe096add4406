"""The runtime's own costs (per compute action, per step): measured by profiler/overhead.py,
charged by the simulator, planned for by the search."""

from __future__ import annotations

import contextlib
import time

import pytest

import planner.search as search
from codegen._runtime import PipelineRuntime
from planner import Cluster, plan_pipeline
from profiler.overhead import runtime_overhead
from profiler.types import RuntimeOverhead
from schedules import Costs, build_schedule, simulate
from tests.conftest import synthetic_profile


def test_every_compute_action_pays_the_overhead_and_the_step_pays_once():
    """GPipe, 2 stages, 2 micro-batches, F = 1 and B = 2 plus 0.5 per action and 3 per step:
    F(0) 0-1.5 and 1.5-3 on stage 0, 1.5-3 and 3-4.5 on stage 1; B 4.5-7 and 7-9.5 on
    stage 1, 7-9.5 and 9.5-12 on stage 0; the step 12 + 3 = 15 (9 without the overheads)."""
    sched = build_schedule("gpipe", 2, 2)
    plain = Costs.uniform(2, 1.0, 2.0)
    assert simulate(sched, plain).makespan == 9.0
    costs = Costs.uniform(2, 1.0, 2.0, action_overhead=0.5, step_overhead=3.0)
    for rendezvous in (False, True):
        tl = simulate(sched, costs, rendezvous=rendezvous)
        assert tl.makespan == 15.0
        assert max(tl.busy) == 4 * 0.5 + 2 * 1.0 + 2 * 2.0
    # recomputation re-runs the stage's forward call, which pays its own overhead
    again = Costs.uniform(2, 1.0, 2.0, action_overhead=0.5, recompute=["always", "never"])
    tl = simulate(sched, again)
    b0 = [sp for sp in tl.spans if sp.action.stage == 0 and sp.action.kind.value == "B"]
    assert [sp.end - sp.start for sp in b0] == [4.0, 4.0]  # 2 + 0.5, then 1 + 0.5 again
    with pytest.raises(ValueError, match="action_overhead"):
        simulate(sched, Costs.uniform(2, action_overhead=float("nan")))


def _with_overhead(action_ms: float, step_ms: float = 0.0):
    profile = synthetic_profile([1.0] * 8, sizes=(1, 2, 4, 8, 16, 32))
    return profile.model_copy(update={"runtime": RuntimeOverhead(action_ms=action_ms,
                                                                 step_ms=step_ms)})  # fmt: skip


@pytest.mark.parametrize("target", ["streams", "torchrun"])
def test_the_plan_predicts_its_program_with_the_overheads(target):
    profile = _with_overhead(0.75, 2.0)
    plan = plan_pipeline(profile, Cluster.uniform(2, "1GiB"), 32, target=target)
    assert plan.runtime == profile.runtime
    tl = search.simulate_plan(plan, levels=False)
    assert plan.predicted.iteration_ms == tl.makespan
    free = search.simulate_plan(plan.model_copy(update={"runtime": None}), levels=False).makespan
    assert plan.predicted.iteration_ms > free + 2.0


def test_per_action_overhead_makes_fewer_larger_microbatches_pay():
    """Layer costs that scale with the micro-batch size favour the most micro-batches (the
    smallest bubble); each action's fixed cost pushes back, and the plan takes fewer."""
    cluster = Cluster.uniform(4, "1GiB")
    free = plan_pipeline(_with_overhead(0.0), cluster, 32, schedule="1f1b")
    costly = plan_pipeline(_with_overhead(2.0), cluster, 32, schedule="1f1b")
    assert free.microbatches == 32
    assert costly.microbatches < free.microbatches
    # and it is the best M under the overhead: every other count predicts no faster
    for M in (1, 2, 4, 8, 16, 32):
        other = plan_pipeline(_with_overhead(2.0), cluster, 32, schedule="1f1b", microbatches=M)
        assert other.predicted.iteration_ms >= costly.predicted.iteration_ms


def test_the_probe_sees_what_the_runtime_adds(monkeypatch):
    """A runtime made 2 ms slower per action and 10 ms per step: the probe's fit finds it."""
    base = runtime_overhead(rounds=5, warmup=1)
    plain_action, plain_begin = PipelineRuntime._action, PipelineRuntime.begin

    @contextlib.contextmanager
    def slow_action(self, what, s, m):
        time.sleep(0.002)
        with plain_action(self, what, s, m):
            yield

    def slow_begin(self, *args):
        time.sleep(0.010)
        return plain_begin(self, *args)

    monkeypatch.setattr(PipelineRuntime, "_action", slow_action)
    monkeypatch.setattr(PipelineRuntime, "begin", slow_begin)
    got = runtime_overhead(rounds=5, warmup=1)
    assert 1.8 < got.action_ms - base.action_ms < 3.5
    assert 8.0 < got.step_ms < 16.0
