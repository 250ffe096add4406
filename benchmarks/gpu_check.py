"""The CUDA side of the project in one run on a machine with a GPU; prints one table for
BENCHMARKS.md (issues #4, #7, #12). Meant to finish in under 5 minutes on one GPU.

Rows 1-12, a small transformer, every schedule x recomputation mode, stages on streams of one GPU:
  - parity: the pipelined step's loss and every gradient against the un-pipelined model (max
    relative error);
  - the stream checker's verdict on the same program and layout (run on the CPU: problems found);
  - predicted against measured (Pipe.measure): the largest per-device peak-memory error and the
    step time;
  - speed: the pipe against a plain loop over the same micro-batches (medians of interleaved
    repeats).
Rows 13-15, a larger transformer: speed of the plain loop, the pipe on streams of one GPU, and
torchgpipe (when installed) on the same device; the pipe over K GPUs when the machine has them.

    python benchmarks/gpu_check.py [--steps 20] [--device cuda]   (--device cpu: a dry run)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codegen import check_streams, compile_pipe  # noqa: E402
from planner import Cluster, plan_pipeline  # noqa: E402
from profiler import profile_model  # noqa: E402
from profiler.examples import transformer  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MODES = ["never", "except_last", "always"]
COLUMNS = [
    "model", "schedule", "recompute", "loss rel err", "max grad rel err", "stream check",
    "worst peak-memory err", "step ms predicted", "step ms measured", "loop ms", "pipe ms",
    "pipe / loop", "other",
]  # fmt: skip


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def cell(fn: Callable[[], str]) -> str:
    """A cell's text; a failure shows as its exception's name and message, the row goes on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one bad cell must not lose the whole table
        return f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:60]}"


def medians(runs: dict[str, Callable[[], object]], steps: int, dev: str) -> dict[str, float]:
    """Median ms of each contender, interleaved so that drift hits all alike."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(steps):
        for k, fn in runs.items():
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def loop(model: nn.Module, plan, x, y, dev: str) -> Callable[[], None]:
    """The same micro-batches one after another, each stage checkpointed when the plan
    recomputes it: what the pipe must beat."""
    stages = [model[a:b] for a, b in (s.layers for s in plan.stages)]
    modes = [s.recompute for s in plan.stages]
    M, N = plan.microbatches, x.shape[0]

    def run() -> None:
        for m, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
            h = xm.to(dev)
            for st, mode in zip(stages, modes):
                again = mode == "always" or (mode == "except_last" and m < M - 1)
                h = checkpoint(st, h, use_reentrant=False) if again else st(h)
            (loss_fn(h, ym.to(dev)) * (xm.shape[0] / N)).backward()

    return run


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
    name = torch.cuda.get_device_name(0) if dev != "cpu" else "cpu (dry run)"
    n_gpu = torch.cuda.device_count() if dev != "cpu" else 0
    N, K, M = args.batch, args.devices, args.microbatches
    started = time.perf_counter()
    print(f"# {time.strftime('%Y-%m-%d')} | {name} x {n_gpu} | torch {torch.__version__}")
    print(f"# K={K} stages on streams of {dev}, batch {N} as M={M} micro-batches\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))

    def row(values: dict[str, str]) -> None:
        print("| " + " | ".join(values.get(c, "") for c in COLUMNS) + " |", flush=True)

    # 1. A small transformer: parity, the checker, predicted vs measured, speed vs a loop.
    small = transformer(vocab=256, d_model=64, heads=4, depth=6, seq_len=32, batch=N)
    xs, ys = torch.randint(0, 256, (N, 32)), torch.randint(0, 256, (N, 32))
    prof = profile_model(
        copy.deepcopy(small), xs[:8], device=dev, batch_sizes=[N // M], repeats=2, progress=False
    )
    ref = copy.deepcopy(small).to(dev)
    expected = loss_fn(ref(xs.to(dev)), ys.to(dev))
    expected.backward()
    for schedule in SCHEDULES:
        for mode in MODES:
            plan = plan_pipeline(
                prof, Cluster.uniform(K, "64GiB"), N, microbatches=M, schedule=schedule,
                recompute=mode,
            )  # fmt: skip
            r = {"model": "transformer d=64", "schedule": schedule, "recompute": mode}
            model = copy.deepcopy(small)
            pipe = compile_pipe(model, plan, devices=[dev] * K)
            loss = pipe.train_step(xs.to(dev), ys.to(dev), loss_fn)
            sync(dev)
            r["loss rel err"] = f"{rel(loss, expected.detach()):.1e}"
            pairs = list(zip(model.parameters(), ref.parameters()))
            r["max grad rel err"] = cell(
                lambda: f"{max(rel(p.grad, q.grad) for p, q in pairs):.1e}"
            )

            def checked(plan=plan) -> str:
                found = check_streams(small, plan, xs, ys, loss_fn, ["cuda:0"] * K)
                return "clean" if not found else f"{len(found)}: {found[0][:80]}"

            r["stream check"] = cell(checked)
            report = None

            def measured(pipe=pipe) -> str:
                nonlocal report
                report = pipe.measure(xs.to(dev), ys.to(dev), loss_fn, steps=3)
                worst = max(report.devices, key=lambda d: abs(d.memory_error))
                return f"{worst.memory_error:+.1%} ({worst.name})"

            r["worst peak-memory err"] = cell(measured)
            if report is not None:
                r["step ms predicted"] = f"{report.predicted_step_ms:.2f}"
                r["step ms measured"] = f"{report.measured_step_ms:.2f} ({report.step_error:+.0%})"
            timed = medians(
                {
                    "loop": loop(copy.deepcopy(small).to(dev), plan, xs, ys, dev),
                    "pipe": lambda pipe=pipe: pipe.train_step(xs.to(dev), ys.to(dev), loss_fn),
                },
                max(3, args.steps // 4),
                dev,
            )
            r["loop ms"], r["pipe ms"] = f"{timed['loop']:.2f}", f"{timed['pipe']:.2f}"
            r["pipe / loop"] = f"{timed['pipe'] / timed['loop']:.2f}"
            row(r)

    # 2. Speed on a larger transformer: loop, pipe on one GPU, torchgpipe, pipe over K GPUs.
    big = transformer(vocab=8192, d_model=args.width, heads=16, depth=12, seq_len=256, batch=N)
    x, y = torch.randint(0, 8192, (N, 256)), torch.randint(0, 8192, (N, 256))
    prof = profile_model(
        copy.deepcopy(big), x[: N // M], device=dev, batch_sizes=[N // M], repeats=3, progress=False
    )
    try:
        from torchgpipe import GPipe
    except ImportError:
        GPipe = None  # noqa: N806
    for schedule, mode in (("gpipe", "never"), ("1f1b", "never"), ("gpipe", "always")):
        plan = plan_pipeline(
            prof, Cluster.uniform(K, "128GiB"), N, microbatches=M, schedule=schedule, recompute=mode
        )
        one = compile_pipe(copy.deepcopy(big), plan, devices=[dev] * K)
        runs: dict[str, Callable[[], object]] = {
            "loop": loop(copy.deepcopy(big).to(dev), plan, x, y, dev),
            "pipe": lambda one=one: one.train_step(x, y, loss_fn),
        }
        balance = [b - a for a, b in (s.layers for s in plan.stages)]
        if GPipe is not None and schedule == "gpipe" and plan.stages_per_device == 1:
            gp = GPipe(copy.deepcopy(big), balance=balance, devices=[dev] * K, chunks=M,
                       checkpoint=mode)  # fmt: skip
            runs["torchgpipe"] = lambda gp=gp: loss_fn(
                gp(x.to(dev)), y.to(gp.devices[-1])
            ).backward()
        if n_gpu >= K:
            many = compile_pipe(copy.deepcopy(big), plan, devices=[f"cuda:{k}" for k in range(K)])
            runs[f"pipe on {K} GPUs"] = lambda many=many: many.train_step(x, y, loss_fn)
        timed = medians(runs, args.steps, dev)
        others = ", ".join(
            f"{k} {v:.1f} ms ({v / timed['loop']:.2f})" for k, v in timed.items()
            if k not in ("loop", "pipe")
        )  # fmt: skip
        row({
            "model": f"transformer d={args.width}", "schedule": schedule, "recompute": mode,
            "loop ms": f"{timed['loop']:.1f}", "pipe ms": f"{timed['pipe']:.1f}",
            "pipe / loop": f"{timed['pipe'] / timed['loop']:.2f}", "other": others or "-",
        })  # fmt: skip
    print(f"\n# {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
