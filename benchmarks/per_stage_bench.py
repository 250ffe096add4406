"""Per-stage recomputation and checkpointed layers against the best single mode, on the example
transformer under tight budgets (issue #9): predicted by the plan, and measured by running the
plans.

For each budget per device: the best plan whose stages all recompute the same way (the search
over M and schedule, once per mode), the best plan where each stage chooses its own
(`--recompute per_stage`, no checkpointed layers), and the planner's own choice (`--recompute
auto`, which also tries layers under checkpoints of their own). Each is then run: the streams
target for memory (each device's peak from the allocator) and the torchrun target for time (one
process per device, one thread each, gloo links measured first), `--steps` timed steps, median.

    OMP_NUM_THREADS=1 python benchmarks/per_stage_bench.py [--budgets 16MiB,24MiB] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure_bench import cli, link, print_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="16MiB,20MiB,24MiB")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    latency, bandwidth = link()
    print(f"gloo link: latency {latency:.3f} ms, bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prof = out / "transformer.json"
        r = cli("profile", "example:transformer", "--threads", "1", "--batch-sizes", "1,2,4,8",
                "-o", str(prof))  # fmt: skip
        assert r.returncode == 0, r.stderr
        for budget in args.budgets.split(","):
            cluster = out / "cluster.json"
            cluster.write_text(json.dumps({
                "kind": "cluster",
                "devices": [{"name": f"rank{k}", "memory_bytes": budget}
                            for k in range(args.devices)],
                "links": [{"bandwidth_bytes_per_s": bandwidth, "latency_ms": latency}]
                * (args.devices - 1),
            }))  # fmt: skip
            plans = {}
            for mode in ("never", "except_last", "always", "per_stage", "auto"):
                path = out / f"{mode}.json"
                ck = "auto" if mode == "auto" else "none"
                r = cli("plan", str(prof), "--cluster", str(cluster), "--batch-size",
                        str(args.batch_size), "--recompute", mode, "--checkpoint-layers", ck,
                        "-o", str(path))  # fmt: skip
                if r.returncode == 0:
                    plans[mode] = (path, json.loads(path.read_text()))
            single = [m for m in ("never", "except_last", "always") if m in plans]
            if not single or "per_stage" not in plans or "auto" not in plans:
                print(f"{budget}: no plan fits", flush=True)
                continue
            best = min(single, key=lambda m: plans[m][1]["predicted"]["iteration_ms"])
            results = {}
            for label, mode in (("single", best), ("per-stage", "per_stage"), ("auto", "auto")):
                path, plan = plans[mode]
                reports = {}
                for target in ("streams", "torchrun"):
                    rep = out / f"{mode}-{target}.json"
                    r = cli("measure", str(path), "--model", "example:transformer", "--target",
                            target, "--steps", str(args.steps), "-o", str(rep))  # fmt: skip
                    assert r.returncode in (0, 1), r.stderr
                    reports[target] = json.loads(rep.read_text())
                stages = [st["recompute"] for st in plan["stages"]]
                what = (f"M={plan['microbatches']} {plan['schedule']} "
                        + (plan["recompute"] if plan["recompute"] != "per_stage"
                           else "per stage: " + ",".join(stages))
                        + (f", layers {plan['checkpointed']} checkpointed"
                           if plan.get("checkpointed") else ""))  # fmt: skip
                mem = reports["streams"]["devices"]
                results[label] = (
                    what,
                    plan["predicted"]["iteration_ms"],
                    reports["torchrun"]["measured_step_ms"],
                    max(d["predicted_peak_bytes"] for d in mem),
                    max(d["measured_peak_bytes"] for d in mem),
                )
            sp, sm = results["single"][1], results["single"][2]
            for label in ("single", "per-stage", "auto"):
                w, p, m, pk, mk = results[label]
                rows.append([budget, label, w, f"{p:.1f}", f"{m:.1f}", f"{sp / p:.3f}x",
                             f"{sm / m:.3f}x", f"{pk / 2**20:.2f} / {mk / 2**20:.2f}"])  # fmt: skip
                print(" | ".join(rows[-1]), flush=True)
    head = ["budget", "contender", "plan", "predicted ms", "measured ms (torchrun)",
            "gain predicted", "gain measured", "peak MiB predicted / measured"]  # fmt: skip
    print_table(head, rows)


if __name__ == "__main__":
    main()
