"""What a new user sees first: ``moeserve serve`` without ``--model`` serves the trained demo,
and its greedy answer to a chat question is made of English words from its training text,
where the tiny random model's is not."""

from __future__ import annotations

import lzma
import re

import httpx

from moeserve import LLM, SamplingParams
from moeserve.demo import DATA_DIR, tiny_model_path
from tests.e2e.server import start_server

QUESTION = [{"role": "user", "content": "What does the sorted() function do?"}]
MAX_TOKENS = 48


def word_share(answer: str, words: set[str]) -> tuple[int, float]:
    """(how many whitespace-separated tokens, the share of them that are words of the
    training text once edge punctuation and case are dropped)."""
    tokens = [t.strip(".,;:!?()\"'`").lower() for t in answer.split()]
    tokens = [t for t in tokens if t]
    return len(tokens), sum(t in words for t in tokens) / max(1, len(tokens))


def test_the_demo_answers_in_words():
    text = lzma.decompress((DATA_DIR / "demo_text.txt.xz").read_bytes()).decode()
    words = set(re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower()))
    srv = start_server("--served-model-name", "demo", builtin_demo=True)
    try:
        r = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop_cleanly()
    n, share = word_share(answer, words)
    assert n >= 8 and share >= 0.8, answer
    # the check can fail: the tiny random model's answer is not words
    tiny = LLM(model=str(tiny_model_path()), progress=False)
    noise = tiny.chat(QUESTION, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert word_share(noise[0].outputs[0].text, words)[1] < 0.6, noise[0].outputs[0].text
