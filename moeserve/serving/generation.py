"""One engine request as the API server runs it: queue it, turn its outputs into per-sample
text deltas, end samples at stop strings, record its metrics, and abort it in the engine if
its HTTP client goes away (the async generator is closed or cancelled).

Several prompts of one completions request run as several Generations; :func:`merge` yields
their deltas as they come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from moeserve.core import SamplingParams
from moeserve.serving.client import EngineClient, RequestStream
from moeserve.serving.metrics import ServerMetrics
from moeserve.serving.outputs import RequestTracker, SampleDelta
from moeserve.text_tracker import TextOptions
from moeserve.tokenizer import Tokenizer


@dataclass
class Generation:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tracker: RequestTracker
    prompt_index: int = 0  # which prompt of the HTTP request
    prompt_text: str = ""
    stream: RequestStream | None = None
    arrival: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        options: TextOptions,
        tokenizer: Tokenizer,
        prompt_index: int = 0,
        prompt_text: str = "",
    ) -> Generation:
        tracker = RequestTracker(tokenizer, prompt_ids, params.n, options)
        return cls(
            request_id,
            prompt_ids,
            params,
            tracker,
            prompt_index,
            prompt_text,
            arrival=time.monotonic(),
        )

    async def start(self, client: EngineClient, metrics: ServerMetrics) -> None:
        """Queue the request; raises QueueFullError / RejectedError / EngineDeadError."""
        self.stream = await client.add_request(self.request_id, self.prompt_ids, self.params)
        metrics.prompt_tokens.inc(len(self.prompt_ids))

    async def first_output(self) -> None:
        """Wait until the engine sent this request's first output (kept for :meth:`deltas`);
        raises RequestFailedError when the engine failed the request before it."""
        assert self.stream is not None, "start() first"
        await self.stream.peek()

    def abort(self) -> None:
        """Drop the request in the engine (a stream that never started)."""
        if self.stream is not None:
            self.stream.abort()

    async def deltas(self, metrics: ServerMetrics) -> AsyncIterator[list[SampleDelta]]:
        """The request's sample deltas until every sample finished. Closing or cancelling
        the iterator early aborts the request in the engine."""
        assert self.stream is not None, "start() first"
        try:
            async for out in self.stream:
                deltas = self.tracker.update(out)
                self._observe(deltas, metrics)
                for d in deltas:
                    if d.stop_found and not self.tracker.finished:
                        self.stream.finish_sample(d.index, d.stop_reason)
                if deltas:
                    yield deltas
                if self.tracker.finished:
                    break
        finally:
            if not self.tracker.finished or not self.stream.finished:
                self.stream.abort()  # disconnect, error, or all samples cut by stop strings
        self._finish(metrics)

    def _observe(self, deltas: list[SampleDelta], metrics: ServerMetrics) -> None:
        n = sum(len(d.token_ids) for d in deltas)
        if not n:
            return
        now = time.monotonic()
        metrics.generation_tokens.inc(n)
        if self.first_token_at is None:
            self.first_token_at = now
            metrics.ttft.observe(now - self.arrival)
        else:
            metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now

    def _finish(self, metrics: ServerMetrics) -> None:
        metrics.e2e.observe(time.monotonic() - self.arrival)
        queue_time = self.tracker.metrics.get("queue_time")
        if queue_time is not None:
            metrics.queue_time.observe(queue_time)
        metrics.request_success(self.tracker.samples[0].finish_reason or "unknown")


async def merge(
    generations: list[Generation], metrics: ServerMetrics
) -> AsyncIterator[tuple[Generation, list[SampleDelta]]]:
    """Deltas of several generations, in arrival order. Closing this iterator (or an error
    in one generation) closes them all, which aborts the unfinished ones."""
    if len(generations) == 1:
        g = generations[0]
        async for deltas in g.deltas(metrics):
            yield g, deltas
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g: Generation) -> None:
        try:
            async for deltas in g.deltas(metrics):
                await queue.put((g, deltas))
            await queue.put((g, done))
        except BaseException as e:
            await queue.put((g, e))
            raise

    tasks = [asyncio.create_task(pump(g)) for g in generations]
    try:
        remaining = len(tasks)
        while remaining:
            g, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield g, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
