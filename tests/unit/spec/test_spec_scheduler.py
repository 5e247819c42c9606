"""Scheduler and block manager under speculative decoding, with a fake target and fake drafts
(pure Python): outputs equal plain decoding whatever is accepted, the blocks cover every slot
a step writes (drafts and recursive MTP rows), and the KV bookkeeping stays intact through
chunking, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest

from moeserve.core import SamplingParams, Sequence
from moeserve.engine.scheduler import Scheduler, SchedulerConfig
from moeserve.kvcache.block_manager import BlockManager
from moeserve.spec.batch import SpecBatch

BS = 4


def fake_next(tokens: list[int]) -> int:
    return (sum(tokens) * 7 + len(tokens)) % 50 + 3


def expected(prompt: list[int], max_tokens: int, stop: int | None) -> list[int]:
    toks, out = list(prompt), []
    while len(out) < max_tokens:
        t = fake_next(toks)
        toks.append(t)
        out.append(t)
        if t == stop:
            break
    return out


def make_seqs(rng: random.Random, n: int, max_model_len: int) -> list[Sequence]:
    base = [rng.randrange(3, 50) for _ in range(12)]
    seqs = []
    for i in range(n):
        prompt = (base[: rng.randrange(0, 12)] if i % 2 else []) + [
            rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))
        ]
        max_tokens = rng.randrange(1, min(24, max_model_len - len(prompt)))
        stop = rng.choice([None, rng.randrange(3, 53)])
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, stop_token_ids=() if stop is None else (stop,)
        )
        seqs.append(Sequence(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
    return seqs


def num_drafts(seq: Sequence, emitted: int, k: int, max_model_len: int) -> int:
    """As ModelRunner._num_drafts."""
    left = min(
        max_model_len - (seq.num_tokens + emitted),
        seq.params.max_tokens - (len(seq.output_token_ids) + emitted),
    )
    return max(0, min(k, left - 1))


@pytest.mark.parametrize("seed", range(12))
def test_speculative_scheduling_matches_plain_decoding(seed):
    rng = random.Random(seed)
    k = rng.choice([1, 2, 3])
    max_model_len = 48
    cfg = SchedulerConfig(
        max_model_len=max_model_len,
        num_blocks=rng.choice([12, 16, 40]),
        block_size=BS,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        num_spec_tokens=k,
    )
    sched = Scheduler(cfg)
    seqs = make_seqs(rng, 8, max_model_len)
    for s in seqs:
        sched.add(s)
    hit_rate = rng.choice([0.0, 0.5, 0.9, 1.0])
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert isinstance(batch, SpecBatch)
        sampled, spec = [], []
        for entry, drafts in zip(batch.seqs, batch.drafts, strict=True):
            seq = entry.seq
            assert not drafts or entry.num_new_tokens == 1
            # every slot the step may write: its tokens, its drafts, k - 1 recursive MTP rows
            if entry.sample:
                need = min(entry.end + len(drafts) + k - 1, max_model_len)
                assert len(seq.block_table) * BS >= need
            if not entry.sample:
                sampled.append((None, None))
                spec.append(((), (), ()))
                continue
            toks = seq.all_token_ids
            emitted = []
            for d in drafts:
                if d != fake_next(toks + emitted):
                    break
                emitted.append(d)
            emitted.append(fake_next(toks + emitted))
            new = []
            for _ in range(num_drafts(seq, len(emitted), k, max_model_len)):
                t = fake_next(toks + emitted + new)
                new.append(t if rng.random() < hit_rate else 0)
            sampled.append((emitted[0], None))
            spec.append((tuple(emitted[1:]), (None,) * (len(emitted) - 1), tuple(new)))
        sched.update(batch, sampled, spec)
        sched.check_integrity()
    assert not sched.has_unfinished()
    for s in seqs:
        stop = s.params.stop_token_ids[0] if s.params.stop_token_ids else None
        assert s.output_token_ids == expected(s.prompt_token_ids, s.params.max_tokens, stop)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not sched.drafts
    if hit_rate > 0.5:
        assert sched.num_accepted_tokens > 0


def test_lookahead_allocates_past_the_known_tokens():
    bm = BlockManager(8, BS)
    seq = Sequence(request_id="r", prompt_token_ids=[3] * 6, params=SamplingParams())
    assert bm.can_allocate(seq, 6, lookahead=3)
    bm.allocate(seq, 6, lookahead=3)  # 9 slots: 3 blocks
    assert len(seq.block_table) == 3
    assert bm.can_allocate(seq, 6, lookahead=26)  # 32 slots: the whole pool of 8 blocks
    assert not bm.can_allocate(seq, 6, lookahead=27)
    with pytest.raises(ValueError, match="lookahead"):
        bm.can_allocate(seq, 6, lookahead=-1)
    bm.free(seq)
    bm.check_integrity()
