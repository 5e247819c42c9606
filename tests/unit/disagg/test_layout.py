"""``plan_writes`` against ``copy_reference``: the planned writes run with ``ctypes.memmove``
on real tensors (the layouts hold their data pointers) and must leave the destination pool
exactly as the torch oracle does, for MLA and GQA pools, mismatched block sizes and head
ranges split over prefill ranks; every incompatible pair or bad table is refused; the KV
digest tells a landed transfer from one with bytes still due."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.disagg.layout import (
    GQA,
    MLA,
    PoolLayout,
    Writes,
    copy_reference,
    plan_writes,
)

LAYERS, LATENT, HEADS, HEAD_DIM = 3, 6, 4, 3


class Pool:
    """Per-layer ``[slots, *token_shape]`` tensors of random values and their layout."""

    def __init__(
        self,
        kind: str,
        num_blocks: int,
        block_size: int,
        heads: tuple[int, int] = (0, HEADS),
        total_heads: int = HEADS,
        num_layers: int = LAYERS,
        latent: int = LATENT,
        head_dim: int = HEAD_DIM,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        shape = (latent,) if kind == MLA else (2, heads[1] - heads[0], head_dim)
        g = torch.Generator().manual_seed(seed)
        slots = num_blocks * block_size
        self.caches = [
            torch.randn((slots, *shape), generator=g).to(dtype) for _ in range(num_layers)
        ]
        start = heads[0] if kind == GQA else 0
        total = total_heads if kind == GQA else 0
        self.layout = PoolLayout.of_pool(self.caches, block_size, kind, start, total)

    def clone(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.caches]


def slot(table: list[int], block_size: int, t: int) -> int:
    """Token ``t``'s slot in a pool (the module docstring's rule, written out again)."""
    return table[t // block_size] * block_size + t % block_size


def execute(writes: Writes) -> None:
    for src, dst, n in zip(writes.srcs, writes.dsts, writes.lengths, strict=True):
        ctypes.memmove(dst, src, n)


def check_against_reference(src: Pool, dst: Pool, src_table, dst_table, num_tokens) -> Writes:
    """Run the planned writes on ``dst`` and compare with the oracle on a copy of it."""
    want = dst.clone()
    copy_reference(src.caches, want, src.layout, dst.layout, src_table, dst_table, num_tokens)
    writes = plan_writes(src.layout, dst.layout, src_table, dst_table, num_tokens)
    execute(writes)
    for got, ref in zip(dst.caches, want, strict=True):
        assert torch.equal(got, ref)
    return writes


@st.composite
def transfer(draw, max_tokens: int = 40):
    """(source block size, destination block size, tokens, source table, destination table,
    source pool blocks, destination pool blocks): tables of distinct blocks in random order,
    sometimes longer than the tokens need."""
    bs_src = draw(st.integers(1, 5))
    bs_dst = draw(st.integers(1, 5))
    num_tokens = draw(st.integers(1, max_tokens))
    tables, sizes = [], []
    for bs in (bs_src, bs_dst):
        need = -(-num_tokens // bs) + draw(st.integers(0, 2))
        num_blocks = need + draw(st.integers(0, 6))
        blocks = draw(st.permutations(range(num_blocks)))[:need]
        if draw(st.booleans()):  # runs of consecutive ids, as a fresh pool hands them out
            blocks = sorted(blocks)
        tables.append(list(blocks))
        sizes.append(num_blocks)
    return bs_src, bs_dst, num_tokens, tables[0], tables[1], sizes[0], sizes[1]


@settings(max_examples=60, deadline=None)
@given(transfer())
def test_mla_writes_match_the_reference(case):
    bs_src, bs_dst, n, src_table, dst_table, nb_src, nb_dst = case
    src = Pool(MLA, nb_src, bs_src, seed=1)
    dst = Pool(MLA, nb_dst, bs_dst, seed=2)
    untouched = dst.clone()
    writes = check_against_reference(src, dst, src_table, dst_table, n)
    assert writes.num_bytes == LAYERS * n * src.layout.slot_bytes
    # the oracle itself: token t's latent lands in its slot, nothing else changes
    s_slots = [slot(src_table, bs_src, t) for t in range(n)]
    d_slots = [slot(dst_table, bs_dst, t) for t in range(n)]
    others = sorted(set(range(nb_dst * bs_dst)) - set(d_slots))
    for layer in range(LAYERS):
        assert torch.equal(dst.caches[layer][d_slots], src.caches[layer][s_slots])
        assert torch.equal(dst.caches[layer][others], untouched[layer][others])


@settings(max_examples=40, deadline=None)
@given(transfer(max_tokens=24))
def test_gqa_same_heads_writes_match_the_reference(case):
    bs_src, bs_dst, n, src_table, dst_table, nb_src, nb_dst = case
    src = Pool(GQA, nb_src, bs_src, seed=3)
    dst = Pool(GQA, nb_dst, bs_dst, seed=4)
    writes = check_against_reference(src, dst, src_table, dst_table, n)
    assert writes.num_bytes == LAYERS * n * src.layout.slot_bytes
    assert len(writes) <= LAYERS * n  # whole slots, merged where consecutive


@settings(max_examples=40, deadline=None)
@given(transfer(max_tokens=24), st.sampled_from([1, 2, 3]))
def test_two_prefill_ranks_fill_every_head_of_the_decode_pool(case, split):
    """Prefill TP2 (ranks holding heads [0, split) and [split, 4)), decode TP1 (all heads):
    each rank writes its heads, per token one write for K and one for V; together they fill
    the decode pool's slots as the concatenation of the two ranks' heads."""
    bs_src, bs_dst, n, src_table, dst_table, nb_src, nb_dst = case
    ranks = [
        Pool(GQA, nb_src, bs_src, heads=(0, split), seed=5),
        Pool(GQA, nb_src, bs_src, heads=(split, HEADS), seed=6),
    ]
    dst = Pool(GQA, nb_dst, bs_dst, seed=7)
    want = dst.clone()
    for rank in ranks:
        copy_reference(rank.caches, want, rank.layout, dst.layout, src_table, dst_table, n)
    for rank in ranks:
        writes = plan_writes(rank.layout, dst.layout, src_table, dst_table, n)
        assert len(writes) == LAYERS * n * 2
        assert writes.num_bytes == LAYERS * n * 2 * rank.layout.num_heads * HEAD_DIM * 4
        execute(writes)
    s_slots = [slot(src_table, bs_src, t) for t in range(n)]
    d_slots = [slot(dst_table, bs_dst, t) for t in range(n)]
    for layer in range(LAYERS):
        assert torch.equal(dst.caches[layer], want[layer])
        whole = torch.cat([r.caches[layer][s_slots] for r in ranks], dim=2)
        assert torch.equal(dst.caches[layer][d_slots], whole)


def test_a_decode_rank_takes_only_its_heads_from_a_whole_prefill_pool():
    """Prefill TP1 (all heads), decode TP2: the rank holding heads [2, 4) gets those; a
    source holding none of a destination's heads plans no write."""
    src = Pool(GQA, 4, 4, seed=8)
    dst = Pool(GQA, 4, 4, heads=(2, 4), seed=9)
    writes = check_against_reference(src, dst, [3, 1], [0, 2], 7)
    assert len(writes) == LAYERS * 7 * 2
    for layer in range(LAYERS):
        s_slots = [slot([3, 1], 4, t) for t in range(7)]
        d_slots = [slot([0, 2], 4, t) for t in range(7)]
        assert torch.equal(dst.caches[layer][d_slots], src.caches[layer][s_slots][:, :, 2:4])
    other = Pool(GQA, 4, 4, heads=(0, 2), seed=10)
    assert len(plan_writes(other.layout, dst.layout, [0], [0], 3)) == 0


def test_consecutive_blocks_merge_into_one_write_per_layer():
    src = Pool(MLA, 16, 4)
    dst = Pool(MLA, 16, 4, seed=1)
    writes = check_against_reference(src, dst, [2, 3, 4, 5], [9, 10, 11, 12], 15)
    assert len(writes) == LAYERS
    assert writes.lengths == (15 * src.layout.slot_bytes,) * LAYERS
    # one block out of order on the destination splits each layer's run in three
    writes = check_against_reference(src, dst, [2, 3, 4, 5], [9, 10, 0, 12], 15)
    assert len(writes) == 3 * LAYERS
    # different block sizes whose slots still follow on: one run per layer
    wide = Pool(MLA, 8, 8, seed=2)
    writes = check_against_reference(src, wide, [4, 5, 6, 7], [2, 3], 13)
    assert len(writes) == LAYERS
    # GQA with the same heads moves whole slots as MLA does
    g_src, g_dst = Pool(GQA, 8, 4, seed=3), Pool(GQA, 8, 4, seed=4)
    assert len(check_against_reference(g_src, g_dst, [0, 1, 2], [5, 6, 7], 12)) == LAYERS


def test_bad_tables_are_refused_with_the_problem_named():
    src, dst = Pool(MLA, 4, 4).layout, Pool(MLA, 4, 4, seed=1).layout
    with pytest.raises(ValueError, match="the source holds 1 blocks, fewer than 2 for 5 tokens"):
        plan_writes(src, dst, [0], [0, 1], 5)
    with pytest.raises(ValueError, match="the destination holds 0 blocks, fewer than 1"):
        plan_writes(src, dst, [0], [], 1)
    with pytest.raises(ValueError, match="the source's block 4 is outside its pool"):
        plan_writes(src, dst, [0, 4], [0, 1], 5)
    with pytest.raises(ValueError, match="the destination's block -1 is outside its pool"):
        plan_writes(src, dst, [0, 1], [-1, 1], 5)
    # blocks past what the tokens need are not looked at
    assert len(plan_writes(src, dst, [0, 99], [1, -5], 4)) == LAYERS


@pytest.mark.parametrize(
    "dst_kw, problem",
    [
        (dict(kind=MLA), "attention gqa vs mla"),
        (dict(num_layers=2), "3 vs 2 cache layers"),
        (dict(dtype=torch.bfloat16), "KV dtype float32 vs bfloat16"),
        (dict(total_heads=8), "KV heads 4x3 vs 8x3"),
        (dict(head_dim=5), "KV heads 4x3 vs 4x5"),
    ],
)
def test_incompatible_gqa_pools_are_refused(dst_kw, problem):
    src = Pool(GQA, 4, 4).layout
    kind = dst_kw.pop("kind", GQA)
    dst = Pool(kind, 4, 4, **dst_kw).layout
    with pytest.raises(ValueError, match="the prefill and decode KV pools differ: .*" + problem):
        plan_writes(src, dst, [0], [0], 2)


def test_incompatible_mla_pools_are_refused():
    src = Pool(MLA, 4, 4).layout
    with pytest.raises(ValueError, match="differ: attention mla vs gqa$"):
        plan_writes(src, Pool(GQA, 4, 4).layout, [0], [0], 2)
    with pytest.raises(ValueError, match=r"latent \(6,\) vs \(8,\)"):
        plan_writes(src, Pool(MLA, 4, 4, latent=8).layout, [0], [0], 2)
    with pytest.raises(ValueError, match="3 vs 1 cache layers; KV dtype float32 vs float16$"):
        plan_writes(src, Pool(MLA, 4, 4, num_layers=1, dtype=torch.float16).layout, [0], [0], 2)


def test_layouts_check_themselves_and_survive_json():
    layout = Pool(GQA, 4, 2, heads=(1, 3)).layout
    assert PoolLayout.from_json(layout.to_json()) == layout
    assert layout.num_heads == 2 and layout.head_bytes == HEAD_DIM * 4
    assert layout.pool_bytes == (4 * 2 * layout.slot_bytes,) * LAYERS
    with pytest.raises(ValueError, match="pool kind must be"):
        PoolLayout.from_json({**layout.to_json(), "kind": "mha"})
    with pytest.raises(ValueError, match=r"heads \[3, 5\) are not within the model's 4"):
        PoolLayout.from_json({**layout.to_json(), "head_start": 3})
    with pytest.raises(ValueError, match=r"a GQA pool holds \[2, heads, head_dim\]"):
        PoolLayout.from_json({**layout.to_json(), "token_shape": [3, 2, 3]})
    caches = [torch.zeros(10, LATENT)]
    with pytest.raises(ValueError, match="10 slots are not whole blocks of 4"):
        PoolLayout.of_pool(caches, 4, MLA)
    with pytest.raises(ValueError, match="contiguous and of one shape"):
        PoolLayout.of_pool([torch.zeros(8, 2 * LATENT)[:, ::2]], 4, MLA)
