"""Bad requests get OpenAI-shaped 4xx/503 answers that name the problem, and none of them
disturbs a long stream running meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import API_KEY, start_server

LONG_TOKENS = 400
QUEUE_TOKENS = 1900  # the full-queue test's streams: most of the tiny model's 2048 positions


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


class LongStream(threading.Thread):
    """A greedy stream of ``max_tokens`` tokens read in the background."""

    def __init__(self, client: openai.OpenAI, model: str, max_tokens: int = LONG_TOKENS) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.tokens, self.chunks, self.error = 0, 0, None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model,
                prompt="A long story about experts",
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                self.started.set()
                self.chunks += 1
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()


def test_bad_requests_leave_a_running_stream_alone(client, http, model, server):
    long = LongStream(client, model)
    long.start()
    assert long.started.wait(60)
    post = http.post
    url = "/v1/completions"

    # malformed JSON
    r = post(url, content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert "JSON" in _error(r, 400)["message"]
    # invalid UTF-8
    r = post(url, content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert "UTF-8" in _error(r, 400)["message"]
    # a field of the wrong type
    err = _error(post(url, json={"prompt": "hi", "temperature": "hot"}), 400)
    assert err["param"] == "temperature" and "temperature" in err["message"]
    err = _error(post(url, json={"prompt": "hi", "n": [1]}), 400)
    assert err["param"] == "n"
    # out of range
    err = _error(post(url, json={"prompt": "hi", "top_p": 5}), 400)
    assert err["param"] == "top_p"
    err = _error(post(url, json={"prompt": "hi", "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens"
    err = _error(post("/v1/chat/completions", json={"messages": [], "max_tokens": 3}), 400)
    assert err["param"] == "messages"
    err = _error(post(url, json={"prompt": "hi", "logprobs": 99}), 400)
    assert err["param"] == "logprobs"
    # unknown model
    err = _error(post(url, json={"prompt": "hi", "model": "gpt-17"}), 400)
    assert err["param"] == "model" and "gpt-17" in err["message"]
    # a prompt longer than the context, or one that leaves no room for max_tokens
    err = _error(post(url, json={"prompt": "expert " * 3000}), 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    err = _error(post(url, json={"prompt": "hi", "max_tokens": 100000}), 400)
    assert err["param"] == "max_tokens"
    # empty prompts
    err = _error(post(url, json={"prompt": ""}), 400)
    assert err["param"] == "prompt"
    err = _error(post(url, json={"prompt": []}), 400)
    assert err["param"] == "prompt"
    # a token id outside the vocabulary, a lone surrogate
    err = _error(post(url, json={"prompt": [1, 10**6]}), 400)
    assert err["param"] == "prompt"
    body = b'{"prompt": "\\ud800 hi"}'
    err = _error(post(url, content=body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == "prompt"
    # a missing or wrong API key
    err = _error(httpx.post(f"{server.url}{url}", json={"prompt": "hi"}), 401)
    assert err["code"] == "invalid_api_key"
    bad = {"Authorization": "Bearer nope"}
    _error(httpx.post(f"{server.url}{url}", json={"prompt": "hi"}, headers=bad), 401)
    # the openai client raises its own typed errors for these
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", temperature=7)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0).models.list()

    long.join(120)
    assert long.error is None
    assert long.tokens == LONG_TOKENS
    assert http.get("/debug/engine").json()["integrity"] == "ok"


def _gauge(url: str, name: str) -> float | None:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def test_full_queue_is_503_with_retry_after():
    srv = start_server("--max-num-seqs", "1", "--max-waiting-requests", "1", "--api-key", API_KEY)
    try:
        client = openai.OpenAI(base_url=srv.v1, api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        # the queue must stay full until the third request is answered: on a fast host 400
        # tokens of the tiny model took under a second, and the queue could empty first
        n = QUEUE_TOKENS
        running, waiting = LongStream(client, model, n), LongStream(client, model, n)
        running.start()
        assert running.started.wait(60)
        waiting.start()  # queued behind the running one (max_num_seqs=1)
        deadline = time.monotonic() + 60
        while _gauge(srv.url, "moeserve:num_requests_waiting") != 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": "one more", "max_tokens": 4}
        r = httpx.post(f"{srv.v1}/completions", json=body, headers=headers, timeout=120)
        err = _error(r, 503)
        assert "queue" in err["message"]
        assert r.headers["retry-after"] == "1"
        running.join(120)
        waiting.join(120)
        assert running.tokens == waiting.tokens == n
    finally:
        assert srv.stop() == 0, srv.text()


def test_openapi_schema_states_the_ranges(http):
    schema = http.get("/openapi.json").json()
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["top_p"]["anyOf"][0]["maximum"] == 1
    assert json.dumps(schema)  # serialisable, served as the fuzz test's source
