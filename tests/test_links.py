"""`gpipe-plan links`: the links between ranks, measured as a pipeline's hand-offs (issue #7)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cluster import Cluster
from profiler.limits import MAX_BANDWIDTH
from profiler.links import SIZES, fit_link

ROOT = Path(__file__).resolve().parents[1]


def test_fit_link_recovers_an_exact_line():
    ms = [0.2 + n / 2.5e9 * 1e3 for n in SIZES]
    latency, bandwidth = fit_link(SIZES, ms)
    assert latency == pytest.approx(0.2, rel=1e-9)
    assert bandwidth == pytest.approx(2.5e9, rel=1e-9)


def test_fit_link_never_states_a_negative_latency():
    sizes = [1000.0, 2000.0, 4000.0]
    ms = [0.5, 1.5, 3.5]  # the line through them crosses zero at 500 bytes: -0.5 ms intercept
    latency, bandwidth = fit_link(sizes, ms)
    slope = (1000 * 0.5 + 2000 * 1.5 + 4000 * 3.5) / (1000**2 + 2000**2 + 4000**2)
    assert latency == 0.0
    assert bandwidth == pytest.approx(1e3 / slope, rel=1e-12)


def test_fit_link_of_latency_alone():
    assert fit_link([1024, 4096, 16384], [0.3, 0.3, 0.3]) == (pytest.approx(0.3), MAX_BANDWIDTH)
    assert fit_link([1024, 4096], [0.4, 0.2]) == (pytest.approx(0.3), MAX_BANDWIDTH)
    with pytest.raises(ValueError):
        fit_link([1024], [])


def test_links_measures_two_gloo_ranks_and_plans_with_them(tmp_path, run_cli):
    out = tmp_path / "cluster.json"
    busy = 20.0
    r = run_cli("links", "--nproc-per-node", "2", "--memory", "1GiB", "--rounds", "2",
                "--max-bytes", "4096", "--busy-ms", busy, "-o", out)  # fmt: skip
    assert r.code == 0, r.err
    assert "rank0 -> rank1: latency" in r.out
    cluster = Cluster.load(out)
    assert [d.name for d in cluster.devices] == ["rank0", "rank1"]
    assert all(d.memory_bytes == 2**30 and d.host is None for d in cluster.devices)
    (link,) = cluster.links
    # a hand-off takes some time, and not the sender's compute before it
    assert 0 < link.transfer_ms(4096) < busy


def test_links_across_hosts_corrects_the_clocks(tmp_path):
    """Ranks that say they are on different hosts take their clock offset from a ping-pong:
    on one host it must come out near zero, and the hand-offs stay as short."""
    out = tmp_path / "cluster.json"
    driver = tmp_path / "hosts.py"
    driver.write_text(
        "import os, sys\n"
        "import profiler.links as links\n"
        "links.socket.gethostname = lambda: 'host' + os.environ['RANK']\n"
        "sys.exit(links.main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(driver), "--memory", "1GiB", "--rounds", "2", "--max-bytes", "4096",
         "--busy-ms", "20", "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    cluster = Cluster.load(out)
    assert [d.host for d in cluster.devices] == ["host0", "host1"]
    assert 0 < cluster.links[0].transfer_ms(4096) < 20


@pytest.mark.parametrize(
    "args, said",
    [
        (["--nproc-per-node", "1", "--memory", "1GiB"], "--nproc-per-node 1: must be from 2"),
        (["--nproc-per-node", "2", "--memory", "lots"], "lots"),
        (["--nproc-per-node", "2", "--memory", "1GiB", "--rounds", "0"], "--rounds 0"),
    ],
)
def test_links_refuses_bad_input_before_launching(tmp_path, run_cli, args, said):
    out = tmp_path / "cluster.json"
    r = run_cli("links", *args, "-o", out)
    assert r.code == 2 and said in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not out.exists()


def test_links_needs_memory_on_the_cpu(tmp_path, run_cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on CUDA the GPU's memory is the default")
    out = tmp_path / "cluster.json"
    out.write_text("kept")
    r = run_cli("links", "--nproc-per-node", "2", "-o", out)
    assert r.code == 2 and "--memory is required" in r.err
    assert out.read_text() == "kept"
