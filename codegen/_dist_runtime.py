# ---------------------------------------------------------------------------------------------
# gpipe-plan distributed runtime: one process per pipeline device, launched by torchrun (one host
# or many); stages on other ranks are reached over torch.distributed point-to-point (gloo on CPU,
# NCCL on GPU). Each rank's straight-line program receives a tensor right before the action that
# uses it and sends right after the action that makes it; sends do not block (isend), which is the
# order the schedule validator proves cannot hang. gloo cannot tell whether a send has completed
# without waiting for it, so a sent tensor is let go at the first receive from the same peer that
# proves it taken (the peer sent that message after taking ours), where waiting never blocks;
# sends nothing acknowledges are let go at the end of the step. What a rank holds that way is
# bounded by the schedule, not by the micro-batch count, but the plan does not count it (the plan
# counts the streams target's hand-offs; `measure --target torchrun` shows the difference).
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

from ._numerics import defer_batch_norm, save_rng  # emit: drop
from ._runtime import (  # emit: drop
    RECEIVED,  # emit: drop
    Grads,  # emit: drop
    PipelineRuntime,  # emit: drop
    Value,  # emit: drop
    _split_target,  # emit: drop
    _tensors,  # emit: drop
    _to,  # emit: drop
)  # emit: drop

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]  # fmt: skip
_HEADER = 256  # int64 slots: [count, is_tuple, then per tensor: dtype, ndim, dims...]


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
        self._route(layers)
        self.ties = self._tie_groups(layers)
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
        self.action_log = None
        self.rng = None
        self._reset()

    def _tie_groups(self, layers: list[nn.Module]) -> list[tuple[nn.Parameter, Any]]:
        """A parameter that stages on several ranks use (tied weights): every rank holding it
        sums its gradient with the others' at the end of the step, so all of them take the same
        optimizer step. Each rank sees the whole model, so all agree on the groups (and create
        them in the same order, as torch.distributed requires)."""
        users: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for s, (a, b) in enumerate(self.STAGES):
            for layer in layers[a:b]:
                for p in layer.parameters():
                    users.setdefault(id(p), (p, set()))[1].add(self.RANKS[s])
        groups: dict[tuple[int, ...], Any] = {}
        ties = []
        for p, ranks in users.values():
            if len(ranks) > 1 and p.requires_grad:
                key = tuple(sorted(ranks))
                if key not in groups:
                    groups[key] = dist.new_group(list(key))
                if self.rank in ranks:
                    ties.append((p, groups[key]))
        return ties

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: give them to this rank's optimizer."""
        for s in sorted(self.local):
            yield from self.stages[s].parameters()

    def _reset(self) -> None:
        super()._reset()
        self.outbox: dict[tuple[str, int, int], Any] = {}
        self.out_meta: dict[tuple[int, int], list[tuple[list[int], torch.dtype] | None]] = {}
        self.sent: dict[tuple[str, int, int], tuple[list[Any], list[torch.Tensor]]] = {}

    def begin(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        """Every rank calls this with the same mini-batch; only the first stage's rank needs x and
        only the last stage's rank needs y (the others may pass None)."""
        M, last = self.MICROBATCHES, len(self.STAGES) - 1
        self.loss_fn = loss_fn
        self._reset()
        # gradients accumulated over earlier steps are not summed across ranks again
        self.tied_grads = {id(p): p.grad for p, _ in self.ties if p.grad is not None}
        for p, _ in self.ties:
            p.grad = None
        seed = torch.randint(0, 2**62, (1,)).to(self.device)
        dist.broadcast(seed, src=0)  # the same dropout seeds on every rank
        self.seed = int(seed.item())
        self.rng = save_rng([self.device])
        if 0 in self.local:
            if x is None or x.shape[0] < M:
                raise ValueError(
                    f"the first stage's rank needs the input batch, with at least {M} samples"
                )
            self.batch = list(torch.tensor_split(x, M))
        if last in self.local:
            sized = y if isinstance(y, torch.Tensor) else x
            if sized is None:
                raise ValueError("the last stage's rank needs the targets (batch first)")
            parts = torch.tensor_split(sized, M)
            self.weights = [p.shape[0] / sized.shape[0] for p in parts]
            self.targets = [_to(t, self.device) for t in _split_target(y, M)]

    def finish(self) -> torch.Tensor:
        for key in list(self.sent):
            self.release(*key)
        for p, group in self.ties:  # tied weights: this step's gradient of every use, on each
            before = self.tied_grads.get(id(p))  # what p.grad held before the step, set aside
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            if before is not None:
                p.grad.add_(before)
        last = len(self.STAGES) - 1
        total = torch.zeros((), device=self.device)
        if last in self.local:
            total = sum(self.losses[m].float() for m in range(self.MICROBATCHES)) + total
        dist.broadcast(total, src=self.RANKS[last])
        self._reset()
        return total

    def release(self, kind: str, s: int, m: int) -> None:
        """Let go of what SEND_<kind> of stage s, micro-batch m sent: the send has completed."""
        works, _ = self.sent.pop((kind, s, m))
        for w in works:
            w.wait()

    # Hand-offs: within the rank as before; to another rank through the outbox and SEND actions.

    def _tag(self, kind: str, src: int, dst: int, m: int) -> int:
        """A captured graph's messages carry a tag each: a rank may send one rank several."""
        S = len(self.STAGES)
        return (("FB".index(kind) * S + src) * S + dst) * self.MICROBATCHES + m + 1

    def push(self, value: Value, s: int, m: int) -> None:
        if self.routed:
            far = []
            for (a, t), names in sorted(self.routes.items()):
                if a != s:
                    continue
                if t in self.local:
                    moved = self._move([value[n].detach() for n in names], s, t, None)
                    self.inputs.setdefault((t, m), {}).update(zip(names, moved))
                else:
                    far.append((t, [value[n].detach() for n in names]))
            self.out_meta[(s, m)] = {  # type: ignore[assignment]
                n: (list(t.shape), t.dtype)
                if t.is_floating_point() and n != self.input_name
                else None
                for n, t in value.items()
            }
            if far:
                self.outbox[("F", s, m)] = far
            return
        if s + 1 in self.local:
            return super().push(value, s, m)
        ts = [t.detach() for t in _tensors(value)]
        self.out_meta[(s, m)] = [
            (list(t.shape), t.dtype) if t.is_floating_point() else None for t in ts
        ]
        self.outbox[("F", s, m)] = (isinstance(value, tuple), ts)

    def leave_grad(self, grads: Grads, s: int, m: int, like: list[torch.Tensor]) -> None:
        if self.routed:
            mine = dict(zip(self.receives[s], zip(grads, like)))
            near: dict[str, Any] = {}
            far = []
            for (a, t), names in sorted(self.routes.items()):
                if t != s:
                    continue
                if a in self.local:
                    near.update({n: mine[n][0] for n in names})
                else:  # floating-point values only, zeros where no gradient came
                    far.append((a, [
                        g if g is not None else torch.zeros_like(x)
                        for n, (g, x) in ((n, mine[n]) for n in names)
                        if x.is_floating_point() and n != self.input_name
                    ]))  # fmt: skip
            if near:
                self.outgrads[(s, m)] = (near, None)  # type: ignore[assignment]
            if far:
                self.outbox[("B", s, m)] = far
            return
        if s - 1 in self.local:
            return super().leave_grad(grads, s, m, like)
        # One tensor per floating-point input, zeros where it got no gradient: the receiver
        # knows the shapes of the outputs they belong to.
        self.outbox[("B", s, m)] = [
            g if g is not None else torch.zeros_like(t)
            for g, t in zip(grads, like)
            if t.is_floating_point()
        ]

    def pull(self, s: int, m: int) -> Grads:
        if self.routed or s + 1 in self.local:
            return super().pull(s, m)
        return self.outgrads.pop((s + 1, m))[0]  # received by RECV_B, already ours

    def _send_tensors(
        self, ts: list[torch.Tensor], is_tuple: bool, dst: int, tag: int
    ) -> tuple[list[Any], list[torch.Tensor]]:
        """A header (how many tensors, their dtypes and shapes), then the tensors; not waited
        for: (the sends, the tensors they hold)."""
        header = [len(ts), int(is_tuple)]
        for t in ts:
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(header) > _HEADER:
            raise ValueError("too many or too high-dimensional tensors cross this cut")
        head = torch.tensor(
            header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=self.device
        )
        ts = [t.contiguous() for t in ts]
        return [dist.isend(head, dst, tag=tag)] + [dist.isend(t, dst, tag=tag) for t in ts], [
            head,
            *ts,
        ]

    def _recv_tensors(self, src: int, tag: int) -> tuple[list[torch.Tensor], bool]:
        head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(head, src, tag=tag)
        h = head.tolist()
        count, is_tuple, k, ts = h[0], bool(h[1]), 2, []
        for _ in range(count):
            dtype, ndim = _DTYPES[h[k]], h[k + 1]
            shape = h[k + 2 : k + 2 + ndim]
            k += 2 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src, tag=tag)
            ts.append(t)
        return ts, is_tuple

    def send_forward(self, s: int, m: int) -> None:
        if self.routed:
            with self._action("send_forward", s, m):
                works: list[Any] = []
                held: list[torch.Tensor] = []
                for t, ts in self.outbox.pop(("F", s, m)):
                    w, h = self._send_tensors(ts, True, self.RANKS[t], self._tag("F", s, t, m))
                    works += w
                    held += h
                self.sent[("F", s, m)] = (works, held)
            return
        with self._action("send_forward", s, m):
            is_tuple, ts = self.outbox.pop(("F", s, m))
            self.sent[("F", s, m)] = self._send_tensors(ts, is_tuple, self.RANKS[s + 1], 0)

    def recv_forward(self, s: int, m: int) -> None:
        if self.routed:
            with self._action("recv_forward", s, m):
                for (a, t), names in sorted(self.routes.items()):
                    if t == s and a not in self.local:
                        ts, _ = self._recv_tensors(self.RANKS[a], self._tag("F", a, s, m))
                        self.inputs.setdefault((s, m), {}).update(zip(names, ts))
            return
        with self._action("recv_forward", s, m):
            ts, is_tuple = self._recv_tensors(self.RANKS[s - 1], 0)
            self.inputs[(s, m)] = tuple(ts) if is_tuple else ts[0]

    def send_backward(self, s: int, m: int) -> None:
        if self.routed:
            with self._action("send_backward", s, m):
                works: list[Any] = []
                held: list[torch.Tensor] = []
                for a, gs in self.outbox.pop(("B", s, m)):
                    tag = self._tag("B", a, s, m)
                    for g in gs:
                        g = g.contiguous()
                        works.append(dist.isend(g, self.RANKS[a], tag=tag))
                        held.append(g)
                self.sent[("B", s, m)] = (works, held)
            return
        with self._action("send_backward", s, m):
            ts = [g.contiguous() for g in self.outbox.pop(("B", s, m))]
            works = [dist.isend(t, self.RANKS[s - 1]) for t in ts]
            self.sent[("B", s, m)] = (works, ts)

    def recv_backward(self, s: int, m: int) -> None:
        if self.routed:
            with self._action("recv_backward", s, m):
                meta = self.out_meta.pop((s, m))
                for (a, t), names in sorted(self.routes.items()):
                    if a != s or t in self.local:
                        continue
                    got: dict[str, Any] = {}
                    for n in names:
                        if meta[n] is None:  # type: ignore[call-overload]
                            got[n] = None
                            continue
                        shape, dtype = meta[n]  # type: ignore[call-overload]
                        g = torch.empty(shape, dtype=dtype, device=self.device)
                        dist.recv(g, self.RANKS[t], tag=self._tag("B", s, t, m))
                        got[n] = g
                    self.outgrads.setdefault((t, m), ({}, RECEIVED))[0].update(got)  # type: ignore[union-attr]
            return
        with self._action("recv_backward", s, m):
            src = self.RANKS[s + 1]
            got: list[torch.Tensor | None] = []
            for meta in self.out_meta.pop((s, m)):
                if meta is None:
                    got.append(None)
                    continue
                shape, dtype = meta
                g = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(g, src)
                got.append(g)
            self.outgrads[(s + 1, m)] = (got, None)

    def _enter_streams(self) -> None:
        pass

    def _leave_streams(self) -> None:
        pass
