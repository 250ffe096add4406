"""What the stream checker costs, and what it sees (issue #12).

For the examples' streams programs (K devices, every schedule), in one process on the CPU:
the median time of one plain training step (the CPU branch), of the checker's whole run (two
steps and an inference under the stand-in, CUDA branch), the number of tensor operations it
charged to streams, the streams it tracked, and the problems it found. Contenders alternate.

    python benchmarks/streamcheck_bench.py [--repeats 3] [--devices 4]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codegen import emit_program  # noqa: E402
from planner import Cluster, plan_pipeline  # noqa: E402
from profiler import profile_model  # noqa: E402
from profiler.examples import mlp, transformer  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--devices", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    K = args.devices
    print(f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | "
          f"torch {torch.__version__} | 1 thread | K={K}, M=8\n")  # fmt: skip
    print("| model | schedule | one plain step, ms | checked run (2 steps + inference), ms | ratio "
          "| tensor operations seen | streams | problems |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, build in (("mlp", mlp), ("transformer", transformer)):
        model = build()
        x = model.example_input
        prof = profile_model(copy.deepcopy(model), x, repeats=1, warmup=0, progress=False)
        out = model(x)
        y = torch.randint(0, out.shape[-1], out.shape[:-1])  # a class per sample (or token)

        def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(o.reshape(-1, o.shape[-1]), t.reshape(-1))

        for schedule in SCHEDULES:
            plan = plan_pipeline(
                prof, Cluster.uniform(K, "64GiB"), x.shape[0], microbatches=8, schedule=schedule
            )
            program = types.ModuleType("program")
            exec(compile(emit_program(plan), "program.py", "exec"), program.__dict__)
            plain = program.Pipeline(copy.deepcopy(model), ["cpu"] * K)
            seen: dict[str, int] = {}

            def checked(program=program) -> None:
                check = program.StreamCheck
                issued = check.issued
                count = [0]

                def counting(self, *a):  # noqa: ANN001, ANN202
                    count[0] += 1
                    seen["streams"] = len(self.streams)
                    return issued(self, *a)

                check.issued = counting
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        problems = program.check_pipeline(
                            lambda: program.Pipeline(
                                copy.deepcopy(model), [f"cuda:{k}" for k in range(K)]
                            ),
                            x, y, loss_fn,
                        )  # fmt: skip
                finally:
                    check.issued = issued
                seen.update(ops=count[0], problems=len(problems))

            times: dict[str, list[float]] = {"plain": [], "checked": []}
            runs = {
                "plain": lambda plain=plain: plain.train_step(x, y, loss_fn),
                "checked": checked,
            }
            for _ in range(args.repeats):
                for k, fn in runs.items():
                    t0 = time.perf_counter()
                    fn()
                    times[k].append((time.perf_counter() - t0) * 1e3)
            p, c = statistics.median(times["plain"]), statistics.median(times["checked"])
            print(f"| {name} | {schedule} | {p:.1f} | {c:.1f} | {c / p:.1f} | {seen['ops']} | "
                  f"{seen['streams']} | {seen['problems']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
