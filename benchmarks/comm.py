"""Collective latency and bandwidth over gloo on local ranks: ``all_to_all_single`` (even
splits, what EP dispatch/combine move) and ``all_reduce`` (what TP layers move).

Each size is the bytes one rank sends (fp32), 4 KiB to 16 MiB, plus the row-count exchange
that opens every EP dispatch (one int64 per rank). Every iteration starts after a barrier;
its time is the slowest rank's. Prints best and median of N and the median's bandwidth
(bytes per rank / time), and writes the table as JSON.

    python benchmarks/comm.py [--ranks 2 4] [--iters 30] [--out bench_out/comm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.distributed.mp import run_ranks  # noqa: E402

SIZES = [4096 * 4**i for i in range(7)]  # 4 KiB .. 16 MiB


def _ops(group, ws: int, nbytes: int):
    n = max(ws, nbytes // 4 // ws * ws)
    x, out = torch.randn(n), torch.empty(n)
    return {
        "all_to_all_single": lambda: dist.all_to_all_single(out, x, group=group),
        "all_reduce": lambda: dist.all_reduce(x, group=group),
    }


def worker(rank: int, ws: int, iters: int) -> dict:
    """Per (op, bytes): this rank's time of every iteration."""
    group = dist.new_group(list(range(ws)))
    cases = []
    counts_in, counts_out = torch.ones(ws, dtype=torch.int64), torch.empty(ws, dtype=torch.int64)

    def counts():
        dist.all_to_all_single(counts_out, counts_in, group=group)

    cases.append(("all_to_all_single (counts)", 8 * ws, counts))
    for nbytes in SIZES:
        cases += [(name, nbytes, fn) for name, fn in _ops(group, ws, nbytes).items()]
    times = {}
    for name, nbytes, fn in cases:
        n = iters if nbytes <= (1 << 20) else max(5, iters // 3)
        for _ in range(3):
            fn()
        ts = []
        for _ in range(n):
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        times[name, nbytes] = ts
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "comm.json"))
    args = ap.parse_args()

    rows = []
    print(f"gloo over 127.0.0.1, 1 thread per rank, {os.cpu_count()} cores visible")
    head = f"{'op':<28}{'ranks':>6}{'bytes':>10}{'best us':>10}{'median us':>11}{'MB/s':>9}"
    print(head)
    for ws in args.ranks:
        per_rank = run_ranks(worker, ws, args.iters, timeout=600)
        for key in per_rank[0]:
            slowest = [max(ts) for ts in zip(*(r[key] for r in per_rank))]
            best, med = min(slowest), statistics.median(slowest)
            row = dict(
                op=key[0],
                ranks=ws,
                bytes=key[1],
                iters=len(slowest),
                best_us=best * 1e6,
                median_us=med * 1e6,
                mb_per_s=key[1] / med / 1e6,
            )
            rows.append(row)
            print(
                f"{row['op']:<28}{ws:>6}{key[1]:>10}{row['best_us']:>10.0f}"
                f"{row['median_us']:>11.0f}{row['mb_per_s']:>9.0f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        torch=torch.__version__,
        machine=platform.machine(),
        threads_per_rank=1,
        command=" ".join(sys.argv),
        loadavg_at_end=os.getloadavg(),
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
