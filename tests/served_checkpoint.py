"""A trained DeepSeek-V3 checkpoint with an MTP layer, as moeserve serves it: the drafts keep
the greedy tokens, and transformers reads the same model from the same files."""

from __future__ import annotations

from pathlib import Path

import torch


def check_served_checkpoint(model_dir: Path, prompt: str, max_tokens: int = 8) -> torch.Tensor:
    """moeserve (fp32 compute) on ``model_dir``: the same greedy tokens with the MTP layer
    drafting (k=2) as without, and transformers' prompt logprobs to 1e-4. Returns moeserve's
    prompt logprobs (each prompt token after the first)."""
    from transformers import AutoModelForCausalLM

    from moeserve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    plain = LLM(model=str(model_dir), dtype="float32", progress=False).generate([prompt], params)
    spec = LLM(model=str(model_dir), dtype="float32", progress=False, speculative_num_tokens=2)
    drafted = spec.generate([prompt], params)[0]
    assert drafted.outputs[0].token_ids == plain[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([plain[0].prompt_token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
    want = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    got = torch.tensor([next(iter(p.values())).logprob for p in plain[0].prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    return got
