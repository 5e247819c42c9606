"""Where a KV pool's bytes are, and the writes that copy a prompt's KV from one pool to another.

A pool (``kvcache/pool.py``) holds one ``[num_blocks * block_size, *token_shape]`` tensor per
layer, contiguous, so token slot ``s`` of layer ``l`` starts at ``layer_addrs[l] + s *
slot_bytes``. Token ``t`` of a sequence lives in slot ``block_table[t // block_size] *
block_size + t % block_size``.

MLA's latent (``[kv_lora_rank + qk_rope_head_dim]`` per token) is the same on every
tensor-parallel rank, so a prompt moves as whole runs of slots: consecutive tokens whose
slots are consecutive on both sides are one write, per layer (at best one write per layer
for the whole prompt; a block boundary where either side's next block is not the next block
id starts a new run).

GQA holds ``[2, kv_heads, head_dim]`` per token, the heads split over tensor-parallel ranks.
When both sides hold the same heads the slots move whole, as for MLA. When they split the
heads differently (prefill TP2, decode TP1, say) :func:`plan_writes` writes the heads the two
have in common straight into the destination: per token, one write for K and one for V
(adjacent tokens do not merge, since the destination's heads of one token are not next to
the next token's), ``2 * tokens * layers`` writes. The ranks do not send those:
``regroup.py`` moves the same bytes in a few writes per layer. :func:`plan_writes` returns
the source and destination addresses and lengths for one transfer engine batch;
:func:`copy_reference` does the same copy with torch indexing (the oracle of the tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MLA, GQA = "mla", "gqa"


@dataclass(frozen=True)
class PoolLayout:
    """One pool's addresses and shape, as the other side of a transfer needs them (JSON-able).

    ``kind``: ``mla`` (one latent vector per token) or ``gqa`` (``[2, heads, head_dim]`` per
    token). For GQA, ``head_start`` and ``num_heads`` say which of the model's
    ``total_heads`` KV heads this pool holds."""

    kind: str
    layer_addrs: tuple[int, ...]
    num_blocks: int
    block_size: int
    token_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    head_start: int = 0
    total_heads: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_addrs", tuple(self.layer_addrs))
        object.__setattr__(self, "token_shape", tuple(self.token_shape))
        if self.kind not in (MLA, GQA):
            raise ValueError(f"pool kind must be {MLA!r} or {GQA!r}, got {self.kind!r}")
        if self.kind == GQA:
            if len(self.token_shape) != 3 or self.token_shape[0] != 2:
                raise ValueError(f"a GQA pool holds [2, heads, head_dim], got {self.token_shape}")
            if not 0 <= self.head_start < self.head_start + self.num_heads <= self.total_heads:
                raise ValueError(
                    f"heads [{self.head_start}, {self.head_start + self.num_heads}) are not "
                    f"within the model's {self.total_heads}"
                )

    @property
    def slot_bytes(self) -> int:
        n = self.itemsize
        for s in self.token_shape:
            n *= s
        return n

    @property
    def num_heads(self) -> int:
        return self.token_shape[1] if self.kind == GQA else 0

    @property
    def head_bytes(self) -> int:
        return self.token_shape[2] * self.itemsize if self.kind == GQA else 0

    @property
    def pool_bytes(self) -> tuple[int, ...]:
        """Bytes of each layer's tensor (what the transfer engine registers)."""
        return (self.num_blocks * self.block_size * self.slot_bytes,) * len(self.layer_addrs)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "layer_addrs": list(self.layer_addrs),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "token_shape": list(self.token_shape),
            "dtype": self.dtype,
            "itemsize": self.itemsize,
            "head_start": self.head_start,
            "total_heads": self.total_heads,
        }

    @classmethod
    def from_json(cls, d: dict) -> PoolLayout:
        return cls(**d)

    @classmethod
    def of_pool(
        cls,
        caches: Sequence[torch.Tensor],
        block_size: int,
        kind: str,
        head_start: int = 0,
        total_heads: int = 0,
    ) -> PoolLayout:
        """The layout of a pool's per-layer tensors (each ``[slots, *token_shape]``,
        contiguous)."""
        first = caches[0]
        for c in caches:
            if not c.is_contiguous() or c.shape != first.shape or c.dtype != first.dtype:
                raise ValueError("every layer's cache must be contiguous and of one shape")
        slots = first.shape[0]
        if slots % block_size:
            raise ValueError(f"{slots} slots are not whole blocks of {block_size}")
        return cls(
            kind=kind,
            layer_addrs=tuple(c.data_ptr() for c in caches),
            num_blocks=slots // block_size,
            block_size=block_size,
            token_shape=tuple(first.shape[1:]),
            dtype=str(first.dtype).removeprefix("torch."),
            itemsize=first.element_size(),
            head_start=head_start,
            total_heads=total_heads,
        )


@dataclass(frozen=True)
class Writes:
    """One transfer-engine batch: ``lengths[i]`` bytes from ``srcs[i]`` to ``dsts[i]``."""

    srcs: tuple[int, ...]
    dsts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self.srcs)


def check_compatible(src: PoolLayout, dst: PoolLayout) -> None:
    """Raise ValueError naming what differs when ``src`` cannot write into ``dst``."""
    problems = []
    if src.kind != dst.kind:
        problems.append(f"attention {src.kind} vs {dst.kind}")
    if len(src.layer_addrs) != len(dst.layer_addrs):
        problems.append(f"{len(src.layer_addrs)} vs {len(dst.layer_addrs)} cache layers")
    if src.dtype != dst.dtype:
        problems.append(f"KV dtype {src.dtype} vs {dst.dtype}")
    if src.kind == dst.kind == MLA and src.token_shape != dst.token_shape:
        problems.append(f"latent {src.token_shape} vs {dst.token_shape}")
    if src.kind == dst.kind == GQA:
        if src.total_heads != dst.total_heads or src.token_shape[2] != dst.token_shape[2]:
            problems.append(
                f"KV heads {src.total_heads}x{src.token_shape[2]} vs "
                f"{dst.total_heads}x{dst.token_shape[2]}"
            )
    if problems:
        raise ValueError("the prefill and decode KV pools differ: " + "; ".join(problems))


def shared_heads(src: PoolLayout, dst: PoolLayout) -> tuple[int, int]:
    """GQA: the KV heads ``[lo, hi)`` both pools hold (``lo >= hi``: none)."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.num_heads, dst.head_start + dst.num_heads)
    return lo, hi


def transfer_bytes(src: PoolLayout, dst: PoolLayout, num_tokens: int) -> int:
    """Bytes :func:`plan_writes` moves from ``src`` into ``dst`` for ``num_tokens`` tokens."""
    layers = len(src.layer_addrs)
    if src.kind == MLA:
        return num_tokens * src.slot_bytes * layers
    lo, hi = shared_heads(src, dst)
    return max(0, hi - lo) * src.head_bytes * 2 * num_tokens * layers


def slot_of(table: Sequence[int], block_size: int, t: int) -> int:
    return table[t // block_size] * block_size + t % block_size


def slot_index(table: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The pool slot of each of tokens ``[0, num_tokens)``, as an index tensor."""
    return torch.tensor([slot_of(table, block_size, t) for t in range(num_tokens)])


def slot_runs(
    src_table: Sequence[int],
    dst_table: Sequence[int],
    block_size_src: int,
    block_size_dst: int,
    num_tokens: int,
) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, tokens) of each run of tokens whose slots
    are consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    t = 0
    while t < num_tokens:
        s0, d0 = slot_of(src_table, block_size_src, t), slot_of(dst_table, block_size_dst, t)
        n = 1
        # extend within both current blocks, then across blocks whose ids follow on
        while t + n < num_tokens:
            s = slot_of(src_table, block_size_src, t + n)
            d = slot_of(dst_table, block_size_dst, t + n)
            if s != s0 + n or d != d0 + n:
                break
            n += 1
        runs.append((s0, d0, n))
        t += n
    return runs


def check_tables(
    src: PoolLayout,
    dst: PoolLayout,
    src_table: Sequence[int],
    dst_table: Sequence[int],
    num_tokens: int,
) -> None:
    """Raise ValueError when the pools are incompatible or a block table is too short for
    ``num_tokens`` tokens or names a block outside its pool."""
    check_compatible(src, dst)
    for name, table, layout in (("source", src_table, src), ("destination", dst_table, dst)):
        need = -(-num_tokens // layout.block_size)
        if len(table) < need:
            raise ValueError(
                f"the {name} holds {len(table)} blocks, fewer than {need} for {num_tokens} tokens"
            )
        bad = [b for b in table[:need] if not 0 <= b < layout.num_blocks]
        if bad:
            raise ValueError(f"the {name}'s block {bad[0]} is outside its pool")


def plan_writes(
    src: PoolLayout,
    dst: PoolLayout,
    src_table: Sequence[int],
    dst_table: Sequence[int],
    num_tokens: int,
) -> Writes:
    """The writes that copy tokens ``[0, num_tokens)`` of a sequence from ``src`` (its blocks
    ``src_table``) into ``dst`` (blocks ``dst_table``), every layer, in one batch. For GQA
    only the heads both pools hold (``src`` writes its share; the other shares come from the
    other source ranks). Raises ValueError when the pools are incompatible or a table is too
    short."""
    check_tables(src, dst, src_table, dst_table, num_tokens)
    srcs: list[int] = []
    dsts: list[int] = []
    lengths: list[int] = []
    runs = slot_runs(src_table, dst_table, src.block_size, dst.block_size, num_tokens)
    same_heads = src.kind == MLA or (
        src.head_start == dst.head_start and src.num_heads == dst.num_heads
    )
    if same_heads:
        sb = src.slot_bytes
        for s_base, d_base in zip(src.layer_addrs, dst.layer_addrs):
            for s0, d0, n in runs:
                srcs.append(s_base + s0 * sb)
                dsts.append(d_base + d0 * sb)
                lengths.append(n * sb)
        return Writes(tuple(srcs), tuple(dsts), tuple(lengths))
    lo, hi = shared_heads(src, dst)
    if lo >= hi:
        return Writes((), (), ())  # this source holds none of the destination's heads
    hb = src.head_bytes
    length = (hi - lo) * hb
    s_kv, d_kv = src.num_heads * hb, dst.num_heads * hb  # bytes from K to V in a slot
    s_off, d_off = (lo - src.head_start) * hb, (lo - dst.head_start) * hb
    for s_base, d_base in zip(src.layer_addrs, dst.layer_addrs):
        for s0, d0, n in runs:
            for k in range(n):
                s_slot = s_base + (s0 + k) * src.slot_bytes + s_off
                d_slot = d_base + (d0 + k) * dst.slot_bytes + d_off
                for kv in (0, 1):
                    srcs.append(s_slot + kv * s_kv)
                    dsts.append(d_slot + kv * d_kv)
                    lengths.append(length)
    return Writes(tuple(srcs), tuple(dsts), tuple(lengths))


def copy_reference(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src: PoolLayout,
    dst: PoolLayout,
    src_table: Sequence[int],
    dst_table: Sequence[int],
    num_tokens: int,
) -> None:
    """What :func:`plan_writes`' batch does, with torch indexing: the tests' oracle."""
    s_slots = slot_index(src_table, src.block_size, num_tokens)
    d_slots = slot_index(dst_table, dst.block_size, num_tokens)
    for s_cache, d_cache in zip(src_caches, dst_caches):
        if src.kind == MLA:
            d_cache[d_slots] = s_cache[s_slots]
            continue
        lo, hi = shared_heads(src, dst)
        if lo < hi:
            d_cache[d_slots, :, lo - dst.head_start : hi - dst.head_start] = s_cache[
                s_slots, :, lo - src.head_start : hi - src.head_start
            ]
