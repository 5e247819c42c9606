"""What a hostile or careless client sends must never stall the others, reach a 500 or leak the
server's paths: request templates (refused by default; sandboxed when trusted), bodies too
large or nested too deep, the API key checked before the body, impossible ``n``."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.server import API_KEY, RunningServer, start_server
from tests.e2e.test_errors import _error as openai_error

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]
BODY_LIMIT = 1 << 20
# issue 20's probe: 48 s of empty loops on the event loop, before the sandbox
LOOPS = (
    "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
    "{% endfor %}{% endfor %}{% endfor %}hi"
)
HOSTILE_TEMPLATES = {
    "division": "{{ 1/0 }}",
    "range step": "{{ range(0,1,0) }}",
    "overflow": "{{ (1e308*10)|int }}",
    "truncate": "{{ 'x'|truncate(-1) }}",
    "center": "{{ 'x'|center(2**62) }}",
    "recursive macro": "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
    "huge output": "{% for i in range(100000) %}{{ 'hello world ' * 1000 }}{% endfor %}",
    "syntax": "{% for %}",
}


def _error(r: httpx.Response, status: int) -> dict:
    """test_errors' OpenAI-shaped error, with nothing of a traceback in it."""
    err = openai_error(r, status)
    assert err["type"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    return err


@pytest.fixture(scope="module")
def trusting() -> RunningServer:
    srv = start_server(
        "--api-key",
        API_KEY,
        "--trust-request-chat-template",
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--max-waiting-requests",
        "3",
    )
    yield srv
    srv.stop_cleanly()


def _chat(url: str, timeout: float = 60, **fields) -> httpx.Response:
    body = {"messages": HI, "max_tokens": 2, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=timeout)


class HealthProbe(threading.Thread):
    """Polls /health until stopped; records the slowest answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.slowest, self.codes = url, 0.0, set()
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.done.is_set():
                t0 = time.monotonic()
                self.codes.add(c.get(f"{self.url}/health").status_code)
                self.slowest = max(self.slowest, time.monotonic() - t0)
                time.sleep(0.02)

    def stop(self) -> None:
        self.done.set()
        self.join(30)


def test_request_templates_are_refused_without_the_flag(server):
    for fields, param in (
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": LOOPS}}, "chat_template_kwargs.chat_template"),
    ):
        t0 = time.monotonic()
        err = _error(_chat(server.url, **fields), 400)
        assert err["code"] == "untrusted_chat_template" and err["param"] == param
        assert "--trust-request-chat-template" in err["message"]
        assert time.monotonic() - t0 < 30  # refused, not rendered
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": HI, "chat_template": "{{ 1/0 }}"},
        headers=HEADERS,
    )
    assert _error(r, 400)["code"] == "untrusted_chat_template"
    # the model's own template, by name, is its own
    assert _chat(server.url, chat_template="default").status_code == 200


def test_a_looping_template_stalls_no_one(trusting):
    probe = HealthProbe(trusting.url)
    probe.start()
    other: dict = {}

    def generate() -> None:
        body = {"prompt": "The expert", "max_tokens": 40, "ignore_eos": True}
        other["r"] = httpx.post(
            f"{trusting.url}/v1/completions", json=body, headers=HEADERS, timeout=120
        )

    worker = threading.Thread(target=generate)
    worker.start()
    t0 = time.monotonic()
    err = _error(_chat(trusting.url, chat_template_kwargs={"chat_template": LOOPS}), 400)
    took = time.monotonic() - t0
    worker.join(120)
    probe.stop()
    assert "did not finish within" in err["message"], err
    assert took < 20, took  # the budget (2 s) ended it, not the loops (48 s)
    assert other["r"].status_code == 200
    assert probe.codes == {200}
    assert probe.slowest < 1.0, probe.slowest  # a blocked loop would hold it for seconds
    # the sandbox restarts: the next request template renders
    ok = httpx.post(
        f"{trusting.url}/tokenize",
        json={"messages": HI, "chat_template": "[{{ messages[0].content }}]"},
        headers=HEADERS,
    )
    assert ok.status_code == 200, ok.text
    assert (
        ok.json()["tokens"]
        == httpx.post(
            f"{trusting.url}/tokenize",
            json={"prompt": "[hi]", "add_special_tokens": False},
            headers=HEADERS,
        ).json()["tokens"]
    )


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_template_failures_are_400s_with_a_short_message(trusting, name):
    template = HOSTILE_TEMPLATES[name]
    for fields in (
        {"chat_template": template},
        {"chat_template_kwargs": {"chat_template": template}},
    ):
        err = _error(_chat(trusting.url, **fields), 400)
        assert len(err["message"]) < 500, err["message"]
        assert err["param"] in ("chat_template", "chat_template_kwargs.chat_template")


def test_no_traceback_in_the_log_for_user_errors(trusting):
    for template in HOSTILE_TEMPLATES.values():
        _chat(trusting.url, chat_template=template)
    _chat(trusting.url, chat_template_kwargs={"deep": _nested(60)})
    assert "Traceback" not in trusting.text(), trusting.text()[-3000:]


def _nested(depth: int) -> dict:
    out: dict = {}
    for _ in range(depth):
        out = {"a": out}
    return out


def test_deep_json_is_a_400_before_parsing(trusting):
    for depth in (65, 500, 100_000):
        body = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"x": "["}}
        raw = json.dumps(body)[:-2] + ', "deep": ' + "[" * depth + "]" * depth + "}}"
        r = httpx.post(
            f"{trusting.url}/v1/chat/completions",
            content=raw,
            headers={**HEADERS, "Content-Type": "application/json"},
        )
        err = _error(r, 400)
        assert err["code"] == "too_deep" and f"{depth + 2} deep" in err["message"]
    # brackets inside strings do not count; 60 levels of objects render
    deep_ok = {"x": "[" * 1000, "d": _nested(55)}
    assert _chat(trusting.url, chat_template_kwargs=deep_ok).status_code == 200


def test_bodies_over_the_limit_get_413(trusting):
    big = {"prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    r = httpx.post(f"{trusting.url}/v1/completions", json=big, headers=HEADERS)
    assert _error(r, 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is counted while the body arrives
        for _ in range(40):
            yield b"x" * (BODY_LIMIT // 32)

    r = httpx.post(f"{trusting.url}/v1/completions", content=chunks(), headers=HEADERS)
    assert _error(r, 413)["code"] == "request_too_large"
    assert httpx.get(f"{trusting.url}/health").status_code == 200


def test_the_key_is_checked_before_the_body(trusting):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{trusting.url}{path}", content=b"{not json")
        assert _error(r, 401)["code"] == "invalid_api_key"
        r = httpx.post(f"{trusting.url}{path}", content=b"x" * (2 * BODY_LIMIT))
        assert _error(r, 401)["code"] == "invalid_api_key"
    for path in ("/openapi.json", "/docs", "/redoc", "/v1/models"):
        assert _error(httpx.get(f"{trusting.url}{path}"), 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{trusting.url}{path}", headers=HEADERS).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{trusting.url}{path}").status_code == 200


def test_n_the_queue_can_never_hold_is_a_400(trusting):
    r = httpx.post(
        f"{trusting.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "n": 4},
        headers=HEADERS,
    )
    err = _error(r, 400)
    assert err["param"] == "n" and "--max-waiting-requests" in err["message"]
    r = httpx.post(
        f"{trusting.url}/v1/completions",
        json={"prompt": ["a", "b"], "max_tokens": 2, "n": 2},
        headers=HEADERS,
    )
    assert _error(r, 400)["param"] == "n"
    ok = httpx.post(
        f"{trusting.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "n": 3},
        headers=HEADERS,
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


def test_no_path_reaches_a_client_or_a_metric_label(server, http):
    models = http.get("/v1/models").json()["data"]
    name = models[0]["id"]
    assert "/" not in name and models[0]["root"] == name
    r = http.post("/v1/completions", json={"model": "/etc/passwd", "prompt": "hi"})
    err = _error(r, 400)
    assert err["code"] == "model_not_found" and "/" not in err["message"].replace("/etc/passwd", "")
    text = httpx.get(f"{server.url}/metrics").text
    labels = [line for line in text.splitlines() if 'model_name="' in line]
    assert labels and all(f'model_name="{name}"' in line for line in labels)
