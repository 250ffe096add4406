"""Partition solve time: L layers on K stages, exact solver, one core.

Layer costs are random (seeded) with a mild memory limit that binds on some cuts, the worst case
for the probe (its reachable sets are widest when memory, not time, trims them). Prints a table;
medians of --repeats runs. Also times the whole `gpipe-plan plan` command on example:transformer.

    python benchmarks/partition_bench.py [--repeats 5] [--skip-cli]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.costs import Chain  # noqa: E402
from planner.cpsat import solve_partition_cpsat  # noqa: E402
from planner.dp import solve_partition_dp  # noqa: E402
from planner.memory import MemoryModel, StageShape  # noqa: E402
from planner.partition import StageSpec, solve_partition  # noqa: E402


def chain(L: int, seed: int = 0) -> Chain:
    rng = np.random.default_rng(seed)
    zeros = np.zeros(L, dtype=np.int64)
    forward, backward, input_grad = (rng.uniform(0.5, 2.0, L), rng.uniform(1.0, 4.0, L),
                                     rng.uniform(0.5, 1.0, L))  # fmt: skip
    params, saved = rng.integers(1_000, 100_000, L), rng.integers(1_000, 50_000, L)
    transient, boundary = rng.integers(0, 20_000, L), rng.integers(1_000, 10_000, L + 1)
    return Chain(
        mb=1, forward=forward, backward=backward, input_grad=input_grad,
        weight_grad=rng.uniform(0.5, 1.0, L), params=params, largest_param=params, buffers=zeros,
        saved=saved, shared=zeros, input_saved=zeros, loss_saved=zeros,
        forward_transient=transient, backward_transient=transient, input_unsaved=zeros,
        forward_peak=transient, input_grad_transient=transient, weight_grad_transient=transient,
        zgrad=boundary[1:], grad_in=boundary[:-1], boundary=boundary, num_model_layers=L,
    )  # fmt: skip


def link_costs(c: Chain, K: int, seed: int = 1) -> list[np.ndarray]:
    """Per cut: a transfer costing up to 1.5x an even stage's work, and one boundary in fifty
    not allowed."""
    rng = np.random.default_rng(seed)
    even = float((c.forward + c.backward).sum()) / K
    return [
        np.where(rng.random(c.num_layers + 1) < 0.02, np.inf, rng.uniform(0, 1.5 * even, c.num_layers + 1))
        for _ in range(K - 1)
    ]  # fmt: skip


def specs(c: Chain, K: int) -> list[StageSpec]:
    # eight micro-batches' activations and the running layer's transient
    shape = StageShape(occupancy=((0, 8, 0, 0, 0, 0, 1, 0, 0, 0, 0),), optimizer_slots=2)
    whole = int(MemoryModel(c).total(0, c.num_layers, shape)[0])
    return [StageSpec(1.0, int(1.5 * whole / K), shape)] * K  # binds: 1.5x an even share


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-cli", action="store_true")
    args = ap.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d')} | {cpu_name()} | "
        f"python {platform.python_version()} | numpy {np.__version__} | "
        f"threads pinned to 1: {os.environ.get('OMP_NUM_THREADS') == '1'}"
    )
    print(
        "| L | K | probe median ms (min-max) | probes | bottleneck | DP agrees | CP-SAT ms, agrees "
        "| with link costs: probe median ms (min-max) | bottleneck | DP agrees |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for L in (100, 1_000, 10_000):
        c = chain(L)
        times = c.forward + c.backward
        for K in (4, 16, 64):
            sp = specs(c, K)
            samples, part = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                part = solve_partition(times, MemoryModel(c), sp)
                samples.append((time.perf_counter() - t0) * 1e3)
            assert part is not None
            agrees, cp = "-", "-"
            if L <= 100:
                dp = solve_partition_dp(times, MemoryModel(c), sp)
                agrees = "yes" if dp is not None and dp.bottleneck == part.bottleneck else "NO"
                t0 = time.perf_counter()
                sat = solve_partition_cpsat(times, MemoryModel(c), sp, time_limit_s=60)
                ms = (time.perf_counter() - t0) * 1e3
                # CP-SAT works on times rounded to ns: equal to within that rounding.
                same = sat is not None and abs(sat.bottleneck - part.bottleneck) <= 1e-6 * L
                proven = "" if sat is not None and sat.extra["optimal"] else " (not proven)"
                cp = f"{ms:.0f}, {'yes' if same else 'NO'}{proven}"
            cuts = link_costs(c, K)
            linked, lpart = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                lpart = solve_partition(times, MemoryModel(c), sp, cuts)
                linked.append((time.perf_counter() - t0) * 1e3)
            lagrees = "-"
            if L <= 100:
                ldp = solve_partition_dp(times, MemoryModel(c), sp, cuts)
                same = (ldp is None) == (lpart is None)
                same = same and (ldp is None or ldp.bottleneck == lpart.bottleneck)
                lagrees = "yes" if same else "NO"
            med, lmed = statistics.median(samples), statistics.median(linked)
            print(
                f"| {L} | {K} | {med:.1f} ({min(samples):.1f}-{max(samples):.1f}) "
                f"| {part.probes} | {part.bottleneck:.4f} | {agrees} | {cp} "
                f"| {lmed:.1f} ({min(linked):.1f}-{max(linked):.1f}) "
                f"| {f'{lpart.bottleneck:.4f}' if lpart else 'no split fits'} "
                f"| {lagrees} |"
            )
    if args.skip_cli:
        return
    with tempfile.TemporaryDirectory() as tmp:
        prof = Path(tmp) / "profile.json"
        subprocess.run([sys.executable, str(ROOT / "cli.py"), "profile", "example:transformer", "-o", str(prof)],
                       check=True, capture_output=True)  # fmt: skip
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, str(ROOT / "cli.py"), "plan", str(prof), "--devices", "4", "--memory",
                 "64MiB", "--batch-size", "32", "-o", str(Path(tmp) / "plan.json")],
                check=True, capture_output=True,
            )  # fmt: skip
            samples.append((time.perf_counter() - t0) * 1e3)
        print(
            f"\n`gpipe-plan plan` on example:transformer (11 layers, K=4, N=32, all M/schedule/"
            f"recompute candidates), whole process: median {statistics.median(samples):.0f} ms "
            f"(min {min(samples):.0f}, max {max(samples):.0f}) over {args.repeats} runs"
        )


if __name__ == "__main__":
    main()
