"""The memory of a stage: the one place that says what a stage of layers [i, j) holds at its peak.

    params      parameters and buffers of the stage's layers
    grads       one gradient per parameter
    optimizer   optimizer slots per parameter (SGD 0, momentum 1, Adam 2)
    stashed     activations kept for backward: max over the stage's stash pairs (a, b) of
                a x input + b x S, where a micro-batches are kept as their input only (to be
                re-materialised) and b whole; the pairs come from the schedule's program order
                (schedules/stash.py), e.g. GPipe without recomputation ((0, M),), with it ((M, 1),).
                S = what the layers save for one micro-batch, counting once the tensors two
                neighbouring layers both save; input = the tensor entering layer i
    live        the largest transient of one layer above its stash (gradients in flight, temporaries)
    workspace   what the device reserves before any stage runs

Every term grows as a stage gains layers at its end, which is what makes the partition
search exact. All functions take numpy arrays of starts and ends, so the solver evaluates
thousands of candidate stages in one call; scalars work too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costs import Chain

RECOMPUTE_MODES = ("never", "except_last", "always")


@dataclass(frozen=True)
class StageShape:
    """What a stage's memory depends on besides its layers."""

    stash: tuple[tuple[int, int], ...]  # (inputs kept, whole stashes kept) at the stage's peaks
    optimizer_slots: int
    reserved: int = 0

    @property
    def inflight(self) -> int:
        """Micro-batches whose activations (whole or input only) the stage holds at its peak."""
        return max(a + b for a, b in self.stash)


class MemoryModel:
    """Prefix sums and a range-maximum table over one Chain."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        zero = np.zeros(1, dtype=np.int64)
        self._params = np.concatenate([zero, np.cumsum(chain.params)])
        self._buffers = np.concatenate([zero, np.cumsum(chain.buffers)])
        self._saved = np.concatenate([zero, np.cumsum(chain.saved)])
        self._shared = np.concatenate([zero, np.cumsum(chain.shared)])
        self._boundary = chain.boundary
        # _table[k][i] = max(transient[i : i + 2**k]), for O(1) range maxima.
        levels = [chain.transient.astype(np.int64)]
        while 2 ** len(levels) <= len(chain.transient):
            prev, half = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-half], prev[half:]))
        self._table = levels

    def _range_max(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        span = j - i
        k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
        out = np.empty(np.shape(i), dtype=np.int64)
        for level in np.unique(k):
            sel = k == level
            table = self._table[level]
            out[sel] = np.maximum(table[i[sel]], table[j[sel] - 2**level])
        return out

    def terms(
        self, i: np.ndarray | int, j: np.ndarray | int, shape: StageShape
    ) -> dict[str, np.ndarray]:
        """The breakdown for stages [i, j) (j > i), as arrays of bytes."""
        i = np.atleast_1d(np.asarray(i, dtype=np.int64))
        j = np.atleast_1d(np.asarray(j, dtype=np.int64))
        p = self._params[j] - self._params[i]
        saved = self._saved[j] - self._saved[i] - (self._shared[j] - self._shared[i + 1])
        entering = self._boundary[i]
        stashed = np.zeros(i.shape, dtype=np.int64)
        for a, b in shape.stash:
            stashed = np.maximum(stashed, a * entering + b * saved)
        return {
            "params": p + self._buffers[j] - self._buffers[i],
            "grads": p,
            "optimizer": shape.optimizer_slots * p,
            "stashed_activations": stashed,
            "live_activations": self._range_max(i, j),
            "workspace": np.full(i.shape, shape.reserved, dtype=np.int64),
        }

    def total(self, i: np.ndarray | int, j: np.ndarray | int, shape: StageShape) -> np.ndarray:
        return sum(self.terms(i, j, shape).values())  # type: ignore[return-value]

    def max_end(self, shape: StageShape, budget: int) -> np.ndarray:
        """For every start i: the largest end j with total(i, j) <= budget, or i if even [i, i+1)
        does not fit. Binary search on all starts at once (total grows with j)."""
        n = self.chain.num_layers
        i = np.arange(n, dtype=np.int64)
        lo, hi = (
            i.copy(),
            np.full(n, n + 1, dtype=np.int64),
        )  # total(i, lo) fits (or lo = i); hi does not
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                return lo
            idx = np.nonzero(open_)[0]
            mid = (lo[idx] + hi[idx]) // 2
            fits = self.total(i[idx], mid, shape) <= budget
            lo[idx[fits]] = mid[fits]
            hi[idx[~fits]] = mid[~fits]
