"""The Plan: where every layer runs, how the mini-batch is split, and what that is predicted to
cost. Torch-free, so `check`, `show` and `simulate` answer without importing torch."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from profiler.artifact import Artifact

from .cluster import Cluster

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
Recompute = Literal["never", "except_last", "always"]
Optimizer = Literal["sgd", "momentum", "adam"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemoryBreakdown(_Strict):
    """Bytes a stage holds at its peak (planner/memory.py says how each term is computed)."""

    params: int
    grads: int
    optimizer: int
    stashed_activations: int = Field(
        description="inputs and saved activations of the micro-batches in flight (the loss's apart)"
    )
    loss: int = Field(description="what the loss function saves for backward (last stage)")
    gradient_buffers: int = Field(
        description="input gradients waiting for the previous stage, zero-bubble I-to-W buffers"
    )
    live_activations: int = Field(description="the running action's transient")
    optimizer_step: int = Field(
        default=0, description="the optimizer step's temporaries, when that is the worst moment"
    )
    workspace: int
    total: int
    budget: int


class StateBytes(_Strict):
    """Bytes one micro-batch holds on the stage's device in each state (schedules/memory.py)."""

    input: int
    activations: int
    during_i: int
    between_iw: int
    grad: int
    pulled: int
    live: int = Field(description="the stage's largest transient while one of its actions runs")
    remat_live: int = Field(description="... while zero bubble re-materialises at I")
    forward_live: int = Field(description="... while a forward that keeps nothing runs")
    input_live: int = Field(description="... while zero-bubble I runs")
    weight_live: int = Field(description="... while zero-bubble W runs")
    optimizer_step: int = Field(description="the optimizer step's temporaries, after the step")
    foreach: bool = Field(description="the optimizer's multi-tensor kernels make them all at once")
    static: int = Field(description="weights, gradients, optimizer state and workspace")


class StagePlan(_Strict):
    index: int
    rank: int = Field(description="position of the stage's device in the cluster")
    device: str
    layers: tuple[int, int] = Field(description="[start, end) in the model's layer order")
    layer_types: list[str]
    recompute: Recompute
    inflight: int = Field(description="micro-batches whose tensors the stage holds at its worst")
    occupancy: list[tuple[int, ...]] = Field(
        description="micro-batches per state (input, activations, during_i, between_iw, grad, "
        "pulled), "
        "then which transient (live, remat_live, forward_live, input_live, weight_live) runs, at "
        "the stage's candidate peaks"
    )
    work_ms: float = Field(
        description="what the partition balances: one micro-batch's forward, backward (I + W for "
        "zero bubble) and average recomputation on this device"
    )
    forward_ms: float = Field(description="per micro-batch, on this device")
    backward_ms: float
    input_grad_ms: float = Field(description="the input gradient alone (zero-bubble I)")
    weight_grad_ms: float = Field(
        description="the weight gradients alone, layer by layer (zero-bubble W); I + W may exceed "
        "backward_ms: W re-derives each layer's internal gradients"
    )
    recompute_ms: float
    send_bytes: int = Field(description="per micro-batch, to the next stage (0 for the last)")
    send_ms: float
    stash_bytes: int = Field(description="what one micro-batch leaves saved for backward")
    input_bytes: int = Field(description="one micro-batch entering the stage")
    state_bytes: StateBytes
    memory: MemoryBreakdown


class DeviceUse(_Strict):
    """A device's memory: the sum over the stages it holds (one, or v when interleaved)."""

    name: str
    stages: list[int]
    total: int
    budget: int


class Prediction(_Strict):
    iteration_ms: float
    bubble_fraction: float
    throughput_samples_per_s: float
    bottleneck_ms: float = Field(
        description="the busiest resource per micro-batch: a stage's work_ms or a link's transfer"
    )
    peak_memory: list[int] = Field(description="per device, from the simulated schedule")


class SolverInfo(_Strict):
    method: str
    optimal: bool = Field(
        description="the bottleneck is proven minimal for this M, schedule and recomputation, "
        "under the model the simulator uses"
    )
    unproven: str = Field(default="", description="what is not proven, when optimal is false")
    lower_bound_ms: float
    gap: float
    candidates: int = Field(
        description="(micro-batch count, schedule, recompute) combinations solved"
    )


class PlanMeta(_Strict):
    """Facts about the run, not the plan: left out of the digest and free to differ."""

    created: str = ""
    tool_version: str = ""
    solve_ms: float = 0.0


class Plan(Artifact):
    FORMAT_VERSION: ClassVar[int] = 2
    kind: Literal["plan"] = "plan"
    format_version: int = 2
    model: str
    model_digest: str
    profile_digest: str
    cluster_digest: str
    device_type: str = Field(description="where the profile was measured, e.g. cpu or cuda:0")
    dtype: str
    input_shape: list[int] = Field(description="one sample of the model's input")
    input_dtype: str
    num_layers: int = Field(gt=0)
    cluster: Cluster
    batch_size: int = Field(gt=0)
    microbatches: int = Field(gt=0)
    microbatch_size: int = Field(gt=0, description="the largest micro-batch: ceil(N / M)")
    schedule: Schedule
    stages_per_device: int = Field(default=1, description="v: chunks per device (interleaved)")
    recompute: Recompute
    optimizer: Optimizer
    loss: str = Field(default="", description="the profiled loss the last stage includes, if any")
    stages: list[StagePlan] = Field(min_length=1)
    devices: list[DeviceUse] = Field(min_length=1)
    predicted: Prediction
    solver: SolverInfo
    meta: PlanMeta = PlanMeta()

    @property
    def fits(self) -> bool:
        return all(d.total <= d.budget for d in self.devices)
