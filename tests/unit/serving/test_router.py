"""``moeserve router``: its options, the sglang-router command line, the discovery of the
workers, and one run of the real sglang-router in front of two stand-in workers.

The stand-ins are tiny ``http.server`` threads that answer what a moeserve instance started
with ``--disaggregation-mode`` answers the router (/server_info, /health, /model_info and a
completion); they exist only for this test."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from moeserve.serving import router as router_mod
from moeserve.serving.router import (
    RouterOptions,
    discover_workers,
    find_router_binary,
    normalize_worker_url,
    router_argv,
)
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    """A stand-in instance on 127.0.0.1: ``info`` is its /server_info (``status`` its code),
    ``answer`` what a POST gets; ``posts`` records (path, body) of each POST."""

    def __init__(self, info, status: int = 200, answer: dict | None = None):
        self.info, self.status, self.answer = info, status, answer or {}
        self.posts: list[tuple[str, dict]] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, body) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/server_info":
                    self._send(worker.status, worker.info)
                elif self.path == "/model_info":
                    self._send(200, {"model_path": "demo", "is_generation": True})
                elif self.path == "/health":
                    self._send(200, b"")
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                worker.posts.append((self.path, json.loads(body)))
                self._send(200, worker.answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> _Worker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _prefill(port: int, **kw) -> _Worker:
    return _Worker({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": port}, **kw)


def _decode(**kw) -> _Worker:
    return _Worker({"disaggregation_mode": "decode"}, **kw)


def _options(prefill=("http://127.0.0.1:8001",), decode=("http://127.0.0.1:8002",), **kw):
    return RouterOptions(prefill_urls=tuple(prefill), decode_urls=tuple(decode), **kw)


# --- options and the command line ---------------------------------------------------------


def test_router_argv_is_the_whole_sglang_router_command_line():
    options = _options(
        prefill=("http://10.0.0.1:8001/", "http://10.0.0.2:8001"),
        decode=("http://10.0.0.3:8002", "http://10.0.0.4:8002"),
        port=30000,
        request_timeout_s=600,
        log_level="warning",
        extra_args=("--retry-max-retries", "2"),
    )
    ports = {"http://10.0.0.1:8001": 8998, "http://10.0.0.2:8001": 8999}
    assert router_argv(options, ports) == [
        find_router_binary(), "launch", "--pd-disaggregation",
        "--prefill", "http://10.0.0.1:8001", "8998",
        "--prefill", "http://10.0.0.2:8001", "8999",
        "--decode", "http://10.0.0.3:8002",
        "--decode", "http://10.0.0.4:8002",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", "30001",
        "--prefill-policy", "cache_aware",
        "--decode-policy", "power_of_two",
        "--request-timeout-secs", "600",
        "--worker-startup-check-interval", "1",
        "--worker-startup-timeout-secs", "60",
        "--health-check-interval-secs", "1",
        "--shutdown-grace-period-secs", "8",
        "--log-level", "warn",
        "--retry-max-retries", "2",
    ]  # fmt: skip


def test_policies_and_ports_resolve_as_documented():
    one = _options(port=9000)
    assert (one.prefill_policy_name, one.decode_policy_name) == ("cache_aware", "round_robin")
    assert one.metrics_port == 9001
    both = _options(port=9000, policy="random", decode_policy="round_robin", prometheus_port=1)
    assert (both.prefill_policy_name, both.decode_policy_name) == ("random", "round_robin")
    assert both.metrics_port == 1
    assert _options(port=9000, host="::").local_url == "http://[::1]:9000"
    assert _options(port=9000, host="0.0.0.0").local_url == "http://127.0.0.1:9000"
    with pytest.raises(ValueError, match="no bootstrap port known for .*127.0.0.1:8001"):
        router_argv(one, {})


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(prefill=()), "no --prefill URL given"),
        (dict(decode=()), "no --decode URL given"),
        (dict(prefill=("http://h:1", "http://h:1/")), "http://h:1 is given twice as --prefill"),
        (dict(decode=("http://h:2", "http://h:2")), "http://h:2 is given twice as --decode"),
        (dict(prefill=("http://h:1",), decode=("http://h:1",)), "both as --prefill and as"),
        (dict(prefill=("h:8001",)), "'h:8001' is not a worker URL"),
        (dict(prefill=("ftp://h:8001",)), "'ftp://h:8001' is not a worker URL"),
        (dict(prefill=("http://h",)), "'http://h' is not a worker URL"),
        (dict(decode=("http://h:80/v1",)), "'http://h:80/v1' is not a worker URL"),
        (dict(decode=("http://h:80?x=1",)), "'http://h:80\\?x=1' is not a worker URL"),
        (dict(decode=("http://h:99999",)), "'http://h:99999' is not a worker URL"),
        (dict(decode=("http://h:0",)), "'http://h:0' is not a worker URL"),
        (dict(port=0), "--port must be in \\[1, 65535\\], got 0"),
        (dict(port=70000), "--port must be in \\[1, 65535\\], got 70000"),
        (dict(port=65535), "give --prometheus-port"),
        (dict(prometheus_port=9000), "--prometheus-port 9000 is the router's own --port"),
        (dict(prometheus_port=0), "--prometheus-port must be in"),
        (dict(host=""), "--host must not be empty"),
        (dict(policy="least_load"), "--policy 'least_load': expected one of random"),
        (dict(prefill_policy="manual"), "--prefill-policy 'manual'"),
        (dict(decode_policy="power_of_two"), "power_of_two for decode needs >= 2"),
        (dict(policy="power_of_two"), "power_of_two for prefill needs >= 2"),
        (dict(request_timeout_s=0), "request timeout must be >= 1"),
        (dict(wait_timeout_s=0), "--wait-timeout must be > 0"),
        (dict(log_level="trace"), "--log-level 'trace'"),
    ],
)
def test_each_bad_option_is_a_value_error_naming_it(kw, message):
    kw.setdefault("port", 9000)
    with pytest.raises(ValueError, match=message):
        _options(**kw)


def test_normalize_worker_url_keeps_scheme_host_and_port():
    assert normalize_worker_url(" https://[::1]:8443/ ") == "https://[::1]:8443"
    assert normalize_worker_url("http://node-3:8001") == "http://node-3:8001"


def test_the_binary_is_looked_for_next_to_python_first_then_named_for_install(
    tmp_path, monkeypatch
):
    fake = tmp_path / "sglang-router"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert find_router_binary() == str(fake)
    fake.unlink()
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install sglang-router==0.3.2"):
        find_router_binary()


def test_the_cli_passes_what_follows_dashdash_to_the_router():
    from moeserve.cli import build_parser, main

    args = build_parser().parse_args(
        "router --prefill http://a:1 http://b:1 --decode http://c:2 --port 5 -- --x 7".split()
    )
    assert args.prefill == ["http://a:1", "http://b:1"]
    assert (args.decode, args.port) == (["http://c:2"], 5)
    assert args.router_args == ["--x", "7"]
    assert main("router --prefill a:1 --decode http://c:2 --port 5".split()) == 2


# --- discovery -------------------------------------------------------------------------------


def test_discovery_returns_each_prefill_bootstrap_port():
    with _prefill(9101) as p1, _prefill(9102) as p2, _decode() as d:
        ports = discover_workers(_options((p1.url + "/", p2.url), (d.url,), port=9000))
    assert ports == {p1.url: 9101, p2.url: 9102}


def test_discovery_waits_for_a_worker_that_is_still_loading():
    with _prefill(9101, status=503) as p, _decode() as d:
        threading.Timer(0.6, lambda: setattr(p, "status", 200)).start()
        t0 = time.monotonic()
        assert discover_workers(_options((p.url,), (d.url,), port=9000)) == {p.url: 9101}
        assert time.monotonic() - t0 >= 0.5


def test_a_worker_in_the_other_role_is_named_with_its_mode():
    with _decode() as d, _decode() as d2:
        with pytest.raises(ValueError) as e:
            discover_workers(_options((d.url,), (d2.url,), port=9000))
    assert str(e.value) == (
        f"{d.url} serves as 'decode', not as a prefill instance: start it with "
        "--disaggregation-mode prefill"
    )
    with _prefill(9101) as p, _Worker({"disaggregation_mode": "null"}) as n:
        with pytest.raises(ValueError, match=f"{n.url} serves as 'null', not as a decode"):
            discover_workers(_options((p.url,), (n.url,), port=9000))


@pytest.mark.parametrize(
    "info, message",
    [
        ({"disaggregation_mode": "prefill"}, "gives no valid disaggregation_bootstrap_port"),
        (
            {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": "8998"},
            "got '8998'",
        ),
        ({"model_path": "x"}, "has no disaggregation_mode"),
        (b"<html>", "answered no JSON object"),
    ],
)
def test_a_prefill_worker_without_a_usable_server_info_is_named(info, message):
    with _Worker(info) as p, _decode() as d:
        with pytest.raises(ValueError, match=message) as e:
            discover_workers(_options((p.url,), (d.url,), port=9000))
    assert p.url in str(e.value)


def test_a_worker_that_never_answers_200_is_named_with_its_last_answer():
    with _prefill(9101) as p, _decode(status=503) as d:
        with pytest.raises(ValueError) as e:
            discover_workers(_options((p.url,), (d.url,), port=9000, wait_timeout_s=0.8))
    assert f"{d.url} did not answer GET /server_info with 200 within 0.8 s" in str(e.value)
    assert "HTTP 503" in str(e.value)
    closed = f"http://127.0.0.1:{_free_port()}"
    with _decode() as d:
        with pytest.raises(ValueError, match=f"{closed} did not answer .*ConnectError"):
            discover_workers(_options((closed,), (d.url,), port=9000, wait_timeout_s=0.5))


# --- the real sglang-router ------------------------------------------------------------------


class _RouterProcess:
    """``python -m moeserve.cli router ...`` with its stderr read line by line."""

    def __init__(self, *args: str):
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moeserve.cli", "router", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.log)
                continue
            self.log.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} within {timeout} s:\n{''.join(self.log)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pid_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _start(p: _Worker, d: _Worker) -> tuple[_RouterProcess, int, int]:
    port = free_port(span=2)  # the router's, and + 1 for its metrics
    r = _RouterProcess("--prefill", p.url, "--decode", d.url, "--port", str(port))
    started = r.wait_for("started sglang-router (pid ", timeout=15)
    child = int(started.split("(pid ")[1].split(")")[0])
    r.wait_for("router ready at", timeout=15)
    return r, port, child


def test_the_real_router_sends_each_request_to_both_and_returns_decodes_answer():
    decode_answer = {"id": "cmpl-d", "object": "text_completion", "choices": [{"text": "D"}]}
    with _prefill(9199, answer={"id": "cmpl-p"}) as p, _decode(answer=decode_answer) as d:
        r, port, child = _start(p, d)
        try:
            body = {"model": "demo", "prompt": "hello", "max_tokens": 4}
            got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
            assert got.status_code == 200 and got.json() == decode_answer
            [(p_path, p_body)], [(d_path, d_body)] = p.posts, d.posts
            assert p_path == d_path == "/v1/completions"
            assert p_body["bootstrap_host"] == "127.0.0.1"
            assert p_body["bootstrap_port"] == 9199  # what its /server_info announced
            assert isinstance(p_body["bootstrap_room"], int)
            assert d_body["bootstrap_room"] == p_body["bootstrap_room"]
            assert p_body["prompt"] == "hello" and d_body["max_tokens"] == 4

            t0 = time.monotonic()
            r.proc.send_signal(signal.SIGTERM)
            assert r.proc.wait(timeout=15) == 0
            assert _pid_gone(child, 15 - (time.monotonic() - t0)), "sglang-router outlived us"
        finally:
            r.kill()


def test_a_router_that_dies_ends_the_command_with_its_code():
    with _prefill(9198) as p, _decode() as d:
        r, _, child = _start(p, d)
        try:
            os.kill(child, signal.SIGKILL)
            assert r.proc.wait(timeout=15) == 128 + signal.SIGKILL
            r.wait_for("sglang-router exited with code 137", timeout=5)
        finally:
            r.kill()


def test_a_signal_during_discovery_ends_the_command_at_once():
    closed = f"http://127.0.0.1:{_free_port()}"
    with _prefill(9197) as p:
        port = free_port(span=2)
        r = _RouterProcess("--prefill", p.url, "--decode", closed, "--port", str(port))
        try:
            r.wait_for("waiting up to 600 s for GET /server_info", timeout=15)
            r.proc.send_signal(signal.SIGTERM)
            assert r.proc.wait(timeout=5) == 0
        finally:
            r.kill()


def test_a_busy_port_or_an_unknown_host_fails_before_discovery():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: Address"):
            router_mod.run_router(_options(port=port))
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: Address"):
            router_mod.run_router(_options(port=free_port(), prometheus_port=port))
    with pytest.raises(ValueError, match="cannot listen on no-such-host.invalid:"):
        router_mod.run_router(_options(port=9000, host="no-such-host.invalid"))


def test_the_module_stays_light():
    code = "import sys, moeserve.serving.router; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr
    assert router_mod.ROUTER_REQUIREMENT == "sglang-router==0.3.2"
