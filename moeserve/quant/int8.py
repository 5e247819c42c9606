"""Weight-only int8 with one fp32 scale per output row (symmetric, per-output-channel).

    w[..., n, k] ~= q[..., n, k] * scale[..., n]      q in [-127, 127], scale = max_k |w| / 127

A ``[N, K]`` weight keeps the ``[N, K]`` row-major layout the kernels stream
(``ops/cpu/int8.c``). Rows quantize independently, so any slice of rows (a fused layer's gate
or up half, an expert slot, a tensor-parallel shard) is quantized on its own as it is loaded.

:class:`Int8Weight` is the module a layer holds instead of its fp32 ``nn.Parameter`` (its
``q`` and ``scale`` are parameters, so they move and count like any weight);
:class:`Int8Tensor` is a view of rows of it. Both answer what the weight loaders ask of a
parameter (``shape``, ``w[rows]``, ``copy_``, ``zero_``), so the layers' ``weight_specs`` load
int8 weights unchanged: ``copy_`` quantizes the rows it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

QMAX = 127
_BLOCK_ROWS = 1024  # rows quantized at a time: bounds the fp32 temporaries of a big tensor


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [..., N, K], scale fp32 [..., N])`` of ``w`` (any float dtype), row by row:
    ``scale = max|row| / 127``, ``q = round(row / scale)``; an all-zero row gets scale 0 and
    q 0. Raises ValueError on non-finite values."""
    if w.dim() < 1 or not w.is_floating_point():
        raise ValueError(f"int8 quantization needs a float tensor, got {w.dtype} {tuple(w.shape)}")
    K = w.shape[-1]
    rows = w.reshape(-1, K)
    q = torch.empty(rows.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=w.device)
    for r0 in range(0, rows.shape[0], _BLOCK_ROWS):
        blk = rows[r0 : r0 + _BLOCK_ROWS].float()
        amax = blk.abs().amax(dim=1) if K else blk.new_zeros(blk.shape[0])
        if not torch.isfinite(amax).all():
            raise ValueError("cannot quantize a weight with inf or nan values to int8")
        s = amax / QMAX
        safe = torch.where(amax > 0, s, torch.ones_like(s))
        # out of place: blk may be the caller's tensor (float() of fp32 does not copy)
        q_blk = torch.div(blk, safe[:, None]).round_().clamp_(-QMAX, QMAX)
        q[r0 : r0 + blk.shape[0]] = q_blk.to(torch.int8)
        scale[r0 : r0 + blk.shape[0]] = s
    return q.view(w.shape), scale.view(w.shape[:-1])


@dataclass(frozen=True)
class Int8Tensor:
    """Rows of an int8 weight: ``q [..., N, K]`` int8 and ``scale [..., N]`` fp32, views of the
    owning :class:`Int8Weight`'s storage (writes go through). ``weight_format``: the name of
    the format it is held for (``ops/formats``): ``int8``, or ``w8a8_int8``, where each GEMM
    with this weight quantizes its input rows to int8 per token too."""

    q: torch.Tensor
    scale: torch.Tensor
    weight_format: str = "int8"
    dtype: ClassVar[torch.dtype] = torch.int8

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.scale.shape != self.q.shape[:-1]:
            raise ValueError(
                f"Int8Tensor needs int8 q [..., N, K] and scale [..., N], got q {self.q.dtype} "
                f"{tuple(self.q.shape)} and scale {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return self.q.dim()

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors that hold the weight (what an expert move copies per slot)."""
        return self.q, self.scale

    def __getitem__(self, index) -> Int8Tensor:
        """Rows or leading dims only (``w[a:b]``, ``w[s, rows]``): a scale covers a whole row,
        so the last (K) dim cannot be cut."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) >= self.q.dim() or not all(isinstance(i, (int, slice)) for i in idx):
            raise IndexError(
                f"an int8 weight of shape {tuple(self.shape)} can be indexed by ints and "
                f"slices over its leading dims only, got {index!r}"
            )
        return Int8Tensor(self.q[idx], self.scale[idx], self.weight_format)

    def copy_(self, w: torch.Tensor) -> Int8Tensor:
        """Quantize ``w`` (same shape, any float dtype) into these rows."""
        if tuple(w.shape) != tuple(self.shape):
            raise ValueError(
                f"cannot load a tensor of shape {tuple(w.shape)} into int8 rows of shape "
                f"{tuple(self.shape)}"
            )
        q, scale = quantize_rows(w)
        self.q.copy_(q)
        self.scale.copy_(scale)
        return self

    def zero_(self) -> Int8Tensor:
        self.q.zero_()
        self.scale.zero_()
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale`` as a dense tensor (computed in fp32)."""
        return (self.q.float() * self.scale.unsqueeze(-1)).to(dtype)


class Int8Weight(nn.Module):
    """An int8 weight held by a layer in place of its fp32 parameter: parameters ``q`` (int8,
    the weight's shape) and ``scale`` (fp32, the shape without the last dim). Indexing,
    ``copy_`` and ``zero_`` act on :attr:`data`. ``weight_format``: see :class:`Int8Tensor`."""

    dtype: ClassVar[torch.dtype] = torch.int8

    def __init__(
        self,
        shape: tuple[int, ...],
        device: torch.device | str | None = None,
        weight_format: str = "int8",
    ) -> None:
        super().__init__()
        self.weight_format = weight_format
        if len(shape) < 2:
            raise ValueError(f"an int8 weight needs [..., N, K], got shape {tuple(shape)}")
        self.q = nn.Parameter(
            torch.empty(shape, dtype=torch.int8, device=device), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.zeros(shape[:-1], dtype=torch.float32, device=device), requires_grad=False
        )
        self._data = Int8Tensor(self.q, self.scale, weight_format)

    @property
    def data(self) -> Int8Tensor:
        """The rows as an :class:`Int8Tensor` (made once: every projection call asks)."""
        d, p = self._data, self._parameters
        if d.q is not p["q"] or d.scale is not p["scale"]:  # parameters were replaced
            d = self._data = Int8Tensor(p["q"], p["scale"], self.weight_format)
        return d

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return self.q.dim()

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.parts()

    def __getitem__(self, index) -> Int8Tensor:
        return self.data[index]

    def copy_(self, w: torch.Tensor) -> Int8Tensor:
        return self.data.copy_(w)

    def zero_(self) -> Int8Tensor:
        return self.data.zero_()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.dequantize(dtype)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, weight_format={self.weight_format}"


def as_int8(w) -> Int8Tensor | None:
    """The :class:`Int8Tensor` behind ``w``, or None for a dense tensor."""
    if isinstance(w, Int8Weight):
        return w.data
    return w if isinstance(w, Int8Tensor) else None
