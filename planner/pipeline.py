"""What a schedule costs, in closed form: the planner's quick arithmetic for one candidate.

fill-drain (GPipe), K stages, M micro-batches, forward f_s, backward b_s, recompute r_s:

    forward  = sum f_s + (M - 1) * max f_s
    backward = sum (b_s + r_s) + (M - 1) * max (b_s + r_s)

with each cut's transfer added once per direction, and a slow link bounding the steady state
like a slow stage. The two maxima are kept apart on purpose: one formula with t = f + b
underestimates when the forward and backward bottlenecks sit on different stages.
1F1B has the same makespan; it differs in how many micro-batches a stage holds (`inflight`).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


def inflight(schedule: str, num_stages: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, num_stages - stage)
    raise ValueError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True)
class StageTimes:
    forward: float
    backward: float
    recompute: float  # per recomputed micro-batch
    send: float  # to the next stage, per micro-batch and direction (0 for the last)


def iteration_ms(stages: list[StageTimes], microbatches: int, recompute: str) -> float:
    M = microbatches
    fwd_steady = max([s.forward for s in stages] + [s.send for s in stages])
    bwd_steady = max([s.backward + s.recompute for s in stages] + [s.send for s in stages])
    # The first micro-batch through backward is the last one forward: under except_last it is
    # the one micro-batch not recomputed.
    first_recompute = [s.recompute if recompute == "always" else 0.0 for s in stages]
    links = sum(s.send for s in stages)
    forward = sum(s.forward for s in stages) + links + (M - 1) * fwd_steady
    backward = (
        sum(s.backward + r for s, r in zip(stages, first_recompute)) + links + (M - 1) * bwd_steady
    )
    return forward + backward


def busy_ms(stage: StageTimes, microbatches: int, recompute: str) -> float:
    recomputed = {"never": 0, "except_last": microbatches - 1, "always": microbatches}[recompute]
    return microbatches * (stage.forward + stage.backward) + recomputed * stage.recompute


def bubble_fraction(stages: list[StageTimes], microbatches: int, recompute: str) -> float:
    """Idle share of device time: (K - 1) / (M + K - 1) for equal stages and free links."""
    total = iteration_ms(stages, microbatches, recompute)
    busy = sum(busy_ms(s, microbatches, recompute) for s in stages)
    return 1.0 - busy / (len(stages) * total) if total > 0 else 0.0
