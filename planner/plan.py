"""The Plan: where every layer runs, how the mini-batch is split, and what that is predicted to
cost. Torch-free, so `check`, `show` and `simulate` answer without importing torch."""

from __future__ import annotations

from typing import Literal

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
    stashed_activations: int
    live_activations: int
    workspace: int
    total: int
    budget: int


class StagePlan(_Strict):
    index: int
    rank: int = Field(description="position of the stage's device in the cluster")
    device: str
    layers: tuple[int, int] = Field(description="[start, end) in the model's layer order")
    layer_types: list[str]
    recompute: Recompute
    inflight: int = Field(description="micro-batches whose activations the stage holds at its peak")
    stash_pairs: list[tuple[int, int]] = Field(
        description="(kept as input only, kept whole) micro-batch counts at the stage's peaks"
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
    bottleneck_ms: float = Field(description="the slowest stage's forward+backward+recompute")
    peak_memory: list[int] = Field(description="per device, from the simulated schedule")


class SolverInfo(_Strict):
    method: str
    optimal: bool = Field(
        description="the bottleneck is proven minimal for this M, schedule and recomputation"
    )
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
    kind: Literal["plan"] = "plan"
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
    stages: list[StagePlan] = Field(min_length=1)
    devices: list[DeviceUse] = Field(min_length=1)
    predicted: Prediction
    solver: SolverInfo
    meta: PlanMeta = PlanMeta()

    @property
    def fits(self) -> bool:
        return all(d.total <= d.budget for d in self.devices)
