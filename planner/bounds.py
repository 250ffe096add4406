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
    W = float(work.sum())
    if W <= 0:
        return 0.0
    load = microbatches * W / float(sum(speeds))
    busy = work > 0
    rho = min(1.0, float((counted[busy] / work[busy]).min()))
    if rho <= 1e-9:  # (a vanishing fill term; subnormal rho once rounded it above the truth)
        return load
    # 1 - (1 - rho / M)^S, accurate also where rho / M is tiny
    x = rho / microbatches
    share = 1.0 if x >= 1 else -math.expm1(num_stages * math.log1p(-x))
    if share <= 0:
        return load
    fill = rho * W / share / max(speeds)
    return max(load, fill)


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
