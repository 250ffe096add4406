"""Timing layers: identical layers are grouped and share one pooled Timing, and the number of
rounds follows the stopping rule and the time budget exactly (scripted samples, a fake clock).
Real timings are only checked for structure, never for their values."""

from __future__ import annotations

import math
from itertools import cycle

import pytest
import torch
from torch import nn

from profiler.examples import transformer
from profiler.timing import (
    LayerTiming,
    StopRule,
    robust_rse,
    sample_groups,
    structure_key,
    time_layers,
    timing_rse,
    to_timing,
    unsettled,
)
from profiler.types import Profile, Timing

CPU = torch.device("cpu")
NOISY = [1.0, 0.75, 1.25]  # from n = 6 on, a cycle of these has median 1 and MAD 0.25


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


class Scripted:
    """A group of `members` whose forward and backward samples cycle through `values`; each round
    costs `cost_s` seconds of the fake clock, warming up costs nothing. Counts both."""

    def __init__(self, clock: FakeClock, values: list[float], members: int = 1, cost_s: float = 1):
        self.clock, self.members, self.cost_s = clock, members, cost_s
        self.values = cycle(values)
        self.warms = self.takes = 0

    def warm(self) -> None:
        self.warms += 1

    def take(self) -> list[tuple[float, float, float, float]]:
        self.clock.advance(self.cost_s)
        self.takes += 1
        return [(v, v, 0.0, 0.0) for v in (next(self.values) for _ in range(self.members))]


def rounds_of(samplers: list[Scripted], rule: StopRule, budget_s: float, clock: FakeClock):
    return [pool.rounds for pool in sample_groups(samplers, rule, budget_s, clock)]


# The stopping rule, on scripted samples.


def test_robust_rse_by_hand():
    # median 1, MAD 0.25, n = 90
    assert robust_rse(NOISY * 30) == pytest.approx(1.2533 * 1.4826 * 0.25 / math.sqrt(90))
    assert robust_rse([2.0] * 7) == 0.0
    assert robust_rse([0.0] * 7) == 0.0  # a figure that does not exist is stable
    assert robust_rse([0.0, 0.0, 5.0]) == 0.0
    assert robust_rse([]) == math.inf


def test_done_waits_for_min_repeats_and_checks_forward_and_backward():
    rule = StopRule(min_repeats=5, max_repeats=10, target_rse=0.05)
    assert not rule.done(4, [1.0] * 4, [1.0] * 4)
    assert rule.done(5, [1.0] * 5, [1.0] * 5)
    assert rule.done(5, [0.0] * 5, [0.0] * 5)
    assert not rule.done(6, [1.0] * 6, NOISY * 2)
    assert not rule.done(6, NOISY * 2, [1.0] * 6)
    assert rule.done(10, NOISY * 2, NOISY * 2)  # max_repeats


def test_constant_samples_stop_at_min_repeats():
    clock = FakeClock()
    group = Scripted(clock, [2.0])
    assert rounds_of([group], StopRule(5, 200, 0.02), 1e9, clock) == [5]
    assert (group.warms, group.takes) == (1, 5)


def test_noisy_samples_continue_until_the_target_rse():
    # rse(n) = 1.2533 * 1.4826 * 0.25 / sqrt(n) <= 0.05 first at n = 87 (86.32 by hand)
    clock = FakeClock()
    group = Scripted(clock, NOISY)
    assert rounds_of([group], StopRule(5, 200, 0.05), 1e9, clock) == [87]
    assert (group.warms, group.takes) == (1, 88)  # one round discarded before resuming


def test_pooled_samples_of_all_members_count():
    # two members: 88 samples after 44 rounds are the first n >= 87
    clock = FakeClock()
    rule = StopRule(5, 200, 0.05)
    assert rounds_of([Scripted(clock, NOISY, members=2)], rule, 1e9, clock) == [44]


def test_noisy_samples_stop_at_max_repeats():
    clock = FakeClock()
    assert rounds_of([Scripted(clock, NOISY)], StopRule(5, 20, 0.05), 1e9, clock) == [20]


def test_all_zero_samples_stop_at_min_repeats():
    clock = FakeClock()
    assert rounds_of([Scripted(clock, [0.0])], StopRule(3, 200, 0.0), 1e9, clock) == [3]
    assert to_timing([0.0] * 3) == Timing(median=0, min=0, max=0, samples=3, spread=0)


def test_budget_is_shared_by_cost_per_round():
    # Minimum rounds: 5 * 1 s + 5 * 3 s = 20 s; of the 40 s left the cheap group gets 10 s, the
    # expensive one 30 s: both one discarded round and 9 more.
    clock = FakeClock()
    cheap, dear = Scripted(clock, NOISY, cost_s=1), Scripted(clock, NOISY, cost_s=3)
    assert rounds_of([cheap, dear], StopRule(5, 200, 0.0), 60, clock) == [14, 14]
    assert (cheap.takes, dear.takes) == (15, 15)
    assert clock.now == 60


def test_unused_share_goes_to_the_groups_after():
    # The stable group needs nothing beyond its minimum: the 40 s left buy 13 rounds of 3 s,
    # the first discarded.
    clock = FakeClock()
    stable, dear = Scripted(clock, [1.0], cost_s=1), Scripted(clock, NOISY, cost_s=3)
    assert rounds_of([stable, dear], StopRule(5, 200, 0.0), 60, clock) == [5, 17]
    assert clock.now == 20 + 39


def test_a_cheap_group_cannot_spend_an_expensive_groups_share():
    # 30 s left after the minimum rounds: the cheap group gets 30 * 1/6 = 5 s, not all of it;
    # each discards one round and keeps 4.
    clock = FakeClock()
    cheap, dear = Scripted(clock, NOISY, cost_s=1), Scripted(clock, NOISY, cost_s=5)
    assert rounds_of([cheap, dear], StopRule(5, 200, 0.0), 60, clock) == [9, 9]


def test_a_share_too_small_for_two_rounds_is_not_started():
    # 5 s left: the cheap group's 1.25 s cannot pay a discarded round and a kept one; all 5 s,
    # then offered to the expensive group, cannot either (2 * 3 s).
    clock = FakeClock()
    cheap, dear = Scripted(clock, NOISY, cost_s=1), Scripted(clock, NOISY, cost_s=3)
    assert rounds_of([cheap, dear], StopRule(5, 200, 0.0), 25, clock) == [5, 5]
    assert (cheap.takes, dear.takes) == (5, 5)


def test_rounds_that_cost_no_clock_time_run_to_max_repeats():
    clock = FakeClock()
    groups = [Scripted(clock, NOISY, cost_s=0), Scripted(clock, NOISY, cost_s=0)]
    assert rounds_of(groups, StopRule(5, 30, 0.0), 1, clock) == [30, 30]


def test_minimum_rounds_are_taken_even_past_the_budget():
    clock = FakeClock()
    groups = [Scripted(clock, NOISY, cost_s=1), Scripted(clock, NOISY, cost_s=3)]
    assert rounds_of(groups, StopRule(5, 200, 0.0), 10, clock) == [5, 5]
    assert [(g.warms, g.takes) for g in groups] == [(1, 5), (1, 5)]


def test_bad_rules_say_what_to_change():
    with pytest.raises(ValueError, match="raise max_repeats"):
        StopRule(min_repeats=5, max_repeats=4)
    with pytest.raises(ValueError, match="min_repeats"):
        StopRule(min_repeats=0)


def test_to_timing_by_hand():
    # deviations from the median 3: 2, 1, 0, 1, 7 -> MAD 1
    assert to_timing([1.0, 2.0, 3.0, 4.0, 10.0]) == Timing(
        median=3.0, min=1.0, max=10.0, samples=5, spread=1 / 3
    )


# Which layers are identical.


def x(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.zeros(*shape).requires_grad_(grad)


def test_identical_linears_group():
    assert structure_key(nn.Linear(4, 4), x(2, 4)) == structure_key(nn.Linear(4, 4), x(2, 4))
    assert hash(structure_key(nn.Linear(4, 4), x(2, 4))) is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (nn.Linear(4, 4), nn.Linear(4, 5)),
        (nn.Linear(4, 4), nn.Linear(4, 4, bias=False)),
        (nn.Linear(4, 4), nn.Linear(4, 4).double()),
        (nn.Linear(4, 4), nn.Linear(4, 4).requires_grad_(False)),
        (nn.Linear(4, 4), nn.Linear(4, 4).eval()),
        (nn.Dropout(0.1), nn.Dropout(0.2)),
        (nn.ReLU(), nn.GELU()),
        (nn.GELU(), nn.GELU(approximate="tanh")),
        (nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())),
        (nn.BatchNorm1d(4), nn.BatchNorm1d(4, momentum=0.2)),
        # same parameter shapes, only the number of heads differs
        (nn.MultiheadAttention(8, 2), nn.MultiheadAttention(8, 4)),
    ],
)
def test_different_layers_do_not_group(a: nn.Module, b: nn.Module):
    inp = x(2, 3, 4) if not isinstance(a, nn.MultiheadAttention) else x(3, 2, 8)
    assert structure_key(a, inp) != structure_key(b, inp)


def test_the_same_layer_on_different_inputs_does_not_group():
    layer = nn.Linear(4, 4)
    key = structure_key(layer, x(2, 4))
    assert key != structure_key(layer, x(3, 4))
    assert key != structure_key(layer, x(2, 4, grad=False))
    assert key != structure_key(layer, x(2, 4).double())
    assert key != structure_key(layer, (x(2, 4),))
    pair = (x(2, 4), x(2, 4))
    assert structure_key(layer, pair) == structure_key(nn.Linear(4, 4), (x(2, 4), x(2, 4)))
    assert structure_key(layer, pair) != structure_key(layer, (x(2, 4), x(2, 4, grad=False)))


def test_transformer_blocks_group_and_the_rest_does_not():
    model = transformer(vocab=64, d_model=32, heads=2, depth=4, seq_len=8, batch=2)
    h = x(2, 8, 32)
    keys = [structure_key(block, h) for block in model[1:5]]
    assert len(set(keys)) == 1
    assert structure_key(model[5], h) not in keys  # the final LayerNorm
    assert structure_key(model[0], torch.zeros(2, 8, dtype=torch.long)) not in keys


# Real layers, end to end: only structure is checked.


def chained_inputs(model: nn.Sequential, sample: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's detached input, as the profiler prepares it: the model's own input needs no
    gradient, every later one does (it is a stage boundary)."""
    inputs, h = [], sample
    for i, layer in enumerate(model):
        inp = h.detach().requires_grad_(i > 0 and h.is_floating_point())
        inputs.append(inp)
        h = layer(inp)
    return inputs


def linear_relu(depth: int = 4, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def test_identical_layers_share_one_pooled_timing():
    model = linear_relu()
    inputs = chained_inputs(model, torch.randn(3, 8))
    t = time_layers(list(model), inputs, CPU, warmup=1, min_repeats=2, max_repeats=2)
    assert len(t) == 8 and all(isinstance(lt, LayerTiming) for lt in t)
    # the first Linear's input needs no gradient: a group of its own
    assert t[2] is t[4] is t[6] and t[1] is t[3] is t[5] is t[7]
    assert t[0] is not t[2]
    for group, size in (([0], 1), ([2, 4, 6], 3), ([1, 3, 5, 7], 4)):
        for i in group:
            for timing in (t[i].forward, t[i].backward, t[i].backward_input, t[i].backward_weight):
                assert timing.samples == 2 * size
                assert 0 <= timing.min <= timing.median <= timing.max
                assert timing.spread >= 0
    assert t[0].backward_input == Timing(median=0, min=0, max=0, samples=2, spread=0)
    assert t[1].backward_weight == Timing(median=0, min=0, max=0, samples=8, spread=0)
    assert all(p.grad is None for p in model.parameters())


def test_a_zero_budget_takes_exactly_the_minimum_rounds():
    model = transformer(vocab=64, d_model=32, heads=2, depth=4, seq_len=8, batch=2)
    inputs = chained_inputs(model, model.example_input)
    t = time_layers(list(model), inputs, CPU, warmup=0, min_repeats=2, time_budget_s=0.0)
    assert t[1] is t[2] is t[3] is t[4]
    assert [lt.forward.samples for lt in t] == [2, 8, 8, 8, 8, 2, 2]
    assert t[0].backward_input.median == 0  # int64 tokens have no gradient
    assert all(p.grad is None for p in model.parameters())


LOG: list[nn.Module] = []


class Probe(nn.Module):
    """No parameters, no settings: identical probes group. Logs each forward it runs."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        LOG.append(self)
        return h * 2


def test_members_run_in_rotating_order():
    probes = [Probe(), Probe(), Probe()]
    LOG.clear()
    time_layers(probes, [x(2, 2)] * 3, CPU, warmup=0, min_repeats=3, max_repeats=3)
    # per sample: the timed forward, then one forward each for full backward and I (no W)
    order = [probes.index(p) for p in LOG[::3]]
    assert LOG == [probes[i] for i in order for _ in range(3)]
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_mismatched_inputs_say_what_to_pass():
    with pytest.raises(ValueError, match="one input per layer"):
        time_layers([nn.ReLU()], [], CPU)


@pytest.mark.parametrize(
    "samples", [NOISY * 30, [2.0] * 7, [1.0, 3.0], [1.0, 1.1, 0.9, 5.0, 1.05], [0.0, 0.0, 5.0]]
)
def test_a_timing_keeps_what_its_rse_needs(samples):
    """The rse the stop rule read can be told from the Timing a profile keeps."""
    assert timing_rse(to_timing(samples)) == pytest.approx(robust_rse(samples), rel=1e-12)


def test_unsettled_figures_are_counted_once_per_group_with_the_noisiest_named():
    from conftest import synthetic_profile

    prof = synthetic_profile([1.0, 2.0, 3.0, 4.0], sizes=(1, 2))
    assert unsettled(prof.layers) == (0, 16, None)  # (one sample each: spread 0)
    calm = to_timing([1.0, 1.01, 0.99, 1.0, 1.0] * 4)  # rse below 2%
    noisy, noisier = to_timing(NOISY * 10), to_timing(NOISY * 2)  # +-9.6%, +-21.5%
    assert timing_rse(calm) <= 0.02 < timing_rse(noisy) < timing_rse(noisier)
    layers = [x.model_copy(deep=True) for x in prof.layers]
    # two identical layers share one pooled figure (equal in every field): counted once
    for x in layers[:2]:
        x.forward_ms[2] = noisy
        x.backward_ms[1] = calm
    layers[3].backward_ms[2] = noisier
    layers[3].backward_input_ms[1] = to_timing(NOISY * 2)  # (not a figure the rule reads)
    count, total, worst = unsettled(layers)
    assert (count, total) == (2, 14)  # 16 figures, two pairs of them shared by one group
    assert worst is not None and (worst[0].index, worst[1], worst[2]) == (3, "backward", 2)
    assert worst[3] == timing_rse(noisier)


def test_profile_says_which_figures_did_not_settle(run_cli, tmp_path, monkeypatch):
    import profiler.timing

    out = tmp_path / "p.json"
    quiet = run_cli("profile", "example:mlp", "--repeats", "1", "--time-budget", "0", "-o", out)
    assert quiet.code == 0
    told = "timed figures did not settle" in quiet.err
    count, total, worst = unsettled(Profile.load(out).layers)
    assert told == (worst is not None)  # said exactly where the profile shows it
    monkeypatch.setattr(profiler.timing, "unsettled", lambda layers: (3, 12, (
        Profile.load(out).layers[1], "backward", 8, 0.094)))  # fmt: skip
    r = run_cli("profile", "example:mlp", "--repeats", "1", "--time-budget", "0", "-o", out)
    assert r.code == 0
    assert (
        "note: 3 of 12 timed figures did not settle to +-2% within --time-budget / --max-repeats "
        "(the noisiest: layer 1 (ReLU) backward at size 8, +-9.4%)"
    ) in r.err
