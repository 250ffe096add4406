"""Frozen parameters (a fine-tuning): the plan's peak per device against `measure`'s, for a
frozen prefix and a frozen suffix, every schedule, SGD and Adam.

Six Linear(256) + ReLU blocks, the first four (or the last four) Linears frozen, profiled at
1, 2 and 4 samples, planned on two devices for a batch of 8 in 4 micro-batches, one step
measured in process (the streams program; memory from the allocator's events: exact, not
timed). With --baseline CHECKOUT the same runs in that checkout too, side by side.

    python benchmarks/frozen_bench.py [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rows(root: Path) -> list[dict]:
    sys.path.insert(0, str(root))
    import torch
    from torch import nn

    from codegen import compile_pipe
    from codegen.measure import make_data
    from planner import Cluster, plan_pipeline
    from profiler import profile_model

    def build(part: str) -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())])
        for k in range(0, 8) if part == "first" else range(4, 12):
            model[k].requires_grad_(False)
        return model

    out = []
    for part in ("first", "last"):
        prof = profile_model(build(part), torch.randn(4, 256), batch_sizes=[1, 2, 4], repeats=1,
                             warmup=0, max_repeats=1, overhead=False, progress=False,
                             loss_fn="mse", threads=1)  # fmt: skip
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            for optimizer in ("sgd", "adam"):
                plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                                     schedule=schedule, recompute="never",
                                     optimizer=optimizer)  # fmt: skip
                model = build(part)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pipe = compile_pipe(model, plan)
                x, y, loss_fn = make_data(model, plan)
                devices = pipe.measure(x, y, loss_fn, steps=1).devices
                out.append({
                    "case": f"{part} | {schedule} | {optimizer}",
                    "split": [list(st.layers) for st in plan.stages],
                    "peaks": [(d.predicted_peak_bytes, d.measured_peak_bytes) for d in devices],
                })  # fmt: skip
    return out


def _errors(row: dict) -> str:
    return ", ".join(f"{100 * (p - m) / m:+.1f}%" for p, m in row["peaks"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="a checkout of an earlier commit, run the same way")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # (a baseline's run)
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(rows(Path(args.root))))
        return
    then = None
    if args.baseline:
        done = subprocess.run(
            [sys.executable, __file__, "--json", "--root", str(Path(args.baseline).resolve())],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        then = json.loads(done.stdout.splitlines()[-1])
    now = rows(ROOT)
    head = "| frozen | schedule | optimizer | split | "
    head += "before: predicted - measured | now |" if then else "predicted - measured |"
    print(head + " now, the most bytes apart |")
    print("|---|---|---|---|---|---|" + ("---|" if then else ""))
    for k, row in enumerate(now):
        before = f" {_errors(then[k])} |" if then else ""
        worst = max(abs(p - m) for p, m in row["peaks"])
        print(f"| {row['case']} | {row['split']} |{before} {_errors(row)} | {worst} |")


if __name__ == "__main__":
    main()
