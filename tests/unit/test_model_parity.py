"""moeserve against the transformers implementation of the same checkpoint (the oracle):
prompt log-probabilities within 1e-4 at every position and 32 identical greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.checkpoints import build_hf_model, save_hf_checkpoint

KINDS = ["deepseek_v3", "qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    hf = build_hf_model(request.param)
    path = save_hf_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    # MOESERVE_TEST_DEVICE=cuda runs moeserve on a GPU against the CPU oracle (scripts/)
    device = os.environ.get("MOESERVE_TEST_DEVICE", "cpu")
    llm = LLM(model=str(path), dtype="float32", device=device, max_model_len=512, progress=False)
    yield request.param, hf, llm
    llm.engine.scheduler.check_integrity()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (n,), generator=g).tolist()


def test_prompt_logprobs_match_transformers(pair):
    kind, hf, llm = pair
    ids = _prompt(1, 57)
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    got = torch.tensor([plp[i][ids[i]].logprob for i in range(1, len(ids))])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() < 1e-4, kind


def test_prompt_logprobs_top_n(pair):
    _, hf, llm = pair
    ids = _prompt(2, 20)
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=3, temperature=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        top = ref[i - 1].topk(3)
        for rank, (lp, tok) in enumerate(zip(top.values, top.indices), start=1):
            assert entry[int(tok)].rank == rank
            assert abs(entry[int(tok)].logprob - float(lp)) < 1e-4
        assert ids[i] in entry


def test_greedy_32_tokens_match_transformers(pair):
    kind, hf, llm = pair
    for seed, n in ((3, 9), (4, 33)):
        ids = _prompt(seed, n)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                pad_token_id=0,
            )[0, n:].tolist()
        out = llm.generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == ref, kind
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "overrides", [dict(q_lora_rank=None), dict(attention_bias=True)], ids=["no-q-lora", "bias"]
)
def test_deepseek_variants_match_transformers(tmp_path, overrides):
    """MLA without a query LoRA (q_proj straight from x, as DeepSeek-V2-Lite) and with
    projection biases (loaded into the fused q_a/kv_a projection)."""
    hf = build_hf_model("deepseek_v3", **overrides)
    if overrides.get("attention_bias"):
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias") and "correction" not in name:
                    p.normal_(0, 0.5)
    path = save_hf_checkpoint(hf, tmp_path / "ckpt")
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, progress=False)
    ids = _prompt(3, 41)
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() < 1e-4
    greedy = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref_ids = hf.generate(
            torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(ids) :].tolist()
    assert greedy.outputs[0].token_ids == ref_ids
    llm.engine.scheduler.check_integrity()
