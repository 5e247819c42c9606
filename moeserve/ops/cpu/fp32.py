"""The CPU decode kernels of ``fp32.c``: the few-row fp32 GEMM, the routed-expert FFN of a
MoE layer, RMSNorm and DeepSeek's grouped routing, each for at most ``MAX_ROWS`` token rows,
each with its pure-torch reference named in its docstring. ``ops/cpu/build.py`` compiles and
loads the source; when that is not possible :func:`available` is False and callers use the
references. The GEMMs (few-row, MoE, per-head) exist for AVX2+FMA and for AVX-512F;
:func:`wide` picks AVX-512F where the CPU has it (``MOESERVE_CPU_AVX512=0`` keeps AVX2).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
from functools import cache, lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F_

from moeserve.ops.cpu import build
from moeserve.ops.cpu.bound import (
    BoundGemm,
    BoundHeadGemm,
    MoEBuffers,
    on_cpu_contiguous,
    pointers,
)
from moeserve.ops.cpu.bound import few_rows as _few_rows
from moeserve.ops.cpu.build import F32, I64, INT, PTR
from moeserve.platform import cpu_flags, sve_vector_bits

_SOURCE = Path(__file__).with_name("fp32.c")
# measured faster than MKL's GEMM up to 128 rows here (96-128 rows: AVX-512 2.0-2.9x, AVX2
# 1.1-1.4x; docs/benchmarks.md, benchmarks/fp32_gemm.py)
MAX_ROWS = 128
# In one MoE call, an expert with at least this many rows (prefill: the folded shared expert
# takes every token, a routed one T * top_k / E on average) runs as two MKL GEMMs instead,
# where MKL's packed GEMM beats the kernel: with the AVX2 kernel (measured with MKL limited
# to AVX2 too, benchmarks/moe_prefill.py: 512 tokens 1.34x, 128-256 tokens 1.02-1.03x) from
# 16 rows; with AVX-512 never (None), since the call's packed-panel path (moe_packed.h)
# matched or beat MKL at 512-2048 tokens (docs/benchmarks.md "Prefill MoE").
MKL_MIN_ROWS = 16
MKL_MIN_ROWS_WIDE: int | None = None


def mkl_min_rows(avx512: bool | None = None) -> int | None:
    """Rows from which an expert of an MoE call runs through MKL (None: never) for the ISA
    ``avx512`` picks (:func:`wide` by default)."""
    return MKL_MIN_ROWS_WIDE if _wide(avx512) else MKL_MIN_ROWS


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    for prefix in _PREFIX.values():  # the fp32 kernels and their twins on bf16 weights
        build.declare(
            lib, f"{prefix}_gemm_nt_small", I64, I64, I64, PTR, I64, PTR, I64, PTR, I64, INT
        )
        build.declare(
            lib,
            f"{prefix}_moe_small",
            *(I64, PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, INT),
        )
        build.declare(
            lib,
            f"{prefix}_head_gemm_nt_small",
            *(I64,) * 4,
            *(PTR, I64, I64, PTR, I64, I64, PTR, I64, I64, INT),
        )
    build.declare(lib, "moeserve_rms_norm", I64, I64, PTR, I64, PTR, F32, PTR, I64)
    build.declare(lib, "moeserve_add_rms_norm", I64, I64, PTR, I64, PTR, I64, PTR, F32, PTR, I64)
    build.declare(lib, "moeserve_silu_mul", I64, I64, PTR, I64)
    build.declare(
        lib,
        "moeserve_route_grouped_sigmoid",
        *(I64, I64, I64, I64, I64, PTR, PTR, INT, F32, PTR, PTR, PTR, I64),
    )
    return lib


# the entry points per weight dtype: bf16 weights run the same bodies, widened in registers
_PREFIX = {torch.float32: "moeserve", torch.bfloat16: "moeserve_bf16w"}


@cache
def _entry(name: str, dtype: torch.dtype):
    """The library's ``name`` kernel for weights of ``dtype`` (:data:`_PREFIX`)."""
    return getattr(_library(), f"{_PREFIX[dtype]}_{name}")


def available() -> bool:
    return _library() is not None


@lru_cache(maxsize=1)
def wide() -> bool:
    """Whether the GEMMs run their AVX-512F variant (twice the lanes per FMA, twice the
    registers) here."""
    return "avx512f" in cpu_flags() and os.environ.get("MOESERVE_CPU_AVX512", "1") != "0"


def isa_name(avx512: bool) -> str:
    """What the kernels run as (benchmark tables): on x86-64 AVX-512F (``avx512``) or AVX2;
    on aarch64 the one body each build has, SVE at the vector length it was built for, else
    NEON (``ops/cpu/build.py``)."""
    if platform.machine() in build.ARM_MACHINES:
        bits = sve_vector_bits() if "sve" in cpu_flags() else None
        return f"SVE-{bits}" if bits else "NEON"
    return "AVX-512" if avx512 else "AVX2"


def _wide(avx512: bool | None) -> int:
    return int(wide() if avx512 is None else avx512)


def few_rows(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether ``x`` is what the row kernels here (and the int8 ones, with their ``max_rows``)
    take: ``[M, K]`` fp32 on the CPU, 0 < M <= ``max_rows``, unit-stride rows."""
    return _few_rows(x, max_rows)


def weight_ok(w: torch.Tensor) -> bool:
    """Whether the GEMM kernels take ``w`` as their ``[N, K]`` weight (fp32, or bf16 widened
    in registers; unit-stride rows) and are built."""
    return w.dim() == 2 and w.dtype in _PREFIX and w.stride(1) == 1 and available()


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``gemm_nt(x, w)`` runs the kernel for these operands."""
    return few_rows(x) and weight_ok(w)


def gemm_nt(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, avx512: bool | None = None
) -> torch.Tensor:
    """``x @ w.T`` for ``x [M, K]`` (M <= MAX_ROWS), ``w [N, K]`` with unit-stride rows.

    ``out`` ([M, N], unit-stride rows) receives the result when given; ``avx512`` overrides
    :func:`wide` (tests, benchmarks). The caller checks :func:`usable` first; the reference is
    ``F.linear(x, w.float())`` (``w`` fp32 or bf16).
    """
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    _entry("gemm_nt_small", w.dtype)(
        M,
        N,
        K,
        x.data_ptr(),
        x.stride(0),
        w.data_ptr(),
        w.stride(0),
        out.data_ptr(),
        out.stride(0),
        _wide(avx512),
    )
    return out


def bind_gemm(w: torch.Tensor, fallback) -> BoundGemm | None:
    """:func:`gemm_nt` with ``w`` bound (:class:`BoundGemm`); None where the kernel does not
    take ``w``."""
    if not (w.device.type == "cpu" and weight_ok(w)):
        return None
    fn = _entry("gemm_nt_small", w.dtype)
    w_args = (w.data_ptr(), w.stride(0))
    return BoundGemm(fn, tuple(w.shape), w_args, MAX_ROWS, int(wide()), pointers(w), fallback)


def moe_usable(
    x_RD: torch.Tensor, counts: list[int], w13_EFD: torch.Tensor, w2_EDF: torch.Tensor
) -> bool:
    """Whether :func:`moe_experts` runs the kernel for these operands (fp32 rows, fp32 or bf16
    weights; any number of rows per expert: :func:`moe_call_buffers` splits larger groups)."""
    return (
        0 < max(counts, default=0)
        and x_RD.dtype == torch.float32
        and w13_EFD.dtype == w2_EDF.dtype
        and w13_EFD.dtype in _PREFIX
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and w13_EFD.is_contiguous()
        and w2_EDF.is_contiguous()
        and available()
    )


def moe_call_buffers(
    R: int,
    D: int,
    F: int,
    experts: list[int],
    counts: list[int],
    weight_R: torch.Tensor,
    max_rows: int = MAX_ROWS,
    starts: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a one-call MoE kernel (fp32 here, int8 in ``int8.py``) takes besides the weights:
    the groups' ``[expert, first row, rows]`` table ``[3, G]``, the routing weights in fp32,
    and the hidden ``[R, 2F]`` and output ``[R, D]`` buffers. An expert's rows beyond
    ``max_rows`` are split into near-equal groups of at most that many (prefill: the folded
    shared expert takes every token), so G may exceed ``len(experts)``. ``starts`` (default:
    the groups back to back from row 0) lets the table leave rows out."""
    if starts is None:
        starts = list(itertools.accumulate(counts, initial=0))[:-1]
    if max(counts, default=0) > max_rows:
        table = []
        for e, first, n in zip(experts, starts, counts):
            size = -(-n // -(-n // max_rows))  # n in ceil(n / max_rows) near-equal parts
            table += [(e, first + r, min(size, n - r)) for r in range(0, n, size)]
        experts, starts, counts = (list(col) for col in zip(*table))
    meta = torch.tensor([experts, starts, counts], dtype=torch.int64)
    h = torch.empty(R, 2 * F, dtype=torch.float32)
    y = torch.empty(R, D, dtype=torch.float32)
    return meta, weight_R.to(torch.float32).contiguous(), h, y


def moe_call_split(
    R: int,
    D: int,
    F: int,
    experts: list[int],
    counts: list[int],
    weight_R: torch.Tensor,
    least: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """:func:`moe_call_buffers` for the groups (rows sorted by expert, back to back) of fewer
    than ``least`` rows (None: every group), which one kernel call takes, and ``(index, first
    row)`` of each other group, which the caller runs through MKL into the same output."""
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    big = [least is not None and n >= least for n in counts]
    small = [i for i, b in enumerate(big) if not b]
    meta, weight32_R, h, y = moe_call_buffers(
        R,
        D,
        F,
        [experts[i] for i in small],
        [counts[i] for i in small],
        weight_R,
        starts=[starts[i] for i in small],
    )
    return meta, weight32_R, h, y, [(i, starts[i]) for i, b in enumerate(big) if b]


def dequantized_experts(
    x_RD: torch.Tensor,
    y_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    big: list[tuple[int, int]],
    weight_R: torch.Tensor,
    w13,
    w2,
    dequantize_into,
) -> None:
    """The ``big`` groups of :func:`moe_call_split` (``(index, first row)``) through MKL into
    ``y_RD``: each expert's quantized ``w13``/``w2`` dequantized (``dequantize_into(w, out)``)
    into two reused fp32 buffers, the gated FFN as two GEMMs, times the routing weights."""
    if not big:
        return
    b13_FD = torch.empty(w13.shape[1:], dtype=torch.float32)
    b2_DF = torch.empty(w2.shape[1:], dtype=torch.float32)
    for i, first in big:
        rows = slice(first, first + counts[i])
        gate, up = F_.linear(x_RD[rows], dequantize_into(w13[experts[i]], b13_FD)).chunk(2, -1)
        w2_DF = dequantize_into(w2[experts[i]], b2_DF)
        torch.matmul(F_.silu(gate).mul_(up), w2_DF.t(), out=y_RD[rows])
        y_RD[rows] *= weight_R[rows, None]


def moe_experts(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    weight_R: torch.Tensor,
    avx512: bool | None = None,
) -> torch.Tensor:
    """Rows of ``x_RD`` sorted by expert (``counts[i]`` rows for ``experts[i]``) through their
    experts' gated FFN, each scaled by its routing weight; ``avx512`` overrides :func:`wide`.
    Experts of :func:`mkl_min_rows` rows or more run as two MKL GEMMs, the rest in one kernel
    call. The reference is ``ops/moe.py: moe_reference``."""
    D, F = x_RD.shape[1], w2_EDF.shape[2]
    meta, weight_R, h, y, big = moe_call_split(
        x_RD.shape[0], D, F, experts, counts, weight_R, mkl_min_rows(avx512)
    )
    if meta.shape[1]:
        _entry("moe_small", w13_EFD.dtype)(
            meta.shape[1],
            meta[0].data_ptr(),
            meta[1].data_ptr(),
            meta[2].data_ptr(),
            D,
            F,
            x_RD.data_ptr(),
            w13_EFD.data_ptr(),
            w2_EDF.data_ptr(),
            weight_R.data_ptr(),
            h.data_ptr(),
            y.data_ptr(),
            _wide(avx512),
        )
    for i, first in big:
        rows = slice(first, first + counts[i])
        w13, w2 = w13_EFD[experts[i]].float(), w2_EDF[experts[i]].float()  # bf16: widened
        gate, up = F_.linear(x_RD[rows], w13).chunk(2, dim=-1)
        torch.matmul(F_.silu(gate).mul_(up), w2.t(), out=y[rows])
        y[rows] *= weight_R[rows, None]
    return y


class BoundMoE:
    """fp32 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`): the
    groups through :func:`moe_experts`, which takes them as lists."""

    max_rows = MAX_ROWS
    pointers = ()  # moe_experts reads the weights' addresses at each call

    def __init__(self, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> None:
        self.w13_EFD, self.w2_EDF = w13_EFD, w2_EDF
        self.buffers: MoEBuffers | None = None

    @staticmethod
    def bind(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> BoundMoE | None:
        ok = w13_EFD.dtype == w2_EDF.dtype and w13_EFD.dtype in _PREFIX and available()
        ok = ok and on_cpu_contiguous(w13_EFD, w2_EDF)
        return BoundMoE(w13_EFD, w2_EDF) if ok else None

    def prepare(self, buffers: MoEBuffers) -> None:
        self.buffers = buffers

    def call_args(self) -> None:
        return None  # run does more than one call

    def run(self, G: int) -> torch.Tensor:
        b = self.buffers
        experts, _starts, counts = b.meta[:, :G].tolist()
        return moe_experts(b.x_sorted, experts, counts, self.w13_EFD, self.w2_EDF, b.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim for few fp32 rows with the kernel; None when it does not apply
    (the caller then uses ``F.rms_norm``, the reference)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    bound = BoundRMSNorm.bind(weight, eps)
    y = None if bound is None else bound(x2)
    return None if y is None else y.view(x.shape)


class BoundRMSNorm:
    """:func:`rms_norm` for few fp32 rows with the weight's pointer derived once; None from
    :meth:`__call__` where the kernel does not apply (the caller then runs ``F.rms_norm``,
    the reference)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.ptr, self.eps = weight, weight.data_ptr(), eps
        self.fn = _library().moeserve_rms_norm

    @staticmethod
    def bind(weight: torch.Tensor, eps: float) -> BoundRMSNorm | None:
        ok = (
            weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and available()
        )
        return BoundRMSNorm(weight, eps) if ok else None

    def fresh(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the bound tensor, at the same address."""
        return weight is self.weight and weight.data_ptr() == self.ptr

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """RMSNorm of ``x [M, D]`` (unit-stride rows; a column slice is fine) into ``out``
        (``[M, D]``) when given; None for rows the kernel does not take."""
        if not few_rows(x):
            return None
        M, D = x.shape
        if out is None:
            out = torch.empty(M, D, dtype=torch.float32)
        self.fn(M, D, x.data_ptr(), x.stride(0), self.ptr, self.eps, out.data_ptr(), out.stride(0))
        return out


def route_grouped_sigmoid(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    counts_E: torch.Tensor | None = None,
    extra_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V3 routing of few rows in C; None when it does not apply (the caller then runs
    ``ops/routing.py: route_grouped_sigmoid``, the reference). ``counts_E`` (int64, contiguous)
    gains one per routed choice; with ``extra_id`` every row ends with that id at weight 1."""
    T, E = logits_TE.shape
    if not (
        logits_TE.dtype == torch.float32
        and logits_TE.device.type == "cpu"
        and logits_TE.is_contiguous()
        and 0 < T <= MAX_ROWS
        and E <= 1024
        and n_group <= 256
        and top_k <= topk_group * (E // n_group)
        and (bias_E is None or (bias_E.dtype == torch.float32 and bias_E.is_contiguous()))
        and (counts_E is None or (counts_E.dtype == torch.int64 and counts_E.is_contiguous()))
        and available()
    ):
        return None
    K = top_k + (extra_id is not None)
    ids = torch.empty(T, K, dtype=torch.int64)
    weights = torch.empty(T, K, dtype=torch.float32)
    _library().moeserve_route_grouped_sigmoid(
        T,
        E,
        n_group,
        topk_group,
        top_k,
        logits_TE.data_ptr(),
        None if bias_E is None else bias_E.data_ptr(),
        int(norm_topk_prob),
        scaling,
        ids.data_ptr(),
        weights.data_ptr(),
        None if counts_E is None else counts_E.data_ptr(),
        -1 if extra_id is None else extra_id,
    )
    return weights, ids


def head_gemm_nt(
    x_HMK: torch.Tensor,
    w_HNK: torch.Tensor,
    out_HMN: torch.Tensor | None = None,
    avx512: bool | None = None,
) -> torch.Tensor | None:
    """``x[h] @ w[h].T`` for every head h in one call (``torch.bmm(x, w.transpose(1, 2))`` is
    the reference); None when the kernel does not apply. Any head/row strides with unit-stride
    rows; ``out_HMN`` receives the result when given; ``avx512`` overrides :func:`wide`."""
    H, M, K = x_HMK.shape
    N = w_HNK.shape[1]
    if not (
        0 < M <= MAX_ROWS
        and x_HMK.dtype == torch.float32
        and w_HNK.dtype in _PREFIX
        and x_HMK.device.type == "cpu"
        and x_HMK.stride(2) == 1
        and w_HNK.stride(2) == 1
        and (out_HMN is None or (out_HMN.stride(2) == 1 and out_HMN.dtype == torch.float32))
        and available()
    ):
        return None
    if out_HMN is None:
        out_HMN = torch.empty(H, M, N, dtype=torch.float32)
    _entry("head_gemm_nt_small", w_HNK.dtype)(
        H,
        M,
        N,
        K,
        x_HMK.data_ptr(),
        x_HMK.stride(0),
        x_HMK.stride(1),
        w_HNK.data_ptr(),
        w_HNK.stride(0),
        w_HNK.stride(1),
        out_HMN.data_ptr(),
        out_HMN.stride(0),
        out_HMN.stride(1),
        _wide(avx512),
    )
    return out_HMN


def bind_head_gemm(w_HNK: torch.Tensor) -> BoundHeadGemm | None:
    """:func:`head_gemm_nt` with its fp32 or bf16 weight bound; None where the kernel does not
    take it."""
    ok = w_HNK.dtype in _PREFIX and w_HNK.device.type == "cpu" and w_HNK.is_contiguous()
    if not (ok and available()):
        return None
    return BoundHeadGemm.dense(_entry("head_gemm_nt_small", w_HNK.dtype), w_HNK, int(wide()))
