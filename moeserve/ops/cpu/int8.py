"""The weight-only int8 kernels of ``int8.c`` and their pure-torch references.

Weights are :class:`~moeserve.quant.int8.Int8Tensor` rows (``q [N, K]`` int8, ``scale [N]``
fp32); activations and outputs are fp32. The kernels take at most ``MAX_ROWS`` token rows;
``ops/cpu/build.py`` compiles and loads the source, and when that is not possible
:func:`available` is False and callers use the references. Each kernel exists for AVX2+FMA
and for AVX-512F; :func:`wide` picks AVX-512F where the CPU has it (``MOESERVE_CPU_AVX512=0``
keeps AVX2).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import I64, INT, PTR
from moeserve.ops.cpu.kernels import few_rows, moe_call_buffers, wide  # shared with fp32
from moeserve.quant.int8 import Int8Tensor

_SOURCE = Path(__file__).with_name("int8.c")
MAX_ROWS = 64


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
) -> torch.Tensor:
    """Reference of :func:`moe_experts`: rows sorted by expert (``counts[i]`` rows for
    ``experts[i]``) through their expert's gated FFN with :func:`linear_int8_ref`, each scaled
    by its routing weight."""
    F2 = w13.shape[1]
    y_RD = torch.empty(x_RD.shape, dtype=torch.float32, device=x_RD.device)
    start = 0
    for e, n in zip(experts, counts):
        rows = slice(start, start + n)
        gate, up = linear_int8_ref(x_RD[rows], w13.q[e], w13.scale[e]).split(F2 // 2, dim=-1)
        y_RD[rows] = linear_int8_ref(F.silu(gate) * up, w2.q[e], w2.scale[e])
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
    """Whether :func:`gemm_nt` runs the kernel for these operands."""
    return few_rows(x, MAX_ROWS) and _rows_ok(w) and available()


def gemm_nt(
    x: torch.Tensor, w: Int8Tensor, out: torch.Tensor | None = None, avx512: bool | None = None
) -> torch.Tensor:
    """``(x @ w.q.T) * w.scale`` for ``x [M, K]`` fp32 (M <= MAX_ROWS), ``w`` of ``[N, K]``.

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


def dequantize_into(w: Int8Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = w.q * w.scale[:, None]`` (fp32 ``[N, K]``, unit-stride rows) with the kernel;
    the reference is ``Int8Tensor.dequantize``. The caller checks :func:`available`."""
    N, K = w.q.shape
    _library().moeserve_int8_dequant(
        N, K, w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr(), out.data_ptr(), out.stride(0)
    )
    return out


def moe_usable(x_RD: torch.Tensor, counts: list[int], w13: Int8Tensor, w2: Int8Tensor) -> bool:
    """Whether :func:`moe_experts` runs the kernel for these operands."""
    return (
        0 < max(counts, default=0) <= MAX_ROWS
        and x_RD.dtype == torch.float32
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and all(t.is_contiguous() for t in (w13.q, w13.scale, w2.q, w2.scale))
        and w13.q.device.type == "cpu"
        and available()
    )


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
    ``[E, 2F, D]``, ``w2`` ``[E, D, F]``), each times its routing weight, in one kernel call;
    ``avx512`` overrides :func:`wide`. The reference is :func:`moe_int8_ref`."""
    D, F_ = x_RD.shape[1], w2.q.shape[2]
    meta, weight_R, h, y = moe_call_buffers(x_RD.shape[0], D, F_, experts, counts, weight_R)
    _library().moeserve_int8_moe_small(
        len(experts),
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
    return y
