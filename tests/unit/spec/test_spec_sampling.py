"""Speculative sampling through the whole engine on a tiny-vocabulary model: the second and
third tokens follow the target model's exact marginals (computed with transformers), also
when drafts come from a hot subset of the vocabulary, and the same test fails when the
accept/reject rule is broken (or compares with a draft distribution that was not the one
drafted from)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.spec import mtp as mtp_mod
from moeserve.spec import verify as verify_mod
from moeserve.spec.hot_vocab import save_token_map
from tests.mtp_checkpoint import save_mtp_checkpoint

VOCAB = 8
PROMPT = [2, 3, 4, 5, 6]
N = 600
# chi-square critical values at p = 0.001 by degrees of freedom (tables)
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
HOT = [0, 2, 3, 5, 6]  # the drafts' vocabulary in the hot-map tests


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


def sampled_counts(path, k: int, token_map=None, patch=None) -> tuple[torch.Tensor, torch.Tensor]:
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=256,
        progress=False,
        speculative_num_tokens=k,
        speculative_token_map=token_map,
    )
    if patch is not None:
        patch(llm)
    drafted: set[int] = set()
    proposer, real = llm.engine.runner.proposer, llm.engine.runner.proposer.propose

    def propose(h_TD, entries):
        out = real(h_TD, entries)
        drafted.update(t for d, _ in out for t in d)
        return out

    proposer.propose = propose
    params = SamplingParams(n=N, temperature=1.0, max_tokens=4, ignore_eos=True, seed=11)
    out = llm.generate(PROMPT, params)[0]
    toks = torch.tensor([c.token_ids for c in out.outputs])
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if token_map is not None:
        assert drafted <= set(HOT)
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


@pytest.fixture
def hot_map(tmp_path):
    path = tmp_path / "hot.pt"
    save_token_map(path, HOT)
    return str(path)


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_with_hot_drafts_keeps_the_target_distribution(model, hot_map, k):
    hf, path = model
    p2, p3 = exact_marginals(hf)
    c2, c3 = sampled_counts(path, k, hot_map)
    assert chi2_over_critical(c2, p2) < 1
    assert chi2_over_critical(c3, p3) < 1


def test_hot_drafts_judged_by_the_full_distribution_fail(model, hot_map, monkeypatch):
    """Drafting from the hot ids but handing rejection sampling the full-vocabulary
    distribution (not the renormalized one drafted from) must be caught."""
    hf, path = model
    p2, p3 = exact_marginals(hf)
    full: dict[str, torch.Tensor] = {}
    real_sample = mtp_mod.sample_drafts

    def patch(llm):
        proposer = llm.engine.runner.proposer

        def draft_logits(h_BD):
            full["logits"] = proposer.layer.compute_logits(h_BD)
            return proposer.hot.full_logits(h_BD)

        proposer.draft_logits = draft_logits

    def sample_drafts(logits_NV, views):
        toks, probs = real_sample(logits_NV, views)
        q_NV = full["logits"].float().softmax(dim=-1)
        return toks, [None if p is None else q_NV[i] for i, p in enumerate(probs)]

    monkeypatch.setattr(mtp_mod, "sample_drafts", sample_drafts)
    c2, c3 = sampled_counts(path, 2, hot_map, patch)
    assert max(chi2_over_critical(c2, p2), chi2_over_critical(c3, p3)) > 1
