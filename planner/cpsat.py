"""The same partition problem as an integer program, solved by OR-tools CP-SAT.

An independent second solver: it cross-checks the probe in the tests and, for `--solver cp-sat`,
re-solves the chosen candidate and reports CP-SAT's own lower bound and gap. Layer k goes to
stage stage_of[k], which starts at 0, ends at S - 1 and steps by 0 or 1 (contiguous, none empty).
With x[k][s] = (stage_of[k] == s) and first[k][s] = "k opens stage s", every term of the memory
model is linear:

    stashed_s >= a * sum_k boundary[k] first[k][s] + b * (sum_k saved[k] x[k][s]
                                                          - sum_k shared[k] (x[k][s] - first[k][s]))
    live_s    >= transient[k] x[k][s]            for every k

Times are scaled to integers (nanoseconds) and speeds to thousandths, so the optimum is exact for
the scaled costs; the reported bottleneck is recomputed in floating point from the split.
Imported only when CP-SAT runs: ortools is a heavy import.
"""

from __future__ import annotations

import numpy as np

from .memory import MemoryModel
from .partition import Partition, StageSpec, stage_costs

TIME_SCALE = 1e6  # ms -> ns
SPEED_SCALE = 1000


def solve_partition_cpsat(
    times: np.ndarray,
    memory: MemoryModel,
    stages: list[StageSpec],
    *,
    time_limit_s: float = 20.0,
    workers: int = 1,
) -> Partition | None:
    from ortools.sat.python import cp_model

    L, S = len(times), len(stages)
    if not 1 <= S <= L:
        raise ValueError(f"cannot split {L} layers into {S} non-empty stages")
    c = memory.chain
    t = [int(round(float(v) * TIME_SCALE)) for v in times]
    speed = [max(1, int(round(st.speed * SPEED_SCALE))) for st in stages]
    m = cp_model.CpModel()
    stage_of = [m.new_int_var(0, S - 1, f"stage_of{k}") for k in range(L)]
    m.add(stage_of[0] == 0)
    m.add(stage_of[L - 1] == S - 1)
    step = [m.new_bool_var(f"step{k}") for k in range(L - 1)]  # layer k + 1 opens a new stage
    for k in range(L - 1):
        m.add(stage_of[k + 1] == stage_of[k] + step[k])
    x = [[m.new_bool_var(f"x{k}_{s}") for s in range(S)] for k in range(L)]
    first = [[m.new_bool_var(f"first{k}_{s}") for s in range(S)] for k in range(L)]
    for k in range(L):
        m.add_exactly_one(x[k])
        m.add(sum(s * x[k][s] for s in range(S)) == stage_of[k])
        for s in range(S):
            if k == 0:
                m.add(first[0][s] == x[0][s])
            else:  # first = x AND step[k-1]
                m.add_implication(first[k][s], x[k][s])
                m.add_implication(first[k][s], step[k - 1])
                m.add_bool_or([first[k][s], x[k][s].Not(), step[k - 1].Not()])
    horizon = sum(t) * SPEED_SCALE
    bottleneck = m.new_int_var(0, horizon, "bottleneck")  # ns
    for s, spec in enumerate(stages):
        busy = sum(t[k] * x[k][s] for k in range(L))
        m.add(busy * SPEED_SCALE <= bottleneck * speed[s])
        shape = spec.shape
        weights = sum(
            int((2 + shape.optimizer_slots) * c.params[k] + c.buffers[k]) * x[k][s]
            for k in range(L)
        )
        saved = sum(int(c.saved[k]) * x[k][s] for k in range(L)) - sum(
            int(c.shared[k]) * (x[k][s] - first[k][s]) for k in range(1, L)
        )
        entering = sum(int(c.boundary[k]) * first[k][s] for k in range(L))
        cap = int(spec.budget)
        stashed = m.new_int_var(0, max(cap, 0), f"stashed{s}")
        for a, b in shape.stash:
            m.add(a * entering + b * saved <= stashed)
        live = m.new_int_var(0, max(cap, 0), f"live{s}")
        for k in range(L):
            if c.transient[k]:
                m.add(int(c.transient[k]) * x[k][s] <= live)
        m.add(weights + stashed + live + shape.reserved <= cap)
    m.minimize(bottleneck)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            return None
        raise RuntimeError(
            f"CP-SAT found no split within {time_limit_s:g} s ({solver.status_name(status)})"
        )
    owner = [solver.value(v) for v in stage_of]
    bounds = [0] + [k for k in range(1, L) if owner[k] != owner[k - 1]] + [L]
    costs = stage_costs(np.asarray(times, dtype=np.float64), bounds, [st.speed for st in stages])
    bound = solver.best_objective_bound / TIME_SCALE
    found = solver.objective_value / TIME_SCALE
    return Partition(
        bounds=bounds,
        bottleneck=max(costs),
        extra={
            "optimal": float(status == cp_model.OPTIMAL),
            "lower_bound_ms": bound,
            "gap": (found - bound) / found if found > 0 else 0.0,
        },
    )
