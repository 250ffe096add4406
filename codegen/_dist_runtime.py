# ---------------------------------------------------------------------------------------------
# gpipe-plan distributed runtime: one process per pipeline device, launched by torchrun (one host
# or many); stages on other ranks are reached over torch.distributed point-to-point (gloo on CPU,
# NCCL on GPU). Each rank's straight-line program receives a tensor right before the action that
# uses it and sends right after the action that makes it; sends do not block (isend), which is the
# order the schedule validator proves cannot hang.
#
# Activations travel as a header (how many tensors, their dtypes and shapes) and then the tensors;
# gradients need no header: the receiver knows the shapes of the outputs they belong to.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations  # emit: drop

import contextlib  # emit: drop
import os
from collections.abc import Callable, Iterator  # emit: drop
from typing import Any  # emit: drop

import torch  # emit: drop
import torch.distributed as dist
from torch import nn  # emit: drop

from ._runtime import (  # emit: drop
    PipelineRuntime,  # emit: drop
    Value,  # emit: drop
    _split_target,  # emit: drop
    _tensors,  # emit: drop
    _to,  # emit: drop
    defer_batch_norm,  # emit: drop
)  # emit: drop

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]  # fmt: skip
_HEADER = 64  # int64 slots: [count, is_tuple, then per tensor: dtype, ndim, dims...]


class DistPipelineRuntime(PipelineRuntime):
    """PipelineRuntime for one rank: only this rank's stages live here."""

    def __init__(self, model: nn.Sequential, *, deferred_batch_norm: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "call torch.distributed.init_process_group first (torchrun sets it up)"
            )
        self.rank, world = dist.get_rank(), dist.get_world_size()
        ranks = max(self.RANKS) + 1
        if world != ranks:
            raise RuntimeError(
                f"this program runs on {ranks} processes, not {world}: torchrun --nproc-per-node {ranks}"
            )
        layers = list(model)
        if self.STAGES[-1][1] != len(layers):
            raise ValueError(
                f"this program splits {self.STAGES[-1][1]} layers; the model has {len(layers)}"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = (
            torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        )
        self.local = {s for s, r in enumerate(self.RANKS) if r == self.rank}
        self.devices = [self.device] * len(self.STAGES)
        self.stages = [
            nn.Sequential(*layers[a:b]).to(self.device) if s in self.local else nn.Sequential()
            for s, (a, b) in enumerate(self.STAGES)
        ]
        self.deferred_batch_norm = deferred_batch_norm
        if deferred_batch_norm:
            for s in self.local:
                defer_batch_norm(self.stages[s], self.MICROBATCHES)
        self.cuda = False  # one device per process: no streams of our own
        self.stage_context = lambda s: contextlib.nullcontext()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: give them to this rank's optimizer."""
        for s in sorted(self.local):
            yield from self.stages[s].parameters()

    def begin(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        """Every rank calls this with the same mini-batch; only the first stage's rank needs x and
        only the last stage's rank needs y (the others may pass None)."""
        M, last = self.MICROBATCHES, len(self.STAGES) - 1
        self.loss_fn = loss_fn
        self._reset()
        self.outbox: dict[tuple[str, int, int], Any] = {}
        self.works: list[Any] = []
        seed = torch.randint(0, 2**62, (1,)).to(self.device)
        dist.broadcast(seed, src=0)  # the same dropout seeds on every rank
        self.seed = int(seed.item())
        if 0 in self.local:
            if x is None or x.shape[0] < M:
                raise ValueError(
                    f"the first stage's rank needs the input batch, with at least {M} samples"
                )
            for m, c in enumerate(torch.tensor_split(x, M)):
                self.inputs[(0, m)] = c.to(self.device)
        if last in self.local:
            sized = y if isinstance(y, torch.Tensor) else x
            if sized is None:
                raise ValueError("the last stage's rank needs the targets (batch first)")
            parts = torch.tensor_split(sized, M)
            self.weights = [p.shape[0] / sized.shape[0] for p in parts]
            self.targets = [_to(t, self.device) for t in _split_target(y, M)]

    def finish(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        last = len(self.STAGES) - 1
        total = torch.zeros((), device=self.device)
        if last in self.local:
            total = sum(self.losses[m].detach().float() for m in range(self.MICROBATCHES)) + total
        dist.broadcast(total, src=self.RANKS[last])
        self._reset()
        self.outbox, self.works = {}, []
        return total

    # Hand-offs: within the rank as before; to another rank through the outbox and SEND actions.

    def send_activation(self, value: Value, s: int, m: int) -> None:
        if s + 1 in self.local:
            return super().send_activation(value, s, m)
        self.outbox[("F", s, m)] = (isinstance(value, tuple), [t.detach() for t in _tensors(value)])

    def send_gradient(self, grads: list[torch.Tensor | None], s: int, m: int) -> None:
        if s - 1 in self.local:
            return super().send_gradient(grads, s, m)
        inputs = _tensors(self.inputs[(s, m)])
        self.outbox[("B", s, m)] = [
            (g if g is not None else torch.zeros_like(t)).detach()
            for g, t in zip(grads, inputs)
            if t.is_floating_point()
        ]

    def send_forward(self, s: int, m: int) -> None:
        with self._action("send_forward", s, m):
            is_tuple, ts = self.outbox.pop(("F", s, m))
            header = [len(ts), int(is_tuple)]
            for t in ts:
                header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            if len(header) > _HEADER:
                raise ValueError("too many or too high-dimensional tensors cross this cut")
            head = torch.tensor(
                header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=self.device
            )
            dst = self.RANKS[s + 1]
            self.works.append(dist.isend(head, dst))
            self.works += [dist.isend(t.contiguous(), dst) for t in ts]
            self._keep(head, ts)

    def recv_forward(self, s: int, m: int) -> None:
        with self._action("recv_forward", s, m):
            src = self.RANKS[s - 1]
            head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(head, src)
            h = head.tolist()
            count, is_tuple, k, ts = h[0], bool(h[1]), 2, []
            for _ in range(count):
                dtype, ndim = _DTYPES[h[k]], h[k + 1]
                shape = h[k + 2 : k + 2 + ndim]
                k += 2 + ndim
                t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(t, src)
                ts.append(t)
            self.inputs[(s, m)] = tuple(ts) if is_tuple else ts[0]

    def send_backward(self, s: int, m: int) -> None:
        with self._action("send_backward", s, m):
            grads = self.outbox.pop(("B", s, m))
            dst = self.RANKS[s - 1]
            self.works += [dist.isend(g.contiguous(), dst) for g in grads]
            self._keep(*grads)

    def recv_backward(self, s: int, m: int) -> None:
        with self._action("recv_backward", s, m):
            src = self.RANKS[s + 1]
            got: list[torch.Tensor | None] = []
            for o in _tensors(self.outputs[(s, m)]):
                if o.is_floating_point():
                    g = torch.empty_like(o)
                    dist.recv(g, src)
                    got.append(g)
                else:
                    got.append(None)
            self.ready[("grad", s, m)] = got

    def _keep(self, *objs: Any) -> None:
        """isend reads its buffer later: hold it until finish() waits for the sends."""
        self.works.append(_Held(objs))

    def _enter_streams(self) -> None:
        pass

    def _leave_streams(self) -> None:
        pass


class _Held:
    def __init__(self, objs: Any) -> None:
        self.objs = objs

    def wait(self) -> None:
        self.objs = None
