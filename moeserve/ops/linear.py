"""``linear(x, w, bias)``: the projection every layer calls, dispatched to the fastest kernel.

Few-row fp32 inputs on AVX2 CPUs (decode) go to the streaming kernel in
``ops/cpu/kernels.c``; everything else, and the reference, is ``F.linear``. Int8 weights
(``quant/int8.py``) go to ``ops/linear_int8.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import kernels
from moeserve.ops.linear_int8 import linear_int8, linear_int8_into
from moeserve.quant.int8 import as_int8


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [..., K]``, ``w [N, K]`` (dense or int8)."""
    if (q := as_int8(w)) is not None:
        return linear_int8(x, q, bias)
    if kernels.usable(x, w):
        y = kernels.gemm_nt(x, w)
        return y if bias is None else y.add_(bias)
    return F.linear(x, w, bias)


def linear_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ w.T`` without an intermediate for the kernel path."""
    if (q := as_int8(w)) is not None:
        return linear_int8_into(x, q, out)
    if kernels.usable(x, w) and out.stride(-1) == 1:
        return kernels.gemm_nt(x, w, out=out)
    return torch.matmul(x, w.t(), out=out)
