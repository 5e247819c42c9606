"""The weight-only int8 kernels of ``int8.c`` and their pure-torch references.

Weights are :class:`~moeserve.quant.int8.Int8Tensor` rows (``q [N, K]`` int8, ``scale [N]``
fp32); activations and outputs are fp32. The GEMM takes at most ``MAX_ROWS`` token rows
(any number with AVX-512F) and the MoE call any number;
``ops/cpu/build.py`` compiles and loads the source, and when that is not possible
:func:`available` is False and callers use the references. Each kernel exists for AVX2+FMA
and for AVX-512F; :func:`wide` picks AVX-512F where the CPU has it (``MOESERVE_CPU_AVX512=0``
keeps AVX2). On aarch64 one body per build (NEON, or SVE at the CPU's vector length), and
where the CPU has the dot product (``asimddp``) calls of up to :data:`SDOT_MAX_ROWS` rows (an
MoE call's: its largest expert's) run on SDOT with each row rounded to 16-bit fixed point,
``int4.round_rows_ref``'s rounding (``int8_sdot.h``; tests/unit/ops/cpu/test_arm_int8.py);
where it also has the int8 matrix multiply (``i8mm``) calls of any row count do, those of two
rows or more on SMMLA.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import build
from moeserve.ops.cpu.bound import BoundGemm, MoEBuffers, on_cpu_contiguous, pointers
from moeserve.ops.cpu.build import I64, INT, PTR
from moeserve.ops.cpu.fp32 import (  # shared with fp32
    dequantized_experts,
    few_rows,
    moe_call_split,
    wide,
)
from moeserve.quant.int8 import Int8Tensor

_SOURCE = Path(__file__).with_name("int8.c")
MAX_ROWS = 64
SDOT_MAX_ROWS = 12  # int8.c, aarch64 with the dot product but no i8mm: rows SDOT takes
# In one MoE call, an expert with at least this many rows is dequantized and runs as two MKL
# GEMMs instead of in the kernel (fp32.MKL_MIN_ROWS is the fp32 twin). With the AVX2
# kernel (benchmarks/moe_prefill.py --format int8 with MKL limited to AVX2 too) from 64 rows:
# 2048 tokens 1.41x the kernel alone, 512 tokens (only the folded shared expert) 1.07x, while
# 16 rows lost 3-4%. With AVX-512 never (None): the call's packed-panel path (moe_packed.h)
# converts while packing, 1.8x dequantize + MKL at 512 tokens.
MKL_MIN_ROWS: int | None = 64
MKL_MIN_ROWS_WIDE: int | None = None


def linear_int8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference: ``(x @ q.T) * scale``, fp32, for ``x [..., K]``, ``q [N, K]``, ``scale [N]``."""
    return F.linear(x.float(), q.float()) * scale


def moe_int8_ref(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int8Tensor,
    w2: Int8Tensor,
    weight_R: torch.Tensor,
    gemm: Callable[[torch.Tensor, object], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference of :func:`moe_experts`: rows sorted by expert (``counts[i]`` rows for
    ``experts[i]``) through their expert's gated FFN with ``gemm(x, w)`` (by default
    :func:`linear_int8_ref`; ``int8_amx.moe_ref`` and ``int4.moe_int4_ref`` pass their own),
    each scaled by its routing weight."""
    if gemm is None:
        gemm = lambda x, w: linear_int8_ref(x, w.q, w.scale)  # noqa: E731
    F2 = w13.shape[1]
    y_RD = torch.empty(x_RD.shape, dtype=torch.float32, device=x_RD.device)
    start = 0
    for e, n in zip(experts, counts):
        rows = slice(start, start + n)
        gate, up = gemm(x_RD[rows], w13[e]).split(F2 // 2, dim=-1)
        y_RD[rows] = gemm(F.silu(gate) * up, w2[e])
        start += n
    return y_RD.mul_(weight_R.float().unsqueeze(1))


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    build.declare(
        lib, "moeserve_int8_gemm_nt_small", I64, I64, I64, PTR, I64, PTR, I64, PTR, PTR, I64, INT
    )
    build.declare(
        lib,
        "moeserve_int8_moe_small",
        *(I64, PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, INT),
    )
    build.declare(lib, "moeserve_int8_dequant", I64, I64, PTR, I64, PTR, PTR, I64)
    return lib


def available() -> bool:
    return _library() is not None


@lru_cache(maxsize=1)
def _rows_ok(w: Int8Tensor) -> bool:
    return (
        w.q.device.type == "cpu"
        and w.q.dim() == 2
        and w.q.stride(1) == 1
        and w.scale.is_contiguous()
    )


def usable(x: torch.Tensor, w: Int8Tensor) -> bool:
    """Whether :func:`gemm_nt` runs the kernel for these operands: up to ``MAX_ROWS`` rows, or
    any number with AVX-512F (from 24 rows its packed panels)."""
    return few_rows(x, sys.maxsize if wide() else MAX_ROWS) and _rows_ok(w) and available()


def gemm_nt(
    x: torch.Tensor, w: Int8Tensor, out: torch.Tensor | None = None, avx512: bool | None = None
) -> torch.Tensor:
    """``(x @ w.q.T) * w.scale`` for ``x [M, K]`` fp32, ``w`` of ``[N, K]``: up to MAX_ROWS
    rows the dot form, which streams each weight row once. With AVX-512F any number of rows,
    and from 24 (the packed path's ``PACK_MIN_ROWS``) the C call runs the packed panels of
    ``moe_packed.h`` instead: each 64-row panel of ``w`` converted, scaled and transposed once
    into an fp32 buffer, then outer-product tiles of 6 rows of ``x`` over it (1.1-1.9x the dot
    form at 24-64 rows, 1.2-1.9x dequantizing blocks for MKL at 512: docs/benchmarks.md).

    ``out`` ([M, N] fp32, unit-stride rows) receives the result when given. ``avx512``
    overrides :func:`wide` (tests). The caller checks :func:`usable` first; the reference is
    :func:`linear_int8_ref`.
    """
    M, K = x.shape
    N = w.q.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    _library().moeserve_int8_gemm_nt_small(
        M,
        N,
        K,
        x.data_ptr(),
        x.stride(0),
        w.q.data_ptr(),
        w.q.stride(0),
        w.scale.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        int(wide() if avx512 is None else avx512),
    )
    return out


def bind_gemm(w: Int8Tensor, fallback) -> BoundGemm | None:
    """:func:`gemm_nt` for up to ``MAX_ROWS`` rows with ``w`` bound; None where the kernel does
    not take ``w``."""
    if not (available() and w.q.dim() == 2 and _rows_ok(w)):
        return None
    fn = _library().moeserve_int8_gemm_nt_small
    w_args = (w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr())
    bound = pointers(w.q, w.scale)
    return BoundGemm(fn, tuple(w.shape), w_args, MAX_ROWS, int(wide()), bound, fallback)


def dequantize_into(w: Int8Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = w.q * w.scale[:, None]`` (fp32 ``[N, K]``, unit-stride rows) with the kernel;
    the reference is ``Int8Tensor.dequantize``. The caller checks :func:`available`."""
    N, K = w.q.shape
    _library().moeserve_int8_dequant(
        N, K, w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr(), out.data_ptr(), out.stride(0)
    )
    return out


def moe_usable(x_RD: torch.Tensor, counts: list[int], w13: Int8Tensor, w2: Int8Tensor) -> bool:
    """Whether :func:`moe_experts` runs for these operands (any number of rows per expert)."""
    return (
        0 < max(counts, default=0)
        and x_RD.dtype == torch.float32
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and all(t.is_contiguous() for t in (w13.q, w13.scale, w2.q, w2.scale))
        and w13.q.device.type == "cpu"
        and available()
    )


def mkl_min_rows(avx512: bool | None = None) -> int | None:
    """Rows from which an expert of an int8 MoE call is dequantized and runs through MKL
    (None: never) for the ISA ``avx512`` picks (:func:`wide` by default)."""
    return MKL_MIN_ROWS_WIDE if (wide() if avx512 is None else avx512) else MKL_MIN_ROWS


def moe_experts(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int8Tensor,
    w2: Int8Tensor,
    weight_R: torch.Tensor,
    avx512: bool | None = None,
) -> torch.Tensor:
    """Rows of ``x_RD`` sorted by expert through their experts' gated FFN (int8 ``w13``
    ``[E, 2F, D]``, ``w2`` ``[E, D, F]``), each times its routing weight; ``avx512`` overrides
    :func:`wide`. Experts of :func:`mkl_min_rows` rows or more are dequantized and run as two
    MKL GEMMs, the rest in one kernel call. The reference is :func:`moe_int8_ref`."""
    D, F_ = x_RD.shape[1], w2.q.shape[2]
    meta, weight_R, h, y, big = moe_call_split(
        x_RD.shape[0], D, F_, experts, counts, weight_R, mkl_min_rows(avx512)
    )
    if meta.shape[1]:
        _library().moeserve_int8_moe_small(
            meta.shape[1],
            meta[0].data_ptr(),
            meta[1].data_ptr(),
            meta[2].data_ptr(),
            D,
            F_,
            x_RD.data_ptr(),
            w13.q.data_ptr(),
            w13.scale.data_ptr(),
            w2.q.data_ptr(),
            w2.scale.data_ptr(),
            weight_R.data_ptr(),
            h.data_ptr(),
            y.data_ptr(),
            int(wide() if avx512 is None else avx512),
        )
    dequantized_experts(x_RD, y, experts, counts, big, weight_R, w13, w2, dequantize_into)
    return y


class BoundMoE:
    """The int8 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`): one
    ``moeserve_int8_moe_small`` call over the sorted groups."""

    max_rows = MAX_ROWS  # decode batches; more go through moe_experts

    def __init__(self, w13: Int8Tensor, w2: Int8Tensor) -> None:
        weights = (w13.q, w13.scale, w2.q, w2.scale)
        self.w_args = tuple(t.data_ptr() for t in weights)
        self.pointers = pointers(*weights)
        self.fn = _library().moeserve_int8_moe_small
        self.wide = int(wide())

    @staticmethod
    def bind(w13: Int8Tensor, w2: Int8Tensor) -> BoundMoE | None:
        ok = available() and on_cpu_contiguous(w13.q, w13.scale, w2.q, w2.scale)
        return BoundMoE(w13, w2) if ok else None

    def prepare(self, b: MoEBuffers) -> None:
        self.y = b.y_sorted
        self.args = (*b.group_args(), *self.w_args, b.weight.data_ptr(), b.h.data_ptr())
        self.args += (b.y_sorted.data_ptr(), self.wide)

    def call_args(self) -> tuple:
        return self.fn, self.args, self.y

    def run(self, G: int) -> torch.Tensor:
        self.fn(G, *self.args)
        return self.y
