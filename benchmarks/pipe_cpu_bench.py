"""The compiled pipe on CPU against (a) a plain loop over micro-batches with loss.backward() (checkpointing each stage when
the plan recomputes) and
(b) torchgpipe's GPipe with devices=['cpu'] * K: same model, balance, micro-batches and
recomputation. On one CPU nothing overlaps, so this measures the pipeline's own overhead.

torchgpipe is a benchmark-only dependency: pip install torchgpipe==0.0.7 (it runs on torch 2.x).
Runs interleave the contenders (a, b, pipe, a, b, pipe, ...) and report medians and ratios.

    python benchmarks/pipe_cpu_bench.py [--steps 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codegen import compile_pipe  # noqa: E402
from planner import Cluster, plan_pipeline  # noqa: E402
from profiler import profile_model  # noqa: E402
from profiler.examples import transformer  # noqa: E402


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        from torchgpipe import GPipe
    except ImportError:
        GPipe = None  # noqa: N806
        print("torchgpipe not installed: pip install torchgpipe==0.0.7 (comparison (b) skipped)")

    N, K, M = args.batch, args.devices, args.microbatches
    base = transformer(batch=N)
    x = torch.randint(0, 512, (N, 64))
    y = torch.randint(0, 512, (N, 64))
    profile = profile_model(
        copy.deepcopy(base), x[:8], batch_sizes=[N // M], repeats=3, progress=False
    )
    print(f"# {time.strftime('%Y-%m-%d')} | torch {torch.__version__} | {args.threads} threads | "
          f"example:transformer (11 layers), N={N}, K={K}, M={M}, {args.steps} steps each")  # fmt: skip
    print(
        "| schedule | recompute | balance | (a) loop ms | (a') loop in schedule order ms "
        "| (b) torchgpipe ms | pipe ms | pipe / (a) | pipe / (a') | pipe / (b) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for schedule, mode in (("gpipe", "never"), ("gpipe", "always"), ("1f1b", "never")):
        plan = plan_pipeline(
            profile,
            Cluster.uniform(K, "64GiB"),
            N,
            microbatches=M,
            schedule=schedule,
            recompute=mode,
        )
        balance = [b - a for a, b in (s.layers for s in plan.stages)]
        loop_model, gp_model, pipe_model = (copy.deepcopy(base) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = compile_pipe(pipe_model, plan)
        gpipe = (
            GPipe(gp_model, balance=balance, devices=["cpu"] * K, chunks=M, checkpoint=mode)
            if GPipe
            else None
        )

        stages = [loop_model[a:b] for a, b in (s.layers for s in plan.stages)]

        def run_loop() -> None:
            # The reference: micro-batches one after another, each stage checkpointed when the
            # plan recomputes (torch.utils.checkpoint, as the pipe does).
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                h = xm
                for st in stages:
                    h = checkpoint(st, h, use_reentrant=False) if mode == "always" else st(h)
                (loss_fn(h, ym) * (xm.shape[0] / N)).backward()

        def run_loop_in_order() -> None:
            # The same loop, but micro-batches in the schedule's order (fill-drain: every forward,
            # then the backwards last-in first-out): what the pipe does, minus the pipe.
            if schedule != "gpipe":
                return run_loop()
            losses = []
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                h = xm
                for st in stages:
                    h = checkpoint(st, h, use_reentrant=False) if mode == "always" else st(h)
                losses.append(loss_fn(h, ym) * (xm.shape[0] / N))
            for loss in reversed(losses):
                loss.backward()

        def run_gpipe() -> None:
            loss_fn(gpipe(x), y).backward()

        def run_pipe() -> None:
            pipe.train_step(x, y, loss_fn)

        contenders = {"loop": run_loop, "loop in order": run_loop_in_order, "pipe": run_pipe}
        if gpipe is not None:
            contenders["torchgpipe"] = run_gpipe
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for k in contenders:
            contenders[k]()  # warm-up
        for _ in range(args.steps):
            for k, fn in contenders.items():
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        gp = med.get("torchgpipe", float("nan"))
        lo = med["loop in order"]
        print(f"| {schedule} | {mode} | {balance} | {med['loop']:.1f} | {lo:.1f} | {gp:.1f} | {med['pipe']:.1f} | "
              f"{med['pipe'] / med['loop']:.3f} | {med['pipe'] / lo:.3f} | {med['pipe'] / gp:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
