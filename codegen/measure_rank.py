"""One rank of `gpipe-plan measure --target torchrun`: run the emitted torchrun program for a
warm-up step, one step under allocation tracing and `steps` timed steps, and write what this
rank measured to OUT_DIR/rank<r>.json. The parent process puts the ranks together.

    torchrun --nproc-per-node K -m codegen.measure_rank PROGRAM PLAN MODEL OUT_DIR STEPS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from planner.plan import Plan
from profiler.memtrack import trace_allocations
from profiler.models import in_dtype, load_model

from .measure import (
    device_name,
    make_data,
    make_optimizer,
    optimizer_steps,
    static_bytes,
)


def main(argv: list[str]) -> None:
    program, plan_path, model_spec, out_dir, steps = argv
    plan = Plan.load(plan_path)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    try:
        namespace: dict = {}
        exec(compile(Path(program).read_text(), program, "exec"), namespace)
        torch.manual_seed(0)  # the same model and batch on every rank
        model = in_dtype(load_model(model_spec), plan.dtype)
        x, y, loss_fn = make_data(model, plan)
        if plan.captured:  # the program runs the graph its own loader captures (same seed)
            torch.manual_seed(0)
            model = namespace["load_model"]()
        pipe = namespace["Pipeline"](model)
        params = list(pipe.parameters())
        optimizer = make_optimizer(plan.optimizer, params)
        local = sorted(pipe.local)

        def step() -> float:
            """One training step; returns the pipeline's part of it in ms (no optimizer)."""
            t0 = time.perf_counter()
            pipe.train_step(x, y, loss_fn)
            ms = (time.perf_counter() - t0) * 1e3
            optimizer_steps([optimizer], [local[0]], [params])
            return ms

        step()  # warm-up: gradients and optimizer state
        dist.barrier()
        with trace_allocations() as trace:
            step()
        # everything this rank allocates on its device is that device's: what its stages'
        # ranges made, and what it made outside them (counted, and reported as unattributed,
        # so that a miss cannot hide behind the ranges)
        here = device_name(pipe.device)
        whole = trace.peaks(lambda owner, device: 0 if device == here else None).get(0, 0)

        def unowned(owner: str | None, device: str) -> int | None:
            return 0 if device == here and (owner is None or not owner.isdigit()) else None

        other = trace.peaks(unowned).get(0, 0)  # (on this device: a GPU's host memory is not)
        walls, log = [], []
        pipe.action_log = []
        for _ in range(int(steps)):
            dist.barrier()
            walls.append(step())
            log += pipe.action_times()
            pipe.action_log = []
        result = {
            "rank": rank,
            "stages": local,
            "dynamic_peak": whole,
            "other_peak": other,
            "static": static_bytes([pipe.stages[s] for s in local], optimizer),
            "walls": walls,
            "log": log,
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # NOTE: tearing gloo down while a peer is still mid-exit can abort it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
