"""The bf16 AMX kernels (``ops/cpu/amx.c``) against the other ways to run the same product.

Projection ``x [M, K] @ w.T`` with ``w [N, K]`` at token rows M from decode to prefill:

    amx f32-x   the kernel with fp32 rows and bf16 weights (--quantization bf16)
    amx bf16-x  the kernel with bf16 rows (--dtype bfloat16)
    onednn      F.linear in bf16 (oneDNN's AMX GEMM, which packs the weight per call)
    fp32        ops/linear.linear on the fp32 weight (moeserve's fp32 kernel or MKL)

and the routed-expert call of one MoE layer (benchmark model shapes, 64 experts, top 6) at
1 to 2048 tokens: the AMX call on bf16 weights against the fp32 call on fp32 weights. The
variants of each row run interleaved, median of ``--rounds`` (the host is noisy); prints
GFLOP/s and the weight stream in GB/s, writes JSON.

    python benchmarks/amx_gemm.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import amx, kernels
from moeserve.ops.linear import linear


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def median_times(variants: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each variant, the variants interleaved round by round."""
    got: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            got[name].append(timed(fn, reps))
    return {k: statistics.median(v) for k, v in got.items()}


def projections(args) -> list[dict]:
    N, K = args.n, args.k
    w32 = torch.randn(N, K)
    w16 = w32.bfloat16()
    rows = []
    for M in args.rows:
        x32 = torch.randn(M, K)
        x16 = x32.bfloat16()
        out32 = torch.empty(M, N)
        variants = {
            "amx f32-x": lambda x32=x32, out32=out32: amx.gemm_nt(x32, w16, out=out32),
            "amx bf16-x": lambda x16=x16: amx.gemm_nt(x16, w16),
            "onednn": lambda x16=x16: F.linear(x16, w16),
            "fp32": lambda x32=x32: linear(x32, w32),
        }
        reps = max(2, min(200, int(2e9 / (2 * M * N * K + 4e7))))
        t = median_times(variants, args.rounds, reps)
        flops = 2 * M * N * K
        for name, s in t.items():
            wbytes = N * K * (4 if name == "fp32" else 2)
            rows.append(
                dict(kind="projection", M=M, N=N, K=K, variant=name, seconds=s,
                     gflops=flops / s / 1e9, weight_gbs=wbytes / s / 1e9)
            )  # fmt: skip
    return rows


def moe_calls(args) -> list[dict]:
    E, top_k, D, F_ = 64, 6, 1024, 512
    w13 = torch.randn(E, 2 * F_, D) / D**0.5
    w2 = torch.randn(E, D, F_) / F_**0.5
    w13_16, w2_16 = w13.bfloat16(), w2.bfloat16()
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in args.tokens:
        ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
        counts_E = torch.bincount(ids.reshape(-1), minlength=E).tolist()
        experts = [e for e in range(E) if counts_E[e]]
        counts = [counts_E[e] for e in experts]
        R = sum(counts)
        x = torch.randn(R, D)
        w = torch.rand(R)
        args16 = (x, experts, counts, w13_16, w2_16, w)
        args32 = (x, experts, counts, w13, w2, w)
        variants = {
            "amx": lambda a=args16: amx.moe_experts(*a),
            "fp32": lambda a=args32: kernels.moe_experts(*a),
        }
        reps = 20 if T <= 64 else 3
        t = median_times(variants, args.rounds, reps)
        flops = 2 * R * 3 * D * F_
        for name, s in t.items():
            wbytes = len(experts) * 3 * D * F_ * (2 if name == "amx" else 4)
            rows.append(
                dict(kind="moe", tokens=T, variant=name, seconds=s, gflops=flops / s / 1e9,
                     weight_gbs=wbytes / s / 1e9)
            )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,48,128,512,2048")
    ap.add_argument("--tokens", default="1,8,32,512,2048", help="MoE call: tokens routed")
    ap.add_argument("--n", type=int, default=2816)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--out", default="bench_out/amx_gemm.json")
    args = ap.parse_args()
    args.rows = [int(v) for v in args.rows.split(",")]
    args.tokens = [int(v) for v in args.tokens.split(",")]
    torch.set_num_threads(args.threads)
    if not amx.available():
        raise SystemExit("no AMX on this CPU (or the kernel refused the tile state)")
    rows = projections(args)
    print(f"projection N={args.n} K={args.k}, {args.threads} threads, median of {args.rounds}")
    print(f"{'M':>6}" + "".join(f"{v:>22}" for v in ("amx f32-x", "amx bf16-x", "onednn", "fp32")))
    for M in args.rows:
        cells = [r for r in rows if r["M"] == M]
        print(
            f"{M:>6}"
            + "".join(f"{r['gflops']:>9.0f} GF {r['weight_gbs']:>5.1f} GB/s" for r in cells)
        )
    moe = moe_calls(args)
    print("\nMoE call (64 experts, top 6, D 1024, F 512): amx (bf16 weights) against fp32")
    print(f"{'tokens':>6}{'amx':>22}{'fp32':>22}{'ratio':>8}")
    for T in args.tokens:
        a, f = (r for r in moe if r["tokens"] == T)
        cells = "".join(f"{r['gflops']:>9.0f} GF {r['weight_gbs']:>5.1f} GB/s" for r in (a, f))
        print(f"{T:>6}{cells}{f['seconds'] / a['seconds']:>7.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(rows=rows + moe, torch=torch.__version__), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
