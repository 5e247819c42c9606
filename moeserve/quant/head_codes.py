"""MLA's absorbed weights as int8 codes with their scales, exactly as a quantized
``kv_b_proj`` holds them (``ops/cpu/int8.c``'s per-head products read this form).

Both absorbed weights are blocks of ``kv_b_proj``'s rows: per head, ``R`` rows of ``C`` codes
``q [H, R, C]`` int8, each group of ``group`` columns of a row with its own scale (int8: one
group, the row's scale; int4: its codes less their zero point, int4's groups). So

    W_UV [H, V, C]   the rows themselves (``transposed`` False):
                     w[h, r, c] = q[h, r, c] * scale[h, c // group, r]
    W_UK [H, C, N]   their transpose (``transposed`` True):
                     w[h, c, r] = q[h, r, c] * scale[h, r, c // group]

each scale laid out as its kernel reads it (``ops/cpu/int8_heads.py``): W_UV's per group of
columns over the rows, W_UK's per row. A quarter of the fp32 bytes the absorbed weights
streamed a decode step before (the benchmark model: 24 of int4's 131 MB a step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, eq=False)
class HeadCodes:
    """One absorbed weight in the module's form. ``weight_format``: the format whose per-head
    products take it (``ops/formats/int8.py``; the codes are int8 for int4's weights too)."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int
    transposed: bool = False
    weight_format: str = "int8"
    dtype: ClassVar[torch.dtype] = torch.int8

    def __post_init__(self) -> None:
        H, R, C = self.q.shape if self.q.dim() == 3 else (0, 0, 0)
        J = C // self.group if self.group > 0 else 0
        want = (H, R, J) if self.transposed else (H, J, R)
        ok = self.q.dtype == torch.int8 and H > 0 and J > 0 and C % self.group == 0
        if not (ok and tuple(self.scale.shape) == want and self.scale.dtype == torch.float32):
            layout = "[H, R, C / group]" if self.transposed else "[H, C / group, R]"
            raise ValueError(
                f"HeadCodes needs int8 codes [H, R, C] and fp32 scales {layout}; got codes "
                f"{self.q.dtype} {tuple(self.q.shape)}, scales {self.scale.dtype} "
                f"{tuple(self.scale.shape)}, group {self.group}"
            )

    @staticmethod
    def rows(codes_HRC: torch.Tensor, scale_HRJ: torch.Tensor) -> HeadCodes:
        """The weight ``[H, R, C]`` of the rows: each group of ``C / J`` columns times its
        scale."""
        J = scale_HRJ.shape[-1]
        scale = scale_HRJ.float().transpose(1, 2).contiguous()
        return HeadCodes(codes_HRC.contiguous(), scale, codes_HRC.shape[-1] // J)

    @staticmethod
    def columns(codes_HRC: torch.Tensor, scale_HRJ: torch.Tensor) -> HeadCodes:
        """The transpose ``[H, C, R]`` of :meth:`rows`' weight."""
        J = scale_HRJ.shape[-1]
        scale = scale_HRJ.float().contiguous()
        return HeadCodes(codes_HRC.contiguous(), scale, codes_HRC.shape[-1] // J, True)

    def __repr__(self) -> str:
        form = "transposed rows" if self.transposed else "rows"
        return f"HeadCodes(shape={tuple(self.shape)}, {form}, a scale per {self.group} columns)"

    @property
    def shape(self) -> torch.Size:
        H, R, C = self.q.shape
        return torch.Size((H, C, R) if self.transposed else (H, R, C))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return 3

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors a kernel reads (for the bound calls' address checks)."""
        return self.q, self.scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight :attr:`shape`."""
        if self.transposed:
            w = self.q.float() * self.scale.repeat_interleave(self.group, dim=2)
            return w.transpose(1, 2).to(dtype)
        w = self.q.float() * self.scale.repeat_interleave(self.group, dim=1).transpose(1, 2)
        return w.to(dtype)
