"""validate(schedule): every stage runs F and B (or I and W) once per micro-batch, dependencies
hold, and executing the ranks' lists in order cannot deadlock. Errors print the rank x step grid
with the faulty cell marked."""

from __future__ import annotations

from collections import Counter

from .ir import Action, Kind, Schedule, infer_placement


class ScheduleError(ValueError):
    """A schedule that cannot run. The message ends with the grid, the faulty cell in >< marks."""


def validate(schedule: Schedule) -> None:
    try:
        placement = infer_placement(schedule.ranks, schedule.num_stages)
    except ValueError as e:
        raise ScheduleError(f"{schedule.name}: {e}\n{grid(schedule)}") from None
    if placement != schedule.placement:
        raise ScheduleError(f"{schedule.name}: actions do not match the stated stage placement")
    _check_counts(schedule)
    _check_runs(schedule)


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


def split_stages(schedule: Schedule) -> set[int]:
    """Stages whose backward is split into I and W."""
    return {a.stage for acts in schedule.ranks.values() for a in acts if a.kind == Kind.I}


def dependencies(a: Action, schedule: Schedule, has_comms: bool, split: set[int]) -> list[Action]:
    """What must have run before `a` (on any rank). Cross-rank inputs come through a RECV when
    the schedule carries communication, directly from the producer when it is compute-only.
    `split`: the stages whose backward is I + W (see split_stages)."""
    S, s, m, k, place = schedule.num_stages, a.stage, a.microbatch, a.kind, schedule.placement

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


def _check_runs(schedule: Schedule) -> None:
    """Run every rank's list in order, each action once all it depends on has run; sends never
    block, receives wait for their send. Stuck before the end means deadlock."""
    has_comms = any(not a.kind.is_compute for acts in schedule.ranks.values() for a in acts)
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
