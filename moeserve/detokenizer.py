"""Streaming detokenization of generated tokens (stop strings: ``text_tracker.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first outputs (vLLM uses 5 too)


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas as they arrive.

    Each ``step`` decodes a small window ``ids[prefix:]`` and compares it with the text of
    ``ids[prefix:read]`` (vLLM's prefix/read offsets), so byte-level merges and spaces come
    out as a full decode would give them:

        ids:  ... p p p | o o o o | n n
                  ^prefix ^read     new tokens appended at the end

    A delta is emitted only when the window's text does not end in U+FFFD, so a multi-byte
    character split across tokens is never cut. The concatenation of every ``step`` and a
    final ``flush`` equals ``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers;
    a few prompt tokens give the first output its context (a SentencePiece tokenizer then
    keeps the first token's leading space, as vLLM does).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        # a context that ends inside a character would merge with the output's bytes
        if self._decode(context).endswith("\ufffd"):
            context = []
        self._ids = context
        self._prefix = 0
        self._read = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that became final (possibly empty)."""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text, prefix_text)

    def flush(self) -> str:
        """Return any held-back text (e.g. a trailing incomplete character as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text):
            return ""
        return self._advance(text, prefix_text)

    def _advance(self, text: str, prefix_text: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]
