"""The CUDA side of issue #4, in one run on a machine with a GPU (prints what BENCHMARKS.md needs):

1. parity on CUDA: every schedule x recomputation, all stages on separate streams of one GPU,
   against the un-pipelined model (loss and every gradient, max relative error);
2. speed: a plain loop over micro-batches vs the compiled pipe with its stages on streams of one
   GPU vs torchgpipe (if installed) on ['cuda:0'] * K; then the pipe over several GPUs when the
   machine has them. Medians of interleaved repeats.

    python benchmarks/gpu_check.py [--steps 20] [--device cuda]   (--device cpu: a dry run)
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

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MODES = ["never", "except_last", "always"]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    name = torch.cuda.get_device_name(0) if dev != "cpu" else "cpu"
    n_gpu = torch.cuda.device_count() if dev != "cpu" else 0
    print(f"# {time.strftime('%Y-%m-%d')} | {name} x {n_gpu} | torch {torch.__version__}")
    N, K, M = args.batch, args.devices, args.microbatches

    # 1. Parity on the device, small model.
    small = transformer(vocab=256, d_model=64, heads=4, depth=6, seq_len=32, batch=N)
    xs = torch.randint(0, 256, (N, 32))
    ys = torch.randint(0, 256, (N, 32))
    prof = profile_model(
        copy.deepcopy(small), xs[:8], device=dev, batch_sizes=[N // M], repeats=2, progress=False
    )
    ref = copy.deepcopy(small).to(dev)
    expected = loss_fn(ref(xs.to(dev)), ys.to(dev))
    expected.backward()
    print("\n## parity (stages on separate streams of one device)\n")
    print("| schedule | recompute | loss rel err | max grad rel err |")
    print("|---|---|---|---|")
    for schedule in SCHEDULES:
        for mode in MODES:
            plan = plan_pipeline(
                prof,
                Cluster.uniform(K, "64GiB"),
                N,
                microbatches=M,
                schedule=schedule,
                recompute=mode,
            )
            model = copy.deepcopy(small)
            pipe = compile_pipe(model, plan, devices=[dev] * K)
            loss = pipe.train_step(xs.to(dev), ys.to(dev), loss_fn)
            sync(dev)
            err = max(rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
            print(f"| {schedule} | {mode} | {rel(loss, expected.detach()):.2e} | {err:.2e} |")

    # 2. Speed, a larger model.
    big = transformer(vocab=8192, d_model=args.width, heads=16, depth=12, seq_len=256, batch=N)
    x = torch.randint(0, 8192, (N, 256))
    y = torch.randint(0, 8192, (N, 256))
    prof = profile_model(
        copy.deepcopy(big), x[: N // M], device=dev, batch_sizes=[N // M], repeats=3, progress=False
    )
    try:
        from torchgpipe import GPipe
    except ImportError:
        GPipe = None  # noqa: N806
    print(f"\n## speed: example:transformer d={args.width}, 12 blocks, N={N}, K={K}, M={M}\n")
    print("| setup | schedule | recompute | median ms | vs loop |")
    print("|---|---|---|---|---|")
    for schedule, mode in (("gpipe", "never"), ("1f1b", "never"), ("gpipe", "always")):
        plan = plan_pipeline(
            prof, Cluster.uniform(K, "128GiB"), N, microbatches=M, schedule=schedule, recompute=mode
        )
        balance = (
            [b - a for a, b in (s.layers for s in plan.stages)]
            if plan.stages_per_device == 1
            else None
        )
        loop_model = copy.deepcopy(big).to(dev)
        stages = [loop_model[a:b] for a, b in (s.layers for s in plan.stages)]
        runs = {}

        def run_loop(stages: list[nn.Module] = stages, mode: str = mode) -> None:
            # Micro-batches one after another; each stage checkpointed when the plan recomputes.
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                h = xm.to(dev)
                for st in stages:
                    h = checkpoint(st, h, use_reentrant=False) if mode == "always" else st(h)
                (loss_fn(h, ym.to(dev)) * (xm.shape[0] / N)).backward()

        runs["loop, one stream"] = run_loop
        one = compile_pipe(copy.deepcopy(big), plan, devices=[dev] * K)
        runs["pipe, K streams on one device"] = lambda one=one: one.train_step(x, y, loss_fn)
        if GPipe is not None and balance is not None and schedule == "gpipe":
            gp = GPipe(
                copy.deepcopy(big), balance=balance, devices=[dev] * K, chunks=M, checkpoint=mode
            )
            runs["torchgpipe, one device"] = lambda gp=gp: loss_fn(
                gp(x.to(dev)), y.to(gp.devices[-1])
            ).backward()
        if n_gpu >= K:
            many = compile_pipe(copy.deepcopy(big), plan, devices=[f"cuda:{k}" for k in range(K)])
            runs[f"pipe, {K} GPUs"] = lambda many=many: many.train_step(x, y, loss_fn)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            fn()
        sync(dev)
        for _ in range(args.steps):
            for k, fn in runs.items():
                sync(dev)
                t0 = time.perf_counter()
                fn()
                sync(dev)
                times[k].append((time.perf_counter() - t0) * 1e3)
        base = statistics.median(times["loop, one stream"])
        for k, v in times.items():
            med = statistics.median(v)
            print(f"| {k} | {schedule} | {mode} | {med:.1f} | {med / base:.3f} |")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
