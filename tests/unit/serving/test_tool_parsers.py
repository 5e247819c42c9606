"""Tool-call parsers (``serving/tool_parsers``) on recorded DeepSeek-V3/R1, V3.1 and Qwen3
texts, malformed ones included: a parser never raises on model output and falls back to
plain content; streamed, any cut into deltas assembles the same calls in OpenAI's shape."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.serving.tool_parsers import ToolCallStream, tool_format

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

V3_TWO = (
    f"Let me check.{B}{CB}function{SEP}get_weather\n```json\n"
    '{"city": "Paris", "unit": "c"}\n```'
    f"{CE}\n{CB}function{SEP}get_time\n```json\n{{}}\n```{CE}{E}"
)
V31_ONE = f'{B}{CB}search{SEP}{{"q": "moe \\"experts\\""}}{CE}{E}'
QWEN_TWO = (
    "<think>\nI need tools.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)

WELL_FORMED = [
    (
        "deepseek_v3",
        V3_TWO,
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})],
    ),
    ("deepseek_v31", V31_ONE, None, [("search", {"q": 'moe "experts"'})]),
    (
        "hermes",
        QWEN_TWO,
        "<think>\nI need tools.\n</think>\n\n",  # the text before the calls, as it is
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # whitespace alone before the calls (R1 after its thinking section) is no content
    ("deepseek_v31", "\n\n" + V31_ONE, None, [("search", {"q": 'moe "experts"'})]),
    ("hermes", "just words", "just words", []),
    ("deepseek_v3", "no tools here", "no tools here", []),
]

MALFORMED = [
    ("deepseek_v3", f"x{B}{CB}function{SEP}f\n```json\n{{bad json\n```{CE}{E}"),
    ("deepseek_v3", f"x{B}{CB}function{SEP}f\n```json\n{{}}"),  # cut: never closed
    ("deepseek_v3", f"x{B}garbage{CB}"),
    ("deepseek_v31", f"{B}{CB}f{SEP}[1, 2]{CE}{E}"),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}'),  # never closed
    ("hermes", '<tool_call>{"name": "f"}</tool_call> trailing words'),
]


@pytest.mark.parametrize("parser, text, content, calls", WELL_FORMED)
def test_recorded_calls(parser, text, content, calls):
    parsed = tool_format(parser).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    assert all(c.to_openai()["type"] == "function" for c in parsed.tool_calls)


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_calls_are_content(parser, text):
    parsed = tool_format(parser).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def stream(parser: str, text: str, cuts: list[int]):
    points = sorted({min(c, len(text)) for c in cuts})
    s = ToolCallStream(tool_format(parser))
    parts = [s.feed(text[a:b]) for a, b in zip([0, *points], [*points, len(text)])]
    parts.append(s.finish())
    content = "".join(c for c, _ in parts)
    calls: dict[int, dict] = {}
    for _, deltas in parts:
        for d in deltas:
            c = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in d:
                assert c["id"] is None and d["type"] == "function"  # the header comes once
                c["id"], c["name"] = d["id"], d["function"]["name"]
            c["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(WELL_FORMED), cuts=st.lists(st.integers(0, 400), max_size=15))
def test_any_cut_streams_the_same_calls(case, cuts):
    parser, text, content, calls = case
    got_content, got_calls = stream(parser, text, cuts)
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls
    if calls:  # what came before the calls, exactly as the parse has it
        assert got_content == (content or "")
    else:
        assert got_content == text


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(MALFORMED), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_a_malformed_stream_loses_no_text(case, cuts):
    parser, text = case
    content, calls = stream(parser, text, cuts)
    if not calls:  # nothing was sent as a call: every character came as content
        assert content == text


PIECES = [B, E, CB, CE, SEP, "function", "\n```json\n", "```", "{", "}", '"a"', ":", "1"]
PIECES += ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}', " ", "x"]


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(["deepseek_v3", "deepseek_v31", "hermes"]),
    pieces=st.lists(st.sampled_from(PIECES), max_size=14),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)  # fmt: skip
def test_never_raises_on_any_text(parser, pieces, cuts):
    text = "".join(pieces)
    tool_format(parser).parse(text)
    stream(parser, text, cuts)


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_format("nope")
