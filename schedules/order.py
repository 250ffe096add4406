"""The issue order: the one sequence in which a single host issues every compute action.

A compiled pipeline on one host issues each action in turn (on CUDA the kernels then run on the
stages' streams, overlapping; on CPU they simply run). Memory is allocated and freed as the host
issues work, so what each device holds at any moment is fixed by this order alone. It is chosen
from the schedule alone, never from measured costs: then the planner can know each stage's
memory before it knows the split, and the simulator, the planner and the compiled program all
replay the same order.

The order: run the schedule through the simulator with unit costs (F = 1, B = 2, I = W = 1),
then issue actions by their start there, each after everything it depends on (ties: lower rank
first, then program order). Recomputation does not enter: a stage's states then move with its
own recomputation alone, so each stage may choose its own and its memory stays a function of
its layers and that choice (what keeps the per-stage search exact).

    1f1b, K = 2, M = 3:  0F0 0F1 1F0 1B0 0B0 1F1 1B1 0F2 0B1 1F2 1B2 0B2
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter
from typing import TypeVar

import numpy as np

from .ir import COMPUTE, Action, Schedule

T = TypeVar("T")


def issue_order(schedule: Schedule, start: dict[Action, float]) -> list[Action]:
    """Every compute action once, each after all it depends on; among the actions that could go
    next, the one that starts first in `start`."""
    from .validate import dependencies, split_stages

    sched = schedule.compute_only()
    split = split_stages(sched)
    ptr = dict.fromkeys(sched.ranks, 0)
    done: set[Action] = set()
    waiting: dict[Action, list[int]] = {}
    heap: list[tuple[float, int, int, Action]] = []

    def offer(r: int) -> None:
        if ptr[r] == len(sched.ranks[r]):
            return
        a = sched.ranks[r][ptr[r]]
        missing = next((d for d in dependencies(a, sched, False, split) if d not in done), None)
        if missing is None:
            heapq.heappush(heap, (start[a], r, ptr[r], a))
        else:
            waiting.setdefault(missing, []).append(r)

    for r in sched.ranks:
        offer(r)
    order: list[Action] = []
    while heap:
        _, r, _, a = heapq.heappop(heap)
        order.append(a)
        done.add(a)
        ptr[r] += 1
        offer(r)
        for rr in waiting.pop(a, []):
            offer(rr)
    if len(order) != sum(len(a) for a in sched.ranks.values()):
        from .validate import validate

        validate(sched)  # raises with the grid
        raise AssertionError("issue order incomplete for a schedule that validates")
    return order


def canonical_order(schedule: Schedule, recompute: str | Sequence[str] = "never") -> list[Action]:
    """The issue order of `schedule`; the same under every recomputation `recompute` (one mode,
    or one per stage: accepted so that callers need not know that)."""
    return list(_canonical(schedule, ())[0])


def issue_arrays(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The issue order as arrays: each action's kind (F 0, B 1, I 2, W 3), stage, micro-batch."""
    return _canonical(schedule, ())[1]


def program_arrays(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compute actions rank after rank, each in program order, as issue_arrays has them
    (no issue order is made); kept per schedule, as the issue order is."""
    return kept(_PROGRAMS, schedule_key(schedule, ("program",)), lambda: _program_arrays(schedule))


def kept(cache: dict[tuple, T], key: tuple, make: Callable[[], T]) -> T:
    """make(), kept in `cache` under `key` (at most 256 kept: past that the cache starts over)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) > 256:
            cache.clear()
        hit = cache[key] = make()
    return hit


_PROGRAMS: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _program_arrays(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from .waves import KIND_CODE

    acts = [a for _, acts in sorted(schedule.ranks.items()) for a in acts if a.kind.is_compute]
    n = len(acts)
    arrays = (
        np.fromiter(map(KIND_CODE.__getitem__, map(attrgetter("kind"), acts)), np.int64, n),
        np.fromiter(map(attrgetter("stage"), acts), np.int64, n),
        np.fromiter(map(attrgetter("microbatch"), acts), np.int64, n),
    )
    for a in arrays:  # kept and shared: nobody writes into them
        a.setflags(write=False)
    return arrays


def schedule_key(schedule: Schedule, modes: tuple[str, ...]) -> tuple:
    """What an issue order (and anything derived from it alone) depends on: the compute actions
    and how they are placed and routed, hashed once per schedule object."""
    return (_identity(schedule)[1], modes)


class _Key:
    """A large hashable value whose hash is computed once (a schedule's actions: hashing them on
    every cache lookup cost more than the lookups saved)."""

    __slots__ = ("value", "hash")

    def __init__(self, value: tuple) -> None:
        self.value = value
        self.hash = hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Key) and self.hash == other.hash and self.value == other.value
        )


def freeze(schedule: Schedule) -> Schedule:
    """Mark a schedule that nobody edits any more (the planner's, made once per name, size and
    routes): its key is then made once and kept on it. Any other schedule's key is made afresh
    at each use, so an edit in place is always seen."""
    schedule._frozen = True  # type: ignore[attr-defined]
    return schedule


def _identity(schedule: Schedule) -> tuple[tuple, _Key, bool]:
    """The schedule's compute content as a _Key (and whether that is all it holds); kept on a
    frozen schedule (see freeze), where edits that change a rank's length, the placement or the
    routes are still noticed."""
    guard = (
        schedule.name,
        schedule.num_stages,
        schedule.num_microbatches,
        tuple(schedule.placement),
        tuple(schedule.routes),
        tuple((r, id(acts), len(acts)) for r, acts in schedule.ranks.items()),
    )
    kept = getattr(schedule, "_identity", None) if getattr(schedule, "_frozen", False) else None
    if kept is None or kept[0] != guard:
        kinds = set(map(attrgetter("kind"), chain.from_iterable(schedule.ranks.values())))
        only = kinds <= set(COMPUTE)
        ranks = tuple(
            (r, tuple(acts) if only else tuple(a for a in acts if a.kind.is_compute))
            for r, acts in sorted(schedule.ranks.items())
        )
        kept = (guard, _Key(guard[:5] + (ranks,)), only)
        if getattr(schedule, "_frozen", False):
            schedule._identity = kept  # type: ignore[attr-defined]
    return kept


def compute_only_key(schedule: Schedule) -> _Key | None:
    """schedule_key(schedule, ()) for a schedule of compute actions only; None if it also
    communicates (a key of its compute alone would then stand for two different schedules)."""
    _, key, only = _identity(schedule)
    return key if only else None


_Order = tuple[tuple[Action, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _canonical(schedule: Schedule, modes: tuple[str, ...]) -> _Order:
    return _cached(schedule_key(schedule, modes), schedule)


_CACHE: dict[tuple, _Order] = {}


def _cached(key: tuple, schedule: Schedule) -> _Order:
    return kept(_CACHE, key, lambda: _unit_cost_order(schedule))


UNIT = (1.0, 2.0, 1.0, 1.0)  # F, B, I, W: the costs the order is simulated with


def _unit_cost_order(schedule: Schedule) -> _Order:
    from .simulate import Costs, simulate
    from .waves import KIND_CODE, durations, run, waves_of

    f, b, i, w = UNIT
    S = schedule.num_stages
    sched = schedule if compute_only_key(schedule) is not None else schedule.compute_only()
    # Every action here takes time, so each one starts after all it depends on has started:
    # issue_order's choice among the ready actions is then simply the order of (start, rank,
    # place in the program), and a sort gives it without walking the dependencies.
    waves = waves_of(sched)
    if waves is not None:  # the same simulation, a wave at a time
        n = len(waves.actions)
        idle = np.zeros((S, schedule.num_microbatches))
        dur = durations(waves, [f] * S, [b] * S, [i] * S, [w] * S, idle, [0.0] * (S - 1))
        start = run(waves, dur)[0][:n]
        rank = np.repeat(np.arange(len(waves.offsets) - 1), np.diff(waves.offsets))
        pos = np.arange(n) - waves.offsets[rank]
        perm = np.lexsort((pos, rank, start))
        order = tuple(waves.actions[k] for k in perm.tolist())
        return order, (waves.kind[perm], waves.stage[perm], waves.mb[perm])
    costs = Costs([f] * S, [b] * S, input_grad=[i] * S, weight_grad=[w] * S)
    timeline = simulate(sched, costs, memory=False)
    keyed = [
        (st, r, p, a)
        for r, acts in sorted(sched.ranks.items())
        for p, (a, st) in enumerate(zip(acts, timeline.starts[r]))
    ]
    keyed.sort(key=lambda x: x[:3])
    order = tuple(a for *_, a in keyed)
    arrays = (
        np.fromiter((KIND_CODE[a.kind] for a in order), np.int64, len(order)),
        np.fromiter((a.stage for a in order), np.int64, len(order)),
        np.fromiter((a.microbatch for a in order), np.int64, len(order)),
    )
    return order, arrays
