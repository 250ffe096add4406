"""Exact min-bottleneck contiguous partition ("chains on chains") under per-stage memory limits.

Stage s runs layers [i, j) on device s, costs (T[j] - T[i]) / speed[s] per micro-batch and must
fit budget[s]. Optionally the link between stages s and s + 1 costs cuts[s][j] per micro-batch
when that cut sits at layer boundary j (math.inf: not allowed there), or cuts[s][j, k] when it
also depends on where stage s + 1 ends (a captured graph's stage receives what its layers read;
non-decreasing in k, so it limits how far stage s + 1 may reach from j, as memory does). Links are resources of
their own (transfers overlap compute), so we minimise the slowest stage or link:

    bottleneck = max( max_s (T[b_{s+1}] - T[b_s]) / speed[s],  max_{s < K-1} cuts[s][b_{s+1}] )

The probe answers "is there a split whose every stage and every cut costs at most B?" exactly: it
carries the set of layer positions that s stages can reach, stage by stage. From a start i, the
feasible ends are the interval (i, e_s(i)], where e_s(i) is limited by time (a binary search on
the prefix sums) and by memory (precomputed once per distinct device; memory does not depend on
B); a position where the next stage may start must also be a cut the link allows within B:

    reach_0 = {0};   reach_{s+1} = union over i in reach_s of (i, e_s(i)]  &  {j : cuts[s][j] <= B}
    (no cut mask after the last stage);   feasible iff L in reach_K

Greedy "fill each stage as far as it goes" is not enough here: with unequal devices, or with a
memory term that depends on where a stage starts (the recomputed stage's input), running ahead
can strand a heavy layer on a small device. The search over B bisects on the real line, snaps to
the bottleneck of each feasible split found, and finishes by proving that nothing just below the
best bottleneck is feasible, so the answer is the exact optimum, not an approximation.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .memory import MemoryModel, StageShape


@dataclass(frozen=True)
class StageSpec:
    """Device position s of the pipeline: its speed, its memory budget, and its memory shape.
    `more`: further shapes the stage may choose instead (per-stage recomputation), option x
    costing times[x] per layer; option 0 is `shape`."""

    speed: float
    budget: int
    shape: StageShape
    more: tuple[StageShape, ...] = ()

    @property
    def shapes(self) -> tuple[StageShape, ...]:
        return (self.shape, *self.more)


@dataclass
class Partition:
    bounds: list[int]  # K + 1 cut positions: 0 = b_0 < b_1 < ... < b_K = L
    bottleneck: float  # the slowest stage, or the slowest transfer at a cut when cuts were given
    probes: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    choices: list[int] = field(default_factory=list)  # per stage: the option it runs (or [])

    @property
    def stages(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))


def stage_costs(times: np.ndarray, bounds: list[int], speeds: list[float]) -> list[float]:
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    return [
        float(prefix[j] - prefix[i]) / sp
        for (i, j), sp in zip(zip(bounds[:-1], bounds[1:]), speeds)
    ]


def cut_table(cuts: Sequence[np.ndarray] | None, layers: int, stages: int) -> np.ndarray | None:
    """cuts as a (stages - 1, layers + 1) float array, checked; None stays None.

    A link's cost may also depend on where the stage after it ends (a captured graph's stage
    receives only what its layers read): cuts[s][j, k] for the stage [j, k), non-decreasing in
    k. With any such entry the table is (stages - 1, layers + 1, layers + 1), the others
    broadcast along k."""
    if cuts is None:
        return None
    if len(cuts) != stages - 1:
        raise ValueError(
            f"cuts has {len(cuts)} arrays but {stages} stages have {stages - 1} links; "
            "pass one array per link"
        )
    rows = [np.asarray(row, dtype=np.float64) for row in cuts]
    spans = any(row.ndim == 2 for row in rows)
    n = layers + 1
    table = np.empty((stages - 1, n, n) if spans else (stages - 1, n), dtype=np.float64)
    for s, row in enumerate(rows):
        if row.shape not in ((n,), (n, n)):
            raise ValueError(
                f"cuts[{s}] has shape {row.shape}; pass one entry per layer boundary, "
                f"{n} for {layers} layers (or {n} x {n}: per start and end of the next stage)"
            )
        if not (row >= 0).all():
            raise ValueError(f"cuts[{s}] has a negative or NaN entry; use math.inf to forbid a cut")
        if spans and row.ndim == 2:
            later = np.triu(np.ones((n, n), dtype=bool), 1)
            with np.errstate(invalid="ignore"):  # inf - inf: a forbidden start, any order
                grows = np.diff(np.where(later, row, 0.0), axis=1)
            if (grows < 0).any():
                raise ValueError(f"cuts[{s}][j, k] must not decrease as k grows")
        table[s] = row if not spans or row.ndim == 2 else row[:, None]
    return table


def split_cuts(table: np.ndarray | None, bounds: list[int]) -> list[float]:
    """The transfer time of each link of a split (empty without cuts)."""
    if table is None:
        return []
    if table.ndim == 3:
        return [float(table[s][j, bounds[s + 2]]) for s, j in enumerate(bounds[1:-1])]
    return [float(table[s][j]) for s, j in enumerate(bounds[1:-1])]


def option_times(times: np.ndarray, stages: Sequence[StageSpec]) -> np.ndarray:
    """times as an (options, layers) array, one row per option every stage has."""
    table = np.atleast_2d(np.asarray(times, dtype=np.float64))
    for s, spec in enumerate(stages):
        if len(spec.shapes) != len(table):
            raise ValueError(
                f"stage {s} has {len(spec.shapes)} memory shapes for {len(table)} rows of times"
            )
    return table


class _Prober:
    def __init__(
        self,
        times: np.ndarray,
        memory: MemoryModel,
        stages: list[StageSpec],
        cuts: Sequence[np.ndarray] | None = None,
        cap_bound: float = math.inf,
    ) -> None:
        """`cap_bound`: the largest bound the caller expects to probe. Memory tables are then
        searched only as far as any stage could reach under it (the cheapest option at the
        fastest speed), and searched in full the first time a probe reaches past that."""
        table = option_times(times, stages)
        self.L, self.K = table.shape[1], len(stages)
        self.cuts = cut_table(cuts, self.L, self.K)
        # Under an infinite bound a cut is allowed iff finite: compare against the largest one.
        finite = self.cuts[np.isfinite(self.cuts)] if self.cuts is not None else np.zeros(0)
        self.max_cut = float(finite.max()) if finite.size else 0.0
        self._cut_values = np.unique(finite)  # sorted: the next one past a bound is a search
        zero = np.zeros((len(table), 1))
        self.prefixes = np.concatenate([zero, np.cumsum(table, axis=1)], axis=1)
        self.least = table.min(axis=0)  # per layer, its cheapest option (for lower bounds)
        self.speeds = [s.speed for s in stages]
        self.probes = 0
        # whether memory lowered some stage's end in the last probe, from a start its stages
        # may still reach the end from on time alone (_near)
        self.memory_cut = False
        self._every = np.arange(self.L + 1, dtype=np.int64)
        self._memory, self._keys = memory, [[(sh, s.budget) for sh in s.shapes] for s in stages]
        self._least = np.concatenate([[0.0], np.cumsum(self.least)])
        self.reach_to(cap_bound)
        self._bound = math.nan  # the bound _time_ends holds ends for (nan: none yet)
        self._near_at: tuple[float, list[int]] = (math.nan, [])  # (_near's last bound, its)
        self._time_ends: dict[tuple[int, float], np.ndarray] = {}
        self._link_ends: dict[int, np.ndarray] = {}
        # Links whose cost depends on the next stage's end: the entries before a start do not
        # count (cleared, so that each row is non-decreasing and a count finds the last end).
        if self.cuts is not None and self.cuts.ndim == 3:
            later = np.triu(np.ones((self.L + 1, self.L + 1), dtype=bool), 1)
            self.cuts = np.where(later, self.cuts, 0.0)

    def reach_to(self, cap_bound: float) -> None:
        """Make the memory tables exact for every probe up to cap_bound (math.inf: any).

        Under a finite bound they are searched only as far as any stage could reach (the
        cheapest option at the fastest speed), and only from the starts a split within the
        bound may give each stage, time alone deciding (memory and links only take starts
        away): stage s starts at most where s stages filled as far as they go end
        (`_window[s][1]`), and at least where the stages after it, filled so, still reach the
        end (`_window[s][0]`). On long chains and many stages, near the optimum, that is a few
        starts per stage, where the whole chain is L."""
        L, K = self.L, self.K
        self._loads = getattr(self, "_loads", 0) + 1
        self._cap_bound = cap_bound
        # per option and start: the last end the tables are exact to
        self._cap: list[np.ndarray] | None = None
        self._window: list[tuple[int, int]] | None = None  # per stage: its first and last start
        if math.isfinite(cap_bound):
            # Each option costs at least the cheapest per layer, so its time ends come no
            # later; taken a little past the bound, as a float sum over the cheapest options
            # may round unlike an option's own (a window too narrow at its first start would
            # go unnoticed: one too narrow at its last is searched in full, _starts)
            wide = cap_bound * (1 + 1e-9) + 1e-12 * self.prefixes[:, -1].max() / min(self.speeds)
            ends = {
                sp: self._time_end(self._least, sp, self._every, wide) for sp in set(self.speeds)
            }
            # (each option's own time ends, at the fastest speed: an option that costs more
            # than the cheapest searches its tables less far)
            own = {
                (x, sp): self._time_end(P, sp, self._every, wide)
                for x, P in enumerate(self.prefixes)
                for sp in set(self.speeds)
            }
            fastest = max(self.speeds)
            self._cap = [own[(x, fastest)][:L] for x in range(len(self.prefixes))]
            first, last, far = [0] * K, [0] * K, 0
            guessed, reach = [0] * K, 0  # the same, memory's ends guessed too (end_guess)
            for s in range(K):
                last[s] = min(far, L - (K - s))
                far = int(ends[self.speeds[s]][last[s]])
                guessed[s] = at = min(reach, last[s])
                reach = max(
                    min(int(own[(x, self.speeds[s])][at]), self._memory.end_guess(*key, at))
                    for x, key in enumerate(self._keys[s])
                )
            near = L
            for s in range(K - 1, -1, -1):  # the first start whose greedy stages reach `near`
                near = first[s] = int(np.searchsorted(ends[self.speeds[s]], near, side="left"))
            self._wide = list(zip(first, last))
            # Where memory binds, a stage's ends come sooner than time alone lets them: its
            # window ends where the stages before it, filled as far as time and the guess of
            # memory let them, end (a stage reached past it widens the windows: _starts).
            self._window = [(f, max(f, g)) for f, g in zip(first, guessed)]
        self._load_tables()

    def _load_tables(self) -> None:
        keys, starts, caps = [], [], []
        for s, row in enumerate(self._keys):
            keys += row
            caps += self._cap or []
            if self._window is not None:
                first, last = self._window[s]
                starts += [np.arange(first, last + 1, dtype=np.int64)] * len(row)
        found = self._memory.max_ends(keys, cap=caps or None, starts=starts or None)
        self.mem_end: list[list[np.ndarray]] = []
        for row in self._keys:
            self.mem_end.append(found[: len(row)])
            found = found[len(row) :]

    def _exact_to(self, starts: np.ndarray, j: np.ndarray, x: int | None = None) -> None:
        """Make the memory tables exact up to end j from each start (searching them in full)."""
        if self._cap is None:
            return
        at = np.minimum(starts, self.L - 1)
        if any((j > cap[at]).any() for cap in (self._cap if x is None else [self._cap[x]])):
            self.reach_to(math.inf)

    def _starts(self, s: int, reach: np.ndarray, room: int) -> np.ndarray:
        """The positions stage s may start at: reached, leaving each later stage a layer, and
        within its window (where the tables are exact)."""
        starts = np.nonzero(reach[: room + 1])[0]
        if self._window is not None:
            first, last = self._window[s]
            if starts.size and starts[-1] > last:
                if starts[-1] <= self._wide[s][1] and self._window != self._wide:
                    # memory's guess fell short: the windows time alone gives, whose tables
                    # add to those loaded (max_ends keeps what it found)
                    self._window = self._wide
                    self._loads += 1
                    self._load_tables()
                else:  # (cannot happen under the bound: in full)
                    self.reach_to(math.inf)
                return starts
            starts = starts[starts >= first]
        return starts

    def ends(self, s: int, starts: np.ndarray, bound: float) -> np.ndarray:
        """Largest j per start with cost(s, i, j) <= bound and stage s's memory fitting, under
        the best of its options (each option's feasible ends are an interval from the start).
        The time limit from every start is computed once per probe, option and speed: stages
        of equal speed share it."""
        if self._bound != bound:
            self._bound, self._time_ends, self._link_ends = bound, {}, {}
        best = starts.copy()
        every = self._every
        for x, P in enumerate(self.prefixes):
            key = (x, self.speeds[s])
            if key not in self._time_ends:
                self._time_ends[key] = self._time_end(P, self.speeds[s], every, bound)
            j = self._time_ends[key][starts]
            self._exact_to(starts, j, x)
            room = self.mem_end[s][x][starts]
            if not self.memory_cut and (room < j).any():
                # (only from a start whose stages may still reach the end on time alone: the
                # others' depend on how far the tables were searched, a hint's probes too)
                self.memory_cut = bool(((room < j) & (starts >= self._near(bound)[s])).any())
            best = np.maximum(best, np.minimum(j, room))
        if s > 0 and self.cuts is not None and self.cuts.ndim == 3:
            if s not in self._link_ends:  # the last end each start's link allows
                cap = min(bound, self.max_cut)
                self._link_ends[s] = (self.cuts[s - 1] <= cap).sum(axis=1) - 1
            best = np.minimum(best, np.maximum(self._link_ends[s][starts], starts))
        return best

    def _near(self, bound: float) -> list[int]:
        """Per stage, the first start from which it and the stages after it may reach the end
        within `bound` on time alone (each layer at its cheapest option, links aside; a little
        past the bound, as reach_to's windows)."""
        if self._near_at[0] != bound:
            wide = bound * (1 + 1e-9) + 1e-12 * self.prefixes[:, -1].max() / min(self.speeds)
            ends = {
                sp: self._time_end(self._least, sp, self._every, wide) for sp in set(self.speeds)
            }
            near, first = self.L, [0] * self.K
            for s in range(self.K - 1, -1, -1):
                near = first[s] = int(np.searchsorted(ends[self.speeds[s]], near, side="left"))
            self._near_at = (bound, first)
        return self._near_at[1]

    def _time_end(self, P: np.ndarray, sp: float, starts: np.ndarray, bound: float) -> np.ndarray:
        """Largest j per start with (P[j] - P[start]) / sp <= bound."""
        base = P[starts]
        if math.isinf(bound):
            return np.full(starts.shape, self.L, dtype=np.int64)
        if bound < 0:  # times are >= 0: not even one layer fits
            return starts.copy()
        j = np.searchsorted(P, base + bound * sp, side="right") - 1
        # searchsorted compares base + bound*sp; the cost is (P[j] - base) / sp. Agree exactly,
        # moving a whole run of equal prefix sums (zero-time layers) at a time: they cost the
        # same. Each pass moves j one way only, so both loops end (mostly after one pass).
        while (over := (P[j] - base) / sp > bound).any():
            j = np.where(over, np.searchsorted(P, P[j], side="left") - 1, j)
        nxt = np.minimum(j + 1, self.L)
        while (under := (nxt > j) & ((P[nxt] - base) / sp <= bound)).any():
            j = np.where(under, np.searchsorted(P, P[nxt], side="right") - 1, j)
            nxt = np.minimum(j + 1, self.L)
        return j

    def probe(self, bound: float) -> list[int] | None:
        """A split with every stage cost <= bound and every stage fitting, or None (then
        `next_bound()` says how far the bound must rise to change that)."""
        self.probes += 1
        if bound > self._cap_bound:  # (the windows hold for bounds up to theirs only)
            self.reach_to(math.inf)
        while True:  # again where the tables were searched in full on the way (see _starts)
            loads = self._loads
            found = self._probe(bound)
            if loads == self._loads:
                return found

    def _probe(self, bound: float) -> list[int] | None:
        self.memory_cut = False
        L, K = self.L, self.K
        reach = np.zeros(L + 1, dtype=bool)
        reach[0] = True
        cap = min(bound, self.max_cut)  # cuts[s][j] <= cap: within the bound and finite
        steps: list[tuple[np.ndarray, np.ndarray]] = []
        self._seen: list[tuple[int, np.ndarray, int]] = []  # what next_bound reads
        self._seen_cap = cap
        for s in range(K):
            room = L - (K - s)  # a later stage needs at least one layer each
            starts = self._starts(s, reach, room)
            if starts.size == 0:
                return None
            e = np.minimum(self.ends(s, starts, bound), room + 1)
            self._seen.append((s, starts, room + 1))
            ok = e > starts
            starts, e = starts[ok], e[ok]
            if starts.size == 0:
                return None
            steps.append((starts, e))
            cover = np.bincount(starts + 1, minlength=L + 2) - np.bincount(e + 1, minlength=L + 2)
            reach = np.cumsum(cover)[: L + 1] > 0
            if self.cuts is not None and s < K - 1 and self.cuts.ndim == 2:
                reach &= self.cuts[s] <= cap  # stage s + 1 starts only where its link may cut
        if not reach[L]:
            return None
        bounds = [L]
        for starts, e in reversed(steps):  # every start came from a masked reach: an allowed cut
            end = bounds[-1]
            ok = (starts < end) & (e >= end)
            bounds.append(int(starts[ok][0]))  # the earliest start: later stages as long as allowed
        return bounds[::-1]

    def next_bound(self) -> float:
        """After a probe that found nothing: the least bound that could find something.

        Every bound below both the least cost of one more layer on any stage, from any start it
        reached (by time: memory does not move with the bound), and the least link cost past
        the probe's bound reaches the same ends, and fails alike."""
        values = self._cut_values
        past = int(np.searchsorted(values, self._seen_cap, side="right"))
        least = float(values[past]) if past < len(values) else math.inf
        for s, starts, last in self._seen:
            least = min(least, self._one_more(s, starts, last))
        return least

    def _one_more(self, s: int, starts: np.ndarray, last: int) -> float:
        """The least cost, over stage s's options, of the layer after its time limit from any
        of `starts` (the one `ends` found under the last probe's bound), among those within
        `last`: what a larger bound would first let the stage take."""
        least = math.inf
        for x, P in enumerate(self.prefixes):
            j = self._time_ends[(x, self.speeds[s])][starts]
            more = j < last
            if more.any():
                i = starts[more]
                least = min(least, float(((P[j[more] + 1] - P[i]) / self.speeds[s]).min()))
        return least

    def costs(self, bounds: list[int]) -> tuple[list[float], list[int]]:
        """Per stage of a split: its cost under its fastest option that fits, and that option
        (the first on a tie). The same float expressions the probe compares against its bound."""
        costs, choices = [], []
        for s, (i, j) in enumerate(zip(bounds[:-1], bounds[1:])):
            sp = self.speeds[s]
            # (an option whose time alone takes it past the bound the tables serve is not
            # the fastest one that fits, and its table does not reach that far)
            far = [j <= cap[min(i, self.L - 1)] for cap in self._cap or []]
            if self._cap is not None and not any(far):
                self.reach_to(math.inf)
            best, pick = math.inf, 0
            for x, (P, mem_end) in enumerate(zip(self.prefixes, self.mem_end[s])):
                if self._cap is not None and not far[x]:
                    continue
                if mem_end[i] >= j and float(P[j] - P[i]) / sp < best:
                    best, pick = float(P[j] - P[i]) / sp, x
            costs.append(best)
            choices.append(pick)
        return costs, choices

    def bottleneck(self, bounds: list[int], probed: float = math.inf) -> float:
        """The slowest stage or link of a split; a split that probe(probed) returned costs at
        most `probed` (the bisection relies on it to progress)."""
        value = max(self.costs(bounds)[0] + split_cuts(self.cuts, bounds))
        assert value <= probed, f"the probe returned {bounds} under {probed}, but it costs {value}"
        return value


def feasible_split(
    times: np.ndarray,
    memory: MemoryModel,
    stages: list[StageSpec],
    cuts: Sequence[np.ndarray] | None = None,
    reach_from: int | None = None,
) -> bool:
    """Whether any split fits every stage's budget and cuts only where allowed (time unbounded;
    `reach_from` as fitting_split's)."""
    return (
        fitting_split(times, memory, stages, cuts, split=False, reach_from=reach_from) is not None
    )


def fitting_split(
    times: np.ndarray,
    memory: MemoryModel,
    stages: list[StageSpec],
    cuts: Sequence[np.ndarray] | None = None,
    split: bool = True,
    reach_from: int | None = None,
) -> list[int] | None:
    """Some split (its bounds) that fits every stage's budget under some option and cuts only
    where allowed, time unbounded; None where none does. On chains of `reach_from` layers or
    more (REACH_FROM unless given) memory_split's where it decides (without the memory tables),
    else the probe's (on shorter ones its tables cost less, and are kept for the next candidate
    asked about the same stage shape and budget). `split`: as memory_split's."""
    table = option_times(times, stages)
    L, K = table.shape[1], len(stages)
    if L >= (REACH_FROM if reach_from is None else reach_from) and (
        cuts is None or all(np.ndim(row) == 1 for row in cuts)
    ):
        links = cut_table(cuts, L, K)
        allowed = None if links is None else np.isfinite(links)
        decided, bounds = memory_split(memory, stages, L, allowed, split)
        if decided:
            return bounds
    return _Prober(times, memory, stages, cuts).probe(math.inf)


REACH_FROM = 4096  # layers from which fitting_split tries memory_split first (BENCHMARKS.md)
WINDOW = 64  # the fewest ends _reach tries at once


def memory_split(
    memory: MemoryModel,
    stages: list[StageSpec],
    layers: int,
    allowed: np.ndarray | None = None,
    split: bool = True,
) -> tuple[bool, list[int] | None]:
    """A split of `layers` layers whose every stage fits its budget under some option, time
    aside, cutting only where `allowed` (per link and layer boundary; None: anywhere): (True,
    bounds), or (True, None) where none does; (False, None) where this way cannot tell (then
    the probe's reach over every start does). `split`: False where only whether one fits
    matters (bounds are then [] for yes).

    Where one layer fits from every start a stage may take, the positions s stages reach are an
    interval [lo, r] (each start i adds (i, e(i)], and e(i) > i; past a start where no cut may
    go, the next position must be reached from a start before it), so only its far end needs
    finding: the farthest end any start fits. A start that does not fit end r + 1 fits no later
    end (a stage's memory grows with its end), so the starts are filtered end by end, and the
    last one left is followed to its own farthest end. That is about one evaluation per start
    and a few windows of ends per stage, where the memory tables take a bisection per start,
    stage shape and budget."""
    K = len(stages)
    kept: list[np.ndarray] = []  # per stage: the starts it may take
    lo = hi = 0
    width = max(WINDOW, 2 * (layers // K))
    least = _weights_need(memory, stages, layers)
    for s, spec in enumerate(stages):
        if hi < least[s]:  # the stages from s on cannot hold the rest's weights: none fits
            return True, None
        hi = min(hi, layers - (K - s))  # later stages take a layer each
        reached = np.arange(lo, hi + 1, dtype=np.int64)
        cut = s > 0 and allowed is not None
        starts = reached[allowed[s - 1][reached]] if cut else reached  # type: ignore[index]
        if not starts.size:
            return True, None
        gaps = np.setdiff1d(reached[1:], starts) if len(starts) < len(reached) else starts[:0]
        far = _reach(memory, spec, starts, gaps, hi + 1, layers - (K - s - 1), width)
        if far is None:
            return False, None
        kept.append(starts)
        lo, hi = int(starts[0]) + 1, far
    if hi < layers:
        return True, None
    if not split:
        return True, []
    bounds = [layers]
    for s in range(K - 1, -1, -1):  # back from the end: a start the stage may take that fits
        end = bounds[-1]
        starts = kept[s][kept[s] < end]
        shapes = stages[s].shapes
        n = len(starts)
        fits = memory._totals(
            np.tile(starts, len(shapes)), np.full(n * len(shapes), end), list(shapes),
            np.arange(0, n * len(shapes) + 1, n),
        ) <= stages[s].budget  # fmt: skip
        ok = fits.reshape(len(shapes), n).any(axis=0)
        bounds.append(int(starts[ok][-1]))  # (one does: end is in the reach of stage s)
    return True, bounds[::-1]


def _weights_need(memory: MemoryModel, stages: list[StageSpec], layers: int) -> list[int]:
    """Per stage s: the first start from which stages s, s + 1, ... could reach the end by
    their weights alone (gradients, optimizer slots, buffers and reserved bytes, each a
    prefix sum: MemoryModel.total() is at least them), each as far as its budget lets it;
    0 for all with tied parameters (not a prefix sum there). A split whose stage s starts
    before it fits nowhere: where the weights all but fill the devices, that shows within a
    few stages, without the memory model."""
    K = len(stages)
    least = [0] * (K + 1)
    if memory._tied:
        return least
    least[K] = layers
    for s in range(K - 1, -1, -1):
        at = layers + 1  # (no option: past every start)
        for shape in stages[s].shapes:
            weights = memory.weights(shape.optimizer_slots)
            room = stages[s].budget - shape.reserved
            at = min(at, int(np.searchsorted(weights, weights[least[s + 1]] - room, "left")))
        least[s] = at
    return least


def _reach(
    memory: MemoryModel,
    spec: StageSpec,
    starts: np.ndarray,
    gaps: np.ndarray,
    far: int,
    last: int,
    width: int,
) -> int | None:
    """The far end of what one stage reaches from `starts` (sorted), up to `last`, where `far`
    is reached already (the position after the last start); `gaps`: the positions between
    them where no cut may go. None where a start fits not even one layer, or the position
    after a gap is not reached from the start before it (the reach may have a hole:
    memory_split cannot tell).

    Each pass is one evaluation of the memory model: every (start, option) pair still in the
    running at the end past `far` (one that does not fit it fits no later end; nor one whose
    weights alone, MemoryModel.static_of, are over the budget there: those are not evaluated),
    and the pair with the latest start over a window of ends (how far it goes)."""
    shapes = tuple(dict.fromkeys(spec.shapes))  # (options alike on this stage: one)
    one = np.zeros(len(starts), dtype=bool)
    for shape in shapes:
        one |= memory.one_layer(shape)[starts] <= spec.budget
    if not one.all():
        return None
    gaps = gaps[gaps > starts[0]]  # (those before the first start are not passed)
    if gaps.size:
        before = starts[np.searchsorted(starts, gaps) - 1]
        covered = np.zeros(gaps.shape, dtype=bool)
        for shape in shapes:
            covered |= memory.total(before, gaps + 1, shape) <= spec.budget
        if not covered.all():
            return None
    pair_i = np.tile(starts, len(shapes))
    pair_x = np.repeat(np.arange(len(shapes)), len(starts))
    while far < last and pair_i.size:
        # the weights alone rule out most starts far from the end, without an evaluation
        room = np.array([spec.budget - sh.reserved for sh in shapes])[pair_x]
        slots = np.array([sh.optimizer_slots for sh in shapes])[pair_x]
        end = np.full(pair_i.shape, far + 1)
        keep = memory.static_of(pair_i, end, slots) <= room
        pair_i, pair_x = pair_i[keep], pair_x[keep]
        if not pair_i.size:
            break
        k = int(np.argmax(pair_i))  # (the first of the latest start's options)
        ends = np.arange(far + 1, min(far + width, last) + 1, dtype=np.int64)
        other = np.ones(pair_i.shape, dtype=bool)
        other[k] = False
        i_parts, j_parts, sizes = [], [], []
        for x in range(len(shapes)):
            mine = other & (pair_x == x)
            runs = pair_x[k] == x
            i_parts += [pair_i[mine], np.full(len(ends) if runs else 0, pair_i[k])]
            j_parts += [np.full(int(mine.sum()), far + 1), ends if runs else ends[:0]]
            sizes.append(int(mine.sum()) + (len(ends) if runs else 0))
        fits = memory._totals(
            np.concatenate(i_parts), np.concatenate(j_parts), list(shapes),
            np.cumsum([0, *sizes]),
        ) <= spec.budget  # fmt: skip
        survived = np.zeros(pair_i.shape, dtype=bool)
        at = 0
        for x in range(len(shapes)):
            mine = other & (pair_x == x)
            n = int(mine.sum())
            survived[mine] = fits[at : at + n]
            if pair_x[k] == x:
                window = fits[at + n : at + n + len(ends)]
                taken = len(ends) if window.all() else int(np.argmin(window))
            at += sizes[x]
        survived[k] = taken == len(ends) and far + taken < last  # it may go farther still
        if survived[k]:
            width *= 4
        far += taken
        pair_i, pair_x = pair_i[survived], pair_x[survived]
    return far


# The first probes' bounds, times the split time alone makes: each failed one's tables are
# a fraction of the next's (the windows grow with the bound's excess over it)
# (finer: a first fit nearer the optimum, whose tables reach less far; coarser: where no
# split fits near the time alone, fewer probes and tables lost)
LADDER = (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0)


def _time_alone(least: np.ndarray, speeds: list[float]) -> tuple[float, float]:
    """(below, about): a bound below every split's bottleneck, each layer at its cheapest
    option, and about the least one (within 1e-4 above) at which the stages may reach the end
    on time alone when a stage may also stay empty (memory and links only take splits away;
    an empty stage only adds some). Each test fills the stages in turn as far as the bound
    lets them: where it fails, so does every split (a farther end is never reached from an
    earlier start); a bisection on the prefix sums."""
    L, K = len(least), len(speeds)
    prefix = np.concatenate([[0.0], np.cumsum(least)]).tolist()

    def fits(bound: float) -> bool:
        at = 0
        for s, sp in enumerate(speeds):
            end = bisect.bisect_right(prefix, prefix[at] + bound * sp, at) - 1
            at = max(at, min(end, L - (K - s - 1)))
        return at == L

    lo = max(float(np.max(least)) / max(speeds), float(least.sum()) / sum(speeds))
    hi = float(least.sum()) / min(speeds)
    if lo <= 0 or not fits(hi * (1 + 1e-9)):
        return max(lo, 0.0) * (1 - 1e-9), 0.0  # (zero-time layers, or rounding: no guess)
    hi = hi * (1 + 1e-9)
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        if not lo < mid < hi:  # (subnormal times: halving no longer moves)
            break
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo * (1 - 1e-9), hi  # (the greedy test's sums round a little unlike the probe's)


class NoneWithin(Exception):
    """No split that fits has a bottleneck within the limit the caller set (solve_partition).
    `by_time`: not even by time alone (each layer at its cheapest option, memory aside)."""

    def __init__(self, limit: float, by_time: bool = False) -> None:
        super().__init__(f"no split fits with a bottleneck within {limit}")
        self.limit, self.by_time = limit, by_time


def solve_partition(
    times: np.ndarray,
    memory: MemoryModel,
    stages: list[StageSpec],
    cuts: Sequence[np.ndarray] | None = None,
    limit: float = math.inf,
    free_only: bool = False,
    hint: float = math.inf,
) -> Partition | None:
    """The split of len(times) layers into len(stages) non-empty contiguous stages that minimises
    the slowest stage (or link, with cuts: see the module docstring), with every stage within its
    budget; None when no split fits in memory at allowed cuts. `limit`: a bottleneck past which
    the caller has no use for a split; NoneWithin is raised where no split that fits reaches
    it (a search that already holds a plan this fast: the split's bound could not beat it).
    `free_only`: the caller has use only for a split memory does not bind (`memory_free`); None
    also where the first probe finds memory lowering a stage's end. (Mostly it then lowers one
    at the optimum too: a start reached under a bound is reached under any larger one, where its
    time allows at least as far. Not always, where that probe lies above the optimum: the caller
    must take None as "not known free", never as "none fits".) `hint`: a bottleneck some split
    is known to meet (one option's split, where a stage may choose among several): the first
    probes go no higher, and the bisection starts below it."""
    L, K = np.atleast_2d(times).shape[1], len(stages)
    if not 1 <= K <= L:
        raise ValueError(f"cannot split {L} layers into {K} non-empty stages")
    least = option_times(times, stages).min(axis=0)
    speeds = [s.speed for s in stages]
    # Bounds on compute alone (each layer at its cheapest option, no memory, no links): at
    # most the optimum, lo below any split and `fast` about the best split's
    lo, fast = _time_alone(least, speeds)
    if lo > limit:
        raise NoneWithin(limit, by_time=True)
    # First probe near the split time alone would make: when memory and links let it stand,
    # no probe reaches past it, and memory is searched only that far, and only from the
    # starts a split within it may give each stage. Where they do not, wider, then in full
    # (up to the limit: a probe there that fails ends the search).
    prober, bounds = None, None
    top = min(limit, hint if hint >= lo else math.inf)  # (below lo no split meets it)
    ladder = [fast * f for f in LADDER if fast > 0 and fast * f < top] + [top]
    if top < limit:  # (a hint that does not hold after all: on to the limit)
        ladder.append(limit)
    for first in ladder:
        if prober is None:
            prober = _Prober(times, memory, stages, cuts, cap_bound=first)
        else:
            prober.reach_to(first)
        bounds = prober.probe(first)
        if free_only and prober.memory_cut:
            return None
        if bounds is not None:
            break
        lo = max(lo, first)  # nothing fits within it
    if bounds is None:
        if math.isinf(limit):
            return None
        raise NoneWithin(limit)
    hi = prober.bottleneck(bounds)
    lo = min(lo, hi) * (1 - 1e-12)
    tried, proven = math.nan, False  # the best bottleneck a proof was last tried at
    while hi - lo > 1e-9 * hi:
        if hi - lo <= 1e-4 * hi and tried != hi:
            # Narrow enough that the split in hand is likely optimal: try to prove it now (one
            # probe just below) rather than bisect on to 1e-9.
            tried = hi
            found = prober.probe(below := float(np.nextafter(hi, -math.inf)))
            if found is None:
                proven = True
                break
            bounds, hi = found, prober.bottleneck(found, below)
            continue
        mid = (lo + hi) / 2
        found = prober.probe(mid)
        if found is None:
            # nothing changes below the next bound that lets some stage take another layer
            nxt = prober.next_bound()
            if nxt >= hi:  # (no split below hi then: the one in hand is optimal)
                proven = True
                break
            lo = max(mid, float(np.nextafter(nxt, -math.inf)))
        else:
            bounds, hi = found, prober.bottleneck(found, mid)
    # Prove it: no split is feasible strictly below the best bottleneck found.
    while not proven:
        found = prober.probe(below := float(np.nextafter(hi, -math.inf)))
        if found is None:
            break
        bounds, hi = found, prober.bottleneck(found, below)
    proof_cut = prober.memory_cut
    # The split returned: the probe's at the optimum itself, whichever way the bisection went.
    canonical = prober.probe(hi)
    assert canonical is not None, f"no split within {hi}, which {bounds} meets"
    bounds = canonical
    # `memory_free`: memory lowered no stage's end in the proof (time alone rules out anything
    # faster) nor in the probe that made the split (so further options, each costing at least
    # as much per layer, reach exactly the same ends there: the same split, every stage on its
    # first option). Only starts within the windows count: from the others no split within
    # the bound reaches the end on time alone, at each layer's cheapest option, whatever
    # memory lets them take.
    memory_free = 0.0 if proof_cut or prober.memory_cut else 1.0
    return Partition(
        bounds=bounds, bottleneck=prober.bottleneck(bounds, hi), probes=prober.probes,
        choices=prober.costs(bounds)[1], extra={"memory_free": memory_free},
    )  # fmt: skip
