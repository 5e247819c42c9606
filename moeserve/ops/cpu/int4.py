"""The weight-only int4 kernels of ``int4.c`` and their pure-torch references.

Weights are :class:`~moeserve.quant.int4.Int4Tensor` rows (``q [N, K/2]`` packed codes,
``scale`` and ``zero [N, K/G]``, one per group of ``G`` columns); activations and outputs are
fp32. The GEMM takes at most ``MAX_ROWS`` token rows (any number with AVX-512F) and the MoE
call any number; ``ops/cpu/build.py`` compiles and loads the source, and when that is not
possible :func:`available` is False and callers use the references. Each kernel exists for
AVX2+FMA and for AVX-512F; :func:`wide` picks AVX-512F where the CPU has it
(``MOESERVE_CPU_AVX512=0`` keeps AVX2). How the kernels unpack and dequantize the codes, and
what was measured: ``int4.c``'s header.
"""

from __future__ import annotations

import ctypes
import sys
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
from moeserve.ops.cpu.int8 import moe_int8_ref
from moeserve.quant.int4 import GROUP_SIZES, Int4Tensor

_SOURCE = Path(__file__).with_name("int4.c")
# Rows the AVX2 GEMM takes; more go to dequantized blocks and MKL (ops/formats/int4.py: 1 thread,
# 64-128 rows even, 512 rows MKL 1.05-1.13x). The AVX-512 GEMM takes any number: 1.5-2x the
# blocks + MKL at 64-512 rows (1024 x 1024 to 2048 x 4096, one thread), in registers; from 40
# rows it packs dequantized panels as int8 does, 1.1-1.25x the register form at 256 rows
# (int4.c's header).
MAX_ROWS = 64
# In one MoE call, an expert with at least this many rows is dequantized and runs as two MKL
# GEMMs instead of in the kernel (int8.MKL_MIN_ROWS is the int8 twin). Measured on the
# benchmark model's layer (64 experts, D 1024, F 512, group 128, one thread): with AVX2, 2048
# tokens (~190 rows an expert) 1.12x the kernel alone, 512-1024 tokens even; with AVX-512
# never (None): the kernel was 1.6x dequantize + MKL at 1024 tokens, before its experts of 32
# rows or more went through packed panels (int4.c: 1.2-1.27x faster at 1024-2048 tokens).
MKL_MIN_ROWS: int | None = 64
MKL_MIN_ROWS_WIDE: int | None = None


def linear_int4_ref(x: torch.Tensor, w: Int4Tensor) -> torch.Tensor:
    """Reference: ``x @ w.dequantize().T`` in fp32, for ``x [..., K]`` and ``w [N, K]``."""
    return F.linear(x.float(), w.dequantize())


def moe_int4_ref(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int4Tensor,
    w2: Int4Tensor,
    weight_R: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`moe_experts`: int8's reference loop (rows sorted by expert through
    their expert's gated FFN, each scaled by its routing weight) with
    :func:`linear_int4_ref`."""
    return moe_int8_ref(x_RD, experts, counts, w13, w2, weight_R, gemm=linear_int4_ref)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    build.declare(
        lib,
        "moeserve_int4_gemm_nt_small",
        *(I64, I64, I64, PTR, I64, PTR, I64, PTR, PTR, I64, PTR, I64, INT),
    )
    build.declare(
        lib,
        "moeserve_int4_moe_small",
        *(I64, PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR),
        INT,
    )
    build.declare(lib, "moeserve_int4_dequant", I64, I64, PTR, I64, PTR, PTR, I64, PTR, I64)
    return lib


def available() -> bool:
    return _library() is not None


@lru_cache(maxsize=1)
def _rows_ok(w: Int4Tensor) -> bool:
    """A 2-D weight on the CPU with unit-stride code rows, contiguous scales and zeros (the
    kernels read a row's groups back to back, rows K / G apart) and a group size they
    take."""
    return (
        w.group_size in GROUP_SIZES
        and w.q.device.type == "cpu"
        and w.q.dim() == 2
        and w.q.stride(1) == 1
        and w.scale.is_contiguous()
        and w.zero.is_contiguous()
    )


def usable(x: torch.Tensor, w: Int4Tensor) -> bool:
    """Whether :func:`gemm_nt` runs the kernel for these operands: up to ``MAX_ROWS`` rows, or
    any number with AVX-512F."""
    return few_rows(x, sys.maxsize if wide() else MAX_ROWS) and _rows_ok(w) and available()


def _w_args(w: Int4Tensor) -> tuple:
    """The weight-side arguments of the GEMM: codes, their row stride in bytes, scales, zero
    points, group size."""
    return (w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr(), w.zero.data_ptr(), w.group_size)


def gemm_nt(
    x: torch.Tensor, w: Int4Tensor, out: torch.Tensor | None = None, avx512: bool | None = None
) -> torch.Tensor:
    """``x @ w.dequantize().T`` for ``x [M, K]`` fp32, ``w`` of ``[N, K]``: each weight row
    streamed once, its codes unpacked and dequantized in registers, and dotted with blocks of
    token rows (AVX-512F: any number of rows, in passes of rows that stay in cache, and from
    40 rows through panels of 64 weight rows dequantized once; AVX2: up to 6 rows, more
    through fp32 chunks of each panel dequantized once).

    ``out`` ([M, N] fp32, unit-stride rows) receives the result when given. ``avx512``
    overrides :func:`wide` (tests). The caller checks :func:`usable` first; the reference is
    :func:`linear_int4_ref`.
    """
    M, K = x.shape
    N = w.q.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    _library().moeserve_int4_gemm_nt_small(
        M,
        N,
        K,
        x.data_ptr(),
        x.stride(0),
        *_w_args(w),
        out.data_ptr(),
        out.stride(0),
        int(wide() if avx512 is None else avx512),
    )
    return out


def bind_gemm(w: Int4Tensor, fallback) -> BoundGemm | None:
    """:func:`gemm_nt` for up to ``MAX_ROWS`` rows with ``w`` bound; None where the kernel does
    not take ``w``."""
    if not (available() and w.q.dim() == 2 and _rows_ok(w)):
        return None
    fn = _library().moeserve_int4_gemm_nt_small
    bound = pointers(w.q, w.scale, w.zero)
    return BoundGemm(fn, tuple(w.shape), _w_args(w), MAX_ROWS, int(wide()), bound, fallback)


def dequantize_into(w: Int4Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = w.dequantize()`` (fp32 ``[N, K]``, unit-stride rows) with the kernel, for a
    2-D ``w`` with unit-stride code rows; the reference is ``Int4Tensor.dequantize``. The
    caller checks :func:`available`."""
    if w.group_size % 32:  # a hand-built weight's group inside a run of codes
        return out.copy_(w.dequantize())
    N, K = w.shape
    scale, zero = w.scale.contiguous(), w.zero.contiguous()  # K / G per row: cheap if not
    _library().moeserve_int4_dequant(
        N,
        K,
        w.q.data_ptr(),
        w.q.stride(0),
        scale.data_ptr(),
        zero.data_ptr(),
        w.group_size,
        out.data_ptr(),
        out.stride(0),
    )
    return out


def moe_usable(x_RD: torch.Tensor, counts: list[int], w13: Int4Tensor, w2: Int4Tensor) -> bool:
    """Whether :func:`moe_experts` runs for these operands (any number of rows per expert;
    both projections with one group size)."""
    return (
        0 < max(counts, default=0)
        and x_RD.dtype == torch.float32
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and w13.group_size == w2.group_size in GROUP_SIZES
        and on_cpu_contiguous(w13.q, w13.scale, w13.zero, w2.q, w2.scale, w2.zero)
        and available()
    )


def mkl_min_rows(avx512: bool | None = None) -> int | None:
    """Rows from which an expert of an int4 MoE call is dequantized and runs through MKL
    (None: never) for the ISA ``avx512`` picks (:func:`wide` by default)."""
    return MKL_MIN_ROWS_WIDE if (wide() if avx512 is None else avx512) else MKL_MIN_ROWS


def _moe_w_args(w13: Int4Tensor, w2: Int4Tensor) -> tuple:
    """The weight-side arguments of the MoE call: each projection's codes, scales and zero
    points, then the shared group size."""
    parts = (w13.q, w13.scale, w13.zero, w2.q, w2.scale, w2.zero)
    return (*(t.data_ptr() for t in parts), w13.group_size)


def moe_experts(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int4Tensor,
    w2: Int4Tensor,
    weight_R: torch.Tensor,
    avx512: bool | None = None,
) -> torch.Tensor:
    """Rows of ``x_RD`` sorted by expert through their experts' gated FFN (int4 ``w13``
    ``[E, 2F, D]``, ``w2`` ``[E, D, F]``, one group size), each times its routing weight;
    ``avx512`` overrides :func:`wide`. Experts of :func:`mkl_min_rows` rows or more are
    dequantized and run as two MKL GEMMs, the rest in one kernel call. The reference is
    :func:`moe_int4_ref`."""
    D, F_ = x_RD.shape[1], w2.shape[2]
    meta, weight_R, h, y, big = moe_call_split(
        x_RD.shape[0], D, F_, experts, counts, weight_R, mkl_min_rows(avx512)
    )
    if meta.shape[1]:
        _library().moeserve_int4_moe_small(
            meta.shape[1],
            meta[0].data_ptr(),
            meta[1].data_ptr(),
            meta[2].data_ptr(),
            D,
            F_,
            x_RD.data_ptr(),
            *_moe_w_args(w13, w2),
            weight_R.data_ptr(),
            h.data_ptr(),
            y.data_ptr(),
            int(wide() if avx512 is None else avx512),
        )
    dequantized_experts(x_RD, y, experts, counts, big, weight_R, w13, w2, dequantize_into)
    return y


class BoundMoE:
    """The int4 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`): one
    ``moeserve_int4_moe_small`` call over the sorted groups."""

    max_rows = MAX_ROWS  # decode batches; more go through moe_experts

    def __init__(self, w13: Int4Tensor, w2: Int4Tensor) -> None:
        self.w_args = _moe_w_args(w13, w2)
        self.pointers = pointers(*w13.parts(), *w2.parts())
        self.fn = _library().moeserve_int4_moe_small
        self.wide = int(wide())

    @staticmethod
    def bind(w13: Int4Tensor, w2: Int4Tensor) -> BoundMoE | None:
        ok = (
            available()
            and w13.group_size == w2.group_size in GROUP_SIZES
            and on_cpu_contiguous(*w13.parts(), *w2.parts())
        )
        return BoundMoE(w13, w2) if ok else None

    def prepare(self, b: MoEBuffers) -> None:
        self.y = b.y_sorted
        self.args = (*b.group_args(), *self.w_args, b.weight.data_ptr(), b.h.data_ptr())
        self.args += (b.y_sorted.data_ptr(), self.wide)

    def run(self, G: int) -> torch.Tensor:
        self.fn(G, *self.args)
        return self.y
