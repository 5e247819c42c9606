"""Engine behaviour on a tiny DeepSeek-V3 checkpoint: continuous batching, chunked prefill,
prefix caching, preemption and aborts all leave the greedy outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.checkpoints import build_hf_model, save_hf_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path_factory.mktemp("ds"))


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(path), dtype="float32", progress=False, **kw)


def prompts(n: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (n,), generator=g).tolist()
    return [(prefix or []) + torch.randint(2, 512, (m,), generator=g).tolist() for m in lengths]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(ckpt):
    """Each of the 16 prompts run alone: the reference for every batching test."""
    llm = make_llm(ckpt, max_num_seqs=1, enable_prefix_caching=False)
    ref = [token_ids(llm.generate(p, GREEDY))[0] for p in prompts(16)]
    llm.engine.scheduler.check_integrity()
    return ref


def test_continuous_batching_matches_each_alone(ckpt, alone):
    # a small token budget forces chunked prefill and decode+prefill mixed in one step
    llm = make_llm(ckpt, max_num_seqs=8, max_num_batched_tokens=48)
    assert token_ids(llm.generate(prompts(16), GREEDY)) == alone
    llm.engine.scheduler.check_integrity()


def test_prefix_caching_on_and_off_agree_and_hits_count(ckpt):
    shared = prompts(1, seed=7)[0] + prompts(1, seed=8)[0]  # a long common prefix
    ps = prompts(6, seed=9, prefix=shared)
    results = {}
    for on in (False, True):
        llm = make_llm(ckpt, max_num_seqs=4, enable_prefix_caching=on)
        results[on] = token_ids(llm.generate(ps[:1], GREEDY)) + token_ids(
            llm.generate(ps[1:], GREEDY)
        )
        bm = llm.engine.scheduler.block_manager
        if on:
            assert bm.prefix_cache_hits > 0
        else:
            assert bm.prefix_cache_hits == 0
        llm.engine.scheduler.check_integrity()
    assert results[True] == results[False]


def test_small_kv_pool_preempts_and_still_matches(ckpt, alone):
    spec_bytes = make_llm(ckpt, max_num_seqs=1).engine.kv_pool.spec.bytes_per_token
    # room for ~14 blocks of 16 tokens: far less than 8 sequences of up to ~100 tokens
    gb = 14 * 16 * spec_bytes / (1 << 30)
    llm = make_llm(ckpt, max_num_seqs=8, kv_cache_memory_gb=gb, max_model_len=128)
    assert token_ids(llm.generate(prompts(16), GREEDY)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_integrity()


def test_abort_frees_blocks_at_once(ckpt):
    llm = make_llm(ckpt)
    engine = llm.engine
    bm = engine.scheduler.block_manager
    free0 = bm.num_free_blocks
    for i, p in enumerate(prompts(4, seed=3)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert bm.num_free_blocks < free0
    for i in range(4):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    # aborted requests leave nothing pinned: every block is free or evictable cache
    assert bm.num_free_blocks == free0


def test_seeded_sampling_and_n(ckpt):
    llm = make_llm(ckpt)
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    a = llm.generate([prompts(1, seed=5)[0]], p)[0]
    b = llm.generate([prompts(1, seed=5)[0]], p)[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # samples differ from each other
    llm.engine.scheduler.check_integrity()


def test_logprobs_of_generated_tokens(ckpt):
    llm = make_llm(ckpt)
    out = llm.generate(
        prompts(1, seed=6), SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert pos[tok].rank == 1  # greedy picks the most likely token
        assert len(pos) == 2
        assert pos[tok].decoded_token is not None
    assert c.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs))
    )


def test_stop_string_and_stop_token(ckpt):
    llm = make_llm(ckpt)
    tok = llm.get_tokenizer()
    base = llm.generate(
        "hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )[0].outputs[0]
    # stop on a piece of the greedy text: the output ends right before it
    text = base.text
    assert len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = llm.generate(
        "hello world", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=stop)
    )[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    # stop token id: finishes on that token
    stop_id = base.token_ids[3]
    cut = llm.generate(
        "hello world", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert cut.token_ids[-1] == stop_id and cut.finish_reason == "stop"
    assert cut.stop_reason == stop_id
    assert tok is not None
    llm.engine.scheduler.check_integrity()


def test_bad_prompts_are_rejected_without_leaking(ckpt):
    llm = make_llm(ckpt, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(2, 80))], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()


def test_more_samples_than_the_queue_holds_is_invalid_not_full(ckpt):
    llm = make_llm(ckpt, max_waiting_requests=2)
    with pytest.raises(ValueError, match="can never be queued"):
        llm.engine.add_request("r", [5, 6], SamplingParams(n=3, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("ok", [5, 6], SamplingParams(n=2, max_tokens=2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.scheduler.check_integrity()


def test_max_model_len_finishes_with_length(ckpt):
    llm = make_llm(ckpt, max_model_len=40)
    out = llm.generate([list(range(2, 32))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"


def test_prompt_logprobs_survive_chunked_prefill(ckpt):
    ids = prompts(1, seed=12)[0] + prompts(1, seed=13)[0]
    p = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    whole = make_llm(ckpt).generate([ids], p)[0]
    chunked = make_llm(ckpt, max_num_batched_tokens=16).generate([ids], p)[0]
    assert len(chunked.prompt_logprobs) == len(ids) and chunked.prompt_logprobs[0] is None
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_chat_renders_the_template_and_takes_many_conversations(ckpt):
    llm = make_llm(ckpt)
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = llm.chat(conv, p)
    want = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
    assert len(out) == 1 and out[0].prompt_token_ids == want
    assert want[0] == tok.bos_token_id and want.count(tok.bos_token_id) == 1
    many = llm.chat([conv, [{"role": "user", "content": "Hello"}]], p)
    assert len(many) == 2 and many[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_micro_batches_keep_order_and_balance_tokens():
    from moeserve.core import Batch, ScheduledSeq, Sequence
    from moeserve.engine.model_runner import split_micro_batches

    seqs = [
        Sequence(request_id=str(i), prompt_token_ids=[1] * n, params=SamplingParams())
        for i, n in enumerate([1, 1, 30, 5, 40])
    ]
    batch = Batch(tuple(ScheduledSeq(s, 0, len(s.prompt_token_ids)) for s in seqs))
    for n in (1, 2, 3, 7):
        parts = split_micro_batches(batch, n)
        assert len(parts) == n
        assert [s for p in parts for s in p.seqs] == list(batch.seqs)
    two = split_micro_batches(batch, 2)
    assert [s.seq.request_id for s in two[1].seqs] == ["4"]  # 40 of 77 tokens
