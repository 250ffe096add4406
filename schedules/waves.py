"""A compute-only schedule as arrays, its dependencies cut into waves, and the simulation that
runs one wave at a time: numpy over each wave instead of Python over each action, for the
planner, which simulates schedules of tens of thousands of actions.

Nodes are the actions, rank by rank in program order, then the transfers: an F's output or a
B/I's input gradient crossing ranks. A node starts when its predecessors (at most three) have
all ended, and ends its duration later:

    action     the action before it on its rank; F(s,m): its input X(s,m); B/I(s,m): F(s,m)
               and the gradient G(s,m); W(s,m): I(s,m)
    transfer   the action that made the tensor, and the transfer before it on the same cut and
               direction (one link each, taken in the sender's program order)

X(s,m) is F(s-1,m) itself when both stages share a rank, else the transfer after it; G(s,m)
likewise from stage s+1's B or I (none where stage s+1 sends no gradient back: no stage
before it trains, a frozen prefix). These are simulate.py's rules with its arithmetic (start: the
largest predecessor end; end: start + duration), so the two agree to the bit, and a test holds
them to each other. A wave holds the nodes whose longest chain of predecessors has one length:

    1f1b, K = 2, M = 2 (T: a transfer)
    wave 0: 0F0          wave 3: 1B0          wave 6: 1F1
    wave 1: 0F1  T(0F0)  wave 4: T(1B0)       wave 7: 1B1 ...
    wave 2: 1F0          wave 5: 0B0  T(0F1)

so each wave reads only what earlier waves wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from .ir import Action, Kind, Schedule
from .order import compute_only_key

KIND_CODE = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3}  # as arrays carry kinds
F_, B_, I_, W_ = range(4)


@dataclass(frozen=True)
class Waves:
    """`actions` rank by rank in program order (`offsets[r]` where rank r's begin); node n >= len
    (actions) is transfer n - len(actions), sent by `tr_source`. `pred[n]`: node n's
    predecessors, `nodes` (the sentinel, which ends at 0) where it has fewer than three."""

    actions: tuple[Action, ...]
    offsets: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    tr_dir: np.ndarray  # 0: activations forward, 1: gradients back
    tr_cut: np.ndarray
    tr_mb: np.ndarray
    tr_source: np.ndarray
    pred: np.ndarray
    waves: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]  # nodes, preds
    # every node, lane by lane (a rank's actions, then a link's transfers), each in its order
    lanes: np.ndarray
    lane_starts: np.ndarray

    @property
    def nodes(self) -> int:
        return len(self.pred)


_CACHE: dict[object, Waves | None] = {}


def waves_of(schedule: Schedule, sends: Sequence[bool] | None = None) -> Waves | None:
    """The schedule's waves (kept per schedule), or None where the fast path does not apply:
    communication actions, an action twice, a dependency missing or a cycle. simulate() then
    runs its event loop, which reports what is wrong. `sends`: per stage, whether it sends
    gradients back (None: every stage; where one does not, the stage before waits for none)."""
    key = compute_only_key(schedule)
    if key is None:
        return None
    key = (key, None if sends is None else tuple(sends))
    if key not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = _build(schedule, sends)
    return _CACHE[key]


def _build(schedule: Schedule, sends: Sequence[bool] | None = None) -> Waves | None:
    S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    if sorted(schedule.ranks) != list(range(R)):
        return None
    acts = tuple(a for r in range(R) for a in schedule.ranks[r])
    if not set(map(attrgetter("kind"), acts)) <= KIND_CODE.keys():
        return None
    n = len(acts)
    # map with attrgetter: the attribute reads run in C
    kind = np.fromiter(map(KIND_CODE.__getitem__, map(attrgetter("kind"), acts)), np.int64, n)
    stage = np.fromiter(map(attrgetter("stage"), acts), np.int64, n)
    mb = np.fromiter(map(attrgetter("microbatch"), acts), np.int64, n)
    if n and (stage.min() < 0 or stage.max() >= S or mb.min() < 0 or mb.max() >= M):
        return None
    lens = [len(schedule.ranks[r]) for r in range(R)]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    rank = np.repeat(np.arange(R), lens)
    place = np.asarray(schedule.placement, dtype=np.int64)
    if n and (place[stage] != rank).any():
        return None

    def table(mask: np.ndarray) -> np.ndarray | None:
        """(stage, micro-batch) -> the one node of `mask` there, -1 where none; None if two."""
        at = np.full(S * M, -1, dtype=np.int64)
        cell = stage[mask] * M + mb[mask]
        if len(cell) and np.bincount(cell).max() > 1:
            return None
        at[cell] = np.nonzero(mask)[0]
        return at

    is_f, is_bi, is_i, is_w = kind == F_, (kind == B_) | (kind == I_), kind == I_, kind == W_
    f_at, bi_at, i_at, w_at = table(is_f), table(is_bi), table(is_i), table(is_w)
    if f_at is None or bi_at is None or i_at is None or w_at is None:
        return None
    # transfers: what crosses ranks, in node order (per sender, its program order)
    last = S - 1
    nxt = np.minimum(stage + 1, last)
    prv = np.maximum(stage - 1, 0)
    # back[s]: whether stage s sends gradients back (so stage s - 1's B or I waits for it)
    back = np.ones(S, dtype=bool) if sends is None else np.asarray(sends, dtype=bool)
    fwd_out = is_f & (stage < last) & (place[nxt] != rank)
    bwd_out = is_bi & (stage > 0) & (place[prv] != rank) & back[stage]
    source = np.nonzero(fwd_out | bwd_out)[0]
    t_dir = np.where(fwd_out[source], 0, 1).astype(np.int64)
    t_cut = np.where(t_dir == 0, stage[source], stage[source] - 1)
    T = len(source)
    N = n + T
    sentinel = N
    out_of = np.full(n, -1, dtype=np.int64)  # the transfer an action sends, -1: none
    out_of[source] = n + np.arange(T)

    def arrived(producer: np.ndarray) -> np.ndarray:
        """Where a consumer on another rank reads the producer's tensor: its transfer."""
        t = out_of[producer]
        return np.where(t >= 0, t, producer)

    pred = np.full((N, 3), sentinel, dtype=np.int64)
    act = pred[:n]  # the actions' rows (a view)
    idx = np.arange(n)
    first = np.zeros(n, dtype=bool)
    first[offsets[:-1][np.array(lens) > 0]] = True
    act[:, 0] = np.where(first, sentinel, idx - 1)
    # (who, column, producer table, producer's stage, whether it may come by a transfer)
    rules = (
        (is_f & (stage > 0), 1, f_at, np.maximum(stage - 1, 0), True),  # F: X from F(s-1)
        (is_bi, 1, f_at, stage, False),  # B/I: its own F
        (is_bi & (stage < last) & back[nxt], 2, bi_at, nxt, True),  # B/I: G from s+1's B/I
        (is_w, 1, i_at, stage, False),  # W: its own I
    )
    for need, column, table_at, where, crossing in rules:
        src = table_at[where * M + mb][need]
        if (src < 0).any():  # a dependency the schedule never runs
            return None
        act[need, column] = arrived(src) if crossing else src
    # a transfer: its sender, and the transfer before it on its link
    pred[n:N, 0] = source
    link = t_dir * S + t_cut
    by_link = np.lexsort((source, link))
    before = np.full(T, sentinel, dtype=np.int64)
    same = link[by_link][1:] == link[by_link][:-1]
    before[by_link[1:][same]] = n + by_link[:-1][same]
    pred[n:N, 1] = before
    # lanes: each rank's actions in program order, then each link's transfers in turn; a
    # node's predecessors include the one before it in its lane
    lanes = np.concatenate([np.arange(n), n + by_link])
    link_starts = n + np.flatnonzero(np.concatenate([[T > 0], ~same])) if T else []
    lane_starts = np.unique(np.concatenate([offsets, link_starts, [N]]).astype(np.int64))
    waves = _kahn(pred, sentinel, R, lanes, lane_starts)
    if waves is None:
        return None
    return Waves(
        actions=acts, offsets=offsets, kind=kind, stage=stage, mb=mb, tr_dir=t_dir,
        tr_cut=t_cut, tr_mb=mb[source], tr_source=source, pred=pred,
        waves=tuple((w, pred[w, 0], pred[w, 1], pred[w, 2]) for w in waves), lanes=lanes,
        lane_starts=lane_starts,
    )  # fmt: skip


def _kahn(
    pred: np.ndarray, sentinel: int, ranks: int, lanes: np.ndarray, lane_starts: np.ndarray
) -> list[np.ndarray] | None:
    """The nodes wave by wave (Kahn's algorithm, a whole frontier at a time), each wave in node
    order; None on a cycle. A wave holds about one node per rank and link: with few ranks,
    numpy's cost per call outweighs its speed per node, and plain Python does better (equal
    at 16 ranks on this project's 2-core machine, the lanes 3x faster at 64)."""
    if ranks <= 8:
        return _kahn_python(pred, sentinel)
    return _kahn_lanes(pred, sentinel, lanes, lane_starts)


def _kahn_lanes(
    pred: np.ndarray, sentinel: int, lanes: np.ndarray, lane_starts: np.ndarray
) -> list[np.ndarray] | None:
    """Kahn's waves where the nodes form lanes (`lanes[lane_starts[k]:lane_starts[k + 1]]`,
    each node's lane predecessor among its predecessors): the next wave is every lane's next
    node whose predecessors are all done. A node joins the wave after its last predecessor's,
    as in Kahn's algorithm, and only lanes are looked at, never successor lists."""
    done = np.zeros(len(pred) + 1, dtype=bool)
    done[sentinel] = True
    pos, end = lane_starts[:-1].copy(), lane_starts[1:].copy()
    waves = []
    while len(pos):
        head = lanes[pos]
        ready = done[pred[head]].all(axis=1)
        nodes = head[ready]
        if not len(nodes):
            return None  # a cycle: no lane can move
        done[nodes] = True
        nodes.sort()
        waves.append(nodes)
        pos += ready
        if (pos[ready] == end[ready]).any():
            keep = pos < end
            pos, end = pos[keep], end[keep]
    return waves


def _successors(pred: np.ndarray, sentinel: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each node's in-degree, and its successors: flat[ptr[q] : ptr[q + 1]] for node q."""
    N = len(pred)
    dst = np.repeat(np.arange(N), 3)
    src = pred.reshape(-1)
    real = src != sentinel
    src, dst = src[real], dst[real]
    by_src = np.argsort(src, kind="stable")
    ptr = np.searchsorted(src[by_src], np.arange(N + 1))
    return np.bincount(dst, minlength=N), dst[by_src], ptr


def _kahn_python(pred: np.ndarray, sentinel: int) -> list[np.ndarray] | None:
    N = len(pred)
    # (numpy builds the successor lists; Python walks them)
    arrays = _successors(pred, sentinel)
    indeg, flat, ptr = (a.tolist() for a in arrays)
    level = [0] * N
    frontier = [n for n in range(N) if indeg[n] == 0]
    done = 0
    while frontier:
        done += len(frontier)
        nxt = []
        for q in frontier:
            up = level[q] + 1
            for n in flat[ptr[q] : ptr[q + 1]]:
                indeg[n] -= 1
                if indeg[n] == 0:
                    level[n] = up
                    nxt.append(n)
        frontier = nxt
    if done < N:
        return None
    depth = np.array(level, dtype=np.int64)
    order = np.argsort(depth, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(depth[order])) + 1)


def durations(
    w: Waves,
    forward: Sequence[float],
    backward: Sequence[float],
    input_grad: Sequence[float],
    weight_grad: Sequence[float],
    remat: np.ndarray,
    transfer: Sequence[float],
) -> np.ndarray:
    """Each node's duration, as simulate() charges it (`remat[s, m]`: what re-materialising
    micro-batch m's forward adds to stage s's B or I, 0 where it keeps its activations)."""
    s = w.stage
    f = np.asarray(forward, dtype=np.float64)
    per_kind = np.stack(
        [f, np.asarray(backward, np.float64), np.asarray(input_grad, np.float64),
         np.asarray(weight_grad, np.float64)]
    )  # fmt: skip
    d = per_kind[w.kind, s]
    again = (w.kind == B_) | (w.kind == I_)
    d = np.where(again, d + remat[s, w.mb], d)  # (the same sum as simulate's `bwd + rec`)
    link = np.asarray(list(transfer) + [0.0], dtype=np.float64)
    return np.concatenate([d, link[w.tr_cut]])


def run(w: Waves, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every node's start and end."""
    end = np.zeros(w.nodes + 1)  # the last entry: the sentinel, ended at 0
    start = np.zeros(w.nodes)
    for nodes, p0, p1, p2 in w.waves:
        st = np.maximum(np.maximum(end[p0], end[p1]), end[p2])
        start[nodes] = st
        end[nodes] = st + dur[nodes]
    return start, end[:-1]
