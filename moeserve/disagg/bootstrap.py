"""The bootstrap link between a decode instance and the prefill instances it takes KV from.

The router gives a request to a prefill and a decode instance at once, with the prefill
instance's bootstrap address (``bootstrap_host``, ``bootstrap_port``) and a ``bootstrap_room``
naming the request on both sides (SGLang's protocol). The two engines then talk over ZeroMQ:
the prefill instance binds a ROUTER socket on its bootstrap port, each decode instance
connects one DEALER per prefill instance it meets. Messages are JSON objects with an ``op``::

    decode -> prefill   want      room, the decode pool's layout and the blocks to write,
                                  the tokens to send, its transfer-engine session, the
                                  checkpoint's hash and the prompt's (both sides must agree)
                        cancel    room: the decode side dropped the request
    prefill -> decode   waiting   rooms still queued or prefilling here (keeps them alive)
                        done      room: every byte is in the decode instance's blocks
                        failed    room, reason, late_writes (whether a write may still land)
                        cancelled room: no write of this room will come

The DEALER sockets heartbeat (ZMQ_HEARTBEAT_*): a prefill instance that dies, or stops
answering for ``HEARTBEAT_TIMEOUT_MS``, shows up as a disconnect (:meth:`BootstrapClients.
disconnected`), and its rooms fail at once instead of waiting for their timeout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from moeserve.kvcache.block_manager import hash_block

logger = logging.getLogger(__name__)

WANT, CANCEL, WAITING, DONE, FAILED, CANCELLED = (
    "want",
    "cancel",
    "waiting",
    "done",
    "failed",
    "cancelled",
)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000

Peer = tuple[str, int]  # a prefill instance's bootstrap (host, port)


def prompt_digest(token_ids: Sequence[int]) -> str:
    """sha256 of token ids as little-endian int64 (the same on every host): the prefix
    cache's block hash of them, with no parent."""
    return hash_block(b"", token_ids).hex()


def _encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def _decode(frame: bytes) -> dict | None:
    try:
        msg = json.loads(frame)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("op"), str) else None


class BootstrapServer:
    """The prefill instance's end: a ROUTER socket on the bootstrap port."""

    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            raise ValueError(
                f"the disaggregation bootstrap port {host}:{port} cannot be bound ({e}): "
                "choose another --disaggregation-bootstrap-port"
            ) from None
        self.address = f"{host}:{port}"

    def receive(self) -> list[tuple[bytes, dict]]:
        """Every message waiting now, with the identity of the decode instance it came from."""
        out = []
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            except ValueError:  # not two frames: not ours
                continue
            msg = _decode(frame)
            if msg is None:
                logger.warning("bootstrap %s: dropped a malformed message", self.address)
                continue
            out.append((ident, msg))

    def send(self, ident: bytes, msg: dict) -> bool:
        """False when the decode instance is gone (nothing to tell)."""
        try:
            self.sock.send_multipart([ident, _encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


class BootstrapClients:
    """The decode instance's end: one DEALER (and its monitor) per prefill instance."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self._socks: dict[Peer, zmq.Socket] = {}
        self._monitors: dict[Peer, zmq.Socket] = {}
        self._connected: set[Peer] = set()
        self._down: set[Peer] = set()  # dropped, not connected again since

    def _socket(self, peer: Peer) -> zmq.Socket:
        sock = self._socks.get(peer)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.RECONNECT_IVL, 200)
            self._monitors[peer] = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
            )
            sock.connect(f"tcp://{peer[0]}:{peer[1]}")
            self._socks[peer] = sock
        return sock

    def send(self, peer: Peer, msg: dict) -> None:
        try:
            self._socket(peer).send(_encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the queue to an unreachable peer is full: its rooms time out
            logger.warning("bootstrap: the queue to %s:%d is full", *peer)

    def receive(self) -> list[tuple[Peer, dict]]:
        out = []
        for peer, sock in self._socks.items():
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = _decode(frame)
                if msg is not None:
                    out.append((peer, msg))
        return out

    def disconnected(self) -> list[Peer]:
        """Peers that were connected and dropped since the last call (died, or stopped
        answering heartbeats)."""
        gone = []
        for peer, mon in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_CONNECTED:
                    self._connected.add(peer)
                    self._down.discard(peer)
                elif event["event"] == zmq.EVENT_DISCONNECTED and peer in self._connected:
                    self._connected.discard(peer)
                    self._down.add(peer)
                    gone.append(peer)
        return gone

    def is_down(self, peer: Peer) -> bool:
        """``peer`` dropped (as :meth:`disconnected` reported) and has not connected again:
        a message to it now only waits in the queue (say, a prefill instance that switched
        to the decode role and closed its bootstrap port)."""
        return peer in self._down

    def sockets(self) -> list[zmq.Socket]:
        return [*self._socks.values(), *self._monitors.values()]

    def close(self) -> None:
        for sock in self._socks.values():
            sock.disable_monitor()
            sock.close()
        for mon in self._monitors.values():
            mon.close()
        self._socks.clear()
        self._monitors.clear()
