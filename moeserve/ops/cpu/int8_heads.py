"""MLA's absorbed per-head products on int8 codes (``int8.c``'s ``head_gemm``) and their
pure-torch reference.

The weight is a :class:`~moeserve.quant.head_codes.HeadCodes` (the int8 and int4 formats'
absorbed ``W_UK``/``W_UV``), held input-major: for each head and block of 4 vectors of
outputs, the kernel runs down the stored rows (64-512 of them) once per block of token rows,
each row's codes times their scales (W_UK: a scale per row and group of outputs; W_UV: a
vector of them per group of rows), then a broadcast of each token value and an FMA per vector:
no horizontal sums, no transposed reads. With more token rows than one register block, a
job's scaled codes are converted once into fp32. fp32 throughout: the dense weight's product
up to the order of the sums. One body per ISA, as ``int8.c``'s (AVX2, AVX-512F, NEON/SVE).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from moeserve.ops.cpu import build, int8
from moeserve.ops.cpu.bound import BoundHeadGemm, pointers
from moeserve.ops.cpu.build import I64, INT, PTR
from moeserve.ops.cpu.fp32 import wide
from moeserve.quant.head_codes import HeadCodes


def head_gemm_ref(x_HMK: torch.Tensor, w: HeadCodes) -> torch.Tensor:
    """Reference: ``x[h] @ w[h].T`` in fp32, each code times its scale first, as the kernel."""
    return torch.bmm(x_HMK.float(), w.scaled_kn())


@lru_cache(maxsize=1)
def _function():
    """The kernel function, or None without the library."""
    lib = int8._library()
    if lib is None:
        return None
    build.declare(
        lib,
        "moeserve_int8_head_gemm_small",
        *(I64, I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, INT, PTR, I64, I64, INT),
    )
    return lib.moeserve_int8_head_gemm_small


def available() -> bool:
    return _function() is not None


def weight_ok(w) -> bool:
    """Whether the kernels take ``w``: a HeadCodes of contiguous CPU tensors, a build here."""
    return (
        isinstance(w, HeadCodes)
        and w.device.type == "cpu"
        and all(t.is_contiguous() for t in w.tensors())
        and available()
    )


def usable(x_HMK: torch.Tensor, w: HeadCodes) -> bool:
    """Whether :func:`head_gemm_nt` runs the kernel: fp32 ``x [H, M, K]`` with unit-stride
    rows, any M."""
    return (
        x_HMK.dtype == torch.float32
        and x_HMK.device.type == "cpu"
        and x_HMK.dim() == 3
        and x_HMK.shape[0] == w.shape[0]
        and x_HMK.shape[1] > 0
        and x_HMK.shape[2] == w.shape[2]
        and x_HMK.stride(2) == 1
        and weight_ok(w)
    )


def absorbed(
    codes_HRC: torch.Tensor, scale_HRJ: torch.Tensor, N: int, dtype: torch.dtype
) -> tuple[HeadCodes, HeadCodes] | None:
    """MLA's absorbed ``(W_UK [H, C, N], W_UV [H, V, C])`` from ``kv_b_proj``'s codes
    ``[H, N + V, C]`` and scales ``[H, N + V, J]`` (each of a row's J groups of columns; each
    head's first N rows are W_UK's), where the kernels take them: on the CPU, for a model
    whose activations (``dtype``) are fp32, as the kernels'; else None."""
    if codes_HRC.device.type != "cpu" or dtype != torch.float32 or not available():
        return None
    uk = HeadCodes.columns(codes_HRC[:, :N], scale_HRJ[:, :N])
    uv = HeadCodes.rows(codes_HRC[:, N:], scale_HRJ[:, N:])
    return uk, uv


def _w_args(w: HeadCodes) -> tuple:
    """The kernel's weight arguments: codes, their head and row strides, scales, group and
    where the groups run."""
    q = w.q
    return (q.data_ptr(), q.stride(0), q.stride(1), w.scale.data_ptr(), w.group, int(w.grouped_out))


def head_gemm_nt(
    x_HMK: torch.Tensor,
    w: HeadCodes,
    out_HMN: torch.Tensor | None = None,
    avx512: bool | None = None,
) -> torch.Tensor:
    """``x[h] @ w[h].T`` for every head in one call (``out_HMN``, fp32 with unit-stride rows,
    receives it when given); ``avx512`` overrides :func:`wide`. The caller checks
    :func:`usable`; the reference is :func:`head_gemm_ref`."""
    H, M, K = x_HMK.shape
    N = w.shape[1]
    if out_HMN is None:
        out_HMN = torch.empty(H, M, N, dtype=torch.float32)
    _function()(
        H, M, N, K, x_HMK.data_ptr(), x_HMK.stride(0), x_HMK.stride(1), *_w_args(w),
        out_HMN.data_ptr(), out_HMN.stride(0), out_HMN.stride(1),
        int(wide() if avx512 is None else avx512),
    )  # fmt: skip
    return out_HMN


def bind_head_gemm(w: HeadCodes) -> BoundHeadGemm | None:
    """:func:`head_gemm_nt` with ``w`` bound; None where the kernel does not take it."""
    if not weight_ok(w):
        return None
    return BoundHeadGemm(_function(), w, _w_args(w), int(wide()), pointers(*w.tensors()))
