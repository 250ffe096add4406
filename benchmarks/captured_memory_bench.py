"""Predicted against measured peak memory, per device, for the captured-graph examples (U-Net,
ResNet, GPT) under every schedule, with and without recomputation (issue #7).

Memory is measured in one process (`gpipe-plan measure`, streams target: the allocator's own
reports, charged to the stage whose action made each allocation). A captured graph's skips
cross stages, which is where the plan's memory model is hardest to get right; `check` is only
safe if no row shows the run holding more than the plan says.

    python benchmarks/captured_memory_bench.py [--memory 64MiB] [--out DIR]
        [--target streams|torchrun] [--root CHECKOUT]

`--target torchrun` plans for the torchrun program and measures it (one process per device,
one thread each; the profile taken with one thread too), on the U-Net's splits whose last
stage takes a skip straight from the first, with fewer micro-batches than devices and more.
`--root` runs another checkout's command line (to compare with an earlier version).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # (example, devices, batch, micro-batches, sizes profiled)
    ("unet", 4, 16, 2, "1,2,4,8"),
    ("resnet", 2, 16, 2, "2,4,8"),
    ("gpt", 2, 16, 2, "1,2,4,8"),
]
TORCHRUN_CASES = [
    ("unet", 3, 8, 2, "1,2,4"),
    ("unet", 3, 12, 3, "1,2,4"),
    ("unet", 4, 8, 2, "1,2,4"),
    ("unet", 4, 24, 6, "1,2,4"),
]
SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
MODES = ["never", "always"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, check=False
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="64MiB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--target", choices=["streams", "torchrun"], default="streams")
    ap.add_argument("--root", default=None, help="the checkout whose cli.py runs")
    args = ap.parse_args()
    global ROOT
    ROOT = Path(args.root).resolve() if args.root else ROOT
    torchrun = args.target == "torchrun"
    cases, schedules = (TORCHRUN_CASES, [*SCHEDULES, "interleaved-1f1b"]) if torchrun else (
        CASES, SCHEDULES)  # fmt: skip
    threads = ["--threads", "1"] if torchrun else []
    out = Path(args.out or tempfile.mkdtemp(prefix="captured-mem-"))
    out.mkdir(parents=True, exist_ok=True)
    print("| model | devices x M | schedule | recompute | device | predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst_under = 0.0
    for name, K, N, M, sizes in cases:
        prof = out / f"{name}.{sizes}.profile.json"
        r = (
            cli("profile", f"example:{name}", "--batch-sizes", sizes, *threads, "-o", str(prof))
            if not prof.exists()
            else None
        )
        if r is not None and r.returncode:
            sys.exit(r.stderr)
        for schedule in schedules:
            for mode in MODES:
                plan = out / f"{name}.{K}.{M}.{schedule}.{mode}.plan.json"
                report = out / f"{name}.{K}.{M}.{schedule}.{mode}.measure.json"
                r = cli("plan", str(prof), "--devices", str(K), "--memory", args.memory,
                        "--batch-size", str(N), "--microbatches", str(M), "--schedule", schedule,
                        "--recompute", mode, "--target", args.target, "-o", str(plan))  # fmt: skip
                if r.returncode:
                    if "interleaved-1f1b needs" in r.stderr:
                        continue
                    sys.exit(r.stderr)
                r = cli("measure", str(plan), "--model", f"example:{name}", "--steps", "1",
                        "-o", str(report))  # fmt: skip
                if r.returncode not in (0, 1):  # (1: a device over its prediction, reported)
                    sys.exit(r.stderr)
                for d in json.loads(report.read_text())["devices"]:
                    p, m = d["predicted_peak_bytes"], d["measured_peak_bytes"]
                    worst_under = max(worst_under, m / p - 1)
                    print(f"| {name} | {K} x {M} | {schedule} | {mode} | {d['name']} | {p} | {m} "
                          f"| {100 * (m / p - 1):+.2f}% |", flush=True)  # fmt: skip
    print(f"\nthe most a run held above its prediction: {100 * worst_under:+.2f}%")


if __name__ == "__main__":
    main()
