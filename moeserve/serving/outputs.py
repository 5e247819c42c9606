"""The API server's view of one request's samples: detokenization, stop strings, logprobs.

The engine sends token ids only (``detokenize=False``); this process turns them into text.
For each engine output (a delta) :meth:`RequestTracker.update` returns what is new per sample.
When a stop string appears, the text is cut there, the sample is finished with reason
``stop``, and the caller tells the engine (``FinishSample``) so the sample stops using KV.

While a sample may still hit a stop string, up to ``len(longest stop) - 1`` trailing
characters are held back, so streamed text never shows the start of a stop string that is
later cut (vLLM does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.core import PositionLogprobs, RequestOutput
from moeserve.detokenizer import IncrementalDetokenizer, find_stop
from moeserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


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
    detok: IncrementalDetokenizer
    text: str = ""
    num_chars_sent: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RequestTracker:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], n: int, options: TextOptions
    ) -> None:
        self.options = options
        self.samples = [
            _Sample(IncrementalDetokenizer(tokenizer, prompt_ids, options.skip_special_tokens))
            for _ in range(n)
        ]
        self._hold = max((len(s) for s in options.stop), default=1) - 1
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

    def _update_sample(self, index: int, sample: _Sample, c) -> SampleDelta:
        opts = self.options
        sample.token_ids.extend(c.token_ids)
        if c.logprobs:
            sample.logprobs.extend(c.logprobs)
        before = len(sample.text)
        sample.text += sample.detok.step(c.token_ids)
        engine_finished = c.finish_reason is not None
        if engine_finished and c.finish_reason != "abort":
            sample.text += sample.detok.flush()
        delta = SampleDelta(index, "", list(c.token_ids), c.logprobs)
        hit = None
        if opts.stop and sample.num_tokens >= opts.min_tokens:
            hit = find_stop(sample.text, before, opts.stop)
        if hit is not None:
            at, stop = hit
            sample.text = sample.text[: at + len(stop) if opts.include_stop_str_in_output else at]
            sample.finish_reason, sample.stop_reason = "stop", stop
            delta.stop_found = True
        elif engine_finished:
            sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason
        # text that a stop string could still claim stays back until the sample ends
        end = len(sample.text) if sample.finished else len(sample.text) - self._hold
        if end > sample.num_chars_sent:
            delta.text = sample.text[sample.num_chars_sent : end]
            sample.num_chars_sent = end
        delta.finish_reason, delta.stop_reason = sample.finish_reason, sample.stop_reason
        return delta

    def text(self, index: int) -> str:
        return self.samples[index].text
