"""validate(schedule): every stage runs F and B (or I and W) once per micro-batch, dependencies
hold, and executing the ranks' lists in order cannot deadlock. Errors print the rank x step grid
with the faulty cell marked.

Two transports are modelled. By default a send never blocks (an isend with room to spare) and a
receive waits for its send. `rendezvous=True` is the stricter one NCCL may impose: a rank runs its
communication in the order it posts it, one batch at a time (comm.batches: everything between
two compute actions), and a batch completes only when every message in it meets its other end
posted in the peer's current batch. Messages between two ranks must also be received in the
order they are sent, since nothing but that order tells them apart."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .comm import Message, action_messages, batches, message_lookup
from .ir import Action, Kind, Schedule, infer_placement


class ScheduleError(ValueError):
    """A schedule that cannot run. The message ends with the grid, the faulty cell in >< marks."""


def validate(schedule: Schedule, *, rendezvous: bool = False) -> None:
    """Raise ScheduleError, with the rank x step grid, for a schedule that cannot run.
    `rendezvous`: sends block until their receive is posted (see the module doc)."""
    try:
        placement = infer_placement(schedule.ranks, schedule.num_stages)
    except ValueError as e:
        raise ScheduleError(f"{schedule.name}: {e}\n{grid(schedule)}") from None
    if placement != schedule.placement:
        raise ScheduleError(f"{schedule.name}: actions do not match the stated stage placement")
    _check_counts(schedule)
    _check_peers(schedule)
    _check_runs(schedule)
    if rendezvous:
        check_order(schedule)
        _check_rendezvous(schedule)


def _check_counts(schedule: Schedule) -> None:
    S, M = schedule.num_stages, schedule.num_microbatches
    seen: Counter[Action] = Counter()
    for r, acts in schedule.ranks.items():
        for step, a in enumerate(acts):
            if not (0 <= a.stage < S and 0 <= a.microbatch < M):
                _fail(schedule, f"{a} is outside {S} stages x {M} micro-batches", r, step)
            seen[a] += 1
            if seen[a] > 1:
                _fail(schedule, f"{a} appears more than once", r, step)
    for s in range(S):
        split = any(Action(s, Kind.I, m) in seen for m in range(M))
        kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
        for m in range(M):
            for k in kinds:
                if Action(s, k, m) not in seen:
                    r = schedule.placement[s]
                    _fail(
                        schedule,
                        f"stage {s} never runs {Action(s, k, m)}",
                        r,
                        len(schedule.ranks[r]),
                    )
            if split and Action(s, Kind.B, m) in seen:
                r = schedule.placement[s]
                _fail(schedule, f"stage {s} mixes B with I/W for micro-batch {m}", r,
                      schedule.ranks[r].index(Action(s, Kind.B, m)))  # fmt: skip


def _check_peers(schedule: Schedule) -> None:
    """Communication by peer names, on every action, a stage it exchanges with across ranks."""
    if comms_of(schedule) != "peer":
        return
    place = schedule.placement
    for r, acts in schedule.ranks.items():
        for step, a in enumerate(acts):
            if a.kind.is_compute:
                continue
            if a.peer < 0:
                _fail(schedule, f"{a} names no peer, where the others do (e.g. {a}@0)", r, step)
            forward = a.kind in (Kind.SEND_F, Kind.RECV_B)
            ends = schedule.receivers(a.stage) if forward else schedule.senders(a.stage)
            if a.peer not in ends or place[a.peer] == place[a.stage]:
                _fail(schedule, f"{a}: stage {a.stage} exchanges nothing with stage {a.peer} "
                      "across ranks", r, step)  # fmt: skip


def split_stages(schedule: Schedule) -> set[int]:
    """Stages whose backward is split into I and W."""
    return {a.stage for acts in schedule.ranks.values() for a in acts if a.kind == Kind.I}


def comms_of(schedule: Schedule) -> bool | str:
    """How a schedule carries communication: not at all (False), an action per stage and
    direction (True), or an action per message ("peer": `0SEND_F1@3`)."""
    kinds = [a for acts in schedule.ranks.values() for a in acts if not a.kind.is_compute]
    if not kinds:
        return False
    return "peer" if any(a.peer >= 0 for a in kinds) else True


def dependencies(
    a: Action, schedule: Schedule, has_comms: bool | str, split: set[int]
) -> list[Action]:
    """What must have run before `a` (on any rank). Cross-rank inputs come through a RECV when
    the schedule carries communication (one per message when by peer: comms_of), directly
    from the producer when it is compute-only. `split`: the stages whose backward is I + W
    (see split_stages)."""
    S, s, m, k, place = schedule.num_stages, a.stage, a.microbatch, a.kind, schedule.placement
    if has_comms == "peer":
        return _peer_dependencies(a, schedule, split)

    def backward(stage: int) -> Action:
        return Action(stage, Kind.I if stage in split else Kind.B, m)

    if k == Kind.F:
        senders = schedule.senders(s)
        if has_comms and any(place[a] != place[s] for a in senders):
            return [Action(s, Kind.RECV_F, m)] + [
                Action(a, Kind.F, m) for a in senders if place[a] == place[s]
            ]
        return [Action(a, Kind.F, m) for a in senders]
    if k in (Kind.B, Kind.I):
        if s == S - 1:
            return [Action(s, Kind.F, m)]
        receivers = schedule.receivers(s)
        if has_comms and any(place[b] != place[s] for b in receivers):
            return [Action(s, Kind.F, m), Action(s, Kind.RECV_B, m)] + [
                backward(b) for b in receivers if place[b] == place[s]
            ]
        return [Action(s, Kind.F, m)] + [backward(b) for b in receivers]
    if k == Kind.W:
        return [Action(s, Kind.I, m)]
    if k == Kind.SEND_F:
        return [Action(s, Kind.F, m)]
    if k == Kind.RECV_F:
        return [Action(a, Kind.SEND_F, m) for a in schedule.senders(s) if place[a] != place[s]]
    if k == Kind.SEND_B:
        return [backward(s)]
    return [Action(b, Kind.SEND_B, m) for b in schedule.receivers(s) if place[b] != place[s]]


def _peer_dependencies(a: Action, schedule: Schedule, split: set[int]) -> list[Action]:
    """dependencies() where each communication action carries the one message with its peer."""
    S, s, m, k, place = schedule.num_stages, a.stage, a.microbatch, a.kind, schedule.placement

    def backward(stage: int) -> Action:
        return Action(stage, Kind.I if stage in split else Kind.B, m)

    if k == Kind.F:
        return [
            Action(s, Kind.RECV_F, m, x) if place[x] != place[s] else Action(x, Kind.F, m)
            for x in schedule.senders(s)
        ]
    if k in (Kind.B, Kind.I):
        if s == S - 1:
            return [Action(s, Kind.F, m)]
        return [Action(s, Kind.F, m)] + [
            Action(s, Kind.RECV_B, m, t) if place[t] != place[s] else backward(t)
            for t in schedule.receivers(s)
        ]
    if k == Kind.W:
        return [Action(s, Kind.I, m)]
    if k == Kind.SEND_F:
        return [Action(s, Kind.F, m)]
    if k == Kind.RECV_F:
        return [Action(a.peer, Kind.SEND_F, m, s)]
    if k == Kind.SEND_B:
        return [backward(s)]
    return [Action(a.peer, Kind.SEND_B, m, s)]


def _check_runs(schedule: Schedule) -> None:
    """Run every rank's list in order, each action once all it depends on has run; sends never
    block, receives wait for their send. Stuck before the end means deadlock."""
    has_comms = comms_of(schedule)
    split = split_stages(schedule)
    done: set[Action] = set()
    ptr = dict.fromkeys(schedule.ranks, 0)
    waiting: dict[Action, list[int]] = {}
    todo = list(schedule.ranks)
    while todo:
        r = todo.pop()
        acts = schedule.ranks[r]
        while ptr[r] < len(acts):
            a = acts[ptr[r]]
            deps = dependencies(a, schedule, has_comms, split)
            missing = next((d for d in deps if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            done.add(a)
            ptr[r] += 1
            todo.extend(waiting.pop(a, []))
    stuck = {r: p for r, p in ptr.items() if p < len(schedule.ranks[r])}
    if not stuck:
        return
    marks = dict(stuck)

    def missing(r: int) -> list[Action]:
        a = schedule.ranks[r][stuck[r]]
        return [d for d in dependencies(a, schedule, has_comms, split) if d not in done]

    # A head waiting for something later on its own rank is an order error, the root cause.
    for r in sorted(stuck):
        a = schedule.ranks[r][stuck[r]]
        later = [d for d in missing(r) if d in schedule.ranks[r][stuck[r] :]]
        if later:
            _fail(
                schedule,
                f"rank {r} runs {a} before {later[0]}, which it depends on",
                r,
                stuck[r],
                marks,
            )
    for r in sorted(stuck):
        absent = [d for d in missing(r) if not _appears(schedule, d)]
        if absent:
            a = schedule.ranks[r][stuck[r]]
            _fail(
                schedule,
                f"rank {r} runs {a} but {absent[0]} is nowhere in the schedule",
                r,
                stuck[r],
                marks,
            )
    r = min(stuck)
    a = schedule.ranks[r][stuck[r]]
    what = ", ".join(map(str, missing(r)))
    _fail(
        schedule,
        f"deadlock: rank {r} waits at {a} for {what}, which waits in turn",
        r,
        stuck[r],
        marks,
    )


def check_order(schedule: Schedule) -> None:
    """Between each pair of ranks, the receiver takes the messages in the order they were sent."""
    sent: dict[tuple[int, int], list[tuple[Message, int]]] = {}
    taken: dict[tuple[int, int], list[tuple[Message, int]]] = {}
    look = message_lookup(schedule)
    for r, acts in sorted(schedule.ranks.items()):
        for k, a in enumerate(acts):
            for msg, peer in look(a):
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    sent.setdefault((r, peer), []).append((msg, k))
                else:
                    taken.setdefault((peer, r), []).append((msg, k))
    for (r, q), out in sorted(sent.items()):
        into = taken.get((r, q), [])
        for (msg, k), (got, k2) in zip(out, into):
            if msg != got:
                _fail(
                    schedule,
                    f"rank {r} sends {_name(msg)} to rank {q} before {_name(got)}, but rank {q} "
                    f"takes {_name(got)} first: messages between two ranks arrive in the order "
                    "they are sent",
                    r,
                    k,
                    {r: k, q: k2},
                )


def _name(msg: Message) -> str:
    kind, s, t, m = msg
    return (
        f"activations {s}->{t} of micro-batch {m}"
        if kind == "F"
        else (f"gradients {s}->{t} of micro-batch {m}")
    )


@dataclass
class Rendezvous:
    """Where a rendezvous run of a lowered schedule stopped (module doc): per rank, the batch it
    waits at (comm.batches) or None when it ran to the end; what went through."""

    programs: dict[int, list[list[Action]]]
    at: dict[int, int | None]
    done: set[Action]
    delivered: set[Message]

    @property
    def stuck(self) -> dict[int, int]:
        """rank -> the index of the batch it waits at."""
        return {r: k for r, k in self.at.items() if k is not None}

    def step(self, r: int) -> int:
        """The position in rank r's action list where its waiting batch begins."""
        return sum(len(b) for b in self.programs[r][: self.at[r]])


def posts(lowered: Schedule, batch: list[Action]) -> set[tuple[Message, bool]]:
    """What a batch posts at once: each message it carries, and whether it is the send."""
    return {
        (msg, a.kind in (Kind.SEND_F, Kind.SEND_B))
        for a in batch
        if not a.kind.is_compute
        for msg, _ in action_messages(lowered, a)
    }


def rendezvous_run(schedule: Schedule) -> Rendezvous:
    """Run the ranks with blocking sends: each rank's compute actions once their inputs are in,
    its batches once every message in them has met its other end posted (module doc)."""
    has_comms = comms_of(schedule)
    split = split_stages(schedule)
    progs = {r: batches(acts) for r, acts in schedule.ranks.items()}
    posted_by = {r: [posts(schedule, b) for b in prog] for r, prog in progs.items()}
    done: set[Action] = set()
    delivered: set[Message] = set()
    ptr = dict.fromkeys(progs, 0)
    moved = True
    while moved:
        moved = False
        for r, prog in progs.items():  # compute actions whose inputs are in
            while ptr[r] < len(prog) and prog[ptr[r]][0].kind.is_compute:
                a = prog[ptr[r]][0]
                if any(d not in done for d in dependencies(a, schedule, has_comms, split)):
                    break
                done.add(a)
                ptr[r] += 1
                moved = True
        heads = {r: posted_by[r][ptr[r]] for r in progs if ptr[r] < len(progs[r])}
        posted = set().union(*heads.values()) if heads else set()
        # a message goes through while both its ends are posted; a batch ends with its last
        delivered.update(msg for msg, is_send in posted if is_send and (msg, False) in posted)
        for r, ops in heads.items():
            if progs[r][ptr[r]][0].kind.is_compute or not all(m in delivered for m, _ in ops):
                continue
            done.update(progs[r][ptr[r]])
            ptr[r] += 1
            moved = True
    at = {r: (p if p < len(progs[r]) else None) for r, p in ptr.items()}
    return Rendezvous(progs, at, done, delivered)


def _check_rendezvous(schedule: Schedule) -> None:
    run = rendezvous_run(schedule)
    stuck = run.stuck
    if not stuck:
        return
    has_comms = comms_of(schedule)
    split = split_stages(schedule)
    waits = []
    for r, k in sorted(stuck.items()):
        b = run.programs[r][k]
        if b[0].kind.is_compute:
            what = [d for d in dependencies(b[0], schedule, has_comms, split) if d not in run.done]
            waits.append(f"rank {r} waits at {b[0]} for {', '.join(map(str, what))}")
            continue
        for a in b:
            late = [(msg, peer) for msg, peer in action_messages(schedule, a)
                    if msg not in run.delivered]  # fmt: skip
            if late:
                msg, peer = late[0]
                other = "receive" if a.kind in (Kind.SEND_F, Kind.SEND_B) else "send"
                waits.append(f"rank {r} waits at {a} for rank {peer} to post the {other} of "
                             f"{_name(msg)}")  # fmt: skip
                break
    marks = {r: run.step(r) for r in stuck}
    r = min(stuck)
    _fail(
        schedule,
        "deadlock when a send completes only once its receive is posted: " + "; ".join(waits),
        r,
        marks[r],
        marks,
    )


def _appears(schedule: Schedule, a: Action) -> bool:
    return any(a in acts for acts in schedule.ranks.values())


def _fail(
    schedule: Schedule, msg: str, rank: int, step: int, marks: dict[int, int] | None = None
) -> None:
    raise ScheduleError(
        f"{schedule.name}: {msg} (rank {rank}, step {step})\n"
        + grid(schedule, marks or {rank: step}, focus=step)
    )


def grid(schedule: Schedule, marks: dict[int, int] | None = None, focus: int | None = None,
         width: int = 16) -> str:  # fmt: skip
    """The rank x step grid; cells in `marks` (rank -> step) are shown as >cell<. Long schedules
    show a window of `width` steps around `focus`."""
    marks = marks or {}
    n = max((len(a) for a in schedule.ranks.values()), default=0)
    lo = 0 if focus is None or n <= width else max(0, min(focus - width // 2, n - width))
    hi = (
        n
        if focus is None and n <= 4 * width
        else min(n, lo + (width if focus is not None else 4 * width))
    )
    cells = {
        r: [str(a) for a in acts[lo:hi]] + [""] * (hi - lo - len(acts[lo:hi]))
        for r, acts in schedule.ranks.items()
    }
    for r, p in marks.items():
        if lo <= p < hi:
            cells[r][p - lo] = f">{cells[r][p - lo] or '?'}<"
        elif p == len(schedule.ranks[r]) and p == hi:
            cells[r].append(">?<")
    w = max([len(c) for row in cells.values() for c in row] + [len(str(hi))], default=1)
    head = "rank\\step " + " ".join(str(k).rjust(w) for k in range(lo, hi))
    rows = [f"{r:>9} " + " ".join(c.rjust(w) for c in cells[r]) for r in sorted(cells)]
    more = f" ... ({n} steps)" if lo > 0 or hi < n else ""
    return "\n".join([head + more, *rows])
