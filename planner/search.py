"""plan_pipeline: search micro-batch counts, schedules and recomputation; solve the partition
exactly for each; keep the lowest predicted iteration time that fits every device."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from profiler.artifact import InputError
from profiler.types import Profile

from .cluster import Cluster
from .costs import OPTIMIZER_SLOTS, Chain, chain_at
from .dp import solve_partition_dp
from .memory import RECOMPUTE_MODES, MemoryModel, StageShape
from .partition import Partition, StageSpec, feasible_split, solve_partition
from .pipeline import SCHEDULES, StageTimes, bubble_fraction, inflight, iteration_ms
from .plan import MemoryBreakdown, Plan, PlanMeta, Prediction, SolverInfo, StagePlan

SOLVERS = ("auto", "probe", "dp")


class InfeasibleError(Exception):
    """No split fits the memory budgets. `needed_bytes`: the smallest memory per device that
    some split (with some micro-batch count, schedule and recomputation tried) would need."""

    def __init__(self, message: str, needed_bytes: int, closest: Plan | None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.closest = closest


@dataclass(frozen=True)
class _Candidate:
    microbatches: int
    schedule: str
    recompute: str


def microbatch_candidates(batch_size: int, num_stages: int) -> list[int]:
    """Every M up to 4K (where the bubble matters most), then powers of two, all <= N."""
    small = set(range(1, min(batch_size, 4 * num_stages, 64) + 1))
    powers = {2**k for k in range(int(math.log2(batch_size)) + 1)}
    return sorted(m for m in small | powers | {batch_size} if m <= batch_size)


def plan_pipeline(
    profile: Profile,
    cluster: Cluster,
    batch_size: int,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    recompute: str = "auto",
    optimizer: str = "adam",
    solver: str = "auto",
) -> Plan:
    """The fastest predicted plan for `profile` on `cluster` that fits every device's memory.

    Raises InputError for bad arguments and InfeasibleError when no split fits."""
    started = time.perf_counter()
    K, L = cluster.size, len(profile.layers)
    if batch_size < 1:
        raise InputError(f"--batch-size {batch_size}: must be at least 1")
    if K > L:
        raise InputError(
            f"{K} devices but the model has only {L} layers: every stage needs at least one layer; "
            f"use --devices {L} or fewer"
        )
    if optimizer not in OPTIMIZER_SLOTS:
        raise InputError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_SLOTS)}")
    if solver not in SOLVERS:
        raise InputError(f"--solver {solver!r}: choose one of {', '.join(SOLVERS)}")
    ms = _choices(microbatches, "auto", microbatch_candidates(batch_size, K), "--microbatches")
    if any(m > batch_size or m < 1 for m in ms):
        raise InputError(
            f"--microbatches {microbatches}: must be between 1 and the batch size {batch_size}"
        )
    schedules = _choices(schedule, "auto", list(SCHEDULES), "--schedule")
    modes = _choices(recompute, "auto", list(RECOMPUTE_MODES), "--checkpoint")
    candidates = [_Candidate(m, s, r) for m in ms for s in schedules for r in modes]
    solve, method = (
        (solve_partition_dp, "dp") if solver == "dp" else (solve_partition, "probe-bisection")
    )

    best: tuple[float, Plan] | None = None
    chains: dict[int, tuple[Chain, MemoryModel]] = {}
    for cand in candidates:
        mb = -(-batch_size // cand.microbatches)
        if mb not in chains:
            chain = chain_at(profile, mb)
            chains[mb] = (chain, MemoryModel(chain))
        chain, memory = chains[mb]
        specs = _stage_specs(cluster, cand, optimizer)
        part = solve(_stage_times(chain, cand.recompute), memory, specs)
        if part is None:
            continue
        plan = _build_plan(
            profile, cluster, batch_size, cand, optimizer, chain, memory, specs, part, method
        )
        key = plan.predicted.iteration_ms
        if best is None or key < best[0] * (1 - 1e-12):
            best = (key, plan)
    if best is None:
        raise _infeasible(profile, cluster, batch_size, candidates, optimizer, chains)
    plan = best[1]
    wall = (time.perf_counter() - started) * 1e3
    plan.solver = plan.solver.model_copy(update={"candidates": len(candidates)})
    plan.meta = plan.meta.model_copy(update={"solve_ms": wall})
    return plan


def _choices(value: int | str, auto: str, allowed: list, flag: str) -> list:
    if value == auto:
        return allowed
    if isinstance(allowed[0], int):
        try:
            return [int(value)]
        except (TypeError, ValueError):
            raise InputError(f"{flag} {value!r}: expected auto or a whole number") from None
    if value not in allowed:
        raise InputError(f"{flag} {value!r}: choose auto or one of {', '.join(allowed)}")
    return [value]


def _stage_times(chain: Chain, recompute: str) -> np.ndarray:
    """What the partition balances: one micro-batch's forward + backward (+ recompute) per layer."""
    per_layer = chain.forward + chain.backward
    return per_layer + chain.forward if recompute != "never" else per_layer


def _stage_specs(cluster: Cluster, cand: _Candidate, optimizer: str) -> list[StageSpec]:
    K = cluster.size
    return [
        StageSpec(
            speed=d.speed,
            budget=d.memory_bytes,
            shape=StageShape(
                inflight=inflight(cand.schedule, K, cand.microbatches, s),
                microbatches=cand.microbatches,
                recompute=cand.recompute,
                optimizer_slots=OPTIMIZER_SLOTS[optimizer],
                reserved=d.reserved_bytes,
            ),
        )
        for s, d in enumerate(cluster.devices)
    ]


def _build_plan(
    profile: Profile,
    cluster: Cluster,
    batch_size: int,
    cand: _Candidate,
    optimizer: str,
    chain: Chain,
    memory: MemoryModel,
    specs: list[StageSpec],
    part: Partition,
    method: str,
) -> Plan:
    K = cluster.size
    stages, times = [], []
    for s, ((i, j), spec, device) in enumerate(zip(part.stages, specs, cluster.devices)):
        f = float(chain.forward[i:j].sum()) / spec.speed
        b = float(chain.backward[i:j].sum()) / spec.speed
        r = f if cand.recompute != "never" else 0.0
        send_bytes = int(chain.boundary[j]) if s < K - 1 else 0
        send = cluster.links[s].transfer_ms(send_bytes) if s < K - 1 else 0.0
        terms = {k: int(v[0]) for k, v in memory.terms(i, j, spec.shape).items()}
        times.append(StageTimes(forward=f, backward=b, recompute=r, send=send))
        stages.append(
            StagePlan(
                index=s,
                device=device.name,
                layers=(i, j),
                layer_types=[profile.layers[k].type for k in range(i, j)],
                recompute=cand.recompute,
                inflight=spec.shape.inflight,
                forward_ms=f,
                backward_ms=b,
                recompute_ms=r,
                send_bytes=send_bytes,
                send_ms=send,
                memory=MemoryBreakdown(**terms, total=sum(terms.values()), budget=spec.budget),
            )
        )
    total_ms = iteration_ms(times, cand.microbatches, cand.recompute)
    return Plan(
        model=profile.model,
        model_digest=profile.model_digest,
        profile_digest=profile.digest(),
        cluster_digest=cluster.digest(),
        device_type=profile.device,
        dtype=profile.dtype,
        cluster=cluster,
        batch_size=batch_size,
        microbatches=cand.microbatches,
        microbatch_size=chain.mb,
        schedule=cand.schedule,  # type: ignore[arg-type]
        recompute=cand.recompute,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        stages=stages,
        predicted=Prediction(
            iteration_ms=total_ms,
            bubble_fraction=bubble_fraction(times, cand.microbatches, cand.recompute),
            throughput_samples_per_s=batch_size / total_ms * 1e3 if total_ms > 0 else math.inf,
            bottleneck_ms=part.bottleneck,
        ),
        solver=SolverInfo(
            method=method,
            optimal=True,
            lower_bound_ms=part.bottleneck,
            gap=0.0,
            candidates=1,
        ),
        meta=PlanMeta(
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            tool_version=_version(),
        ),
    )


def _infeasible(
    profile: Profile,
    cluster: Cluster,
    batch_size: int,
    candidates: Iterable[_Candidate],
    optimizer: str,
    chains: dict[int, tuple[Chain, MemoryModel]],
) -> InfeasibleError:
    """Find the least memory per device that any candidate split needs (a min-max partition on
    memory, by bisection on a uniform budget), and say how far each device falls short."""
    need: int | None = None
    closest: Plan | None = None
    for cand in candidates:
        chain, memory = chains[-(-batch_size // cand.microbatches)]
        specs = _stage_specs(cluster, cand, optimizer)
        times = _stage_times(chain, cand.recompute)

        def fits(budget: int) -> bool:
            return feasible_split(times, memory, _uniform(specs, budget))  # noqa: B023

        hi = need if need is not None else 1
        if need is None:
            while not fits(hi):
                hi *= 2
        elif not fits(hi):
            continue
        lo = 0  # nothing fits in 0 bytes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        if need is None or hi < need:
            need = hi
            part = solve_partition(times, memory, _uniform(specs, hi))
            assert part is not None
            plan = _build_plan(
                profile,
                cluster,
                batch_size,
                cand,
                optimizer,
                chain,
                memory,
                specs,
                part,
                "probe-bisection",
            )
            closest = plan.model_copy(
                update={"stages": [_with_budget(st, cluster) for st in plan.stages]}
            )
    assert need is not None and closest is not None  # one stage with everything always fits in "hi"
    worst = max(closest.stages, key=lambda st: st.memory.total - st.memory.budget)
    from .units import format_size

    return InfeasibleError(
        f"no split fits: the best one (M={closest.microbatches}, {closest.schedule}, "
        f"recompute {closest.recompute}) needs {format_size(need)} per device; stage "
        f"{worst.index} on {worst.device} needs {format_size(worst.memory.total)} of "
        f"{format_size(worst.memory.budget)} (over by {format_size(worst.memory.over_by)})",
        need,
        closest,
    )


def _with_budget(stage: StagePlan, cluster: Cluster) -> StagePlan:
    budget = cluster.devices[stage.index].memory_bytes
    return stage.model_copy(update={"memory": stage.memory.model_copy(update={"budget": budget})})


def _uniform(specs: list[StageSpec], budget: int) -> list[StageSpec]:
    return [StageSpec(s.speed, budget, s.shape) for s in specs]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gpipe-plan")
    except Exception:
        return "unknown"
