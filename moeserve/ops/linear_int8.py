"""``linear_int8(x, w)``: the projection with an int8 weight (:class:`Int8Tensor`), dispatched
to the fastest path; ``ops/linear.py`` sends int8 weights here.

    few rows (<= int8.MAX_ROWS), CPU   the kernel of ops/cpu/int8.c (AVX2 or AVX-512):
                                       streams q once
    any rows, AVX-512 CPU              the same call, from 24 rows the packed panels of
                                       ops/cpu/moe_packed.h: each 64-row panel converted into
                                       an fp32 buffer once, outer-product tiles over it
                                       (1.2-1.9x the blocks below at 512 rows)
    more rows (prefill), AVX2 CPU      blocks of weight rows dequantized into one reused fp32
                                       buffer that stays in cache, each block an MKL GEMM
                                       (as fast as dequantizing all first, without the
                                       full-size buffer: benchmarks/int8_gemm.py)
    anywhere else (CUDA, no kernels)   the reference, ops/cpu/int8.py: linear_int8_ref

Activations of another dtype (bf16) are computed in fp32 and cast back.

A w8a8_int8 weight (``act_int8``) multiplies the input rows quantized to int8 per token: on
AMX the int8 tile kernel of ``ops/cpu/amx_int8.c`` (any rows), elsewhere the rows rounded to
their int8 grids (``amx_int8.fake_quant``) through the paths above.
"""

from __future__ import annotations

import torch

from moeserve.ops.cpu import amx_int8
from moeserve.ops.cpu import int8 as kernels
from moeserve.quant.int8 import Int8Tensor

_BLOCK_BYTES = 1 << 20  # fp32 bytes of dequantized weight per block: stays in L2


def linear_int8(x: torch.Tensor, w: Int8Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(w).T (+ bias)`` for ``x [..., K]``, ``w`` of ``[N, K]``; the result has
    ``x``'s dtype."""
    if bias is None and not w.act_int8 and kernels.usable(x, w):  # decode: checked first
        return kernels.gemm_nt(x, w)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    y = _matmul(x2 if x2.dtype == torch.float32 else x2.float(), w, None)
    y = y.view(*x.shape[:-1], w.shape[0])
    if bias is not None:
        y = y.add_(bias)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def linear_int8_into(x: torch.Tensor, w: Int8Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ dequantize(w).T`` for 2-D fp32 ``x`` and ``out``."""
    if out.dtype == torch.float32 and out.stride(-1) == 1 and x.dtype == torch.float32:
        return _matmul(x, w, out)
    out.copy_(linear_int8(x, w))
    return out


def _matmul(x: torch.Tensor, w: Int8Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x [M, K]`` times int8 ``w [N, K]``; into ``out`` (unit-stride rows) if given."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.act_int8:
        if amx_int8.usable(x, w):
            return amx_int8.gemm_nt(x, w, out=out)
        x = amx_int8.fake_quant(x)
    if kernels.usable(x, w):
        return kernels.gemm_nt(x, w, out=out)
    M, N = x.shape[0], w.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if x.device.type == "cpu" and M > 0 and kernels.available() and w.q.stride(1) == 1:
        return _blocked(x, w, out)
    return out.copy_(kernels.linear_int8_ref(x, w.q, w.scale))


def _blocked(x: torch.Tensor, w: Int8Tensor, out: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    nb = max(16, min(N, _BLOCK_BYTES // (4 * max(K, 1))))
    buf = torch.empty(nb, K, dtype=torch.float32)
    for n0 in range(0, N, nb):
        n1 = min(N, n0 + nb)
        b = kernels.dequantize_into(w[n0:n1], buf[: n1 - n0])
        out[:, n0:n1] = x @ b.t()
    return out
