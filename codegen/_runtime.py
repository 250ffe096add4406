# ---------------------------------------------------------------------------------------------
# gpipe-plan pipeline runtime: the helpers a compiled program's straight-line train_step calls.
# Imports only torch. Each call runs one action of the schedule for one (stage, micro-batch):
#
#     forward(s, m)          run stage s on micro-batch m; send its output to stage s + 1
#     backward(s, m)         full backward; send the input gradient to stage s - 1
#     backward_input(s, m)   zero-bubble I: the input gradient only (graph kept for W)
#     backward_weight(s, m)  zero-bubble W: the weight gradients, then free the graph
#
# Stage boundaries detach and re-attach autograd: a stage's input is a detached leaf, and its
# .grad is what travels back. The last stage scales each micro-batch's (mean) loss by its share
# of the mini-batch, so the gradients add up to those of the whole mini-batch's mean loss.
# On CUDA each stage has its own compute stream plus send/receive copy streams; events order the
# streams and record_stream tells the allocator which streams still use a tensor, so one host
# thread issues every action and kernels of different stages overlap. On CPU the same calls run
# in order and compute the same numbers.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Value = Any  # a tensor or a tuple of tensors: what flows between layers of an nn.Sequential


class StageError(RuntimeError):
    """An exception inside a stage, naming the action, the stage and the micro-batch."""


class DeferredBatchNorm(nn.Module):
    """BatchNorm that normalises each micro-batch with its own statistics (as GPipe does) but
    updates the running statistics once per mini-batch, from all its micro-batches together, so
    they equal the un-pipelined model's. Shares the wrapped layer's parameters and buffers."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, microbatches: int) -> None:
        super().__init__()
        self.bn = bn
        self.microbatches = microbatches
        self.tracking = True  # False while a checkpoint re-runs the forward
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


def _tensors(v: Value) -> list[torch.Tensor]:
    return list(v) if isinstance(v, tuple) else [v]


def _like(v: Value, ts: list[torch.Tensor]) -> Value:
    return tuple(ts) if isinstance(v, tuple) else ts[0]


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    d = t.detach()
    return d.requires_grad_(grad and d.is_floating_point())


class PipelineRuntime:
    """Stages, devices, streams and the per-micro-batch state of one step. A compiled program
    subclasses it with the plan's constants and the straight-line train_step and infer."""

    SCHEDULE = "gpipe"
    MICROBATCHES = 1
    STAGES: list[tuple[int, int]] = []  # [start, end) layer range of each stage
    RANKS: list[int] = []  # device position of each stage
    RECOMPUTE = "never"

    def __init__(
        self,
        model: nn.Sequential,
        devices: list[str | torch.device],
        *,
        deferred_batch_norm: bool = False,
    ) -> None:
        layers = list(model)
        if not self.STAGES or self.STAGES[-1][1] != len(layers):
            raise ValueError(
                f"this program splits {self.STAGES[-1][1] if self.STAGES else 0} layers; "
                f"the model has {len(layers)}"
            )
        self.devices = [torch.device(devices[r]) for r in self.RANKS]
        # The stages hold the model's own layers (and so its own parameters), moved in place.
        self.stages = [
            nn.Sequential(*layers[a:b]).to(d) for (a, b), d in zip(self.STAGES, self.devices)
        ]
        self.deferred_batch_norm = deferred_batch_norm
        if deferred_batch_norm:
            for st in self.stages:
                defer_batch_norm(st, self.MICROBATCHES)
        self.cuda = any(d.type == "cuda" for d in self.devices)
        if self.cuda:
            self.compute = [torch.cuda.Stream(d) for d in self.devices]
            self.send_streams = [torch.cuda.Stream(d) for d in self.devices]
            self.recv_streams = [torch.cuda.Stream(d) for d in self.devices]
        # Where a stage's computation runs; tests swap in a saved_tensors_hooks context here.
        self.stage_context: Callable[[int], contextlib.AbstractContextManager[Any]] = lambda s: (
            contextlib.nullcontext()
        )

    # -- a step ---------------------------------------------------------------------------

    def begin(self, x: torch.Tensor, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        M, n = self.MICROBATCHES, x.shape[0]
        if n < M:
            raise ValueError(
                f"a batch of {n} cannot be split into {M} micro-batches; pass at least {M} samples"
            )
        self.loss_fn = loss_fn
        self._reset()
        # One draw from the caller's RNG per step; every (layer, micro-batch) forward then runs on
        # its own seed, so dropout masks do not depend on the schedule or on recomputation.
        self.seed = int(torch.randint(0, 2**62, (1,)).item())
        xs = torch.tensor_split(x, M)
        self.targets = _split_target(y, M)
        self.weights = [c.shape[0] / n for c in xs]
        first, last = self.devices[0], self.devices[-1]
        for m, c in enumerate(xs):
            self.inputs[(0, m)] = c.to(first, non_blocking=True)
        self.targets = [_to(t, last) for t in self.targets]
        self._enter_streams()  # after the copies above, which run on the default streams

    def finish(self) -> torch.Tensor:
        """Make the default streams wait for the pipeline, and return the mini-batch loss."""
        self._leave_streams()
        total = sum(self.losses[m].detach() for m in range(self.MICROBATCHES))
        self._reset()
        return total  # type: ignore[return-value]

    def _reset(self) -> None:
        """Forget the step: every tensor of it is dropped here, or earlier by _free."""
        self.inputs: dict[tuple[int, int], Value] = {}
        self.outputs: dict[tuple[int, int], Value] = {}
        self.grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}  # from the next stage
        self.losses: dict[int, torch.Tensor] = {}
        self.ready: dict[tuple[str, int, int], Any] = {}
        self.layer_outputs: dict[tuple[int, int], list[Value]] = {}  # for a layer-wise W
        self.layer_grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}

    # -- actions --------------------------------------------------------------------------

    def forward(self, s: int, m: int) -> None:
        with self._action("forward", s, m):
            inp = _like_leaf(self.inputs[(s, m)], grad=s > 0)
            self.inputs[(s, m)] = inp
            with self.stage_context(s):
                out = self._run(s, m, inp)
            self.outputs[(s, m)] = out
            if s == len(self.stages) - 1:
                self.losses[m] = self.loss_fn(out, self.targets[m]) * self.weights[m]
            else:
                self.send_activation(out, s, m)

    def backward(self, s: int, m: int) -> None:
        with self._action("backward", s, m):
            roots, grads = self._roots(s, m)
            if roots:
                torch.autograd.backward(roots, grads)
            self._send_input_grads(s, m, [t.grad for t in _tensors(self.inputs[(s, m)])])
            self._free(s, m)

    def backward_input(self, s: int, m: int) -> None:
        with self._action("backward_input", s, m):
            inputs = _tensors(self.inputs[(s, m)])
            wrt = [t for t in inputs if t.requires_grad]
            # Without recomputation, also ask for the gradient of every layer's output: the same
            # pass computes them, and then W can run each layer's weight gradient on its own.
            inner = self.layer_outputs.get((s, m), [])
            hidden = [t for out in inner[:-1] for t in _tensors(out) if t.requires_grad]
            roots, grads = self._roots(s, m)
            got: list[torch.Tensor | None] = []
            if (wrt or hidden) and roots:
                got = list(
                    torch.autograd.grad(
                        roots, wrt + hidden, grads, retain_graph=True, allow_unused=True
                    )
                )
            self.layer_grads[(s, m)] = got[len(wrt) :]
            it = iter(got[: len(wrt)])
            self._send_input_grads(s, m, [next(it) if t.requires_grad else None for t in inputs])

    def backward_weight(self, s: int, m: int) -> None:
        with self._action("backward_weight", s, m):
            roots, grads = self._roots(s, m)
            inner = self.layer_outputs.pop((s, m), None)
            if inner is None:  # recomputed: one pass over the whole stage for its weights
                params = [p for p in self.stages[s].parameters() if p.requires_grad]
                if roots and params:
                    torch.autograd.backward(roots, grads, inputs=params)
            else:  # layer by layer, from each layer's output and the gradient I left for it
                hidden = iter(self.layer_grads.pop((s, m)))
                for k, layer in enumerate(self.stages[s]):
                    if k == len(inner) - 1:  # the stage's own roots (the loss on the last stage)
                        outs, gs = roots, grads
                    else:
                        tensors = [t for t in _tensors(inner[k]) if t.requires_grad]
                        pairs = [(t, next(hidden)) for t in tensors]
                        outs = [t for t, g in pairs if g is not None]
                        gs = [g for _, g in pairs if g is not None]
                    params = [p for p in layer.parameters() if p.requires_grad]
                    if outs and params:
                        torch.autograd.backward(outs, gs, inputs=params)
            self._free(s, m)

    # -- inference ------------------------------------------------------------------------

    def infer_begin(self, x: torch.Tensor) -> None:
        M = min(self.MICROBATCHES, x.shape[0])
        self.infer_microbatches = M
        self.inputs, self.outputs, self.ready = {}, {}, {}
        for m, c in enumerate(torch.tensor_split(x, M)):
            self.inputs[(0, m)] = c.to(self.devices[0], non_blocking=True)
        self._enter_streams()

    def infer_forward(self, s: int, m: int) -> None:
        if m >= self.infer_microbatches:
            return
        with self._action("forward", s, m), torch.no_grad():
            out = self.stages[s](self.inputs.pop((s, m)))
            if s == len(self.stages) - 1:
                self.outputs[(s, m)] = out
            else:
                self.send_activation(out, s, m)

    def infer_finish(self) -> Value:
        self._leave_streams()
        last = len(self.stages) - 1
        outs = [self.outputs.pop((last, m)) for m in range(self.infer_microbatches)]
        self.inputs, self.outputs, self.ready = {}, {}, {}
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)

    # -- machinery ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _action(self, what: str, s: int, m: int) -> Iterator[None]:
        try:
            with self._stream(s):
                yield
        except StageError:
            raise
        except Exception as e:
            raise StageError(
                f"{what} of stage {s}, micro-batch {m} failed: {type(e).__name__}: {e}"
            ) from e

    def _run(self, s: int, m: int, inp: Value) -> Value:
        recompute = self.RECOMPUTE == "always" or (
            self.RECOMPUTE == "except_last" and m < self.MICROBATCHES - 1
        )
        if not recompute:
            return self._layers(s, m, inp, keep=self.SCHEDULE == "zb-h1")
        calls = [0]

        def run(*args: torch.Tensor) -> Value:
            # The first call is the real forward; later ones re-materialise for backward and
            # must not count batch-norm statistics again.
            calls[0] += 1
            with _replaying(self.stages[s], replay=calls[0] > 1):
                return self._layers(s, m, _like(inp, list(args)))

        return checkpoint(run, *_tensors(inp), use_reentrant=False, preserve_rng_state=True)

    def _layers(self, s: int, m: int, h: Value, keep: bool = False) -> Value:
        """Each layer on its own seed: dropout masks depend on (step, layer, micro-batch) only,
        not on the schedule, the partition or recomputation. `keep`: remember every layer's
        output, for a layer-by-layer weight gradient (zero-bubble W)."""
        first = self.STAGES[s][0]
        outs = []
        for k, layer in enumerate(self.stages[s]):
            with self._seeded(self.devices[s], first + k, m):
                h = layer(h)
            outs.append(h)
        if keep:
            self.layer_outputs[(s, m)] = outs
        return h

    @contextlib.contextmanager
    def _seeded(self, dev: torch.device, layer: int, m: int) -> Iterator[None]:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            seed = (self.seed + 1_000_003 * layer + m) % 2**63
            torch.default_generator.manual_seed(seed)
            if dev.type == "cuda":
                torch.cuda.manual_seed(seed)  # the current device: the stage's, inside its stream
            yield

    def _roots(self, s: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if s == len(self.stages) - 1:
            return [self.losses[m]], None
        outs = _tensors(self.outputs[(s, m)])
        if (s, m) not in self.grads:  # kept until the graph is freed: W needs it after I
            self.grads[(s, m)] = self.ready.pop(("grad", s, m))
        grads = self.grads[(s, m)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _send_input_grads(self, s: int, m: int, grads: list[torch.Tensor | None]) -> None:
        if s > 0:
            self.send_gradient(grads, s, m)

    def _free(self, s: int, m: int) -> None:
        self.layer_outputs.pop((s, m), None)
        self.layer_grads.pop((s, m), None)
        self.outputs.pop((s, m), None)
        self.grads.pop((s, m), None)
        self.inputs.pop((s, m), None)

    # Transfers. On CPU a transfer is a hand-over. On CUDA: the producing stream records an
    # event; the send stream (source device) and receive stream (destination device) wait for it
    # and copy; the consumer's compute stream waits for the copy.

    def send_activation(self, value: Value, s: int, m: int) -> None:
        """Stage s's output for micro-batch m becomes stage s + 1's input."""
        moved = self._move([t.detach() for t in _tensors(value)], s, s + 1)
        self.inputs[(s + 1, m)] = _like(value, moved)

    def send_gradient(self, grads: list[torch.Tensor | None], s: int, m: int) -> None:
        """The gradient of stage s's input becomes that of stage s - 1's output (None where an
        input needs no gradient)."""
        moved = iter(self._move([g for g in grads if g is not None], s, s - 1))
        self.ready[("grad", s - 1, m)] = [next(moved) if g is not None else None for g in grads]

    def _move(self, ts: list[torch.Tensor], src: int, dst: int) -> list[torch.Tensor]:
        a, b = self.devices[src], self.devices[dst]
        if not self.cuda:
            return [t.to(b) for t in ts]
        produced = torch.cuda.Event()
        produced.record(self.compute[src])
        if a == b:
            self.compute[dst].wait_event(produced)
            for t in ts:
                t.record_stream(self.compute[dst])
            return ts
        send, recv = self.send_streams[src], self.recv_streams[dst]
        send.wait_event(produced)
        # NOTE: a copy between GPUs runs on the source's current stream and syncs with the
        # destination's current stream; make both ours (as torchgpipe's Copy does).
        with torch.cuda.stream(send), torch.cuda.stream(recv):
            out = [t.to(b, non_blocking=True) for t in ts]
        for t in ts:
            t.record_stream(send)
        copied = torch.cuda.Event()
        copied.record(recv)
        self.compute[dst].wait_event(copied)
        for t in out:
            t.record_stream(recv)
            t.record_stream(self.compute[dst])
        return out

    def _stream(self, s: int) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.compute[s]) if self.cuda else contextlib.nullcontext()

    def _enter_streams(self) -> None:
        if self.cuda:
            for st, d in zip(self.compute, self.devices):
                st.wait_stream(torch.cuda.current_stream(d))

    def _leave_streams(self) -> None:
        if self.cuda:
            for streams in (self.compute, self.send_streams, self.recv_streams):
                for st, d in zip(streams, self.devices):
                    torch.cuda.current_stream(d).wait_stream(st)


def _like_leaf(v: Value, grad: bool) -> Value:
    return _like(v, [_leaf(t, grad) for t in _tensors(v)])


def _split_target(y: Any, M: int) -> list[Any]:
    if isinstance(y, torch.Tensor):
        return list(torch.tensor_split(y, M))
    if isinstance(y, (tuple, list)):
        parts = [_split_target(t, M) for t in y]
        return [type(y)(p[m] for p in parts) for m in range(M)]
    return [y] * M


def _to(y: Any, device: torch.device) -> Any:
    if isinstance(y, torch.Tensor):
        return y.to(device, non_blocking=True)
    if isinstance(y, (tuple, list)):
        return type(y)(_to(t, device) for t in y)
    return y


@contextlib.contextmanager
def _replaying(stage: nn.Module, replay: bool) -> Iterator[None]:
    """While a checkpoint re-runs a stage's forward: keep batch-norm running statistics as they
    were (the real forward already counted this micro-batch) and stop deferred batch norm from
    accumulating again."""
    if not replay:
        yield
        return
    deferred = [mod for mod in stage.modules() if isinstance(mod, DeferredBatchNorm)]
    plain = [mod for mod in stage.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    saved = [[b.detach().clone() for b in mod.buffers()] for mod in plain]
    for mod in deferred:
        mod.tracking = False
    try:
        yield
    finally:
        for mod in deferred:
            mod.tracking = True
        with torch.no_grad():
            for mod, bufs in zip(plain, saved):
                for b, old in zip(mod.buffers(), bufs):
                    b.copy_(old)
