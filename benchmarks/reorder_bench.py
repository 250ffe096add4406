"""`gpipe-plan plan --allow-reorder` on clusters described by host: the whole process, one core.

The example transformer and mlp are profiled once (one thread, so both contenders read the
same file); each cluster is planned by this checkout and, with --baseline, by an earlier one,
alternated run by run. Prints the device orders planned, the seconds (median), and whether
the two plans are the same (split, schedule, predicted time and peaks).

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/reorder_bench.py [--repeats 1]
        [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_bench import _timed  # noqa: E402

FAST = {"bandwidth_bytes_per_s": 1e10}
SLOW = {"bandwidth_bytes_per_s": 1e8, "latency_ms": 0.05}


def cluster(hosts: str, memories: list[str], speeds: list[float] | None = None,
            links: tuple[dict, dict] = (FAST, SLOW)) -> dict:  # fmt: skip
    return {
        "kind": "cluster",
        "devices": [
            {"name": f"{h}{k}", "memory_bytes": m, "host": h, "speed": v}
            for k, (h, m, v) in enumerate(zip(hosts, memories, speeds or [1.0] * len(hosts)))
        ],
        "links": {"intra_host": links[0], "inter_host": links[1]},
    }


CASES = [  # (label, model, batch size, cluster)
    ("8 alike devices, 2 hosts listed a, b, a, b, ...", "transformer", 32,
     cluster("abababab", ["16MiB"] * 8)),
    ("4 devices of 4 sizes, 2 hosts (a, b, a, b)", "transformer", 32,
     cluster("abab", ["12MiB", "16MiB", "24MiB", "32MiB"])),
    ("6 alike devices, 3 hosts (a, b, c, a, b, c)", "mlp", 64, cluster("abcabc", ["8MiB"] * 6)),
    ("a red team's: 4 devices of 4 sizes and 3 speeds, 2 hosts (a, b, a, b)", "gpt", 10,
     cluster("abab", ["6MiB", "64MiB", "12MiB", "5MiB"], [1.0, 0.5, 2.0, 1.0],
             ({"bandwidth_bytes_per_s": 1e9, "latency_ms": 0.01},
              {"bandwidth_bytes_per_s": 1e7, "latency_ms": 0.5}))),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--baseline", help="a checkout of an earlier commit, run alternately")
    args = ap.parse_args()
    exe = [sys.executable, str(ROOT / "cli.py")]
    base = [sys.executable, str(Path(args.baseline) / "cli.py")] if args.baseline else None
    print(f"# {time.strftime('%Y-%m-%d')}, python {sys.version.split()[0]}")
    print("| cluster | model | orders (baseline / now) | baseline s | now s | ratio | same plan |")
    print("|---|---|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {}
        for model, batch in {(c[1], c[2]) for c in CASES}:
            # (measured up to the whole batch: no figure is extended past the profile, which
            # the two checkouts may do apart)
            sizes = ",".join(map(str, sorted({1, 2, 4, 8, batch})))
            profiles[model] = Path(tmp) / f"{model}.json"
            subprocess.run([*exe, "profile", f"example:{model}", "--batch-sizes", sizes,
                            "--threads", "1", "-o", str(profiles[model])],
                           check=True, capture_output=True)  # fmt: skip
        for label, model, batch, spec in CASES:
            path = Path(tmp) / "cluster.json"
            path.write_text(json.dumps(spec))

            def run(prog: list[str], out: Path) -> tuple[float, dict]:
                cmd = [*prog, "plan", str(profiles[model]), "--cluster", str(path),
                       "--batch-size", str(batch), "--allow-reorder", "-o", str(out)]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                return time.perf_counter() - t0, json.loads(out.read_text())

            now, then = [], []
            for _ in range(args.repeats):
                if base:
                    wall, old = run(base, Path(tmp) / "base.json")
                    then.append(wall)
                wall, plan = run(exe, Path(tmp) / "plan.json")
                now.append(wall)
            orders = plan["solver"]["method"].split(", ")[-1].split()[0]
            b = statistics.median(now)
            if base:
                a = statistics.median(then)
                was = old["solver"]["method"].split(", ")[-1].split()[0]
                same = _timed(old) == _timed(plan)
                print(f"| {label} | {model} | {was} / {orders} | {a:.2f} | {b:.2f} | {a / b:.1f}x "
                      f"| {'yes' if same else 'NO'} |", flush=True)  # fmt: skip
            else:
                print(f"| {label} | {model} | {orders} | | {b:.2f} | | |", flush=True)


if __name__ == "__main__":
    main()
