"""Zero bubble's step time, this checkout against a baseline (issue #7's cost of `_Owned`): the
runtime reads a layer's input through `_Owned` so that a gradient handed back as a slice of a
larger one (a concatenation's) is copied out; on every input that costs an autograd node each
way. Models: an MLP of 16 tiny layers (no slice anywhere) and the readers model of
zero_bubble_bench.py's first case (three concatenations).

Each run is a fresh process (the checkout's own code, one thread): profile, plan zb-h1 on 2
devices with 8 micro-batches, 3 warm-up steps, then the median of 30 timed steps of the streams
program. The checkouts alternate, `--repeats` times each; the table gives each side's median of
those medians and the ratio.

    python benchmarks/zb_step_bench.py --baseline CHECKOUT [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("GPIPE_ROOT", Path(__file__).resolve().parents[1]))
MODELS = ("mlp", "readers")


def one(name: str) -> float:
    """The median step (ms) of `name` under the checkout at ROOT."""
    sys.path.insert(0, str(ROOT))
    import warnings

    import torch
    from torch import nn

    from codegen import compile_pipe
    from planner import Cluster, plan_pipeline
    from tests.conftest import even_times, quick_profile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "mlp":
        from profiler.examples import mlp

        model = mlp(width=128, depth=16, batch=32)
        x, loss = model.example_input, "cross_entropy"
        y, loss_fn = torch.randint(0, 10, (32,)), nn.functional.cross_entropy
    else:
        from tests.test_graph import _ReadEach

        model = _ReadEach(C=32)
        x, loss = torch.randn(32, 3, 16, 16), "mse"
        y, loss_fn = torch.randn(32, 3, 16, 16), nn.functional.mse_loss
    prof = even_times(quick_profile(model, x, batch_sizes=[4, 8, 32], loss_fn=loss, threads=1))
    plan = plan_pipeline(
        prof, Cluster.uniform(2, "1GiB"), 32, microbatches=8, schedule="zb-h1", recompute="never"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = compile_pipe(model, plan).program
    for _ in range(3):
        program.train_step(x, y, loss_fn)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        program.train_step(x, y, loss_fn)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="an earlier checkout")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal: a model, in this process)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    sides = {"baseline": Path(args.baseline).resolve(), "now": ROOT}
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, one thread, zb-h1, 2 stages, M=8")
    print("| model | baseline ms | now ms | now / baseline |")
    print("|---|---:|---:|---:|")
    for name in MODELS:
        got: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.repeats):  # (alternated: the machine's drift hits both)
            for side, root in sides.items():
                env = dict(os.environ, GPIPE_ROOT=str(root))
                out = subprocess.run(
                    [sys.executable, __file__, "--baseline", args.baseline, "--one", name],
                    env=env, capture_output=True, text=True, check=True,
                )  # fmt: skip
                got[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        then, now = (statistics.median(got[side]) for side in ("baseline", "now"))
        print(f"| {name} | {then:.2f} | {now:.2f} | {now / then:.2f} |")


if __name__ == "__main__":
    main()
