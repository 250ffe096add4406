"""The Profile: what the planner knows about a model, measured once per layer. Torch-free."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, ClassVar, Literal, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from .artifact import Artifact, LaterFields
from .limits import MAX_BATCH, MAX_BYTES, MAX_LAYERS, MAX_MS, MIN_MS, DType, Text

# (strict: "0_5" or true is no time)
Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False, strict=True)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
_StrictBytes = Annotated[int, Field(ge=0, le=MAX_BYTES, strict=True)]  # ("8", true: refused)


@pydantic_dataclass(config=ConfigDict(extra="forbid"), slots=True)
class Timing:
    """Milliseconds over the timed repeats: the median is used, min and max show the noise.

    Structurally identical layers are timed together and share one Timing: `samples` counts the
    pooled measurements, `spread` is their median absolute deviation relative to the median."""

    median: Ms
    min: Ms
    max: Ms
    samples: int = Field(default=1, ge=1, le=2**31, strict=True)
    spread: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False, strict=True)


class LayerProfile(BaseModel):
    """One layer of the sequential model (or its loss). Keys of the per-size maps are micro-batch
    sizes.

    Sizes are bytes, as the device allocates them (on CUDA, rounded to the caching allocator's
    blocks). `saved_bytes` is what autograd keeps for this layer's backward (each storage once;
    parameters and buffers excluded, they are model memory). `shared_bytes` is the part of it
    that the previous layer saves too (typically its output, which this layer saves as its
    input): a stage holding both layers holds those bytes once. `input_saved_bytes` is the part
    of this layer's input that it saves itself. `forward_transient_bytes` and
    `backward_transient_bytes` are the most the layer allocates beyond what it keeps saved while
    its forward, or its backward, runs: its output, gradients, temporaries, and the temporary
    weight gradient added into an existing .grad (the backward's from its output's gradient laid
    out as a stage's last layer receives it). `input_unsaved_bytes` is the part of its input
    that neither it nor the layer before saves: inside a stage, alive only while its forward
    runs. `forward_peak_bytes` is the most its forward allocates when nothing is kept for backward
    (how a recomputed stage runs its forward). `input_grad_transient_bytes` and
    `weight_grad_transient_bytes` are what zero bubble's I and W add beyond what they keep (the
    gradients of the layer's output and input are counted by the planner as kept).
    """

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    name: Text
    type: Text
    param_bytes: Bytes
    largest_param_bytes: Bytes = Field(default=0, description="its largest parameter tensor")
    buffer_bytes: Bytes
    output_shape: list[list[Annotated[int, Field(ge=0)]]] = Field(
        description="per sample, one shape per output tensor"
    )
    output_bytes: Bytes = Field(description="per sample: what crosses a cut after this layer")
    passed_bytes: Bytes = Field(
        default=0,
        description="per sample: the part of output_bytes that is its own input handed on "
        "unchanged (a captured graph's skip that spans the layer)",
    )
    crossing: list[Text] = Field(
        default_factory=list,
        description="a captured graph's layer: the values that cross the cut after it (the "
        "graph's node names: its output, and every skip that spans the cut)",
    )
    crossing_bytes: list[Bytes] = Field(
        default_factory=list, description="per sample: each crossing value's bytes, in order"
    )
    crossing_grad: list[bool] = Field(
        default_factory=list, description="each crossing value is floating point (has a gradient)"
    )
    reads: list[Text] | None = Field(
        default=None,
        description="a captured graph's layer: the values crossing the cut before it that it "
        "uses (the others it only hands on; a pipeline sends each value straight to the "
        "stages that use it)",
    )
    forward_ms: dict[int, Timing]
    backward_ms: dict[int, Timing]
    backward_input_ms: dict[int, Timing] = Field(
        description="the input gradient alone (zero-bubble I)"
    )
    backward_weight_ms: dict[int, Timing] = Field(
        description="the weight gradients alone, from the layer's output (zero-bubble W)"
    )
    saved_bytes: dict[int, Bytes]
    shared_bytes: dict[int, Bytes]
    input_saved_bytes: dict[int, Bytes]
    forward_transient_bytes: dict[int, Bytes]
    backward_transient_bytes: dict[int, Bytes]
    input_unsaved_bytes: dict[int, Bytes]
    forward_peak_bytes: dict[int, Bytes]
    input_grad_transient_bytes: dict[int, Bytes]
    weight_grad_transient_bytes: dict[int, Bytes]
    param_tensor_bytes: list[_StrictBytes] | None = Field(
        default=None,
        description="each trainable parameter tensor's bytes, in the order an optimizer steps "
        "them (a stage's optimizer takes its layers' in turn); absent in profiles made before "
        "it was recorded (the planner then counts the optimizer step by the largest alone)",
    )
    stop_transient_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="the most its forward allocates beyond what it saves, up to the moment it "
        "saves its last tensor: where torch's checkpoint stops re-running the layer under a "
        "checkpoint of its own (a layer that saves nothing: its forward_transient_bytes; a "
        "recomputed stage is re-run whole); absent in profiles made before it was measured "
        "(the planner then counts the whole forward)",
    )

    views_input: bool | None = Field(
        default=None,
        description="whether its outputs are views of its input (or its input itself) and it "
        "saves nothing: a stage that opens with it holds its input once where a later layer "
        "saves such a view; absent in profiles made before it was recorded (the planner then "
        "counts the two apart)",
    )

    input_grad_is_view: bool | None = Field(
        default=None,
        description="whether the input gradient its backward makes is a view of the output "
        "gradient it is given (the same storage), from every layout that gradient was "
        "measured in (a reshape of a transposed one copies): zero bubble's I makes nothing "
        "there; absent in profiles made before it was measured (the planner then counts the "
        "two gradients apart there)",
    )

    weight_grad_frees_input: bool | None = Field(
        default=None,
        description="whether its zero-bubble W (the weight gradients alone) lets go every "
        "tensor its graph saved of its input's storage: where it does not (a node off every "
        "way to a parameter saved it, or it has no weights), the stage holds what the layer "
        "before saved of its own output through that layer's W; absent in profiles made before "
        "it was measured (the planner then counts it held)",
    )

    passed_sum_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="a captured graph's layer that reads a value and hands it on: what its "
        "backward allocates beyond backward_transient_bytes where the value's gradient from "
        "later layers is held apart (a later stage's, which the runtime keeps): autograd makes "
        "the sum as a new tensor; absent in profiles made before it was measured (the planner "
        "then counts the value's whole gradient)",
    )

    inner_backward_transient_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="backward_transient_bytes where the output's "
        "gradient is held by autograd alone (a stage's inner layer: the next layer's backward "
        "made it, laid out as that backward lays it out), let go once the nodes that read it "
        "have run; absent in profiles made before it was measured (the planner then counts "
        "backward_transient_bytes)",
    )

    weight_grad_kept_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="what its graph still holds of the tensors it saved (not its weights) "
        "once its zero-bubble W has run (nodes off every way to a parameter keep theirs; "
        "without weights that train, all of them): the rest goes as that W runs, before the "
        "W of the layers before it in its stage; absent in profiles made before it was "
        "measured (the planner then counts every saved tensor held through the stage's W)",
    )

    ctx_held_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="what a custom autograd.Function in the layer keeps as attributes of its "
        "ctx (`ctx.x = x`, which no saved-tensor hook sees), its input aside, not the model's "
        "weights: in saved_bytes too. A checkpoint cannot let it go (the graph it re-runs from "
        "keeps the node, and the ctx with it, until backward), so a layer under a checkpoint "
        "of its own holds it beside its input (a recomputed stage runs its first forward "
        "without a graph: nothing kept); absent where the layer keeps nothing so (and in "
        "profiles made before it was measured)",
    )

    ctx_input_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="the part of its input a custom autograd.Function in the layer keeps on "
        "its ctx (see ctx_held_bytes); absent where the layer keeps none so",
    )

    ctx_late_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="what its saves count (saved_bytes less shared_bytes) that its ctx keeps "
        "(see ctx_held_bytes): a backward lets those go not as it passes this layer but with "
        "the graph, once the stage's backward is done; absent where no ctx keeps any",
    )

    ctx_prev_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="what the layer before it saved that its ctx keeps: in a stage holding "
        "both, let go with the graph too, not as the backward passes the layer before; absent "
        "where no ctx keeps any",
    )

    ctx_dup_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="the part of ctx_held_bytes a saved-tensor hook saves too: a checkpoint's "
        "re-run makes that again, beside the one the ctx keeps; absent where no ctx keeps any",
    )

    ctx_dup_input_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="the part of ctx_input_bytes a hook saves too, its own or the layer "
        "before's (its output); absent where no ctx keeps any",
    )

    tied_first_backward_bytes: dict[int, Bytes] | None = Field(
        default=None,
        description="a layer that uses a parameter another layer uses too (tied): what its "
        "backward holds beyond backward_transient_bytes at its peak where that parameter has "
        "no gradient yet, so that the one the backward makes stays (a stage's copy of the "
        "parameter, in its first backward): that gradient where it is made before the peak, "
        "else 0; absent in profiles made before it was measured (the planner then counts the "
        "gradient from the backward's end)",
    )


PER_SIZE = tuple(
    name for name, f in LayerProfile.model_fields.items() if get_origin(f.annotation) is dict
)
"""The LayerProfile fields measured at every micro-batch size."""
CTX_FIELDS = (
    "ctx_held_bytes",
    "ctx_input_bytes",
    "ctx_late_bytes",
    "ctx_prev_bytes",
    "ctx_dup_bytes",
    "ctx_dup_input_bytes",
)
"""What custom autograd.Functions keep on their ctx: figures a layer has only where one does."""
LATER_PER_SIZE = (
    "stop_transient_bytes",
    "passed_sum_bytes",
    "inner_backward_transient_bytes",
    "tied_first_backward_bytes",
    "weight_grad_kept_bytes",
    *CTX_FIELDS,
)
LATER_LAYER = (
    "param_tensor_bytes",
    "views_input",
    "input_grad_is_view",
    "weight_grad_frees_input",
)  # (not per size: left out of the file where unset too)
"""Per-size fields added since the format's version: absent (None) in older profiles."""


def _per_size(layer: LayerProfile) -> tuple[str, ...]:
    """The layer's per-size maps: every PER_SIZE field, and the later ones it has."""
    kept = layer.__dict__
    return PER_SIZE + tuple(f for f in LATER_PER_SIZE if kept.get(f) is not None)


def _by_size(layer: LayerProfile, sizes: list[int]) -> bool:
    """Whether each of the layer's per-size maps lists exactly `sizes`, in that order."""
    kept = layer.__dict__
    return all(list(kept[field]) == sizes for field in _per_size(layer))


class OptimizerStep(LaterFields):
    """What one optimizer step allocates for its temporaries on the profiled device: `per_byte`
    bytes per byte of parameters, over all of a device's parameters at once when `foreach`
    (multi-tensor kernels), else over the largest parameter (one tensor after another). One
    tensor after another, `carry` bytes per byte of the tensor stepped before are still held
    while the next is (Adam's denominator: 1)."""

    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("carry",)
    model_config = ConfigDict(extra="forbid", strict=True)
    foreach: bool
    per_byte: float = Field(ge=0, le=1e3, allow_inf_nan=False)
    carry: float | None = Field(default=None, ge=0, le=1e3, allow_inf_nan=False)

    @model_validator(mode="after")
    def _carry_with_a_step(self) -> OptimizerStep:
        # (the plan counts the carry relative to per_byte: one a thousand times past it is not
        # what a step that makes next to nothing of its own can carry; found by a red team)
        if self.carry and self.carry > 1e3 * self.per_byte:
            raise ValueError(
                f"carry {self.carry} is more than a thousand times per_byte {self.per_byte}: a "
                "step carries over part of what it makes"
            )
        if self.carry and self.foreach:
            raise ValueError("carry is of a step one tensor after another, not of foreach")
        return self


class RuntimeOverhead(BaseModel):
    """What the pipeline runtime adds to the profiled compute (profiler/overhead.py):
    `action_ms` to every compute action of a stage (forward, backward, I, W), `call_ms` to each
    backward and I (the stage's one autograd call, which the layers' figures leave out), and
    `step_ms` once per step."""

    model_config = ConfigDict(extra="forbid", strict=True)
    action_ms: float = Field(ge=0, le=1e3, allow_inf_nan=False)
    step_ms: float = Field(ge=0, le=1e4, allow_inf_nan=False)
    call_ms: float = Field(default=0.0, ge=0, le=1e3, allow_inf_nan=False)

    @field_validator("action_ms", "step_ms", "call_ms")
    @classmethod
    def _measurable(cls, ms: float) -> float:
        return ms if ms >= MIN_MS else 0.0  # (as the layers' times: ProfileTable)


class TiedParameter(BaseModel):
    """A parameter several layers use (tied input and output embeddings): a stage holding more
    than one of them holds it once; stages on different devices each hold a copy."""

    model_config = ConfigDict(extra="forbid")
    bytes: Bytes
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=2)
    frozen: StrictBool = Field(
        default=False,
        description="it takes no gradient (requires_grad off): no stage holds a gradient or "
        "optimizer state for it (left out of the file where no tied parameter is frozen)",
    )


class ProfileMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    created: str = ""
    torch_version: str = ""
    warmup: int = 0
    repeats: int = 0
    threads: int = Field(default=0, ge=0, le=1024, strict=True)  # (0: not recorded)


class Profile(Artifact):
    """Measured per-layer costs of one model on one device, at several micro-batch sizes."""

    FORMAT_VERSION: ClassVar[int] = 2
    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("runtime",)
    kind: Literal["profile"] = "profile"
    format_version: StrictInt = 2
    model: Text = Field(description="how the model was named: example:NAME, pkg.mod:fn, file.py:fn")
    model_digest: Text = Field(description="sha256 of layer types and parameter shapes")
    device: Text
    device_name: Text
    dtype: DType
    input_shape: list[Annotated[int, Field(ge=0)]] = Field(
        description="the sample input's shape per sample (no batch)"
    )
    input_dtype: DType
    input_bytes: Bytes = Field(description="per sample: what enters the first stage")
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_BATCH)]] = Field(min_length=1)
    layers: list[LayerProfile] = Field(min_length=1, max_length=MAX_LAYERS)
    loss: LayerProfile | None = Field(
        default=None,
        description="the loss function, measured like a layer after the last one (type: its name)",
    )
    optimizer_step: dict[str, OptimizerStep] = Field(
        default_factory=dict, description="per optimizer (sgd, momentum, adam)"
    )
    captured: bool = Field(
        default=False,
        description="the model is not an nn.Sequential: its graph was captured (torch.export) "
        "and its layers are runs of the graph's operations (profiler/graph.py)",
    )
    tied: list[TiedParameter] = Field(
        default_factory=list,
        description="parameters that several layers use (each layer's param_bytes counts them)",
    )
    runtime: RuntimeOverhead | None = Field(
        default=None,
        description="what the pipeline runtime adds per action and per step beyond the layers' "
        "compute, measured on this device (profiler/overhead.py); absent: not measured",
    )
    meta: ProfileMeta = ProfileMeta()

    def canonical_json(self, *, with_meta: bool = True) -> str:
        """Fields in their declared order, each per-size map by increasing size, optimizers by
        name: the same profile always gives the same bytes. Written by pydantic's own
        serializer: json's indented output is pure Python, seconds on 10 000 layers."""
        return self._ordered().model_dump_json(indent=1, exclude=self._left_out(with_meta)) + "\n"

    def digest(self) -> str:
        """sha256 of the compact canonical content, `meta` excluded (re-profiling the same model
        the same way keeps it); pydantic's serializer, 5x json's on a large profile."""
        text = self._ordered().model_dump_json(exclude=self._left_out(with_meta=False))
        return hashlib.sha256(text.encode()).hexdigest()

    def _left_out(self, with_meta: bool) -> dict[str, Any]:
        """What the file and the digest leave out: the later fields unset (a profile made before
        them reads and digests as it did), and `meta` unless asked for."""
        drop: dict[str, Any] = {name: True for name in self._unset_later()}
        if not with_meta:
            drop["meta"] = True
        entries = self.layers + ([self.loss] if self.loss else [])
        later = LATER_PER_SIZE + LATER_LAYER
        unset = {f for f in later if all(getattr(x, f) is None for x in entries)}
        if unset:
            drop["layers"] = {"__all__": unset}
            if self.loss:
                drop["loss"] = unset
        if not any(t.frozen for t in self.tied):  # (a later field too)
            drop["tied"] = {"__all__": {"frozen"}}
        return drop

    def _ordered(self) -> Profile:
        """This profile with every per-size map by increasing size and its optimizers by name:
        itself, as the validator leaves it, or a sorted copy where a map was put in since
        (model_copy and assignment skip the validator)."""
        entries = self.layers + ([self.loss] if self.loss else [])
        # the validator leaves every map listing batch_sizes in order: one list comparison
        # each (4x faster than checking each map's order pair by pair); any other map, even
        # one in order, takes the sorted copy, which holds the same
        sizes = self.batch_sizes
        if all(_by_size(x, sizes) for x in entries) and list(self.optimizer_step) == sorted(
            self.optimizer_step
        ):
            return self

        def fix(x: LayerProfile) -> LayerProfile:
            return x.model_copy(
                update={f: dict(sorted(getattr(x, f).items())) for f in _per_size(x)}
            )

        return self.model_copy(
            update={
                "layers": [fix(x) for x in self.layers],
                "loss": fix(self.loss) if self.loss else None,
                "optimizer_step": dict(sorted(self.optimizer_step.items())),
            }
        )

    @model_validator(mode="after")
    def _sizes_consistent(self) -> Profile:
        order = self.batch_sizes
        sizes = set(order)
        if sorted(sizes) != order or min(sizes) < 1:
            raise ValueError("batch_sizes must be distinct positive integers in increasing order")
        for layer in self.layers + ([self.loss] if self.loss else []):
            if _by_size(layer, order):
                continue
            kept = layer.__dict__
            for field in _per_size(layer):
                have = kept[field]
                if set(have) != sizes:
                    raise ValueError(
                        f"layer {layer.index}: {field} is not given for every batch size"
                    )
                # By increasing size, whatever order the file had (json's sorted keys put 16
                # before 2): what the tables read and canonical JSON writes. The values were
                # validated; a layer the caller passed in is reordered in place (equal still).
                kept[field] = {b: have[b] for b in order}
        if list(self.optimizer_step) != sorted(self.optimizer_step):
            self.__dict__["optimizer_step"] = dict(sorted(self.optimizer_step.items()))
        if [layer.index for layer in self.layers] != list(range(len(self.layers))):
            raise ValueError("layers must be numbered 0, 1, 2, ... in order")
        for t in self.tied:
            if sorted(set(t.layers)) != t.layers or t.layers[-1] >= len(self.layers):
                raise ValueError("a tied parameter's layers must be distinct layers, in order")
        for layer in self.layers:  # (found by a red team: a list that contradicts the layer's
            tensors = layer.param_tensor_bytes  # weights gave nonsense, not a refusal)
            if tensors and max(tensors) > layer.largest_param_bytes:
                raise ValueError(
                    f"layer {layer.index}: param_tensor_bytes lists a tensor of {max(tensors)} "
                    f"bytes, more than its largest_param_bytes ({layer.largest_param_bytes})"
                )
        return self
