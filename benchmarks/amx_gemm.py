"""The AMX kernels (``ops/cpu/bf16_amx.c``: bf16, ``ops/cpu/int8_amx.c``: w8a8 int8,
``ops/cpu/int4_amx.c``: w4a8 int4) against the other ways to run the same product.

Projection ``x [M, K] @ w.T`` with ``w [N, K]`` at token rows M from decode to prefill:

    amx f32-x   the bf16 kernel with fp32 rows and bf16 weights (--quantization bf16)
    amx bf16-x  the bf16 kernel with bf16 rows (--dtype bfloat16)
    onednn      F.linear in bf16 (oneDNN's AMX GEMM, which packs the weight per call)
    amx w8a8    the int8 kernel: int8 weights, rows quantized per token (w8a8_int8)
    w4a8        w4a8_int8's call (ops/cpu/int4_amx.py): int4 weights (groups of 128), rows
                quantized per token; from 16 rows unpacked to int8 tiles (int4_amx.c),
                fewer on int4's integer dots (VNNI)
    int8        the weight-only int8 kernel, fp32 rows (--quantization int8, int8.c)
    int4        the weight-only int4 kernel, fp32 rows (int4.c: what --quantization int4
                runs without AMX, and on AMX below int4_amx.ROWS16_MIN rows)
    int4 tiles  int4 on the int8 tiles in its own numerics (int4_amx.c with rows16: each
                row in 16-bit fixed point on two byte planes), what --quantization int4 runs
                on AMX from int4_amx.ROWS16_MIN rows
    fp32        ops/linear.linear on the fp32 weight (moeserve's fp32 kernel or MKL)

and the routed-expert call of one MoE layer (benchmark model shapes, 64 experts, top 6) at
1 to 2048 tokens, the same formats' calls against the fp32 call on fp32 weights. The
variants of each row run interleaved, median of ``--rounds`` (the host is noisy); prints
GFLOP/s and the weight stream in GB/s, writes JSON. Without AMX-INT8 the w8a8 and w4a8
variants are left out.

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

from moeserve.ops.cpu import bf16_amx, int4_amx, int8_amx
from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu import int4 as int4_kernels
from moeserve.ops.cpu import int8 as int8_kernels
from moeserve.ops.linear import linear
from moeserve.quant.int4 import Int4Tensor, quantize_groups
from moeserve.quant.int8 import Int8Tensor, quantize_rows

PROJECTIONS = (
    "amx f32-x", "amx bf16-x", "onednn", "amx w8a8", "w4a8", "int8", "int4", "int4 tiles", "fp32"
)  # fmt: skip
MOE = ("amx bf16", "amx w8a8", "w4a8", "int8", "int4", "int4 tiles", "fp32")
INT8_TILES = ("amx w8a8", "w4a8", "int4 tiles")  # left out without AMX-INT8

# bytes per weight element (int4: codes, and an fp32 scale and a zero byte per 128); else bf16's
INT4_BYTES = 0.5 + 5 / 128
WEIGHT_BYTES = {"fp32": 4, "int8": 1, "amx w8a8": 1, "int4": INT4_BYTES, "w4a8": INT4_BYTES}
WEIGHT_BYTES["int4 tiles"] = INT4_BYTES


def weight_bytes(variant: str) -> float:
    return WEIGHT_BYTES.get(variant, 2)


def int4_weight(w: torch.Tensor) -> Int4Tensor:
    return Int4Tensor(*quantize_groups(w, 128))


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
    w8 = Int8Tensor(*quantize_rows(w32))
    w4 = int4_weight(w32)
    rows = []
    for M in args.rows:
        x32 = torch.randn(M, K)
        x16 = x32.bfloat16()
        out32 = torch.empty(M, N)
        variants = {
            "amx f32-x": lambda x32=x32, out32=out32: bf16_amx.gemm_nt(x32, w16, out=out32),
            "amx bf16-x": lambda x16=x16: bf16_amx.gemm_nt(x16, w16),
            "onednn": lambda x16=x16: F.linear(x16, w16),
            "amx w8a8": lambda x32=x32, out32=out32: int8_amx.gemm_nt(x32, w8, out=out32),
            "w4a8": lambda x32=x32, out32=out32: int4_amx.gemm_nt(x32, w4, out=out32),
            "int8": lambda x32=x32, out32=out32: int8_kernels.gemm_nt(x32, w8, out=out32),
            "int4": lambda x32=x32, out32=out32: int4_kernels.gemm_nt(x32, w4, out=out32),
            "int4 tiles": lambda x32=x32, out32=out32: int4_amx.gemm_nt(
                x32, w4, out=out32, rows16=True
            ),
            "fp32": lambda x32=x32: linear(x32, w32),
        }
        for name in INT8_TILES if not int8_amx.available() else ():
            del variants[name]
        reps = max(2, min(200, int(2e9 / (2 * M * N * K + 4e7))))
        t = median_times(variants, args.rounds, reps)
        flops = 2 * M * N * K
        for name, s in t.items():
            wbytes = int(N * K * weight_bytes(name))
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
    w13_8, w2_8 = Int8Tensor(*quantize_rows(w13)), Int8Tensor(*quantize_rows(w2))
    w13_4, w2_4 = int4_weight(w13), int4_weight(w2)
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
        args8 = (x, experts, counts, w13_8, w2_8, w)
        args4 = (x, experts, counts, w13_4, w2_4, w)
        variants = {
            "amx bf16": lambda a=args16: bf16_amx.moe_experts(*a),
            "amx w8a8": lambda a=args8: int8_amx.moe_experts(*a),
            "w4a8": lambda a=args4: int4_amx.moe_experts(*a),
            "int8": lambda a=args8: int8_kernels.moe_experts(*a),
            "int4": lambda a=args4: int4_kernels.moe_experts(*a),
            "int4 tiles": lambda a=args4: int4_amx.moe_experts(*a, rows16=True),
            "fp32": lambda a=args32: fp32_kernels.moe_experts(*a),
        }
        for name in INT8_TILES if not int8_amx.available() else ():
            del variants[name]
        reps = 20 if T <= 64 else 3
        t = median_times(variants, args.rounds, reps)
        flops = 2 * R * 3 * D * F_
        for name, s in t.items():
            wbytes = int(len(experts) * 3 * D * F_ * weight_bytes(name))
            rows.append(
                dict(kind="moe", tokens=T, variant=name, seconds=s, gflops=flops / s / 1e9,
                     weight_gbs=wbytes / s / 1e9)
            )  # fmt: skip
    return rows


def table(rows: list[dict], key: str, values: list[int], variants: tuple[str, ...]) -> None:
    """One line per ``key`` value: GFLOP/s and weight GB/s of each variant (and its speed-up
    over fp32 for the MoE call)."""
    names = [v for v in variants if any(r["variant"] == v for r in rows)]
    print(f"{key:>6}" + "".join(f"{v:>26}" for v in names))
    for val in values:
        cells = {r["variant"]: r for r in rows if r[key] == val}
        fp32 = cells["fp32"]["seconds"]
        print(
            f"{val:>6}"
            + "".join(
                f"{cells[v]['gflops']:>7.0f} GF {cells[v]['weight_gbs']:>5.1f} GB/s "
                f"{fp32 / cells[v]['seconds']:>4.1f}x"
                for v in names
            )
        )


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
    if not bf16_amx.available():
        raise SystemExit("no AMX on this CPU (or the kernel refused the tile state)")
    rows = projections(args)
    print(f"projection N={args.n} K={args.k}, {args.threads} threads, median of {args.rounds}")
    table(rows, "M", args.rows, PROJECTIONS)
    moe = moe_calls(args)
    print("\nMoE call (64 experts, top 6, D 1024, F 512); x: fp32 seconds / the variant's")
    table(moe, "tokens", args.tokens, MOE)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(rows=rows + moe, torch=torch.__version__), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
