"""The whole `gpipe-plan plan` process at scale: L layers on K devices, `--schedule auto`.

Synthetic profiles: per-layer forward times lognormal (seeded), backward twice the forward,
parameters, saved activations and outputs drawn uniformly, measured at sizes 1..32, a loss at the
end. Each run is a fresh process (what a user waits for: import, load, search, write); one run per
size unless --repeats says more (then the median). Prints a table with the candidates considered,
solved and pruned by their bound. The program timed is this checkout's cli.py, run from
bytecode compiled by an untimed run first, as an installed package runs (--cold: the sources
compiled in every process).

    python benchmarks/plan_bench.py [--layers 100,1000,10000] [--devices 4,16,64] [--repeats 1]
        [--target streams|torchrun] [--baseline CHECKOUT] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from profiler.types import LayerProfile, Profile, Timing  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32)


def synthetic(L: int, seed: int = 0) -> Profile:
    rng = np.random.default_rng(seed)
    fwd = rng.lognormal(0.0, 0.5, L + 1)
    params = rng.integers(10_000, 1_000_000, L)
    saved = rng.integers(1_000, 100_000, L + 1)
    out = rng.integers(1_000, 50_000, L + 1)

    def t(ms: float) -> Timing:
        return Timing(median=ms, min=ms, max=ms)

    def layer(i: int, kind: str, p: int) -> LayerProfile:
        per = {b: int(saved[i]) * b for b in SIZES}
        return LayerProfile(
            index=i, name=str(i), type=kind, param_bytes=p, largest_param_bytes=p,
            buffer_bytes=0, output_shape=[[int(out[i]) // 4]], output_bytes=int(out[i]),
            forward_ms={b: t(fwd[i] * b) for b in SIZES},
            backward_ms={b: t(2 * fwd[i] * b) for b in SIZES},
            backward_input_ms={b: t(fwd[i] * b) for b in SIZES},
            backward_weight_ms={b: t(fwd[i] * b) for b in SIZES},
            saved_bytes=per, shared_bytes={b: 0 for b in SIZES},
            input_saved_bytes={b: 0 for b in SIZES},
            forward_transient_bytes={b: 4096 * b for b in SIZES},
            backward_transient_bytes={b: 8192 * b for b in SIZES},
            input_unsaved_bytes={b: 0 for b in SIZES},
            forward_peak_bytes={b: int(saved[i]) * b + 4096 * b for b in SIZES},
            input_grad_transient_bytes={b: 4096 * b for b in SIZES},
            weight_grad_transient_bytes={b: 4096 * b for b in SIZES},
        )  # fmt: skip

    return Profile(
        model=f"synthetic:{L}", model_digest="0" * 64, device="cpu", device_name="synthetic",
        dtype="float32", input_shape=[256], input_dtype="float32", input_bytes=1024,
        batch_sizes=list(SIZES), layers=[layer(i, "Layer", int(params[i])) for i in range(L)],
        loss=layer(L, "loss", 0),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="100,1000,10000")
    ap.add_argument("--devices", default="4,16,64")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--memory", default="1GiB")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--target",
        default="streams",
        choices=["streams", "torchrun"],
        help="the program planned for (torchrun: its lowering is chosen and timed)",
    )
    ap.add_argument("--baseline", help="a checkout of an earlier commit: run it alternately, "
                    "same profiles, and compare times and plans")  # fmt: skip
    ap.add_argument("--cold", action="store_true", help="compile the sources in every process "
                    "(no bytecode cache, as under PYTHONDONTWRITEBYTECODE)")  # fmt: skip
    args = ap.parse_args()
    # this checkout's cli.py (not whichever gpipe-plan is installed), as the baseline's
    exe = [sys.executable, str(ROOT / "cli.py")]
    base = [sys.executable, str(Path(args.baseline) / "cli.py")] if args.baseline else None
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, batch {args.batch_size}, {args.memory} per device, "
          f"target {args.target}")  # fmt: skip
    if base:
        print("| layers | devices | baseline s | now s | ratio | candidates | solved | pruned "
              "| plan | same plan |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    else:
        print("| layers | devices | whole process s | candidates | solved | pruned | plan |")
        print("|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        # An installed package runs from bytecode, compiled once; a process that compiles
        # every source first takes 0.25-0.35 s more here (PYTHONDONTWRITEBYTECODE, set on
        # these machines). The bytecode goes to a folder of the run's own (under it, each
        # source's path: the checkouts apart), written by a run that is not timed, unless
        # --cold.
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        # (cold: as these machines run it, the libraries' bytecode read, none written; a
        # checkout that has a __pycache__ of its own is read too: an empty cache folder would
        # compile numpy and pydantic as well, 2.1 s against 0.9 s at 100 x 4)
        if args.cold:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
            small = Path(tmp) / "small.json"
            synthetic(8).save(small)
            for prog in [exe] + ([base] if base else []):
                warm = [*prog, "plan", str(small), "--devices", "2", "--memory", args.memory,
                        "--batch-size", "8", "--target", args.target, "-o", os.devnull]  # fmt: skip
                subprocess.run(warm, capture_output=True, env=env, cwd=tmp)
        for L in map(int, args.layers.split(",")):
            prof = Path(tmp) / f"p{L}.json"
            synthetic(L).save(prof)
            for K in map(int, args.devices.split(",")):
                if K > L:
                    continue

                def run(prog: list[str], out: Path) -> tuple[float, int, str]:
                    cmd = [*prog, "plan", str(prof), "--devices", str(K), "--memory", args.memory,
                           "--batch-size", str(args.batch_size), "--target", args.target,
                           "-o", str(out)]  # fmt: skip
                    t0 = time.perf_counter()
                    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
                    wall = time.perf_counter() - t0
                    if done.returncode not in (0, 1):
                        raise SystemExit(done.stderr)
                    return wall, done.returncode, done.stderr

                now, then = [], []
                for _ in range(args.repeats):  # alternated: the machine's drift hits both
                    if base:
                        wall, _, told = run(base, Path(tmp) / "base.json")
                        then.append(wall)
                    wall, rc, said = run(exe, Path(tmp) / "plan.json")
                    now.append(wall)
                if rc == 1 and base:  # no split fits: both must name the same least memory
                    a, b = statistics.median(then), statistics.median(now)
                    same = _need(told) == _need(said)
                    print(f"| {L} | {K} | {a:.2f} | {b:.2f} | {a / b:.1f}x | | | | no split fits: "
                          f"{_need(said)} bytes | {'yes' if same else 'NO'} |", flush=True)  # fmt: skip
                    continue
                if rc == 1:  # no split fits: the search ran to the end
                    print(f"| {L} | {K} | {statistics.median(now):.2f} | no split fits: "
                          f"{_need(said)} bytes |", flush=True)  # fmt: skip
                    continue
                plan = json.loads((Path(tmp) / "plan.json").read_text())
                s = plan["solver"]
                what = f"M={plan['microbatches']} {plan['schedule']} {plan['recompute']}"
                counts = f"{s['candidates']} | {s['solved']} | {s['pruned']}"
                if base:
                    old = json.loads((Path(tmp) / "base.json").read_text())
                    same = all(_timed(old)[k] == _timed(plan)[k] for k in _timed(plan))
                    a, b = statistics.median(then), statistics.median(now)
                    print(f"| {L} | {K} | {a:.2f} | {b:.2f} | {a / b:.1f}x | {counts} | {what} | "
                          f"{'yes' if same else 'NO'} |", flush=True)  # fmt: skip
                else:
                    print(f"| {L} | {K} | {statistics.median(now):.2f} | {counts} | {what} |",
                          flush=True)  # fmt: skip


def _need(stderr: str) -> str:
    """The least memory per device a "no split fits" message names, in bytes."""
    found = re.search(r"\((\d+) bytes\)", stderr)
    return found.group(1) if found else "?"


def _timed(plan: dict) -> dict:
    """What makes two plans the same: the split and what it runs, predicted time and memory."""
    return {
        "stages": [(st["layers"], st["recompute"]) for st in plan["stages"]],
        "choice": (plan["microbatches"], plan["schedule"], plan["recompute"]),
        "ms": plan["predicted"]["iteration_ms"],
        "peaks": plan["predicted"]["peak_memory"],
    }


if __name__ == "__main__":
    main()
