"""Weight-only int8 GEMM against fp32 on the decode and prefill shapes of the benchmark model.

GB/s counts the weight bytes read per call (fp32: 4 per weight, int8: 1 plus the row scales);
the time ratio is what decode gains. Each call reads another copy of the weight, from a set
of copies larger than the L3 cache, so the weight streams from memory as in a decode step.
For many rows (prefill) it compares fp32 ``F.linear`` with the path the int8 format
(``ops/formats/int8.py``) takes (with AVX-512 the packed panels of ``ops/cpu/moe_packed.h``),
its AVX2 path (blocks of rows dequantized for MKL) and dequantizing the whole weight first.

    python benchmarks/int8_gemm.py [--threads 2] [--rows 1 4 32] [--prefill-rows 512]

The MoE rows time the one-call routed-expert kernels (fp32 ``fp32_kernels.moe_experts``, int8
``int8.moe_experts``) on the benchmark model's layer shape.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu import int8
from moeserve.ops.formats.base import dequantized_blocks
from moeserve.ops.linear import linear as linear_int8
from moeserve.quant.int8 import Int8Tensor, quantize_rows

SHAPES = [(1024, 512), (1024, 1024), (6144, 384), (32000, 1024)]


COLD_BYTES = 192 << 20  # copies of a weight fill this much: well past the L3 cache


def copies(t, total: int = COLD_BYTES) -> list:
    """Clones of ``t`` (a tensor, or a tuple of the tensors of one weight: tuples of clones),
    together at least ``total`` bytes, so cycling through them streams from memory."""
    parts = t if isinstance(t, tuple) else (t,)
    size = sum(p.numel() * p.element_size() for p in parts)
    n = max(1, -(-total // size))
    if isinstance(t, tuple):
        return [tuple(p.clone() for p in t) for _ in range(n)]
    return [t.clone() for _ in range(n)]


def cycling(items: list):
    i = 0

    def next_item():
        nonlocal i
        i += 1
        return items[i % len(items)]

    return next_item


def best_ms(fn, budget_s: float = 0.3, min_reps: int = 3) -> float:
    """The best time (ms) of ``fn`` over at least ``min_reps`` calls and ``budget_s``."""
    fn()
    times, t_end = [], time.perf_counter() + budget_s
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def decode_row(N: int, K: int, M: int, isas: list[bool], g: torch.Generator) -> str:
    """One table row: fp32 kernel and int8 kernel (each ISA) on cold copies of one weight."""
    w = torch.randn(N, K, generator=g)
    q, scale = quantize_rows(w)
    ws, qs = cycling(copies(w)), cycling(copies(q))
    x = torch.randn(M, K, generator=g)
    f32 = best_ms(lambda: fp32_kernels.gemm_nt(x, ws()))
    i8 = [
        best_ms(partial(lambda wide: int8.gemm_nt(x, Int8Tensor(qs(), scale), avx512=wide), wide))
        for wide in isas
    ]
    gbs = " | ".join(f"{(N * K + N * 4) / t / 1e6:.1f}" for t in i8)
    ups = " | ".join(f"{f32 / t:.2f}x" for t in i8)
    return f"| {N} x {K} | {M} | {N * K * 4 / f32 / 1e6:.1f} | {gbs} | {ups} |"


def prefill_row(N: int, K: int, M: int, g: torch.Generator) -> str:
    w = torch.randn(N, K, generator=g)
    t = Int8Tensor(*quantize_rows(w))
    x = torch.randn(M, K, generator=g)
    f32 = best_ms(lambda: F.linear(x, w))
    path = best_ms(lambda: linear_int8(x, t))
    out = torch.empty(M, N)
    blocks = best_ms(lambda: dequantized_blocks(x, t, out, int8.dequantize_into))
    whole = best_ms(lambda: F.linear(x, t.dequantize()))
    return (
        f"| {N} x {K} | {f32:.2f} | {path:.2f} ({f32 / path:.2f}x) "
        f"| {blocks:.2f} ({f32 / blocks:.2f}x) | {whole:.2f} |"
    )


def moe_row(T: int, isas: list[bool], g: torch.Generator) -> str:
    """The routed experts of one benchmark-model MoE layer (64 experts, D 1024, F 512, top-6)
    for T tokens in one kernel call: GB/s of expert weight read. Each call routes afresh and
    reads another copy of the layer (copies of >= 512 MB), so experts come from memory."""
    E, D, F_, K = 64, 1024, 512, 6
    w13, w2 = torch.randn(E, 2 * F_, D, generator=g), torch.randn(E, D, F_, generator=g)
    (q13, s13), (q2, s2) = quantize_rows(w13), quantize_rows(w2)
    n13 = E * 2 * F_ * D
    big = 512 << 20
    dense = torch.cat((w13.flatten(), w2.flatten()))  # 400 MB: one copy is past the L3
    quant = cycling(copies(torch.cat((q13.flatten(), q2.flatten())), big))
    del w13, w2
    routes = []
    for _ in range(16):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).flatten()
        counts_E = torch.bincount(ids, minlength=E).tolist()
        experts = [e for e in range(E) if counts_E[e]]
        routes.append((experts, [counts_E[e] for e in experts]))
    route = cycling(routes)
    x, weight = torch.randn(T * K, D, generator=g), torch.rand(T * K, generator=g)

    def run_fp32() -> None:
        experts, counts = route()
        w13_, w2_ = dense[:n13].view(E, 2 * F_, D), dense[n13:].view(E, D, F_)
        fp32_kernels.moe_experts(x, experts, counts, w13_, w2_, weight)

    def run_int8(wide: bool) -> None:
        flat, (experts, counts) = quant(), route()
        a = Int8Tensor(flat[:n13].view(E, 2 * F_, D), s13)
        b = Int8Tensor(flat[n13:].view(E, D, F_), s2)
        int8.moe_experts(x, experts, counts, a, b, weight, wide)

    weights = sum(len(e) for e, _ in routes) / len(routes) * 3 * F_ * D  # per call, mean
    f32 = best_ms(run_fp32)
    i8 = [best_ms(partial(run_int8, wide)) for wide in isas]
    gbs = " | ".join(f"{weights / t / 1e6:.1f}" for t in i8)
    ups = " | ".join(f"{f32 / t:.2f}x" for t in i8)
    n_exp = sum(len(e) for e, _ in routes) / len(routes)
    label = f"MoE layer, T={T} ({n_exp:.0f} experts, {T * K} rows)"
    return f"| {label} | {weights * 4 / f32 / 1e6:.1f} | {gbs} | {ups} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--prefill-rows", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    isas = [False, True] if int8.wide() else [False]
    names = [fp32_kernels.isa_name(wide) for wide in isas]
    gb_head = " | ".join(f"int8 {n} GB/s" for n in names)
    up_head = " | ".join(f"{n} speedup" for n in names)
    print(f"| weight (N x K) | M | fp32 kernel GB/s | {gb_head} | {up_head} |")
    print("|---|---:|---:|" + "---:|" * 2 * len(isas))
    for N, K in SHAPES:
        for M in args.rows:
            print(decode_row(N, K, M, isas, g), flush=True)
    for T in (1, 32):
        print(moe_row(T, isas, g), flush=True)
    print(f"\nprefill, M={args.prefill_rows} rows (ms)")
    print(
        "| weight (N x K) | fp32 F.linear | int8 path | int8 blocks + MKL (AVX2 path) "
        "| dequantize all + F.linear |"
    )
    print("|---|---:|---:|---:|---:|")
    for N, K in SHAPES:
        print(prefill_row(N, K, args.prefill_rows, g), flush=True)


if __name__ == "__main__":
    main()
