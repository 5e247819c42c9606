"""A client that leaves frees its request's KV blocks at once; SIGTERM drains the server and
leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.e2e.server import API_KEY, start_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _wait_idle(http, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/debug/engine").json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def _generated(server) -> float:
    """Tokens the server has generated so far (its /metrics counter)."""
    from tests.e2e.test_metrics import _scrape

    return _scrape(server.url)[("moeserve:generation_tokens_total", ())]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disconnect_mid_stream_frees_blocks(server, http, endpoint):
    before = _generated(server)
    body = {"max_tokens": 1500, "stream": True, "ignore_eos": True}
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "go"}]
    else:
        path, body["prompt"] = "/v1/completions", "go on and on"
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            running = http.get("/debug/engine").json()
            assert running["num_running"] == 1
            assert running["num_free_blocks"] < running["num_blocks"]
        # leaving the block closes the connection
    t0 = time.monotonic()
    stats = _wait_idle(http)
    took = time.monotonic() - t0
    assert stats["integrity"] == "ok"
    assert stats["kv_cache_usage"] == 0.0
    assert took < 2.0
    assert _generated(server) - before < 1500  # stopped, not run to its end


def test_disconnect_without_streaming_aborts(server, http):
    """A client that gives up on a request it does not stream: the engine stops the request
    (fewer tokens generated than asked for) and frees its blocks. The timeout is far below
    the 2000 decode steps the request asks for, however fast the engine."""
    before = _generated(server)
    body = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.v1}/completions", json=body, headers=HEADERS, timeout=0.3)
    stats = _wait_idle(http)
    assert stats["integrity"] == "ok"
    assert stats["kv_cache_usage"] == 0.0
    assert _generated(server) - before < 2000


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def test_sigterm_lets_running_requests_finish():
    # a timeout far above the request's time: 1900 tokens take ~30 s on a busy 2-core host
    srv = start_server("--shutdown-timeout", "150")
    pids = srv.engine_pids()
    assert pids
    result = {}

    def run():
        r = httpx.post(
            f"{srv.v1}/completions",
            json={"prompt": "hi", "max_tokens": 1900, "ignore_eos": True},
            timeout=180,
        )
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)  # the request is running (1900 tokens: seconds, also on a fast host)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # the port stays open while draining: new requests learn why they are refused
    r = httpx.post(f"{srv.v1}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "shutting down" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/health").status_code == 503
    t.join(180)
    assert srv.stop(timeout=180) == 0, srv.text()
    assert not _port_open(srv.url)
    assert result["status"] == 200
    assert result["body"]["usage"]["completion_tokens"] == 1900
    assert not srv.engine_pids()


def test_sigterm_ends_long_streams_with_an_error_event():
    srv = start_server("--shutdown-timeout", "1")
    events = []
    with httpx.Client(timeout=60) as c:
        body = {"prompt": "hi", "max_tokens": 1900, "stream": True, "ignore_eos": True}
        with c.stream("POST", f"{srv.v1}/completions", json=body) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    srv.proc.send_signal(signal.SIGTERM)
    assert srv.stop() == 0, srv.text()
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "shut down" in err["message"] and err["code"] == "unavailable"
    assert 3 < len(events) < 1900
    assert not srv.engine_pids()


def test_engine_death_fails_requests_and_stops_the_server():
    srv = start_server()
    engine_pid = srv.engine_pids()[0]
    result = {}

    def run():
        with httpx.Client(timeout=60) as c:
            body = {"prompt": "hi", "max_tokens": 1900, "stream": True, "ignore_eos": True}
            with c.stream("POST", f"{srv.v1}/completions", json=body) as r:
                result["events"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    os.kill(engine_pid, signal.SIGKILL)
    t.join(60)
    # for a moment the port still answers, with a 503 that says what happened
    r = httpx.post(f"{srv.v1}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "engine has failed" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{srv.url}/health").status_code == 503
    code = srv.proc.wait(60)
    assert code == 1, srv.text()
    events = result["events"]
    assert events[-1] == "data: [DONE]"
    assert "engine" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    assert not srv.engine_pids()


def test_a_client_that_does_not_read_never_stalls_the_engine(server, http, client, model):
    """A streams 1500 tokens to a client that reads nothing; meanwhile B completes, and the
    engine keeps producing A's tokens (they queue in the API server, not in the engine): A is
    still running a second later, or has finished and its whole stream is there to read."""
    body = {"prompt": "slow reader", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200  # headers only; the body is never read
            before = _generated(server)
            b = client.completions.create(
                model=model, prompt="fast reader", max_tokens=40, extra_body={"ignore_eos": True}
            )
            assert b.usage.completion_tokens == 40
            time.sleep(1.0)
            assert _generated(server) - before > 40 + 20  # A kept generating while unread
            running = http.get("/debug/engine").json()["num_running"]
            if running == 0:
                # a fast engine (the decode stack) has produced all of A already: its whole
                # stream waits in the API server, to its end
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                last = json.loads(events[-2].removeprefix("data: "))
                assert last["choices"][0]["finish_reason"] == "length", last
            else:
                assert running == 1
    _wait_idle(http)
