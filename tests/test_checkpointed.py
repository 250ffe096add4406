"""Layers each under an activation checkpoint of their own (plan_pipeline's `checkpoint`,
`plan --checkpoint-layers`): the planner's chain keeps only such a layer's input and charges its
forward again in backward; the runtime wraps the layer in torch.utils.checkpoint. Right when the
gradients are the un-pipelined model's and the run holds what the plan says."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen import emit_program
from codegen.emit import pipelining_refusal
from planner import Cluster, plan_pipeline
from planner.costs import checkpointed
from planner.memory import MemoryModel
from planner.partition import solve_partition
from planner.plan import Plan
from planner.search import InfeasibleError, simulate_plan
from profiler.limits import ArgumentError
from tests import test_codegen
from tests.conftest import even_times, quick_profile
from tests.test_codegen import N, assert_parity, compile_quiet, data, small_transformer
from tests.test_partition import assert_optimal, brute_force, make_chain, problems

K = 2
profiles = test_codegen.profiles  # the small mlp and transformer, profiled once per module


def every_other(profile) -> list[int]:
    return list(range(1, len(profile.layers) - 1, 2))


def every_other_plans(profile) -> list[Plan]:
    """Every other layer checkpointed, under each schedule that allows it."""
    return [
        plan_pipeline(
            profile,
            Cluster.uniform(K, "1GiB"),
            N,
            microbatches=4,
            schedule=schedule,
            checkpoint=every_other(profile),
        )  # fmt: skip
        for schedule in ("gpipe", "1f1b", "interleaved-1f1b")
    ]


@pytest.mark.parametrize(
    "kind, schedule",
    [("mlp", "gpipe"), ("transformer", "1f1b"), ("transformer", "interleaved-1f1b")],
)
def test_gradients_equal_the_model(profiles, kind, schedule):
    prof = profiles[kind]
    plan = plan_pipeline(
        prof, Cluster.uniform(K, "1GiB"), N, microbatches=4, schedule=schedule,
        checkpoint=every_other(prof),
    )  # fmt: skip
    assert plan.checkpointed == every_other(prof) and plan.recompute == "never"
    assert "CHECKPOINTED = " in emit_program(plan)
    assert_parity(kind, plan)


def test_dropout_is_replayed_inside_the_checkpoint(profiles):
    """A checkpointed layer runs its forward again on its own seed: with dropout on, the same
    gradients as the plan without checkpoints."""
    runs = []
    for ck in ([], every_other(profiles["transformer"])):
        model = small_transformer(dropout=0.2)
        plan = plan_pipeline(
            profiles["transformer"], Cluster.uniform(K, "1GiB"), N, microbatches=4,
            schedule="1f1b", checkpoint=ck,
        )  # fmt: skip
        pipe = compile_quiet(model, plan)
        x, y, loss_fn = data("transformer")
        loss = pipe.train_step(x, y, loss_fn)
        runs.append((loss, [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b)
    assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(ga, gb))


def test_a_checkpointed_layer_keeps_its_input_and_runs_its_forward_again():
    """The chain's figures, layer by layer, against the rules written out."""
    c = make_chain(
        4,
        forward=np.array([1.0, 2.0, 3.0, 4.0]),
        backward=np.array([2.0, 3.0, 4.0, 5.0]),
        saved=np.array([10, 30, 50, 70]),
        shared=np.array([0, 8, 20, 6]),
        input_saved=np.array([5, 8, 20, 0]),
        forward_transient=np.array([1, 2, 3, 4]),
        backward_transient=np.array([40, 5, 6, 7]),
        input_unsaved=np.array([0, 0, 0, 9]),
        forward_peak=np.array([11, 12, 13, 14]),
        boundary=np.array([6, 8, 20, 9, 3]),
    )
    k = checkpointed(c, (1, 2))
    assert k.checkpointed == (1, 2)
    assert k.backward.tolist() == [2.0, 5.0, 7.0, 5.0]  # its forward again, in backward
    assert k.forward.tolist() == c.forward.tolist()
    assert k.saved.tolist() == [10, 8, 20, 70]  # its input alone
    assert k.input_saved.tolist() == [5, 8, 20, 0]
    # layer 1's input is what layer 0 saves of it (8, from its shared part); layer 2's
    # predecessor keeps only its own input; layer 3 follows a checkpointed layer: nothing shared
    assert k.shared.tolist() == [0, 8, 0, 0]
    assert k.forward_transient.tolist() == [1, 12, 13, 4]  # its forward keeps nothing
    # again: max(forward transient + output gradient, backward transient) + what it saves
    # beyond its input
    assert k.backward_transient.tolist() == [40, max(2 + 20, 5) + 22, max(3 + 9, 6) + 30, 7]
    # layer 3 saves none of its input, and its checkpointed predecessor keeps only its own
    assert k.input_unsaved.tolist() == [0, 0, 0, 9]
    assert checkpointed(c, ()) is c
    with pytest.raises(ValueError):
        checkpointed(c, (4,))


def test_memory_is_what_the_run_holds(profiles):
    """The plan's peak per device against measure's count of live tensor storages."""
    for plan in every_other_plans(profiles["transformer"]):
        pipe = compile_quiet(small_transformer(), plan)
        x, y, loss_fn = data("transformer")
        report = pipe.measure(x, y, loss_fn, steps=1)
        for d in report.devices:
            assert abs(d.memory_error) <= 0.05, (plan.schedule, d)


def test_auto_checkpoints_where_memory_binds_and_says_what_it_beat(profiles):
    prof = even_times(profiles["transformer"])  # every layer 1 ms: no timing noise
    roomy = plan_pipeline(prof, Cluster.uniform(K, "1GiB"), N)
    assert roomy.checkpointed is None and all(st.recompute == "never" for st in roomy.stages)
    # a budget where whole stages must recompute without checkpoints
    base = plan_pipeline(prof, Cluster.uniform(K, "1GiB"), N, checkpoint=())
    for share in np.linspace(0.95, 0.5, 19):
        tight = int(max(base.predicted.peak_memory) * share)
        try:
            plain = plan_pipeline(prof, Cluster.uniform(K, tight), N, checkpoint=())
        except InfeasibleError:
            continue
        if any(st.recompute != "never" for st in plain.stages):
            break
    else:
        pytest.fail("no budget made the plan recompute")
    auto = plan_pipeline(prof, Cluster.uniform(K, tight), N)
    assert auto.checkpointed and auto.recompute == "never"
    assert auto.predicted.iteration_ms < plain.predicted.iteration_ms
    assert auto.fits and "not every set" in auto.solver.unproven
    first = auto.alternatives[0]
    assert (first.schedule, first.recompute, first.iteration_ms) == (
        plain.schedule, plain.recompute, plain.predicted.iteration_ms,
    )  # fmt: skip
    assert first.reason.startswith("no checkpointed layers: ")
    # the same set given by hand: the same plan, without the note
    again = plan_pipeline(prof, Cluster.uniform(K, tight), N, checkpoint=auto.checkpointed)
    assert again.predicted.iteration_ms == auto.predicted.iteration_ms
    assert [st.layers for st in again.stages] == [st.layers for st in auto.stages]


def test_checkpoints_are_refused_where_they_cannot_run(profiles, tmp_path, run_cli):
    prof = profiles["mlp"]
    cluster = Cluster.uniform(K, "1GiB")
    for kw, words in (
        (dict(schedule="zb-h1"), "zero bubble"),
        (dict(recompute="always"), "recompute must be never"),
        (dict(checkpoint=[len(prof.layers)]), "layer indices"),
        (dict(checkpoint="some"), "checkpoint"),
    ):
        kw = {"checkpoint": [1], **kw}
        with pytest.raises(ArgumentError, match=words):
            plan_pipeline(prof, cluster, N, **kw)
    plan = plan_pipeline(prof, cluster, N, microbatches=4, schedule="1f1b", checkpoint=[1, 2])
    # a hand-edited plan that checkpoints under zero bubble, or a layer past the model
    data_ = plan.model_dump(mode="json")
    for change in ({"schedule": "zb-h1"}, {"checkpointed": [1, len(prof.layers)]}):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**data_, **change}))
        r = run_cli("show", bad)
        assert r.code == 2 and "checkpointed" in r.err and "Traceback" not in r.err
    assert "checkpoint" in pipelining_refusal(plan)
    # the flag
    path = tmp_path / "p.json"
    prof.save(tmp_path / "prof.json")
    r = run_cli("plan", tmp_path / "prof.json", "--devices", "2", "--memory", "1GiB",
                "--batch-size", "8", "--schedule", "1f1b", "--checkpoint-layers", "1-2,4",
                "-o", path)  # fmt: skip
    assert r.code == 0 and "layers 1-2, 4 each under a checkpoint" in r.out
    assert Plan.load(path).checkpointed == [1, 2, 4]
    for flag in ("x", "3-1", "1,99"):
        r = run_cli("plan", tmp_path / "prof.json", "--devices", "2", "--memory", "1GiB",
                    "--batch-size", "8", "--checkpoint-layers", flag, "-o", path)  # fmt: skip
        assert r.code == 2 and r.err.count("\n") == 1 and "--checkpoint-layers" in r.err, r.err
    assert Plan.load(path).checkpointed == [1, 2, 4]  # left as it was


def test_the_plan_predicts_what_the_simulator_replays(profiles):
    for plan in every_other_plans(profiles["transformer"]):
        timed = simulate_plan(plan)
        assert timed.makespan == pytest.approx(plan.predicted.iteration_ms, rel=1e-12)
        assert timed.peak_memory == plan.predicted.peak_memory


@settings(max_examples=80, deadline=None)
@given(problems(), st.data())
def test_the_split_is_the_brute_force_optimum_of_the_checkpointed_chain(problem, draw):
    """Random chains, stage specs and checkpoint sets: the solver on the checkpointed chain
    against every split of it."""
    chain, specs, cuts = problem
    L = chain.num_model_layers
    c = checkpointed(chain, tuple(draw.draw(st.sets(st.integers(0, L - 1), max_size=L))))
    times = c.forward + c.backward
    expected = brute_force(times, c, specs, cuts)
    assert_optimal(
        solve_partition(times, MemoryModel(c), specs, cuts), expected, times, c, specs, cuts
    )


class _Mean(torch.nn.Module):
    """Saves nothing for backward: under a checkpoint it keeps nothing either."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def _fine_layers() -> torch.nn.Sequential:
    nn = torch.nn
    W = 32
    model = nn.Sequential(
        nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.ReLU(),
        nn.Linear(W, W), _Mean(), nn.Linear(W, 10),
    )  # fmt: skip
    model.example_input = torch.randn(N, 128, W)
    return model


def test_fine_layers_hold_what_the_plan_says_and_auto_tries_none():
    """Layers that save their output (ReLU, Tanh), one that saves nothing, a Linear that saves
    what the ReLU before it saves: each checkpointed alone or in runs, the run against the plan,
    byte for byte but a scalar's worth. None of them frees anything alone, so auto tries none."""
    torch.manual_seed(0)
    model = _fine_layers()
    # every layer 1 ms: the same split every run (where a stage ends in the layer that saves
    # nothing, the plan over-counts that stage by an input, checkpointed or not)
    prof = even_times(quick_profile(model, model.example_input, batch_sizes=[1, 2, 8]))
    x = model.example_input
    y = torch.randint(0, 10, (N,), generator=torch.Generator().manual_seed(2))
    loss_fn = torch.nn.CrossEntropyLoss()
    for layers in ([7], [1], [2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]):
        plan = plan_pipeline(
            prof, Cluster.uniform(K, "1GiB"), N, microbatches=4, schedule="gpipe",
            checkpoint=layers,
        )  # fmt: skip
        report = compile_quiet(model, plan).measure(x, y, loss_fn, steps=1)
        for d in report.devices:
            assert abs(d.measured_peak_bytes - d.predicted_peak_bytes) <= 512, (layers, d)
    from planner.search import _checkpoint_sets

    assert _checkpoint_sets(prof) == []


def test_where_nothing_fits_only_the_set_that_frees_most_is_searched(profiles, monkeypatch):
    """Each search where nothing fits also looks for the least memory that would do: where
    even the largest set of checkpointed layers fits nowhere, the smaller ones are not tried."""
    import planner.search as search

    prof = even_times(profiles["transformer"])
    tried = []
    real = search.plan_pipeline

    def counting(*args, **kw):
        if not isinstance(kw.get("checkpoint", "auto"), str):
            tried.append(tuple(kw["checkpoint"]))
        return real(*args, **kw)

    monkeypatch.setattr(search, "plan_pipeline", counting)
    sets = search._checkpoint_sets(prof)
    assert len(sets) > 1
    with pytest.raises(InfeasibleError):
        search.plan_pipeline(prof, Cluster.uniform(K, 1000), N)
    assert tried == [(), sets[-1]]


def test_a_frozen_layer_that_saves_only_its_weight_keeps_its_input_under_a_checkpoint():
    """Found by a cold review: a frozen Linear whose input needs a gradient saves its weight
    alone, which the profile's saved bytes leave out (a model's own storage), so the plan said
    its checkpoint keeps nothing; torch's checkpoint keeps the input wherever a layer saves
    any tensor (a weight too). Frozen middle Linears under checkpoints held 2.1% more than the
    plan. Now none is under. The plan is over where the layer before saves that same input
    (a ReLU its output: the profile does not say so, and it is counted twice), here by one
    input per micro-batch in flight and checkpointed Linear after a plain ReLU: 4.8% with the
    three ReLUs before them plain, 1.5% with only the first plain."""
    from tests.conftest import measured_step

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(),
            *[x for _ in range(3) for x in (torch.nn.Linear(512, 512), torch.nn.ReLU())],
            torch.nn.Linear(512, 64),
        )  # fmt: skip
        for k in range(2, 8):  # a frozen middle: a gradient crosses it
            m[k].requires_grad_(False)
        return m

    x = torch.randn(32, 64)
    prof = even_times(quick_profile(build(), x[:8], batch_sizes=[8], loss_fn="mse", threads=1))
    for ck in ([2, 4, 6], [2, 3, 4, 5, 6, 7]):
        plan = plan_pipeline(prof, Cluster.uniform(1, "2GiB"), 32, microbatches=4,
                             schedule="gpipe", recompute="never", optimizer="sgd", checkpoint=ck)  # fmt: skip
        (d,) = measured_step(build(), plan).devices
        assert d.measured_peak_bytes <= d.predicted_peak_bytes + 64, (ck, d)
        # (the outputs of the plain ReLUs before them counted twice: 4 micro-batches of 8 x 512)
        twice = len([k for k in ck if k - 1 not in ck]) * 4 * 8 * 512 * 4
        assert d.predicted_peak_bytes <= d.measured_peak_bytes + twice + 64, (ck, d)
