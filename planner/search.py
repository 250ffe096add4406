"""plan_pipeline: search micro-batch counts, schedules and recomputation; solve the partition
exactly for each; score it with the schedule simulator; keep the fastest that fits every device.

One cost model serves the partition, the lower bounds and the simulator. A stage's work per
micro-batch is its forward, its backward (I + W for zero bubble, as the simulator charges them)
and its recomputation averaged over the micro-batches (M - 1 of M recompute under except_last);
each link carries one transfer per micro-batch and direction. The partition minimises the
busiest of those resources exactly, and the simulator runs the same numbers.

For interleaved-1f1b each device holds v = 2 stages (looped: stage s on device s mod K). The
partition first lets each stage use its whole device (necessary, since a device holds at least
either stage), and the plan then counts each device's two stages together along the issue
order. When that split fits, it is the optimum; when it overruns a device, the partition is
solved again with each stage given half its device (sufficient), and with every stage
recomputing alike (checked the same way): the fastest that fits is marked not proven, with the
first split's bottleneck as its lower bound. The link from the last device
back to the first, which looping needs, is taken to be as slow as the slowest link.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from profiler.limits import (
    INT64_SAFE,
    MAX_BATCH,
    MAX_BYTES,
    MAX_MICROBATCHES,
    ArgumentError,
    choice,
    real,
    whole,
)
from profiler.types import PER_SIZE, Profile, RuntimeOverhead
from schedules import (
    SCHEDULE_NAMES,
    Costs,
    Kind,
    Schedule,
    Timeline,
    build_schedule,
    insert_comms,
    simulate,
)
from schedules.comm import fastest_lowering_of, lowering_of, preposted, receive_offsets
from schedules.memory import (
    STATES,
    TRANSIENTS,
    StageBytes,
    occupancy,
    occupancy_bound,
    occupancy_floor,
    peaks,
)
from schedules.order import freeze
from schedules.simulate import message_sizes

from .bounds import (
    interleaved_bound_of,
    interleaved_runs_bound,
    least_bottleneck,
    prior_bound_of,
    work_shares,
    work_summary,
)
from .cluster import Cluster
from .costs import OPTIMIZER_SLOTS, Chain, ProfileTable, chain_at, checkpoint_gain, checkpointed
from .dp import solve_partition_dp
from .memory import CPU_RNG_STATE, RECOMPUTE_MODES, MemoryModel, StageShape
from .partition import (
    NoneWithin,
    Partition,
    StageSpec,
    feasible_split,
    fitting_split,
    solve_partition,
)
from .plan import (
    Alternative,
    DeviceUse,
    MemoryBreakdown,
    Plan,
    PlanMeta,
    Prediction,
    SolverInfo,
    StagePlan,
    StateBytes,
)
from .routing import Flow, carried
from .routing import routes as route_pairs
from .units import format_size
from .version import VERSION

SOLVERS = ("auto", "probe", "dp", "cp-sat")
TARGETS = ("streams", "torchrun")
INTERLEAVE = 2  # stages per device for interleaved-1f1b


class InfeasibleError(Exception):
    """No split fits the memory budgets. `needed_bytes`: the smallest memory per device that
    some split (with some micro-batch count, schedule and recomputation tried) would need; on
    devices of mixed memory, what each device with less would need, the others unchanged."""

    def __init__(self, message: str, needed_bytes: int, closest: Plan | None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.closest = closest


@dataclass(frozen=True)
class Candidate:
    """One combination the search tries."""

    microbatches: int
    schedule: str
    recompute: str

    @property
    def per_device(self) -> int:
        return INTERLEAVE if self.schedule == "interleaved-1f1b" else 1

    @property
    def modes(self) -> tuple[str, ...]:
        """The recomputation each stage may choose: every mode per stage, or the one mode."""
        return RECOMPUTE_MODES if self.recompute == PER_STAGE else (self.recompute,)


PER_STAGE = "per_stage"  # each stage its own recomputation
SEARCH_MODES = (*RECOMPUTE_MODES, PER_STAGE)


def recomputed_share(mode: str, microbatches: int) -> float:
    """The share of micro-batches whose backward re-runs the forward under `mode`."""
    M = microbatches
    return {"never": 0.0, "always": 1.0, "except_last": (M - 1) / M}[mode]


@dataclass
class _Problem:
    """What every candidate of one plan_pipeline call shares."""

    profile: Profile
    cluster: Cluster
    batch_size: int
    optimizer: str
    digests: tuple[str, str] = ("", "")  # of the profile and the cluster: computed once
    target: str = "streams"  # the program whose time each plan predicts (Plan.target)
    checkpointed: tuple[int, ...] = ()  # layers each run under a checkpoint of its own
    table: ProfileTable = None  # type: ignore[assignment]  # (read from the profile unless given)
    chains: dict[int, Chain] = field(default_factory=dict)
    memories: dict[int, MemoryModel] = field(default_factory=dict)
    granular: dict[tuple[int, bool, int], list] = field(default_factory=dict)
    summaries: dict[tuple[int, bool, float], tuple[float, float]] = field(default_factory=dict)
    runs: dict[tuple, float] = field(default_factory=dict)  # interleaved_runs_bound's
    # _solve's shortcuts, per shortcut (and schedule and recompute): [successes, misses]
    records: dict[tuple, list[int]] = field(default_factory=dict)
    link_floors: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)
    # per candidate and occupancy kind (_stage_specs): each stage's memory shapes
    shapes: dict[tuple[Candidate, str], list[list[StageShape]]] = field(default_factory=dict)
    # interleaved splits solved (_solved_split): per (M, schedule, modes, halved), the split
    # and the limit it was solved under
    splits: dict[tuple, tuple[float, Partition | None]] = field(default_factory=dict)
    # one stage per device: per (M, schedule, recompute) of a single-mode candidate, its
    # split's bottleneck (a per-stage candidate's stages may each choose that mode: _hint)
    met: dict[tuple[int, str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.table is None:
            self.table = ProfileTable(self.profile)

    def costs(self, cand: Candidate) -> Chain:
        """The per-layer costs at the candidate's micro-batch size (read once per size)."""
        return self.chain_of(-(-self.batch_size // cand.microbatches))

    def chain_of(self, mb: int) -> Chain:
        """The per-layer costs at micro-batch size `mb` (read once per size)."""
        if mb not in self.chains:
            chain = checkpointed(chain_at(self.table, mb), self.checkpointed)
            if self.target == "torchrun" and chain.tied:  # each rank steps its own copy
                chain = dataclasses.replace(chain, copies_keep_state=True)
            step = self.profile.optimizer_step.get(self.optimizer)
            if (
                step is not None and not step.foreach and step.carry
                and step.carry <= 1e3 * step.per_byte  # (as the profile is read: types.py)
            ):  # fmt: skip
                # what the step of a tensor still holds while the next is stepped (Adam's
                # denominator: 1), relative to the step's own per byte (MemoryModel.step_size;
                # an optimizer whose step makes next to nothing of its own, an edited
                # profile's, is counted by its largest tensor as before: no ratio past 1e3)
                chain = dataclasses.replace(chain, step_carry=step.carry / step.per_byte)
            self.chains[mb] = chain
        return self.chains[mb]

    @cached_property
    def runtime_bytes(self) -> int:
        """What each device's runtime holds through the step beside the stages' tensors: the
        torchrun program keeps the caller's CPU RNG state there (to put it back), and on a
        CPU that is the device's memory. The streams program keeps one for the whole process,
        not a device's; on a GPU it is host memory."""
        on_cpu = self.profile.device.split(":")[0] == "cpu"
        return CPU_RNG_STATE if self.target == "torchrun" and on_cpu else 0

    @cached_property
    def chain_order(self) -> bool:
        """Whether no stage starts before the one ahead of it has handed it something, as the
        bounds' fill and drain terms and the exact split take it. Not so for the torchrun
        program of a captured graph with skips or a stage that reads nothing of the stage
        before: it runs such branches side by side (the default program keeps chain order)."""
        if self.target != "torchrun" or not self.profile.captured:
            return True
        flow = chain_at(self.table, self.profile.batch_sizes[0]).flow
        return flow is None or flow.chain_only()

    def chain(self, cand: Candidate) -> tuple[Chain, MemoryModel]:
        """The costs and the memory model built on them (once per size)."""
        chain = self.costs(cand)
        return chain, self.memory_of(chain.mb)

    def memory_of(self, mb: int) -> MemoryModel:
        if mb not in self.memories:
            self.memories[mb] = MemoryModel(self.chain_of(mb))
        return self.memories[mb]

    def measured_smaller(self, cand: Candidate) -> bool:
        """Whether the batch splits unevenly and the profile measured the smaller size (or
        below it): then the plan counts the smaller micro-batches at their own size, for
        either target (`larger`)."""
        smaller = self.batch_size // cand.microbatches
        return bool(self.batch_size % cand.microbatches) and smaller >= min(
            self.profile.batch_sizes
        )

    def larger(self, cand: Candidate) -> int:
        """How many micro-batches take one sample more than the rest (torch.tensor_split
        makes the first batch_size % M the larger), where the batch splits unevenly and the
        devices' peaks count each at its own size (the split is solved at the larger); 0
        where they count all at the larger: where the profile measured nothing at or below
        the smaller size (scaled down from a larger one, a layer's fixed part would shrink
        with it: found by a review, 0.5% low)."""
        if not self.measured_smaller(cand):
            return 0
        return self.batch_size % cand.microbatches


def microbatch_candidates(batch_size: int, num_devices: int) -> list[int]:
    """Every M up to 4K (where the bubble matters most), then powers of two, all <= N."""
    top = min(batch_size, MAX_MICROBATCHES)
    small = set(range(1, min(top, 4 * num_devices, 64) + 1))
    powers = {2**k for k in range(int(math.log2(top)) + 1)}
    return sorted(small | powers | {top})


CP_SAT_SECONDS = 20.0  # the most CP-SAT's re-solve of the chosen split may take


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
    time_limit_s: float | None = None,
    progress: bool | None = None,
    allow_reorder: bool = False,
    target: str = "streams",
    checkpoint: Sequence[int] | str = "auto",
    _beat: float | None = None,
    _shared: dict[str, Any] | None = None,
    _digest: str | None = None,
) -> Plan:
    """The fastest predicted plan for `profile` on `cluster` that fits every device's memory.
    `time_limit_s`: return the best plan found by then, marked not proven (the search goes on
    until one plan fits). `progress`: a bar on stderr (default: when it is a terminal).
    `allow_reorder`: the devices may run the stages in another order (Cluster.placements:
    every distinct order, hosts kept together when links are given by host); the plan's
    cluster lists them in the order chosen. `target`: the program whose time is minimised
    and predicted (Plan.target): the torchrun program's ranks wait for each other where sends
    meet their receives, which the exact split does not see (the plan says so when it costs).
    `checkpoint`: model layers each run under an activation checkpoint of their own (a
    sequential model; no other recomputation, and not zero bubble, whose W needs the graph
    I made): they keep only their input for backward, and recompute their forward there.
    "auto" (with recompute auto): where the best plan recomputes whole stages or none fits,
    also a few such sets, the layers that free the most bytes per millisecond of forward
    first (`_checkpoint_sets`), and the fastest plan of all wins.

    Raises ArgumentError (an InputError) for bad arguments and InfeasibleError when no split fits."""
    started = time.perf_counter()
    if time_limit_s is not None:  # (before any search reads it: found by a red team)
        time_limit_s = real(time_limit_s, "time_limit_s", 0, 86400)
    if isinstance(checkpoint, str):
        choice(checkpoint, "checkpoint", ("auto",))
        kw = dict(
            microbatches=microbatches, schedule=schedule, recompute=recompute,
            optimizer=optimizer, solver=solver, progress=progress, allow_reorder=allow_reorder,
            target=target, _digest=_digest,
        )  # fmt: skip
        return _sealed(_with_checkpoints(profile, cluster, batch_size, started, time_limit_s, kw))
    if allow_reorder and isinstance(cluster, Cluster) and cluster.size > 1:
        return _sealed(_reordered(
            profile, cluster, batch_size, started,
            microbatches=microbatches, schedule=schedule, recompute=recompute,
            optimizer=optimizer, solver=solver, time_limit_s=time_limit_s, progress=progress,
            target=target, checkpoint=checkpoint, _digest=_digest,
        ))  # fmt: skip
    if not isinstance(profile, Profile):
        raise ArgumentError("profile", type(profile).__name__, "expected a Profile")
    if not isinstance(cluster, Cluster):
        raise ArgumentError("cluster", type(cluster).__name__, "expected a Cluster")
    K, L = cluster.size, len(profile.layers)
    whole(batch_size, "batch_size", 1, MAX_BATCH)
    if K > L:
        raise ArgumentError(
            "cluster",
            f"{K} devices",
            f"the model has only {L} layers and every stage needs at least one; use {L} "
            "devices or fewer",
        )
    choice(optimizer, "optimizer", tuple(OPTIMIZER_SLOTS))
    choice(solver, "solver", SOLVERS)
    choice(target, "target", TARGETS)
    if time_limit_s is not None:
        real(time_limit_s, "time_limit_s", 0, 86400)
    if microbatches == "auto":
        ms = microbatch_candidates(batch_size, K)
    else:
        ms = [whole(microbatches, "microbatches", 1, min(batch_size, MAX_MICROBATCHES))]
    schedules = _choices(schedule, SCHEDULE_NAMES, "schedule")
    modes = _choices(recompute, SEARCH_MODES, "recompute")
    layers = _checkpoint_layers(checkpoint, profile, schedule, recompute)
    if layers:
        schedules = [x for x in schedules if x != "zb-h1"]
        modes = ["never"]
    candidates = [
        c
        for c in (Candidate(m, s, r) for m in ms for s in schedules for r in modes)
        if _possible(c, K, L)
    ]
    if not candidates:
        raise ArgumentError(
            "schedule",
            schedule,
            f"interleaved-1f1b needs {INTERLEAVE * K} layers or more and a micro-batch count "
            f"that is at most {K} or a multiple of {K}",
        )
    solve, method = (
        (solve_partition_dp, "dp") if solver == "dp" else (solve_partition, "probe-bisection")
    )
    if _shared is None:
        problem = _Problem(
            profile, cluster, batch_size, optimizer,
            (_digest or profile.digest(), cluster.digest()), target, layers,
        )  # fmt: skip
    else:  # one device order of several (_reordered): what the cluster does not change, once
        if not _shared:
            _shared["digest"] = _digest or profile.digest()
            _shared["problem"] = _Problem(profile, cluster, batch_size, optimizer, ("", ""),
                                          target, layers)  # fmt: skip
        # the per-layer costs and the memory tables read the profile alone (the devices'
        # budgets are the tables' keys), so every order reads the first one's
        first = _shared["problem"]
        problem = _Problem(
            profile, cluster, batch_size, optimizer, (_shared["digest"], cluster.digest()),
            target, layers, table=first.table, chains=first.chains, memories=first.memories,
        )  # fmt: skip
    _check_magnitude(problem.table, batch_size, max(c.microbatches for c in candidates))

    floor = _static_need(problem, candidates[0])
    if floor:  # the devices cannot hold even the weights: nothing to search
        best, best_cand, visited = None, None, _Visited()
        visited.outcomes.update((k, _Outcome("nofit", math.inf)) for k in range(len(candidates)))
    else:
        best, best_cand, visited = _search(
            problem, candidates, solve, method, time_limit_s, progress, _beat
        )
    outrun = _Outrun(len(candidates), visited.solved, visited.pruned, visited.timed_out)
    if _beat is not None and best is not None and not _beats(best, _beat):
        raise outrun  # (another order's plan is as fast: it wins the tie)
    if best is None or best_cand is None:
        if _beat is not None and not any(  # only the memory search may still find one
            candidates[k].per_device > 1 and o.kind in ("nofit", "over")
            for k, o in visited.outcomes.items()
        ):
            raise outrun
        deadline = None if time_limit_s is None else started + time_limit_s
        show = sys.stderr.isatty() if progress is None else progress
        err = _infeasible(problem, candidates, floor, deadline, show)
        if err.closest is None or not err.closest.fits:
            if _beat is not None:
                raise outrun
            if visited.ahead_over:  # (the memory search, like the split's, does not see them)
                mems = [d.memory_bytes for d in cluster.devices]
                need = err.needed_bytes
                why = visited.ahead_over
                if err.closest is None or not min(mems) < need < INT64_SAFE:
                    raise InfeasibleError(f"no split fits: {why}", INT64_SAFE, err.closest)
                # (a budget at which it plans, _planned_need; a smaller one may too, with a
                # slower split: whether a budget plans need not carry over to a larger one)
                where = "per device" if max(mems) < need else "on every device with less"
                raise InfeasibleError(
                    f"no split fits: {why}; it plans with {format_size(need, up=True)} "
                    f"({need} bytes) {where}",
                    need,
                    err.closest,
                )
            raise err
        if _beat is not None and not _beats(err.closest, _beat):
            raise outrun
        # The memory search found a split that fits, which the split search missed: an
        # interleaved one (that search is exact per stage, not per device), or one whose
        # program holds less than that search counts (a torchrun program, a captured graph's
        # real routes). Keep it, and say so.
        best = err.closest
        best_cand = Candidate(best.microbatches, best.schedule, best.recompute)
        found = "found by the search for the least memory per device"
        best.solver = best.solver.model_copy(
            update={
                "optimal": False,
                "unproven": f"interleaved: {found}"
                if best.stages_per_device > 1
                else f"{found}: the split search, which counts each stage as its issue order "
                "holds it, found none that fits"
                + ("" if visited.ahead_over else "; this plan's program holds less"),
            }
        )
    halved = "half its device" in best.solver.unproven
    if solver == "cp-sat" and profile.captured:
        best.solver = best.solver.model_copy(
            update={
                "method": "probe-bisection (CP-SAT models a chain; a captured graph's stages "
                "receive what they read)"
            }
        )
    elif solver == "cp-sat" and problem.chain(best_cand)[0].tied:
        best.solver = best.solver.model_copy(
            update={
                "method": "probe-bisection (CP-SAT models a chain whose layers add up; a "
                "tied parameter is held once by the stage using it twice)"
            }
        )
    elif solver == "cp-sat" and problem.chain(best_cand)[0].ctx_late is not None:
        best.solver = best.solver.model_copy(
            update={
                "method": "probe-bisection (CP-SAT models no tensors a custom "
                "autograd.Function keeps on its ctx, which its layers keep)"
            }
        )
    elif solver == "cp-sat" and (best_cand.recompute == PER_STAGE or halved):
        what = "one recomputation mode" if not halved else "splits checked stage by stage"
        best.solver = best.solver.model_copy(
            update={"method": f"probe-bisection (CP-SAT re-solves {what} only)"}
        )
    elif solver == "cp-sat":
        # The search ran on the probe; CP-SAT re-solves the chosen candidate on its own and
        # reports its own bound, an independent check of the split.
        from .cpsat import solve_partition_cpsat

        chain, memory = problem.chain(best_cand)
        specs = _stage_specs(problem, best_cand, halve=False)
        # (within what --time-limit leaves, CP_SAT_SECONDS at most)
        left = CP_SAT_SECONDS
        if time_limit_s is not None:
            left = min(left, time_limit_s - (time.perf_counter() - started))
        part, failed = None, "the time limit left it no time"
        if left > 0:
            try:
                part = solve_partition_cpsat(
                    _balance_times(chain, best_cand)[0],
                    memory,
                    specs,
                    cuts=_cut_costs(cluster, best_cand, chain),
                    time_limit_s=left,
                )
                failed = "" if part is not None else "it found infeasible what the probe solved"
            except RuntimeError as e:
                failed = str(e)
        rebuilt = _build_plan(problem, best_cand, specs, part, "cp-sat") if part else None
        faster = rebuilt is not None and (
            rebuilt.predicted.iteration_ms <= best.predicted.iteration_ms * (1 + 1e-12)
        )
        if rebuilt is not None and rebuilt.fits and faster:
            best = rebuilt
        elif (
            rebuilt is not None
            and rebuilt.fits
            and part is not None
            and (part.extra.get("optimal", 1.0) != 1.0)
        ):  # (stopped by its time limit: a split, not proven the best; the probe's is)
            best.solver = best.solver.model_copy(
                update={"method": "probe-bisection (CP-SAT stopped at its time limit before "
                        f"proving its split, {100 * part.extra.get('gap', 0.0):.3g}% from its "
                        "bound, which simulated no faster)"}
            )  # fmt: skip
        elif rebuilt is not None and rebuilt.fits:  # the same bottleneck, a slower schedule
            best.solver = best.solver.model_copy(
                update={"method": "probe-bisection (CP-SAT's split of the same bottleneck "
                        "simulated slower)"}
            )  # fmt: skip
        else:  # keep the probe's exact split, and say that CP-SAT did not confirm it
            if rebuilt is not None:
                failed = "its split overran a device's memory once both stages were counted"
            told = best.solver.unproven
            best.solver = best.solver.model_copy(
                update={
                    "unproven": f"CP-SAT could not re-solve the split: {failed}"
                    + (f"; {told}" if told else "")
                }
            )
    unproven = best.solver.unproven
    if visited.ahead_over:
        unproven = visited.ahead_over + (f"; {unproven}" if unproven else "")
    # (judged on the plan chosen: a memory-bound candidate whose own program would have held
    # less is not looked at)
    held_less = best._held_less and visited.memory_bound
    if held_less:
        unproven = f"{HELD_LESS}" + (f"; {unproven}" if unproven else "")
    if visited.timed_out:
        unproven = f"{TIMED_OUT} after {visited.solved} of {len(candidates)} candidates" + (
            f"; {unproven}" if unproven else ""
        )
    best.solver = best.solver.model_copy(
        update={
            "candidates": len(candidates),
            "solved": visited.solved,
            "pruned": visited.pruned,
            "optimal": best.solver.optimal
            and not (visited.timed_out or visited.ahead_over or held_less),
            "unproven": unproven,
        }
    )
    best.alternatives = _alternatives(problem, candidates, visited, best, best_cand)
    best._solve_ms = (time.perf_counter() - started) * 1e3
    return _sealed(best)


def _sealed(plan: Plan) -> Plan:
    """The plan with the digest of its content in `meta`, as a file of it carries: its
    `lowering` is then trusted only while the content is what it was made for (a copy with
    other stages or costs finds its own again: torchrun_schedule)."""
    plan.meta = plan.meta.model_copy(update={"content_digest": plan.digest()})
    return plan


def _with_checkpoints(
    profile: Profile,
    cluster: Cluster,
    batch_size: int,
    started: float,
    time_limit_s: float | None,
    kw: dict[str, Any],
) -> Plan:
    """plan_pipeline without checkpointed layers; then, where that plan recomputes a stage or
    no split fits (memory binds), again with each of `_checkpoint_sets`: the fastest wins
    (ties: fewer checkpoints). Not every set of layers is tried: a plan chosen so says so."""

    def left() -> float | None:
        return (
            None
            if time_limit_s is None
            else max(time_limit_s - (time.perf_counter() - started), 0.0)
        )

    error: InfeasibleError | None = None
    best: Plan | None = None
    if isinstance(profile, Profile) and kw.get("_digest") is None:
        # (each set of checkpointed layers plans the same profile: its digest once, 0.36 s of
        # a "no split fits" at 10 000 layers twice)
        kw = {**kw, "_digest": profile.digest()}
    try:
        best = plan_pipeline(profile, cluster, batch_size, checkpoint=(), time_limit_s=left(), **kw)
    except InfeasibleError as e:
        error = e
    base = best
    binds = best is None or any(st.recompute != "never" for st in best.stages)
    eligible = (
        isinstance(profile, Profile) and not profile.captured
        and kw["recompute"] == "auto" and kw["schedule"] != "zb-h1"
    )  # fmt: skip
    if not (binds and eligible):
        if best is None:
            assert error is not None
            raise error
        return best
    sets = _checkpoint_sets(profile)
    if base is None and sets:
        # Nothing fits without checkpoints: the set that frees the most goes first, and where
        # even it fits nowhere the others are not searched (each such search also looks for
        # the least memory that would do: as long as the whole search again).
        sets = [sets[-1], *sets[:-1]]
    chosen = False
    for k, layers in enumerate(sets):
        if best is not None and left() == 0.0:
            note = (
                f"the time limit left {len(sets) - k} of {len(sets)} sets of checkpointed "
                "layers untried"
            )
            told = best.solver.unproven
            best.solver = best.solver.model_copy(
                update={"unproven": f"{told}; {note}" if told else note, "optimal": False}
            )
            break
        try:
            plan = plan_pipeline(
                profile, cluster, batch_size, checkpoint=layers, time_limit_s=left(), **kw
            )
        except InfeasibleError as e:
            if error is None or e.needed_bytes < error.needed_bytes:
                error = e
            if base is None and k == 0:
                break
            continue
        if best is None or _faster(plan, best):
            best, chosen = plan, True
    if best is None:
        assert error is not None
        raise error
    if chosen:
        if base is not None:  # what a user overriding the choice would get
            ms = base.predicted.iteration_ms
            slower = (ms / best.predicted.iteration_ms - 1) * 100
            best.alternatives = [
                Alternative(
                    microbatches=base.microbatches,
                    schedule=base.schedule,
                    recompute=base.recompute,
                    iteration_ms=ms,
                    peak_bytes=max(base.predicted.peak_memory),
                    reason=f"no checkpointed layers: {slower:.2g}% slower",
                ),
                *best.alternatives,
            ]
        told = best.solver.unproven
        note = (
            f"checkpointed layers chosen among {len(sets)} sets (those freeing the most bytes "
            "per millisecond of forward first), not every set"
        )
        best.solver = best.solver.model_copy(
            update={"unproven": f"{told}; {note}" if told else note}
        )
    return best


def _checkpoint_sets(profile: Profile) -> list[tuple[int, ...]]:
    """Sets of layers to checkpoint, each the first n of the model's layers that free bytes
    alone (`checkpoint_gain`, at the largest profiled size), ranked by bytes freed per
    millisecond their forward takes again; n about an eighth, a quarter, half, three quarters
    and all of them, and 1. None where no layer frees anything (fine layers, each keeping its
    input where a neighbour kept the same bytes: a checkpoint of one such layer holds as much)."""
    chain = chain_at(profile, profile.batch_sizes[-1])
    gain = checkpoint_gain(chain)
    rate = gain / np.maximum(chain.forward[: len(gain)], 1e-6)
    ranked = [int(k) for k in np.argsort(-rate, kind="stable") if gain[k] > 0]
    n = len(ranked)
    sizes = sorted({1, *(max(round(n * f), 1) for f in (1 / 8, 1 / 4, 1 / 2, 3 / 4, 1))})
    return [tuple(sorted(ranked[:k])) for k in sizes if k <= n]


TIMED_OUT = "the time limit stopped the search"  # (how a plan's `unproven` says so)


class _Outrun(Exception):
    """A device order none of whose candidates beats the plan already found for another."""

    def __init__(self, candidates: int, solved: int, pruned: int, timed_out: bool) -> None:
        super().__init__("outrun")
        self.counts = (candidates, solved, pruned)
        self.timed_out = timed_out  # (then not every candidate of it was searched)


def _reordered(
    profile: Profile, cluster: Cluster, batch_size: int, started: float, **kw: Any
) -> Plan:
    """plan_pipeline once per device order; the fastest (ties: the earlier order) wins. Each
    order after the first plan is searched against that plan's time: its candidates whose bound
    cannot beat it are pruned, so an order that cannot win costs its bounds, not its search.
    `time_limit_s` holds for all the orders together, found or not."""
    orders, complete = cluster.placements()  # (not complete: past the most it lists)
    shared: dict[str, Any] = {}  # (plan_pipeline's: what every order reads alike)
    best: Plan | None = None
    error: InfeasibleError | None = None
    candidates = solved = pruned = 0
    limit = kw.pop("time_limit_s", None)
    tried = 0
    timed = False  # the time limit left an order unsearched, or one searched in part
    # (a bar over the orders, for a search that may take minutes, found by a red team: 140 s
    # on 8 devices of two hosts; each order's own search then shows none)
    progress = kw.get("progress")
    show = sys.stderr.isatty() if progress is None else bool(progress)
    inner = {**kw, "progress": False} if show else kw
    with _progress_bar(len(orders), show, "device orders") as tick:
        for order in orders:
            left = None if limit is None else limit - (time.perf_counter() - started)
            if left is not None and left <= 0 and tried:
                timed = True
                break
            tried += 1
            tick()
            try:
                plan = plan_pipeline(
                    profile,
                    cluster.reordered(order),
                    batch_size,
                    time_limit_s=None if left is None else max(left, 0.0),
                    _beat=None if best is None else best.predicted.iteration_ms,
                    _shared=shared,
                    **inner,
                )
            except _Outrun as e:
                candidates, solved, pruned = (
                    a + b for a, b in zip((candidates, solved, pruned), e.counts)
                )
                timed = timed or e.timed_out
                continue
            except InfeasibleError as e:
                if error is None or e.needed_bytes < error.needed_bytes:
                    error = e
                continue
            candidates += plan.solver.candidates
            solved += plan.solver.solved
            pruned += plan.solver.pruned
            timed = timed or TIMED_OUT in plan.solver.unproven
            if best is None or _faster(plan, best):
                best = plan
    if timed:
        note = f"the time limit cut the search of the device orders short ({tried} searched)"
    else:
        note = f"{tried} device orders tried, not all of them"
    if best is None:
        assert error is not None
        if timed or not complete:
            raise InfeasibleError(f"{error} ({note})", error.needed_bytes, error.closest)
        raise error
    unproven = best.solver.unproven
    if timed or not complete:
        unproven = note + (f"; {unproven}" if unproven else "")
        complete = False
    best.solver = best.solver.model_copy(
        update={
            "method": f"{best.solver.method}, {tried} device order" + ("s" if tried != 1 else ""),
            "candidates": candidates,
            "solved": solved,
            "pruned": pruned,
            "optimal": best.solver.optimal and complete,
            "unproven": unproven,
        }
    )
    best._solve_ms = (time.perf_counter() - started) * 1e3
    return best


@dataclass
class _Outcome:
    """What the search learnt of one candidate: `ms` is its predicted time ("plan", "over"), a
    lower bound on it ("bound": after its split; "limit": no split that fits is within the
    bottleneck that could beat the best plan so far; "pruned", "unsearched": before), or inf
    ("nofit": no split fits)."""

    kind: str
    ms: float
    peak: int | None = None
    detail: str = ""
    recompute: str = ""  # its plan's (a per-stage candidate's may read never)


@dataclass
class _Visited:
    solved: int = 0
    pruned: int = 0
    timed_out: bool = False
    # a split overran a device only by what the split search does not count: why (AHEAD_OVER,
    # UNEVEN_OVER), else ""
    ahead_over: str = ""
    # memory bound some solved candidate's split, or let none fit
    memory_bound: bool = False
    outcomes: dict[int, _Outcome] = field(default_factory=dict)
    later: dict[int, _Later] = field(default_factory=dict)  # "plan" outcomes not made yet
    build: Callable[[_Later], Plan] = lambda later: later.plan  # (set by _search)


def _search(
    problem: _Problem,
    candidates: list[Candidate],
    solve: Callable[..., Partition | None],
    method: str,
    time_limit_s: float | None,
    progress: bool | None,
    outside: float | None = None,
) -> tuple[Plan | None, Candidate | None, _Visited]:
    """Every candidate in the order of its prior bound (planner/bounds.py), skipping those whose
    bound cannot beat the best plan so far (or `outside`, the time of a plan found elsewhere:
    another device order's). A solved split whose own bound is above the next candidate's
    prior bound waits (least bound first) until the candidates before it are visited
    (WAIT_FOR_BOUNDS). The winner is the same as an exhaustive search's: the least predicted
    time, ties (within 1e-12) going to the candidate listed first (the caller drops one that
    does not beat `outside`)."""
    started = time.perf_counter()
    speeds = [d.speed for d in problem.cluster.devices]
    prior = [_prior_bound(problem, c, speeds) for c in candidates]
    # Equal bounds (the same total work, say) are visited likely-fastest first: more
    # micro-batches, less bubble, less recomputation. The winner does not depend on the order
    # (ties go to the candidate listed first); the sooner a fast plan is in hand, the more of
    # the others its time rules out by their split's bound, before any simulation.
    order = sorted(range(len(candidates)), key=lambda k: (prior[k], _likely(candidates[k]), k))
    best: tuple[float, int, Plan, Candidate] | None = None
    visited = _Visited()
    outcomes = visited.outcomes
    built: dict[tuple, Plan] = {}
    timed: dict[tuple, _Later] = {}  # splits that fit by the bound, timed, not made yet
    settled: dict[tuple[int, str], tuple[_Outcome, Plan | None]] = {}  # see PER_STAGE below
    waiting_pairs: dict[tuple[int, str], float] = {}  # never twins waiting, memory free

    def to_beat() -> float | None:
        """The time a candidate must beat: the best so far's, or the outside plan's."""
        ref = min(
            best[0] if best is not None else math.inf, math.inf if outside is None else outside
        )
        return None if math.isinf(ref) else ref

    def beaten(bound: float) -> bool:
        ref = to_beat()
        return ref is not None and bound > ref * (1 + 1e-12)

    # A split whose bound (after it is solved) exceeds the next candidates' prior bounds waits
    # for them: a faster plan found meanwhile may rule it out before its plan is made.
    waiting: list[tuple[float, int, int, tuple]] = []  # (bound, order, k, state): a heap

    def take_settled(k: int, pair: tuple[int, str]) -> None:
        """A per-stage candidate whose never twin's solve proved that memory does not bind
        (partition.py, `memory_free`): recomputation only adds time, so no per-stage choice
        beats that split with every stage choosing never, the twin's answer."""
        nonlocal best
        visited.solved += 1
        outcomes[k], twin = settled[pair]
        if isinstance(twin, _Later):
            visited.later[k] = twin
        if twin is not None and (best is None or _better(_ms(twin), k, best[0], best[1])):
            best = (_ms(twin), k, twin, candidates[k])

    def finish(k: int, state: tuple) -> None:
        """The rest of a solved candidate: ruled out by its split's bound, or timed / made."""
        nonlocal best
        cand = candidates[k]
        pair = (cand.microbatches, cand.schedule)
        waiting_pairs.pop(pair, None)
        _, part, fits, free, bound, chain, times = state
        fell: tuple[Plan, float | None] | None = None  # the fallback's, where it was made here
        if beaten(bound) and cand.per_device > 1:
            # Interleaved: the bound is of this split's plan, which may overrun a device once
            # both its stages are counted; the candidate's plan is then a fallback's, another
            # split with a bound of its own (found by a stress run: pruned here, the fallback
            # beat every other plan). Only where one may win is anything made.
            if _fits_jointly_by_bound(problem, cand, part):  # then it is the candidate's plan
                outcomes[k] = _Outcome("bound", bound)
                return
            specs = _stage_specs(problem, cand, halve=False)
            visited.memory_bound = True  # (its devices may overrun)
            won, below = _interleaved_fallback(
                problem, cand, times, specs, part, solve, method, None, to_beat()
            )
            if won is None:  # none can win: the split's own plan cannot either
                outcomes[k] = _Outcome(
                    "bound", min(bound, below or math.inf), detail="" if below is None else "or"
                )
                return
            fell = (won, below)  # (taken below if the split's own plan overruns)
        elif beaten(bound):  # it cannot beat the best so far: no simulation
            outcomes[k] = _Outcome("bound", bound)
            if free:
                settled[pair] = (outcomes[k], None)
            return
        # a per-stage split that chose what a single-mode candidate's did is that plan
        same = (cand.microbatches, cand.schedule, tuple(part.bounds),
                tuple(_stage_modes(cand, part)), part.bottleneck, tuple(part.extra.items()))  # fmt: skip
        lazy = cand.per_device == 1 and chain.flow is None and problem.target != "torchrun"
        if fits and lazy and not problem.larger(cand):
            # It fits by the bound: time it alone, and make the plan (its issue order, its
            # memory) only if it wins or is listed as a runner-up (_alternatives). (Not on an
            # uneven batch, whose smaller micro-batches the split search, solved at the larger
            # size, does not count: their working memory may be larger, _no_state_above)
            later = timed.get(same)
            if later is None:
                modes = _stage_modes(cand, part)
                label = modes[0] if len(set(modes)) == 1 else PER_STAGE
                later = timed[same] = _Later(cand, part, _plan_time(problem, cand, part), label)
            t = _ms(later)
            outcomes[k] = _Outcome("plan", t, recompute=later.recompute)
            visited.later[k] = later
            if free:
                settled[pair] = (outcomes[k], later)
            if best is None or _better(t, k, best[0], best[1]):
                best = (t, k, later, cand)
            return
        specs = _stage_specs(problem, cand, halve=False)
        plan = built.get(same) or _build_plan(problem, cand, specs, part, method, beat=to_beat())
        built[same] = plan
        # planned for torchrun: slower than the best already, untimed (an interleaved one that
        # overruns a device: its fallback's, below, may not be)
        if plan._untimed and (cand.per_device == 1 or plan.fits):
            outcomes[k] = _Outcome("bound", plan.predicted.iteration_ms)
            if free:
                settled[pair] = (outcomes[k], None)
            return
        if not plan.fits and cand.per_device > 1:
            # the per-stage twin may fall back differently (every stage recomputing)
            free = False
            visited.memory_bound = True
            found = fell or _interleaved_fallback(
                problem, cand, times, specs, part, solve, method, plan, to_beat()
            )
            plan, at_least = found[0] or plan, found[1]
            if not plan.fits and at_least is not None:  # what might fit cannot win
                outcomes[k] = _Outcome("bound", at_least, detail="over")
                return
        t = plan.predicted.iteration_ms
        peak = max(plan.predicted.peak_memory)
        if not plan.fits:
            outcomes[k] = _Outcome("over", t, peak, _over_budget(plan))
            visited.ahead_over = visited.ahead_over or plan._ahead_over
            return
        outcomes[k] = _Outcome("plan", t, peak, recompute=plan.recompute)
        if free:
            settled[pair] = (outcomes[k], plan)
        if best is None or _better(t, k, best[0], best[1]):
            best = (t, k, plan, cand)

    def attempt(k: int, defer: bool, following: float = math.inf, at: int = 0) -> None:
        """Solve candidate k's split; then finish it, or (`defer`) let it wait where its
        split's bound exceeds `following`, the next candidate's prior bound."""
        cand = candidates[k]
        chain, memory = problem.chain(cand)
        # Interleaved: each stage may first use its whole device (a relaxation: a device
        # holds at least either of its stages); the plan then checks each device's stages
        # together, along the issue order.
        cuts = _cut_costs(problem.cluster, cand, chain)
        times = _balance_times(chain, cand)
        limit = _bottleneck_limit(problem, cand, chain, to_beat())
        try:
            hint = _hint(problem, cand, cand.modes, False)
            if cand.per_device > 1:  # (its own solves' `fits` is of one stage per device)
                part, fits = _solved_split(
                    problem, cand, cand.modes, False, limit,
                    lambda: _solve(problem, cand, solve, method, times, memory, cuts, limit,
                                   hint)[0],
                ), False  # fmt: skip
            else:
                part, fits = _solve(problem, cand, solve, method, times, memory, cuts, limit, hint)
                if part is not None and len(cand.modes) == 1:
                    problem.met[(cand.microbatches, cand.schedule, cand.modes[0])] = part.bottleneck
        except NoneWithin as e:
            visited.solved += 1
            visited.memory_bound |= not e.by_time
            outcomes[k] = _Outcome("limit", limit * cand.microbatches)
            return
        visited.solved += 1
        # (a solver that does not say whether memory bound it: as if it did)
        visited.memory_bound |= part is None or part.extra.get("memory_free") != 1.0
        if part is None:
            outcomes[k] = _Outcome("nofit", math.inf)
            return
        # memory bound no end of the never split: the per-stage twin would find it again
        # (an interleaved one, only where that split's devices then fit: see below)
        free = cand.recompute == "never" and part.extra.get("memory_free") == 1.0
        bound = _lower_bound(problem, cand, _stage_speeds(problem, cand), part)
        state = ("split", part, fits, free, bound, chain, times)
        if defer and not beaten(bound) and bound > following * (1 + 1e-12):
            heapq.heappush(waiting, (bound, at, k, state))
            if free:
                waiting_pairs[(cand.microbatches, cand.schedule)] = bound
            return
        finish(k, state)

    def resume(upto: float) -> None:
        """Finish the waiting splits whose bound is at most `upto`, least bound first."""
        while waiting and waiting[0][0] <= upto:
            _, _, k, state = heapq.heappop(waiting)
            if state[0] != "twin":
                finish(k, state)
                continue
            # a per-stage candidate that waited behind its never twin (here, not in finish:
            # closures that call each other are a cycle, which kept the problem and its
            # profile, a million objects at 10 000 layers, for the collector)
            cand = candidates[k]
            pair = (cand.microbatches, cand.schedule)
            if pair in settled:
                take_settled(k, pair)
            else:  # (the twin's plan did not settle it: over budget, or a fallback)
                attempt(k, defer=False)

    show = sys.stderr.isatty() if progress is None else progress
    hurried = False  # past the time limit with no plan: the rest, likeliest to fit first
    with _progress_bar(len(order), show) as tick:
        for n, k in enumerate(order):
            cand = candidates[k]
            resume(prior[k])
            if not hurried and beaten(prior[k]):
                visited.pruned = len(order) - n  # the rest are sorted by this bound
                outcomes.update((q, _Outcome("pruned", prior[q])) for q in order[n:])
                break
            if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
                if best is None and waiting:  # (the splits solved may hold a plan: no more
                    resume(math.inf)  # solves, found by a red team with a slow solver)
                if best is not None or outside is not None:
                    resume(math.inf)  # (solved already: finished, as they would have been)
                    visited.timed_out = True
                    outcomes.update((q, _Outcome("unsearched", prior[q])) for q in order[n:])
                    break
            tick()
            pair = (cand.microbatches, cand.schedule)
            if cand.recompute == PER_STAGE and pair in settled:
                take_settled(k, pair)
                continue
            if cand.recompute == PER_STAGE and pair in waiting_pairs:
                # its never twin waits (memory free there): so does it, right behind
                heapq.heappush(waiting, (waiting_pairs[pair], n, k, ("twin",)))
                continue
            # (waits behind the next candidate, or behind a split already waiting)
            following = prior[order[n + 1]] if n + 1 < len(order) else math.inf
            following = min(following, waiting[0][0]) if waiting else following
            # (past the time limit, nothing waits: the plan in hand is what is returned)
            late = time_limit_s is not None and time.perf_counter() - started > time_limit_s
            attempt(k, defer=WAIT_FOR_BOUNDS and not late, following=following, at=n)
            if late and not hurried and best is None and outside is None:
                # The time limit has passed and nothing fits yet: the search goes on until a
                # plan does (found by a red team: `--time-limit 0.01` took 92 s, visiting
                # candidates best bound first where memory ruled out most of them). The rest go
                # by turns: the likeliest to fit (_likely_fit), then the next by bound (which
                # the likeliest need not be: an interleaved split may fit where 1F1B does not),
                # so the first plan comes within twice the solves of the better of the two
                # orders. It is marked not proven, as any plan found past the limit is.
                hurried = True
                order[n + 1 :] = _by_turns(
                    order[n + 1 :], key=lambda q: (*_likely_fit(candidates[q]), prior[q], q)
                )
    resume(math.inf)  # what still waits: ruled out by its bound now, or made
    if best is None:
        return None, None, visited
    visited.build = lambda later: later.make(problem, method)
    won = best[2]
    return (won.make(problem, method) if isinstance(won, _Later) else won), best[3], visited


_BUBBLE_RANK = {"zb-h1": 0, "interleaved-1f1b": 1, "1f1b": 2, "gpipe": 3}
_RECOMPUTE_RANK = {"never": 0, PER_STAGE: 1, "except_last": 2, "always": 3}


def _likely(cand: Candidate) -> tuple[int, int, int]:
    """Of candidates with equal bounds, which to visit first (_search)."""
    return (
        -cand.microbatches,
        _BUBBLE_RANK.get(cand.schedule, 4),
        _RECOMPUTE_RANK.get(cand.recompute, 4),
    )


@dataclass
class _Later:
    """A solved candidate whose split fits its devices by the occupancy bound alone, timed but
    not yet made into a plan (made on demand: only the winner and the runners-up listed)."""

    cand: Candidate
    part: Partition
    ms: float  # its predicted time: _plan_time, which the plan's own simulation equals
    recompute: str
    plan: Plan | None = None

    def make(self, problem: _Problem, method: str) -> Plan:
        if self.plan is None:
            specs = _stage_specs(problem, self.cand, halve=False)
            self.plan = _build_plan(problem, self.cand, specs, self.part, method)
        return self.plan


def _ms(plan: Plan | _Later) -> float:
    return plan.ms if isinstance(plan, _Later) else plan.predicted.iteration_ms


def _plan_time(problem: _Problem, cand: Candidate, part: Partition) -> float:
    """The predicted time of a chain's split on one stage per device, streams target: what
    _build_plan's simulation finds, from the same stage costs (stage_costs), without the
    memory (which needs the schedule's issue order)."""
    profile, cluster = problem.profile, problem.cluster
    chain, memory = problem.chain(cand)
    K, L = cluster.size, chain.num_model_layers
    modes = _stage_modes(cand, part)
    received, grads = _received(memory, part), _received(memory, part, grad=True)
    speeds = [d.speed for d in cluster.devices]
    times = [
        _stage_times(chain, cand, modes[s], i, j, speeds[s]) for s, (i, j) in enumerate(part.stages)
    ]
    rt = profile.runtime
    costs = Costs(
        forward=[t["forward_ms"] for t in times],
        backward=[t["backward_ms"] for t in times],
        input_grad=[t["input_grad_ms"] for t in times],
        weight_grad=[t["weight_grad_ms"] for t in times],
        recompute=modes,
        transfer=[_link_ms(cluster, s, s + 1, received[s + 1]) for s in range(K - 1)],
        action_overhead=rt.action_ms if rt is not None else 0.0,
        step_overhead=rt.step_ms if rt is not None else 0.0,
        call_overhead=rt.call_ms if rt is not None else 0.0,
        input_calls=[
            input_calls(s, (i, min(j, L)), K, g)
            for s, ((i, j), g) in enumerate(zip(part.stages, grads))
        ],
        sends_grads=[g > 0 for g in grads],
    )
    return simulate(
        plan_schedule(cand.schedule, K, cand.microbatches), costs, memory=False
    ).makespan


BOUND_FIRST = True  # solve with occupancy_bound first (False: the exact occupancy at once)
# a solved split whose bound exceeds the next candidates' prior bounds waits for them (_search)
WAIT_FOR_BOUNDS = True


def _solve(
    problem: _Problem,
    cand: Candidate,
    solve: Callable[..., Partition | None],
    method: str,
    times: np.ndarray,
    memory: MemoryModel,
    cuts: list[np.ndarray] | None,
    limit: float = math.inf,
    hint: float = math.inf,
) -> tuple[Partition | None, bool]:
    """The candidate's split, and whether it fits by the bound (then every stage fits its
    device by the exact occupancy too, which is never larger: StageShape.bound). `limit`: the
    bottleneck past which the split cannot win (_bottleneck_limit); NoneWithin where no split
    that fits its device by the exact occupancy is within it.

    The probe first solves with a bound on each stage's occupancy from the program alone
    (occupancy_bound), which needs no issue order. Where memory then lowered no end
    (`memory_free`), the exact occupancy, never larger, lowers none either: every probe of the
    proof and of the split reaches the same ends, so the split, its bottleneck and its
    choices are the exact solve's (a test holds them equal). Then, where memory binds, a floor
    on the occupancy (occupancy_floor) may prove that no split fits. Else, or with another
    solver, the exact occupancy is solved with. The bound holds about the whole batch in
    flight, so it lets memory go free for most candidates of a search or for almost none:
    each shortcut is tried for a schedule and recomputation while it has succeeded at least
    as often as it missed there (`_worth`; a miss costs about a solve)."""
    if method != "probe-bisection" or not BOUND_FIRST:
        return solve(times, memory, _stage_specs(problem, cand, halve=False), cuts=cuts), False
    kind = (cand.schedule, cand.recompute)
    records = problem.records
    if _worth(records, "bound", kind):
        try:
            bounded = solve(times, memory, _stage_specs(problem, cand, halve=False,
                            which="bound"), cuts=cuts, limit=limit, free_only=True)  # fmt: skip
        except NoneWithin as e:
            if e.by_time:  # (memory aside: so for the exact occupancy too)
                raise
            # the bound holds more than the exact occupancy: no proof, and no miss either
            # (without the limit it might have let memory go free)
        else:
            fits = bounded is not None and bounded.extra.get("memory_free") == 1.0
            _count(records, "bound", kind, fits)
            if fits:
                return bounded, True
    # Where even occupancy_floor, never more than the exact occupancy, lets no split fit, none
    # fits (the search's "nofit"), and no issue order is needed.
    if _worth(records, "floor", kind):
        floor = _stage_specs(problem, cand, halve=False, which="floor")
        proved = not feasible_split(times, memory, floor, cuts)
        _count(records, "floor", kind, proved)
        if proved:
            return None, False
    exact = _stage_specs(problem, cand, halve=False)
    within = {} if math.isinf(hint) else {"hint": hint}
    return solve(times, memory, exact, cuts=cuts, limit=limit, **within), False


def _hint(problem: _Problem, cand: Candidate, modes: tuple[str, ...], halved: bool) -> float:
    """A bottleneck some split of a candidate whose stages each choose among `modes` is known
    to meet (solve_partition's `hint`): the least of the splits found with every stage in one
    of them (the same times and memory shapes for that option), where solved already."""
    if len(modes) < 2:
        return math.inf
    found = [math.inf]
    for mode in modes:
        if cand.per_device == 1:
            found.append(problem.met.get((cand.microbatches, cand.schedule, mode), math.inf))
            continue
        kept = problem.splits.get((cand.microbatches, cand.schedule, (mode,), halved))
        if kept is not None and kept[1] is not None:
            found.append(kept[1].bottleneck)
    return min(found)


def _solved_split(
    problem: _Problem,
    cand: Candidate,
    modes: tuple[str, ...],
    halved: bool,
    limit: float,
    run: Callable[[], Partition | None],
) -> Partition | None:
    """An interleaved candidate's split with each stage on its whole device (or on half of it:
    `halved`) under `modes`, the options every stage has: `run()` solves it, with `limit` (see
    solve_partition; NoneWithin passes through). The same split recurs: a per-stage
    candidate's fallback that runs every stage in one mode solves what that mode's own
    candidate solved, and a per-stage candidate whose never twin's split was free of memory
    (`memory_free`: memory lowered no end, so further options, each costing at least as much
    per layer, reach the same ends: the same split, every stage choosing never; the search's
    twins rely on the same, `settled`) solves that twin's split again. Kept per (M, schedule,
    modes, halved): a split found is the answer under any limit at or above its bottleneck;
    "none fits" under any limit. Else solved."""
    key = (cand.microbatches, cand.schedule, modes, halved)
    found = problem.splits.get(key)
    if found is None and len(modes) > 1 and problem.target != "torchrun":
        twin = problem.splits.get((cand.microbatches, cand.schedule, (modes[0],), halved))
        if twin is not None and twin[1] is not None and twin[1].extra.get("memory_free") == 1.0:
            # (whether memory binds the other options is not known: said as if it did, which
            # only a torchrun plan's labels read, `held_less`: none is derived there)
            part = twin[1]
            found = (twin[0], dataclasses.replace(
                part, extra={**part.extra, "memory_free": 0.0},
                choices=[0] * (len(part.bounds) - 1),
            ))  # fmt: skip
    if found is not None:
        part = found[1]
        if part is None and math.isinf(found[0]):
            return None
        if part is not None and part.bottleneck <= limit:
            return dataclasses.replace(part, extra=dict(part.extra), choices=list(part.choices))
    part = run()  # (NoneWithin: nothing kept, the limit may rise later)
    kept = (
        None
        if part is None
        else dataclasses.replace(part, extra=dict(part.extra), choices=list(part.choices))
    )  # (the caller's to change: a fallback names the option its stages run)
    problem.splits[key] = (limit, kept)
    return part


def _bottleneck_limit(
    problem: _Problem, cand: Candidate, chain: Chain, beat: float | None
) -> float:
    """The bottleneck past which a candidate's split cannot beat `beat` (the best time so far):
    each stage runs its work (what the partition balances, on its device) once per micro-batch
    and each link carries a transfer per micro-batch, so the split's lower bound (_lower_bound,
    which _search prunes by) is at least M times its bottleneck. A captured graph's links past
    ROUTED_LINKS are costed above what the bound charges, and a torchrun program that need not
    keep the chain's order is bounded without its links (_lower_bound): no limit there. A
    margin of 1e-9 keeps rounding on the side of solving."""
    if beat is None or (chain.flow is not None and chain.num_layers > ROUTED_LINKS):
        return math.inf
    if not problem.chain_order:  # (links carry skips the bound counts as nothing: no link term)
        return math.inf
    return beat * (1 + 1e-9) / cand.microbatches


def _worth(records: dict[tuple, list[int]], shortcut: str, kind: tuple[str, str]) -> bool:
    """Whether a shortcut is worth another try for a candidate of this schedule and
    recomputation: until it has missed there more often than not. (Per schedule: where memory
    binds, zero bubble often fits nowhere while 1F1B fits; a miss costs about a solve.)"""
    hits, misses = records.get((shortcut, *kind), (0, 0))
    return hits >= misses


def _count(
    records: dict[tuple, list[int]], shortcut: str, kind: tuple[str, str], hit: bool
) -> None:
    records.setdefault((shortcut, *kind), [0, 0])[0 if hit else 1] += 1


def _interleaved_fallback(
    problem: _Problem,
    cand: Candidate,
    times: np.ndarray,
    specs: list[StageSpec],
    relaxed: Partition,
    solve: Callable[..., Partition | None],
    method: str,
    relaxed_plan: Plan | None,
    beat: float | None = None,
) -> tuple[Plan | None, float | None]:
    """The relaxed split (its plan: `relaxed_plan`) overran a device once both its stages were
    counted. Try what is sufficient instead: each stage on half its device, and (per-stage
    candidates) every stage recomputing alike, each free to use its whole device and checked
    jointly. The fastest that fits, marked not proven (the relaxed bottleneck bounds it from
    below); else the relaxed plan, which does not fit. A try whose split's lower bound cannot
    beat `beat` (the best time so far) is not made into a plan (nor solved past the bottleneck
    that could: _bottleneck_limit); with the relaxed plan comes then the least such bound (else
    None). `relaxed_plan` None: not made yet, and None back where no try fits."""
    chain, memory = problem.chain(cand)
    cuts = _cut_costs(problem.cluster, cand, chain)
    limit = _bottleneck_limit(problem, cand, chain, beat)
    within = {"limit": limit} if method == "probe-bisection" and math.isfinite(limit) else {}
    tries: list[tuple[list[StageSpec], np.ndarray, list[int] | None, tuple, bool]] = [
        (_stage_specs(problem, cand), times, None, cand.modes, True)
    ]
    if len(cand.modes) > 1:  # one mode for all, as a uniform candidate would run
        for x in range(len(cand.modes)):
            alike = [StageSpec(sp.speed, sp.budget, sp.shapes[x]) for sp in specs]
            tries.append((alike, times[x : x + 1], [x] * len(specs), (cand.modes[x],), False))
    best, at_least = relaxed_plan, math.inf
    for try_specs, try_times, choices, modes, halved in tries:
        hint = _hint(problem, cand, modes, halved) if method == "probe-bisection" else math.inf
        more = {**within, **({} if math.isinf(hint) else {"hint": hint})}
        try:
            part = _solved_split(
                problem, cand, modes, halved, limit if within else math.inf,
                lambda t=try_times, sp=try_specs, kw=more: solve(t, memory, sp, cuts=cuts, **kw),
            )  # fmt: skip
        except NoneWithin:  # (its bound is past `beat`: at least M times the limit)
            at_least = min(at_least, limit * cand.microbatches)
            continue
        if part is None:
            continue
        if choices is not None:  # solved as one option: say which, on the full specs
            part.choices = choices
            try_specs = specs
        bound = _lower_bound(problem, cand, [sp.speed for sp in try_specs], part)
        if beat is not None and bound > beat * (1 + 1e-12):
            at_least = min(at_least, bound)
            continue
        plan = _build_plan(problem, cand, try_specs, part, method, relaxed=relaxed)
        if plan.fits and (best is None or not best.fits or _faster(plan, best)):
            best = plan
    return best, (at_least if math.isfinite(at_least) else None)


def _fits_jointly_by_bound(problem: _Problem, cand: Candidate, part: Partition) -> bool:
    """Whether an interleaved split surely fits its devices with both stages counted: each
    device's stages' totals by occupancy_bound (never below the exact occupancy's, StageShape
    .bound), under the options the split chose, add up within the device's memory. What a
    device holds at any moment is its stages' own holdings then, each at most its peak, and
    their reserved shares make the device's. (And at the optimizer step, a stage's first tensor
    stepped beside the carry of the device's other stage's last tensor: within the two stages'
    own steps, which the totals add, where that carry is at most the temporaries of the tensor
    it comes from, step_carry <= 1; else this says nothing.)"""
    chain, memory = problem.chain(cand)
    if chain.step_carry > 1:
        return False
    specs = _stage_specs(problem, cand, halve=False, which="bound")
    K = problem.cluster.size
    choices = part.choices or [0] * len(specs)
    totals = [
        int(memory.total(i, j, specs[s].shapes[choices[s]])[0])
        for s, (i, j) in enumerate(part.stages)
    ]
    if problem.measured_smaller(cand):
        # An uneven batch: the totals count every micro-batch at the larger size, whose
        # states bound the smaller ones' (_no_state_above) but whose working memory need not,
        # and the plan counts the smaller's where it is known (a stress run: True on splits
        # whose plan overran, so a fallback that might have won went unsolved and the plan
        # was claimed optimal).
        grown = _smaller_growth(problem, cand, part, choices)
        if grown is None:
            return False
        totals = [t + g for t, g in zip(totals, grown)]
    held = [0] * K
    for s, total in enumerate(totals):
        held[s % K] += total
    return all(h <= d.memory_bytes for h, d in zip(held, problem.cluster.devices))


def _smaller_growth(
    problem: _Problem, cand: Candidate, part: Partition, choices: list[int]
) -> list[int] | None:
    """Per stage, how much more working memory a smaller micro-batch of an uneven batch may
    take than a larger one: its transients' growth over the larger's, added up (what a stage
    holds at any moment is its states, each a smaller micro-batch's at most the larger's, and
    its working memory then). None for a captured graph (its stages have no breakdown here)."""
    chain, memory = problem.chain(cand)
    if chain.flow is not None:
        return None
    specs = _stage_specs(problem, cand, halve=False)
    shapes = [specs[s].shapes[choices[s]] for s in range(len(specs))]
    lo, hi = np.array([i for i, _ in part.stages]), np.array([j for _, j in part.stages])
    sizes = memory.stages_bytes(lo, hi, shapes)
    rest = problem.memory_of(chain.mb - 1).stages_bytes(lo, hi, shapes)
    return [
        sum(max(0, getattr(r, k) - getattr(b, k)) for k in TRANSIENTS) for b, r in zip(sizes, rest)
    ]


def _faster(a: Plan, b: Plan) -> bool:
    return _beats(a, b.predicted.iteration_ms)


def _beats(plan: Plan, ms: float) -> bool:
    """Faster than `ms` by more than rounding."""
    return plan.predicted.iteration_ms < ms * (1 - 1e-12)


def _over_budget(plan: Plan) -> str:
    worst = max(plan.devices, key=lambda d: d.total - d.budget)
    over = format_size(worst.total - worst.budget, up=True)
    return f"{worst.name} over its budget by {over}"


def _alternatives(
    problem: _Problem,
    candidates: list[Candidate],
    visited: _Visited,
    chosen: Plan,
    won: Candidate,
) -> list[Alternative]:
    """The best known candidate of every (schedule, recompute) but the chosen one, best first,
    each with the reason it lost: a simulated time when there is one, else the bound that
    ruled it out (so a pair's pick is its fastest simulated candidate, or failing that its
    lowest bound)."""
    best_ms = chosen.predicted.iteration_ms
    label = (chosen.microbatches, chosen.schedule, chosen.recompute)  # per-stage may read never
    groups: dict[tuple[str, str], list[int]] = {}
    for k, c in enumerate(candidates):
        o = visited.outcomes.get(k)
        read = (c.microbatches, c.schedule, o.recompute if o and o.recompute else c.recompute)
        same = c == won or (c.microbatches, c.schedule, c.recompute) == label or read == label
        if not same and o is not None:
            groups.setdefault((c.schedule, c.recompute), []).append(k)
    # within a group, what is known to be faster first: a predicted time beats a bound
    rank = {"plan": 0, "over": 3, "bound": 1, "limit": 1, "pruned": 1, "unsearched": 1, "nofit": 2}
    picks = []
    for members in groups.values():
        members.sort(key=lambda k: (rank[visited.outcomes[k].kind], visited.outcomes[k].ms, k))
        picks.append(members[0])
    picks.sort(key=lambda k: (visited.outcomes[k].ms, k))
    out = []
    for k in picks:
        c, o = candidates[k], visited.outcomes[k]
        if o.kind == "plan" and o.peak is None and k in visited.later:  # made only now
            o.peak = max(visited.build(visited.later[k]).predicted.peak_memory)
        slower = (o.ms / best_ms - 1) * 100 if best_ms > 0 else 0.0
        if o.kind == "plan":
            reason = (
                f"{slower:.2g}% slower"
                if o.ms > best_ms * (1 + 1e-12)
                else "as fast; a tie goes to the candidate listed first"
            )
        elif o.kind == "over" and c.per_device > 1:  # its devices counted with both stages
            reason = (
                f"its best split puts {o.detail} once both stages of a device are counted, and "
                "no split fits with each stage in half its device"
            )
        elif o.kind == "over":  # (its program, or an uneven batch's smaller micro-batches)
            reason = f"its best split puts {o.detail} as its program holds it"
        elif o.kind == "nofit":
            reason = "no split fits the memory budgets" + _fastest_need(problem, c)
        elif o.kind == "bound" and o.detail == "over":  # (interleaved: _interleaved_fallback)
            reason = (
                "its best split overruns a device once both its stages are counted; a split "
                f"that fits is at least {slower:.1f}% slower"
            )
        elif o.kind == "bound":
            also = ", and its fallbacks' where that overruns a device" if o.detail == "or" else ""
            reason = f"at least {slower:.1f}% slower (its split's lower bound{also})"
        elif o.kind == "limit":
            reason = (
                "cannot beat the plan chosen: no split that fits has its slowest stage or link "
                f"within {o.ms / c.microbatches:.4g} ms per micro-batch"
            )
        elif o.kind == "pruned":
            reason = f"at least {slower:.1f}% slower by its bound (not solved)"
        else:
            reason = "not solved before the time limit"
        timed = o.kind in ("plan", "over")
        out.append(
            Alternative(
                microbatches=c.microbatches,
                schedule=c.schedule,  # type: ignore[arg-type]
                recompute=c.recompute,  # type: ignore[arg-type]
                iteration_ms=o.ms if timed else None,
                at_least_ms=o.ms if o.kind in ("bound", "limit", "pruned", "unsearched") else None,
                peak_bytes=o.peak,
                reason=reason,
            )
        )
    return out


def _fastest_need(problem: _Problem, cand: Candidate) -> str:
    """What the fastest split (memory aside) would need where it is tightest, as a clause: its
    simulated device peaks, both stages of an interleaved device together."""
    chain, memory = problem.chain(cand)
    specs = _stage_specs(problem, cand, budget=INT64_SAFE, halve=False)
    part = solve_partition(
        _balance_times(chain, cand), memory, specs, cuts=_cut_costs(problem.cluster, cand, chain)
    )
    if part is None:
        return ""
    plan = _build_plan(problem, cand, _stage_specs(problem, cand, halve=False), part, "probe")
    worst = max(plan.devices, key=lambda d: d.total - d.budget)
    if worst.total <= worst.budget:
        return ""
    return (
        f" (its fastest split would need {format_size(worst.total, up=True)} on {worst.name}, "
        f"{format_size(worst.total - worst.budget, up=True)} over)"
    )


def _better(t: float, k: int, best_t: float, best_k: int) -> bool:
    """Faster by more than rounding, or as fast and listed earlier."""
    return t < best_t * (1 - 1e-12) or (t <= best_t * (1 + 1e-12) and k < best_k)


def _prior_bound(problem: _Problem, cand: Candidate, speeds: list[float]) -> float:
    chain = problem.costs(cand)
    zb = cand.schedule == "zb-h1"
    S = problem.cluster.size * cand.per_device
    M = cand.microbatches
    # what the bounds read of the layers, once per size, cost and cheapest mode (per-stage:
    # every stage's cheapest, never)
    share = recomputed_share(cand.modes[0], M)
    summary = (chain.mb, zb, share)
    counted = chain.forward if zb else chain.forward + chain.backward
    back = chain.input_grad + chain.weight_grad if zb else chain.backward
    if summary not in problem.summaries:
        problem.summaries[summary] = work_summary(chain.forward * (1 + share) + back, counted)
    W, rho = problem.summaries[summary]
    spread = prior_bound_of(W, rho, M, S, speeds)
    # The split's granularity, without recomputation (which only adds work): once per size.
    # And each layer l: the stage holding it runs l M times, after micro-batch 0's forward (and
    # backward, after its last) through every layer before the stage, so at least before l.
    key = (chain.mb, zb, cand.per_device)
    if key not in problem.granular:
        work = chain.forward + back
        per_stage = [speeds[s % len(speeds)] for s in range(S)]
        before = np.concatenate([[0.0], np.cumsum(counted)[:-1]])
        # least_bottleneck (a bisection, 1 ms at 1 000 layers on 128 stages) is at most what
        # filling the stages in turn reaches: each takes more than its share less one layer.
        # Where M times that cannot be the largest term, it is not computed.
        above = (float(work.sum()) + S * float(work.max(initial=0.0))) / sum(per_stage)
        problem.granular[key] = [None, work, before, per_stage, above * (1 + 1e-6)]
    kept = problem.granular[key]
    work, before = kept[1], kept[2]

    def granular_term(others: float) -> float:
        """M times the least bottleneck, with the runtime's cost, where it may exceed `others`
        (the largest of the other terms; else a value at most that, which leaves it so)."""
        if M * kept[4] + runtime <= others:
            return others
        if kept[0] is None:
            kept[0] = least_bottleneck(kept[1], kept[3])
        return M * kept[0] + runtime

    layer = float((M * work + before).max()) / max(speeds) if cand.per_device == 1 else 0.0
    # The runtime's own cost: every device runs M A v compute actions (A per micro-batch and
    # stage), each adding `action`; a layer's stage, M A of them. The fill term gets none.
    action, call, step = _overhead(problem)
    # per micro-batch and stage (zero bubble's I may make no call: a stage of one layer that
    # receives no gradient)
    per_mb = 3 * action if zb else 2 * action + call
    load = M * W / float(sum(speeds))  # (the cheapest mode's work)
    runtime = M * cand.per_device * per_mb
    # The links: a cut carries M transfers each way, one after another (the simulator's links),
    # the first once micro-batch 0 has crossed the cuts before it, and the last one's
    # micro-batch must then cross the cuts after it and come back through every cut a
    # gradient crosses (not those of a frozen prefix).
    most, total, back_way = _link_floor(problem, cand, chain)
    links = (M - 1) * most + total + back_way
    if not problem.chain_order:  # the devices' loads alone: no way through the stages holds
        rest = max(load + runtime, links)
        return step + max(granular_term(rest), rest)
    # each device's two stages framed (bounds.py; a chain's: a captured graph's stage may take
    # nothing from the one before it)
    if cand.per_device == INTERLEAVE == 2 and not problem.profile.captured:
        spread = max(spread, interleaved_bound_of(W, rho, M, len(speeds), speeds))
        # and paths through the schedule's own order (bounds.py), of the work without
        # recomputation (which only adds to it): once per size and M, for every mode; where M
        # exceeds the devices (at M = K they say what interleaved_bound says)
        runs = (chain.mb, M)
        # (not where a frozen prefix may be cut: its B waits for no gradient, and a path
        # through that wait is not one the run takes)
        frozen = bool((chain.grad_in[1 : chain.num_layers] == 0).any())
        if runs not in problem.runs and M > len(speeds) and not frozen:
            plain = chain.forward + back
            shares = work_shares(chain.forward, back, plain)
            sched = plan_schedule(cand.schedule, len(speeds), M)
            problem.runs[runs] = interleaved_runs_bound(sched, float(plain.sum()), shares, speeds)
        spread = max(spread, problem.runs.get(runs, 0.0))
    rest = max(spread, layer + M * per_mb, load + runtime, links)
    return step + max(granular_term(rest), rest)


def _link_floor(problem: _Problem, cand: Candidate, chain: Chain) -> tuple[float, float, float]:
    """The least one transfer can take on each cut of any split (as `_cut_costs` prices it: a
    cut may go after any layer but the last model layer, when the loss follows): their largest,
    their sum, and the sum over the cuts a gradient must cross on its way back (all but as
    many first cuts as a frozen prefix may hold), once per micro-batch size and stages per
    device. A chain's only (else 0): a captured graph's stage receives only what it reads,
    from wherever it was made."""
    key = (chain.mb, cand.per_device)
    if key not in problem.link_floors:
        cluster = problem.cluster
        K, S, n = cluster.size, cluster.size * cand.per_device, chain.num_layers
        allowed = np.ones(n, dtype=bool)
        allowed[0] = False  # (before the first layer: no stage is empty)
        if chain.has_loss:
            allowed[chain.num_model_layers] = False
        floors = [0.0]
        frozen = 0
        if S > 1 and chain.flow is None and allowed.any():
            least = float(chain.boundary[:n][allowed].min())
            floors = [_link_ms(cluster, s % K, (s + 1) % K, least) for s in range(S - 1)]
            # the cuts no gradient crosses come first (a frozen prefix), at most one per
            # boundary whose layer's input needs none
            frozen = int((allowed & (chain.grad_in == 0)).sum())
        problem.link_floors[key] = (max(floors), sum(floors), sum(floors[frozen:]))
    return problem.link_floors[key]


def _overhead(problem: _Problem) -> tuple[float, float, float]:
    """What the runtime adds per compute action, per B or I (its autograd call) and per step
    (the profile's `runtime`; and the torchrun program's all-reduces, which every plan for it
    pays: the cluster's step_sync_ms)."""
    rt = problem.profile.runtime
    action, call, step = (rt.action_ms, rt.call_ms, rt.step_ms) if rt else (0.0, 0.0, 0.0)
    return action, call, step + _step_sync(problem)


def _step_sync(problem: _Problem) -> float:
    """What the torchrun program's two all-reduces add to each step (the cluster's
    step_sync_ms): nothing for another target, or for one device."""
    if problem.target == "torchrun" and problem.cluster.size > 1:
        return problem.cluster.step_sync_ms or 0.0
    return 0.0


@contextmanager
def _progress_bar(total: int, show: bool, desc: str = "planning") -> Iterator[Callable[[], None]]:
    """A bar on the terminal, for searches long enough to wonder about (over a second)."""
    if not show:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="candidate", file=sys.stderr, leave=False,
              delay=1.0) as bar:  # fmt: skip
        yield lambda: bar.update(1)


def _checkpoint_layers(
    given: Sequence[int], profile: Profile, schedule: str, recompute: str
) -> tuple[int, ...]:
    """plan_pipeline's `checkpoint`, checked: distinct model layers, in order."""
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise ArgumentError("checkpoint", given, "expected a list of layer indices")
    if not given:
        return ()
    L = len(profile.layers)
    bad = [k for k in given if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < L]
    if bad:
        raise ArgumentError("checkpoint", bad[0], f"expected layer indices 0 .. {L - 1}")
    if profile.captured:
        raise ArgumentError(
            "checkpoint", list(given), "checkpointed layers need a sequential model; this "
            "profile's graph was captured (its layers read values from further back)",
        )  # fmt: skip
    if schedule == "zb-h1":
        raise ArgumentError(
            "checkpoint", list(given), "zero bubble splits each backward into I and W, "
            "which a layer's own checkpoint cannot be run across; choose another schedule",
        )  # fmt: skip
    if recompute not in ("auto", "never"):
        raise ArgumentError(
            "checkpoint", list(given), f"checkpointed layers are the recomputation: "
            f"recompute must be never (or auto), not {recompute}",
        )  # fmt: skip
    return tuple(sorted(set(given)))


def _choices(value: str, allowed: tuple[str, ...] | list[str], arg: str) -> list[str]:
    return list(allowed) if value == "auto" else [choice(value, arg, ("auto", *allowed))]


def _check_magnitude(table: ProfileTable, batch_size: int, most: int) -> None:
    """Refuse at once a batch so far past the profiled sizes that its extrapolated bytes would
    overflow the planner's int64 arithmetic (the total is about the same for every M). In
    floating point: int64 is what would overflow."""
    # per micro-batch, times the micro-batches a stage may hold at once (all of them, at most
    # `most`, the candidates' largest count): a profile whose bytes do not grow with the
    # samples (edited so) is largest in small ones
    least = -(-batch_size // most)
    per_size = max(
        sum(float(table.at(f, mb).sum()) for f in PER_SIZE if f.endswith("_bytes"))
        * -(-batch_size // mb)
        for mb in {least, batch_size, *(b for b in table.sizes if least < b < batch_size)}
    )
    crossing = float(table.profile.input_bytes + table.fixed("output_bytes").sum()) * batch_size
    total = per_size + 3 * crossing + 8 * float(table.fixed("param_bytes").sum())
    if total * 4 >= INT64_SAFE:
        raise ArgumentError(
            "batch_size",
            batch_size,
            f"by the profile (measured up to {max(table.sizes)} samples) its tensors "
            f"would take {format_size(total)}, past what any device holds; use a smaller batch",
        )


def _possible(c: Candidate, K: int, L: int) -> bool:
    if c.schedule != "interleaved-1f1b":
        return True
    return K * INTERLEAVE <= L and (c.microbatches <= K or c.microbatches % K == 0)


def plan_schedule(
    name: str, num_devices: int, microbatches: int, routes: tuple[tuple[int, int], ...] = ()
) -> Schedule:
    """The schedule a plan runs: `name` over num_devices x v stages, activations going along
    `routes` (a chain when empty). Made once per distinct arguments, however they are passed
    (a cache keyed on the call itself took routes=() and no routes for two schedules)."""
    return _plan_schedule(name, num_devices, microbatches, tuple(routes))


@lru_cache(maxsize=512)
def _plan_schedule(
    name: str, num_devices: int, microbatches: int, routes: tuple[tuple[int, int], ...]
) -> Schedule:
    v = INTERLEAVE if name == "interleaved-1f1b" else 1
    sched = build_schedule(name, num_devices * v, microbatches, stages_per_rank=v)
    # checked as it is made; kept by the cache above, so never edited: its key is kept on it
    return freeze(dataclasses.replace(sched, routes=list(routes)))


def _routes(plan: Plan) -> tuple[tuple[int, int], ...]:
    return tuple((s, t) for s, t in plan.routes)


def schedule_of(plan: Plan) -> Schedule:
    """The schedule of a plan, with its routes."""
    return plan_schedule(plan.schedule, len(plan.devices), plan.microbatches, _routes(plan))


def _grads_back(flow: Flow, bounds: list[int]) -> list[dict[int, int]]:
    """Per stage of a captured graph's split: the gradient bytes it sends back, per micro-batch,
    to each stage it takes values from (the floating values each route carries, routing.py)."""
    index = {name: v for v, name in enumerate(flow.names)}
    out: list[dict[int, int]] = [{} for _ in range(len(bounds) - 1)]
    for (src, dst), names in carried(flow, bounds).items():
        out[dst][src] = int(sum(int(flow.nbytes[index[n]]) for n in names if flow.grad[index[n]]))
    return out


def _received(memory: MemoryModel, part: Partition, grad: bool = False) -> list[int]:
    """What each stage of a split receives per micro-batch (routing.py); `grad`: the part
    of it that needs a gradient (what the stage sends back)."""
    at = 1 if grad else 0
    return [int(memory.inputs(np.array([i]), np.array([j]))[at][0]) for i, j in part.stages]


def _steady_count(name: str, num_devices: int) -> int | None:
    """The micro-batch count from which a schedule's exact occupancy and floor stop changing
    on a chain (None: they grow with M, as GPipe's do): K + 1 for 1F1B and zero bubble, three
    rounds of K for the interleaved schedule (whose counts past K are multiples of K)."""
    if name in ("1f1b", "zb-h1"):
        return num_devices + 1
    if name == "interleaved-1f1b":
        return 3 * num_devices
    return None


@lru_cache(maxsize=2048)
def _occupancy(
    name: str,
    num_devices: int,
    microbatches: int,
    recompute: str,
    routes: tuple[tuple[int, int], ...] = (),
    which: str = "exact",
) -> list:
    """The exact occupancy of a plan's schedule, or the bound above it or the floor below it
    (schedules/memory.py). Past a count (_steady_count) a steady schedule's exact occupancy
    and floor on a chain are the same for every micro-batch count (each further micro-batch
    repeats the steady state; the last one's except_last is in the drain either way): read
    there, the tables stay a size that does not grow with M (tests/test_memory_states.py
    holds them equal well past it)."""
    steady = _steady_count(name, num_devices)
    if steady is not None and not routes and which != "bound" and microbatches > steady:
        return _occupancy(name, num_devices, steady, recompute, routes, which)
    schedule = plan_schedule(name, num_devices, microbatches, routes)
    made = {"exact": occupancy, "bound": occupancy_bound, "floor": occupancy_floor}[which]
    return made(schedule, recompute)


def _any_routes(stages: int) -> tuple[tuple[int, int], ...]:
    """Every pair of stages: where a captured graph's split is not known yet, a stage's far
    inputs are counted as arriving with stage 0's forward (the earliest they could)."""
    return tuple((s, t) for t in range(stages) for s in range(t))


def _balance_times(chain: Chain, cand: Candidate) -> np.ndarray:
    """What the partition balances, per layer: the work one micro-batch costs (see module doc),
    one row per recomputation a stage may choose (cheapest first)."""
    back = chain.input_grad + chain.weight_grad if cand.schedule == "zb-h1" else chain.backward
    M = cand.microbatches
    return np.stack([chain.forward * (1 + recomputed_share(m, M)) + back for m in cand.modes])


def _link_ms(cluster: Cluster, rank: int, nxt: int, nbytes: float, late: bool = False) -> float:
    if rank == nxt:
        return 0.0
    if nxt == rank + 1:
        return cluster.links[rank].transfer_ms(nbytes, late=late)
    # The loop back from the last device to the first: assume the slowest link.
    return max(link.transfer_ms(nbytes, late=late) for link in cluster.links)


def _cut_costs(cluster: Cluster, cand: Candidate, chain: Chain) -> list[np.ndarray] | None:
    """Per cut between stage s and s + 1: what one micro-batch's transfer costs at each boundary
    (inf where no cut may go: between the last layer and the loss). A captured graph's stage
    receives only what its layers read: there the cost is per start j and end k of stage s + 1
    (routing.py), up to ROUTED_LINKS entries; past that, every value live at j (no less)."""
    K, S = cluster.size, cluster.size * cand.per_device
    if S == 1:
        return None
    n = chain.num_layers
    nbytes: np.ndarray = chain.boundary.astype(np.float64)
    if chain.flow is not None and n <= ROUTED_LINKS:
        nbytes = chain.flow.recv_table().astype(np.float64)
    per_link = [link.transfer_ms(nbytes) for link in cluster.links]
    loop_back = np.maximum.reduce(per_link) if per_link else np.zeros_like(nbytes)
    cuts = []
    for s in range(S - 1):
        rank, nxt = s % K, (s + 1) % K
        # the same link costs as _link_ms, for every boundary at once
        c = per_link[rank] if nxt == rank + 1 else loop_back if nxt != rank else 0 * nbytes
        c = np.array(c, dtype=np.float64)
        if chain.has_loss:
            c[chain.num_model_layers] = math.inf
        cuts.append(c)
    return cuts


ROUTED_LINKS = 1000  # entries past which a captured graph's links are costed per cut only


def _stage_specs(
    problem: _Problem,
    cand: Candidate,
    budget: int | None = None,
    *,
    halve: bool = True,
    which: str = "exact",
) -> list[StageSpec]:
    """One spec per stage; `budget` raises every device with less memory to it (the
    infeasibility search: on equal devices, their memory replaced).
    With v stages per device each gets 1/v of its device's memory (`halve`), or all of it (a
    relaxation, for plans whose devices are then checked with both stages together); its
    share of the reserved memory is 1/v either way. `which`: "exact", "bound" (each stage's
    occupancy as one tuple above it: occupancy_bound, StageShape.bound) or "floor" (tuples
    below it: occupancy_floor)."""
    cluster, optimizer = problem.cluster, problem.optimizer
    K, v = cluster.size, cand.per_device
    every = problem.shapes.get((cand, which))
    if every is None:  # (the same for every budget: made once)
        routes = _any_routes(K * v) if problem.profile.captured else ()
        occ = [
            _occupancy(cand.schedule, K, cand.microbatches, mode, routes, which)
            for mode in cand.modes
        ]
        step = problem.profile.optimizer_step.get(optimizer)
        every = problem.shapes[(cand, which)] = [
            [
                StageShape(
                    occupancy=o[s],
                    optimizer_slots=OPTIMIZER_SLOTS[optimizer],
                    reserved=cluster.devices[s % K].reserved_bytes // v,
                    runtime=problem.runtime_bytes if s < K else 0,  # (once per device)
                    optimizer_step=step.per_byte if step else 0.0,
                    foreach=step.foreach if step else False,
                    bound=which == "bound",
                )
                for o in occ
            ]
            for s in range(K * v)
        ]
    return [
        StageSpec(
            speed=cluster.devices[s % K].speed,
            budget=max(cluster.devices[s % K].memory_bytes, budget or 0) // (v if halve else 1),
            shape=shapes[0],
            more=tuple(shapes[1:]),
        )
        for s, shapes in enumerate(every)
    ]


def _stage_speeds(problem: _Problem, cand: Candidate) -> list[float]:
    """Each stage's device speed (stage s runs on device s mod K)."""
    devices = problem.cluster.devices
    return [devices[s % len(devices)].speed for s in range(len(devices) * cand.per_device)]


def _stage_modes(cand: Candidate, part: Partition) -> list[str]:
    """Each stage's recomputation in a solved split."""
    choices = part.choices or [0] * (len(part.bounds) - 1)
    return [cand.modes[x] for x in choices]


def _stage_times(
    chain: Chain, cand: Candidate, mode: str, i: int, j: int, speed: float
) -> dict[str, float]:
    f = float(chain.forward[i:j].sum()) / speed
    times = {
        "forward_ms": f,
        "backward_ms": float(chain.backward[i:j].sum()) / speed,
        "input_grad_ms": float(chain.input_grad[i:j].sum()) / speed,
        "weight_grad_ms": float(chain.weight_grad[i:j].sum()) / speed,
        "recompute_ms": f if mode != "never" else 0.0,
    }
    back = (
        times["input_grad_ms"] + times["weight_grad_ms"]
        if cand.schedule == "zb-h1"
        else times["backward_ms"]
    )
    times["work_ms"] = f * (1 + recomputed_share(mode, cand.microbatches)) + back
    # One micro-batch through the stage and back, without recomputation: forward, then B (or
    # zero bubble's I: its W is off the critical path, nothing waits for it)
    times["trip_ms"] = f + (times["input_grad_ms"] if cand.schedule == "zb-h1" else back)
    return times


def _lower_bound(problem: _Problem, cand: Candidate, speeds: list[float], part: Partition) -> float:
    """No schedule beats the busiest device's or link's load, nor one micro-batch's trip there
    and back (every stage's forward and backward, and every transfer twice). And each device's
    load is framed: its first action, an F of micro-batch m on its first stage s, waits for m's
    forward through the stages before s (on other devices, or they would come first); after
    its last action, a B or I of micro-batch m on stage s, m's backward runs back through the
    stages before s (a W or F: nothing follows). Interleaved devices included."""
    chain, memory = problem.chain(cand)
    K, M = problem.cluster.size, cand.microbatches
    received, grads = _received(memory, part), _received(memory, part, grad=True)
    busy = [0.0] * K
    trip = 0.0
    link = 0.0
    S = len(speeds)
    # before[kind][s]: one micro-batch's forward (F), backward (B) or I from stage s back to
    # the first, transfers included
    before = {Kind.F: [0.0] * S, Kind.B: [0.0] * S, Kind.I: [0.0] * S}
    own = [0.0] * S  # each stage's own load
    modes = _stage_modes(cand, part)
    # the runtime's cost per compute action (A per micro-batch and stage, two on its trip),
    # and per B or I, its autograd call
    action, call, step = _overhead(problem)
    zb = cand.schedule == "zb-h1"
    A = 3 if zb else 2
    forward, trips = [0.0] * S, [0.0] * S  # per stage: one micro-batch's forward; F then B
    for s, (i, j) in enumerate(part.stages):
        # a zero-bubble first stage of one layer makes no call at I
        called = call * input_calls(s, (i, j), S, grads[s]) if zb else call
        paid = {Kind.F: action, Kind.B: action + call, Kind.I: action + called}
        t = _stage_times(chain, cand, modes[s], i, j, speeds[s])
        own[s] = M * (t["work_ms"] + A * action + called)
        busy[s % K] += own[s]
        trips[s] = t["trip_ms"] + 2 * action + called
        forward[s] = t["forward_ms"] + action
        # where stage s + 1 sends no gradient back (a frozen prefix up to s), the way back
        # ends there: stage s's B or I waits for nothing (stage_costs' sends_grads)
        back = s < S - 1 and (grads[s + 1] > 0 or chain.flow is not None)
        trip += trips[s] if back or s == S - 1 else forward[s]
        if s < S - 1:  # what the next stage receives, as the plan times it
            c = _link_ms(problem.cluster, s % K, (s + 1) % K, float(received[s + 1]))
            trip += 2 * c if back else c
            link = max(link, M * c)
            for kind, ms in ((Kind.F, "forward_ms"), (Kind.B, "backward_ms"),
                             (Kind.I, "input_grad_ms")):  # fmt: skip
                way = kind == Kind.F or back
                before[kind][s + 1] = before[kind][s] + t[ms] + paid[kind] + c if way else 0.0
    program = plan_schedule(cand.schedule, K, M).ranks
    if not problem.chain_order:
        # A stage waits only for the stages it takes values from, and links may carry a skip
        # beside everything else (counted as nothing): a micro-batch reaches stage s once the
        # longest way of forwards to it has run. Each device's first action waits for that,
        # and each stage's F and B of a micro-batch come after it.
        reach = [0.0] * S
        for a, b in sorted(route_pairs(chain.flow, part.bounds)):  # (routes go forward)
            reach[b] = max(reach[b], reach[a] + forward[a])
        first = [reach[program[d][0].stage] + busy[d] for d in range(K)]
        return step + max(*first, *(reach[s] + trips[s] for s in range(S)))
    framed = 0.0
    for d in range(K):
        first, last = program[d][0], program[d][-1]
        tail = before[last.kind][last.stage] if last.kind in (Kind.B, Kind.I) else 0.0
        framed = max(framed, before[Kind.F][first.stage] + busy[d] + tail)
    # ... and so is each stage's own load, between its first action (a forward, waiting for
    # a micro-batch's way there) and its last (after a B or I, that way back): an interleaved
    # device's later stage waits for every stage before it. (A chain only: a captured graph's
    # stage may take nothing from the one before it.)
    kinds = () if problem.profile.captured else _last_kinds(cand.schedule, K, M)
    for s, last_kind in enumerate(kinds):
        tail = before[last_kind][s] if last_kind in (Kind.B, Kind.I) else 0.0
        framed = max(framed, before[Kind.F][s] + own[s] + tail)
    return step + max(max(busy), trip, link, framed)


@lru_cache(maxsize=256)
def _last_kinds(name: str, num_devices: int, microbatches: int) -> tuple[Kind, ...]:
    """Per stage of the schedule, the kind of its last action."""
    sched = plan_schedule(name, num_devices, microbatches)
    last: dict[int, Kind] = {}
    for acts in sched.ranks.values():
        for a in acts:
            last[a.stage] = a.kind
    return tuple(last[s] for s in range(sched.num_stages))


def _build_plan(
    problem: _Problem,
    cand: Candidate,
    specs: list[StageSpec],
    part: Partition,
    method: str,
    relaxed: Partition | None = None,
    beat: float | None = None,
) -> Plan:
    """The plan of a solved split. `relaxed`: the split found when each interleaved stage could
    use its whole device, whose bottleneck bounds this one from below (it overran a device).
    `beat`: the time to beat; planned for torchrun, a chain whose plan is slower than that
    where sends never wait is not timed as the program runs (it cannot be faster there)."""
    profile, cluster = problem.profile, problem.cluster
    chain, memory = problem.chain(cand)
    K, v, L = cluster.size, cand.per_device, chain.num_model_layers
    S = K * v
    modes = _stage_modes(cand, part)
    # The split is known now: the stages' real routes, and where each stage's inputs come from.
    routes = tuple(route_pairs(chain.flow, part.bounds)) if chain.flow is not None else ()
    starts = [None] + [i for i, _ in part.stages[:-1]]
    received = _received(memory, part)
    back = _grads_back(chain.flow, part.bounds) if chain.flow is not None else None
    larger = problem.larger(cand)
    smaller = problem.memory_of(chain.mb - 1) if larger else None
    # what a captured graph's stages send back per stage they take values from, per size
    back_rest = None
    if larger and back is not None:
        back_rest = _grads_back(problem.chain_of(chain.mb - 1).flow, part.bounds)
    stages = []
    pairs: list[tuple[StageBytes, StageBytes]] = []  # (each stage's larger and smaller bytes)
    for s, ((i, j), spec) in enumerate(zip(part.stages, specs)):
        rank = s % K
        shape = spec.shapes[cand.modes.index(modes[s])]
        if chain.flow is not None:
            occ = _occupancy(cand.schedule, K, cand.microbatches, modes[s], routes)
            shape = dataclasses.replace(shape, occupancy=occ[s])
        # what the next stage receives: from this stage, and on a captured graph straight
        # from the stages before (the simulator times it as one transfer after this forward)
        send_bytes = received[s + 1] if s < S - 1 else 0
        send = _link_ms(cluster, rank, (s + 1) % K, send_bytes) if s < S - 1 else 0.0
        late = _link_ms(cluster, rank, (s + 1) % K, send_bytes, late=True) if s < S - 1 else 0.0
        states = memory.state_bytes(i, j, starts[s])
        raw = memory.terms(i, j, shape, starts[s], states)
        sizes = memory.stage_bytes(i, j, shape, starts[s], known=(states, raw))
        rest = smaller.stage_bytes(i, j, shape, starts[s]) if smaller is not None else None
        if rest is not None:
            rest = _no_state_above(rest, sizes)
        if v == 1 and problem.target == "streams":
            # the streams program's copy of a tied weight on this device: its gradient is
            # handed to the model's parameter as each step ends, and made again by the stage's
            # first backward (with stages sharing a device, a copy may be the parameter itself)
            copy = int(memory.copied(np.array([i]), np.array([j]))[0])
            if copy:
                use = _copies_made_at(chain, i, j)
                # (B makes it; zero bubble's W, whose walk is its own: from its start)
                by_b = cand.schedule != "zb-h1"
                # (made inside the first layer's backward, but before its peak: kept there)
                first = _first_extra(memory.chain, i) if by_b and use == i else 0
                tied = {"late_grad": copy, "late_grad_at_end": by_b and use == i and not first}
                if by_b and (use > i or first):  # (a tied copy: the memory model walks B)
                    tied["late_live"] = memory.late_walk(i, j, use, copy, first)
                sizes = dataclasses.replace(sizes, **tied)
                if rest is not None:
                    small = tied
                    if "late_live" in tied:
                        again = _first_extra(smaller.chain, i) if first else 0
                        late = smaller.late_walk(i, j, use, copy, again) if use > i or again else 0
                        small = {**tied, "late_live": late}
                        if not late:  # (the smaller micro-batch's: made after its peak)
                            small = {**tied, "late_grad_at_end": True, "late_live": 0}
                    rest = dataclasses.replace(rest, **small)
        if rest is not None:
            pairs.append((sizes, rest))
        terms = {k: int(x[0]) for k, x in raw.items()}
        terms.pop("optimizer_step_size")
        stages.append(
            StagePlan(
                index=s,
                rank=rank,
                device=cluster.devices[rank].name,
                layers=(i, min(j, L)),
                layer_types=[profile.layers[k].type for k in range(i, min(j, L))],
                recompute=modes[s],  # type: ignore[arg-type]
                inflight=shape.inflight,
                occupancy=list(shape.occupancy),
                **{
                    k: x
                    for k, x in _stage_times(chain, cand, modes[s], i, j, spec.speed).items()
                    if k != "trip_ms"
                },
                send_bytes=send_bytes,
                send_ms=send,
                late_send_ms=late if late != send else None,
                stash_bytes=int(states["saved"][0]),
                input_bytes=received[s],
                grads_back=sorted(back[s].items()) if back is not None else None,
                grads_back_rest=sorted(back_rest[s].items()) if back_rest is not None else None,
                state_bytes=_state_bytes(sizes, cand.per_device),
                state_bytes_rest=_state_bytes(rest, cand.per_device) if rest else None,
                memory=MemoryBreakdown(
                    **{**terms, "runtime": terms["runtime"] or None},  # (unset: left out)
                    total=sum(terms.values()),
                    budget=spec.budget,
                ),
            )
        )
    timeline = simulate_stages(
        cand.schedule, K, cand.microbatches, stages, levels=False, routes=routes,
        runtime=profile.runtime, larger=larger,
    )  # fmt: skip
    devices = [
        DeviceUse(
            name=d.name,
            stages=[st.index for st in stages if st.rank == k],
            total=timeline.peak_memory[k],
            budget=d.memory_bytes,
        )
        for k, d in enumerate(cluster.devices)
    ]
    total_ms, bubble = timeline.makespan, timeline.bubble_fraction
    peak_memory = timeline.peak_memory
    ahead_over = held_less = False
    uneven_over = pairs and _uneven_over(cand, K, modes, routes, pairs, larger, devices)
    waits = ""
    # (one stage per device, and it fits: else the search goes on to the interleaved
    # fallback, or reports by how much it is over budget)
    sync = _step_sync(problem)  # (the same for every plan)
    total_ms += sync
    lost = beat is not None and v == 1 and not routes and total_ms > beat * (1 + 1e-12)
    lost = lost and all(d.total <= d.budget for d in devices)
    lowering = None  # (which lowering the torchrun program runs: fastest_lowering_of)
    if problem.target == "torchrun" and K > 1 and not lost:
        costs = stage_costs(
            stages, profile.runtime, profile.device, step_sync_ms=sync, larger=larger
        )
        sched = plan_schedule(cand.schedule, K, cand.microbatches, routes)
        lowered, ran, lowering = fastest_lowering_of(sched, costs)  # timed as it runs
        # what its ranks hold beyond or short of the issue order, where their messages are
        # posted (simulate counts them too)
        ahead, after = receive_offsets(
            lowered, [st.state_bytes.input for st in stages],
            [st.state_bytes.grad for st in stages], costs.grads_back,
            preposted(lowered, costs), sends_held=ran is None,
            **message_sizes(costs),
        )  # fmt: skip
        if ahead or after:
            fitted = all(d.total <= d.budget for d in devices)
            peak_memory = peaks(
                lowered, modes, costs.memory, ahead, after,  # type: ignore[arg-type]
                smaller=costs.memory_rest, larger=costs.larger,
            )  # fmt: skip
            held_less = any(x < d.total for d, x in zip(devices, peak_memory))
            devices = [d.model_copy(update={"total": x}) for d, x in zip(devices, peak_memory)]
            ahead_over = fitted and any(d.total > d.budget for d in devices)
        if ran is None:  # as gloo runs a program not proven to meet
            ran = simulate(lowered, costs, memory=False, rendezvous=True).makespan
        if ran > total_ms * (1 + 1e-12):
            waits = (
                f"the torchrun program's ranks wait for each other in their batches of sends "
                f"and receives ({ran - total_ms:.3g} ms over the same plan where "
                "sends never wait), which the exact split does not see"
            )
        elif ran < total_ms * (1 - 1e-12):
            # the default model takes a captured graph's stages in chain order; the program
            # runs branches that exchange nothing side by side: faster than what the bounds
            # that pruned other candidates assume
            waits = (
                f"the torchrun program runs this captured graph's branches side by side "
                f"({total_ms - ran:.3g} ms under the chain-order model the split and "
                "the search's bounds use)"
            )
        if not problem.chain_order and "side by side" not in waits:
            side = (
                "the torchrun program may run this captured graph's branches side by side, "
                "which the exact split (stages in chain order) does not see"
            )
            waits = f"{waits}; {side}" if waits else side
        # the same compute, over a longer (or shorter) step
        total_ms, bubble = ran, 1 - sum(timeline.busy) / (K * ran) if ran else 0.0
    solved = part.extra.get("optimal", 1.0) == 1.0
    # An uneven batch's split is solved with every micro-batch at the larger size: where memory
    # bound it there, a split over a device only at that size may fit as this plan counts each
    # micro-batch (found by a review: one that did was 7% faster than a plan said optimal)
    at_larger = bool(larger) and part.extra.get("memory_free", 0.0) != 1.0
    proven = relaxed is None and solved and not waits and not at_larger
    unproven = ""
    lower = part.extra.get("lower_bound_ms", part.bottleneck)
    gap = part.extra.get("gap", 0.0)
    if relaxed is not None:
        unproven = (
            "interleaved: the best split with each stage free to use its whole device overran "
            "a device once both stages were counted; this one was found with each stage in "
            "half its device's memory, or with every stage recomputing alike"
        )
        lower = relaxed.bottleneck
        gap = (part.bottleneck - lower) / part.bottleneck if part.bottleneck > 0 else 0.0
    elif not solved:
        unproven = f"{method} stopped before proving its split optimal"
    if at_larger:
        uneven = (
            "the batch splits unevenly and memory bound the split, solved with every "
            "micro-batch at the larger size; one over a device only there may fit"
        )
        unproven = f"{unproven}; {uneven}" if unproven else uneven
    if waits:
        unproven = f"{unproven}; {waits}" if unproven else waits
    plan = Plan(
        model=profile.model,
        model_digest=profile.model_digest,
        profile_digest=problem.digests[0],
        cluster_digest=problem.digests[1],
        device_type=profile.device,
        dtype=profile.dtype,
        input_shape=profile.input_shape,
        input_dtype=profile.input_dtype,
        captured=profile.captured,
        routes=[list(r) for r in routes],
        num_layers=L,
        cluster=cluster,
        batch_size=problem.batch_size,
        microbatches=cand.microbatches,
        microbatch_size=chain.mb,
        schedule=cand.schedule,  # type: ignore[arg-type]
        stages_per_device=v,
        # one mode when every stage chose it
        recompute=modes[0] if len(set(modes)) == 1 else PER_STAGE,  # type: ignore[arg-type]
        optimizer=problem.optimizer,  # type: ignore[arg-type]
        target=problem.target,  # type: ignore[arg-type]
        loss=profile.loss.type if profile.loss is not None else "",
        runtime=profile.runtime,
        checkpointed=list(chain.checkpointed) or None,
        lowering=lowering,
        threads=profile.meta.threads or None,
        stages=stages,
        devices=devices,
        predicted=Prediction(
            iteration_ms=total_ms,
            bubble_fraction=bubble,
            throughput_samples_per_s=(problem.batch_size / total_ms * 1e3 if total_ms > 0 else 0.0),
            bottleneck_ms=part.bottleneck,
            peak_memory=peak_memory,
        ),
        solver=SolverInfo(
            method=method,
            optimal=proven,
            unproven=unproven,
            lower_bound_ms=lower,
            gap=gap,
            candidates=1,
        ),
        meta=PlanMeta(tool_version=VERSION),
    )
    plan._untimed = problem.target == "torchrun" and K > 1 and lost
    plan._ahead_over = AHEAD_OVER if ahead_over else UNEVEN_OVER if uneven_over else ""
    plan._held_less = held_less
    return plan


def _first_extra(chain: Chain, i: int) -> int:
    """What keeping a tied copy's new gradient adds to the peak of layer i's backward, which
    makes it (Chain.tied_first; 0 where the profile has no such figure)."""
    return 0 if chain.tied_first is None else int(chain.tied_first[i])


def _copies_made_at(chain: Chain, i: int, j: int) -> int:
    """The layer whose backward makes the gradients of the trainable tied parameters stage
    [i, j) holds copies of (a layer before i uses them too), in the stage's first backward:
    their first use in the stage, the latest of those (B and W go from the last layer; from
    there on all are counted, some early). The stage's first layer (i): they are made inside
    its transient, profiled as a temporary gradient added into one already there, and exist
    from the action's end (StageBytes.late_grad_at_end); a later one: they wait through the
    layers before it, each on top of their own transient (StageBytes.late_live)."""
    use = i
    for k, (_, layers) in enumerate(chain.tied):
        mine = [x for x in layers if i <= x < j]
        if k not in chain.frozen_tied and mine and any(x < i for x in layers):
            use = max(use, min(mine))
    return use


def _state_bytes(sizes: StageBytes, per_device: int) -> StateBytes:
    return StateBytes(
        **{
            k: v
            for k, v in vars(sizes).items()
            # (unset: left out of the plan, and only an interleaved device reads
            # them: a plan of one stage per device stays readable by an older tool)
            if k not in StateBytes.LATER_FIELDS
            or (
                v
                and (
                    per_device > 1 or k in ("runtime", "late_grad", "late_grad_at_end", "late_live")
                )
            )
        }
    )


def stage_bytes(stage: StagePlan, rest: bool = False) -> StageBytes:
    """What the simulator counts of a stage's micro-batches (`rest`: of those one sample
    smaller, where the batch splits unevenly)."""
    got = (
        stage.state_bytes_rest if rest and stage.state_bytes_rest else stage.state_bytes
    ).model_dump()
    if got["stop_live"] is None:  # a plan made before it was counted: the whole forward
        got["stop_live"] = got["remat_live"]
    for name in StateBytes.LATER_FIELDS:  # (a plan without them: nothing carried across)
        got[name] = got.get(name) or 0
    return StageBytes(**got)


def stage_costs(
    stages: list[StagePlan],
    runtime: RuntimeOverhead | None = None,
    device_type: str = "cpu",
    *,
    step_sync_ms: float | None = None,
    larger: int = 0,
) -> Costs:
    """What the simulator charges each of the plan's stages (per micro-batch) and cuts, and
    what the runtime adds per action and per step (the profile's `runtime`, and for the
    torchrun program its all-reduces, the cluster's `step_sync_ms`); on a GPU
    (`device_type`, the profile's) the torchrun program's communication runs over NCCL,
    each rank's in the order posted (Costs.ordered_p2p). `larger`: where the batch splits
    unevenly, how many micro-batches are the larger ones (the rest count state_bytes_rest)."""
    uneven = larger and any(st.state_bytes_rest is not None for st in stages)
    routed = any(st.grads_back is not None for st in stages)
    return Costs(
        memory_rest=[stage_bytes(st, rest=True) for st in stages] if uneven else None,
        larger=larger if uneven else 0,
        ordered_p2p=device_type.split(":")[0] == "cuda",
        forward=[st.forward_ms for st in stages],
        backward=[st.backward_ms for st in stages],
        input_grad=[st.input_grad_ms for st in stages],
        weight_grad=[st.weight_grad_ms for st in stages],
        recompute=[st.recompute for st in stages],
        transfer=[st.send_ms for st in stages[:-1]],
        late_transfer=(
            [st.send_ms if st.late_send_ms is None else st.late_send_ms for st in stages[:-1]]
            if any(st.late_send_ms is not None for st in stages[:-1])
            else None
        ),
        memory=[stage_bytes(st) for st in stages],
        action_overhead=runtime.action_ms if runtime is not None else 0.0,
        step_overhead=(runtime.step_ms if runtime is not None else 0.0) + (step_sync_ms or 0.0),
        call_overhead=runtime.call_ms if runtime is not None else 0.0,
        input_calls=[
            input_calls(st.index, st.layers, len(stages), st.state_bytes.grad) for st in stages
        ],
        grads_back=(
            [None if st.grads_back is None else dict(st.grads_back) for st in stages]
            if routed
            else None
        ),
        # a chain's stage whose input needs no gradient (a frozen prefix before it) sends
        # none back (a captured graph's are timed as sent: over, where its runtime sends none
        # after a frozen prefix)
        sends_grads=None if routed else [st.state_bytes.grad > 0 for st in stages],
        grads_back_rest=(
            [None if st.grads_back_rest is None else dict(st.grads_back_rest) for st in stages]
            if uneven and any(st.grads_back_rest is not None for st in stages)
            else None
        ),
    )


def input_calls(s: int, layers: tuple[int, int], num_stages: int, grad_bytes: int) -> int:
    """The autograd calls stage s's I makes (codegen/_runtime.py): one, but none on a stage of
    one layer that hands on to another stage and receives nothing that needs a gradient
    (`grad_bytes`, the gradient it sends back per micro-batch, is 0: the first stage, or a
    captured graph's stage that reads only the model's input or nothing): W then starts from
    its layer's output gradient, and nothing asks for another."""
    one = layers[1] - layers[0] == 1
    return 0 if one and s < num_stages - 1 and grad_bytes == 0 else 1


def simulate_stages(
    schedule: str,
    num_devices: int,
    microbatches: int,
    stages: list[StagePlan],
    *,
    levels: bool = True,
    routes: tuple[tuple[int, int], ...] = (),
    runtime: RuntimeOverhead | None = None,
    larger: int = 0,
) -> Timeline:
    """Run the plan's schedule through the simulator with the plan's own stage costs
    (`levels=False`: peaks only, not each device's memory over time; `larger`: stage_costs')."""
    sched = plan_schedule(schedule, num_devices, microbatches, routes)
    return simulate(sched, stage_costs(stages, runtime, larger=larger), levels=levels)


def simulate_plan(plan: Plan, *, levels: bool = True, rendezvous: bool | None = None) -> Timeline:
    """The plan's own schedule, routes and stage costs through the simulator; `rendezvous`:
    the program the torchrun target runs (`torchrun_schedule`), as it runs it (by default
    when that is the plan's target, whose times then match the plan's)."""
    if rendezvous is None:
        rendezvous = plan.target == "torchrun"
    larger = plan.batch_size % plan.microbatches
    if not rendezvous or len(plan.devices) == 1:
        return simulate_stages(
            plan.schedule, len(plan.devices), plan.microbatches, plan.stages, levels=levels,
            routes=_routes(plan), runtime=plan.runtime, larger=larger,
        )  # fmt: skip
    return simulate(
        torchrun_schedule(plan),
        stage_costs(
            plan.stages,
            plan.runtime,
            plan.device_type,
            step_sync_ms=plan.cluster.step_sync_ms,
            larger=larger,
        ),
        levels=levels,
        rendezvous=True,
    )


def torchrun_schedule(plan: Plan, schedule: Schedule | None = None) -> Schedule:
    """`schedule` (by default the plan's own) with the communication the torchrun target
    posts: of the lowerings that meet where sends block, the one the simulator finds fastest
    under the plan's costs (insert_comms): the one the plan names (`lowering`), made alone,
    where its content is what it was sealed with (a file, or the search's own plan); else
    found again (a copy of a plan with other stages or costs)."""
    costs = stage_costs(
        plan.stages, plan.runtime, plan.device_type, step_sync_ms=plan.cluster.step_sync_ms
    )  # (the search's own: the same lowering, whatever the sync does to near ties)
    own = schedule_of(plan)
    sealed = plan.lowering is not None and plan.meta.content_digest == plan.digest()
    if sealed and (schedule is None or schedule is own or schedule == own):
        # the one the search found fastest, made again alone (the others are not timed)
        lowered = lowering_of(own, costs, plan.lowering)  # type: ignore[arg-type]
        if lowered is not None:  # (else named by another version: searched again)
            return lowered
    return insert_comms(schedule or own, costs)


_HOLDS_RANK = {"1f1b": 0, "zb-h1": 1, "interleaved-1f1b": 2, "gpipe": 3}
# (_infeasible relies on per-stage candidates coming before never and except_last)
_SMALL_RANK = {"always": 0, PER_STAGE: 1, "except_last": 2, "never": 3}


def _by_turns(order: list[int], key: Callable[[int], Any]) -> list[int]:
    """`order`'s items, taken by turns from `order` sorted by `key` and from `order` itself,
    each once."""
    other = sorted(order, key=key)
    out: list[int] = []
    seen: set[int] = set()
    for pair in zip(other, order):
        for q in pair:
            if q not in seen:
                seen.add(q)
                out.append(q)
    return out


def _likely_fit(cand: Candidate) -> tuple[int, int]:
    """Of candidates not searched yet past the time limit with no plan, which likely fits:
    per-stage recomputation first (it fits wherever recomputing every stage does, and may
    run faster), then the schedules that hold fewer micro-batches (as _likely_small; the
    caller then takes the better bound first, which, unlike the most micro-batches, weighs
    what each costs)."""
    rank = 0 if cand.recompute == PER_STAGE else 1 + _SMALL_RANK.get(cand.recompute, 4)
    return (rank, _HOLDS_RANK.get(cand.schedule, 4))


def _likely_small(cand: Candidate) -> tuple[int, int, int]:
    """Of candidates that fit nowhere, which likely needs least memory (_infeasible)."""
    return (
        _SMALL_RANK.get(cand.recompute, 4),
        _HOLDS_RANK.get(cand.schedule, 4),
        -cand.microbatches,
    )


_Fit = tuple[list[StageSpec], Partition, bool, int]


def _fits_within(problem: _Problem, cand: Candidate) -> Callable[..., _Fit | None]:
    """fits(budget): a split of `cand` that fits when every device with less memory than
    `budget` is raised to it, the specs it was solved with, whether those are halved
    (interleaved stages first each on half a device, sufficient; then each free to use it all
    and the fastest split the device checked with both, what the search also tries), and the
    least budget at which the same split still fits the same way (at most `budget`; one stage
    per device: every budget from there up fits, so a search for the least need not look
    between the two; interleaved: `budget` itself, see _infeasible)."""
    chain, memory = problem.chain(cand)
    times = _balance_times(chain, cand)
    cuts = _cut_costs(problem.cluster, cand, chain)
    devices = problem.cluster.devices
    v = cand.per_device

    def fits(budget: int, solved: bool = False) -> _Fit | None:
        """`solved`: the split is the fastest that fits (else any that fits, found faster)."""
        specs = _stage_specs(problem, cand, budget)
        bounds = fitting_split(times, memory, specs, cuts=cuts)
        if bounds is not None and v > 1 and problem.measured_smaller(cand):
            # Each stage within half its device at the larger size: the smaller micro-batches'
            # working memory may be larger, as their plan counts it (_fits_jointly_by_bound's
            # case). Such a split fits where its devices' peaks do; else as below.
            part = fastest(specs)
            totals = _device_peaks(problem, cand, specs, part)
            if all(t <= max(d.memory_bytes, budget) for t, d in zip(totals, devices)):
                return specs, part, True, budget
        elif bounds is not None:
            part = fastest(specs) if solved else Partition(bounds=bounds, bottleneck=math.nan)
            return specs, part, v > 1, budget if v > 1 else need_of(specs, part, budget)
        if v == 1:
            return None
        whole = _stage_specs(problem, cand, budget, halve=False)
        if fitting_split(times, memory, whole, cuts=cuts, split=False) is None:
            return None  # no split fits with each stage on its whole device
        part = fastest(whole)
        totals = _device_peaks(problem, cand, whole, part)
        fit = all(t <= max(d.memory_bytes, budget) for t, d in zip(totals, devices))
        # (another budget may solve to another split: this one's is known to fit only here)
        return (whole, part, False, budget) if fit else None

    def fastest(specs: list[StageSpec]) -> Partition:
        part = solve_partition(times, memory, specs, cuts=cuts)
        assert part is not None
        return part

    def need_of(specs: list[StageSpec], part: Partition, budget: int) -> int:
        """The largest of the raised devices' stages, each at its least total over its
        options."""
        raised = [
            (s, i, j) for s, (i, j) in enumerate(part.stages)
            if devices[s].memory_bytes < budget
        ]  # fmt: skip
        shapes = [(s, i, j, sh) for s, i, j in raised for sh in specs[s].shapes]
        totals = memory._totals(
            np.array([i for _, i, _, _ in shapes], dtype=np.int64),
            np.array([j for _, _, j, _ in shapes], dtype=np.int64),
            [sh for *_, sh in shapes],
            np.arange(len(shapes) + 1),
        )
        least: dict[int, int] = {}
        for (s, *_), total in zip(shapes, totals.tolist()):
            least[s] = min(least.get(s, total), total)
        return max(least.values(), default=0)

    return fits


def _none_fits_any(
    problem: _Problem, group: list[Candidate], budget: int, which: str = "exact"
) -> bool:
    """Whether no candidate of `group` (one micro-batch size, one number of stages) fits
    `budget` (every device with less raised to it, each stage free to use its whole device:
    what _fits_within tries last), shown by one split search where each stage may take the
    shape of any candidate there: every candidate's split is such a split, so where none fits,
    no candidate's does. (Looser than each candidate alone: where one fits, each is tried.)"""
    if not group:
        return True
    cand = group[0]
    chain, memory = problem.chain(cand)
    options: dict[tuple, np.ndarray] = {}  # per option: its shape on every stage, its times
    for c in group:
        specs = _stage_specs(problem, c, budget, halve=False, which=which)
        times = _balance_times(chain, c)
        for x in range(len(c.modes)):
            options.setdefault(tuple(sp.shapes[x] for sp in specs), times[x])
    columns = list(options)
    specs = [
        StageSpec(sp.speed, sp.budget, columns[0][s], tuple(col[s] for col in columns[1:]))
        for s, sp in enumerate(_stage_specs(problem, cand, budget, halve=False))
    ]
    cuts = _cut_costs(problem.cluster, cand, chain)
    # (memory_split first whatever the chain's length: the tables of so many shapes, each at
    # a budget of its own, would serve no later test)
    return not feasible_split(np.stack(list(options.values())), memory, specs, cuts, reach_from=0)


def _no_state_above(
    rest: StageBytes, sizes: StageBytes, keys: tuple[str, ...] = STATES
) -> StageBytes:
    """A smaller micro-batch's bytes, no state above the larger's (B's pulled gradient, raised
    so that a stage grows with its end, was above it on a last stage at one sample, where the
    larger's was none: found by a red team). Its working memory (the transients) may be
    larger, as measured: convolutions on a CPU take more at one sample than at two (a U-Net's
    device was 32% over its plan where they were capped too: found by a red team). `keys`:
    STATES + TRANSIENTS for what the split search, solved at the larger size, counts."""
    return dataclasses.replace(rest, **{k: min(getattr(rest, k), getattr(sizes, k)) for k in keys})


def _uneven_over(
    cand: Candidate,
    K: int,
    modes: list[str],
    routes: tuple,
    pairs: list[tuple[StageBytes, StageBytes]],
    larger: int,
    devices: list[DeviceUse],
) -> bool:
    """Whether a device overran its budget only by the working memory of a smaller micro-batch
    of an uneven batch beyond the larger's, which the split search (solved at the larger size)
    does not count: it would fit with them capped at the larger's."""
    sizes = [b for b, _ in pairs]
    capped = [_no_state_above(r, b, STATES + TRANSIENTS) for b, r in pairs]
    if capped == [r for _, r in pairs] or all(d.total <= d.budget for d in devices):
        return False
    schedule = plan_schedule(cand.schedule, K, cand.microbatches, routes)
    counted = peaks(schedule, modes, sizes, smaller=capped, larger=larger)
    return all(x <= d.budget for x, d in zip(counted, devices))


def _device_peaks(
    problem: _Problem, cand: Candidate, specs: list[StageSpec], part: Partition
) -> list[int]:
    """Each device's peak under a split, as its plan (_build_plan) would say: for a chain on
    the streams target, the same stage bytes through the same `peaks` its simulation takes,
    without the rest of the plan; else the plan's own. (On an uneven batch, at least it.)"""
    chain, memory = problem.chain(cand)
    if chain.flow is not None or problem.target != "streams":
        plan = _build_plan(problem, cand, specs, part, "probe-bisection")
        return [d.total for d in plan.devices]
    modes = _stage_modes(cand, part)
    lo, hi = np.array([i for i, _ in part.stages]), np.array([j for _, j in part.stages])
    shapes = [spec.shapes[cand.modes.index(modes[s])] for s, spec in enumerate(specs)]
    sizes = memory.stages_bytes(lo, hi, shapes)
    schedule = plan_schedule(cand.schedule, problem.cluster.size, cand.microbatches)
    counted = peaks(schedule, modes, sizes)
    if larger := problem.larger(cand):
        # An uneven batch: every micro-batch at the larger size, as the split search counts
        # them, and at least what the plan counts, the ones from batch % M on at their own
        # bytes (their working memory may be larger). Only the plan's own figure let the
        # bisection for the least memory find budgets that fit one split and not the next
        # larger one (a faster interleaved plan was missed: found by this suite).
        smaller = problem.memory_of(chain.mb - 1).stages_bytes(lo, hi, shapes)
        rest = [_no_state_above(r, b) for r, b in zip(smaller, sizes)]
        own = peaks(schedule, modes, sizes, smaller=rest, larger=larger)
        counted = [max(a, b) for a, b in zip(counted, own)]
    return counted


def _shown(
    problem: _Problem, cand: Candidate, found: tuple[list[StageSpec], Partition, bool] | None
) -> Plan:
    """The plan of a split `_fits_within` found, against the cluster's own budgets."""
    assert found is not None
    specs, part, halved, _ = found  # (solved: fits(budget, solved=True))
    real = [
        StageSpec(sp.speed, spec.budget, sp.shape, sp.more)
        for sp, spec in zip(specs, _stage_specs(problem, cand, halve=halved))
    ]
    return _build_plan(problem, cand, real, part, "probe-bisection")


def _least(fits: Callable[..., _Fit | None], need: int | None, floor: int = 1) -> int | None:
    """The least budget `fits` takes, by bisection; only if below `need` (then one try just
    below it first, and a search only where that fits). `floor`: a budget below which nothing
    fits (_static_need). Each budget that fits says the least its split takes: the bisection
    goes on from there."""
    lo = max(floor, 1) - 1  # known not to fit (nothing fits in 0 bytes)
    if need is None:
        hi = lo + 1
        # (no further than the most a device may have: plans past it are not made)
        while hi < MAX_BYTES and not (found := fits(hi)):
            hi = min(2 * hi, MAX_BYTES)
        if hi >= MAX_BYTES and not (found := fits(MAX_BYTES)):
            return None
    else:
        hi = need - 1
        if hi <= lo or not (found := fits(hi)):  # no closer than the closest so far: one try
            return None
    hi = max(found[3], lo + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = fits(mid)
        # (what fits at mid takes at most mid: kept so, the bisection ends whatever fits says)
        lo, hi = (lo, min(mid, max(found[3], lo + 1))) if found else (mid, hi)
    return hi


def _static_need(problem: _Problem, cand: Candidate) -> int:
    """The least budget, every device with less memory raised to it (as _stage_specs does), at
    which the devices together can hold the model's weights, gradients, optimizer slots and
    buffers (MemoryModel.static, the same for every candidate): below it no split fits. 0
    where the cluster as it is holds them."""
    _, memory = problem.chain(cand)
    need = memory.static(OPTIMIZER_SLOTS[problem.optimizer])
    mems = [d.memory_bytes for d in problem.cluster.devices]
    if sum(mems) >= need:
        return 0
    lo, hi = 0, max(need, *mems)  # sum(max(m, hi)) >= len(mems) * hi >= need
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(max(m, mid) for m in mems) >= need else (mid, hi)
    return hi


AHEAD_OVER = (
    "a split overran a device only by what its torchrun program holds beyond the split "
    "search's count (a gradient received ahead of the backward that reads it, or what a batch "
    "of sends and receives holds while it goes), which the split search does not see (a slower "
    "split of that candidate may fit; plan with more memory, or with --target streams)"
)


UNEVEN_OVER = (
    "a split overran a device only by the working memory of the batch's smaller micro-batches "
    "beyond the larger ones' (measured so by the profile: a convolution on a CPU may take more "
    "at fewer samples), which the split search, solved at the larger size, does not see (a "
    "slower split of that candidate may fit; plan with more memory, or with a batch size the "
    "micro-batches divide)"
)


HELD_LESS = (
    "memory bound the split search (or its solver does not say whether it did), which counts "
    "each message between stages where the issue order has it; the torchrun program holds less "
    "on some device (its receives posted later, or its sends let go sooner), so a faster split "
    "may fit"
)


def _overruns(plan: Plan, budget: int) -> bool:
    """Whether a plan made against the cluster's own budgets overruns a device once every device
    with less memory than `budget` is raised to it."""
    return any(d.total > max(d.budget, budget) for d in plan.devices)


PLANNED_TRIES = 32  # whole searches at most, bisecting for a need that plans
PLANNED_SECONDS = 30.0  # and no new one past this many seconds of them


def _raised(problem: _Problem, budget: int) -> _Problem:
    """The same problem with every device with less memory than `budget` raised to it (equal
    devices: each given `budget`, whatever they have), its caches shared where they do not
    depend on a device's memory."""
    cluster = problem.cluster
    equal = len({d.memory_bytes for d in cluster.devices}) == 1
    devices = [
        d.model_copy(update={"memory_bytes": budget if equal else max(d.memory_bytes, budget)})
        for d in cluster.devices
    ]
    raised = copy.copy(problem)  # (its caches shared, its profile table not made again)
    raised.cluster = cluster.model_copy(update={"devices": devices})
    raised.splits = {}  # (but for the splits solved: those depend on the memory)
    return raised


def _planned_need(
    problem: _Problem,
    shown: _Problem,
    candidates: list[Candidate],
    need: int,
    closest: Plan,
    deadline: float | None,
) -> tuple[int, Plan, bool]:
    """Where the closest plan's program holds more than the split search counts (a torchrun
    program's gradients received ahead of their backward, its batches of messages in flight;
    an uneven batch's smaller micro-batches' working memory beyond the larger ones'),
    `plan` at the split search's `need` fails (found by a red team: 12 of 200 small torchrun
    cases were told a need at which `plan` then failed). The closest plan itself fits from
    `held`, the most any device it overruns holds: there `plan` returns it (on equal devices
    this search finds it again whatever the devices' memory, and it fits), unless the search
    finds a plan first. Below that, the whole search (`_search`, every candidate) is bisected
    down from there to a budget one byte below which it finds nothing, above what is known
    to fail (the split search's need, and the devices' own memory). Whether a budget plans
    need not carry over to a larger one (the fastest split moves with it): the least found,
    not proven the least (on equal devices, _infeasible then takes the least the plan found
    holds). Returns the need, a plan that fits there (made against the cluster's own budgets,
    as _shown's), and whether PLANNED_TRIES, PLANNED_SECONDS or `deadline` cut the bisection
    short. `shown`: the problem on the cluster as it is, which plans are made against."""
    held = max(d.total for d in closest.devices if d.total > max(d.budget, need))
    mems = [d.memory_bytes for d in problem.cluster.devices]
    # (equal devices: each given the budget, whatever they have, so that this search is the
    # same on the cluster with any memory, and `plan` with the need finds what it found)
    lo = need - 1 if min(mems) == max(mems) else max(need - 1, min(mems))
    hi, plan = held, closest
    tries = 0
    # (each try is a whole search, which at a tight budget on a large model may take long)
    stop = time.perf_counter() + PLANNED_SECONDS
    stop = stop if deadline is None else min(stop, deadline)
    while hi - lo > 1:
        if tries >= PLANNED_TRIES or time.perf_counter() > stop:
            return hi, plan, True
        tries += 1
        mid = (lo + hi) // 2
        won, cand, _ = _search(
            _raised(problem, mid), candidates, solve_partition, "probe-bisection", None, False
        )
        if won is None or cand is None:
            lo = mid
        else:
            hi, plan = mid, _rebudgeted(shown, cand, won)
    return hi, plan, False


def _rebudgeted(problem: _Problem, cand: Candidate, plan: Plan) -> Plan:
    """The same split made into a plan against the cluster's own budgets (a plan the search
    made on a cluster of raised memory)."""
    chain, _ = problem.chain(cand)
    # (the plan's last stage ends at the model's last layer; the chain's, past its loss)
    bounds = [st.layers[0] for st in plan.stages] + [chain.num_layers]
    part = Partition(
        bounds=bounds,
        bottleneck=plan.predicted.bottleneck_ms,
        choices=[cand.modes.index(st.recompute) for st in plan.stages],
    )
    specs = _stage_specs(problem, cand, halve=False)
    return _build_plan(problem, cand, specs, part, "probe-bisection")


def _infeasible(
    problem: _Problem,
    candidates: list[Candidate],
    floor: int = 0,
    deadline: float | None = None,
    progress: bool = False,
) -> InfeasibleError:
    """Find the least memory per device that any candidate split needs (a min-max partition on
    memory, by bisection on a budget that every device with less is raised to: on equal devices
    the memory each needs, on mixed ones what the small ones need while the large keep theirs),
    and say how far each device falls short. `floor`: a budget below which none fits
    (_static_need). Past `deadline` (time.perf_counter()), once one candidate's need is known,
    the others are left untried and the message says so (the need is then one that fits, not
    proven the least). `progress`: a bar on stderr while the candidates are tried (at 1 000
    layers on 64 devices that takes tens of seconds)."""
    cluster = problem.cluster
    shown = problem  # (the closest plans are made against the cluster's own budgets)
    if len({d.memory_bytes for d in cluster.devices}) == 1:
        # Equal devices: each budget tried is every device's memory, whatever they have, so
        # that the need found is the same on this cluster with any memory (there `plan` finds
        # it again). Raised from what they have, budgets below it were all alike: a cluster
        # whose split overran its devices only by what a torchrun program holds beyond the
        # split search's count was said to need 1 byte.
        problem = _raised(problem, 1)
        floor = max(floor, _static_need(problem, candidates[0]))
    need: int | None = None
    closest: Plan | None = None
    # Likely least memory first (each later candidate then takes one try below the least so
    # far, and a bisection only where it does better): whole-stage recomputation, the
    # schedules that hold fewer micro-batches, smaller micro-batches.
    chosen: Candidate | None = None
    chosen_fits: Callable[..., _Fit | None] | None = None
    alike: set[tuple] = set()
    tried: set[tuple[int, str]] = set()  # (M, schedule) of the per-stage candidates tried
    united: dict[tuple, bool] = {}  # (size and stage count, least so far): none of those fits
    ordered = sorted(candidates, key=_likely_small)
    untried = 0
    bar = _progress_bar(len(ordered), progress, "no split fits; finding the least memory")
    with bar as tick:
        for n, cand in enumerate(ordered):
            if need is not None and deadline is not None and time.perf_counter() > deadline:
                untried = len(ordered) - n
                break
            tick()
            if (
                cand.per_device == 1
                and cand.recompute in ("never", "except_last")
                and ((cand.microbatches, cand.schedule) in tried)
            ):
                # its per-stage twin, tried before it (_SMALL_RANK), may choose its mode on every
                # stage: it fits every budget this one fits, so this one needs no less
                continue
            if cand.per_device == 1 and cand.recompute == PER_STAGE:
                tried.add((cand.microbatches, cand.schedule))
            if need is not None:
                # One test for the candidates left of its size and stage count (_none_fits_any):
                # where none of them fits just below the least so far, none is tried alone. With
                # their occupancy floors first (made faster than their exact occupancy, and enough
                # for most); with the exact ones too on one stage per device.
                group = (problem.costs(cand).mb, cand.per_device)
                if (group, need) not in united:
                    rest = [c for c in ordered[n:] if (problem.costs(c).mb, c.per_device) == group]
                    united[(group, need)] = _none_fits_any(problem, rest, need - 1, "floor") or (
                        cand.per_device == 1 and _none_fits_any(problem, rest, need - 1)
                    )
                if united[(group, need)]:
                    continue
            if cand.per_device == 1:
                # What fits reads of a candidate with one stage per device is the chain at its
                # micro-batch size, its stage shapes and where cuts may go (the same for every
                # candidate of that size; never its times, nor its schedule's name): candidates
                # alike in those (1F1B's and zero bubble's past their steady state) need the
                # same least budget, and only the first is searched
                _stage_specs(problem, cand)  # (its shapes, kept in problem.shapes)
                key = (problem.costs(cand).mb, tuple(map(tuple, problem.shapes[(cand, "exact")])))
                if key in alike:
                    continue
                alike.add(key)
            fits = _fits_within(problem, cand)
            # (interleaved: whether a budget fits need not carry over to a larger one, so the
            # least budget is a bisection's from nothing, as it always was)
            least = _least(fits, need, floor if cand.per_device == 1 else 0)
            if least is not None:
                need, chosen, chosen_fits = least, cand, fits
    if chosen is not None and chosen_fits is not None and need is not None:
        # (only the closest one's split is solved for speed and made a plan)
        closest = _shown(shown, chosen, chosen_fits(need, True))
    if closest is not None and closest.fits and not untried:
        # An interleaved split fits the cluster as it is, its devices checked with both
        # stages (which the split search does not do). Each such candidate's split at its own
        # least memory is one that does (a split's choice moves with the budget, so this is
        # a heuristic, marked unproven): of those that fit, the fastest.
        for cand in candidates:
            if cand.per_device == 1 or cand == chosen:
                continue
            fits = _fits_within(problem, cand)
            least = _least(fits, None)
            if least is not None:
                plan = _shown(shown, cand, fits(least, True))
                if plan.fits and plan.predicted.iteration_ms < closest.predicted.iteration_ms:
                    closest = plan
    if need is None or closest is None:
        return InfeasibleError(
            f"no split fits even in {format_size(MAX_BYTES)} per device, the most gpipe-plan "
            "plans for",
            INT64_SAFE,
            None,
        )
    cut = False
    if _overruns(closest, need):
        need, closest, cut = _planned_need(problem, shown, candidates, need, closest, deadline)
    worst = max(closest.devices, key=lambda d: d.total - d.budget)
    mixed = len({d.memory_bytes for d in cluster.devices}) > 1
    if not mixed and worst.total < need:
        # The split search counts each stage as the issue order holds it (a captured graph's
        # far inputs as they could arrive first); the closest plan, its real routes and, for
        # torchrun, its program, may hold less. On equal devices that plan is what `plan`
        # returns from this budget up (this search, run again there, finds the same split),
        # and below it nothing fits: the least memory is its largest device's (found by a red
        # team: a GPT under torchrun was told 7 922 176 bytes, and planned in 7 889 408).
        need = worst.total
    small = [d.name for d in cluster.devices if d.memory_bytes < need]
    where = (
        f"on every device with less ({', '.join(small)}; the others as they are)"
        if mixed and len(small) < len(cluster.devices)
        else "per device"
    )
    left = (
        f" (the time limit stopped the search with {untried} of {len(ordered)} candidates not "
        "looked at: one of them may need less)"
        if untried
        else " (the search for the least stopped early: it plans with this, and may with less)"
        if cut
        else ""
    )
    if all(c.per_device > 1 for c in ordered):  # (found by a review: 6 149 bytes did, 7 709 said)
        left += (
            " (interleaved: the split is searched stage by stage and each device's stages are "
            "counted together after, so a split that fits with less may have been missed)"
        )
    return InfeasibleError(
        f"no split fits: the best one {'found ' if untried else ''}(M={closest.microbatches}, "
        f"{closest.schedule}, recompute {closest.recompute}) needs "
        f"{format_size(need, up=True)} ({need} bytes) {where}; {worst.name} would need "
        f"{format_size(worst.total, up=True)} of {format_size(worst.budget)} (over by "
        f"{format_size(worst.total - worst.budget, up=True)}){left}",
        need,
        closest,
    )
