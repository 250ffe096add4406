"""Run under torchrun by test_codegen's torchrun tests: for each emitted program given, one step
on every rank against the un-pipelined model; each rank writes what it measured as JSON."""

from __future__ import annotations

import copy
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.environ["GPIPE_ROOT"])
from profiler.examples import mlp  # noqa: E402


def main() -> None:
    out_dir, programs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if out_dir in ("--fail", "--kill"):  # the last rank's loss fails mid-step: nobody may hang
        ns: dict = {}
        exec(compile(open(programs[0]).read(), programs[0], "exec"), ns)
        torch.manual_seed(0)
        pipe = ns["Pipeline"](mlp(width=32, depth=4, batch=8))

        def broken(out, y):
            if out_dir == "--kill":  # killed from outside, as an out-of-memory killer would
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("bad label")

        pipe.train_step(torch.randn(8, 32), torch.zeros(8, dtype=torch.long), broken)
    results = {}
    for path in programs:
        ns: dict = {}
        exec(compile(open(path).read(), path, "exec"), ns)
        torch.manual_seed(0)
        model = mlp(width=32, depth=4, batch=8)
        if os.environ.get("GPIPE_INPLACE"):  # its ReLUs change their input in place
            for layer in model:
                if isinstance(layer, nn.ReLU):
                    layer.inplace = True
        name = os.path.basename(path)
        frozen = 2 if name.startswith("frozen2") else 5 if name.startswith("frozen") else 0
        model[:frozen].requires_grad_(False)  # a frozen prefix: no gradient crosses it
        reference = copy.deepcopy(model)
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        loss_fn = nn.CrossEntropyLoss()
        expected = loss_fn(reference(x), y)
        expected.backward()
        pipe = ns["Pipeline"](model)
        loss = pipe.train_step(x if rank == 0 else None, y, loss_fn)
        errs = []
        for s in sorted(pipe.local):
            a, b = pipe.STAGES[s]
            for i in range(a, b):
                for p, q in zip(model[i].parameters(), reference[i].parameters()):
                    if i < frozen:  # (no gradient: an error of 1 if one came)
                        errs.append(float(p.grad is not None or q.grad is not None))
                        continue
                    errs.append(float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
        results[os.path.basename(path)] = {
            "loss_err": abs(float(loss) - float(expected.detach())),
            "grad_err": max(errs, default=0.0),
            "params": len(errs),
            "trains_before": pipe.trains_before,  # (as agreed by the ranks)
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    print(f"rank {rank}: results written", file=sys.stderr, flush=True)
    dist.barrier()  # NOTE: tearing gloo down while a peer is still mid-exit can abort the process
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
