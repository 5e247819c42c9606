"""The API server's side of the engine link: spawn the engine process, send it typed
messages, and route its outputs to the request that waits for them (asyncio, ZeroMQ).

One reader task takes every message from the engine and hands each RequestOutput to its
request's queue, so a slow HTTP client only ever delays its own queue, never the engine.
The reader also keeps the engine's latest stats snapshot (:attr:`EngineClient.stats`), which
the engine publishes on its own; ``/metrics`` reads it without a message to the engine.
A watchdog notices an engine process that exits; every waiting request then ends with
:class:`EngineDeadError` and the server stops.

An engine that lives but stops answering (stuck, or SIGSTOPped) is noticed only where a bound
is known: with prefill/decode disaggregation (:attr:`EngineClient.stall_timeout_s`, the
transfer timeout). An engine with any request to work on publishes a stats snapshot at least
every ``messages.STATS_INTERVAL_S`` between its steps, so one that sent nothing for the
timeout while requests waited is stuck: each waiting request with bootstrap fields then fails
(503), and so does each new one until the engine sends something again. A router waits for
both instances' answers, so the prefill instance must answer even when its engine cannot;
``/health`` answers 503 meanwhile, which takes the instance out of the router's rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import zmq
import zmq.asyncio

from moeserve.core import RequestOutput, SamplingParams
from moeserve.serving import messages as m

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process failed or exited; nothing more will come from it."""


class RequestEndedError(RuntimeError):
    """The server ended this request before it finished (shutdown timeout)."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error (a failed KV transfer): answered 503, so
    a router may retry it elsewhere."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (answered 503 with Retry-After)."""


class RejectedError(ValueError):
    """The engine refused the request as invalid (answered 400)."""


class RequestStream:
    """The outputs (deltas) of one request, in order, until one with ``finished``."""

    def __init__(self, client: EngineClient, request_id: str, moves_kv: bool = False) -> None:
        """``moves_kv``: the request has bootstrap fields (it fails when the engine stalls)."""
        self.client, self.request_id = client, request_id
        self.moves_kv = moves_kv
        self.sent_at = time.monotonic()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._peeked: RequestOutput | BaseException | None = None

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def peek(self) -> RequestOutput:
        """The next output without taking it (the iterator yields it next); raises what the
        iterator would."""
        if self._peeked is None:
            self._peeked = await self.queue.get()
        item = self._peeked
        if isinstance(item, BaseException):
            raise item
        if item.error is not None:
            raise RequestFailedError(item.error)
        return item

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            if self._peeked is not None:
                item, self._peeked = self._peeked, None
            else:
                item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            if item.error is not None:
                self.finished = True
                raise RequestFailedError(item.error)
            yield item

    def finish_sample(self, index: int, stop: str | None) -> None:
        """Tell the engine that sample ``index`` ended at a stop string."""
        self.client.send(m.FinishSample(self.request_id, index, stop))

    def abort(self) -> None:
        """Drop the request in the engine (its KV blocks are freed before the next step)."""
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)


_STALL_CHECK_S = 0.5  # how often the stall watchdog looks (at most a quarter of its bound)


def starved(
    streams: Iterable[RequestStream], last_heard: float, now: float, timeout_s: float
) -> list[RequestStream]:
    """The requests the engine has sent nothing for since they were sent, for more than
    ``timeout_s`` (an engine with work publishes at least every ``STATS_INTERVAL_S``)."""
    return [s for s in streams if now - max(last_heard, s.sent_at) > timeout_s]


class EngineClient:
    def __init__(self, proc: subprocess.Popen, ipc_dir: Path) -> None:
        self.proc = proc
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.pull = self.ctx.socket(zmq.PULL)
        for sock in (self.push, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
        self.push.bind(f"ipc://{ipc_dir}/input")
        self.pull.bind(f"ipc://{ipc_dir}/output")
        self.ready: m.Ready | None = None
        self.dead: str | None = None
        self.stats: m.StatsSnapshot | None = None  # the engine's latest, as it published it
        self.stats_received_at = 0.0  # time.monotonic() when it arrived
        self.missing_ranks: list[str] = []  # the group's ranks whose heartbeat is late
        self.elastic: dict | None = None  # elastic EP: the group's live ranks and losses
        self.last_heard = time.monotonic()  # when the engine last sent any message
        # prefill/decode disaggregation: the engine counts as stalled once it sent nothing
        # for this long while requests waited (None: never); set before wait_ready
        self.stall_timeout_s: float | None = None
        self.stalled: str | None = None  # why: until the engine sends something again
        self.paused: str | None = None  # why new requests are refused (a role switch drains)
        self.stop_requested: str | None = None  # why another host asked the group to stop
        self._closing = False
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, asyncio.Future[m.AddResult]] = {}
        self._calls: dict[int, asyncio.Future[m.CallResult]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # -- start and stop ---------------------------------------------------------------------

    @classmethod
    def spawn(
        cls, config: dict, ipc_dir: Path, api_url: str | None = None, term_grace_s: float = 0.0
    ) -> EngineClient:
        """Start the engine process for ``config`` (EngineConfig fields); call
        :meth:`wait_ready` next, inside the event loop. ``api_url``: where this server
        listens (an engine group's other hosts log it); ``term_grace_s``: how long the engine
        leaves a SIGTERM of its own to this process's Shutdown (0: it stops at once)."""
        spec = {
            "config": config,
            "input": f"ipc://{ipc_dir}/input",
            "output": f"ipc://{ipc_dir}/output",
            "parent_pid": os.getpid(),
            "api_url": api_url,
            "term_grace_s": term_grace_s,
        }
        # its own session: a terminal's Ctrl-C reaches only this process, which then stops
        # the engine in order
        proc = subprocess.Popen(
            [sys.executable, "-m", "moeserve.serving.engine_core", json.dumps(spec)],
            start_new_session=True,
        )
        return cls(proc, ipc_dir)

    async def wait_ready(self) -> m.Ready:
        """Wait until the engine has loaded (no time limit while its process lives). Raises
        EngineDeadError with the engine's reason when it fails to start."""
        while True:
            if await self.pull.poll(200):
                msg = m.decode(await self.pull.recv())
                if isinstance(msg, m.Ready):
                    self.ready = msg
                    break
                if isinstance(msg, m.EngineDead):
                    self._reap()
                    raise EngineDeadError(msg.message)
                if isinstance(msg, m.GroupHealth):  # the group formed; a rank is late already
                    self.missing_ranks = msg.missing
                    self.elastic = msg.elastic or self.elastic
                    continue
                if isinstance(msg, m.StopRequested):
                    self.stop_requested = msg.reason
                    continue
                raise m.MessageError(f"expected Ready from the engine, got {type(msg).__name__}")
            if self.proc.poll() is not None:
                raise EngineDeadError(f"the engine process exited with code {self.proc.returncode}")
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="engine-outputs"),
            asyncio.create_task(self._watch_process(), name="engine-watchdog"),
        ]
        if self.stall_timeout_s is not None:
            self._tasks.append(
                asyncio.create_task(self._watch_stalls(self.stall_timeout_s), name="engine-stall")
            )
        return msg

    async def shutdown(self, timeout: float = 30.0) -> int:
        """Stop the engine (it stops its group's ranks) and wait; kill it after ``timeout``.
        Returns the engine process's exit code."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self.proc.poll() is None:
            # never wait to send: an engine that is failing has closed its end, and a PUSH
            # without a peer would hold the message (and this server) forever
            with contextlib.suppress(zmq.ZMQError):
                await self.push.send(m.encode(m.Shutdown()), flags=zmq.NOBLOCK)
            deadline = asyncio.get_running_loop().time() + timeout
            while self.proc.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        code = self._reap()
        self._fail_all(EngineDeadError("the server is shutting down"))
        self.push.close()
        self.pull.close()
        self.ctx.term()
        return code

    def _reap(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    # -- requests -----------------------------------------------------------------------------

    def send(self, msg: m.Message) -> None:
        if self.dead is None and not self._closing:
            self.push.send(m.encode(msg))  # zmq.asyncio: queued at once; never blocks here

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises QueueFullError,
        RejectedError, EngineDeadError, or RequestFailedError for a request with bootstrap
        fields while the engine is stalled (or once it stalls before accepting it), and for
        any while :attr:`paused`."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.stalled is not None and params.kv_transfer is not None:
            raise RequestFailedError(self.stalled)  # a router would wait for it in vain
        if self.paused is not None:  # after the HTTP layer's check, before the count below
            raise RequestFailedError(self.paused)
        if request_id in self._streams:
            raise RejectedError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, moves_kv=params.kv_transfer is not None)
        self._streams[request_id] = stream
        accepted = asyncio.get_running_loop().create_future()
        self._adds[request_id] = accepted
        try:
            self.send(m.AddRequest(request_id, prompt_token_ids, params))
            result = await accepted
        except BaseException:  # cancelled while waiting: the engine may have accepted it
            self._adds.pop(request_id, None)
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        if result.error_kind is not None:
            self._streams.pop(request_id, None)
            if result.error_kind == "queue_full":
                raise QueueFullError(result.message)
            raise RejectedError(result.message)
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.send(m.AbortRequests([request_id]))

    def end_all(self, message: str) -> None:
        """End every unfinished request now with RequestEndedError (shutdown timeout)."""
        streams = list(self._streams.values())
        if streams:
            self.send(m.AbortRequests([s.request_id for s in streams]))
        self._fail_all(RequestEndedError(message))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def call(self, method: str, timeout: float = 10.0, args: dict | None = None):
        """Ask the engine (between two steps) and return its answer."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self.send(m.Call(call_id, method, args))
            result = await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(result.error)
        return result.result

    # -- background tasks --------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            msg = m.decode(await self.pull.recv())
            self.last_heard = time.monotonic()
            if self.stalled is not None:
                logger.warning("the engine answers again (it had stalled: %s)", self.stalled)
                self.stalled = None
            if isinstance(msg, m.StepOutputs):
                for out in msg.outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(out)
                        if out.finished:
                            del self._streams[out.request_id]
            elif isinstance(msg, m.AddResult):
                future = self._adds.pop(msg.request_id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, m.StatsSnapshot):
                self.stats, self.stats_received_at = msg, time.monotonic()
            elif isinstance(msg, m.CallResult):
                future = self._calls.get(msg.call_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, m.GroupHealth):
                if msg.missing:
                    logger.warning("engine group: %s", "; ".join(msg.missing))
                elif self.missing_ranks:
                    logger.info("engine group: every rank is alive again")
                self.missing_ranks = msg.missing
                self.elastic = msg.elastic or self.elastic
            elif isinstance(msg, m.StopRequested):
                self.stop_requested = msg.reason
            elif isinstance(msg, m.EngineDead):
                self._die(msg.message)
                return

    async def _watch_stalls(self, timeout_s: float) -> None:
        """Fail each waiting request with bootstrap fields once the engine has sent nothing
        for ``timeout_s`` since it was sent (:func:`starved`), and mark the engine stalled."""
        while True:
            await asyncio.sleep(min(_STALL_CHECK_S, timeout_s / 4))
            if self.pull.get(zmq.EVENTS) & zmq.POLLIN:
                continue  # messages wait for the reader: this loop is late, not the engine
            now = time.monotonic()
            late = starved(self._streams.values(), self.last_heard, now, timeout_s)
            if not late:
                continue
            if self.stalled is None:
                self.stalled = (
                    f"the engine has sent nothing for {now - self.last_heard:.1f} s while "
                    f"{len(self._streams)} request(s) waited (a bound of {timeout_s:g} s, "
                    "--disaggregation-transfer-timeout): it is stuck or stopped"
                )
                logger.error("%s", self.stalled)
            error = RequestFailedError(self.stalled)
            for stream in late:
                if stream.moves_kv:
                    self._fail_stream(stream, error)

    def _fail_stream(self, stream: RequestStream, error: BaseException) -> None:
        """End one request with ``error`` here, and drop it in the engine."""
        self._streams.pop(stream.request_id, None)
        added = self._adds.pop(stream.request_id, None)
        if added is not None and not added.done():
            added.set_exception(error)  # add_request aborts it in the engine
            return
        stream.queue.put_nowait(error)
        self.send(m.AbortRequests([stream.request_id]))

    async def _watch_process(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.2)
        if not self._closing:
            self._die(f"the engine process exited with code {self.proc.returncode}")

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        logger.error("engine failed: %s", reason)
        self.dead = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
        for future in (*self._adds.values(), *self._calls.values()):
            if not future.done():
                future.set_exception(error)
        self._adds.clear()
