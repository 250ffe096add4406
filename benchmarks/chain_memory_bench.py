"""Predicted against measured peak memory of chains (nn.Sequential), per device, under every
schedule and recomputation mode (issue #7): the example mlp and transformer (its cross-entropy
loss profiled), and three small chains whose stages the plan once got wrong by a whole
activation (a lone first Linear, a stage ending in a mean, a stage that hands its input on).

Memory is measured in one process (`Pipe.measure`, streams target: the allocator's own reports,
charged to the stage whose action made each allocation). The small chains are planned from
profiles whose layers all take 1 ms, so that their splits depend on their structure alone.

`--baseline CHECKOUT` runs the same rows with an earlier checkout's planner and runtime, on the
same saved profiles, side by side.

    python benchmarks/chain_memory_bench.py [--baseline DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(os.environ.get("GPIPE_ROOT", Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MODES = ["never", "except_last", "always"]
W = 32


class Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class Same(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def small() -> dict:
    """name: (model, input, target, devices, batch, micro-batches)"""
    torch.manual_seed(0)
    x, y = torch.randn(8, 512, W), torch.randint(0, 10, (8,))
    lone = [nn.Linear(W, W), nn.Sequential(nn.ReLU(), nn.Linear(W, W), Mean(), nn.Linear(W, 10))]
    mean = [nn.Linear(W, W), nn.ReLU(), Mean(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10)]
    same = [nn.Linear(W, W), nn.Dropout(0.3), Same(), Mean(), nn.Linear(W, 10)]
    return {
        name: (nn.Sequential(*layers), x, y, 2, 8, 4)
        for name, layers in (("lone first Linear", lone), ("ends in a mean", mean),
                             ("hands its input on", same))
    }  # fmt: skip


def examples() -> dict:
    from profiler.examples import mlp, transformer

    torch.manual_seed(0)
    out = {}
    for name, model in (
        ("mlp", mlp(width=64, depth=4, batch=12)),
        ("transformer", transformer(vocab=256, d_model=32, heads=2, depth=6, seq_len=16, batch=12)),
    ):
        out[name] = (model, None, None, 3, 12, 3)
    return out


def profile_all(folder: Path) -> None:
    from profiler import profile_model
    from tests.conftest import even_times, quick_profile

    for name, (model, x, _, _, _, _) in small().items():
        even_times(quick_profile(model, x, batch_sizes=[1, 2, 8])).save(folder / f"{name}.json")
    for name, (model, _, _, _, _, _) in examples().items():
        prof = profile_model(
            model, model.example_input, batch_sizes=[4], repeats=1, max_repeats=1, warmup=0,
            progress=False,
        )  # fmt: skip
        prof.save(folder / f"{name}.json")


def rows(folder: Path) -> list[dict]:
    from codegen import compile_pipe
    from codegen.measure import make_data
    from planner import Cluster, plan_pipeline
    from profiler.types import LayerProfile, Profile

    def load(path: Path) -> Profile:
        # an earlier checkout reads the layers' figures it knows (a profile made now has
        # later ones: stop_transient_bytes)
        data = json.loads(path.read_text())
        known = LayerProfile.model_fields
        for x in data["layers"] + ([data["loss"]] if data.get("loss") else []):
            for key in [k for k in x if k not in known]:
                del x[key]
        return Profile.model_validate(data)

    cases = {**small(), **examples()}
    out = []
    for name, (model, x, y, K, batch, M) in cases.items():
        prof = load(folder / f"{name}.json")
        for schedule in SCHEDULES:
            for mode in MODES:
                try:
                    plan = plan_pipeline(
                        prof, Cluster.uniform(K, "1GiB"), batch, microbatches=M,
                        schedule=schedule, recompute=mode, checkpoint=(),
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 (a schedule this layout cannot run)
                    out.append({"case": name, "schedule": schedule, "mode": mode,
                                "skipped": str(e).splitlines()[0]})  # fmt: skip
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pipe = compile_pipe(model, plan)
                    if x is None:
                        xs, ys, loss_fn = make_data(model, plan)
                    else:
                        xs, ys, loss_fn = x, y, nn.CrossEntropyLoss()
                    report = pipe.measure(xs, ys, loss_fn, steps=1)
                out.append({
                    "case": name, "schedule": schedule, "mode": mode,
                    "stages": [list(st.layers) for st in plan.stages],
                    "devices": [[d.predicted_peak_bytes, d.measured_peak_bytes]
                                for d in report.devices],
                })  # fmt: skip
    return out


def _error(row: list[int]) -> float:
    predicted, measured = row
    return (measured - predicted) / predicted * 100


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="an earlier checkout: the same rows with its code")
    ap.add_argument("--out", default=None, help="keep the profiles and rows here")
    ap.add_argument("--rows", help=argparse.SUPPRESS)  # (internal: profiles folder, print rows)
    args = ap.parse_args()
    if args.rows:
        print(json.dumps(rows(Path(args.rows))))
        return
    folder = Path(args.out or tempfile.mkdtemp(prefix="chain-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    profile_all(folder)
    runs = {"now": rows(folder)}
    if args.baseline:
        env = dict(os.environ, GPIPE_ROOT=str(Path(args.baseline).resolve()))
        got = subprocess.run(
            [sys.executable, __file__, "--rows", str(folder)], env=env, capture_output=True,
            text=True, check=True,
        )  # fmt: skip
        runs["baseline"] = json.loads(got.stdout.strip().splitlines()[-1])
    (folder / "rows.json").write_text(json.dumps(runs, indent=1))
    base = {(r["case"], r["schedule"], r["mode"]): r for r in runs.get("baseline", [])}
    head = "| case | schedule | recompute | stages | device | predicted | measured | error |"
    if base:
        head += " baseline predicted | baseline measured | baseline error |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    worst = {"now": 0.0, "baseline": 0.0}
    for r in runs["now"]:
        if "skipped" in r:
            continue
        b = base.get((r["case"], r["schedule"], r["mode"]))
        for k, dev in enumerate(r["devices"]):
            line = (f"| {r['case']} | {r['schedule']} | {r['mode']} | {r['stages']} | dev{k} | "
                    f"{dev[0]} | {dev[1]} | {_error(dev):+.1f}% |")  # fmt: skip
            worst["now"] = max(worst["now"], abs(_error(dev)))
            if b is not None and "devices" in b:
                old = b["devices"][k]
                same = b["stages"] == r["stages"]
                line += f" {old[0]} | {old[1]} | {_error(old):+.1f}%{'' if same else ' (other split)'} |"
                worst["baseline"] = max(worst["baseline"], abs(_error(old)))
            print(line)
    print(f"\nlargest error: now {worst['now']:.1f}%" + (
        f", baseline {worst['baseline']:.1f}%" if base else ""))  # fmt: skip
    print(f"rows and profiles: {folder}")


if __name__ == "__main__":
    main()
