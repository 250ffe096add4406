"""Which values of a captured graph each stage receives, and from which stage.

A captured model's layer hands on every value live across the cut after it, but a pipeline does
not relay them stage by stage: each value goes once from the stage that makes it straight to
each later stage that reads it (codegen/_runtime.py). So what a stage [i, j) receives depends on
its end too: the values crossing cut i that some layer in [i, j) reads.

Entries are the chain's (layers, then the loss when profiled); value v is made by entry born[v]
(0 for the model's input: stage 0 holds the whole micro-batch anyway), read by the entries in
reads[v], and crosses every cut c with born[v] < c <= last[v].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from profiler.artifact import InputError
from profiler.types import LayerProfile


@dataclass(frozen=True)
class Flow:
    """Per value of a captured graph (arrays over values; `nxt` over values x cuts 0..n)."""

    names: list[str]
    born: np.ndarray
    last: np.ndarray
    nxt: np.ndarray  # nxt[v, i]: the first entry >= i that reads v (n where none does)
    nbytes: np.ndarray  # one micro-batch's, rounded to the allocator's blocks
    grad: np.ndarray  # floating point: its gradient goes back the same way
    readers: list[list[int]]

    @classmethod
    def of(cls, layers: Sequence[LayerProfile], has_loss: bool, mb: int, unit: int) -> Flow:
        born: dict[str, int] = {}
        per_sample: dict[str, int] = {}
        floating: dict[str, bool] = {}
        readers: dict[str, list[int]] = {}
        old = [
            x.index for x in layers if x.reads is None or len(x.crossing_bytes) != len(x.crossing)
        ]
        if old:
            raise InputError(
                f"this profile of a captured graph does not say what layer {old[0]} reads or "
                "what each value it hands on weighs (an older gpipe-plan made it): profile the "
                "model again"
            )
        for k, layer in enumerate(layers):
            for name in layer.reads:  # type: ignore[union-attr]  # None: refused above
                if name in born:
                    readers[name].append(k)
            grads = layer.crossing_grad or [True] * len(layer.crossing)
            for name, nb, g in zip(layer.crossing, layer.crossing_bytes, grads):
                g = g and not (k == 0 and name in (layers[0].reads or []))  # the model's input
                if name not in born:
                    born[name], per_sample[name], floating[name] = k, nb, g
                    readers[name] = []
        n = len(layers) + (1 if has_loss else 0)
        if has_loss:  # the loss reads what the last layer returns
            for name in layers[-1].crossing:
                readers[name].append(len(layers))
        names = list(born)
        V = len(names)
        nxt = np.full((V, n + 1), n, dtype=np.int64)
        for v, name in enumerate(names):
            rs = np.asarray(sorted(readers[name]), dtype=np.int64)
            if len(rs):
                k = np.searchsorted(rs, np.arange(n + 1))
                nxt[v] = np.where(k < len(rs), rs[np.minimum(k, len(rs) - 1)], n)
        raw = np.array([per_sample[x] for x in names], dtype=np.int64) * mb
        return cls(
            names=names,
            born=np.array([born[x] for x in names], dtype=np.int64),
            last=np.array([max(readers[x], default=-1) for x in names], dtype=np.int64),
            nxt=nxt,
            nbytes=-(-raw // unit) * unit,
            grad=np.array([floating[x] for x in names], dtype=bool),
            readers=[sorted(readers[x]) for x in names],
        )

    def chain_only(self) -> bool:
        """Whether the stages of every split exchange as a chain: each value is read by the
        layer right after the one that makes it and no other, and each layer after the first
        reads a value the one before it made (so no stage may start before the one before)."""
        n = self.nxt.shape[1] - 1
        fed = set()
        for made, readers in zip(self.born.tolist(), self.readers):
            if any(r != made + 1 for r in readers):
                return False
            if readers:
                fed.add(made + 1)
        return all(k in fed for k in range(1, n))

    def received(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """(values, len(i)): whether stage [i, j) receives the value (it crosses cut i and a
        layer of the stage reads it)."""
        i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
        born, last = self.born[:, None], self.last[:, None]
        return (born < i) & (i <= last) & (self.nxt[:, i] < j)

    def recv(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Bytes stage [i, j) receives per micro-batch."""
        return self.nbytes @ self.received(i, j)

    def recv_table(self) -> np.ndarray:
        """recv(i, k) for every start i and end k > i, as an (n + 1) x (n + 1) array (0 where
        k <= i), in O(n (values + n)); made once per Flow."""
        if "_table" not in self.__dict__:
            n = self.nxt.shape[1] - 1
            out = np.zeros((n + 1, n + 1), dtype=np.int64)
            for i in range(1, n + 1):
                live = (self.born < i) & (i <= self.last)
                counts = np.bincount(
                    self.nxt[live, i] + 1, weights=self.nbytes[live], minlength=n + 2
                )
                out[i] = np.cumsum(counts)[: n + 1].round().astype(np.int64)
            out[np.tril_indices(n + 1)] = 0
            object.__setattr__(self, "_table", out)
        return self.__dict__["_table"]

    def recv_grad(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """... of which floating point: the input gradients it sends back."""
        return (self.nbytes * self.grad) @ self.received(i, j)

    def passing(self, i: np.ndarray, j: np.ndarray, last: np.ndarray | None = None) -> np.ndarray:
        """Per micro-batch, the gradient bytes of the values stage [i, j) makes before its last
        layer and sends on (skips). Its backward holds the gradient each of them is sent back
        and, apart, their total inside the stage, where a layer of it reads them too (as in
        every U-Net block that sends a skip and pools it). `last`: per end k, what the last
        layer itself sends (then: all the stage sends). Where the sum shrinks as the stage grows
        (a skip read by the layer that joins it), the largest over the shorter ends is taken:
        then the stage's memory grows with its end, as the partition search needs, and never
        counts less than the run holds."""
        return self._sums(last)[np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)]

    def sending(self, last: np.ndarray) -> np.ndarray:
        """passing(i, k, last) for every start and end as it is, without the running max over
        k: what stage [i, k) sends back per micro-batch (`last`: the chain's zgrad, as
        passing's always is)."""
        return self._sums(last, running=False)

    def _sums(self, last: np.ndarray | None, running: bool = True) -> np.ndarray:
        """passing(i, k, last) for every start and end, made once per Flow in O(n^2 + values):
        each value born at b and read last by entry e counts for the starts i <= b and the
        ends b + 2 <= k <= e (a rectangle, added as four corners), then the running max over
        k."""
        key = ("_passing" if last is None else "_sending") + ("" if running else "_as_is")
        if key not in self.__dict__:
            n = self.nxt.shape[1] - 1
            corners = np.zeros((n + 2, n + 2), dtype=np.int64)
            for b, e, w in zip(self.born.tolist(), self.last.tolist(), self.nbytes * self.grad):
                if w and e >= b + 2:
                    corners[0, b + 2] += w
                    corners[0, e + 1] -= w
                    corners[b + 1, b + 2] -= w
                    corners[b + 1, e + 1] += w
            table = corners.cumsum(axis=0).cumsum(axis=1)[: n + 1, : n + 1]
            if last is not None:
                table[:, 1:] += np.asarray(last, dtype=np.int64)[None, :n]
            table = np.triu(table, 1)
            if running:
                table = np.maximum.accumulate(table, axis=1)
            table.setflags(write=False)
            object.__setattr__(self, key, table)
        return self.__dict__[key]

    def unread(self) -> np.ndarray:
        """u[l, k] for entries l < k: the gradient bytes of the values entry l hands on
        unchanged that no entry of l + 1 .. k - 1 reads. In a stage ending at k, no gradient
        of them is made inside while l's backward runs (a skip sent on is held as pulled,
        once), though l's profiled backward counts one for each."""
        n = self.nxt.shape[1] - 1
        rows = np.zeros((n + 1, n + 2), dtype=np.int64)
        for v in np.nonzero(self.grad)[0].tolist():
            b, e, w = int(self.born[v]), int(self.last[v]), int(self.nbytes[v])
            ls = np.arange(b + 1, e)  # the entries that hand v on: b < l < e
            if not len(ls):
                continue
            np.add.at(rows, (ls, ls + 1), w)
            np.add.at(rows, (ls, self.nxt[v, ls + 1] + 1), -w)
        return rows.cumsum(axis=1)[:, : n + 1]

    def far(
        self, start: np.ndarray, i: np.ndarray, j: np.ndarray, grad: bool = False
    ) -> np.ndarray:
        """... of which made before entry `start` (the previous stage's first): sent by a
        stage further back, so it arrives before the previous stage's forward ends (and its
        gradient, `grad`, leaves after the previous stage's backward)."""
        made_before = self.born[:, None] < np.asarray(start, dtype=np.int64)
        weights = self.nbytes * self.grad if grad else self.nbytes
        return weights @ (self.received(i, j) & made_before)


def routes(flow: Flow | None, bounds: Sequence[int]) -> list[tuple[int, int]]:
    """The (sender, receiver) stage pairs of a split at `bounds` (a chain without a flow)."""
    if flow is None:
        return [(s, s + 1) for s in range(len(bounds) - 2)]
    return sorted(carried(flow, bounds))


def carried(flow: Flow, bounds: Sequence[int]) -> dict[tuple[int, int], list[str]]:
    """What each route carries: (sender, receiver) -> the names of the values, in graph order."""
    stage_of = np.searchsorted(np.asarray(bounds[1:]), np.arange(bounds[-1]), side="right")
    out: dict[tuple[int, int], list[str]] = {}
    for v, name in enumerate(flow.names):
        src = int(stage_of[flow.born[v]])
        for dst in sorted({int(stage_of[r]) for r in flow.readers[v]} - {src}):
            out.setdefault((src, dst), []).append(name)
    return out
