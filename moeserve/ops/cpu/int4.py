"""The weight-only int4 kernels of ``int4.c`` and their pure-torch references.

Weights are :class:`~moeserve.quant.int4.Int4Tensor` rows (``q [N, K/2]`` packed codes,
``scale`` and ``zero [N, K/G]``, one per group of ``G`` columns); activations and outputs are
fp32. The GEMM takes at most ``MAX_ROWS`` token rows (any number with AVX-512F) and the MoE
call any number; ``ops/cpu/build.py`` compiles and loads the source, and when that is not
possible :func:`available` is False and callers use the references. Each kernel exists for
AVX2+FMA and for AVX-512F, and both have a twin on integer dot products of bytes
(``int4_idot.h``: AVX2, and AVX-512 VNNI for the GEMM of fewer than 256 rows) that takes each
token row rounded to 16-bit fixed point (:func:`round_rows_ref`). :func:`isa` picks the
integer dots where they run (AVX-512 VNNI, else AVX2 on a CPU without AVX-512F), else
AVX-512F's lookups; ``MOESERVE_CPU_AVX512=0`` keeps AVX2, ``MOESERVE_INT4_IDOT=0`` the fp32
forms. How the kernels unpack and dequantize the codes, and what was measured: ``int4.c``'s
header.
"""

from __future__ import annotations

import ctypes
import os
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
from moeserve.platform import cpu_flags
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
# The ``isa`` of the kernels (int4.c's ISA_*): AVX2+FMA (codes dequantized by FMAs), AVX-512F
# (codes looked up in each group's 16 values), and the integer dots on the rows rounded to 16
# bits with AVX-512 VNNI or AVX2
AVX2, AVX512, VNNI, AVX2_IDOT = 0, 1, 2, 3
# or'ed into VNNI or AVX2_IDOT: the rows (and an MoE call's hidden) on their int8 grids first,
# w4a8_int8's rounding (ops/cpu/int4_amx.py: its few-row calls)
INT8_ROWS = 16
# or'ed into the isa of a bound call whose weights' zero points are all 8 (symmetric, as
# ``--quantization int4`` quantizes by default): the integer dots do not read them
ZERO8 = 32
XMAX = 32639  # int4_idot.h: the rounded rows' largest magnitude
IDOT_MAX_ROWS = 256  # int4.c: the integer dots take fewer rows (an expert's, in an MoE call)


def isa() -> int:
    """Which kernels run here: :data:`VNNI` where the CPU has AVX-512 VNNI (with BW and VL),
    :data:`AVX512` with AVX-512F alone, else :data:`AVX2_IDOT`; without the integer dots
    (``MOESERVE_INT4_IDOT=0``) :data:`AVX512` or :data:`AVX2`."""
    idot = os.environ.get("MOESERVE_INT4_IDOT", "1") != "0"
    if not wide():
        return AVX2_IDOT if idot else AVX2
    vnni = {"avx512_vnni", "avx512bw", "avx512vl"} <= cpu_flags()
    return VNNI if vnni and idot else AVX512


def _isa(level: int | None) -> int:
    return isa() if level is None else int(level)


def rounds_rows(level: int | None, rows: int) -> bool:
    """Whether the GEMM of ``level`` (:func:`isa` by default) on ``rows`` token rows runs on
    the integer dots, which round them (:func:`round_rows_ref`)."""
    level = _isa(level)
    return level == AVX2_IDOT or (level == VNNI and rows < IDOT_MAX_ROWS)


def linear_int4_ref(x: torch.Tensor, w: Int4Tensor) -> torch.Tensor:
    """Reference: ``x @ w.dequantize().T`` in fp32, for ``x [..., K]`` and ``w [N, K]``."""
    return F.linear(x.float(), w.dequantize())


def rows16_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` in 16-bit fixed point per row, as the integer-dot kernels (and int4 on
    AMX's tiles) take it: the integers ``xi`` (fp32, ``|xi| <= XMAX``, ties to even) and the
    rows' scales ``c = max|row| / XMAX`` (``[..., 1]``), ``x ~ xi * c``; a row with a nan or
    an inf gets scale nan."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(float(XMAX)) / amax, torch.zeros_like(amax))
    xi = torch.round(x * inv).clamp(-XMAX, XMAX)
    finite = torch.isfinite(x).all(dim=-1, keepdim=True)
    return torch.where(finite, xi, 0.0), torch.where(finite, amax / XMAX, torch.nan)


def round_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` rounded per row as the integer-dot kernels take it: to the multiples of
    ``max|row| / 32639`` (:func:`rows16_ref`), so :func:`linear_int4_ref` of it is what they
    compute, up to the order of the fp32 sums. A row with a nan or an inf becomes all nan."""
    xi, c = rows16_ref(x)
    return xi * c


def linear_isa_ref(x: torch.Tensor, w: Int4Tensor, level: int | None = None) -> torch.Tensor:
    """What :func:`gemm_nt` computes for ``x [M, K]`` and ``level`` (:func:`isa` by default):
    the reference on ``x`` as it is, or rounded (:func:`round_rows_ref`) where the integer
    dots run (fewer than ``IDOT_MAX_ROWS`` rows)."""
    return linear_int4_ref(round_rows_ref(x) if rounds_rows(level, x.shape[0]) else x, w)


def moe_int4_ref(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int4Tensor,
    w2: Int4Tensor,
    weight_R: torch.Tensor,
    level: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`moe_experts` for ``level`` (:func:`isa` by default): int8's
    reference loop (rows sorted by expert through their expert's gated FFN, each scaled by
    its routing weight) with :func:`linear_int4_ref`, on rows rounded as the integer dots
    take them where those run the experts (all but the experts of :func:`mkl_min_rows` rows
    or more)."""
    least = mkl_min_rows(level)  # experts of this many rows run through MKL, unrounded
    # the call hands the kernel groups of at most fp32.MAX_ROWS (128) rows, fewer than
    # IDOT_MAX_ROWS: the integer dots take all of them where they run
    rounded = rounds_rows(level, 1)

    def gemm(x: torch.Tensor, w: Int4Tensor) -> torch.Tensor:
        in_kernel = least is None or x.shape[0] < least
        return linear_int4_ref(round_rows_ref(x) if rounded and in_kernel else x, w)

    return moe_int8_ref(x_RD, experts, counts, w13, w2, weight_R, gemm=gemm)


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
    # 0, or -1 where a call with INT8_ROWS cannot run on the integer dots
    lib.moeserve_int4_gemm_nt_small.restype = INT
    lib.moeserve_int4_moe_small.restype = INT
    return lib


def available() -> bool:
    return _library() is not None


def entry(name: str):
    """The loaded library's ``moeserve_int4_<name>`` (``gemm_nt_small``, ``moe_small``) for
    the w4a8 calls that share it (``ops/cpu/int4_amx.py``); the caller checks
    :func:`available`."""
    return getattr(_library(), f"moeserve_int4_{name}")


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


def w_args(w: Int4Tensor) -> tuple:
    """The weight-side arguments of the GEMM: codes, their row stride in bytes, scales, zero
    points, group size."""
    return (w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr(), w.zero.data_ptr(), w.group_size)


def zero8(*ws: Int4Tensor) -> int:
    """:data:`ZERO8` where every weight is symmetric and each of its zero points 8, else 0
    (and with ``MOESERVE_INT4_ZERO8=0``: the zero points read as before, e.g. to run kernels
    older than the flag, ``benchmarks/kernel_ab.py``). For a bound call: the flag holds while
    the bound tensors do, and a symmetric weight's ``copy_`` and an expert moved between
    symmetric weights keep zero points of 8."""
    if os.environ.get("MOESERVE_INT4_ZERO8", "1") == "0":
        return 0
    return ZERO8 if all(w.symmetric and bool((w.zero == 8).all()) for w in ws) else 0


def gemm_nt(
    x: torch.Tensor, w: Int4Tensor, out: torch.Tensor | None = None, level: int | None = None
) -> torch.Tensor:
    """``x @ w.dequantize().T`` for ``x [M, K]`` fp32, ``w`` of ``[N, K]``: each weight row
    streamed once, its codes unpacked and dequantized in registers, and dotted with blocks of
    token rows (AVX-512F: any number of rows, in passes of rows that stay in cache, and from
    40 rows through panels of 64 weight rows dequantized once; AVX2: up to 6 rows, more
    through fp32 chunks of each panel dequantized once; on integer dots, blocks of 4 token
    rows, with AVX-512 VNNI up to 255 rows).

    ``out`` ([M, N] fp32, unit-stride rows) receives the result when given. ``level``
    overrides :func:`isa` (tests). The caller checks :func:`usable` first; the reference is
    :func:`linear_isa_ref`.
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
        *w_args(w),
        out.data_ptr(),
        out.stride(0),
        _isa(level),
    )
    return out


def bind_gemm(w: Int4Tensor, fallback, max_rows: int = MAX_ROWS) -> BoundGemm | None:
    """:func:`gemm_nt` for up to ``max_rows`` (at most ``MAX_ROWS``) rows with ``w`` bound;
    more go to ``fallback``. None where the kernel does not take ``w``."""
    if not (available() and w.q.dim() == 2 and _rows_ok(w)):
        return None
    fn = _library().moeserve_int4_gemm_nt_small
    bound = pointers(w.q, w.scale, w.zero)
    most = min(max_rows, MAX_ROWS)
    return BoundGemm(fn, tuple(w.shape), w_args(w), most, isa() | zero8(w), bound, fallback)


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


def mkl_min_rows(level: int | None = None) -> int | None:
    """Rows from which an expert of an int4 MoE call is dequantized and runs through MKL
    (None: never) for the kernels ``level`` picks (:func:`isa` by default)."""
    return MKL_MIN_ROWS if _isa(level) in (AVX2, AVX2_IDOT) else MKL_MIN_ROWS_WIDE


def moe_w_args(w13: Int4Tensor, w2: Int4Tensor) -> tuple:
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
    level: int | None = None,
) -> torch.Tensor:
    """Rows of ``x_RD`` sorted by expert through their experts' gated FFN (int4 ``w13``
    ``[E, 2F, D]``, ``w2`` ``[E, D, F]``, one group size), each times its routing weight;
    ``level`` overrides :func:`isa`. Experts of :func:`mkl_min_rows` rows or more are
    dequantized and run as two MKL GEMMs, the rest in one kernel call. The reference is
    :func:`moe_int4_ref`."""
    D, F_ = x_RD.shape[1], w2.shape[2]
    meta, weight_R, h, y, big = moe_call_split(
        x_RD.shape[0], D, F_, experts, counts, weight_R, mkl_min_rows(level)
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
            *moe_w_args(w13, w2),
            weight_R.data_ptr(),
            h.data_ptr(),
            y.data_ptr(),
            _isa(level),
        )
    dequantized_experts(x_RD, y, experts, counts, big, weight_R, w13, w2, dequantize_into)
    return y


class BoundMoE:
    """The int4 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`): one
    ``moeserve_int4_moe_small`` call over the sorted groups."""

    max_rows = MAX_ROWS  # decode batches; more go through moe_experts

    def __init__(self, w13: Int4Tensor, w2: Int4Tensor) -> None:
        self.w_args = moe_w_args(w13, w2)
        self.pointers = pointers(*w13.parts(), *w2.parts())
        self.fn = _library().moeserve_int4_moe_small
        self.isa = isa() | zero8(w13, w2)

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
        self.args += (b.y_sorted.data_ptr(), self.isa)

    def call_args(self) -> tuple:
        return self.fn, self.args, self.y

    def run(self, G: int) -> torch.Tensor:
        self.fn(G, *self.args)
        return self.y
