"""Speculative sampling through the whole engine on a tiny-vocabulary model: the second and
third tokens follow the target model's exact marginals (computed with transformers), and
the same test fails when the accept/reject rule is broken."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.spec import verify as verify_mod
from tests.mtp_checkpoint import save_mtp_checkpoint

VOCAB = 8
PROMPT = [2, 3, 4, 5, 6]
N = 600
# chi-square critical values at p = 0.001 by degrees of freedom (tables)
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    overrides = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    hf, _, path = save_mtp_checkpoint(
        tmp_path_factory.mktemp("tiny") / "ck", seed=3, with_tokenizer=False, **overrides
    )
    return hf, path


def exact_marginals(hf) -> tuple[torch.Tensor, torch.Tensor]:
    """p(token 2) and p(token 3) of plain sampling at temperature 1."""

    def probs(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + ids])).logits[0, -1].double()
        return logits.softmax(-1)

    p1 = probs([])
    p2, p3 = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        pa = probs([a])
        p2 += p1[a] * pa
        for b in range(VOCAB):
            p3 += p1[a] * pa[b] * probs([a, b])
    return p2, p3


def chi2_over_critical(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square statistic over its p = 0.001 critical value; bins expecting fewer than 5
    draws are merged."""
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] < 5:  # merge the small bin into the smallest big one
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmin()] += counts[~keep].sum()
        exp[exp.argmin()] += expected[~keep].sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat / CHI2_P001[len(obs) - 1]


def sampled_counts(path, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=256,
        progress=False,
        speculative_num_tokens=k,
    )
    params = SamplingParams(n=N, temperature=1.0, max_tokens=4, ignore_eos=True, seed=11)
    out = llm.generate(PROMPT, params)[0]
    toks = torch.tensor([c.token_ids for c in out.outputs])
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    return torch.bincount(toks[:, 1], minlength=VOCAB).double(), torch.bincount(
        toks[:, 2], minlength=VOCAB
    ).double()


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_with_mtp_keeps_the_target_distribution(model, k):
    hf, path = model
    p2, p3 = exact_marginals(hf)
    c2, c3 = sampled_counts(path, k)
    assert chi2_over_critical(c2, p2) < 1
    assert chi2_over_critical(c3, p3) < 1


def test_a_broken_rule_fails(model, monkeypatch):
    """Accepting every draft (tokens follow the draft) must be caught by the same test."""
    hf, path = model
    p2, p3 = exact_marginals(hf)
    real = verify_mod.rejection_sample

    def always_accept(drafts, num, q, p, u_acc, u_fin):
        # the target made equal to the draft where there are drafts: everything is accepted
        return real(drafts, num, q, torch.cat([q.to(p.dtype), p[:, -1:]], dim=1), u_acc, u_fin)

    monkeypatch.setattr(verify_mod, "rejection_sample", always_accept)
    c2, c3 = sampled_counts(path, 2)
    assert max(chi2_over_critical(c2, p2), chi2_over_critical(c3, p3)) > 1
