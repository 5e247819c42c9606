"""An engine that lives but sends nothing (prefill/decode disaggregation): ``EngineClient``
fails each waiting request with bootstrap fields once the engine has been silent for the
bound, and reports the engine stalled until it sends something again. Real ZeroMQ sockets;
the engine is a stand-in in this process that answers only what the test tells it to."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from moeserve.core import KVTransferParams, SamplingParams
from moeserve.serving import messages as m
from moeserve.serving.client import EngineClient, RequestFailedError, starved

BOUND_S = 0.4
READY = m.Ready(
    max_model_len=64,
    vocab_size=16,
    architecture="stand-in",
    world_size=1,
    data_parallel_size=1,
    max_num_seqs=4,
)


def test_starved_counts_silence_from_the_later_of_the_last_message_and_the_send():
    streams = [SimpleNamespace(sent_at=10.0), SimpleNamespace(sent_at=14.0)]
    assert starved(streams, last_heard=12.0, now=14.5, timeout_s=2.0) == [streams[0]]
    assert starved(streams, last_heard=12.0, now=16.5, timeout_s=2.0) == streams
    assert starved(streams, last_heard=16.0, now=16.5, timeout_s=2.0) == []


@pytest.fixture()
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_silent_engine_fails_disaggregated_requests_and_reads_stalled(tmp_path, sleeper):
    async def scenario() -> None:
        client = EngineClient(sleeper, tmp_path)
        client.stall_timeout_s = BOUND_S
        ctx = zmq.asyncio.Context()
        engine_in, engine_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        engine_in.connect(f"ipc://{tmp_path}/input")
        engine_out.connect(f"ipc://{tmp_path}/output")
        try:
            await engine_out.send(m.encode(READY))
            await client.wait_ready()
            moves = SamplingParams(max_tokens=4, kv_transfer=KVTransferParams("h", 1, 7))
            plain = asyncio.create_task(client.add_request("plain", [1, 2], SamplingParams()))
            start = time.monotonic()
            with pytest.raises(RequestFailedError, match="sent nothing"):
                await client.add_request("moves", [1, 2], moves)  # never accepted: silent
            assert BOUND_S <= time.monotonic() - start < BOUND_S + 1.0
            assert client.stalled is not None
            assert not plain.done()  # a request without bootstrap fields waits on
            received = [m.decode(await engine_in.recv()) for _ in range(3)]
            assert isinstance(received[2], m.AbortRequests)  # the engine drops it later
            assert received[2].request_ids == ["moves"]
            with pytest.raises(RequestFailedError, match="sent nothing"):  # at once now
                await client.add_request("moves again", [1, 2], moves)

            await engine_out.send(m.encode(m.AddResult("plain")))
            await plain
            assert client.stalled is None  # the engine spoke again
        finally:
            await client.shutdown(timeout=0.1)
            engine_in.close()
            engine_out.close()
            ctx.term()

    asyncio.run(asyncio.wait_for(scenario(), 10))  # no watchdog: add_request waits forever
