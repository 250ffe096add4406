"""Simulator speed: K = 64 ranks, M = 512 micro-batches, interleaved 1F1B with v = 2 (131 072
compute actions), compute-only and with SEND/RECV inserted; plus the other schedules at the same
size. Medians of --repeats runs, one process, one core.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/simulate_bench.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedules import Costs, build_schedule, insert_comms, simulate  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, float, float, object]:
    samples, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), min(samples), max(samples), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    K, M = 64, 512
    print(f"# {time.strftime('%Y-%m-%d')} | K={K} ranks, M={M} | medians of {args.repeats}")
    print(
        "| schedule | stages | actions | build ms | simulate ms (min-max) | with comms: actions | simulate ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, v in (("interleaved-1f1b", 2), ("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)):
        S = K * v
        build, _, _, sched = timed(lambda: build_schedule(name, S, M, stages_per_rank=v), 1)  # noqa: B023
        costs = Costs.uniform(S, 1.0, 2.0, transfer=[0.05] * (S - 1))
        med, lo, hi, _ = timed(lambda: simulate(sched, costs), args.repeats)  # noqa: B023
        lowered = insert_comms(sched)
        cmed, _, _, _ = timed(lambda: simulate(lowered, costs), args.repeats)  # noqa: B023
        n = sum(len(a) for a in sched.ranks.values())
        nc = sum(len(a) for a in lowered.ranks.values())
        print(
            f"| {name} | {S} | {n} | {build:.0f} | {med:.0f} ({lo:.0f}-{hi:.0f}) | {nc} | {cmed:.0f} |"
        )


if __name__ == "__main__":
    main()
