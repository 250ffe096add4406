"""Pictures of a timeline: Chrome trace JSON (Perfetto, chrome://tracing), a PNG Gantt chart
(matplotlib, optional) and an ASCII chart for terminals."""

from __future__ import annotations

import json
from typing import Any

from .ir import Kind
from .simulate import Timeline

COLOURS = {  # Chrome trace reserved colour names, and matplotlib colours for the PNG
    Kind.F: ("thread_state_running", "#4c78a8"),
    Kind.B: ("thread_state_iowait", "#e45756"),
    Kind.I: ("thread_state_iowait", "#f58518"),
    Kind.W: ("thread_state_runnable", "#54a24b"),
}


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """One complete event ("X") per action, one track per rank, a memory counter per rank, and a
    track per link for transfers. Times in microseconds as the format wants."""
    events: list[dict[str, Any]] = []
    for r in sorted(timeline.schedule.ranks):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        )
    for sp in timeline.spans:
        ev = {
            "ph": "X",
            "name": str(sp.action),
            "cat": sp.action.kind.value,
            "pid": 0,
            "tid": sp.rank,
            "ts": sp.start * 1e3,
            "dur": (sp.end - sp.start) * 1e3,
            "args": {"stage": sp.action.stage, "microbatch": sp.action.microbatch},
        }
        if sp.action.kind in COLOURS:
            ev["cname"] = COLOURS[sp.action.kind][0]
        events.append(ev)
    for tr in timeline.transfers:
        if tr.end > tr.start:
            events.append({
                "ph": "X", "name": f"{tr.direction}{tr.microbatch} cut {tr.cut}", "cat": "transfer",
                "pid": 1, "tid": tr.cut, "ts": tr.start * 1e3, "dur": (tr.end - tr.start) * 1e3,
            })  # fmt: skip
    for r, steps in enumerate(timeline.memory):
        for t, level in steps:
            events.append(
                {
                    "ph": "C",
                    "name": f"memory rank {r}",
                    "pid": 0,
                    "ts": t * 1e3,
                    "args": {"bytes": level},
                }
            )
    events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "ranks"}})
    events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "links"}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {
        "schedule": timeline.schedule.name, "makespan_ms": timeline.makespan}}  # fmt: skip


def write_chrome_trace(timeline: Timeline, path: str) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(timeline), f)


def ascii_timeline(timeline: Timeline, width: int = 96) -> str:
    """Each rank as a row of characters over time: F forward, B backward, I input grad, W weight
    grad, '.' idle; lower case marks a recomputing backward is not shown separately."""
    if timeline.makespan <= 0:
        return "(empty)"
    scale = width / timeline.makespan
    rows = []
    for r in sorted(timeline.schedule.ranks):
        line = ["."] * width
        for a, st, en in zip(timeline.schedule.ranks[r], timeline.starts[r], timeline.ends[r]):
            if not a.kind.is_compute or en <= st:
                continue
            lo, hi = int(st * scale), max(int(st * scale) + 1, int(en * scale))
            for x in range(lo, min(hi, width)):
                line[x] = a.kind.value
        rows.append(f"rank {r:>3} |{''.join(line)}|")
    return "\n".join(rows)


def gantt_png(timeline: Timeline, path: str) -> None:
    """A Gantt chart of compute per rank with memory under it. Needs matplotlib (the plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("a Gantt PNG needs matplotlib: pip install 'gpipe-plan[plot]'") from e
    R = timeline.schedule.num_ranks
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(12, 1.0 + 0.45 * R + 2.2), sharex=True,
                                  gridspec_kw={"height_ratios": [max(R, 2), 3]})  # fmt: skip
    for r in range(R):
        for a, st, en in zip(timeline.schedule.ranks[r], timeline.starts[r], timeline.ends[r]):
            if a.kind in COLOURS and en > st:
                ax.broken_barh(
                    [(st, en - st)],
                    (r - 0.4, 0.8),
                    facecolors=COLOURS[a.kind][1],
                    edgecolor="white",
                    linewidth=0.3,
                )
                if R <= 16 and timeline.schedule.num_microbatches <= 16:
                    ax.text(
                        (st + en) / 2,
                        r,
                        f"{a.kind.value}{a.microbatch}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                    )
    ax.set_yticks(range(R), [f"rank {r}" for r in range(R)])
    ax.invert_yaxis()
    ax.set_title(
        f"{timeline.schedule.name}: makespan {timeline.makespan:.3g} ms, bubble {timeline.bubble_fraction:.1%}"
    )
    for r, steps in enumerate(timeline.memory):
        ts, levels = zip(*steps)
        mem.step(ts, levels, where="post", label=f"rank {r}" if R <= 8 else None, linewidth=0.8)
    mem.set_xlabel("ms")
    mem.set_ylabel("bytes")
    if R <= 8:
        mem.legend(fontsize=6, ncol=min(R, 4))
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # PNG whatever the name ends with
    plt.close(fig)
