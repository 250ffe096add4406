"""What the pipeline runtime itself costs on this device, beyond the layers' compute.

Every action of a compiled program (a stage's forward, backward, I or W on one micro-batch)
goes through the runtime's bookkeeping: the program's call, taking and handing on the
activation, the stage's seed per layer. A step also begins and ends (splitting the batch, the
caller's RNG, the loss). The layer profile measures none of it. And each layer's backward is
profiled as its own autograd call, while a stage's B or I makes one call for all its layers:
`autograd_call_ms` measures what a call costs whatever it computes, the profile takes it off
every layer's backward and I, and the runtime's cost per B and I adds it back once. On a model whose actions take a millisecond that work is a tenth of the
step, and it is what makes many small micro-batches slower than a few large ones.

`runtime_overhead` measures both figures with the runtime that codegen emits, on a probe of
two one-layer stages (`nn.Linear(8, 8)`, one sample per micro-batch): the same work is run by
hand and through the runtime, at two micro-batch counts, and the difference is fitted to a
per-step and a per-action cost.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from .types import RuntimeOverhead

_WIDTH = 8
_COUNTS = (4, 16)  # micro-batch counts of the fit


def _probe_class(microbatches: int) -> type:
    from codegen._runtime import PipelineRuntime

    class Probe(PipelineRuntime):
        SCHEDULE = "gpipe"
        MICROBATCHES = microbatches
        STAGES = [(0, 1), (1, 2)]
        RANKS = [0, 0]
        RECOMPUTE = ["never", "never"]

        def train_step(self, x: torch.Tensor, y: Any, loss_fn: Any) -> torch.Tensor:
            M = self.MICROBATCHES
            self.begin(x, y, loss_fn)
            for m in range(M):
                self.forward(0, m)
                self.forward(1, m)
            for m in range(M):
                self.backward(1, m)
                self.backward(0, m)
            return self.finish()

    return Probe


def _by_hand(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, M: int) -> None:
    """The probe's step without the runtime: the same four calls per micro-batch."""
    xs, ys = torch.tensor_split(x, M), torch.tensor_split(y, M)
    kept = []
    for m in range(M):
        h0 = layers[0](xs[m].clone())
        h = h0.detach().requires_grad_(True)
        loss = nn.functional.mse_loss(layers[1](h), ys[m].clone()) * (1 / M)
        kept.append((h0, h, loss))
    for h0, h, loss in kept:
        loss.backward()
        h0.backward(h.grad)


def autograd_call_ms(device: torch.device | str = "cpu", *, calls: int = 200) -> float:
    """The median time of one autograd backward call on a one-element graph: what every call
    costs whatever it computes. The profile times each layer's backward as its own call, while a
    stage makes one call for all its layers."""
    dev = torch.device(device)
    a = torch.ones(1, device=dev, requires_grad=True)
    g = torch.ones(1, device=dev)
    times = []
    for _ in range(calls + calls // 4):
        y = a * 2
        _sync(dev)
        t0 = time.perf_counter()
        torch.autograd.backward([y], [g])
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[calls // 4 :]) * 1e3


def runtime_overhead(
    device: torch.device | str = "cpu", *, rounds: int = 9, warmup: int = 2, call_ms: float = 0.0
) -> RuntimeOverhead:
    """Fit step(M) - by_hand(M) = step_ms + 4 M action_ms over two micro-batch counts, from
    medians of `rounds` alternated runs (each pair side by side, so drift cancels). `call_ms`
    (autograd_call_ms) is passed through: by hand and in the runtime each stage makes one
    autograd call, so the fit does not see it."""
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        got = _fit(dev, rounds, warmup)
    return got.model_copy(update={"call_ms": call_ms})


def _fit(dev: torch.device, rounds: int, warmup: int) -> RuntimeOverhead:
    torch.manual_seed(0)  # (the caller's RNG is restored afterwards)
    layers = [nn.Linear(_WIDTH, _WIDTH).to(dev), nn.Linear(_WIDTH, _WIDTH).to(dev)]
    model = nn.Sequential(*layers)
    extra = {}
    for M in _COUNTS:
        x = torch.randn(M, _WIDTH, device=dev)
        y = torch.randn(M, _WIDTH, device=dev)
        pipe = _probe_class(M)(model, [dev, dev])
        diffs = []
        for k in range(warmup + rounds):
            runtime, by_hand = 0.0, 0.0
            for turn in (k % 2, 1 - k % 2):  # each goes first every other round
                t0 = time.perf_counter()
                if turn:
                    pipe.train_step(x, y, nn.functional.mse_loss)
                else:
                    _by_hand([st[0] for st in pipe.stages], x, y, M)
                _sync(dev)
                if turn:
                    runtime = time.perf_counter() - t0
                else:
                    by_hand = time.perf_counter() - t0
            if k >= warmup:
                diffs.append(runtime - by_hand)
        extra[M] = statistics.median(diffs) * 1e3
        for p in model.parameters():
            p.grad = None
    (m1, m2), (e1, e2) = _COUNTS, (extra[_COUNTS[0]], extra[_COUNTS[1]])
    action = max((e2 - e1) / (4 * (m2 - m1)), 0.0)
    step = max(e1 - 4 * m1 * action, 0.0)
    return RuntimeOverhead(action_ms=action, step_ms=step)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
