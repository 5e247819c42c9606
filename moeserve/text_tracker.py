"""One output sequence's text: incremental detokenization and the stop-string rules.

The offline engine (``engine/output_processor.py``) and the API server (``serving/outputs.py``)
both feed each step's new token ids to a :class:`TextTracker`, so both apply the same rules:

- **Stop strings** (``stop``): the text is cut where the earliest one starts (kept when
  ``include_stop_str_in_output``). Ties go to the stop listed first.
- **min_tokens**: a stop string may end only in text that arrived with the ``min_tokens + 1``-th
  token or later (vLLM's rule); it may start earlier. EOS and stop token ids are held back by
  the sampler and ``Sequence.check_token_stop``, not here.
- **Speculative steps**: a step that appends several tokens is checked token by token, as if
  each came in its own step; when a stop string ends at token ``i`` of the step, the step's
  tokens after ``i`` were never generated and :meth:`TextTracker.update` says to drop them.
  That holds for a token-level stop (EOS, a stop token id, max_tokens) later in the same step:
  the earlier stop string wins. Token-level stops themselves are applied per token by
  ``Sequence.check_token_stop`` before the tracker sees the step.
- **The stop token's text**: the EOS or stop token id that ended a sequence is decoded like any
  other token (``skip_special_tokens`` hides EOS); vLLM leaves it out unless
  ``include_stop_str_in_output``.
- **Held-back text**: until the sequence ends, the last ``len(longest stop) - 1`` characters
  are not shown, so no shown text is ever taken back by a stop string (none with
  ``include_stop_str_in_output``: the cut then lies after the stop, in text not yet shown).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeserve.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from moeserve.core import SamplingParams
    from moeserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextOptions:
    """The sampling fields that decide a sequence's text (vLLM's names and meanings)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @classmethod
    def from_params(cls, params: SamplingParams) -> TextOptions:
        return cls(
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            min_tokens=params.min_tokens,
        )

    @property
    def hold(self) -> int:
        """Characters held back while a stop string could still claim them."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(map(len, self.stop)) - 1


@dataclass(frozen=True)
class TextStep:
    """What one :meth:`TextTracker.update` decided: keep the first ``num_tokens`` of the
    step's tokens (the rest follow a stop string; the caller drops them), and ``stop``, the
    stop string that ended the sequence in this step (None when none did)."""

    num_tokens: int
    stop: str | None = None


class TextTracker:
    """The text of one output sequence, built from its token ids step by step.

    ``text`` is the whole text so far (cut at a stop string once one is found); ``num_tokens``
    counts the tokens it was built from; ``stop`` is the stop string that ended it, if any.
    After a stop string, :meth:`update` takes no more tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], options: TextOptions):
        self.options = options
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, options.skip_special_tokens)
        self.text = ""
        self.num_tokens = 0
        self.stop: str | None = None
        self._num_chars_taken = 0  # text already returned by take_delta

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def update(self, token_ids: Sequence[int], last: bool = False) -> TextStep:
        """Take one step's new tokens (several with speculative decoding) and check stops.

        ``last``: the sequence ends with these tokens (EOS, a stop token id, max_tokens; not an
        abort), so text held back for an incomplete character is flushed, as a full decode
        would show it. Returns how many of ``token_ids`` to keep and the stop string found;
        after a stop string every later call keeps none. No tokens: nothing changes.
        """
        if self.stopped or not token_ids:
            return TextStep(0)
        opts = self.options
        # with stop strings each token is checked on its own, as if it came in its own step
        one_by_one = bool(opts.stop) and len(token_ids) > 1
        pieces = [[t] for t in token_ids] if one_by_one else [list(token_ids)]
        kept = 0
        for j, piece in enumerate(pieces):
            kept += len(piece)
            self.num_tokens += len(piece)
            before = len(self.text)
            self.text += self._detok.step(piece)
            if last and j == len(pieces) - 1:
                self.text += self._detok.flush()
            # min_tokens: a stop string may not end in the text of the first min_tokens tokens
            if not opts.stop or self.num_tokens <= opts.min_tokens:
                continue
            hit = find_stop(self.text, before, opts.stop)
            if hit is None:
                continue
            at, stop = hit
            self.text = self.text[: at + len(stop) if opts.include_stop_str_in_output else at]
            self.stop = stop
            return TextStep(kept, stop)
        return TextStep(kept)

    def shown(self, finished: bool) -> str:
        """The text an output may show now: all of it once the sequence ``finished`` (or a stop
        string ended it), else without the last :attr:`TextOptions.hold` characters."""
        if finished or self.stopped:
            return self.text
        return self.text[: max(0, len(self.text) - self.options.hold)]

    def take_delta(self, finished: bool) -> str:
        """The part of :meth:`shown` that no earlier call returned (possibly empty)."""
        shown = self.shown(finished)
        delta = shown[self._num_chars_taken :]
        self._num_chars_taken = max(self._num_chars_taken, len(shown))
        return delta


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` without being all of
    it: what must wait, because more text may make it ``tag`` (0: nothing)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def find_stop(text: str, start: int, stops: Iterable[str]) -> tuple[int, str] | None:
    """Earliest stop string in ``text`` that ends after ``start`` (the old text length).

    Returns ``(index, stop)``; the caller cuts ``text[:index]`` (stop excluded). Only the
    tail where a new match can lie is searched: for a stop of length L, ``text[start-L+1:]``.
    Ties go to the stop listed first. Empty stop strings are ignored.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
