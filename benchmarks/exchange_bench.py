"""How long one exchange between two gloo ranks takes once both have posted it, idle and right
after each rank has computed (issue #7: where the torchrun step's unpredicted time goes).

Each rank posts one batch (batch_isend_irecv) with a send of `--kib` KiB to the other rank and a
receive of the same, and waits for it, `--rounds` times; in the second half each round first
runs about a millisecond of matrix products. Every rank stamps when it posted and when its batch
was done (time.perf_counter, one clock for the whole host); rank 0 then reports, per round, the
time from the later of the two posts to the later of the two completions: the exchange itself,
without the wait for a late peer.

    OMP_NUM_THREADS=1 python benchmarks/exchange_bench.py [--rounds 200] [--kib 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RANK = """
import json, sys, time, torch, torch.distributed as dist
rounds, n, out = int(sys.argv[1]), int(sys.argv[2]) * 256, sys.argv[3]
dist.init_process_group("gloo")
r = dist.get_rank()
a, b = torch.randn(n), torch.empty(n)
w = torch.randn(256, 256)
stamps = {}
for mode in ("idle", "after compute"):
    rows = []
    for i in range(rounds):
        if mode == "after compute":
            x = torch.randn(64, 256)
            for _ in range(20):
                x = x @ w
                x = x / x.norm()
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, a, 1 - r), dist.P2POp(dist.irecv, b, 1 - r)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        rows.append((t0, time.perf_counter()))
    stamps[mode] = rows
    dist.barrier()
gathered = [None, None]
dist.all_gather_object(gathered, stamps)
if r == 0:
    with open(out, "w") as f:
        json.dump(gathered, f)
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--kib", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "rank.py", Path(tmp) / "stamps.json"
        script.write_text(RANK)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             str(script), str(args.rounds), str(args.kib), str(out)],
            check=True, env=env, capture_output=True,
        )  # fmt: skip
        ranks = json.loads(out.read_text())
    skip = args.rounds // 10  # warm-up
    print(
        f"| rounds | exchange ms, median | mean | p90 | max | over 1 ms |  ({args.kib} KiB each way)"
    )
    print("|---|---|---|---|---|---|")
    for mode in ranks[0]:
        ms = sorted(
            (max(e0, e1) - max(s0, s1)) * 1e3
            for (s0, e0), (s1, e1) in list(zip(ranks[0][mode], ranks[1][mode]))[skip:]
        )
        over = sum(t > 1.0 for t in ms)
        print(f"| {mode} | {statistics.median(ms):.3f} | {statistics.fmean(ms):.3f} | "
              f"{ms[int(0.9 * len(ms))]:.3f} | {ms[-1]:.2f} | {over}/{len(ms)} |")  # fmt: skip


if __name__ == "__main__":
    main()
