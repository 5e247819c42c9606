"""The decode instance's side: take blocks, ask the prefill instance to fill them, then decode.

A request with bootstrap fields becomes a ``KVRole.DECODE`` sequence over the whole prompt.
The scheduler admits it FCFS with blocks for every prompt token but the last and parks it;
right after that schedule this side sends the prefill instance a ``want`` (its pool's layout,
the block ids, its transfer-engine session), so the prefill side can write as soon as its
KV exists. On ``done`` the sequence runs its last prompt token (the step that samples the
first output token, as after a prefix-cache hit) and decodes as any other.

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

from moeserve.core import FinishReason, Sequence
from moeserve.disagg import bootstrap as b
from moeserve.disagg.connector import LATE_WRITE_GRACE_S, Connector

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    seq: Sequence
    peer: b.Peer
    deadline: float
    asked: float


class DecodeConnector(Connector):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = zmq.Context()
        self.clients = b.BootstrapClients(self.ctx)
        self.pending: dict[int, _Pending] = {}  # room -> asked for, not yet arrived
        self.cancelling: dict[int, _Pending] = {}  # room -> dropped here, awaiting the word
        self.late: list[tuple[Sequence, float]] = []  # quarantined blocks and when to free

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
        super().close()

    def poll(self) -> list[Sequence]:
        now = self.clock()
        finished: list[Sequence] = []
        sched = self.scheduler
        for seq in sched.newly_parked:
            self._ask(seq, now)
        sched.newly_parked.clear()
        for seq in sched.newly_quarantined:  # the client left while the KV was on its way
            self._cancel(seq, now)
        sched.newly_quarantined.clear()
        for peer, msg in self.clients.receive():
            self._on_message(peer, msg, now, finished)
        for peer in self.clients.disconnected():
            self._on_disconnect(peer, now, finished)
        self._expire(now, finished)
        return finished

    def _ask(self, seq: Sequence, now: float) -> None:
        kv = seq.params.kv_transfer
        peer = (kv.host, kv.port)
        want = {
            "op": b.WANT,
            "room": kv.room,
            "session": self.transport.session_id,
            "layout": self.layout.to_json(),
            "blocks": seq.block_table,
            "num_tokens": seq.num_prompt_tokens - 1,
            "model": self.model_hash,
            "prompt": b.prompt_digest(seq.prompt_token_ids[:-1]),
        }
        self.clients.send(peer, want)
        self.pending[kv.room] = _Pending(seq, peer, now + self.timeout_s, now)

    def _cancel(self, seq: Sequence, now: float) -> None:
        room = seq.params.kv_transfer.room
        p = self.pending.pop(room, None)
        if p is None:
            self.scheduler.free_quarantined(seq)
            return
        self.clients.send(p.peer, {"op": b.CANCEL, "room": room})
        p.deadline = now + self.timeout_s
        self.cancelling[room] = p

    def _on_message(self, peer: b.Peer, msg: dict, now: float, finished: list) -> None:
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
            self.scheduler.free_quarantined(c.seq)
            return
        p = self.pending.get(room)
        if p is None or p.peer != peer:
            return  # a room that already ended here
        del self.pending[room]
        if op == b.DONE:
            n = p.seq.num_prompt_tokens - 1
            num_bytes = n * self.layout.slot_bytes * len(self.layout.layer_addrs)
            self.stats.observe(now - p.asked, num_bytes, n)
            self.scheduler.kv_arrived(p.seq)
        elif op == b.FAILED:
            reason = str(msg.get("reason", "the prefill instance failed the transfer"))
            self._fail(p.seq, reason, finished, late=bool(msg.get("late_writes")), now=now)
        else:
            logger.warning("bootstrap: unexpected %r from %s:%d", op, *peer)

    def _on_disconnect(self, peer: b.Peer, now: float, finished: list) -> None:
        reason = f"the prefill instance at {peer[0]}:{peer[1]} disconnected"
        for room, p in list(self.pending.items()):
            if p.peer == peer:
                del self.pending[room]
                self._fail(p.seq, reason, finished, late=True, now=now, grace=LATE_WRITE_GRACE_S)
        for room, c in list(self.cancelling.items()):
            if c.peer == peer:
                del self.cancelling[room]
                self.late.append((c.seq, now + LATE_WRITE_GRACE_S))

    def _fail(
        self,
        seq: Sequence,
        reason: str,
        finished: list,
        late: bool,
        now: float,
        grace: float | None = None,
    ) -> None:
        self.stats.failures += 1
        logger.warning("decode room %d: %s", seq.params.kv_transfer.room, reason)
        finished.append(self.scheduler.release(seq, FinishReason.ABORT, reason, keep_blocks=late))
        if late:
            self.late.append((seq, now + (self.timeout_s if grace is None else grace)))

    def _expire(self, now: float, finished: list) -> None:
        for room, p in list(self.pending.items()):
            if now > p.deadline:
                del self.pending[room]
                reason = (
                    f"no KV from the prefill instance at {p.peer[0]}:{p.peer[1]} within "
                    f"{self.timeout_s:g}s"
                )
                self._fail(p.seq, reason, finished, late=True, now=now)
        for room, c in list(self.cancelling.items()):
            if now > c.deadline:
                del self.cancelling[room]
                self.scheduler.free_quarantined(c.seq)
        due = [(s, t) for s, t in self.late if now >= t]
        for seq, _ in due:
            self.scheduler.free_quarantined(seq)
        self.late = [(s, t) for s, t in self.late if now < t]
