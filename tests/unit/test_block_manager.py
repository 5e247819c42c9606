"""BlockManager: accounting, prefix-cache hits and eviction, with check_integrity() after every
operation, and a randomized run that also checks every cached block holds the right tokens."""

from __future__ import annotations

import random

import pytest

from moeserve.core import SamplingParams, Sequence
from moeserve.kvcache.block_manager import BlockManager

BS = 4


def make_seq(tokens: list[int], **params) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=list(tokens), params=SamplingParams(**params))


@pytest.fixture
def make_bm():
    """A BlockManager whose mutating methods run check_integrity() after each call."""

    def make(num_blocks: int = 8, enable_prefix_caching: bool = True) -> BlockManager:
        bm = BlockManager(num_blocks, BS, enable_prefix_caching)
        bm.check_integrity()
        for name in ("allocate", "commit_full_blocks", "free"):
            fn = getattr(bm, name)

            def checked(*args, _fn=fn, **kwargs):
                out = _fn(*args, **kwargs)
                bm.check_integrity()
                return out

            setattr(bm, name, checked)
        return bm

    return make


def admit_and_compute(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` with a cache lookup and compute all its tokens, as one prefill step."""
    cached = bm.lookup_prefix(seq)
    n = seq.num_tokens - len(cached) * BS
    assert bm.can_allocate(seq, n, cached)
    bm.allocate(seq, n, cached)
    seq.num_computed_tokens += n
    bm.commit_full_blocks(seq)


def test_allocate_append_free_accounting(make_bm):
    bm = make_bm()
    seq = make_seq(list(range(10)))
    assert bm.lookup_prefix(seq) == []
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    seq.num_computed_tokens = 10
    bm.commit_full_blocks(seq)
    seq.append_token(7, None)
    seq.append_token(8, None)
    bm.allocate(seq, 1)  # slot 10: still in block 2
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 11
    bm.allocate(seq, 1)
    seq.num_computed_tokens = 12
    bm.commit_full_blocks(seq)
    seq.append_token(9, None)
    bm.allocate(seq, 1)  # slot 12: a new block
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    # the two full prompt blocks stay cached; block 2 (prompt 8, 9 and outputs 7, 8) does not
    assert bm.num_cached_blocks == 2


def test_cannot_allocate_more_than_free(make_bm):
    bm = make_bm(num_blocks=2)
    seq = make_seq(list(range(9)))
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(ValueError, match="can_allocate"):
        bm.allocate(seq, 9)
    assert bm.can_allocate(seq, 8)
    with pytest.raises(ValueError, match="out of range"):
        bm.can_allocate(seq, 10)


def test_prefix_hit_shares_blocks(make_bm):
    bm = make_bm()
    shared = list(range(100, 108))  # two full blocks
    a = make_seq(shared + [1, 2, 3])
    admit_and_compute(bm, a)
    assert bm.prefix_cache_queries == 11 and bm.prefix_cache_hits == 0

    b = make_seq(shared + [4, 5])
    cached = bm.lookup_prefix(b)
    assert cached == a.block_table[:2]
    bm.allocate(b, 2, cached)
    assert b.num_computed_tokens == 8 and b.num_cached_prompt_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and len(b.block_table) == 3
    assert [bm.ref_count(x) for x in cached] == [2, 2]
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8
    assert bm.num_free_blocks == 8 - 4

    bm.free(a)
    assert [bm.ref_count(x) for x in cached] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_hit_revives_an_evictable_block(make_bm):
    bm = make_bm()
    a = make_seq(list(range(9)))
    admit_and_compute(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8
    b = make_seq(list(range(9)) + [50])
    cached = bm.lookup_prefix(b)
    assert len(cached) == 2
    bm.allocate(b, 2, cached)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8 - 3
    assert [bm.ref_count(x) for x in cached] == [1, 1]


def test_chained_hash_depends_on_the_whole_prefix(make_bm):
    bm = make_bm()
    admit_and_compute(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert bm.lookup_prefix(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_never_the_whole_prompt(make_bm):
    bm = make_bm()
    a = make_seq(list(range(8)))  # exactly two full blocks
    admit_and_compute(bm, a)
    same = make_seq(list(range(8)))
    assert len(bm.lookup_prefix(same)) == 1  # (8 - 1) // 4: the last token is recomputed
    longer = make_seq(list(range(9)))
    assert len(bm.lookup_prefix(longer)) == 2
    assert bm.lookup_prefix(make_seq(list(range(4)))) == []


def test_prompt_logprobs_skip_the_cache(make_bm):
    bm = make_bm()
    admit_and_compute(bm, make_seq(list(range(9))))
    queries = bm.prefix_cache_queries
    seq = make_seq(list(range(9)), prompt_logprobs=1)
    assert bm.lookup_prefix(seq) == []
    bm.allocate(seq, 9)
    assert bm.prefix_cache_queries == queries and seq.num_cached_prompt_tokens == 0


def test_caching_disabled(make_bm):
    bm = make_bm(enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    admit_and_compute(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0
    assert bm.lookup_prefix(make_seq(list(range(9)))) == []
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0


def test_eviction_takes_free_blocks_first_then_lru(make_bm):
    bm = make_bm(num_blocks=6)
    a_tokens, b_tokens = list(range(8)), list(range(100, 108))
    a, b = make_seq(a_tokens + [0]), make_seq(b_tokens + [0])
    for seq in (a, b):
        admit_and_compute(bm, seq)
    bm.free(a)  # evictable, oldest first: a1, a0, b1, b0 (tails first)
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6

    c = make_seq(list(range(200, 208)))
    bm.allocate(c, 8)  # the two truly free blocks (b's third block and a's): no eviction
    assert bm.num_cached_blocks == 4
    d = make_seq(list(range(300, 304)))
    bm.allocate(d, 4)  # evicts a's tail block
    assert len(bm.lookup_prefix(make_seq(a_tokens + [0]))) == 1
    assert len(bm.lookup_prefix(make_seq(b_tokens + [0]))) == 2
    e = make_seq(list(range(400, 404)))
    bm.allocate(e, 4)  # then a's head block
    assert bm.lookup_prefix(make_seq(a_tokens + [0])) == []
    assert len(bm.lookup_prefix(make_seq(b_tokens + [0]))) == 2


def test_duplicate_blocks_keep_the_first_registration(make_bm):
    bm = make_bm()
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    bm.allocate(a, 9)
    bm.allocate(b, 9)  # both computed in the same step: no hit yet
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.commit_full_blocks(seq)
    assert bm.lookup_prefix(make_seq(list(range(9)))) == a.block_table[:2]
    bm.free(b)  # b's copies are plain blocks: truly free, not cached
    assert bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.num_cached_blocks == 2


def test_only_prompt_blocks_are_cached(make_bm):
    """A block reaching into the output was computed by the decode path: a later prompt that
    repeats those tokens recomputes them (and caches its own prompt blocks)."""
    bm = make_bm()
    a = make_seq(list(range(6)))
    admit_and_compute(bm, a)
    for t in (40, 41, 42, 43):  # decodes fill block 1 (prompt 4, 5, outputs 40, 41) and more
        a.append_token(t, None)
        bm.allocate(a, 1)
        a.num_computed_tokens += 1
        bm.commit_full_blocks(a)
    bm.free(a)
    assert bm.num_cached_blocks == 1
    turn2 = make_seq(list(range(6)) + [40, 41, 42, 43, 7])
    assert len(bm.lookup_prefix(turn2)) == 1
    admit_and_compute(bm, turn2)  # its block 1 is prompt now, computed by the prefill
    bm.free(turn2)
    assert len(bm.lookup_prefix(make_seq(turn2.prompt_token_ids + [8]))) == 2


def test_check_integrity_catches_corruption():
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(5)))
    bm.allocate(seq, 5)
    bm.check_integrity()
    bm._ref[seq.block_table[0]] += 1
    with pytest.raises(AssertionError, match="ref"):
        bm.check_integrity()
    bm._ref[seq.block_table[0]] -= 1
    bm._free.append(seq.block_table[1])
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_randomized_stress(make_bm):
    """Random admits, chunked steps, decodes and frees over a small pool. A shadow "KV" array
    records the token written to each slot; every computed position of every live sequence
    must read back its own token, so a wrong prefix hit or a reused live block shows up."""
    rng = random.Random(1234)
    num_blocks = 24
    bm = make_bm(num_blocks=num_blocks)
    kv: list[int | None] = [None] * (num_blocks * BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[Sequence] = []

    def slot(seq: Sequence, p: int) -> int:
        return seq.block_table[p // BS] * BS + p % BS

    for _ in range(3000):
        op = rng.random()
        if op < 0.25 and len(live) < 8:
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            seq = make_seq(rng.choice(prefixes) + tail, prompt_logprobs=rng.choice([None, 0]))
            cached = bm.lookup_prefix(seq)
            remaining = seq.num_tokens - len(cached) * BS
            n = rng.randint(1, remaining)
            if bm.can_allocate(seq, n, cached):
                bm.allocate(seq, n, cached)
                live.append(seq)
                n_new = n
            else:
                continue
        elif op < 0.85 and live:
            seq = rng.choice(live)
            n_new = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)
            if not bm.can_allocate(seq, n_new):
                continue
            bm.allocate(seq, n_new)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            continue
        else:
            continue
        # "compute" tokens [start, start + n_new): write them to their slots
        start = seq.num_computed_tokens
        for p in range(start, start + n_new):
            kv[slot(seq, p)] = seq.token_ids_slice(p, p + 1)[0]
        seq.num_computed_tokens += n_new
        bm.commit_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(rng.randrange(50), None)
        for s in live:
            for p in range(s.num_computed_tokens):
                assert kv[slot(s, p)] == s.token_ids_slice(p, p + 1)[0]

    assert bm.prefix_cache_hits > 0
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks and bm.usage == 0.0
