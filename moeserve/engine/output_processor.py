"""Detokenizes sequences as tokens arrive, applies stop strings, and regroups the samples of
each request into one :class:`RequestOutput` (cumulative text, as vLLM returns by default)."""

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
from moeserve.detokenizer import IncrementalDetokenizer, find_stop
from moeserve.engine.model_runner import SeqStepOutput
from moeserve.tokenizer import Tokenizer


@dataclass
class _SampleState:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    text: str = ""
    num_tokens_seen: int = 0
    stopped: bool = False  # the text was cut at a stop string; later tokens add no text


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState]
    arrival: float = field(default_factory=time.monotonic)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests: dict[str, _RequestState] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = [
            _SampleState(
                seq,
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                if self.tokenizer is not None
                else None,
            )
            for seq in seqs
        ]
        self.requests[request_id] = _RequestState(request_id, prompt, prompt_ids, params, samples)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

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
            outputs.append(out)
            if out.finished:
                del self.requests[request_id]
        return outputs

    def _detokenize(self, sample: _SampleState) -> None:
        seq = sample.seq
        new = seq.output_token_ids[sample.num_tokens_seen :]
        sample.num_tokens_seen = len(seq.output_token_ids)
        if sample.detok is None or not new or sample.stopped:
            return
        before = len(sample.text)
        sample.text += sample.detok.step(new)
        if seq.is_finished and seq.finish_reason is not FinishReason.ABORT:
            # flush text held back for an incomplete character, as a final decode would
            sample.text += sample.detok.flush()
        stops = seq.params.stop
        if stops:
            hit = find_stop(sample.text, before, stops)
            if hit is not None:
                index, stop = hit
                keep = index + len(stop) if seq.params.include_stop_str_in_output else index
                sample.text = sample.text[:keep]
                sample.stopped = True
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.STOP, stop)
                else:  # finished by a token in the same step: the stop string still wins
                    seq.finish(FinishReason.STOP, stop)

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

    def _make_output(self, state: _RequestState) -> RequestOutput:
        finished = all(s.seq.is_finished for s in state.samples)
        # decoded_token strings are filled once, in the final output
        decorate = self._decorate if finished else list
        completions = []
        for i, sample in enumerate(state.samples):
            seq = sample.seq
            want_lp = seq.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=i,
                    text=sample.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                    logprobs=decorate(seq.logprobs) if want_lp else None,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                )
            )
        first = state.samples[0].seq
        prompt_logprobs = None
        if state.params.prompt_logprobs is not None:
            prompt_logprobs = decorate(first.prompt_logprobs)
        metrics = {"arrival_time": state.arrival}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_prompt_tokens,
            metrics=metrics,
        )
