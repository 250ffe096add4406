# ---------------------------------------------------------------------------------------------
# gpipe-plan distributed runtime: one process per pipeline device, launched by torchrun (one host
# or many); stages on other ranks are reached over torch.distributed point-to-point (gloo on CPU,
# NCCL on GPU). Each rank runs a straight-line program in which the communication between two
# compute actions is one batch: every send and receive in it is posted at once
# (batch_isend_irecv; under gloo, which coalesces nothing, one call each) and all of them are
# waited for before the next compute action. The
# program's batches are placed so that this cannot hang even where a send completes only once
# its receive is posted, as with NCCL (schedules/comm.py; validate(..., rendezvous=True)
# proves it for the program), and sent tensors are let go as soon as their batch completes.
# A rank that runs every forward first (GPipe) posts all its forward receives in `begin`
# (PREPOSTED, schedules/comm.preposted): its sender's messages then go at once.
#
# A receive is posted with its buffer, so the receiver must know the shapes before anything
# arrives: every rank works them out itself, once per input shape, by running the whole model
# on fake tensors (no memory, no compute, no messages).
#
# A step that fails on one rank leaves its peers waiting on messages that will never come, and
# neither gloo nor NCCL lets another thread end such a wait. So a failing rank writes why to the
# launch's store, and on every other rank a watchdog thread that sees it while its rank is still
# inside a step ends the process (exit 1, naming the failing rank, action, stage and
# micro-batch): no rank is left waiting, whether or not the failing rank's caller catches the
# error. A step ends on a rank only once every rank has reached its end (the loss is
# all-reduced), so no rank completes a step another failed.
# ---------------------------------------------------------------------------------------------
from __future__ import annotations  # emit: drop

import contextlib  # emit: drop
import logging
import os
import sys
import threading
import time
import weakref
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
    StageError,  # emit: drop
    Value,  # emit: drop
    _shared_parameters,  # emit: drop
    _split_target,  # emit: drop
    _tensors,  # emit: drop
    _to,  # emit: drop
    described,  # emit: drop
    out_of_place,  # emit: drop
    owner,  # emit: drop
    trains,  # emit: drop
    trains_before,  # emit: drop
)  # emit: drop

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]  # fmt: skip
# int64 slots summed at each step: [seed, dtype, ndim, shape..., bits..., targets, refused], the
# bits a stage each (whether it trains), _BITS to a slot (clear of the sign), before the last two
_SIGNATURE = 64
_BITS = 62
Spec = tuple[tuple[int, ...], torch.dtype]


def _samples(y: Any) -> int:
    """How many samples `y` holds, batch first (a tuple's tensors: each as many), 0 where it
    holds no tensor, -1 where one has no batch dimension or they disagree."""
    leaves = [y] if isinstance(y, torch.Tensor) else list(y) if isinstance(y, (tuple, list)) else []
    counts = {t.shape[0] if t.dim() > 0 else -1 for t in leaves if isinstance(t, torch.Tensor)}
    if not counts:
        return 0
    return counts.pop() if len(counts) == 1 and -1 not in counts else -1


def rank_device(named: str | None, rank: int) -> torch.device:
    """A rank's device: the one its cluster device names (torch_device), else the GPU of this
    host's LOCAL_RANK, else the CPU."""
    if named:
        try:
            device = torch.device(named)
        except RuntimeError as e:
            raise RuntimeError(f"device {named!r}: {e}") from None
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= have:
            raise RuntimeError(
                f"the cluster gives this rank {named}, which this host does not have "
                f"({have} CUDA devices)"
            )
        return device
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}")
    return torch.device("cpu")


# How often the watchdog looks at the store while its rank is in a step, and how long it lets
# its rank go on after another rank failed (the rank's own failure, at the same moment, is
# reported as its own), in seconds.
WATCH_EVERY, WATCH_GRACE = 0.2, 1.0


@contextlib.contextmanager
def quiet_fake_tensors() -> Iterator[None]:
    """torch logs every operation a fake tensor cannot run, with its traceback: quiet while a
    pass on fake tensors runs (its caller says what failed, once)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)  # (setLevel: the logger caches what it lets through)
    try:
        yield
    finally:
        log.setLevel(level)


def _why_stopped(store: Any, key: str) -> str | None:
    """What a failing rank wrote under `key` ("rank R failed: ..."), "" if none did yet, None
    where the store cannot be reached."""
    try:
        return store.get(key).decode() if store.check([key]) else ""
    except Exception:  # noqa: BLE001 - the store is gone
        return None


def _watch(
    runtime: Any, in_step: threading.Event, store: Any, key: str, rank: int, halt: Any
) -> None:
    """The watchdog: while `runtime` lives, when another rank's failure is in the store and
    this rank is still in a step a grace period later, halt the process. A rank outside a step
    is let be: its next step says the pipeline stopped."""
    while runtime() is not None:
        if not in_step.wait(1.0):
            continue
        why = _why_stopped(store, key)
        if why is None:  # the store is gone: the launcher ends the job
            return
        if not why or why.startswith(f"rank {rank} "):
            time.sleep(WATCH_EVERY)
            continue
        end = time.monotonic() + WATCH_GRACE
        while in_step.is_set() and time.monotonic() < end:
            time.sleep(0.05)
        if in_step.is_set():
            halt(f"rank {rank} stopped: {why}")
        return


class BatchRefused(ValueError):
    """Every rank refuses this step's batch (one rank's own reason, or the others'), before
    anything of the step is done: the model and its gradients are as they were."""


class ProgramRefused(RuntimeError):
    """A rank will not run this program (world size, model, device, another rank's refusal):
    every rank raises it before anything else crosses ranks."""


class DistPipelineRuntime(PipelineRuntime):
    """PipelineRuntime for one rank: only this rank's stages live here."""

    RENDEZVOUS = True  # the program meets when sends block (validate(..., rendezvous=True))
    DEVICES: list[str] = []  # per rank: the cluster's torch_device ("": this host's choice)
    PLAN = "0" * 16  # the plan and each rank's actions, hashed: the same on every rank
    PROFILED_ON = "cpu"  # the device type the plan's profile was measured on
    PREPOSTED: tuple[int, ...] = ()  # stages whose forward receives are posted at begin
    MAX_BATCH: int | None = None  # the most samples a step may take (a Pipe's: its plan's)
    SAMPLE_SHAPE: list[int] | None = None  # the shape of one (a Pipe's: its plan's)

    def __init__(self, model: nn.Sequential, *, deferred_batch_norm: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "call torch.distributed.init_process_group first (torchrun sets it up)"
            )
        self.rank, world = dist.get_rank(), dist.get_world_size()
        ranks = max(self.RANKS) + 1
        layers = list(model)
        out_of_place(layers)
        problem = ""
        try:
            self.device = self._own_device()
        except RuntimeError as e:
            self.device, problem = torch.device("cpu"), str(e)
        if world != ranks:
            problem = (
                f"this program runs on {ranks} processes, not {world}: torchrun "
                f"--nproc-per-node {ranks}"
            )
        elif self.STAGES[-1][1] != len(layers):
            problem = (
                f"this program splits {self.STAGES[-1][1]} layers; the model has {len(layers)}"
            )
        elif not self.RENDEZVOUS and (
            self.device.type != "cpu" or "nccl" in str(dist.get_backend()).lower()
        ):
            problem = (
                "this program's communication is not proven free of deadlock where a send "
                "completes only once its receive is posted, as with NCCL: run it on CPUs, "
                "under gloo"
            )
        self._agree(problem)
        self.store, self.stop_key, serial = self._stop_store()
        # each pipeline's messages carry tags of their own: a receive a failed step left posted
        # (PREPOSTED) must not take a message of a pipeline made after it
        self.tag_base = serial * 2 * len(self.STAGES) ** 2 * self.MICROBATCHES
        self.in_step = threading.Event()  # set while this rank runs a step (for the watchdog)
        self.watchdog: threading.Thread | None = None
        if self.rank == 0 and self.PROFILED_ON == "cpu" and self.device.type != "cpu":
            import warnings

            warnings.warn(
                f"the plan was made from a CPU profile but runs on {self.device.type}: its "
                "times are the CPU's, and its memory counts no copy of the input batch on the "
                "first stage (the CPU works on the caller's own); profile on the GPU to plan "
                "for it",
                stacklevel=2,
            )
        self.local = {s for s, r in enumerate(self.RANKS) if r == self.rank}
        self.layers = layers
        self.spec_cache: dict[Any, dict[Any, list[Spec]]] = {}
        self.sending: list[tuple[Any, torch.Tensor]] = []  # sends not yet seen complete
        self.tuple_out = [False] * len(self.STAGES)  # does the stage hand on a tuple
        self._route(layers)
        self.ties = self._tie_groups(layers)
        self.devices = [self.device] * len(self.STAGES)
        self.stages = [
            nn.Sequential(*layers[a:b]).to(self.device) if s in self.local else nn.Sequential()
            for s, (a, b) in enumerate(self.STAGES)
        ]
        self.shared = [_shared_parameters(st) for st in self.stages]  # as PipelineRuntime's
        self.deferred_batch_norm = deferred_batch_norm
        if deferred_batch_norm:
            for s in self.local:
                defer_batch_norm(self.stages[s], self.MICROBATCHES)
        # gloo coalesces nothing: each operation of a batch posted by itself, all of them
        # before any wait as batch_isend_irecv posts them, costs a third less to post
        self.post_each = str(dist.get_backend()).lower() == "gloo"
        self.cuda = False  # one device per process: no streams of our own
        self.stage_context = lambda s: contextlib.nullcontext()
        self.action_log = None
        self.rng = None
        # the step's signature, one buffer for every step: a step's own, all-reduced, was let
        # go by gloo's thread now and then only after the step's peak (512 bytes the plan
        # did not count, on the first rank in one of three measured steps)
        self.words = -(-len(self.STAGES) // _BITS)  # (the slots of the stages' bits)
        # (and after its slots, per tied weight: how many of its ranks train it)
        self.signature = torch.zeros(_SIGNATURE + len(self.holders), dtype=torch.int64)
        self._watch()
        self._reset()

    def _own_device(self) -> torch.device:
        """The cluster's device for this rank (its torch_device), else the GPU of this host's
        LOCAL_RANK, else the CPU; on a GPU it becomes the current device, as NCCL needs."""
        named = self.DEVICES[self.rank] if self.rank < len(self.DEVICES) else ""
        device = rank_device(named, self.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _agree(self, problem: str) -> None:
        """Before anything else crosses ranks: every rank runs the same program and none has a
        problem with it, or every rank refuses (each with its own reason, or the others')."""
        device = self.device
        if device.type != "cuda" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # NCCL's collectives
        mine = torch.tensor(
            [int(self.PLAN[:15], 16), int(bool(problem))], dtype=torch.int64, device=device
        )
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if problem:
            raise ProgramRefused(f"rank {self.rank}: {problem}")
        if int(hi[1]):
            raise ProgramRefused(
                f"rank {self.rank}: another rank refused this program; see its message"
            )
        if int(lo[0]) != int(hi[0]):
            raise ProgramRefused(
                f"rank {self.rank} runs program {self.PLAN}, and some rank another: give every "
                "rank the same program"
            )

    def _stop_store(self) -> tuple[Any, str, int]:
        """The launch's store, this pipeline's key in it, where a rank whose step fails says
        why, and how many pipelines this rank made before it. Every rank makes its pipelines
        in the same order (each agrees in _agree), so the n-th on each shares a key."""
        try:
            store = dist.distributed_c10d._get_default_store()
            n = store.add(f"gpipe-plan/pipelines/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - no store: a failure ends the job only as torchrun does
            return None, "", 0
        return store, f"gpipe-plan/{self.PLAN}/{n}/failed", n - 1

    def _failed(self) -> str:
        """Why the pipeline stopped ("rank R failed: ..."), or ""."""
        if self.store is None:
            return ""
        return _why_stopped(self.store, self.stop_key) or ""  # (no store: the launch is ending)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around a step: it does not start once any rank's step failed; a failure here (not a
        refusal, which every rank makes together) is written to the store for the other ranks'
        watchdogs, first writer wins."""
        why = self._failed()
        if why:
            raise StageError(f"rank {self.rank}: the pipeline stopped: {why}")
        if self.store is not None and self.watchdog is None:
            self.watchdog = threading.Thread(
                target=_watch,
                args=(weakref.ref(self), self.in_step, self.store, self.stop_key, self.rank,
                      type(self).halt),
                name=f"gpipe-plan watchdog, rank {self.rank}",
                daemon=True,
            )  # fmt: skip
            self.watchdog.start()
        self.in_step.set()
        self.doing = None
        try:
            yield
        except (BatchRefused, ProgramRefused):
            raise
        except BaseException as e:
            self.in_step.clear()  # (before the store: this rank's watchdog must not halt it)
            doing = self.doing  # the action it failed in (None: between actions)
            reason = str(e) if isinstance(e, StageError) else described(e)
            if isinstance(e, KeyboardInterrupt):
                reason = "interrupted" + (
                    f" in {doing[0]} of stage {doing[1]}, micro-batch {doing[2]}" if doing else ""
                )
            if self.store is None:
                raise
            with contextlib.suppress(Exception):
                self.store.compare_set(self.stop_key, "", f"rank {self.rank} failed: {reason}")
            why = self._failed()
            # A failure in communication (in a batch of sends and receives, or a collective
            # between actions) that follows another rank's is named after that one; one in
            # this rank's own compute is its own.
            talking = doing is None or doing[0].startswith(("send_", "recv_"))
            if why and not why.startswith(f"rank {self.rank} ") and talking:
                raise StageError(f"rank {self.rank} stopped: {why}") from e
            raise
        finally:
            self.in_step.clear()

    @staticmethod
    def halt(message: str) -> None:
        """End this process, which waits on a rank that failed and will never hear from it
        (no thread can end a wait inside gloo or NCCL)."""
        print(f"gpipe-plan: {message}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(1)

    def _tie_groups(self, layers: list[nn.Module]) -> list[tuple[nn.Parameter, Any, int, int]]:
        """A parameter that stages on several ranks use (tied weights): every rank holding it
        sums its gradient with the others' at the end of the step, so all of them take the same
        optimizer step. Each rank sees the whole model, so all agree on the groups (and create
        them in the same order, as torch.distributed requires). Each with its group's first
        rank and its place among all the model's tied weights (`holders`: how many ranks hold
        each)."""
        users: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for s, (a, b) in enumerate(self.STAGES):
            for layer in layers[a:b]:
                for p in layer.parameters():
                    users.setdefault(id(p), (p, set()))[1].add(self.RANKS[s])
        groups: dict[tuple[int, ...], Any] = {}
        ties = []
        self.holders: list[int] = []
        for p, ranks in users.values():  # (frozen ones too: a caller may unfreeze them)
            if len(ranks) > 1:
                key = tuple(sorted(ranks))
                if key not in groups:
                    groups[key] = dist.new_group(list(key))
                if self.rank in ranks:
                    ties.append((p, groups[key], key[0], len(self.holders)))
                self.holders.append(len(ranks))
        return ties

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once (its stages may share one, a tied weight under
        interleaved 1F1B): give them to this rank's optimizer."""
        seen: set[int] = set()
        for s in sorted(self.local):
            for p in self.stages[s].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def _reset(self) -> None:
        super()._reset()
        self.outbox: dict[tuple[str, int, int], Any] = {}
        self.ahead: dict[tuple[int, int], tuple[list[Any], list[torch.Tensor]]] = {}
        self.out_meta: dict[tuple[int, int], list[tuple[list[int], torch.dtype] | None]] = {}

    def begin(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        """Every rank calls this with the same mini-batch; only the first stage's rank needs x and
        only the last stage's rank needs y (the others may pass None)."""
        M, last = self.MICROBATCHES, len(self.STAGES) - 1
        self.loss_fn = loss_fn
        self._reset()
        if self.SCHEDULE == "zb-h1":
            self._rewatch()
        # From the first stage's rank: the dropout seed and the input's shape; from every rank:
        # whether it refuses this batch (so that all refuse together, none left waiting).
        sig = self.signature
        sig.zero_()
        problem = ""
        if 0 in self.local:
            sig[0] = int(torch.randint(0, 2**62, (1,)))
            if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] < M:
                problem = f"the first stage's rank needs the input batch, with at least {M} samples"
            elif x.dtype not in _DTYPES or x.dim() > _SIGNATURE - 5 - self.words:
                problem = f"an input of dtype {x.dtype} and {x.dim()} dimensions"
            else:
                sig[1 : 3 + x.dim()] = torch.tensor([_DTYPES.index(x.dtype), x.dim(), *x.shape])
        if last in self.local and not problem and not callable(loss_fn):
            problem = "loss_fn: expected a function (output, target) -> loss"
        if last in self.local and not problem:
            count = _samples(y)
            if count < 0:
                problem = "the targets' tensors must each be batch first, as many samples each"
            elif count == 0 and _samples(x) < M:
                problem = "the last stage's rank needs the targets (batch first)"
            elif 0 < count < M:
                problem = (
                    f"the targets hold {count} samples; this plan takes at least {M} (one per "
                    "micro-batch)"
                )
            sig[_SIGNATURE - 2] = max(count, 0)  # checked against the input's on every rank, below
        for s in self.local:  # which stages train, read at each step (a caller may freeze or
            if trains(self.stages[s]):  # unfreeze layers between steps): one bit each
                sig[_SIGNATURE - 2 - self.words + s // _BITS] += 1 << (s % _BITS)
        for p, _, _, k in self.ties:  # and how many ranks train each tied weight
            sig[_SIGNATURE + k] += int(p.requires_grad)
        sig[_SIGNATURE - 1] = int(bool(problem))
        sig = sig.to(self.device)
        dist.all_reduce(sig)  # one rank's entries, summed with the others' zeros
        values = sig.tolist()
        head, tied = values[:_SIGNATURE], values[_SIGNATURE:]
        words = head[_SIGNATURE - 2 - self.words : -2]
        training = [bool(words[s // _BITS] >> (s % _BITS) & 1) for s in range(len(self.STAGES))]
        self.trains_before = trains_before(training)
        self.check_frozen(self.local)
        for s in self.local:  # (what trains, as now: zero bubble's I takes their gradients)
            self.shared[s] = _shared_parameters(self.stages[s])
        if problem:
            raise BatchRefused(problem)
        if head[-1]:
            raise BatchRefused("another rank refused this step's batch; see its message")
        if any(0 < n < h for n, h in zip(tied, self.holders)):
            # (each rank would sum the weight's gradient or not by its own flag: a rank left
            # waiting in the sum, found by a red team)
            raise BatchRefused(
                "a tied weight trains on some ranks and is frozen on others: set its "
                "requires_grad alike on every rank"
            )
        # What the summed signature alone settles, every rank settles alike: all refuse
        n, targets = head[3], head[-2]
        if targets and targets != n:
            raise BatchRefused(
                f"the target has {targets} samples but the input has {n}; pass one target per "
                "sample (batch first)"
            )
        if self.MAX_BATCH is not None and n > self.MAX_BATCH:
            raise BatchRefused(
                f"the plan is for batches of {M} to {self.MAX_BATCH} samples ({M} micro-batches, "
                f"its memory figures for {self.MAX_BATCH}); plan again with batch_size={n}"
            )
        sample = head[4 : 3 + head[2]]
        if self.SAMPLE_SHAPE is not None and sample != list(self.SAMPLE_SHAPE):
            raise BatchRefused(
                f"each sample has shape {sample}, the plan is for {list(self.SAMPLE_SHAPE)} (its "
                "memory figures hold for that shape): plan again for this one"
            )
        self.specs = self._shapes(tuple(head[3 : 3 + head[2]]), _DTYPES[head[1]])
        # A weight several ranks share: its gradient accumulated over earlier steps is the
        # same on each of them (every step ends by summing it), and is summed once more only
        # if one rank keeps it: the group's first goes on from it, the others from zero, in
        # place (setting it aside instead held two gradients of the weight through the step,
        # one more than the plan counts). Where a caller made them differ (say, clipped each
        # rank by its own norm), the first rank's is the one carried on, and every rank ends
        # the step holding the same. Once the batch is agreed: a refused step leaves them. A
        # frozen one is not summed (finish): each rank keeps what it holds, the same on each.
        for p, _, first, _ in self.ties:
            if p.grad is not None and p.requires_grad and self.rank != first:
                p.grad.zero_()
        self.seed = head[0]
        if 0 in self.local:
            self.batch = list(torch.tensor_split(x, M))
        self.rng = save_rng([self.device])
        if last in self.local:
            # each micro-batch's share of the loss, by the samples it takes (n: the input's)
            self.weights = [len(p) / n for p in torch.tensor_split(torch.empty(n, 0), M)]
            self.targets = [_to(t, self.device) for t in _split_target(y, M)]
        for s in self.PREPOSTED:  # (schedules.comm.preposted says when this pays)
            # Where a rank's operations run in the order posted whatever their peer (NCCL
            # batches: one communicator), a middle stage's sends would queue behind these:
            # there only the last stage posts ahead, as for a plan profiled on a GPU.
            last = s == len(self.STAGES) - 1
            if s in self.local and not self.routed and (self.post_each or last):
                for m in range(M):
                    ops: list[Any] = []
                    with owner(s):  # (the stage's memory: measure once missed them, unowned)
                        bufs = self._recv(
                            ops, self.specs[(s - 1, s, m)], s - 1, self._tag("F", s - 1, s, m)
                        )
                    self.ahead[(s, m)] = (self._post(ops), bufs)

    def _shapes(self, shape: tuple[int, ...], dtype: torch.dtype) -> dict[Any, list[Spec]]:
        """What each activation message of this step holds, (shape, dtype) per tensor, keyed
        (sender stage, receiver stage, micro-batch): worked out on fake tensors through the
        whole model (every rank holds it), once per input shape and dtype. The ranks agree on
        the outcome (each runs the pass with its own stages on its device: one may fail
        alone), so all refuse the batch or none; each keeps only shapes all of them found, so
        all of them agree again the next time a shape is new."""
        key = (shape, dtype)
        if key in self.spec_cache:
            return self.spec_cache[key]
        from torch._subclasses.fake_tensor import FakeTensorMode

        M = self.MICROBATCHES
        sizes = [len(part) for part in torch.tensor_split(torch.empty(shape[0], 0), M)]
        by_size: dict[int, dict[tuple[int, int], list[Spec]]] = {}
        problem = ""
        try:
            with (
                quiet_fake_tensors(),
                torch.no_grad(),
                FakeTensorMode(allow_non_fake_inputs=True) as mode,
            ):
                for b in sorted(set(sizes)):
                    x = torch.empty((b, *shape[1:]), dtype=dtype)
                    by_size[b] = self._fake_pass(x, mode)
        except Exception as e:  # noqa: BLE001 - said below, once every rank knows
            problem = described(e)
        failed = torch.tensor([int(bool(problem))], dtype=torch.int64, device=self.device)
        dist.all_reduce(failed)
        if problem or int(failed[0]):
            raise BatchRefused(
                f"cannot work out the shapes the stages send each other from an input of shape "
                f"{list(shape)}: {problem or 'another rank could not; see its message'}"
            )
        specs = {
            (a, t, m): by_size[sizes[m]][(a, t)] for m in range(M) for a, t in by_size[sizes[m]]
        }
        self.spec_cache[key] = specs
        return specs

    def _fake_pass(self, x: torch.Tensor, mode: Any) -> dict[tuple[int, int], list[Spec]]:
        """The model on a fake input, in the mode it is in, each layer on fake copies of its
        parameters and buffers (so nothing of the model changes): (sender, receiver) stage ->
        what the sender sends."""
        from torch.func import functional_call

        def call(layer: nn.Module, v: Any) -> Any:
            state = {
                n: mode.from_tensor(t)
                for n, t in [*layer.named_parameters(), *layer.named_buffers()]
            }
            dev = next(iter(state.values()), None)
            if dev is not None:
                v = torch.utils._pytree.tree_map(
                    lambda t: t.to(dev.device) if isinstance(t, torch.Tensor) else t, v
                )
            return functional_call(layer, state, (v,), strict=False)

        def spec(t: torch.Tensor) -> Spec:
            return tuple(t.shape), t.dtype

        out: dict[tuple[int, int], list[Spec]] = {}
        if not self.routed:
            h: Any = x
            for s, (a, b) in enumerate(self.STAGES[:-1]):
                for layer in self.layers[a:b]:
                    h = call(layer, h)
                out[(s, s + 1)] = [spec(t) for t in _tensors(h)]
                self.tuple_out[s] = isinstance(h, tuple)
            return out
        made: dict[str, Spec] = {self.input_name: spec(x)}
        env: dict[str, Any] = {self.input_name: x}
        for layer in self.layers[: self.STAGES[-1][0]]:
            args = tuple(env.get(n) for n in layer.inputs)
            res = call(layer, args if len(args) > 1 else args[0])
            outs = res if len(layer.crossing) > 1 else (res,)
            env = dict(zip(layer.crossing, outs))
            made.update({n: spec(v) for n, v in env.items() if isinstance(v, torch.Tensor)})
        return {(a, t): [made[n] for n in names] for (a, t), names in self.routes.items()}

    def finish(self) -> torch.Tensor:
        for work, _ in self.sending:
            work.wait()
        self.sending = []
        for p, group, _, _ in self.ties:  # tied weights: the gradient of every use, on each
            if not p.requires_grad:  # (frozen: on every rank, which all see the whole model)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        last = len(self.STAGES) - 1
        total = torch.zeros((), device=self.device)
        if last in self.local:
            total = sum(self.losses[m].float() for m in range(self.MICROBATCHES)) + total
        # summed with the other ranks' zeros: no rank returns before every rank reached here,
        # so none completes a step that failed on another
        dist.all_reduce(total)
        self._watched()
        self._reset()
        return total

    # Hand-offs: within the rank as before; to another rank through the outbox and SEND actions.

    def _tag(self, kind: str, src: int, dst: int, m: int) -> int:
        """A captured graph's messages carry a tag each: a rank may send one rank several."""
        S = len(self.STAGES)
        return self.tag_base + (("FB".index(kind) * S + src) * S + dst) * self.MICROBATCHES + m + 1

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
                        and self.trains_before[s]  # (a frozen prefix: none goes back)
                    ]))  # fmt: skip
            if near:
                self.outgrads[(s, m)] = (near, None)  # type: ignore[assignment]
            if far:
                self.outbox[("B", s, m)] = far
            return
        if s - 1 in self.local:
            return super().leave_grad(grads, s, m, like)
        # One tensor per floating-point input, zeros where it got no gradient: the receiver
        # knows the shapes of the outputs they belong to (none after a frozen prefix).
        self.outbox[("B", s, m)] = [
            g if g is not None else torch.zeros_like(t)
            for g, t in zip(grads, like)
            if t.is_floating_point() and self.trains_before[s]
        ]

    def pull(self, s: int, m: int) -> Grads:
        if self.routed or s + 1 in self.local:
            return super().pull(s, m)
        return self.outgrads.pop((s + 1, m))[0]  # received by RECV_B, already ours

    def exchange(self, *actions: tuple[int | str, ...]) -> None:
        """One batch of communication: the sends and receives of `actions` (each
        (what, stage, micro-batch), or with the stage at the other end when the action carries
        that one message only, in program order) posted at once and waited for, so what
        was sent is let go as the batch ends. A program not proven to meet where sends block
        (RENDEZVOUS False: gloo only) waits for its receives only and lets each send go once it
        sees it complete, here or at the end of the step. NOTE: gloo's point-to-point work
        says it is complete only once waited for, so there every send is held to the step's
        end (memory the plan does not count: a program runs this way only where no placement
        of its messages meets, as for some captured graphs' skips)."""
        ops: list[Any] = []
        done: list[Callable[[], None]] = []
        what, s, m = actions[0][:3]
        with self._action(what, s, m):  # type: ignore[arg-type]
            self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]
            for kind, stage, mb, *peer in actions:
                getattr(self, f"_{kind}")(stage, mb, ops, done, *peer)
            works = self._post(ops)
            one = len(works) != len(ops)  # one handle for the whole batch
            for work, op in zip(works, [None] * len(works) if one else ops):
                if op is not None and op.op is dist.isend and not self.RENDEZVOUS:
                    self.sending.append((work, op.tensor))
                else:
                    work.wait()
            for finish in done:
                finish()
        if self.action_log:  # each action of the batch took the batch's time
            *_, start, end = self.action_log[-1]
            self.action_log += [(a[0], a[1], a[2], start, end) for a in actions[1:]]

    def _post(self, ops: list[Any]) -> list[Any]:
        """Post a batch's operations: their work handles (one for the whole batch, or one
        each where the backend coalesces nothing)."""
        if self.post_each:
            return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        return dist.batch_isend_irecv(ops) if ops else []

    def _send(self, ops: list[Any], ts: list[torch.Tensor], dst: int, tag: int) -> None:
        ops += [dist.P2POp(dist.isend, t.contiguous(), self.RANKS[dst], tag=tag) for t in ts]

    def _recv(self, ops: list[Any], specs: list[Spec], src: int, tag: int) -> list[torch.Tensor]:
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        ops += [dist.P2POp(dist.irecv, b, self.RANKS[src], tag=tag) for b in bufs]
        return bufs

    def _mine(self, key: tuple[str, int, int], peer: int) -> Any:
        """What the outbox holds under `key` for `peer` (-1: all of it), taken out."""
        if peer < 0:
            return self.outbox.pop(key)
        held = self.outbox[key]
        self.outbox[key] = [item for item in held if item[0] != peer]
        if not self.outbox[key]:
            del self.outbox[key]
        return [item for item in held if item[0] == peer]

    def _send_forward(
        self, s: int, m: int, ops: list[Any], done: list[Any], peer: int = -1
    ) -> None:
        far = self._mine(("F", s, m), peer) if self.routed else self.outbox.pop(("F", s, m))
        for t, ts in far if self.routed else [(s + 1, far[1])]:
            got = [(tuple(x.shape), x.dtype) for x in ts]
            if got != self.specs[(s, t, m)]:
                raise RuntimeError(
                    f"stage {s} sends stage {t} {got} for micro-batch {m}, where the shape pass "
                    f"found {self.specs[(s, t, m)]}: the model's output shapes depend on more "
                    "than its input's shape"
                )
            self._send(ops, ts, t, self._tag("F", s, t, m))

    def _recv_forward(
        self, s: int, m: int, ops: list[Any], done: list[Any], peer: int = -1
    ) -> None:
        if self.routed:
            for (a, t), names in sorted(self.routes.items()):
                if t == s and a not in self.local and peer in (-1, a):
                    bufs = self._recv(ops, self.specs[(a, t, m)], a, self._tag("F", a, s, m))
                    got = self.inputs.setdefault((s, m), {})
                    done.append(
                        lambda got=got, names=names, bufs=bufs: got.update(zip(names, bufs))
                    )
            return
        works: list[Any] = []
        if (s, m) in self.ahead:  # posted when the step began: here only waited for
            works, bufs = self.ahead.pop((s, m))
        else:
            bufs = self._recv(ops, self.specs[(s - 1, s, m)], s - 1, self._tag("F", s - 1, s, m))
        tuple_out = self.tuple_out

        def finish() -> None:
            for work in works:
                work.wait()
            self.inputs[(s, m)] = tuple(bufs) if tuple_out[s - 1] else bufs[0]

        done.append(finish)

    def _send_backward(
        self, s: int, m: int, ops: list[Any], done: list[Any], peer: int = -1
    ) -> None:
        if self.routed:
            for a, gs in self._mine(("B", s, m), peer):
                self._send(ops, gs, a, self._tag("B", a, s, m))
            return
        self._send(ops, self.outbox.pop(("B", s, m)), s - 1, self._tag("B", s - 1, s, m))

    def _recv_backward(
        self, s: int, m: int, ops: list[Any], done: list[Any], peer: int = -1
    ) -> None:
        if self.routed:
            meta = self.out_meta[(s, m)]  # (dropped with the step: a message per peer reads it)
            for (a, t), names in sorted(self.routes.items()):
                if a != s or t in self.local or peer not in (-1, t):
                    continue
                got: dict[str, Any] = {}
                for n in names:
                    got[n] = None
                    if meta[n] is not None and self.trains_before[t]:  # type: ignore[call-overload]
                        shape, dtype = meta[n]  # type: ignore[call-overload]
                        got[n] = self._recv(ops, [(shape, dtype)], t, self._tag("B", s, t, m))[0]
                slot = self.outgrads.setdefault((t, m), ({}, RECEIVED))[0]
                done.append(lambda slot=slot, got=got: slot.update(got))  # type: ignore[union-attr]
            return
        grads: list[torch.Tensor | None] = [
            None
            if spec is None or not self.trains_before[s + 1]
            else self._recv(ops, [spec], s + 1, self._tag("B", s, s + 1, m))[0]
            for spec in self.out_meta.pop((s, m))  # type: ignore[union-attr]
        ]
        done.append(lambda: self.outgrads.__setitem__((s + 1, m), (grads, None)))

    def _enter_streams(self) -> None:
        pass

    def _leave_streams(self) -> None:
        pass
