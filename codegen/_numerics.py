# ---------------------------------------------------------------------------------------------
# gpipe-plan pipeline numerics: what keeps a pipelined step computing the un-pipelined model's
# numbers. Batch norm either normalises each micro-batch on its own (as the GPipe paper does) or,
# deferred, updates its running statistics once per mini-batch; a re-run forward (a recomputed
# stage's, or a checkpoint's) must not count batch-norm statistics twice; dropout masks depend
# on (step, layer, micro-batch) only, never on the schedule, the partition or recomputation.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations  # emit: drop

import contextlib  # emit: drop
from collections.abc import Iterator  # emit: drop

import torch  # emit: drop
from torch import nn  # emit: drop


class DeferredBatchNorm(nn.Module):
    """BatchNorm that normalises each micro-batch with its own statistics (as GPipe does) but
    updates the running statistics once per mini-batch, from all its micro-batches together:
    the un-pipelined model's for the first batch norm (a later one receives what was
    normalised micro-batch by micro-batch before it). Shares the wrapped layer's parameters and
    buffers."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, microbatches: int) -> None:
        super().__init__()
        self.bn = bn
        self.microbatches = microbatches
        self.tracking = True  # False while the forward runs again
        self._reset()

    def _reset(self) -> None:
        self._sum: torch.Tensor | None = None
        self._sqsum: torch.Tensor | None = None
        self._count = 0
        self._seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if not (self.training and bn.track_running_stats):
            return bn(x)
        dims = [0, *range(2, x.dim())]
        if self.tracking:
            with torch.no_grad():
                xf = x.detach().float()
                s, sq = xf.sum(dims), (xf * xf).sum(dims)
                self._sum = s if self._sum is None else self._sum + s
                self._sqsum = sq if self._sqsum is None else self._sqsum + sq
                self._count += x.numel() // x.shape[1]
                self._seen += 1
                if self._seen == self.microbatches:
                    self._commit()
        return nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)

    def _commit(self) -> None:
        bn, n = self.bn, self._count
        assert self._sum is not None and self._sqsum is not None
        mean = self._sum / n
        var = (self._sqsum / n - mean * mean) * (n / max(n - 1, 1))
        bn.num_batches_tracked.add_(1)
        momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        bn.running_mean.mul_(1 - momentum).add_(mean.to(bn.running_mean.dtype), alpha=momentum)
        bn.running_var.mul_(1 - momentum).add_(var.to(bn.running_var.dtype), alpha=momentum)
        self._reset()


def defer_batch_norm(module: nn.Module, microbatches: int) -> nn.Module:
    """Wrap every BatchNorm in `module` (in place) in a DeferredBatchNorm."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return DeferredBatchNorm(module, microbatches)
    for name, child in module.named_children():
        wrapped = defer_batch_norm(child, microbatches)
        if wrapped is not child:
            setattr(module, name, wrapped)
    return module


def seed_layer(dev: torch.device, seed: int, layer: int, m: int) -> None:
    """Put the RNG on the seed of (step seed, layer, micro-batch). It saves nothing: saving the
    state would allocate a tensor per layer (5 KB of device memory on CPU); the step saves the
    caller's RNG once instead (save_rng / restore_rng)."""
    s = (seed + 1_000_003 * layer + m) % 2**63
    torch.default_generator.manual_seed(s)
    if dev.type == "cuda":
        torch.cuda.manual_seed(s)  # the current device: the stage's, inside its stream


def save_rng(devices: list[torch.device]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The caller's RNG states, restored after the step so the pipeline leaves them as found."""
    cuda = {d.index or 0 for d in devices if d.type == "cuda"}
    return torch.get_rng_state(), {i: torch.cuda.get_rng_state(i) for i in cuda}


def restore_rng(saved: tuple[torch.Tensor, dict[int, torch.Tensor]] | None) -> None:
    if saved is None:
        return
    cpu, cuda = saved
    torch.set_rng_state(cpu)
    for i, state in cuda.items():
        torch.cuda.set_rng_state(state, i)


def _counts_batches(mod: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether a forward of batch norm `mod` adds one to its count of batches."""
    return mod.training and mod.track_running_stats and mod.num_batches_tracked is not None


@contextlib.contextmanager
def replaying(stage: nn.Module, replay: bool, checkpointed: bool = True) -> Iterator[None]:
    """While a stage's forward runs again to re-materialise it (in a checkpoint, or by hand for
    zero bubble at I): the real forward already counted this micro-batch, so batch norm must
    leave its running statistics as they were. In a checkpoint the re-run must save what the
    first run saved, so batch norm updates them, with a momentum of 0 (the same values; its
    count of batches put back afterwards, by as many as the re-run added: a copy of them, held
    through the re-run, was more than the plan counted, found by a red team); by hand the
    graph is kept for I and W and must not see its saved tensors change, so batch norm stops
    tracking them while it runs (same numbers: each micro-batch's own statistics)."""
    if not replay:
        yield
        return
    deferred = [mod for mod in stage.modules() if isinstance(mod, DeferredBatchNorm)]
    wrapped = {id(mod.bn) for mod in deferred}  # (which its wrapper runs on no buffers)
    plain = [mod for mod in stage.modules()
             if isinstance(mod, nn.modules.batchnorm._BatchNorm) and id(mod) not in wrapped]  # fmt: skip
    momenta = [mod.momentum for mod in plain]
    # A captured graph's layers run batch norm as operations on their buffers: put them back.
    graph = [b for mod in stage.modules() if getattr(mod, "captured_layer", False)
             for b in mod.buffers()]  # fmt: skip
    graph_saved = [b.detach().clone() for b in graph]
    tracked = [mod.track_running_stats for mod in plain]
    for mod in deferred:
        mod.tracking = False
    for mod in plain:
        if checkpointed:
            mod.momentum = 0.0
        else:
            mod.track_running_stats = False
    # (by how many its forwards added: a module may run twice, or not at all where the
    # checkpoint stops early; .data's changes leave the version as it is: a cold review's)
    counted = [(mod, mod.num_batches_tracked._version) for mod in plain  # type: ignore[union-attr]
               if _counts_batches(mod)] if checkpointed else []  # fmt: skip
    try:
        yield
    finally:
        for mod in deferred:
            mod.tracking = True
        for mod, was, momentum in zip(plain, tracked, momenta):
            mod.track_running_stats = was
            mod.momentum = momentum
        with torch.no_grad():
            for mod, version in counted:  # (.data: as the running statistics, no new version)
                count = mod.num_batches_tracked
                count.data.sub_(count._version - version)  # type: ignore[union-attr]
            for b, old in zip(graph, graph_saved):  # .data: a graph kept for I/W saved them
                b.data.copy_(old)
