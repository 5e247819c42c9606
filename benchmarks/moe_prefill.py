"""The routed + shared experts of one prefill MoE layer of the benchmark model, three ways.

Hidden 1024, 64 routed experts top-6 plus the shared expert folded in as slot 64 (every
token), expert FFN 512, fp32 random weights in huge pages, three weight sets cycled so the
experts come from memory as in a real forward. Random top-6 choices for T tokens give the
groups; each way computes the same sorted rows:

- ``kernel``: the one-call MoE kernel for every group (big groups split into <= 128 rows;
  with AVX-512 the packed-panel path for experts of 24+ rows): the default with AVX-512;
- ``kernel+mkl``: groups of ``--mkl-min-rows`` rows or more through MKL (``F.linear``), the
  rest in one kernel call: the default of the AVX2 kernel (``MKL_MIN_ROWS``);
- ``mkl loop``: every group through ``F.linear`` (as the per-expert loop of ``layers.moe``).

``--format int8`` quantizes the same weights per output row (``quant/int8.py``) and times
``ops/cpu/int8.moe_experts`` the same three ways: MKL groups are dequantized first, and the
AVX-512 packed path converts int8 to fp32 while it packs; the GFLOP/s are the fp32 FLOPs.

``MOESERVE_CPU_AVX512=0 MKL_ENABLE_INSTRUCTIONS=AVX2`` measures an AVX2-only CPU's choice on
an AVX-512 one.

The ways alternate inside each repeat (the machine's speed drifts); the table shows the
median time and GFLOP/s of each and its ratio to ``kernel``.

    python benchmarks/moe_prefill.py [--tokens 512 1024 2048] [--repeats 8]
                                     [--format fp32|int8] [--mkl-min-rows 64] [--threads 2]
                                     [--out bench_out/moe_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moeserve.ops.cpu import fp32 as fp32_kernels  # noqa: E402
from moeserve.ops.cpu import int8  # noqa: E402
from moeserve.ops.cpu.hugepages import huge_page_zeros  # noqa: E402
from moeserve.quant.int8 import Int8Tensor, quantize_rows  # noqa: E402

E, D, F, TOP_K, SETS = 64, 1024, 512, 6, 3


def huge(t: torch.Tensor) -> torch.Tensor:
    out = huge_page_zeros(tuple(t.shape), t.dtype)
    return out.copy_(t)


def groups(T: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """The active slots and their row counts for T tokens: random top-6 of 64, then the
    shared slot with every token."""
    top = torch.rand(T, E, generator=g).topk(TOP_K, dim=1).indices
    counts_E = torch.bincount(top.flatten(), minlength=E).tolist()
    experts = [e for e in range(E) if counts_E[e]]
    return experts + [E], [counts_E[e] for e in experts] + [T]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--format", choices=["fp32", "int8"], default="fp32")
    ap.add_argument(
        "--mkl-min-rows",
        type=int,
        default=None,
        help="the threshold of the kernel+mkl way (the default: the format's AVX2 kernel's)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "moe_prefill.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = int8 if args.format == "int8" else fp32_kernels
    if not lib.available():
        sys.exit("the CPU kernels are not available here")
    mkl_min_rows = lib.MKL_MIN_ROWS if args.mkl_min_rows is None else args.mkl_min_rows
    g = torch.Generator().manual_seed(0)

    def weight(*shape: int):
        w = torch.randn(*shape, generator=g) * 0.03
        if args.format == "fp32":
            return huge(w)
        q, scale = quantize_rows(w)
        return Int8Tensor(huge(q), scale)

    weights = [(weight(E + 1, 2 * F, D), weight(E + 1, D, F)) for _ in range(SETS)]
    # each way is the format's moe_experts with its own threshold for this CPU's kernel
    # (None: every group in the kernel, 1: every group through MKL)
    thresholds = {"kernel": None, "kernel+mkl": mkl_min_rows, "mkl loop": 1}
    attr = "MKL_MIN_ROWS_WIDE" if lib.wide() else "MKL_MIN_ROWS"
    default_min = getattr(lib, attr)

    def run(name, x, experts, counts, w13, w2, wr):
        setattr(lib, attr, thresholds[name])
        try:
            return lib.moe_experts(x, experts, counts, w13, w2, wr)
        finally:
            setattr(lib, attr, default_min)

    names = list(thresholds)
    rows = []
    print(f"{'tokens':>6} {'way':>11} {'ms':>8} {'GFLOP/s':>8} {'vs kernel':>9}")
    for T in args.tokens:
        experts, counts = groups(T, g)
        R = sum(counts)
        x, wr = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
        flops = 2 * R * 3 * D * F
        outs = {n: run(n, x, experts, counts, *weights[0], wr) for n in names}
        for n in names[1:]:  # the same rows every way
            torch.testing.assert_close(outs[n], outs["kernel"], rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.repeats):
            for n in names:
                t0 = time.perf_counter()
                for w13, w2 in weights:
                    run(n, x, experts, counts, w13, w2, wr)
                times[n].append((time.perf_counter() - t0) / SETS)
        base = statistics.median(times["kernel"])
        for n in names:
            t = statistics.median(times[n])
            rows.append(
                dict(tokens=T, way=n, ms=t * 1e3, gflops=flops / t / 1e9, vs_kernel=base / t)
            )
            print(f"{T:>6} {n:>11} {t * 1e3:>8.1f} {flops / t / 1e9:>8.0f} {base / t:>8.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        threads=args.threads,
        format=args.format,
        mkl_min_rows=mkl_min_rows,
        machine=platform.processor() or platform.machine(),
        rows=rows,
    )
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
