"""The decode instance's control: take blocks, ask the prefill instance to fill them, decode.

A request with bootstrap fields becomes a ``KVRole.DECODE`` sequence over the whole prompt.
The schedulers of its replica admit it FCFS with blocks for every prompt token but the last
and park it; this side then sends the prefill instance a ``want``: every rank of the replica
as a target (its session and pool layout; under tensor parallelism each rank needs the
latent, or its own KV heads), the block ids (the same on every rank of a replica), the
checkpoint's and the prompt's digests. On ``done`` every rank of the replica runs the last
prompt token (the step that samples the first output token, as after a prefix-cache hit) and
decodes it as any other; when ``done`` names the heads of the prefill ranks, the KV came
packed from another tensor-parallel split and each rank first unpacks it (``regroup.py``).

Nothing waits forever: the prefill side renews each room it still works on every second
(``waiting``); a room not renewed within the transfer timeout fails, and so does every room
of a prefill instance whose bootstrap connection drops (a killed process, a host gone: the
heartbeat notices within 3 s). A failed request ends with an error (its HTTP answer is a 503,
which the router may retry elsewhere). Blocks that a write might still reach (a failure the
prefill side did not confirm) stay in quarantine for a grace period before they are reused;
a request dropped here while its KV was on the way is cancelled on the prefill side, and its
blocks are freed when that side confirms (or the timeout passes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from moeserve.core import SamplingParams
from moeserve.disagg import bootstrap as b
from moeserve.disagg import regroup
from moeserve.disagg.connector import LATE_WRITE_GRACE_S, Control
from moeserve.disagg.layout import PoolLayout, transfer_bytes

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    room: int
    peer: b.Peer
    digest: str  # of the prompt less its last token
    num_tokens: int


@dataclass
class _Pending:
    request_id: str
    peer: b.Peer
    deadline: float
    asked: float
    num_bytes: int
    num_tokens: int


class DecodeControl(Control):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = zmq.Context()
        self.clients = b.BootstrapClients(self.ctx)
        self.requests: dict[str, _Request] = {}  # request id -> its room, until it is parked
        self.pending: dict[int, _Pending] = {}  # room -> asked for, not yet arrived
        self.cancelling: dict[int, _Pending] = {}  # room -> dropped here, awaiting the word
        self.late: list[tuple[str, float]] = []  # quarantined request ids, when to free them
        self._cmds: dict = {}

    def on_add(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        kv = params.kv_transfer
        self.requests[request_id] = _Request(
            kv.room, (kv.host, kv.port), b.prompt_digest(prompt_ids[:-1]), len(prompt_ids) - 1
        )

    def on_abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)  # not parked yet: nothing was asked

    def has_pending(self) -> bool:
        return bool(self.pending or self.cancelling or self.late)

    def wait(self, timeout_s: float) -> None:
        socks = self.clients.sockets()
        if not socks:
            super().wait(timeout_s)
            return
        zmq.select(socks, [], [], timeout_s)

    def close(self) -> None:
        self.clients.close()
        self.ctx.term()

    def _cmd(self, name: str, item) -> None:
        self._cmds.setdefault(name, []).append(item)

    def poll(self, events: list[dict]) -> dict:
        now = self.clock()
        self._cmds = {}
        for info, parked in self.leaders(events, "parked"):
            self._ask(parked, info.replica, now)
        for _, request_id in self.leaders(events, "quarantined"):
            self._cancel(request_id, now)
        for peer, msg in self.clients.receive():
            self._on_message(peer, msg, now)
        for peer in self.clients.disconnected():
            self._on_disconnect(peer, now)
        self._expire(now)
        return self._cmds

    def _ask(self, parked: dict, replica: int, now: float) -> None:
        req = self.requests.pop(parked["id"], None)
        if req is None:
            return
        if self.clients.is_down(req.peer):  # it cannot have seen this room: no late write
            reason = f"the prefill instance at {req.peer[0]}:{req.peer[1]} is not reachable"
            self._fail(parked["id"], reason, now, late=False)
            return
        targets = [r.target for r in self.replicas[replica]]
        want = {
            "op": b.WANT,
            "room": req.room,
            "targets": targets,
            "blocks": parked["blocks"],
            "num_tokens": req.num_tokens,
            "model": self.model_hash,
            "prompt": req.digest,
        }
        self.clients.send(req.peer, want)
        num_bytes = 0
        for t in targets:
            layout = PoolLayout.from_json(t["layout"])
            num_bytes += transfer_bytes(layout, layout, req.num_tokens)
        self.pending[req.room] = _Pending(
            parked["id"], req.peer, now + self.timeout_s, now, num_bytes, req.num_tokens
        )

    def _cancel(self, request_id: str, now: float) -> None:
        room = next((r for r, p in self.pending.items() if p.request_id == request_id), None)
        if room is None:
            self._cmd("free", request_id)
            return
        p = self.pending.pop(room)
        self.clients.send(p.peer, {"op": b.CANCEL, "room": room})
        p.deadline = now + self.timeout_s
        self.cancelling[room] = p

    def _on_message(self, peer: b.Peer, msg: dict, now: float) -> None:
        op = msg["op"]
        if op == b.WAITING:
            for room in msg.get("rooms", ()):
                p = self.pending.get(room)
                if p is not None and p.peer == peer:
                    p.deadline = now + self.timeout_s
            return
        room = msg.get("room")
        c = self.cancelling.pop(room, None)
        if c is not None:  # done, failed or cancelled: no write of it will come now
            self._cmd("free", c.request_id)
            return
        p = self.pending.get(room)
        if p is None or p.peer != peer:
            return  # a room that already ended here
        if op not in (b.DONE, b.FAILED, b.CANCELLED):
            logger.warning("bootstrap: unexpected %r from %s:%d", op, *peer)
            return
        del self.pending[room]
        if op == b.DONE:
            sources = msg.get("sources")
            problem = None if sources is None else self._check_sources(sources)
            if problem:
                self._fail(
                    p.request_id, f"the prefill instance sent packed KV heads {problem}", now, False
                )
                return
            self.stats.observe(now - p.asked, p.num_bytes, p.num_tokens)
            if sources is not None:  # its heads came packed: unpacked before the step
                self._cmd("unpack", [p.request_id, sources])
            self._cmd("arrived", p.request_id)
        elif op == b.FAILED:
            reason = str(msg.get("reason", "the prefill instance failed the transfer"))
            self._fail(p.request_id, reason, now, late=bool(msg.get("late_writes")))
        else:  # CANCELLED, unasked: it dropped the request before writing any of it
            self._fail(p.request_id, "the prefill instance dropped the request", now, late=False)

    def _check_sources(self, sources) -> str | None:
        """Why the head ranges of a packed ``done`` cannot be unpacked here (None: they can)."""
        try:
            ranges = [(int(a), int(n)) for a, n in sources]
            for info in self.ranks:
                regroup.route(PoolLayout.from_json(info.layout), ranges)
        except (TypeError, ValueError) as e:
            return f"{sources!r} that this instance cannot unpack: {e}"
        return None

    def _on_disconnect(self, peer: b.Peer, now: float) -> None:
        reason = f"the prefill instance at {peer[0]}:{peer[1]} disconnected"
        for room, p in list(self.pending.items()):
            if p.peer == peer:
                del self.pending[room]
                self._fail(p.request_id, reason, now, late=True, grace=LATE_WRITE_GRACE_S)
        for room, c in list(self.cancelling.items()):
            if c.peer == peer:
                del self.cancelling[room]
                self.late.append((c.request_id, now + LATE_WRITE_GRACE_S))

    def _fail(
        self, request_id: str, reason: str, now: float, late: bool, grace: float | None = None
    ) -> None:
        self.stats.failures += 1
        logger.warning("decode request %s: %s", request_id, reason)
        self._cmd("release", [request_id, "abort", reason, late])
        if late:
            self.late.append((request_id, now + (self.timeout_s if grace is None else grace)))

    def _expire(self, now: float) -> None:
        for room, p in list(self.pending.items()):
            if now > p.deadline:
                del self.pending[room]
                reason = (
                    f"no KV from the prefill instance at {p.peer[0]}:{p.peer[1]} within "
                    f"{self.timeout_s:g}s"
                )
                self._fail(p.request_id, reason, now, late=True)
        for room, c in list(self.cancelling.items()):
            if now > c.deadline:
                del self.cancelling[room]
                self._cmd("free", c.request_id)
        for request_id, _ in [x for x in self.late if now >= x[1]]:
            self._cmd("free", request_id)
        self.late = [x for x in self.late if now < x[1]]
