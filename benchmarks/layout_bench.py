"""Predicted against measured peak memory, per device, on small convolution chains whose plans
were off by an activation (issue #7): a transpose before a 1x1 convolution (the gradient's
layout), convolution, norm and ReLU blocks (an inner layer's output gradient, let go by
autograd), and a flatten and an unflatten between convolutions (a stage that opens with views
of its input). Each under GPipe, 1F1B and zero bubble, on one to three devices.

Each checkout profiles, plans and measures with its own code (`Pipe.measure`, the streams
target: the allocator's own reports per stage). Layer times are evened out after profiling, so
that the splits follow the structure alone and are the same on both sides.

    python benchmarks/layout_bench.py [--baseline CHECKOUT]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("GPIPE_ROOT", Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _compare import compare, measured_row  # noqa: E402
from torch import nn  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


class Swap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(2, 3)


def cases() -> dict:
    """name: (model, devices to try)"""
    torch.manual_seed(0)

    def conv(i: int, o: int, k: int = 3) -> nn.Conv2d:
        return nn.Conv2d(i, o, k, padding=k // 2)

    def block(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(conv(i, o), nn.BatchNorm2d(o), nn.ReLU())

    return {
        "transpose, then 1x1": (nn.Sequential(conv(3, 16), conv(16, 16), Swap(), conv(16, 3, 1)),
                                (1, 2)),
        "conv-norm-ReLU blocks": (nn.Sequential(block(3, 16), block(16, 32), block(32, 32),
                                                block(32, 16), conv(16, 3, 1)), (1, 2, 3)),
        "flatten, unflatten": (nn.Sequential(conv(3, 16), Swap(), conv(16, 16), nn.Flatten(),
                                             nn.Unflatten(1, (16, 16, 16)), conv(16, 3, 1)),
                               (2, 3)),
    }  # fmt: skip


def rows() -> list[dict]:
    from planner import Cluster, plan_pipeline
    from tests.conftest import even_times, quick_profile

    torch.set_num_threads(1)
    out = []
    for name, (model, devices) in cases().items():
        torch.manual_seed(1)
        x, y = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
        prof = even_times(quick_profile(model, x, batch_sizes=[2, 4, 8], loss_fn="mse"))
        for K in devices:
            for schedule in SCHEDULES:
                plan = plan_pipeline(
                    prof, Cluster.uniform(K, "1GiB"), 8, microbatches=4, schedule=schedule,
                    checkpoint=(),
                )  # fmt: skip
                out.append(measured_row(name, K, schedule, model, plan, x, y, nn.MSELoss()))
    return out


if __name__ == "__main__":
    compare(__file__, rows)
