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
    """SEND_F after a forward whose activations some other rank takes, RECV_F before a forward
    that takes activations from another rank; SEND_B and RECV_B alike for their gradients. One
    action carries every route of its stage that crosses ranks (schedule.routes)."""
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


def messages(lowered: Schedule) -> list[tuple[Action, Action]]:
    """Every message a step sends between ranks: (the send that carries it, the receive that
    takes it). A route s -> t across ranks is one message per micro-batch each way."""
    place, M = lowered.placement, lowered.num_microbatches
    out = []
    for s, t in lowered.edges():
        if place[s] == place[t]:
            continue
        for m in range(M):
            out.append((Action(s, Kind.SEND_F, m), Action(t, Kind.RECV_F, m)))
            out.append((Action(t, Kind.SEND_B, m), Action(s, Kind.RECV_B, m)))
    return out


def send_acks(lowered: Schedule) -> dict[int, dict[int, list[Action]]]:
    """Where each rank may let go of what it sent: rank -> {index of a receive -> the sends it
    proves complete}. A message to rank q is complete once we have received anything q sent
    after taking it: q takes its receives in program order, so such a message comes later. A
    send is complete when all its messages are. Sends no receive acknowledges are let go at
    the end of the step.

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
    msgs = messages(lowered)
    # per receive: the (peer rank, position there) of each message it takes
    taken_from: dict[Action, list[tuple[int, int]]] = {}
    for send, recv in msgs:
        taken_from.setdefault(recv, []).append(where[send])
    acks: dict[int, dict[int, list[Action]]] = {r: {} for r in lowered.ranks}
    done_at: dict[Action, int] = {}  # a send -> the receive index by which all its messages are
    for send, recv in msgs:
        r, k = where[send]
        peer, taken = place[recv.stage], where[recv][1]
        ack = None
        for k2 in range(k + 1, len(lowered.ranks[r])):
            b = lowered.ranks[r][k2]
            if b.kind in (Kind.RECV_F, Kind.RECV_B) and any(
                pr == peer and pk > taken for pr, pk in taken_from.get(b, [])
            ):
                ack = k2
                break
        if ack is None:
            done_at[send] = -1  # let go at the end of the step
        elif done_at.get(send, 0) >= 0:
            done_at[send] = max(done_at.get(send, 0), ack)
    for send, k2 in done_at.items():
        if k2 >= 0:
            acks[place[send.stage]].setdefault(k2, []).append(send)
    return acks
