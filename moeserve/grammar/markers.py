"""Markers (DeepSeek's ``<｜tool▁sep｜>``, R1's and Qwen3's ``</think>``, Qwen3's
``<tool_call>``) in a grammar: as the one token the tokenizer has for them, not as text.

llguidance reads an added token as a special token (its bytes are not text), so a string
literal never matches it: a grammar that writes a marker as text would make the model spell
it in pieces, which a model trained on the token does not do. A marker the tokenizer has as
one such token is written ``<[id]>`` instead; one it spells with ordinary tokens stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

import llguidance as llg

from moeserve.tokenizer import Tokenizer


def marker_tokens(
    tokenizer: Tokenizer, ll_tok: llg.LLTokenizer, texts: Iterable[str]
) -> dict[str, int]:
    """Which of ``texts`` the tokenizer has as one token that llguidance holds apart from
    text, with its id."""
    out = {}
    for text in texts:
        tid = tokenizer.added_token_id(text)
        if tid is not None and tid < ll_tok.vocab_size and ll_tok.is_special_token(tid):
            out[text] = tid
    return out


def lark_text(text: str, tokens: Mapping[str, int]) -> str:
    """``text`` as a Lark sequence: string literals, and ``<[id]>`` for each marker of
    ``tokens`` in it (the longest first where two start at one place)."""
    if not text:
        return '""'
    if not tokens:
        return _literal(text)
    pattern = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    parts = []
    for piece in re.split(f"({pattern})", text):
        if piece in tokens:
            parts.append(f"<[{tokens[piece]}]>")
        elif piece:
            parts.append(_literal(piece))
    return " ".join(parts)


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)
