"""RequestGuard (the API key before the body, the size and depth limits, our own bugs as a
500 without their text) and the JSON depth count it relies on."""

from __future__ import annotations

import json
import logging
import random

import httpx
import pytest
from fastapi import FastAPI

from moeserve.serving.guard import RequestGuard, json_depth

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _depth_reference(text: str) -> int:
    depth = best = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def _random_json(rng: random.Random, level: int = 0):
    r = rng.random()
    if level > 7 or r < 0.3:
        return rng.choice(['a"b', "\\", 'x\\"[{', "[]", "\\\\", 1, None, "}", '\\\\"', "é[", ""])
    if r < 0.65:
        return [_random_json(rng, level + 1) for _ in range(rng.randint(0, 3))]
    keys = ["k", "[", '"\\', "{}"]
    return {rng.choice(keys): _random_json(rng, level + 1) for _ in range(rng.randint(0, 3))}


def test_json_depth_matches_a_character_scan():
    rng = random.Random(0)
    for _ in range(2000):
        text = json.dumps(_random_json(rng), ensure_ascii=rng.random() < 0.5)
        assert json_depth(text.encode()) == _depth_reference(text), text
    assert json_depth(b"") == 0 and json_depth(b'"[[["') == 0
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000
    assert json_depth(b'["\\\\"' + b"[[" + b"]]]") == 3  # an escaped backslash ends no string


def _app(fail: bool = False) -> FastAPI:
    """As ``build_app`` installs it: inside Starlette's outermost error middleware."""
    app = FastAPI()
    app.add_middleware(RequestGuard, api_key=KEY, public_paths=["/health"], max_body_bytes=1000)

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        if fail:
            raise KeyError("secret detail")
        return body

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


async def _post(guard: FastAPI, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post("/echo", **kwargs)


@pytest.mark.anyio
async def test_the_key_comes_before_the_body():
    guard = _app()
    r = await _post(guard, content=b"{not json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = await _post(guard, content=b"x" * 5000)  # over the limit, but no key first
    assert r.status_code == 401
    r = await _post(guard, content=b"{not json", headers=AUTH)
    assert r.status_code in (400, 422)  # FastAPI's own answer, past the guard
    r = await _post(guard, json={"a": 1}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"a": 1}
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/openapi.json")).status_code == 401


@pytest.mark.anyio
async def test_size_and_depth_limits():
    guard = _app()
    r = await _post(guard, content=b"x" * 1001, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def chunks():
        for _ in range(11):
            yield b"x" * 100

    r = await _post(guard, content=chunks(), headers=AUTH)
    assert r.status_code == 413
    deep = b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}"
    r = await _post(guard, content=deep, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_deep"
    ok = b'{"a": ' + b"[" * 63 + b"]" * 63 + b', "s": "' + b"[" * 200 + b'"}'
    r = await _post(guard, content=ok, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_our_own_bug_is_a_500_without_its_text(caplog):
    guard = _app(fail=True)
    with caplog.at_level(logging.ERROR, logger="moeserve.serving.guard"):
        r = await _post(guard, json={"a": 1}, headers=AUTH)
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret detail" not in r.text and "KeyError" not in r.text
    error_id = err["message"].split("id ")[1].split(";")[0]
    records = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None


@pytest.fixture
def anyio_backend():
    return "asyncio"
