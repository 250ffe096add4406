"""The runtime's own costs (per compute action, per step): measured by profiler/overhead.py,
charged by the simulator, planned for by the search."""

from __future__ import annotations

import contextlib

import pytest
import torch

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
    # recomputation re-runs the stage's forward inside B: its compute, not another action
    again = Costs.uniform(2, 1.0, 2.0, action_overhead=0.5, recompute=["always", "never"])
    tl = simulate(sched, again)
    b0 = [sp for sp in tl.spans if sp.action.stage == 0 and sp.action.kind.value == "B"]
    assert [sp.end - sp.start for sp in b0] == [3.5, 3.5]  # 2 + 0.5, then the forward's 1
    # the stage's one autograd call: on B (and I), not on F or W
    called = Costs.uniform(2, 1.0, 2.0, action_overhead=0.5, call_overhead=0.25)
    tl = simulate(sched, called)
    b_spans = [sp.end - sp.start for sp in tl.spans if sp.action.kind.value == "B"]
    f_spans = [sp.end - sp.start for sp in tl.spans if sp.action.kind.value == "F"]
    assert b_spans == [2.75] * 4 and f_spans == [1.5] * 4
    zb = simulate(build_schedule("zb-h1", 2, 2), Costs.uniform(2, 1.0, 2.0, call_overhead=0.25))
    got = {sp.action.kind.value: sp.end - sp.start for sp in zb.spans}
    assert got == {"F": 1.0, "I": 1.25, "W": 1.0}
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


def test_the_probe_fits_what_the_runtime_adds(monkeypatch):
    """On a clock that only the runtime moves (2 ms per action, 10 ms per step, the compute
    free): the probe's fit over its two micro-batch counts finds exactly those."""
    import types

    import profiler.overhead as overhead

    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    plain_action, plain_begin = PipelineRuntime._action, PipelineRuntime.begin

    @contextlib.contextmanager
    def timed_action(self, what, s, m):
        clock.t += 0.002
        with plain_action(self, what, s, m):
            yield

    def timed_begin(self, *args):
        clock.t += 0.010
        return plain_begin(self, *args)

    monkeypatch.setattr(PipelineRuntime, "_action", timed_action)
    monkeypatch.setattr(PipelineRuntime, "begin", timed_begin)
    got = runtime_overhead(rounds=3, warmup=1)
    assert abs(got.action_ms - 2.0) < 1e-6 and abs(got.step_ms - 10.0) < 1e-6


def test_the_probe_leaves_the_callers_rng_alone():
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    runtime_overhead(rounds=1, warmup=0)
    assert torch.equal(torch.rand(3), want)


def test_a_profile_without_the_overhead_is_written_and_digested_as_before():
    """A profile that never measured it is written and digested without it (an older
    gpipe-plan of the same format reads the file); one that did keeps it through a save."""
    from profiler.types import Profile

    plain = synthetic_profile([1.0, 2.0])
    assert "runtime" not in plain.canonical_json()
    assert Profile.from_json_text(plain.canonical_json()).digest() == plain.digest()
    measured = plain.model_copy(update={"runtime": RuntimeOverhead(action_ms=0.1, step_ms=0.0)})
    again = Profile.from_json_text(measured.canonical_json())
    assert again.runtime == measured.runtime and again.digest() != plain.digest()


def test_a_file_must_say_what_it_is():
    """The one-pass reader fills a missing `kind` from its default: such a file still takes the
    checked path, and its message."""
    from planner import Cluster
    from profiler.artifact import InputError

    with pytest.raises(InputError, match="no 'kind' field"):
        Cluster.from_json_text('{"devices": [{"name": "a", "memory_bytes": "1GiB"}]}')
    ok = '{"kind": "cluster", "devices": [{"name": "a", "memory_bytes": "1GiB"}]}'
    assert Cluster.from_json_text(ok).devices[0].memory_bytes == 2**30


def test_each_layers_backward_is_timed_without_the_call_a_stage_makes_once(monkeypatch):
    """On a clock where every timed call takes 1 ms: B and I lose exactly the call's cost, F and
    W keep theirs; a call cost past the time leaves 0, and 0 (no call made) stays 0."""
    from torch import nn

    import profiler.timing as timing

    monkeypatch.setattr(timing, "_elapsed", lambda fn, dev: (fn(), 1.0)[1])
    cpu = torch.device("cpu")
    x = torch.randn(4, 8, requires_grad=True)
    assert timing._Member(nn.Linear(8, 8), x, call_ms=0.25).sample(cpu) == (1.0, 0.75, 0.75, 1.0)
    assert timing._Member(nn.Linear(8, 8), x, call_ms=5.0).sample(cpu) == (1.0, 0.0, 0.0, 1.0)
    relu = timing._Member(nn.ReLU(), x.detach(), call_ms=0.25).sample(cpu)  # no grads at all
    assert relu == (1.0, 0.0, 0.0, 0.0)


def test_the_runtime_makes_one_autograd_call_per_b_and_i_and_one_per_layer_in_w(monkeypatch):
    """The premise of the profile's call cost: a stage's B or I is one autograd call whatever
    its layers (recomputation included), its W one per layer with weights."""
    import collections

    import torch.autograd as autograd
    from torch import nn

    calls: collections.Counter = collections.Counter()
    now = [None]
    engine = autograd._engine_run_backward

    def counted(*args, **kwargs):
        calls[now[0]] += 1
        return engine(*args, **kwargs)

    monkeypatch.setattr(autograd, "_engine_run_backward", counted)
    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", counted, raising=False)
    for schedule in ("gpipe", "zb-h1"):
        for mode in ("never", "always"):

            class Probe(PipelineRuntime):
                SCHEDULE, MICROBATCHES = schedule, 2
                STAGES, RANKS, RECOMPUTE = [(0, 3), (3, 6)], [0, 0], [mode, mode]

            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(4, 4) if k % 2 == 0 else nn.ReLU() for k in range(6)])
            pipe = Probe(model, ["cpu", "cpu"])
            calls.clear()
            pipe.begin(torch.randn(2, 4), torch.randn(2, 4), nn.functional.mse_loss)
            for m in range(2):
                for s in range(2):
                    now[0] = ("F", s)
                    pipe.forward(s, m)
            for m in range(2):
                for s in (1, 0):
                    if schedule == "zb-h1":
                        now[0] = ("I", s)
                        pipe.backward_input(s, m)
                        now[0] = ("W", s)
                        pipe.backward_weight(s, m)
                    else:
                        now[0] = ("B", s)
                        pipe.backward(s, m)
            pipe.finish()
            per = {key: n // 2 for key, n in calls.items()}
            if schedule == "zb-h1":  # Linear, ReLU, Linear | ReLU, Linear, ReLU
                assert per == {("I", 0): 1, ("I", 1): 1, ("W", 0): 2, ("W", 1): 1}, (mode, per)
            else:
                assert per == {("B", 0): 1, ("B", 1): 1}, (mode, per)


def test_an_autograd_call_costs_something():
    from profiler.overhead import autograd_call_ms

    call = autograd_call_ms(calls=50)
    assert 0 < call < 50


def test_the_loss_backward_runs_once_per_microbatch_and_zero_bubble_keeps_its_gradients():
    """Zero bubble's W on the last stage starts from the last layer's output gradient, which I
    took: the loss's backward runs once per micro-batch (as the plan charges it), and the
    gradients are those of the whole model's step."""
    from torch import nn

    runs = [0]

    class CountedMSE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, target):
            ctx.save_for_backward(out, target)
            return ((out - target) ** 2).mean()

        @staticmethod
        def backward(ctx, g):
            runs[0] += 1
            out, target = ctx.saved_tensors
            return g * 2 * (out - target) / out.numel(), None

    def loss_fn(out, target):
        return CountedMSE.apply(out, target)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(4, 4) if k % 2 == 0 else nn.Tanh() for k in range(6)])

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    whole = model()
    loss_fn(whole(x), y).backward()
    M = 4
    for schedule, mode in [("gpipe", "never"), ("zb-h1", "never"), ("zb-h1", "always")]:

        class Probe(PipelineRuntime):
            SCHEDULE, MICROBATCHES = schedule, M
            STAGES, RANKS, RECOMPUTE = [(0, 3), (3, 6)], [0, 0], [mode, mode]

        net = model()
        pipe = Probe(net, ["cpu", "cpu"])
        runs[0] = 0

        def after_i(s: int, m: int, pipe: PipelineRuntime = pipe) -> None:
            assert not pipe.kept[(s, m)][0] or s < 1  # the last stage keeps no loss for W

        _all_forwards_then_backwards(pipe, x, y, loss_fn, after_i)
        assert runs[0] == M, (schedule, mode, runs[0])
        for (name, p), q in zip(net.named_parameters(), whole.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), (schedule, mode, name)


@pytest.mark.parametrize(
    "stages", [[(0, 1), (1, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)], [(0, 3)]]
)
def test_zero_bubble_i_makes_the_calls_the_plan_charges(monkeypatch, stages):
    """A first stage of one layer makes no autograd call at I (its input needs no gradient,
    and W takes its output's); every other stage makes one: what `input_calls` tells the
    simulator."""
    import torch.autograd as autograd
    from torch import nn

    calls: dict[int, int] = {}
    now = [0]
    engine = autograd._engine_run_backward

    def counted(*args, **kwargs):
        calls[now[0]] = calls.get(now[0], 0) + 1
        return engine(*args, **kwargs)

    monkeypatch.setattr(autograd, "_engine_run_backward", counted)
    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", counted, raising=False)
    S = len(stages)

    class Probe(PipelineRuntime):
        SCHEDULE, MICROBATCHES = "zb-h1", 1
        STAGES, RANKS, RECOMPUTE = stages, [0] * S, ["never"] * S

    torch.manual_seed(0)
    pipe = Probe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), ["cpu"] * S)
    pipe.begin(torch.randn(2, 4), torch.randn(2, 4), nn.functional.mse_loss)
    for s in range(S):
        pipe.forward(s, 0)
    for s in reversed(range(S)):
        now[0] = s
        pipe.backward_input(s, 0)
        pipe.kept.pop((s, 0))  # (W not run: its calls are not I's)
    made = [calls.get(s, 0) for s in range(S)]
    assert made == [search.input_calls(s, st, S, 16 * (s > 0)) for s, st in enumerate(stages)]
    # ... and the simulator charges exactly those
    one = simulate(
        build_schedule("zb-h1", S, 1),
        Costs.uniform(S, 0.0, 0.0, input_grad=[0.0] * S, weight_grad=[0.0] * S,
                      call_overhead=1.0, input_calls=made),
    )  # fmt: skip
    assert one.makespan == sum(made)


# (recomputing, an in-place first layer changes the input its re-run starts from: torch's own
# checkpoint refuses that too, copy or not)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_an_in_place_first_layer_works_on_the_callers_batch(schedule):
    """Stage 0 works on the caller's micro-batch (no copy on its own device): a first layer
    that would change it in place writes a new tensor instead (as the profile measures it: a
    red team found the plan at 0 bytes there while the run held a micro-batch), the caller's
    batch is left as it was, and the gradients are the whole model's."""
    from torch import nn

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    whole = model()
    nn.functional.mse_loss(whole(x.clone()), y).backward()
    M = 2

    class Probe(PipelineRuntime):
        SCHEDULE, MICROBATCHES = schedule, M
        STAGES, RANKS, RECOMPUTE = [(0, 2), (2, 4)], [0, 0], ["never", "never"]

    net = model()
    pipe = Probe(net, ["cpu", "cpu"])
    given = x.clone()
    _all_forwards_then_backwards(pipe, given, y, nn.functional.mse_loss)
    for p, q in zip(net.parameters(), whole.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), schedule
    assert torch.equal(given, x)  # (left as it was)


def test_a_cpu_plan_run_on_a_gpu_says_what_its_memory_left_out(monkeypatch):
    """The model holds none of the input on stage 0 for a CPU profile (the CPU works on the
    caller's batch); on a GPU the batch is copied there, so compile_pipe says so."""
    import warnings

    from torch import nn

    import codegen.pipe as pipe_mod

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    plan = plan_pipeline(synthetic_profile([1.0, 1.0, 1.0]), Cluster.uniform(2, "1GiB"), 4)
    monkeypatch.setattr(
        pipe_mod, "_resolve_devices", lambda devices, K, plan: [torch.device("cuda:0")] * K
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with contextlib.suppress(Exception):  # no GPU here: the program itself may not start
            pipe_mod.compile_pipe(model, plan, check_model=False)
    assert any("made from a CPU profile" in str(w.message) for w in seen)
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe_mod.compile_pipe(model, plan, ["cpu", "cpu"], check_model=False)
    assert not any("made from a CPU profile" in str(w.message) for w in seen)


def _all_forwards_then_backwards(pipe, x, y, loss_fn, after_i=None) -> None:
    """One step of a runtime built by hand: every forward, then every backward (I and W for
    zero bubble, `after_i(s, m)` between them), last stage first."""
    S, M = len(pipe.STAGES), pipe.MICROBATCHES
    pipe.begin(x, y, loss_fn)
    for m in range(M):
        for s in range(S):
            pipe.forward(s, m)
    for m in range(M):
        for s in reversed(range(S)):
            if pipe.SCHEDULE == "zb-h1":
                pipe.backward_input(s, m)
                if after_i is not None:
                    after_i(s, m)
                pipe.backward_weight(s, m)
            else:
                pipe.backward(s, m)
    pipe.finish()


def test_recomputing_a_stage_that_changes_its_input_in_place_is_refused():
    """Zero bubble re-materialises at I from the stage's input: a first layer that changed it
    in place would re-run on something else and give wrong gradients, so the step refuses
    (the other schedules' checkpoint refuses it in backward)."""
    from torch import nn

    from codegen._runtime import StageError

    class Double(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    class Probe(PipelineRuntime):
        SCHEDULE, MICROBATCHES = "zb-h1", 2
        STAGES, RANKS, RECOMPUTE = [(0, 2), (2, 3)], [0, 0], ["always", "never"]

    torch.manual_seed(0)
    pipe = Probe(nn.Sequential(Double(), nn.Linear(4, 4), nn.Linear(4, 4)), ["cpu", "cpu"])
    with pytest.raises(StageError, match="change their input in place"):
        _all_forwards_then_backwards(pipe, torch.randn(4, 4), torch.randn(4, 4),
                                     torch.nn.functional.mse_loss)  # fmt: skip


def test_the_first_stage_takes_the_callers_tensor_as_it_reads():
    """The alias keeps values, dtype and strides; what an alias cannot carry (a lazy conjugate,
    an inference tensor) is copied instead."""
    from codegen._runtime import _own

    x = torch.randn(6, 4)[::2].t()  # a strided view with an offset-free, non-contiguous layout
    a = _own(x, torch.device("cpu"))
    assert torch.equal(a, x) and a.stride() == x.stride() and a.data_ptr() == x.data_ptr()
    a.add_(1)  # the caller's memory, but a version counter of its own
    assert torch.equal(x, a) and x._version == 0
    z = torch.randn(3, dtype=torch.cfloat).conj()
    assert torch.equal(_own(z, torch.device("cpu")), z)
    with torch.inference_mode():
        frozen = torch.randn(3)
    assert not _own(frozen, torch.device("cpu")).is_inference()
