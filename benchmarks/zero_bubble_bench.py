"""Zero bubble's predicted against measured peak memory, per device (issue #7), beside 1F1B:
- a wide value that three later layers each concatenate with the running one (a captured
  graph): the gradient of a layer's output was a slice of its reader's, held whole from I to
  W (27.7% above the plan on one split). Splits forced, so that a stage holds the readers;
- Linears with ReLUs between them, a frozen head, a ResNet, a tied embedding and head: zero
  bubble keeps from I to W only the gradients of layers whose weights train;
- the readers model's stage from the start to the first reader (a slice of a concatenation's
  gradient keeps all of it), a table two layers add (one parameter, both uses in a stage or
  in two), attention with its input added back, a convolution and ReLU captured as one layer
  before a pool, a value read through a transpose and added back later (red teams' models).

Each checkout profiles, plans and measures with its own code (`Pipe.measure`, the streams
target). Layer times are evened out after profiling, so that the splits follow the structure.

    python benchmarks/zero_bubble_bench.py [--baseline CHECKOUT]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(os.environ.get("GPIPE_ROOT", Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _compare import compare, measured_row, test_models  # noqa: E402
from torch import nn  # noqa: E402

SCHEDULES = ["1f1b", "zb-h1"]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def _frozen_head() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())])
    for k in range(4, 12):
        model[k].requires_grad_(False)
    return model


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    emb, head = nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), head)


def cases() -> dict:
    """name: (model factory, example input, loss, devices to plan for, forced splits)"""
    from profiler.examples import resnet

    tg = test_models()  # (a wide value three later layers concatenate; a table two layers
    # add; attention with its input added back)

    def seeded(cls: type, *args: int) -> Callable[[], nn.Module]:
        return lambda: (torch.manual_seed(0), cls(*args))[1]

    torch.manual_seed(0)
    image = torch.randn(4, 3, 16, 16)
    net = resnet(size=16)
    return {
        "three readers of a wide value": (lambda: tg._ReadEach(128), image, "mse", (),
                                          ([0, 1, 2, 5, 7], [0, 1, 2, 4, 7], [0, 1, 2, 3, 7])),
        "readers, a stage to the first": (seeded(tg._ReadEach, 32), torch.randn(8, 3, 16, 16),
                                          "mse", (), ([0, 3, 7],)),
        "a table two layers add": (seeded(tg._PosTwice), torch.randn(8, 16, 16), "mse", (),
                                   ([0, 2, 4], [0, 1, 2, 4])),
        "attention, input added back": (seeded(tg._Attention), torch.randn(8, 16, 32), "mse",
                                        (), ([0, 2, 5],)),
        "convolution and ReLU, a pool": (seeded(tg._ConvPool), torch.randn(8, 3, 16, 16), "mse",
                                         (), ([0, 2, 7],)),
        "a skip read through a transpose": (seeded(tg._TransposedSkip), torch.randn(8, 16, 32),
                                            "mse", (), ([0, 1, 2, 5],)),
        "Linear and ReLU": (_mlp, torch.randn(12, 64), "cross_entropy", (2, 3), ()),
        "frozen head": (_frozen_head, torch.randn(8, 256), "mse", (2,), ()),
        "ResNet": (lambda: resnet(size=16), net.example_input, "cross_entropy", (3,), ()),
        "tied embedding and head": (_tied, torch.randint(0, 1000, (8, 16)), "cross_entropy",
                                    (2, 3), ()),
    }  # fmt: skip


def rows() -> list[dict]:
    from codegen.measure import make_data
    from planner import Cluster, plan_pipeline, search
    from planner.partition import Partition
    from tests.conftest import even_times, quick_profile

    torch.set_num_threads(1)
    out = []
    for name, (build, x, loss, devices, splits) in cases().items():
        model = build()
        n = x.shape[0]
        prof = even_times(quick_profile(model, x, batch_sizes=[n // 4, n // 2, n], loss_fn=loss,
                                        threads=1))  # fmt: skip
        plans = []
        for schedule in SCHEDULES:
            for K in devices:
                plans.append((K, schedule, plan_pipeline(
                    prof, Cluster.uniform(K, "1GiB"), n, microbatches=4, schedule=schedule,
                    recompute="never",
                )))  # fmt: skip
            for split in splits:  # (a split of the search's own, built as the search builds it)
                K = len(split) - 1
                cluster = Cluster.uniform(K, "1GiB")
                problem = search._Problem(prof, cluster, n, "momentum",
                                          (prof.digest(), cluster.digest()))  # fmt: skip
                cand = search.Candidate(4, schedule, "never")
                specs = search._stage_specs(problem, cand)
                plan = search._build_plan(problem, cand, specs, Partition(split, 0.0), "bench")
                plans.append((K, schedule, plan))
        for K, schedule, plan in plans:
            model = build()
            out.append(measured_row(name, K, schedule, model, plan, *make_data(model, plan)))
    return out


if __name__ == "__main__":
    compare(__file__, rows)
