"""The Profile: what the planner knows about a model, measured once per layer. Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .artifact import Artifact


class Timing(BaseModel):
    """Milliseconds over the timed repeats: the median is used, min and max show the noise."""

    model_config = ConfigDict(extra="forbid")
    median: float = Field(ge=0)
    min: float = Field(ge=0)
    max: float = Field(ge=0)


class LayerProfile(BaseModel):
    """One layer of the sequential model. Keys of the per-size maps are micro-batch sizes.

    Sizes are bytes. `saved_bytes` is what autograd keeps for this layer's backward (each storage
    once; parameters and buffers excluded, they are model memory). `shared_bytes` is the part of
    it that the previous layer saves too (typically its output, which this layer saves as its
    input): a stage holding both layers holds those bytes once.
    """

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    name: str
    type: str
    param_bytes: int = Field(ge=0)
    buffer_bytes: int = Field(ge=0)
    output_shape: list[list[int]] = Field(description="per sample, one shape per output tensor")
    output_bytes: int = Field(ge=0, description="per sample: what crosses a cut after this layer")
    forward_ms: dict[int, Timing]
    backward_ms: dict[int, Timing]
    backward_input_ms: dict[int, Timing] = Field(
        description="the input gradient alone (zero-bubble I)"
    )
    backward_weight_ms: dict[int, Timing] = Field(
        description="the weight gradients alone, from the layer's output (zero-bubble W)"
    )
    saved_bytes: dict[int, int]
    shared_bytes: dict[int, int]
    peak_bytes: dict[int, int] = Field(
        description="transient peak of forward+backward above the layer's input, stash included"
    )


class ProfileMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    created: str = ""
    torch_version: str = ""
    warmup: int = 0
    repeats: int = 0


class Profile(Artifact):
    """Measured per-layer costs of one model on one device, at several micro-batch sizes."""

    kind: Literal["profile"] = "profile"
    model: str = Field(description="how the model was named: example:NAME, pkg.mod:fn, file.py:fn")
    model_digest: str = Field(description="sha256 of layer types and parameter shapes")
    device: str
    device_name: str
    dtype: str
    input_shape: list[int] = Field(description="the sample input's shape per sample (no batch)")
    input_dtype: str
    input_bytes: int = Field(ge=0, description="per sample: what enters the first stage")
    batch_sizes: list[int] = Field(min_length=1)
    layers: list[LayerProfile] = Field(min_length=1)
    meta: ProfileMeta = ProfileMeta()

    @model_validator(mode="after")
    def _sizes_consistent(self) -> Profile:
        sizes = set(self.batch_sizes)
        if sorted(sizes) != self.batch_sizes or min(sizes) < 1:
            raise ValueError("batch_sizes must be distinct positive integers in increasing order")
        for layer in self.layers:
            for field in (
                "forward_ms",
                "backward_ms",
                "backward_input_ms",
                "saved_bytes",
                "shared_bytes",
                "peak_bytes",
            ):
                if set(getattr(layer, field)) != sizes:
                    raise ValueError(
                        f"layer {layer.index}: {field} is not given for every batch size"
                    )
        if [layer.index for layer in self.layers] != list(range(len(self.layers))):
            raise ValueError("layers must be numbered 0, 1, 2, ... in order")
        return self
