"""Detokenizes sequences as tokens arrive, applies stop strings, and regroups the samples of
each request into one :class:`RequestOutput`: cumulative by default, as vLLM returns, or only
what is new (``output_kind="delta"``, what the API server streams) or only the final output.

Text, stop strings and ``min_tokens`` follow :mod:`moeserve.text_tracker`, the rules the API
server applies too; when a stop string ends inside a speculative step, the step's later tokens
are removed from the sequence here. A request with ``detokenize=False`` gets token ids only;
its caller detokenizes and ends a sample at a stop string with
:meth:`OutputProcessor.finish_sample`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from moeserve.core import (
    Batch,
    CompletionOutput,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
    Sequence,
)
from moeserve.engine.codec import SeqStepOutput
from moeserve.text_tracker import TextOptions, TextTracker
from moeserve.tokenizer import Tokenizer


@dataclass
class _SampleState:
    seq: Sequence
    tracker: TextTracker | None  # None: token ids only (detokenize=False or no tokenizer)
    num_tokens_seen: int = 0
    # what earlier delta outputs carried
    num_tokens_sent: int = 0
    finish_sent: bool = False


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState]
    arrival: float = field(default_factory=time.monotonic)
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests: dict[str, _RequestState] = {}
        # sequences finished between steps (finish_sample): reported by the next process()
        self._pending: list[Sequence] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
    ) -> None:
        """Follow a request's sequences. A resumed sequence (``Sequence.resume_from``) brings
        outputs its caller has already received: its text is rebuilt from them and they
        count as sent, so the outputs continue where the caller's left off."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenize = self.tokenizer is not None and params.detokenize
        options = TextOptions.from_params(params)
        samples = []
        for seq in seqs:
            tracker = TextTracker(self.tokenizer, prompt_ids, options) if detokenize else None
            sample = _SampleState(seq, tracker)
            done = len(seq.output_token_ids)
            if done:
                if tracker is not None:
                    tracker.update(seq.output_token_ids, seq.is_finished)
                    tracker.take_delta(seq.is_finished)
                sample.num_tokens_seen = sample.num_tokens_sent = done
                sample.finish_sent = seq.is_finished
            samples.append(sample)
        state = _RequestState(request_id, prompt, prompt_ids, params, samples)
        # a resumed request's caller had its prompt logprobs with its first output
        state.prompt_logprobs_sent = params.output_kind == "delta" and any(
            s.num_tokens_sent for s in samples
        )
        self.requests[request_id] = state

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._pending = [s for s in self._pending if s.request_id != request_id]

    def finish_sample(
        self,
        request_id: str,
        index: int,
        reason: FinishReason = FinishReason.STOP,
        stop_reason: int | str | None = None,
    ) -> bool:
        """End sample ``index`` of a request now (its caller found a stop string): its blocks
        are freed at once and the next :meth:`process` reports it finished. False when the
        request or sample is unknown or already finished."""
        state = self.requests.get(request_id)
        if state is None or not 0 <= index < len(state.samples):
            return False
        sample = state.samples[index]
        if sample.seq.is_finished:
            return False
        self.scheduler.finish(sample.seq, reason, stop_reason)
        self._pending.append(sample.seq)
        return True

    def record_prompt_logprobs(self, batch: Batch, results: list[SeqStepOutput]) -> None:
        for s, r in zip(batch.seqs, results):
            if r.prompt_logprobs is None:
                continue
            seq = s.seq
            # a recomputed (preempted) chunk may cover positions already recorded
            skip = len(seq.prompt_logprobs) - r.first_position
            if skip < 0:
                raise AssertionError("prompt logprobs arrived out of order")
            seq.prompt_logprobs.extend(r.prompt_logprobs[skip:])

    def process(self, updated: list[Sequence]) -> list[RequestOutput]:
        """Outputs of the requests whose sequences got a token or finished this step; a request
        leaves the processor with its finished output."""
        if self._pending:
            updated, self._pending = [*self._pending, *updated], []
        touched: dict[str, _RequestState] = {}
        for seq in updated:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            sample = state.samples[seq.sample_index]
            self._detokenize(sample)
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            out = self._make_output(state)
            if out is None:
                continue
            outputs.append(out)
            if out.finished:
                del self.requests[request_id]
        return outputs

    def _detokenize(self, sample: _SampleState) -> None:
        seq = sample.seq
        new = seq.output_token_ids[sample.num_tokens_seen :]
        sample.num_tokens_seen = len(seq.output_token_ids)
        if sample.tracker is None or not new:
            return
        last = seq.is_finished and seq.finish_reason is not FinishReason.ABORT
        step = sample.tracker.update(new, last)
        if step.num_tokens < len(new):  # the tokens after a stop string were never generated
            _drop_output_tokens(seq, len(new) - step.num_tokens)
            sample.num_tokens_seen = len(seq.output_token_ids)
        if step.stop is None:
            return
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP, step.stop)
        else:  # finished by a token in the same step: the stop string still wins
            seq.finish(FinishReason.STOP, step.stop)

    def _decorate(self, entries: list[PositionLogprobs | None]) -> list[PositionLogprobs | None]:
        if self.tokenizer is None:
            return entries
        out: list[PositionLogprobs | None] = []
        for pos in entries:
            if pos is None:
                out.append(None)
                continue
            out.append(
                {
                    tok: dataclasses.replace(lp, decoded_token=self.tokenizer.decode([tok], False))
                    for tok, lp in pos.items()
                }
            )
        return out

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        """The request's output for this step; None when its kind has nothing to say yet."""
        finished = all(s.seq.is_finished for s in state.samples)
        kind = state.params.output_kind
        if kind == "final" and not finished:
            return None
        delta = kind == "delta"
        decorate = self._decorate if state.params.detokenize else list
        if not delta and not finished:
            decorate = list  # decoded_token strings are filled once, in the final output
        completions = []
        for i, sample in enumerate(state.samples):
            seq = sample.seq
            tokens, logprobs, tracker = seq.output_token_ids, seq.logprobs, sample.tracker
            # text a stop string could still claim stays back until the sample ends
            text = "" if tracker is None else tracker.shown(seq.is_finished)
            if delta:
                newly_finished = seq.is_finished and not sample.finish_sent
                if len(tokens) == sample.num_tokens_sent and not newly_finished:
                    continue
                tokens = tokens[sample.num_tokens_sent :]
                logprobs = logprobs[sample.num_tokens_sent :]
                text = "" if tracker is None else tracker.take_delta(seq.is_finished)
                sample.num_tokens_sent = len(seq.output_token_ids)
                sample.finish_sent = seq.is_finished
            want_lp = seq.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(tokens),
                    cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                    logprobs=decorate(logprobs) if want_lp else None,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                )
            )
        if delta and not completions and not finished:
            return None
        first = state.samples[0].seq
        prompt_logprobs = None
        if state.params.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            prompt_logprobs = decorate(first.prompt_logprobs)
            state.prompt_logprobs_sent = delta
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_prompt_tokens,
            metrics=self._metrics(state),
            error=next((s.seq.error for s in state.samples if s.seq.error), None),
        )

    @staticmethod
    def _metrics(state: _RequestState) -> dict[str, float]:
        """Timestamps (time.monotonic) and the queue time of the request's first sample."""
        first = state.samples[0].seq
        metrics = {"arrival_time": state.arrival}
        if first.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = first.first_scheduled_time
            metrics["queue_time"] = max(0.0, first.first_scheduled_time - first.arrival_time)
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return metrics


def _drop_output_tokens(seq: Sequence, n: int) -> None:
    """Remove the last ``n`` output tokens of ``seq`` (and their logprobs)."""
    for _ in range(n):
        tok = seq.output_token_ids.pop()
        if len(seq.logprobs) > len(seq.output_token_ids):
            entry = seq.logprobs.pop()
            if tok in entry:
                seq.cumulative_logprob -= entry[tok].logprob
