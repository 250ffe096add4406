"""Predicted against measured peak memory per device, this checkout beside an earlier one: the
command line and table the memory benchmarks share (layout_bench.py, zero_bubble_bench.py).

A benchmark gives `rows()`, each {"case", "K", "schedule", "stages", "devices": [[predicted,
measured], ...]}; with --baseline CHECKOUT the same script runs again under that checkout's
code (GPIPE_ROOT) and the two sides are printed row by row."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def measured_row(
    case: str, K: int, schedule: str, model: Any, plan: Any, x: Any, y: Any, loss_fn: Any
) -> dict:
    """One row: the plan's stages and each device's predicted and measured peak, from one
    step of the streams program (`Pipe.measure`)."""
    from codegen import compile_pipe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compile_pipe(model, plan).measure(x, y, loss_fn, steps=1)
    return {
        "case": case, "K": K, "schedule": schedule,
        "stages": [list(st.layers) for st in plan.stages],
        "devices": [[d.predicted_peak_bytes, d.measured_peak_bytes] for d in report.devices],
    }  # fmt: skip


def test_models() -> Any:
    """This checkout's tests/test_graph.py, where the benchmarks' models live, loaded from its
    file: a baseline run (GPIPE_ROOT) builds the same models on its own code."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / "test_graph.py"
    spec = importlib.util.spec_from_file_location("_bench_test_graph", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error(row: list[int]) -> float:
    predicted, measured = row
    return (measured - predicted) / predicted * 100


def _keys(rows: list[dict]) -> list[tuple]:
    """(case, K, schedule, how many such rows came before): one key per row."""
    seen: dict[tuple, int] = {}
    out = []
    for r in rows:
        key = (r["case"], r["K"], r["schedule"])
        out.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


def compare(script: str, rows: Callable[[], list[dict]]) -> None:
    """The benchmark `script`'s main: its rows, and with --baseline the baseline's beside them."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="an earlier checkout: the same rows with its code")
    ap.add_argument("--rows", action="store_true", help=argparse.SUPPRESS)  # (internal)
    args = ap.parse_args()
    if args.rows:
        print(json.dumps(rows()))
        return
    runs = {"now": rows()}
    if args.baseline:
        env = dict(os.environ, GPIPE_ROOT=str(Path(args.baseline).resolve()))
        got = subprocess.run(
            [sys.executable, script, "--rows"], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        runs["baseline"] = json.loads(got.stdout.strip().splitlines()[-1])
    base = dict(zip(_keys(runs.get("baseline", [])), runs.get("baseline", [])))
    head = "| case | K | schedule | stages | device | predicted | measured | error |"
    if base:
        head += " baseline predicted | baseline measured | baseline error |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    worst = {"now": [0.0, 0.0], "baseline": [0.0, 0.0]}  # (most under, most over: percent)
    for key, r in zip(_keys(runs["now"]), runs["now"]):
        b = base.get(key)
        for k, dev in enumerate(r["devices"]):
            line = (f"| {r['case']} | {r['K']} | {r['schedule']} | {r['stages']} | dev{k} | "
                    f"{dev[0]} | {dev[1]} | {_error(dev):+.1f}% |")  # fmt: skip
            worst["now"] = [max(worst["now"][0], _error(dev)), min(worst["now"][1], _error(dev))]
            if b is not None:
                old = b["devices"][k]
                same = b["stages"] == r["stages"]
                line += f" {old[0]} | {old[1]} | {_error(old):+.1f}%{'' if same else ' (other split)'} |"
                e = _error(old)
                worst["baseline"] = [max(worst["baseline"][0], e), min(worst["baseline"][1], e)]
            print(line)
    for side in ("now", "baseline") if base else ("now",):
        under, over = worst[side]
        print(
            f"\n{side}: runs above their plan by up to {under:.1f}%, below it by up to {-over:.1f}%"
        )
