"""``linear(x, w, bias)``: the projection every layer calls, dispatched to the fastest kernel.

Few-row fp32 inputs on AVX2 CPUs (decode) go to the streaming kernel in
``ops/cpu/kernels.c``; everything else, and the reference, is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import kernels


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [..., K]``, ``w [N, K]``."""
    if kernels.usable(x, w):
        y = kernels.gemm_nt(x, w)
        return y if bias is None else y.add_(bias)
    return F.linear(x, w, bias)


def linear_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ w.T`` without an intermediate for the kernel path."""
    if kernels.usable(x, w) and out.stride(-1) == 1:
        return kernels.gemm_nt(x, w, out=out)
    return torch.matmul(x, w.t(), out=out)
