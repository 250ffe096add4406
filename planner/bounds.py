"""A lower bound on a candidate's iteration time before its partition is solved, so the search
visits candidates best-bound-first and skips those that cannot beat the plan it has.

For S stages in pipeline order with per-micro-batch work w_s (forward, backward or I + W, and
average recomputation, at the stage's speed), any schedule of M micro-batches gives stage s

    Q_s = head_s + M w_s + tail_s <= makespan

head_s: its first action waits for micro-batch 0's forward through the stages before it;
tail_s: after its last backward, that micro-batch's backward runs through them (zero bubble's
last action may be a W, which nothing follows, so it gets no tail). With u the part of a layer's
work that head and tail count (forward + backward; forward alone for zero bubble) and
rho = min over layers of u / w, Q_s >= rho * sum_{s' < s} w_s' + M w_s. For any split, the
weights lambda_s that make the coefficient of every w_s equal give

    max_s Q_s >= rho W / (1 - (1 - rho / M)^S)          (W = sum of all w)

which tends to W M / S plus about half the fill-and-drain bubble. The bound also takes the
devices' total load, M W / sum(speeds). Speeds enter as the fastest device's (a stage runs no
faster than that), so the bound holds on any cluster. Transfers only add time.

And the split itself: whatever the memory allows, some stage s carries w_s / speed_s at least
the least bottleneck of any contiguous split of the work into the stages (at their devices'
speeds), and its device runs it M times. With few layers per stage that granularity, not the
average, decides (100 layers on 64 devices: one stage holds the heaviest layer alone).
`least_bottleneck` brackets it by probing many bottlenecks at once.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def prior_bound(
    work: np.ndarray,
    counted: np.ndarray,
    microbatches: int,
    num_stages: int,
    speeds: list[float],
) -> float:
    """A lower bound (ms) on the makespan of any split of layers of per-micro-batch `work` into
    `num_stages` stages, where `counted` is the part of each layer's work on the fill and drain
    path (module docstring)."""
    return prior_bound_of(*work_summary(work, counted), microbatches, num_stages, speeds)


def work_summary(work: np.ndarray, counted: np.ndarray) -> tuple[float, float]:
    """All the bounds below read of the layers: the total work W, and rho, the least share of
    a layer's work that its fill and drain path counts (1 where there is no work)."""
    W = float(work.sum())
    busy = work > 0
    if W <= 0 or not busy.any():
        return 0.0, 1.0
    return W, min(1.0, float((counted[busy] / work[busy]).min()))


def prior_bound_of(
    W: float, rho: float, microbatches: int, num_stages: int, speeds: list[float]
) -> float:
    """prior_bound from the layers' work_summary (the same for every M, S and speeds)."""
    if W <= 0:
        return 0.0
    load = microbatches * W / float(sum(speeds))
    if rho <= 1e-9:  # (a vanishing fill term; subnormal rho once rounded it above the truth)
        return load
    # 1 - (1 - rho / M)^S, accurate also where rho / M is tiny
    x = rho / microbatches
    share = 1.0 if x >= 1 else -math.expm1(num_stages * math.log1p(-x))
    if share <= 0:
        return load
    fill = rho * W / share / max(speeds)
    return max(load, fill)


def interleaved_bound(
    work: np.ndarray, counted: np.ndarray, microbatches: int, num_devices: int,
    speeds: list[float],
) -> float:  # fmt: skip
    """A lower bound (ms) on the makespan of any split of layers of per-micro-batch `work` into
    2 K stages, device d running stages d and d + K (interleaved 1F1B's looped placement).

    Device d's actions lie between its first, a forward of stage d, and its last, a backward
    of stage d: with a_d, b_d the work of stages d and d + K, for every d

        Q_d  = rho sum_{s < d} a_s + M (a_d + b_d)             <= makespan
        Q'_d = rho (sum_s a_s + sum_{s < d} b_s) + M b_d        <= makespan

    (Q'_d: stage d + K's own actions lie between a forward and a backward of it, which wait
    for a micro-batch's way through every stage before it). The least makespan any split
    allows is at least W / c, c the most total work that keeps every Q_d, Q'_d <= 1; by LP
    duality c <= sum y + sum z for any y, z >= 0 whose columns reach 1:

        a_s:  M y_s + rho sum_{d > s} y_d + rho sum_d z_d >= 1
        b_s:  M y_s + M z_s + rho sum_{d > s} z_d >= 1

    Taken with every column exactly 1 (solved from the last device back, linear in sum z),
    then scaled by the least column where rounding left one short; where that system has a
    negative entry, y = 1 / M (the load, M W / K). At M ~ K this is about 1.2x the load; it
    tends to the load as M grows."""
    return interleaved_bound_of(*work_summary(work, counted), microbatches, num_devices, speeds)


def interleaved_bound_of(
    W: float, rho: float, microbatches: int, num_devices: int, speeds: list[float]
) -> float:
    """interleaved_bound from the layers' work_summary."""
    if W <= 0 or num_devices < 1:
        return 0.0
    return W * _framed_share(num_devices, microbatches, rho) / float(max(speeds))


@lru_cache(maxsize=4096)
def _framed_share(K: int, microbatches: int, rho: float) -> float:
    """1 / c for interleaved_bound (per unit of work, at speed 1)."""
    M = float(microbatches)

    def tight(Z: float) -> tuple[list[float], list[float]]:
        y, z = [0.0] * K, [0.0] * K
        ys = zs = 0.0  # sums over the devices after s
        for s in reversed(range(K)):
            y[s] = (1 - rho * ys - rho * Z) / M
            z[s] = (1 - rho * zs) / M - y[s]
            ys, zs = ys + y[s], zs + z[s]
        return y, z

    g0, g1 = sum(tight(0.0)[1]), sum(tight(1.0)[1])
    slope = g1 - g0
    y, z = tight(g0 / (1 - slope)) if slope < 1 else ([1 / M] * K, [0.0] * K)
    if min(y) < 0 or min(z) < 0:
        y, z = [1 / M] * K, [0.0] * K
    Z = sum(z)
    cols = []
    ys = zs = 0.0
    for s in reversed(range(K)):
        cols += [M * y[s] + rho * ys + rho * Z, M * y[s] + M * z[s] + rho * zs]
        ys, zs = ys + y[s], zs + z[s]
    least = min(cols)
    return least / (sum(y) + Z) if least > 0 else 0.0


def least_bottleneck(work: np.ndarray, speeds: list[float] | np.ndarray, rounds: int = 2) -> float:
    """A lower bound on min over contiguous splits of `work` into len(speeds) stages (in that
    order, empty stages allowed: a relaxation) of max_s work_s / speeds[s]; each round shrinks
    the bracket [lo, hi] 65-fold, and hi / lo starts below the number of stages. Each round probes 64 bottlenecks in
    one pass: from each, fill every stage as far as it goes (greedy reach is exact for a fixed
    order of stages); the bracket keeps the largest that fails."""
    speeds = np.asarray(speeds, dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(work, dtype=np.float64)])
    total = float(prefix[-1])
    if total <= 0 or len(speeds) == 0:
        return 0.0
    lo = max(total / float(speeds.sum()), float(work.max()) / float(speeds.max()))
    hi = total / float(speeds.max())  # everything on the fastest stage
    n = len(prefix) - 1
    for _ in range(rounds):
        if hi <= lo * (1 + 1e-12):
            break
        probes = np.linspace(lo, hi, 66)[1:-1]
        pos = np.zeros(len(probes), dtype=np.int64)
        for sp in speeds:
            reach = prefix[pos] + probes * sp * (1 + 1e-12)
            pos = np.searchsorted(prefix, reach, side="right") - 1
        done = pos >= n
        if done.any():
            first = int(np.argmax(done))
            hi = float(probes[first])
            if first > 0:
                lo = float(probes[first - 1])
        else:
            lo = float(probes[-1])
    return lo * (1 - 1e-9)
