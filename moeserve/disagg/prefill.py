"""The prefill instance's side: compute a prompt's KV, write it into the decode instance's
blocks, free the blocks, answer.

A request with bootstrap fields becomes a ``KVRole.PREFILL`` sequence over its prompt less
the last token (the decode instance runs that token itself and samples the first output, so
every output token comes from one place). Per room (the request's name on both sides) this
side pairs two things that arrive in either order: its own sequence, parked by the scheduler
once its prompt is computed, and the decode instance's ``want`` (where to write). With both,
one transfer-engine batch writes every layer's runs of slots (``layout.plan_writes``); when it
completes, ``done`` goes to the decode instance and the sequence finishes (``length``, no
tokens), which ends its HTTP request. Whatever does not arrive within the transfer timeout
(the want, the request, the batch's completion) fails the room on both sides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from moeserve.core import FinishReason, Sequence, SequenceStatus
from moeserve.disagg import bootstrap as b
from moeserve.disagg.connector import Connector
from moeserve.disagg.layout import PoolLayout, plan_writes
from moeserve.disagg.mooncake import DONE, FAILED, TransferBatch

logger = logging.getLogger(__name__)

RENEW_INTERVAL_S = 1.0  # how often the decode side hears that its rooms are still coming


@dataclass
class _Want:
    ident: bytes  # the decode instance's bootstrap identity
    msg: dict
    since: float


@dataclass
class _Transfer:
    seq: Sequence
    want: _Want
    batch: TransferBatch
    started: float
    num_bytes: int
    abandoned: bool = False  # the request was aborted while the batch ran


class PrefillConnector(Connector):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = zmq.Context()
        self.server = b.BootstrapServer(self.ctx, self.options.host, self.options.bootstrap_port)
        self.rooms: dict[int, Sequence] = {}  # room -> this side's sequence, until it ends
        self.wants: dict[int, _Want] = {}
        self.ready: dict[int, float] = {}  # room -> when its prompt finished computing
        self.transfers: dict[int, _Transfer] = {}
        self.cancelled: dict[int, float] = {}  # rooms the decode side dropped, and when
        self._last_renew = 0.0

    def info(self) -> dict:
        return {**super().info(), "disaggregation_bootstrap_port": self.options.bootstrap_port}

    def on_add(self, seq: Sequence) -> None:
        """Raises ValueError for a room in use, or one the decode side already dropped."""
        room = seq.params.kv_transfer.room
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already in use on this prefill instance")
        if self.cancelled.pop(room, None) is not None:
            raise ValueError(f"the decode instance already dropped bootstrap_room {room}")
        self.rooms[room] = seq

    def has_pending(self) -> bool:
        return bool(self.rooms or self.wants or self.transfers or self.cancelled)

    def wait(self, timeout_s: float) -> None:
        self.server.sock.poll(int(timeout_s * 1000) or 1)

    def close(self) -> None:
        self.server.close()
        self.ctx.term()
        super().close()

    # -- the step's hook ------------------------------------------------------------------

    def poll(self) -> list[Sequence]:
        now = self.clock()
        finished: list[Sequence] = []
        for ident, msg in self.server.receive():
            self._on_message(ident, msg, now, finished)
        sched = self.scheduler
        for seq in sched.newly_parked:
            self.ready[seq.params.kv_transfer.room] = now
        sched.newly_parked.clear()
        for seq in sched.newly_quarantined:  # aborted here while parked (the router left)
            self._on_aborted(seq)
        sched.newly_quarantined.clear()
        for room in [r for r in self.ready if r in self.wants]:
            self._start(room, now, finished)
        self._check_transfers(now, finished)
        self._expire(now, finished)
        if now - self._last_renew >= RENEW_INTERVAL_S:
            self._renew()
            self._last_renew = now
        self._forget_finished()
        return finished

    def _on_message(self, ident: bytes, msg: dict, now: float, finished: list) -> None:
        op, room = msg["op"], msg.get("room")
        if not isinstance(room, int):
            logger.warning("bootstrap: a %r message without a room", op)
            return
        if op == b.WANT:
            problem = self._check_want(room, msg)
            if problem:
                self.server.send(ident, {"op": b.FAILED, "room": room, "reason": problem})
                seq = self.rooms.get(room)
                if seq is not None and not seq.is_finished:
                    self._fail(seq, problem, finished)
                return
            self.wants[room] = _Want(ident, msg, now)
        elif op == b.CANCEL:
            self._on_cancel(ident, room, now, finished)
        else:
            logger.warning("bootstrap: unexpected %r from a decode instance", op)

    def _check_want(self, room: int, msg: dict) -> str | None:
        """Why this want cannot be served (None: it can)."""
        if msg.get("model") != self.model_hash:
            return (
                "the prefill and decode instances serve different checkpoints (config.json differs)"
            )
        try:
            PoolLayout.from_json(msg["layout"])
            int(msg["num_tokens"])
            [int(x) for x in msg["blocks"]]
            str(msg["session"])
        except (KeyError, TypeError, ValueError) as e:
            return f"malformed want: {e}"
        seq = self.rooms.get(room)
        if seq is not None and msg.get("prompt") != b.prompt_digest(seq.prompt_token_ids):
            return "the prefill and decode instances tokenized the request differently"
        if room in self.wants or room in self.transfers:
            return f"bootstrap_room {room} was asked for twice"
        return None

    def _on_cancel(self, ident: bytes, room: int, now: float, finished: list) -> None:
        transfer = self.transfers.get(room)
        if transfer is not None:  # answered when its batch ends: no write may land after
            transfer.abandoned = True
            transfer.want.ident = ident
            return
        self.wants.pop(room, None)
        seq = self.rooms.get(room)
        if seq is not None and not seq.is_finished:
            self._fail(seq, "the decode instance dropped the request", finished)
        elif seq is None:
            self.cancelled[room] = now  # the request may still come: refuse it then
        self.server.send(ident, {"op": b.CANCELLED, "room": room})

    def _on_aborted(self, seq: Sequence) -> None:
        """This side's request was aborted while its blocks were parked."""
        room = seq.params.kv_transfer.room
        self.ready.pop(room, None)
        transfer = self.transfers.get(room)
        if transfer is not None:
            transfer.abandoned = True  # its blocks are freed when the batch ends
            return
        self.scheduler.free_quarantined(seq)
        want = self.wants.pop(room, None)
        if want is not None:
            reason = "the request was aborted on the prefill instance"
            self.server.send(want.ident, {"op": b.FAILED, "room": room, "reason": reason})

    # -- transfers --------------------------------------------------------------------------

    def _start(self, room: int, now: float, finished: list) -> None:
        seq = self.rooms[room]
        want = self.wants.pop(room)
        del self.ready[room]
        msg = want.msg
        try:
            writes = plan_writes(
                self.layout,
                PoolLayout.from_json(msg["layout"]),
                seq.block_table,
                msg["blocks"],
                int(msg["num_tokens"]),
            )
            if int(msg["num_tokens"]) != seq.num_prompt_tokens:
                raise ValueError(
                    f"the decode instance wants {msg['num_tokens']} tokens, this side computed "
                    f"{seq.num_prompt_tokens}"
                )
            batch = self.transport.submit(msg["session"], writes.srcs, writes.dsts, writes.lengths)
        except (ValueError, RuntimeError) as e:
            reason = f"the KV transfer could not start: {e}"
            self.server.send(want.ident, {"op": b.FAILED, "room": room, "reason": reason})
            self._fail(seq, reason, finished)
            return
        self.transfers[room] = _Transfer(seq, want, batch, now, writes.num_bytes)

    def _check_transfers(self, now: float, finished: list) -> None:
        for room, t in list(self.transfers.items()):
            status = self.transport.status(t.batch)
            timed_out = status not in (DONE, FAILED) and now - t.started > self.timeout_s
            if status not in (DONE, FAILED) and not timed_out:
                continue
            del self.transfers[room]
            seq = t.seq
            if t.abandoned:
                self.server.send(t.want.ident, {"op": b.CANCELLED, "room": room})
                self.scheduler.free_quarantined(seq)
                continue
            if status == DONE:
                self.stats.observe(now - t.started, t.num_bytes, seq.num_prompt_tokens)
                self.server.send(t.want.ident, {"op": b.DONE, "room": room})
                finished.append(self.scheduler.release(seq, FinishReason.LENGTH))
                continue
            reason = (
                f"the KV transfer timed out after {self.timeout_s:g}s"
                if timed_out
                else "the KV transfer failed (the decode instance is unreachable or gone)"
            )
            self.server.send(
                t.want.ident,
                {"op": b.FAILED, "room": room, "reason": reason, "late_writes": timed_out},
            )
            self._fail(seq, reason, finished)

    def _fail(self, seq: Sequence, reason: str, finished: list) -> None:
        """End this side's request with an error (its HTTP answer is a 503)."""
        self.stats.failures += 1
        logger.warning("prefill room %d: %s", seq.params.kv_transfer.room, reason)
        if seq.status is SequenceStatus.PARKED:
            self.ready.pop(seq.params.kv_transfer.room, None)
            finished.append(self.scheduler.release(seq, FinishReason.ABORT, reason))
        elif not seq.is_finished:  # still queued or prefilling
            self.scheduler.finish(seq, FinishReason.ABORT)
            seq.error = reason
            finished.append(seq)

    def _expire(self, now: float, finished: list) -> None:
        limit = self.timeout_s
        for room, since in list(self.ready.items()):
            if now - since > limit:
                self._fail(
                    self.rooms[room],
                    f"no decode instance asked for bootstrap_room {room} within {limit:g}s",
                    finished,
                )
        for room, want in list(self.wants.items()):
            if room not in self.rooms and now - want.since > limit:
                del self.wants[room]
                reason = f"the prefill instance got no request for bootstrap_room {room}"
                self.server.send(want.ident, {"op": b.FAILED, "room": room, "reason": reason})
        for room, since in list(self.cancelled.items()):
            if now - since > limit:
                del self.cancelled[room]

    def _renew(self) -> None:
        """Tell each decode instance which of its rooms are still queued or computing."""
        by_peer: dict[bytes, list[int]] = {}
        for room, want in self.wants.items():
            if room in self.rooms:
                by_peer.setdefault(want.ident, []).append(room)
        for room, t in self.transfers.items():
            by_peer.setdefault(t.want.ident, []).append(room)
        for ident, rooms in by_peer.items():
            self.server.send(ident, {"op": b.WAITING, "rooms": rooms})

    def _forget_finished(self) -> None:
        for room, seq in list(self.rooms.items()):
            if seq.is_finished and room not in self.transfers:
                del self.rooms[room]
                self.ready.pop(room, None)
