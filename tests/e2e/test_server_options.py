"""Server options that change what a client sees: the API key taken from ``MOESERVE_API_KEY``
(no ``--api-key`` flag) and ``--served-model-name``. One server on the demo model has both."""

from __future__ import annotations

import httpx
import openai
import pytest

from moeserve.demo import TINY_NAME
from tests.e2e.server import RunningServer, start_server

ENV_KEY = "key-from-the-environment"
NAMES = ("moe-alias", "second-alias")


@pytest.fixture(scope="module")
def named_server() -> RunningServer:
    srv = start_server("--served-model-name", *NAMES, env={"MOESERVE_API_KEY": ENV_KEY})
    yield srv
    srv.stop_cleanly()


def _call(url: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if path == "/v1/models":
        return httpx.get(f"{url}{path}", headers=headers)
    body = {"model": NAMES[0], "prompt": "hi", "max_tokens": 2}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def test_api_key_from_the_environment_is_enforced(named_server):
    url = named_server.url
    for path in ("/v1/models", "/v1/completions"):
        r = _call(url, path)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert _call(url, path, "nope").status_code == 401
        assert _call(url, path, ENV_KEY).status_code == 200
    # open without the key: health, version, metrics; the API's description needs it
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        with_key = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {ENV_KEY}"})
        assert with_key.status_code == 200, path


def test_served_model_names_are_listed_required_and_echoed(named_server):
    client = openai.OpenAI(base_url=named_server.v1, api_key=ENV_KEY, max_retries=0, timeout=120)
    models = client.models.list().data
    assert [m.id for m in models] == list(NAMES)
    for name in NAMES:
        out = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert out.model == name
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.model == name
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        assert {chunk.model for chunk in stream} == {name}
    # the model directory's name, the default without the flag, is not served
    assert models[0].model_extra["root"] == NAMES[0]
    with pytest.raises(openai.BadRequestError, match="is not served here") as e:
        client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    # a request that names no model is answered as the first name
    headers = {"Authorization": f"Bearer {ENV_KEY}"}
    r = httpx.post(
        f"{named_server.v1}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]
