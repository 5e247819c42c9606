"""Published 4-bit checkpoints, read as they are: AWQ and GPTQ, decoded into int4's layout
(``quant/int4.py``) without a round trip through floats.

Each quantized ``X.weight [N, K]`` of such a checkpoint is stored as int32-packed tensors::

    AWQ (quant_method "awq", version "gemm")
        X.qweight  [K, N / 8]       8 codes per int32 along N, in AWQ's order: nibble i holds
                                    column 8c + (0 2 4 6 1 3 5 7)[i], so column 8c + j is in
                                    nibble (0 4 1 5 2 6 3 7)[j]
        X.qzeros   [K / G, N / 8]   the zero points, packed the same way
        X.scales   [K / G, N]       fp16
        w[n, k] = (code[k, n] - zero[k // G, n]) * scale[k // G, n]

    GPTQ (quant_method "gptq", AutoGPTQ / GPTQModel)
        X.qweight  [K / 8, N]       8 codes per int32 along K, nibble i = row 8r + i
        X.qzeros   [K / G, N / 8]   8 zero points per int32 along N, nibble i = column 8c + i;
                                    "gptq" (v1) stores (zero - 1) mod 16, "gptq_v2" the zero
        X.scales   [K / G, N]       fp16
        X.g_idx    [K]              the group of each input column (optional: k // G)
        w[n, k] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]

With GPTQ's act-order (``desc_act``) the groups are not runs of columns: ``g_idx`` sorts the
columns by how much they matter. Sorted by ``g_idx`` they are runs again, so the weight is
held with its columns in that order and ``perm`` (the column each stored column came from);
the GEMM then reads ``x[:, perm]`` (``ops/formats/int4.py``). GPTQ gives the same order to
layers that read the same input (gate and up, q and k and v), so fused rows share one.

A tensor-parallel shard of the columns must cut between groups; with act-order, columns
cannot be split at all (a shard would hold parts of groups): a clear error names the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeserve.quant.int4 import GROUP_SIZES, check_group

METHODS = ("awq", "gptq")
# AWQ writes column (0 2 4 6 1 3 5 7)[i] of each 8 into nibble i, so column j is in nibble:
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class Int4CheckpointError(ValueError):
    """A 4-bit checkpoint moeserve cannot read as it is, or whose tensors disagree with its
    config; one line naming the tensor or the setting."""


@dataclass(frozen=True)
class Int4CheckpointConfig:
    """A checkpoint's ``quantization_config`` for AWQ or GPTQ."""

    method: str  # awq | gptq
    group_size: int
    symmetric: bool  # GPTQ's sym (zero points all 8); AWQ: not zero_point
    act_order: bool  # GPTQ's desc_act
    zero_offset: int  # added to each stored zero point: GPTQ v1 stores zero - 1


def parse_int4_config(quant: dict[str, Any], source: str) -> Int4CheckpointConfig:
    """``quantization_config`` of an AWQ or GPTQ checkpoint; Int4CheckpointError naming the
    setting moeserve does not read (bits other than 4, AWQ's gemv or marlin packing, a
    group size int4 does not take, ...)."""
    method = quant.get("quant_method")
    if method not in METHODS:
        raise Int4CheckpointError(f"{source}: {method!r} is not a 4-bit method ({METHODS})")
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise Int4CheckpointError(
            f"{source}: {method} with {bits}-bit weights is not supported (4-bit only)"
        )
    group = quant.get("group_size", quant.get("q_group_size"))
    if not isinstance(group, int) or group not in GROUP_SIZES:
        raise Int4CheckpointError(
            f"{source}: {method} group_size {group!r} is not supported "
            f"(supported: {', '.join(map(str, GROUP_SIZES))})"
        )
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise Int4CheckpointError(
                f"{source}: AWQ version {version!r} is not supported (supported: gemm)"
            )
        return Int4CheckpointConfig("awq", group, not quant.get("zero_point", True), False, 0)
    fmt = str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise Int4CheckpointError(
            f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)"
        )
    return Int4CheckpointConfig(
        "gptq",
        group,
        bool(quant.get("sym", True)),
        bool(quant.get("desc_act", False)),
        1 if fmt == "gptq" else 0,
    )


def packed_names(base: str, method: str) -> tuple[str, ...]:
    """The checkpoint tensors that hold ``base.weight`` (the last, GPTQ's g_idx, may be
    absent)."""
    names = (f"{base}.qweight", f"{base}.qzeros", f"{base}.scales")
    return (*names, f"{base}.g_idx") if method == "gptq" else names


def expected_shapes(method: str, N: int, K: int, group: int) -> dict[str, tuple[int, ...]]:
    """What each packed tensor's shape must be for a ``[N, K]`` weight."""
    shapes = {
        "qweight": (K, N // 8) if method == "awq" else (K // 8, N),
        "qzeros": (K // group, N // 8),
        "scales": (K // group, N),
    }
    if method == "gptq":
        shapes["g_idx"] = (K,)
    return shapes


@dataclass(frozen=True)
class PackedInt4:
    """A 4-bit weight decoded from a checkpoint into int4's terms, ``[N, K]`` logically:
    ``codes [N, K]`` uint8 (the stored column order), ``scale``/``zero`` ``[N, K / G]``, and
    ``perm [K]`` (the column each stored column came from; None: in order)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    perm: torch.Tensor | None = None
    name: str = "a weight"

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def narrow(self, dim: int, start: int, length: int) -> PackedInt4:
        """Rows or columns ``[start, start + length)`` (a tensor-parallel shard). Columns only
        between groups, and never with act-order: Int4CheckpointError otherwise."""
        if dim == 0:
            return PackedInt4(
                self.codes.narrow(0, start, length),
                self.scale.narrow(0, start, length),
                self.zero.narrow(0, start, length),
                self.perm,
                self.name,
            )
        G = self.group_size
        if self.perm is not None:
            raise Int4CheckpointError(
                f"{self.name}: a GPTQ act-order (desc_act) weight cannot be split along its "
                "input columns (tensor parallelism of a row-parallel layer): its groups are "
                "spread over all columns; serve it with expert or data parallelism, or TP 1"
            )
        if start % G or (length % G and start + length < self.codes.shape[1]):
            raise Int4CheckpointError(
                f"{self.name}: a tensor-parallel shard of columns [{start}, {start + length}) "
                f"cuts a group of {G} columns; this layout cannot split the checkpoint's "
                "groups"
            )
        g0, g1 = start // G, -(-(start + length) // G)
        return PackedInt4(
            self.codes.narrow(1, start, length),
            self.scale[:, g0:g1],
            self.zero[:, g0:g1],
            None,
            self.name,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight in the checkpoint's column order (the formats' own
        formula: ``(code - zero) * scale`` per group, then un-permuted)."""
        G = self.group_size
        w = (self.codes.float() - self.zero.float().repeat_interleave(G, 1)) * (
            self.scale.repeat_interleave(G, 1)
        )
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w.to(dtype)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C]`` -> ``[..., C, 8]`` codes, nibble i at index i."""
    return ((packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def _along_n(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """``[R, N / 8]`` int32 packed along N -> ``[R, N]`` codes (AWQ's order or in order)."""
    nib = _nibbles(packed)  # [R, N/8, 8]: nibble i
    if awq:
        nib = nib[..., list(AWQ_NIBBLE_OF_COLUMN)]
    return nib.reshape(packed.shape[0], -1)


def decode(
    config: Int4CheckpointConfig, tensors: dict[str, torch.Tensor], N: int, K: int, name: str
) -> PackedInt4:
    """The packed tensors of ``name`` (keys qweight, qzeros, scales, and g_idx for GPTQ if
    the checkpoint has it) as a :class:`PackedInt4` of ``[N, K]``. Int4CheckpointError for
    shapes or dtypes that disagree with the config."""
    G = config.group_size
    try:
        check_group(K, G, name)
    except ValueError as e:
        raise Int4CheckpointError(f"{name}: {e}") from None
    if N % 8:
        raise Int4CheckpointError(f"{name}: {N} output rows are not a multiple of 8 codes")
    want = expected_shapes(config.method, N, K, G)
    for key, shape in want.items():
        t = tensors.get(key)
        if t is None:
            if key == "g_idx":
                continue
            raise Int4CheckpointError(f"{name}: {key} is missing from the checkpoint")
        if tuple(t.shape) != shape:
            raise Int4CheckpointError(
                f"{name}.{key}: expected shape {shape} for a [{N}, {K}] {config.method} weight "
                f"with group size {G}, got {tuple(t.shape)}: the packing disagrees with the "
                "quantization_config"
            )
        ok = t.is_floating_point() if key == "scales" else t.dtype in (torch.int32, torch.int64)
        if not ok:
            raise Int4CheckpointError(f"{name}.{key}: unexpected dtype {t.dtype}")
    awq = config.method == "awq"
    if awq:
        codes_KN = _along_n(tensors["qweight"], awq=True)
    else:
        codes_KN = _nibbles(tensors["qweight"]).permute(0, 2, 1).reshape(K, N)
    # v1 GPTQ wrote zero - 1 into 4 bits, so a zero point of 0 reads back as 15: wrap
    zeros_GN = (_along_n(tensors["qzeros"], awq).to(torch.int32) + config.zero_offset) & 0xF
    codes = codes_KN.t().contiguous()
    scale = tensors["scales"].float().t().contiguous()
    zero = zeros_GN.to(torch.uint8).t().contiguous()
    perm = None
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if not torch.equal(g_idx, torch.arange(K) // G):
            counts = torch.bincount(g_idx, minlength=K // G)
            if g_idx.min() < 0 or len(counts) != K // G or (counts != G).any():
                raise Int4CheckpointError(
                    f"{name}.g_idx: every group must hold {G} columns; the g_idx disagrees "
                    "with the group size"
                )
            perm = torch.argsort(g_idx, stable=True)
            codes = codes[:, perm].contiguous()
    return PackedInt4(codes, scale, zero, perm, name)
