"""The plan tells the truth: what `measure` reads off the allocator during a real step is what
the plan predicted, for every schedule and recomputation mode; and the accounting itself counts
tensors of known size exactly."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from codegen import compile_pipe
from codegen.measure import make_data
from planner import Cluster, Plan, plan_pipeline
from planner.search import simulate_plan, torchrun_schedule
from profiler import profile_model
from profiler.examples import mlp, transformer
from profiler.memtrack import UNOWNED, owned_by, trace_allocations
from schedules.ir import Action, Kind
from schedules.memory import STATES
from tests.conftest import even_times, measured_step, mixed_plan, quick_profile

F32 = 4
RNG_STATE = torch.get_rng_state().numel()


def test_trace_counts_known_tensors_exactly():
    keep = torch.empty(10)  # made before the trace: not counted, and its free is not either
    with trace_allocations() as trace:
        with owned_by("a"):
            x = torch.empty(1000)  # a: 4000
            with owned_by("b"):
                y = torch.empty(250, dtype=torch.float64)  # b: 2000 (the innermost owner)
            z = torch.empty(3, 5)  # a: 4060
        with owned_by("b"):
            del x  # a: 60 -- a free is charged to the allocation's owner
            w = torch.empty(500, dtype=torch.int16)  # b: 3000
        del keep
        loose = torch.empty(7)  # nobody's: 28
        del z, y
    assert trace.peaks() == {"a": 4060, "b": 3000, UNOWNED: 28}
    assert trace.live() == {"a": 0, "b": 1000, UNOWNED: 28}
    assert [e.size for e in trace.events] == [4000, 2000, 60, -4000, 1000, 28, -60, -2000]
    del w, loose


def test_trace_sees_what_autograd_saves_and_frees():
    lin = nn.Linear(256, 128)
    x = torch.randn(32, 256, requires_grad=True)
    with trace_allocations() as trace:
        with owned_by("forward"):
            out = lin(x).relu()  # relu saves its result; the linear's output dies after relu
        with owned_by("backward"):
            out.sum().backward()
        del out
    peaks = trace.peaks()
    # forward: the linear's output (32x128) and relu's result, both alive while relu runs
    assert peaks["forward"] == 2 * 32 * 128 * F32
    # backward allocates the weight and bias gradients and the input gradient, among others
    assert peaks["backward"] >= (256 * 128 + 128 + 32 * 256) * F32


SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MODES = ["never", "except_last", "always"]
# (devices, micro-batches, batch): micro-batch sizes the profile measured, and interleaving's
# rule (at most K micro-batches or a multiple of K) met
LAYOUTS = [(2, 4, 8), (3, 3, 12), (4, 4, 8)]


def small_transformer() -> nn.Sequential:
    return transformer(vocab=256, d_model=32, heads=2, depth=6, seq_len=16, batch=12)


def small_mlp() -> nn.Sequential:
    return mlp(width=64, depth=4, batch=12)


MODELS = {"transformer": small_transformer, "mlp": small_mlp}


class _Half(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] // 2]


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=1)


def param_free_middle() -> nn.Sequential:
    """Linear | Tanh, half of it, twice that | Linear, Tanh: a middle stage with no weights,
    whose memory is its activations and what it receives (benchmarks/param_free_bench.py)."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.Tanh(), _Half(), _Double(), nn.Linear(64, 64), nn.Tanh()]
    model = nn.Sequential(*layers)
    model.example_input = torch.randn(8, 64)  # type: ignore[assignment]
    return model


def test_torchrun_gpipe_counts_the_receives_it_posts_ahead_where_a_stage_holds_no_weights():
    """Found by measuring: `measure --target torchrun` read a weightless middle stage under
    GPipe 36-50% below its plan. The program posts that stage's forward receives as the step
    begins, outside every stage's range, so the measurement left their buffers out (the plan
    was right). They are the stage's now: the plan to the byte. A rank's peak counts all it
    allocates on its device, in a stage's range or not: the RNG state its runtime keeps
    through the step (5 056 bytes on a CPU, 123% of this stage's plan before the plan counted
    it) is in both."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from codegen.measure import measure_torchrun

    model = param_free_middle()
    prof = even_times(quick_profile(model, torch.randn(8, 64), batch_sizes=[2], loss_fn="mse"))
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, microbatches=4, schedule="gpipe",
                         recompute="always", target="torchrun")  # fmt: skip
    assert [st.layers for st in plan.stages] == [(0, 1), (1, 4), (4, 6)]
    assert [st.state_bytes.runtime for st in plan.stages] == [RNG_STATE] * 3
    report = measure_torchrun(plan, f"{__file__}:param_free_middle", steps=1)
    middle = report.devices[1]
    assert abs(middle.measured_peak_bytes - middle.predicted_peak_bytes) <= 16, middle
    # what the ranks allocated outside their stages' ranges, reported: the RNG state at least
    assert report.unattributed_bytes >= RNG_STATE


def test_the_plan_counts_the_rng_state_the_torchrun_runtime_keeps_through_the_step():
    """The constant is torch's own CPU generator state. A torchrun plan on a CPU counts it once
    per device, through the step and not at the optimizer step after it; the streams program
    keeps one for the whole process (reported beside the devices), so its plan does not."""
    from planner.memory import CPU_RNG_STATE
    from planner.search import simulate_plan

    assert CPU_RNG_STATE == torch.get_rng_state().numel()
    model = param_free_middle()
    prof = even_times(quick_profile(model, torch.randn(8, 64), batch_sizes=[2], loss_fn="mse"))
    kw = dict(microbatches=4, schedule="interleaved-1f1b", recompute="never")
    both = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, target="torchrun", **kw)
    streams = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, **kw)
    assert [st.rank for st in both.stages] == [0, 1, 0, 1]
    assert [st.state_bytes.runtime for st in both.stages] == [RNG_STATE, RNG_STATE, None, None]
    assert all(st.state_bytes.runtime is None for st in streams.stages)
    assert all(st.memory.runtime is None for st in streams.stages)
    assert [d.total for d in both.devices] == simulate_plan(both, levels=False).peak_memory
    # where the optimizer step is the device's worst moment, the RNG state is back already
    plain = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, target="torchrun",
                          microbatches=4, schedule="gpipe", recompute="always")  # fmt: skip
    first = plain.stages[0].memory
    assert first.optimizer_step > 0 and first.runtime is None, first
    assert plain.stages[1].memory.runtime == RNG_STATE


@pytest.fixture(scope="module")
def profiles():
    out = {}
    for name, build in MODELS.items():
        model = build()
        out[name] = profile_model(
            model, model.example_input, batch_sizes=[2, 4], repeats=1, max_repeats=1, warmup=0,
            progress=False,
        )  # fmt: skip
    return out


def measured(profile, build, K, M, N, schedule, mode):
    plan = plan_pipeline(
        profile, Cluster.uniform(K, "1GiB"), N, microbatches=M, schedule=schedule, recompute=mode
    )
    return plan, measured_step(build(), plan)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_batch_split_unevenly_holds_each_micro_batch_at_its_own_size(profiles, name, schedule):
    """7 samples in 3 micro-batches are 3, 2 and 2 (torch.tensor_split). The plan counted
    each at the largest: the transformer's devices read 8% to 16% over the run (the GPT's up
    to 30%, benchmarks/uneven_bench.py). The devices' peaks now count each at its own size,
    as the run holds them (the split is still solved at the largest)."""
    plan, report = measured(profiles[name], MODELS[name], 3, 3, 7, schedule, "never")
    assert all(st.state_bytes_rest is not None for st in plan.stages)
    rest = [st.state_bytes_rest.activations for st in plan.stages]
    assert all(r <= st.state_bytes.activations for r, st in zip(rest, plan.stages)), rest
    assert any(r < st.state_bytes.activations for r, st in zip(rest, plan.stages)), rest
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    if name == "transformer" and schedule == "gpipe":  # every micro-batch in at the peak
        own = [sum(st.memory.total for st in plan.stages if st.rank == k) for k in range(3)]
        # (a device's peak need not move with the micro-batches' sizes: on one CI run's split,
        # from that run's timings, the first device read 204 812 bytes both ways)
        assert all(d.total <= n for d, n in zip(plan.devices, own)), (plan.devices, own)
        assert any(d.total < n for d, n in zip(plan.devices, own)), (plan.devices, own)
    for d in report.devices:
        predicted = d.predicted_peak_bytes - d.static_bytes
        added = d.measured_peak_bytes - d.static_bytes
        assert abs(added - predicted) <= 0.011 * predicted, d
    even = plan_pipeline(profiles[name], Cluster.uniform(3, "1GiB"), 6, microbatches=3,
                         schedule=schedule, recompute="never")  # fmt: skip
    assert all(st.state_bytes_rest is None for st in even.stages)
    # all at the larger size below what the profile measured (scaled down, a layer's fixed
    # part shrinks too: 0.5% low, a review's)
    below = plan_pipeline(profiles[name], Cluster.uniform(3, "1GiB"), 5, microbatches=3,
                          schedule=schedule, recompute="never")  # fmt: skip
    assert all(st.state_bytes_rest is None for st in below.stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torchrun_holds_each_micro_batch_of_an_uneven_batch_at_its_own_size(profiles, schedule):
    """7 samples in 3 micro-batches under torchrun: each rank's messages are made at their
    own micro-batch's size, and the plan counts them so (comm.receive_offsets, `rest`). It
    counted every micro-batch at the larger size: the transformer's ranks read 9% to 16% over
    the run (a review had measured +2% with the states at their own size and the messages
    not)."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from codegen.measure import measure_torchrun

    plan = plan_pipeline(profiles["transformer"], Cluster.uniform(3, "1GiB"), 7, microbatches=3,
                         schedule=schedule, recompute="never", target="torchrun")  # fmt: skip
    assert all(st.state_bytes_rest is not None for st in plan.stages)
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    report = measure_torchrun(plan, f"{__file__}:small_transformer", steps=1)
    for d in report.devices:
        predicted = d.predicted_peak_bytes - d.static_bytes
        added = d.measured_peak_bytes - d.static_bytes
        assert abs(added - predicted) <= 0.011 * predicted, d


def test_zero_bubble_counts_an_inner_layers_i_without_the_stages_input_gradient():
    """Found by a helper measuring zero bubble: I makes the stage's input gradient last, at
    its first layer, but an inner layer's I (the loss's, on the transformer's last stage) was
    counted on top of it: 5.05% over the run. Now to within a few bytes."""
    from profiler.examples import transformer

    def build() -> nn.Module:
        return transformer(vocab=64, d_model=32, heads=2, depth=5, seq_len=64, batch=16,
                           dropout=0.1)  # fmt: skip

    model = build()
    prof = even_times(quick_profile(model, model.example_input, batch_sizes=[4]))
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 16, microbatches=4, schedule="zb-h1",
                         recompute="never", optimizer="sgd")  # fmt: skip
    last = plan.stages[-1]
    assert last.layers == (6, 8) and last.state_bytes.grad > 0
    d = measured_step(build(), plan).devices[-1]
    assert abs(d.measured_peak_bytes - d.predicted_peak_bytes) <= 64, d  # (-32 768 before)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda k: f"K{k[0]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_peak_memory_is_what_the_run_allocates(profiles, name, schedule, mode, layout):
    K, M, N = layout
    plan, report = measured(profiles[name], MODELS[name], K, M, N, schedule, mode)
    assert report.ok and [d.name for d in report.devices] == [d.name for d in plan.devices]
    for d in report.devices:
        assert abs(d.memory_error) <= 0.05, d
        # ... and what a step adds above the weights, gradients and optimizer state, the part
        # a loose model would get wrong, within 1.1%: these runs measure -0.03% to +0.91% of it
        # (torch 2.13, CPU), and one term dropped from the model (zero bubble's input gradient
        # during I) reads +1.29% (found by a cold review: at 5%, as the goal, no test saw it)
        predicted = d.predicted_peak_bytes - d.static_bytes
        added = d.measured_peak_bytes - d.static_bytes
        assert abs(added - predicted) <= 0.011 * predicted, d
    # outside the stages: only the caller's RNG state, kept for the step, and the scalar loss
    assert report.unattributed_bytes <= RNG_STATE + 64


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_each_stage_recomputing_its_own_way_allocates_what_the_plan_says(profiles, name, schedule):
    """Per-stage recomputation: stages recompute never, except_last and always side by side, and
    each device's peak is still what the plan predicts."""
    plan = mixed_plan(profiles[name], Cluster.uniform(3, "1GiB"), 12, 3, schedule)
    assert {st.recompute for st in plan.stages} == {"never", "except_last", "always"}
    report = measured_step(MODELS[name](), plan)
    assert report.ok
    for d in report.devices:
        assert abs(d.memory_error) <= 0.05, d
        predicted = d.predicted_peak_bytes - d.static_bytes
        assert abs(d.measured_peak_bytes - d.static_bytes - predicted) <= 0.05 * predicted, d


def test_a_step_leaves_nothing_behind(profiles):
    """After a step every stage has let go of everything it allocated (the gradients and the
    optimizer state already exist: a warm-up step made them)."""
    for schedule, mode in [("gpipe", "always"), ("zb-h1", "except_last"), ("1f1b", "never"),
                           ("interleaved-1f1b", "never")]:  # fmt: skip
        plan = plan_pipeline(
            profiles["transformer"], Cluster.uniform(2, "1GiB"), 8, microbatches=4,
            schedule=schedule, recompute=mode,
        )  # fmt: skip
        model = small_transformer()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(model, plan)
        x, y, loss_fn = make_data(model, plan)
        pipe.train_step(x, y, loss_fn)
        with trace_allocations() as trace:
            pipe.train_step(x, y, loss_fn)
        left = {o: n for o, n in trace.live().items() if o != UNOWNED}
        assert set(left) == {str(s) for s in range(len(plan.stages))}
        assert all(n == 0 for n in left.values()), (schedule, mode, left)


def test_measuring_a_model_leaves_it_as_it_was():
    """Found by a red team: `Pipe.measure` steps an optimizer on the caller's own model. With a
    loss that is NaN every weight became NaN for good, and gradients appeared where there were
    none; batch norm's running statistics moved with any loss. Weights, gradients, buffers and
    torch's random state are now put back, whether the measure succeeds or fails."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 16))  # fmt: skip
    x = torch.randn(8, 16)
    prof = quick_profile(model, x, batch_sizes=[2, 4])
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=2, schedule="1f1b",
                         optimizer="adam")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].weight.grad = given = torch.ones_like(model[0].weight)  # a gradient the caller has
    y = torch.randn(8, 16)
    random = torch.get_rng_state()

    def nan_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y) * float("nan")

    def failing_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a loss that fails")

    pipe.measure(x, y, nan_loss, steps=1)
    with pytest.raises(Exception, match="a loss that fails"):
        pipe.measure(x, y, failing_loss, steps=1)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the model changed"
    assert model[0].weight.grad is given  # (its own tensor: a review's)
    assert torch.equal(given, torch.ones_like(model[0].weight))
    assert all(p.grad is None for p in (model[0].bias, *model[1].parameters(), *model[3].parameters()))  # fmt: skip
    assert torch.equal(torch.get_rng_state(), random)


def test_the_loss_is_on_the_last_device(profiles):
    """Cross-entropy keeps a log-softmax the size of the logits for every micro-batch in flight;
    a plan that forgot it would be short by that much on the last device."""
    prof = profiles["transformer"]
    assert prof.loss is not None and prof.loss.type == "cross_entropy"
    logits = 256 * 16 * F32  # vocabulary x sequence, per sample
    assert prof.loss.saved_bytes[2] >= 2 * logits
    plan, report = measured(prof, small_transformer, 2, 4, 8, "gpipe", "never")
    assert plan.stages[-1].memory.loss == 4 * prof.loss.saved_bytes[2]  # M micro-batches of 2
    assert abs(report.devices[-1].memory_error) <= 0.05


@pytest.mark.parametrize("K", [2, 3])
def test_zero_bubble_without_a_profiled_loss_allocates_what_the_plan_says(K):
    """Without its loss in the profile, the last stage still keeps the last layer's output
    gradient from I to W (W starts there): the plan counts it (Chain.last_grad). A wide last
    layer without weights makes it most of what that stage adds."""

    class Widen(nn.Module):
        def forward(self, x):
            return x.repeat(1, 64)

    def wide() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), Widen())

    prof = profile_model(wide(), torch.randn(8, 16), batch_sizes=[2, 4], repeats=1,
                         max_repeats=1, warmup=0, overhead=False, progress=False)  # fmt: skip
    assert prof.loss is None
    plan, report = measured(prof, wide, K, 4, 8, "zb-h1", "never")
    for d in report.devices:
        predicted = d.predicted_peak_bytes - d.static_bytes
        assert abs(d.measured_peak_bytes - d.static_bytes - predicted) <= 0.05 * predicted, d


def test_a_loss_named_by_a_file_not_found_here_is_said_so(profiles):
    """Found by a user trial: a plan's `file.py:fn` loss, measured from another directory,
    was reported as "a Python function, which measure cannot name"."""
    from profiler.artifact import InputError

    plan = plan_pipeline(profiles["mlp"], Cluster.uniform(2, "1GiB"), 4, microbatches=2)
    model = MODELS["mlp"]()
    for loss, says in (("nowhere.py:fn", "cannot be loaded from here"),
                       ("<lambda>", "was a Python function")):  # fmt: skip
        with pytest.raises(InputError, match=says):
            make_data(model, plan.model_copy(update={"loss": loss}))


def test_measure_runs_a_loss_that_is_code_only_where_its_command_line_names_it(tmp_path, run_cli):
    """Found by a red team: `measure` imported and ran whatever module the plan's `loss` named
    (its top level created a file), while `check` and `show` passed the plan. A loss that is
    code now runs only when `--loss` names it too; a different one is refused."""
    (tmp_path / "marker.py").write_text(
        "from pathlib import Path\n"
        "Path(__file__).with_suffix('.ran').touch()\n"
        "import torch.nn.functional as F\n"
        "def l(out, target):\n"
        "    return F.mse_loss(out, target)\n"
    )
    spec = f"{tmp_path / 'marker.py'}:l"
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                   "--max-repeats", "1", "--loss", spec, "-o", prof).code == 0  # fmt: skip
    (tmp_path / "marker.ran").unlink()  # (profiling it ran it: that was named)
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 4,
                "--microbatches", 2, "-o", plan)  # fmt: skip
    assert r.code == 0, r.err
    r = run_cli("measure", plan, "--model", "example:mlp", "--steps", 1)
    assert r.code == 2 and f"add --loss {spec}" in r.err, r
    assert not (tmp_path / "marker.ran").exists()
    r = run_cli("measure", plan, "--model", "example:mlp", "--steps", 1, "--loss", "mse")
    assert r.code == 2 and "was profiled with the loss" in r.err, r
    r = run_cli("measure", plan, "--model", "example:mlp", "--steps", 1, "--loss", spec)
    assert r.code in (0, 1), r.err
    assert (tmp_path / "marker.ran").exists()


def test_report_json_and_a_failing_gate(tmp_path, run_cli):
    prof, plan_path = tmp_path / "p.json", tmp_path / "plan.json"
    assert run_cli("profile", "example:mlp", "--batch-sizes", "2,4", "--repeats", "1",
                   "--max-repeats", "1", "-o", prof).code == 0  # fmt: skip
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
                "--microbatches", 2, "--schedule", "1f1b", "-o", plan_path)  # fmt: skip
    assert r.code == 0, r.err
    report = tmp_path / "report.json"
    r = run_cli("measure", plan_path, "--model", "example:mlp", "--steps", 3, "-o", report)
    assert r.code == 0, r.err + r.out
    assert "note:" not in r.err  # (the plan's own target)
    data = json.loads(report.read_text())
    # the median step between the fastest and the slowest, all three told
    fast, slow = data["step_range_ms"]
    assert 0 < fast <= data["measured_step_ms"] <= slow
    assert f"{data['measured_step_ms']:.2f} ms (median; {fast:.2f} to {slow:.2f})" in r.out
    assert {d["name"] for d in data["devices"]} == {"dev0", "dev1"}
    assert {(a["stage"], a["kind"]) for a in data["actions"]} == {
        (s, k) for s in (0, 1) for k in ("F", "B")
    }
    assert all(a["count"] == 6 for a in data["actions"])  # two micro-batches, three steps
    # A plan that claims less memory than the run needs fails the gate: a stage's bytes made
    # smaller, and its device's figures with them (an edit that does not follow is refused),
    # so that the run needs 5.2% more than it claims: over the default 5%, within 5.5%
    measured = data["devices"][1]["measured_peak_bytes"]
    plan = Plan.load(plan_path)
    cut = plan.devices[1].total - int(measured / 1.052)
    plan.stages[1].state_bytes.static -= cut
    plan.stages[1].memory.params -= cut  # (the breakdown with it: the two must agree)
    plan.stages[1].memory.total -= cut
    peaks = simulate_plan(plan, levels=False).peak_memory
    plan.devices[1].total = plan.predicted.peak_memory[1] = peaks[1]
    assert 0.0515 < measured / peaks[1] - 1 < 0.0525
    plan.save(plan_path)
    r = run_cli("measure", plan_path, "--model", "example:mlp", "--steps", 1)
    assert r.code == 1 and "FAIL" in r.out and "dev1" in r.out
    assert run_cli("measure", plan_path, "--model", "example:mlp", "--tolerance", "5.5%").code == 0
    r = run_cli("measure", plan_path, "--model", "example:mlp", "--tolerance", "lots")
    assert r.code == 2 and "--tolerance" in r.err
    # a bare 5 is 500%, a gate nothing fails: refused (found by a red team); 0.055 is 5.5%
    r = run_cli("measure", plan_path, "--model", "example:mlp", "--tolerance", "5")
    assert r.code == 2 and "write 5% for 5 percent" in r.err and "Traceback" not in r.err
    assert run_cli("measure", plan_path, "--model", "example:mlp", "--tolerance", "0.055").code == 0
    # another target than the plan's: measured, with a note that the plan predicts another
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
                "--microbatches", 2, "--target", "torchrun", "-o", plan_path)  # fmt: skip
    assert r.code == 0, r.err
    r = run_cli("measure", plan_path, "--model", "example:mlp", "--target", "streams",
                "--steps", 1)  # fmt: skip
    assert r.code == 0, r.err
    assert "predicts the torchrun program, not the streams one" in r.err
    assert "plan with --target streams" in r.err


def test_the_plans_action_times_are_the_runs_within_a_factor():
    """Found by a cold review: no test held a predicted time against a run (a profiler that
    read every time 10x too small passed them all). On this shared CPU a run's times move with
    the machine's load (BENCHMARKS.md: the mlp's), so the claim here is coarse: the median,
    over the transformer's forward and backward actions, of measured over predicted lies within
    a factor of 3, profiled right before it is measured (once more where the machine was
    caught changing pace)."""
    model = transformer()
    ratios: list[float] = []
    for _ in range(2):
        prof = profile_model(model, model.example_input, batch_sizes=[2], progress=False)
        plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 4, microbatches=2,
                             schedule="1f1b", recompute="never")  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(transformer(), plan)
        x, y, loss_fn = make_data(model, plan)
        report = pipe.measure(x, y, loss_fn, steps=3)
        timed = sorted(a.measured_ms / a.predicted_ms for a in report.actions
                       if a.kind in ("F", "B") and a.predicted_ms > 0)  # fmt: skip
        assert len(timed) == 4
        ratios.append((timed[1] + timed[2]) / 2)
        if 1 / 3 <= ratios[-1] <= 3:
            return
    raise AssertionError(f"measured over predicted, median over actions: {ratios}")


def test_torchrun_holds_what_the_plan_counts(tmp_path, profiles):
    """One process per device: each rank's allocations against the plan. A rank lets go of what
    it sent at the first message that proves the send complete, so 1F1B's memory does not grow
    with the micro-batch count."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from codegen.measure import measure_torchrun

    prof = profiles["transformer"]
    peaks = {}
    for M in (4, 8):
        plan = plan_pipeline(
            prof, Cluster.uniform(2, "1GiB"), 2 * M, microbatches=M, schedule="1f1b",
            recompute="never",
        )  # fmt: skip
        report = measure_torchrun(plan, f"{__file__}:small_transformer", steps=1)
        assert report.target == "torchrun" and report.concurrent
        for d in report.devices:
            assert abs(d.memory_error) <= 0.05, d
        peaks[M] = [d.measured_peak_bytes for d in report.devices]
        counts = {(a.stage, a.kind): a.count for a in report.actions}
        assert counts[(0, "SEND_F")] == counts[(1, "RECV_F")] == M
        # the step predicted is the program's own, its ranks waiting in their batches
        timed = simulate_plan(plan, levels=False, rendezvous=True)
        assert report.predicted_step_ms == timed.makespan
        assert timed.makespan >= plan.predicted.iteration_ms - 1e-9
    # twice the micro-batches, the same peak (1F1B holds K - s micro-batches at most)
    assert peaks[8] == pytest.approx(peaks[4], rel=0.02)


def wide_handoff() -> nn.Sequential:
    """Two stages meeting at a wide activation: the first ends in Linear(16, 1024), the second
    begins by narrowing it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1024), nn.Linear(1024, 16),
                          nn.Linear(16, 16))  # fmt: skip
    model.example_input = torch.randn(256, 16)
    model.example_loss = "mse"
    return model


def test_torchrun_holds_a_batch_of_sends_and_receives_as_its_plan_counts():
    """Found by a cold review: under 1F1B the first rank posts F1's send and B0's receive in one
    batch, holding the wide activation it is sending and the wide gradient's buffer at once,
    between two compute actions, where the issue order had neither on it (the activation
    handed on, the gradient not pulled yet). Its plan said 627 KB and it held 815 KB (+30%).
    Such a batch is now a look of its own (receive_offsets' `after`)."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from codegen.measure import measure_torchrun
    from schedules.comm import receive_offsets

    model = wide_handoff()
    prof = even_times(quick_profile(model, model.example_input, batch_sizes=[64]))
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 256, microbatches=4,
                         schedule="1f1b", recompute="never", target="torchrun")  # fmt: skip
    assert [st.layers for st in plan.stages] == [(0, 2), (2, 4)]
    stages = plan.stages
    _, after = receive_offsets(torchrun_schedule(plan), [st.state_bytes.input for st in stages],
                               [st.state_bytes.grad for st in stages])  # fmt: skip
    wide = 64 * 1024 * 4  # a micro-batch's activation, and its gradient
    assert after[Action(0, Kind.F, 1)] == 2 * wide
    report = measure_torchrun(plan, f"{__file__}:wide_handoff", steps=1)
    for d in report.devices:  # to the byte but for a few (+16 and +36 when written)
        assert abs(d.memory_error) <= 0.001, d


class _TransposedNorm(nn.Module):
    """Batch norm over the features of a (batch, positions, features) tensor: its backward hands
    the layer before a transposed gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class _Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


@pytest.mark.parametrize("as_dense", [False, True])
def test_a_layer_given_a_transposed_gradient_is_measured_so(monkeypatch, as_dense):
    """GELU's backward copies a transposed output gradient into its own layout first: one
    activation more than from a dense gradient. The profile measures each layer's transients
    from a gradient laid out as the next layer's backward lays it out, and the stage holds what
    its plan says, to a few bytes; measured from dense gradients (the old way), it held 128 KiB
    more (found by a cold review)."""
    import profiler.measure as measure
    from tests.conftest import even_times, quick_profile

    if as_dense:
        monkeypatch.setattr(measure, "_strided_otherwise", lambda v, layouts: False)
    W = 32
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(W, W), nn.GELU(), _TransposedNorm(W), nn.Linear(W, W), nn.Linear(W, W),
        _Mean(), nn.Linear(W, 10),
    )  # fmt: skip
    x, y = torch.randn(8, 512, W), torch.randint(0, 10, (8,))
    prof = even_times(quick_profile(model, x, batch_sizes=[1, 2, 8]))  # the same split always
    plan = plan_pipeline(
        prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule="1f1b", checkpoint=()
    )
    assert plan.stages[0].layers[1] >= 3  # GELU, then the norm, inside the first stage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compile_pipe(model, plan).measure(x, y, nn.CrossEntropyLoss(), steps=1)
    over = [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]
    if as_dense:
        assert over[0] >= 128 * 1024
    else:
        assert all(abs(o) <= 512 for o in over), over


class _Swap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(2, 3)


@pytest.mark.parametrize("from_own", [False, True])
def test_a_layers_gradient_layout_is_found_from_the_loss_back(monkeypatch, from_own):
    """A 1x1 convolution after a transpose hands back a dense gradient whatever it is given, and
    the transpose turns that into a transposed one: the convolution before copies it into its
    own layout. Fed a gradient laid out like its own output, the transpose handed back a dense
    one, and the plan missed that copy (the run held 10 KiB more here; one activation, 14.6%,
    on a review's captured model). Found from the loss back, the plan is exact."""
    import profiler.measure as measure
    from tests.conftest import even_times, quick_profile

    if from_own:  # (the old way: each layer fed a gradient laid out as its own output)
        monkeypatch.setattr(
            measure, "_input_layouts", lambda layer, inp, given: [None] * len(measure._tensors(inp))
        )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1), _Swap(),
        nn.Conv2d(16, 3, 1),
    )  # fmt: skip
    from tests.test_graph import _measured_over

    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    # (on one thread, profiled and run: a convolution's workspace on two varies by machine,
    # and on some set the run's peak elsewhere, where the copy did not show)
    prof = even_times(quick_profile(model, x, batch_sizes=[1, 2, 4], loss_fn="mse", threads=1))
    plan = plan_pipeline(
        prof, Cluster.uniform(1, "1GiB"), 4, microbatches=2, schedule="gpipe", checkpoint=()
    )
    (over,) = _measured_over(model, plan, x, y)
    if from_own:
        assert over >= 8 * 1024
    else:
        assert abs(over) <= 256, over


def views_between_convs() -> nn.Sequential:
    """A convolution, a transpose and a convolution; then a flatten and an unflatten before the
    last convolution (module-level: torchrun's ranks build it by name)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), _Swap(), nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(),
        nn.Unflatten(1, (16, 16, 16)), nn.Conv2d(16, 3, 1),
    )  # fmt: skip
    model.example_input = torch.randn(8, 3, 16, 16)
    model.example_loss = "mse"
    return model


@pytest.mark.parametrize(
    "schedule, target, known",
    [("gpipe", "streams", True), ("gpipe", "streams", False), ("1f1b", "streams", True),
     ("1f1b", "streams", False), ("1f1b", "torchrun", True)],
)  # fmt: skip
def test_a_stage_that_opens_with_views_holds_its_input_once(schedule, target, known):
    """A stage that opens with a flatten and an unflatten, then a convolution: the convolution
    saves a view of the stage's input, which the runtime holds anyway. Counted apart (the
    profile not saying which layers only make views), the plan was one activation per micro-
    batch in flight over the run (30.7% under GPipe); counted once, it is the run's. Under
    torchrun, whose ranks receive dense buffers (as the flatten's input was profiled), never
    below it (that program's plan is over by more than this, for other reasons: 29 936 and
    88 232 bytes here)."""
    from codegen.measure import measure_torchrun
    from tests.conftest import even_times, quick_profile

    model = views_between_convs()
    x, y = model.example_input, torch.randn(8, 3, 16, 16)
    prof = even_times(quick_profile(model, x, batch_sizes=[2, 4, 8], loss_fn="mse"))
    assert [layer.views_input for layer in prof.layers] == [False, True, False, True, True, False]
    if not known:  # (a profile made before it was recorded)
        layers = [layer.model_copy(update={"views_input": None}) for layer in prof.layers]
        prof = prof.model_copy(update={"layers": layers})
    plan = plan_pipeline(
        prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule=schedule, checkpoint=(),
        target=target,
    )  # fmt: skip
    assert [s.layers for s in plan.stages] == [(0, 3), (3, 6)]
    if target == "torchrun":
        report = measure_torchrun(plan, f"{__file__}:views_between_convs", steps=1)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = compile_pipe(model, plan).measure(x, y, nn.MSELoss(), steps=1)
    over = [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]
    if target == "torchrun":
        assert all(o <= 64 for o in over), over
    elif known:
        assert all(abs(o) <= 64 for o in over), over
    else:
        assert over[1] <= -(32 * 1024 - 64), over


@pytest.mark.parametrize("devices", [2, 3])
def test_zero_bubbles_i_counts_a_views_gradient_once(devices):
    """Under zero bubble, a stage's unflatten and flatten hand back, in I, views of the
    gradient the convolution after them made: one gradient, which the plan counted once per
    layer. On one thread (where the convolution's own backward is not the peak) the second
    device of two ran 38 688 bytes (21.1%) and the third of three 12 064 (6.2%) below its plan;
    now each device is its plan's to 64 bytes."""
    split, over = _zero_bubble_over(views_between_convs(), devices)
    assert split == {2: [(0, 3), (3, 6)], 3: [(0, 1), (1, 4), (4, 6)]}[devices]
    assert all(abs(o) <= 64 for o in over), over


def _zero_bubble_over(model: nn.Module, devices: int) -> tuple[list[tuple[int, int]], list[int]]:
    """`model` (input and target 8 x 3 x 16 x 16, mse) under zero bubble on `devices`, 4
    micro-batches: the split, and each device's measured peak less its plan's, profiled and
    run on one thread (where a convolution's own backward is not the peak)."""
    from tests.conftest import even_times, quick_profile
    from tests.test_graph import _measured_over

    torch.manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    prof = quick_profile(model, x, batch_sizes=[2, 4, 8], loss_fn="mse", threads=1)
    plan = plan_pipeline(
        even_times(prof), Cluster.uniform(devices, "1GiB"), 8, microbatches=4,
        schedule="zb-h1", checkpoint=(),
    )  # fmt: skip
    return [s.layers for s in plan.stages], _measured_over(model, plan, x, y)


def test_what_custom_functions_keep_on_their_ctx_is_in_the_plan():
    """Custom autograd.Functions keeping their input on ctx, and one a tensor 16x as wide too
    (no saved-tensor hook sees either): held per micro-batch in flight, through a stage's
    whole backward (a ctx goes with the graph, not as B passes its layer), and under a
    checkpoint, which keeps the graph it re-runs from. No device measured above its plan by
    more than 64 bytes, none below it by more than 2%, for every schedule and recomputation
    (a red team's models ran 5-35% over before; recomputing, a received input not run yet is
    counted as holding its ctx's too: the over-count)."""
    from tests.test_graph import _measured_over
    from tests.test_profiler import Square

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), Square("wide"), nn.Linear(512, 32),
                          nn.Linear(32, 512), Square("ctx"), nn.Linear(512, 32))  # fmt: skip
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    prof = even_times(quick_profile(model, x, batch_sizes=[4, 8], loss_fn="mse", threads=1))
    wide = prof.layers[1]
    assert wide.saved_bytes[8] == wide.ctx_late_bytes[8] == 17 * 8 * 512 * 4
    assert (wide.ctx_held_bytes[8], wide.ctx_input_bytes[8]) == (16 * 8 * 512 * 4, 8 * 512 * 4)
    for schedule, recompute, layers in [
        ("1f1b", "never", ()), ("zb-h1", "never", ()), ("gpipe", "always", ()),
        ("1f1b", "always", ()), ("gpipe", "never", (1, 4)),
    ]:  # fmt: skip
        plan = plan_pipeline(
            prof, Cluster.uniform(2, "1GiB"), 32, microbatches=4, schedule=schedule,
            recompute=recompute, checkpoint=layers,
        )  # fmt: skip
        over = _measured_over(model, plan, x, y)
        peaks = plan.predicted.peak_memory
        assert all(-0.02 * p <= o <= 64 for o, p in zip(over, peaks)), (schedule, over, peaks)
    # A ctx that keeps what backward never reads: B lets it go at the stage's end, not as it
    # passes the layer (a red team's: 5.6% over, where B's walk let it go there)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), _KeepsWide())])
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    prof = even_times(quick_profile(model, x, batch_sizes=[4, 8], loss_fn="mse", threads=1))
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 32, microbatches=4, schedule="gpipe",
                         recompute="never", checkpoint=())  # fmt: skip
    over = _measured_over(model, plan, x, y)
    assert all(-0.02 * p <= o <= 64 for o, p in zip(over, plan.predicted.peak_memory)), over
    # A ctx that keeps what a hook saves too (its input, a Tanh's output): a checkpoint's re-run
    # makes that again beside it (a red team's: 8-17% over, recomputing or checkpointed). (The
    # plan holds both from B's start; the re-run comes at the first saved tensor B reads, after
    # the ctx's layer: 3.6% under the plan, the safe side)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), Square("ctx"),
                          *[nn.Linear(64, 64) for _ in range(3)])  # fmt: skip
    x, y = torch.randn(32, 32, 64), torch.randn(32, 32, 64)
    prof = even_times(quick_profile(model, x, batch_sizes=[4, 8], loss_fn="mse", threads=1))
    assert prof.layers[2].ctx_dup_input_bytes[8] == 8 * 32 * 64 * 4
    for recompute, layers in [("always", ()), ("never", (1,))]:
        plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 32, microbatches=4,
                             schedule="gpipe", recompute=recompute, checkpoint=layers)  # fmt: skip
        assert plan.stages[0].layers == (0, 3)
        over = _measured_over(model, plan, x, y)
        peaks = plan.predicted.peak_memory  # (and a few scalars)
        assert all(-0.05 * p <= o <= 128 for o, p in zip(over, peaks)), over


class _Wide(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.wide = x.repeat(1, 16)  # (kept, never read)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * 0.5


class _KeepsWide(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wide.apply(x)


def _conv_blocks_zero_bubble(devices: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Convolution, batch norm and ReLU blocks (one a layer) under zero bubble: _zero_bubble_over."""

    def block(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

    torch.manual_seed(0)
    model = nn.Sequential(block(3, 16), block(16, 32), block(32, 32), block(32, 16),
                          nn.Conv2d(16, 3, 1))  # fmt: skip
    return _zero_bubble_over(model, devices)


@pytest.mark.parametrize("walked", [True, False])
def test_zero_bubbles_w_walks_the_stage_from_its_last_layer(monkeypatch, walked):
    """Zero bubble's W runs from the stage's last layer, each layer's graph going as its own W
    runs: by the first layer's W, the blocks after it have let theirs go. Counted with every
    saved tensor held through the stage's W, the middle device of three ran 28 896 bytes
    (2.0%) below its plan; the profile says what a layer's graph still holds after its W
    (`weight_grad_kept_bytes`), and the plan takes the rest off (Chain.w_freed)."""
    from planner.costs import Chain

    if not walked:
        monkeypatch.setattr(
            Chain, "w_freed", property(lambda c: np.zeros(c.num_layers, dtype=np.int64))
        )
    split, over = _conv_blocks_zero_bubble(3)
    assert split == [(0, 2), (2, 4), (4, 5)]
    if walked:
        assert all(abs(o) <= 64 for o in over), over
    else:
        assert over[1] <= -(28 * 1024), over


@pytest.mark.parametrize("as_run", [True, False])
def test_zero_bubbles_w_lets_a_trained_layers_graph_go_before_the_layer_before_it(
    monkeypatch, as_run
):
    """Zero bubble's W runs layer by layer from the stage's last; a layer that trains lets its
    graph go as its own W runs, the tensors it shares with the layer before it included. The
    plan counted those beside the earlier layer's W as if still held (as they are where the
    later layer trains nothing: a max pool, test_graph.py): convolution, batch norm and ReLU
    blocks, one a layer, ran 32 768 bytes (2.6%) and 32 768 (4.9%) below the plan of two
    devices (with W's walk, test_zero_bubbles_w_walks_the_stage_from_its_last_layer, the second
    device's 32 768 still); now each device is its plan's to 64 bytes."""
    from planner.costs import Chain

    if not as_run:  # as it was: every next layer holding what it shares through W
        monkeypatch.setattr(Chain, "keeps_graph_through_w", property(lambda c: c.kept_grad >= 0))
    split, over = _conv_blocks_zero_bubble(2)
    assert split == [(0, 3), (3, 5)]
    if as_run:
        assert all(abs(o) <= 64 for o in over), over
    else:
        assert over[1] <= -(32 * 1024 - 64), over


def test_a_view_layer_from_a_transposed_input_is_not_taken_for_one():
    """A stage's input arrives dense under torchrun, whatever layout the profile saw: from a
    transposed input, a second transpose hands the next layer a dense view it saves, but from
    the dense one torchrun receives it hands a transposed view, which a linear layer copies and
    saves. Taken for a view of the stage's input, that stage's plan was 18% under its run (a
    review's). Only a view layer profiled from a contiguous input is marked so."""
    from tests.conftest import quick_profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _Swap(), _Swap(), nn.Conv2d(8, 8, 1))
    prof = quick_profile(model, torch.randn(4, 3, 8, 8), batch_sizes=[2])
    assert [layer.views_input for layer in prof.layers] == [False, True, False, False]


class _Same(nn.Module):
    """Hands its input on untouched: no autograd node between the stage's input and output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


# Stages the plan once over-counted (B held the forward's transient as well, and the largest
# output gradient of any of a stage's layers) or, masked by that, under-counted (autograd copied
# the pulled gradient into a pass-through stage's input gradient).
def _lone_first(W: int) -> list[nn.Module]:  # the first stage a lone Linear: no input gradient
    return [nn.Linear(W, W), nn.Sequential(nn.ReLU(), nn.Linear(W, W), _Mean(), nn.Linear(W, 10))]


def _ends_in_mean(W: int) -> list[nn.Module]:  # pulls a small gradient, hands on large ones
    return [nn.Linear(W, W), nn.ReLU(), _Mean(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10)]


def _hands_on(W: int) -> list[nn.Module]:  # a stage of _Same alone
    return [nn.Linear(W, W), nn.Dropout(0.3), _Same(), _Mean(), nn.Linear(W, 10)]


def _wide_out(W: int) -> list[nn.Module]:  # a last stage whose loss's target is wide
    return [nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 4 * W)]


SHAPES = {  # (layers, devices, schedule, recompute, the most the plan may count above the run)
    "lone first layer": (_lone_first, 2, "1f1b", "never", 512),
    "ends in a mean": (_ends_in_mean, 2, "gpipe", "never", 512),
    # recomputing: B holds the gradient through its re-materialising forward and its backward
    "ends in a mean, recomputed": (_ends_in_mean, 2, "1f1b", "always", 512),
    # B re-runs the lone Linear whole, its product too, beside the gradient it pulled (torch's
    # checkpoint stopped at its last save, before the product, which the plan counted: 45%
    # over; it counted the forward up to that save for a while after; now the runtime re-runs
    # the stage by hand, after pulling)
    "lone first layer, recomputed": (_lone_first, 2, "gpipe", "always", 512),
    # beside another stage of its device
    "hands its input on": (_hands_on, 2, "interleaved-1f1b", "never", 512),
    # zero bubble's I takes the gradient as is too, and W keeps none of it (the plan still
    # counts the stage's input as W's graph: 64 KiB over, on the safe side)
    "hands its input on, zero bubble": (_hands_on, 4, "zb-h1", "never", 64 * 1024 + 512),
    # the loss profiled (mse): the runtime copies the target inside the last stage's forward,
    # a recomputed one's too, which the profiled loss now does as well (it was 256 KiB under
    # once B's re-run no longer counted the loss's whole forward)
    "wide output under mse, recomputed": (_wide_out, 2, "gpipe", "always", 512),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_backward_holds_what_the_plan_counts_to_the_byte(shape):
    from tests.conftest import even_times, quick_profile

    W = 32
    layers, K, schedule, mode, slack = SHAPES[shape]
    torch.manual_seed(0)
    model = nn.Sequential(*layers(W))
    x, y, loss_fn, loss = (
        torch.randn(8, 256, W),
        torch.randint(0, 10, (8,)),
        nn.CrossEntropyLoss(),
        None,
    )
    if "mse" in shape:
        y, loss_fn, loss = torch.randn(8, 256, 4 * W), nn.MSELoss(), "mse"
    # (even times: the same split always)
    prof = even_times(quick_profile(model, x, batch_sizes=[1, 2, 8], loss_fn=loss))
    plan = plan_pipeline(
        prof, Cluster.uniform(K, "1GiB"), 8, microbatches=4, schedule=schedule, recompute=mode,
        checkpoint=(),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compile_pipe(model, plan).measure(x, y, loss_fn, steps=1)
    over = [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]
    # (the allocator's few bytes of scalars; the old counts were 64 KiB to 128 KiB off)
    assert all(-slack <= o <= 512 for o in over), (over, [st.layers for st in plan.stages])


@pytest.mark.parametrize("mode", ["never", "except_last"])
def test_torchrun_gpipe_with_receives_posted_ahead_holds_what_the_plan_counts(profiles, mode):
    """GPipe's program posts rank 1's forward receives as the step begins (each input held
    from then on; test_rendezvous checks that it does): no rank holds more than its plan."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from codegen.measure import measure_torchrun
    from planner.search import schedule_of, stage_costs
    from schedules.comm import preposted

    # (a split by structure alone: a one-sample profile's outlier once left norm and head alone
    # on rank 1, which the plan over-counts by 6.4-6.5%; found by a flakiness audit)
    plan = plan_pipeline(
        even_times(profiles["transformer"]), Cluster.uniform(2, "1GiB"), 8, microbatches=4,
        schedule="gpipe", recompute=mode, target="torchrun",
    )  # fmt: skip
    assert preposted(schedule_of(plan), stage_costs(plan.stages, plan.runtime)) == {1}
    report = measure_torchrun(plan, f"{__file__}:small_transformer", steps=1)
    for d in report.devices:  # (measured exactly: what the plan leaves out would show)
        assert -0.05 <= d.memory_error <= 0.001, d


class _Threads(nn.Module):
    """Records the intra-op threads each forward runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return x


def test_measure_runs_with_the_threads_the_profile_measured_with():
    """Found by a review: a bfloat16 model profiled with one thread and measured in a process
    of two read 5% over its plan on a device (a matmul's workspace grows with the threads). The
    plan records the profile's threads, and measure runs the stages with as many, then gives
    the process its own back."""
    torch.manual_seed(0)
    probe = _Threads()
    model = nn.Sequential(nn.Linear(16, 16), probe, nn.Tanh(), nn.Linear(16, 4))
    prof = quick_profile(model, torch.randn(4, 16), batch_sizes=[2], threads=1)
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 4, microbatches=2)
    assert plan.threads == 1 == prof.meta.threads
    assert Plan.model_validate_json(plan.model_dump_json()).threads == 1  # (kept in the file)
    kept = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(model, plan)
        x, y, loss_fn = make_data(model, plan)
        probe.seen.clear()
        pipe.measure(x, y, loss_fn, steps=1)
        assert probe.seen and set(probe.seen) == {1}
        assert torch.get_num_threads() == 2
        probe.seen.clear()
        pipe.train_step(x, y, loss_fn)  # (a step of its own is the caller's business)
        assert set(probe.seen) == {2}
    finally:
        torch.set_num_threads(kept)


def test_an_action_the_profile_timed_at_zero_is_predicted_at_zero_not_rounding():
    """Found by a review: a stage with no weights, its W timed at 0 ms, was predicted the
    rounding its span left less the runtime's overhead (about 1e-17 ms), and the report read
    its run +5.9e16% off."""
    from types import SimpleNamespace

    from codegen.measure import predicted_actions

    def timeline(end: float) -> SimpleNamespace:  # (all predicted_actions reads of one)
        return SimpleNamespace(spans=[SimpleNamespace(action=Action(0, Kind.W, 0), start=1.0,
                                                      end=end)])  # fmt: skip

    overhead = 0.1 + 0.2  # 0.30000000000000004, the action's span: 1e-17 ms left over
    assert 1.0 + overhead - 1.0 - 0.3 > 0
    assert predicted_actions(timeline(1.0 + overhead), 0.3) == {(0, "W"): 0.0}
    assert predicted_actions(timeline(1.5), 0.3) == {(0, "W"): 1.5 - 1.0 - 0.3}


def test_a_stage_of_weights_stepped_back_to_back_holds_what_its_plan_says():
    """Found by measuring: a stage of bias-free Linear layers (their weights stepped one after
    another by CPU Adam, each while the one before's denominator is still alive) read 7% over
    its plan. The profile now measures that carry (Adam's: one byte per byte) and each layer's
    tensors, and the plan counts the step by them."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(4)])
    prof = quick_profile(model, torch.randn(8, 128), batch_sizes=[2, 4], loss_fn="mse")
    assert prof.optimizer_step["adam"].carry == 1.0  # (torch 2.13's single-tensor Adam)
    assert [x.param_tensor_bytes for x in prof.layers] == [[128 * 128 * 4]] * 4
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=2, optimizer="adam")
    # the optimizer step is each device's peak here: its two weights' temporaries, and the
    # first's denominator while the second is stepped (Adam's step counters, 4 bytes each, are
    # the rest)
    assert all(0 <= over <= 16 for over in _held_over(model, plan)), _held_over(model, plan)


def _held_over(model: nn.Module, plan: Plan) -> list[int]:
    """Bytes each device held over its plan in one measured step of the compiled pipe."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)
    x, y, loss_fn = make_data(model, plan)
    report = pipe.measure(x, y, loss_fn, steps=1, tolerance=0.0)
    return [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]


def test_an_interleaved_devices_second_stage_is_stepped_beside_its_firsts_carry():
    """Found by measuring: a device holding (LayerNorm, Linear) and then (Linear, LayerNorm)
    read 10% over its plan. Its optimizer steps the second stage's weight while the first's
    weight still holds its denominator, which each stage alone does not see. The device's
    step is now counted across its stages."""
    torch.manual_seed(0)
    D = 128

    def lin() -> nn.Module:
        return nn.Linear(D, D, bias=False)

    # (the split below puts a weight at the end of each device's first stage and at the
    # start of its second; a LayerNorm steps a weight and a bias of D floats)
    layers = [lin(), nn.LayerNorm(D), lin(), lin(), nn.LayerNorm(D), nn.LayerNorm(D), lin()]
    model = nn.Sequential(*layers, nn.LayerNorm(D))
    prof = even_times(quick_profile(model, torch.randn(8, D), batch_sizes=[2, 4], loss_fn="mse"))
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=2, optimizer="adam",
                         schedule="interleaved-1f1b", recompute="never")  # fmt: skip
    assert [st.layers for st in plan.stages] == [(0, 1), (1, 3), (3, 6), (6, 8)]
    assert [st.rank for st in plan.stages] == [0, 1, 0, 1]
    weight = D * D * 4
    # each device's step: its second stage's weight beside the first's carry (Adam's
    # denominator, one byte per byte), above what either stage's own step is
    step = plan.stages[0].state_bytes
    assert step.step_tail is not None and step.step_tail >= weight
    over = _held_over(model, plan)
    assert all(0 <= x <= 32 for x in over), over  # (Adam's step counters, 4 B a tensor)
    # one stage per device: nothing crosses, and the plan stays as an older tool reads it
    # (found by a review)
    plain = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=2,
                          optimizer="adam", schedule="1f1b", recompute="never")  # fmt: skip
    assert "step_head" not in plain.canonical_json() and "step_tail" not in plain.canonical_json()
    assert "step_head" in plan.canonical_json()


def test_a_device_predicted_at_zero_bytes_and_over_is_named():
    """Found by a red team: a device predicted at 0 bytes that held 1 KiB read "+0.0%" and the
    FAIL line named no device (its error in percent is 0)."""
    import cli
    from codegen.measure import DeviceMeasure, MeasureReport

    def dev(name: str, predicted: int, measured: int) -> DeviceMeasure:
        return DeviceMeasure(name=name, predicted_peak_bytes=predicted,
                             measured_peak_bytes=measured,
                             memory_error=(measured - predicted) / predicted if predicted else 0.0,
                             static_bytes=0, predicted_ms=1.0, measured_ms=1.0, time_error=0.0)  # fmt: skip

    report = MeasureReport(
        plan_digest="x", target="streams", steps=1, tolerance=0.05, concurrent=False,
        predicted_step_ms=1.0, measured_step_ms=1.0, step_range_ms=(1.0, 1.0), step_error=0.0,
        devices=[dev("dev0", 0, 1024), dev("dev1", 1000, 1040), dev("dev2", 1000, 1060)],
        actions=[], unattributed_bytes=0, ok=False,
    )  # fmt: skip
    assert cli._over(report, 0.05) == ["dev0", "dev2"]
    table = cli._measure_table(report)
    assert "+1 KiB" in table.splitlines()[3] and "+4.0%" in table.splitlines()[4]


def test_a_smaller_micro_batch_holds_no_state_above_the_larger_ones():
    """Found by a red team: profiled at 1 and 2 samples, 3 in 2 micro-batches (2, 1) made
    `plan` fail with a traceback on every schedule. The last stage's B pulls no output
    gradient, but the figure raised so that a stage grows with its end was above zero at one
    sample, where at two it was none, and the plan's own validation refused it. No state of
    a smaller micro-batch is counted above the larger's now."""
    from profiler.examples import transformer

    model = transformer(vocab=256, d_model=64, heads=2, depth=2, seq_len=32, batch=8)
    prof = quick_profile(model, model.example_input, batch_sizes=[1, 2])
    for schedule in SCHEDULES[:2] + SCHEDULES[3:]:
        plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 3, microbatches=2,
                             schedule=schedule, recompute="never")  # fmt: skip
        for st in plan.stages:
            big, rest = st.state_bytes.model_dump(), st.state_bytes_rest.model_dump()
            assert all((rest[k] or 0) <= (big[k] or 0) for k in STATES), st


def _frozen(part: str) -> nn.Sequential:
    """Six Linear(256) + ReLU blocks, the first four or the last four Linears frozen (a
    fine-tuning's backbone or head kept as it was)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())])
    for k in range(0, 8) if part == "first" else range(4, 12):
        model[k].requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def frozen_profiles():
    return {
        part: quick_profile(_frozen(part), torch.randn(4, 256), batch_sizes=[1, 2, 4],
                            loss_fn="mse", threads=1)
        for part in ("first", "last")
    }  # fmt: skip


@pytest.mark.parametrize("part", ["first", "last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_frozen_parameters_take_no_gradient_nor_optimizer_state(
    frozen_profiles, part, schedule, optimizer
):
    """Found by a red team: a frozen parameter has no gradient and no optimizer state, yet the
    plan gave every parameter both (and a foreach step over all of them): a plan whose frozen
    Linears sat on one device was 58% (SGD) to 294% (Adam) over its run. It now counts the
    trainable bytes the profile lists (param_tensor_bytes). And a frozen prefix keeps nothing
    for backward (its stages get inputs that need no gradient; the profile measures its layers
    so): a first stage of frozen layers was 3% over. Now each device within a few scalars."""
    prof = frozen_profiles[part]
    frozen = 4 * (256 * 256 + 256) * F32
    assert sum(x.param_bytes for x in prof.layers) - sum(
        sum(x.param_tensor_bytes) for x in prof.layers
    ) == frozen  # fmt: skip
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule=schedule,
                         recompute="never", optimizer=optimizer)  # fmt: skip
    slots = 2 if optimizer == "adam" else 0
    for st in plan.stages:  # every weight once, a gradient and slots per trainable byte
        held = prof.layers[st.layers[0] : st.layers[1]]
        trained = sum(sum(x.param_tensor_bytes) for x in held)
        assert st.memory.params == sum(x.param_bytes for x in held)
        assert (st.memory.grads, st.memory.optimizer) == (trained, slots * trained)
    if part == "first":  # (nothing before layer 8 keeps anything for backward)
        assert all(sum(x.saved_bytes.values()) == 0 for x in prof.layers[:8])
        assert sum(prof.layers[8].saved_bytes.values()) > 0
    # zero bubble's I lets the gradient of a frozen layer's output go (W needs none): a stage
    # ending in one holds the gradient it pulled to I's end, which the stage one layer longer
    # does not, and the plan counts the most over the shorter ends (_let_go_input_live), one
    # gradient (2 KiB) over where a frozen layer is first
    over = 2048 if schedule == "zb-h1" else 0
    for d in measured_step(_frozen(part), plan).devices:
        assert -64 <= d.predicted_peak_bytes - d.measured_peak_bytes <= over + 64, d


class _HandsOn(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _hands_on_then_frozen() -> nn.Sequential:
    """Layers that hand their input on (an Identity and a module returning its input), a
    ReLU, a frozen Linear, a dropout at 0 and a flatten between two Linears."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Identity(), _HandsOn(), nn.ReLU(),
                          nn.Linear(64, 64), nn.Dropout(0.0), nn.Flatten(), nn.Linear(64, 8))  # fmt: skip
    model[4].requires_grad_(False)
    return model


@pytest.mark.parametrize("split", [[0, 1, 5, 9], [0, 2, 5, 9], [0, 3, 5, 9], [0, 1, 5, 7, 9]])
@pytest.mark.parametrize("counted", [True, False])
def test_zero_bubbles_i_after_layers_that_hand_their_input_on(monkeypatch, split, counted):
    """Found by a cold review: in a stage that opens with layers handing their input on, the
    ReLU's I makes the stage's input gradient itself (the Identity's and the pass-through's
    gradient is the one they are given), yet the plan took it for one not made yet, as it is
    where the layer before the ReLU makes a gradient of its own. Once zero bubble let the
    frozen Linear's gradient go, nothing covered it: the middle device ran one gradient (1 KiB,
    4.1%) over its plan. The plan now finds the last layer before each that does not hand on
    (Chain.through)."""
    import dataclasses

    from planner import search
    from planner.costs import Chain
    from planner.partition import Partition

    if not counted:  # the plan as it was: no layer known to hand its input on
        chain_at = search.chain_at

        def without(*args: object, **kwargs: object) -> Chain:
            return dataclasses.replace(chain_at(*args, **kwargs), through=None)

        monkeypatch.setattr(search, "chain_at", without)
    x = torch.randn(16, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = even_times(quick_profile(_hands_on_then_frozen(), x, batch_sizes=[4, 8, 16],
                                        loss_fn="cross_entropy", threads=1))  # fmt: skip
        cluster = Cluster.uniform(len(split) - 1, "1GiB")
        problem = search._Problem(prof, cluster, 16, "momentum", (prof.digest(), cluster.digest()))
        cand = search.Candidate(4, "zb-h1", "never")
        specs = search._stage_specs(problem, cand)
        plan = search._build_plan(problem, cand, specs, Partition(split, 0.0), "test")
        report = measured_step(_hands_on_then_frozen(), plan)
    finally:
        torch.set_num_threads(threads)
    over = [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]
    if counted:  # (a stage of the dropout and the flatten: 1 KiB over, their gradients alias)
        assert all(-1024 - 64 <= o <= 64 for o in over) and abs(over[1]) <= 64, over
    elif split != [0, 3, 5, 9]:  # (there the ReLU opens the stage: nothing hands on before it)
        assert over[1] >= 1024, over


def _tied_sequential() -> nn.Sequential:
    """An embedding and an output head sharing one weight, in an nn.Sequential."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), head)


@pytest.fixture(scope="module")
def tied_profile():
    x = torch.randint(0, 1000, (2, 16))
    return even_times(quick_profile(_tied_sequential(), x, batch_sizes=[1, 2, 4],
                                    loss_fn="cross_entropy", threads=1))  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "schedule", "M"),
    [(1, "gpipe", 2), (1, "1f1b", 4), (1, "zb-h1", 4), (2, "gpipe", 4), (2, "1f1b", 4),
     (2, "zb-h1", 4), (2, "interleaved-1f1b", 2), (3, "1f1b", 4)],
)  # fmt: skip
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_tied_weight_in_a_sequential_is_held_once(tied_profile, devices, schedule, M, optimizer):
    """Found by a sweep of plans against runs: an nn.Sequential's tied embedding and head were
    counted as two weights, each with its gradient and optimizer state (12-45% over on one
    device), and on the head's device the streams program's copy was given optimizer state
    and an optimizer step it does not have (41-68% over). The profile now lists a
    Sequential's tied parameters as a captured graph's, and the plan holds each once per
    stage, its gradient's parts waiting in B and zero bubble's I between the two uses, and a
    copy's gradient from the backward that makes it. Never under; within 64 bytes but for a
    few that hold a tensor of about 8 KiB less than counted (at most 1.2%: 1F1B on one device,
    zero bubble's first device, interleaved 1F1B's second)."""
    prof = tied_profile
    assert [(t.bytes, t.layers) for t in prof.tied] == [(1000 * 64 * F32, [0, 5])]
    plan = plan_pipeline(prof, Cluster.uniform(devices, "1GiB"), 8, microbatches=M,
                         schedule=schedule, recompute="never", optimizer=optimizer)  # fmt: skip
    held = 1000 * 64 * F32 * (2 + (2 if optimizer == "adam" else 0))  # weight, grad, slots
    if devices == 1:
        st = plan.stages[0]
        assert st.memory.params + st.memory.grads + st.memory.optimizer == held + sum(
            (2 + (2 if optimizer == "adam" else 0)) * x.param_bytes for x in prof.layers[1:5]
        )
    # (zero bubble: W's layers let their saved tensors go as they run, which the plan's W does
    # not walk: the embedding's W, last, runs with two tensors of 8 KiB fewer than counted)
    tolerance = 0.02 if schedule == "zb-h1" else 0.012
    for d in measured_step(_tied_sequential(), plan).devices:
        over = d.predicted_peak_bytes - d.measured_peak_bytes
        assert -64 <= over <= tolerance * d.measured_peak_bytes, d
    if devices == 2 and schedule == "1f1b":  # (CP-SAT's chain model adds the layers up)
        again = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=M,
                              schedule=schedule, recompute="never", solver="cp-sat")  # fmt: skip
        assert "tied parameter is held once" in again.solver.method


def test_a_chain_walks_its_tied_weights_only_where_its_tables_stay_small():
    """The walk's tables are (layers + 1)^2, made again from every layer with a later use of a
    tied parameter: an embedding and its head at 1 024 layers are walked; past 1 024 layers,
    or a module reused by all of 800 layers, each layer counts its own (over, as before)."""
    from planner.costs import chain_at
    from profiler.types import TiedParameter
    from tests.conftest import synthetic_profile

    def tied(n: int, uses: list[int]) -> tuple:
        prof = synthetic_profile([1.0] * n)
        prof = prof.model_copy(update={"tied": [TiedParameter(bytes=100, layers=uses)]})
        return chain_at(prof, 1).tied

    assert tied(1024, [0, 1023]) == ((100, (0, 1023)),)
    assert tied(1025, [0, 1024]) == ()
    assert tied(800, list(range(800))) == ()
    assert tied(600, list(range(0, 600, 60))) == ((100, tuple(range(0, 600, 60))),)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_recomputed_stage_of_batch_norms_holds_no_copy_of_their_statistics(schedule):
    """Found by a red team: a checkpoint's re-run of a stage put batch norm's running statistics
    back from a copy made first, held through the re-run and counted nowhere (792 bytes, 5.1%
    over the plan here). It now re-runs with a momentum of 0 (the statistics as they were, their
    count put back): within a few scalars, and the statistics those of a run that recomputes
    nothing (one batch norm with momentum None: a cumulative average)."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(8, 64)]
        for k in range(6):
            layers += [nn.BatchNorm1d(64, momentum=None if k == 1 else 0.1), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(64, 8))

    x = torch.randn(8, 8)
    prof = quick_profile(build(), x[:2], batch_sizes=[2, 8], loss_fn="mse", threads=1)
    stats = []
    for mode in ("always", "never"):
        plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                             schedule=schedule, recompute=mode, optimizer="sgd")  # fmt: skip
        model = build()
        for d in measured_step(model, plan).devices:
            assert abs(d.measured_peak_bytes - d.predicted_peak_bytes) <= 64, (mode, d)
        stats.append([b.clone() for b in model.buffers()])
    for a, b in zip(*stats):
        assert torch.equal(a, b)


class _BatchNormTwice(nn.Module):
    """One batch norm run twice in a layer (a two-view encoder's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 32), nn.BatchNorm1d(32, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.relu(self.bn(h)) + torch.relu(self.bn(2 * h))


class _BatchNormUnsaved(nn.Module):
    """A batch norm of the layer's own input after its last saved tensor: a checkpoint's early
    stop never runs it again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 32), nn.BatchNorm1d(8, affine=False, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + self.bn(x).mean(1, keepdim=True)


@pytest.mark.parametrize("first", [_BatchNormTwice, _BatchNormUnsaved])
def test_a_re_run_puts_back_as_many_batches_as_it_counted(first):
    """A cold review's: the re-run's count of batches was put back by one per batch norm, so one
    run twice counted 36 batches in three steps of four micro-batches (24 right), and one the
    checkpoint's early stop skips counted 0; with a momentum of None (a cumulative average) its
    statistics drifted. Put back by what the re-run added: the statistics and counts of a
    pipeline that recomputes nothing, under a stage's recomputation and a layer's checkpoint."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(first(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    prof = quick_profile(build(), x[:2], batch_sizes=[2, 8], loss_fn="mse", threads=1)
    runs = []
    for mode, layers in (("never", ()), ("always", ()), ("never", (0,))):
        plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule="1f1b",
                             recompute=mode, optimizer="sgd", checkpoint=list(layers))  # fmt: skip
        model = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(model, plan)
        for _ in range(3):
            pipe.train_step(x, y, nn.functional.mse_loss)
        runs.append([b.clone() for b in model[0].bn.buffers()])
    assert int(runs[0][-1]) == 3 * 4 * (2 if first is _BatchNormTwice else 1)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_zero_bubble_holds_the_input_of_a_last_stage_of_views_to_w():
    """A last stage of a flatten and an unflatten, then the loss (which saves a view of the
    stage's input): the views' graph holds that input from I to W. The plan took it off as the
    loss's, whose tensors go with I, and the last device ran 6 156 bytes (20%) over its plan
    (a red team's); counted now."""
    from tests.conftest import even_times, quick_profile
    from tests.test_graph import _measured_over

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 3, 1), nn.Flatten(),
        nn.Unflatten(1, (3, 16, 16)),
    )  # fmt: skip
    torch.manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    prof = even_times(quick_profile(model, x, batch_sizes=[2, 4, 8], loss_fn="mse", threads=1))
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, microbatches=4, schedule="zb-h1",
                         checkpoint=())  # fmt: skip
    assert [s.layers for s in plan.stages][-1] == (4, 6)  # the views alone, and the loss
    over = _measured_over(model, plan, x, y)
    assert all(o <= 64 for o in over), over


class _Tanh16(torch.autograd.Function):
    """tanh, by way of a copy of its input 16x as wide (a kernel's workspace): a forward that
    holds much more while it runs than it keeps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = x.repeat(1, 1, 16)[..., : x.shape[-1]].tanh()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return g * (1 - out * out)


class _Workspace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Tanh16.apply(x)


class _Summed(torch.autograd.Function):
    """The sum over tokens, whose backward reads no saved tensor (it saves none), and makes a
    gradient as wide as its input from a narrow one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.tokens = x.shape[1]
        return x.sum(1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.unsqueeze(1).expand(-1, ctx.tokens, -1).contiguous()


class _Sums(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Summed.apply(x)


class _Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


class _SavedAndKept(torch.autograd.Function):
    """tanh that saves its input and keeps its exp on ctx, reading neither in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.e = x.exp()
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * 0.5


class _Keeps(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavedAndKept.apply(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("tail", [_Sums, _Scaled, _Keeps])
def test_a_recomputed_stage_ending_in_a_layer_whose_backward_reads_nothing(schedule, tail):
    """A recomputed stage whose last layer's backward reads no saved tensor (a custom
    Function's sum over tokens, `x * 3`, a custom Function that saves its input and keeps its
    exp on ctx, reading neither), and whose second layer's forward holds a workspace 16x its
    input. Under torch's checkpoint the re-run came at the first saved tensor B read, after
    the last layer's backward, whose input gradient it held through the re-run: device 0 ran
    131 112 bytes (12.4%) above its plan with `x * 3`, 131 088 (8.3%) with the ctx, 8 208 with
    the sum; and the checkpoint kept each micro-batch's ctx from F to B (the ctx plan 50%
    larger). The runtime runs a recomputed forward without a graph now, and at B's start,
    once it has pulled its gradient, re-runs the stage whole, by hand, as the plan counts it:
    never above it. Zero bubble re-ran so at I already, before pulling, and its plan counted
    the gradient nowhere meanwhile: a torchrun rank, which receives it ahead, ran 98 332 bytes
    above its plan (a red team's); I pulls first now too, and its plan counts the gradient
    beside the re-run. The sum is below the plan by 120 KiB, the safe side: B's pulled
    gradient is raised to what the stage one layer shorter holds through its re-run (the
    Linear's output gradient), so that a stage's total grows with its end, which the exact
    search rests on."""
    from tests.conftest import even_times, quick_profile
    from tests.test_graph import _measured_over

    torch.manual_seed(0)
    wide = tail is not _Sums
    model = nn.Sequential(nn.Linear(64, 64), _Workspace(), nn.Linear(64, 256), tail(),
                          nn.Linear(256, 64), nn.Linear(64, 64), nn.Linear(64, 64))  # fmt: skip
    x = torch.randn(32, 16, 64)
    y = torch.randn(32, 16, 64) if wide else torch.randn(32, 64)
    prof = even_times(quick_profile(model, x, batch_sizes=[4, 8], loss_fn="mse", threads=1))
    assert prof.layers[3].saved_bytes[8] == (8 * 16 * 256 * 4 * 2 if tail is _Keeps else 0)
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 32, microbatches=4, schedule=schedule,
                         recompute="always", checkpoint=())  # fmt: skip
    assert plan.stages[0].layers == (0, 4)
    over = _measured_over(model, plan, x, y)
    peaks = plan.predicted.peak_memory
    assert all(o <= 64 for o in over), (over, peaks)
    below = 8 * 16 * 256 * 4 if tail is _Sums else 0
    assert over[0] >= -(below + 64) and over[1] >= -0.02 * peaks[1], (over, peaks)


def recomputed_tail() -> nn.Sequential:
    """The model above with `x * 3` closing its first stage, for a torchrun launch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), _Workspace(), nn.Linear(64, 256), _Scaled(),
                          nn.Linear(256, 64), nn.Linear(64, 64), nn.Linear(64, 64))  # fmt: skip
    model.example_input = torch.randn(32, 16, 64)
    model.example_loss = "mse"
    return model


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_torchrun_recomputing_holds_its_received_gradient_beside_the_re_run(schedule):
    """A torchrun rank has its output gradient from the receive it posted ahead, before B or I
    starts: through the stage's re-run too. Zero bubble's plan did not count it there (98 332
    bytes, 14.8%, above on rank 0, found by a red team); it does now."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from codegen.measure import measure_torchrun
    from tests.conftest import even_times, quick_profile

    model = recomputed_tail()
    prof = even_times(quick_profile(model, model.example_input, batch_sizes=[8], loss_fn="mse",
                                    threads=1))  # fmt: skip
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 32, microbatches=4, schedule=schedule,
                         recompute="always", checkpoint=(), target="torchrun")  # fmt: skip
    assert plan.stages[0].layers == (0, 4)
    report = measure_torchrun(plan, f"{__file__}:recomputed_tail", steps=1)
    over = [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]
    assert all(o <= 64 for o in over), over


class _Both(nn.Module):
    """Two outputs, one made from the other: (h, tanh(h))."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, torch.tanh(h)


class _First(nn.Module):
    """A linear layer on the first of two, the second handed on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(t[0]), t[1]


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(t[0]) * t[1]


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_zero_bubbles_w_counts_a_layer_whose_outputs_are_made_one_from_another_once(recompute):
    """A layer returning (h, tanh(h)) under zero bubble: W ran its backward from each
    output's gradient, and the gradient autograd gave h's node held tanh's part too, so that
    part reached the weight twice (found by a red team: the layer's weight gradient 0.79 off,
    relative to its largest entry, its bias 1.02; the same at 894edfd). Each output now has a
    node of its own, whose gradient is the later layers' alone: the un-pipelined model's
    gradients, and the plan's memory."""
    import copy

    from tests.conftest import even_times, quick_profile
    from tests.test_graph import _measured_over

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), _Both(), _First(), _First(), _Join(),
                          nn.Linear(64, 64))  # fmt: skip
    x, y = torch.randn(32, 16, 64), torch.randn(32, 16, 64)
    prof = even_times(quick_profile(model, x, batch_sizes=[8], loss_fn="mse", threads=1))
    for K in (2, 3):
        plan = plan_pipeline(prof, Cluster.uniform(K, "1GiB"), 32, microbatches=4,
                             schedule="zb-h1", recompute=recompute, checkpoint=())  # fmt: skip
        assert any(st.layers[0] <= 1 < st.layers[1] - 1 for st in plan.stages)  # (h inside)
        piped, ref = copy.deepcopy(model), copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = compile_pipe(piped, plan).train_step(x, y, nn.MSELoss())
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        assert abs(float(loss) - float(expected)) <= 1e-5
        for (name, p), q in zip(piped.named_parameters(), ref.parameters()):
            err = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
            assert err <= 1e-4, (K, name, err)
        over = _measured_over(model, plan, x, y)
        peaks = plan.predicted.peak_memory
        assert all(-0.02 * p <= o <= 64 for o, p in zip(over, peaks)), (K, over, peaks)
