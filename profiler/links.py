"""The links between a job's ranks, measured as a pipeline uses them (issue #7).

A pipeline's hand-off is not an idle ping-pong: the receiver has sat blocked in its receive
while the sender computed, and the message must wake it. On a shared machine that wake-up costs
from nothing to milliseconds, which a ping-pong between two ranks that do nothing else never
sees. So each neighbouring pair (r, r + 1) is timed this way, in both directions: after a
barrier, the sender computes for `busy_ms` (matrix products) and sends; the receiver, blocked
since the barrier, stamps the message's arrival. The hand-off is arrival minus post on the
host's clock (across hosts, corrected by the clock offset the fastest of a few ping-pongs
gives). Per size the mean is kept, not the median: a step pays every hand-off, slow ones
included. Each link is then fitted to latency + bytes / bandwidth, the model the planner
charges.

    gpipe-plan links --nproc-per-node 2 --memory 16GiB -o cluster.json          # one host
    torchrun --nnodes N ... -m profiler.links --memory 16GiB -o cluster.json   # many hosts
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from .limits import MAX_BANDWIDTH, MAX_MS, MIN_BANDWIDTH

SIZES = tuple(1024 * 4**k for k in range(7))  # 1 KiB .. 4 MiB per message


def fit_link(sizes: Sequence[float], ms: Sequence[float]) -> tuple[float, float]:
    """(latency ms, bandwidth bytes/s) by least squares of ms = latency + bytes / bandwidth.
    A negative intercept is fitted through zero instead; a flat or falling line (latency
    alone) gets the largest bandwidth a cluster may state."""
    if len(sizes) != len(ms) or not sizes:
        raise ValueError("one time per size, at least one")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(ms) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, ms)) / sxx if sxx else 0.0
    latency = my - slope * mx
    if latency < 0:  # through the origin
        latency = 0.0
        slope = sum(x * y for x, y in zip(sizes, ms)) / sum(x * x for x in sizes)
    if slope <= 0:
        return min(max(my, 0.0), MAX_MS), MAX_BANDWIDTH
    return min(latency, MAX_MS), min(max(1e3 / slope, MIN_BANDWIDTH), MAX_BANDWIDTH)


def _busy(ms: float, device: Any) -> None:
    """Compute for about `ms`: what a stage does before it hands its output on."""
    import torch

    w = torch.randn(128, 128, device=device) / 12
    x = torch.randn(64, 128, device=device)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x = torch.tanh(x @ w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _stamp(device: Any) -> float:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


def _offsets(hosts: list[str], device: Any, tries: int = 15) -> list[float]:
    """Per rank, its clock minus rank 0's: 0 on rank 0's host (one clock), else from the
    ping-pong with rank 0 that took least time (its midpoint against the remote stamp)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(world, dtype=torch.float64, device=device)
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    for r in range(1, world):
        if hosts[r] == hosts[0]:
            continue
        best = (math.inf, 0.0)
        for _ in range(tries):
            if rank == 0:
                t0 = _stamp(device)
                dist.send(buf, r)
                dist.recv(buf, r)
                t3 = _stamp(device)
                remote = float(buf.item())
                best = min(best, (t3 - t0, remote - (t0 + t3) / 2))
            elif rank == r:
                dist.recv(buf, 0)
                buf.fill_(_stamp(device))
                dist.send(buf, 0)
        if rank == 0:
            out[r] = best[1]
    dist.broadcast(out, 0)
    return out.tolist()


def measure_hand_offs(
    *, rounds: int = 20, busy_ms: float = 1.0, sizes: Sequence[int] = SIZES, warmup: int = 2
) -> tuple[list[str], list[dict[int, float]]]:
    """Run on every rank of an initialised process group (each on its own device: the CPU, or
    on CUDA the current GPU). Returns the ranks' hosts and, per link r -> r + 1, the mean
    hand-off in ms per message size, both directions together. Every rank gets the result."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if _on_cuda() else torch.device("cpu")
    )
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    offset = _offsets(hosts, device)
    rows = [
        (src, dst, n, i)
        for r in range(world - 1)
        for src, dst in ((r, r + 1), (r + 1, r))
        for n in sizes
        for i in range(warmup + rounds)
    ]
    post = torch.zeros(len(rows), dtype=torch.float64)
    arrive = torch.zeros(len(rows), dtype=torch.float64)
    bufs = {n: torch.zeros(max(n // 4, 1), device=device) for n in sizes}
    for k, (src, dst, n, _) in enumerate(rows):
        dist.barrier()
        if rank == src:
            _busy(busy_ms, device)
            post[k] = _stamp(device) - offset[rank]
            dist.send(bufs[n], dst)
        elif rank == dst:
            dist.recv(bufs[n], src)
            arrive[k] = _stamp(device) - offset[rank]
    stamps = torch.stack([post, arrive]).to(device)
    dist.all_reduce(stamps)  # each entry was written on one rank only
    post, arrive = stamps.cpu()
    per_link: list[dict[int, list[float]]] = [{n: [] for n in sizes} for _ in range(world - 1)]
    for k, (src, dst, n, i) in enumerate(rows):
        if i >= warmup:
            per_link[min(src, dst)][n].append(max(float(arrive[k] - post[k]) * 1e3, 0.0))
    return hosts, [{n: statistics.fmean(v) for n, v in link.items()} for link in per_link]


def _on_cuda() -> bool:
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower()


def build_cluster(
    hosts: list[str], means: list[dict[int, float]], memory: list[int], devices: list[str]
) -> Any:
    """The cluster file for the measured ranks, in rank order: one link per neighbouring pair,
    fitted to its hand-offs; `host` named where the ranks span several."""
    from planner.cluster import Cluster, Device, Link

    several = len(set(hosts)) > 1
    links = []
    for m in means:
        latency, bandwidth = fit_link(list(m), list(m.values()))
        links.append(Link(bandwidth_bytes_per_s=bandwidth, latency_ms=latency))
    return Cluster(
        devices=[
            Device(
                name=f"rank{r}",
                memory_bytes=memory[r],
                torch_device=devices[r] or None,
                host=hosts[r] if several else None,
            )
            for r in range(len(hosts))
        ],
        links=links,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Each rank of a torchrun launch: measure, and rank 0 writes the cluster file."""
    ap = argparse.ArgumentParser(prog="python -m profiler.links")
    ap.add_argument("--memory", help="per device, e.g. 16GiB (on CUDA: the GPU's, by default)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--busy-ms", type=float, default=1.0)
    ap.add_argument("--max-bytes", type=int, default=SIZES[-1])
    ap.add_argument("-o", "--output", default="cluster.json")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    from planner.units import parse_size

    from .files import check_output, write_output

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        problem = ""
        try:
            if world < 2:
                raise ValueError("one rank has no link to measure: launch two or more")
            if rank == 0:
                check_output(args.output)
            sizes = [n for n in SIZES if n <= args.max_bytes] or [SIZES[0]]
            if args.memory is not None:
                memory = parse_size(args.memory, what="memory")
            elif _on_cuda():
                memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            else:
                raise ValueError("--memory is required on the CPU (what a stage may use)")
        except Exception as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
        failed = [None] * world
        dist.all_gather_object(failed, problem)
        if any(failed):
            if rank == 0:
                print(f"links: error: {next(p for p in failed if p)}", file=sys.stderr)
            return 2
        hosts, means = measure_hand_offs(rounds=args.rounds, busy_ms=args.busy_ms, sizes=sizes)
        mems: list[Any] = [None] * world
        names: list[Any] = [None] * world
        mine = f"cuda:{torch.cuda.current_device()}" if _on_cuda() else ""
        dist.all_gather_object(mems, memory)
        dist.all_gather_object(names, mine)
        if rank == 0:
            cluster = build_cluster(hosts, means, mems, names)
            write_output(args.output, cluster.model_dump_json(indent=1, exclude_none=True) + "\n")
            for r, (m, link) in enumerate(zip(means, cluster.links)):
                shown = ", ".join(f"{n // 1024} KiB {ms:.3f}" for n, ms in m.items())
                print(
                    f"rank{r} -> rank{r + 1}: latency {link.latency_ms:.3f} ms, bandwidth "
                    f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s (mean hand-off ms: {shown})"
                )
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
