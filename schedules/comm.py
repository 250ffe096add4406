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


def _match(a: Action) -> Action:
    """The receive a send is taken by (and the send a receive takes)."""
    return {
        Kind.SEND_F: Action(a.stage + 1, Kind.RECV_F, a.microbatch),
        Kind.RECV_F: Action(a.stage - 1, Kind.SEND_F, a.microbatch),
        Kind.SEND_B: Action(a.stage - 1, Kind.RECV_B, a.microbatch),
        Kind.RECV_B: Action(a.stage + 1, Kind.SEND_B, a.microbatch),
    }[a.kind]


def send_acks(lowered: Schedule) -> dict[int, dict[int, list[Action]]]:
    """Where each rank may let go of what it sent: rank -> {index of a receive -> the sends it
    proves complete}. A send to rank q is complete once we have received anything q sent after
    taking it: q takes its receives in program order, so such a message comes later. Sends no
    receive acknowledges are let go at the end of the step.

        0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 ...     RECV_B0 acknowledges SEND_F0, since
        1: RECV_F0 F0 B0 SEND_B0 RECV_F1 ...        rank 1 sent B0 after taking F0
    """
    place = lowered.placement
    where = {
        a: (r, k)
        for r, acts in lowered.ranks.items()
        for k, a in enumerate(acts)
        if not a.kind.is_compute
    }
    acks: dict[int, dict[int, list[Action]]] = {r: {} for r in lowered.ranks}
    for r, acts in lowered.ranks.items():
        for k, a in enumerate(acts):
            if a.kind not in (Kind.SEND_F, Kind.SEND_B):
                continue
            taken = where[_match(a)][1]  # where the peer takes it
            peer = place[_match(a).stage]
            for k2 in range(k + 1, len(acts)):
                b = acts[k2]
                if b.kind in (Kind.RECV_F, Kind.RECV_B) and place[_match(b).stage] == peer:
                    if where[_match(b)][1] > taken:
                        acks[r].setdefault(k2, []).append(a)
                        break
    return acks
