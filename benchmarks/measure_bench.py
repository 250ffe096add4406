"""Predicted against measured, per device: peak memory and step time, for the examples and every
schedule, on this CPU (issue #7).

Memory is measured in one process (`gpipe-plan measure`, streams target: the allocator's own
reports per stage); time with the torchrun target, one process per device and one thread each.
The profile is taken with one thread too, and the links between the two ranks are measured
first with `gpipe-plan links` (gloo over loopback: hand-offs to a receiver that waited while its
sender computed, as a pipeline's are, fitted to latency + bytes / bandwidth), so the plan's
cluster describes the machine the step runs on (an idle ping-pong's fit is printed beside it).
Each plan is made for the program whose time is compared (`--target torchrun`: its ranks wait
for each other where sends meet receives); the time the same plan takes where sends never wait
is listed beside it.

    OMP_NUM_THREADS=1 python benchmarks/measure_bench.py [--steps 5] [--out bench-out]

On a GPU: `--device cuda:0` profiles there and measures the streams target with both stages on
that GPU (named in the cluster); the torchrun target then needs a GPU per rank and is skipped
with fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # (example, batch, micro-batches)
    ("mlp", 64, 8),
    ("transformer", 32, 8),
]
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]

PING = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
out = {}
for n in [2**k for k in range(10, 23, 2)]:
    t = torch.zeros(n // 4)
    samples = []
    for i in range(25):
        dist.barrier()
        t0 = time.perf_counter()
        if r == 0:
            dist.send(t, 1); dist.recv(t, 1)
        else:
            dist.recv(t, 0); dist.send(t, 0)
        samples.append((time.perf_counter() - t0) * 1e3 / 2)
    out[n] = sorted(samples)[len(samples) // 2]
if r == 0:
    print(repr(out))
dist.destroy_process_group()
"""


def link() -> tuple[float, float]:
    """(latency ms, bytes per second) of one gloo transfer between two local ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ping.py"
        script.write_text(PING)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", str(script)],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
    times = eval(run.stdout.strip().splitlines()[-1])  # {bytes: ms}
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    latency = max(my - slope * mx, 0.0)
    return latency, 1e3 / slope


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, env=env
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", default="mlp,transformer")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    import torch

    from planner.plan import Plan
    from planner.search import simulate_plan

    torchrun = not cuda or torch.cuda.device_count() >= 2
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    latency, bandwidth = link()
    print(f"gloo ping-pong: latency {latency:.3f} ms, bandwidth {bandwidth / 1e9:.2f} GB/s")
    cluster = out / "cluster.json"
    r = cli("links", "--nproc-per-node", "2", "--memory", "4GiB", "--device", "cuda" if
            torchrun and cuda else "cpu", "-o", str(cluster))  # fmt: skip
    assert r.returncode == 0, r.stderr
    print(r.stdout.strip(), flush=True)
    measured = json.loads(cluster.read_text())
    if cuda:
        for k, d in enumerate(measured["devices"]):
            d["torch_device"] = args.device if not torchrun else f"cuda:{k}"
        cluster.write_text(json.dumps(measured))

    rows, serial = [], []
    for example, batch, M in [c for c in CASES if c[0] in args.examples.split(",")]:
        prof = out / f"{example}.json"
        mb = batch // M
        sizes = ",".join(str(b) for b in sorted({max(1, mb // 2), mb, 2 * mb}))
        t0 = time.perf_counter()
        threads = [] if cuda else ["--threads", "1"]
        r = cli("profile", f"example:{example}", *threads, "--batch-sizes", sizes,
                "--device", args.device, "-o", str(prof))  # fmt: skip
        assert r.returncode == 0, r.stderr
        print(f"profiled {example} in {time.perf_counter() - t0:.0f} s", flush=True)
        for schedule in SCHEDULES:
            plan = out / f"{example}-{schedule}.json"
            r = cli("plan", str(prof), "--cluster", str(cluster), "--batch-size", str(batch),
                    "--microbatches", str(M), "--schedule", schedule, "--recompute", "never",
                    "--target", "torchrun" if torchrun else "streams", "-o", str(plan))  # fmt: skip
            assert r.returncode == 0, r.stderr
            reports = {}
            for target in ("streams", "torchrun") if torchrun else ("streams",):
                rep = out / f"{example}-{schedule}-{target}.json"
                r = cli("measure", str(plan), "--model", f"example:{example}", "--target",
                        target, "--steps", str(args.steps), "-o", str(rep))  # fmt: skip
                assert r.returncode in (0, 1), r.stderr
                reports[target] = json.loads(rep.read_text())
            mem = reports["streams"]
            run = reports.get("torchrun", mem)
            planned = Plan.load(plan)
            free = simulate_plan(planned, levels=False, rendezvous=False).makespan
            free += (planned.cluster.step_sync_ms or 0.0) if torchrun else 0.0
            # the same program without the runtime's own costs (profile.runtime), as before
            bare = simulate_plan(
                planned.model_copy(update={"runtime": None, "lowering": None}),
                levels=False,
                rendezvous=torchrun,
            ).makespan
            # the model before late receives and the step's all-reduces were in it
            older = planned.model_copy(update={  # (its own fastest lowering, found again)
                "lowering": None,
                "cluster": planned.cluster.model_copy(update={"step_sync_ms": None}),
                "stages": [st.model_copy(update={"late_send_ms": None}) for st in planned.stages],
            })  # fmt: skip
            before = simulate_plan(older, levels=False, rendezvous=torchrun).makespan
            if not cuda:  # one process on the CPU: the stages take turns, no link to wait on
                turns = simulate_plan(planned, levels=False, rendezvous=False)
                rt = planned.runtime
                alone = sum(turns.busy) + (rt.step_ms if rt is not None else 0.0)
                actions = len([sp for sp in turns.spans if sp.action.kind.is_compute])
                alone_bare = alone - (rt.action_ms * actions + rt.step_ms if rt else 0.0)
                got = mem["measured_step_ms"]
                serial.append([
                    example, schedule, f"{got:.1f}", f"{alone:.1f}",
                    f"{100 * (got - alone) / alone:+.1f}%", f"{alone_bare:.1f}",
                    f"{100 * (got - alone_bare) / alone_bare:+.1f}%",
                ])  # fmt: skip
            for d, t in zip(mem["devices"], run["devices"]):
                rows.append([
                    example, schedule, d["name"],
                    f"{d['predicted_peak_bytes'] / 2**20:.2f}",
                    f"{d['measured_peak_bytes'] / 2**20:.2f}",
                    f"{100 * d['memory_error']:+.1f}%",
                    f"{100 * t['memory_error']:+.1f}%",
                    f"{free:.1f}",
                    f"{run['predicted_step_ms']:.1f}",
                    f"{run['measured_step_ms']:.1f} ({run['step_range_ms'][0]:.1f}-"
                    f"{run['step_range_ms'][1]:.1f})",
                    f"{100 * run['step_error']:+.1f}%",
                    f"{before:.1f}",
                    f"{100 * (run['measured_step_ms'] - before) / before:+.1f}%",
                    f"{100 * (run['measured_step_ms'] - bare) / bare:+.1f}%",
                ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    head = ["example", "schedule", "device", "predicted peak MiB", "measured peak MiB",
            "memory error", "memory error (torchrun)", "step ms where sends never wait",
            "predicted step ms (the program)",
            "measured step ms (torchrun, median (fastest-slowest))", "step error",
            "predicted without late receives and the step's all-reduces", "its error",
            "step error without the runtime's overhead"]  # fmt: skip
    print_table(head, rows)
    if serial:
        print_table(["example", "schedule", "measured step ms (one process)",
                     "predicted: every action in turn", "error",
                     "predicted without the runtime's costs", "error "], serial)  # fmt: skip


def print_table(head: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, as BENCHMARKS.md holds them."""
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
