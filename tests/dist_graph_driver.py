"""Run under torchrun by test_graph: for each emitted program given, one step of a small GPT with
tied embeddings (a captured graph) on every rank against the un-pipelined model, then one SGD
step over the rank's `parameters()` (and, for the GPT, a second step with its tied weight frozen
and the gradients accumulating on the first's); each rank writes as JSON the errors of the
gradients and of the stepped weights it holds, and how many parameters it listed (and how many
distinct)."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.environ["GPIPE_ROOT"])
from profiler.examples import gpt, unet  # noqa: E402

SMALL = {"depth": 2, "d_model": 32, "vocab": 64, "seq_len": 16}


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def main() -> None:
    out_dir, programs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for path in programs:
        ns: dict = {}
        kind, _, path = path.rpartition("=")  # unet=PATH: the U-Net (skips across stages)
        exec(compile(open(path).read(), path, "exec"), ns)
        torch.manual_seed(0)
        if kind == "far":  # a value to two stages, the model's input to a far one
            from tests.test_graph import FarReader

            model = FarReader()
        elif kind == "tied":  # a weight two stages of one rank use
            from tests.test_graph import TiedInside

            model = TiedInside()
        else:
            model = unet(size=8) if kind == "unet" else gpt(**SMALL)
        reference = copy.deepcopy(model)
        x = model.example_input
        if kind == "tied":
            y, lf = torch.randn(*x.shape, 40), torch.nn.functional.mse_loss
        elif kind in ("unet", "far"):
            y, lf = torch.randn_like(x), torch.nn.functional.mse_loss
        else:
            y, lf = torch.randint(0, SMALL["vocab"], x.shape), loss_fn
        expected = lf(reference(x), y)
        expected.backward()
        pipe = ns["Pipeline"](ns["capture"](model, x[:2]))
        loss = pipe.train_step(x if rank == 0 else None, y, lf)
        names = {id(p): n for n, p in model.named_parameters()}
        want = dict(reference.named_parameters())
        errs = {}
        for s in sorted(pipe.local):
            for p in pipe.stages[s].parameters():
                q = want[names[id(p)]]
                errs[names[id(p)]] = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        listed = list(pipe.parameters())
        torch.optim.SGD(listed, lr=0.1).step()  # (a parameter listed twice: stepped twice)
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        moved = {}
        for p in listed:
            q = want[names[id(p)]]
            moved[names[id(p)]] = float((p.detach() - q.detach()).abs().max())
        accum = None
        if kind == "":  # the GPT: its tied weight frozen, a second step accumulating on the first
            for m in (model, reference):
                m.tokens.weight.requires_grad_(False)
            x2, y2 = x.flip(0), y.flip(0)
            lf(reference(x2), y2).backward()
            pipe.train_step(x2 if rank == 0 else None, y2, lf)
            accum = {}
            for p in listed:
                q = want[names[id(p)]]
                accum[names[id(p)]] = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
            # then unfrozen on the first rank alone: every rank refuses the step (each summed
            # the weight's gradient or not by its own flag, and the ranks waited on each other)
            if rank == 0:
                model.tokens.weight.requires_grad_(True)
            try:
                pipe.train_step(x if rank == 0 else None, y, lf)
            except ns["BatchRefused"] as e:
                accum["refused"] = str(e)
        results[os.path.basename(path)] = {
            "accum_err": accum,
            "listed": len(listed),
            "distinct": len({id(p) for p in listed}),
            "held": sum(len(list(pipe.stages[s].parameters())) for s in pipe.local),
            "step_err": moved,
            # relative to the loss where it is above 1 (the far model's sums are large)
            "loss_err": abs(float(loss) - float(expected.detach()))
            / max(1.0, abs(float(expected.detach()))),
            "grad_err": errs,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()  # NOTE: tearing gloo down while a peer is still mid-exit can abort the process
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
