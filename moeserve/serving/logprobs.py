"""Logprobs in the two shapes of OpenAI's API.

The engine returns, per position, the chosen token's log-probability and the top-N
alternatives (``{token_id: Logprob(logprob, rank)}``). Chat completions list them as
``{token, logprob, bytes, top_logprobs}``; completions as parallel arrays ``tokens``,
``token_logprobs``, ``top_logprobs`` (token text -> logprob) and ``text_offset``.
"""

from __future__ import annotations

from functools import lru_cache

from moeserve.core import PositionLogprobs
from moeserve.serving.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from moeserve.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in of each byte -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token's display text and bytes (cached). A byte-level BPE piece maps to its exact
    bytes; a token that holds only part of a UTF-8 character shows as ``bytes:\\xe2\\x80``
    (OpenAI's convention), so different partial tokens never share a name."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self.tokenizer.id_to_piece(token_id) or ""
            table = _byte_decoder()
            special = token_id in self.tokenizer.all_special_ids
            if piece and not special and all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            else:
                raw = text.encode("utf-8", "replace")
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def visible_len(self, token_id: int) -> int:
        """Characters the token adds to text decoded without special tokens."""
        if token_id in self.tokenizer.all_special_ids:
            return 0
        return len(self.tokenizer.decode([token_id], skip_special_tokens=True))


def _top(entry: PositionLogprobs, n: int) -> list[tuple[int, float]]:
    ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank <= n)
    return [(tok, logprob) for _, tok, logprob in ranked[:n]]


def chat_logprobs(
    token_ids: list[int], entries: list[PositionLogprobs], top_n: int, texts: TokenTexts
) -> list[TokenLogprob]:
    out = []
    for tok, entry in zip(token_ids, entries):
        text, raw = texts.get(tok)
        top = []
        for alt, logprob in _top(entry, top_n):
            alt_text, alt_raw = texts.get(alt)
            top.append(TopLogprob(token=alt_text, logprob=logprob, bytes=alt_raw))
        out.append(
            TokenLogprob(
                token=text,
                logprob=_finite(entry[tok].logprob),
                bytes=raw,
                top_logprobs=top,
            )
        )
    return out


def completion_logprobs(
    token_ids: list[int],
    entries: list[PositionLogprobs | None],
    top_n: int,
    texts: TokenTexts,
    text_offset: int,
) -> CompletionLogprobs:
    """``text_offset`` is where the first token's text starts in the choice's text."""
    result = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries):
        text, _ = texts.get(tok)
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        text_offset += texts.visible_len(tok)
        if entry is None:  # the first prompt token has no logprob
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_finite(entry[tok].logprob))
        top = {texts.get(alt)[0]: logprob for alt, logprob in _top(entry, top_n)}
        top.setdefault(text, _finite(entry[tok].logprob))
        result.top_logprobs.append(top)
    return result


def _finite(x: float) -> float:
    """JSON has no -inf: a token of probability 0 reports the lowest float instead."""
    return x if x > -3.0e38 else -3.0e38
