"""MLA's absorbed weights as int8 codes with their scales, exactly as a quantized
``kv_b_proj`` holds them (``ops/cpu/int8.c``'s per-head products read this form).

Both absorbed weights are blocks of ``kv_b_proj``'s rows: per head, ``R`` rows of ``C``
codes, each group of ``group`` columns of a row with its own scale (int8: one group, the row's
scale; int4: its codes less their zero point, int4's groups). A weight ``w [H, N, K]`` (N
outputs, K inputs, as the per-head GEMMs take it) is held input-major, ``q [H, K, N]``, so
the kernel runs along the stored rows with its outputs in the vector lanes:

    W_UK [H, C, N]   (:meth:`HeadCodes.columns`) kv_b_proj's rows as stored, input r, output
                     c: w[h, c, r] = q[h, r, c] * scale[h, r, c // group]   (``grouped_out``)
    W_UV [H, V, C]   (:meth:`HeadCodes.rows`) the rows transposed, input c, output v:
                     w[h, v, c] = q[h, c, v] * scale[h, c // group, v]

One byte a weight plus the scales: a quarter of the fp32 bytes the absorbed weights streamed
a decode step before (the benchmark model: 24 of int4's 131 MB a step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, eq=False)
class HeadCodes:
    """One absorbed weight in the module's form: ``q [H, K, N]`` int8, ``scale`` fp32
    ``[H, K, N / group]`` (``grouped_out``: the groups run along the outputs) or
    ``[H, K / group, N]`` (along the inputs). ``weight_format``: the format whose per-head
    products take it (``ops/formats/int8.py``; the codes are int8 for int4's weights too)."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int
    grouped_out: bool
    weight_format: str = "int8"
    dtype: ClassVar[torch.dtype] = torch.int8

    def __post_init__(self) -> None:
        H, K, N = self.q.shape if self.q.dim() == 3 else (0, 0, 0)
        along = N if self.grouped_out else K
        ok = self.q.dtype == torch.int8 and H > 0 and self.group > 0 and along % self.group == 0
        want = (H, K, N // self.group) if self.grouped_out else (H, K // self.group, N)
        if not (ok and tuple(self.scale.shape) == want and self.scale.dtype == torch.float32):
            layout = "[H, K, N / group]" if self.grouped_out else "[H, K / group, N]"
            raise ValueError(
                f"HeadCodes needs int8 codes [H, K, N] and fp32 scales {layout}; got codes "
                f"{self.q.dtype} {tuple(self.q.shape)}, scales {self.scale.dtype} "
                f"{tuple(self.scale.shape)}, group {self.group}"
            )

    @staticmethod
    def rows(codes_HRC: torch.Tensor, scale_HRJ: torch.Tensor) -> HeadCodes:
        """The weight ``[H, R, C]`` of the rows (each group of ``C / J`` columns times its
        scale), held transposed."""
        group = codes_HRC.shape[-1] // scale_HRJ.shape[-1]
        q = codes_HRC.transpose(1, 2).contiguous()
        return HeadCodes(q, scale_HRJ.float().transpose(1, 2).contiguous(), group, False)

    @staticmethod
    def columns(codes_HRC: torch.Tensor, scale_HRJ: torch.Tensor) -> HeadCodes:
        """The transpose ``[H, C, R]`` of :meth:`rows`' weight: the rows as stored."""
        group = codes_HRC.shape[-1] // scale_HRJ.shape[-1]
        return HeadCodes(codes_HRC.contiguous(), scale_HRJ.float().contiguous(), group, True)

    def __repr__(self) -> str:
        along = "outputs" if self.grouped_out else "inputs"
        return f"HeadCodes(shape={tuple(self.shape)}, a scale per {self.group} {along})"

    @property
    def shape(self) -> torch.Size:
        """``[H, N, K]``: the weight as the per-head GEMMs take it."""
        H, K, N = self.q.shape
        return torch.Size((H, N, K))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return 3

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors a kernel reads (for the bound calls' address checks)."""
        return self.q, self.scale

    def scaled_kn(self) -> torch.Tensor:
        """The weight input-major, ``[H, K, N]`` fp32: each code times its scale."""
        dim = 2 if self.grouped_out else 1
        return self.q.float() * self.scale.repeat_interleave(self.group, dim=dim)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight :attr:`shape`."""
        return self.scaled_kn().transpose(1, 2).to(dtype)
