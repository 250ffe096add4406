"""The Plan: where every layer runs, how the mini-batch is split, and what that is predicted to
cost. Torch-free, so `check`, `show` and `simulate` answer without importing torch."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, model_validator

from profiler.artifact import Artifact, InputError, LaterFields
from profiler.limits import MAX_BATCH, MAX_BYTES, MAX_MICROBATCHES, DType, Text
from profiler.types import RuntimeOverhead
from schedules.comm import LOWERINGS

from .cluster import Cluster
from .memory import CPU_RNG_STATE
from .version import REMAT_BY_HAND

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
Recompute = Literal["never", "except_last", "always"]
# a plan's: one mode for every stage, or per_stage (each stage says its own)
PlanRecompute = Literal["never", "except_last", "always", "per_stage"]
Optimizer = Literal["sgd", "momentum", "adam"]
Target = Literal["streams", "torchrun"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Bytes = Annotated[int, Field(ge=0, le=2**62)]
# A stage's time: at most MAX_LAYERS x MAX_MS / MIN_SPEED x 3 (forward, backward, recompute)
Ms = Annotated[float, Field(ge=0, le=1e21)]
Count = Annotated[int, Field(ge=0)]
_StrictCount = Annotated[StrictInt, Field(ge=0)]
_StrictBytes = Annotated[StrictInt, Field(ge=0, le=2**62)]


class MemoryBreakdown(_Strict, LaterFields):
    """Bytes a stage holds at its peak (planner/memory.py says how each term is computed)."""

    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("runtime",)

    params: Bytes
    grads: Bytes
    optimizer: Bytes
    stashed_activations: Bytes = Field(
        description="inputs and saved activations of the micro-batches in flight (the loss's apart)"
    )
    loss: Bytes = Field(description="what the loss function saves for backward (last stage)")
    gradient_buffers: Bytes = Field(
        description="input gradients waiting for the previous stage, zero-bubble I-to-W buffers"
    )
    live_activations: Bytes = Field(description="the running action's transient")
    optimizer_step: Bytes = Field(
        default=0, description="the optimizer step's temporaries, when that is the worst moment"
    )
    workspace: Bytes
    runtime: Bytes | None = Field(
        default=None,
        description="what the runtime holds through the step: the caller's RNG state, on a CPU "
        "under torchrun (absent: none)",
    )
    total: Bytes
    budget: int = Field(ge=0, le=MAX_BYTES, description="0 when a tiny device is split in two")


# the states a stage holds once per micro-batch in flight (the rest: once, or one at a time)
_PER_MICROBATCH = ("input", "activations", "during_i", "between_iw", "grad", "pulled", "early",
                   "late")  # fmt: skip


class StateBytes(_Strict, LaterFields):
    """Bytes one micro-batch holds on the stage's device in each state (schedules/memory.py)."""

    LATER_FIELDS: ClassVar[tuple[str, ...]] = (
        "step_head", "step_tail", "runtime", "late_grad", "late_grad_at_end", "late_live"
    )  # fmt: skip

    input: Bytes
    activations: Bytes
    during_i: Bytes
    between_iw: Bytes
    grad: Bytes
    pulled: Bytes
    early: Bytes = Field(
        default=0, description="sent by a stage before the previous one, arriving earlier"
    )
    late: Bytes = Field(
        default=0, description="... its gradient, held until that stage's backward takes it"
    )
    live: Bytes = Field(description="the stage's largest transient while its backward runs")
    remat_live: Bytes = Field(
        description="... while a forward that keeps its saves runs (F, a recomputed B's or I's)"
    )
    forward_live: Bytes = Field(description="... while a forward that keeps nothing runs")
    input_live: Bytes = Field(description="... while zero-bubble I runs")
    weight_live: Bytes = Field(description="... while zero-bubble W runs")
    stop_live: Bytes | None = Field(
        default=None,
        description="... while a recomputed B's re-materialising forward runs (the stage's "
        "whole forward, at B's start); absent in plans made before it was counted: remat_live",
    )
    optimizer_step: Bytes = Field(description="the optimizer step's temporaries, after the step")
    foreach: bool = Field(description="the optimizer's multi-tensor kernels make them all at once")
    static: Bytes = Field(description="weights, gradients, optimizer state and workspace")
    step_head: Bytes | None = Field(
        default=None,
        description="one tensor at a time: the step temporaries of the stage's first tensor; "
        "absent where no tensor's step holds anything while the next is stepped",
    )
    step_tail: Bytes | None = Field(
        default=None,
        description="... and what its last tensor's step still holds while the next tensor "
        "(a later stage's on the same device) is stepped",
    )
    runtime: Bytes | None = Field(
        default=None,
        description="what the runtime holds from the step's start to its end, whatever runs "
        "(the caller's RNG state where it lives on the device: a CPU, under torchrun)",
    )
    late_grad: Bytes | None = Field(
        default=None,
        description="a gradient counted in static that exists only from the stage's first "
        "backward (B or W) to the step's end: the streams program's copy of a tied weight "
        "(absent: none)",
    )
    late_grad_at_end: bool | None = Field(
        default=None,
        description="late_grad is made by the stage's first B's last layer, inside its "
        "transient, and exists from that action's end (absent: from its start)",
    )
    late_live: Bytes | None = Field(
        default=None,
        description="... or made inside that backward (a B) by a later layer: it exists from "
        "the action's end, and the B's transient is this instead of live (absent: neither)",
    )


class StagePlan(_Strict, LaterFields):
    LATER_FIELDS: ClassVar[tuple[str, ...]] = (
        "late_send_ms", "grads_back", "state_bytes_rest", "grads_back_rest"
    )  # fmt: skip

    index: Count
    rank: Count = Field(description="position of the stage's device in the cluster")
    device: Text
    layers: tuple[int, int] = Field(description="[start, end) in the model's layer order")
    layer_types: list[Text]
    recompute: Recompute
    inflight: Count = Field(description="micro-batches whose tensors the stage holds at its worst")
    occupancy: list[tuple[Count, ...]] = Field(
        description="micro-batches per state (input, activations, during_i, between_iw, grad, "
        "pulled), "
        "then which transient (live, remat_live, forward_live, input_live, weight_live, "
        "stop_live) runs, at "
        "the stage's candidate peaks"
    )
    work_ms: Ms = Field(
        description="what the partition balances: one micro-batch's forward, backward (I + W for "
        "zero bubble) and average recomputation on this device"
    )
    forward_ms: Ms = Field(description="per micro-batch, on this device")
    backward_ms: Ms
    input_grad_ms: Ms = Field(description="the input gradient alone (zero-bubble I)")
    weight_grad_ms: Ms = Field(
        description="the weight gradients alone, layer by layer (zero-bubble W); I + W may exceed "
        "backward_ms: W re-derives each layer's internal gradients"
    )
    recompute_ms: Ms
    send_bytes: Bytes = Field(
        description="per micro-batch, what the next stage receives (0 for the last): from this "
        "stage, and in a captured graph straight from the stages before it"
    )
    send_ms: Ms
    late_send_ms: Ms | None = Field(
        default=None,
        strict=True,
        description="the same transfer where the next stage posts its receive after this one's "
        "send (the link's late figures; None: send_ms)",
    )
    stash_bytes: Bytes = Field(description="what one micro-batch leaves saved for backward")
    input_bytes: Bytes = Field(description="one micro-batch entering the stage")
    grads_back: list[tuple[_StrictCount, _StrictBytes]] | None = Field(
        default=None,
        strict=True,
        description="a captured graph's: per stage this one takes values from, the bytes of their "
        "gradients it sends back there per micro-batch (None: all of state_bytes.grad, to the "
        "stage before)",
    )
    grads_back_rest: list[tuple[_StrictCount, _StrictBytes]] | None = Field(
        default=None,
        strict=True,
        description="grads_back of the smaller micro-batches of an uneven split, where the "
        "torchrun program's plan counts them (None: as grads_back)",
    )
    state_bytes: StateBytes
    state_bytes_rest: StateBytes | None = Field(
        default=None,
        description="a batch split into unequal micro-batches: the state bytes of those one "
        "sample smaller, the last M - batch_size % M (state_bytes: the first, larger ones; "
        "memory: the stage at the larger size throughout, what its split was solved with)",
    )
    memory: MemoryBreakdown


class DeviceUse(_Strict):
    """A device's memory: the sum over the stages it holds (one, or v when interleaved)."""

    name: Text
    stages: list[int]
    total: Bytes
    budget: int = Field(gt=0, le=MAX_BYTES)


class Prediction(_Strict):
    iteration_ms: float = Field(ge=0, le=1e26)
    bubble_fraction: float = Field(ge=0, le=1)
    throughput_samples_per_s: float = Field(ge=0, description="0 when the times are all zero")
    bottleneck_ms: Ms = Field(
        description="the busiest resource per micro-batch: a stage's work_ms or a link's transfer"
    )
    peak_memory: list[Bytes] = Field(description="per device, from the simulated schedule")


class SolverInfo(_Strict):
    method: Text
    optimal: bool = Field(
        description="the bottleneck is proven minimal for this M, schedule and recomputation, "
        "under the model the simulator uses"
    )
    unproven: Text = Field(default="", description="what is not proven, when optimal is false")
    lower_bound_ms: Ms
    gap: float
    candidates: Count = Field(
        description="(micro-batch count, schedule, recompute) combinations considered"
    )
    solved: Count = Field(default=0, description="... whose partition was solved")
    pruned: Count = Field(
        default=0, description="... skipped: their lower bound could not beat the plan found"
    )


class Alternative(_Strict):
    """A candidate the search did not choose, and why: what a user reads before overriding."""

    microbatches: int = Field(gt=0, le=MAX_MICROBATCHES)
    schedule: Schedule
    recompute: PlanRecompute
    iteration_ms: float | None = Field(
        default=None, ge=0, le=1e26, description="predicted, when its plan was simulated"
    )
    at_least_ms: float | None = Field(
        default=None, ge=0, le=1e26, description="a lower bound, when it was not simulated"
    )
    peak_bytes: Bytes | None = Field(default=None, description="its busiest device's peak")
    reason: Text


class PlanMeta(_Strict):
    """Left out of the digest. Nothing here depends on the time or the machine, so the same
    inputs give a byte-identical plan.json (the solve time goes to the terminal only)."""

    tool_version: Text = ""
    # sha256 of everything else in the file (Artifact.digest), written with it: a plan edited
    # by hand after it was written is refused where it is read, whatever the edit (a checksum,
    # not a signature: whoever computes it again gets past it, and meets check's own tests)
    content_digest: Text = ""

    @model_validator(mode="before")
    @classmethod
    def _drop_run_facts(cls, data: object) -> object:
        """Plans written before 0.1 carried `created` and `solve_ms`: read them, keep neither."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in ("created", "solve_ms")}
        return data


class Plan(Artifact):
    FORMAT_VERSION: ClassVar[int] = 2
    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("runtime", "checkpointed", "lowering", "threads")

    @classmethod
    def from_json_text(cls, text: str, *, source: str = "<input>") -> Plan:  # type: ignore[override]
        """As every file; and each stage's budget is its device's (whole, or half of an
        interleaved device's), which `show` prints beside the totals `check` gates (the search
        makes plans under other budgets too, to say how much memory would do: not files)."""
        plan = super().from_json_text(text, source=source)
        sealed = plan.meta.content_digest
        if not sealed:
            raise InputError(
                f"{source}: carries no digest of its content (made by a gpipe-plan before 0.3, "
                "or edited): plan again"
            )
        if sealed != plan.digest():
            raise InputError(
                f"{source}: its content is not what gpipe-plan wrote (edited since): plan again"
            )
        made = _release(plan.meta.tool_version)
        if made is not None and made < REMAT_BY_HAND and plan.recomputes:
            raise InputError(
                f"{source}: made by gpipe-plan {plan.meta.tool_version}, which counted a "
                "recomputed stage's re-run as torch's checkpoint runs it; this one re-runs it "
                "whole at its backward's start, which holds more: plan again"
            )
        K, v = len(plan.cluster.devices), plan.stages_per_device
        for st in plan.stages:
            whole = plan.cluster.devices[st.index % K].memory_bytes
            if st.memory.budget not in (whole, whole // v):
                raise InputError(
                    f"{source}: invalid plan: stage {st.index}'s memory budget is "
                    f"{st.memory.budget} bytes, but its device {st.device} has {whole}"
                    + (f" (or {whole // v} for each of its {v} stages)" if v > 1 else "")
                )
        return plan

    def canonical_json(self, *, with_meta: bool = True) -> str:
        """As every file's, with the digest of the rest in `meta` (checked when read)."""
        data = self._data()
        if with_meta:
            data["meta"] = {**data.get("meta", {}), "content_digest": self.digest()}
        else:
            data.pop("meta", None)
        return json.dumps(data, sort_keys=True, indent=1) + "\n"

    def _data(self) -> dict[str, Any]:
        # a plan made before stop_live was counted reads, writes and digests as it did
        data = super()._data()
        for stage in data.get("stages", ()):
            if stage["state_bytes"].get("stop_live", 0) is None:
                del stage["state_bytes"]["stop_live"]
        return data

    kind: Literal["plan"] = "plan"
    format_version: StrictInt = 2
    model: Text
    model_digest: Text
    profile_digest: Text
    cluster_digest: Text
    device_type: Text = Field(description="where the profile was measured, e.g. cpu or cuda:0")
    dtype: DType
    input_shape: list[Count] = Field(description="one sample of the model's input")
    input_dtype: DType
    num_layers: int = Field(gt=0)
    cluster: Cluster
    batch_size: int = Field(gt=0, le=MAX_BATCH)
    microbatches: int = Field(gt=0, le=MAX_MICROBATCHES)
    microbatch_size: int = Field(gt=0, description="the largest micro-batch: ceil(N / M)")
    schedule: Schedule
    stages_per_device: int = Field(
        default=1, ge=1, le=2, description="v: chunks per device (interleaved)"
    )
    recompute: PlanRecompute
    optimizer: Optimizer
    target: Target = Field(
        default="streams",
        description="the program the times predict: streams (a transfer never holds its "
        "sender) or torchrun (each rank held in its batch of sends and receives until every "
        "message in it has gone)",
    )
    loss: Text = Field(default="", description="the profiled loss the last stage includes, if any")
    runtime: RuntimeOverhead | None = Field(
        default=None,
        description="the profile's runtime overhead, which the predicted times include: per "
        "compute action and per step (absent: not measured, counted as none)",
    )
    captured: bool = Field(
        default=False, description="the model's graph was captured: layers are runs of its graph"
    )
    checkpointed: list[Count] | None = Field(
        default=None,
        description="model layers each run under an activation checkpoint of their own: they "
        "keep only their input for backward and run their forward again there (absent: none)",
    )
    lowering: int | None = Field(
        default=None,
        ge=0,
        lt=LOWERINGS,
        description="torchrun: which lowering of the schedule (how its sends and receives are "
        "posted) the program runs, the fastest of those that meet where sends block: 0 as "
        "issued, 1 in lock-step, 2-4 timed from the compute-only timeline (absent: found again)",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        strict=True,
        description="the intra-op threads the profile measured with: on the CPU some kernels' "
        "memory grows with them (bfloat16 matmuls' workspace), so `measure` runs the streams "
        "program with as many (absent: not recorded)",
    )
    routes: list[tuple[Count, Count]] = Field(
        default_factory=list,
        description="(sender, receiver) stage pairs that activations travel along; empty: each "
        "stage to the next. A captured graph sends each value straight to the stages that read it",
    )
    stages: list[StagePlan] = Field(min_length=1)
    devices: list[DeviceUse] = Field(min_length=1)
    predicted: Prediction
    solver: SolverInfo
    alternatives: list[Alternative] = Field(
        default_factory=list, description="the runners-up, best first, with the reason each lost"
    )
    meta: PlanMeta = PlanMeta()
    _solve_ms: float = PrivateAttr(default=0.0)
    # the search's: its torchrun program was not timed, since the plan where sends never
    # wait (predicted) already lost; that time is then a lower bound of the program's
    _untimed: bool = PrivateAttr(default=False)
    _ahead_over: str = PrivateAttr(default="")  # (why: search.AHEAD_OVER, UNEVEN_OVER)
    # its torchrun program holds less on some device than the issue order counts (search.py)
    _held_less: bool = PrivateAttr(default=False)

    @property
    def recomputes(self) -> bool:
        """Whether some stage re-runs its forward whole, in backward (or zero bubble's I)."""
        return any(st.recompute != "never" for st in self.stages)

    @property
    def fits(self) -> bool:
        return all(d.total <= d.budget for d in self.devices)

    @property
    def solve_ms(self) -> float:
        """How long plan_pipeline took (0 for a plan read from disk): not saved."""
        return self._solve_ms

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        """A plan is run as written: one that runs a layer twice, skips one, or disagrees with
        its own cluster or schedule is refused here, before anything reads it."""
        K, v, S = len(self.cluster.devices), self.stages_per_device, len(self.stages)
        if v != (2 if self.schedule == "interleaved-1f1b" else 1):
            raise ValueError(f"stages_per_device {v} does not fit schedule {self.schedule}")
        if S != K * v:
            raise ValueError(f"{S} stages on {K} devices x {v}: expected {K * v} stages")
        bad = [r for r in self.routes if not r[0] < r[1] < S]
        if bad:
            raise ValueError(f"route {list(bad[0])} is not (sender, later receiver) of {S} stages")
        if self.routes and not self.captured:  # (its program would fail once it ran)
            raise ValueError("routes: a sequential model's stages each send to the next; only a "
                             "captured graph's plan lists routes")  # fmt: skip
        end = 0
        for s, st in enumerate(self.stages):
            i, j = st.layers
            if st.index != s:
                raise ValueError(f"stage {s} is numbered {st.index}; number stages 0, 1, 2, ...")
            if i != end or j <= i:
                raise ValueError(
                    f"stage {s} holds layers [{i}, {j}), but it must start at layer {end} and "
                    "hold at least one: stages are contiguous, in order, and cover every layer"
                )
            end = j
            if st.rank != s % K or st.device != self.cluster.devices[s % K].name:
                raise ValueError(
                    f"stage {s} is on {st.device} (rank {st.rank}); the cluster puts it on "
                    f"{self.cluster.devices[s % K].name} (rank {s % K})"
                )
            reserved = self.cluster.devices[s % K].reserved_bytes // v
            if st.memory.workspace != reserved:
                raise ValueError(
                    f"stage {s}: workspace {st.memory.workspace} is not its share "
                    f"({reserved}) of {st.device}'s reserved_bytes "
                    f"({self.cluster.devices[s % K].reserved_bytes})"
                )
            if st.recompute != self.recompute and self.recompute != "per_stage":
                raise ValueError(
                    f"stage {s}: recompute {st.recompute}, the plan's is {self.recompute}"
                )
        if end != self.num_layers:
            raise ValueError(f"the stages cover layers [0, {end}) of {self.num_layers}")
        if self.checkpointed is not None:
            ks = self.checkpointed
            if not ks or ks != sorted(set(ks)) or ks[-1] >= self.num_layers:
                raise ValueError(
                    f"checkpointed layers {ks}: expected distinct layers 0 .. "
                    f"{self.num_layers - 1}, in order"
                )
            if self.captured or self.schedule == "zb-h1" or self.recompute != "never":
                raise ValueError(
                    "checkpointed layers run only in a sequential model's plan without zero "
                    "bubble and without other recomputation"
                )
        # (a plan made before the runtime's bytes were counted has them on no stage)
        counted = any(st.state_bytes.runtime is not None for st in self.stages)
        for st in self.stages:
            if len(st.layer_types) != st.layers[1] - st.layers[0]:
                raise ValueError(f"stage {st.index}: {len(st.layer_types)} layer types listed")
            if st.late_send_ms is not None and st.late_send_ms < st.send_ms:
                raise ValueError(
                    f"stage {st.index}: late_send_ms {st.late_send_ms} is below its send_ms "
                    f"{st.send_ms} (a late receive costs at least the hand-off)"
                )
            held = st.memory.model_dump()
            parts = sum(n or 0 for k, n in held.items() if k not in ("total", "budget"))
            if held["total"] != parts:
                raise ValueError(
                    f"stage {st.index}: memory total {held['total']} is not the sum of its "
                    f"parts ({parts})"
                )
            # (the bytes `check` simulates are state_bytes: they must be the breakdown's, found
            # by a red team: a plan whose workspace was raised in the breakdown alone passed)
            static = sum(held[k] for k in ("params", "grads", "optimizer", "workspace"))
            if st.state_bytes.static != static:
                raise ValueError(
                    f"stage {st.index}: state_bytes.static {st.state_bytes.static} is not its "
                    f"weights, gradients, optimizer state and workspace ({static})"
                )
            if held["optimizer_step"] not in (0, st.state_bytes.optimizer_step):
                raise ValueError(
                    f"stage {st.index}: memory.optimizer_step {held['optimizer_step']} is "
                    f"neither 0 nor the step's temporaries ({st.state_bytes.optimizer_step})"
                )
            # the torchrun program keeps the caller's CPU RNG state through the step, on each
            # device's first stage (found by a review: any figure was taken); a plan made
            # before it was counted has none, and is read as it was (5 056 bytes under)
            on_cpu = self.device_type.split(":")[0] == "cpu"
            first = st.index < K  # (each device's first stage)
            rng = CPU_RNG_STATE if self.target == "torchrun" and on_cpu and first else None
            if st.state_bytes.runtime not in ({rng} if counted else {None, rng}):
                raise ValueError(
                    f"stage {st.index}: state_bytes.runtime {st.state_bytes.runtime}; the "
                    f"{self.target} program on {self.device_type} holds {rng or 0} there"
                )
            at_step = held["optimizer_step"] > 0
            if held.get("runtime") != (None if at_step else st.state_bytes.runtime):
                raise ValueError(
                    f"stage {st.index}: memory.runtime {held.get('runtime')} is not what the "
                    f"runtime holds through the step ({st.state_bytes.runtime})"
                )
            late = st.state_bytes.late_grad  # (a tied copy's gradient: at most the grads')
            if st.state_bytes.late_grad_at_end is not None and not late:
                raise ValueError(
                    f"stage {st.index}: state_bytes.late_grad_at_end without a late_grad"
                )
            for sb in (st.state_bytes, st.state_bytes_rest or st.state_bytes):
                # (B's transient with the late gradient made inside: at least either)
                if sb.late_live is not None and (
                    not late or sb.late_grad_at_end or sb.late_live < max(late, sb.live)
                ):
                    raise ValueError(
                        f"stage {st.index}: state_bytes.late_live {sb.late_live} without a "
                        "late_grad made inside the stage's first B, or below it or live"
                    )
            if late is not None and (self.target != "streams" or v != 1 or late > held["grads"]):
                raise ValueError(
                    f"stage {st.index}: state_bytes.late_grad {late} is not a gradient the "
                    f"{self.target} program makes late (only a streams plan's tied copy's, at "
                    f"most its gradients' {held['grads']} bytes)"
                )
            rest = st.state_bytes_rest
            if rest is not None:
                uneven = self.batch_size % self.microbatches
                mine, theirs = st.state_bytes.model_dump(), rest.model_dump()
                alike = ("static", "optimizer_step", "foreach", "runtime", "late_grad",
                         "late_grad_at_end",
                         "step_head", "step_tail")  # fmt: skip
                if (
                    not uneven
                    or any(theirs.get(k) != mine.get(k) for k in alike)
                    or any((theirs[k] or 0) > (mine[k] or 0) for k in _PER_MICROBATCH)
                ):
                    raise ValueError(
                        f"stage {st.index}: state_bytes_rest is not what a smaller micro-batch "
                        "of an uneven split holds beside state_bytes"
                    )
            back = st.grads_back or []
            rest_back = st.grads_back_rest
            if rest_back is not None and (
                st.state_bytes_rest is None
                or st.grads_back is None
                or [a for a, _ in rest_back] != [a for a, _ in back]
                or any(n > m for (_, n), (_, m) in zip(rest_back, back))
            ):
                raise ValueError(
                    f"stage {st.index}: grads_back_rest is not what a smaller micro-batch of "
                    "an uneven split sends back to the stages grads_back names"
                )
            if back:  # what it sends back to each stage it takes values from
                senders = sorted(a for a, t in self.routes if t == st.index) if self.routes else (
                    [st.index - 1] if st.index else []
                )  # fmt: skip
                named = [a for a, _ in back]
                if len(set(named)) != len(named) or not set(named) <= set(senders):
                    raise ValueError(
                        f"stage {st.index}: grads_back names stages {named}; it takes values "
                        f"from {senders or 'none'}, each named once"
                    )
            # the simulator counts each state's bytes up to M times on a device in int64: a
            # stage past 2^60 bytes so counted (none is near: MAX_BYTES per device) overflows it
            sb = st.state_bytes.model_dump(exclude={"foreach"})
            each = sum(sb[k] for k in _PER_MICROBATCH) + sum(n for _, n in back)
            once = sum(n for k, n in sb.items() if n is not None and k not in _PER_MICROBATCH)
            if each * max(self.microbatches, 1) + once + held["total"] > 2**60:
                raise ValueError(
                    f"stage {st.index}: its bytes ({each} per micro-batch in flight, "
                    f"{self.microbatches} micro-batches, {once} more) are past what a device holds"
                )
        N, M = self.batch_size, self.microbatches
        if M > N or self.microbatch_size != -(-N // M):
            raise ValueError(
                f"batch {N} as {M} micro-batches needs micro-batches of {-(-N // M)} "
                f"(and M <= N), not {self.microbatch_size}"
            )
        if v > 1 and M > K and M % K:
            raise ValueError(
                f"interleaved-1f1b runs {M} micro-batches on {K} devices: needs M <= K or a multiple of K"
            )
        if len(self.devices) != K or len(self.predicted.peak_memory) != K:
            raise ValueError(
                f"the cluster has {K} devices; devices and predicted.peak_memory list {len(self.devices)} and {len(self.predicted.peak_memory)}"
            )
        for k, (use, dev) in enumerate(zip(self.devices, self.cluster.devices)):
            if use.name != dev.name or use.budget != dev.memory_bytes:
                raise ValueError(
                    f"devices[{k}] ({use.name}, budget {use.budget}) differs from the cluster's "
                    f"device {k} ({dev.name}, {dev.memory_bytes} bytes)"
                )
            if use.stages != list(range(k, S, K)):
                raise ValueError(
                    f"devices[{k}] lists stages {use.stages}, not {list(range(k, S, K))}"
                )
        return self


def _release(version: str) -> tuple[int, ...] | None:
    """A tool version's numbers ("0.3.0" -> (0, 3, 0)); None where it is not one."""
    parts = version.split(".")
    # (ASCII digits alone: "²" is a digit to str.isdigit, and int() refuses it)
    ok = all(p.isascii() and p.isdigit() for p in parts)
    return tuple(int(p) for p in parts) if ok else None
