"""The scheduler's side of prefill/decode disaggregation, without a model: decode-role
sequences are admitted with blocks for all prompt tokens but the last and parked until their
KV arrives; prefill-role sequences compute their prompt, never sample and are parked when it
is done; parked sequences that are aborted or released keep their blocks in quarantine until
the connector frees them. ``check_integrity()`` runs after every step."""

from __future__ import annotations

import pytest

from moeserve.core import FinishReason, KVRole, SamplingParams, Sequence, SequenceStatus
from moeserve.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def scheduler(**kw) -> Scheduler:
    kw.setdefault("max_model_len", 64)
    kw.setdefault("num_blocks", 32)
    kw.setdefault("block_size", BS)
    return Scheduler(SchedulerConfig(**kw))


def seq(
    n: int, role: KVRole = KVRole.LOCAL, request_id: str = "r", first: int = 10, max_tokens=3
) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(first, first + n))
    return Sequence(request_id=request_id, prompt_token_ids=prompt, params=params, kv_role=role)


def step(sched: Scheduler) -> list[tuple[Sequence, int, int, bool]]:
    """One step with a fake model (token 7 for each entry that samples); returns
    (sequence, start, tokens, samples) per entry, [] when nothing ran."""
    batch = sched.schedule()
    sched.check_integrity()
    if batch is None:
        return []
    assert batch.num_tokens <= sched.config.max_num_batched_tokens
    ran = [(s.seq, s.start, s.num_new_tokens, s.sample) for s in batch.seqs]
    for s in batch.seqs:
        assert not (s.sample and s.seq.kv_role is KVRole.PREFILL), "a prefill-role entry sampled"
    sched.update(batch, [(7, None) if s.sample else (None, None) for s in batch.seqs])
    sched.check_integrity()
    return ran


def all_free(sched: Scheduler) -> bool:
    sched.check_integrity()
    bm = sched.block_manager
    return bm.num_free_blocks == bm.num_blocks and not sched.parked and not sched.quarantined


def test_a_decode_role_sequence_waits_parked_then_runs_its_last_prompt_token():
    sched = scheduler(max_num_batched_tokens=4)  # the budget is far below the prompt
    d = seq(10, KVRole.DECODE)
    sched.add(d)
    assert step(sched) == []  # admitted and parked: no tokens computed here
    assert d.status is SequenceStatus.PARKED and sched.parked == {d.seq_id: d}
    assert sched.newly_parked == [d] and sched.has_unfinished()
    assert len(d.block_table) == 3 and d.num_computed_tokens == 0  # 9 tokens in blocks of 4
    sched.newly_parked.clear()
    assert step(sched) == []  # still parked
    sched.kv_arrived(d)
    assert d.kv_role is KVRole.LOCAL and d.status is SequenceStatus.RUNNING
    [(s, start, n, samples)] = step(sched)
    assert (s, start, n, samples) == (d, 9, 1, True)  # one prompt token, which samples
    assert d.output_token_ids == [7] and len(d.block_table) == 3
    while sched.has_unfinished():
        [(_, _, n, samples)] = step(sched)
        assert (n, samples) == (1, True)
    assert d.finish_reason is FinishReason.LENGTH and d.output_token_ids == [7, 7, 7]
    assert all_free(sched)


def test_decode_role_sequences_count_toward_max_num_seqs_not_the_budget():
    sched = scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    a, b = seq(20, KVRole.DECODE, "a"), seq(20, KVRole.DECODE, "b")
    local = seq(3, request_id="c")
    for s in (a, b, local):
        sched.add(s)
    assert step(sched) == []
    assert sched.num_parked == 2 and list(sched.waiting) == [local]  # the third must wait
    sched.kv_arrived(a)
    ran = step(sched)
    assert [(s, n) for s, _, n, _ in ran] == [(a, 1)] and list(sched.waiting) == [local]
    sched.kv_arrived(b)
    while sched.has_unfinished():
        step(sched)
    assert all(s.output_token_ids == [7, 7, 7] for s in (a, b, local))
    assert all_free(sched)


def test_a_decode_role_sequence_waits_in_line_for_blocks():
    sched = scheduler(num_blocks=16, max_model_len=60)
    big, small = seq(57, KVRole.DECODE, "big"), seq(10, KVRole.DECODE, "small")
    hog = seq(40, request_id="hog")
    sched.add(hog)
    step(sched)  # the local sequence takes 10 of the 16 blocks
    sched.add(big)
    sched.add(small)
    step(sched)
    assert list(sched.waiting) == [big, small]  # first come, first served: small waits too
    while not hog.is_finished:
        step(sched)
    step(sched)
    assert sched.parked == {big.seq_id: big} and len(big.block_table) == 14
    assert list(sched.waiting) == [small]  # 3 blocks wanted, 2 free
    sched.kv_arrived(big)
    while not big.is_finished:
        step(sched)
    step(sched)
    assert sched.parked == {small.seq_id: small} and len(small.block_table) == 3
    sched.kv_arrived(small)
    while sched.has_unfinished():
        step(sched)
    assert big.finish_reason is FinishReason.LENGTH and len(big.output_token_ids) == 3
    assert all_free(sched)


@pytest.mark.parametrize("budget", [64, 5])
def test_a_prefill_role_sequence_never_samples_and_parks_when_its_prompt_is_computed(budget):
    sched = scheduler(max_num_batched_tokens=budget)
    p = seq(13, KVRole.PREFILL)
    sched.add(p)
    chunks = []
    while p.status is not SequenceStatus.PARKED:
        [(s, start, n, samples)] = step(sched)
        assert s is p and not samples
        chunks.append((start, n))
    assert chunks == ([(0, 13)] if budget == 64 else [(0, 5), (5, 5), (10, 3)])
    assert sched.newly_parked == [p] and p.num_computed_tokens == 13 and not p.output_token_ids
    assert len(p.block_table) == 4 and not sched.running
    assert step(sched) == []  # parked: nothing to run
    sched.newly_parked.clear()
    with pytest.raises(ValueError, match="is not waiting for its KV"):
        sched.kv_arrived(p)
    assert sched.parked == {p.seq_id: p}  # a refused kv_arrived leaves it parked
    sched.check_integrity()
    assert sched.release(p, FinishReason.LENGTH) is p
    assert p.finish_reason is FinishReason.LENGTH and p.error is None
    assert not sched.has_unfinished() and all_free(sched)
    # its full prompt blocks stay in the prefix cache: the next prompt hits them
    q = seq(13, KVRole.PREFILL, "q")
    sched.add(q)
    [(_, start, n, _)] = step(sched)
    assert (start, n) == (12, 1) and q.status is SequenceStatus.PARKED
    sched.release(q, FinishReason.LENGTH)
    assert all_free(sched)


def test_parked_sequences_run_beside_local_ones():
    """A prefill-role sequence parked on a prefill instance and local requests beside it."""
    sched = scheduler(max_num_batched_tokens=8)
    p, local = seq(9, KVRole.PREFILL, "p"), seq(6, request_id="l", first=50)
    sched.add(p)
    sched.add(local)
    while p.status is not SequenceStatus.PARKED:
        step(sched)
    while sched.running:
        [(s, *_)] = step(sched)
        assert s is local
    assert local.output_token_ids == [7, 7, 7] and sched.has_unfinished()
    sched.release(p, FinishReason.ABORT, "the transfer failed")
    assert p.error == "the transfer failed" and p.finish_reason is FinishReason.ABORT
    assert all_free(sched)


@pytest.mark.parametrize("role", [KVRole.DECODE, KVRole.PREFILL])
def test_aborting_a_parked_sequence_quarantines_its_blocks(role):
    sched = scheduler()
    s = seq(9, role)
    sched.add(s)
    while s.status is not SequenceStatus.PARKED:
        step(sched)
    blocks = list(s.block_table)
    assert sched.abort("r") == [s]
    assert s.finish_reason is FinishReason.ABORT and sched.newly_quarantined == [s]
    assert sched.quarantined == {s.seq_id: s} and not sched.parked
    assert not sched.has_unfinished() and s.block_table == blocks  # a transfer may touch them
    sched.check_integrity()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - len(blocks)
    assert sched.abort("r") == []  # already finished
    with pytest.raises(ValueError, match="is not parked"):
        sched.release(s, FinishReason.ABORT)
    sched.free_quarantined(s)
    sched.free_quarantined(s)  # once only
    assert all_free(sched)


def test_release_keeping_the_blocks_quarantines_them():
    sched = scheduler()
    d = seq(9, KVRole.DECODE)
    sched.add(d)
    step(sched)
    sched.release(d, FinishReason.ABORT, "no KV within 1s", keep_blocks=True)
    assert d.is_finished and d.error == "no KV within 1s"
    assert sched.quarantined == {d.seq_id: d} and len(d.block_table) == 2
    assert sched.newly_quarantined == []  # the connector knows already: it released it
    sched.check_integrity()
    with pytest.raises(ValueError, match="is not waiting for its KV"):
        sched.kv_arrived(d)
    sched.free_quarantined(d)
    assert all_free(sched)


def test_a_decode_role_sequence_preempted_after_its_kv_arrived_recomputes_locally():
    """After ``kv_arrived`` the sequence is local: a preemption recomputes its prompt here."""
    sched = scheduler(num_blocks=6, max_model_len=24, max_num_batched_tokens=64)
    other = seq(7, request_id="o", first=40, max_tokens=4)  # arrived first: never the victim
    d = seq(15, KVRole.DECODE, "d", max_tokens=8)
    sched.add(d)
    step(sched)
    sched.kv_arrived(d)
    step(sched)  # d's 16 tokens fill 4 blocks
    sched.add(other)
    step(sched)  # other takes the last 2 blocks; d's next token needs a fifth
    [(s, *_)] = step(sched)
    assert s is other and d.status is SequenceStatus.WAITING and d.num_preemptions == 1
    while sched.has_unfinished():
        step(sched)
    assert d.kv_role is KVRole.LOCAL and d.output_token_ids == [7] * 8
    assert all_free(sched)
