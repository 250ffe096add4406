"""How many micro-batches' activations each stage holds at its peaks, read off the schedule.

A rank runs its actions one at a time, so what it holds depends on program order alone, not on
costs. Walking each program with the simulator's rules (F stashes; a recomputed backward first
re-materialises; B or W frees) gives, per stage, the pairs

    (a, b) = (micro-batches kept as their input only, micro-batches kept whole)

at every moment the stage allocates. Its activation peak for stash S and input X is then
max over pairs of a*X + b*S, whatever S and X are: the planner uses these pairs, so its memory
prediction is the simulator's, exactly, for any schedule.

    gpipe, never:        ((0, M),)         1f1b, never:   ((0, min(M, K - s)),)
    gpipe, always:       ((M, 1),)         gpipe, except_last: ((M - 1, 1),)
"""

from __future__ import annotations

from collections.abc import Sequence

from .ir import Kind, Schedule

Pairs = tuple[tuple[int, int], ...]


def recomputes(mode: str, microbatch: int, num_microbatches: int) -> bool:
    """Whether micro-batch `microbatch` is re-materialised under recomputation `mode`."""
    if mode == "never":
        return False
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < num_microbatches - 1
    raise ValueError(f"unknown recompute mode {mode!r}")


def stash_pairs(schedule: Schedule, recompute: str | Sequence[str]) -> list[Pairs]:
    S, M = schedule.num_stages, schedule.num_microbatches
    modes = [recompute] * S if isinstance(recompute, str) else list(recompute)
    seen: list[set[tuple[int, int]]] = [set() for _ in range(S)]
    for acts in schedule.ranks.values():
        inputs = [0] * S
        whole = [0] * S
        for a in acts:
            s, m = a.stage, a.microbatch
            rec = recomputes(modes[s], m, M)
            if a.kind == Kind.F:
                if rec:
                    inputs[s] += 1
                else:
                    whole[s] += 1
                seen[s].add((inputs[s], whole[s]))
            elif a.kind in (Kind.B, Kind.I) and rec:
                whole[s] += 1
                seen[s].add((inputs[s], whole[s]))
            if a.kind in (Kind.B, Kind.W):
                whole[s] -= 1
                if rec:
                    inputs[s] -= 1
    return [_pareto(p) for p in seen]


def _pareto(pairs: set[tuple[int, int]]) -> Pairs:
    """Drop pairs that another pair dominates in both counts: they can never be the peak."""
    keep = [p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs)]
    return tuple(sorted(keep))
