"""The thinking section before a held answer (``grammar/compile.py``) and markers as tokens
(``grammar/markers.py``): with "</think>" as one token (the demo's, as R1's and Qwen3's) the
grammar takes that token and never its spelling; with a tokenizer that spells it, the text;
a thinking budget forces the token after that many tokens."""

from __future__ import annotations

import dataclasses
import random

import llguidance as llg
import pytest
import torch

from moeserve.core import SamplingParams, Sequence
from moeserve.demo import MARKER_TOKENS, tiny_model_path
from moeserve.grammar.bank import GrammarBank
from moeserve.grammar.compile import GrammarError, compile_for
from moeserve.grammar.markers import lark_text, marker_tokens
from moeserve.grammar.tokenizer import ll_tokenizer
from moeserve.guided import GuidedDecodingParams
from moeserve.tokenizer import Tokenizer
from tests.helpers import demo_tokenizer_variant

V = 520
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_path())


@pytest.fixture(scope="module")
def spelled(tmp_path_factory) -> Tokenizer:
    """The demo tokenizer without its marker tokens: "</think>" is text."""
    return demo_tokenizer_variant(tmp_path_factory.mktemp("spelled"), drop=MARKER_TOKENS)


def _matcher(tokenizer: Tokenizer, params: GuidedDecodingParams) -> llg.LLMatcher:
    lt, grammar = compile_for(params, tokenizer, V)
    return llg.LLMatcher(lt, grammar)


def _accepts(tokenizer, params, ids: list[int]) -> bool:
    m = _matcher(tokenizer, params)
    return m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("which", ["tok", "spelled"])
@pytest.mark.parametrize(
    "thinking, text, ok",
    [
        ("inside", 'hm\nok</think>\n\n{"a":1}', True),
        ("inside", '</think>{"a":1}', True),  # an empty section
        ("inside", '{"a":1}', False),  # the section must end first
        ("inside", 'x</think>{"a":"b"}', False),  # what follows is held to the schema
        ("optional", '{"a":1}', True),
        ("optional", '<think>\nhm\n</think>\n\n{"a":2}', True),
        ("optional", 'hm</think>{"a":1}', False),
        ("", '{"a":1}', True),
    ],
)
def test_the_answer_after_a_thinking_section(request, which, thinking, text, ok):
    tokenizer = request.getfixturevalue(which)
    params = GuidedDecodingParams(json=SCHEMA, thinking=thinking)
    assert _accepts(tokenizer, params, tokenizer.encode(text, add_special_tokens=False)) == ok
    with pytest.raises(ValueError, match="thinking must be"):
        GuidedDecodingParams(regex="a", thinking="maybe")


@pytest.mark.parametrize(
    "gap, ok", [("", True), ("\n\n", True), (" \n \n", True), (" " * 5, False)]
)
def test_the_whitespace_after_the_section_is_bounded(tok, gap, ok):
    """A model that never learned the answer's format could otherwise spend its tokens on
    spaces before the answer (the trained demo did, before a tool call)."""
    params = GuidedDecodingParams(regex="[a-z]+", thinking="inside")
    ids = tok.encode(f"hm</think>{gap}abc", add_special_tokens=False)
    assert _accepts(tok, params, ids) == ok


def test_the_section_ends_with_the_token_and_never_its_spelling(tok, spelled):
    end = tok.added_token_id("</think>")
    assert end is not None and spelled.added_token_id("</think>") is None
    params = GuidedDecodingParams(json=SCHEMA, thinking="inside")
    pieces = tok.encode("hm </th", add_special_tokens=False) + tok.encode(
        "ink>", add_special_tokens=False
    )
    assert end not in pieces
    m = _matcher(tok, params)
    assert not m.consume_tokens(pieces)  # the spelling would end the section as text
    answer = tok.encode('{"a":1}', add_special_tokens=False)
    assert _accepts(tok, params, tok.encode("hm </th", add_special_tokens=False) + [end, *answer])
    # the spelling tokenizer ends the section with the text
    spelled_ids = spelled.encode('hm </think>{"a":1}', add_special_tokens=False)
    assert _accepts(spelled, params, spelled_ids)


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("budget", [0, 1, 5])
@pytest.mark.parametrize("thinking", ["inside", "optional"])
def test_a_budget_forces_the_end_after_that_many_tokens(tok, thinking, budget):
    """Random tokens from the mask: the section has ``budget`` tokens at most, then
    "</think>"; more only while its text ends inside a UTF-8 character (byte tokens), which
    "</think>" may not cut. Every path ends in an answer that parses."""
    end, start = tok.added_token_id("</think>"), tok.added_token_id("<think>")
    lt = ll_tokenizer(tok, V)
    bank = GrammarBank(tok)
    rng = random.Random(budget)
    guided = GuidedDecodingParams(json=SCHEMA, thinking=thinking, thinking_budget=budget)
    for trial in range(6):
        seq = Sequence("r", [0], SamplingParams(guided_decoding=guided), eos_token_ids={1})
        if thinking == "optional":
            seq.append_token(start, None)
        section = []
        for _ in range(60):
            logits = torch.zeros(1, V)
            bank.mask(logits, [seq])
            allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
            t = rng.choice(allowed)
            seq.append_token(t, None)
            if t == end:
                break
            section.append(t)
            if len(section) > budget:  # past the budget only to finish a character
                assert not _whole_utf8(lt.decode_bytes(section[:-1])), (trial, section)
        assert t == end and len(section) <= budget + 3, (trial, section)
        # the answer after it still holds: finish with a valid object
        for t in tok.encode('{"a":3}', add_special_tokens=False):
            seq.append_token(t, None)
        logits = torch.zeros(1, V)
        bank.mask(logits, [seq])
        assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [1]


def test_a_budget_counts_drafts_and_leaves_no_trace(tok):
    """Under MTP the row after each draft is forced as the count after those drafts says,
    and the count itself stays where the outputs left it."""
    end = tok.added_token_id("</think>")
    words = tok.encode("ab cd ef", add_special_tokens=False)
    bank = GrammarBank(tok)
    guided = GuidedDecodingParams(free_text=True, thinking="inside", thinking_budget=3)
    seq = Sequence("r", [0], SamplingParams(guided_decoding=guided), eos_token_ids={1})
    seq.append_token(words[0], None)
    drafts = words[1:4]  # the 2nd and 3rd section tokens, then one past the budget
    logits = torch.zeros(len(drafts) + 1, V)
    bank.mask_drafts(logits, [seq], [drafts])
    rows = [(row > float("-inf")).nonzero().flatten().tolist() for row in logits]
    assert [r == [end] for r in rows] == [False, False, True, True]
    plain = torch.zeros(1, V)
    bank.mask(plain, [seq])  # one token so far: free
    assert (plain[0] > float("-inf")).sum() > 1


def test_a_budget_alone_holds_the_section_and_frees_the_answer(tok):
    end = tok.added_token_id("</think>")
    words = tok.encode("ab cd ef gh", add_special_tokens=False)
    guided = GuidedDecodingParams(free_text=True, thinking="inside", thinking_budget=2)
    bank = GrammarBank(tok)
    seq = Sequence("r", [0], SamplingParams(guided_decoding=guided), eos_token_ids={1})
    counts = []
    for t in [*words[:2], end, *words]:
        logits = torch.zeros(1, V)
        bank.mask(logits, [seq])
        allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
        assert t in allowed
        counts.append(len(allowed))
        seq.append_token(t, None)
    assert counts[2] == 1 and min(counts[:2] + counts[3:]) > 100  # forced once, else free
    assert _accepts(tok, guided, words[:3] + [end])  # the grammar alone does not count
    with pytest.raises(ValueError, match=">= 0"):
        GuidedDecodingParams(free_text=True, thinking="inside", thinking_budget=-1)


def test_a_budget_with_a_spelled_marker_is_a_clear_error(spelled, tmp_path):
    params = GuidedDecodingParams(json_object=True, thinking="inside", thinking_budget=4)
    with pytest.raises(GrammarError, match="needs </think> as one token"):
        compile_for(params, spelled, V)
    no_start = demo_tokenizer_variant(tmp_path, drop=("<think>",))
    compile_for(params, no_start, V)  # the section is open from the start: no <think> to see
    with pytest.raises(GrammarError, match="needs <think> as one token"):
        compile_for(dataclasses.replace(params, thinking="optional"), no_start, V)


def test_markers_in_lark_text(tok):
    ids = marker_tokens(tok, ll_tokenizer(tok, V), [*MARKER_TOKENS, "<tool_call>", "ab"])
    assert set(ids) == set(MARKER_TOKENS)  # not text the tokenizer spells
    sep, begin = ids["<｜tool▁sep｜>"], ids["<｜tool▁call▁begin｜>"]
    assert lark_text(f"{MARKER_TOKENS[2]}function{MARKER_TOKENS[4]}f\n", ids) == (
        f'<[{begin}]> "function" <[{sep}]> "f\\n"'
    )
    assert lark_text('say "x"', ids) == '"say \\"x\\""'
    assert lark_text("", ids) == '""'


@pytest.mark.parametrize(
    "params",
    [
        GuidedDecodingParams(choice=["yes", "no"], thinking="inside"),
        GuidedDecodingParams(grammar='start: "yes" | "no"', thinking="inside"),
        GuidedDecodingParams(grammar='root ::= "yes" | "no"', thinking="inside"),
        GuidedDecodingParams(regex="yes|no", thinking="inside"),
    ],
)
def test_every_kind_composes_after_the_section(tok, params):
    """Lark kinds (choice, grammar: and so the tool-call grammar) compose like the rest."""
    assert _accepts(tok, params, tok.encode("hm</think>yes", add_special_tokens=False))
    assert not _accepts(tok, params, tok.encode("hm</think>maybe", add_special_tokens=False))
