"""Predicted against measured peak memory, per device, for small captured models whose layers
read a value and hand it on to a later one (a skip's source read by the next layer too): a
convolution chain with a concatenated skip, a small U-Net with and without its residual, a
linear chain with a long skip (issue #7).

Such a layer's zero-bubble I (its input's gradient) went unmeasured, so zero bubble's first
stage of a convolution model ran 41% over its plan; under GPipe and 1F1B, the sum of that
value's gradient parts (the one received from the later stage and the reader's own) went
uncounted, 10-12% under. Each case is profiled, planned and measured
by the command line of `--root` (default: this checkout), so the same script measures an
earlier version: the fix is in the profiler, which each version runs for itself.

    python benchmarks/skip_reader_bench.py [--root CHECKOUT] [--target streams|torchrun]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = """
import torch
import torch.nn.functional as F
from torch import nn


class ConvSkip(nn.Module):
    def __init__(self, relu=True):
        super().__init__()
        self.c1, self.c2, self.c3 = (nn.Conv2d(3 if k == 0 else 8, 8, 3, padding=1) for k in range(3))
        self.c4 = nn.Conv2d(16, 3, 1)
        self.relu = relu

    def forward(self, x):
        a = F.relu if self.relu else (lambda t: t)
        x1 = a(self.c1(x))
        return self.c4(torch.cat([a(self.c3(a(self.c2(x1)))), x1], dim=1))


class UNet(nn.Module):
    def __init__(self, residual=True):
        super().__init__()
        self.e1 = nn.Conv2d(3, 8, 3, padding=1)
        self.e2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.d1 = nn.Conv2d(16, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 3, 1)
        self.residual = residual

    def forward(self, x):
        e1 = F.relu(self.e1(x))
        e2 = F.relu(self.e2(e1))
        m = F.relu(self.mid(e2))
        if self.residual:
            m = m + e2
        return self.out(F.relu(self.d1(torch.cat([self.up(m), e1], dim=1))))


class LongSkip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.e = nn.Linear(32, 64), nn.Linear(128, 16)
        self.b, self.c, self.d = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        a = torch.relu(self.a(x))
        d = torch.relu(self.d(torch.relu(self.c(torch.relu(self.b(a))))))
        return self.e(torch.cat([a, d], dim=-1))


class TwoLater(nn.Module):  # x1 read by the next layer and by two after it (a review's)

    def __init__(self, more=False):
        super().__init__()
        self.c = nn.ModuleList([nn.Conv2d(3 if k == 0 else 8, 8, 3, padding=1) for k in range(5)])
        self.out = nn.Conv2d(8, 3, 1)
        self.more = more

    def forward(self, x):
        c = self.c
        x1 = F.relu(c[0](x))
        b = F.relu(c[2](F.relu(c[1](x1)) + x1))
        if self.more:  # (two of x1's readers in one later stage)
            b = F.relu(c[4](F.relu(c[3](b)) + x1))
        return self.out(b + x1)


def conv_skip():
    torch.manual_seed(0)
    return ConvSkip()


def two_later():
    torch.manual_seed(0)
    return TwoLater()


def two_later_more():
    torch.manual_seed(0)
    return TwoLater(more=True)


def conv_skip_norelu():
    torch.manual_seed(0)
    return ConvSkip(relu=False)


def unet():
    torch.manual_seed(0)
    return UNet()


def unet_nores():
    torch.manual_seed(0)
    return UNet(residual=False)


def long_skip():
    torch.manual_seed(0)
    return LongSkip()
"""

IMAGE = ("4,3,16,16", "1,2,4")
CASES = [  # (model, input shape and sizes, devices, batch, micro-batches, schedule, optimizer)
    ("conv_skip_norelu", IMAGE, 2, 4, 1, "zb-h1", "sgd"),
    ("conv_skip", IMAGE, 2, 7, 3, "zb-h1", "adam"),
    ("conv_skip", IMAGE, 2, 4, 2, "1f1b", "momentum"),
    ("unet", IMAGE, 3, 4, 2, "zb-h1", "momentum"),
    ("unet", IMAGE, 2, 4, 2, "zb-h1", "adam"),
    ("unet", IMAGE, 3, 4, 2, "gpipe", "sgd"),
    ("unet_nores", IMAGE, 2, 4, 2, "zb-h1", "adam"),
    ("two_later", IMAGE, 2, 4, 1, "zb-h1", "sgd"),
    ("two_later", IMAGE, 2, 4, 2, "zb-h1", "adam"),
    ("two_later_more", IMAGE, 2, 4, 1, "zb-h1", "sgd"),
    ("two_later", IMAGE, 2, 4, 1, "1f1b", "sgd"),
    ("two_later", IMAGE, 2, 4, 1, "gpipe", "momentum"),
    ("two_later", IMAGE, 3, 4, 2, "1f1b", "sgd"),
    ("two_later_more", IMAGE, 2, 4, 2, "gpipe", "adam"),
    ("conv_skip", IMAGE, 2, 4, 2, "gpipe", "sgd"),
    ("long_skip", ("8,32", "1,2,4,8"), 2, 8, 4, "zb-h1", "momentum"),
    ("long_skip", ("8,32", "1,2,4,8"), 3, 8, 4, "1f1b", "sgd"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose cli.py runs")
    ap.add_argument("--target", choices=["streams", "torchrun"], default="streams")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(root / "cli.py"), *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)}\n{done.stderr}")
        return done

    print(f"# {time.strftime('%Y-%m-%d')}, {root}, target {args.target}")
    print("| model | devices | batch / M | schedule | optimizer | device: predicted -> measured "
          "(measured - predicted) |")  # fmt: skip
    print("|---|---:|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "skips.py"
        models.write_text(MODELS)
        profiled: dict[str, Path] = {}
        for name, (shape, sizes), K, batch, M, schedule, optimizer in CASES:
            spec = f"{models}:{name}"
            if name not in profiled:
                profiled[name] = Path(tmp) / f"{name}.json"
                cli("profile", spec, "--input-shape", shape, "--batch-sizes", sizes, "--loss",
                    "mse", "--threads", "1", "-o", str(profiled[name]))  # fmt: skip
            plan, report = Path(tmp) / "plan.json", Path(tmp) / "report.json"
            cli("plan", str(profiled[name]), "--devices", str(K), "--memory", "1GiB",
                "--batch-size", str(batch), "--microbatches", str(M), "--schedule", schedule,
                "--recompute", "never", "--optimizer", optimizer, "--target", args.target,
                "-o", str(plan))  # fmt: skip
            cli("measure", str(plan), "--model", spec, "--target", args.target, "--steps", "2",
                "-o", str(report))  # fmt: skip
            devices = json.loads(report.read_text())["devices"]
            cells = [
                f"{d['name']}: {d['predicted_peak_bytes']:,} -> {d['measured_peak_bytes']:,} "
                f"({d['measured_peak_bytes'] - d['predicted_peak_bytes']:+,})"
                for d in devices
            ]
            print(f"| {name} | {K} | {batch} / {M} | {schedule} | {optimizer} | "
                  f"{'; '.join(cells)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
