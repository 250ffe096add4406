"""How long a distributed Pipe's ranks take to stop once a step fails on one of them, the caller
catching the error (issue #11, failure behaviour).

Each case is one torchrun launch of K ranks (gloo, one thread each) running the mlp example
under a plan of the given schedule; the step fails on one rank (a forward pre-hook raising at
the given micro-batch on that rank's first layer), after a good step, and every rank catches
the StageError. The failing rank notes when its error came; every other rank notes when its
watchdog halts it (the runtime's own halt, wrapped to write the time first) or, where its own
wait failed first, when its error came; torchrun's end is timed from outside (wall clock, one
host). The table gives, per case, the failing rank's time to its error, the most any other rank
took after that to stop, and when the launch ended, over --repeats launches (median, min-max).

    python benchmarks/stop_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # (schedule, ranks, failing rank, micro-batch it fails at)
    ("gpipe", 2, 1, 0),
    ("gpipe", 4, 3, 3),
    ("1f1b", 2, 0, 1),
    ("1f1b", 4, 1, 2),
    ("interleaved-1f1b", 2, 1, 2),
    ("zb-h1", 4, 2, 1),
]


def rank_main(out: str, plan_path: str, bad: int, at: int) -> None:
    """Under torchrun: one failing step, caught; this rank's times as JSON."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from codegen import StageError, compile_pipe
    from planner.plan import Plan
    from profiler.examples import mlp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = mlp(width=256, depth=8, batch=64)
    plan = Plan.load(plan_path)
    calls, armed = [], False

    def boom(module, args):
        if armed and type(args[0]).__name__ != "FakeTensor":  # (the shape pass: fakes)
            calls.append(1)
            if len(calls) == at + 1:
                raise ValueError("boom")

    if rank == bad:
        first = next(st for st in plan.stages if st.rank == rank).layers[0]
        model[first].register_forward_pre_hook(boom)
    pipe = compile_pipe(model, plan, distributed=True)
    runtime = type(pipe.program)
    halt = runtime.halt

    def timed_halt(message: str) -> None:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"began": began, "ended": time.time(), "what": message}, f)
        halt(message)

    runtime.halt = staticmethod(timed_halt)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    pipe.train_step(x, y, nn.CrossEntropyLoss())  # a good step first: shapes worked out
    armed = True
    dist.barrier()
    began = time.time()
    try:
        pipe.train_step(x, y, nn.CrossEntropyLoss())
        ended, what = time.time(), "ran"
    except StageError as e:
        ended, what = time.time(), str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"began": began, "ended": ended, "what": what}, f)
    time.sleep(60)  # (the failing rank: torchrun ends it once a peer halts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from planner import Cluster, plan_pipeline
    from profiler.examples import mlp
    from profiler.measure import profile_model

    model = mlp(width=256, depth=8, batch=64)
    profile = profile_model(model, model.example_input, batch_sizes=[8, 16], repeats=2)
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, python "
          f"{platform.python_version()}, torch gloo on loopback, 1 thread per rank")  # fmt: skip
    print(
        "| schedule | ranks | failing rank, micro-batch | failing rank's error s | "
        "last peer stopped after it, ms | launch ended after it, s | every peer named it |"
    )
    print("|---|---:|---|---:|---:|---:|---|")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for schedule, K, bad, at in CASES:
        plan = plan_pipeline(profile, Cluster.uniform(K, "4GiB"), 64, microbatches=8,
                             schedule=schedule, recompute="never")  # fmt: skip
        own, after, ended, named = [], [], [], True
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "plan.json"
                plan.save(path)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={K}", __file__, "--rank", tmp, str(path), str(bad),
                       str(at)]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
                end = time.time()
                if done.returncode == 0 or "boom" not in done.stderr:
                    sys.exit(done.stderr[-3000:])
                got = {r: json.loads(p.read_text()) for r in range(K)
                       if (p := Path(tmp) / f"rank{r}.json").exists()}  # fmt: skip
            origin = got[bad]
            own.append(origin["ended"] - origin["began"])
            # a rank torchrun ended before it wrote anything stopped no later than the launch
            after.append(max(got[r]["ended"] if r in got else end for r in range(K))
                         - origin["ended"])  # fmt: skip
            ended.append(end - origin["ended"])
            named &= (
                all(
                    got[r]["what"].startswith(f"rank {r} stopped: rank {bad} failed: ")
                    for r in got
                    if r != bad
                )
                and "ValueError: boom" in origin["what"]
            )

        def spread(v: list[float], scale: float) -> str:
            return (f"{statistics.median(v) * scale:.2f} ({min(v) * scale:.2f}-"
                    f"{max(v) * scale:.2f})")  # fmt: skip

        print(
            f"| {schedule} | {K} | {bad}, {at} | {spread(own, 1)} | {spread(after, 1e3)} | "
            f"{spread(ended, 1)} | {'yes' if named else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
