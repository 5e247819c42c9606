"""A thinking budget (``GuidedDecodingParams.thinking_budget``, the API's
``thinking_token_budget``), counted on token ids beside the grammar.

The grammar admits ``</think>`` anywhere in the section; the count forces it: once the
section holds ``budget`` tokens, the next row allows only ``</think>``. Where the section's
text then ends inside a UTF-8 character (byte tokens), the grammar refuses ``</think>``
until the character is whole, so the row keeps the grammar's mask for those few tokens
(at most 3 more). Not llguidance's ``max_tokens``: a matcher with such a lexeme cannot roll
back, and MTP's draft masks roll back every step. So the budget needs ``</think>`` as one
token (and, where the model opens the section itself, ``<think>`` too): a count of tokens
cannot see a marker that is spelled.

    inside     the section is open from the first output token
    optional   it opens at the ``<think>`` token (whitespace before it aside), or never
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass
class ThinkingCount:
    """Where one sequence stands in its section; :meth:`feed` it the output tokens."""

    budget: int
    end: int  # the id of "</think>"
    start: int | None  # the id of "<think>" ("optional" only)
    is_open: bool  # inside the section now
    closed: bool = False
    thought: int = 0  # tokens in the section so far

    @classmethod
    def of(cls, mode: str, budget: int, start: int | None, end: int) -> ThinkingCount:
        return cls(budget, end, start, is_open=mode == "inside")

    def feed(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.is_open, self.closed, self.thought = self._after(t)

    def forced(self) -> int | None:
        """The token the next row must be (``</think>``), or None when the count leaves it
        free."""
        if self.is_open and not self.closed and self.thought >= self.budget:
            return self.end
        return None

    def forced_after_drafts(self, drafts: Sequence[int]) -> list[int | None]:
        """:meth:`forced` for the row before each draft and after the last (``len(drafts) +
        1`` rows), without moving this count."""
        is_open, closed, thought = self.is_open, self.closed, self.thought
        out = [self.forced()]
        for t in drafts:
            self.is_open, self.closed, self.thought = self._after(t)
            out.append(self.forced())
        self.is_open, self.closed, self.thought = is_open, closed, thought
        return out

    def _after(self, t: int) -> tuple[bool, bool, int]:
        if self.closed:
            return False, True, self.thought
        if not self.is_open:
            return t == self.start, False, 0
        if t == self.end:
            return False, True, self.thought
        return True, False, self.thought + 1
