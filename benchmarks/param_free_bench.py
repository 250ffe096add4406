"""A parameter-free middle stage, predicted against measured peak memory on the streams and the
torchrun targets (issue #7): Linear | Tanh, a slice of half its input, a concatenation back |
Linear, K = 3, M = 4, micro-batches of 2 x 256 floats, every layer timed 1 ms so that the split
is the one above. Both programs hold what their plans count. Before 2026-12-06 `measure
--target torchrun` read the middle stage under GPipe 36-50% low: the receives the program
posts as the step begins were allocated outside every stage's range, and left out.

    python benchmarks/param_free_bench.py
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

D = 256


class Half(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] // 2]


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=1)


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, D), nn.Tanh(), Half(), Double(), nn.Linear(D, D), nn.Tanh())
    m.example_input = torch.randn(8, D)  # type: ignore[assignment]
    return m


def main() -> None:
    from codegen.measure import make_data, measure_torchrun
    from codegen.pipe import compile_pipe
    from planner import Cluster
    from planner.search import plan_pipeline
    from profiler import profile_model

    net = model()
    prof = profile_model(net, torch.randn(8, D), batch_sizes=[2, 4], repeats=1, warmup=0,
                         max_repeats=1, overhead=False, progress=False, loss_fn="mse")  # fmt: skip
    one = {"median": 1.0, "min": 1.0, "max": 1.0}
    timed = ("forward_ms", "backward_ms", "backward_input_ms", "backward_weight_ms")

    def even(x):  # type: ignore[no-untyped-def]
        return x.model_copy(
            update={f: {b: dataclasses.replace(t, **one) for b, t in getattr(x, f).items()}
                    for f in timed}
        )  # fmt: skip

    prof = prof.model_copy(update={"layers": [even(x) for x in prof.layers],
                                   "loss": even(prof.loss)})  # fmt: skip
    print("| schedule | mode | stages | streams: predicted / measured B | "
          "torchrun: predicted / measured B |")  # fmt: skip
    print("|---|---|---|---:|---:|")
    for schedule in ("gpipe", "1f1b"):
        for mode in ("never", "always"):
            rows = []
            for target in ("streams", "torchrun"):
                plan = plan_pipeline(prof, Cluster.uniform(3, "1GiB"), 8, microbatches=4,
                                     schedule=schedule, recompute=mode, target=target)  # fmt: skip
                if target == "streams":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        pipe = compile_pipe(net, plan)
                    x, y, loss_fn = make_data(net, plan)
                    report = pipe.measure(x, y, loss_fn, steps=1, tolerance=1.0)
                else:
                    report = measure_torchrun(plan, f"{Path(__file__).resolve()}:model", steps=1)
                d = report.devices[1]
                rows.append(f"{d.predicted_peak_bytes} / {d.measured_peak_bytes} "
                            f"({100 * d.memory_error:+.1f}%)")  # fmt: skip
            stages = [list(st.layers) for st in plan.stages]
            print(f"| {schedule} | {mode} | {stages} | {rows[0]} | {rows[1]} |", flush=True)


if __name__ == "__main__":
    main()
