"""Where the torchrun program posts its messages: each receive right before the action that reads
it (plain) against the placement chosen by time (insert_comms with the plan's costs), head to
head, with what the simulator predicts for each (issues #7 and #11).

For each example and schedule: one plan (2 devices, `--recompute never`), two torchrun programs
that differ only in where their batches of sends and receives sit, both run in one launch (2
ranks x 1 thread, gloo), step after step in turn; time is the median over the steps, each step
between two barriers.

    OMP_NUM_THREADS=1 python benchmarks/lowering_bench.py [--steps 15] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_bench import print_table  # noqa: E402
from pipelining_bench import cli  # noqa: E402

CASES = [  # (example, batch, micro-batches, schedules)
    ("transformer", 32, 8, ["zb-h1", "interleaved-1f1b", "1f1b"]),
    ("mlp", 256, 8, ["zb-h1", "interleaved-1f1b", "1f1b"]),
]

RANK = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["GPIPE_ROOT"])
from codegen.measure import make_data
from planner.plan import Plan
from profiler.models import as_layers, load_model

out, steps, spec = sys.argv[1], int(sys.argv[2]), sys.argv[3]
pairs = [a.split("=", 1) for a in sys.argv[4:]]
dist.init_process_group("gloo")
rank = dist.get_rank()
pipes = {}
for name, program in pairs:
    ns = {}
    exec(compile(open(program).read(), program, "exec"), ns)
    torch.manual_seed(0)
    model = load_model(spec)
    pipes[name] = ns["Pipeline"](torch.nn.Sequential(*as_layers(model, model.example_input)))
plan = Plan.load(pairs[0][1].replace(".plain.py", ".json").replace(".timed.py", ".json"))
torch.manual_seed(0)
x, y, loss_fn = make_data(load_model(spec), plan)
times = {n: [] for n in pipes}
for k in range(steps + 2):
    for n, pipe in pipes.items():
        for p in pipe.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        pipe.train_step(x, y, loss_fn)
        dist.barrier()
        if k >= 2:  # two warm-up steps
            times[n].append((time.perf_counter() - t0) * 1e3)
if rank == 0:
    with open(os.path.join(out, "times.json"), "w") as f:
        json.dump({n: statistics.median(t) for n, t in times.items()}, f)
dist.barrier()
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(exist_ok=True)

    from codegen.emit import emit_program
    from planner.plan import Plan
    from planner.search import schedule_of, simulate_plan, stage_costs
    from schedules import insert_comms, simulate

    rows = []
    for example, batch, M, schedules in CASES:
        prof = out / f"lw-{example}.json"
        mb = batch // M
        cli("profile", f"example:{example}", "--threads", "1", "--batch-sizes",
            f"{mb // 2},{mb},{2 * mb}", "-o", str(prof))  # fmt: skip
        for schedule in schedules:
            path = out / f"lw-{example}-{schedule}.json"
            cli("plan", str(prof), "--devices", "2", "--memory", "4GiB", "--batch-size",
                str(batch), "--microbatches", str(M), "--schedule", schedule, "--recompute",
                "never", "-o", str(path))  # fmt: skip
            plan = Plan.load(path)
            costs, sched = stage_costs(plan.stages, plan.runtime), schedule_of(plan)
            plain = insert_comms(sched)
            timed = insert_comms(sched, costs)
            predicted = {
                "plain": simulate(plain, costs, memory=False, rendezvous=True).makespan,
                "timed": simulate(timed, costs, memory=False, rendezvous=True).makespan,
            }
            free = simulate_plan(plan, levels=False, rendezvous=False).makespan
            programs = {}
            for name, lowered in (("plain", plain), ("timed", timed)):
                programs[name] = out / f"lw-{example}-{schedule}.{name}.py"
                # emit_program lowers the plan's schedule itself: hand it this lowering
                import codegen.emit as emit

                was = emit.torchrun_schedule
                emit.torchrun_schedule = lambda plan, s, lowered=lowered: lowered
                try:
                    programs[name].write_text(
                        emit_program(plan, target="torchrun", model=f"example:{example}")
                    )
                finally:
                    emit.torchrun_schedule = was
            same = plain.ranks == timed.ranks
            with tempfile.TemporaryDirectory() as tmp:
                script = Path(tmp) / "rank.py"
                script.write_text(RANK)
                env = {**os.environ, "OMP_NUM_THREADS": "1", "GPIPE_ROOT": str(ROOT)}
                t0 = time.perf_counter()
                r = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node=2", str(script), tmp, str(args.steps),
                     f"example:{example}",
                     *[f"{n}={p}" for n, p in programs.items()]],
                    capture_output=True, text=True, env=env,
                )  # fmt: skip
                if r.returncode != 0:
                    raise SystemExit(r.stderr[-3000:])
                ms = json.loads((Path(tmp) / "times.json").read_text())
            print(f"{example} {schedule}: {time.perf_counter() - t0:.0f} s", flush=True)
            rows.append([
                example, schedule, f"{free:.1f}",
                f"{predicted['plain']:.1f}", f"{ms['plain']:.1f}",
                f"{predicted['timed']:.1f}", f"{ms['timed']:.1f}",
                "same program" if same else f"{ms['plain'] / ms['timed']:.2f}x",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    head = ["example", "schedule", "predicted where sends never wait",
            "plain: predicted ms", "plain: measured ms (median)",
            "chosen by time: predicted ms", "chosen by time: measured ms (median)",
            "speed-up"]  # fmt: skip
    print_table(head, rows)


if __name__ == "__main__":
    main()
