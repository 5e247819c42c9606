"""A reduced draft vocabulary: the token-map helpers, the sub-head's logits against the full
head (fp32 and int8), greedy outputs identical to MTP off with drafts only from the hot ids,
and switching speculation on an idle engine. (Sampling: ``test_spec_sampling.py``.)"""

from __future__ import annotations

import math

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.engine.spec_setup import set_speculation
from moeserve.ops.linear import linear
from moeserve.quant.int8 import Int8Tensor, quantize_rows
from moeserve.spec.hot_vocab import HotVocab, load_token_map, most_frequent_ids, save_token_map
from tests.mtp_checkpoint import save_mtp_checkpoint

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, progress=False)


def test_most_frequent_ids():
    stream = [5, 5, 5, 2, 2, 9, 9, 7, 100, -1]
    assert most_frequent_ids(stream, 1, 50) == [5]
    assert most_frequent_ids(stream, 3, 50) == [2, 5, 9]  # 2 and 9 tie: both fit
    assert most_frequent_ids(stream, 2, 50) == [2, 5]  # the tie goes to the smaller id
    assert most_frequent_ids(stream, 10, 50) == [2, 5, 7, 9]  # ids outside the vocab dropped
    with pytest.raises(ValueError, match="n >= 1"):
        most_frequent_ids(stream, 0, 50)


@pytest.mark.parametrize("suffix", [".pt", ".json", ".txt"])
def test_token_map_files(tmp_path, suffix):
    path = tmp_path / f"map{suffix}"
    if suffix == ".txt":
        path.write_text("9 3,3\n1\n")
    else:
        save_token_map(path, [9, 3, 3, 1])
    assert load_token_map(path, 10) == [1, 3, 9]
    with pytest.raises(ValueError, match="out of range for vocab size 9"):
        load_token_map(path, 9)


def test_token_map_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_token_map(tmp_path / "missing.pt", 10)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no token ids"):
        load_token_map(tmp_path / "empty.json", 10)


@pytest.mark.parametrize("int8", [False, True])
def test_hot_logits_are_the_full_heads_on_the_subset(int8):
    g = torch.Generator().manual_seed(0)
    w_VD = torch.randn(50, 16, generator=g)
    weight = Int8Tensor(*quantize_rows(w_VD)) if int8 else w_VD
    hot = HotVocab(weight, [7, 3, 40, 3])
    assert len(hot) == 3 and hot.ids_H.tolist() == [3, 7, 40]
    h_ND = torch.randn(4, 16, generator=g)
    got_NV = hot.full_logits(h_ND)
    full_NV = linear(h_ND, weight).float()
    assert got_NV.shape == (4, 50)
    torch.testing.assert_close(got_NV[:, hot.ids_H], full_NV[:, hot.ids_H])
    outside = torch.ones(50, dtype=torch.bool)
    outside[hot.ids_H] = False
    assert bool((got_NV[:, outside] == -math.inf).all())
    with pytest.raises(ValueError, match="subset"):
        HotVocab(weight, [50])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    _, _, path = save_mtp_checkpoint(tmp_path_factory.mktemp("mtp-hot") / "ck")
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 500, (m,), generator=g).tolist() for m in (3, 17, 40, 9)]


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(str(ckpt), **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_with_hot_drafts(ckpt, reference, tmp_path, k):
    # half of the tokens the model emits, and some others: drafts right and wrong
    emitted = [t for r in reference for t in r]
    hot_ids = most_frequent_ids(emitted, len(set(emitted)) // 2, 512) + list(range(100, 140))
    path = tmp_path / "hot.json"
    save_token_map(path, hot_ids)
    llm = LLM(str(ckpt), speculative_num_tokens=k, speculative_token_map=str(path), **ENGINE)
    proposer = llm.engine.runner.proposer
    assert proposer.hot is not None and proposer.hot.ids_H.tolist() == sorted(set(hot_ids))
    drafted: list[int] = []
    real = proposer.propose

    def propose(h_TD, entries):
        out = real(h_TD, entries)
        drafted.extend(t for d, _ in out for t in d)
        return out

    proposer.propose = propose
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]
    assert got == reference
    assert drafted and set(drafted) <= set(hot_ids)
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_token_map_needs_speculation(ckpt, tmp_path):
    with pytest.raises(ValueError, match="speculative_num_tokens"):
        LLM(str(ckpt), speculative_token_map=str(tmp_path / "x.pt"), **ENGINE)


def test_set_speculation_switches_an_idle_engine(ckpt, reference):
    llm = LLM(str(ckpt), speculative_num_tokens=2, **ENGINE)
    for k, token_map in ((0, None), (1, [2, 3, 4]), (3, None), (0, None)):
        set_speculation(llm.engine, k, token_map)
        before = llm.engine.stats()["spec_decode_num_draft_tokens"]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)] == reference
        drafted = llm.engine.stats()["spec_decode_num_draft_tokens"] - before
        assert (drafted > 0) == (k > 0)
    llm.engine.add_request("busy", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="idle"):
        set_speculation(llm.engine, 1)
    llm.engine.abort_request("busy")
    plain = LLM(str(ckpt), **ENGINE)
    with pytest.raises(ValueError, match="built with speculation"):
        set_speculation(plain.engine, 1)
