"""Group-wise 4-bit weights: each run of ``group_size`` columns of a row has its own fp32 scale
and integer zero point.

    w[..., n, k] ~= (u[..., n, k] - zero[..., n, g]) * scale[..., n, g]     g = k // group_size

``u`` is a 4-bit code in [0, 15]. Symmetric (the default): ``zero`` is 8 and ``scale`` is
``max |w| / 7`` over the group, so the codes 1..15 stand for -7..7 steps. Asymmetric:
``scale = (max - min) / 15`` and ``zero = round(-min / scale)``, so the group's range maps onto
all 16 codes (AWQ's and GPTQ's form; their checkpoints load into the same layout,
``quant/int4_checkpoints.py``).

Layout, what the kernels (``ops/cpu/int4.c``) read: ``q [..., N, K / 2]`` uint8, each run of
32 columns in 16 bytes, byte ``j`` holding column ``j`` in its low nibble and column ``16 + j``
in its high one. One 16-byte load then gives 32 consecutive columns as two vectors (the low
and the high nibbles), for AVX-512 (16 lanes) and, in halves, AVX2 (8 lanes). ``scale`` is
``[..., N, K / group_size]`` fp32 and ``zero`` the same shape in uint8. So ``K`` must be a
multiple of 32 and of the group size (32, 64 or 128): a clear error otherwise.

Rows quantize independently, as int8's do (``quant/int8.py``): any slice of rows is quantized
on its own as it is loaded, and a tensor-parallel shard of the columns (a row-parallel layer)
is quantized after the loader cut it, its groups inside the shard. :class:`Int4Weight` is the
module a layer holds; :class:`Int4Tensor` a view of rows of it, answering what the loaders ask
of a parameter (``shape``, ``w[rows]``, ``copy_``, ``zero_``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from moeserve.ops.formats import INT4_GROUP_SIZES

BLOCK = 32  # columns packed together (16 bytes)
GROUP_SIZES = INT4_GROUP_SIZES  # 32, 64, 128
DEFAULT_GROUP_SIZE = 128
SYMMETRIC_ZERO = 8
_BLOCK_ROWS = 1024  # rows quantized at a time: bounds the fp32 temporaries


def check_group(K: int, group_size: int, what: str = "a weight") -> None:
    """Raise ValueError unless ``group_size`` is one of :data:`GROUP_SIZES` and divides
    ``K`` (the columns of ``what``)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
        )
    if K % group_size:
        raise ValueError(
            f"int4 group size {group_size} does not divide the {K} columns of {what} (under "
            "tensor parallelism, this rank's share of them): use a group size or a "
            "tensor-parallel size that keeps the groups whole, or another format"
        )


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``u [..., K]`` (each < 16, K a multiple of 32) as ``[..., K / 2]`` bytes in
    the kernels' layout (the module's doc)."""
    blocks = u.reshape(*u.shape[:-1], -1, 2, 16)
    return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).reshape(*u.shape[:-1], -1)


def unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """The codes ``[..., 2 * Kh]`` of packed bytes ``q [..., Kh]`` (inverse of
    :func:`pack_nibbles`)."""
    blocks = q.reshape(*q.shape[:-1], -1, 1, 16)
    both = torch.cat([blocks & 0x0F, blocks >> 4], dim=-2)
    return both.reshape(*q.shape[:-1], -1)


def quantize_groups(
    w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero)`` of ``w [..., N, K]`` (any float dtype) in the module's layout. An
    all-zero group gets scale 0. Raises ValueError for a group size that does not fit ``K``
    or non-finite values."""
    if w.dim() < 1 or not w.is_floating_point():
        raise ValueError(f"int4 quantization needs a float tensor, got {w.dtype} {tuple(w.shape)}")
    K = w.shape[-1]
    check_group(K, group_size)
    rows = w.reshape(-1, K)
    n_rows, n_groups = rows.shape[0], K // group_size
    q = torch.empty(n_rows, K // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n_rows, n_groups, dtype=torch.float32, device=w.device)
    zero = torch.empty(n_rows, n_groups, dtype=torch.uint8, device=w.device)
    for r0 in range(0, n_rows, _BLOCK_ROWS):
        g = rows[r0 : r0 + _BLOCK_ROWS].float().reshape(-1, n_groups, group_size)
        r1 = r0 + g.shape[0]
        if symmetric:
            amax = g.abs().amax(dim=-1)
            if not torch.isfinite(amax).all():
                raise ValueError("cannot quantize a weight with inf or nan values to int4")
            s = amax / 7
            z = torch.full_like(s, SYMMETRIC_ZERO)
        else:
            lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
            if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
                raise ValueError("cannot quantize a weight with inf or nan values to int4")
            s = (hi - lo) / 15
            safe = torch.where(s > 0, s, torch.ones_like(s))
            z = torch.round(-lo / safe).clamp_(0, 15)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        u = torch.round(g / safe[..., None]).add_(z[..., None]).clamp_(0, 15)
        q[r0:r1] = pack_nibbles(u.to(torch.uint8).reshape(g.shape[0], K))
        scale[r0:r1] = s
        zero[r0:r1] = z.to(torch.uint8)
    lead = w.shape[:-1]
    return q.view(*lead, K // 2), scale.view(*lead, n_groups), zero.view(*lead, n_groups)


def dequantize_groups(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(u - zero) * scale`` as a dense ``[..., N, K]`` tensor (computed in fp32)."""
    u = unpack_nibbles(q).float()
    group = u.shape[-1] // scale.shape[-1]
    g = u.view(*u.shape[:-1], -1, group)
    w = (g - zero.float().unsqueeze(-1)) * scale.unsqueeze(-1)
    return w.reshape(u.shape).to(dtype)


@dataclass(frozen=True)
class Int4Tensor:
    """Rows of an int4 weight: ``q [..., N, K / 2]`` packed codes, ``scale`` and ``zero``
    ``[..., N, K / group_size]``, views of the owning :class:`Int4Weight`'s storage (writes
    go through). ``symmetric``: how ``copy_`` quantizes."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    symmetric: bool = True
    weight_format: str = "int4"
    # GPTQ act-order: ``[..., K]`` (no N dim), the input column each stored column came from;
    # the GEMM reads ``x[:, perm]``. None: columns in order.
    perm: torch.Tensor | None = None
    dtype: ClassVar[torch.dtype] = torch.uint8

    def __post_init__(self) -> None:
        ok = (
            self.q.dtype == torch.uint8
            and self.zero.dtype == torch.uint8
            and self.scale.dtype == torch.float32
            and self.scale.shape == self.zero.shape
            and self.scale.shape[:-1] == self.q.shape[:-1]
            and self.scale.shape[-1] > 0
            and (2 * self.q.shape[-1]) % self.scale.shape[-1] == 0
        )
        if not ok:
            raise ValueError(
                "Int4Tensor needs uint8 q [..., N, K/2], fp32 scale and uint8 zero "
                f"[..., N, K/group]; got q {self.q.dtype} {tuple(self.q.shape)}, scale "
                f"{self.scale.dtype} {tuple(self.scale.shape)}, zero {self.zero.dtype} "
                f"{tuple(self.zero.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.q.shape[:-1], 2 * self.q.shape[-1]))

    @property
    def group_size(self) -> int:
        return 2 * self.q.shape[-1] // self.scale.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return self.q.dim()

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold the weight (what an expert move copies per slot)."""
        parts = (self.q, self.scale, self.zero)
        return parts if self.perm is None else (*parts, self.perm)

    def __getitem__(self, index) -> Int4Tensor:
        """Rows or leading dims only: a group runs along the last (K) dim, which cannot be
        cut."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) >= self.q.dim() or not all(isinstance(i, (int, slice)) for i in idx):
            raise IndexError(
                f"an int4 weight of shape {tuple(self.shape)} can be indexed by ints and "
                f"slices over its leading dims only, got {index!r}"
            )
        perm = self.perm
        if perm is not None:  # the perm has no row dim: only the dims before it index it
            lead = idx[: self.q.dim() - 2]
            perm = perm[lead] if lead else perm
        return Int4Tensor(
            self.q[idx], self.scale[idx], self.zero[idx], self.symmetric, self.weight_format, perm
        )

    def take(self, ids: torch.Tensor) -> Int4Tensor:
        """A contiguous copy of rows ``ids`` of a 2-D weight."""
        return Int4Tensor(
            self.q[ids].contiguous(),
            self.scale[ids].contiguous(),
            self.zero[ids].contiguous(),
            self.symmetric,
            self.weight_format,
            self.perm,
        )

    def copy_(self, w) -> Int4Tensor:
        """Quantize ``w`` (same shape, any float dtype) into these rows, or store a
        checkpoint's 4-bit weight (a ``PackedInt4``, ``quant/int4_checkpoints.py``) as it
        is."""
        if hasattr(w, "codes"):
            return self._store(w)
        if tuple(w.shape) != tuple(self.shape):
            raise ValueError(
                f"cannot load a tensor of shape {tuple(w.shape)} into int4 rows of shape "
                f"{tuple(self.shape)}"
            )
        q, scale, zero = quantize_groups(w, self.group_size, self.symmetric)
        self.q.copy_(q)
        self.scale.copy_(scale)
        self.zero.copy_(zero)
        return self

    def _store(self, packed) -> Int4Tensor:
        """A checkpoint's codes, scales and zero points as they are; with act-order, its
        column order, which rows sharing this weight's order (gate and up) must agree on."""
        if tuple(packed.codes.shape) != tuple(self.shape) or tuple(packed.scale.shape) != tuple(
            self.scale.shape
        ):
            raise ValueError(
                f"{packed.name}: 4-bit codes {tuple(packed.codes.shape)} with scales "
                f"{tuple(packed.scale.shape)} do not fit int4 rows of shape "
                f"{tuple(self.shape)} with scales {tuple(self.scale.shape)}: the checkpoint's "
                "group size differs from the weight's"
            )
        if packed.perm is not None:
            if self.perm is None:
                raise ValueError(
                    f"{packed.name}: an act-order weight, but this int4 weight was made "
                    "without a column order (the checkpoint's desc_act is false)"
                )
            held, want = self.perm, packed.perm.to(self.perm.dtype)
            identity = torch.arange(held.shape[-1], dtype=held.dtype)
            if not torch.equal(held, identity) and not torch.equal(held, want):
                raise ValueError(
                    f"{packed.name}: its act-order column order differs from the rows fused "
                    "with it (gate and up, or q, k and v, must share one)"
                )
            held.copy_(want)
        self.q.copy_(pack_nibbles(packed.codes))
        self.scale.copy_(packed.scale)
        self.zero.copy_(packed.zero)
        return self

    def zero_(self) -> Int4Tensor:
        self.q.zero_()
        self.scale.zero_()
        self.zero.zero_()
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_groups(self.q, self.scale, self.zero, dtype)

    def signed_codes(self) -> torch.Tensor:
        """The codes less their group's zero point, ``[..., N, K]`` int8 in [-15, 15] (in the
        stored column order): the weight is these times their group's scale."""
        u = unpack_nibbles(self.q).to(torch.int16)
        g = u.view(*u.shape[:-1], -1, self.group_size) - self.zero.to(torch.int16).unsqueeze(-1)
        return g.to(torch.int8).view(u.shape)


class Int4Weight(nn.Module):
    """An int4 weight held by a layer in place of its float parameter: parameters ``q``,
    ``scale`` and ``zero`` (the module's layout), and with ``act_order`` a column order
    ``perm`` (int32, ``[..., K]`` without the row dim; identity until a GPTQ act-order weight
    is stored). Indexing, ``copy_`` and ``zero_`` act on :attr:`data`. Raises ValueError when
    ``group_size`` does not fit the weight's columns."""

    dtype: ClassVar[torch.dtype] = torch.uint8

    def __init__(
        self,
        shape: tuple[int, ...],
        group_size: int = DEFAULT_GROUP_SIZE,
        symmetric: bool = True,
        device: torch.device | str | None = None,
        weight_format: str = "int4",
        act_order: bool = False,
    ) -> None:
        super().__init__()
        if len(shape) < 2:
            raise ValueError(f"an int4 weight needs [..., N, K], got shape {tuple(shape)}")
        *lead, K = shape
        check_group(K, group_size, f"a weight of shape {tuple(shape)}")
        self.weight_format, self.symmetric = weight_format, symmetric
        groups = (*lead, K // group_size)
        self.q = nn.Parameter(
            torch.empty(*lead, K // 2, dtype=torch.uint8, device=device), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.zeros(groups, dtype=torch.float32, device=device), requires_grad=False
        )
        self.zero = nn.Parameter(
            torch.full(groups, SYMMETRIC_ZERO, dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        self.perm = None
        if act_order:
            order = torch.arange(K, dtype=torch.int32, device=device)
            self.perm = nn.Parameter(order.expand(*lead[:-1], K).clone(), requires_grad=False)
        self._data = self._view()

    def _view(self) -> Int4Tensor:
        p = self._parameters
        return Int4Tensor(
            p["q"], p["scale"], p["zero"], self.symmetric, self.weight_format, p.get("perm")
        )

    @property
    def data(self) -> Int4Tensor:
        """The rows as an :class:`Int4Tensor` (made once: every projection call asks)."""
        d, p = self._data, self._parameters
        if d.q is not p["q"] or d.scale is not p["scale"] or d.perm is not p.get("perm"):
            d = self._data = self._view()  # parameters were replaced
        return d

    def drop_identity_order(self) -> bool:
        """Forget ``perm`` where it is the identity everywhere (no act-order weight was
        stored: the GEMM then skips the gather); returns whether it went."""
        p = self.perm
        if p is None:
            return False
        if not torch.equal(p, torch.arange(p.shape[-1], dtype=p.dtype).expand_as(p)):
            return False
        self.perm = None
        self._data = self._view()
        return True

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def group_size(self) -> int:
        return self.data.group_size

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return self.q.dim()

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.data.parts()

    def __getitem__(self, index) -> Int4Tensor:
        return self.data[index]

    def copy_(self, w: torch.Tensor) -> Int4Tensor:
        return self.data.copy_(w)

    def zero_(self) -> Int4Tensor:
        return self.data.zero_()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.dequantize(dtype)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"shape={tuple(self.shape)}, group_size={self.group_size}, {kind}"


def as_int4(w) -> Int4Tensor | None:
    """The :class:`Int4Tensor` behind ``w``, or None for any other weight."""
    if isinstance(w, Int4Weight):
        return w.data
    return w if isinstance(w, Int4Tensor) else None
