"""The API server's view of one request's samples: their text, stop strings and logprobs.

The engine sends token ids only (``detokenize=False``); this process turns them into text with
one :class:`~moeserve.text_tracker.TextTracker` per sample, the rules the offline engine
applies too (stop strings, ``min_tokens``, held-back text, a speculative step cut after a stop
string). For each engine output (a delta) :meth:`RequestTracker.update` returns what is new per
sample. When a stop string appears, the text is cut there, the step's tokens after it are
dropped, the sample is finished with reason ``stop``, and the caller tells the engine
(``FinishSample``) so the sample stops using KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.core import CompletionOutput, PositionLogprobs, RequestOutput
from moeserve.text_tracker import TextOptions, TextTracker
from moeserve.tokenizer import Tokenizer


@dataclass
class SampleDelta:
    """What one output added to sample ``index``; ``finish_reason`` is set once, when the
    sample ends (``stop_found`` when this process ended it at a stop string)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_found: bool = False


@dataclass
class _Sample:
    tracker: TextTracker
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.tracker.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RequestTracker:
    """The ``n`` samples of one engine request, rebuilt from its delta outputs."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], n: int, options: TextOptions
    ) -> None:
        self.options = options
        self.samples = [_Sample(TextTracker(tokenizer, prompt_ids, options)) for _ in range(n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.metrics: dict[str, float] = {}

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def update(self, out: RequestOutput) -> list[SampleDelta]:
        """Apply one engine output (delta kind); samples already finished here are skipped."""
        self.num_cached_tokens = out.num_cached_tokens
        self.metrics = out.metrics
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        deltas = []
        for c in out.outputs:
            sample = self.samples[c.index]
            if sample.finished:
                continue
            deltas.append(self._update_sample(c.index, sample, c))
        return deltas

    def _update_sample(self, index: int, sample: _Sample, c: CompletionOutput) -> SampleDelta:
        engine_finished = c.finish_reason is not None
        step = sample.tracker.update(c.token_ids, engine_finished and c.finish_reason != "abort")
        # a stop string inside a speculative step: the tokens after it were never generated
        token_ids = list(c.token_ids[: step.num_tokens])
        logprobs = c.logprobs[: step.num_tokens] if c.logprobs else c.logprobs
        sample.token_ids.extend(token_ids)
        if logprobs:
            sample.logprobs.extend(logprobs)
        delta = SampleDelta(index, "", token_ids, logprobs)
        if step.stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", step.stop
            delta.stop_found = True
        elif engine_finished:
            sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason
        delta.text = sample.tracker.take_delta(sample.finished)
        delta.finish_reason, delta.stop_reason = sample.finish_reason, sample.stop_reason
        return delta

    def text(self, index: int) -> str:
        return self.samples[index].text
