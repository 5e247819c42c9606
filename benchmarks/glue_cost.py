"""What the code between two kernels of a decode step costs: warm, and right after a weight stream.

A decode step streams every weight it uses from memory, megabytes per layer, through the
caches; the Python, torch and ctypes code between two kernels then runs from cold caches.
This times a few such operations (median of N) in a loop alone ("warm") and right after an
int4 GEMM over 4.5 MB of weights that cycles through eight copies ("after a stream"), which
is why the decode stack (``models/decode_stack.py``) runs a step's kernels as call chains
(``ops/cpu/chain.py``) with no module call, torch op or allocation between them. Prints a
table, writes JSON.

    python benchmarks/glue_cost.py [--threads 2] [--reps 300] [--out bench_out/glue_cost.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moeserve.layers.norm import RMSNorm
from moeserve.layers.sampler import greedy_ids
from moeserve.ops.cpu import chain, fp32, int4
from moeserve.quant.int4 import Int4Tensor, quantize_groups


def cases() -> dict:
    """name -> a callable doing one operation of a decode step's glue."""
    norm, x = RMSNorm(1024), torch.randn(1, 1024)
    norm(x)
    k = norm.bound()
    args = (1, 1024, x.data_ptr(), 1024, k.ptr, 1e-6, x.data_ptr(), 1024)
    c = chain.CallChain()
    for _ in range(10):
        c.add(fp32._library().moeserve_rms_norm, args)
    ten = c.build()
    rows, identity, logits = torch.randn(7, 1024), torch.nn.Identity(), torch.randn(1, 32000)
    return {
        "nothing": lambda: None,
        "RMSNorm module (the kernel inside)": lambda: norm(x),
        "ctypes call, arguments ready": lambda: k.fn(*args),
        "10 calls in one chain": ten.run,
        "torch add [1, 1024]": lambda: x + x,
        "torch sum of 7 rows": lambda: rows.sum(dim=0, keepdim=True),
        "module that does nothing": lambda: identity(x),
        "torch.empty(1, 1024)": lambda: torch.empty(1, 1024),
        "torch argmax of 32000": lambda: logits.argmax(dim=-1),
        "the sampler's argmax of 32000 (NumPy)": lambda: greedy_ids(logits),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default="bench_out/glue_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    copies = [Int4Tensor(*quantize_groups(torch.randn(8192, 1024), 128)) for _ in range(8)]
    stream = [int4.bind_gemm(w, lambda x: None) for w in copies]
    xs, ys = torch.randn(1, 1024), torch.empty(1, 8192)
    turn = itertools.count()
    rows = []
    print("| operation | warm us | after a stream us |\n|---|---:|---:|")
    for name, fn in cases().items():
        out = {}
        for label, before in (("warm", None), ("cold", lambda: stream[next(turn) % 8](xs, ys))):
            times = []
            for _ in range(args.reps):
                if before is not None:
                    before()
                t0 = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - t0)
            out[label] = statistics.median(times) / 1e3
        rows.append(dict(operation=name, warm_us=out["warm"], cold_us=out["cold"]))
        print(f"| {name} | {out['warm']:.2f} | {out['cold']:.2f} |", flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = dict(machine=platform.processor() or platform.machine(), threads=args.threads)
    path.write_text(json.dumps({**record, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
