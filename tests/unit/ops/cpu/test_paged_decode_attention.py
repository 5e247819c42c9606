"""The paged decode-attention kernels (MLA absorbed and GQA) against their gather references,
each test on the AVX2 scores and values and, where the CPU has it, the AVX-512F ones."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.ops.cpu import attention as cpu_attention
from moeserve.ops.cpu import fp32

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no AVX2/FMA CPU or no C compiler: the references run"
)


@pytest.fixture(autouse=True, params=["avx2", "avx512"])
def isa(request, monkeypatch):
    """The kernel's ISA (``fp32.wide``, as the GEMMs choose it)."""
    if request.param == "avx512" and not fp32.wide():
        pytest.skip("no AVX-512F here")
    if request.param == "avx2":
        monkeypatch.setattr(cpu_attention, "wide", lambda: False)
    return request.param


def scattered_tables(lens: list[int], bs: int, g: torch.Generator) -> tuple[int, list[list[int]]]:
    """Block tables drawing each sequence's blocks from a shuffled pool (no two share one),
    so no table is contiguous; one spare block more than needed, as a table may hold."""
    need = [(n + bs - 1) // bs + 1 for n in lens]
    pool = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, k = [], 0
    for n in need:
        tables.append(pool[k : k + n])
        k += n
    return sum(need) + 3, tables


def decode_meta(lens: list[int], tables: list[list[int]], bs: int) -> AttentionMetadata:
    """Metadata of a step of pure decodes whose contexts (new token included) are ``lens``."""
    return AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, bs)


def check_mla(
    lens: list[int],
    bs: int,
    H: int = 16,
    C: int = 256,
    R: int = 32,
    seed: int = 0,
    cache_dtype: torch.dtype = torch.float32,
):
    """The kernel against the gather reference; a bf16 cache against the reference on the
    same values in fp32 (the kernel widens them exactly)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, tables = scattered_tables(lens, bs, g)
    cache = torch.randn(num_blocks * bs, C + R, generator=g).to(cache_dtype)
    B = len(lens)
    q = torch.randn(B, H, C + R, generator=g)
    meta = decode_meta(lens, tables, bs)
    scale = (C + R) ** -0.5
    args = (meta.decode_block_table_BN, meta.decode_context_lens_B, bs, scale)
    got = cpu_attention.mla_decode(q[..., :C], q[..., C:], cache, *args)
    ref = cpu_attention.mla_decode_ref(
        q[..., :C], q[..., C:], cache.float(), meta.decode_slots_BL, meta.decode_bias_B1L, scale
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "lens,bs",
    [
        ([1], 16),  # one token
        ([16], 16),  # context exactly fills a block
        ([17], 16),  # one token into the second block
        ([2048], 16),  # long: split over threads and merged
        ([700], 1),  # a block per token
        ([333], 7),  # odd block size
        ([1, 16, 32, 5, 100, 1000, 64, 63], 16),  # ragged batch
        ([512] * 8, 16),
        ([3000, 1, 2, 40], 32),  # one long sequence among short ones: split, others not
    ],
)
def test_mla_decode_matches_gather_reference(lens, bs):
    check_mla(lens, bs, seed=len(lens) + bs)


@pytest.mark.parametrize("H,C,R", [(4, 32, 16), (3, 20, 6), (1, 8, 1), (6, 512, 64)])
def test_mla_decode_odd_shapes(H, C, R):
    """Heads not a multiple of 4, dims not multiples of 8 or 16."""
    check_mla([1, 37, 300], 16, H, C, R, seed=H + C + R)


@pytest.mark.parametrize("lens,bs", [([1, 17, 300], 16), ([2048], 16), ([333, 5], 7)])
def test_mla_decode_bf16_cache(lens, bs):
    """A bf16 model's cache: rows widened per tile (split and unsplit items, odd blocks)."""
    check_mla(lens, bs, seed=bs, cache_dtype=torch.bfloat16)
    check_mla([40], 16, 3, 20, 6, seed=2, cache_dtype=torch.bfloat16)  # dims off 8


def test_mla_decode_strided_query_and_output():
    """The layer's call: q_lat head-major ([H, B, C] seen as [B, H, C]), q_pe a slice of the
    projected query, the output written head-major in place, int64 table accepted."""
    g = torch.Generator().manual_seed(1)
    lens, bs, H, C, R = [40, 9, 130], 16, 8, 64, 16
    num_blocks, tables = scattered_tables(lens, bs, g)
    cache = torch.randn(num_blocks * bs, C + R, generator=g)
    meta = decode_meta(lens, tables, bs)
    B = len(lens)
    q_lat_HBC = torch.randn(H, B, C, generator=g)
    q_pe_BHR = torch.randn(B, H, 48 + R, generator=g)[..., 48:]
    out_HBC = torch.full((H, B, C), float("nan"))
    table64 = meta.decode_block_table_BN.long()
    cpu_attention.mla_decode(
        q_lat_HBC.transpose(0, 1),
        q_pe_BHR,
        cache,
        table64,
        meta.decode_context_lens_B,
        bs,
        0.1,
        out_BHC=out_HBC.transpose(0, 1),
    )
    ref = cpu_attention.mla_decode_ref(
        q_lat_HBC.transpose(0, 1), q_pe_BHR, cache, meta.decode_slots_BL, meta.decode_bias_B1L, 0.1
    )
    torch.testing.assert_close(out_HBC.transpose(0, 1), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H", [16, 6, 5])
def test_mla_decode_splits_the_heads_of_a_short_context(H):
    """One sequence too short to split by tokens: with two threads its heads go to them in
    ranges of whole score blocks (H 16: 8 + 8; 6: 4 + 2; 5: 4 + 1), and a GQA cache with one
    KV head the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_mla([40], 16, H, 64, 16, seed=H)
        check_mla([100], 7, H, 64, 16, seed=H + 1, cache_dtype=torch.bfloat16)
        check_gqa(2 * H, 1, 64, [50], 16, torch.float32)
    finally:
        torch.set_num_threads(threads)


def test_mla_decode_single_thread():
    """One thread: no split, one item per sequence (the other tests split long contexts
    when more than one thread is there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_mla([2048, 3], 16, seed=5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("H,G,Hd", [(4, 2, 16), (8, 8, 64), (32, 4, 128), (6, 3, 20)])
@pytest.mark.parametrize("lens,bs", [([1, 16, 17, 300], 16), ([2000], 16), ([5, 70], 3)])
def test_gqa_decode_matches_gather_reference(H, G, Hd, lens, bs):
    check_gqa(H, G, Hd, lens, bs, torch.float32)


@pytest.mark.parametrize("H,G,Hd", [(8, 2, 64), (6, 3, 20)])
def test_gqa_decode_bf16_cache(H, G, Hd):
    """Keys and values apart in the row: both widened."""
    check_gqa(H, G, Hd, [1, 17, 300], 16, torch.bfloat16)


def check_gqa(H: int, G: int, Hd: int, lens: list[int], bs: int, cache_dtype: torch.dtype):
    g = torch.Generator().manual_seed(H + G + Hd + len(lens))
    num_blocks, tables = scattered_tables(lens, bs, g)
    cache = torch.randn(num_blocks * bs, 2, G, Hd, generator=g).to(cache_dtype)
    q = torch.randn(len(lens), H, Hd, generator=g)
    meta = decode_meta(lens, tables, bs)
    args = (meta.decode_block_table_BN, meta.decode_context_lens_B, bs, Hd**-0.5)
    got = cpu_attention.gqa_decode(q, cache, *args)
    ref = cpu_attention.gqa_decode_ref(
        q, cache.float(), meta.decode_slots_BL, meta.decode_bias_B1L, Hd**-0.5
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_kernels_decline_what_they_do_not_handle():
    cache = torch.randn(32, 40, dtype=torch.float64)
    q = torch.randn(1, 2, 40, dtype=torch.float64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    assert cpu_attention.mla_decode(q[..., :32], q[..., 32:], cache, table, lens, 16, 1.0) is None
    gqa_cache = torch.randn(32, 2, 3, 8)
    assert cpu_attention.gqa_decode(torch.randn(1, 4, 8), gqa_cache, table, lens, 16, 1.0) is None


def test_metadata_slots_match_block_tables():
    """The lazily built gather slots follow the block tables; padding is masked."""
    lens, bs = [3, 18, 1], 8
    tables = [[4, 9], [0, 2, 7], [5]]
    meta = decode_meta(lens, tables, bs)
    assert meta.decode_block_table_BN.tolist() == [[4, 9, 0], [0, 2, 7], [5, 0, 0]]
    assert meta.decode_context_lens_B.tolist() == lens
    slots = meta.decode_slots_BL
    assert slots[0, :3].tolist() == [32, 33, 34]
    assert slots[1].tolist() == [*range(0, 8), *range(16, 24), 56, 57]
    assert slots[2, 0].item() == 40
    bias = meta.decode_bias_B1L[:, 0]
    assert (bias[0, :3] == 0).all() and torch.isinf(bias[0, 3:]).all()
    assert (bias[1] == 0).all()
    assert meta.slot_mapping_T.tolist() == [34, 57, 40]
