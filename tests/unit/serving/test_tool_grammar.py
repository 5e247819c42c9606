"""The grammar behind ``tool_choice`` required / named (``tool_parsers/grammar.py``): what
it admits is what the parser reads, arguments outside a function's schema are refused, and
random logits held to it always give calls that parse and validate. On three tokenizers:
the demo's (DeepSeek's markers are tokens, as in DeepSeek's own), one with Qwen3's
``<tool_call>`` tokens too, and one that spells every marker."""

from __future__ import annotations

import json

import llguidance as llg
import pytest
import torch

from moeserve.core import SamplingParams, Sequence
from moeserve.demo import MARKER_TOKENS, tiny_model_path
from moeserve.grammar.bank import GrammarBank
from moeserve.grammar.markers import marker_tokens
from moeserve.grammar.tokenizer import ll_tokenizer
from moeserve.serving.tool_parsers import tool_format
from moeserve.serving.tool_parsers.grammar import MARKERS, tool_call_grammar, tool_functions
from moeserve.tokenizer import Tokenizer
from tests.helpers import demo_tokenizer_variant
from tests.unit.serving.test_tool_parsers import QWEN_TWO, V3_TWO, V31_ONE

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 16}},
        "required": ["q"], "additionalProperties": False}}},
]  # fmt: skip


VARIANTS = ["demo", "qwen", "spelled"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tok")
    return {
        "demo": Tokenizer.from_dir(tiny_model_path()),
        "qwen": demo_tokenizer_variant(root / "q", add=("<tool_call>", "</tool_call>")),
        "spelled": demo_tokenizer_variant(root / "s", drop=MARKER_TOKENS),
    }


@pytest.fixture(scope="module")
def tok(tokenizers):
    return tokenizers["demo"]


def grammar(tok, parser, fns, parallel=True) -> str:
    """The grammar as the server builds it for ``tok``: its one-token markers as tokens."""
    tokens = marker_tokens(tok, ll_tokenizer(tok, 520), MARKERS[parser])
    return tool_call_grammar(parser, fns, parallel, tokens)


def accepts(tok, lark: str, text: str) -> bool:
    lt = ll_tokenizer(tok, 520)
    m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_lark(lark))
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", QWEN_TWO[QWEN_TWO.index("<tool_call>") :]),
        ("deepseek_v3", V3_TWO[V3_TWO.index("<｜tool▁calls▁begin｜>") :]),
        ("deepseek_v31", V31_ONE),
    ],
)
def test_recorded_calls_are_in_the_grammar(tokenizers, variant, parser, text):
    tok, fns = tokenizers[variant], tool_functions(TOOLS)
    assert accepts(tok, grammar(tok, parser, fns), text)
    assert tool_format(parser).parse(text).tool_calls
    if text.count("<tool_call>") + text.count("<｜tool▁call▁begin｜>") > 1:
        assert not accepts(tok, grammar(tok, parser, fns, parallel=False), text)
    if marker_tokens(tok, ll_tokenizer(tok, 520), MARKERS[parser]):
        # why markers are named as tokens: llguidance never matches a token like these
        # with a string literal, so a grammar writing them as text refuses the model's calls
        assert not accepts(tok, tool_call_grammar(parser, fns), text)


def test_arguments_outside_the_schema_and_other_functions_are_refused(tok):
    lark = grammar(tok, "hermes", tool_functions(TOOLS, only="get_weather"))
    args = '{"city":"Oslo","unit":"c"}'
    good = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    assert accepts(tok, lark, good)
    assert not accepts(tok, lark, good.replace('"c"', '"k"'))
    assert not accepts(tok, lark, good.replace("get_weather", "get_time"))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("parser", ["hermes", "deepseek_v3", "deepseek_v31"])
def test_random_logits_held_to_it_always_give_valid_calls(tokenizers, variant, parser):
    # one call: random logits would rarely stop adding parallel ones
    tok = tokenizers[variant]
    fmt, lark = tool_format(parser), grammar(tok, parser, tool_functions(TOOLS), False)
    bank, g = GrammarBank(tok), torch.Generator().manual_seed(0)
    params = SamplingParams(guided_decoding={"grammar": lark})
    markers = set(marker_tokens(tok, ll_tokenizer(tok, 520), MARKERS[parser]).values())
    for trial in range(3):
        seq = Sequence(f"r{trial}", [1, 2], params, eos_token_ids=tok.eos_token_ids)
        for _ in range(400):
            logits = torch.randn(1, 520, generator=g) * 3
            bank.mask(logits, [seq])
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            if t in tok.eos_token_ids:
                break
            seq.append_token(t, None)
        else:
            pytest.fail("no end within 400 tokens")
        parsed = fmt.parse(tok.decode(seq.output_token_ids))
        assert parsed.tool_calls and parsed.content is None
        assert markers <= set(seq.output_token_ids)  # a marker the tokenizer has: its token
        for call in parsed.tool_calls:
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                assert set(args) <= {"city", "unit"} and "city" in args
                assert len(args["city"]) <= 10 and args.get("unit", "c") in ("c", "f")
            elif call.name == "search":
                assert set(args) == {"q"} and len(args["q"]) <= 16
            else:
                assert call.name == "get_time" and args == {}


def test_bad_tools_are_errors():
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        tool_functions([{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="not among the tools"):
        tool_functions(TOOLS, only="nope")
    with pytest.raises(ValueError, match="not a function tool"):
        tool_functions([{"type": "retrieval"}])
    with pytest.raises(ValueError, match="no tool-call grammar"):
        tool_call_grammar("nope", tool_functions(TOOLS))
