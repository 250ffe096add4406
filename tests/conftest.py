"""Shared fixtures: synthetic profiles with exact numbers, real profiles of the examples, and a
way to run the CLI in-process and read what it printed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

import cli
from profiler.types import LayerProfile, Profile, Timing


def synthetic_profile(
    forward: Sequence[float],
    backward: Sequence[float] | None = None,
    *,
    params: Sequence[int] | None = None,
    saved: Sequence[int] | None = None,
    shared: Sequence[int] | None = None,
    peak: Sequence[int] | None = None,
    output_bytes: Sequence[int] | None = None,
    input_bytes: int = 16,
    sizes: Sequence[int] = (1,),
) -> Profile:
    """A profile whose per-sample numbers are given; every quantity scales linearly with the
    micro-batch size, so values at any size are exact."""
    n = len(forward)
    backward = backward if backward is not None else [2 * f for f in forward]
    params = params if params is not None else [100] * n
    saved = saved if saved is not None else [10] * n
    shared = shared if shared is not None else [0] * n
    peak = peak if peak is not None else [s + 5 for s in saved]
    output_bytes = output_bytes if output_bytes is not None else [8] * n
    layers = [
        LayerProfile(
            index=i,
            name=str(i),
            type="Synthetic",
            param_bytes=params[i],
            buffer_bytes=0,
            output_shape=[[output_bytes[i] // 4]],
            output_bytes=output_bytes[i],
            forward_ms={b: _t(forward[i] * b) for b in sizes},
            backward_ms={b: _t(backward[i] * b) for b in sizes},
            backward_input_ms={b: _t(backward[i] * b / 2) for b in sizes},
            backward_weight_ms={b: _t(backward[i] * b / 2) for b in sizes},
            saved_bytes={b: saved[i] * b for b in sizes},
            shared_bytes={b: shared[i] * b for b in sizes},
            peak_bytes={b: peak[i] * b for b in sizes},
        )
        for i in range(n)
    ]
    return Profile(
        model="synthetic:chain",
        model_digest="0" * 64,
        device="cpu",
        device_name="synthetic",
        dtype="float32",
        input_shape=[input_bytes // 4],
        input_dtype="float32",
        input_bytes=input_bytes,
        batch_sizes=list(sizes),
        layers=layers,
    )


def _t(ms: float) -> Timing:
    return Timing(median=ms, min=ms, max=ms)


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]):
    def run(*args: str) -> Result:
        code = cli.main([str(a) for a in args])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="session")
def transformer_profile_path(tmp_path_factory: pytest.TempPathFactory):
    """example:transformer profiled once on the CPU (quickly: timing noise does not matter here)."""
    path = tmp_path_factory.mktemp("profiles") / "transformer.json"
    code = cli.main(
        [
            "profile",
            "example:transformer",
            "--batch-sizes",
            "1,2,4",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "-o",
            str(path),
        ]  # fmt: skip
    )
    assert code == 0
    return path
