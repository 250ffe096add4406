"""A recomputed step's time and peak memory, this checkout against another (issue #7: the
runtime re-runs a recomputed stage by hand at its backward's start; it used torch's checkpoint).

Per example model and schedule, every stage recomputing: one plan (made once, by this
checkout, and given to both) on 2 CPU devices, run by the streams program in one process, one
thread. Each checkout runs in a process of its own; the processes alternate, --rounds times,
and each reports the median of --steps train steps after a warm-up one, and each device's
measured peak and the plan's figure for it (`Pipe.measure`; the same plan for both). The
table gives the medians over rounds and the time ratio (this checkout / the other).

    python benchmarks/remat_bench.py --baseline CHECKOUT [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = [(m, s) for m in ("mlp", "transformer") for s in ("gpipe", "1f1b", "zb-h1")]


def _plan(name: str, schedule: str, path: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from planner import Cluster, plan_pipeline
    from profiler import examples, profile_model

    torch.manual_seed(0)
    model = getattr(examples, name)(batch=32)
    x = model.example_input
    prof = profile_model(model, x[:1], batch_sizes=[4, 8], loss_fn=model.example_loss,
                         repeats=3, warmup=1, progress=False, threads=1)  # fmt: skip
    plan = plan_pipeline(prof, Cluster.uniform(2, 1 << 30), 32, microbatches=4,
                         schedule=schedule, recompute="always", checkpoint=())  # fmt: skip
    plan.save(path)


def worker(root: str, name: str, plan_path: str, steps: int) -> None:
    sys.path.insert(0, root)
    import torch

    from codegen import compile_pipe
    from planner import Plan
    from profiler import examples

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(examples, name)(batch=32)
    x = model.example_input
    y = torch.randint(0, 10 if name == "mlp" else 512, (32,) if name == "mlp" else x.shape)
    loss_fn = torch.nn.CrossEntropyLoss()

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.reshape(-1, out.shape[-1]), t.reshape(-1))

    plan = Plan.load(plan_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = compile_pipe(model, plan)
        pipe.train_step(x, y, loss)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            pipe.train_step(x, y, loss)
            times.append(time.perf_counter() - t0)
        report = pipe.measure(x, y, loss, steps=1)
    peaks = [[d.measured_peak_bytes, d.predicted_peak_bytes] for d in report.devices]
    print(json.dumps({"ms": 1000 * statistics.median(times), "peaks": peaks}), flush=True)


def _run(root: Path, name: str, plan: str, steps: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(root), name, plan, str(steps)],
        capture_output=True, text=True, cwd=root,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{root}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peaks(rows: list[dict]) -> str:
    """Each device's measured (planned) peak, KiB: the same every round."""
    return " / ".join(f"{m / 2**10:.0f} ({p / 2**10:.0f})" for m, p in rows[0]["peaks"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=False, help="the other checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        root, name, plan, steps = args.worker
        worker(root, name, plan, int(steps))
        return
    if not args.baseline:
        raise SystemExit("--baseline CHECKOUT is required")
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, python "
          f"{platform.python_version()}, 2 devices, batch 32, M = 4, recompute always, one "
          f"thread, {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print("| model | schedule | step ms now | baseline | now / baseline (min-max) | "
          "peak KiB dev 0 / dev 1, measured (planned): now | baseline |")  # fmt: skip
    print("|---|---|---:|---:|---:|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, schedule in CASES:
            plan = str(Path(tmp) / f"{name}-{schedule}.json")
            _plan(name, schedule, plan)
            now, then = [], []
            for _ in range(args.rounds):
                now.append(_run(ROOT, name, plan, args.steps))
                then.append(_run(Path(args.baseline), name, plan, args.steps))
            ratios = [a["ms"] / b["ms"] for a, b in zip(now, then)]
            a = statistics.median(r["ms"] for r in now)
            b = statistics.median(r["ms"] for r in then)
            print(f"| {name} | {schedule} | {a:.1f} | {b:.1f} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) | {_peaks(now)} | {_peaks(then)} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
