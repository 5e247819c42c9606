"""The hostile-client probe of issue 20, kept as a fuzz target (slow suite): schemathesis over
the schema, generated chat templates, and hand-written bodies (templates that loop, overflow
or recurse; JSON nested deep; fields of megabytes) against a server that trusts request
templates. No answer may be a 5xx, and ``/health``, polled by a concurrent client the whole
time, must stay fast."""

from __future__ import annotations

import json

import httpx
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from tests.e2e.server import API_KEY, RunningServer, start_server
from tests.e2e.test_fuzz import FUZZ, POSTS, _cap, _check
from tests.e2e.test_hardening import HOSTILE_TEMPLATES, LOOPS, HealthProbe

pytestmark = pytest.mark.slow
schemathesis = pytest.importorskip("schemathesis")

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
HI = [{"role": "user", "content": "hi"}]
MB = 1 << 20


def _chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 2, **fields}


def _deep(depth: int, inner: str = "[]") -> str:
    return "[" * depth + inner + "]" * depth


def hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(label, path, raw body)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    out: list[tuple[str, str, object]] = [
        (
            "loops (issue 20's 229 bytes)",
            chat,
            _chat(chat_template_kwargs={"chat_template": LOOPS}),
        ),
        ("template output 9.6 MB", chat, _chat(chat_template="{{ 'hello world ' * 800000 }}")),
        ("template text 7.2 MB", chat, _chat(chat_template="hello world " * 600_000)),
        ("prompt 7.2 MB", comp, {"prompt": "hello world " * 600_000, "max_tokens": 1}),
        ("message 7.2 MB", chat, {"messages": [{"role": "user", "content": "ab " * 2_400_000}]}),
        ("100k messages", chat, {"messages": HI * 100_000, "max_tokens": 1}),
        ("1M token ids", comp, {"prompt": [1] * 1_000_000, "max_tokens": 1}),
        ("10k stop strings", comp, {"prompt": "hi", "max_tokens": 8, "stop": ["zz"] * 10_000}),
        (
            "100k logit_bias",
            comp,
            {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(100_000)}},
        ),
        ("n=128", comp, {"prompt": "hi", "max_tokens": 1, "n": 128}),
        ("max_tokens 2**62", comp, {"prompt": "hi", "max_tokens": 2**62}),
        ("model name 1 MB", comp, {"prompt": "hi", "model": "m" * MB}),
        ("kwargs clash", chat, _chat(chat_template_kwargs={"messages": [], "tools": 3})),
        ("kwargs agp", chat, _chat(chat_template_kwargs={"add_generation_prompt": "x"})),
        ("surrogate template", chat, _chat(chat_template="\ud800{{ messages }}")),
        ("surrogate content", chat, {"messages": [{"role": "user", "content": "\udfff"}]}),
        (
            "nul bytes",
            chat,
            {"messages": [{"role": "user", "content": "\x00" * 1000}], "max_tokens": 2},
        ),
    ]
    out += [(f"template: {k}", chat, _chat(chat_template=v)) for k, v in HOSTILE_TEMPLATES.items()]
    raw = [(label, path, json.dumps(body).encode()) for label, path, body in out]
    head = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    for depth in (70, 500, 100_000, 3_000_000):
        raw.append(
            (
                f"kwargs {depth} deep",
                chat,
                head + b'"chat_template_kwargs": {"x": ' + _deep(depth).encode() + b"}}",
            )
        )
    raw += [
        ("tools 500 deep", chat, head + b'"tools": [' + _deep(500, "{}").encode() + b"]}"),
        (
            "content parts 500 deep",
            chat,
            b'{"messages": [{"role": "user", "content": ' + _deep(500).encode() + b"}]}",
        ),
        (
            "brackets in strings",
            chat,
            head + b'"chat_template_kwargs": {"x": "' + b"[{" * MB + b'"}}',
        ),
        ("escaped quotes", chat, head + b'"chat_template_kwargs": {"x": "' + b'\\"[' * MB + b'"}}'),
        ("bad utf-8, deep", comp, b'{"prompt": "\xff\xfe' + b"[" * 10_000 + b'"}'),
        ("9 MB body", comp, b'{"prompt": "' + b"x" * (9 * MB) + b'"}'),
    ]
    return raw


def _assert_no_server_error(r: requests.Response, label: str) -> None:
    """test_fuzz's check, and an error stays short and free of tracebacks."""
    _check(r, label)
    if r.status_code >= 400:
        assert "Traceback" not in r.text, label
        assert len(r.text) < 10_000, f"{label}: a {len(r.text)}-byte error"


@pytest.fixture(scope="module")
def hostile_server() -> RunningServer:
    srv = start_server(
        "--api-key", API_KEY, "--trust-request-chat-template", "--max-waiting-requests", "64"
    )
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def probe(hostile_server):
    p = HealthProbe(hostile_server.url)
    p.start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        s.headers.update(HEADERS)
        yield s


def test_hand_written_hostile_bodies(hostile_server, probe, session):
    statuses = {}
    for label, path, body in hostile_bodies():
        r = session.post(f"{hostile_server.url}{path}", data=body, timeout=120)
        statuses[label] = r.status_code
        _assert_no_server_error(r, label)
    assert statuses["9 MB body"] == 413
    assert statuses["kwargs 3000000 deep"] == 400 and statuses["tools 500 deep"] == 400
    assert statuses["brackets in strings"] == 200 and statuses["escaped quotes"] == 200
    assert statuses["n=128"] == 400  # more than the queue can hold: a 400, not a 503
    assert statuses["prompt 7.2 MB"] == 400  # longer than the context
    assert statuses["10k stop strings"] == 200
    assert probe.codes == {200} and probe.slowest < 1.0, (probe.slowest, statuses)


_FRAGMENTS = st.sampled_from(
    [
        "{{ messages }}",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{{ 'x' * %d }}",
        "{{ range(%d)|list|length }}",
        "{{ (%d)|string|center(%d) }}",
        "{{ %d / (%d - %d) }}",
        "{% for i in range(%d) %}{% for j in range(%d) %}{% endfor %}{% endfor %}",
        "{% macro r(n) %}{{ r(n + %d) }}{% endmacro %}{{ r(0) }}",
        "{{ raise_exception('no') }}",
        "{{ messages[%d] }}",
        "{{ namespace(_x=%d) }}",
        "{{ ''.__class__ }}",
        "{{ %d|int|abs|float|round }}",
        "{% set ns = namespace(a=%d) %}{{ ns.a ** %d }}",
        "{{ 'a'|truncate(%d)|wordwrap(%d) }}",
        "{{ [1,2]|batch(%d)|list }}",
        "{% if %d %}{{ bos_token }}{% endif %}",
        "{{ x",
        "{% endfor %}",
    ]
)


@st.composite
def templates(draw) -> str:
    parts = []
    for fragment in draw(st.lists(_FRAGMENTS, min_size=1, max_size=4)):
        while "%d" in fragment:
            n = draw(st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63), st.just(10**6)))
            fragment = fragment.replace("%d", str(n), 1)
        parts.append(fragment)
    return "".join(parts)


def test_generated_templates(hostile_server, probe, session):
    @FUZZ
    @given(template=templates())
    def run(template):
        r = session.post(
            f"{hostile_server.url}/v1/chat/completions",
            data=json.dumps(_chat(chat_template=template)),
            timeout=60,
        )
        _assert_no_server_error(r, template)

    run()
    assert probe.codes == {200} and probe.slowest < 1.0, probe.slowest


def _fuzz_one(url: str, session, operation, mode: str, path: str) -> None:
    strategy = operation.as_strategy(schemathesis.GenerationMode(mode))

    @FUZZ
    @given(case=strategy)
    def run(case):
        if mode == "positive":
            case.body = _cap(case.body)
        response = case.call(base_url=url, session=session, timeout=60)
        _check(response, f"{mode} {path} {case.body!r:.300}")

    run()


@pytest.mark.parametrize("mode", ["negative", "positive"])
def test_schema_fuzz_with_the_probe(hostile_server, probe, session, mode):
    schema = schemathesis.openapi.from_dict(
        httpx.get(f"{hostile_server.url}/openapi.json", headers=HEADERS).json()
    )
    for path in POSTS:
        _fuzz_one(hostile_server.url, session, schema[path]["POST"], mode, path)
    assert probe.codes == {200} and probe.slowest < 1.0, probe.slowest
    assert httpx.get(f"{hostile_server.url}/health").status_code == 200
    assert "Traceback" not in hostile_server.text()
