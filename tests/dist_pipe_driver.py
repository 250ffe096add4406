"""Run under torchrun by test_codegen: compile_pipe(model, plan, distributed=True) on every rank,
one training step against the un-pipelined model; each rank writes what it found as JSON.

    torchrun --nproc-per-node K tests/dist_pipe_driver.py [--torch] OUT_DIR PLAN [PLAN ...]
    torchrun --nproc-per-node K tests/dist_pipe_driver.py --fail OUT_DIR PLAN
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.environ["GPIPE_ROOT"])
from codegen.pipe import compile_pipe  # noqa: E402
from planner.plan import Plan  # noqa: E402
from profiler.artifact import InputError  # noqa: E402
from profiler.examples import mlp  # noqa: E402


def reference_step() -> tuple:
    """The model, its un-pipelined copy after one step, the batch, the loss and its value."""
    torch.manual_seed(0)
    model = mlp(width=32, depth=4, batch=8)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    loss_fn = nn.CrossEntropyLoss()
    expected = loss_fn(reference(x), y)
    expected.backward()
    return model, reference, x, y, loss_fn, expected


def on_torch(path: str) -> dict:
    """The plan on torch.distributed.pipelining's runtime (codegen.torch_pipelining)."""
    from codegen import torch_pipelining

    model, reference, x, y, loss_fn, expected = reference_step()
    plan = Plan.load(path)
    stages, schedule = torch_pipelining(model, plan, loss_fn)
    mine = {st.stage_index for st in stages}
    losses: list = []
    if 0 in mine:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    errs = []
    for s in sorted(mine):
        a, b = plan.stages[s].layers
        for i in range(a, b):
            for p, q in zip(model[i].parameters(), reference[i].parameters()):
                errs.append(float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
    loss = sum(losses) / len(losses) if losses else expected.detach()
    return {
        "loss_err": abs(float(loss) - float(expected.detach())),
        "grad_err": max(errs, default=1.0),
        "params": len(errs),
        "others": 0,
        "repr": f"rank {dist.get_rank()} of 2",
        "inference": "pipelined inference runs in one process",
    }


def failing(out_dir: str, path: str) -> None:
    """A step whose loss fails on the last rank (with an exception whose message cannot be read),
    every rank's caller catching the error (as a user's loop might); the failing rank tries a second step. The first rank's forwards come
    late, so the last rank fails with receives still pending. Each rank writes what it saw
    (the others are halted by their watchdogs before they can)."""
    import time

    from codegen import StageError

    rank, last = dist.get_rank(), dist.get_world_size() - 1
    model, _, x, y, _, _ = reference_step()

    class Unreadable(ValueError):  # (found by a red team: its str() raising hung the launch)
        def __str__(self) -> str:
            raise Unreadable()

    def broken(out, y):
        raise Unreadable()

    def slow(module, args):
        if type(args[0]).__name__ != "FakeTensor":  # (the shape pass runs it on fakes)
            time.sleep(0.3)

    if rank == 0:
        model[0].register_forward_pre_hook(slow)
    pipe = compile_pipe(model, Plan.load(path), distributed=True)
    seen = []
    for _ in range(2 if rank == last else 1):
        try:
            pipe.train_step(x if rank == 0 else None, y, broken)
            seen.append("returned")
        except StageError as e:
            seen.append(str(e))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    if rank != last:
        time.sleep(30)  # (not reached: the watchdog ends this process; if it does not, slow)


def main() -> None:
    if sys.argv[1] == "--fail":
        dist.init_process_group("gloo")
        failing(sys.argv[2], sys.argv[3])
        return
    torch_runtime = sys.argv[1] == "--torch"
    out_dir, plans = sys.argv[1 + torch_runtime], sys.argv[2 + torch_runtime :]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for path in plans:
        if torch_runtime:
            results[os.path.basename(path)] = on_torch(path)
            continue
        model, reference, x, y, loss_fn, expected = reference_step()
        pipe = compile_pipe(model, Plan.load(path), distributed=True)
        loss = pipe.train_step(x if pipe.rank == 0 else None, y, loss_fn)
        mine = {id(p) for p in pipe.parameters()}
        errs, others = [], 0
        for p, q in zip(model.parameters(), reference.parameters()):
            if id(p) in mine:
                errs.append(float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
            elif p.grad is not None:
                others += 1  # another rank's parameter got a gradient here
        try:
            pipe(x)
            inference = "ran"
        except InputError as e:
            inference = str(e)
        results[os.path.basename(path)] = {
            "loss_err": abs(float(loss) - float(expected.detach())),
            "grad_err": max(errs, default=1.0),
            "params": len(errs),
            "others": others,
            "repr": repr(pipe),
            "inference": inference,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()  # NOTE: tearing gloo down while a peer is still mid-exit can abort the process
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
