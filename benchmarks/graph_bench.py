"""Graph models (issue #10): capture, profile and plan a 48-block GPT-2-style model (tied
embedding and head) and a ResNet-sized residual net; record the wall time of each part, the
cuts found, the predicted bubble, and predicted against measured memory per device (the streams
target in this process, every allocation read off the allocator: `Pipe.measure`).

    OMP_NUM_THREADS=1 python benchmarks/graph_bench.py [--devices 4] [--steps 1]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure_bench import print_table  # noqa: E402

from codegen.pipe import compile_pipe  # noqa: E402
from planner import Cluster, plan_pipeline  # noqa: E402
from profiler.examples import gpt, resnet  # noqa: E402
from profiler.graph import capture  # noqa: E402
from profiler.measure import profile_model  # noqa: E402

MiB = 2**20


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def cases() -> list[tuple[str, nn.Module, torch.Tensor, object]]:
    g = gpt(depth=48, d_model=128, heads=4, vocab=2048, seq_len=64, batch=16)
    r = resnet(widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3), size=64, classes=100, batch=16)
    return [
        ("gpt 48 blocks", g, torch.randint(0, 2048, (16, 64)), lm_loss),
        ("resnet 3-4-6-3", r, torch.randint(0, 100, (16,)), nn.functional.cross_entropy),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--memory", default="4GiB")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.devices} devices of {args.memory}, 1 thread")  # fmt: skip
    walls, mem = [], []
    for name, model, y, loss_fn in cases():
        x = model.example_input
        params = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        layers = capture(model, x)
        t1 = time.perf_counter()
        prof = profile_model(layers, x, repeats=3, warmup=1, progress=False)
        t2 = time.perf_counter()
        plan = plan_pipeline(prof, Cluster.uniform(args.devices, args.memory), x.shape[0])
        t3 = time.perf_counter()
        cuts = ", ".join(
            f"{layers[a].unit}..{layers[b - 1].unit}" for a, b in (st.layers for st in plan.stages)
        )
        walls.append([
            name, f"{params / 1e6:.1f}M", str(len(layers)), f"{t1 - t0:.1f}", f"{t2 - t1:.1f}",
            f"{t3 - t2:.1f}", f"M={plan.microbatches} {plan.schedule} {plan.recompute}",
            f"{plan.predicted.bubble_fraction:.1%}", cuts,
        ])  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(layers, plan)
        report = pipe.measure(x, y, loss_fn, steps=args.steps)
        for d in report.devices:
            p, m = d.predicted_peak_bytes, d.measured_peak_bytes
            mem.append([name, d.name, f"{p / MiB:.1f}", f"{m / MiB:.1f}", f"{(p - m) / m:+.1%}"])
        print(f"{name}: done", file=sys.stderr, flush=True)
    print_table(
        ["model", "params", "layers", "capture s", "profile s", "plan s", "plan", "bubble",
         "stages (first..last layer)"],
        walls,
    )  # fmt: skip
    print_table(["model", "device", "predicted peak MiB", "measured peak MiB", "error"], mem)


if __name__ == "__main__":
    main()
