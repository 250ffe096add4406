"""Dynamic programming over (stages, layers): the reference solver for small chains.

best[s][j] = the smallest bottleneck of a split of layers [0, j) into s + 1 stages that all fit,
counting the links between them when cuts are given (cuts[s - 1][i]: stage s - 1 hands over to
stage s at boundary i):

    best[s][j] = min over i of max(best[s - 1][i], cuts[s - 1][i], (T[j] - T[i]) / speed[s])

(with options, per-stage recomputation: the stage's cost is its cheapest option that fits)

O(K * L^2) stage evaluations; exact, simple, and independent of the probe's bookkeeping, which
is what makes it worth keeping next to the fast solver.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .memory import MemoryModel
from .partition import Partition, StageSpec, cut_table, option_times


def solve_partition_dp(
    times: np.ndarray,
    memory: MemoryModel,
    stages: list[StageSpec],
    cuts: Sequence[np.ndarray] | None = None,
) -> Partition | None:
    table = option_times(times, stages)
    L, K = table.shape[1], len(stages)
    if not 1 <= K <= L:
        raise ValueError(f"cannot split {L} layers into {K} non-empty stages")
    links = cut_table(cuts, L, K)
    prefixes = np.concatenate([np.zeros((len(table), 1)), np.cumsum(table, axis=1)], axis=1)
    best = np.full((K, L + 1), math.inf)
    arg = np.zeros((K, L + 1), dtype=np.int64)
    pick = np.zeros((K, L + 1), dtype=np.int64)
    for s, spec in enumerate(stages):
        for j in range(s + 1, L - (K - s - 1) + 1):
            i = np.arange(s, j)  # stage s covers [i, j); stages before it cover [0, i)
            cost = np.full(i.shape, math.inf)
            option = np.zeros(i.shape, dtype=np.int64)
            for x, (prefix, shape) in enumerate(zip(prefixes, spec.shapes)):
                fits = memory.total(i, np.full(i.shape, j), shape) <= spec.budget
                c = np.where(fits, (prefix[j] - prefix[i]) / spec.speed, math.inf)
                option = np.where(c < cost, x, option)
                cost = np.minimum(cost, c)
            before = best[s - 1][i] if s else np.where(i == 0, 0.0, math.inf)
            if s and links is not None:  # inf: no cut allowed at i
                link = links[s - 1][i, j] if links.ndim == 3 else links[s - 1][i]
                before = np.maximum(before, link)
            value = np.maximum(before, cost)
            k = int(np.argmin(value))
            best[s][j], arg[s][j], pick[s][j] = value[k], i[k], option[k]
    if math.isinf(best[K - 1][L]):
        return None
    bounds = [L]
    choices = []
    for s in range(K - 1, -1, -1):
        choices.append(int(pick[s][bounds[-1]]))
        bounds.append(int(arg[s][bounds[-1]]))
    return Partition(bounds=bounds[::-1], bottleneck=float(best[K - 1][L]), choices=choices[::-1])
