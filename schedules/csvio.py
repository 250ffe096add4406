"""CSV exchange in torch.distributed.pipelining's `compute_only` layout: one row per rank, one
action per cell, in order. (Its runtime loads these with `_load_csv(..., "compute_only")`.)"""

from __future__ import annotations

import csv
import io

from .ir import Action, Schedule


def to_csv(schedule: Schedule) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for r in range(schedule.num_ranks):
        writer.writerow([str(a) for a in schedule.ranks[r] if a.kind.is_compute])
    return buf.getvalue()


def from_csv(text: str, name: str = "csv") -> Schedule:
    ranks: dict[int, list[Action]] = {}
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        ranks[r] = [Action.parse(cell) for cell in row if cell.strip() and cell.strip() != "None"]
    acts = [a for row in ranks.values() for a in row]
    if not acts:
        raise ValueError("the CSV holds no actions")
    return Schedule(
        name, max(a.stage for a in acts) + 1, max(a.microbatch for a in acts) + 1, ranks
    )
