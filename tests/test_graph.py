"""Models that are not nn.Sequential: graph capture, layers, crossing tensors, and pipelines
whose gradients equal the un-pipelined model's."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from codegen.emit import emit_program
from codegen.pipe import compile_pipe
from planner import Cluster, Plan, format_size, plan_pipeline
from profiler.artifact import InputError
from profiler.examples import gpt, resnet, unet
from profiler.graph import CapturedModel, capture
from profiler.limits import ArgumentError
from profiler.models import as_layers
from profiler.types import Profile
from tests.conftest import even_times, measured_step, quick_profile

F32 = 4


class SizeUser(nn.Module):
    """Reads the batch size in the last layer: a size that must reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = self.b(torch.relu(self.a(x)))
        return h.view(n, 2, 3).sum(-1)


class SizeCrosser(SizeUser):
    """After `a`, nothing that crosses has the batch dimension: the size itself must cross."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        m = self.a(x).mean(0)
        return self.b(m).expand(n, 6)


class InPlace(nn.Module):
    """torchvision's habit: nn.ReLU(inplace=True) as a module call of its own, writing into
    what the layer before made (a pipeline stage's leaf input, were it run in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv(x))
        y = self.conv2(x)
        y += x
        return self.fc(self.relu(y).mean((2, 3)))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h * 2 if h.sum() > 0 else h


def _needs_gloo() -> None:
    """Skip a test that launches torchrun where torch.distributed with gloo is not there."""
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def captured_unet() -> tuple[nn.Module, CapturedModel]:
    model = unet(width=4, depth=2, size=8)
    return model, capture(model, model.example_input)


@pytest.mark.parametrize("make", [resnet, unet, SizeUser])
def test_captured_model_computes_the_model_at_every_batch_size(make):
    model = make()
    x = getattr(model, "example_input", torch.randn(4, 6))
    layers = capture(model, x)
    assert isinstance(layers, nn.Sequential) and len(layers) >= 2
    # the model's own parameters, each once
    assert {id(p) for p in layers.parameters()} == {id(p) for p in model.parameters()}
    model.eval(), layers.eval()
    for n in (1, 3, 5):
        xs = torch.cat([x] * 3)[:n]
        torch.testing.assert_close(layers(xs), model(xs), rtol=0, atol=0)


def test_unet_crossing_bytes_equal_a_hand_count(captured_unet):
    """width 4, depth 2, 3 x 8 x 8 input. Encoder level k: double conv at width 4 * 2^k on a
    (8 / 2^k)^2 map, its output kept as the skip, then max-pooled."""
    model, layers = captured_unet
    names = [layer.unit for layer in layers]
    assert names[:8] == [f"down.{k}.{j}" for k in range(2) for j in range(4)]
    skip0 = 4 * 8 * 8 * F32  # down.0's output: 4 channels on 8 x 8
    skip1 = 8 * 4 * 4 * F32  # down.1's output: 8 channels on 4 x 4

    prof = quick_profile(model, model.example_input, batch_sizes=[1])  # fmt: skip
    per = {x.name: x.output_bytes for x in prof.layers}
    assert per["down.0.0"] == 4 * 8 * 8 * F32  # the conv's output only: nothing else is live
    assert per["down.0.3"] == skip0 + 4 * 4 * 4 * F32  # the skip and its pooled copy
    assert per["down.1.0"] == skip0 + 8 * 4 * 4 * F32
    assert per["down.1.3"] == skip0 + skip1 + 8 * 2 * 2 * F32
    assert per["bottom.3"] == skip0 + skip1 + 16 * 2 * 2 * F32
    assert per["up.0"] == skip0 + 16 * 4 * 4 * F32  # skip1 is inside the concatenation now
    assert per["merge.0.3"] == skip0 + 8 * 4 * 4 * F32
    assert per["up.1"] == 8 * 8 * 8 * F32  # the last concatenation: every skip used
    assert per["out"] == 3 * 8 * 8 * F32
    assert prof.captured and len(prof.layers[names.index("down.1.0")].crossing) == 2


def test_a_size_crosses_as_a_tensor_only_where_no_input_carries_it():
    layers = capture(SizeUser(), torch.randn(4, 6))
    # the batch size is a dimension of every tensor that crosses: it never needs to travel
    assert all(len(layer.crossing) == 1 for layer in layers)


def test_a_size_no_tensor_carries_crosses_as_a_tensor_and_the_pipeline_runs():
    model = SizeCrosser()
    x = torch.randn(8, 6)
    layers = capture(model, x)
    assert len(layers) == 2 and len(layers[0].crossing) == 2  # the mean and the batch size
    for n in (2, 5):
        torch.testing.assert_close(layers(x[:n]), model(x[:n]), rtol=0, atol=0)
    prof = quick_profile(layers, x, batch_sizes=[2])
    plan = _plan(prof, "1f1b", "never")
    _assert_step_parity(model, layers, plan, x, torch.randn(8, 6), nn.functional.mse_loss)


def test_in_place_at_a_layer_boundary_runs_out_of_place_with_parity():
    model = InPlace()
    x = torch.randn(8, 3, 8, 8)
    layers = capture(model, x)
    assert [layer.unit for layer in layers] == ["conv", "relu", "conv2", "relu", "fc"]
    prof = quick_profile(layers, x, batch_sizes=[2])
    plan = _plan(prof, "1f1b", "never", K=4)  # 5 layers on 4 stages: a ReLU starts one
    assert any(layers[st.layers[0]].unit == "relu" for st in plan.stages)
    y = torch.randint(0, 3, (8,))
    _assert_step_parity(model, layers, plan, x, y, nn.functional.cross_entropy)


def test_pipelined_inference_of_a_captured_model_in_eval_mode():
    model = resnet(widths=(4, 8), blocks=1, size=8)
    x = model.example_input
    layers = capture(model, x)
    prof = quick_profile(layers, x, batch_sizes=[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, _plan(prof, "gpipe", "never"))
    pipe.train_step(x, torch.zeros(8, dtype=torch.long), nn.functional.cross_entropy)
    model.eval()
    with torch.no_grad():
        want = model(x)  # batch norm on the running statistics the pipeline left
    layers.eval()
    torch.testing.assert_close(pipe(x), want, rtol=1e-5, atol=1e-6)


def test_data_dependent_control_flow_is_refused_with_the_line():
    with pytest.raises(InputError) as e:
        as_layers(Branchy(), torch.randn(4, 4))
    msg = str(e.value)
    assert "cannot capture the graph of Branchy" in msg and "test_graph.py" in msg
    assert "torch.cond" in msg and "\n" not in msg


def _plan(prof, schedule, recompute, K=2, M=4):
    return plan_pipeline(
        prof, Cluster.uniform(K, "1GiB"), 8, microbatches=M, schedule=schedule, recompute=recompute
    )


def _reference_step(model, x, y, loss_fn, M):
    """The un-pipelined model over the same micro-batches (batch norm sees each micro-batch)."""
    total = sum(
        loss_fn(model(a), b) * len(a) / len(x) for a, b in zip(x.tensor_split(M), y.tensor_split(M))
    )
    total.backward()
    return total


def _assert_step_parity(model, layers, plan, x, y, loss_fn):
    """One pipelined step of `plan` on `layers` (the model's own, captured) gives the
    un-pipelined model's loss, gradients and batch-norm statistics."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    loss = pipe.train_step(x, y, loss_fn)
    want = _reference_step(ref, x, y, loss_fn, plan.microbatches)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # batch norm's running statistics moved once per micro-batch, recomputation or not
    for b, c in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c)


@pytest.mark.parametrize(
    "make, schedule",
    [(unet, s) for s in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")]
    + [(resnet, "gpipe"), (resnet, "zb-h1")],  # batch norm: the schedules that replay unlike
)
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_graph_pipeline_gradients_equal_the_model(make, schedule, recompute):
    model = make(size=8) if make is unet else make(widths=(4, 8), blocks=1, size=8)
    x = model.example_input
    layers = capture(model, x)
    prof = quick_profile(layers, x, batch_sizes=[2])
    K = 3 if schedule == "gpipe" else 2
    plan = _plan(prof, schedule, recompute, K=K)
    if make is resnet:
        y, loss_fn = torch.randint(0, 10, (8,)), nn.functional.cross_entropy
    else:
        y, loss_fn = torch.randn_like(x), nn.functional.mse_loss
    _assert_step_parity(model, layers, plan, x, y, loss_fn)


def test_compile_pipe_captures_the_users_own_model(captured_unet):
    model, layers = captured_unet
    prof = quick_profile(layers, model.example_input, batch_sizes=[2])  # fmt: skip
    plan = _plan(prof, "1f1b", "never")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)  # the plain module: captured again, same layers
    owned = {id(p) for st in pipe.stages for p in st.parameters()}
    assert owned == {id(p) for p in model.parameters()}
    with pytest.raises(ArgumentError, match="deferred_batch_norm"):
        compile_pipe(model, plan, ["cpu", "cpu"], deferred_batch_norm=True)


def test_emitted_program_captures_and_runs(tmp_path):
    model = unet()  # as the program builds it: example:unet
    prof = quick_profile(model, model.example_input, batch_sizes=[2], model_spec="example:unet")  # fmt: skip
    plan = _plan(prof, "1f1b", "always")
    assert plan.captured
    src = emit_program(plan, model="example:unet")
    assert "def capture(" in src and "class GraphLayer" in src
    path = tmp_path / "prog.py"
    path.write_text(src)
    import ast
    import shutil

    tree = ast.parse(src)
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.partition(".")[0] for m in modules} <= {
        "__future__", "argparse", "collections", "contextlib", "copy", "io", "logging", "re",
        "sys", "time", "torch", "typing", "warnings", "weakref",
    }  # fmt: skip
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    fmt = subprocess.run([ruff, "format", "--check", "--line-length", "100", str(path)],
                         capture_output=True, text=True)  # fmt: skip
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    run = subprocess.run([sys.executable, str(path), "--device", "cpu"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "one 1f1b step" in run.stdout
    run = subprocess.run([sys.executable, str(path), "--check-streams"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "the streams order every use of memory" in run.stdout


GPT_SMALL = {"depth": 2, "d_model": 32, "vocab": 64, "seq_len": 16}


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def gpt_profile():
    model = gpt(**GPT_SMALL)
    layers = capture(model, model.example_input)
    prof = quick_profile(layers, model.example_input, batch_sizes=[2])  # fmt: skip
    return model, layers, prof


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("cuts", [(2, 5), (2, 4), (2,)])
def test_a_tied_copys_gradient_counts_from_where_the_first_backward_makes_it(
    gpt_profile, schedule, cuts
):
    """The streams program's copy of the tied weight, on the head's device, has its gradient
    made again by each step's first B, in the head's backward, which its profile measured
    adding a temporary gradient into one already there: in the first B that temporary is the
    gradient. The plan counted both. The head alone on the last device (cut at 5): 12.0% and
    14.8% over the run; it counts from that B's end now (nothing runs after the stage's first
    layer in it). After the final LayerNorm (4): 8.8% and 11.5% over; the B's transient now
    counts the gradient once its walk has passed the head (late_live). With the blocks too
    (2), the walk past the head sets the device's peak: late_live there is what keeps the plan
    from 8 KiB under (a walk that left the gradient out)."""
    from planner import search
    from planner.partition import Partition

    model, layers, prof = gpt_profile
    K = len(cuts) + 1
    problem = search._Problem(prof, Cluster.uniform(K, "1GiB"), 6, "adam", ("", ""), "streams",
                              ())  # fmt: skip
    cand = search.Candidate(3, schedule, "never")
    chain, memory = problem.chain(cand)
    split = Partition(bounds=[0, *cuts, chain.num_layers], bottleneck=0.0)
    specs = search._stage_specs(problem, cand, halve=False)
    plan = search._sealed(search._build_plan(problem, cand, specs, split, "test"))
    last, a = plan.stages[-1].state_bytes, cuts[-1]
    assert plan.stages[-1].layer_types[-1] == "Linear"  # (the head: the model's last layer)
    assert (last.late_grad, last.late_grad_at_end) == (64 * 32 * 4, True if a == 5 else None)
    if a < 5:  # (what the walk holds past the head, with the gradient: exactly so)
        walk = memory.late_walk(a, chain.num_layers, 5, 0)
        assert last.live == walk
        assert last.late_live == (walk + 8192 if a == 2 else walk)
    d = measured_step(layers, plan, gpt_small()).devices[-1]
    assert abs(d.measured_peak_bytes - d.predicted_peak_bytes) <= 160, d  # (a few scalars)


@pytest.mark.parametrize("target", ["streams", "torchrun"])
def test_the_least_memory_of_a_captured_graph_is_the_least_that_plans(gpt_profile, target):
    """Found by a red team: where no split fits a GPT under torchrun, the need stated was the
    split search's count (7 922 176 bytes), while `plan` succeeded from 7 889 408: the closest
    plan, its program and real routes, holds less. On equal devices the need is now the
    closest plan's largest device: it plans there, and one byte less it does not."""
    from planner import InfeasibleError

    _, _, prof = gpt_profile
    kw = dict(target=target, schedule="1f1b")
    with pytest.raises(InfeasibleError) as info:
        plan_pipeline(prof, Cluster.uniform(3, 1000), 4, **kw)
    need = info.value.needed_bytes
    assert max(d.total for d in info.value.closest.devices) == need
    plan = plan_pipeline(prof, Cluster.uniform(3, need), 4, **kw)
    assert plan.fits and plan.stages_per_device == 1
    if target == "torchrun":  # found by the memory search (once labelled "interleaved: ...")
        assert not plan.solver.optimal and "interleaved" not in plan.solver.unproven
        assert "least memory per device: the split search" in plan.solver.unproven
    with pytest.raises(InfeasibleError):
        plan_pipeline(prof, Cluster.uniform(3, need - 1), 4, **kw)


def test_a_tied_copys_gradient_is_counted_from_its_stages_first_backward(gpt_profile):
    """The streams program hands the gradient of its copy of a tied weight to the model's
    own parameter as each step ends, and its stage's next backward makes it again: until
    then the device holds one weight gradient less than its weights' count. Measured on the
    GPT's head stage under zero bubble with 8 samples in 3 micro-batches, whose peak comes
    at an I before the first W: 1.6% over the run before the plan knew, -0.17% now."""
    model, layers, prof = gpt_profile
    prof = even_times(prof)
    from planner.search import schedule_of, simulate_plan, stage_costs
    from schedules.memory import peaks

    tied = model.tokens.weight.numel() * F32
    plan = _plan(prof, "zb-h1", "never", K=2, M=3)
    last = plan.stages[-1]
    assert last.state_bytes.late_grad == tied and plan.stages[0].state_bytes.late_grad is None
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    x, y = model.example_input, torch.randint(0, GPT_SMALL["vocab"], model.example_input.shape)
    d = pipe.measure(x, y, _lm_loss, steps=1).devices[-1]
    assert abs(d.memory_error) <= 0.005, d
    # counted all step, as before, the head's device would read 1.6% over its run
    costs = stage_costs(plan.stages, plan.runtime, larger=8 % 3)
    always = [[dataclasses.replace(b, late_grad=0) for b in sizes]
              for sizes in (costs.memory, costs.memory_rest)]  # fmt: skip
    before = peaks(schedule_of(plan), "never", always[0], smaller=always[1], larger=costs.larger)
    assert before[-1] == d.predicted_peak_bytes + tied
    assert d.measured_peak_bytes < 0.99 * before[-1]
    # under torchrun each rank keeps its copy's gradient (and steps it): nothing late
    run = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=3, schedule="zb-h1",
                        recompute="never", target="torchrun")  # fmt: skip
    assert all(st.state_bytes.late_grad is None for st in run.stages)


def test_tied_weights_are_counted_on_both_stages(gpt_profile):
    model, layers, prof = gpt_profile
    # a split by structure alone: one slow sample of the head's once left the head alone on
    # the last stage (found by a flakiness audit), a stage the plan over-counts by 7.5-8.3%
    prof = even_times(prof)
    tied = model.tokens.weight.numel() * F32
    per = {x.name: x.param_bytes for x in prof.layers}
    assert per["tokens"] == per["head"] == tied  # the head's weight is the embedding's
    plan = _plan(prof, "1f1b", "never")
    first, last = plan.stages[0], plan.stages[-1]
    assert first.rank != last.rank  # the embedding and the head on different devices
    for st in (first, last):  # each holds its own copy of the tied weight
        a, b = st.layers
        assert st.memory.params == st.memory.grads == sum(x.param_bytes for x in prof.layers[a:b])
        assert st.memory.params >= tied
    # ... but only the model's own takes optimizer state: the copy's gradient joins it first
    assert first.memory.optimizer == 2 * first.memory.params  # (adam: two slots)
    assert last.memory.optimizer == 2 * (last.memory.params - tied)
    assert [(t.bytes, len(t.layers)) for t in prof.tied] == [(tied, 2)]
    # ... as the run holds it (before, the head's device measured 4.7% under its plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    x, y = model.example_input, torch.randint(0, GPT_SMALL["vocab"], model.example_input.shape)
    report = pipe.measure(x, y, _lm_loss, steps=1)
    assert all(abs(d.memory_error) <= 0.005 for d in report.devices), report.devices
    # one device holding both: the weight once, as the model itself holds it
    one = plan_pipeline(prof, Cluster.uniform(1, "1GiB"), 8, microbatches=2, schedule="gpipe")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # each parameter once
    assert one.stages[0].memory.params == whole == sum(x.param_bytes for x in prof.layers) - tied


def gpt_small() -> nn.Module:
    """The GPT of GPT_SMALL, seeded: what each rank of a torchrun measure builds."""
    torch.manual_seed(0)
    return gpt(**GPT_SMALL)


def test_torchrun_holds_a_tied_weight_as_its_plan_counts(gpt_profile):
    """Found by measuring example:gpt under torchrun: the head's rank held 7.2% more than its
    plan (50% with the head alone on it). Each rank steps its own copy of the tied weight, so
    keeps its optimizer state, which the plan counted on the first stage alone; and the step
    set the weight's accumulated gradient aside while it made a new one. Now a torchrun plan
    counts the state on every stage that uses the weight, and the step holds one gradient."""
    _needs_gloo()
    from codegen.measure import measure_torchrun

    model, _, prof = gpt_profile
    prof = even_times(prof)  # (the same split always)
    tied = model.tokens.weight.numel() * F32
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule="1f1b",
                         recompute="never", target="torchrun")  # fmt: skip
    streams = _plan(prof, "1f1b", "never")
    assert [st.layers for st in plan.stages] == [st.layers for st in streams.stages]
    first, last = plan.stages[0], plan.stages[-1]
    assert first.memory.optimizer == 2 * first.memory.params  # (adam: two slots)
    assert last.memory.optimizer == 2 * last.memory.params  # the copy's own, too
    # (and each rank's runtime keeps the caller's CPU RNG state through the step)
    rng = torch.get_rng_state().numel()
    assert last.memory.total == streams.stages[-1].memory.total + 2 * tied + rng
    assert first.memory.total == streams.stages[0].memory.total + rng
    report = measure_torchrun(plan, f"{__file__}:gpt_small", steps=1)
    for d in report.devices:  # (measured exactly: what the plan leaves out would show)
        assert -0.05 <= d.memory_error <= 0.001, d


def test_torchrun_holds_an_uneven_batchs_gradients_sent_back_at_their_own_size():
    """7 samples in 3 micro-batches (3, 2, 2) under torchrun. A captured graph's gradients sent
    back per stage were known at one size, and its plan counted every micro-batch at the
    larger: a red team measured the GPT's ranks 10% to 16% under their plans. Each stage now
    says what its smaller micro-batches send back (grads_back_rest), and each message is
    counted at its own size: to the byte, a few scalars aside."""
    _needs_gloo()
    from codegen.measure import measure_torchrun
    from planner.search import simulate_plan

    model = gpt_small()
    layers = capture(model, model.example_input)
    prof = even_times(quick_profile(layers, model.example_input, batch_sizes=[2, 3]))
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 7, microbatches=3, schedule="1f1b",
                         recompute="never", target="torchrun")  # fmt: skip
    assert all(st.state_bytes_rest is not None for st in plan.stages)
    sent = [(st.grads_back, st.grads_back_rest) for st in plan.stages if st.grads_back]
    assert sent and all(n < m for back, rest in sent for (_, n), (_, m) in zip(rest, back))
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    report = measure_torchrun(plan, f"{__file__}:gpt_small", steps=1)
    for d in report.devices:
        assert d.predicted_peak_bytes - 256 <= d.measured_peak_bytes, d
        assert d.measured_peak_bytes <= d.predicted_peak_bytes + 256, d
    # resealed with more sent back than the larger micro-batches send: refused
    data = plan.model_dump()
    st = next(x for x in data["stages"] if x["grads_back"])
    st["grads_back_rest"] = [[a, n + 1] for a, n in st["grads_back"]]
    with pytest.raises(ValueError, match="grads_back_rest"):
        Plan.model_validate(data)
    st["grads_back_rest"] = None  # (a plan made before: its messages all at the larger size)
    Plan.model_validate(data)


def _gpt_step_as_the_model_takes_it(model: nn.Module, layers: Any, plan: Any) -> tuple:
    """Compile the plan, take one step, and hold its loss and every gradient of the model to
    the un-pipelined step's; the pipe and the batch, for more."""
    ref = copy.deepcopy(model)
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    x = model.example_input
    y = torch.randint(0, GPT_SMALL["vocab"], x.shape)
    loss = pipe.train_step(x, y, _lm_loss)
    want = _lm_loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    return pipe, x, y


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_tied_weights_gradients_are_summed_into_the_models_parameter(gpt_profile, schedule):
    model, layers, prof = gpt_profile
    plan = _plan(prof, schedule, "except_last")
    for _ in range(2):  # compiling twice leaves the model's layers as they were
        pipe, x, y = _gpt_step_as_the_model_takes_it(model, layers, plan)
        (own, copies), *rest = pipe.program.tied
        assert own is model.tokens.weight and len(copies) == 1 and not rest
        assert copies[0].grad is None  # handed to the model's parameter
    # an optimizer step on the model's parameter reaches the copy at the next step
    with torch.no_grad():
        model.tokens.weight.add_(1.0)
    pipe.train_step(x, y, _lm_loss)
    torch.testing.assert_close(copies[0].detach(), model.tokens.weight.detach())


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_a_weight_two_layers_of_one_stage_share_gets_one_gradient_under_zero_bubble(
    gpt_profile, recompute
):
    """Found by a review: on one device the embedding and the head (one tied weight) share a
    stage, and each layer's own W reached the weight through the other layer too: the second
    W found that graph gone (an error), and would have counted it twice. Its gradient is now
    taken in I, over the whole stage, once."""
    model, layers, prof = gpt_profile
    plan = plan_pipeline(prof, Cluster.uniform(1, "1GiB"), 8, microbatches=2, schedule="zb-h1",
                         recompute=recompute)  # fmt: skip
    pipe, x, y = _gpt_step_as_the_model_takes_it(model, layers, plan)
    report = pipe.measure(x, y, _lm_loss, steps=1)
    for d in report.devices:
        assert d.measured_peak_bytes <= 1.001 * d.predicted_peak_bytes, d


def test_cli_profiles_plans_and_compiles_a_graph_example(run_cli, tmp_path):
    prof, plan, prog = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "prog.py"
    r = run_cli("profile", "example:resnet", "--batch-sizes", "2", "--repeats", "1",
                "--warmup", "0", "-o", prof)  # fmt: skip
    assert r.code == 0, r.err
    r = run_cli("plan", prof, "--devices", "3", "--memory", "256MiB", "--batch-size", "8",
                "-o", plan)  # fmt: skip
    assert r.code == 0, r.err
    assert "BasicBlock" in r.out  # the layers are named after the modules they run
    r = run_cli("codegen", plan, "--model", "example:resnet", "-o", prog)
    assert r.code == 0, r.err
    assert "def capture(" in prog.read_text()
    # routes the model's graph does not send along: refused before a program is written (it
    # failed with a traceback once it ran)
    data = json.loads(plan.read_text())
    assert data["routes"] == [[0, 1], [1, 2]]
    data["routes"] = [[0, 1], [0, 2], [1, 2]]
    data["meta"]["content_digest"] = Plan.model_validate(data).digest()  # (as on purpose)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    r = run_cli("codegen", edited, "--model", "example:resnet", "-o", tmp_path / "e.py")
    assert r.code == 2 and "are not what the model's graph sends" in r.err, r.err
    assert not (tmp_path / "e.py").exists()
    # a plan of one model is refused for another graph model
    r = run_cli("codegen", plan, "--model", "example:unet", "-o", tmp_path / "other.py")
    assert r.code == 2 and "different model" in r.err


SKIP_MODEL = """
import torch
from torch import nn


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)
        self.c = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) + x)


def build():
    torch.manual_seed(0)
    model = Skip()
    model.example_input = torch.randn(4, 2, 4, 4)
    return model
"""


def test_a_captured_graph_profiled_in_bfloat16_compiles_and_runs(run_cli, tmp_path, capsys):
    """Found by a cold review: the graph was captured on the float32 example while the model
    was in bfloat16 ("Input type (float) and bias type (c10::BFloat16)")."""
    src, prof, plan = tmp_path / "skip.py", tmp_path / "p.json", tmp_path / "plan.json"
    src.write_text(SKIP_MODEL)
    # every micro-batch size the search may pick is profiled: memory is then measured, not
    # extended from one size (from size 2 alone, micro-batches of 1 ran 47-53% over the plan,
    # which failed the measure below when the noisy timings picked M = 4)
    r = run_cli("profile", f"{src}:build", "--dtype", "bfloat16", "--batch-sizes", "1,2,4",
                "--repeats", "1", "--warmup", "0", "-o", prof)  # fmt: skip
    assert r.code == 0, r.err
    r = run_cli("plan", prof, "--devices", "2", "--memory", "1GiB", "--batch-size", "4",
                "-o", plan)  # fmt: skip
    assert r.code == 0, r.err
    program = tmp_path / "program.py"
    r = run_cli("codegen", plan, "--model", f"{src}:build", "-o", program)
    assert r.code == 0, r.err
    ns: dict = {}
    exec(compile(program.read_text(), str(program), "exec"), ns)
    ns["main"](["--device", "cpu"])
    assert " ms, loss " in capsys.readouterr().out
    r = run_cli("measure", plan, "--model", f"{src}:build", "--steps", "1", "--tolerance", "50%")
    assert r.code == 0, r.err


def test_measure_runs_a_captured_graph_under_torchrun(run_cli, tmp_path):
    """Found by a user trial: each rank built the model uncaptured for the program's Pipeline
    ("'ResNet' object is not iterable"). It takes the graph the program's own loader captures."""
    _needs_gloo()
    prof, plan, out = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "m.json"
    r = run_cli("profile", "example:resnet", "--batch-sizes", "2", "--repeats", "1",
                "--warmup", "0", "-o", prof)  # fmt: skip
    assert r.code == 0, r.err
    r = run_cli("plan", prof, "--devices", "2", "--memory", "256MiB", "--batch-size", "4",
                "--microbatches", "2", "--target", "torchrun", "-o", plan)  # fmt: skip
    assert r.code == 0, r.err
    r = run_cli("measure", plan, "--model", "example:resnet", "--target", "torchrun",
                "--steps", "1", "--tolerance", "50%", "-o", out)  # fmt: skip
    assert r.code == 0, r.err
    report = json.loads(out.read_text())
    assert report["target"] == "torchrun" and len(report["devices"]) == 2
    assert all(d["measured_peak_bytes"] > 0 for d in report["devices"])


@pytest.fixture(scope="module")
def unet_routes():
    """A U-Net (width 8, depth 3, 8 x 8) over 4 stages: its first skip spans all of them. Every
    layer's time is set to 1 ms, so the split (and so the routes) does not depend on how fast
    this machine ran the profile."""
    model = unet(size=8)
    layers = capture(model, model.example_input)
    # (one thread, as each rank of a torchrun measure runs: a backward's temporaries differ
    # with the thread count)
    prof = quick_profile(layers, model.example_input, batch_sizes=[2], threads=1)
    return model, layers, even_times(prof)


def test_what_a_stage_receives_per_start_and_end_equals_the_value_by_value_sum(unet_routes):
    from planner.costs import chain_at

    flow = chain_at(unet_routes[2], 3).flow
    table = flow.recv_table()
    n = table.shape[0] - 1
    i, k = np.triu_indices(n + 1, 1)
    np.testing.assert_array_equal(table[i, k], flow.recv(i, k))
    assert (table[np.tril_indices(n + 1)] == 0).all()


def _bounds(plan, prof):
    return [st.layers[0] for st in plan.stages] + [len(prof.layers) + (prof.loss is not None)]


def test_a_skip_is_sent_once_straight_to_the_stage_that_reads_it(unet_routes):
    from codegen._runtime import routes_of
    from planner.costs import chain_at
    from planner.routing import carried
    from planner.search import schedule_of
    from schedules.comm import insert_comms, messages

    model, layers, prof = unet_routes
    plan = _plan(prof, "1f1b", "never", K=4, M=4)
    by_name = {x.name: x for x in prof.layers}
    first_skip = by_name["down.0.3"].crossing[0]  # down.0's output, read by the last merge
    wanted = carried(chain_at(prof, 2).flow, _bounds(plan, prof))
    skip_stage = next(t for (s, t), names in wanted.items() if first_skip in names)
    assert skip_stage == 3 and (0, 3) in [tuple(r) for r in plan.routes]
    # sent once: only the route 0 -> 3 carries it; the stages between neither take nor give it
    assert [r for r, names in wanted.items() if first_skip in names] == [(0, 3)]
    # the runtime routes exactly what the plan counted
    stages = [st.layers for st in plan.stages]
    assert routes_of(list(layers), stages) == wanted
    # counted in the schedule's sends: one message per micro-batch and direction on 0 -> 3
    lowered = insert_comms(schedule_of(plan))
    msgs = [(str(a), str(b)) for a, b in messages(lowered)]
    M = plan.microbatches
    # (each message its own action, `0SEND_F0@3`: one action carrying several could hang NCCL)
    assert [p for p in msgs if p[0].startswith("0SEND_F") and p[1].startswith("3")] == [
        (f"0SEND_F{m}@3", f"3RECV_F{m}@0") for m in range(M)
    ]
    assert len(msgs) == 2 * M * len(plan.routes)
    # what a stage receives: the values its layers read, by hand from the U-Net's shapes
    # (8 channels at 8 x 8 for down.0, 16 at 4 x 4 for down.1, 32 at 2 x 2 for down.2)
    mb = plan.microbatch_size
    skip0, skip1, skip2 = 8 * 8 * 8 * F32, 16 * 4 * 4 * F32, 32 * 2 * 2 * F32
    received = [st.input_bytes for st in plan.stages]
    relayed = [prof.input_bytes * mb] + [
        prof.layers[i - 1].output_bytes * mb for i, _ in stages[1:]
    ]
    assert received[0] == relayed[0]
    assert all(r <= w for r, w in zip(received, relayed)) and received[1:] != relayed[1:]
    last = wanted[(0, 3)] + [n for (s, t), ns in wanted.items() if t == 3 and s != 0 for n in ns]
    sizes = {n: b * mb for x in prof.layers for n, b in zip(x.crossing, x.crossing_bytes)}
    assert received[3] == sum(sizes[n] for n in last)
    assert sizes[first_skip] == skip0 * mb and {skip1 * mb, skip2 * mb} <= set(sizes.values())


@pytest.mark.parametrize(
    "schedule, recompute",
    [("1f1b", "never"), ("zb-h1", "never"), ("gpipe", "always"), ("interleaved-1f1b", "never")],
)
def test_skips_straight_to_far_stages_keep_gradient_parity(unet_routes, schedule, recompute):
    model, layers, prof = unet_routes
    K = 2 if schedule == "interleaved-1f1b" else 4
    plan = _plan(prof, schedule, recompute, K=K, M=4)
    assert any(t > s + 1 for s, t in plan.routes)  # a skip past a stage
    for p in model.parameters():
        p.grad = None
    x = model.example_input
    _assert_step_parity(model, layers, plan, x, torch.randn_like(x), nn.functional.mse_loss)


def test_early_arrivals_are_counted_where_they_wait(unet_routes):
    """A skip from stage 0 reaches stage 3 after 0F(m), before 2F(m): the plan holds it there
    as `early` from then on; its gradient stays there after 2B(m) pulls its own share, until
    0B(m) pulls it (`late`). What the planner counts while the split is unknown is no less."""
    from planner.search import schedule_of
    from schedules.memory import EARLY, replay

    _, _, prof = unet_routes
    plan = _plan(prof, "1f1b", "never", K=4, M=4)
    sched = schedule_of(plan)
    routes = [tuple(r) for r in plan.routes]
    far = {u: min(s for s, v in routes if v == u and s < u - 1) for s, u in routes if s < u - 1}
    assert far  # the U-Net's first skip passes a stage
    assert sched.early_from() == [far.get(t, -1) for t in range(4)]
    assert [st.state_bytes.early > 0 for st in plan.stages] == [t in far for t in range(4)]
    # and their gradients (skips are floating point) wait there for that stage's backward
    assert [st.state_bytes.late for st in plan.stages] == [
        st.state_bytes.early for st in plan.stages
    ]
    # the occupancy says the last such stage holds several micro-batches' early arrivals at once
    assert max(t[EARLY] for t in plan.stages[max(far)].occupancy) >= 2
    from planner.search import stage_bytes

    played = replay(sched, [st.recompute for st in plan.stages],
                    [stage_bytes(st) for st in plan.stages])  # fmt: skip
    assert played.peaks == plan.predicted.peak_memory


def test_skips_across_ranks_and_tied_weights_under_torchrun(unet_routes, gpt_profile, tmp_path):
    """One launch of 2 gloo ranks runs four programs: a U-Net and a model read far down, whose
    skips pass a stage and cross ranks; and a GPT whose tied embedding is on both ranks, under
    1F1B and interleaving. Each gives the un-pipelined loss and gradients."""
    _needs_gloo()
    import json

    from tests.test_codegen import ROOT, torchrun

    _, _, prof = unet_routes
    plan = _plan(prof, "interleaved-1f1b", "never", K=2, M=4)
    assert any(t > s + 1 and s % 2 != t % 2 for s, t in plan.routes)  # past a stage, across ranks
    (tmp_path / "unet.py").write_text(emit_program(plan, target="torchrun"))
    far = FarReader()
    layers = capture(far, far.example_input[:2])
    fprof = even_times(quick_profile(layers, far.example_input[:2], batch_sizes=[2]))  # fmt: skip
    fplan = plan_pipeline(fprof, Cluster.uniform(2, "1GiB"), 32, microbatches=4,
                          schedule="interleaved-1f1b", recompute="never")  # fmt: skip
    assert any(t > s + 1 for s, t in fplan.routes)
    (tmp_path / "far.py").write_text(emit_program(fplan, target="torchrun"))
    _, _, gprof = gpt_profile
    gpt = []
    for schedule in ("1f1b", "interleaved-1f1b"):
        path = tmp_path / f"{schedule}.py"
        path.write_text(emit_program(_plan(gprof, schedule, "never"), target="torchrun"))
        gpt.append(str(path))
    torch.manual_seed(0)
    _, tplan = _tied_inside_plan(TiedInside())
    (tmp_path / "tied.py").write_text(emit_program(tplan, target="torchrun"))
    r = torchrun(2, str(ROOT / "tests" / "dist_graph_driver.py"), str(tmp_path),
                 f"unet={tmp_path / 'unet.py'}", f"far={tmp_path / 'far.py'}", *gpt,
                 f"tied={tmp_path / 'tied.py'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    held = set()
    repeats = 0
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("unet.py", "far.py", "tied.py"):
            res = results[name]
            assert res["loss_err"] <= 1e-5, (rank, name, res)
            assert max(res["grad_err"].values()) <= 1e-4, (rank, name, res)
        for name in ("1f1b.py", "interleaved-1f1b.py"):
            res = results[name]
            assert res["loss_err"] <= 1e-5, (rank, name)
            assert max(res["grad_err"].values()) <= 1e-5, (rank, name, res)
            # the tied weight frozen before a second step that accumulates on the first: every
            # rank keeps its first-step gradient (a rank other than the tie group's first once
            # zeroed it, and no sum followed: the whole gradient lost there)
            refused = res["accum_err"].pop("refused", "")
            assert max(res["accum_err"].values()) <= 1e-5, (rank, name, res)
            # ... and unfrozen on one rank alone, the step refused on every rank (it hung)
            assert refused.startswith("a tied weight trains on some ranks"), (rank, name)
            held |= {(rank, p) for p in res["grad_err"]}
        for name, res in results.items():
            # each parameter listed once, and one SGD step over them is the model's (a tied
            # weight two stages of the rank use, listed twice, was stepped twice)
            assert res["listed"] == res["distinct"], (rank, name, res)
            assert max(res["step_err"].values()) <= 1e-5, (rank, name, res)
        repeats += results["tied.py"]["held"] - results["tied.py"]["listed"]
    assert repeats > 0  # (the tied model's plan has a rank whose two stages share the weight)
    assert (0, "tokens.weight") in held and (1, "tokens.weight") in held  # on both ranks


def test_a_device_over_only_by_gradients_received_ahead_is_said_so(unet_routes):
    """The split search does not count the gradients a torchrun rank receives ahead of their
    backward: a device given just less than its plan needs is over only by those. The search
    says so (found by a review: it claimed "needs 1 B" of a device that had more), and says
    with how much it plans."""
    from planner.cluster import Device
    from planner.search import AHEAD_OVER, InfeasibleError, simulate_stages

    _, _, prof = unet_routes
    kw = dict(microbatches=4, schedule="gpipe", recompute="except_last", target="torchrun")
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, **kw)
    plain = simulate_stages(plan.schedule, 3, 4, plan.stages, levels=False,
                            routes=tuple(map(tuple, plan.routes))).peak_memory  # fmt: skip
    need = plan.devices[0].total
    assert need > plain[0]  # (what rank 0 receives ahead raises its peak)
    devices = [Device(name=f"dev{i}", memory_bytes=need - 1 if i == 0 else 2**30) for i in range(3)]
    with pytest.raises(InfeasibleError) as got:
        plan_pipeline(prof, Cluster(devices=devices), 8, **kw)
    # ... and a budget at which it plans (a slower split may plan with less, as it says)
    assert str(got.value).startswith(f"no split fits: {AHEAD_OVER}; it plans with ")
    assert str(got.value).endswith(f"({need} bytes) on every device with less")
    assert got.value.needed_bytes == need
    # with what it receives ahead counted, it fits again
    devices[0] = Device(name="dev0", memory_bytes=need)
    assert plan_pipeline(prof, Cluster(devices=devices), 8, **kw).devices[0].total == need


def unet_small() -> nn.Module:
    """The U-Net of the unet_routes fixture: what each rank of a torchrun measure builds."""
    return unet(size=8)


def test_torchrun_holds_the_skip_gradients_it_receives_ahead_as_its_plan_counts(unet_routes):
    """Found by measuring a U-Net under torchrun: the program that meets its senders soonest
    (`_lockstep`) has the first rank take micro-batch m - 1's skip gradients from the last
    before its backward of m, and the first rank held 7.0% more than its plan, which counted
    them on the last rank until the backward that reads them. The plan now counts each such
    gradient on its reader from its receive, by what its route carries: to the byte here. (It
    still counts it on its sender too, until that backward: 11% over there, on the safe side;
    the sender lets it go once its send is seen complete.)"""
    _needs_gloo()
    from codegen.measure import measure_torchrun
    from planner.search import simulate_plan, torchrun_schedule
    from schedules.comm import received_ahead

    _, _, prof = unet_routes
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, microbatches=4, schedule="gpipe",
                         recompute="except_last", target="torchrun")  # fmt: skip
    stages = plan.stages
    grads = [st.state_bytes.grad for st in stages]
    back = [dict(st.grads_back) for st in stages]  # (a captured graph's: known per route)
    ahead = received_ahead(torchrun_schedule(plan), grads, back)
    on = {stages[a.stage].rank for a in ahead}
    assert on == {0} and 0 < max(ahead.values()) < grads[2]  # a part of what stage 2 sends back
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    report = measure_torchrun(plan, f"{__file__}:unet_small", steps=1)
    for d in report.devices:  # (measured exactly: what the plan leaves out would show)
        assert d.memory_error <= 0.001, d
    assert abs(report.devices[0].memory_error) <= 0.001, report.devices[0]


def test_torchrun_counts_activations_where_its_receives_are_posted(unet_routes):
    """Found by measuring a U-Net under torchrun, 1F1B on 2 ranks: the issue order hands
    micro-batch m + 1's activations to the last rank as the first rank's forward ends, before
    the last rank's backward of m; its program posts that receive only after that backward.
    The plan counted them there all the same: 11% over on the last rank. Each chain message is
    now counted where the program holds it (schedules.comm.receive_offsets): the last rank's
    figure drops, and no rank holds more than its plan."""
    _needs_gloo()
    from codegen.measure import measure_torchrun
    from planner.search import simulate_plan, torchrun_schedule
    from schedules.comm import receive_offsets

    _, _, prof = unet_routes
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule="1f1b",
                         recompute="never", target="torchrun")  # fmt: skip
    stages = plan.stages
    held, _ = receive_offsets(torchrun_schedule(plan), [st.state_bytes.input for st in stages],
                              [st.state_bytes.grad for st in stages])  # fmt: skip
    assert {str(a): n for a, n in held.items()} == {
        "1F0": -stages[1].state_bytes.input,
        "1B0": -stages[1].state_bytes.input,
    }
    issue_order = simulate_plan(plan, levels=False, rendezvous=False).peak_memory
    assert plan.devices[1].total < issue_order[1]
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    report = measure_torchrun(plan, f"{__file__}:unet_small", steps=1)
    for d in report.devices:  # to 0.5% (counted where the issue order has them: -0.8%)
        assert abs(d.memory_error) <= 0.005, d


def test_torchrun_counts_a_skip_where_its_receive_and_send_are_posted(unet_routes):
    """Found by measuring a U-Net under torchrun, 1F1B with fewer micro-batches than ranks:
    the last stage takes a skip from the first one as well as its input from the one before.
    The issue order hands micro-batch 1's input to it as those forwards end, and keeps micro-
    batch 0's gradient of the skip there until the first stage's backward; the program
    receives the one only before its forward and lets the other go once its send has gone.
    The plan counted them all the same, and read 13% above the run on the example U-Net's
    last rank (3.7% on this one). Now within 0.5% on every rank."""
    _needs_gloo()
    from codegen.measure import measure_torchrun
    from planner.search import simulate_plan

    _, _, prof = unet_routes
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 4, microbatches=2, schedule="1f1b",
                         recompute="never", target="torchrun")  # fmt: skip
    sb = plan.stages[2].state_bytes
    assert sb.early > 0 and sb.late > 0  # (the skip the last stage takes from the first)
    issue_order = simulate_plan(plan, levels=False, rendezvous=False).peak_memory
    assert plan.devices[2].total < issue_order[2]
    assert [d.total for d in plan.devices] == simulate_plan(plan, levels=False).peak_memory
    report = measure_torchrun(plan, f"{__file__}:unet_small", steps=1)
    for d in report.devices:
        assert abs(d.memory_error) <= 0.005, d


def test_show_gives_each_devices_own_peak_where_its_stages_do_not(unet_routes, run_cli, tmp_path):
    """Found by a red team: `show` listed each stage's figures only, while `check` gates each
    device's, which the torchrun program's messages move (here rank 1 holds less)."""
    _, _, prof = unet_routes
    kw = dict(microbatches=4, schedule="1f1b", recompute="never")
    for target in ("torchrun", "streams"):
        plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, target=target, **kw)
        plan.save(tmp_path / "plan.json")
        r = run_cli("show", tmp_path / "plan.json")
        assert r.code == 0, r.err
        own = [sum(st.memory.total for st in plan.stages if st.rank == k) for k in (0, 1)]
        differs = [d.total for d in plan.devices] != own
        assert differs == (target == "torchrun")
        line = [x for x in r.out.splitlines() if x.startswith("on each device")]
        assert len(line) == differs
        if differs:
            assert f"dev1 {format_size(plan.devices[1].total)} of 1 GiB (0%)" in line[0]


def test_a_split_memory_bound_where_the_program_holds_less_is_not_called_optimal(unet_routes):
    """The split search counts each message where the issue order has it; the torchrun program
    of this U-Net holds one micro-batch's activations less on its last rank. Given just less
    than the unconstrained split needs there, memory binds the search, and a split that fits
    only by the program's own figures may be faster: the plan says so, and is not called
    optimal. The same budget for the streams program, which holds what the search counts, is
    not marked so."""
    from planner.search import HELD_LESS, simulate_plan

    _, _, prof = unet_routes
    kw = dict(microbatches=4, schedule="1f1b", recompute="never")
    free = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, target="torchrun", **kw)
    need = max(simulate_plan(free, levels=False, rendezvous=False).peak_memory)
    tight = plan_pipeline(prof, Cluster.uniform(2, need - 1), 8, target="torchrun", **kw)
    counted = simulate_plan(tight, levels=False, rendezvous=False).peak_memory
    assert any(d.total < n for d, n in zip(tight.devices, counted))
    assert HELD_LESS in tight.solver.unproven and not tight.solver.optimal
    assert HELD_LESS not in free.solver.unproven  # (memory bound nothing there)
    streams = plan_pipeline(prof, Cluster.uniform(2, need - 1), 8, target="streams", **kw)
    assert HELD_LESS not in streams.solver.unproven and streams.solver.optimal


class FarReader(nn.Module):
    """A wide value made first and read twice far down (by the middle and by the end), and the
    input read again at the end: what a routed pipeline sends to several stages."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.mid = nn.ModuleList([nn.Linear(64, 64) for _ in range(n)])
        self.out = nn.Linear(64, 64)
        self.example_input = torch.randn(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        s = torch.tanh(x).repeat(1, 64)
        h = self.a(x)
        for k, m in enumerate(self.mid):
            h = torch.relu(m(h))
            if k == 3:
                h = h + (s * 0.25).view(n, 64, 64).sum(1)
        return self.out(h) + (s * 0.5).view(n, 64, 64).sum(1) + x


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_routed_memory_is_not_under_predicted(schedule):
    """What the allocator hands each device in a real step stays within the plan's prediction
    (the `measure` gate, 5%), with a value sent to two stages and gradients summed from both;
    and the step's gradients equal the model's."""
    from planner.costs import chain_at
    from planner.routing import carried

    torch.manual_seed(0)
    model = FarReader()
    x = model.example_input
    layers = capture(model, x[:2])
    prof = even_times(quick_profile(layers, x[:2], batch_sizes=[2, 4]))  # fmt: skip
    plan = plan_pipeline(prof, Cluster.uniform(4, "1GiB"), 32, microbatches=4, schedule=schedule,
                         recompute="never")  # fmt: skip
    sent = carried(chain_at(prof, plan.microbatch_size).flow, _bounds(plan, prof))
    names = [n for ns in sent.values() for n in ns]
    assert any(names.count(n) > 1 for n in names)  # one value to two stages
    assert "x" in names  # the model's input, read again at the end: sent on, no gradient back
    _assert_step_parity(model, layers, plan, x, torch.randn_like(x), nn.functional.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    report = pipe.measure(torch.randn(32, 64), torch.randn(32, 64), nn.functional.mse_loss,
                          steps=1)  # fmt: skip
    for d in report.devices:
        assert d.measured_peak_bytes <= d.predicted_peak_bytes * 1.05, d
    assert report.ok


def test_show_names_the_routes_past_a_stage(unet_routes, run_cli, tmp_path):
    plan = _plan(unet_routes[2], "1f1b", "never", K=4, M=4)
    path = tmp_path / "plan.json"
    plan.save(path)
    r = run_cli("show", path)
    assert r.code == 0, r.err
    far = ", ".join(f"{a} -> {b}" for a, b in plan.routes if b > a + 1)
    assert f"straight to a later stage: {far}" in r.out and "0 -> 3" in far


class ReadsNothing(nn.Module):
    """A layer that computes from its own parameter alone: with one layer per stage, stage 1
    receives nothing, and what stage 0 makes goes straight to stage 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.pos = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.example_input = torch.randn(8, 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        p = self.pos(torch.ones(4, 8))  # parameters and literals only
        return self.c(self.b(h)) + p


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_stage_that_receives_nothing_runs(schedule):
    model = ReadsNothing()
    x = model.example_input
    layers = capture(model, x)
    assert [layer.unit for layer in layers] == ["a", "pos", "b", "c"]
    assert layers[1].reads == []
    prof = even_times(quick_profile(layers, x, batch_sizes=[2]))
    plan = _plan(prof, schedule, "never", K=4, M=4)
    assert plan.stages[1].input_bytes == 0 and (0, 2) in [tuple(r) for r in plan.routes]
    _assert_step_parity(model, layers, plan, x, torch.randn(8, 4, 8), nn.functional.mse_loss)


def test_zero_bubble_charges_the_calls_a_stage_that_receives_nothing_makes(monkeypatch):
    """A captured graph's stage of one layer that receives nothing needing a gradient makes no
    autograd call at I (nothing asks for one; its W starts from its output's gradient): the
    plan charges each stage the calls the runtime makes, and the stage of `pos` none."""
    import torch.autograd as autograd

    from planner.search import stage_costs

    model = ReadsNothing()
    x = model.example_input
    layers = capture(model, x)
    prof = even_times(quick_profile(layers, x, batch_sizes=[2]))
    plan = _plan(prof, "zb-h1", "never", K=4, M=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    calls, now = {}, [-1]
    engine = autograd._engine_run_backward

    def counted(*args, **kwargs):
        calls[now[0]] = calls.get(now[0], 0) + 1
        return engine(*args, **kwargs)

    monkeypatch.setattr(autograd, "_engine_run_backward", counted)
    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", counted, raising=False)
    runtime = pipe.program
    i_of = runtime.backward_input

    def backward_input(s, m):
        now[0] = s
        try:
            i_of(s, m)
        finally:
            now[0] = -1

    monkeypatch.setattr(runtime, "backward_input", backward_input)
    pipe.train_step(x, torch.randn(8, 4, 8), nn.functional.mse_loss)
    made = [calls.get(s, 0) for s in range(len(plan.stages))]
    assert made == stage_costs(plan.stages).input_calls == [0, 0, 1, 1], (
        made,
        stage_costs(plan.stages).input_calls,
    )


def _timed(prof, k, ms):
    """The profile with layer k's four timings set to `ms`."""
    timed = ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms")
    one = {"median": ms, "min": ms, "max": ms}
    layers = [
        x.model_copy(update={f: {b: dataclasses.replace(t, **one) for b, t in getattr(x, f).items()}
                             for f in timed}) if x.index == k else x
        for x in prof.layers
    ]  # fmt: skip
    return prof.model_copy(update={"layers": layers})


@pytest.mark.parametrize("target", ["streams", "torchrun"])
def test_the_search_bounds_hold_for_a_captured_graph_whose_stages_need_not_wait(target):
    """Brute force over every split: both bounds that prune candidates stay below the time the
    plan predicts, where `pos` (reading only parameters) may run beside the layer before it.
    The torchrun program runs it so: its bounds were above its time (119 of 1 056 splits) when
    they took the stages in chain order; now the devices' loads and the longest way along the
    split's routes bound it there, and its plans say the split is not proven."""
    from planner import search
    from planner.partition import Partition, cut_table, split_cuts

    model = ReadsNothing()
    x = model.example_input
    base = even_times(quick_profile(capture(model, x), x, batch_sizes=[2]))
    checked = 0
    for k, ms in ((0, 0.1), (1, 10.0)):
        prof = _timed(base, k, ms)
        for K in (3, 4):
            cluster = Cluster.uniform(K, "1GiB", latency_ms=0.5)
            problem = search._Problem(prof, cluster, 8, "adam", target=target)
            assert problem.chain_order == (target == "streams")
            L = problem.costs(search.Candidate(1, "gpipe", "never")).num_layers
            for M in (1, 4):
                for schedule in ("gpipe", "1f1b", "zb-h1"):
                    cand = search.Candidate(M, schedule, "never")
                    specs = search._stage_specs(problem, cand)
                    prior = search._prior_bound(problem, cand, [1.0] * K)
                    chain, _ = problem.chain(cand)
                    times = search._balance_times(chain, cand)[0]
                    links = cut_table(search._cut_costs(cluster, cand, chain), L, K)
                    limited = math.isfinite(search._bottleneck_limit(problem, cand, chain, 1.0))
                    for cuts in itertools.combinations(range(1, 4), K - 1):  # (4 layers)
                        part = Partition([0, *cuts, L], 0.0, choices=[0] * K)
                        after = search._lower_bound(problem, cand, [1.0] * K, part)
                        plan = search._build_plan(problem, cand, specs, part, "test")
                        got = plan.predicted.iteration_ms
                        assert prior <= got * (1 + 1e-9), (k, K, M, schedule, cuts, prior, got)
                        assert after <= got * (1 + 1e-9), (k, K, M, schedule, cuts, after, got)
                        if limited:  # the solve's limit: M x the bottleneck is below the bound
                            bounds = part.bounds
                            neck = max([float(times[a:b].sum()) for a, b in part.stages]
                                       + split_cuts(links, bounds))  # fmt: skip
                            assert M * neck <= after * (1 + 1e-12), (K, M, schedule, cuts)
                        if target == "torchrun":
                            assert not plan.solver.optimal
                            assert "side by side" in plan.solver.unproven
                        checked += 1
    assert checked == 2 * (3 + 1) * 2 * 3


def test_no_limit_on_the_bottleneck_where_links_carry_skips_the_bound_does_not_count():
    """Found by a cold review: under torchrun a stage of ReadsNothing waits only for what it
    reads, and its bound leaves the links out (they may carry a skip beside the rest), so M
    times a split's bottleneck, slow links included, was above the bound: the limit on later
    candidates' splits ruled out M = 2 (44.8 ms), and the plan was M = 1 (45.6 ms)."""
    from planner import search

    model = ReadsNothing()
    x = model.example_input
    prof = quick_profile(capture(model, x), x, batch_sizes=[1, 2, 4, 8])
    timed = ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms")
    layers = []
    for layer, fixed, per in zip(prof.layers, [5.0, 5.0, 0.0, 0.5], [0.5, 0.1, 0.1, 1.0]):
        update = {
            f: {n: dataclasses.replace(t, **dict.fromkeys(("median", "min", "max"),
                                                      (fixed + per * n) * (1 + (f == "backward_ms"))))
                for n, t in getattr(layer, f).items()}
            for f in timed
        }  # fmt: skip
        layers.append(layer.model_copy(update=update))
    prof = prof.model_copy(update={"layers": layers})
    cluster = Cluster.uniform(3, "1GiB", bandwidth=1e4)

    def plan(limit: bool):
        with pytest.MonkeyPatch.context() as mp:
            if not limit:
                mp.setattr(search, "_bottleneck_limit", lambda *a: math.inf)
            return plan_pipeline(prof, cluster, 8, target="torchrun")

    a, b = plan(True), plan(False)
    assert b.microbatches == 2 and b.predicted.iteration_ms == pytest.approx(44.8)
    assert (a.microbatches, a.schedule, [s.layers for s in a.stages]) == (
        b.microbatches, b.schedule, [s.layers for s in b.stages]
    )  # fmt: skip
    assert a.predicted.iteration_ms == b.predicted.iteration_ms


def test_a_captured_chain_keeps_its_proof_under_torchrun():
    """A captured graph whose layers only read the layer before (a wrapped Sequential): the
    torchrun program keeps chain order, so the bounds and the split's proof stand."""
    from planner import search

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(8, 8)
    prof = even_times(quick_profile(capture(model, x), x, batch_sizes=[2]))
    assert prof.captured
    problem = search._Problem(prof, Cluster.uniform(2, "1GiB"), 8, "adam", target="torchrun")
    assert problem.chain_order
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule="1f1b",
                         target="torchrun")  # fmt: skip
    assert plan.solver.optimal, plan.solver.unproven


def test_a_captured_graph_makes_its_tensors_on_the_device_its_layer_runs_on():
    """torch.arange(n, device=ids.device) in a model: the capture ran on the CPU, but on a GPU
    the layer must make it there (found by the stream checker: the GPT's position ids stayed
    on the host while its embedding moved to a GPU)."""
    from codegen._streamcheck import StreamCheck
    from profiler.examples import gpt

    model = gpt(vocab=64, d_model=32, heads=2, depth=1, seq_len=8)
    layers = capture(model, model.example_input)
    baked = [
        (layer.unit, n.name) for layer in layers for n in layer.gm.graph.nodes
        if isinstance(n.kwargs.get("device"), torch.device)
    ]  # fmt: skip
    assert baked == []
    with StreamCheck() as check:
        on_gpu = copy.deepcopy(layers).to("cuda:1")
        out = on_gpu(model.example_input.to("cuda:1"))
        assert out.device == torch.device("cuda:1")
    assert check.problems == []
    torch.testing.assert_close(layers(model.example_input), model(model.example_input))


@pytest.mark.parametrize("K", [2, 4])
def test_a_captured_graph_planned_for_torchrun(unet_routes, K):
    """The U-Net's skips go straight to the stages that read them: the torchrun program is
    timed with them (each message between neighbours on its link, a skip free of its own), the
    plan predicts that, and where the program beats the chain-order model the search's bounds
    use, the plan says the search is not proven."""
    from planner.search import simulate_plan

    _, _, prof = unet_routes
    plan = plan_pipeline(prof, Cluster.uniform(K, "1GiB", latency_ms=0.5), 8, microbatches=4,
                         target="torchrun")  # fmt: skip
    assert plan.target == "torchrun" and any(t > s + 1 for s, t in plan.routes)
    timed = simulate_plan(plan)
    free = simulate_plan(plan, rendezvous=False)
    assert plan.predicted.iteration_ms == timed.makespan
    if timed.makespan < free.makespan:
        assert not plan.solver.optimal and "side by side" in plan.solver.unproven
    elif timed.makespan > free.makespan:
        assert not plan.solver.optimal and "wait for each other" in plan.solver.unproven
    assert emit_program(plan, target="torchrun")


def test_skip_gradients_per_start_and_end_equal_the_value_by_value_sum(unet_routes):
    """Flow.passing (the skips a stage sends, with and without its last layer's own output)
    and Flow.unread, against their definitions value by value."""
    from planner.costs import chain_at

    chain = chain_at(unet_routes[2], 2)
    flow = chain.flow
    n = flow.nxt.shape[1] - 1
    values = [v for v in range(len(flow.names)) if flow.grad[v]]

    def skips(i, k):  # made in [i, k - 1), read by an entry >= k
        return sum(int(flow.nbytes[v]) for v in values
                   if i <= flow.born[v] < k - 1 and flow.last[v] >= k)  # fmt: skip

    def envelope(i, k, last):
        return max(skips(i, e) + (int(last[e - 1]) if last is not None else 0)
                   for e in range(i + 1, k + 1))  # fmt: skip

    assert any(skips(i, k) for i in range(n) for k in range(i + 1, n + 1))
    for last in (None, chain.zgrad):
        for i in range(n):
            for k in range(i + 1, n + 1):
                assert flow.passing(i, k, last) == envelope(i, k, last), (i, k)
    u = flow.unread()
    for k in range(1, n + 1):
        for e in range(k):
            handed = [v for v in values if flow.born[v] < e < flow.last[v]]
            want = sum(int(flow.nbytes[v]) for v in handed
                       if not any(e < r < k for r in flow.readers[v]))  # fmt: skip
            assert u[e, k] == want, (e, k)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_unet_holds_no_more_than_its_plan_says(unet_routes, schedule, mode):
    """A U-Net's skips cross stages: every device holds at most what the plan predicts (zero
    bubble's first stage once held each skip's gradient twice from I to W, and the plan counted
    it once), and the plan counts at most 5% more (it counted up to 12% more before it walked
    each stage's layers as autograd does)."""
    model, layers, prof = unet_routes
    plan = _plan(prof, schedule, mode, K=4, M=4)
    assert any(b > a + 1 for a, b in plan.routes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    x = model.example_input
    report = pipe.measure(x, torch.randn_like(x), nn.functional.mse_loss, steps=1)
    for d in report.devices:
        assert d.measured_peak_bytes <= 1.001 * d.predicted_peak_bytes, d  # (a few scalars)
        assert d.predicted_peak_bytes <= 1.05 * d.measured_peak_bytes, d


def test_a_resnet_under_zero_bubble_holds_no_more_than_its_plan_says():
    """Found by a review: on this ResNet split the second device held 1.2% more than its plan.
    The runtime's W went from the stage's first layer to its last, so a layer's output, which
    the next layer saves as its input, outlived the layer's W: W held up to one output more
    than the profile measures for the layer alone (32 KiB here). W now runs from the last
    layer, and the plan walks I, as it does B."""
    torch.manual_seed(0)
    model = resnet(size=16)
    x = model.example_input
    y = torch.randint(0, 10, (x.shape[0],))
    _zero_bubble_holds_its_plan(model, x, y, nn.functional.cross_entropy, devices=3)


def _zero_bubble_holds_its_plan(model: nn.Module, x: Any, y: Any, loss_fn: Any, devices: int):
    """Captured, profiled, planned (zb-h1, M = 4) and run: no device holds more than its plan
    says (a few scalars aside)."""
    layers = capture(model, x)
    prof = even_times(quick_profile(layers, x, batch_sizes=[1, 2, 4]))
    plan = plan_pipeline(prof, Cluster.uniform(devices, "1GiB"), 8, microbatches=4,
                         schedule="zb-h1", recompute="never")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    report = pipe.measure(x, y, loss_fn, steps=1)
    for d in report.devices:
        assert d.measured_peak_bytes <= 1.001 * d.predicted_peak_bytes, d


class _PreNormAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(torch.softmax(q @ k.transpose(1, 2) / 8, -1) @ v)


class _ResidualStream(nn.Module):
    """A pre-norm transformer whose norms, attentions and MLPs are its own children: captured,
    each is a layer, and the residual stream skips over them."""

    def __init__(self, d: int = 32, n: int = 2) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, d), nn.Linear(d, 16)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.attn = nn.ModuleList(_PreNormAttention(d) for _ in range(n))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for ln1, attn, ln2, mlp in zip(self.ln1, self.attn, self.ln2, self.mlp):
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        return self.out(x)


def test_zero_bubbles_input_gradient_on_a_residual_stream_holds_no_more_than_planned():
    """Found by a review: I walked as a chain's (the output gradients of the layers before l - 1
    not made yet while l's runs) is wrong where the residual stream, made before l - 1, is
    read after l: its gradient exists already. The run held 16 KiB (1.1%) more than that plan."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, 16)
    _zero_bubble_holds_its_plan(
        _ResidualStream(), x, torch.randn_like(x), nn.functional.mse_loss, devices=1
    )


def _halves(prof):
    """The profile with every layer's timings 1 ms and its loss's 0: four layers split 2 and 2
    on two devices, whatever the timer read."""
    prof = even_times(prof)
    zero = {"median": 0.0, "min": 0.0, "max": 0.0}
    timed = ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms")
    loss = prof.loss.model_copy(
        update={f: {b: dataclasses.replace(t, **zero) for b, t in getattr(prof.loss, f).items()}
                for f in timed}
    )  # fmt: skip
    return prof.model_copy(update={"loss": loss})


class _ReadTwice(nn.Module):
    """A value (h) that several later layers read, and one that needs no gradient."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, d), nn.Linear(d, d), nn.Linear(d, d)
        self.e, self.f = nn.Linear(d, d), nn.Linear(d, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        m = (x.detach() * 2).relu()
        v = self.c(self.b(h)) + h
        w = self.e(v) * h + m.sum(-1, keepdim=True)
        return self.f(w + h)


def test_zero_bubbles_input_gradient_summed_from_two_readers_holds_no_more_than_planned():
    """Found by a review: where two layers of a stage read one value, I adds their parts into
    a new buffer beside the first, which no layer's own figure sees. The middle stage held
    16 KiB (5.6%) more than its plan under recomputation except the last micro-batch."""
    torch.manual_seed(0)
    model = _ReadTwice()
    x = torch.randn(8, 64, 16)
    layers = capture(model, x)
    prof = even_times(quick_profile(layers, x, batch_sizes=[1, 2, 4]))
    plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, microbatches=4, schedule="zb-h1",
                         recompute="except_last")  # fmt: skip
    assert [st.layers for st in plan.stages] == [(0, 1), (1, 3), (3, 5)]  # h read twice in [1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    middle = pipe.measure(x, torch.randn_like(x), nn.functional.mse_loss, steps=1).devices[1]
    assert middle.measured_peak_bytes <= 1.001 * middle.predicted_peak_bytes, middle


class _Mix(nn.Module):
    def __init__(self, C: int) -> None:
        super().__init__()
        self.c = nn.Conv2d(C + 4, 4, 3, padding=1)

    def forward(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c(torch.cat([h, a], 1)))


class _ReadEach(nn.Module):
    """A wide value (a) that each of three later layers concatenates with the running one."""

    def __init__(self, C: int = 64) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 4, 3, padding=1)
        self.m = nn.ModuleList([_Mix(C) for _ in range(3)])
        self.o = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        h = self.b(a)
        for m in self.m:
            h = m(h, a)
        return self.o(h)


def _forced_plans(
    model: nn.Module, x: torch.Tensor, split: Sequence[int], *candidates: tuple[str, str]
) -> list:
    """`model`'s plans on `split` (built as the search builds a split of its own), one per
    (schedule, recompute), 4 micro-batches of the mse loss; profiled on one thread at a
    quarter, a half and the whole of x's batch, as the sweeps that found what these tests
    hold ran."""
    from planner import search
    from planner.partition import Partition

    n = x.shape[0]
    prof = quick_profile(model, x, batch_sizes=[n // 4, n // 2, n], loss_fn="mse", threads=1)
    prof = even_times(prof)
    cluster = Cluster.uniform(len(split) - 1, "1GiB")
    problem = search._Problem(prof, cluster, n, "momentum", (prof.digest(), cluster.digest()))
    plans = []
    for schedule, recompute in candidates:
        cand = search.Candidate(4, schedule, recompute)
        specs = search._stage_specs(problem, cand)
        plans.append(search._build_plan(problem, cand, specs, Partition(list(split), 0.0), "test"))
    return plans


def _read_each_plans(
    *candidates: tuple[str, str], split: tuple[int, ...] = (0, 1, 2, 5, 7)
) -> tuple[nn.Module, Any, Any, list]:
    """_ReadEach, its data, and its plans on a split (default: the three readers in stage 2),
    one per (schedule, recompute): _forced_plans."""
    torch.manual_seed(0)
    model = _ReadEach()
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    return model, x, y, _forced_plans(model, x, split, *candidates)


def _measured_over(model: nn.Module, plan: Any, x: Any, y: Any, patch: Any = None) -> list[int]:
    """Each device's measured peak less its predicted one (`patch`: run on the program first),
    on one thread."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)
    if patch is not None:
        patch(pipe._module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = pipe.measure(x, y, nn.MSELoss(), steps=1)
    finally:
        torch.set_num_threads(threads)
    return [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]


@pytest.mark.parametrize("owned", [True, False])
def test_zero_bubble_keeps_a_layers_output_gradient_in_its_own_memory(owned):
    """Found by a review: the gradient of a layer's output that the next layer concatenates
    is a slice of the concatenation's gradient. Zero bubble's I asked autograd for it and kept
    it for W, and with it the whole buffer, through I (autograd holds what it returns) and on
    to W: the stage of the three readers ran 27.7% over its plan at 128 channels. The later
    layers now read each kept output through `_Owned`, whose backward copies a slice out."""

    def as_it_was(module: Any) -> None:  # the slice kept as autograd hands it over
        module._own_memory = lambda g: g

    model, x, y, (plan,) = _read_each_plans(("zb-h1", "never"))
    over = _measured_over(model, plan, x, y, None if owned else as_it_was)
    if owned:
        assert all(o <= 64 for o in over) and over[2] == 0, over
    else:
        assert over[2] >= 4 * 64 * 16 * 16 * 4, over  # four of a's slices at least


class _PosTwice(nn.Module):
    """A learned table added after each of two layers: one parameter two layers use."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16, 16) * 0.1)
        self.l1, self.l2, self.h = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h(torch.relu(self.l2(torch.relu(self.l1(x) + self.pos)) + self.pos))


@pytest.mark.parametrize("measured", [True, False])
def test_zero_bubbles_i_through_a_first_layer_to_a_parameter_two_layers_share(
    monkeypatch, measured
):
    """Found by a red team: zero bubble's I takes the gradient of a parameter two layers of a
    stage use, through both. The stage's first layer, whose input needs no gradient, had its
    I measured as nothing: its way to the parameter (its ReLU's gradient) ran one parameter's
    bytes (16 KiB at 64 x 64, 4.2%) over the plan. The profile now measures I towards such a
    parameter too."""
    from planner.memory import MemoryModel
    from profiler import measure

    if not measured:  # as it was: no parameter is another layer's too
        monkeypatch.setattr(measure, "_shared_ids", lambda layers: frozenset())
        # (and W without what the next layer shares, which counts more than W holds here and
        # would cover I's peak: test_zero_bubbles_w_counts_what_the_next_layer_keeps_...)
        monkeypatch.setattr(MemoryModel, "_weight_shared", property(lambda m: m._weight_live))
    torch.manual_seed(0)
    model = _PosTwice()
    x, y = torch.randn(8, 16, 16), torch.randn(8, 16, 16)
    (plan,) = _forced_plans(model, x, [0, 2, 4], ("zb-h1", "never"))
    over = _measured_over(model, plan, x, y)
    if measured:
        assert all(o <= 64 for o in over), over
    else:
        assert over[0] >= 16 * 16 * 4, over  # the parameter's part: not in the figure


class _PosThrice(nn.Module):
    """A learned table added after each of three layers."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16, 16) * 0.1)
        self.l = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.h = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.l:
            x = torch.relu(layer(x) + self.pos)
        return self.h(x)


@pytest.mark.parametrize(
    "first,uses", [(True, 2), (False, 2), (True, 3)], ids=["twice", "control", "thrice"]
)
def test_a_tied_copys_gradient_made_before_its_layers_peak_is_counted_there(
    monkeypatch, first, uses
):
    """Found by a sweep of a red team's models: a stage whose first layer adds a table another
    stage's layer adds too (its copy of the table) makes the copy's gradient first in its
    first backward, and keeps it through the layer's peak; the plan counted it from the
    backward's end (as a head's, made at its peak): one table's bytes, 4-6%, over the plan
    under GPipe and 1F1B. The profile measures what keeping it adds to the layer's peak
    (Chain.tied_first), and the first backward counts it there. With three uses, the middle
    stage's (a review found the figure lost there to a loop's name: 4 KiB, 5%, over)."""
    from planner import search

    if not first:  # as it was: from the backward's end
        monkeypatch.setattr(search, "_first_extra", lambda chain, i: 0)
    torch.manual_seed(0)
    model = _PosTwice() if uses == 2 else _PosThrice()
    x, y = torch.randn(8, 16, 16), torch.randn(8, 16, 16)
    (plan,) = _forced_plans(model, x, [0, 1, 2, uses + 2], ("1f1b", "never"))
    over = _measured_over(model, plan, x, y)
    if first:
        assert all(o <= 64 for o in over), over
    else:
        assert over[1] >= 16 * 16 * 4, over  # the table's gradient


class _Attention(nn.Module):
    """A normalised input, multi-head attention over it, and the input added back."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.ln, self.qkv = nn.LayerNorm(c), nn.Linear(c, 3 * c)
        self.proj, self.head, self.c = nn.Linear(c, c), nn.Linear(c, c), c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(self.c, dim=-1)
        q = q.reshape(b, t, 4, c // 4).permute(0, 2, 1, 3)
        k = k.reshape(b, t, 4, c // 4).permute(0, 2, 3, 1)
        v = v.reshape(b, t, 4, c // 4).permute(0, 2, 1, 3)
        a = (torch.softmax(q @ k * 0.35, -1) @ v).permute(0, 2, 1, 3).flatten(2)
        return self.head(self.proj(a) + x)


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_zero_bubbles_i_figure_takes_off_only_the_gradients_it_makes(recompute):
    """Found by a red team: a captured layer that takes the model's input along for a later
    residual (here, the attention's) makes no gradient for it, yet its I figure took that
    input's bytes off as a gradient it keeps: the first stage ran 4 KiB (3.6-4.7%) over its
    plan under zero bubble."""
    torch.manual_seed(0)
    model = _Attention()
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    (plan,) = _forced_plans(model, x, [0, 2, 5], ("zb-h1", recompute))
    over = _measured_over(model, plan, x, y)
    assert all(o <= 64 for o in over), over


class _ConvPool(nn.Module):
    """A convolution and its ReLU captured as one layer, a max pool after it, and more."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(2)
        self.c2, self.up = nn.Conv2d(8, 8, 3, padding=1), nn.Upsample(scale_factor=2)
        self.c3, self.h = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        u = self.up(torch.relu(self.c2(self.pool(a))))
        return self.h(self.c3(u).mean((2, 3)))


@pytest.mark.parametrize("shared", [True, False])
def test_zero_bubbles_w_counts_what_the_next_layer_keeps_of_a_layers_saved(monkeypatch, shared):
    """Found by a red team: a layer's W figure was measured on the layer alone, whose W lets
    its saved tensors go as it runs (the ReLU's output here); in the stage the max pool after
    it saves that output too and keeps it in the graph W holds: the first stage ran the ReLU
    output's bytes (16-21%) over its plan under zero bubble. W now counts what the next layer
    of the stage shares of a layer's saved tensors (MemoryModel._weight_shared)."""
    from planner.memory import MemoryModel

    if not shared:  # as it was: each layer's figure alone
        monkeypatch.setattr(MemoryModel, "_weight_shared", property(lambda m: m._weight_live))
    torch.manual_seed(0)
    model = _ConvPool()
    x, y = torch.randn(8, 3, 16, 16), torch.randn(8, 10)
    (plan,) = _forced_plans(model, x, [0, 2, 7], ("zb-h1", "never"))
    over = _measured_over(model, plan, x, y)
    if shared:
        assert all(o <= 64 for o in over), over
    else:
        assert over[0] >= 2 * 8 * 16 * 16 * 4, over  # the ReLU output of one micro-batch


class _BranchOffWeights(nn.Module):
    """A Linear beside a branch without weights that saves the input (x * x): zero bubble's W
    reaches the Linear's weight without running the branch, whose graph keeps the input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.l = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + x * x


def _w_holds_input_model(branch: bool) -> nn.Sequential:
    """Linear-ReLU layers, the second a _BranchOffWeights (or one more Linear-ReLU)."""
    torch.manual_seed(0)

    def lin_relu() -> nn.Sequential:
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU())

    middle = _BranchOffWeights(256) if branch else lin_relu()
    return nn.Sequential(lin_relu(), middle, lin_relu(), nn.Linear(256, 256))


def test_the_profile_says_whether_a_layers_w_lets_its_input_go():
    """A layer's zero-bubble W lets go what its graph saved of its input where every node
    that saved it lies on a way to a weight: not a branch without weights, nor a layer without
    weights, nor the loss."""
    x = torch.randn(8, 256)
    for branch, frees in ((False, [True, True, True, True]), (True, [True, False, True, True])):
        prof = quick_profile(_w_holds_input_model(branch), x, batch_sizes=[2, 4], loss_fn="mse")
        assert [layer.weight_grad_frees_input for layer in prof.layers] == frees
        assert prof.loss is not None and prof.loss.weight_grad_frees_input is False
    prof = quick_profile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
                         torch.randn(4, 8), batch_sizes=[2, 4], loss_fn="mse")  # fmt: skip
    assert [layer.weight_grad_frees_input for layer in prof.layers] == [True, False, True]


@pytest.mark.parametrize("rule", ["profiled", "trains"])
def test_zero_bubbles_w_counts_what_a_branch_off_the_weights_keeps(monkeypatch, rule):
    """W runs from the stage's last layer; a layer that trains lets its graph go as its W
    runs, so what it saved of the layer before's output is gone before that layer's W, except
    what a node off every way to a weight saved (x * x beside a Linear): that stays until the
    stage's W ends. Taken as gone wherever the next layer trains, the first device of two ran
    one micro-batch's ReLU output (16 KiB) over its plan; the profile says which layers keep
    it (`weight_grad_frees_input`), and the plan counts it there."""
    from planner.costs import Chain

    if rule == "trains":  # every layer that trains taken to let its input go
        monkeypatch.setattr(Chain, "keeps_graph_through_w", property(lambda c: c.kept_grad == 0))
    model = _w_holds_input_model(branch=True)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    (plan,) = _forced_plans(model, x, [0, 2, 4], ("zb-h1", "never"))
    over = _measured_over(model, plan, x, y)
    if rule == "profiled":
        assert all(o <= 64 for o in over), over
    else:
        assert over[0] >= 16 * 256 * 4, over


class _Wide(nn.Module):
    """Two Linears through a wide hidden layer: a large weight gradient, so that W is its
    stage's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 2048), nn.Linear(2048, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _MakesH(nn.Module):
    """(l(x), h): h = tanh(l2(x)), 512 wide, saved by its tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(64, 64), nn.Linear(64, 512)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.l(x), torch.tanh(self.l2(x))


class _UsesH(nn.Module):
    """(l(a) * h[:, :64], h): saves a view of h and hands h on."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, h = t
        return self.l(a) * h[:, :64], h


class _JoinsH(nn.Module):
    """a * h[:, 64:128]: no weights, so its graph (and h) stays through the stage's W."""

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, h = t
        return a * h[:, 64:128]


@pytest.mark.parametrize("passes", [True, False])
def test_zero_bubbles_w_walk_keeps_what_a_layer_handed_on_holds(monkeypatch, passes):
    """Found by a red team: W's walk took h, which a layer makes and saves, as let go at that
    layer's W because the next layer runs a W of its own; but the next layer hands h on, and
    the weightless layer after it saves a view of h and keeps its graph to the stage's W's
    end. The first device of two ran 6 KiB over its plan. No layer lets anything go in the
    walk now where the layer after it hands a value on (Chain.passes)."""
    from planner.costs import Chain

    if not passes:  # as it was: handed-on values not looked at
        walk = Chain.w_freed.fget
        monkeypatch.setattr(
            Chain, "w_freed", property(lambda c: walk(dataclasses.replace(c, passes=None)))
        )
    torch.manual_seed(0)
    model = nn.Sequential(_Wide(), nn.Linear(64, 64), _MakesH(), _UsesH(), _JoinsH(),
                          nn.Linear(64, 64))  # fmt: skip
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    (plan,) = _forced_plans(model, x, [0, 5, 7], ("zb-h1", "never"))
    over = _measured_over(model, plan, x, y)
    if passes:
        assert all(o <= 64 for o in over), over
    else:
        assert over[0] >= 4096, over


class _MakesWideH(_MakesH):
    """_MakesH with h 16 384 wide (256 KiB a micro-batch of 4): tanh(h)'s gradient is then
    the largest tensor its W makes but the weight's."""

    def __init__(self) -> None:
        super().__init__()
        self.l2 = nn.Linear(64, 16384)


@pytest.mark.parametrize("counted", [True, False])
@pytest.mark.parametrize("split", [[0, 2, 7], [0, 5, 7]])
def test_zero_bubbles_w_counts_what_a_layer_handed_on_keeps_of_the_layer_before(
    monkeypatch, counted, split
):
    """Found by a red team: the layer making h saves its tanh's output; the next layer hands h
    on, and the weightless layer after that saves a view of it and keeps its graph to the
    stage's W's end. The profile measured the maker's W alone, where the tanh's saved output
    went as its backward ran, before the Linear under it made its gradient; in the stage it
    is still held, and the device ran that output's bytes (256 KiB, 1.2-1.4%) over its plan,
    on either side of the cut (the maker first or in the middle of its stage)."""
    from planner.memory import MemoryModel

    if not counted:  # as it was: only a next layer that keeps its own graph was looked at
        monkeypatch.setattr(MemoryModel, "_weight_passed", None)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    (plan,) = _forced_plans(_wide_h_model(), x, split, ("zb-h1", "never"))
    over = _measured_over(_wide_h_model(), plan, x, y)
    if counted:
        assert all(o <= 64 for o in over), over
    else:
        assert max(over) >= 200_000, over


def _wide_h_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Wide(), nn.Linear(64, 64), _MakesWideH(), _UsesH(), _JoinsH(),
                         nn.Linear(64, 64))  # fmt: skip


@pytest.mark.parametrize(
    "schedule, in_place", [("gpipe", True), ("1f1b", True), ("zb-h1", True), ("1f1b", False)]
)
def test_a_stage_that_reads_a_value_and_hands_it_on_adds_its_gradient_in_place(schedule, in_place):
    """Found by a red team: a stage of one layer that reads h (a view of it, saved) and hands
    it on. Its input's gradient is the part the layer's backward makes plus the one pulled for
    the h it handed on, which the runtime summed into a third tensor of h's size beside the
    two: the device ran 15-18% over its plan under every schedule. It adds the pulled one
    into the made one now, which no other tensor shares."""

    def as_it_was(module: Any) -> None:
        module._summed = lambda into, g, others: g if into is None else into + g

    x, y = torch.randn(16, 64), torch.randn(16, 64)
    (plan,) = _forced_plans(_wide_h_model(), x, [0, 3, 4, 7], (schedule, "never"))
    model = _wide_h_model()
    over = _measured_over(model, plan, x, y, None if in_place else as_it_was)
    if in_place:
        assert all(o <= 64 for o in over), over
    else:
        assert over[1] >= 200_000, over


class _Pair(nn.Module):
    """(x, tanh(x))."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.tanh(x)


class _SumsAndHands(nn.Module):
    """(a + h, h): autograd hands back one gradient for both a and h."""

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, h = t
        return a + h, h


class _SumOfHands(nn.Module):
    """(a + h.sum(1), h): h's gradient made here is expanded (one element, many times)."""

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, h = t
        return a + h.sum(1, keepdim=True), h


class _Times(nn.Module):
    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return t[0] * t[1]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("guarded", [True, False])
def test_a_handed_on_gradient_is_added_into_no_gradient_another_input_shares(schedule, guarded):
    """The pulled gradient of a value a stage hands on (here a stage of one layer, which
    returns its input h beside a + h) is added in place into the one the stage's backward made
    for h; but autograd hands x + y's one gradient back to both x and y, and adding into it
    gave a the pulled part too: a wrong gradient (zero bubble's I, which asks autograd.grad).
    It is added only into a gradient no other tensor shares."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Pair(), _SumsAndHands(), _Times(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    (plan,) = _forced_plans(model, x, [0, 2, 3, 6], (schedule, "never"))
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)
    if not guarded:  # as a first version had it: whatever shares its memory
        pipe._module._shares = lambda t, others: False
    pipe.train_step(x, y, nn.MSELoss())
    _reference_step(ref, x, y, nn.MSELoss(), plan.microbatches)
    same = [
        torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters())
    ]
    if guarded or schedule != "zb-h1":  # (backward's .grad: autograd's own for each input)
        assert all(same), same
    else:
        assert not all(same), same


def test_a_handed_on_gradient_is_not_added_into_an_expanded_one():
    """Found by a red team: where the stage's layer reads h through a sum, the gradient
    autograd makes for h is expanded (one element stands for a row), and adding the pulled
    part into it in place failed zero bubble's I ("more than one element of the written-to
    tensor refers to a single memory location"). It is added into a new tensor there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Pair(), _SumOfHands(), _Times(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    (plan,) = _forced_plans(model, x, [0, 2, 3, 6], ("zb-h1", "never"))
    _assert_step_parity(model, model, plan, x, y, nn.MSELoss())


class _TransposedLinear(nn.Module):
    """A Linear over the last two dimensions swapped: the gradient it hands back is laid out
    transposed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.l = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x.transpose(1, 2))


def _unflatten_then_transposed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.Tanh(), nn.Unflatten(1, (8, 8)), _TransposedLinear(8), nn.Tanh(),
        nn.Flatten(), nn.Linear(64, 64),
    )  # fmt: skip


@pytest.mark.parametrize("measured", [True, False])
def test_zero_bubbles_i_counts_a_reshape_of_a_transposed_gradient(monkeypatch, measured):
    """Found by a red team: an unflatten's input gradient is a view of its output's where that
    gradient is dense, but the Linear over a transpose after it hands back a transposed one,
    which the reshape copies. Taken for a view from the dense gradient alone, zero bubble's I
    on the stage [tanh, unflatten] ran that copy (one micro-batch's gradient, 1 KiB, 12.5%)
    over its plan. The profile measures the view from every layout the layer is given
    (`input_grad_is_view`), and the unflatten is no view there."""
    from planner.costs import Chain

    if not measured:  # as it was: a view wherever the dense gradient's backward made one
        heuristic = Chain.grad_views.fget

        def as_it_was(c: Chain) -> np.ndarray:
            return heuristic(dataclasses.replace(c, grad_is_view=None))

        monkeypatch.setattr(Chain, "grad_views", property(as_it_was))
    model = _unflatten_then_transposed()
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    prof = quick_profile(model, x, batch_sizes=[4, 8, 16], loss_fn="mse", threads=1)
    assert [layer.input_grad_is_view for layer in prof.layers] == [
        False, False, False, False, False, True, False
    ]  # fmt: skip
    (plan,) = _forced_plans(model, x, [0, 1, 3, 8], ("zb-h1", "never"))
    over = _measured_over(model, plan, x, y)
    if measured:
        assert all(o <= 64 for o in over), over
    else:
        assert over[1] >= 4 * 64 * 4, over


class _Transposed(nn.Module):
    """A Linear over the first two dimensions swapped (as nn.MultiheadAttention's batch_first
    path does)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.l(h.transpose(0, 1)).transpose(0, 1)


class _TransposedSkip(nn.Module):
    """A value read by a layer through a transpose and added back two layers later."""

    def __init__(self) -> None:
        super().__init__()
        self.i, self.a = nn.Linear(32, 32), _Transposed()
        self.o, self.h = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.i(x)
        return self.h(self.o(self.a(h)) + h)


def test_a_gradient_summed_from_two_stages_is_laid_out_densely():
    """Found by a red team: a value two later stages read, one through a transpose, gets its
    gradient as the sum of two parts, which the runtime laid out as the first (transposed);
    zero bubble's W then copied it dense again: one gradient (19.5%) over the first stage's
    plan. The sum is dense now, as the plan's figures take a received gradient."""
    torch.manual_seed(0)
    model = _TransposedSkip()
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    (plan,) = _forced_plans(model, x, [0, 1, 2, 5], ("zb-h1", "never"))
    assert all(o <= 64 for o in _measured_over(model, plan, x, y))


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


@pytest.mark.parametrize("recompute", ["except_last", "always"])
def test_zero_bubble_recomputes_a_stage_of_views_alone(recompute):
    """Found by a red team: zero bubble re-materialising a stage at I runs its forward first
    without a graph; a stage of one transpose then hands back a view of its input that needs
    a gradient and has no node, and asking for its gradient edge failed the step. Now it runs,
    with the un-pipelined model's gradients, and holds what its plan says."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Transpose(), nn.Linear(16, 16))
    x, y = torch.randn(8, 16, 32), torch.randn(8, 32, 16)
    (plan,) = _forced_plans(model, x, [0, 1, 2, 4], ("zb-h1", recompute))
    assert [st.layers for st in plan.stages] == [(0, 1), (1, 2), (2, 3)]  # (the loss: in 2)
    _assert_step_parity(model, model, plan, x, y, nn.functional.mse_loss)
    over = _measured_over(copy.deepcopy(model), plan, x, y)
    assert all(o <= 64 for o in over), over


def test_zero_bubble_reads_through_owned_after_its_first_step_only_where_a_slice_came():
    """`_Owned` costs an autograd node each way on every layer input (a step of a 16-layer
    MLP of tiny layers took 1.26x as long). The first step reads every input through one and
    notes where its gradient came as a slice of a larger one; later steps only there: on the
    readers model, the three layers that concatenate, and nowhere on an MLP. Memory after the
    first step is what the plan says (`measure` runs a warm-up step first: the tests above
    measure the second)."""
    from profiler.examples import mlp

    model, x, y, (plan,) = _read_each_plans(("zb-h1", "never"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = compile_pipe(model, plan).program
    assert program.sliced is None
    program.train_step(x, y, nn.MSELoss())
    assert {k for k, _ in program.sliced} == {2, 3, 4}, program.sliced
    program.train_step(x, y, nn.MSELoss())  # (runs with the selection)
    # a first step with all but the last layer frozen sees no slice; unfrozen, the layers are
    # watched again (a review's: the selection of the frozen step held 19.8% over the plan)
    sliced = program.sliced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("o."))
        pipe.program.train_step(x, y, nn.MSELoss())
        assert pipe.program.sliced == frozenset()
        for p in model.parameters():
            p.requires_grad_(True)
    over = pipe.measure(x, y, nn.MSELoss(), steps=2).devices
    assert pipe.program.sliced == sliced
    assert all(d.measured_peak_bytes <= d.predicted_peak_bytes + 64 for d in over), over

    net = mlp(width=16, depth=4, batch=8)
    prof = quick_profile(net, net.example_input, batch_sizes=[2, 4], loss_fn="cross_entropy")
    plan = plan_pipeline(
        prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4, schedule="zb-h1", recompute="never"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = compile_pipe(net, plan).program
    program.train_step(net.example_input, torch.randint(0, 10, (8,)), nn.functional.cross_entropy)
    assert program.sliced == frozenset()


@pytest.mark.parametrize("tight", [True, False])
def test_a_captured_stage_that_never_recomputes_counts_bs_own_transient(monkeypatch, tight):
    """Found by a benchmark: a captured graph's B was counted with the larger of its own
    transient and its forward's, re-materialising or not, so that its pulled gradient grew
    with the stage's end for both. The first stage (one convolution whose 64 channels three
    later layers read) was planned 57 KiB over its 1F1B run, never recomputing (48% more than
    it held). Where no B re-materialises, the plan now counts B's own transient, its pulled
    gradient raised with that alone (MemoryModel._flow_pulled(tight=True))."""
    from planner.memory import MemoryModel

    if not tight:  # as it was: every captured graph's shape counts the larger of the two
        monkeypatch.setattr(MemoryModel, "_pulled_key", lambda self, shape: "pulled")
    model, x, y, plans = _read_each_plans(("1f1b", "never"), ("1f1b", "always"))
    over = dict(zip(("never", "always"), (_measured_over(model, p, x, y) for p in plans)))
    assert all(o <= 64 for got in over.values() for o in got), over  # never under
    if tight:
        assert abs(over["never"][0]) <= 64, over
    else:
        assert over["never"][0] <= -32 * 1024, over


@pytest.mark.parametrize("whole", [True, False])
def test_a_layer_whose_output_gradient_is_a_slice_keeps_the_whole_gradient(monkeypatch, whole):
    """Found by a review: the first stage [0, 3) makes a, runs b on it and the first reader,
    which concatenates b's output with a. The reader's backward hands b a slice of the
    concatenation's gradient, and the slice keeps all of it alive while b's backward runs; the
    profile seeded b's inner figure with a tensor only as large as the slice's own span, and
    the stage ran 15 360 bytes (2.4%) over its plan under 1F1B at 32 channels. The profile now
    seeds it as a slice of a storage as large as the one it keeps (measure._Layout.whole)."""
    from profiler import measure

    if not whole:  # as it was: the slice's own span
        monkeypatch.setattr(measure._Layout, "whole", measure._Layout.ones)
    model, x, y, (plan,) = _read_each_plans(("1f1b", "never"), split=(0, 3, 7))
    over = _measured_over(model, plan, x, y)
    if whole:
        assert all(o <= 64 for o in over) and abs(over[0]) <= 64, over
    else:
        assert over[0] >= 16 * 1024, over


class _ConvSkip(nn.Module):
    """A convolution's output read by the next one and kept for later: concatenated at the end
    (`twice` False), or added before each of the two layers after the next (True)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)  # fmt: skip
        self.c4 = nn.Conv2d(8 if twice else 16, 3, 1)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.c1(x)
        if self.twice:
            return self.c4(self.c3(self.c2(x1) + x1) + x1)
        return self.c4(torch.cat([self.c3(self.c2(x1)), x1], dim=1))


@pytest.mark.parametrize("twice", [False, True])
def test_zero_bubbles_input_gradient_of_a_layer_that_reads_and_hands_on_a_skip_is_measured(twice):
    """Found by a sweep: a layer that reads a value and also hands it on (c2 here: x1 goes on
    to the concatenation) had its I (input gradient) left unmeasured, 0, so zero bubble's
    first stage held 42% more than its plan (245 056 bytes against 172 640), and `check`
    passed it. The profile now measures it. The sum of the value's gradient parts stays
    counted on top of the layers' peaks: where x1's later readers are two (`twice`), the sum
    is alive while an earlier layer's I works, and counting it beside them instead was 10%
    under (a review's); with one later reader that is 13% over, the safe side."""
    torch.manual_seed(0)
    model = _ConvSkip(twice)
    x = torch.randn(4, 3, 16, 16)
    layers = capture(model, x)
    prof = quick_profile(layers, x, batch_sizes=[1, 2, 4], loss_fn="mse", threads=1)
    reader = prof.layers[1]  # c2, which reads x1 and hands it on
    assert reader.input_grad_transient_bytes[4] > 0
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 4, microbatches=1, schedule="zb-h1",
                         recompute="never", optimizer="sgd")  # fmt: skip
    assert [st.layers for st in plan.stages][0] == (0, 2)  # c1 and c2: x1 made, read, sent
    for d in measured_step(layers, plan, model).devices:
        assert d.measured_peak_bytes <= d.predicted_peak_bytes + 64, d  # (a few scalars)
        # (13% on the machine it was found on; 16% on an AVX2-only one, its kernels' memory)
        assert d.measured_peak_bytes >= 0.8 * d.predicted_peak_bytes, d


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_gradient_received_for_a_value_the_stage_reads_is_summed_into_a_new_tensor(
    schedule, twice
):
    """Found by a review: the first stage makes x1, reads it (c2) and sends it on; in B its
    gradient arrives from the next stage, which the runtime holds, so autograd makes the sum
    with c2's part as a new tensor. GPipe and 1F1B ran one x1 over the plan (10.5%); `check`
    passed it. The profile now measures what the sum adds to c2's backward."""
    torch.manual_seed(0)
    model = _ConvSkip(twice)
    x = torch.randn(4, 3, 16, 16)
    layers = capture(model, x)
    prof = _halves(quick_profile(layers, x, batch_sizes=[1, 2, 4], loss_fn="mse", threads=1))
    if twice:  # c2's sum comes after its backward's peak (where it adds to the peak)
        assert prof.layers[1].passed_sum_bytes[4] > 0
    assert prof.layers[0].passed_sum_bytes[4] == 0  # (c1 hands nothing on)
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 4, microbatches=2, schedule=schedule,
                         recompute="never", optimizer="sgd")  # fmt: skip
    assert [st.layers for st in plan.stages][0] == (0, 2)
    first = measured_step(layers, plan, model).devices[0]
    assert first.measured_peak_bytes <= first.predicted_peak_bytes + 64, first
    assert first.measured_peak_bytes >= 0.9 * first.predicted_peak_bytes, first
    # a profile made before the sum was measured: the value's whole gradient, never under
    older = prof.model_copy(
        update={"layers": [x.model_copy(update={"passed_sum_bytes": None}) for x in prof.layers]}
    )
    again = plan_pipeline(older, Cluster.uniform(2, "1GiB"), 4, microbatches=2,
                          schedule=schedule, recompute="never", optimizer="sgd")  # fmt: skip
    assert again.stages[0].layers == (0, 2)
    assert again.devices[0].total >= first.measured_peak_bytes - 64


class _NextAndAfter(nn.Module):
    """x1 read by the next layer and by the one after, added (`cat` False) or concatenated
    (True: the later reader's part of x1's gradient is a slice of its output's gradient)."""

    def __init__(self, cat: bool) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(16 if cat else 8, 8, 3, padding=1)
        self.c4 = nn.Conv2d(16 if cat else 8, 3, 1)
        self.cat = cat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = torch.relu(self.c1(x))
        a = torch.relu(self.c2(x1))
        if self.cat:
            b = torch.relu(self.c3(torch.cat([a, x1], 1)))
            return self.c4(torch.cat([b, x1], 1))
        return self.c4(torch.relu(self.c3(a + x1)) + x1)


@pytest.mark.parametrize("cat", [False, True])
def test_an_inner_layers_backward_holds_no_output_gradient_autograd_has_let_go(cat):
    """A layer's backward was counted with its output's gradient alive to its end, as the
    profile held it; inside a stage the next layer's backward makes it, and autograd lets it
    go once the nodes that read it have run, before the peak of a convolution's backward. The
    last stage held one gradient (11%) less than its plan said (found by a helper's trace of
    the run). Now exact; where the layer's part of a value's gradient waits for an earlier
    reader's in the same stage, as a slice of that gradient (`cat`, one device), the whole
    figure still counts."""
    torch.manual_seed(0)
    model = _NextAndAfter(cat)
    x = torch.randn(4, 3, 16, 16)
    layers = capture(model, x)
    prof = _halves(quick_profile(layers, x, batch_sizes=[1, 2, 4], loss_fn="mse", threads=1))
    inner = [x.inner_backward_transient_bytes[4] for x in prof.layers]
    assert inner[2] < prof.layers[2].backward_transient_bytes[4]  # (c3)
    for k in (2, 1):
        plan = plan_pipeline(prof, Cluster.uniform(k, "1GiB"), 4, microbatches=1,
                             schedule="gpipe", recompute="never", optimizer="sgd")  # fmt: skip
        last = measured_step(layers, plan, model).devices[-1]
        assert last.measured_peak_bytes <= last.predicted_peak_bytes + 64, last
        if k == 2:
            assert plan.stages[-1].layers == (2, 4)
            assert last.measured_peak_bytes >= last.predicted_peak_bytes - 64, last


def test_a_smaller_micro_batch_is_counted_with_the_working_memory_its_profile_measured():
    """Found by a red team: on a CPU a convolution may take more working memory at one sample
    than at two (the profile measures both), and a U-Net's 3 samples in 2 micro-batches (2, 1)
    ran up to 32% over a plan that counted the smaller one's at most the larger's; `check`
    passed it. The smaller micro-batch's transients are now counted as measured: no device
    holds more than its plan says (a few scalars aside)."""

    model = unet()
    layers = capture(model, model.example_input)
    prof = quick_profile(layers, model.example_input, batch_sizes=[1, 2], model_spec="example:unet")  # fmt: skip
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 3, microbatches=2, schedule="gpipe",
                         recompute="never")  # fmt: skip
    assert all(st.state_bytes_rest is not None for st in plan.stages)
    report = measured_step(layers, plan, model)
    for d in report.devices:
        assert d.measured_peak_bytes <= 1.001 * d.predicted_peak_bytes, d


def test_a_gradient_sent_back_holds_no_more_than_its_own_bytes():
    """Found by a red team: a U-Net stage from layer 19 on reads skips from the first stage
    through cats, whose backward narrows their output gradients. At one sample each slice is
    contiguous, so the stage's input kept it as a view of the whole buffer until the first
    stage pulled it: the last device held 3% more than its plan (41 044 bytes here; more than
    its budget where `check` passed). The runtime now leaves gradients of their own size."""
    report, _ = _unet_measured_on(size=1, microbatches=5, cuts=[8, 19])
    for d in report.devices:
        assert d.measured_peak_bytes <= d.predicted_peak_bytes + 256, d  # (a few scalars)


def _unet_measured_on(size: int, microbatches: int, cuts: list[int]) -> tuple[Any, Any]:
    """example:unet profiled at `size` samples, its streams program under 1F1B on 3 devices
    with the stages cut at `cuts` (whatever the search would choose), measured: the report and
    the memory model of the split."""
    import planner.search as search
    from planner.partition import Partition

    model = unet()
    layers = capture(model, model.example_input)
    prof = quick_profile(layers, model.example_input, batch_sizes=[size], model_spec="example:unet")
    problem = search._Problem(prof, Cluster.uniform(3, "1GiB"), size * microbatches, "adam",
                              ("", ""), "streams", ())  # fmt: skip
    cand = search.Candidate(microbatches, "1f1b", "never")
    chain, memory = problem.chain(cand)
    split = Partition(bounds=[0, *cuts, chain.num_layers], bottleneck=0.0)
    specs = search._stage_specs(problem, cand, halve=False)
    plan = search._sealed(search._build_plan(problem, cand, specs, split, "probe-bisection"))
    return measured_step(layers, plan, model), memory


def test_a_skip_inside_a_stage_is_counted_while_its_gradient_waits():
    """Found by a red team: in the U-Net, layer 11 makes a value that layer 16 reads (a skip
    inside the stage [10, 22)). B makes its gradient at layer 16 and holds it until layer 11's
    backward, while layers 15 to 12 run: none of those layers' own figures sees it (each was
    measured alone), and 1F1B's middle device read 1.3% over its plan, by that gradient
    (8 192 bytes a sample). The plan's B now counts such a gradient while it waits."""
    report, memory = _unet_measured_on(size=2, microbatches=2, cuts=[10, 22])
    assert memory._inner_skips()[11] == [(11, 16, 8192 * 2)]  # (its gradient: two samples)
    for d in report.devices:
        # (not over-counted: to a few scalars where it was found, 0.4% on an AVX2-only machine,
        # whose convolutions' working memory differs)
        assert 0.99 * d.predicted_peak_bytes <= d.measured_peak_bytes, d
        assert d.measured_peak_bytes <= d.predicted_peak_bytes + 256, d  # (a few scalars)


class _TiedHead(nn.Module):
    """An embedding whose weight is also the output head's (a red team's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.l, self.l2 = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l(self.e(x)))) @ self.e.weight.t()


@pytest.mark.parametrize(
    ("schedule", "microbatches", "recompute", "optimizer"),
    [("gpipe", 5, "never", "sgd"), ("1f1b", 5, "except_last", "sgd"), ("zb-h1", 3, "never", "sgd"),
     ("zb-h1", 4, "never", "adam")],
)  # fmt: skip
def test_a_weight_two_layers_of_one_stage_use_is_counted_while_its_gradient_waits(
    schedule, microbatches, recompute, optimizer
):
    """Found by a red team: with an embedding and the head that reuses its weight in one stage,
    B (or zero bubble's I, which makes such a parameter's gradient) makes the head's part of
    the gradient first, and autograd keeps it apart while the layers between run, then sums
    the two parts into a third tensor: none of the layers' own figures sees it. One device
    read 12-22% over its plan in each case here (B's walk for GPipe and 1F1B, I's for zero
    bubble); now within a few scalars, or a few percent over."""
    torch.manual_seed(0)
    model = _TiedHead()
    x = torch.randint(0, 50, (5, 6))
    layers = capture(model, x[:1])
    prof = quick_profile(layers, x[:1], batch_sizes=list(range(1, 6)), loss_fn="mse", threads=1)
    assert [(t.bytes, sorted(t.layers)) for t in prof.tied] == [(3200, [0, 2])]
    plan = plan_pipeline(prof, Cluster.uniform(1, "256MiB"), 5, microbatches=microbatches,
                         schedule=schedule, recompute=recompute, optimizer=optimizer)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    y = torch.randn(5, 6, 50)
    (d,) = pipe.measure(x, y, nn.functional.mse_loss, steps=1).devices
    assert d.measured_peak_bytes <= d.predicted_peak_bytes + 256, d  # (a few scalars)
    assert d.predicted_peak_bytes <= 1.05 * d.measured_peak_bytes, d


@pytest.mark.parametrize(
    ("devices", "schedule", "optimizer"),
    [(1, "gpipe", "sgd"), (1, "zb-h1", "adam"), (2, "gpipe", "adam"), (2, "zb-h1", "sgd")],
)
def test_a_frozen_tied_weight_takes_no_gradient_nor_optimizer_state(devices, schedule, optimizer):
    """The embedding and head of _TiedHead sharing a frozen weight: the profile marks it frozen,
    and no stage holds a gradient, optimizer slots or a waiting gradient part for it (the plan
    was 15% to 2.1x over its run before: each device's peak within a few scalars now)."""
    torch.manual_seed(0)
    model = _TiedHead()
    model.e.weight.requires_grad_(False)
    x = torch.randint(0, 50, (5, 6))
    layers = capture(model, x[:1])
    prof = quick_profile(layers, x[:1], batch_sizes=list(range(1, 6)), loss_fn="mse", threads=1)
    assert [(t.bytes, t.layers, t.frozen) for t in prof.tied] == [(3200, [0, 2], True)]
    assert Profile.model_validate_json(prof.canonical_json()).tied == prof.tied
    plan = plan_pipeline(prof, Cluster.uniform(devices, "256MiB"), 5, microbatches=5,
                         schedule=schedule, recompute="never", optimizer=optimizer)  # fmt: skip
    assert sum(st.memory.grads for st in plan.stages) == 2 * (16 * 16 + 16) * 4  # the Linears'
    for d in measured_step(layers, plan, model).devices:
        assert abs(d.measured_peak_bytes - d.predicted_peak_bytes) <= 64, d


@pytest.mark.parametrize(("devices", "schedule"), [(1, "zb-h1"), (2, "gpipe"), (2, "zb-h1")])
def test_a_tied_weight_frozen_and_unfrozen_between_steps_gets_its_gradient(devices, schedule):
    """The runtime reads which parameters train at each step. A cold review's: a tied weight
    unfrozen after compiling kept a frozen copy on the head's device (its gradient 79% off),
    one frozen after compiling still got a gradient, and zero bubble on one device raised."""
    torch.manual_seed(0)
    model = _TiedHead()
    x = torch.randint(0, 50, (5, 6))
    y = torch.randn(5, 6, 50)
    layers = capture(model, x[:1])
    prof = quick_profile(layers, x[:1], batch_sizes=[1, 2], loss_fn="mse", threads=1)
    plan = plan_pipeline(prof, Cluster.uniform(devices, "256MiB"), 5, microbatches=3,
                         schedule=schedule, recompute="never")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    reference = copy.deepcopy(model)
    for frozen in (True, False, True):
        for m in (model, reference):
            m.e.weight.requires_grad_(not frozen)
            m.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference(x), y).backward()
        pipe.train_step(x, y, nn.functional.mse_loss)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None) == (frozen and name == "e.weight"), name
            if q.grad is not None:
                assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), (frozen, name)


class TiedInside(nn.Module):
    """An embedding whose weight a middle layer and the head use too (read by
    dist_graph_driver.py, whose ranks build it)."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(40, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.example_input = torch.randint(0, 40, (8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.e(x)
        for k, block in enumerate(self.blocks):
            h = torch.relu(block(h)) + h
            if k == 3:
                h = torch.softmax(h @ self.e.weight.t(), -1) @ self.e.weight
        return h @ self.e.weight.t()


def _tied_inside_plan(model: TiedInside) -> tuple[CapturedModel, Plan]:
    """The model's graph and its plan: interleaved 1F1B on 2 devices, one device's two stages
    both using the tied weight."""
    x = model.example_input
    layers = capture(model, x[:1])
    prof = even_times(quick_profile(layers, x[:1], batch_sizes=[1, 2], loss_fn="mse"))
    return layers, plan_pipeline(prof, Cluster.uniform(2, "256MiB"), 8, microbatches=4,
                         schedule="interleaved-1f1b", recompute="never", optimizer="sgd")  # fmt: skip


def test_a_weight_two_stages_of_one_device_use_is_given_to_the_optimizer_once():
    """Found by a cold review: under interleaved 1F1B two stages on one device may use one
    parameter (a tied weight), and the pipe listed it once per stage, so an optimizer over
    pipe.parameters() stepped it twice (torch warns, and the weight moved 0.5 away from the
    un-pipelined step's). Listed once now: one SGD step equals the model's."""
    torch.manual_seed(0)
    model = TiedInside()
    ref = copy.deepcopy(model)
    x, y = model.example_input, torch.randn(8, 4, 40)
    layers, plan = _tied_inside_plan(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(layers, plan)
    listed = [p for st in pipe.stages for p in st.parameters()]
    params = list(pipe.parameters())
    assert len(params) == len({id(p) for p in params}) < len(listed)  # (a repeat left out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch warns of a repeated parameter)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.train_step(x, y, nn.functional.mse_loss)
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name


def test_the_late_walk_without_a_late_gradient_is_bs_transient(gpt_profile):
    """MemoryModel.late_walk, a stage's first B with a gradient made at layer `use`: with none
    (0 bytes) it is the B transient the memory model counts (`live`), for every stage and use;
    with some, at most that and the bytes more, and at least the bytes."""
    from planner import search

    _, _, prof = gpt_profile
    problem = search._Problem(prof, Cluster.uniform(2, "1GiB"), 4, "adam", ("", ""), "streams",
                              ())  # fmt: skip
    _, memory = problem.chain(search.Candidate(2, "gpipe", "never"))
    n = memory.chain.num_layers
    for i in range(n):
        for k in range(i + 2, n + 1):
            live = int(memory.state_bytes(np.array([i]), np.array([k]), only={"live"})["live"][0])
            for use in range(i + 1, k):
                assert memory.late_walk(i, k, use, 0) == live, (i, k, use)
                assert 8192 <= memory.late_walk(i, k, use, 8192) <= live + 8192


class _Dense(nn.Module):
    """Each convolution reads the concatenation of every output before it: the first one's
    output goes to every later layer."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)
        self.c = nn.ModuleList([nn.Conv2d(8 * (k + 1), 8, 3, padding=1) for k in range(3)])
        self.out = nn.Conv2d(32, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fs = [torch.relu(self.c0(x))]
        for c in self.c:
            fs.append(torch.relu(c(torch.cat(fs, 1))))
        return self.out(torch.cat(fs, 1))


@pytest.mark.parametrize("counted", [True, False])
def test_a_recomputed_stage_holds_the_sum_of_a_gradient_two_stages_sent_back(monkeypatch, counted):
    """A stage whose only layer's output two later stages read gets two gradients back for it,
    which the runtime holds: autograd adds them into a new tensor as B begins, and that sum
    lives through the re-materialising forward of a recomputed B. Not counted, the first
    stage ran 16.7% over its plan (a sweep's dense model, older than this session)."""
    from planner import search
    from planner.memory import MemoryModel
    from planner.partition import Partition
    from tests.conftest import even_times, quick_profile

    torch.manual_seed(0)
    model = _Dense()
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    # one thread, as the sweep ran (with two, the convolutions' own working memory there is
    # larger than the sum, and the plan's peak lies elsewhere)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = quick_profile(model, x, batch_sizes=[1, 2, 4], loss_fn="mse", threads=1)
        prof = even_times(prof)
        cluster = Cluster.uniform(3, "1GiB")

        def made() -> Any:
            problem = search._Problem(prof, cluster, 4, "momentum",
                                      (prof.digest(), cluster.digest()))  # fmt: skip
            cand = search.Candidate(2, "1f1b", "always")
            specs = search._stage_specs(problem, cand)
            return search._build_plan(problem, cand, specs, Partition([0, 1, 3, 6], 0.0), "test")

        plan = made()
        if not counted:
            with_sum = plan.predicted.peak_memory[0]
            monkeypatch.setattr(
                MemoryModel, "_sent_sums", property(lambda m: np.zeros((7, 7), dtype=np.int64))
            )
            plan = made()
            if plan.predicted.peak_memory[0] == with_sum:  # (a control with nothing to show)
                pytest.skip("this machine's convolutions put the first device's peak elsewhere")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = compile_pipe(model, plan).measure(x, y, nn.MSELoss(), steps=1)
    finally:
        torch.set_num_threads(threads)
    over = [d.measured_peak_bytes - d.predicted_peak_bytes for d in report.devices]
    if counted:
        assert all(o <= 64 for o in over) and abs(over[0]) <= 64, over
    else:
        assert over[0] >= 8 * 1024, over
