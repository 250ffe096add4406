# ---------------------------------------------------------------------------------------------
# gpipe-plan stream checker: a program's CUDA-stream code, run on the CPU, with every use of device
# memory held against the order its streams guarantee. It needs no GPU and changes no line of
# the code it checks: what it runs is the runtime's CUDA branch, the code a GPU runs.
#
# A stand-in takes the place of what the runtime calls of torch.cuda (Stream, Event, stream(),
# current_stream, synchronize, the RNG) and of Tensor.record_stream; a dispatch mode sees every
# tensor operation, runs it on the CPU (a "cuda:k" device becomes the CPU; the memory remembers
# k) and charges it to the stream current on its device. Happens-before is a clock per stream
# (_fakecuda.py): work stamped (U, c) is ordered before S's next op when S[U] >= c. Reported:
#   read   a tensor read where its last write is not ordered before the read;
#   write  a tensor written while an earlier read or write on another stream may be pending;
#   free   a tensor's memory going back to the pool of the stream it was allocated on while
#          another stream may still use it, and record_stream did not name that stream. The
#          caching allocator hands freed memory to the next allocation on that stream: into a
#          default stream's pool, which code outside the pipeline allocates from at any time,
#          the free itself must be ordered; into a stream of the pipeline's own, the next
#          allocation on that stream must be.
#   mixed  an operation on tensors of two devices (a GPU refuses it).
# Copies go as on CUDA: .to() returns the tensor itself where CUDA would (same device and
# dtype); host <-> device on the device's current stream (a blocking one makes the host wait);
# device to device on the source's current stream, after the destination's current stream and
# before its later work, into memory of the destination's current stream.
# Backward ops are charged to the stream current when backward is called: the runtime runs a
# stage's forward and backward on the same stream, where CUDA's autograd runs them too.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations  # emit: drop

import contextlib  # emit: drop
import re
import weakref
from collections.abc import Callable, Iterator  # emit: drop
from typing import Any  # emit: drop

import torch  # emit: drop
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._fakecuda import _CHECKS, FakeEvent, FakeStream, _index, _latest  # emit: drop


class _Memory:
    """One storage on a (pretend) device: who made it, and its accesses per stream."""

    __slots__ = ("finalizer", "device", "pool", "reads", "recorded", "used", "what", "write")

    def __init__(self, what: str, device: int, pool: FakeStream) -> None:
        self.what = what
        self.device = device
        self.pool = pool  # the stream it was allocated on
        self.write: tuple[FakeStream, int, str] | None = None  # last write: stream, stamp, where
        self.reads: dict[int, tuple[FakeStream, int, str]] = {}  # since that write, per stream
        self.used: dict[int, tuple[FakeStream, int, str]] = {}  # the last access, per stream
        self.recorded: set[int] = set()  # the streams record_stream named
        self.finalizer: Any = None


_COPIES = ("aten::_to_copy", "aten::copy_")
_SYNCS = (  # the host waits for these: it reads what they make, or their size depends on it
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::equal",
    "aten::is_nonzero",
)  # fmt: skip


class StreamCheck:
    """Run CUDA-stream code on the CPU and collect its happens-before violations:

        with StreamCheck() as check:
            pipe = Pipeline(model, ["cuda:0", "cuda:1"])   # built inside: the model moves
            check.watch(pipe)
            pipe.train_step(x, y, loss_fn)
        check.problems   # [] when every access is ordered

    Tensors made inside are CPU tensors that say they are on the cuda device they were put on.
    """

    LIMIT = 20  # distinct problems kept (the same one on other micro-batches only counts)

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.defaults: dict[int, FakeStream] = {}
        self.current: dict[int, FakeStream] = {}
        self.host: dict[int, int] = {}  # the clocks the host has waited for: all later work follows
        self.pending: dict[int, list[tuple[str, FakeStream, int, str, str]]] = {}  # per pool
        self.device = 0
        self.memory: dict[int, _Memory] = {}
        self.where = "outside the step"
        self.problems: list[str] = []
        self.seen: dict[str, int] = {}  # a problem with its numbers taken out -> times seen
        self._saved: list[tuple[Any, str, Any]] = []
        self._after: list[Any] = []  # what follows the operation being issued (copies)
        self._mode = _Dispatch(self)

    # -- the stand-in -----------------------------------------------------------------------

    def __enter__(self) -> StreamCheck:
        cuda = torch.cuda
        fakes = {
            "Stream": FakeStream,
            "Event": FakeEvent,
            "stream": self.stream,
            "current_stream": self.current_stream,
            "default_stream": self.default_stream,
            "synchronize": self.synchronize,
            "current_device": lambda: self.device,
            "set_device": self._set_device,
            "manual_seed": lambda seed: None,
            "get_rng_state": lambda device="cuda": torch.zeros(0, dtype=torch.uint8),
            "set_rng_state": lambda state, device="cuda": None,
            # NOTE: parsing a "cuda" device argument initialises CUDA first, which a CPU-only
            # build refuses; the dispatch mode then moves the work to the CPU.
            "_lazy_init": lambda: None,
            "device": self.on_device,
        }
        for name, fake in fakes.items():
            self._saved.append((cuda, name, getattr(cuda, name)))
            setattr(cuda, name, fake)
        # A captured graph asks prim.device where its layer is (profiler/graph.py): not an
        # operation the dispatch mode sees, so it answers here.
        device_of = torch.ops.prim.device
        self._saved.append((device_of, "default", device_of.default))
        physical = device_of.default
        device_of.default = lambda t: self._device(t, physical(t))
        # Tensors made from Python data straight onto a GPU: made on the host, then copied.
        for name in ("tensor", "as_tensor"):
            make = getattr(torch, name)
            self._saved.append((torch, name, make))
            setattr(torch, name, self._from_data(make, copies=name == "tensor"))
        # A tensor says it is where the check put it, so code that makes tensors "on the
        # device of x" makes them there (and the check sees them).
        base = torch._C.TensorBase
        tensor_fakes = {
            "record_stream": lambda t, stream: self.record_stream(t, stream),
            "to": lambda t, *args, **kwargs: self._to(base.to, t, *args, **kwargs),
            "cpu": lambda t, memory_format=torch.preserve_format: self._to(
                base.to, t, "cpu", memory_format=memory_format
            ),
            "cuda": lambda t, device=None, non_blocking=False, **kw: self._to(
                base.to, t, torch.device("cuda", _index(device)), non_blocking=non_blocking, **kw
            ),
            "device": property(lambda t: self._device(t, base.device.__get__(t))),
            "is_cuda": property(lambda t: self._device(t, base.device.__get__(t)).type == "cuda"),
            "get_device": lambda t: self._device_of(t),
            "new_tensor": lambda t, data, **kw: self._to(
                base.to, base.new_tensor(t, data, **kw), t.device
            ),
            "numpy": lambda t, **kw: self._host_only(t, "numpy()", base.numpy, **kw),
        }
        for name, fake in tensor_fakes.items():
            self._saved.append((torch.Tensor, name, torch.Tensor.__dict__.get(name)))
            setattr(torch.Tensor, name, fake)
        _CHECKS.append(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        _CHECKS.remove(self)
        for obj, name, value in reversed(self._saved):
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        self._saved.clear()
        for mem in self.memory.values():
            mem.finalizer.detach()
        self.memory.clear()

    def default_stream(self, device: Any = None) -> FakeStream:
        i = _index(device)
        if i not in self.defaults:
            self.defaults[i] = FakeStream(i, name=f"the default stream of cuda:{i}")
        return self.defaults[i]

    def current_stream(self, device: Any = None) -> FakeStream:
        i = _index(device)
        return self.current.get(i) or self.default_stream(i)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        """torch.cuda.stream: the stream is current on its device, which becomes current."""
        if stream is None:
            yield
            return
        device, before = self.device, self.current.get(stream.index)
        self.current[stream.index], self.device = stream, stream.index
        try:
            yield
        finally:
            if before is None:
                self.current.pop(stream.index, None)
            else:
                self.current[stream.index] = before
            self.device = device

    def _to(self, to: Callable[..., Any], t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Tensor.to as CUDA does it: the tensor itself where device and dtype already match,
        else a copy (which the dispatch mode charges to the right streams)."""
        copy = kwargs.pop("copy", False)
        if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
            other, *rest = args
            args = (other.device, other.dtype, *rest)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        src = self._device_of(t)
        dst = src if device is None else (_index(device) if device.type == "cuda" else -1)
        fmt = memory_format in (None, torch.preserve_format)
        if dst == src and (dtype is None or dtype == t.dtype) and fmt and not copy:
            return t
        where = torch.device("cuda", dst) if dst >= 0 else torch.device("cpu")
        more = {} if memory_format is None else {"memory_format": memory_format}
        return to(t, where, dtype or t.dtype, non_blocking=non_blocking, copy=True, **more)

    def _from_data(self, make: Callable[..., Any], copies: bool) -> Callable[..., Any]:
        """torch.tensor (copies: always a new tensor) or torch.as_tensor onto a GPU."""

        def made(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
            if device is None or torch.device(device).type != "cuda":
                return make(data, *args, device=device, **kwargs)
            if isinstance(data, torch.Tensor) and not copies:
                return self._to(torch._C.TensorBase.to, data, device, *args, **kwargs)
            return self._to(torch._C.TensorBase.to, make(data, *args, **kwargs), device)

        return made

    def _host_only(self, t: torch.Tensor, what: str, call: Callable[..., Any], **kw: Any) -> Any:
        if self._device_of(t) >= 0:
            where = f"cuda:{self._device_of(t)}"
            raise TypeError(f"can't call {what} on a tensor on {where}; copy it to the host first")
        return call(t, **kw)

    @contextlib.contextmanager
    def on_device(self, device: Any) -> Iterator[None]:
        """torch.cuda.device: the device is current inside."""
        before = self.device
        if device is not None and not (isinstance(device, int) and device < 0):
            self.device = _index(device)
        try:
            yield
        finally:
            self.device = before

    def synchronize(self, device: Any = None) -> None:
        """torch.cuda.synchronize: the host waits for every stream of the device."""
        i = _index(device)
        self.host_waits(_latest(st.clock for st in self.streams if st.index == i))

    def _device(self, t: torch.Tensor, physical: torch.device) -> torch.device:
        mem = self.memory.get(_key(t))
        return torch.device("cuda", mem.device) if mem is not None else physical

    def _set_device(self, device: Any) -> None:
        self.device = _index(device)

    def host_waits(self, clock: dict[int, int]) -> None:
        """The host waited for `clock`: all work issued later, on any stream, comes after."""
        self.host = _latest([self.host, clock])
        for st in self.streams:
            st.join(clock)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        mem = self.memory.get(_key(t))
        if mem is not None:
            mem.recorded.add(stream.id)

    # -- naming -----------------------------------------------------------------------------

    def watch(self, runtime: Any) -> None:
        """Name a pipeline runtime's streams and parameters, and label every action it runs."""
        for attr, role in (
            ("compute", "compute"),
            ("send_streams", "send"),
            ("recv_streams", "receive"),
        ):
            for s, st in enumerate(getattr(runtime, attr, [])):
                st.name = f"stage {s}'s {role} stream"
        for s, stage in enumerate(getattr(runtime, "stages", [])):
            for name, p in stage.named_parameters():
                mem = self.memory.get(_key(p))
                if mem is not None:
                    mem.what = f"parameter {name} of stage {s}"
        for method in ("begin", "finish", "infer_begin", "infer_finish"):
            setattr(runtime, method, self._labelled(getattr(runtime, method), method))
        action = runtime._action

        @contextlib.contextmanager
        def labelled(what: str, s: int, m: int) -> Iterator[None]:
            where, self.where = self.where, f"{what} of stage {s}, micro-batch {m}"
            try:
                with action(what, s, m):
                    yield
            finally:
                self.where = where

        runtime._action = labelled

    def _labelled(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.at(f"{name} of the step"):
                return method(*args, **kwargs)

        return run

    @contextlib.contextmanager
    def at(self, where: str) -> Iterator[None]:
        """Accesses inside are described as happening `where`."""
        before, self.where = self.where, where
        try:
            yield
        finally:
            self.where = before

    def report(self, problem: str) -> None:
        shape = re.sub(r"\d+", "#", problem)
        self.seen[shape] = self.seen.get(shape, 0) + 1
        if self.seen[shape] == 1 and len(self.problems) < self.LIMIT:
            self.problems.append(problem)

    # -- what the dispatch mode sees ----------------------------------------------------------

    def issued(self, func: Any, args: tuple, kwargs: dict, out: Any, target: int | None) -> None:
        """One operation has run (on the CPU); `target` is the cuda device a device argument
        named (-1: the CPU named explicitly; None: none named)."""
        schema = func._schema
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        looks = schema.name.split("::")[-1].startswith("new_") or schema.name.endswith("_like")
        for k, arg in enumerate(schema.arguments):
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            ts = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            if arg.alias_info is not None and arg.alias_info.is_write:
                writes += ts
            elif not looks:
                reads += ts
        if torch.Tag.inplace_view in func.tags or (
            schema.returns
            and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        ):
            return  # a view: the same memory, nothing run
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        tagged = [self.memory[k].device for k in map(_key, writes + reads) if k in self.memory]
        if looks:
            tagged += [self.memory[k].device for k in map(_key, args[:1]) if k in self.memory]
        if schema.name in _COPIES:
            stream, pool = self._copy(schema.name, args, kwargs, target)
        else:
            if len(set(tagged)) > 1:
                self.report(
                    f"{self.where}: {func} takes tensors of cuda:{tagged[0]} and "
                    f"cuda:{next(d for d in tagged if d != tagged[0])}, which a GPU refuses"
                )
            elif tagged and not schema.name.startswith("aten::index"):
                host = [t for t in reads + writes if t.dim() > 0 and _key(t) not in self.memory]
                if host:
                    dtype = str(host[0].dtype).removeprefix("torch.")
                    self.report(
                        f"{self.where}: {func} takes a host tensor ({dtype}{list(host[0].shape)}) "
                        f"with tensors of cuda:{tagged[0]}, which a GPU refuses"
                    )
            device = target if target is not None else (tagged[0] if tagged else -1)
            if device < 0:
                return  # host work: not tracked
            stream = pool = self.current_stream(device)
        if stream is None:
            return
        stamp = stream.tick()
        for t in reads:
            self._access(t, stream, stamp, write=False)
        for t in writes:
            self._access(t, stream, stamp, write=True)
        if pool is not None:
            known = {_key(t) for t in reads + writes}
            for t in outs:
                key = _key(t)
                if key is not None and key not in known and key not in self.memory:
                    self._allocated(t, key, func, pool, stream, stamp)
        if schema.name in _SYNCS:
            self.host_waits(stream.clock)

    def _copy(
        self, name: str, args: tuple, kwargs: dict, target: int | None
    ) -> tuple[FakeStream | None, FakeStream | None]:
        """(the stream a copy runs on, the stream its new memory comes from), as on CUDA."""
        src, dst = (args[0], None) if name == "aten::_to_copy" else (args[1], args[0])
        a = self._device_of(src)
        b = self._device_of(dst) if dst is not None else (target if target is not None else a)
        blocking = not kwargs.get(
            "non_blocking", args[2] if len(args) > 2 and dst is not None else False
        )
        if a < 0 and b < 0:
            return None, None
        if a < 0 or b < 0:  # between host and device: on the device's current stream
            stream = self.current_stream(b if a < 0 else a)
            if blocking:
                self._after.append(stream)
            return stream, stream if b >= 0 else None
        if a == b:
            return self.current_stream(a), self.current_stream(a)
        source, dest = self.current_stream(a), self.current_stream(b)
        source.join(dest.clock)
        self._after.append(("join", dest, source))
        return source, dest

    def _device_of(self, t: Any) -> int:
        mem = self.memory.get(_key(t)) if isinstance(t, torch.Tensor) else None
        return mem.device if mem is not None else -1

    def _allocated(
        self, t: torch.Tensor, key: int, func: Any, pool: FakeStream, stream: FakeStream, stamp: int
    ) -> None:
        dtype = str(t.dtype).removeprefix("torch.")
        what = f"{dtype}{list(t.shape)} made by {func} ({self.where})"
        self._reuse(pool)
        mem = _Memory(what, pool.index, pool)
        mem.write = (stream, stamp, self.where)
        mem.used[stream.id] = mem.write
        mem.finalizer = weakref.finalize(t.untyped_storage(), self._freed, key)
        self.memory[key] = mem

    def _access(self, t: torch.Tensor, stream: FakeStream, stamp: int, write: bool) -> None:
        mem = self.memory.get(_key(t))
        if mem is None:
            return
        here, verb = self.where, "writes" if write else "reads"
        w = mem.write
        if w is not None and w[0] is not stream and not stream.orders(w[0], w[1]):
            self.report(
                f"{here}: {verb} {mem.what} on {stream.name}, but its write on {w[0].name} "
                f"({w[2]}) is not ordered before it: no event or wait_stream joins them"
            )
        if write:
            for u, c, where in mem.reads.values():
                if u is not stream and not stream.orders(u, c):
                    self.report(
                        f"{here}: writes {mem.what} on {stream.name} while its read on {u.name} "
                        f"({where}) may still be pending"
                    )
            mem.write = (stream, stamp, here)
            mem.reads = {}
        else:
            mem.reads[stream.id] = (stream, stamp, here)
        mem.used[stream.id] = (stream, stamp, here)

    def _freed(self, key: int) -> None:
        mem = self.memory.pop(key, None)
        if mem is None:
            return
        shared = mem.pool in self.defaults.values()
        for u, c, where in mem.used.values():
            if u is mem.pool or u.id in mem.recorded or mem.pool.orders(u, c):
                continue
            if not shared:  # the pipeline's own stream: what matters is its next allocation
                self.pending.setdefault(mem.pool.id, []).append((mem.what, u, c, where, self.where))
                continue
            self.report(
                f"{self.where}: {mem.what} goes back to the memory pool of {mem.pool.name} while "
                f"{u.name} may still use it ({where}): ordered by no wait, and no "
                f"record_stream names {u.name}"
            )

    def _reuse(self, pool: FakeStream) -> None:
        """An allocation on `pool`'s stream may take any memory freed into its pool: each use
        of such memory on another stream must be ordered before it by now."""
        for what, u, c, where, freed in self.pending.pop(pool.id, []):
            if not pool.orders(u, c):
                self.report(
                    f"{self.where}: {pool.name} allocates while memory it freed ({what}, freed "
                    f"in {freed}) may still be in use on {u.name} ({where}): ordered by no wait, "
                    f"and no record_stream names {u.name}"
                )


def _key(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


class _Dispatch(TorchDispatchMode):
    """Every tensor operation: moved to the CPU if it names a cuda device, then charged to a
    stream by the check."""

    def __init__(self, check: StreamCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        target = None
        device = kwargs.get("device")
        if isinstance(device, torch.device):
            target = _index(device) if device.type == "cuda" else -1
            kwargs = {**kwargs, "device": torch.device("cpu")}
        check = self.check
        check._after = []
        out = func(*args, **kwargs)
        check.issued(func, args, kwargs, out, target)
        for item in check._after:
            if isinstance(item, tuple):
                item[1].join(item[2].clock)  # the destination's later work follows the copy
            else:
                check.host_waits(item.clock)
        return out


def check_pipeline(
    make: Callable[[], Any],
    x: torch.Tensor,
    y: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    steps: int = 2,
) -> list[str]:
    """Build a pipeline runtime with `make()` (on cuda devices) and run `steps` training steps
    and one inference under the check, as a training loop runs them: the batch and targets
    copied to the first device without waiting (as from pinned memory), and after each step
    the loss read, then every parameter updated and its gradient dropped, on the default
    streams, with nothing waiting for that before the next step. Returns the problems found."""
    with StreamCheck() as check:
        with check.at("building the pipeline"):
            pipe = make()
        check.watch(pipe)
        first = pipe.devices[0]
        for step in range(steps):
            with check.at(f"the caller, before step {step}"):
                xd = x.to(first, non_blocking=True)
                yd = y.to(first, non_blocking=True) if isinstance(y, torch.Tensor) else y
            with check.at(f"step {step}, between actions"):
                loss = pipe.train_step(xd, yd, loss_fn)
            with check.at(f"the caller, after step {step}"), torch.no_grad():
                float(loss)
                for stage in pipe.stages:
                    for p in stage.parameters():
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-1e-3)
                            p.grad = None
                del xd, yd, loss
        with check.at("the caller, around inference"):
            out = pipe.infer(x.to(first, non_blocking=True))
            float(tree_leaves(out)[0].float().sum())
            del out
        del pipe
    return check.problems
