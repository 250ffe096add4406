"""A parameter-free middle stage, predicted against measured peak memory on the streams and the
torchrun targets (issue #7): tests/test_measure.py's param_free_middle (Linear | Tanh, a slice
of half its input, a concatenation back | Linear, Tanh; 64 features), K = 3, M = 4,
micro-batches of 2 samples, every layer timed 1 ms so that the split is the one above, each
plan made for the target it is measured on. Both programs hold what their plans count. Before
2026-12-06 `measure --target torchrun` read the middle stage under GPipe 36-50% low: the
receives the program posts as the step begins were allocated outside every stage's range,
and left out.

    python benchmarks/param_free_bench.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from codegen.measure import make_data, measure_torchrun
    from codegen.pipe import compile_pipe
    from planner import Cluster
    from planner.search import plan_pipeline
    from tests.conftest import even_times, quick_profile
    from tests.test_measure import param_free_middle

    net = param_free_middle()
    prof = even_times(quick_profile(net, torch.randn(8, 64), batch_sizes=[2], loss_fn="mse"))
    spec = f"{ROOT / 'tests' / 'test_measure.py'}:param_free_middle"
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
                    report = measure_torchrun(plan, spec, steps=1)
                d = report.devices[1]
                rows.append(f"{d.predicted_peak_bytes} / {d.measured_peak_bytes} "
                            f"({100 * d.memory_error:+.1f}%)")  # fmt: skip
            stages = [list(st.layers) for st in plan.stages]
            print(f"| {schedule} | {mode} | {stages} | {rows[0]} | {rows[1]} |", flush=True)


if __name__ == "__main__":
    main()
