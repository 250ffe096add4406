"""Skips sent straight to the stage that reads them (issue #10, item 2): a U-Net over 4 stages,
each schedule. Side by side, per stage: what it receives when every value live at its first cut
is relayed to it (the old hand-off), and what it receives now (only what its layers read, each
value straight from the stage that made it); the bytes a step moves between stages both ways;
and predicted against measured peak memory per device for the routed pipeline (the streams
target in this process, every allocation read off the allocator: `Pipe.measure`).

    OMP_NUM_THREADS=1 python benchmarks/routes_bench.py [--devices 4] [--steps 2]
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
from profiler.examples import unet  # noqa: E402
from profiler.graph import capture  # noqa: E402
from profiler.measure import profile_model  # noqa: E402

KiB = 2**10
MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.devices} devices, 1 thread")  # fmt: skip
    model = unet(width=16, depth=3, size=32, batch=8)
    x = model.example_input
    layers = capture(model, x)
    prof = profile_model(layers, x, repeats=3, warmup=1, progress=False)
    relay = prof.model_copy(update={"captured": False})  # every live value to the next stage
    inputs, moved, mem = [], [], []
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        kw = dict(microbatches=4, schedule=schedule, recompute="never")
        plan = plan_pipeline(prof, Cluster.uniform(args.devices, "4GiB"), x.shape[0], **kw)
        bounds = [st.layers for st in plan.stages]
        old = plan_pipeline(relay, Cluster.uniform(args.devices, "4GiB"), x.shape[0], **kw)
        mb = plan.microbatch_size
        relayed = [prof.input_bytes * mb] + [
            prof.layers[i - 1].output_bytes * mb for i, _ in bounds[1:]
        ]
        got = [st.input_bytes for st in plan.stages]
        inputs.append([schedule, " / ".join(f"{a // KiB}->{b // KiB}" for a, b in zip(relayed, got)),
                       ", ".join(f"{s}->{t}" for s, t in plan.routes)])  # fmt: skip
        # per step, both ways (gradients of floating-point values go back the same way)
        M = plan.microbatches
        moved.append([schedule, f"{2 * M * sum(relayed[1:]) / MiB:.2f}",
                      f"{2 * M * sum(got[1:]) / MiB:.2f}",
                      f"{sum(got[1:]) / sum(relayed[1:]):.2f}"])  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(layers, plan)
        report = pipe.measure(x, torch.randn_like(x), nn.functional.mse_loss, steps=args.steps)
        for d, o in zip(report.devices, old.predicted.peak_memory):
            p, m = d.predicted_peak_bytes, d.measured_peak_bytes
            mem.append([schedule, d.name, f"{o / MiB:.2f}", f"{p / MiB:.2f}", f"{m / MiB:.2f}",
                        f"{(p - m) / m:+.1%}"])  # fmt: skip
        print(f"{schedule}: done", file=sys.stderr, flush=True)
    print_table(["schedule", "stage input KiB, relayed -> routed", "routes"], inputs)
    print_table(["schedule", "relayed MiB/step", "routed MiB/step", "ratio"], moved)
    print_table(["schedule", "device", "relay model, own split, MiB", "predicted peak MiB",
                 "measured peak MiB", "error"], mem)  # fmt: skip


if __name__ == "__main__":
    main()
