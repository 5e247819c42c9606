"""Verification with the sampler's processing: drafts count as output tokens for the rows
after them (penalties, min_tokens), and a row without drafts is a plain sampler step."""

from __future__ import annotations

import torch

from moeserve.core import SamplingParams, Sequence
from moeserve.layers.sampler import Sampler
from moeserve.spec.verify import SeqView, sample_drafts, verify


def make_seq(output=(), **params) -> Sequence:
    seq = Sequence(request_id="r", prompt_token_ids=[1, 2], params=SamplingParams(**params))
    seq.output_token_ids = list(output)
    return seq


def test_no_drafts_is_a_greedy_sampler_step():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)
    seqs = [make_seq(temperature=0), make_seq([4], temperature=0, repetition_penalty=1.5)]
    seqs.append(make_seq([5, 5], temperature=0, frequency_penalty=1.0))
    got = verify(logits, seqs, [(), (), ()], [None] * 3)
    assert [v.token_ids for v in got] == [[t] for t in Sampler()(logits, seqs).token_ids]
    assert all(v.num_accepted == 0 for v in got)


def test_drafts_are_history_for_the_rows_after_them():
    """Token 3 leads at both rows; the draft 3 is accepted at row 0, and row 1 sees it as an
    output token, so the repetition penalty hands row 1 to token 4."""
    logits = torch.full((2, 6), 0.0)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    seq = make_seq(temperature=0, repetition_penalty=2.0)
    (v,) = verify(logits, [seq], [(3,)], [None])
    assert v.token_ids == [3, 4] and v.num_accepted == 1
    (plain,) = verify(logits[:1], [seq], [()], [None])
    assert plain.token_ids == [3]


def test_min_tokens_blocks_eos_on_draft_rows():
    seq = make_seq(temperature=0, min_tokens=2)
    seq.eos_token_ids = frozenset({1})
    logits = torch.zeros(3, 5)
    logits[:, 1] = 5.0  # EOS wins unless blocked
    logits[:, 2] = 1.0
    (v,) = verify(logits, [seq], [(2, 2)], [None])
    # rows 0 and 1 have 0 and 1 outputs before them: EOS blocked; row 2 has 2: EOS allowed
    assert v.token_ids == [2, 2, 1]


def test_seeded_sequences_draw_only_from_their_generator():
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    seqs = [make_seq(temperature=0.8, seed=5)]
    toks, probs = sample_drafts(logits[:1], [SeqView.of(seqs[0])])
    assert probs[0] is not None and abs(float(probs[0].sum()) - 1) < 1e-5
    seqs2 = [make_seq(temperature=0.8, seed=5)]
    torch.manual_seed(123)  # the global RNG must not matter
    toks2, _ = sample_drafts(logits[:1], [SeqView.of(seqs2[0])])
    assert toks == toks2
    a = verify(logits, seqs, [tuple(toks)], [probs[0][None]])
    b = verify(logits, seqs2, [tuple(toks)], [probs[0][None]])
    assert a[0].token_ids == b[0].token_ids


def test_logprobs_for_every_emitted_token():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    seq = make_seq(temperature=0, logprobs=2)
    drafts = tuple(int(t) for t in logits[:2].argmax(-1))
    (v,) = verify(logits, [seq], [drafts], [None])
    assert v.num_accepted == 2 and len(v.logprobs) == 3
    lp = torch.log_softmax(logits, -1)
    for j, (tok, entry) in enumerate(zip(v.token_ids, v.logprobs)):
        assert abs(entry[tok].logprob - float(lp[j, tok])) < 1e-6 and entry[tok].rank == 1
