"""RMSNorm, computed in fp32 as the reference implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu.bound import Guard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        # the kernel for decode rows with the weight bound, on first use
        self._kernel: fp32_kernels.BoundRMSNorm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if x.dim() == 2:
                y = self.decode_rows(x)
            else:  # per-head norms (Qwen's q/k norm): rows of the last dim
                y = self.decode_rows(x.reshape(-1, x.shape[-1]))
                y = None if y is None else y.view(x.shape)
            if y is not None:
                return y
            # one fused op; the same arithmetic as the reference path below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def decode_rows(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The kernel (``fp32.c``) for a few fp32 rows ``x [M, D]`` with unit-stride rows
        (a column slice is fine), into ``out [M, D]`` when given; None when it does not apply
        (the caller then runs ``F.rms_norm``, the reference)."""
        k = self.bound()
        return None if k is None else k(x, out)

    def bound_guard(self) -> Guard:
        """What :meth:`bound` checks, as a guard (``ops/cpu/bound.py``): it holds while
        :meth:`bound` would return the kernel it returned last."""
        k = self._kernel
        same = ((self, "_kernel", k), (self, "weight", self.weight))
        return Guard(same, () if k is None else ((k.weight, k.ptr),))

    def bound(self) -> fp32_kernels.BoundRMSNorm | None:
        """The kernel with this norm's weight bound (bound again where the weight was replaced
        or moved); None where it does not take the weight."""
        k = self._kernel
        if k is None or not k.fresh(self.weight):
            k = self._kernel = fp32_kernels.BoundRMSNorm.bind(self.weight, self.eps)
        return k
