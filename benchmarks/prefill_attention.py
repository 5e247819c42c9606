"""MLA prefill attention on the benchmark model's shapes: the AVX-512 kernel against the blocked
torch form, alternating in one process.

Each way runs ``layers.mla.MLAttention.forward_naive`` for one fresh prompt of L tokens (16
heads, latent 256, rope 32, nope 64, value 64, fp32): the ``kv_b_proj`` expansion of the
latent rows, then ``ops/prefill_attention.causal_attention_parts`` either through the kernel
of ``ops/cpu/prefill_attention.c`` or, with the kernel switched off, through the blocked
``bmm`` form over concatenated keys. The ways alternate inside each repeat (the machine's
speed drifts); the table shows median ms, GFLOP/s (the expansion GEMM plus the causal half of
the attention square) and the ratio.

    python benchmarks/prefill_attention.py [--tokens 512 2048] [--repeats 7] [--threads 2]
                                           [--out bench_out/prefill_attention.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moeserve.layers.mla import MLAttention  # noqa: E402
from moeserve.ops import prefill_attention as pa  # noqa: E402
from moeserve.ops.linear import linear  # noqa: E402

H, C, R, N, V = 16, 256, 32, 64, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "prefill_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not pa.kernel.available():
        sys.exit("the prefill attention kernel needs AVX-512F and the CPU kernels")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H * (N + V), C, generator=g) * 0.05
    layer = SimpleNamespace(
        H=H, C=C, R=R, N=N, V=V, scale=1 / math.sqrt(N + R), kv_b_proj=lambda x: linear(x, w)
    )
    kernel_on = pa.kernel.available

    def run(way: str, q: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        pa.kernel.available = kernel_on if way == "kernel" else (lambda: False)
        try:
            return MLAttention.forward_naive(layer, q, ctx)
        finally:
            pa.kernel.available = kernel_on

    ways = ["kernel", "blocked"]
    rows = []
    print(f"{'tokens':>6} {'way':>8} {'ms':>8} {'GFLOP/s':>8} {'vs blocked':>10}")
    with torch.inference_mode():
        for L in args.tokens:
            q = torch.randn(L, H, N + R, generator=g)
            ctx = torch.randn(L, C + R, generator=g)
            outs = {way: run(way, q, ctx) for way in ways}
            torch.testing.assert_close(outs["kernel"], outs["blocked"], rtol=1e-4, atol=1e-5)
            flops = 2 * L * C * H * (N + V) + H * L * (L + 1) * (N + R + V)
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way in ways:
                    t0 = time.perf_counter()
                    run(way, q, ctx)
                    times[way].append(time.perf_counter() - t0)
            base = statistics.median(times["blocked"])
            for way in ways:
                t = statistics.median(times[way])
                rows.append(
                    dict(tokens=L, way=way, ms=t * 1e3, gflops=flops / t / 1e9, vs_blocked=base / t)
                )
                print(f"{L:>6} {way:>8} {t * 1e3:>8.1f} {flops / t / 1e9:>8.0f} {base / t:>9.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        threads=args.threads, machine=platform.processor() or platform.machine(), rows=rows
    )
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
