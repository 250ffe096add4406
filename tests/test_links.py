"""`gpipe-plan links`: the links between ranks, measured as a pipeline's hand-offs (issue #7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.cluster import Cluster, Link
from profiler.limits import MAX_BANDWIDTH
from profiler.links import SIZES, build_cluster, fit_link

ROOT = Path(__file__).resolve().parents[1]


def test_fit_link_recovers_an_exact_line():
    ms = [0.2 + n / 2.5e9 * 1e3 for n in SIZES]
    latency, bandwidth = fit_link(SIZES, ms)
    assert latency == pytest.approx(0.2, rel=1e-9)
    assert bandwidth == pytest.approx(2.5e9, rel=1e-9)


def test_fit_link_weighs_each_size_by_its_relative_error():
    """Noise of a tenth on every point: the latency of 1 KiB messages stays within a tenth,
    where a plain least-squares fit, led by the largest messages, would miss it."""
    sizes = list(SIZES)
    exact = [0.05 + n / 1e9 * 1e3 for n in sizes]
    noisy = [y * (1.1 if k % 2 else 0.9) for k, y in enumerate(exact)]
    latency, bandwidth = fit_link(sizes, noisy)
    assert latency == pytest.approx(0.05, rel=0.1)
    assert bandwidth == pytest.approx(1e9, rel=0.1)


def test_fit_link_never_states_a_negative_latency():
    sizes = [1000.0, 2000.0, 4000.0]
    ms = [0.5, 1.5, 3.5]  # the line through them crosses zero at 500 bytes: -0.5 ms intercept
    latency, bandwidth = fit_link(sizes, ms)
    w = [1 / y**2 for y in ms]  # through zero, each point weighed by its relative error
    slope = sum(a * x * y for a, x, y in zip(w, sizes, ms)) / sum(
        a * x * x for a, x in zip(w, sizes)
    )
    assert latency == 0.0
    assert bandwidth == pytest.approx(1e3 / slope, rel=1e-12)


def test_fit_link_of_latency_alone():
    assert fit_link([1024, 4096, 16384], [0.3, 0.3, 0.3]) == (pytest.approx(0.3), MAX_BANDWIDTH)
    # falling: the mean, each point weighed by its relative error (1/0.16 and 1/0.04)
    assert fit_link([1024, 4096], [0.4, 0.2]) == (pytest.approx(7.5 / 31.25), MAX_BANDWIDTH)
    with pytest.raises(ValueError):
        fit_link([1024], [])


def test_a_late_receive_costs_at_least_a_hand_off():
    """A link's late figures price a message received late; a file that makes one cheaper
    than a hand-off (or gives a late bandwidth without a bandwidth) is refused."""
    link = Link(bandwidth_bytes_per_s=1e6, latency_ms=0.5, late_latency_ms=2.0,
                late_bandwidth_bytes_per_s=5e5)  # fmt: skip
    assert link.transfer_ms(1000) == 1.5 and link.transfer_ms(1000, late=True) == 4.0
    assert list(link.transfer_ms(np.array([0.0, 1000.0]), late=True)) == [2.0, 4.0]
    only = Link(latency_ms=0.5, late_latency_ms=1.25)  # transfers otherwise free
    assert (only.transfer_ms(8), only.transfer_ms(8, late=True), only.transfer_ms(0, late=True)) \
        == (0.5, 1.25, 0.0)  # fmt: skip
    assert Link(latency_ms=0.5).transfer_ms(8, late=True) == 0.5  # no late figures: a hand-off
    for bad, said in [
        ({"latency_ms": 1.0, "late_latency_ms": 0.5}, "below latency_ms"),
        ({"bandwidth_bytes_per_s": 1e6, "late_bandwidth_bytes_per_s": 2e6}, "at least as much"),
        ({"late_bandwidth_bytes_per_s": 2e6}, "at least as much"),
        ({"latency_ms": 0.5, "late_latency_ms": True}, "valid number"),  # (not 1 ms)
        ({"bandwidth_bytes_per_s": 1e6, "late_bandwidth_bytes_per_s": "5e5"}, "valid number"),
    ]:
        with pytest.raises(ValueError, match=said):
            Link(**bad)


def test_the_cluster_keeps_late_figures_no_cheaper_than_the_hand_offs():
    """build_cluster fits the late receives apart; a fit below the hand-off's (noise) is raised
    to it, and where both agree the link states no late figures."""
    hand = {1024: 0.2 + 1024 / 1e6, 4096: 0.2 + 4096 / 1e6}  # 0.2 ms, 1 GB/s
    late = {1024: 0.6 + 1024 / 5e5, 4096: 0.6 + 4096 / 5e5}  # 0.6 ms, 0.5 GB/s
    faster = {1024: 0.1 + 1024 / 2e6, 4096: 0.1 + 4096 / 2e6}
    cluster = build_cluster(["h", "h", "h"], [hand, hand], [2**30] * 3, ["", "", ""],
                            [late, faster])  # fmt: skip
    a, b = cluster.links
    assert a.latency_ms == pytest.approx(0.2) and a.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert a.late_latency_ms == pytest.approx(0.6)
    assert a.late_bandwidth_bytes_per_s == pytest.approx(5e8)
    assert (b.late_latency_ms, b.late_bandwidth_bytes_per_s) == (None, None)
    assert build_cluster(["h", "h"], [hand], [1, 1], ["", ""]).links[0].has_late is False
    # late receives quicker than hand-offs when small but slower when large: each size is
    # raised to its hand-off before the fit, which then prices every size near what was
    # measured (raising the fitted latency alone overpriced 64 KiB by 25%)
    sizes = [1024, 4096, 65536, 262144]
    hand = {n: 0.2 + n / 1e6 for n in sizes}
    late = {n: 0.1 + n / 5e5 for n in sizes}
    (link,) = build_cluster(["h", "h"], [hand], [1, 1], ["", ""], [late]).links
    for n in sizes:
        priced = link.transfer_ms(n, late=True)
        assert hand[n] <= priced <= 1.15 * max(hand[n], late[n]), n


def test_a_cluster_file_from_before_the_later_figures_keeps_its_bytes():
    """A cluster written before links stated late figures and a step's all-reduces reads
    and writes back as it was (no new keys: its digest holds, and an older gpipe-plan still
    reads what this one writes); figures given are written."""
    old = {
        "kind": "cluster",
        "format_version": 1,
        "devices": [
            {"name": f"d{k}", "memory_bytes": 2**30, "speed": 1.0, "reserved_bytes": 0,
             "torch_device": None, "host": None}
            for k in range(2)
        ],
        "links": [{"bandwidth_bytes_per_s": 1e9, "latency_ms": 0.25}],
        "host_links": None,
    }  # fmt: skip
    text = json.dumps(old, sort_keys=True, indent=1) + "\n"
    cluster = Cluster.from_json_text(text)
    assert cluster.canonical_json() == text
    late = {1024: 0.6 + 1024 / 5e5, 4096: 0.6 + 4096 / 5e5}
    hand = {1024: 0.2 + 1024 / 1e6, 4096: 0.2 + 4096 / 1e6}
    made = build_cluster(["h", "h"], [hand], [1, 1], ["", ""], [late], step_sync_ms=0.4)
    data = json.loads(made.canonical_json())
    assert data["step_sync_ms"] == 0.4
    assert set(data["links"][0]) == {"bandwidth_bytes_per_s", "latency_ms", "late_latency_ms",
                                     "late_bandwidth_bytes_per_s"}  # fmt: skip
    assert Cluster.from_json_text(made.canonical_json()) == made
    assert build_cluster(["h", "h"], [hand], [1, 1], ["", ""], step_sync_ms=-0.1).step_sync_ms == 0


def test_links_measures_two_gloo_ranks_and_plans_with_them(tmp_path, run_cli):
    out = tmp_path / "cluster.json"
    # (a median of 5 rounds of 50 ms: the sync figure is mostly a waiting rank's wake-up, and
    # on a loaded machine one round of 2 went past 8 ms in 16 of 40 tries: a flakiness audit)
    busy = 50.0
    r = run_cli("links", "--nproc-per-node", "2", "--memory", "1GiB", "--rounds", "5",
                "--max-bytes", "4096", "--busy-ms", busy, "-o", out)  # fmt: skip
    assert r.code == 0, r.err
    assert "rank0 -> rank1: latency" in r.out
    cluster = Cluster.load(out)
    assert [d.name for d in cluster.devices] == ["rank0", "rank1"]
    assert all(d.memory_bytes == 2**30 and d.host is None for d in cluster.devices)
    (link,) = cluster.links
    # a hand-off takes not the sender's compute before it
    # (two sizes: a slow 4 KiB hand-off makes the fitted line's latency 0, as it may be)
    assert 0 <= link.latency_ms < busy and link.transfer_ms(4096) < busy
    # a late receive from its post on (not the receiver's 1.5 x busy of compute before it)
    assert "received late: latency" in r.out
    assert link.transfer_ms(4096, late=True) < 1.5 * busy
    # a step's two all-reduces, without the compute between them: rank 0 computes 1.5 x busy,
    # rank 1 busy, so a figure that took the shorter compute off would be 0.5 x busy or more
    assert "a step's two all-reduces" in r.out
    assert 0 < cluster.step_sync_ms < 0.4 * busy


DRIVER = """
import json, os, sys, time
import torch.distributed as dist
import profiler.links as links

rank = int(os.environ["RANK"])
links.socket.gethostname = lambda: f"host{rank}"
if rank == 1:  # another host's clock: 1000 s ahead, and running 0.1% fast
    real = time.perf_counter
    start = real()
    time.perf_counter = lambda: 1000.0 + start + (real() - start) * 1.001
dist.init_process_group("gloo")
hosts, means = links.measure_hand_offs(rounds=2, busy_ms=20.0, sizes=[1024, 4096])
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"hosts": hosts, "means": [list(m.values()) for m in means]}, f)
dist.destroy_process_group()
"""


def test_links_across_hosts_matches_the_clocks(tmp_path):
    """Ranks on different hosts read different clocks: here rank 1's is 1000 s ahead and
    drifts. The two directions' errors cancel: the hand-offs still come out as short as on one
    clock (not 1000 s, and not the sender's 20 ms of compute)."""
    out = tmp_path / "means.json"
    driver = tmp_path / "hosts.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(driver), str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["hosts"] == ["host0", "host1"]
    ((small, large),) = got["means"]
    assert 0.001 < small < 20 and 0.001 < large < 20, got


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


def test_links_on_cuda_needs_a_gpu_per_rank(tmp_path, run_cli):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has a GPU for each of two ranks")
    out = tmp_path / "cluster.json"
    r = run_cli("links", "--nproc-per-node", "2", "--device", "cuda", "-o", out)
    assert r.code == 2 and "NCCL needs a GPU per rank" in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1 and not out.exists()


def test_links_needs_memory_on_the_cpu(tmp_path, run_cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on CUDA the GPU's memory is the default")
    out = tmp_path / "cluster.json"
    out.write_text("kept")
    r = run_cli("links", "--nproc-per-node", "2", "-o", out)
    assert r.code == 2 and "--memory is required" in r.err
    assert out.read_text() == "kept"


def _running(marker: str) -> list[str]:
    """Command lines of the measuring ranks alive now that hold `marker` (not torchrun's)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                line = (Path("/proc") / name / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            rank = b"profiler.links" in line and b"torch.distributed.run" not in line
            if marker.encode() in line and rank:
                found.append(line.decode(errors="replace"))
    return found


def test_links_past_its_timeout_stops_every_rank(tmp_path, run_cli):
    """torchrun starts each rank in a session of its own: killing torchrun's alone left them
    running, and the command waiting for them. Here the ranks are seen running first."""
    import threading
    import time

    out = tmp_path / "cluster.json"
    done: dict = {}

    def launch() -> None:
        done["r"] = run_cli("links", "--nproc-per-node", "2", "--memory", "1GiB", "--rounds",
                            "2", "--max-bytes", "4KiB", "--busy-ms", "4321", "--timeout", "15",
                            "-o", out)  # fmt: skip

    worker = threading.Thread(target=launch)
    worker.start()
    deadline = time.monotonic() + 15
    while len(_running("4321.0")) < 2 and time.monotonic() < deadline and worker.is_alive():
        time.sleep(0.2)
    seen = len(_running("4321.0"))
    worker.join()
    r = done["r"]
    if seen < 2:  # torch took longer than the timeout to start them: nothing was tested
        pytest.skip(f"the ranks did not start within 15 s here ({r.err.strip()})")
    assert r.code == 2 and "ran past 15 s and was stopped" in r.err, r.err
    assert not out.exists()
    deadline = time.monotonic() + 10  # SIGKILLed, perhaps not yet gone
    while _running("4321.0") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running("4321.0") == []


TORCHRUN_FAILURE = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/re/boom.py", line 4, in <module>
[rank1]:     raise RuntimeError("rank one broke")
[rank1]: RuntimeError: rank one broke
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/re/boom.py", line 5, in <module>
[rank0]:     dist.barrier()
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer
W1201 15:22:53.980000 27068 torch/distributed/elastic/multiprocessing/api.py:1028] Sending \
process 27072 closing signal SIGTERM
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 27072)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 27073)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failing_rank_is_reported_by_its_own_error():
    """torchrun's output as torch 2.13 writes it when rank 1 raises and rank 0 then loses its
    peer: the root cause's own line, not rank 0's knock-on error nor torchrun's summary."""
    from codegen.measure import rank_error

    assert rank_error(TORCHRUN_FAILURE) == "RuntimeError: rank one broke"
    # the root cause killed by a signal (out of memory, say) printed nothing of its own
    killed = TORCHRUN_FAILURE.replace("[rank1]: RuntimeError: rank one broke\n", "").replace(
        "exitcode  : 1 (pid: 27073)", "exitcode  : -9 (pid: 27073)"
    )
    assert rank_error(killed) == "rank 1 ended with exit code -9"
    # no root cause named: the first rank to report an error
    first = TORCHRUN_FAILURE.split("Root Cause")[0]
    assert rank_error(first) == "RuntimeError: rank one broke"
    # the root cause a rank our watchdog ended (it exited first): the rank it names, whose own
    # error line is there, or else what the watchdog said of it
    halted = (
        TORCHRUN_FAILURE.replace("exitcode  : 1 (pid: 27073)", "exitcode  : 1 (pid: 27072)")
        .replace("rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)")
        .replace(
            "[rank0]: Traceback (most recent call last):\n",
            "gpipe-plan: rank 0 stopped: rank 1 failed: forward of stage 1, micro-batch 2 failed: "
            "RuntimeError: rank one broke\n",
        )
    )
    halted = "\n".join(line for line in halted.splitlines() if not line.startswith("[rank0]"))
    assert rank_error(halted) == "RuntimeError: rank one broke"
    alone = halted.replace("[rank1]: RuntimeError: rank one broke\n", "")
    assert rank_error(alone) == (
        "rank 1 failed: forward of stage 1, micro-batch 2 failed: RuntimeError: rank one broke"
    )
    assert rank_error("[1]:ValueError: bad\n") == "ValueError: bad"
    assert rank_error("Exception ignored in: <function f>\nExit code 3\n") == ""
    assert rank_error("nothing to see\n") == ""
