"""plan_pipeline: search micro-batch counts, schedules and recomputation; solve the partition
exactly for each; score it with the schedule simulator; keep the fastest that fits every device.

For interleaved-1f1b each device holds v = 2 stages (looped: stage s on device s mod K). The
partition then gives each stage half its device's memory, which is sufficient but not necessary:
such plans are marked not proven optimal. The link from the last device back to the first,
which looping needs, is taken to be as slow as the slowest link.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from profiler.artifact import InputError
from profiler.types import Profile
from schedules import SCHEDULE_NAMES, Costs, Schedule, Timeline, build_schedule, simulate
from schedules.stash import stash_pairs

from .cluster import Cluster
from .costs import OPTIMIZER_SLOTS, Chain, chain_at
from .dp import solve_partition_dp
from .memory import RECOMPUTE_MODES, MemoryModel, StageShape
from .partition import Partition, StageSpec, feasible_split, solve_partition
from .plan import DeviceUse, MemoryBreakdown, Plan, PlanMeta, Prediction, SolverInfo, StagePlan
from .units import format_size

SOLVERS = ("auto", "probe", "dp", "cp-sat")
INTERLEAVE = 2  # stages per device for interleaved-1f1b


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

    @property
    def per_device(self) -> int:
        return INTERLEAVE if self.schedule == "interleaved-1f1b" else 1


def microbatch_candidates(batch_size: int, num_devices: int) -> list[int]:
    """Every M up to 4K (where the bubble matters most), then powers of two, all <= N."""
    small = set(range(1, min(batch_size, 4 * num_devices, 64) + 1))
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
    ms = _choices(microbatches, microbatch_candidates(batch_size, K), "--microbatches")
    if any(m > batch_size or m < 1 for m in ms):
        raise InputError(
            f"--microbatches {microbatches}: must be between 1 and the batch size {batch_size}"
        )
    schedules = _choices(schedule, list(SCHEDULE_NAMES), "--schedule")
    modes = _choices(recompute, list(RECOMPUTE_MODES), "--checkpoint")
    candidates = [
        c
        for c in (_Candidate(m, s, r) for m in ms for s in schedules for r in modes)
        if _possible(c, K, L)
    ]
    if not candidates:
        raise InputError(
            f"--schedule interleaved-1f1b needs {INTERLEAVE * K} layers or more and a micro-batch "
            f"count that is at most {K} or a multiple of {K}"
        )
    solve, method = (
        (solve_partition_dp, "dp") if solver == "dp" else (solve_partition, "probe-bisection")
    )

    best: Plan | None = None
    best_cand: _Candidate | None = None
    chains: dict[int, tuple[Chain, MemoryModel]] = {}
    for cand in candidates:
        chain, memory = _chain(profile, batch_size, cand, chains)
        specs = _stage_specs(cluster, cand, optimizer)
        part = solve(_balance_times(chain, cand.recompute), memory, specs)
        if part is None:
            continue
        if (
            best is not None
            and _lower_bound(chain, cand, specs, part) >= best.predicted.iteration_ms
        ):
            continue  # cannot beat the best so far: skip the simulation
        plan = _build_plan(
            profile, cluster, batch_size, cand, optimizer, chain, memory, specs, part, method
        )
        if plan.fits and (
            best is None or plan.predicted.iteration_ms < best.predicted.iteration_ms * (1 - 1e-12)
        ):
            best, best_cand = plan, cand
    if best is None or best_cand is None:
        raise _infeasible(profile, cluster, batch_size, candidates, optimizer, chains)
    if solver == "cp-sat":
        # The search ran on the probe; CP-SAT re-solves the chosen candidate on its own and
        # reports its own bound, an independent check of the split.
        from .cpsat import solve_partition_cpsat

        chain, memory = _chain(profile, batch_size, best_cand, chains)
        specs = _stage_specs(cluster, best_cand, optimizer)
        part = solve_partition_cpsat(_balance_times(chain, best_cand.recompute), memory, specs)
        assert part is not None, "CP-SAT found infeasible what the probe solved"
        best = _build_plan(
            profile, cluster, batch_size, best_cand, optimizer, chain, memory, specs, part, "cp-sat"
        )
    best.solver = best.solver.model_copy(update={"candidates": len(candidates)})
    best.meta = best.meta.model_copy(update={"solve_ms": (time.perf_counter() - started) * 1e3})
    return best


def _choices(value: int | str, allowed: list, flag: str) -> list:
    if value == "auto":
        return allowed
    if isinstance(allowed[0], int):
        try:
            return [int(value)]
        except (TypeError, ValueError):
            raise InputError(f"{flag} {value!r}: expected auto or a whole number") from None
    if value not in allowed:
        raise InputError(f"{flag} {value!r}: choose auto or one of {', '.join(allowed)}")
    return [value]


def _possible(c: _Candidate, K: int, L: int) -> bool:
    if c.schedule != "interleaved-1f1b":
        return True
    return K * INTERLEAVE <= L and (c.microbatches <= K or c.microbatches % K == 0)


def _chain(
    profile: Profile, batch_size: int, cand: _Candidate, cache: dict
) -> tuple[Chain, MemoryModel]:
    mb = -(-batch_size // cand.microbatches)
    if mb not in cache:
        chain = chain_at(profile, mb)
        cache[mb] = (chain, MemoryModel(chain))
    return cache[mb]


@lru_cache(maxsize=512)
def plan_schedule(name: str, num_devices: int, microbatches: int) -> Schedule:
    """The schedule a plan runs: `name` over num_devices x v stages."""
    v = INTERLEAVE if name == "interleaved-1f1b" else 1
    return build_schedule(name, num_devices * v, microbatches, stages_per_rank=v)


@lru_cache(maxsize=2048)
def _pairs(name: str, num_devices: int, microbatches: int, recompute: str) -> list:
    return stash_pairs(plan_schedule(name, num_devices, microbatches), recompute)


def _balance_times(chain: Chain, recompute: str) -> np.ndarray:
    """What the partition balances: one micro-batch's forward + backward (+ recompute) per layer."""
    per_layer = chain.forward + chain.backward
    return per_layer + chain.forward if recompute != "never" else per_layer


def _stage_specs(
    cluster: Cluster, cand: _Candidate, optimizer: str, budget: int | None = None
) -> list[StageSpec]:
    """One spec per stage; `budget` replaces every device's memory (the infeasibility search)."""
    K, v = cluster.size, cand.per_device
    pairs = _pairs(cand.schedule, K, cand.microbatches, cand.recompute)
    specs = []
    for s in range(K * v):
        d = cluster.devices[s % K]
        specs.append(
            StageSpec(
                speed=d.speed,
                budget=(d.memory_bytes if budget is None else budget) // v,
                shape=StageShape(
                    stash=pairs[s],
                    optimizer_slots=OPTIMIZER_SLOTS[optimizer],
                    reserved=d.reserved_bytes // v,
                ),
            )
        )
    return specs


def _lower_bound(chain: Chain, cand: _Candidate, specs: list[StageSpec], part: Partition) -> float:
    """No schedule beats the busiest device's work, nor one micro-batch's trip there and back."""
    K = len(specs) // cand.per_device
    busy = [0.0] * K
    trip = 0.0
    for s, (i, j) in enumerate(part.stages):
        f = float(chain.forward[i:j].sum()) / specs[s].speed
        b = float(chain.backward[i:j].sum()) / specs[s].speed
        r = f if cand.recompute != "never" else 0.0
        busy[s % K] += cand.microbatches * (f + b) + (cand.microbatches - 1) * r
        trip += f + b
    return max(max(busy), trip)


def _link_ms(cluster: Cluster, rank: int, nxt: int, nbytes: int) -> float:
    if rank == nxt:
        return 0.0
    if nxt == rank + 1:
        return cluster.links[rank].transfer_ms(nbytes)
    # The loop back from the last device to the first: assume the slowest link.
    return max(link.transfer_ms(nbytes) for link in cluster.links)


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
    K, v = cluster.size, cand.per_device
    S = K * v
    stages = []
    for s, ((i, j), spec) in enumerate(zip(part.stages, specs)):
        rank = s % K
        f = float(chain.forward[i:j].sum()) / spec.speed
        b = float(chain.backward[i:j].sum()) / spec.speed
        i_ms = float(chain.input_grad[i:j].sum()) / spec.speed
        w_ms = float(chain.weight_grad[i:j].sum()) / spec.speed
        send_bytes = int(chain.boundary[j]) if s < S - 1 else 0
        send = _link_ms(cluster, rank, (s + 1) % K, send_bytes) if s < S - 1 else 0.0
        terms = {k: int(x[0]) for k, x in memory.terms(i, j, spec.shape).items()}
        saved = int(memory.terms(i, j, StageShape(((0, 1),), 0))["stashed_activations"][0])
        stages.append(
            StagePlan(
                index=s,
                rank=rank,
                device=cluster.devices[rank].name,
                layers=(i, j),
                layer_types=[profile.layers[k].type for k in range(i, j)],
                recompute=cand.recompute,  # type: ignore[arg-type]
                inflight=spec.shape.inflight,
                stash_pairs=list(spec.shape.stash),
                forward_ms=f,
                backward_ms=b,
                input_grad_ms=i_ms,
                weight_grad_ms=w_ms,
                recompute_ms=f if cand.recompute != "never" else 0.0,
                send_bytes=send_bytes,
                send_ms=send,
                stash_bytes=saved,
                input_bytes=int(chain.boundary[i]),
                memory=MemoryBreakdown(**terms, total=sum(terms.values()), budget=spec.budget),
            )
        )
    devices = [
        DeviceUse(
            name=d.name,
            stages=[st.index for st in stages if st.rank == k],
            total=sum(st.memory.total for st in stages if st.rank == k),
            budget=d.memory_bytes,
        )
        for k, d in enumerate(cluster.devices)
    ]
    timeline = simulate_stages(cand.schedule, K, cand.microbatches, stages)
    total_ms = timeline.makespan
    return Plan(
        model=profile.model,
        model_digest=profile.model_digest,
        profile_digest=profile.digest(),
        cluster_digest=cluster.digest(),
        device_type=profile.device,
        dtype=profile.dtype,
        input_shape=profile.input_shape,
        input_dtype=profile.input_dtype,
        num_layers=len(profile.layers),
        cluster=cluster,
        batch_size=batch_size,
        microbatches=cand.microbatches,
        microbatch_size=chain.mb,
        schedule=cand.schedule,  # type: ignore[arg-type]
        stages_per_device=v,
        recompute=cand.recompute,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        stages=stages,
        devices=devices,
        predicted=Prediction(
            iteration_ms=total_ms,
            bubble_fraction=timeline.bubble_fraction,
            throughput_samples_per_s=batch_size / total_ms * 1e3 if total_ms > 0 else math.inf,
            bottleneck_ms=part.bottleneck,
            peak_memory=timeline.peak_memory,
        ),
        solver=SolverInfo(
            method=method,
            # Interleaved plans halve each stage's budget: the split is optimal for that, not
            # proven optimal for the device.
            optimal=v == 1 and part.extra.get("optimal", 1.0) == 1.0,
            lower_bound_ms=part.extra.get("lower_bound_ms", part.bottleneck) if v == 1 else 0.0,
            gap=part.extra.get("gap", 0.0) if v == 1 else 1.0,
            candidates=1,
        ),
        meta=PlanMeta(
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            tool_version=_version(),
        ),
    )


def simulate_stages(
    schedule: str, num_devices: int, microbatches: int, stages: list[StagePlan]
) -> Timeline:
    """Run the plan's schedule through the simulator with the plan's own stage costs."""
    sched = plan_schedule(schedule, num_devices, microbatches)
    m = [st.memory for st in stages]
    costs = Costs(
        forward=[st.forward_ms for st in stages],
        backward=[st.backward_ms for st in stages],
        input_grad=[st.input_grad_ms for st in stages],
        weight_grad=[st.weight_grad_ms for st in stages],
        recompute=[st.recompute for st in stages],
        transfer=[st.send_ms for st in stages[:-1]],
        activation_bytes=[st.stash_bytes for st in stages],
        input_bytes=[st.input_bytes for st in stages],
        static_bytes=[
            x.params + x.grads + x.optimizer + x.live_activations + x.workspace for x in m
        ],
    )
    return simulate(sched, costs)


def _infeasible(
    profile: Profile,
    cluster: Cluster,
    batch_size: int,
    candidates: list[_Candidate],
    optimizer: str,
    chains: dict[int, tuple[Chain, MemoryModel]],
) -> InfeasibleError:
    """Find the least memory per device that any candidate split needs (a min-max partition on
    memory, by bisection on a uniform budget), and say how far each device falls short."""
    need: int | None = None
    closest: Plan | None = None
    for cand in candidates:
        chain, memory = _chain(profile, batch_size, cand, chains)
        times = _balance_times(chain, cand.recompute)

        def fits(
            budget: int,
            cand: _Candidate = cand,
            times: np.ndarray = times,
            memory: MemoryModel = memory,
        ) -> bool:
            return feasible_split(times, memory, _stage_specs(cluster, cand, optimizer, budget))

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
            part = solve_partition(times, memory, _stage_specs(cluster, cand, optimizer, hi))
            assert part is not None
            closest = _build_plan(
                profile, cluster, batch_size, cand, optimizer, chain, memory,
                _stage_specs(cluster, cand, optimizer), part, "probe-bisection",
            )  # fmt: skip
    assert need is not None and closest is not None
    worst = max(closest.devices, key=lambda d: d.total - d.budget)
    return InfeasibleError(
        f"no split fits: the best one (M={closest.microbatches}, {closest.schedule}, "
        f"recompute {closest.recompute}) needs {format_size(need)} per device; {worst.name} "
        f"would need {format_size(worst.total)} of {format_size(worst.budget)} "
        f"(over by {format_size(worst.total - worst.budget)})",
        need,
        closest,
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gpipe-plan")
    except Exception:
        return "unknown"
