"""``moeserve router``: the real ``sglang-router`` in PD mode in front of moeserve instances.

    this process                               sglang-router (child, our process group)
      GET {url}/server_info of every worker,
      until 200 (bounded by wait_timeout_s);
      check each one's disaggregation_mode
      spawn ----------------------------------->  registers each worker (/health,
                                                  /server_info, /model_info)
      poll the router's GET /workers until
      every URL is listed, healthy, in its role
      log "router ready at ..."                   serves: each request goes to one prefill
                                                  and one decode worker at once
      SIGTERM/SIGINT: forward it, wait
      _STOP_WAIT_S, then SIGKILL                  drains, exits
      exit with its code

Torch-free and light (httpx and the standard library), so the command starts fast.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from moeserve.serving.auto_pd import AutoPD
from moeserve.serving.auto_pd_policy import AutoPDOptions
from moeserve.serving.supervisor import StopFlag, StopSignals, spawn, supervise, terminate

logger = logging.getLogger("moeserve.router")

ROUTER_REQUIREMENT = "sglang-router==0.3.2"
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
# our level names -> sglang-router's --log-level choices (debug, info, warn, error)
LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}

# The flags we pass to sglang-router and why (its defaults in parentheses). extra_args come
# after them on the command line, and the router's argparse keeps the last value of a flag,
# so a user's `-- --health-check-interval-secs 5` overrides ours.
# (30 s) the router polls a worker this often while it registers it; ours already answered
# /server_info when the router starts, so a second's wait is all registration should take
_STARTUP_CHECK_INTERVAL_S = 1
# (1800 s, for a model still loading) our discovery waited for the load already; this bounds
# the router's own registration of workers that are known to be up
_STARTUP_TIMEOUT_S = 60
# (60 s) with the default --health-failure-threshold 3, a worker that died was out of the
# rotation ~2.5 s after its death (measured with interval 1); a moeserve /health is cheap
# (it asks the engine nothing), so one GET per second and worker costs nothing
_HEALTH_CHECK_INTERVAL_S = 1
# (180 s) the router's own drain of running requests after a SIGTERM: shorter than our wait
# before SIGKILL, so that it finishes its drain rather than being killed in the middle
_SHUTDOWN_GRACE_S = 8
_STOP_WAIT_S = 10.0  # after forwarding SIGTERM/SIGINT, then SIGKILL
_REGISTER_WAIT_S = _STARTUP_TIMEOUT_S + 10.0  # for the router's GET /workers to list them all
_POLL_S = 0.25  # between two polls of a worker's /server_info or the router's /workers
_HTTP_TIMEOUT_S = 5.0  # one GET


@dataclass(frozen=True)
class RouterOptions:
    """What ``moeserve router`` runs. URLs are normalized (no trailing slash)."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    port: int
    host: str = "127.0.0.1"
    prometheus_port: int | None = None  # None: port + 1 (sglang-router's own 29000 collides)
    # None: the recommendation of sglang's docs for PD ("cache_aware for prefill,
    # power_of_two for decode"): a request whose prefix a prefill instance has seen lands
    # where that prefix's KV is cached; decode has no prefix to reuse (its KV arrives from
    # prefill), so it balances load: power_of_two picks the less loaded of two random
    # workers, by the router's own count of requests in flight when the workers publish no
    # load. sglang-router refuses power_of_two with fewer than 2 workers in a role, so a
    # single decode worker gets round_robin (the same thing with one worker).
    policy: str | None = None  # both roles, unless prefill_policy / decode_policy is given
    prefill_policy: str | None = None
    decode_policy: str | None = None
    request_timeout_s: int = 1800
    wait_timeout_s: float = 600.0
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()
    # adaptive P/D (auto_pd.py): None leaves every instance in its role
    auto_pd: AutoPDOptions | None = None

    def __post_init__(self) -> None:
        prefill = tuple(normalize_worker_url(u) for u in self.prefill_urls)
        decode = tuple(normalize_worker_url(u) for u in self.decode_urls)
        object.__setattr__(self, "prefill_urls", prefill)
        object.__setattr__(self, "decode_urls", decode)
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        for role, urls in (("prefill", prefill), ("decode", decode)):
            if not urls:
                raise ValueError(f"no --{role} URL given: the router needs at least one")
            for i, url in enumerate(urls):
                if url in urls[:i]:
                    raise ValueError(f"{url} is given twice as --{role}")
        for url in prefill:
            if url in decode:
                raise ValueError(
                    f"{url} is given both as --prefill and as --decode: an instance serves "
                    "one role (its --disaggregation-mode)"
                )
        if not self.host:
            raise ValueError("the router's --host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"the router's --port must be in [1, 65535], got {self.port}")
        if self.prometheus_port is None and self.port == 65535:
            raise ValueError("--port 65535 leaves no port + 1 for metrics: give --prometheus-port")
        if self.prometheus_port is not None and not 1 <= self.prometheus_port <= 65535:
            raise ValueError(f"--prometheus-port must be in [1, 65535], got {self.prometheus_port}")
        if self.metrics_port == self.port:
            raise ValueError(f"--prometheus-port {self.metrics_port} is the router's own --port")
        for flag, name in (
            ("--policy", self.policy),
            ("--prefill-policy", self.prefill_policy),
            ("--decode-policy", self.decode_policy),
        ):
            if name is not None and name not in POLICIES:
                raise ValueError(f"{flag} {name!r}: expected one of {', '.join(POLICIES)}")
        for role, name, urls in (
            ("prefill", self.prefill_policy_name, prefill),
            ("decode", self.decode_policy_name, decode),
        ):
            if name == "power_of_two" and len(urls) < 2:
                raise ValueError(f"power_of_two for {role} needs >= 2 {role} workers, got 1")
            if name == "power_of_two" and self.auto_pd is not None:
                raise ValueError(
                    f"power_of_two for {role} needs >= 2 {role} workers, and --auto-pd may "
                    "leave one: choose another policy"
                )
        if self.auto_pd is not None and len(prefill) + len(decode) < 3:
            raise ValueError(
                "--auto-pd needs at least 3 instances: with one per role there is none to move"
            )
        if self.request_timeout_s < 1:
            raise ValueError(f"the request timeout must be >= 1 s, got {self.request_timeout_s}")
        if self.wait_timeout_s <= 0:
            raise ValueError(f"--wait-timeout must be > 0 s, got {self.wait_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r}: expected one of {list(LOG_LEVELS)}")

    @property
    def metrics_port(self) -> int:
        return self.prometheus_port if self.prometheus_port is not None else self.port + 1

    @property
    def prefill_policy_name(self) -> str:
        return self.prefill_policy or self.policy or "cache_aware"

    @property
    def decode_policy_name(self) -> str:
        many = len(self.decode_urls) >= 2 and self.auto_pd is None
        default = "power_of_two" if many else "round_robin"
        return self.decode_policy or self.policy or default

    @property
    def url(self) -> str:
        return _http_url(self.host, self.port)

    @property
    def local_url(self) -> str:
        """Where this host reaches the router (a wildcard --host is not an address to call)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return _http_url(host, self.port)


def _http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def normalize_worker_url(url: str) -> str:
    """``http(s)://HOST:PORT`` without a trailing slash; ValueError naming anything else."""
    what = f"{url!r} is not a worker URL: expected http://HOST:PORT, e.g. http://127.0.0.1:8001"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{what} ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port:
        raise ValueError(what)
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{what} (nothing after the port)")
    return f"{parts.scheme}://{parts.netloc}"


def discover_workers(options: RouterOptions, stop: StopFlag | None = None) -> dict[str, int]:
    """Wait for every worker's ``GET /server_info`` (200) and check its role; returns each
    prefill URL's ``disaggregation_bootstrap_port``. One deadline, ``wait_timeout_s`` from now,
    bounds the whole wait. Raises ValueError naming a worker that never answered 200 (with its
    last answer), answered no JSON object, or serves another role; returns early, with what it
    has, when ``stop`` is set."""
    stop = stop or StopFlag()
    deadline = time.monotonic() + options.wait_timeout_s
    ports: dict[str, int] = {}
    roles = [(u, "prefill") for u in options.prefill_urls]
    roles += [(u, "decode") for u in options.decode_urls]
    with httpx.Client(timeout=_HTTP_TIMEOUT_S, trust_env=False) as client:
        for url, role in roles:
            info = _server_info(client, url, deadline, options.wait_timeout_s, stop)
            if info is None:
                return ports
            port = _check_role(url, role, info)
            if port is not None:
                ports[url] = port
    return ports


def _server_info(client, url: str, deadline: float, wait_s: float, stop: StopFlag):
    last = "nothing"
    while True:
        try:
            r = client.get(f"{url}/server_info")
            if r.status_code == 200:
                break
            last = f"HTTP {r.status_code} {r.text[:200]!r}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if time.monotonic() >= deadline:
            raise ValueError(
                f"{url} did not answer GET /server_info with 200 within {wait_s:g} s "
                f"(--wait-timeout); its last answer: {last}"
            )
        if stop.sleep(_POLL_S):
            return None
    try:
        info = r.json()
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise ValueError(f"{url}/server_info answered no JSON object: {r.text[:200]!r}")
    return info


def _check_role(url: str, role: str, info: dict) -> int | None:
    mode = info.get("disaggregation_mode")
    if mode is None:
        raise ValueError(
            f"{url}/server_info has no disaggregation_mode: is it a moeserve server started "
            f"with --disaggregation-mode {role}?"
        )
    if mode != role:
        raise ValueError(
            f"{url} serves as {mode!r}, not as a {role} instance: start it with "
            f"--disaggregation-mode {role}"
        )
    if role == "decode":
        return None
    port = info.get("disaggregation_bootstrap_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(
            f"{url} serves as 'prefill' but its /server_info gives no valid "
            f"disaggregation_bootstrap_port (got {port!r})"
        )
    return port


def find_router_binary() -> str:
    """``sglang-router`` next to this Python first (a venv that is not activated), then PATH."""
    found = shutil.which("sglang-router", path=str(Path(sys.executable).parent))
    found = found or shutil.which("sglang-router")
    if found is None:
        raise FileNotFoundError(
            f"sglang-router not found next to {sys.executable} or on PATH: "
            f"pip install {ROUTER_REQUIREMENT}"
        )
    return found


def router_argv(options: RouterOptions, bootstrap_ports: Mapping[str, int]) -> list[str]:
    """The sglang-router command line for ``options``; ``bootstrap_ports`` maps each prefill
    URL to the bootstrap port it announced (:func:`discover_workers`)."""
    argv = [find_router_binary(), "launch", "--pd-disaggregation"]
    for url in options.prefill_urls:
        if url not in bootstrap_ports:
            raise ValueError(f"no bootstrap port known for the prefill instance {url}")
        argv += ["--prefill", url, str(bootstrap_ports[url])]
    for url in options.decode_urls:
        argv += ["--decode", url]
    argv += [
        "--host", options.host,
        "--port", str(options.port),
        # its default 0.0.0.0 would publish the metrics of a router that listens on loopback
        "--prometheus-host", options.host,
        "--prometheus-port", str(options.metrics_port),
        "--prefill-policy", options.prefill_policy_name,
        "--decode-policy", options.decode_policy_name,
        "--request-timeout-secs", str(options.request_timeout_s),
        "--worker-startup-check-interval", str(_STARTUP_CHECK_INTERVAL_S),
        "--worker-startup-timeout-secs", str(_STARTUP_TIMEOUT_S),
        "--health-check-interval-secs", str(_HEALTH_CHECK_INTERVAL_S),
        "--shutdown-grace-period-secs", str(_SHUTDOWN_GRACE_S),
        "--log-level", LOG_LEVELS[options.log_level],
    ]  # fmt: skip
    return argv + list(options.extra_args)


def run_router(options: RouterOptions) -> int:
    """Discover the workers, start sglang-router, wait until it lists them all, then until it
    exits. Returns its exit code (128 + N if signal N ended it); a router that exits when we
    did not ask for it gives at least 1. SIGTERM/SIGINT are forwarded to it, SIGKILL follows
    after ``_STOP_WAIT_S``. Raises ValueError for a port in use or a worker that is missing or
    in the wrong role, RuntimeError if the router never lists the workers."""
    for port in (options.port, options.metrics_port):
        _check_port_free(options.host, port)
    find_router_binary()  # fail before a long discovery, not after it
    with StopSignals(StopFlag()) as stop:
        logger.info(
            "waiting up to %g s for GET /server_info of %s",
            options.wait_timeout_s,
            ", ".join(options.prefill_urls + options.decode_urls),
        )
        ports = discover_workers(options, stop)
        if stop.signum is not None:
            return 0
        argv = router_argv(options, ports)
        child = spawn(argv)
        logger.info("started sglang-router (pid %d): %s", child.pid, " ".join(argv))
        controller = None
        try:
            if _wait_registered(options, child, stop):
                logger.info(
                    "router ready at %s: prefill %s decode %s",
                    options.url,
                    list(options.prefill_urls),
                    list(options.decode_urls),
                )
                if options.auto_pd is not None:
                    controller = AutoPD(options.local_url, options.auto_pd, stop)
                    controller.start()
            code = supervise(child, stop, _STOP_WAIT_S)
        except BaseException:
            terminate(child, _STOP_WAIT_S)
            raise
        finally:
            if controller is not None:
                controller.close(_STOP_WAIT_S)  # the router is gone: nothing left to steer
    if stop.signum is None:
        logger.error("sglang-router exited with code %d", code)
        return code or 1
    return code


def _check_port_free(host: str, port: int) -> None:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's listener
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _wait_registered(options: RouterOptions, child: subprocess.Popen, stop: StopFlag) -> bool:
    """Until the router's GET /workers lists every URL as healthy, in its role (its /health
    answers 200 before any worker is registered, and its /readiness stays 200 with a worker
    missing). False if a stop was asked for first or the router exited; RuntimeError if the wait
    passes ``_REGISTER_WAIT_S``."""
    want = {u: "prefill" for u in options.prefill_urls}
    want.update({u: "decode" for u in options.decode_urls})
    deadline = time.monotonic() + _REGISTER_WAIT_S
    missing = sorted(want)
    with httpx.Client(timeout=_HTTP_TIMEOUT_S, trust_env=False) as client:
        while True:
            if child.poll() is not None:
                logger.error("sglang-router exited before it listed the workers (see its log)")
                return False
            try:
                listed = client.get(f"{options.local_url}/workers").json().get("workers", [])
                got = {
                    w.get("url", "").rstrip("/"): w.get("worker_type")
                    for w in listed
                    if w.get("is_healthy")
                }
                missing = sorted(u for u, role in want.items() if got.get(u) != role)
                if not missing:
                    return True
            except (httpx.HTTPError, ValueError, AttributeError):
                pass  # not listening yet, or not the answer we expect yet
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"sglang-router did not list {', '.join(missing)} as healthy workers "
                    f"within {_REGISTER_WAIT_S:g} s (GET {options.local_url}/workers)"
                )
            if stop.sleep(_POLL_S):
                return False
