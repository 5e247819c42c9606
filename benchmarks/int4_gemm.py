"""Weight-only int4 GEMM (group 128 and 32) against int8 and fp32 on the decode shapes of the
benchmark model.

GB/s counts the weight bytes read per call (fp32: 4 per weight; int8: 1 plus a 4-byte scale
per row; int4: K / 2 bytes of codes plus 5 per group, an fp32 scale and a uint8 zero point);
``int4/int8`` is the int4 kernel's speed over the int8 kernel's (its rows per second over
int8's). Each call reads another copy of the weight, from a set of copies larger than the L3
cache, so the weight streams from memory as in a decode step. One table per kernel form of
int4 (``ops/cpu/int4.py`` isa levels: avx2, avx2-idot, avx512, vnni), the fp32 and int8
kernels beside it in their AVX2 or AVX-512 variant.

    python benchmarks/int4_gemm.py [--threads 2] [--rows 1 2 4 8 16 32] [--isa all]
        [--out bench_out/int4_gemm.json]

``--isa all`` prints one table of every form this CPU runs side by side instead (each case's
forms timed one after another), with the integer dots against their fp32-exact twins.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from int8_gemm import best_ms as int8_best_ms
from int8_gemm import copies, cycling  # the same cold-weight rotation as the int8 benchmark

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu import int4, int8
from moeserve.quant.int4 import Int4Tensor, quantize_groups
from moeserve.quant.int8 import Int8Tensor, quantize_rows

SHAPES = [(1024, 1024), (6144, 384), (32000, 1024)]
GROUPS = (128, 32)
best_ms = partial(int8_best_ms, budget_s=0.15)  # many forms a case: a shorter budget each


LEVELS = {"avx2": int4.AVX2, "avx2-idot": int4.AVX2_IDOT, "avx512": int4.AVX512, "vnni": int4.VNNI}


def shape_rows(N: int, K: int, rows: list[int], level: int, g: torch.Generator) -> list[dict]:
    """fp32, int8 and int4 kernels (each group size) on cold copies of one weight, for each
    row count: ms and GB/s of each."""
    w = torch.randn(N, K, generator=g)
    fp32_w = cycling([c[0] for c in copies((w,))])
    i8 = cycling([Int8Tensor(*c) for c in copies(quantize_rows(w))])
    i4 = {G: cycling([Int4Tensor(*c) for c in copies(quantize_groups(w, G))]) for G in GROUPS}
    del w
    nbytes = {"fp32": 4 * N * K, "int8": N * K + 4 * N}
    nbytes |= {f"int4 g{G}": N * (K // 2 + 5 * K // G) for G in GROUPS}
    out, wide = [], level in (int4.AVX512, int4.VNNI)
    isa = next(name for name, v in LEVELS.items() if v == level)
    for M in rows:
        x = torch.randn(M, K, generator=g)
        ms = {
            "fp32": best_ms(lambda x=x: fp32_kernels.gemm_nt(x, fp32_w(), avx512=wide)),
            "int8": best_ms(lambda x=x: int8.gemm_nt(x, i8(), avx512=wide)),
        }
        for G in GROUPS:
            ms[f"int4 g{G}"] = best_ms(lambda x=x, G=G: int4.gemm_nt(x, i4[G](), level=level))
        gbs = {k: nbytes[k] / t / 1e6 for k, t in ms.items()}
        out.append(dict(N=N, K=K, M=M, isa=isa, ms=ms, gbs=gbs))
    return out


def table(records: list[dict]) -> None:
    kinds = ["fp32", "int8", *(f"int4 g{G}" for G in GROUPS)]
    head = " | ".join(f"{k} ms (GB/s)" for k in kinds)
    ratios = " | ".join(f"g{G}/int8" for G in GROUPS)
    print(f"| weight (N x K) | M | {head} | {ratios} |")
    print("|---|---:|" + "---:|" * (len(kinds) + len(GROUPS)))
    for r in records:
        cells = " | ".join(f"{r['ms'][k]:.3f} ({r['gbs'][k]:.1f})" for k in kinds)
        up = " | ".join(f"{r['ms']['int8'] / r['ms'][f'int4 g{G}']:.2f}x" for G in GROUPS)
        print(f"| {r['N']} x {r['K']} | {r['M']} | {cells} | {up} |", flush=True)


def forms_rows(N: int, K: int, rows: list[int], levels: list[int], g) -> list[dict]:
    """Every int4 kernel form in ``levels`` (each group size) and int8 (the ISA picked here)
    on cold copies of one weight, one after another for each row count, so that they meet
    the same memory: ms of each."""
    w = torch.randn(N, K, generator=g)
    i8 = cycling([Int8Tensor(*c) for c in copies(quantize_rows(w))])
    i4 = {G: cycling([Int4Tensor(*c) for c in copies(quantize_groups(w, G))]) for G in GROUPS}
    del w
    names = {v: n for n, v in LEVELS.items()}
    out = []
    for M in rows:
        x = torch.randn(M, K, generator=g)
        ms = {"int8": best_ms(lambda x=x: int8.gemm_nt(x, i8()))}
        for G in GROUPS:
            for level in levels:
                run = lambda x=x, G=G, level=level: int4.gemm_nt(x, i4[G](), level=level)  # noqa: E731
                ms[f"g{G} {names[level]}"] = best_ms(run)
        out.append(dict(N=N, K=K, M=M, ms=ms))
    return out


def forms_table(records: list[dict], levels: list[int]) -> None:
    names = [n for n, v in LEVELS.items() if v in levels]
    pairs = [(a, b) for a, b in (("avx2-idot", "avx2"), ("vnni", "avx512")) if a in names]
    cols = [f"g{G} {n}" for G in GROUPS for n in names]
    ratio_cols = [f"g{G} {a}/{b}" for G in GROUPS for a, b in pairs]
    print(f"| weight (N x K) | M | int8 | {' | '.join(cols)} | {' | '.join(ratio_cols)} |")
    print("|---|---:|" + "---:|" * (1 + len(cols) + len(ratio_cols)))
    for r in records:
        ms = r["ms"]
        cells = " | ".join(f"{ms[c]:.3f}" for c in ["int8", *cols])
        up = " | ".join(
            f"{ms[f'g{G} {b}'] / ms[f'g{G} {a}']:.2f}x" for G in GROUPS for a, b in pairs
        )
        print(f"| {r['N']} x {r['K']} | {r['M']} | {cells} | {up} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument(
        "--isa", choices=["default", *LEVELS, "all"], default="default",
        help="int4's kernel form; default: the one picked here (int4.isa()), all: every one "
        "this CPU runs",
    )  # fmt: skip
    ap.add_argument("--out", default="bench_out/int4_gemm.json")
    args = ap.parse_args()
    if not (int4.available() and int8.available() and fp32_kernels.available()):
        raise SystemExit("the CPU kernels are not available here (no AVX2/FMA or no compiler)")
    torch.set_num_threads(args.threads)
    here = [int4.AVX2, int4.AVX2_IDOT] + ([int4.AVX512] if int4.wide() else [])
    here += [int4.VNNI] if int4.isa() == int4.VNNI else []
    if args.isa == "default":
        levels = [int4.isa()]
    elif args.isa == "all":
        levels = here
    elif LEVELS[args.isa] in here:
        levels = [LEVELS[args.isa]]
    else:
        raise SystemExit(f"--isa {args.isa}: this CPU does not run it")
    g = torch.Generator().manual_seed(0)
    records = []
    if args.isa == "all":  # the forms side by side, each against its fp32-exact twin
        print(f"\nint4 kernel forms (ms), int8 beside, {args.threads} threads, best of >= 3")
        records = [r for N, K in SHAPES for r in forms_rows(N, K, args.rows, levels, g)]
        forms_table(records, levels)
        levels = []
    for level in levels:
        name = next(n for n, v in LEVELS.items() if v == level)
        print(f"\nint4 {name}, {args.threads} threads, best of >= 3 calls")
        rows = [r for N, K in SHAPES for r in shape_rows(N, K, args.rows, level, g)]
        table(rows)
        records += rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(threads=args.threads, torch=torch.__version__)
    out.write_text(json.dumps(dict(meta=meta, rows=records), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
