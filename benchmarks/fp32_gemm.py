"""The fp32 few-row fp32_kernels, AVX2 against AVX-512F against MKL, by number of token rows.

For each weight shape of the benchmark model and each M it times ``fp32_kernels.gemm_nt`` on both
ISAs and ``F.linear`` (MKL), interleaved in rounds (the machine's memory bandwidth drifts, so
the variants of a case are compared within one stretch of time; best of each kept). Each call
reads another copy of the weight from a set of copies larger than the L3 cache, so the weight
streams from memory as in a decode step. Reports GFLOP/s (2 M N K per call) and GB/s (weight
bytes per call); M <= 8 is bound by the read bandwidth, M >= 16 by the FMA throughput.

    python benchmarks/fp32_gemm.py [--threads 2] [--rows 1 2 4 8 16 32 48 64 96 128]
                                   [--weights bf16]

``--weights bf16`` times the same calls on bf16 weights (the bf16 format's kernels where AMX
does not run: fp32.c's bodies widening each weight in registers, or on aarch64 with the BF16
extension BFMMLA/BFDOT on rows rounded to bf16), the reference then being ``F.linear`` on the
weight widened per call, as the format does for rows the kernels do not take.

It also times the per-head GEMMs of MLA's absorbed decode (``fp32_kernels.head_gemm_nt``) and the
one-call MoE kernel (``fp32_kernels.moe_experts``) on the benchmark model's layer: 64 routed
experts top-6 plus the folded shared-expert slot that takes every token (D 1024, F 512),
against the per-expert ``F.linear`` loop. Writes the tables' figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from int8_gemm import copies, cycling  # same cold-weight rotation as the int8 benchmark

from moeserve.ops.cpu import fp32 as fp32_kernels

SHAPES = [(1024, 1024), (1024, 512), (1536, 384), (5632, 1024), (32000, 1024)]
HEAD_SHAPES = [(16, 256, 64), (16, 64, 256)]  # (heads, N, K): q_nope @ W_UK, o_lat @ W_UV


def interleaved_ms(fns: dict, rounds: int = 4, budget_s: float = 0.06) -> dict[str, float]:
    """Best time (ms) of each function, timed in ``rounds`` interleaved turns."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm up (compiles the kernels on first use)
    for _ in range(rounds):
        for name, fn in fns.items():
            t_end = time.perf_counter() + budget_s
            while True:
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
                best[name] = min(best[name], t)
                if time.perf_counter() > t_end:
                    break
    return {name: t * 1e3 for name, t in best.items()}


def variants(isas: list[bool], kernel, reference) -> dict:
    fns = {fp32_kernels.isa_name(wide): (lambda wide=wide: kernel(wide)) for wide in isas}
    fns["MKL"] = reference
    return fns


def gemm_case(x: torch.Tensor, ws, isas: list[bool]) -> dict[str, float]:
    y = torch.empty(x.shape[0], ws().shape[0])
    return interleaved_ms(
        variants(
            isas,
            lambda wide: fp32_kernels.gemm_nt(x, ws(), y, wide),
            lambda: F.linear(x, ws().float()),  # .float(): bf16 widened per call, fp32 as is
        )
    )


def gemm_rows(
    N: int, K: int, rows: list[int], isas: list[bool], g: torch.Generator, dtype: torch.dtype
) -> list:
    ws = cycling(copies(torch.randn(N, K, generator=g).to(dtype)))
    return [
        dict(N=N, K=K, M=M, ms=gemm_case(torch.randn(M, K, generator=g), ws, isas)) for M in rows
    ]


def head_case(x: torch.Tensor, ws, isas: list[bool]) -> dict[str, float]:
    return interleaved_ms(
        variants(
            isas,
            lambda wide: fp32_kernels.head_gemm_nt(x, ws(), avx512=wide),
            lambda: torch.bmm(x, ws().float().transpose(1, 2)),
        )
    )


def head_rows(
    H: int, N: int, K: int, rows: list[int], isas: list[bool], g: torch.Generator, dtype
) -> list:
    ws = cycling(copies(torch.randn(H, N, K, generator=g).to(dtype)))
    return [
        dict(H=H, N=N, K=K, M=M, ms=head_case(torch.randn(H, M, K, generator=g), ws, isas))
        for M in rows
    ]


def moe_case(layer, route, x: torch.Tensor, weight: torch.Tensor, isas: list[bool]) -> dict:
    F_ = layer()[1].shape[2]

    def kernel(wide: bool) -> None:
        (w13, w2), (experts, counts) = layer(), route()
        fp32_kernels.moe_experts(x, experts, counts, w13, w2, weight, wide)

    def loop() -> None:  # layers/moe.py: experts_sorted's per-expert loop, on MKL
        (w13, w2), (experts, counts) = layer(), route()
        y, start = torch.empty_like(x), 0
        for e, n in zip(experts, counts):
            rows = slice(start, start + n)
            gate, up = F.linear(x[rows], w13[e].float()).split(F_, dim=-1)
            torch.mul(F.linear(F.silu(gate) * up, w2[e].float()), weight[rows, None], out=y[rows])
            start += n

    return interleaved_ms(variants(isas, kernel, loop))


def moe_rows(tokens: list[int], isas: list[bool], g: torch.Generator, dtype: torch.dtype) -> list:
    """One MoE layer of the benchmark model: 64 routed experts (top-6) and the shared expert
    in slot 64 (every token), D 1024, F 512; each call routes afresh and reads another copy
    of the layer's 409 MB of expert weights, so the experts come from memory."""
    E, D, F_, K = 64, 1024, 512, 6
    layers = [
        (
            torch.randn(E + 1, 2 * F_, D, generator=g).to(dtype),
            torch.randn(E + 1, D, F_, generator=g).to(dtype),
        )
        for _ in range(2)
    ]
    out = []
    for T in tokens:
        routes = []
        for _ in range(16):
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).flatten()
            counts_E = torch.bincount(ids, minlength=E).tolist() + [T]
            experts = [e for e in range(E + 1) if counts_E[e]]
            routes.append((experts, [counts_E[e] for e in experts]))
        R = T * (K + 1)
        x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
        ms = moe_case(cycling(layers), cycling(routes), x, weight, isas)
        n_exp = sum(len(e) for e, _ in routes) / len(routes)
        out.append(
            dict(
                T=T,
                rows=R,
                experts=n_exp,
                bytes=n_exp * 3 * F_ * D * dtype.itemsize,
                flops=2 * R * 3 * F_ * D,
                ms=ms,
            )
        )
    return out


def fmt_gemm(r: dict, names: list[str], flops: float, nbytes: float, head: str) -> str:
    best = min(r["ms"], key=r["ms"].get)
    cells = [f"{flops / r['ms'][n] / 1e6:.0f} / {nbytes / r['ms'][n] / 1e6:.1f}" for n in names]
    cells = [f"**{c}**" if n == best else c for c, n in zip(cells, names)]
    return f"| {head} | {r['M']} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128])
    ap.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--shapes", default=None, help="N x K list, e.g. 1024x1024,1024x512; none")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--weights", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--out", default="bench_out/fp32_gemm.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not fp32_kernels.available():
        raise SystemExit("the fp32 kernels are not available here (no AVX2/FMA or no compiler)")
    g = torch.Generator().manual_seed(0)
    isas = [False, True] if fp32_kernels.wide() else [False]
    names = [*(fp32_kernels.isa_name(wide) for wide in isas), "MKL"]
    shapes = SHAPES
    if args.shapes:
        shapes = [
            tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s != "none"
        ]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.weights]
    wb = dtype.itemsize
    result = dict(
        threads=args.threads,
        machine=platform.processor() or platform.machine(),
        weights=args.weights,
    )

    print(f"{args.weights} weights: GFLOP/s / GB/s of weight read (best of each in bold)\n")
    print("| weight (N x K) | M | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    result["gemm"] = []
    for N, K in shapes:
        for r in gemm_rows(N, K, args.rows, isas, g, dtype):
            result["gemm"].append(r)
            print(fmt_gemm(r, names, 2 * r["M"] * N * K, wb * N * K, f"{N} x {K}"), flush=True)
        gc.collect()
    result["head_gemm"] = []
    for H, N, K in HEAD_SHAPES:
        for r in head_rows(H, N, K, [M for M in args.rows if M <= 64], isas, g, dtype):
            result["head_gemm"].append(r)
            head = f"per-head {H} x {N} x {K}"
            print(fmt_gemm(r, names, 2 * r["M"] * H * N * K, wb * H * N * K, head), flush=True)
    if not args.skip_moe:
        print("\nMoE layer (64 experts top-6 + shared slot, D 1024, F 512): ms, GB/s of expert")
        print("weight read, GFLOP/s; MKL is the per-expert F.linear loop\n")
        print("| tokens | rows | experts | " + " | ".join(names) + " |")
        print("|---:|---:|---:|" + "---:|" * len(names))
        result["moe"] = moe_rows(args.moe_tokens, isas, g, dtype)
        for r in result["moe"]:
            cells = [
                f"{r['ms'][n]:.2f} ms, {r['bytes'] / r['ms'][n] / 1e6:.1f} GB/s, "
                f"{r['flops'] / r['ms'][n] / 1e6:.0f}"
                for n in names
            ]
            print(f"| {r['T']} | {r['rows']} | {r['experts']:.1f} | " + " | ".join(cells) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
