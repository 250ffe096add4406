"""Compute after a wait: how much slower a stage's forward and backward run right after the
process paused, on this machine (issue #7: where the mlp's step time goes).

A pipeline rank waits for its peers between actions, and the profile times each layer in a
tight loop. This times the mlp's first stage (its first 8 layers, a micro-batch of 8 rows, one
thread) after pauses of several lengths, paused by sleeping (as a rank blocked in a receive
does) or by spinning, alone or beside a second process doing the same (as the other rank of a
2-rank pipeline does). Medians over `--reps` steps per row; a pause of 0 is the profile's
condition.

    python benchmarks/idle_bench.py [--reps 150]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAUSES_MS = (0.0, 0.2, 1.0, 5.0, 20.0)


def one_process(mode: str, reps: int) -> dict[float, tuple[float, float]]:
    """{pause ms: (forward ms, backward ms)}, medians, in this process."""
    import torch

    sys.path.insert(0, str(ROOT))
    from profiler.examples import mlp

    torch.set_num_threads(1)
    stage = torch.nn.Sequential(*list(mlp())[:8])
    x = torch.randn(8, 256)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        y = stage(x.requires_grad_())
        t1 = time.perf_counter()
        y.sum().backward()
        return t1 - t0, time.perf_counter() - t1

    def pause(seconds: float) -> None:
        if mode == "sleep":
            time.sleep(seconds)
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

    for _ in range(200):
        step()
    out = {}
    for ms in PAUSES_MS:
        fwd, bwd = [], []
        for _ in range(reps):
            if ms:
                pause(ms / 1e3)
            f, b = step()
            fwd.append(f * 1e3)
            bwd.append(b * 1e3)
        out[ms] = (statistics.median(fwd), statistics.median(bwd))
    return out


def run(mode: str, reps: int, beside: bool) -> dict[float, tuple[float, float]]:
    """One measuring process (and, `beside`, a second one doing the same at the same time)."""
    cmd = [sys.executable, __file__, "--child", mode, "--reps", str(reps)]
    other = subprocess.Popen(cmd, stdout=subprocess.DEVNULL) if beside else None
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    if other is not None:
        other.wait()
    return {float(k): tuple(v) for k, v in json.loads(res.stdout).items()}  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_process(args.child, args.reps)))
        return
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {platform.processor()}")
    print("| pause | how | forward ms | backward ms | forward x | backward x |")
    print("|---|---|---|---|---|---|")
    for beside in (False, True):
        for mode in ("sleep", "spin"):
            res = run(mode, args.reps, beside)
            f0, b0 = res[0.0]
            for ms, (f, b) in res.items():
                how = f"{mode}{', beside another' if beside else ''}"
                print(f"| {ms:g} ms | {how} | {f:.3f} | {b:.3f} | {f / f0:.2f} | {b / b0:.2f} |")


if __name__ == "__main__":
    main()
