"""The links between a job's ranks, measured as a pipeline uses them (issue #7).

A pipeline's hand-off is not an idle ping-pong: the receiver has sat blocked in its receive
while the sender computed, and the message must wake it. On a shared machine that wake-up costs
from nothing to milliseconds, which a ping-pong between two ranks that do nothing else never
sees. So each neighbouring pair (r, r + 1) is timed this way, in both directions: after a
barrier, the sender computes for `busy_ms` (matrix products) and sends; the receiver, blocked
since the barrier, stamps the message's arrival. The hand-off is arrival minus post (across
hosts the clocks differ, and the two directions' errors cancel: see measure_hand_offs). Per
size the mean is kept, not the median: a step pays every hand-off, slow ones
included. Each link is then fitted to latency + bytes / bandwidth, the model the planner
charges.

A pipeline also receives late: in the torchrun program's exchanges a rank posts a send and
a receive and waits for both, while its peer posts the matching receive later, after some
compute. gloo moves the bytes only once told that the receive is posted, and that notice
must wake the sender's side (over two busy vCPUs about three times a hand-off, on average).
So each link is also timed that way (measure_late_receives: the receiver's own clock, from
its receive's post to the arrival) and fitted apart: the link's late figures, which the
torchrun model charges a message whose receive is posted after its send.

And every step of the torchrun program begins and ends with a small all-reduce among all
ranks (the batch's signature; the loss), which the pipeline's own schedule does not hold:
measure_step_syncs times the pair, the cluster's `step_sync_ms`.

    gpipe-plan links --nproc-per-node 2 --memory 16GiB -o cluster.json          # one host
    torchrun --nnodes N ... -m profiler.links --memory 16GiB -o cluster.json   # many hosts
"""

from __future__ import annotations

import argparse
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
    """(latency ms, bandwidth bytes/s) fitted to ms = latency + bytes / bandwidth, each point
    weighed by its relative error (1 KiB and 4 MiB count alike, so the latency is not a
    leftover of the largest messages). A negative intercept is fitted through zero instead;
    a flat or falling line (latency alone) gets the largest bandwidth a cluster may state."""
    if len(sizes) != len(ms) or not sizes:
        raise ValueError("one time per size, at least one")
    w = [1 / max(y, 1e-9) ** 2 for y in ms]
    sw = sum(w)
    swx = sum(a * x for a, x in zip(w, sizes))
    swy = sum(a * y for a, y in zip(w, ms))
    swxx = sum(a * x * x for a, x in zip(w, sizes))
    swxy = sum(a * x * y for a, x, y in zip(w, sizes, ms))
    det = sw * swxx - swx * swx
    slope = (sw * swxy - swx * swy) / det if det > 0 else 0.0
    latency = (swy - slope * swx) / sw
    if latency < 0:  # through the origin
        latency, slope = 0.0, swxy / swxx
    if slope <= 0:
        return min(max(swy / sw, 0.0), MAX_MS), MAX_BANDWIDTH
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


def measure_hand_offs(
    *, rounds: int = 20, busy_ms: float = 1.0, sizes: Sequence[int] = SIZES, warmup: int = 2
) -> tuple[list[str], list[dict[int, float]]]:
    """Run on every rank of an initialised process group (each on its own device: the CPU, or
    on NCCL the current GPU). Returns the ranks' hosts and, per link r -> r + 1, the mean
    hand-off in ms per message size, both directions together. Every rank gets the result.

    The directions take turns, hand-off by hand-off, and each one-way time is the receiver's
    stamp less the sender's. Across hosts the two stamps come from different clocks, but
    what one direction gains from their offset the other loses: the mean of the pairs is the
    hand-off itself, however far apart the clocks are (and however they drift, but for the
    little they drift between two turns)."""
    import torch
    import torch.distributed as dist

    rank, world, device = _placed()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=_cpu_group())
    bufs, rows = _turns(world, sizes, rounds + warmup, device)
    stamps = torch.zeros(2, len(rows), dtype=torch.float64)  # the post, then the arrival
    for j, (a, b, n, k) in enumerate(rows):
        src, dst = (a, b) if k % 2 == 0 else (b, a)
        dist.barrier()
        if rank == src:
            _busy(busy_ms, device)
            stamps[0, j] = _stamp(device)
            dist.send(bufs[n], dst)
        elif rank == dst:
            dist.recv(bufs[n], src)
            stamps[1, j] = _stamp(device)
    stamps = stamps.to(device)
    dist.all_reduce(stamps)  # each entry was written on one rank only
    post, arrive = stamps.cpu().tolist()
    got: list[dict[int, list[float]]] = [{n: [] for n in sizes} for _ in range(world - 1)]
    for j, (a, _, n, k) in enumerate(rows):
        if k >= 2 * warmup:
            got[a][n].append((arrive[j] - post[j]) * 1e3)
    return hosts, [{n: statistics.fmean(v) for n, v in link.items()} for link in got]


def measure_late_receives(
    *, rounds: int = 20, busy_ms: float = 1.0, sizes: Sequence[int] = SIZES, warmup: int = 2
) -> list[dict[int, float]]:
    """Run on every rank, as measure_hand_offs. Per link r -> r + 1, the mean time in ms from a
    late receive's post to its message's arrival, per size, both directions together: the
    sender computes `busy_ms`, posts its send, waits for it and computes `busy_ms` more; the
    receiver computes 1.5 x `busy_ms` before it posts. Each time is read on the receiver's
    clock alone. Every rank gets the result."""
    import torch
    import torch.distributed as dist

    rank, world, device = _placed()
    bufs, rows = _turns(world, sizes, rounds + warmup, device)
    took = torch.zeros(len(rows), dtype=torch.float64)
    for j, (a, b, n, k) in enumerate(rows):
        src, dst = (a, b) if k % 2 == 0 else (b, a)
        dist.barrier()
        if rank == src:
            _busy(busy_ms, device)
            dist.isend(bufs[n], dst).wait()
            _busy(busy_ms, device)
        elif rank == dst:
            _busy(1.5 * busy_ms, device)
            posted = _stamp(device)
            dist.recv(bufs[n], src)
            took[j] = (_stamp(device) - posted) * 1e3
    took = took.to(device)
    dist.all_reduce(took)  # each entry was written on one rank only
    got: list[dict[int, list[float]]] = [{n: [] for n in sizes} for _ in range(world - 1)]
    for j, ms in enumerate(took.cpu().tolist()):
        a, _, n, k = rows[j]
        if k >= 2 * warmup:
            got[a][n].append(ms)
    return [{n: statistics.fmean(v) for n, v in link.items()} for link in got]


def measure_step_syncs(*, rounds: int = 20, busy_ms: float = 1.0, warmup: int = 2) -> float:
    """Run on every rank, as measure_hand_offs. The median ms a step spends in the torchrun
    program's two small all-reduces: one as the step begins (16 int64, the batch's
    signature) and one as it ends (the loss), with compute between them that ends later on
    rank 0 (as a pipeline's last backward does) than on the others. Per round, the longest
    rank's wall less the longest compute. Every rank gets the result."""
    import torch
    import torch.distributed as dist

    rank, world, device = _placed()
    signature = torch.zeros(16, dtype=torch.int64, device=device)
    loss = torch.zeros((), device=device)
    took = torch.zeros(2, world, warmup + rounds, dtype=torch.float64)  # wall, then compute
    for j in range(warmup + rounds):
        dist.barrier()
        t0 = _stamp(device)
        dist.all_reduce(signature)
        signature.tolist()  # (the program reads it)
        t1 = _stamp(device)
        _busy(busy_ms * (1.5 if rank == 0 else 1.0), device)
        t2 = _stamp(device)
        dist.all_reduce(loss)
        took[0, rank, j] = (_stamp(device) - t0) * 1e3
        took[1, rank, j] = (t2 - t1) * 1e3
    took = took.to(device)
    dist.all_reduce(took)  # each entry was written on one rank only
    wall, busy = took.cpu().amax(dim=1).tolist()
    return statistics.median(w - b for w, b in zip(wall[warmup:], busy[warmup:]))


def _placed() -> tuple[int, int, Any]:
    """This rank, the world's size and the device it measures on (its GPU on NCCL)."""
    import torch
    import torch.distributed as dist

    cuda = _on_cuda()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _turns(world: int, sizes: Sequence[int], count: int, device: Any) -> tuple[dict, list]:
    """A buffer per message size, and the turns of a measurement: (r, r + 1, size, k) per link,
    size and turn, `count` each way (the directions alternate with k)."""
    import torch

    bufs = {n: torch.zeros(max(n // 4, 1), device=device) for n in sizes}
    rows = [(r, r + 1, n, k) for r in range(world - 1) for n in sizes for k in range(2 * count)]
    return bufs, rows


def _on_cuda() -> bool:
    """Whether the process group moves CUDA tensors (NCCL): then each rank uses its GPU."""
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower()


def build_cluster(
    hosts: list[str],
    means: list[dict[int, float]],
    memory: list[int],
    devices: list[str],
    late: list[dict[int, float]] | None = None,
    step_sync_ms: float | None = None,
) -> Any:
    """The cluster file for the measured ranks, in rank order: one link per neighbouring pair,
    fitted to its hand-offs (and its late receives, `late`: never cheaper than a hand-off);
    `host` named where the ranks span several; `step_sync_ms` as measure_step_syncs found."""
    from planner.cluster import Cluster, Device, Link

    several = len(set(hosts)) > 1
    links = []
    for k, m in enumerate(means):
        latency, bandwidth = fit_link(list(m), list(m.values()))
        link = Link(bandwidth_bytes_per_s=bandwidth, latency_ms=latency)
        if late is not None:  # each size no cheaper than its hand-off (noise), then fitted
            floor = {n: max(t, m.get(n, t)) for n, t in late[k].items()}
            lat, bw = fit_link(list(floor), list(floor.values()))
            lat, bw = max(lat, latency), min(bw, bandwidth)
            if (lat, bw) != (latency, bandwidth):
                link = Link(
                    bandwidth_bytes_per_s=bandwidth,
                    latency_ms=latency,
                    late_latency_ms=lat,
                    late_bandwidth_bytes_per_s=bw if bw != bandwidth else None,
                )
        links.append(link)
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
        step_sync_ms=None if step_sync_ms is None else min(max(step_sync_ms, 0.0), MAX_MS),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Each rank of a torchrun launch: measure, and rank 0 writes the cluster file. A problem
    on any rank (a bad flag, no GPU of its own) stops every rank, rank 0 saying why."""
    ap = argparse.ArgumentParser(prog="python -m profiler.links")
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    help="cpu (gloo) or cuda (NCCL, a GPU per rank); default: cuda if present")  # fmt: skip
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

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    problem = ""
    if cuda and local >= torch.cuda.device_count():
        problem = (
            f"rank {os.environ.get('RANK', '?')} has no GPU of its own ({local} of "
            f"{torch.cuda.device_count()}): launch at most one rank per GPU, or --device cpu"
        )
    elif cuda:
        torch.cuda.set_device(local)
    # the ranks agree over gloo first, so that one without a GPU cannot hang NCCL's start
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        memory = 0
        try:
            if problem:
                pass
            elif world < 2:
                problem = "one rank has no link to measure: launch two or more"
            elif args.rounds < 1 or not 0 <= args.busy_ms <= 1e4 or args.max_bytes < 1:
                problem = "--rounds and --max-bytes must be at least 1, --busy-ms 0 to 10000"
            else:
                if rank == 0:
                    check_output(args.output)
                if args.memory is not None:
                    memory = parse_size(args.memory, what="memory")
                elif cuda:
                    memory = torch.cuda.get_device_properties(local).total_memory
                else:
                    problem = "--memory is required on the CPU (what a stage may use)"
        except Exception as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
        said: list[Any] = [None] * world
        dist.all_gather_object(said, problem, group=_cpu_group())
        if any(said):
            if rank == 0:
                print(f"links: error: {next(p for p in said if p)}", file=sys.stderr)
            return 2
        sizes = [n for n in SIZES if n <= args.max_bytes] or [SIZES[0]]
        hosts, means = measure_hand_offs(rounds=args.rounds, busy_ms=args.busy_ms, sizes=sizes)
        late = measure_late_receives(rounds=args.rounds, busy_ms=args.busy_ms, sizes=sizes)
        sync = measure_step_syncs(rounds=args.rounds, busy_ms=args.busy_ms)
        mems: list[Any] = [None] * world
        names: list[Any] = [None] * world
        dist.all_gather_object(mems, memory, group=_cpu_group())
        dist.all_gather_object(names, f"cuda:{local}" if cuda else "", group=_cpu_group())
        if rank == 0:
            cluster = build_cluster(hosts, means, mems, names, late, sync)
            write_output(args.output, cluster.model_dump_json(indent=1, exclude_none=True) + "\n")
            for r, (m, link) in enumerate(zip(means, cluster.links)):
                shown = ", ".join(f"{n // 1024} KiB {ms:.3f}" for n, ms in m.items())
                print(
                    f"rank{r} -> rank{r + 1}: latency {link.latency_ms:.3f} ms, bandwidth "
                    f"{_speed(link.bandwidth_bytes_per_s)} (mean hand-off ms: {shown})"
                )
                shown = ", ".join(f"{n // 1024} KiB {ms:.3f}" for n, ms in late[r].items())
                lat = link.late_latency_ms if link.has_late else link.latency_ms
                bw = link.late_bandwidth_bytes_per_s if link.has_late else None
                print(
                    f"  received late: latency {lat:.3f} ms, bandwidth "
                    f"{_speed(bw or link.bandwidth_bytes_per_s)} (mean ms: {shown})"
                )
            print(f"a step's two all-reduces (its start and end): {sync:.3f} ms (median)")
        return 0
    finally:
        dist.destroy_process_group()
        _GROUP.clear()


def _speed(bandwidth: float | None) -> str:
    bw = bandwidth or MAX_BANDWIDTH
    return "too fast to tell" if bw >= MAX_BANDWIDTH else f"{bw / 1e9:.2f} GB/s"


_GROUP: list[Any] = []


def _cpu_group() -> Any:
    """A gloo group of every rank, for the objects the ranks tell each other (made once)."""
    import torch.distributed as dist

    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


if __name__ == "__main__":
    sys.exit(main())
