"""One stage's backward against the sum of its layers' backwards, each its own autograd call as
the profiler times them (issue #7): the difference is the per-call cost that the profile now
takes off each layer and the runtime's cost per B adds back once.

Stages of the example mlp (Linear/ReLU pairs, width 256) and of the example transformer, at one
micro-batch size; in each round the stage's layers are timed one call each, then the stage in
one call, side by side; medians over the rounds.

    OMP_NUM_THREADS=1 python benchmarks/backward_call_bench.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from profiler.examples import mlp, transformer  # noqa: E402
from profiler.models import as_layers  # noqa: E402
from profiler.overhead import autograd_call_ms  # noqa: E402


def _ms(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def compare(name: str, layers: list[torch.nn.Module], x: torch.Tensor, rounds: int) -> list[str]:
    per_layer, stage = [], []
    for r in range(rounds + rounds // 4):
        h, ins = x, []
        with torch.no_grad():
            for layer in layers:
                ins.append(h)
                h = layer(h)
        total = 0.0
        for layer, inp in zip(layers, ins):
            inp = inp.detach().requires_grad_(inp.is_floating_point())
            out = layer(inp)
            g = torch.ones_like(out)
            total += _ms(lambda: torch.autograd.backward([out], [g]))  # noqa: B023
        first = ins[0].detach().requires_grad_(ins[0].is_floating_point())
        out = first
        for layer in layers:
            out = layer(out)
        g = torch.ones_like(out)
        one = _ms(lambda: torch.autograd.backward([out], [g]))  # noqa: B023
        if r >= rounds // 4:
            per_layer.append(total)
            stage.append(one)
    a, b = statistics.median(per_layer), statistics.median(stage)
    return [name, str(len(layers)), f"{a:.3f}", f"{b:.3f}", f"{(a - b) / (len(layers) - 1):.4f}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    m = mlp()
    rows.append(compare("mlp, layers 0-8, micro-batch 8", list(m)[:9], torch.randn(8, 256),
                        args.rounds))  # fmt: skip
    t = transformer()
    layers = list(as_layers(t, t.example_input))
    rows.append(compare("transformer, layers 1-5, micro-batch 4", layers[1:6],
                        layers[0](t.example_input[:4]).detach(), args.rounds // 4))  # fmt: skip
    call = statistics.median(autograd_call_ms() for _ in range(5))
    print(f"one autograd call on a one-element graph: {call:.4f} ms (median of 5 medians)")
    print("| stage | layers | sum of the layers' backwards ms | the stage's backward ms | "
          "difference per extra call ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
