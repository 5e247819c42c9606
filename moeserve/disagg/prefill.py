"""The prefill instance's control: compute a prompt's KV, have it written into the decode
instance's blocks, free the blocks, answer.

A request with bootstrap fields becomes a ``KVRole.PREFILL`` sequence over its prompt less
the last token (the decode instance runs that token itself and samples the first output, so
every output token comes from one place). Per room (the request's name on both sides) this
side pairs two things that arrive in either order: its own sequence, parked by the schedulers
of its replica once its prompt is computed, and the decode instance's ``want`` (where to
write: every rank of the decode replica that holds the request, its blocks, its session).
With both, a ``send`` command has the replica's ranks write (``rank.py``): MLA's latent is the
same on every tensor-parallel rank, so the decode ranks are shared out over the prefill
ranks; a GQA decode rank's heads come from the prefill rank that holds the same heads, or,
between different tensor-parallel splits (``regroup.py``), from the one rank that holds them
all (it gathers them into a staging buffer) or from the ranks that each hold part of them
(they write packed into the decode blocks, and ``done`` names their heads so the decode
ranks unpack them). When every writer's batch has completed, ``done`` goes to the decode
instance and the sequence finishes (``length``, no tokens), which ends its HTTP request.
Whatever does not arrive within the transfer timeout (the want, the request, the batches'
completion) fails the room on both sides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from moeserve.core import SamplingParams
from moeserve.disagg import bootstrap as b
from moeserve.disagg import regroup
from moeserve.disagg.connector import Control, RankInfo
from moeserve.disagg.layout import MLA, PoolLayout, check_compatible, transfer_bytes
from moeserve.disagg.mooncake import DONE, FAILED

logger = logging.getLogger(__name__)

RENEW_INTERVAL_S = 1.0  # how often the decode side hears that its rooms are still coming


@dataclass
class _Room:
    request_id: str
    digest: str  # of the prompt less its last token
    num_tokens: int
    ready_at: float | None = None  # when its replica parked it (its prompt is computed)
    replica: int = 0
    blocks: list[int] = field(default_factory=list)
    aborted: bool = False


@dataclass
class _Want:
    ident: bytes  # the decode instance's bootstrap identity
    msg: dict
    since: float


@dataclass
class _Transfer:
    want: _Want
    writers: set[int]  # ranks writing
    started: float
    num_bytes: int
    results: dict[int, int] = field(default_factory=dict)  # rank -> DONE | FAILED
    abandoned: bool = False  # the request was aborted while the batches ran
    sources: list | None = None  # GQA heads of the writers, when a target gets them packed


class PrefillControl(Control):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = zmq.Context()
        try:
            self.server = b.BootstrapServer(
                self.ctx, self.options.host, self.options.bootstrap_port
            )
        except BaseException:
            self.ctx.term()
            raise
        self.rooms: dict[int, _Room] = {}  # room -> this side's request, until it ends
        self.room_of: dict[str, int] = {}  # request id -> room
        self.wants: dict[int, _Want] = {}
        self.transfers: dict[int, _Transfer] = {}
        self.cancelled: dict[int, float] = {}  # rooms the decode side dropped, and when
        self._last_renew = 0.0
        self._cmds: dict = {}

    def info(self) -> dict:
        return {**super().info(), "disaggregation_bootstrap_port": self.options.bootstrap_port}

    def on_add(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        """Raises ValueError for a room in use, or one the decode side already dropped."""
        room = params.kv_transfer.room
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already in use on this prefill instance")
        if self.cancelled.pop(room, None) is not None:
            raise ValueError(f"the decode instance already dropped bootstrap_room {room}")
        self.rooms[room] = _Room(request_id, b.prompt_digest(prompt_ids[:-1]), len(prompt_ids) - 1)
        self.room_of[request_id] = room

    def on_abort(self, request_id: str) -> None:
        room = self.room_of.get(request_id)
        if room is not None:
            self.rooms[room].aborted = True

    def has_pending(self) -> bool:
        return bool(self.rooms or self.wants or self.transfers or self.cancelled)

    def wait(self, timeout_s: float) -> None:
        self.server.sock.poll(int(timeout_s * 1000) or 1)

    def close(self) -> None:
        self.server.close()
        self.ctx.term()

    # -- the step's hook ------------------------------------------------------------------

    def poll(self, events: list[dict]) -> dict:
        now = self.clock()
        self._cmds = {}
        for ident, msg in self.server.receive():
            self._on_message(ident, msg, now)
        for info, parked in self.leaders(events, "parked"):
            r = self.rooms.get(parked["room"])
            if r is not None and r.request_id == parked["id"]:
                r.ready_at, r.replica, r.blocks = now, info.replica, parked["blocks"]
        for info, ev in zip(self.ranks, events):
            for room, status in ev.get("transfers", {}).items():
                t = self.transfers.get(int(room))
                if t is not None and info.rank in t.writers:
                    t.results[info.rank] = status
        self._drop_aborted()
        for room in [r for r, x in self.rooms.items() if x.ready_at is not None]:
            if room in self.wants and room not in self.transfers:
                self._start(room, now)
        self._check_transfers(now)
        self._expire(now)
        if now - self._last_renew >= RENEW_INTERVAL_S:
            self._renew()
            self._last_renew = now
        return self._cmds

    def _cmd(self, name: str, item) -> None:
        self._cmds.setdefault(name, []).append(item)

    def _end(self, room: int, error: str | None) -> None:
        """The room's request ends here: sent (``error`` None) or failed."""
        r = self.rooms.pop(room)
        self.room_of.pop(r.request_id, None)
        if error is None:
            self._cmd("release", [r.request_id, "length", None, False])
        else:
            self.stats.failures += 1
            logger.warning("prefill room %d: %s", room, error)
            self._cmd("fail", [r.request_id, error])

    def _on_message(self, ident: bytes, msg: dict, now: float) -> None:
        op, room = msg["op"], msg.get("room")
        if not isinstance(room, int):
            logger.warning("bootstrap: a %r message without a room", op)
            return
        if op == b.WANT:
            problem = self._check_want(room, msg)
            if problem:
                self.server.send(ident, {"op": b.FAILED, "room": room, "reason": problem})
                if room in self.rooms and room not in self.transfers:
                    self._end(room, problem)
                return
            self.wants[room] = _Want(ident, msg, now)
        elif op == b.CANCEL:
            self._on_cancel(ident, room, now)
        else:
            logger.warning("bootstrap: unexpected %r from a decode instance", op)

    def _check_want(self, room: int, msg: dict) -> str | None:
        """Why this want cannot be served (None: it can)."""
        if msg.get("model") != self.model_hash:
            return (
                "the prefill and decode instances serve different checkpoints (config.json differs)"
            )
        try:
            targets = [PoolLayout.from_json(t["layout"]) for t in msg["targets"]]
            [str(t["session"]) for t in msg["targets"]]
            int(msg["num_tokens"])
            [int(x) for x in msg["blocks"]]
            for t in targets:
                check_compatible(PoolLayout.from_json(self.ranks[0].layout), t)
        except (KeyError, TypeError, ValueError) as e:
            return f"malformed want: {e}"
        if not targets:
            return "malformed want: no target"
        r = self.rooms.get(room)
        if r is not None and msg.get("prompt") != r.digest:
            return "the prefill and decode instances tokenized the request differently"
        if r is not None and int(msg["num_tokens"]) != r.num_tokens:
            return (
                f"the decode instance wants {msg['num_tokens']} tokens, this one has {r.num_tokens}"
            )
        if room in self.wants or room in self.transfers:
            return f"bootstrap_room {room} was asked for twice"
        return None

    def _on_cancel(self, ident: bytes, room: int, now: float) -> None:
        transfer = self.transfers.get(room)
        if transfer is not None:  # answered when its batches end: no write may land after
            transfer.abandoned = True
            transfer.want.ident = ident
            return
        self.wants.pop(room, None)
        if room in self.rooms:
            self._end(room, "the decode instance dropped the request")
        else:
            self.cancelled[room] = now  # the request may still come: refuse it then
        self.server.send(ident, {"op": b.CANCELLED, "room": room})

    def _drop_aborted(self) -> None:
        """Requests aborted here (the router left): their parked blocks are freed once no
        batch reads them, and the decode side hears of it."""
        for room, r in list(self.rooms.items()):
            if not r.aborted:
                continue
            transfer = self.transfers.get(room)
            if transfer is not None:
                transfer.abandoned = True
                continue
            del self.rooms[room]
            self.room_of.pop(r.request_id, None)
            if r.ready_at is not None:
                self._cmd("free", r.request_id)
            want = self.wants.pop(room, None)
            if want is not None:
                reason = "the request was aborted on the prefill instance"
                self.server.send(want.ident, {"op": b.FAILED, "room": room, "reason": reason})

    # -- transfers --------------------------------------------------------------------------

    def _start(self, room: int, now: float) -> None:
        r = self.rooms[room]
        want = self.wants.pop(room)
        msg = want.msg
        if msg.get("prompt") != r.digest or int(msg["num_tokens"]) != r.num_tokens:
            # a want that came before its request was checked without the prompt
            reason = "the prefill and decode instances tokenized the request differently"
            self.server.send(want.ident, {"op": b.FAILED, "room": room, "reason": reason})
            self._end(room, reason)
            return
        try:
            writers, num_bytes, sources = self._assign(
                self.replicas[r.replica], msg["targets"], r.num_tokens
            )
        except ValueError as e:
            reason = f"the KV transfer cannot be planned: {e}"
            self.server.send(want.ident, {"op": b.FAILED, "room": room, "reason": reason})
            self._end(room, reason)
            return
        self._cmd(
            "send",
            {
                "id": r.request_id,
                "room": room,
                "blocks": [int(x) for x in msg["blocks"]],
                "num_tokens": r.num_tokens,
                "targets": msg["targets"],
                "writers": {str(k): v for k, v in writers.items()},
            },
        )
        self.transfers[room] = _Transfer(want, set(writers), now, num_bytes, sources=sources)

    @staticmethod
    def _assign(
        sources: list[RankInfo], targets: list[dict], num_tokens: int
    ) -> tuple[dict[int, list[int]], int, list | None]:
        """Which source rank writes into which target (rank -> target indexes), the bytes
        all of it moves, and the sources' GQA head ranges when a target gets its heads
        packed (the decode side unpacks them; None otherwise). MLA: the targets shared out
        over the sources in turn. GQA: ``regroup.route``; ValueError when the heads cannot
        be regrouped."""
        writers: dict[int, list[int]] = {}
        total = 0
        packed = False
        src_layouts = [PoolLayout.from_json(s.layout) for s in sources]
        ranges = regroup.head_ranges(src_layouts)
        for i, t in enumerate(targets):
            dst = PoolLayout.from_json(t["layout"])
            if dst.kind == MLA:
                k = i % len(sources)
                writers.setdefault(sources[k].rank, []).append(i)
                total += transfer_bytes(src_layouts[k], dst, num_tokens)
                continue
            how, used = regroup.route(dst, ranges)
            packed |= how == regroup.PACK
            for head_range in used:  # the first rank holding each range writes it
                k = next(
                    k
                    for k, src in enumerate(src_layouts)
                    if (src.head_start, src.num_heads) == head_range
                )
                writers.setdefault(sources[k].rank, []).append(i)
                total += transfer_bytes(src_layouts[k], dst, num_tokens)
        return writers, total, [list(r) for r in ranges] if packed else None

    def _check_transfers(self, now: float) -> None:
        for room, t in list(self.transfers.items()):
            failed = FAILED in t.results.values()
            done = not failed and all(t.results.get(w) == DONE for w in t.writers)
            timed_out = not (failed or done) and now - t.started > self.timeout_s
            if not (failed or done or timed_out):
                continue
            del self.transfers[room]
            r = self.rooms.get(room)
            if t.abandoned:
                self.server.send(t.want.ident, {"op": b.CANCELLED, "room": room})
                if r is not None:
                    del self.rooms[room]
                    self.room_of.pop(r.request_id, None)
                    if r.aborted:
                        self._cmd("free", r.request_id)
                    else:  # the decode side dropped it
                        self._cmd("fail", [r.request_id, "the decode instance dropped the request"])
                continue
            if done:
                self.stats.observe(now - t.started, t.num_bytes, r.num_tokens)
                msg = {"op": b.DONE, "room": room}
                if t.sources is not None:
                    msg["sources"] = t.sources
                self.server.send(t.want.ident, msg)
                self._end(room, None)
                continue
            late = True  # a failed or late batch's other writes may still be landing
            reason = (
                f"the KV transfer timed out after {self.timeout_s:g}s"
                if timed_out
                else "the KV transfer failed (the decode instance is unreachable or gone)"
            )
            self.server.send(
                t.want.ident, {"op": b.FAILED, "room": room, "reason": reason, "late_writes": late}
            )
            self._end(room, reason)

    def _expire(self, now: float) -> None:
        limit = self.timeout_s
        for room, r in list(self.rooms.items()):
            if r.ready_at is not None and room not in self.transfers and now - r.ready_at > limit:
                self._end(
                    room, f"no decode instance asked for bootstrap_room {room} within {limit:g}s"
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
