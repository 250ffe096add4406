"""The Python API: compile_pipe(model, plan) -> Pipe, and auto_pipe (profile, plan, compile)."""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any

import torch
from torch import nn

from planner import Cluster, Plan, parse_size, plan_pipeline
from profiler.artifact import InputError
from profiler.limits import MAX_BATCH, ArgumentError, real, whole
from profiler.measure import profile_model
from profiler.models import as_layers, capture_sample, model_digest
from schedules import Schedule

from ._runtime import StageError
from .emit import emit_program


class Pipe:
    """A model compiled into a pipeline. Its parameters are the model's own (moved to their
    devices), so any optimizer over `model.parameters()` works as usual.

        loss = pipe.train_step(x, y, loss_fn)   # .grad as after loss_fn(model(x), y).backward()
        out = pipe(x)                           # pipelined inference, no graph kept
    """

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        source: str,
        program: Any,
        module: Any,
        distributed: bool = False,
        model: nn.Module | None = None,
    ) -> None:
        self.plan = plan
        self.schedule = schedule
        self.source = source
        self.program = program
        self._module = module  # the executed program: its own StageError class lives there
        self.distributed = distributed  # one rank of a torchrun launch: only its stages here
        # the model compiled, and which modules it had then: each step checks (not given on a
        # rank of a launch, where one rank's refusal alone would leave the others waiting, and
        # a rank may drop the layers it does not run: found by a review)
        self._model = model
        self._made_of = _made_of(model) if model is not None else None

    @property
    def rank(self) -> int:
        """This process's rank (0 when the whole pipeline runs here)."""
        return self.program.rank if self.distributed else 0

    def parameters(self) -> Any:
        """The parameters this process trains, each once: give them to its optimizer. (Two
        stages on one device may use one parameter, a tied weight under interleaved 1F1B:
        listed twice, an optimizer stepped it twice; found by a cold review.)"""
        if self.distributed:
            return self.program.parameters()
        return _once(p for stage in self.program.stages for p in stage.parameters())

    @property
    def stages(self) -> list[nn.Sequential]:
        return self.program.stages

    @property
    def devices(self) -> list[torch.device]:
        return self.program.devices

    def train_step(self, x: torch.Tensor, y: Any, loss_fn: Any) -> torch.Tensor:
        """One step over the mini-batch x (batch first) with targets y; returns the mean loss.
        `loss_fn(output, target)` must average over the samples it is given. Distributed,
        every rank calls it: x matters on the first stage's rank, y on the last's (the others
        may pass None), and afterwards this rank's parameters hold their gradients."""
        self._unchanged()
        if self.distributed:  # every rank refuses a bad batch together, in the step's start
            # (a loss function too: only the last stage's rank uses it, and judges it there)
            try:
                return self.program.train_step(x, y, loss_fn)
            except self._module.StageError as e:
                raise StageError(str(e)) from e.__cause__
            except self._module.BatchRefused as e:
                raise InputError(str(e)) from None
        if not callable(loss_fn):
            raise ArgumentError("loss_fn", loss_fn, "expected a function (output, target) -> loss")
        self._check_batch(x)
        parts = y if isinstance(y, (tuple, list)) else (y,)
        if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in parts):
            raise InputError(
                "the target is one value (a tensor of no dimensions); pass one target per "
                "sample (batch first)"
            )
        if (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and y.dim() > 0
            and y.shape[0] != x.shape[0]
        ):
            raise InputError(
                f"the target has {y.shape[0]} samples but the input has {x.shape[0]}; "
                "pass one target per sample (batch first)"
            )
        try:
            return self.program.train_step(x, y, loss_fn)
        except self._module.StageError as e:
            raise StageError(str(e)) from e.__cause__

    def measure(
        self, x: torch.Tensor, y: Any, loss_fn: Any, *, steps: int = 3, tolerance: float = 0.05
    ) -> Any:
        """Run a warm-up step and `steps` more (each with an optimizer step of the plan's kind,
        whose tiny learning rate leaves the model all but unchanged) and compare memory and
        time with the plan: a MeasureReport (codegen/measure.py)."""
        from .measure import left_as_it_was, measure_in_process

        if self.distributed:
            raise InputError(
                "a distributed pipe is measured from outside: gpipe-plan measure PLAN --model "
                "MODEL --target torchrun"
            )
        self._unchanged()
        self._check_batch(x)
        whole(steps, "steps", 1, 10_000)
        real(tolerance, "tolerance", 0, 10)
        try:
            with left_as_it_was(self.program.stages):
                return measure_in_process(
                    self.plan, self.program, x, y, loss_fn, steps=steps, tolerance=tolerance
                )
        except self._module.StageError as e:
            raise StageError(str(e)) from e.__cause__

    def __call__(self, x: torch.Tensor) -> Any:
        if self.distributed:
            raise InputError(
                "pipelined inference runs in one process: compile the plan without distributed=True"
            )
        self._unchanged()
        self._check_batch(x)
        try:
            return self.program.infer(x)
        except self._module.StageError as e:
            raise StageError(str(e)) from e.__cause__

    def _unchanged(self) -> None:
        """The model still has the modules it was compiled with: the program runs those, so
        a layer replaced since would be left out of every step, unsaid, and an optimizer over
        the model would step parameters that never get a gradient (found by a red team). A
        parameter replaced on a module the program runs is used as it is: let be."""
        if self._model is not None and _made_of(self._model) != self._made_of:
            raise InputError(
                "the model changed since compile_pipe (a module replaced, added or removed), "
                "and the pipe runs the modules it was given: compile it again (plan it again "
                "where its layers changed)"
            )

    def _check_batch(self, x: Any) -> None:
        """The plan's memory holds for its batch size: more samples would break its promise."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise ArgumentError("x", type(x).__name__, "expected a tensor, batch first")
        N, M = self.plan.batch_size, self.plan.microbatches
        if not M <= x.shape[0] <= N:
            raise ArgumentError(
                "x.shape[0]",
                x.shape[0],
                f"the plan is for batches of {M} to {N} samples ({M} micro-batches, its memory "
                f"figures for {N}); plan again with batch_size={x.shape[0]}",
            )
        if list(x.shape[1:]) != list(self.plan.input_shape):
            raise InputError(_other_shape(list(x.shape[1:]), list(self.plan.input_shape)))

    def __repr__(self) -> str:
        if self.distributed:
            return (
                f"Pipe({self.plan.schedule}, rank {self.rank} of {len(self.plan.devices)}: "
                f"stages {sorted(self.program.local)} on {self.program.device}, "
                f"M={self.plan.microbatches})"
            )
        return (
            f"Pipe({self.plan.schedule}, {len(self.plan.stages)} stages on "
            f"{[str(d) for d in self.devices]}, M={self.plan.microbatches})"
        )


def _other_shape(got: list[int], planned: list[int]) -> str:
    """Why a batch of other samples is refused (found by a red team: a pipe took samples 250x
    the planned size, and measured 88x its plan's memory)."""
    return (
        f"each sample has shape {got}, the plan is for {planned} (its memory figures hold for "
        "that shape): plan again for this one"
    )


def layers_mismatch(layers: nn.Module, plan: Plan) -> str | None:
    """Where the model's layers (profiler.models.as_layers) are not of the plan's kind: an
    nn.Sequential's own against a plan for a captured graph, or the other way (a hand-edited
    `captured`: found by a red team, a traceback from codegen or a program that fails)."""
    captured = bool(getattr(layers, "captured", False))
    if captured == plan.captured:
        return None
    kind = "a graph captured from the model" if plan.captured else "an nn.Sequential's layers"
    own = "no nn.Sequential (its graph is captured)" if captured else "an nn.Sequential"
    return f"splits {kind}, but the model given is {own}; profile and plan the model again"


def compile_pipe(
    model: nn.Module,
    plan: Plan,
    devices: list[str | torch.device] | None = None,
    *,
    deferred_batch_norm: bool = False,
    check_model: bool = True,
    distributed: bool = False,
) -> Pipe:
    """Compile `plan` for `model`. `devices` (one per plan device) defaults to cuda:0..K-1 when
    the machine has them, else every stage runs on the CPU (and the Pipe says so once).

    `distributed=True`, inside a torchrun launch (init_process_group called): this rank's part
    of the torchrun program, a Pipe for its own stages; each rank takes its cluster device's
    torch_device, else cuda:LOCAL_RANK, else the CPU."""
    if not isinstance(model, nn.Module):
        raise ArgumentError("model", type(model).__name__, "expected a torch nn.Module")
    if not isinstance(plan, Plan):
        raise ArgumentError("plan", type(plan).__name__, "expected a Plan (Plan.load(path))")
    given = model
    model = as_layers(model, capture_sample(model, plan.input_shape, plan.input_dtype))
    mismatch = layers_mismatch(model, plan)
    if mismatch:
        raise InputError(f"the plan {mismatch}")
    if deferred_batch_norm and getattr(model, "captured", False):
        raise ArgumentError(
            "deferred_batch_norm",
            True,
            "is for nn.Sequential models; a captured graph runs batch norm as operations",
        )
    if check_model and model_digest(model) != plan.model_digest:
        raise InputError(
            f"the plan was made for a different model ({plan.model}, digest "
            f"{plan.model_digest[:12]}, this one {model_digest(model)[:12]}); "
            "profile and plan this model again"
        )
    if distributed:
        return _distributed_pipe(model, plan, devices, deferred_batch_norm)
    K = len(plan.devices)
    devs = _resolve_devices(devices, K, plan)
    if plan.device_type.split(":")[0] == "cpu" and devs[0].type != "cpu":
        warnings.warn(
            f"the plan was made from a CPU profile but runs on {devs[0]}: its times are the CPU's, "
            "and its memory counts no copy of the input batch on the first stage (the CPU works "
            "on the caller's own); profile on the GPU to plan for it",
            stacklevel=2,
        )
    source = emit_program(plan)
    namespace = types.ModuleType("gpipe_plan_program")
    exec(compile(source, f"<gpipe-plan program {plan.digest()[:12]}>", "exec"), namespace.__dict__)
    program = namespace.Pipeline(model, devs, deferred_batch_norm=deferred_batch_norm)
    from planner.search import schedule_of

    return Pipe(plan, schedule_of(plan), source, program, namespace, model=given)


def check_streams(
    model: nn.Module,
    plan: Plan,
    x: torch.Tensor,
    y: Any,
    loss_fn: Any,
    devices: list[str] | None = None,
    *,
    deferred_batch_norm: bool = False,
) -> list[str]:
    """Run the plan's streams program for a copy of `model` on the CPU under the stream checker
    (codegen/_streamcheck.py): two training steps and an inference as a training loop would run
    them, with its CUDA stream code doing what it does on a GPU. Returns the uses of memory its
    streams leave unordered ([] when none). `devices`: the cuda devices of the stages, by
    default one each (cuda:0..K-1); ["cuda:0"] * K puts every stage on streams of one GPU."""
    K = len(plan.devices)
    devices = devices if devices is not None else [f"cuda:{k}" for k in range(K)]
    if len(devices) != K or not all(torch.device(d).type == "cuda" for d in devices):
        raise ArgumentError("devices", devices, f"expected {K} cuda devices, e.g. ['cuda:0'] * {K}")
    model = as_layers(model, capture_sample(model, plan.input_shape, plan.input_dtype))
    source = emit_program(plan)
    namespace = types.ModuleType("gpipe_plan_program")
    exec(compile(source, f"<gpipe-plan program {plan.digest()[:12]}>", "exec"), namespace.__dict__)
    copied = copy.deepcopy(model)
    return namespace.check_pipeline(
        lambda: namespace.Pipeline(copied, devices, deferred_batch_norm=deferred_batch_norm),
        x,
        y,
        loss_fn,
    )


def _distributed_pipe(
    model: nn.Module, plan: Plan, devices: Any, deferred_batch_norm: bool
) -> Pipe:
    import torch.distributed as dist

    if devices is not None:
        raise ArgumentError(
            "devices",
            devices,
            "a distributed pipe's rank takes its device from the plan's cluster (torch_device) "
            "or from LOCAL_RANK",
        )
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(
            "compile_pipe(..., distributed=True) runs inside a torchrun launch: call "
            "torch.distributed.init_process_group first"
        )
    from planner.search import schedule_of

    source = emit_program(plan, target="torchrun")
    namespace = types.ModuleType("gpipe_plan_program")
    exec(compile(source, f"<gpipe-plan program {plan.digest()[:12]}>", "exec"), namespace.__dict__)
    try:
        program = namespace.Pipeline(model, deferred_batch_norm=deferred_batch_norm)
    except (RuntimeError, ValueError) as e:  # wrong world size, device or plan: every rank
        raise InputError(str(e)) from None
    program.MAX_BATCH = plan.batch_size  # (the plan's memory holds up to it; checked in step)
    program.SAMPLE_SHAPE = list(plan.input_shape)  # (and for samples of this shape)
    return Pipe(plan, schedule_of(plan), source, program, namespace, distributed=True)


def torch_pipelining(model: nn.Module, plan: Plan, loss_fn: Any) -> tuple[list[Any], Any]:
    """Inside a torchrun launch: the plan run on torch.distributed.pipelining's own runtime.
    Returns this rank's PipelineStages, built from the plan's split (no tracing; stage s on
    rank plan.stages[s].rank, on the cluster's torch_device, else cuda:LOCAL_RANK, else the
    CPU), and torch's schedule runtime loaded with the plan's schedule as its CSV. Step it as
    torch's schedules are stepped: schedule.step(x) on the first stage's rank,
    schedule.step(target=y, losses=losses) on the last's, schedule.step() elsewhere."""
    import torch.distributed as dist

    from planner.search import schedule_of
    from schedules import to_csv

    from ._dist_runtime import rank_device
    from ._pipelining import tied_across, torch_pipeline
    from .emit import pipelining_refusal

    if not isinstance(plan, Plan):
        raise ArgumentError("plan", type(plan).__name__, "expected a Plan (Plan.load(path))")
    if not callable(loss_fn):
        raise ArgumentError("loss_fn", loss_fn, "expected a function (output, target) -> loss")
    refusal = pipelining_refusal(plan)
    if refusal is not None:
        raise InputError(refusal)
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(
            "torch_pipelining runs inside a torchrun launch: call "
            "torch.distributed.init_process_group first"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != len(plan.devices):
        raise InputError(f"the plan is for {len(plan.devices)} processes, this launch has {world}")
    try:
        device = rank_device(plan.cluster.devices[rank].torch_device, rank)
    except RuntimeError as e:
        raise InputError(f"rank {rank}: {e}") from None
    layers = list(as_layers(model, capture_sample(model, plan.input_shape, plan.input_dtype)))
    refusal = tied_across(
        layers, [st.layers for st in plan.stages], [st.rank for st in plan.stages]
    )
    if refusal is not None:
        raise InputError(refusal)
    return torch_pipeline(
        layers,
        [st.layers for st in plan.stages],
        [st.rank for st in plan.stages],
        [st.recompute for st in plan.stages],
        to_csv(schedule_of(plan)),
        plan.microbatches,
        loss_fn,
        rank,
        device,
    )


def auto_pipe(
    model: nn.Module,
    sample: torch.Tensor,
    devices: list[str | torch.device],
    memory: str | int,
    batch_size: int,
    **plan_options: Any,
) -> Pipe:
    """Profile on devices[0], plan for len(devices) devices of `memory` each, and compile."""
    if not isinstance(devices, list | tuple) or not devices:
        raise ArgumentError("devices", devices, "expected a list of at least one device")
    whole(batch_size, "batch_size", 1, MAX_BATCH)
    parse_size(memory, "memory")
    dev = torch.device(devices[0])
    profile = profile_model(model, sample, device=dev if _exists(dev) else "cpu", progress=False)
    plan = plan_pipeline(profile, Cluster.uniform(len(devices), memory), batch_size, **plan_options)
    return compile_pipe(model, plan, devices)


def _exists(dev: torch.device) -> bool:
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    return False


def _resolve_devices(
    devices: list[str | torch.device] | None, K: int, plan: Plan
) -> list[torch.device]:
    if devices is not None:
        if not isinstance(devices, list | tuple):
            raise ArgumentError(
                "devices", devices, f"expected a list of {K} devices, e.g. {['cpu'] * K}"
            )
        if len(devices) != K:
            raise InputError(
                f"the plan has {K} devices but devices= lists {len(devices)}; pass {K}"
            )
        out = []
        for d in devices:
            try:
                dev = torch.device(d)
            except (RuntimeError, TypeError):
                raise InputError(f"device {d!r} is not a torch device") from None
            if not _exists(dev):
                raise InputError(
                    f"device {d} does not exist on this machine "
                    f"({torch.cuda.device_count()} CUDA device(s)); pass devices=[...] that exist"
                )
            out.append(dev)
        return out
    named = [d.torch_device for d in plan.cluster.devices]
    if all(n is not None and _exists(torch.device(n)) for n in named):
        return [torch.device(n) for n in named]  # type: ignore[arg-type]
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu >= K:
        return [torch.device(f"cuda:{k}") for k in range(K)]
    warnings.warn(
        f"the plan has {K} devices but this machine has {n_gpu} CUDA device(s): every stage runs "
        "on the CPU (pass devices=[...] to choose)",
        stacklevel=3,
    )
    return [torch.device("cpu")] * K


def _once(params: Any) -> Any:
    """`params` without repeats (the first of each, in order)."""
    seen: set[int] = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _made_of(model: nn.Module) -> tuple[int, ...]:
    """Which modules `model` holds, by identity (a microsecond or so a module; the old ones
    stay alive in the program, so no new module takes one of their ids)."""
    return tuple(map(id, model.modules()))
