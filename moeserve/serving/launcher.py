"""``moeserve serve``: bind the port, start the engine process, serve HTTP until a signal.

    this process (API server)              engine process (+ its ranks)
      bind host:port (fails fast)
      spawn ------------------------------>  load the model, start the ranks
      wait for Ready  <--------------------  Ready
      uvicorn serves ...                     steps
      SIGTERM/SIGINT: answer new requests 503 (the port stays open), let running requests
      finish for --shutdown-timeout, end the rest with an error event, close the port,
      then Shutdown ------------------------>  stop the ranks, exit 0
      exit 0 (1 if the engine failed)

A second SIGINT forces the exit. If the engine dies while serving, waiting requests get an
error at once, new ones a 503 naming the failure for ``_FAILED_LINGER_S`` (so that a client
or a load balancer learns why, rather than meeting a closed port), and the server exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from moeserve.config import EngineConfig
from moeserve.serving.api_server import build_app
from moeserve.serving.client import EngineClient, EngineDeadError
from moeserve.serving.guard import DEFAULT_MAX_BODY_BYTES
from moeserve.serving.messages import Ready
from moeserve.serving.metrics import ServerMetrics
from moeserve.serving.prompts import PromptWorkers
from moeserve.serving.reasoning import PARSERS as REASONING_PARSERS
from moeserve.serving.sampling import ModelDefaults
from moeserve.serving.state import ServerState
from moeserve.serving.tool_parsers import PARSERS as TOOL_PARSERS
from moeserve.tokenizer import Tokenizer

logger = logging.getLogger("moeserve.serve")

_FAILED_LINGER_S = 2.0  # after an engine failure, how long new requests still get a 503
_ENGINE_STOP_S = 15.0  # beyond the shutdown timeout: the engine's own stop after a SIGTERM


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    shutdown_timeout_s: float = 30.0
    debug_endpoints: bool = False
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None  # serving/reasoning.py: deepseek_r1 | qwen3
    tool_call_parser: str | None = None  # serving/tool_parsers: deepseek_v3 | ... | hermes
    enable_auto_tool_choice: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"the request body limit must be >= 1 byte, got {self.max_request_body_bytes}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}; choose "
                f"{', '.join(TOOL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; choose "
                f"{', '.join(REASONING_PARSERS)}"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`serve` installs handlers that drain
    the engine's requests before the server stops (uvicorn's would re-raise the signal)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections whose proto says TCP, and
    # without it a response written in two parts waits ~40 ms for the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code."""
    tokenizer = Tokenizer.from_dir(config.model)  # the API server tokenizes
    sock = bind(options.host, options.port)
    with tempfile.TemporaryDirectory(prefix="moeserve-ipc-") as ipc_dir:
        return asyncio.run(_serve(config, options, tokenizer, sock, Path(ipc_dir)))


async def _serve(
    config: EngineConfig,
    options: ServeOptions,
    tokenizer: Tokenizer,
    sock: socket.socket,
    ipc_dir: Path,
) -> int:
    client = EngineClient.spawn(
        dataclasses.asdict(config),
        ipc_dir,
        api_url=_public_url(sock, config),
        term_grace_s=options.shutdown_timeout_s + _ENGINE_STOP_S,
    )
    if config.disaggregation_mode != "null":  # a router waits on us: answer even when stuck
        client.stall_timeout_s = config.disaggregation_transfer_timeout_s
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        ready = await _wait_ready(client, stop)
    except EngineDeadError as e:
        logger.error("the engine failed to start: %s", e)
        await client.shutdown(timeout=5)
        return 1
    if ready is None:  # a signal while loading: the engine reads no message until it is up
        client.proc.terminate()
        await client.shutdown(timeout=10)
        return 0

    state = _server_state(config, options, tokenizer, client, ready)
    names = state.model_names
    # what start-up built lives as long as the process: out of the collector's way, so that
    # a full collection during a large request walks only that request's objects
    gc.freeze()
    server = _Server(
        uvicorn.Config(
            build_app(state),
            log_level=options.log_level,
            timeout_graceful_shutdown=options.shutdown_timeout_s + 5,
            lifespan="off",
        )
    )
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    logger.info(
        "serving %s (%s, max_model_len %d, %d rank(s) on %d node(s)) on http://%s:%d",
        names[0],
        ready.architecture,
        ready.max_model_len,
        ready.world_size,
        ready.nnodes,
        host,
        port,
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    watch = asyncio.create_task(_until_stop_or_engine_death(client, stop))
    done, _ = await asyncio.wait({serving, watch}, return_when=asyncio.FIRST_COMPLETED)
    if watch in done:
        # new requests get 503 with the port still open; running requests finish, up to the
        # timeout; a second SIGINT cuts it short
        state.draining = True
        force = asyncio.Event()
        loop.remove_signal_handler(signal.SIGINT)
        loop.add_signal_handler(signal.SIGINT, force.set)
        await _drain(client, options.shutdown_timeout_s, force)
        server.should_exit = True
        server.force_exit = force.is_set()
        await serving
    else:
        watch.cancel()
        await serving  # uvicorn stopped on its own (e.g. startup failed): re-raise
    failed = client.dead is not None
    await state.prompts.close()
    code = await client.shutdown()
    if code != 0 and not failed:
        logger.error("the engine exited with code %d", code)
    logger.info("server stopped")
    return 1 if failed or code != 0 else 0


async def _wait_ready(client: EngineClient, stop: asyncio.Event):
    ready = asyncio.create_task(client.wait_ready())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        stopped.cancel()
        return ready.result()
    ready.cancel()
    return None


async def _until_stop_or_engine_death(client: EngineClient, stop: asyncio.Event) -> None:
    while not stop.is_set() and client.dead is None and client.stop_requested is None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    if client.dead is not None:
        logger.error("stopping: the engine failed (%s)", client.dead)
    elif not stop.is_set():
        logger.info("stopping: %s; waiting for running requests", client.stop_requested)
    else:
        logger.info("stopping: waiting up to the shutdown timeout for running requests")


def _server_state(
    config: EngineConfig,
    options: ServeOptions,
    tokenizer: Tokenizer,
    client: EngineClient,
    ready: Ready,
) -> ServerState:
    names = list(options.served_model_names) or [default_model_name(config.model)]
    return ServerState(
        client=client,
        tokenizer=tokenizer,
        model_names=names,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        metrics=ServerMetrics(names[0]),
        prompts=PromptWorkers(tokenizer, options.trust_request_chat_template),
        defaults=ModelDefaults.from_model_dir(config.model),
        api_key=options.api_key,
        debug_endpoints=options.debug_endpoints,
        reasoning_parser=options.reasoning_parser,
        tool_call_parser=options.tool_call_parser,
        enable_auto_tool_choice=options.enable_auto_tool_choice,
        max_request_body_bytes=options.max_request_body_bytes,
        max_waiting_requests=ready.max_waiting_requests,
        data_parallel_size=ready.data_parallel_size,
        model_path=config.model,
        disaggregation_mode=config.disaggregation_mode,
        bootstrap_port=(
            config.disaggregation_bootstrap_port
            if config.disaggregation_mode == "prefill"
            else None
        ),
    )


def _public_url(sock: socket.socket, config: EngineConfig) -> str:
    """The URL the other hosts of an engine group log: the bound address, or for a wildcard
    bind the address they reach this host at (``--master-addr``)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = config.master_addr or socket.gethostname()
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


def default_model_name(model_dir: str) -> str:
    """The name clients use when ``--served-model-name`` is not given: the model directory's
    own name (never its path, which would reach every client and metric label)."""
    return Path(model_dir).name or "model"


async def _drain(client: EngineClient, timeout_s: float, force: asyncio.Event) -> None:
    """Wait (the port open, new requests answered 503) until the running requests finished,
    at most ``timeout_s``; then end the rest. After an engine failure the requests have
    already ended; the 503s go on for ``_FAILED_LINGER_S``."""
    if client.dead is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(force.wait(), min(_FAILED_LINGER_S, timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    while client.num_unfinished and time.monotonic() < deadline and not force.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(force.wait(), 0.05)
    if client.num_unfinished:
        logger.warning("ending %d unfinished request(s)", client.num_unfinished)
        client.end_all(f"the server shut down after waiting {timeout_s:g}s")
