"""Fuzz the running server from its own OpenAPI schema (schemathesis + hypothesis): bodies
that break the schema, bodies that follow it, and arbitrary bytes must never get a 5xx, and
the server must still answer and keep its KV cache consistent afterwards."""

from __future__ import annotations

import httpx
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.server import API_KEY

schemathesis = pytest.importorskip("schemathesis")

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    database=None,
)


# random schemas, regexes, grammars, tool lists and thinking budgets (this server has no
# reasoning parser) are 400s nearly always (each has its own tests): every other positive
# body keeps them, so the rest can reach a 200
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
GUIDED += ("tools", "tool_choice", "thinking_token_budget")
_seen = [0]


def _cap(body):
    """Keep valid requests cheap (few tokens, few samples) and about the served model (a
    random model name is a 400, tested on its own)."""
    if isinstance(body, dict):
        body.pop("model", None)
        _seen[0] += 1
        if _seen[0] % 2:
            for key in GUIDED:
                body.pop(key, None)
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 4:
                body[key] = 4
        if "messages" in body and not body.get("max_tokens"):
            body["max_completion_tokens"] = 4  # else the output may fill the context
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
            body["prompt"] = body["prompt"][:4]
        if "prompt" in body:  # empty prompts and ids past the vocabulary are 400s (tested)
            body["prompt"] = _valid_prompt(body["prompt"])
    return body


def _valid_prompt(prompt):
    if isinstance(prompt, str):
        return prompt or "hi"
    if isinstance(prompt, int):
        return prompt % 512
    if isinstance(prompt, list):
        return [_valid_prompt(p) for p in prompt] or "hi"
    return prompt


def _check(response, label: str) -> None:
    assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        err = response.json()["error"]
        assert err["message"] and err["type"]
    assert "InternalServerError" not in response.text, f"{label}: {response.text[:500]}"


@pytest.fixture(scope="module")
def operations(server):
    schema = schemathesis.openapi.from_dict(
        httpx.get(f"{server.url}/openapi.json", headers=HEADERS).json()
    )
    return {path: schema[path]["POST"] for path in POSTS}


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        s.headers.update(HEADERS)
        yield s


@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize("mode", ["negative", "positive"])
def test_schema_fuzz_finds_no_server_error(server, http, operations, session, path, mode):
    strategy = operations[path].as_strategy(schemathesis.GenerationMode(mode))
    statuses: dict[int, int] = {}

    @FUZZ
    @given(case=strategy)
    def run(case):
        if mode == "positive":
            case.body = _cap(case.body)
        response = case.call(base_url=server.url, session=session, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        _check(response, f"{mode} {path} {case.body!r:.300}")

    run()
    if mode == "negative":  # the fuzzer did reach the validation
        assert statuses.get(400, 0) >= 10, statuses
    else:
        assert statuses.get(200, 0) >= 5, statuses  # others: legitimate 400s
    assert http.get("/health").status_code == 200
    assert http.get("/debug/engine").json()["integrity"] == "ok"


@pytest.mark.parametrize("path", POSTS)
def test_arbitrary_bytes_are_4xx(server, session, path):
    @FUZZ
    @given(body=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
    def run(body):
        r = session.post(
            f"{server.url}{path}",
            data=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        _check(r, f"{path} {body!r:.200}")
        assert r.status_code == 400 or r.status_code == 200

    run()
