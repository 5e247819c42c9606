"""MTP speculative decoding in the engine: greedy outputs identical to MTP off, whatever the
drafts; stops inside accepted tokens; chunked prefill, prefix caching and preemption; the KV
cache intact after every test (``tests/conftest.py`` checks every engine)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.spec.mtp import MTPProposer
from tests.mtp_checkpoint import save_mtp_checkpoint

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, progress=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    _, _, path = save_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ck")
    return path


def mixed_prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 33, 5, 21][:n]
    return [torch.randint(2, 500, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), **ENGINE)
    return {
        "mixed": [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(), GREEDY)],
    }


class OracleDrafts:
    """Runs the real MTP layer (its cache must stay filled), then replaces its greedy drafts
    by the known continuation with every ``miss``-th draft wrong, so steps accept several
    tokens, some all k, some none."""

    def __init__(self, inner: MTPProposer, continuations: dict[tuple[int, ...], list[int]], miss):
        self.inner, self.continuations, self.miss = inner, continuations, miss
        self.calls = 0

    def propose(self, h_TD, entries):
        out = self.inner.propose(h_TD, entries)
        fixed = []
        for e, (drafts, probs) in zip(entries, out, strict=True):
            ref = self.continuations.get(tuple(e.seq.prompt_token_ids))
            if ref is None or not drafts or not e.seq.params.greedy:
                fixed.append((drafts, probs))
                continue
            at = len(e.seq.output_token_ids) + len(e.history)
            want = ref[at : at + len(drafts)]
            want += [7] * (len(drafts) - len(want))
            for j in range(len(want)):
                self.calls += 1
                if self.calls % self.miss == 0:
                    want[j] = (want[j] + 1) % 500
            fixed.append((want, probs))
        return fixed


def spec_llm(ckpt, k: int, continuations=None, miss: int = 5, **kw) -> LLM:
    llm = LLM(str(ckpt), speculative_num_tokens=k, **{**ENGINE, **kw})
    if continuations is not None:
        runner = llm.engine.runner
        runner.proposer = OracleDrafts(runner.proposer, continuations, miss)
    return llm


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_identical_with_mtp_drafts(ckpt, reference, k):
    llm = spec_llm(ckpt, k)
    assert tokens(llm.generate(mixed_prompts(), GREEDY)) == reference["mixed"]
    stats = llm.engine.stats()
    assert stats["spec_decode_num_verify_steps"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_verify_steps"]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_identical_when_drafts_are_often_right(ckpt, reference, k):
    ps = mixed_prompts()
    conts = {tuple(p): r for p, r in zip(ps, reference["mixed"])}
    llm = spec_llm(ckpt, k, conts, miss=4)
    assert tokens(llm.generate(ps, GREEDY)) == reference["mixed"]
    s = llm.engine.stats()
    # most drafts right: many more accepted tokens than steps that verified
    assert s["spec_decode_num_accepted_tokens"] > 0.5 * s["spec_decode_num_draft_tokens"]
    assert s["spec_decode_num_accepted_tokens"] > s["spec_decode_num_verify_steps"] * (k > 1)


def test_chunked_prefill_prefix_cache_and_preemption(ckpt, reference):
    """A tiny token budget chunks the prompts, shared prefixes hit the cache, and a KV pool
    of a few blocks preempts sequences mid-generation; outputs stay the same."""
    ps = mixed_prompts()
    shared = [ps[2][:32] + p for p in ps[:3]]
    base = LLM(str(ckpt), **ENGINE)
    want = tokens(base.generate(ps + shared, GREEDY))
    conts = {tuple(p): r for p, r in zip(ps + shared, want)}
    # 9 blocks of 16 tokens, 4 cache layers (3 + MTP) of 48 fp32 numbers per token
    kw = dict(max_num_batched_tokens=24, max_model_len=128, block_size=16)
    llm = spec_llm(ckpt, 3, conts, miss=3, kv_cache_memory_gb=9 * 16 * 48 * 4 * 4 / 2**30, **kw)
    assert llm.engine.scheduler.block_manager.num_blocks == 9
    got = tokens(llm.generate(ps + shared, GREEDY))
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert sched.block_manager.prefix_cache_hits > 0
    sched.check_integrity()
    assert not sched.drafts  # nothing left behind by finished sequences


def test_max_tokens_and_stop_token_inside_accepted_tokens(ckpt, reference):
    ps = mixed_prompts()
    conts = {tuple(p): r for p, r in zip(ps, reference["mixed"])}
    llm = spec_llm(ckpt, 3, conts, miss=1000)  # drafts always right: 4 tokens a step
    for max_tokens in (1, 2, 6, 7):
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        got = tokens(llm.generate(ps, p))
        assert got == [r[:max_tokens] for r in reference["mixed"]]
    # stop at the 6th token of each reference: a token accepted in the middle of a step
    for p_ids, ref in zip(ps, reference["mixed"]):
        stop = ref[5]
        cut = ref.index(stop) + 1
        out = llm.generate(
            p_ids,
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
        )
        c = out[0].outputs[0]
        assert c.token_ids == ref[:cut] and c.finish_reason == "stop" and c.stop_reason == stop


def test_stop_string_inside_accepted_tokens(ckpt, reference):
    ps = mixed_prompts()
    conts = {tuple(p): r for p, r in zip(ps, reference["mixed"])}
    base = LLM(str(ckpt), **ENGINE)
    llm = spec_llm(ckpt, 3, conts, miss=1000)
    tok = llm.get_tokenizer()
    for p_ids, ref in zip(ps, reference["mixed"]):
        text = tok.decode(ref[:12])
        stop = text[len(tok.decode(ref[:6])) :][:3]
        if not stop.strip():
            continue
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
        want = base.generate(p_ids, params)[0].outputs[0]
        got = llm.generate(p_ids, params)[0].outputs[0]
        assert (got.text, got.finish_reason, got.stop_reason) == (
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        assert got.token_ids == want.token_ids


def test_spec_without_mtp_layer_is_refused(tmp_path):
    from tests.checkpoints import build_hf_model, save_hf_checkpoint

    path = save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path / "plain")
    with pytest.raises(ValueError, match="MTP layer"):
        LLM(str(path), speculative_num_tokens=2, **ENGINE)
