"""simulate(schedule, costs) -> Timeline: exact, event-driven.

Each rank runs its actions in order; an action starts when its rank is free and its inputs have
arrived. A tensor crossing ranks travels on the link of its cut (one link per cut and direction,
transfers on it in the sender's order, overlapping compute). Memory per rank moves at actions:

    F        + stash              (activations, or only the stage input when recomputing)
    B / I    + activations        (only when recomputing: re-materialised before the backward)
    B / W    - everything the micro-batch holds on that stage

so peaks are exact for the model; allocations happen at an action's start and frees at its end.

`rendezvous=True` times the program the torchrun target runs instead: a send holds its rank
until its receive is posted and the message has gone (`_rendezvous_loop`). Every wait of the
default model is in it too, so it is never the faster of the two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .comm import (
    _meets,
    batches,
    insert_comms,
    message_lookup,
    preposted,
    receive_offsets,
)
from .ir import _COMPUTE_KINDS, Action, Kind, Schedule
from .memory import StageBytes, peaks, recomputes, timed_levels
from .validate import comms_of
from .waves import Waves, durations, run, waves_of


@dataclass
class Costs:
    """Per-stage costs of one micro-batch (ms, bytes). Unset I/W split backward in half."""

    forward: Sequence[float]
    backward: Sequence[float]
    input_grad: Sequence[float] | None = None
    weight_grad: Sequence[float] | None = None
    recompute: Sequence[str] | None = None  # per stage: never | always | except_last
    transfer: Sequence[float] | None = None  # per cut s -> s+1, each direction
    # per cut: the same transfer where its receive is posted after its send (the torchrun
    # model only, `rendezvous`: gloo moves it only once told that the receive is posted;
    # cluster.Link's late figures). None: as `transfer`
    late_transfer: Sequence[float] | None = None
    memory: Sequence[StageBytes] | None = None  # per stage (default: count stashed micro-batches)
    # a batch split unevenly: per stage, the bytes of the micro-batches from `larger` on, one
    # sample smaller (None: all as `memory`)
    memory_rest: Sequence[StageBytes] | None = None
    larger: int = 0
    # what the runtime adds: to every compute action (F, B, I, W; a recomputation inside B or
    # I adds its forward's compute only), and once to the step
    action_overhead: float = 0.0
    step_overhead: float = 0.0
    # and to every B and I: the stage's one autograd call, which per-layer figures leave out
    call_overhead: float = 0.0
    # per stage, the autograd calls its I makes (default one each): none on a first stage of
    # one layer, whose input needs no gradient and whose layer's output gradient W takes
    input_calls: Sequence[int] | None = None
    # the torchrun program's point-to-point operations run, on each rank, in the order posted
    # whatever their peer (NCCL: its batches share one communicator): comm.preposted then
    # posts ahead only where nothing the rank sends later could queue behind
    ordered_p2p: bool = False
    # per stage, the gradient bytes it sends back to each stage it takes values from (a
    # captured graph's routes; None: all of memory[t].grad, to the stage before)
    grads_back: Sequence[dict[int, int] | None] | None = None
    # the same for the micro-batches from `larger` on (None: as grads_back)
    grads_back_rest: Sequence[dict[int, int] | None] | None = None
    # per stage, whether it sends gradients back (None: every stage but the first). False
    # where no stage before it trains (a frozen prefix): its input needs no gradient, so no
    # message goes back and the stages before wait for none (the runtime's trains_before)
    sends_grads: Sequence[bool] | None = None

    @classmethod
    def uniform(
        cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, **kw: object
    ) -> Costs:
        return cls([forward] * num_stages, [backward] * num_stages, **kw)  # type: ignore[arg-type]


@dataclass(slots=True)
class Span:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Transfer:
    cut: int  # between stage `cut` and `cut + 1`
    direction: str  # "F" (activations forward) or "B" (gradients back)
    microbatch: int
    start: float
    end: float


@dataclass
class Timeline:
    schedule: Schedule
    starts: list[list[float]] = field(repr=False)  # per rank, per action of its program
    ends: list[list[float]] = field(repr=False)
    raw_transfers: list[tuple[int, int, int, float, float]] = field(repr=False)
    makespan: float
    busy: list[float]
    peak_memory: list[int]
    memory: list[list[tuple[float, int]]] = field(repr=False)  # per rank: (time, bytes) steps

    @property
    def spans(self) -> list[Span]:
        """Every action with its start and end, rank by rank in program order."""
        return [
            Span(r, a, st, en)
            for r, acts in sorted(self.schedule.ranks.items())
            for a, st, en in zip(acts, self.starts[r], self.ends[r])
        ]

    @property
    def transfers(self) -> list[Transfer]:
        return [Transfer(c, "FB"[d], m, st, en) for d, c, m, st, en in self.raw_transfers]

    @property
    def bubble(self) -> list[float]:
        """Idle share of each rank's time."""
        return [1 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        if not self.makespan:
            return 0.0
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def utilisation(self) -> list[float]:
        return [b / self.makespan if self.makespan else 0.0 for b in self.busy]


def _check_costs(S: int, **times: list[float]) -> None:
    """Every time a finite number >= 0, one per stage (per cut for transfers): a NaN or a
    negative time would not fail, it would quietly give a wrong timeline."""
    for name, values in times.items():
        cuts = name in ("transfer", "late_transfer")
        want = S - 1 if cuts else S
        if len(values) != want:
            raise ValueError(
                f"costs.{name}: {len(values)} values for {want} {'cuts' if cuts else 'stages'}"
            )
        bad = [v for v in values if not _finite_time(v)]
        if bad:
            raise ValueError(f"costs.{name}: {bad[0]!r} is not a finite time >= 0")


def _finite_time(v: object) -> bool:
    try:
        return 0 <= float(v) < math.inf  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def simulate(
    schedule: Schedule,
    costs: Costs,
    *,
    memory: bool = True,
    levels: bool = True,
    rendezvous: bool = False,
) -> Timeline:
    """The timeline of `schedule` under `costs`; `memory=False` skips the memory replay, and
    `levels=False` keeps its peaks but not each device's level over time (for drawing).
    `rendezvous`: as the torchrun program runs it, each batch of communication held until
    every message in it has met its other end and gone (`_rendezvous_loop`); a schedule
    without communication actions is lowered first (insert_comms)."""
    S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    modes = list(costs.recompute) if costs.recompute is not None else ["never"] * S
    fwd, bwd, i_cost, w_cost, rec, link = _cost_lists(schedule, costs)
    sends = _sends_list(costs, S)

    w = None if rendezvous else waves_of(schedule, sends)
    if rendezvous:
        if not comms_of(schedule):
            schedule = insert_comms(schedule, costs)
        ahead = preposted(schedule, costs)
        late = _late_list(costs, link)
        run_ = _as_it_runs(
            schedule, fwd, bwd, i_cost, w_cost, rec, link, preposted=ahead, late=late,
            sends=sends,
        )  # fmt: skip
    elif w is not None:
        remat = np.array(rec, dtype=np.float64).reshape(S, M)
        run_ = _by_waves(w, durations(w, fwd, bwd, i_cost, w_cost, remat, link))
    else:
        run_ = _event_loop(schedule, fwd, bwd, i_cost, w_cost, rec, link, sends)
    starts, ends, transfers, busy = run_
    makespan = max([max(e, default=0.0) for e in ends] + [tr[4] for tr in transfers] + [0.0])
    makespan += costs.step_overhead
    memory_steps: list[list[tuple[float, int]]] = [[] for _ in range(R)]
    peak = [0] * R
    if memory:
        sizes = list(costs.memory) if costs.memory is not None else [StageBytes()] * S
        if len(sizes) != S:
            raise ValueError(f"costs give memory for {len(sizes)} stages, the schedule has {S}")
        # the torchrun program: what its ranks hold beyond or short of the issue order, where
        # their messages are posted (a program that does not meet holds its sends to the end)
        ahead, after = (
            receive_offsets(
                schedule, [b.input for b in sizes], [b.grad for b in sizes], costs.grads_back,
                preposted(schedule, costs), sends_held=not _meets(schedule),
                **message_sizes(costs),
            )
            if rendezvous
            else (None, None)
        )  # fmt: skip
        rest = {"smaller": costs.memory_rest, "larger": costs.larger}
        peak = peaks(schedule, modes, sizes, ahead, after, **rest)  # type: ignore[arg-type]
        if levels:
            when: dict[Action, tuple[float, float]] = {}
            for r, acts in schedule.ranks.items():
                for a, st, en in zip(acts, starts[r], ends[r]):
                    when[a] = (st, en)
            memory_steps = timed_levels(schedule, modes, sizes, when, **rest)  # type: ignore[arg-type]
    return Timeline(schedule, starts, ends, transfers, makespan, busy, peak, memory_steps)


def message_sizes(costs: Costs) -> dict[str, Any]:
    """receive_offsets' keywords for the sizes of the messages the costs count: what a stage's
    senders from further back send it and its gradient (`far_bytes`), and an uneven batch's
    smaller micro-batches' messages (`rest`, `larger`, `far_rest`) where the costs count them."""
    rest = smaller_messages(costs)
    memory = list(costs.memory) if costs.memory is not None else None
    return {
        "rest": rest,
        "larger": costs.larger,
        "far_bytes": [(b.early, b.late) for b in memory] if memory is not None else None,
        "far_rest": (
            [(b.early, b.late) for b in costs.memory_rest]
            if rest is not None and costs.memory_rest is not None
            else None
        ),
    }


def smaller_messages(
    costs: Costs,
) -> tuple[list[int], list[int], Sequence[dict[int, int] | None] | None] | None:
    """What an uneven batch's smaller micro-batches send on and back per stage (their inputs,
    their input gradients, a captured graph's per stage it sends to), where the costs count
    them (memory_rest); None where they do not, or a captured graph's gradients sent back are
    known at one size (all at the larger)."""
    if costs.memory_rest is None or not costs.larger:
        return None
    if costs.grads_back is not None and costs.grads_back_rest is None:
        return None
    inputs, grads = [b.input for b in costs.memory_rest], [b.grad for b in costs.memory_rest]
    return inputs, grads, costs.grads_back_rest


_Run = tuple[
    list[list[float]], list[list[float]], list[tuple[int, int, int, float, float]], list[float]
]


def _by_waves(w: Waves, dur: np.ndarray) -> _Run:
    """Starts, ends, transfers and busy time per rank, a wave at a time (waves.py)."""
    start, end = run(w, dur)
    n, off = len(w.actions), w.offsets
    R = len(off) - 1
    starts = [start[off[r] : off[r + 1]].tolist() for r in range(R)]
    ends = [end[off[r] : off[r + 1]].tolist() for r in range(R)]
    # busy: the running sum in program order, as the event loop adds it
    busy = [float(np.cumsum(dur[off[r] : off[r + 1]])[-1]) if off[r + 1] > off[r] else 0.0
            for r in range(R)]  # fmt: skip
    transfers = list(
        zip(w.tr_dir.tolist(), w.tr_cut.tolist(), w.tr_mb.tolist(), start[n:].tolist(),
            end[n:].tolist())
    )  # fmt: skip
    return starts, ends, transfers, busy


def _event_loop(
    schedule: Schedule,
    fwd: list[float],
    bwd: list[float],
    i_cost: list[float],
    w_cost: list[float],
    rec: list[list[float]],  # per stage and micro-batch: its re-materialisation's cost
    link: list[float],
    sends: Sequence[bool] | None = None,  # per stage, whether it sends gradients back
) -> _Run:
    """The event-driven simulation, for any schedule (communication actions included)."""
    S = schedule.num_stages
    place = schedule.placement
    R = schedule.num_ranks
    # Actions as (code, stage, mb) tuples: enum comparisons in the hot loop cost more than the loop.
    code = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3, Kind.SEND_F: 4, Kind.SEND_B: 4,
            Kind.RECV_F: 5, Kind.RECV_B: 6}  # fmt: skip
    programs = [
        [(code[a.kind], a.stage, a.microbatch) for a in schedule.ranks[r]] for r in range(R)
    ]
    avail: dict[tuple[int, int, int], float] = {}  # (what, stage, mb) -> when it is ready there
    X, G, FDONE, IDONE = 0, 1, 2, 3  # input arrived, gradient arrived, own F done, own I done
    link_free: dict[tuple[int, int], float] = {}
    waiting: dict[tuple[int, int, int], list[int]] = {}
    rank_time = [0.0] * R
    busy = [0.0] * R
    ptr = [0] * R
    starts: list[list[float]] = [[] for _ in range(R)]
    ends: list[list[float]] = [[] for _ in range(R)]
    transfers: list[tuple[int, int, int, float, float]] = []
    todo = list(range(R))

    def publish(key: tuple[int, int, int], t: float) -> None:
        avail[key] = t
        w = waiting.pop(key, None)
        if w:
            todo.extend(w)

    def ship(direction: int, cut: int, m: int, t: float, key: tuple[int, int, int]) -> None:
        start = max(t, link_free.get((direction, cut), 0.0))
        end = start + link[cut]
        link_free[(direction, cut)] = end
        transfers.append((direction, cut, m, start, end))
        publish(key, end)

    last = S - 1
    # waits[s]: whether stage s's B or I waits for a gradient from stage s + 1
    waits = [s < last and (sends is None or sends[s + 1]) for s in range(S)]
    while todo:
        r = todo.pop()
        prog = programs[r]
        n = len(prog)
        p = ptr[r]
        t_rank = rank_time[r]
        while p < n:
            c, s, m = prog[p]
            start = t_rank
            # The waits below are written out per kind on purpose: a generic loop over a tuple
            # of keys made the whole simulation 1.5-2x slower (benchmarks/simulate_bench.py).
            if c == 0 or c == 5:  # F or RECV_F: wait for the input
                if s > 0:
                    t = avail.get((X, s, m))
                    if t is None:
                        waiting.setdefault((X, s, m), []).append(r)
                        break
                    if t > start:
                        start = t
            elif c == 1 or c == 2:  # B or I: own forward, and the gradient from the next stage
                t = avail.get((FDONE, s, m))
                if t is None:
                    waiting.setdefault((FDONE, s, m), []).append(r)
                    break
                if t > start:
                    start = t
                if waits[s]:
                    t = avail.get((G, s, m))
                    if t is None:
                        waiting.setdefault((G, s, m), []).append(r)
                        break
                    if t > start:
                        start = t
            elif c == 3:  # W: own I
                t = avail.get((IDONE, s, m))
                if t is None:
                    waiting.setdefault((IDONE, s, m), []).append(r)
                    break
                if t > start:
                    start = t
            elif c == 6 and waits[s]:  # RECV_B
                t = avail.get((G, s, m))
                if t is None:
                    waiting.setdefault((G, s, m), []).append(r)
                    break
                if t > start:
                    start = t
            if c == 0:
                dur = fwd[s]
            elif c == 1:
                dur = bwd[s] + rec[s][m]
            elif c == 2:
                dur = i_cost[s] + rec[s][m]
            elif c == 3:
                dur = w_cost[s]
            else:
                dur = 0.0
            end = start + dur
            t_rank = end
            busy[r] += dur
            p += 1
            starts[r].append(start)
            ends[r].append(end)
            if c == 0:
                publish((FDONE, s, m), end)
                if s < last:
                    if place[s + 1] == r:
                        publish((X, s + 1, m), end)
                    else:
                        ship(0, s, m, end, (X, s + 1, m))
            elif c == 1 or c == 2:
                if c == 2:
                    publish((IDONE, s, m), end)
                if s > 0 and waits[s - 1]:
                    if place[s - 1] == r:
                        publish((G, s - 1, m), end)
                    else:
                        ship(1, s - 1, m, end, (G, s - 1, m))
        ptr[r] = p
        rank_time[r] = t_rank
    if any(ptr[r] < len(programs[r]) for r in range(R)):
        from .validate import validate

        validate(schedule)  # raises with the grid
        raise AssertionError("simulation stalled on a schedule that validates")
    return starts, ends, transfers, busy


def _cost_lists(schedule: Schedule, costs: Costs) -> tuple:
    """Per stage: forward, backward, I and W times, whether each micro-batch recomputes, and
    per cut the transfer time; checked (one per stage, finite, >= 0)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    fwd, bwd = list(costs.forward), list(costs.backward)
    if len(fwd) != S or len(bwd) != S:
        raise ValueError(
            f"costs give {len(fwd)} forward / {len(bwd)} backward times for {S} stages"
        )
    i_cost = list(costs.input_grad) if costs.input_grad is not None else [b / 2 for b in bwd]
    w_cost = (
        list(costs.weight_grad)
        if costs.weight_grad is not None
        else [b - i for b, i in zip(bwd, i_cost)]
    )
    modes = list(costs.recompute) if costs.recompute is not None else ["never"] * S
    link = list(costs.transfer) if costs.transfer is not None else [0.0] * max(S - 1, 0)
    _check_costs(S, forward=fwd, backward=bwd, input_grad=i_cost, weight_grad=w_cost, transfer=link)
    if len(modes) != S or not set(modes) <= {"never", "always", "except_last"}:
        raise ValueError(f"costs.recompute {modes}: one of never, always, except_last per stage")
    extra, call = costs.action_overhead, costs.call_overhead
    if not all(_finite_time(t) for t in (extra, call, costs.step_overhead)):
        raise ValueError(
            "costs.action_overhead, call_overhead and step_overhead: finite times >= 0"
        )
    # a recomputation re-runs the stage's forward inside its B (or I): the compute, not
    # another action of the runtime
    remat = [
        [f if recomputes(mode, m, M) else 0.0 for m in range(M)] for f, mode in zip(fwd, modes)
    ]
    calls = list(costs.input_calls) if costs.input_calls is not None else [1] * S
    if len(calls) != S or not all(isinstance(n, int) and n >= 0 for n in calls):
        raise ValueError(f"costs.input_calls {calls}: a count >= 0 per stage")
    if extra or call:
        fwd, w_cost = ([t + extra for t in ts] for ts in (fwd, w_cost))
        bwd = [t + (extra + call) for t in bwd]
        i_cost = [t + (extra + call * n) for t, n in zip(i_cost, calls)]
    return fwd, bwd, i_cost, w_cost, remat, link


def _sends_list(costs: Costs, S: int) -> tuple[bool, ...] | None:
    """Per stage, whether it sends gradients back (Costs.sends_grads), checked; None where
    every stage does."""
    if costs.sends_grads is None:
        return None
    sends = tuple(costs.sends_grads)
    if len(sends) != S or not all(isinstance(x, (bool, np.bool_)) for x in sends):
        raise ValueError(f"costs.sends_grads {list(sends)}: one True or False per stage")
    sends = tuple(bool(x) for x in sends)
    return None if all(sends[1:]) else sends


def _late_list(costs: Costs, link: list[float]) -> list[float] | None:
    """Per cut, a late receive's transfer time (Costs.late_transfer), checked; None: none
    differs from the hand-off's."""
    if costs.late_transfer is None:
        return None
    late = list(costs.late_transfer)
    _check_costs(len(link) + 1, late_transfer=late)
    if any(a < b for a, b in zip(late, link)):
        raise ValueError("costs.late_transfer: each at least its cut's transfer time")
    return late


def blocking_makespan(lowered: Schedule, costs: Costs, beat: float | None = None) -> float | None:
    """The makespan of `lowered` run with blocking sends, or None where it does not meet there
    (its ranks disagree on the order of their messages, or some rank never gets past a batch):
    what insert_comms weighs its lowerings by. `beat`: a makespan the caller already has; the
    run stops as soon as this one is sure to take longer, and says so with math.inf."""
    from .validate import ScheduleError, check_order

    times = _cost_lists(lowered, costs)
    try:  # (a run that meets nowhere stops as any does: stuck. The order is checked after)
        got = _rendezvous_loop(
            lowered,
            *times,
            sends_block=True,
            preposted=preposted(lowered, costs),
            late_link=_late_list(costs, times[-1]),
            give_up=None if beat is None else (beat, costs.step_overhead),
            sends=_sends_list(costs, lowered.num_stages),
        )
    except _Slower:
        return math.inf
    if got is None:
        return None
    try:
        check_order(lowered)
    except ScheduleError:
        return None
    ends = got[1]
    last = max([max(e, default=0.0) for e in ends] + [tr[4] for tr in got[2]] + [0.0])
    return last + costs.step_overhead


def _as_it_runs(
    schedule: Schedule,
    *times: Any,
    preposted: frozenset[int] = frozenset(),
    late: list[float] | None = None,
    sends: Sequence[bool] | None = None,
) -> _Run:
    """The torchrun program's timeline: its sends block where it is proven to meet there (it
    then waits for them), else they go as on gloo (the program says RENDEZVOUS = False);
    `preposted`: stages whose forward receives are all posted when the step begins; `late`:
    per cut, a message's time where its receive is posted after its send; `sends`: per
    stage, whether it sends gradients back (None: all)."""
    from .validate import ScheduleError, check_order, validate

    try:
        check_order(schedule)
        ordered = True
    except ScheduleError:
        ordered = False
    got = None
    if ordered:
        got = _rendezvous_loop(
            schedule, *times, sends_block=True, preposted=preposted, late_link=late,
            sends=sends,
        )  # fmt: skip
    if got is None:
        got = _rendezvous_loop(
            schedule, *times, sends_block=False, preposted=preposted, late_link=late,
            sends=sends,
        )  # fmt: skip
    if got is None:
        validate(schedule)  # raises with the grid
        raise AssertionError("simulation stalled on a schedule that validates")
    return got


def _sent_only(look: Callable[[Action], tuple], sends: Sequence[bool]) -> Callable:
    """`look` without the gradient messages of stages that send none (Costs.sends_grads)."""

    def sent(a: Action) -> tuple:
        return tuple(x for x in look(a) if x[0][0] == "F" or sends[x[0][1]])

    return sent


class _Slower(Exception):
    """A run given up on: it would end after the makespan it was asked to beat."""


def _rendezvous_loop(
    schedule: Schedule,
    fwd: list[float],
    bwd: list[float],
    i_cost: list[float],
    w_cost: list[float],
    rec: list[list[float]],  # per stage and micro-batch: its re-materialisation's cost
    link: list[float],
    sends_block: bool = True,
    preposted: frozenset[int] = frozenset(),
    late_link: list[float] | None = None,
    give_up: tuple[float, float] | None = None,
    sends: Sequence[bool] | None = None,
) -> _Run | None:
    """The timeline of a lowered schedule as the torchrun program runs it: each run of
    communication between two compute actions is one batch, posted when the rank reaches it
    and left once every message in it has gone (`sends_block`; else, as a program not proven
    to meet runs on gloo, once every message it receives has come). A message goes once both
    of its ends are posted and its link is free, and takes its link's time: a message between
    neighbouring stages is charged all the next stage receives (skips included, as the default
    model charges it); a skip past a stage adds no time of its own. A rank waiting in a batch
    is not busy. A compute action waits for what it reads: its own rank's actions, or the
    messages that brought the rest. A stage in `preposted` (comm.preposted) has every forward
    receive posted at time 0; its RECV_F batches only wait. A message whose receive is
    posted after its send takes `late_link`'s time for its cut (gloo moves it only once told
    that the receive is posted: cluster.Link's late figures), if given. None where a rank
    never gets past a batch. `give_up` (beat, overhead): raise _Slower as soon as some rank is
    sure to end past beat less the step's overhead (the makespan would then exceed beat).
    `sends`: per stage, whether it sends gradients back (None: all); where it does not, its
    gradient messages are not sent (the runtime posts nothing for them) and not waited for."""
    S, R, place = schedule.num_stages, schedule.num_ranks, schedule.placement
    senders = [schedule.senders(t) for t in range(S)]
    receivers = [schedule.receivers(t) for t in range(S)]
    programs = [batches(schedule.ranks[r]) for r in range(R)]
    SENT = (Kind.SEND_F, Kind.SEND_B)

    def duration(a: Action) -> float:
        s, m = a.stage, a.microbatch
        if a.kind == Kind.F:
            return fwd[s]
        if a.kind == Kind.B:
            return bwd[s] + rec[s][m]
        if a.kind == Kind.I:
            return i_cost[s] + rec[s][m]
        return w_cost[s]

    rest: list[list[float]] = []  # per rank and batch: the compute from there to its end
    limit = math.inf
    if give_up is not None:
        # A rank at time t before batch p ends no sooner than t and its compute from p on:
        # past `limit`, so would the makespan (plus the step's overhead). The margin covers
        # the sums' rounding, far below it, so that no run that would beat `beat` stops.
        beat, overhead = give_up
        limit = beat - overhead + 1e-9 * (abs(beat) + abs(overhead))
        for prog in programs:
            after = [0.0] * (len(prog) + 1)
            for p in range(len(prog) - 1, -1, -1):
                a = prog[p][0]
                after[p] = after[p + 1] + (duration(a) if a.kind in _COMPUTE_KINDS else 0.0)
            rest.append(after)
    look = message_lookup(schedule)
    if sends is not None:
        look = _sent_only(look, sends)
    # per rank and batch: (message, is_send) for each message it carries, once reached
    carried: list[dict[int, list[tuple[tuple, bool]]]] = [{} for _ in range(R)]
    avail: dict[tuple, float] = {}  # what is done or has arrived -> when
    posted: dict[tuple, float] = {}  # (message, is_send) -> when that end was posted
    link_free: dict[tuple[int, int], float] = {}
    waiting: dict[tuple, list[int]] = {}
    rank_time = [0.0] * R
    busy = [0.0] * R
    ptr = [0] * R
    entered = [-1] * R  # the last batch each rank has posted
    starts: list[list[float]] = [[] for _ in range(R)]
    ends: list[list[float]] = [[] for _ in range(R)]
    transfers: list[tuple[int, int, int, float, float]] = []
    todo = list(range(R))
    for t in preposted:
        for m in range(schedule.num_microbatches):
            end = (("F", t - 1, t, m), False)
            posted[end] = avail[("posted", *end)] = 0.0

    def publish(key: tuple, t: float) -> None:
        avail[key] = t
        woken = waiting.pop(key, None)
        if woken:
            todo.extend(woken)

    def deliver(msg: tuple) -> float:
        kind, s, t, m = msg
        key = ("msg", msg)
        if key not in avail:
            sent, asked = posted[(msg, True)], posted[(msg, False)]
            go = max(sent, asked)
            end = go
            if abs(s - t) == 1:
                d, cut = (0 if kind == "F" else 1), min(s, t)
                go = max(go, link_free.get((d, cut), 0.0))
                slow = late_link is not None and asked > sent
                end = go + (late_link[cut] if slow else link[cut])  # type: ignore[index]
                link_free[(d, cut)] = end
                transfers.append((d, cut, m, go, end))
            publish(key, end)
        return avail[key]

    def needs(a: Action, r: int) -> list[tuple]:
        s, m = a.stage, a.microbatch
        if a.kind == Kind.F:
            return [("F", x, m) if place[x] == r else ("msg", ("F", x, s, m)) for x in senders[s]]
        if a.kind in (Kind.B, Kind.I):
            return [("F", s, m)] + [
                ("bwd", x, m) if place[x] == r else ("msg", ("B", x, s, m))
                for x in receivers[s]
                if sends is None or sends[x]
            ]
        return [("I", s, m)]  # W

    while todo:
        r = todo.pop()
        prog, p, t_rank = programs[r], ptr[r], rank_time[r]
        while p < len(prog):
            batch = prog[p]
            a = batch[0]
            if a.kind not in _COMPUTE_KINDS:
                ops = carried[r].get(p)
                if ops is None:
                    ops = carried[r][p] = [
                        (msg, b.kind in SENT) for b in batch for msg, _ in look(b)
                    ]
                if entered[r] < p:
                    entered[r] = p
                    for end in ops:
                        if end not in posted:  # (a receive posted ahead keeps its time)
                            posted[end] = t_rank
                            publish(("posted", *end), t_rank)
                waited = [(msg, snd) for msg, snd in ops if sends_block or not snd]
                late = next(((m_, not s_) for m_, s_ in waited if (m_, not s_) not in posted), None)
                if late is not None:
                    waiting.setdefault(("posted", *late), []).append(r)
                    break
                done = max([t_rank] + [deliver(msg) for msg, _ in waited])
                if give_up is not None and done + rest[r][p + 1] > limit:
                    raise _Slower
                for _ in batch:
                    starts[r].append(t_rank)
                    ends[r].append(done)
                t_rank = done
                p += 1
                continue
            wants = needs(a, r)
            blocked = next((k for k in wants if k not in avail), None)
            if blocked is not None:
                waiting.setdefault(blocked, []).append(r)
                break
            start = max([t_rank] + [avail[k] for k in wants])
            s, m = a.stage, a.microbatch
            dur = duration(a)
            end = start + dur
            t_rank = end
            busy[r] += dur
            p += 1
            if give_up is not None and end + rest[r][p] > limit:
                raise _Slower
            starts[r].append(start)
            ends[r].append(end)
            if a.kind == Kind.F:
                publish(("F", s, m), end)
            elif a.kind in (Kind.B, Kind.I):
                publish(("bwd", s, m), end)
                if a.kind == Kind.I:
                    publish(("I", s, m), end)
        ptr[r] = p
        rank_time[r] = t_rank
    if any(ptr[r] < len(programs[r]) for r in range(R)):
        return None
    return starts, ends, transfers, busy
