"""A frozen front's step time: the plan's prediction against `measure`'s, under torchrun.

A fine-tuning's frozen front (twelve Linear(512) + GELU blocks) before a trained head (three
Linear(512) + ReLU, a Linear(512, 16)): wide activations for little compute, so the hand-offs
count. Profiled at 8, 16 and 32 samples on one thread; the links measured on this host
(`gpipe-plan links --nproc-per-node 2 --threads 1`); planned for torchrun on those two ranks,
batch 128 in 8 micro-batches, GPipe and 1F1B; each plan measured (`measure --target torchrun`)
for --steps steps, --rounds times, the schedules alternated. With --baseline CHECKOUT the same
profile and cluster are planned by that checkout too (its prediction beside this one's).

    python benchmarks/frozen_time_bench.py [--rounds 3] [--steps 10] [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
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
        for _ in range(args.rounds):
            for s in schedules:
                rep = cli(ROOT, "measure", f"plan-{s}.json", "--model", "front.py:model",
                          "--target", "torchrun", "--steps", str(args.steps),
                          "-o", f"measure-{s}.json", cwd=d)  # fmt: skip
                measured[s].append(rep["measured_step_ms"])  # type: ignore[index]
    print(f"python {platform.python_version()}, links: hand-off latency "
          f"{link['latency_ms']:.2f} ms, bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"{args.rounds} rounds of {args.steps} steps")  # fmt: skip
    print()
    print(
        "| schedule | split | predicted before ms | predicted now ms | measured ms, median "
        "(min-max) | before | now |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
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
              f"{(now - got) / got:+.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
