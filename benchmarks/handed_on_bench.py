"""A value handed on through a tuple: each device's measured peak against its plan, on every
split of a small model into 2 and 3 stages, under every schedule, with and without
recomputation. One thread, in-process memory accounting (`Pipe.measure`).

The model (a red team's): a layer makes (a, h), h = tanh(l2(x)) 16 384 wide, saved by its
tanh; the next reads a view of h and hands h on; a weightless one after it reads h again. Its
stages hold h in ways a chain of plain layers does not: saved by one layer and kept by a later
one, read and handed on at once (its gradient then has two parts), received and sent on.

    python benchmarks/handed_on_bench.py [--baseline CHECKOUT]

With --baseline, the same plans are made and run on that checkout too (a process of its own),
and the table shows both: measured less predicted bytes per device, and as a percent of the
prediction (positive: the run held more than the plan said).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CANDIDATES = [
    ("gpipe", "never"),
    ("1f1b", "never"),
    ("zb-h1", "never"),
    ("1f1b", "always"),
    ("zb-h1", "always"),
]
LAYERS = 6  # and the loss


def _model():  # noqa: ANN202
    import torch
    from torch import nn

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 2048), nn.Linear(2048, 64)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.b(self.a(x))

    class MakesH(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l, self.l2 = nn.Linear(64, 64), nn.Linear(64, 16384)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.l(x), torch.tanh(self.l2(x))

    class UsesH(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(64, 64)

        def forward(self, t):  # noqa: ANN001, ANN202
            a, h = t
            return self.l(a) * h[:, :64], h

    class JoinsH(nn.Module):
        def forward(self, t):  # noqa: ANN001, ANN202
            a, h = t
            return a * h[:, 64:128]

    torch.manual_seed(0)
    return nn.Sequential(Wide(), nn.Linear(64, 64), MakesH(), UsesH(), JoinsH(), nn.Linear(64, 64))


def splits() -> list[list[int]]:
    cut = range(1, LAYERS)
    return [[0, a, LAYERS + 1] for a in cut] + [
        [0, a, b, LAYERS + 1] for a, b in itertools.combinations(cut, 2)
    ]


def worker(root: str) -> None:
    sys.path.insert(0, root)
    import torch
    from torch import nn

    from codegen import compile_pipe
    from planner import Cluster, search
    from planner.partition import Partition
    from profiler import profile_model

    x, y = torch.randn(16, 64), torch.randn(16, 64)
    prof = profile_model(
        _model(), x[:1], batch_sizes=[4, 8, 16], loss_fn=nn.MSELoss(), repeats=1, warmup=0,
        progress=False, threads=1,
    )  # fmt: skip
    torch.set_num_threads(1)
    for split in splits():
        cluster = Cluster.uniform(len(split) - 1, "1GiB")
        problem = search._Problem(prof, cluster, 16, "momentum", (prof.digest(), cluster.digest()))
        for schedule, recompute in CANDIDATES:
            cand = search.Candidate(4, schedule, recompute)
            specs = search._stage_specs(problem, cand)
            plan = search._build_plan(problem, cand, specs, Partition(split, 0.0), "bench")
            model = _model()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = compile_pipe(model, plan).measure(x, y, nn.MSELoss(), steps=1)
            over = [(d.measured_peak_bytes, d.predicted_peak_bytes) for d in report.devices]
            print(json.dumps([split, schedule, recompute, over]), flush=True)


def _run(root: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(root)], capture_output=True, text=True, cwd=root
    )
    if done.returncode:
        sys.exit(done.stderr[-2000:])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    return {(tuple(r[0]), r[1], r[2]): r[3] for r in rows}


def _cell(over: list | None) -> str:
    if over is None:
        return "-"
    return ", ".join(f"{m - p:+d} ({100 * (m - p) / p:+.1f}%)" for m, p in over)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="an earlier checkout, run the same way")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, python "
          f"{platform.python_version()}, batch 16, M = 4, one thread")  # fmt: skip
    now = _run(ROOT)
    then = _run(Path(args.baseline)) if args.baseline else None
    print("| split | schedule | recompute | now: measured less predicted, per device |"
          + (" baseline |" if then is not None else ""))  # fmt: skip
    print("|---|---|---|---|" + ("---|" if then is not None else ""))
    for key, over in now.items():
        split, schedule, recompute = key
        line = f"| {list(split)} | {schedule} | {recompute} | {_cell(over)} |"
        if then is not None:
            line += f" {_cell(then.get(key))} |"
        print(line, flush=True)
    # the worst device of any case, above and below its plan, per schedule and checkout
    for name, table in [("now", now)] + ([("baseline", then)] if then is not None else []):
        for schedule in dict.fromkeys(s for s, _ in CANDIDATES):
            rel = [(m - p) / p for k, over in table.items() if k[1] == schedule for m, p in over]
            print(f"{name} {schedule}: most above its plan {100 * max(rel):+.2f}%, most below "
                  f"{100 * min(rel):+.2f}%")  # fmt: skip


if __name__ == "__main__":
    main()
