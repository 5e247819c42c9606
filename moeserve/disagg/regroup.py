"""GQA KV between pools that split the KV heads differently (prefill TP1 -> decode TP2, or
prefill TP2 -> decode TP1), in a few contiguous writes per layer instead of two per token.

``layout.plan_writes`` regroups heads with one write for K and one for V per token and layer:
over Mooncake's TCP transport each write is a TCP connection of its own, and tens of thousands
of them per prompt are both slow and fragile. Instead a destination pool's heads come from
the source ranks by one of three routes (:func:`route`), chosen alike on both sides from the
head ranges of the prefill replica's ranks:

- ``SLOTS``: a source holds exactly the destination's heads: whole slots move
  (``layout.plan_writes``; no copy).
- ``GATHER``: a source holds all of the destination's heads and more (prefill TP1 -> decode
  TP2). It gathers them with torch indexing into a registered staging buffer laid out as the
  destination's slots, ``[layers, tokens, 2, dst_heads, head_dim]``, and writes runs of slots
  from it (:func:`gather`, :func:`plan_gathered_writes`). Cost: one local copy of the bytes
  sent (``tokens * dst.slot_bytes`` per layer), writes as for ``SLOTS``.
- ``PACK``: several sources each hold part of the destination's heads (prefill TP2 -> decode
  TP1). Each writes its own slots, whole, as one byte stream into the destination sequence's
  own blocks, read as one flat region in token order, at the offset of its heads; when every
  stream has landed the decode rank moves the heads to their places (:func:`unpack`). Cost:
  writes as for ``SLOTS`` (a few per layer and source), and on the decode rank one gather and
  one scatter of the prompt's KV per layer; no staging memory (the blocks are the decode
  sequence's own, exclusive until it runs).

The flat region of ``PACK``, ``n`` tokens, destination heads ``[d, d + H)`` fed by sources
``[d, d + h0)``, ``[d + h0, d + H)``::

    dst slot bytes, in token order:  | slot(0) | slot(1) | ... | slot(n - 1) |
    flat bytes:                      | stream 0: n x [2, h0, hd] | stream 1: n x [2, H - h0, hd] |

Stream ``i`` starts at byte ``n * 2 * head_bytes * (start_i - d)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeserve.disagg.layout import (
    GQA,
    PoolLayout,
    Writes,
    check_tables,
    slot_index,
    slot_of,
    slot_runs,
)

SLOTS, GATHER, PACK = "slots", "gather", "pack"

HeadRange = tuple[int, int]  # (first head, number of heads)


def head_ranges(layouts: Sequence[PoolLayout]) -> list[HeadRange]:
    """The distinct head ranges of ``layouts``, by first head."""
    return sorted({(x.head_start, x.num_heads) for x in layouts})


def route(dst: PoolLayout, sources: Sequence[HeadRange]) -> tuple[str, list[HeadRange]]:
    """How ``dst``'s heads come from sources holding ``sources``: ``(SLOTS, [the equal
    range])``, ``(GATHER, [a covering range])`` or ``(PACK, [the ranges within dst, in head
    order])``. MLA is always SLOTS from the first source. Raises ValueError when the ranges
    neither cover nor tile ``dst``'s heads."""
    ranges = sorted(set((int(a), int(n)) for a, n in sources))
    if dst.kind != GQA:
        return SLOTS, ranges[:1]
    lo, hi = dst.head_start, dst.head_start + dst.num_heads
    if (lo, hi - lo) in ranges:
        return SLOTS, [(lo, hi - lo)]
    covering = [(a, n) for a, n in ranges if a <= lo and hi <= a + n]
    if covering:
        return GATHER, [min(covering, key=lambda r: r[1])]
    inside = [(a, n) for a, n in ranges if lo <= a and a + n <= hi]
    tiles, at = [], lo
    for a, n in inside:
        if a == at:
            tiles.append((a, n))
            at += n
    if at != hi:
        raise ValueError(
            f"no prefill rank holds or tiles the decode rank's KV heads [{lo}, {hi}) "
            f"(prefill ranks hold {[(a, a + n) for a, n in ranges]})"
        )
    return PACK, tiles


def staging_shape(src: PoolLayout, dst: PoolLayout, num_tokens: int) -> tuple[int, ...]:
    """GATHER's staging tensor: ``[layers, tokens, 2, dst_heads, head_dim]``."""
    return (len(src.layer_addrs), num_tokens, *dst.token_shape)


def gather(
    src_caches: Sequence[torch.Tensor],
    src: PoolLayout,
    dst: PoolLayout,
    src_table: Sequence[int],
    num_tokens: int,
    out: torch.Tensor,
) -> None:
    """Fill ``out`` (:func:`staging_shape`) with ``dst``'s heads of tokens ``[0,
    num_tokens)``, every layer, from ``src``'s caches (which must hold all of them)."""
    a = dst.head_start - src.head_start
    b = a + dst.num_heads
    if a < 0 or b > src.num_heads:
        raise ValueError("the source does not hold every head of the destination")
    if out.shape != staging_shape(src, dst, num_tokens) or out.dtype != src_caches[0].dtype:
        raise ValueError(f"the staging tensor is {out.dtype}{list(out.shape)}, not as the pools")
    slots = slot_index(src_table, src.block_size, num_tokens)
    for cache, o in zip(src_caches, out):
        torch.index_select(cache[:, :, a:b], 0, slots, out=o)


def plan_gathered_writes(
    stage_addr: int, dst: PoolLayout, dst_table: Sequence[int], num_tokens: int
) -> Writes:
    """The writes of a :func:`gather` staging buffer at ``stage_addr`` into ``dst``'s
    blocks ``dst_table``: one per layer and run of consecutive destination slots."""
    sb, n = dst.slot_bytes, num_tokens
    identity = list(range(-(-n // dst.block_size)))
    runs = slot_runs(identity, dst_table, dst.block_size, dst.block_size, n)
    srcs, dsts, lengths = [], [], []
    for layer, base in enumerate(dst.layer_addrs):
        for t0, d0, k in runs:
            srcs.append(stage_addr + (layer * n + t0) * sb)
            dsts.append(base + d0 * sb)
            lengths.append(k * sb)
    return Writes(tuple(srcs), tuple(dsts), tuple(lengths))


def _breaks(table: Sequence[int], block_size: int, num_tokens: int) -> list[int]:
    """Tokens ``t > 0`` whose slot does not follow token ``t - 1``'s."""
    return [
        t
        for t in range(1, num_tokens)
        if slot_of(table, block_size, t) != slot_of(table, block_size, t - 1) + 1
    ]


def stream_offset(dst: PoolLayout, head_start: int, num_tokens: int) -> int:
    """PACK: the byte in ``dst``'s flat region where the stream of heads from
    ``head_start`` on begins (module docstring)."""
    return num_tokens * 2 * dst.head_bytes * (head_start - dst.head_start)


def plan_packed_writes(
    src: PoolLayout,
    dst: PoolLayout,
    src_table: Sequence[int],
    dst_table: Sequence[int],
    num_tokens: int,
) -> Writes:
    """PACK: the writes of ``src``'s slots of tokens ``[0, num_tokens)``, every layer, as one
    stream into ``dst``'s flat region (module docstring): a write ends only where the source
    slots or the destination slots stop being consecutive (at best one per layer)."""
    check_tables(src, dst, src_table, dst_table, num_tokens)
    lo, hi = dst.head_start, dst.head_start + dst.num_heads
    if not (lo <= src.head_start and src.head_start + src.num_heads <= hi):
        raise ValueError("the source's heads are not within the destination's")
    n, ssb, dsb = num_tokens, src.slot_bytes, dst.slot_bytes
    off = stream_offset(dst, src.head_start, n)
    length = n * ssb
    cuts = {0, length}
    cuts.update(t * ssb for t in _breaks(src_table, src.block_size, n))
    cuts.update(
        t * dsb - off for t in _breaks(dst_table, dst.block_size, n) if off < t * dsb < off + length
    )
    # destination slot boundaries are cuts too when a block boundary falls there; within a
    # run of consecutive slots the flat region is contiguous
    edges = sorted(cuts)
    srcs, dsts, lengths = [], [], []
    for s_base, d_base in zip(src.layer_addrs, dst.layer_addrs):
        for y0, y1 in zip(edges, edges[1:]):
            x0 = off + y0
            srcs.append(s_base + slot_of(src_table, src.block_size, y0 // ssb) * ssb + y0 % ssb)
            dsts.append(d_base + slot_of(dst_table, dst.block_size, x0 // dsb) * dsb + x0 % dsb)
            lengths.append(y1 - y0)
    return Writes(tuple(srcs), tuple(dsts), tuple(lengths))


def unpack(
    dst_caches: Sequence[torch.Tensor],
    dst: PoolLayout,
    sources: Sequence[HeadRange],
    dst_table: Sequence[int],
    num_tokens: int,
) -> None:
    """PACK, on the decode rank once every stream has landed: move each source's heads from
    the flat region to their places in the slots. Does nothing unless ``route(dst,
    sources)`` is PACK."""
    how, tiles = route(dst, sources)
    if how != PACK:
        return
    n, hd = num_tokens, dst.token_shape[2]
    slots = slot_index(dst_table, dst.block_size, n)
    for cache in dst_caches:
        flat = cache.index_select(0, slots).reshape(-1)  # the region, in token order
        for a, h in tiles:
            start = stream_offset(dst, a, n) // dst.itemsize
            stream = flat[start : start + n * 2 * h * hd].view(n, 2, h, hd)
            i = a - dst.head_start
            cache[slots, :, i : i + h] = stream
