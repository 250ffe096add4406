"""Per-layer costs of one micro-batch, read off a Profile at the micro-batch size a plan uses.

Profiles are measured at a few sizes; between them we interpolate linearly, beyond them we
extend the line through the two nearest sizes (time and activation memory are close to affine in
the batch size once past the smallest sizes).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from profiler.types import Profile

OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2}


def at_size(measured: dict[int, float], b: int) -> float:
    """`measured` (size -> value) read at size `b`: exact, interpolated or extended; never < 0."""
    xs = sorted(measured)
    if b in measured:
        return float(measured[b])
    if len(xs) == 1:
        return float(measured[xs[0]]) * b / xs[0]
    k = bisect.bisect_left(xs, b)
    k = min(max(k, 1), len(xs) - 1)
    x0, x1 = xs[k - 1], xs[k]
    y0, y1 = float(measured[x0]), float(measured[x1])
    return max(y0 + (y1 - y0) * (b - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True)
class Chain:
    """Per-layer costs for micro-batches of `mb` samples (arrays of length L unless noted).

    Times are ms on the profiled device; sizes are bytes. `boundary[l]` is what enters layer l
    (length L + 1: boundary[0] is the model input, boundary[L] the model output).
    """

    mb: int
    forward: np.ndarray
    backward: np.ndarray
    input_grad: np.ndarray  # zero-bubble I: the input gradient alone
    weight_grad: np.ndarray  # zero-bubble W: the weight gradients alone, as the pipe runs them
    params: np.ndarray
    buffers: np.ndarray
    saved: np.ndarray
    shared: np.ndarray
    transient: np.ndarray
    boundary: np.ndarray

    @property
    def num_layers(self) -> int:
        return len(self.forward)


def chain_at(profile: Profile, mb: int) -> Chain:
    """The profile's layers as arrays, read at micro-batch size `mb`."""
    layers = profile.layers

    def times(attr: str) -> np.ndarray:
        return np.array(
            [at_size({b: t.median for b, t in getattr(x, attr).items()}, mb) for x in layers]
        )

    def sizes(attr: str) -> np.ndarray:
        return np.array([round(at_size(getattr(x, attr), mb)) for x in layers], dtype=np.int64)

    saved = sizes("saved_bytes")
    peak = sizes("peak_bytes")
    boundary = np.array(
        [profile.input_bytes * mb] + [x.output_bytes * mb for x in layers], dtype=np.int64
    )
    return Chain(
        mb=mb,
        forward=times("forward_ms"),
        backward=times("backward_ms"),
        input_grad=times("backward_input_ms"),
        weight_grad=times("backward_weight_ms"),
        params=np.array([x.param_bytes for x in layers], dtype=np.int64),
        buffers=np.array([x.buffer_bytes for x in layers], dtype=np.int64),
        saved=saved,
        shared=np.minimum(sizes("shared_bytes"), saved),
        transient=np.maximum(peak - saved, 0),
        boundary=boundary,
    )
