"""Schedule generators: build_schedule(name, num_stages, num_microbatches, ...) -> Schedule.

    gpipe (fill-drain), K=3, M=3; each row a rank, time flows right. Backward takes the
    micro-batches last-in first-out, as autograd would on the whole mini-batch: the last
    micro-batch's backward follows its forward at once, which is why recomputation can skip it.
      0: F0 F1 F2          B2 B1 B0
      1:    F0 F1 F2    B2 B1 B0
      2:       F0 F1 F2 B2 B1 B0

    1f1b (PipeDream-flush): K - s - 1 warm-up forwards, then one forward / one backward:
      0: F0 F1 F2       B0    F3 B1 ...
      2:       F0 B0 F1 B1 F2 B2 ...

Any K >= 1 and M >= 1 (M < K included).
"""

from __future__ import annotations

from .ir import Action, Kind, Schedule, row

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, *, stages_per_rank: int = 2
) -> Schedule:
    """A schedule by name. `num_stages` counts pipeline stages; for interleaved-1f1b the ranks
    number num_stages // stages_per_rank, each holding `stages_per_rank` stages (looped)."""
    K, M = num_stages, num_microbatches
    if K < 1 or M < 1:
        raise ValueError(f"need at least one stage and one micro-batch (got {K} and {M})")
    if name == "gpipe":
        return _gpipe(K, M)
    if name == "1f1b":
        return _one_f_one_b(K, M)
    if name == "interleaved-1f1b":
        v = stages_per_rank
        if v < 1 or K % v:
            raise ValueError(f"interleaved-1f1b: {K} stages do not split into {v} per rank")
        R = K // v
        if M > R and M % R:
            raise ValueError(
                f"interleaved-1f1b runs micro-batches in rounds of {R} (one per rank): use a "
                f"micro-batch count that is a multiple of {R}, or at most {R}"
            )
        return _interleaved(R, v, M)
    if name == "zb-h1":
        return _zb_h1(K, M)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def _gpipe(K: int, M: int) -> Schedule:
    ranks = {s: row(Kind.F, s, M) + row(Kind.B, s, M)[::-1] for s in range(K)}
    return Schedule("gpipe", K, M, ranks, list(range(K)))


def _alternate(first: list[Action], second: list[Action]) -> list[Action]:
    """first[0] second[0] first[1] second[1] ... (equal lengths)."""
    out = first + second
    out[::2], out[1::2] = first, second
    return out


def _one_f_one_b(K: int, M: int) -> Schedule:
    ranks = {}
    for s in range(K):
        warm = min(K - s - 1, M)
        f, b = row(Kind.F, s, M), row(Kind.B, s, M)
        ranks[s] = f[:warm] + _alternate(f[warm:], b[: M - warm]) + b[M - warm :]
    return Schedule("1f1b", K, M, ranks, list(range(K)))


def _interleaved(R: int, v: int, M: int) -> Schedule:
    """Looped placement: rank r holds stages r, r + R, ..., r + (v-1)R. Micro-batches go in rounds
    of R: each round runs through chunk 0 on all its micro-batches, then chunk 1, ... (Megatron's
    order); backward goes through the chunks in reverse. Rank r warms up with
    (v - 1) * R + 2 * (R - 1 - r) forwards, then alternates one forward and one backward."""
    forwards: list[tuple[int, int]] = []  # (chunk, micro-batch) in issue order
    backwards: list[tuple[int, int]] = []
    for start in range(0, M, R):
        group = range(start, min(start + R, M))
        forwards += [(c, m) for c in range(v) for m in group]
        backwards += [(c, m) for c in reversed(range(v)) for m in group]
    ranks = {}
    for r in range(R):
        f = [row(Kind.F, c * R + r, M) for c in range(v)]
        b = [row(Kind.B, c * R + r, M) for c in range(v)]
        fs = [f[c][m] for c, m in forwards]
        bs = [b[c][m] for c, m in backwards]
        warm = min((v - 1) * R + 2 * (R - 1 - r), len(fs))
        steady = len(fs) - warm
        ranks[r] = fs[:warm] + _alternate(fs[warm:], bs[:steady]) + bs[steady:]
    return Schedule("interleaved-1f1b", R * v, M, ranks, [s % R for s in range(R * v)])


def _zb_h1(K: int, M: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into I (input gradient, on the critical path) and W
    (weight gradient, free to move). Stage s runs W(m) right after I(m + s), and the W's left over
    at the end. Delaying the later stages' W's lets the I's race back through the pipeline and the
    W's fill what were bubbles; stage s then holds (K - s) + s = K micro-batches at most, the peak of
    1F1B's first stage, so peak memory stays that of 1F1B. With F = I = W the bubble is a third
    of 1F1B's.

        K=4, M=4, stage 3:  F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 W2 W3
                  stage 0:  F0 F1 F2 F3 I0 W0 I1 W1 I2 W2 I3 W3
    """
    ranks = {}
    for s in range(K):
        warm = min(K - s - 1, M)
        f, i, w = row(Kind.F, s, M), row(Kind.I, s, M), row(Kind.W, s, M)
        acts = f[:warm]
        owed = 0  # next W to run
        for a in _alternate(f[warm:], i[: M - warm]) + i[M - warm :]:
            acts.append(a)
            if a.kind is Kind.I and a.microbatch >= s:
                acts.append(w[owed])
                owed += 1
        ranks[s] = acts + w[owed:]
    return Schedule("zb-h1", K, M, ranks, list(range(K)))
