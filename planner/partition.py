"""Exact min-bottleneck contiguous partition ("chains on chains") under per-stage memory limits.

Stage s runs layers [i, j) on device s, costs (T[j] - T[i]) / speed[s] per micro-batch and must
fit budget[s]. We minimise the slowest stage.

The probe answers "is there a split whose every stage costs at most B?" exactly: it carries the
set of layer positions that s stages can reach, stage by stage. From a start i, the feasible ends
are the interval (i, e_s(i)], where e_s(i) is limited by time (a binary search on the prefix
sums) and by memory (precomputed once per distinct device; memory does not depend on B):

    reach_0 = {0};   reach_{s+1} = union over i in reach_s of (i, e_s(i)];   feasible iff L in reach_K

Greedy "fill each stage as far as it goes" is not enough here: with unequal devices, or with a
memory term that depends on where a stage starts (the recomputed stage's input), running ahead
can strand a heavy layer on a small device. The search over B bisects on the real line, snaps to
the bottleneck of each feasible split found, and finishes by proving that nothing just below the
best bottleneck is feasible, so the answer is the exact optimum, not an approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .memory import MemoryModel, StageShape


@dataclass(frozen=True)
class StageSpec:
    """Device position s of the pipeline: its speed, its memory budget, and its memory shape."""

    speed: float
    budget: int
    shape: StageShape


@dataclass
class Partition:
    bounds: list[int]  # K + 1 cut positions: 0 = b_0 < b_1 < ... < b_K = L
    bottleneck: float
    probes: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def stages(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))


def stage_costs(times: np.ndarray, bounds: list[int], speeds: list[float]) -> list[float]:
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    return [
        float(prefix[j] - prefix[i]) / sp
        for (i, j), sp in zip(zip(bounds[:-1], bounds[1:]), speeds)
    ]


class _Prober:
    def __init__(self, times: np.ndarray, memory: MemoryModel, stages: list[StageSpec]) -> None:
        self.L, self.K = len(times), len(stages)
        self.prefix = np.concatenate([[0.0], np.cumsum(times, dtype=np.float64)])
        self.speeds = [s.speed for s in stages]
        cache: dict[tuple[StageShape, int], np.ndarray] = {}
        self.mem_end = []
        for s in stages:
            key = (s.shape, s.budget)
            if key not in cache:
                cache[key] = memory.max_end(s.shape, s.budget)
            self.mem_end.append(cache[key])
        self.probes = 0

    def ends(self, s: int, starts: np.ndarray, bound: float) -> np.ndarray:
        """Largest j per start with cost(s, i, j) <= bound and stage s's memory fitting."""
        P, sp = self.prefix, self.speeds[s]
        base = P[starts]
        if math.isinf(bound):
            j = np.full(starts.shape, self.L, dtype=np.int64)
        else:
            j = np.searchsorted(P, base + bound * sp, side="right") - 1
            # searchsorted compares base + bound*sp; the cost is (P[j] - base) / sp. Agree exactly.
            for _ in range(4):
                over = (P[j] - base) / sp > bound
                if not over.any():
                    break
                j = j - over
            for _ in range(4):
                nxt = np.minimum(j + 1, self.L)
                under = (nxt > j) & ((P[nxt] - base) / sp <= bound)
                if not under.any():
                    break
                j = j + under
        return np.minimum(j, self.mem_end[s][starts])

    def probe(self, bound: float) -> list[int] | None:
        """A split with every stage cost <= bound and every stage fitting, or None."""
        self.probes += 1
        L, K = self.L, self.K
        reach = np.zeros(L + 1, dtype=bool)
        reach[0] = True
        steps: list[tuple[np.ndarray, np.ndarray]] = []
        for s in range(K):
            room = L - (K - s)  # a later stage needs at least one layer each
            starts = np.nonzero(reach[: room + 1])[0]
            if starts.size == 0:
                return None
            e = np.minimum(self.ends(s, starts, bound), room + 1)
            ok = e > starts
            starts, e = starts[ok], e[ok]
            if starts.size == 0:
                return None
            steps.append((starts, e))
            cover = np.bincount(starts + 1, minlength=L + 2) - np.bincount(e + 1, minlength=L + 2)
            reach = np.cumsum(cover)[: L + 1] > 0
        if not reach[L]:
            return None
        bounds = [L]
        for starts, e in reversed(steps):
            end = bounds[-1]
            ok = (starts < end) & (e >= end)
            bounds.append(int(starts[ok][0]))  # the earliest start: later stages as long as allowed
        return bounds[::-1]

    def bottleneck(self, bounds: list[int]) -> float:
        P = self.prefix
        return max(
            float(P[j] - P[i]) / sp for i, j, sp in zip(bounds[:-1], bounds[1:], self.speeds)
        )


def feasible_split(times: np.ndarray, memory: MemoryModel, stages: list[StageSpec]) -> bool:
    """Whether any split fits every stage's budget (time unbounded)."""
    return _Prober(np.asarray(times, dtype=np.float64), memory, stages).probe(math.inf) is not None


def solve_partition(
    times: np.ndarray, memory: MemoryModel, stages: list[StageSpec]
) -> Partition | None:
    """The split of len(times) layers into len(stages) non-empty contiguous stages that minimises
    the slowest stage, with every stage within its budget; None when no split fits in memory."""
    L, K = len(times), len(stages)
    if not 1 <= K <= L:
        raise ValueError(f"cannot split {L} layers into {K} non-empty stages")
    prober = _Prober(np.asarray(times, dtype=np.float64), memory, stages)
    bounds = prober.probe(math.inf)
    if bounds is None:
        return None
    hi = prober.bottleneck(bounds)
    total = float(prober.prefix[-1])
    lo = max(float(np.max(times)) / max(prober.speeds), total / sum(prober.speeds))
    lo = min(lo, hi) * (1 - 1e-12)
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        found = prober.probe(mid)
        if found is None:
            lo = mid
        else:
            bounds, hi = found, prober.bottleneck(found)
    # Prove it: no split is feasible strictly below the best bottleneck found.
    while (found := prober.probe(float(np.nextafter(hi, -math.inf)))) is not None:
        bounds, hi = found, prober.bottleneck(found)
    return Partition(bounds=bounds, bottleneck=hi, probes=prober.probes)
