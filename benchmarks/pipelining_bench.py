"""Our torchrun program against torch.distributed.pipelining, head to head (issue #11).

Same model, split, micro-batch count and loss; 2 ranks of one thread each over gloo on this
host. In one run, step after step in turn: our emitted torchrun program (the plan's schedule),
torch's ScheduleGPipe and Schedule1F1B on PipelineStages built by hand from our split, and the
same step in one process (rank 0 alone, rank 1 waiting). Each contender's step time is the
median over the steps (each step between two barriers, so the slower rank counts); peak memory
is what one step allocates on each rank, from the allocator's own reports (profiler/memtrack),
on top of the weights. A Chrome trace of rank 0's step under our program is written for a look
at where the time goes. Our programs are planned for torchrun (`--target torchrun`), one per
schedule listed; torch's stages take the first one's split.

    OMP_NUM_THREADS=1 python benchmarks/pipelining_bench.py [--steps 20] [--out bench-out]
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

CASES = [  # (example, batch, micro-batches, our schedules: the first one's split is torch's)
    ("transformer", 32, 8, ["1f1b", "gpipe", "zb-h1"]),
    ("mlp", 256, 8, ["1f1b", "gpipe", "zb-h1"]),
]

RANK = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
import torch.nn.functional as F
sys.path.insert(0, os.environ["GPIPE_ROOT"])
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from planner.plan import Plan
from profiler.memtrack import trace_allocations
from profiler.models import as_layers, load_model

programs, plan_paths, spec, out, steps = sys.argv[1:6]
programs, plan_paths = programs.split(","), plan_paths.split(",")
steps = int(steps)
dist.init_process_group("gloo")
rank = dist.get_rank()
plans = [Plan.load(p) for p in plan_paths]
plan = plans[0]
M = plan.microbatches


def loss_fn(out, y):
    if out.dim() == 3:  # a language model: logits per token
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


def fresh():
    torch.manual_seed(0)
    model = load_model(spec)
    return list(as_layers(model, model.example_input))


torch.manual_seed(1)
example = load_model(spec).example_input
B = plan.batch_size
if example.dtype.is_floating_point:
    x = torch.randn(B, *example.shape[1:])
else:
    x = torch.randint(0, int(example.max()) + 1, (B, *example.shape[1:]))
layers = fresh()
with torch.no_grad():
    logits = torch.nn.Sequential(*layers)(x[:2])
classes = logits.shape[-1]
y = torch.randint(0, classes, (B, *logits.shape[1:-1]))

ours = {}
for program, p in zip(programs, plans):
    ns = {}
    exec(compile(open(program).read(), program, "exec"), ns)
    ours[f"ours ({p.schedule})"] = ns["Pipeline"](torch.nn.Sequential(*fresh()))
ours_params = [q for pipe in ours.values() for q in pipe.parameters()]
first = next(iter(ours))

(a, b) = plan.stages[rank].layers
torch_stages = {}
for name, cls in (("torch ScheduleGPipe", ScheduleGPipe), ("torch Schedule1F1B", Schedule1F1B)):
    mine = torch.nn.Sequential(*fresh()[a:b])
    stage = PipelineStage(mine, rank, 2, torch.device("cpu"))
    torch_stages[name] = (mine, cls(stage, n_microbatches=M, loss_fn=loss_fn))
whole = torch.nn.Sequential(*fresh())


def step_ours(name):
    def run():
        return ours[name].train_step(x if rank == 0 else None, y, loss_fn)
    return run


def step_torch(name):
    def run():
        _, sched = torch_stages[name]
        losses = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        return sum(losses) / len(losses) if losses else None
    return run


def step_single():
    if rank == 0:
        loss = loss_fn(whole(x), y)
        loss.backward()
        return loss.detach()
    return None


def zero():
    for p in ours_params:
        p.grad = None
    for mine, _ in torch_stages.values():
        mine.zero_grad(set_to_none=True)
    whole.zero_grad(set_to_none=True)


contenders = {**{n: step_ours(n) for n in ours}, **{n: step_torch(n) for n in torch_stages},
              "one process": step_single}
times = {n: [] for n in contenders}
peaks, losses = {}, {}
for n, fn in contenders.items():  # warm-up, and one traced step each
    for _ in range(2):
        zero(); dist.barrier(); fn()
    zero(); dist.barrier()
    with trace_allocations() as trace:
        got = fn()
    dist.barrier()
    peaks[n] = max(trace.peaks(lambda owner, device: "all").values(), default=0)
    losses[n] = None if got is None else float(got)
for k in range(steps):
    for n, fn in contenders.items():
        zero()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[n].append((time.perf_counter() - t0) * 1e3)
if rank == 0:
    zero(); dist.barrier()
    with torch.profiler.profile() as prof:
        step_ours(first)()
    dist.barrier()
    prof.export_chrome_trace(os.path.join(out, "ours-rank0.json"))
else:
    zero(); dist.barrier(); step_ours(first)(); dist.barrier()
res = {"rank": rank, "ms": {n: statistics.median(t) for n, t in times.items()},
       "peak": peaks, "loss": losses}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
dist.barrier()
dist.destroy_process_group()
"""


def cli(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                       text=True, env=env)  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(r.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(exist_ok=True)
    rows = []
    for example, batch, M, schedules in CASES:
        prof = out / f"pp-{example}.json"
        mb = batch // M
        cli("profile", f"example:{example}", "--threads", "1", "--batch-sizes",
            f"{mb // 2},{mb},{2 * mb}", "-o", str(prof))  # fmt: skip
        plans, programs = [], []
        for schedule in schedules:
            plan = out / f"pp-{example}-{schedule}-plan.json"
            cli("plan", str(prof), "--devices", "2", "--memory", "4GiB", "--batch-size",
                str(batch), "--microbatches", str(M), "--schedule", schedule, "--recompute",
                "never", "--target", "torchrun", "-o", str(plan))  # fmt: skip
            program = out / f"pp-{example}-{schedule}.py"
            cli("codegen", str(plan), "--model", f"example:{example}", "--target", "torchrun",
                "-o", str(program))  # fmt: skip
            plans.append(plan)
            programs.append(program)
        predicted = {f"ours ({s})": json.loads(p.read_text())["predicted"]["iteration_ms"]
                     for s, p in zip(schedules, plans)}  # fmt: skip
        splits = {f"ours ({s})": json.loads(p.read_text())["stages"][0]["layers"]
                  for s, p in zip(schedules, plans)}  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "rank.py"
            script.write_text(RANK)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GPIPE_ROOT": str(ROOT)}
            t0 = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node=2", str(script), ",".join(map(str, programs)),
                 ",".join(map(str, plans)), f"example:{example}", tmp, str(args.steps)],
                capture_output=True, text=True, env=env,
            )  # fmt: skip
            if r.returncode != 0:
                raise SystemExit(r.stderr[-3000:])
            res = [json.loads((Path(tmp) / f"rank{k}.json").read_text()) for k in range(2)]
            if (Path(tmp) / "ours-rank0.json").exists():
                (Path(tmp) / "ours-rank0.json").replace(out / f"pp-{example}-trace.json")
        print(f"{example}: {time.perf_counter() - t0:.0f} s", flush=True)
        ms = res[0]["ms"]
        base = ms[f"ours ({schedules[0]})"]
        for n in ms:
            loss = res[1]["loss"].get(n) if res[1]["loss"].get(n) is not None else res[0]["loss"][n]
            rows.append([
                example, n, f"{ms[n]:.1f}", f"{ms[n] / base:.2f}x",
                f"{predicted[n]:.1f}" if n in predicted else "",
                str(splits.get(n, splits[f"ours ({schedules[0]})"] if "torch" in n else "")),
                f"{res[0]['peak'][n] / 2**20:.2f}", f"{res[1]['peak'][n] / 2**20:.2f}",
                f"{loss:.5f}",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    head = ["example", "contender", "step ms (median)", "its time / our first",
            "predicted ms (torchrun program)", "stage 0 layers", "rank 0 peak MiB",
            "rank 1 peak MiB", "loss"]  # fmt: skip
    print_table(head, rows)


if __name__ == "__main__":
    main()
