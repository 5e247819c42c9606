"""Scheduler with fake sequences and a fake model: the next token is a deterministic function of
the sequence's tokens, so batching, chunking, preemption and caching must not change outputs."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from moeserve.core import FinishReason, SamplingParams, Sequence, SequenceStatus
from moeserve.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig

BS = 4


def config(**kw) -> SchedulerConfig:
    kw.setdefault("max_model_len", 64)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", BS)
    return SchedulerConfig(**kw)


def make_seq(prompt: list[int], max_tokens: int = 8, request_id: str = "r", **kw) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Sequence(request_id=request_id, prompt_token_ids=list(prompt), params=params)


def fake_token(seq: Sequence) -> int:
    return (sum(seq.all_token_ids) * 7 + seq.num_tokens) % 50 + 3


class Ran(NamedTuple):
    """One entry of a step as it was scheduled (``ScheduledSeq.sample`` is only meaningful
    until :meth:`Scheduler.update` appends the sampled token)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool


def step(sched: Scheduler) -> list[Ran] | None:
    """One engine step with the fake model, checking the batch contract and integrity."""
    batch = sched.schedule()
    sched.check_integrity()
    if batch is None:
        return None
    assert batch.num_tokens <= sched.config.max_num_batched_tokens
    assert len(batch) <= sched.config.max_num_seqs
    decodes = [s.is_decode for s in batch.seqs]
    assert decodes == sorted(decodes, reverse=True)  # decodes first
    assert batch.num_decodes == sum(decodes)
    for s in batch.seqs:
        assert s.start == s.seq.num_computed_tokens
        assert len(s.seq.block_table) * BS >= s.end
    ran = [Ran(s.seq, s.start, s.num_new_tokens, s.sample) for s in batch.seqs]
    sampled = [(fake_token(s.seq), None) if s.sample else (None, None) for s in batch.seqs]
    sched.update(batch, sampled)
    sched.check_integrity()
    return ran


def run_to_end(sched: Scheduler, max_steps: int = 10_000) -> list[list[Ran]]:
    batches = []
    while sched.has_unfinished():
        batch = step(sched)
        assert batch is not None, "unfinished sequences but nothing scheduled"
        batches.append(batch)
        assert len(batches) < max_steps
    return batches


def random_prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference_outputs(prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    out = []
    for p in prompts:
        seq = make_seq(p, max_tokens)
        seq.append_token(fake_token(seq), None)
        while not seq.check_token_stop():
            seq.append_token(fake_token(seq), None)
        out.append(seq.output_token_ids)
    return out


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        config(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="chunked prefill"):
        config(enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="KV cache holds"):
        config(num_blocks=8)  # 32 token slots < max_model_len 64
    with pytest.raises(ValueError, match="max_waiting"):
        config(max_waiting=0)


def test_add_rejects_a_prompt_without_room_for_output():
    sched = Scheduler(config())
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq(list(range(64))))
    sched.add(make_seq(list(range(63))))
    assert sched.num_waiting == 1


def test_bounded_queue():
    sched = Scheduler(config(max_waiting=2))
    sched.add(make_seq([1, 2]))
    sched.add(make_seq([3, 4]))
    with pytest.raises(QueueFullError):
        sched.add(make_seq([5, 6]))
    step(sched)  # both admitted: room again
    sched.add(make_seq([5, 6]))


def test_outputs_match_the_reference():
    prompts = random_prompts(12)
    sched = Scheduler(config(max_num_seqs=5, max_num_batched_tokens=16))
    seqs = [make_seq(p) for p in prompts]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert [s.output_token_ids for s in seqs] == reference_outputs(prompts)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.config.num_blocks


def test_continuous_batching_admits_while_others_decode():
    sched = Scheduler(config())
    a = make_seq([1, 2, 3], max_tokens=20)
    sched.add(a)
    step(sched)
    step(sched)
    b = make_seq([4, 5, 6, 7, 8])
    sched.add(b)
    batch = step(sched)
    assert [(r.seq, r.num_new_tokens, r.sample) for r in batch] == [(a, 1, True), (b, 5, True)]


def test_chunked_prefill_splits_a_long_prompt():
    sched = Scheduler(config(max_num_batched_tokens=16))
    seq = make_seq(list(range(40)), max_tokens=2)
    sched.add(seq)
    chunks = [(r.start, r.num_new_tokens, r.sample) for b in run_to_end(sched) for r in b]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert seq.output_token_ids == reference_outputs([list(range(40))], 2)[0]


def test_chunked_prefill_shares_the_budget_with_decodes():
    sched = Scheduler(config(max_num_batched_tokens=10))
    a = make_seq([1, 2], max_tokens=10)
    sched.add(a)
    step(sched)
    sched.add(make_seq(list(range(30))))
    batch = step(sched)
    assert [r.num_new_tokens for r in batch] == [1, 9]


def test_decodes_come_first_and_one_prompt_token_is_a_prefill_chunk():
    sched = Scheduler(config(max_num_batched_tokens=10))
    sched.add(a := make_seq([1, 2]))
    step(sched)  # a's prompt; a decodes from now on
    sched.add(c := make_seq(list(range(8))))
    sched.add(b := make_seq([1, 2, 3, 4, 5]))
    batch = sched.schedule()  # a's decode, c's 8 tokens, b's first token: the budget left
    assert [(s.seq, s.num_new_tokens) for s in batch.seqs] == [(a, 1), (c, 8), (b, 1)]
    # b's token is a prompt token: it runs the prefill path, as it would in a longer chunk
    assert [s.is_decode for s in batch.seqs] == [True, False, False]
    assert batch.num_decodes == 1


def test_without_chunked_prefill_prompts_run_whole():
    sched = Scheduler(
        config(max_num_batched_tokens=64, enable_chunked_prefill=False, max_num_seqs=8)
    )
    prompts = random_prompts(6, seed=1, lo=20, hi=40)
    for p in prompts:
        sched.add(make_seq(p))
    for batch in run_to_end(sched):
        for r in batch:
            assert r.sample  # every chunk reaches the end: nothing split


def test_max_num_seqs():
    sched = Scheduler(config(max_num_seqs=3))
    for p in random_prompts(7, seed=2, hi=8):
        sched.add(make_seq(p))
    first = step(sched)
    assert len(first) == 3 and sched.num_running == 3 and sched.num_waiting == 4
    batches = run_to_end(sched)
    assert max(len(b) for b in batches) == 3


def test_preemption_keeps_outputs():
    prompts = random_prompts(10, seed=3, lo=10, hi=30)
    max_tokens = 20
    # 16 blocks of 4 = 64 slots; ten sequences of up to 50 tokens need far more
    sched = Scheduler(config(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=32))
    seqs = [make_seq(p, max_tokens) for p in prompts]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert sched.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions
    assert [s.output_token_ids for s in seqs] == reference_outputs(prompts, max_tokens)
    assert sched.block_manager.num_free_blocks == 16


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_without_chunked_prefill(prefix_caching):
    prompts = random_prompts(8, seed=4, lo=10, hi=30)
    sched = Scheduler(
        config(
            num_blocks=16,
            max_num_batched_tokens=64,
            enable_chunked_prefill=False,
            enable_prefix_caching=prefix_caching,
        )
    )
    seqs = [make_seq(p, 20) for p in prompts]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert sched.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == reference_outputs(prompts, 20)


def test_preempted_sequence_goes_to_the_front():
    sched = Scheduler(config(num_blocks=16, max_num_batched_tokens=64))
    old, new = make_seq(list(range(30)), 30), make_seq(list(range(30, 60)), 30)
    sched.add(old)
    sched.add(new)
    sched.add(late := make_seq([1, 2]))
    while not sched.num_preemptions:
        step(sched)
    assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert old.status is SequenceStatus.RUNNING
    assert list(sched.waiting) == [new, late]


def test_abort_frees_blocks_at_once():
    sched = Scheduler(config(max_num_seqs=2))
    total = sched.block_manager.num_free_blocks
    for i, p in enumerate(random_prompts(3, seed=5, lo=10, hi=20)):
        sched.add(make_seq(p, 20, request_id=f"r{i}"))
    step(sched)
    step(sched)
    assert sched.block_manager.num_free_blocks < total
    aborted = [s for i in range(3) for s in sched.abort(f"r{i}")]
    assert len(aborted) == 3  # two running, one still waiting
    assert all(s.finish_reason is FinishReason.ABORT and s.is_finished for s in aborted)
    assert all(s.block_table == [] for s in aborted)
    assert not sched.has_unfinished() and sched.schedule() is None
    assert sched.block_manager.num_free_blocks == total
    assert sched.abort("unknown") == []
    sched.check_integrity()


def test_abort_between_schedule_and_update():
    sched = Scheduler(config())
    sched.add(make_seq([1, 2, 3], request_id="a"))
    sched.add(b := make_seq([4, 5, 6], request_id="b"))
    batch = sched.schedule()
    sched.abort("a")
    updated = sched.update(batch, [(fake_token(s.seq), None) for s in batch.seqs])
    assert updated == [b]
    sched.check_integrity()


def test_finish_for_a_stop_string():
    sched = Scheduler(config())
    sched.add(seq := make_seq([1, 2, 3], 20))
    step(sched)
    sched.finish(seq, FinishReason.STOP, "stop")
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason == "stop"
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.config.num_blocks
    sched.check_integrity()


def test_update_returns_sequences_that_got_a_token():
    sched = Scheduler(config(max_num_batched_tokens=8))
    sched.add(a := make_seq([1, 2, 3], 20))
    sched.add(make_seq(list(range(20))))  # chunked: no token this step
    batch = sched.schedule()
    sampled = [(fake_token(s.seq), None) if s.sample else (None, None) for s in batch.seqs]
    assert sched.update(batch, sampled) == [a]
    with pytest.raises(ValueError, match="results"):
        sched.update(batch, [])


def test_scheduler_caps_at_its_max_model_len():
    sched = Scheduler(config(max_model_len=16))
    seq = make_seq(list(range(10)), max_tokens=100)  # seq.max_model_len is unbounded
    sched.add(seq)
    run_to_end(sched)
    assert seq.num_tokens == 16 and seq.finish_reason is FinishReason.LENGTH


def test_prefix_cache_hits_for_a_shared_prefix():
    shared = list(range(100, 130))  # 30 tokens: 7 full blocks
    sched = Scheduler(config())
    a = make_seq(shared + [1, 2])
    sched.add(a)
    run_to_end(sched)
    b = make_seq(shared + [3, 4, 5])
    sched.add(b)
    first = step(sched)
    assert first[0].start == 28 and first[0].num_new_tokens == 5
    assert b.num_cached_prompt_tokens == 28
    assert sched.block_manager.prefix_cache_hits == 28
    run_to_end(sched)
    assert b.output_token_ids == reference_outputs([shared + [3, 4, 5]])[0]


def test_prompt_logprobs_sequences_skip_the_cache():
    sched = Scheduler(config())
    sched.add(make_seq(list(range(20))))
    run_to_end(sched)
    sched.add(seq := make_seq(list(range(20)), prompt_logprobs=1))
    assert step(sched)[0].start == 0
    assert seq.num_cached_prompt_tokens == 0


def test_randomized_arrivals_and_aborts():
    """Requests arrive, abort and finish at random over a tight pool; every survivor's output
    equals the reference and the pool ends empty."""
    rng = random.Random(99)
    sched = Scheduler(
        config(num_blocks=20, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48)
    )
    shared = [rng.randrange(100) for _ in range(12)]
    done: list[Sequence] = []
    for i in range(300):
        if rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + random_prompts(1, seed=i, hi=20)[0]
            seq = make_seq(prompt, rng.randint(1, 15), request_id=f"r{i}")
            sched.add(seq)
            done.append(seq)
        if rng.random() < 0.05 and done:
            sched.abort(rng.choice(done).request_id)
        step(sched)
    run_to_end(sched)
    assert sched.num_preemptions > 0 and sched.block_manager.prefix_cache_hits > 0
    for seq in done:
        assert seq.is_finished
        if seq.finish_reason is not FinishReason.ABORT:
            want = reference_outputs([seq.prompt_token_ids], seq.params.max_tokens)[0]
            assert seq.output_token_ids == want
    assert sched.block_manager.num_free_blocks == 20
