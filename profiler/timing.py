"""time_layers: time every layer of a sequential model, pooling structurally identical layers.

Timed one by one, the identical blocks of a transformer measured anywhere from 3 to 8 ms and the
planner balanced noise. So layers with the same `structure_key` form a group, timed together:

- A round takes one sample of every figure (forward, full backward, input gradient I, weight
  gradients W) from every member, starting one member later each round, so a slow drift of the
  machine reaches every member equally. For a group of three:

      # round r: members in the order they run
      # 0: m0 m1 m2
      # 1: m1 m2 m0
      # 2: m2 m0 m1

- All samples of a group are pooled into one Timing per figure, which every member gets.
- Rounds go on from `min_repeats` until the median is stable, by its robust relative standard
  error over the n pooled samples (1.4826 MAD estimates sigma, 1.2533 sigma / sqrt(n) is the
  standard error of a median of normal noise):

      rse = 1.2533 * 1.4826 * MAD / sqrt(n) / median    (0 when the median is 0)

  checked on forward and full backward, or until `max_repeats` rounds, or until the group's share
  of the time budget is spent (see `sample_groups`).

Each figure is measured as the layer runs in the pipe, on its detached input: the backward parts
each run their own untimed forward first; I and W are 0 where there is no input gradient or there
are no weights.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .types import LayerProfile, Timing

TARGET_RSE = 0.02  # how settled a group's forward and backward must be to stop (StopRule)

Value = Any  # a tensor or a tuple of tensors: what flows between layers of an nn.Sequential

FIGURES = ("forward", "backward", "backward_input", "backward_weight")
Sample = tuple[float, float, float, float]  # ms of one member in one round, in FIGURES order


@dataclass(frozen=True)
class LayerTiming:
    """The four figures of one layer, in ms; the members of a group share one LayerTiming."""

    forward: Timing
    backward: Timing
    backward_input: Timing  # the input gradient alone (zero-bubble I)
    backward_weight: Timing  # the weight gradients alone, from the layer's output (zero-bubble W)


def time_layers(
    layers: Sequence[nn.Module],
    inputs: Sequence[Value],
    dev: torch.device,
    *,
    warmup: int = 2,
    min_repeats: int = 5,
    max_repeats: int = 200,
    target_rse: float = TARGET_RSE,
    time_budget_s: float = 10.0,
    clock: Callable[[], float] | None = None,
    call_ms: float = 0.0,
) -> list[LayerTiming]:
    """Time each layer on its input (`inputs[i]`, detached, requires_grad where it is a stage
    boundary), identical layers together. The warm-up and `min_repeats` rounds are always taken;
    further rounds stop once the call has used `time_budget_s` seconds of `clock` (default
    perf_counter), shared between groups as `sample_groups` says. Parameters' gradients are left
    None. `call_ms`: what one autograd call costs whatever it computes, taken off each layer's
    backward and I: a stage makes one such call for all its layers (the runtime's cost per
    action adds it back, profiler/overhead.py); W stays as measured, one call per layer as the
    runtime makes it."""
    if len(layers) != len(inputs):
        raise ValueError(f"{len(layers)} layers but {len(inputs)} inputs; pass one input per layer")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")
    rule = StopRule(min_repeats, max_repeats, target_rse)
    groups: dict[Hashable, list[int]] = {}
    for i, (layer, inp) in enumerate(zip(layers, inputs)):
        groups.setdefault(structure_key(layer, inp), []).append(i)
    members = list(groups.values())
    samplers = [
        _LayerGroup([(layers[i], inputs[i]) for i in m], dev, warmup, call_ms) for m in members
    ]
    try:
        pools = sample_groups(samplers, rule, time_budget_s, clock or time.perf_counter)
    finally:
        for layer in layers:
            for p in layer.parameters():
                p.grad = None
    by_layer: dict[int, LayerTiming] = {}
    for m, pool in zip(members, pools):
        timing = LayerTiming(**{f: to_timing(s) for f, s in zip(FIGURES, pool.figures)})
        by_layer.update(dict.fromkeys(m, timing))
    return [by_layer[i] for i in range(len(layers))]


def structure_key(layer: nn.Module, inp: Value) -> Hashable:
    """Equal for layers that run the same computation on the same kind of input: class, every
    submodule's class, extra_repr, plain attributes (MultiheadAttention's num_heads is in neither
    its repr nor its shapes) and training flag, parameter and buffer shapes, and the input's
    tensors. Any doubt splits a group: an attribute that differs makes two groups."""
    modules = tuple(
        (name, _qualname(m), m.extra_repr(), m.training, _plain_attributes(m))
        for name, m in layer.named_modules()
    )
    params = tuple(
        (name, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad)
        for name, p in layer.named_parameters()
    )
    buffers = tuple(
        (name, tuple(b.shape), str(b.dtype), str(b.device), b.requires_grad)
        for name, b in layer.named_buffers()
    )
    tensors = tuple(
        (tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad) for t in _tensors(inp)
    )
    return (_qualname(layer), modules, params, buffers, isinstance(inp, tuple), tensors)


@dataclass(frozen=True)
class StopRule:
    """When a group has been timed often enough; the time budget is `sample_groups`' part."""

    min_repeats: int = 5
    max_repeats: int = 200
    target_rse: float = TARGET_RSE

    def __post_init__(self) -> None:
        if self.min_repeats < 1:
            raise ValueError(f"min_repeats must be at least 1, got {self.min_repeats}")
        if self.max_repeats < self.min_repeats:
            raise ValueError(
                f"max_repeats ({self.max_repeats}) is below min_repeats ({self.min_repeats}); "
                "raise max_repeats or lower min_repeats"
            )
        if self.target_rse < 0:
            raise ValueError(f"target_rse must be at least 0, got {self.target_rse}")

    def done(self, rounds: int, forward: Sequence[float], backward: Sequence[float]) -> bool:
        """After `rounds` rounds with these pooled forward and full-backward samples."""
        if rounds < self.min_repeats:
            return False
        if rounds >= self.max_repeats:
            return True
        return robust_rse(forward) <= self.target_rse and robust_rse(backward) <= self.target_rse


def robust_rse(samples: Sequence[float]) -> float:
    """Relative standard error of the median, from the MAD; 0 when the median is 0 (a figure that
    does not exist, such as W of a layer without weights, is stable), inf without samples."""
    if not samples:
        return math.inf
    median = statistics.median(samples)
    if median == 0:
        return 0.0
    return 1.2533 * 1.4826 * _mad(samples, median) / math.sqrt(len(samples)) / median


def timing_rse(t: Timing) -> float:
    """robust_rse of the samples a Timing pools, from what it keeps of them (its spread is
    their MAD over the median)."""
    return 1.2533 * 1.4826 * t.spread / math.sqrt(t.samples)


def unsettled(
    layers: Sequence[LayerProfile], target_rse: float = TARGET_RSE
) -> tuple[int, int, tuple[LayerProfile, str, int, float] | None]:
    """Of the figures the stop rule reads (each layer's forward and full backward, at every
    size), how many are above `target_rse` (they stopped at the time budget or the repeat
    limit), of how many, and the noisiest: (layer, figure, size, rse). Structurally identical
    layers share their figures (equal in every field): counted once."""
    seen: set[tuple] = set()
    count = total = 0
    worst: tuple[LayerProfile, str, int, float] | None = None
    for layer in layers:
        for name, figure in (("forward", layer.forward_ms), ("backward", layer.backward_ms)):
            for size, t in figure.items():
                key = (name, size, t.median, t.min, t.max, t.samples, t.spread)
                if key in seen:
                    continue
                seen.add(key)
                total += 1
                rse = timing_rse(t)
                if rse > target_rse:
                    count += 1
                    if worst is None or rse > worst[3]:
                        worst = (layer, name, size, rse)
    return count, total, worst


def to_timing(samples: Sequence[float]) -> Timing:
    """The pooled samples of one figure as a Timing: spread is MAD / median (0 at median 0)."""
    median = statistics.median(samples)
    spread = _mad(samples, median) / median if median > 0 else 0.0
    return Timing(
        median=median, min=min(samples), max=max(samples), samples=len(samples), spread=spread
    )


@dataclass
class Pool:
    """The samples of one group so far, per figure in FIGURES order, pooled over its members."""

    rounds: int = 0
    figures: tuple[list[float], ...] = field(default_factory=lambda: tuple([] for _ in FIGURES))

    def add(self, round_samples: Sequence[Sample]) -> None:
        for sample in round_samples:
            for figure, ms in zip(self.figures, sample):
                figure.append(ms)
        self.rounds += 1


class Sampler(Protocol):
    """Times one group: `warm` runs every member untimed, `take` is one round (a Sample per
    member)."""

    def warm(self) -> None: ...

    def take(self) -> list[Sample]: ...


def sample_groups(
    samplers: Sequence[Sampler], rule: StopRule, budget_s: float, clock: Callable[[], float]
) -> list[Pool]:
    """Run every group to `rule` within `budget_s` seconds of `clock`.

    First each group warms up and takes `min_repeats` rounds, whatever the budget; that gives its
    cost per round. The budget left is then shared, in group order, among the groups not yet
    done, in proportion to their cost per round: each can afford as many further rounds as the
    others. Resuming, a group first takes one round it discards (the other groups have run
    since, its caches are cold), then stops at the first round that would overrun its share;
    what it leaves unused goes to the groups after it, so none gets less than its proportional
    share. So the budget bounds the rounds beyond the minimum, not the minimum itself."""
    pools = [Pool() for _ in samplers]
    cost: list[float] = []  # seconds per round, from the minimum rounds
    start = clock()
    for sampler, pool in zip(samplers, pools):
        sampler.warm()
        t0 = clock()
        while pool.rounds < rule.min_repeats:
            pool.add(sampler.take())
        cost.append((clock() - t0) / pool.rounds)

    def done(g: int) -> bool:
        return rule.done(pools[g].rounds, pools[g].figures[0], pools[g].figures[1])

    left = budget_s - (clock() - start)
    todo = [g for g in range(len(pools)) if not done(g)]
    for n, g in enumerate(todo):
        weight = sum(cost[h] for h in todo[n:])
        share = left * cost[g] / weight if weight > 0 else left / (len(todo) - n)
        if 2 * cost[g] > share:
            continue
        t0 = clock()
        samplers[g].take()  # discarded: its caches went cold while the other groups ran
        while not done(g) and clock() - t0 + cost[g] <= share:
            pools[g].add(samplers[g].take())
        left -= clock() - t0
    return pools


class _LayerGroup:
    """Sampler over real layers: one sample of each figure per member per round, rotating."""

    def __init__(
        self,
        members: list[tuple[nn.Module, Value]],
        dev: torch.device,
        warmup: int,
        call_ms: float = 0.0,
    ) -> None:
        self._members = [_Member(layer, inp, call_ms) for layer, inp in members]
        self._dev = dev
        self._warmup = warmup
        self._round = 0

    def warm(self) -> None:
        for _ in range(self._warmup):
            for m in self._members:
                m.sample(self._dev)

    def take(self) -> list[Sample]:
        k = len(self._members)
        first = self._round % k
        self._round += 1
        return [self._members[(first + j) % k].sample(self._dev) for j in range(k)]


class _Member:
    """One layer on its input; measures the four figures exactly as the pipe runs them."""

    def __init__(self, layer: nn.Module, inp: Value, call_ms: float = 0.0) -> None:
        self.layer = layer
        self.inp = inp
        self.wrt = [t for t in _tensors(inp) if t.requires_grad]
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.call_ms = call_ms

    def sample(self, dev: torch.device) -> Sample:
        forward = _elapsed(lambda: self.layer(self.inp), dev)
        full, wrt_input, wrt_weight = (self._backward(dev, p) for p in ("full", "input", "weight"))
        if self.call_ms:  # (0 stays 0: no call was made)
            full = max(full - self.call_ms, 0.0) if full else 0.0
            wrt_input = max(wrt_input - self.call_ms, 0.0) if wrt_input else 0.0
        return forward, full, wrt_input, wrt_weight

    def _backward(self, dev: torch.device, part: str) -> float:
        """The backward of one fresh (untimed) forward: all of it, the input gradient only, or
        the weight gradients only, from the layer's output with `inputs=` its parameters."""
        if (part == "input" and not self.wrt) or (part == "weight" and not self.params):
            return 0.0
        roots, grads = _backward_args(self.layer(self.inp))
        if not roots:
            return 0.0
        if part == "input":
            return _elapsed(
                lambda: torch.autograd.grad(roots, self.wrt, grads, allow_unused=True), dev
            )
        if part == "weight":
            return _elapsed(lambda: torch.autograd.backward(roots, grads, inputs=self.params), dev)
        return _elapsed(lambda: torch.autograd.backward(roots, grads), dev)


def _elapsed(fn: Callable[[], object], dev: torch.device) -> float:
    """Milliseconds of fn: CUDA events on a GPU, perf_counter on the CPU."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _backward_args(out: Value) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    roots = [t for t in _tensors(out) if t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def _tensors(v: Value) -> list[torch.Tensor]:
    """The tensors of a layer's input or output: itself, a tuple's, or (a captured model's
    last layer, returning what the model returns, e.g. a library's output class) its leaves'."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, tuple):
        return list(v)
    return [t for t in torch.utils._pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]


def _mad(samples: Sequence[float], median: float) -> float:
    return statistics.median(abs(s - median) for s in samples)


def _qualname(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain_attributes(m: nn.Module) -> tuple[tuple[str, Any], ...]:
    """The module's own scalar settings (p of Dropout, num_heads of MultiheadAttention)."""
    return tuple(
        (k, _frozen(v)) for k, v in sorted(vars(m).items()) if k != "training" and _plain(v)
    )


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(map(_plain, v)))


def _frozen(v: Any) -> Any:
    return tuple(_frozen(x) for x in v) if isinstance(v, (tuple, list)) else v
