"""Structured output's parts (``moeserve/grammar/``): the bitmask against its per-token
oracle, the grammar of each kind of ``GuidedDecodingParams`` and its errors, and the bank's
masks for sampled rows and for draft positions, on the demo tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.core import SamplingParams, Sequence
from moeserve.demo import tiny_model_path
from moeserve.grammar.bank import GrammarBank
from moeserve.grammar.bitmask import (
    apply_bitmask,
    reference_apply_bitmask,
    torch_apply_bitmask,
)
from moeserve.grammar.compile import GrammarError, check, grammar_of
from moeserve.grammar.tokenizer import ll_tokenizer
from moeserve.guided import GuidedDecodingParams
from moeserve.tokenizer import Tokenizer

V = 520  # wider than the demo tokenizer's 512 ids, as a model's logits may be


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_path())


@pytest.mark.parametrize("apply", [apply_bitmask, torch_apply_bitmask])
@pytest.mark.parametrize("vocab, words", [(70, 3), (64, 2), (100, 2), (33, 1), (300, 10)])
def test_bitmask_matches_its_oracle(apply, vocab, words):
    g = torch.Generator().manual_seed(vocab)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[0, 0], mask[1, 0] = -1, 0  # every token of a word allowed; none
    logits = torch.randn(4, vocab + 5, generator=g)[:3, :vocab]  # rows with a stride
    want = logits.clone()
    apply(logits, mask)
    reference_apply_bitmask(want, mask)
    assert torch.equal(logits, want)


def test_the_kernel_and_torch_agree_at_deepseeks_vocabulary():
    g = torch.Generator().manual_seed(1)
    mask = torch.randint(-(2**31), 2**31 - 1, (32, 4040), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[:, :100] = -1
    mask[:, 100:200] = 0
    a = torch.randn(32, 129280, generator=g)
    b = a.clone()
    apply_bitmask(a, mask)
    torch_apply_bitmask(b, mask)
    assert torch.equal(a, b)
    half = a.to(torch.bfloat16)  # not fp32: the torch path
    apply_bitmask(half, mask)
    assert torch.equal(half.isinf(), a.isinf())


def test_params_take_exactly_one_kind():
    assert GuidedDecodingParams(json={"type": "object"}).kind == "json"
    assert GuidedDecodingParams(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", grammar="start: /a/")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="non-empty list"):
        GuidedDecodingParams(choice=[])
    # through SamplingParams and back (the engine group's codec carries dicts)
    p = SamplingParams(guided_decoding={"regex": "a+", "strict": False})
    assert p.guided_decoding == GuidedDecodingParams(regex="a+", strict=False)


@pytest.mark.parametrize(
    "params, text, ok",
    [
        (GuidedDecodingParams(json={"type": "integer"}), "42", True),
        (GuidedDecodingParams(json={"type": "integer"}), "4.5", False),
        (GuidedDecodingParams(json_object=True), '{"a":1}', True),
        (GuidedDecodingParams(json_object=True), "[1]", False),
        (GuidedDecodingParams(regex="[ab]+c"), "abac", True),
        (GuidedDecodingParams(regex="[ab]+c"), "abc d", False),
        (GuidedDecodingParams(choice=['say "hi"', "no"]), 'say "hi"', True),
        (GuidedDecodingParams(choice=['say "hi"', "no"]), "say", False),
        (GuidedDecodingParams(grammar='root ::= "x" [0-9]+'), "x12", True),
        (GuidedDecodingParams(grammar="start: /y+/"), "yyy", True),
        (GuidedDecodingParams(grammar="start: /y+/"), "yx", False),
    ],
)
def test_each_kind_accepts_what_it_should(tok, params, text, ok):
    import llguidance as llg

    matcher = llg.LLMatcher(ll_tokenizer(tok, V), check(params, ll_tokenizer(tok, V)))
    ids = tok.encode(text, add_special_tokens=False)
    consumed = matcher.consume_tokens(ids)
    assert (consumed and matcher.is_accepting()) == ok


@pytest.mark.parametrize(
    "params, match",
    [
        (GuidedDecodingParams(regex="[a-"), "invalid regex"),
        (GuidedDecodingParams(json={"type": "objectx"}), "invalid json"),
        (GuidedDecodingParams(json={"type": "string", "format": "nope"}), "Unknown format"),
        (GuidedDecodingParams(grammar="root ::= ("), "invalid grammar"),
        (GuidedDecodingParams(json="[1, 2]"), "object or a boolean"),
    ],
)
def test_bad_input_is_a_grammar_error(tok, params, match):
    with pytest.raises(GrammarError, match=match):
        check(params, ll_tokenizer(tok, V))
    # not strict: a keyword it cannot enforce is ignored
    check(
        GuidedDecodingParams(json={"type": "string", "format": "nope"}, strict=False),
        ll_tokenizer(tok, V),
    )
    assert grammar_of(GuidedDecodingParams(regex="a")) is grammar_of(
        GuidedDecodingParams(regex="a")
    )


def _seq(tok, params: SamplingParams, outputs: list[int] = ()) -> Sequence:
    seq = Sequence("r", tok.encode("x"), params, eos_token_ids=tok.eos_token_ids)
    for t in outputs:
        seq.append_token(t, None)
    return seq


def _allowed(row: torch.Tensor) -> list[int]:
    return (row > float("-inf")).nonzero().flatten().tolist()


def test_bank_masks_constrained_rows_and_follows_their_outputs(tok):
    bank = GrammarBank(tok)
    ab = tok.encode("ab", add_special_tokens=False)
    guided = SamplingParams(guided_decoding=GuidedDecodingParams(regex="ab"))
    seqs = [_seq(tok, SamplingParams()), _seq(tok, guided), _seq(tok, guided, ab)]
    logits = torch.zeros(3, V)
    bank.mask(logits, seqs)
    assert len(_allowed(logits[0])) == V  # free: untouched
    first = _allowed(logits[1])
    assert all(tok.decode([t]) in ("a", "ab") for t in first)
    assert _allowed(logits[2]) == sorted(tok.eos_token_ids)  # complete: only EOS
    # the matcher catches up with tokens appended since (sampled or accepted)
    seqs[1].append_token(tok.encode("a", add_special_tokens=False)[0], None)
    logits = torch.zeros(3, V)
    bank.mask(logits, seqs)
    assert [tok.decode([t]) for t in _allowed(logits[1])] == ["b"]


def test_bank_masks_draft_positions_and_leaves_no_trace(tok):
    bank = GrammarBank(tok)
    seq = _seq(tok, SamplingParams(guided_decoding=GuidedDecodingParams(regex="abcd")))
    drafts = tok.encode("abcd", add_special_tokens=False)  # the canonical tokens
    free = _seq(tok, SamplingParams())
    logits = torch.zeros(2 + len(drafts) + 1, V)  # free: 1 draft (2 rows), then the guided
    bank.mask_drafts(logits, [free, seq], [[7], drafts])
    assert len(_allowed(logits[0])) == len(_allowed(logits[1])) == V
    for j, t in enumerate(drafts):  # the row after drafts[:j] allows drafts[j]
        assert t in _allowed(logits[2 + j])
    assert _allowed(logits[-1]) == sorted(tok.eos_token_ids)  # after every draft: the end
    # the drafts were rolled back: a plain mask is the first row's again
    plain = torch.zeros(1, V)
    bank.mask(plain, [seq])
    assert _allowed(plain[0]) == _allowed(logits[2])
    # a sequence that left its grammar (not through a mask) may only end
    z = tok.encode("z", add_special_tokens=False)
    broken = _seq(tok, SamplingParams(guided_decoding=GuidedDecodingParams(regex="abc")), z)
    logits = torch.zeros(1, V)
    bank.mask(logits, [broken])
    assert _allowed(logits[0]) == sorted(tok.eos_token_ids)


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        GrammarBank(None).mask(
            torch.zeros(1, V),
            [Sequence("r", [1, 2], SamplingParams(guided_decoding={"regex": "a"}))],
        )
    assert json.loads(grammar_of(GuidedDecodingParams(json_object=True)))


def test_the_engine_and_server_do_not_import_torch_dynamo():
    """``llguidance.torch`` imports ``torch._dynamo`` (~2 s and ~100 MB in every engine and
    API process); the bank calls llguidance's executor directly instead."""
    import subprocess
    import sys

    code = (
        "import sys, moeserve.engine.engine, moeserve.serving.api_server, moeserve.grammar.bank;"
        "print(sorted(m for m in ('llguidance.torch', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_engine_refuses_a_bad_grammar_when_it_is_added():
    from moeserve import LLM

    llm = LLM(model=str(tiny_model_path()), progress=False, max_model_len=128)
    with pytest.raises(GrammarError, match="invalid regex"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, guided_decoding={"regex": "[a-"}))
    assert not llm.engine.has_unfinished_requests()
