"""Absorbed MLA decode attention alone: the paged kernel against the gather reference.

The benchmark model's shapes (16 heads, kv_lora_rank 256, rope 32, fp32) and the engine's
default block size; each of B sequences has L cached tokens in blocks scattered over the
cache. One iteration runs all 12 layers, each over its own cache as in the model: where the
12 caches outgrow the L3 (32 MiB here: B * L above ~2400 tokens) each call reads its latent
from memory. Reported per layer: median (and best) ms of the kernel and of the reference
(gather the context, bmm, softmax, bmm; its slots and mask prebuilt, as the step's metadata
builds them once), taking turns each iteration, and the effective read bandwidth of each,
B * L * (C + R) * 4 bytes over its median time.

    python benchmarks/mla_decode.py [--batch 1 8 32 64] [--context 64 512 2048] [--threads 2]
                                    [--layers 12] [--out bench_out/mla_decode.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moeserve.config import EngineConfig  # noqa: E402
from moeserve.layers.attention_meta import AttentionMetadata  # noqa: E402
from moeserve.ops.cpu import attention as cpu_attention  # noqa: E402

H, C, R, N = 16, 256, 32, 64  # N: qk_nope_head_dim, for the softmax scale
BLOCK_SIZE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}["block_size"]


def make_case(B: int, L: int, layers: int, g: torch.Generator):
    """Per-layer caches holding B contexts of L tokens in shuffled blocks, the step's metadata,
    and the queries."""
    bs = BLOCK_SIZE
    per_seq = (L + bs - 1) // bs
    order = torch.randperm(B * per_seq, generator=g).tolist()
    tables = [order[b * per_seq : (b + 1) * per_seq] for b in range(B)]
    meta = AttentionMetadata.build([L - 1] * B, [1] * B, tables, bs)
    caches = [torch.randn(B * per_seq * bs, C + R, generator=g) for _ in range(layers)]
    q_lat = torch.randn(H, B, C, generator=g).transpose(0, 1)  # head-major, as the layer has it
    q_pe = torch.randn(B, H, R, generator=g)
    return caches, meta, q_lat, q_pe


def run_kernel(cache, q_lat, q_pe, meta, scale, out):
    return cpu_attention.mla_decode(
        q_lat,
        q_pe,
        cache,
        meta.decode_block_table_BN,
        meta.decode_context_lens_B,
        meta.block_size,
        scale,
        out_BHC=out,
    )


def run_gather(cache, q_lat, q_pe, meta, scale, out=None):
    slots, bias = meta.decode_slots_BL, meta.decode_bias_B1L  # built once, on the first call
    return cpu_attention.mla_decode_ref(q_lat, q_pe, cache, slots, bias, scale)


def time_per_layer(fns, caches, *args, min_s: float = 0.5, min_iters: int = 5):
    """Per ``fn`` of ``fns``: the median and the best ms of one layer's ``fn(cache, *args)``.
    The functions take turns each iteration (all layers each), so both see the same noise."""
    for fn in fns:
        for c in caches[:2]:
            fn(c, *args)  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_iters or time.perf_counter() - start < min_s:
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            for c in caches:
                fn(c, *args)
            ts.append(1e3 * (time.perf_counter() - t0) / len(caches))
    return [(statistics.median(ts), min(ts)) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "mla_decode.json"))
    args = ap.parse_args()
    if not cpu_attention.available():
        sys.exit("the decode-attention kernel is unavailable here (no AVX2/FMA or no compiler)")
    torch.set_num_threads(args.threads)
    scale = (N + R) ** -0.5
    g = torch.Generator().manual_seed(0)
    print(
        f"absorbed MLA decode per layer, H={H} C={C} R={R} block {BLOCK_SIZE}, fp32, "
        f"{args.threads} threads; median ms"
    )
    cols = (
        "B",
        "L",
        "kernel",
        "gather",
        "speedup",
        "kernel_GB/s",
        "gather_GB/s",
        "best_k",
        "best_g",
    )
    print("".join(f"{c:>12}" for c in cols))
    rows = []
    for B in args.batch:
        for L in args.context:
            caches, meta, q_lat, q_pe = make_case(B, L, args.layers, g)
            call = (q_lat, q_pe, meta, scale, torch.empty(H, B, C).transpose(0, 1))
            err = (run_kernel(caches[0], *call) - run_gather(caches[0], *call)).abs().max()
            (k_ms, k_best), (g_ms, g_best) = time_per_layer((run_kernel, run_gather), caches, *call)
            gb = B * L * (C + R) * 4 / 1e9
            row = dict(B=B, L=L, kernel_ms=k_ms, gather_ms=g_ms, max_abs_err=err.item())
            row.update(kernel_best_ms=k_best, gather_best_ms=g_best)
            row.update(kernel_gb_s=gb / (k_ms / 1e3), gather_gb_s=gb / (g_ms / 1e3))
            rows.append(row)
            print(
                f"{B:>12}{L:>12}{k_ms:>12.3f}{g_ms:>12.3f}{g_ms / k_ms:>11.1f}x"
                f"{row['kernel_gb_s']:>12.1f}{row['gather_gb_s']:>12.1f}"
                f"{k_best:>12.3f}{g_best:>12.3f}"
            )
            del caches
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta_info = dict(
        torch=torch.__version__,
        machine=platform.machine(),
        threads=args.threads,
        block_size=BLOCK_SIZE,
        command=" ".join(sys.argv),
        loadavg_at_end=os.getloadavg(),
    )
    out_path.write_text(json.dumps({"meta": meta_info, "rows": rows}, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
