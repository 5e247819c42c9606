"""The serving benchmark against a fake OpenAI streaming server (FastAPI + uvicorn in a thread).

The fake server streams one chunk per requested token (``max_tokens``) with small sleeps, then a
usage chunk and ``[DONE]``. It fails on purpose: ``max_tokens == 7`` gets HTTP 500 and
``max_tokens == 9`` an error event after two chunks. Tokens are Unicode code points (vocab 128);
code point 0 plays BOS, added by ``/tokenize`` with ``add_special_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from moeserve.bench.serving import (
    BenchmarkError,
    ServingBenchConfig,
    add_serving_parser,
    arrival_offsets,
    run_benchmark,
)

CHUNK_SLEEP_S = 0.002


class FakeServer:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "vocab_size": 128}]}

        @app.post("/tokenize")
        async def tokenize(req: Request):
            body = await req.json()
            tokens = [ord(c) for c in body["prompt"]]
            if body.get("add_special_tokens", True):
                tokens = [0, *tokens]  # code point 0 plays BOS
            return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

        @app.post("/detokenize")
        async def detokenize(req: Request):
            return {"prompt": "".join(chr(t) for t in (await req.json())["tokens"])}

        @app.post("/v1/completions")
        async def completions(req: Request):
            return await self._generate(req, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(req: Request):
            return await self._generate(req, chat=True)

        return app

    async def _generate(self, req: Request, chat: bool):
        body = await req.json()
        self.bodies.append(body)
        self.auth.append(req.headers.get("authorization"))
        n = body["max_tokens"]
        if n == 7:
            return JSONResponse({"error": {"message": "injected 500"}}, status_code=500)

        def event(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                for i in range(n):
                    await asyncio.sleep(CHUNK_SLEEP_S)
                    if n == 9 and i == 2:
                        yield event({"error": {"message": "injected stream error"}})
                        return
                    choice = {"index": 0, "delta": {"content": "x"}} if chat else {"text": "x"}
                    yield event({"choices": [choice]})
                usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                yield event({"choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake():
    srv = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(srv.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    srv.url = f"http://127.0.0.1:{port}"
    yield srv
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.bodies.clear()
    fake.auth.clear()
    fake.max_in_flight = 0


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="moeserve bench")
    serving = add_serving_parser(parser.add_subparsers(dest="command", required=True))
    return parser, serving


def test_help_states_the_range_ratio_definition():
    _, serving = _parser()
    text = " ".join(serving.format_help().split())
    assert "[L*(1-r), L*(1+r)]" in text
    assert "vLLM's current definition" in text


def test_arrival_offsets_are_seeded_poisson():
    a = arrival_offsets(2000, rate=50.0, seed=1)
    assert a[0] == 0.0 and a == sorted(a)
    assert a == arrival_offsets(2000, rate=50.0, seed=1)
    assert a[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(3, rate=float("inf")) == [0.0, 0.0, 0.0]


def test_poisson_rate_random_prompts_cli(fake, tmp_path, capsys):
    parser, _ = _parser()
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = parser.parse_args(
        ["serving", "--base-url", fake.url + "/v1", "--num-prompts", "20"]
        + ["--random-input-len", "16", "--random-output-len", "5", "--random-range-ratio", "0.2"]
        + ["--request-rate", "50", "--seed", "1", "--api-key", "sk-test", "--disable-tqdm"]
        + ["--goodput", "ttft:60000", "e2el:60000"]
        + ["--output-json", str(out_json), "--plot", str(out_png)]
    )
    assert args.func(args) == 0

    table = capsys.readouterr().out
    lines = table.splitlines()
    assert "============ Serving Benchmark Result ============" in lines
    assert "Successful requests:                     20" in lines
    assert "Failed requests:                         0" in lines
    for label in (
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label

    d = json.loads(out_json.read_text())
    assert d["completed"] == 20 and d["failed"] == 0
    assert d["total_output_tokens"] == sum(d["output_lens"])
    assert all(4 <= n <= 6 for n in d["output_lens"])  # 5 +- 20%
    assert d["total_input_tokens"] == sum(d["input_lens"])
    assert all(12 <= n <= 20 for n in d["input_lens"])  # 16 +- 20%, fitted within one token
    assert all(0 < t < e for t, e in zip(d["ttfts"], d["e2els"]))
    assert all(len(itl) == n - 1 for itl, n in zip(d["itls"], d["output_lens"]))
    assert d["request_goodput"] == pytest.approx(d["request_throughput"])
    assert d["config"]["request_rate"] == 50.0 and d["config"]["model_id"] == "fake-model"
    assert "api_key" not in d["config"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    body = fake.bodies[-1]  # 1 warm-up + 20 timed, all to /v1/completions
    assert len(fake.bodies) == 21
    assert body["model"] == "fake-model" and isinstance(body["prompt"], str)
    assert not any("\x00" in b["prompt"] for b in fake.bodies)  # the "BOS" is avoided
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert set(fake.auth) == {"Bearer sk-test"}


def test_max_concurrency_chat_with_failures(fake, tmp_path):
    lines = [{"prompt": "hello", "output_len": 4}, {"prompt": "boom", "output_len": 7}]
    lines += [{"messages": [{"role": "user", "content": "hi there"}], "output_len": 6}]
    lines += [{"prompt": "cut", "output_len": 9}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = ServingBenchConfig(
        base_url=fake.url,
        endpoint="chat",
        dataset=str(path),
        num_prompts=16,  # the 4 lines, 4 times
        max_concurrency=3,
        ignore_eos=False,
        disable_tqdm=True,
    )
    result = asyncio.run(run_benchmark(config))
    assert (result.completed, result.failed) == (8, 8)
    assert result.total_output_tokens == 4 * (4 + 6)
    assert result.total_input_tokens == 4 * (len("hello") + len("hi there"))
    errors = [r.error for r in result.records if not r.success]
    assert sum("HTTP 500" in e and "injected 500" in e for e in errors) == 4
    assert errors.count("injected stream error") == 4
    assert all(0 < r.ttft < r.e2e for r in result.records if r.success)
    assert fake.max_in_flight <= 3
    assert 1 <= result.max_concurrent_requests <= 3
    chat_bodies = fake.bodies[1:]
    assert chat_bodies[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert chat_bodies[2]["messages"] == lines[2]["messages"]
    assert "ignore_eos" not in chat_bodies[0]


def test_failed_warmup_and_unreachable_server(fake, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "boom", "output_len": 7}\n')
    config = ServingBenchConfig(base_url=fake.url, dataset=str(path), num_prompts=2)
    with pytest.raises(BenchmarkError, match="warm-up request .* failed: HTTP 500"):
        asyncio.run(run_benchmark(config))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(BenchmarkError, match="is the server running"):
        asyncio.run(run_benchmark(ServingBenchConfig(base_url=dead, num_prompts=1)))


def test_completions_endpoint_refuses_chat_messages(fake, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    config = ServingBenchConfig(base_url=fake.url, dataset=str(path), num_prompts=1)
    with pytest.raises(ValueError, match="use --endpoint chat"):
        asyncio.run(run_benchmark(config))
