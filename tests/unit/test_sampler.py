from __future__ import annotations

import math
import random

import pytest
import torch

from moeserve.core import SamplingParams, Sequence
from moeserve.layers import sampler as sampler_mod
from moeserve.layers.sampler import (
    Sampler,
    compute_prompt_logprobs,
    greedy_ids,
    process_logits,
    reference_process_logits,
    reference_sampling_logits,
    sample_reference,
    sampling_logits,
)


def make_seq(prompt=(1, 2, 3), output=(), eos=frozenset(), sample_index=0, **params) -> Sequence:
    seq = Sequence(
        request_id="r",
        prompt_token_ids=list(prompt),
        params=SamplingParams(**params),
        sample_index=sample_index,
        eos_token_ids=frozenset(eos),
    )
    seq.output_token_ids = list(output)
    return seq


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def kept(l_V: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(l_V)).flatten().tolist())


def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    before = logits.clone()
    out = Sampler()(logits, [make_seq(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


def test_greedy_ids_are_torch_argmax():
    """Ties (the first), nan (the first nan), all -inf, signed zeros; fp32 through NumPy, other
    dtypes through torch."""
    nan, inf = float("nan"), float("inf")
    rows = [[1, 3, 3, 2], [nan, 1, nan, 5], [-inf] * 4, [2, nan, 9, 9], [0.0, -0.0, 0.0, -1]]
    x = torch.tensor(rows)
    assert torch.equal(greedy_ids(x), x.argmax(-1))
    assert greedy_ids(x).dtype == torch.int64
    big = torch.randn(3, 32000)
    big[1, 7] = big[1, 9000] = big[1].max() + 1
    assert torch.equal(greedy_ids(big), big.argmax(-1))
    assert torch.equal(greedy_ids(big.double()), big.argmax(-1))
    assert torch.equal(greedy_ids(big[:, ::2]), big[:, ::2].argmax(-1))  # strided rows


def test_empty_batch_and_shape_check():
    assert Sampler()(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError, match="expected logits of shape"):
        Sampler()(torch.zeros(2, 10), [make_seq()])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_matches_distribution(temperature):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    n = 4000
    torch.manual_seed(1234)
    out = Sampler()(probs.log().expand(n, 4), [make_seq(temperature=temperature)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float()
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 16.3  # df = 3, p = 0.001


def test_top_k_keeps_k_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    seqs = [make_seq(top_k=5), make_seq(top_k=1), make_seq()]
    l = sampling_logits(logits, seqs)
    assert kept(l[0]) == set(logits[0].topk(5).indices.tolist())
    assert kept(l[1]) == {int(logits[1].argmax())}
    assert kept(l[2]) == set(range(100))
    torch.manual_seed(1)
    tokens = Sampler()(logits[:1].expand(500, 100), [seqs[0]] * 500).token_ids
    assert set(tokens) <= kept(l[0])


@pytest.mark.parametrize(
    "top_p, expected", [(0.45, {3}), (0.55, {3, 2}), (0.75, {3, 2}), (0.85, {3, 2, 1})]
)
def test_top_p_hand_made(top_p, expected):
    logits = logits_of([0.05, 0.15, 0.3, 0.5])
    seq = make_seq(top_p=top_p)
    assert kept(sampling_logits(logits[None], [seq])[0]) == expected
    assert kept(reference_sampling_logits(logits, seq.params)) == expected


def test_top_p_wide_nucleus_falls_back_to_full_sort():
    vocab = sampler_mod.TOP_P_CANDIDATES * 3
    torch.manual_seed(0)
    logits = torch.randn(2, vocab) * 0.1  # nearly flat: the nucleus is far wider than C
    seqs = [make_seq(top_p=0.9), make_seq(top_p=0.2)]
    fast = sampling_logits(logits, seqs)
    assert len(kept(fast[0])) > sampler_mod.TOP_P_CANDIDATES
    for r, s in enumerate(seqs):
        assert kept(fast[r]) == kept(reference_sampling_logits(logits[r], s.params))


def test_min_p():
    logits = logits_of([0.5, 0.3, 0.12, 0.08])
    seq = make_seq(min_p=0.2)  # threshold 0.1
    assert kept(sampling_logits(logits[None], [seq])[0]) == {0, 1, 2}
    assert kept(reference_sampling_logits(logits, seq.params)) == {0, 1, 2}


def test_repetition_penalty_exact():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    seq = make_seq(prompt=[0, 1], output=[3], repetition_penalty=2.0)
    expected = torch.tensor([1.0, -4.0, 1.0, -2.0, 0.5])
    assert torch.equal(reference_process_logits(logits, seq), expected)
    assert torch.equal(process_logits(logits[None], [seq])[0], expected)


def test_frequency_and_presence_penalties_exact():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    # token 0 only in the prompt: untouched; token 1 twice, token 2 once in the output
    seq = make_seq(prompt=[0], output=[1, 2, 1], frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([1.0, 1.0 - 2 * 0.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0])
    assert torch.equal(reference_process_logits(logits, seq), expected)
    assert torch.equal(process_logits(logits[None], [seq])[0], expected)


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 4)
    seqs = [
        make_seq(eos={1}, stop_token_ids=[2], min_tokens=2, temperature=0.0),
        make_seq(eos={1}, stop_token_ids=[2], min_tokens=2, output=[3, 3], temperature=0.0),
        make_seq(eos={1}, min_tokens=2, ignore_eos=True, temperature=0.0),
        make_seq(eos={1}, stop_token_ids=[2], min_tokens=5, output=[0]),
    ]
    out = Sampler()(logits, seqs)
    assert out.token_ids[:3] == [3, 1, 1]
    assert out.token_ids[3] not in (1, 2)
    processed = process_logits(logits, seqs)
    assert processed[0].tolist() == [0.0, -math.inf, -math.inf, 1.0]
    assert processed[1].tolist() == logits[1].tolist()


def test_no_processing_returns_input_itself():
    logits = torch.randn(2, 8)
    assert process_logits(logits, [make_seq(), make_seq(temperature=0.0)]) is logits


def test_same_seed_same_tokens_different_seeds_differ():
    torch.manual_seed(0)
    logits = torch.randn(10, 1000) * 0.1

    def run(seed):
        seq = make_seq(seed=seed)
        return [Sampler()(logits[i : i + 1], [seq]).token_ids[0] for i in range(10)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_row_independent_of_batch():
    torch.manual_seed(0)
    steps = [torch.randn(6, 500) for _ in range(5)]
    alone, in_batch = make_seq(seed=42, top_p=0.9), make_seq(seed=42, top_p=0.9)
    others = [make_seq(), make_seq(temperature=0.7, top_k=20), make_seq(seed=3), make_seq()]
    greedy = make_seq(temperature=0.0)
    tokens_alone, tokens_batch = [], []
    for l in steps:
        tokens_alone.append(Sampler()(l[2:3], [alone]).token_ids[0])
        batch = [others[0], greedy, in_batch, others[1], others[2], others[3]]
        tokens_batch.append(Sampler()(l, batch).token_ids[2])
    assert tokens_alone == tokens_batch


def test_seeded_rows_match_reference_token_for_token():
    """Random params on random logits: processed and sampling logits match the per-row
    reference, and seeded rows draw the same token as sample_reference."""
    rng = random.Random(0)
    torch.manual_seed(0)
    vocab = 300
    for _ in range(5):
        seqs = []
        for i in range(8):
            params = dict(
                temperature=rng.choice([0.0, 0.5, 1.0, 1.3]),
                top_k=rng.choice([-1, 1, 10, 50]),
                top_p=rng.choice([1.0, 0.5, 0.9]),
                min_p=rng.choice([0.0, 0.05]),
                repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
                frequency_penalty=rng.choice([0.0, 0.4]),
                presence_penalty=rng.choice([0.0, -0.3]),
                min_tokens=rng.choice([0, 3]),
                stop_token_ids=[rng.randrange(vocab)],
                seed=rng.choice([None, 100 + i]),
            )
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            seqs.append(make_seq(prompt, output, eos={0}, **params))
        logits = torch.randn(len(seqs), vocab) * 3
        processed = process_logits(logits, seqs)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(processed[b], reference_process_logits(logits[b], s))
            if not s.params.greedy:
                fast = sampling_logits(processed[b : b + 1], [s])[0]
                ref = reference_sampling_logits(processed[b], s.params)
                torch.testing.assert_close(fast, ref)
        twins = [make_seq(s.prompt_token_ids, s.output_token_ids, eos={0}, **_kw(s)) for s in seqs]
        out = Sampler()(logits, seqs)
        for b, s in enumerate(twins):
            if s.generator is not None or s.params.greedy:
                assert out.token_ids[b] == sample_reference(logits[b], s)


def _kw(seq: Sequence) -> dict:
    p = seq.params
    names = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_tokens"]
    names += ["frequency_penalty", "presence_penalty", "stop_token_ids", "seed"]
    return {n: getattr(p, n) for n in names}


def test_sample_logprobs_contents_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]] * 3)
    seqs = [
        make_seq(temperature=0.0, logprobs=2, repetition_penalty=100.0, prompt=[1]),
        make_seq(temperature=0.0, logprobs=0, presence_penalty=2.0, output=[1, 2]),
        make_seq(temperature=0.0),
    ]
    out = Sampler()(logits, seqs)
    raw = torch.log_softmax(logits[0], -1)
    # row 0: the penalty makes token 2 the argmax; logprobs still come from raw logits
    assert out.token_ids[0] == 2
    d = out.logprobs[0]
    assert list(d) == [2, 1]  # sampled first, then alternatives not already present
    assert d[2].rank == 2 and d[1].rank == 1
    assert d[2].logprob == pytest.approx(float(raw[2]))
    assert d[1].logprob == pytest.approx(float(raw[1]))
    assert all(lp.decoded_token is None for lp in d.values())
    # row 1: logprobs=0 holds only the sampled token (token 0 after penalties on 1 and 2)
    assert out.token_ids[1] == 0
    assert out.logprobs[1] == {0: sampler_mod.Logprob(pytest.approx(float(raw[0])), 3)}
    assert out.logprobs[2] is None


def test_sample_logprobs_sampled_outside_top():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    seq = make_seq(temperature=0.0, logprobs=1, min_tokens=1, eos={0, 1}, stop_token_ids=[2])
    out = Sampler()(logits, [seq])
    assert out.token_ids == [3]
    assert {t: lp.rank for t, lp in out.logprobs[0].items()} == {3: 4, 0: 1}


def test_prompt_logprobs_match_log_softmax(monkeypatch):
    monkeypatch.setattr(sampler_mod, "_PROMPT_LOGPROBS_CHUNK", 3)
    torch.manual_seed(0)
    logits = torch.randn(7, 40)
    targets = torch.randint(0, 40, (7,))
    targets[0] = int(logits[0].argmax())
    ref = torch.log_softmax(logits, -1)
    result = compute_prompt_logprobs(logits, targets.tolist(), 3)
    assert len(result) == 7
    for t, d in enumerate(result):
        tok = int(targets[t])
        assert d[tok].logprob == pytest.approx(float(ref[t, tok]), abs=1e-6)
        assert d[tok].rank == int((ref[t] > ref[t, tok]).sum()) + 1
        top = ref[t].topk(3)
        for j, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
            assert d[i].logprob == pytest.approx(v, abs=1e-6)
            if i != tok:
                assert d[i].rank == j + 1
        assert len(d) == (3 if tok in top.indices.tolist() else 4)
    assert result[0][int(targets[0])].rank == 1
    assert compute_prompt_logprobs(logits, targets, 0)[1] == {
        int(targets[1]): result[1][int(targets[1])]
    }


def test_inverse_cdf_never_picks_removed_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53, 1.0], dtype=torch.float64)  # 1.0: the guard
    assert sampler_mod._inverse_cdf(probs, u).tolist() == [1, 3, 3, 1]
