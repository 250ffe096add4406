"""A batch split into unequal micro-batches, predicted against measured peak memory in one
process (issue #7): torch.tensor_split makes 7 samples in 3 micro-batches 3, 2 and 2, and 8 in
3 are 3, 3 and 2. Before 2026-12-06 the plan counted every micro-batch at the largest size
(up to 12% over the run on the GPT); now each device's peak counts each at its own.

Models: tests/test_measure.py's mlp and transformer, and tests/test_graph.py's small GPT
(captured), each with its own loss, profiled at 2 and 3 samples. Every layer timed alike
(even_times), so the split depends on memory alone and is the same before and after;
recomputation never. `--models unet`: example:unet (captured) profiled at 1 and 2 samples,
where a CPU's convolutions take more working memory at one sample than at two (a red team
measured 32% over the plan when the smaller micro-batch's were capped at the larger's).

    python benchmarks/uneven_bench.py [--models mlp,transformer,gpt,unet]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [(3, 3, 7), (2, 3, 8)]  # (devices, micro-batches, samples)
UNET_CASES = [(2, 2, 3), (4, 2, 3), (2, 4, 5)]
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def _models() -> list[tuple[str, Any, Any]]:
    """(name, build, the layers of a build) per model."""
    from profiler.examples import unet
    from profiler.graph import capture
    from tests.test_graph import gpt_small
    from tests.test_measure import MODELS

    out = [(name, build, lambda m: m) for name, build in MODELS.items()]
    out.append(("gpt", gpt_small, lambda m: capture(m, m.example_input)))
    out.append(("unet", unet, lambda m: capture(m, m.example_input)))
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,transformer,gpt")
    wanted = ap.parse_args().models.split(",")
    from codegen.measure import make_data
    from codegen.pipe import compile_pipe
    from planner import Cluster
    from planner.search import plan_pipeline
    from tests.conftest import even_times, quick_profile

    print("| model | devices x M, samples | schedule | predicted / measured peak per device "
          "(error) |")  # fmt: skip
    print("|---|---|---|---|")
    for name, build, layers_of in _models():
        if name not in wanted:
            continue
        model = build()
        x = model.example_input[:4]
        sizes, cases = ([1, 2], UNET_CASES) if name == "unet" else ([2, 3], CASES)
        prof = even_times(quick_profile(layers_of(model), x, batch_sizes=sizes))
        for K, M, N in cases:
            for schedule in SCHEDULES:
                try:
                    plan = plan_pipeline(prof, Cluster.uniform(K, "1GiB"), N, microbatches=M,
                                         schedule=schedule, recompute="never")  # fmt: skip
                except Exception as e:  # noqa: BLE001 - (interleaved needs M >= K, say)
                    print(f"| {name} | {K} x {M}, {N} | {schedule} | not planned: "
                          f"{str(e)[:60]} |")  # fmt: skip
                    continue
                model = build()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    pipe = compile_pipe(layers_of(model), plan)
                xx, y, loss_fn = make_data(model, plan)
                report = pipe.measure(xx, y, loss_fn, steps=1, tolerance=1.0)
                cells = ", ".join(
                    f"{d.predicted_peak_bytes} / {d.measured_peak_bytes} "
                    f"({100 * d.memory_error:+.2f}%)"
                    for d in report.devices
                )
                print(f"| {name} | {K} x {M}, {N} | {schedule} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
