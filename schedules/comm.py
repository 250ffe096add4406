"""Insert SEND/RECV for every edge that crosses ranks.

Each receive goes right before the action that consumes it and each send right after the action
that produces it. With sends that do not block (isend) and receives that wait, this cannot hang
whenever the compute-only schedule is deadlock-free: a receive waits exactly for a send that sits
right behind an action the compute-only schedule already ran before the consumer.
`validate()` on the result checks it anyway.
"""

from __future__ import annotations

from .ir import Action, Kind, Schedule


def insert_comms(schedule: Schedule) -> Schedule:
    S, place = schedule.num_stages, schedule.placement
    out: dict[int, list[Action]] = {}
    for r, acts in schedule.ranks.items():
        seq: list[Action] = []
        for a in acts:
            if not a.kind.is_compute:
                continue  # already lowered: re-insert from scratch
            s, m = a.stage, a.microbatch
            if a.kind == Kind.F and s > 0 and place[s - 1] != r:
                seq.append(Action(s, Kind.RECV_F, m))
            if a.kind in (Kind.B, Kind.I) and s < S - 1 and place[s + 1] != r:
                seq.append(Action(s, Kind.RECV_B, m))
            seq.append(a)
            if a.kind == Kind.F and s < S - 1 and place[s + 1] != r:
                seq.append(Action(s, Kind.SEND_F, m))
            if a.kind in (Kind.B, Kind.I) and s > 0 and place[s - 1] != r:
                seq.append(Action(s, Kind.SEND_B, m))
        out[r] = seq
    return Schedule(schedule.name, S, schedule.num_microbatches, out, list(place))
