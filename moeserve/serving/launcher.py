"""``moeserve serve``: bind the port, start the engine process, serve HTTP until a signal.

    this process (API server)              engine process (+ its ranks)
      bind host:port (fails fast)
      spawn ------------------------------>  load the model, start the ranks
      wait for Ready  <--------------------  Ready
      uvicorn serves ...                     steps
      SIGTERM/SIGINT: stop accepting, let running requests finish for --shutdown-timeout,
      end the rest with an error event, then Shutdown ---->  stop the ranks, exit 0
      exit 0 (1 if the engine failed)

A second SIGINT forces the exit. If the engine dies while serving, waiting requests get an
error at once and the server exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from moeserve.serving.metrics import ServerMetrics
from moeserve.serving.sampling import ModelDefaults
from moeserve.serving.state import ServerState
from moeserve.tokenizer import Tokenizer

logger = logging.getLogger("moeserve.serve")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    shutdown_timeout_s: float = 30.0
    debug_endpoints: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
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
    client = EngineClient.spawn(dataclasses.asdict(config), ipc_dir)
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
    if ready is None:  # a signal while loading
        await client.shutdown()
        return 0

    names = list(options.served_model_names) or [config.model]
    state = ServerState(
        client=client,
        tokenizer=tokenizer,
        model_names=names,
        model_path=config.model,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        metrics=ServerMetrics(names[0]),
        defaults=ModelDefaults.from_model_dir(config.model),
        api_key=options.api_key,
        debug_endpoints=options.debug_endpoints,
    )
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
        "serving %s (%s, max_model_len %d, %d rank(s)) on http://%s:%d",
        names[0],
        ready.architecture,
        ready.max_model_len,
        ready.world_size,
        host,
        port,
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    watch = asyncio.create_task(_until_stop_or_engine_death(client, stop))
    done, _ = await asyncio.wait({serving, watch}, return_when=asyncio.FIRST_COMPLETED)
    failed = client.dead is not None
    if watch in done:
        # stop accepting; running requests finish, up to the timeout
        state.draining = True
        server.should_exit = True
        loop.remove_signal_handler(signal.SIGINT)
        loop.add_signal_handler(signal.SIGINT, lambda: setattr(server, "force_exit", True))
        ender = asyncio.create_task(_end_stragglers(client, options.shutdown_timeout_s))
        await serving
        ender.cancel()
    else:
        watch.cancel()
        await serving  # uvicorn stopped on its own (e.g. startup failed): re-raise
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
    while not stop.is_set() and client.dead is None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    if client.dead is not None:
        logger.error("stopping: the engine failed (%s)", client.dead)
    else:
        logger.info("stopping: waiting up to the shutdown timeout for running requests")


async def _end_stragglers(client: EngineClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while client.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_unfinished:
        logger.warning("ending %d unfinished request(s)", client.num_unfinished)
        client.end_all(f"the server shut down after waiting {timeout_s:g}s")
