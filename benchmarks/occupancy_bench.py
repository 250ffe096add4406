"""What the planner reads off a deep schedule's issue order, timed alone: the exact occupancy
(schedules/memory.py `occupancy`), the bound above it (`occupancy_bound`) and the floor below it
(`occupancy_floor`), for each schedule kind at K = 64 ranks and M = 256 micro-batches (what
`plan --devices 64 --batch-size 256` reaches). Each figure is computed from empty caches (the
schedule and its issue order are made once beforehand and kept, as the planner keeps them).
Medians of --repeats, in one process; with --baseline, the same script runs under an earlier
checkout in turn, round after round, and the answers must be equal.

    OMP_NUM_THREADS=1 python benchmarks/occupancy_bench.py [--repeats 5] [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [("gpipe", "never"), ("1f1b", "always"), ("interleaved-1f1b", "never"),
         ("zb-h1", "never"), ("zb-h1", "except_last")]  # fmt: skip
K, M = 64, 256


def measure(root: str, repeats: int) -> dict:
    """Per case and figure: the median ms, and a digest of the answer."""
    sys.path.insert(0, root)
    from planner.search import plan_schedule
    from schedules import memory as mm
    from schedules.order import issue_arrays

    out = {}
    for name, mode in CASES:
        sched = plan_schedule(name, K, M, ())
        issue_arrays(sched)  # the issue order, made once and kept (as the planner does)
        for fig, fn in (("exact", mm.occupancy), ("bound", mm.occupancy_bound),
                        ("floor", mm.occupancy_floor)):  # fmt: skip
            samples, got = [], None
            for _ in range(repeats):
                for cache in (mm._EVENTS, mm._BOUNDS, mm._FLOORS):
                    cache.clear()
                t0 = time.perf_counter()
                got = fn(sched, mode)
                samples.append((time.perf_counter() - t0) * 1e3)
            out[f"{name} {mode} {fig}"] = (
                statistics.median(samples),
                hashlib.sha256(repr(got).encode()).hexdigest(),
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", help="an earlier checkout, timed in turn with this one")
    ap.add_argument("--root", help=argparse.SUPPRESS)  # (one side of a comparison)
    args = ap.parse_args()
    if args.root:
        print(json.dumps(measure(args.root, args.repeats)))
        return
    here = str(Path(__file__).resolve().parents[1])
    sides = {"now": here, **({"baseline": args.baseline} if args.baseline else {})}
    got: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(3 if args.baseline else 1):  # rounds, alternated: drift hits both
        for side, root in sides.items():
            run = subprocess.run(
                [sys.executable, __file__, "--root", root, "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            got[side].append(json.loads(run.stdout))
    print(f"# {time.strftime('%Y-%m-%d')}, K = {K}, M = {M}, medians of {args.repeats} x "
          f"{len(got['now'])} rounds")  # fmt: skip
    cols = "| schedule | recompute | figure | " + (
        "baseline ms | now ms | ratio | same answer |" if args.baseline else "ms |"
    )
    print(cols)
    print(
        "|---|---|---|" + "---:|" * (3 if args.baseline else 1) + ("---|" if args.baseline else "")
    )
    for key in got["now"][0]:
        name, mode, fig = key.split()
        now = statistics.median(r[key][0] for r in got["now"])
        if not args.baseline:
            print(f"| {name} | {mode} | {fig} | {now:.1f} |")
            continue
        then = statistics.median(r[key][0] for r in got["baseline"])
        same = got["now"][0][key][1] == got["baseline"][0][key][1]
        print(f"| {name} | {mode} | {fig} | {then:.1f} | {now:.1f} | {then / now:.1f}x | "
              f"{'yes' if same else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
