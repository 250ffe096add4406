"""Insert SEND/RECV for every edge that crosses ranks.

Each receive goes right before the action that consumes it and each send right after the action
that produces it. The communication between two compute actions of a rank is one batch: the
runtime posts all of it at once (torch.distributed.batch_isend_irecv) and waits for all of it
before its next compute action. So a send is posted together with the receives the rank's next
action needs, as Megatron-LM's send_forward_recv_backward pairs them:

    rank 0:  F1 [SEND_F1 RECV_B0] B0        rank 1:  B0 [SEND_B0 RECV_F1] F1

That is what keeps NCCL from hanging, where a send completes only once its receive is posted
and a rank's operations run in the order it posts them: posted one at a time, rank 0 would
wait in SEND_F1 for rank 1, which waits in SEND_B0 for rank 0. `validate(lowered,
rendezvous=True)` proves a lowered schedule free of that (every schedule we generate passes it);
`validate(lowered)` only proves it free of deadlock when sends never block.

Messages between two ranks are taken in the order they are sent (NCCL has no tags): each action's
messages follow `action_messages`, and the runtime posts them in that order.

Where a send waits for its receive, where it is posted decides how long ranks wait for each
other: `insert_comms(schedule, costs)` tries each lowering that meets (this one, time steps,
and three placed from the compute-only timeline) in the simulator as the program runs them
(`simulate(..., rendezvous=True)`) and keeps the fastest. The torchrun target emits that one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .ir import _COMPUTE_KINDS, Action, Kind, Schedule

if TYPE_CHECKING:
    from .simulate import Costs


def insert_comms(schedule: Schedule, costs: Costs | None = None) -> Schedule:
    """SEND_F after a forward whose activations some other rank takes, RECV_F before a forward
    that takes activations from another rank; SEND_B and RECV_B alike for their gradients. One
    action carries every route of its stage that crosses ranks (schedule.routes).

    With `costs`, each lowering that meets where sends block (this one, `_lockstep`, and
    `_timed`'s from the compute-only timeline) is simulated as the torchrun program runs it,
    and the fastest is returned (the first of equals, in that order)."""
    if costs is not None:
        return fastest_lowering(schedule, costs)[0]
    lowered = _plain(schedule)
    if _meets(lowered):
        return lowered
    stepped = _lockstep(schedule)
    if stepped is not None and _meets(stepped):
        return stepped
    return lowered  # validate(..., rendezvous=True) says where it would hang


def received_ahead(
    lowered: Schedule,
    grads: list[int],
    back: Sequence[dict[int, int] | None] | None = None,
) -> dict[Action, int]:
    """Per compute action of a program with its communication placed (as the torchrun target
    runs it): the bytes of gradients its rank has received by then for a later action. The
    issue-order memory (memory.peaks) counts a gradient on the stage that made it until the
    action that reads it (B or I) starts; a lowering that posts that receive earlier (to meet
    its sender: `_lockstep`, `_timed`) has the reading rank hold it from then on, the batch
    being waited for before the next compute action (memory.peaks takes these). `grads`: per
    stage, the bytes of its input gradient (what it sends back, StageBytes.grad); `back`: per
    stage, what of it goes to each stage it takes values from (Costs.grads_back), where known
    (else each message counts at its sender's whole figure, at least the part read here).
    Actions holding none are left out."""
    return _received_back(lowered, grads, back)[0]


def _received_back(
    lowered: Schedule,
    grads: Sequence[int],
    back: Sequence[dict[int, int] | None] | None = None,
    rest: tuple[Sequence[int], Sequence[dict[int, int] | None] | None] | None = None,
    larger: int = 0,
) -> tuple[dict[Action, int], dict[Action, int]]:
    """received_ahead's figures during each compute action, and those of the batch of sends
    and receives after it (its receives' buffers are made as the batch is posted, those of
    the action after it included). `rest`: the (`grads`, `back`) of the micro-batches from
    `larger` on (an uneven batch's smaller ones; `grads` and `back` the others')."""
    if rest is not None and (back is None) != (rest[1] is None):
        raise ValueError("the smaller micro-batches' gradients sent back are given unlike the rest")
    S = lowered.num_stages
    _, receivers = _neighbours(S, tuple(map(tuple, lowered.routes)))
    place = lowered.placement
    during: dict[Action, int] = {}
    after: dict[Action, int] = {}

    def held(pending: list[Action], r: int) -> int:
        """The bytes of the gradients rank r has posted receives for."""
        n = 0
        for q in pending:
            for t in [q.peer] if q.peer >= 0 else receivers[q.stage]:
                if place[t] != r:
                    own, each = (grads, back) if rest is None or q.microbatch < larger else rest
                    piece = each[t] if each is not None else None
                    n += piece.get(q.stage, 0) if piece is not None else own[t]
        return n

    for r, acts in lowered.ranks.items():
        pending: list[Action] = []
        last: Action | None = None
        for a in acts:
            if a.kind == Kind.RECV_B:
                pending.append(a)
                continue
            if not a.kind.is_compute:
                continue
            if last is not None and (n := held(pending, r)):
                after[last] = n
            # what this action reads is counted from its start (pulled), the rest is ahead
            pending = [q for q in pending if (q.stage, q.microbatch) != (a.stage, a.microbatch)
                       or a.kind not in (Kind.B, Kind.I)]  # fmt: skip
            if n := held(pending, r):
                during[a] = n
            last = a
        if last is not None and (n := held(pending, r)):
            after[last] = n
    return during, after


def receive_offsets(
    lowered: Schedule,
    inputs: Sequence[int],
    grads: Sequence[int],
    back: Sequence[dict[int, int] | None] | None = None,
    preposted: frozenset[int] = frozenset(),
    sends_held: bool = False,
    rest: tuple[Sequence[int], Sequence[int], Sequence[dict[int, int] | None] | None] | None = None,
    larger: int = 0,
    far_bytes: Sequence[tuple[int, int]] | None = None,
    far_rest: Sequence[tuple[int, int]] | None = None,
) -> tuple[dict[Action, int], dict[Action, int]]:
    """For memory.peaks: what each rank of a program with its communication placed (as the
    torchrun target runs it) holds beyond (+) or short of (-) what the issue-order memory
    counts on it, because of where the program posts its messages. Two figures per compute
    action: while it runs (`during`), and while the batch of sends and receives right after
    it is posted and waited for (`after`: the rank then holds what it is sending and every
    buffer the batch receives into, next to the states the action left), each batch being
    waited for whole before the rank's next compute action.

    - Gradients received ahead of the action that reads them: received_ahead.
    - A chain's messages (stage t - 1 to t, where t takes values from t - 1 alone, on
      another rank), both ways. The issue order moves a forward's output to its receiver
      as the forward ends, and a gradient to its reader as the reading B or I starts. The
      program holds a message on its sender from the action that makes it until the batch
      that posts its send has gone, and on its receiver from the batch that posts its
      receive (every forward receive as the step begins, on a `preposted` stage) until the
      action that reads it. `sends_held`: a program that does not meet where sends block
      (gloo only) holds every send to the step's end.

    `inputs`, `grads`: per stage, the bytes of its input and of its input gradient
    (StageBytes.input, .grad); `back` as received_ahead's. Actions with no offset are left
    out. A look at a rank between two of its own actions, where another rank's action ends,
    takes the larger of the two actions' `during` figures (memory.peaks).

    A stage that also takes values from further back (a captured graph's skips) holds what
    each sender sends it from the batch that posts its receive, and each part of its input
    gradient until the batch that posts its send, where every sender is on another rank and
    the far senders' messages are posted together: `far_bytes` (per stage, StageBytes'
    (early, late): what its senders before t - 1 send it, and their gradient) says which part
    is theirs. On a far sender, what it sends is counted as the issue order has it (most
    often a tensor its own layers keep anyway). A stage whose `far_bytes` are not given is
    counted as the issue order has it.

    `rest`: where a batch splits unevenly, the (`inputs`, `grads`, `back`) of the
    micro-batches from `larger` on, the smaller ones (`inputs`, `grads` and `back` then the
    larger ones'), each message counted at its own micro-batch's size as the program
    allocates it (`far_rest` their `far_bytes`)."""
    from .order import issue_arrays

    during, after = _received_back(
        lowered, grads, back, rest[1:] if rest is not None else None, larger
    )
    S, place = lowered.num_stages, lowered.placement
    kinds = (Kind.F, Kind.B, Kind.I, Kind.W)
    kind, stage, mb = issue_arrays(lowered)
    issued = {
        (kinds[int(k)], int(s), int(b)): n for n, (k, s, b) in enumerate(zip(kind, stage, mb))
    }
    compute: dict[int, list[Action]] = {}
    at: dict[tuple, int] = {}  # a compute action's, or a post's: the rank's next compute action
    for r, acts in lowered.ranks.items():
        mine = compute[r] = []
        for a in acts:
            if a.kind.is_compute:
                at[(a.kind, a.stage, a.microbatch)] = len(mine)
                mine.append(a)
            else:
                at.setdefault((a.kind, a.stage, a.microbatch, a.peer), len(mine))
    order = {
        r: [issued[(a.kind, a.stage, a.microbatch)] for a in acts] for r, acts in compute.items()
    }
    # per rank, differences along its compute actions: [0] during them, [1] in the batch after
    delta = {r: ([0] * (len(acts) + 1), [0] * (len(acts) + 1)) for r, acts in compute.items()}

    def hold(r: int, lo: int, hi: int, n: int, when: int) -> None:
        """n bytes more on rank r at its compute actions lo .. hi - 1 (or the batches after)."""
        lo, hi = max(lo, 0), min(hi, len(compute[r]))
        if lo < hi and n:
            delta[r][when][lo] += n
            delta[r][when][hi] -= n

    def counted(r: int, made: int, read: int, n: int) -> None:
        """The issue order's count: n bytes on rank r from the end of the action issued at
        `made` to the start of the one issued at `read`, taken away here."""
        hold(r, bisect.bisect_right(order[r], made), bisect.bisect_left(order[r], read), -n, 0)
        hold(r, bisect.bisect_left(order[r], made), bisect.bisect_left(order[r], read), -n, 1)

    def backward(s: int, m: int) -> tuple[Kind, int, int]:
        """The action that makes stage s's input gradient, or reads its output's (B, else I)."""
        return (Kind.B, s, m) if (Kind.B, s, m) in issued else (Kind.I, s, m)

    def posted(kind_: Kind, s: int, m: int, peer: int) -> int | None:
        """Where the rank posts that message: before its compute action at this index. (One
        action carries every route of a stage to or from a rank unless it names its peer.)"""
        return at.get((kind_, s, m, peer), at.get((kind_, s, m, -1)))

    def sending(s: int, t: int, m: int, n: int) -> None:
        """Stage s's message to t of micro-batch m (n bytes), on s's rank from the forward
        that makes it until the batch that posts its send has gone."""
        r, made = place[s], at[(Kind.F, s, m)]
        sent = posted(Kind.SEND_F, s, m, t)
        end = len(compute[r]) if sends_held or sent is None else sent
        hold(r, made + 1, end, n, 0)
        hold(r, made, end, n, 1)

    def posts(kind_: Kind, t: int, m: int, far: list[int]) -> tuple[int | None, ...] | None:
        """Where stage t's rank posts micro-batch m's messages with t - 1 and with the far
        senders (one place for them all, else None)."""
        if kind_ == Kind.RECV_F and t in preposted:
            return 0, 0
        far_at = {posted(kind_, t, m, s) for s in far} or {None}
        return (posted(kind_, t, m, t - 1), *far_at) if len(far_at) == 1 else None

    far_first = lowered.early_from()
    for t in range(1, S):
        a, r, q = t - 1, place[t - 1], place[t]
        senders = lowered.senders(t)
        far = [s for s in senders if s != a]
        if r == q or a not in senders:
            continue
        if far and (
            far_bytes is None
            or (rest is None) != (far_rest is None)
            or any(place[s] == q for s in far)
        ):
            continue
        M = lowered.num_microbatches

        gots = [posts(Kind.RECV_F, t, m, far) for m in range(M)]
        sents = [posts(Kind.SEND_B, t, m, far) for m in range(M)]
        if any(p is None for p in gots + sents):
            continue  # (the far senders' posted apart: as the issue order has them)
        for m in range(M):
            ins, outs = (inputs, grads) if rest is None or m < larger else rest[:2]
            ahead, late = 0, 0
            if far:
                ahead, late = (far_bytes if rest is None or m < larger else far_rest)[t]  # type: ignore[index]
                ahead, late = min(ahead, ins[t]), min(late, outs[t])  # (parts of the whole)
            # forward: the input, made by the senders' F(s, m), read by F(t, m); the far
            # senders' part in the issue order from the first one's F to the end of t - 1's.
            # (On a far sender, what it sends is held as the issue order has it: a skip is
            # most often a tensor the sender's own layers keep for backward, so sending it
            # holds nothing more.)
            n, read = ins[t], at[(Kind.F, t, m)]
            sending(a, t, m, n - ahead)
            for part, got in zip((n - ahead, ahead), gots[m]):  # type: ignore[arg-type]
                got = got or 0  # (a receive not found: held from the start)
                hold(q, got, read, part, 0)
                hold(q, got - 1, read, part, 1)
            counted(q, issued[(Kind.F, a, m)], issued[(Kind.F, t, m)], n)
            if far:
                counted(q, issued[(Kind.F, far_first[t], m)], issued[(Kind.F, a, m)], ahead)
            # backward: t's input gradient, made by its B or I, read by a's B or I (received
            # as received_ahead has it), until the batch that posts its send has gone; the far
            # senders' part in the issue order until the first one's B or I
            n, make = outs[t], backward(t, m)
            for part, sent in zip((n - late, late), sents[m]):  # type: ignore[arg-type]
                end = len(compute[q]) if sends_held or sent is None else sent
                hold(q, at[make] + 1, end, part, 0)
                hold(q, at[make], end, part, 1)
            counted(q, issued[make], issued[backward(a, m)], n)
            if far:
                counted(q, issued[backward(a, m)], issued[backward(far_first[t], m)], late)
    for r, acts in compute.items():
        for when, out in ((0, during), (1, after)):
            level = 0
            for a, d in zip(acts, delta[r][when]):
                level += d
                if level:
                    out[a] = out.get(a, 0) + level
    return (
        {a: n for a, n in during.items() if n},
        {a: n for a, n in after.items() if n},
    )


def preposted(schedule: Schedule, costs: Costs | None = None) -> frozenset[int]:
    """The stages whose torchrun program posts every forward receive when the step begins, each
    micro-batch's forward then waiting for its own: a sender whose receive is already posted
    hands each message over at once, instead of waiting in its send for the receiver to reach
    that micro-batch, so GPipe's first stage runs its forwards back to back.

    A stage qualifies when the schedule is a chain (no routes), the stage is alone on its rank
    and takes its input from another rank, and that rank runs every forward before any other
    compute action (GPipe's order; 1F1B's and zero bubble's too on a stage with no more
    micro-batches than its warm-up takes). Then nothing the rank receives later, and no
    gradient it sends back, needs a message that waits on those receives. Where a rank's
    operations run in the order posted whatever their peer (`costs.ordered_p2p`: NCCL, whose
    batches share one communicator), the activations a middle stage sends on would queue
    behind them: there only a stage that sends nothing on (the last) posts ahead.

    Memory: in the issue order the plan counts in, the stage's forward of micro-batch k
    already holds the inputs of k + 1 (its sender is a micro-batch ahead); posted ahead, it
    also holds those of k + 2 .. M - 1. Its forward of M - 2 holds them all either way, with
    the activations of 0 .. M - 2 where those are kept: so the plan's peak is not raised
    where each micro-batch's input weighs no more than its activations, or the stage
    recomputes (every forward then keeps only its input). With `costs` (costs.memory,
    costs.recompute), a stage that keeps its activations and whose input outweighs them is
    left out (tests/test_memory_states.py holds the rule against the replay)."""
    if schedule.routes:
        return frozenset()
    compute = schedule.compute_only()
    place, M = compute.placement, compute.num_microbatches
    memory = list(costs.memory) if costs is not None and costs.memory is not None else None
    modes = list(costs.recompute) if costs is not None and costs.recompute is not None else None
    ordered = costs is not None and costs.ordered_p2p
    out = set()
    for t in range(1, compute.num_stages):
        r = place[t]
        if place[t - 1] == r or place.count(r) != 1:
            continue
        if ordered and t < compute.num_stages - 1:
            continue
        kinds = [a.kind for a in compute.ranks[r]]
        first_other = next((i for i, k in enumerate(kinds) if k != Kind.F), len(kinds))
        if Kind.F in kinds[first_other:]:
            continue
        if memory is not None and M > 1:
            b, mode = memory[t], modes[t] if modes is not None else "never"
            if mode == "never" and b.input > b.activations:
                continue
        out.add(t)
    return frozenset(out)


def _plain(schedule: Schedule) -> Schedule:
    """Each receive right before the action that reads it, each send right after the one that
    makes it."""
    S, place = schedule.num_stages, schedule.placement
    remote_in = [any(place[a] != place[t] for a in schedule.senders(t)) for t in range(S)]
    remote_out = [any(place[b] != place[s] for b in schedule.receivers(s)) for s in range(S)]
    out: dict[int, list[Action]] = {}
    for r, acts in schedule.ranks.items():
        seq: list[Action] = []
        for a in acts:
            if not a.kind.is_compute:
                continue  # already lowered: re-insert from scratch
            s, m = a.stage, a.microbatch
            if a.kind == Kind.F and remote_in[s]:
                seq.append(Action(s, Kind.RECV_F, m))
            if a.kind in (Kind.B, Kind.I) and remote_out[s]:
                seq.append(Action(s, Kind.RECV_B, m))
            seq.append(a)
            if a.kind == Kind.F and remote_out[s]:
                seq.append(Action(s, Kind.SEND_F, m))
            if a.kind in (Kind.B, Kind.I) and remote_in[s]:
                seq.append(Action(s, Kind.SEND_B, m))
        out[r] = seq
    return Schedule(
        schedule.name, S, schedule.num_microbatches, out, list(place), list(schedule.routes)
    )


def _meets(lowered: Schedule) -> bool:
    """Does every message meet its other end where sends block and nothing has tags?"""
    from .validate import ScheduleError, check_order, rendezvous_run  # it reads this module

    try:
        check_order(lowered)
    except ScheduleError:
        return False
    return not rendezvous_run(lowered).stuck


SENDS = (Kind.SEND_F, Kind.SEND_B)


def _lockstep(schedule: Schedule) -> Schedule | None:
    """Communication in time steps, for schedules whose ranks would wait on each other's sends
    with each send right after its action (interleaved ones, whose ranks send both ways at
    once; a captured graph's skips). Each compute action gets the first step at which its
    rank is free and its inputs were made at earlier steps; each message is posted by both
    ends in a batch at the end of the step that made it. Then, step by step, every rank reaches
    each batch without waiting on a later one, and the batches of one step meet. That argument
    needs each communication action to carry one message: a chain's do; a captured graph's
    are split by peer (`0SEND_F1@3`), since a receive taking several skips at the last of their
    steps could make an earlier sender wait. None where the compute alone cannot run."""
    from .validate import dependencies, split_stages

    compute = schedule.compute_only()
    place, split = compute.placement, split_stages(compute)
    step: dict[Action, int] = {}
    ptr, free = dict.fromkeys(compute.ranks, 0), dict.fromkeys(compute.ranks, 0)
    moved = True
    while moved:
        moved = False
        for r, acts in compute.ranks.items():
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                deps = dependencies(a, compute, False, split)
                if any(d not in step for d in deps):
                    break
                step[a] = max([free[r]] + [step[d] + 1 for d in deps])
                free[r] = step[a] + 1
                ptr[r] += 1
                moved = True
    if any(ptr[r] < len(acts) for r, acts in compute.ranks.items()):
        return None
    # One action per message where a stage sends to, or takes from, several (skips): each
    # end of each message is then posted in the step that made it.
    named = bool(compute.routes)
    at: dict[Action, int] = {}  # communication action -> the step whose batch posts it
    for a, t in compute.edges():
        if place[a] == place[t]:
            continue
        to_t, to_a = (t, a) if named else (-1, -1)
        for m in range(compute.num_microbatches):
            made = step[Action(a, Kind.F, m)]
            at[Action(a, Kind.SEND_F, m, to_t)] = made
            at[Action(t, Kind.RECV_F, m, to_a)] = made
            back = step[Action(t, Kind.I if t in split else Kind.B, m)]
            at[Action(t, Kind.SEND_B, m, to_a)] = back
            at[Action(a, Kind.RECV_B, m, to_t)] = back
    posted: dict[int, dict[int, list[Action]]] = {r: {} for r in compute.ranks}

    look = message_lookup(compute)
    for c, k in sorted(at.items(), key=lambda item: _post_order(look, *item)):
        posted[place[c.stage]].setdefault(k, []).append(c)
    ranks = {}
    for r, acts in compute.ranks.items():
        by_step = {step[a]: a for a in acts}
        seq: list[Action] = []
        for k in sorted(set(by_step) | set(posted[r])):
            if k in by_step:
                seq.append(by_step[k])
            seq += posted[r].get(k, [])
        ranks[r] = seq
    return Schedule(
        compute.name, compute.num_stages, compute.num_microbatches, ranks, list(place),
        list(compute.routes),
    )  # fmt: skip


def fastest_lowering(schedule: Schedule, costs: Costs) -> tuple[Schedule, float | None]:
    """fastest_lowering_of without which lowering it is."""
    return fastest_lowering_of(schedule, costs)[:2]


def lowering_of(schedule: Schedule, costs: Costs, which: int) -> Schedule | None:
    """The lowering fastest_lowering_of named `which` (the same one again, made alone: the
    plain one, lock-step, or one timed from the compute-only timeline under `costs`); None
    where the schedule has no lock-step one."""
    from .simulate import simulate

    if which == 0:
        return _plain(schedule)
    if which == 1:
        return _lockstep(schedule)
    compute = schedule.compute_only()
    return _timed_all(compute, simulate(compute, costs, memory=False))[which - 2]


def fastest_lowering_of(
    schedule: Schedule, costs: Costs
) -> tuple[Schedule, float | None, int | None]:
    """insert_comms with costs, and that program's makespan as it runs (None where no lowering
    meets where sends block: the plain one is returned, to run as gloo does). A lowering meets
    there exactly when its ranks agree on the order of their messages and the timed run with
    blocking sends gets every rank to its end (`rendezvous_run` decides the same, untimed:
    tests/test_rendezvous.py), so each distinct lowering is simulated once, and that run both
    vets and times it; the first of the fastest is kept.

    On a chain, no lowering runs faster than the compute-only timeline, whose messages go as
    soon as they are made (each link's in the same order): one that matches it ends the
    search (tests/test_rendezvous.py holds the premise on every generated schedule). A run sure
    to end later than the best so far stops there, and at first later than the timeline by
    NEAR (a lowering that waits little is usually at hand, and the others then stop early);
    where none comes that near, those stopped are run again in full.

    Third: which lowering it is, for lowering_of to make again (0 the plain one, 1 lock-step,
    2 + n the n-th of _HOW's timed ones), None where none meets or nothing crosses ranks."""
    from .simulate import blocking_makespan, simulate

    plain = _plain(schedule)
    if all(a.kind.is_compute for acts in plain.ranks.values() for a in acts):
        return plain, None, None  # nothing crosses ranks
    compute = schedule.compute_only()
    tl = simulate(compute, costs, memory=False)
    timed: list[Schedule] = []  # (made once, when the first is wanted)

    def nth_timed(n: int) -> Schedule | None:
        if not timed:
            timed.extend(_timed_all(compute, tl))
        return timed[n]

    makers = [lambda: plain, lambda: _lockstep(schedule)]
    makers += [lambda n=n: nth_timed(n) for n in range(len(_HOW))]
    made: list[Schedule | None] = []  # per maker: its lowering, None where no new one
    seen: set[tuple] = set()

    def lowering(k: int) -> Schedule | None:
        while len(made) <= k:
            lowered = makers[len(made)]()
            key = (
                None
                if lowered is None
                else tuple(tuple(a) for _, a in sorted(lowered.ranks.items()))
            )
            made.append(None if key is None or key in seen else lowered)
            seen.add(key)
        return made[k]

    # (a captured graph's: the compute-only timeline takes its stages in chain order, where
    # the program runs branches side by side, sooner: no floor there)
    floor = -math.inf if schedule.routes else tl.makespan
    best: tuple[float, Schedule, int] | None = None
    stuck: set[int] = set()  # lowerings that do not meet
    for ceiling in (floor + NEAR * abs(floor), math.inf) if floor > -math.inf else (math.inf,):
        for k in range(len(makers)):
            lowered = lowering(k)
            if lowered is None or k in stuck:
                continue
            beat = min(ceiling, math.inf if best is None else best[0])
            t = blocking_makespan(lowered, costs, beat=None if math.isinf(beat) else beat)
            if t is None:
                stuck.add(k)
            elif best is None or t < best[0]:
                if t <= beat or math.isinf(beat):
                    best = (t, lowered, k)
                if t <= floor:  # as fast as if no send ever waited: none can do better
                    break
        if best is not None:
            break
    return (best[1], best[0], best[2]) if best is not None else (insert_comms(schedule), None, None)


NEAR = 0.01  # how near the compute-only timeline fastest_lowering first looks (relative)


_HOW = ("early", "late", "nearest")
LOWERINGS = 2 + len(_HOW)  # fastest_lowering_of's: the plain one, lock-step, one per _HOW


def _timed(compute: Schedule, tl: Any, how: str) -> Schedule:
    """Each message posted where the compute-only timeline `tl` has it made: the send right
    after the action that makes it, the receive at a gap between the receiving rank's actions
    (before the one that reads it): the last gap that opens before the message is made
    ("early": the receiver may wait for it), the first that opens after ("late": the sender
    may wait), or whichever is nearer in time."""
    return _timed_all(compute, tl)[_HOW.index(how)]


def _timed_all(compute: Schedule, tl: Any) -> list[Schedule]:
    """_timed for each way in _HOW, what they share worked out once."""
    import bisect

    place, split = compute.placement, split_stages_of(compute)
    named = bool(compute.routes)
    where = {a: (r, i) for r, acts in compute.ranks.items() for i, a in enumerate(acts)}
    gaps = {r: [0.0, *tl.ends[r]] for r in compute.ranks}  # gap i opens as action i - 1 ends

    def gap(rank: int, made: float, before: int) -> tuple[int, int, int]:
        """The gap each way in _HOW takes."""
        t = gaps[rank]
        late = min(bisect.bisect_left(t, made), before)
        early = min(max(bisect.bisect_right(t, made) - 1, 0), before)
        return early, late, early if made - t[early] <= t[late] - made else late

    sends: list[tuple[Action, int, int]] = []  # (send, rank, the gap it is posted at)
    recvs: list[tuple[Action, int, tuple[int, int, int]]] = []  # (receive, rank, gap each way)
    for a, t in compute.edges():
        if place[a] == place[t]:
            continue
        to_t, to_a = (t, a) if named else (-1, -1)
        for m in range(compute.num_microbatches):
            for made, used, send, recv in (
                (Action(a, Kind.F, m), Action(t, Kind.F, m),
                 Action(a, Kind.SEND_F, m, to_t), Action(t, Kind.RECV_F, m, to_a)),
                (Action(t, Kind.I if t in split else Kind.B, m),
                 Action(a, Kind.I if a in split else Kind.B, m),
                 Action(t, Kind.SEND_B, m, to_a), Action(a, Kind.RECV_B, m, to_t)),
            ):  # fmt: skip
                r, i = where[made]
                sends.append((send, r, i + 1))
                ru, j = where[used]
                recvs.append((recv, ru, gap(ru, tl.ends[r][i], j)))
    # Within a gap, the sends first, each side in the order of its messages (_post_order):
    # sorted once by message, then dealt into the gaps in that order
    look = message_lookup(compute)
    sends.sort(key=lambda x: look(x[0])[0][0])
    recvs.sort(key=lambda x: look(x[0])[0][0])
    out = []
    for way in range(len(_HOW)):
        posted: dict[int, dict[int, list[Action]]] = {r: {} for r in compute.ranks}
        for c, r, k in sends:
            posted[r].setdefault(k, []).append(c)
        for c, r, ks in recvs:
            posted[r].setdefault(ks[way], []).append(c)
        ranks = {}
        for r, acts in compute.ranks.items():
            seq: list[Action] = []
            for i, a in enumerate(acts):
                seq += posted[r].get(i, [])
                seq.append(a)
            ranks[r] = seq + posted[r].get(len(acts), [])
        out.append(
            Schedule(
                compute.name,
                compute.num_stages,
                compute.num_microbatches,
                ranks,
                list(place),
                list(compute.routes),
            )  # fmt: skip
        )
    return out


def _post_order(look: Callable[[Action], Any], c: Action, k: int) -> tuple:
    """Within a batch the sends first, each side in the order of its messages: two ranks then
    agree on the order of theirs (the eager check, validate, takes receives one by one)."""
    return (k, c.kind not in SENDS, look(c)[0][0])


def split_stages_of(compute: Schedule) -> set[int]:
    from .validate import split_stages

    return split_stages(compute)


Message = tuple[str, int, int, int]  # (F or B, sending stage, receiving stage, micro-batch)


def action_messages(lowered: Schedule, a: Action) -> list[tuple[Message, int]]:
    """The messages a communication action carries, in the order it posts them, each with the
    rank at the other end. Activations go from stage s to each reader t (a chain: s + 1), their
    gradients back from t to s."""
    return list(message_lookup(lowered)(a))


def message_lookup(lowered: Schedule) -> Callable[[Action], tuple[tuple[Message, int], ...]]:
    """action_messages as a function of the action alone, for loops over a whole program:
    what each action carries depends only on the stages' placement and routes, so it is worked
    out once per action and kept for every schedule that shares them (the lowerings that
    fastest_lowering weighs, and the checks and simulations of each)."""
    table = _message_table(
        lowered.num_stages, tuple(map(tuple, lowered.routes)), tuple(lowered.placement)
    )

    def look(a: Action) -> tuple[tuple[Message, int], ...]:
        found = table.get(a)
        if found is None:
            found = table[a] = tuple(_carried(lowered, a))
        return found

    return look


@lru_cache(maxsize=8)
def _message_table(
    num_stages: int, routes: tuple[tuple[int, ...], ...], placement: tuple[int, ...]
) -> dict[Action, tuple[tuple[Message, int], ...]]:
    return {}


def _carried(lowered: Schedule, a: Action) -> list[tuple[Message, int]]:
    k = a.kind
    if k.is_compute:
        return []
    place, s, m = lowered.placement, a.stage, a.microbatch
    senders, receivers = _neighbours(lowered.num_stages, tuple(map(tuple, lowered.routes)))
    if k == Kind.SEND_F or k == Kind.RECV_B:
        others = receivers[s]
    else:
        others = senders[s]
    ends = [x for x in others if place[x] != place[s] and a.peer in (-1, x)]
    if k == Kind.SEND_F:
        return [(("F", s, t, m), place[t]) for t in ends]
    if k == Kind.RECV_F:
        return [(("F", x, s, m), place[x]) for x in ends]
    if k == Kind.SEND_B:
        return [(("B", s, x, m), place[x]) for x in ends]
    return [(("B", t, s, m), place[t]) for t in ends]


@lru_cache(maxsize=64)
def _neighbours(
    num_stages: int, routes: tuple[tuple[int, ...], ...]
) -> tuple[list[list[int]], list[list[int]]]:
    """Per stage, the stages it takes activations from and the ones it hands them to
    (Schedule.senders and .receivers, worked out once per stage count and routes)."""
    edges = routes or tuple((s, s + 1) for s in range(num_stages - 1))
    senders: list[list[int]] = [[] for _ in range(num_stages)]
    receivers: list[list[int]] = [[] for _ in range(num_stages)]
    for a, b in edges:
        receivers[a].append(b)
        senders[b].append(a)
    return senders, receivers


def by_peer(schedule: Schedule) -> bool:
    """Whether the schedule's communication actions name their peers (one message each)."""
    return any(a.peer >= 0 for acts in schedule.ranks.values() for a in acts)


def batches(actions: list[Action]) -> list[list[Action]]:
    """A rank's program as the runtime runs it: each compute action alone, and each run of
    communication between two compute actions as one batch."""
    out: list[list[Action]] = []
    comm: list[Action] | None = None  # the batch of communication open, if any
    for a in actions:
        if a.kind in _COMPUTE_KINDS:
            out.append([a])
            comm = None
        elif comm is None:
            comm = [a]
            out.append(comm)
        else:
            comm.append(a)
    return out


def messages(lowered: Schedule) -> list[tuple[Action, Action]]:
    """Every message a step sends between ranks: (the send that carries it, the receive that
    takes it). A route s -> t across ranks is one message per micro-batch each way."""
    place, M = lowered.placement, lowered.num_microbatches
    named = by_peer(lowered)
    out = []
    for s, t in lowered.edges():
        if place[s] == place[t]:
            continue
        to_t, to_s = (t, s) if named else (-1, -1)
        for m in range(M):
            out.append((Action(s, Kind.SEND_F, m, to_t), Action(t, Kind.RECV_F, m, to_s)))
            out.append((Action(t, Kind.SEND_B, m, to_s), Action(s, Kind.RECV_B, m, to_t)))
    return out
