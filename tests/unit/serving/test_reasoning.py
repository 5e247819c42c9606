"""Reasoning content (``serving/reasoning.py``) on recorded DeepSeek-R1 and Qwen3 answers,
malformed ones included: the split in one piece, and the same split from any cut into
deltas (the parser never raises on model output)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.serving.reasoning import END, START, ReasoningSplitter, split_whole

R1_PROMPT = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"
QWEN_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN_NO_THINK = QWEN_PROMPT + "<think>\n\n</think>\n\n"

CASES = [
    # (parser, prompt tail, output, reasoning, content)
    ("deepseek_r1", R1_PROMPT, "Add them.\n</think>\n\n4", "Add them.\n", "\n\n4"),
    ("deepseek_r1", R1_PROMPT, "<think>\nAdd them.</think>4", "\nAdd them.", "4"),
    (
        "deepseek_r1",
        R1_PROMPT,
        "Add them and then, cut by max_tok",
        "Add them and then, cut by max_tok",
        None,
    ),
    ("deepseek_r1", R1_PROMPT, "</think>4", None, "4"),
    ("deepseek_r1", "<｜Assistant｜></think>", "4", None, "4"),  # thinking off (V3.1 template)
    ("deepseek_r1", R1_PROMPT, "a </thin b </think> c </think> d", "a </thin b ", " c </think> d"),
    ("qwen3", QWEN_PROMPT, "<think>\nAdd.\n</think>\n\n4", "\nAdd.\n", "\n\n4"),
    ("qwen3", QWEN_PROMPT, "\n<think>Add.</think>4", "Add.", "4"),
    ("qwen3", QWEN_PROMPT, "4, no thinking", None, "4, no thinking"),
    ("qwen3", QWEN_PROMPT, "<think>unfinished", "unfinished", None),
    ("qwen3", QWEN_NO_THINK, "4", None, "4"),
    ("qwen3", QWEN_PROMPT + "<think>\n", "Add.</think>4", "Add.", "4"),
    ("qwen3", QWEN_PROMPT, "<thinking>is not the tag", None, "<thinking>is not the tag"),
    ("qwen3", QWEN_PROMPT, "", None, None),
    ("qwen3", QWEN_PROMPT, "   ", None, "   "),
    ("deepseek_r1", R1_PROMPT, "", None, None),
    ("deepseek_r1", R1_PROMPT, " \n", " \n", None),
]


@pytest.mark.parametrize("parser, prompt, text, reasoning, content", CASES)
def test_recorded_answers(parser, prompt, text, reasoning, content):
    assert split_whole(parser, text, prompt) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 60), max_size=12))
def test_any_cut_into_deltas_gives_the_same_split(case, cuts):
    parser, prompt, text, reasoning, content = case
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    s = ReasoningSplitter(parser, prompt)
    parts = [s.feed(p) for p in pieces] + [s.finish()]
    got_r = "".join(p.reasoning for p in parts) or None
    got_c = "".join(p.content for p in parts) or None
    assert (got_r, got_c) == (reasoning, content)


PIECES = st.sampled_from(["<", ">", "/", "t", "h", "i", "n", "k", " ", "\n", "x", START, END])


@settings(max_examples=400, deadline=None)
@given(
    parser=st.sampled_from(["deepseek_r1", "qwen3"]),
    prompt=st.sampled_from([R1_PROMPT, QWEN_PROMPT, QWEN_NO_THINK]),
    pieces=st.lists(PIECES, max_size=20),
    cuts=st.lists(st.integers(0, 80), max_size=8),
)
def test_any_output_streams_as_it_splits_whole(parser, prompt, pieces, cuts):
    text = "".join(pieces)
    reasoning, content = split_whole(parser, text, prompt)
    points = sorted({min(c, len(text)) for c in cuts})
    s = ReasoningSplitter(parser, prompt)
    parts = [s.feed(text[a:b]) for a, b in zip([0, *points], [*points, len(text)])]
    parts.append(s.finish())
    assert ("".join(p.reasoning for p in parts) or None) == reasoning
    assert ("".join(p.content for p in parts) or None) == content
    # nothing but the tags that switch parts (and blanks before an opening one) is dropped
    kept = (reasoning or "") + (content or "")
    if START not in text and END not in text:
        assert kept == text
    blanks = len(text) - len(text.lstrip())
    assert len(kept) >= len(text) - len(START) - len(END) - blanks


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplitter("nope")
