"""The schedule IR: an action is (stage, kind, micro-batch); a schedule is rank -> ordered actions.

Short forms follow torch.distributed.pipelining, so schedules can be exchanged with it:
`2F0` (stage 2, forward, micro-batch 0), `1B3`, `0I2`, `0W2`, `0SEND_F1`, `1RECV_F1`.
A communication action carries every message of its stage that crosses ranks, or, with a peer,
the one exchanged with that stage: `0SEND_F1@3` (stage 0's activations of micro-batch 1 for
stage 3), `3RECV_F1@0` (the same, taken by stage 3); a captured graph's skips need these.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from enum import Enum
from itertools import repeat
from typing import NamedTuple


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # backward for the input gradient only (zero-bubble split)  # noqa: E741
    W = "W"  # backward for the weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    # str's own hash, in C (Enum's is a Python call on the name, here the same text): every
    # action's hash reads its kind's
    __hash__ = str.__hash__

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE_KINDS


COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
_COMPUTE_KINDS = frozenset(COMPUTE)  # a set: tested once per action in hot loops
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:@(\d+))?$")


class Action(NamedTuple):
    """Immutable, hashed and ordered by (stage, kind, microbatch, peer). A tuple, not a frozen
    dataclass: generators make about a hundred thousand per schedule at 64 ranks, and a
    dataclass takes six times as long to make and far longer to hash."""

    stage: int
    kind: Kind
    microbatch: int
    peer: int = -1  # communication: the stage at the other end; -1: every one that crosses ranks

    def __str__(self) -> str:
        at = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.stage}{self.kind.value}{self.microbatch}{at}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _ACTION.match(text.strip())
        if m is None or (m.group(4) is not None and m.group(2) in ("F", "B", "I", "W")):
            raise ValueError(
                f"{text!r} is not an action; write e.g. 2F0, 1B3, 0SEND_F1, 0SEND_F1@3"
            )
        peer = int(m.group(4)) if m.group(4) is not None else -1
        return cls(int(m.group(1)), Kind(m.group(2)), int(m.group(3)), peer)


_MADE: dict[Action, Action] = {}
_NEW = functools.partial(tuple.__new__, Action)  # from (stage, kind, mb, peer), all in C


def _compute(stage: int, kind: Kind, mb: int) -> Action:
    """One shared object per compute action (equal ones are also identical then, which makes
    comparing schedules cheap)."""
    a = _NEW((stage, kind, mb, -1))
    if len(_MADE) >= 1 << 20:
        _MADE.clear()
        _ROWS.clear()
    return _MADE.setdefault(a, a)


_ROWS: dict[tuple[Kind, int], list[Action]] = {}


def row(kind: Kind, stage: int, count: int) -> list[Action]:
    """The shared actions of `kind` on `stage` for micro-batches 0 .. count - 1 (a new list):
    generators index these instead of making each action."""
    have = _ROWS.setdefault((kind, stage), [])
    if len(have) < count:
        if len(_MADE) + count >= 1 << 20:
            _MADE.clear()
            _ROWS.clear()
            have = _ROWS.setdefault((kind, stage), [])
        # (all in C: the tuples zipped, made and interned by map; 1.28x on 131 072 actions
        # against a generator of Python tuples)
        n = count - len(have)
        fresh = list(map(_NEW, zip(repeat(stage, n), repeat(kind, n), range(len(have), count),
                                   repeat(-1, n))))  # fmt: skip
        have.extend(map(_MADE.setdefault, fresh, fresh))
    return have[:count]


def F(stage: int, mb: int) -> Action:
    return _compute(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Action:
    return _compute(stage, Kind.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743
    return _compute(stage, Kind.I, mb)


def W(stage: int, mb: int) -> Action:
    return _compute(stage, Kind.W, mb)


@dataclass
class Schedule:
    """`ranks[r]` is what rank r does, in order; `placement[s]` is the rank that runs stage s.

    `routes`: the pairs (s, t), s < t, where stage s hands stage t activations (and t hands s
    their gradients). Empty means a chain, each stage to the next; a captured graph's skip
    goes straight from the stage that makes it to each stage that uses it (s, t > s + 1)."""

    name: str
    num_stages: int
    num_microbatches: int
    ranks: dict[int, list[Action]]
    placement: list[int] = field(default_factory=list)
    routes: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.placement:
            self.placement = infer_placement(self.ranks, self.num_stages)
        self.routes = sorted({(int(s), int(t)) for s, t in self.routes})
        bad = [(s, t) for s, t in self.routes if not 0 <= s < t < self.num_stages]
        if bad:
            raise ValueError(f"route {bad[0]} is not (s, t) with 0 <= s < t < {self.num_stages}")

    def edges(self) -> list[tuple[int, int]]:
        """The routes; a chain when none are given."""
        return self.routes or [(s, s + 1) for s in range(self.num_stages - 1)]

    def senders(self, t: int) -> list[int]:
        """The stages stage t takes activations from."""
        if not self.routes:  # a chain (without building its edges: a hot path)
            return [t - 1] if 0 < t < self.num_stages else []
        return [a for a, b in self.routes if b == t]

    def receivers(self, s: int) -> list[int]:
        """The stages stage s hands activations to."""
        if not self.routes:
            return [s + 1] if 0 <= s < self.num_stages - 1 else []
        return [b for a, b in self.routes if a == s]

    def early_from(self) -> list[int]:
        """Per stage t: the first stage that sends to it from further back than t - 1 (its
        activations arrive before the previous stage's do), or -1."""
        first = [-1] * self.num_stages
        for s, t in self.edges():
            if s < t - 1 and (first[t] < 0 or s < first[t]):
                first[t] = s
        return first

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def compute_only(self) -> Schedule:
        ranks = {r: [a for a in acts if a.kind.is_compute] for r, acts in self.ranks.items()}
        return Schedule(
            self.name,
            self.num_stages,
            self.num_microbatches,
            ranks,
            list(self.placement),
            list(self.routes),
        )

    def __str__(self) -> str:
        return "\n".join(
            f"{r}: {' '.join(map(str, acts))}" for r, acts in sorted(self.ranks.items())
        )


def infer_placement(ranks: dict[int, list[Action]], num_stages: int) -> list[int]:
    """Which rank runs each stage, read off the compute actions (each stage on exactly one rank)."""
    placement: dict[int, int] = {}
    for r, acts in ranks.items():
        for a in acts:
            if a.kind.is_compute and placement.setdefault(a.stage, r) != r:
                raise ValueError(f"stage {a.stage} appears on ranks {placement[a.stage]} and {r}")
    missing = [s for s in range(num_stages) if s not in placement]
    if missing:
        raise ValueError(f"stages {missing} have no actions on any rank")
    return [placement[s] for s in range(num_stages)]


def parse_schedule(text: str, name: str = "custom") -> Schedule:
    """Parse the printed form, one rank per line: `0: 0F0 0F1 0B0 0B1`."""
    ranks: dict[int, list[Action]] = {}
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        ranks[int(head)] = [Action.parse(t) for t in body.split()]
    stages = {a.stage for acts in ranks.values() for a in acts}
    mbs = {a.microbatch for acts in ranks.values() for a in acts}
    return Schedule(name, max(stages) + 1, max(mbs) + 1, ranks)
