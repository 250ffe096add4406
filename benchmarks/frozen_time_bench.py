"""A frozen front's step time: the plan's prediction against `measure`'s, under torchrun.

A fine-tuning's frozen front (twelve Linear(512) + GELU blocks) before a trained head (three
Linear(512) + ReLU, a Linear(512, 16)): wide activations for little compute, so the hand-offs
count. Profiled at 8, 16 and 32 samples on one thread; the links measured on this host
(`gpipe-plan links --nproc-per-node 2 --threads 1`); planned for torchrun on those two ranks,
batch 128 in 8 micro-batches, GPipe and 1F1B; each plan measured (`measure --target torchrun`)
for --steps steps, --rounds times, the schedules alternated. With --baseline CHECKOUT the same
profile and cluster are planned by that checkout too (its prediction beside this one's).

The step's error mixes two things: how long each action and message takes, and what waits for
what. The replay separates them: the plan's schedule simulated with each stage's F and B times
as the last measure measured them (its medians; the links as planned), once with the frozen
cut's gradient counted as sent (as before) and once without (now).

    python benchmarks/frozen_time_bench.py [--rounds 3] [--steps 10] [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    front = [m for _ in range(12) for m in (nn.Linear(512, 512), nn.GELU())]
    head = [m for _ in range(3) for m in (nn.Linear(512, 512), nn.ReLU())]
    m = nn.Sequential(*front, *head, nn.Linear(512, 16))
    for layer in front:
        layer.requires_grad_(False)
    m.example_input = torch.randn(64, 512)
    return m
"""


def cli(root: Path, *args: str, cwd: Path) -> dict | None:
    """Run one gpipe-plan command of the checkout at `root`; the JSON it wrote (-o), if any."""
    out = None
    if "-o" in args:
        out = cwd / args[args.index("-o") + 1]
    done = subprocess.run([sys.executable, str(root / "cli.py"), *args], cwd=cwd,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args[:2])}: {done.stderr.strip()[-2000:]}")
    return json.loads(out.read_text()) if out is not None else None


def replay(plan_file: Path, report: dict) -> tuple[float, float]:
    """The plan's torchrun step simulated with the measured per-stage F and B medians: with
    every stage sending gradients back, and as the plan counts them (see module doc)."""
    sys.path.insert(0, str(ROOT))
    from planner.plan import Plan
    from planner.search import stage_costs, torchrun_schedule
    from schedules import simulate

    plan = Plan.model_validate_json(plan_file.read_text())
    got = {(a["stage"], a["kind"]): a["measured_ms"] for a in report["actions"]}
    S = len(plan.stages)
    costs = stage_costs(plan.stages, plan.runtime, plan.device_type,
                        step_sync_ms=plan.cluster.step_sync_ms)  # fmt: skip
    ran = dataclasses.replace(
        costs, forward=[got[(s, "F")] for s in range(S)],
        backward=[got[(s, "B")] for s in range(S)], action_overhead=0.0, call_overhead=0.0,
    )  # fmt: skip
    lowered = torchrun_schedule(plan)
    old, now = (
        simulate(lowered, dataclasses.replace(ran, sends_grads=sends), memory=False,
                 rendezvous=True).makespan
        for sends in (None, costs.sends_grads)
    )  # fmt: skip
    return old, now


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--baseline", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "front.py").write_text(MODEL)
        cluster = cli(ROOT, "links", "--nproc-per-node", "2", "--threads", "1",
                      "--memory", "4GiB", "-o", "cluster.json", cwd=d)  # fmt: skip
        assert cluster is not None
        link = cluster["links"][0]
        cli(ROOT, "profile", "front.py:model", "--batch-sizes", "8,16,32", "--loss", "mse",
            "--threads", "1", "-o", "profile.json", cwd=d)  # fmt: skip
        schedules = ("gpipe", "1f1b")
        plans, before = {}, {}
        for s in schedules:
            common = ("plan", "profile.json", "--cluster", "cluster.json", "--batch-size", "128",
                      "--microbatches", "8", "--schedule", s, "--recompute", "never",
                      "--target", "torchrun")  # fmt: skip
            plans[s] = cli(ROOT, *common, "-o", f"plan-{s}.json", cwd=d)
            if args.baseline is not None:
                old = cli(args.baseline, *common, "-o", f"old-{s}.json", cwd=d)
                before[s] = old["predicted"]["iteration_ms"]  # type: ignore[index]
        measured: dict[str, list[float]] = {s: [] for s in schedules}
        replays: dict[str, list[tuple[float, float]]] = {s: [] for s in schedules}
        for _ in range(args.rounds):
            for s in schedules:
                rep = cli(ROOT, "measure", f"plan-{s}.json", "--model", "front.py:model",
                          "--target", "torchrun", "--steps", str(args.steps),
                          "-o", f"measure-{s}.json", cwd=d)  # fmt: skip
                assert rep is not None
                measured[s].append(rep["measured_step_ms"])
                replays[s].append(replay(d / f"plan-{s}.json", rep))
    print(f"python {platform.python_version()}, links: hand-off latency "
          f"{link['latency_ms']:.2f} ms, bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"{args.rounds} rounds of {args.steps} steps")  # fmt: skip
    print()
    print(
        "| schedule | split | predicted before ms | predicted now ms | measured ms, median "
        "(min-max) | before | now | replay before ms | replay now ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in schedules:
        plan = plans[s]
        assert plan is not None
        now = plan["predicted"]["iteration_ms"]
        got = statistics.median(measured[s])
        split = [st["layers"] for st in plan["stages"]]
        old = before.get(s)
        print(f"| {s} | {split} | {old:.2f} |" if old is not None else f"| {s} | {split} | - |",
              f"{now:.2f} | {got:.2f} ({min(measured[s]):.2f}-{max(measured[s]):.2f}) |",
              f"{(old - got) / got:+.1%} |" if old is not None else "- |",
              f"{(now - got) / got:+.1%} |",
              f"{statistics.median(r[0] for r in replays[s]):.2f} |",
              f"{statistics.median(r[1] for r in replays[s]):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
