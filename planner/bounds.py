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
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from schedules.ir import Kind, Schedule
from schedules.order import kept, program_arrays, schedule_key
from schedules.waves import KIND_CODE


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


def work_shares(forward: np.ndarray, backward: np.ndarray, work: np.ndarray) -> tuple[float, ...]:
    """What interleaved_runs_bound reads of the layers: the least share of a layer's work (as
    passed: the search passes it without recomputation, which only adds) that its forward is,
    that its backward without recomputation is, and that the two together are (each 1 where
    there is no work)."""
    busy = work > 0
    if not busy.any():
        return 1.0, 1.0, 1.0
    w = work[busy]
    return tuple(
        min(1.0, float((part[busy] / w).min())) for part in (forward, backward, forward + backward)
    )


def interleaved_runs_bound(
    schedule: Schedule,
    W: float,
    shares: tuple[float, ...],
    speeds: Sequence[float],
) -> float:
    """A lower bound (ms) on the makespan of any split of layers of total per-micro-batch work
    W into the 2 K stages of `schedule` (interleaved 1F1B: device d runs stages d and d + K, in
    its program's order), `shares` from work_shares.

    interleaved_bound frames each device's whole load, and each later stage's own; a split
    can make those frames nearly as short as the load (a later stage light where an earlier one
    is heavy), while the schedule it runs still has a bubble of several percent. Paths through
    the program see it: a run of device d's actions from its action x to its action y is
    preceded by micro-batch x's way to x (the forwards of the stages before it) and followed by
    y's way back (the backwards of the stages before it); every action on such a path waits
    for the one before it, so the path's length is at most the makespan. On any split a
    path's length is at least sum_s c_s w_s / speed_s, where c_s counts stage s's actions on
    it: M where it holds all of them (their work, w_s), else a forward and
    a backward together at least the smaller `shares`[2] of w_s, a lone forward `shares`[0],
    a lone backward `shares`[1].

    Weights y >= 0 on paths whose columns sum_p y_p c_ps / speed_s reach 1 give makespan >= W
    / sum y. The paths taken: each device's whole program; each device but the last, from
    the first forward of its later stage to that stage's last backward; the last device, from
    its first action to its later stage's last backward. Their weights are solved with every
    column exactly 1 (2 K equations, 2 K weights; on uniform work, the best weights over every
    run that begins with a forward and ends with a backward, which an LP in the tests finds
    too), then scaled by the least column; where that gives a negative weight (forward-heavy
    layers, uneven speeds, M < K), by an LP over y >= 0 instead (_best_weights). At K = 64,
    M = 4 K: 6.3% above the load, where interleaved_bound says 1.2%."""
    K = len(speeds)
    if W <= 0 or K < 1 or schedule.num_ranks != K:
        return 0.0
    key = (schedule_key(schedule, ("runs",)), tuple(shares), tuple(speeds))
    return W * kept(_FACTORS, key, lambda: _runs_factor(schedule, shares, speeds))


_FACTORS: dict[tuple, float] = {}
LEAST_SHARE = 1e-6  # interleaved_runs_bound's shares below it are taken as none
LP_LIMIT_MS = 2000  # the most _best_weights' LP may take


def _runs_factor(schedule: Schedule, shares: tuple[float, ...], speeds: Sequence[float]) -> float:
    """interleaved_runs_bound per unit of W."""
    K, M = len(speeds), schedule.num_microbatches
    counts = _run_counts(schedule)
    if counts is None:
        return 0.0
    # (a share below a millionth taken as none: a smaller share only weakens the bound, and
    # GLOP never returned on one of 1.2e-16, a backward that float rounding left of a layer
    # all forward: found by a hypothesis test)
    f, b, both = (x if x >= LEAST_SHARE else 0.0 for x in shares)
    nf, nb = counts  # (paths, stages)
    pairs = np.minimum(nf, nb)
    c = pairs * both + (nf - pairs) * f + (nb - pairs) * b
    c = np.where((nf == M) & (nb == M), float(M), c)
    c = c / np.array([speeds[s % K] for s in range(2 * K)], dtype=np.float64)
    try:
        y = np.linalg.solve(c.T, np.ones(2 * K))
    except np.linalg.LinAlgError:
        y = None
    if y is None or not np.isfinite(y).all() or y.min() < -1e-9 * max(1.0, float(abs(y).max())):
        y = _best_weights(c)  # (forward-heavy layers, uneven speeds, M < K: an LP)
        if y is None:
            return 0.0
    y = np.maximum(y, 0.0)
    least, total = float((y @ c).min()), float(y.sum())
    return least / total if least > 0 and total > 0 else 0.0


def _best_weights(c: np.ndarray) -> np.ndarray | None:
    """Weights y >= 0 on the rows of `c` (paths) that make the least column (stage) of y c
    the largest, sum y = 1: an LP (OR-tools' GLOP), for where the square system's solution
    has a negative weight. None where GLOP finds none."""
    from ortools.linear_solver import pywraplp

    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    lp.SetTimeLimit(LP_LIMIT_MS)  # (then no weights: the bound is 0, still a bound)
    y = [lp.NumVar(0.0, 1.0, "") for _ in range(c.shape[0])]
    t = lp.NumVar(0.0, lp.infinity(), "t")
    total = lp.Constraint(1.0, 1.0)
    for v in y:
        total.SetCoefficient(v, 1.0)
    for s in range(c.shape[1]):
        column = lp.Constraint(0.0, lp.infinity())
        column.SetCoefficient(t, -1.0)
        for p in np.flatnonzero(c[:, s]):
            column.SetCoefficient(y[p], float(c[p, s]))
    lp.Maximize(t)
    if lp.Solve() not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None
    return np.array([v.solution_value() for v in y])


def _run_counts(schedule: Schedule) -> tuple[np.ndarray, np.ndarray] | None:
    """For interleaved_runs_bound's 2 K paths (rows), how many forwards and backwards of each
    stage (columns) each holds, its way there and back included; None where a device's
    program is not its two stages' forwards and backwards, beginning with a forward and ending
    with a backward. Kept per schedule."""
    return kept(_RUNS, schedule_key(schedule, ("runs",)), lambda: _counted_runs(schedule))


_RUNS: dict[tuple, tuple[np.ndarray, np.ndarray] | None] = {}
_F, _B = KIND_CODE[Kind.F], KIND_CODE[Kind.B]


def _counted_runs(schedule: Schedule) -> tuple[np.ndarray, np.ndarray] | None:
    K, S, M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    kinds, stages, _ = program_arrays(schedule)
    n = 4 * M  # each device: two stages' M forwards and M backwards
    if S != 2 * K or len(kinds) != K * n:
        return None
    nf = np.zeros((S, S))
    nb = np.zeros((S, S))
    for d in range(K):
        k, st = kinds[d * n : (d + 1) * n], stages[d * n : (d + 1) * n]
        if not (np.isin(st, (d, d + K)).all() and np.isin(k, (_F, _B)).all()):
            return None
        later = st == d + K
        if not (later & (k == _F)).any() or not (later & (k == _B)).any():
            return None
        first_later = int(np.argmax(later & (k == _F)))
        last_later = n - 1 - int(np.argmax((later & (k == _B))[::-1]))
        # each device's whole program; then each device but the last from its later stage's
        # first forward to its last backward, the last device from its first action
        tail = (K + d, first_later if d < K - 1 else 0, last_later)
        for row, i, j in ((d, 0, n - 1), tail):
            if k[i] != _F or k[j] != _B:
                return None
            nf[row, : st[i]] += 1  # the way to x: forwards of the stages before it
            nb[row, : st[j]] += 1  # the way back from y: their backwards
            seg_k, seg_s = k[i : j + 1], st[i : j + 1]
            for stage in (d, d + K):
                nf[row, stage] += np.count_nonzero((seg_s == stage) & (seg_k == _F))
                nb[row, stage] += np.count_nonzero((seg_s == stage) & (seg_k == _B))
    for a in (nf, nb):
        a.setflags(write=False)
    return nf, nb


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
