"""The API server's path for one completion, without HTTP or the engine process.

``serve_completion`` runs what ``serving/completions.py`` runs for one prompt: the request
through ``build_params`` (engine params with ``detokenize=False`` plus the ``TextOptions``),
a ``Generation`` (its ``RequestTracker``, ``FinishSample`` at a stop string, abort when every
sample ended), against an engine in this process. Every message passes through the JSON
frames of ``serving/messages.py`` and is applied between two engine steps, as
``serving/engine_core.py`` applies them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from moeserve.core import SamplingParams
from moeserve.serving import messages as m
from moeserve.serving.client import RequestStream
from moeserve.serving.generation import Generation
from moeserve.serving.metrics import ServerMetrics
from moeserve.serving.protocol import CompletionRequest
from moeserve.serving.sampling import ModelDefaults, build_params


class InProcessClient:
    """``EngineClient``'s surface over an ``LLMEngine`` in this process."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.streams: dict[str, RequestStream] = {}
        self.inbox: list[m.Message] = []

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        msg = m.decode(m.encode(m.AddRequest(request_id, prompt_token_ids, params)))
        self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        stream = self.streams[request_id] = RequestStream(self, request_id)
        return stream

    def send(self, msg: m.Message) -> None:
        self.inbox.append(m.decode(m.encode(msg)))

    def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.send(m.AbortRequests([request_id]))

    def _apply_inbox(self) -> None:
        for msg in self.inbox:
            if isinstance(msg, m.AbortRequests):
                for request_id in msg.request_ids:
                    self.engine.abort_request(request_id)
            elif isinstance(msg, m.FinishSample):
                self.engine.finish_sample(msg.request_id, msg.index, msg.stop)
        self.inbox.clear()

    async def run(self, consumer: asyncio.Task) -> None:
        """Step the engine until ``consumer`` is done and the engine is idle; each step's
        outputs are read by the consumer before the next step."""
        for _ in range(100_000):
            self._apply_inbox()
            if not self.engine.has_unfinished_requests():
                if consumer.done():
                    return
            else:
                frame = m.encode(m.StepOutputs(self.engine.step()))
                for out in m.decode(frame).outputs:
                    stream = self.streams.get(out.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(out)
            while any(s.queue.qsize() for s in self.streams.values()) and not consumer.done():
                await asyncio.sleep(0)
            await asyncio.sleep(0)
        raise AssertionError("the request never finished")


@dataclass(frozen=True)
class Completion:
    """One sample of a completion as the server answers it (``text`` as the non-streaming
    response has it, ``deltas`` the texts a stream sends)."""

    text: str
    token_ids: list[int]
    num_logprobs: int
    finish_reason: str | None
    stop_reason: int | str | None
    deltas: list[str]


def serve_completion(engine, tokenizer, prompt_ids: list[int], **fields) -> Completion:
    """One ``/v1/completions`` request (one prompt, ``n = 1``) through the server's pieces;
    ``fields`` are the request's JSON fields (``max_tokens``, ``stop``, ``min_tokens``...)."""
    req = CompletionRequest(prompt=prompt_ids, **fields)
    params, options = build_params(req, ModelDefaults(), req.max_tokens, logprobs=req.logprobs)
    g = Generation.create("cmpl-test-0", prompt_ids, params, options, tokenizer)
    client, metrics = InProcessClient(engine), ServerMetrics("test")

    async def consume() -> list[str]:
        texts = []
        async for deltas in g.deltas(metrics):
            texts += [d.text for d in deltas]
        return texts

    async def main() -> list[str]:
        await g.start(client, metrics)
        consumer = asyncio.create_task(consume())
        await client.run(consumer)
        return consumer.result()

    deltas = asyncio.run(main())
    (sample,) = g.tracker.samples
    return Completion(
        sample.text,
        list(sample.token_ids),
        len(sample.logprobs),
        sample.finish_reason,
        sample.stop_reason,
        deltas,
    )
