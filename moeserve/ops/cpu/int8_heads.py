"""MLA's absorbed per-head products on int8 codes (``int8.c``'s ``head_rows`` and
``head_cols``) and their pure-torch reference.

The weight is a :class:`~moeserve.quant.head_codes.HeadCodes` (the int8 and int4 formats'
absorbed ``W_UK``/``W_UV``), blocks of ``kv_b_proj``'s rows as stored:

    W_UV (rows)         for each head, each panel of 8 rows runs ``int8.c``'s few-row dots
                        over each group of columns (the int8 GEMM's body), times the group's
                        scales
    W_UK (transposed)   the output runs along the stored rows: for each head and block of
                        output columns, down the rows (64-128 of them), each token value
                        times its row's scale broadcast against the row's codes (no
                        horizontal sums, no transposed copy)

fp32 throughout: the dense weight's product up to the order of the sums. One body per ISA, as
``int8.c``'s (AVX2, AVX-512F, NEON/SVE).
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
    """Reference: ``x[h] @ w[h].T`` in fp32 (rows: group by group, as the kernel sums)."""
    x = x_HMK.float()
    q = w.q.float()
    if w.transposed:  # y[h, m, c] = sum_r x[h, m, r] * scale[h, r, c // g] * q[h, r, c]
        return torch.bmm(x, q * w.scale.repeat_interleave(w.group, dim=2))
    g = w.group
    out = torch.zeros(x.shape[0], x.shape[1], q.shape[1], dtype=torch.float32, device=x.device)
    for j in range(q.shape[2] // g):
        cols = slice(j * g, (j + 1) * g)
        out += torch.bmm(x[..., cols], q[..., cols].transpose(1, 2)) * w.scale[:, j, None, :]
    return out


@lru_cache(maxsize=1)
def _functions() -> tuple | None:
    """``(rows, transposed)`` kernel functions, or None without the library."""
    lib = int8._library()
    if lib is None:
        return None
    args = (I64, I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, PTR, I64, I64, INT)
    for name in ("moeserve_int8_head_rows_small", "moeserve_int8_head_cols_small"):
        build.declare(lib, name, *args)
    return lib.moeserve_int8_head_rows_small, lib.moeserve_int8_head_cols_small


def available() -> bool:
    return _functions() is not None


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
    codes_HRC: torch.Tensor, scale_HRJ: torch.Tensor, N: int
) -> tuple[HeadCodes, HeadCodes] | None:
    """MLA's absorbed ``(W_UK [H, C, N], W_UV [H, V, C])`` from ``kv_b_proj``'s codes
    ``[H, N + V, C]`` and scales ``[H, N + V, J]`` (each of a row's J groups of columns; each
    head's first N rows are W_UK's), where the kernels take them; else None."""
    if codes_HRC.device.type != "cpu" or not available():
        return None
    uk = HeadCodes.columns(codes_HRC[:, :N], scale_HRJ[:, :N])
    uv = HeadCodes.rows(codes_HRC[:, N:], scale_HRJ[:, N:])
    return uk, uv


def _call(w: HeadCodes) -> tuple:
    """The kernel of ``w``'s form and its weight arguments."""
    fn = _functions()[1 if w.transposed else 0]
    return fn, (w.q.data_ptr(), w.q.stride(0), w.q.stride(1), w.scale.data_ptr(), w.group)


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
    fn, w_args = _call(w)
    fn(
        H, M, N, K, x_HMK.data_ptr(), x_HMK.stride(0), x_HMK.stride(1), *w_args,
        out_HMN.data_ptr(), out_HMN.stride(0), out_HMN.stride(1),
        int(wide() if avx512 is None else avx512),
    )  # fmt: skip
    return out_HMN


def bind_head_gemm(w: HeadCodes) -> BoundHeadGemm | None:
    """:func:`head_gemm_nt` with ``w`` bound; None where the kernel does not take it."""
    if not weight_ok(w):
        return None
    fn, w_args = _call(w)
    return BoundHeadGemm(fn, w, w_args, int(wide()), pointers(*w.tensors()))
