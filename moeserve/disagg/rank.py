"""One rank's end of the KV transfers: its pool in the transfer engine, the writes it makes,
and the control's decisions applied to its scheduler.

The protocol runs in one place per instance, the control (``control.py``: world rank 0, or
the only process); every rank that holds a KV pool has a :class:`KVRank`. They speak in two
plain-JSON messages, so an engine group carries them on its step broadcast and its gather of
outputs (``launch/engine_group.py``), and one process passes them by hand
(``connector.LocalConnector``)::

    control -> every rank  commands, applied at the start of a step (every rank of a replica
                           applies the same ones in the same step: their schedulers stay alike)
        arrived   [request id]                         the KV is in: run the last prompt token
        release   [[request id, reason, error, keep]]  end a parked sequence (keep: quarantine)
        fail      [[request id, error]]                end a sequence, parked or not, with error
        free      [request id]                         free a quarantined sequence's blocks
        send      [{id, room, blocks, num_tokens, targets: [{session, layout}],
                    writers: {rank: [target index]}}]  write a prompt's KV to a decode replica

    every rank -> control  events, after a step
        parked       [{id, room, blocks}]    what its scheduler parked (replica leaders count)
        quarantined  [request id]            parked sequences aborted here
        transfers    {room: 1 | -1}          its batches that completed (1) or failed (-1)
"""

from __future__ import annotations

import logging

from moeserve.config import DisaggregationOptions
from moeserve.core import FinishReason, Sequence, SequenceStatus
from moeserve.disagg.layout import PoolLayout, plan_writes
from moeserve.disagg.mooncake import DONE, FAILED, MooncakeTransport
from moeserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class KVRank:
    """This rank's transfer engine (its pool registered once) and the commands' effects."""

    def __init__(
        self,
        options: DisaggregationOptions,
        scheduler: Scheduler,
        layout: PoolLayout,
        rank: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.layout = layout
        self.rank = rank
        self.transport = MooncakeTransport(
            options.host, options.ib_device, options.transfer_timeout_s
        )
        self.transport.register(layout.layer_addrs, layout.pool_bytes)
        self._batches: dict[int, list[int]] = {}  # room -> this rank's batches for it
        self._failed: set[int] = set()  # rooms whose writes could not even start here

    def describe(self) -> dict:
        """What the control (and the other side) needs to write into or from this pool."""
        return {"session": self.transport.session_id, "layout": self.layout.to_json()}

    def close(self) -> None:
        self.transport.close()

    # -- events ---------------------------------------------------------------------------

    def events(self) -> dict:
        """What changed here since the last call (module docstring)."""
        sched = self.scheduler
        parked = [
            {"id": s.request_id, "room": s.params.kv_transfer.room, "blocks": list(s.block_table)}
            for s in sched.newly_parked
        ]
        quarantined = [s.request_id for s in sched.newly_quarantined]
        sched.newly_parked.clear()
        sched.newly_quarantined.clear()
        transfers = {room: FAILED for room in self._failed}
        self._failed.clear()
        for room, batches in list(self._batches.items()):
            states = [self.transport.status(b) for b in batches]
            if FAILED in states:
                transfers[room] = FAILED
            elif all(s == DONE for s in states):
                transfers[room] = DONE
            else:
                continue
            logger.debug("room %d: rank %d's batches ended: %s", room, self.rank, states)
            del self._batches[room]
        out: dict = {}
        if parked:
            out["parked"] = parked
        if quarantined:
            out["quarantined"] = quarantined
        if transfers:
            out["transfers"] = {str(r): s for r, s in transfers.items()}
        return out

    @property
    def sending(self) -> bool:
        return bool(self._batches or self._failed)

    # -- commands -------------------------------------------------------------------------

    def apply(self, cmds: dict) -> list[Sequence]:
        """Apply the control's commands; returns the sequences they ended (for the outputs)."""
        if not cmds:
            return []
        sched = self.scheduler
        ended: list[Sequence] = []
        for request_id in cmds.get("arrived", ()):
            seq = self._parked(request_id)
            if seq is not None:
                sched.kv_arrived(seq)
        for request_id, reason, error, keep in cmds.get("release", ()):
            seq = self._parked(request_id)
            if seq is not None:
                ended.append(sched.release(seq, FinishReason(reason), error, keep_blocks=keep))
        for request_id, error in cmds.get("fail", ()):
            ended.extend(self._fail(request_id, error))
        for request_id in cmds.get("free", ()):
            for seq in [s for s in sched.quarantined.values() if s.request_id == request_id]:
                sched.free_quarantined(seq)
        for send in cmds.get("send", ()):
            self._send(send)
        return ended

    def _parked(self, request_id: str) -> Sequence | None:
        return next((s for s in self.scheduler.parked.values() if s.request_id == request_id), None)

    def _fail(self, request_id: str, error: str) -> list[Sequence]:
        sched = self.scheduler
        ended = []
        for seq in [
            s
            for s in (*sched.running, *sched.waiting, *sched.parked.values())
            if s.request_id == request_id
        ]:
            if seq.status is SequenceStatus.PARKED:
                ended.append(sched.release(seq, FinishReason.ABORT, error))
            else:
                sched.finish(seq, FinishReason.ABORT)
                seq.error = error
                ended.append(seq)
        return ended

    def _send(self, send: dict) -> None:
        """Start this rank's writes of a prompt's KV into the targets it was given."""
        mine = send["writers"].get(str(self.rank), ())
        if not mine:
            return
        room = send["room"]
        seq = self._parked(send["id"])
        if seq is None:  # aborted here meanwhile: the control hears of it too
            self._failed.add(room)
            return
        batches = []
        try:
            for i in mine:
                target = send["targets"][i]
                writes = plan_writes(
                    self.layout,
                    PoolLayout.from_json(target["layout"]),
                    seq.block_table,
                    send["blocks"],
                    send["num_tokens"],
                )
                if len(writes):
                    batches.append(
                        self.transport.submit(
                            target["session"], writes.srcs, writes.dsts, writes.lengths
                        )
                    )
        except (ValueError, RuntimeError) as e:
            logger.warning(
                "room %d: the KV transfer could not start on rank %d: %s", room, self.rank, e
            )
            # batches already started still run: the control tells the decode side that
            # writes may land late (it quarantines those blocks)
            self._failed.add(room)
            return
        self._batches[room] = batches
        logger.debug(
            "room %d: rank %d started %d batch(es) to %s",
            room,
            self.rank,
            len(batches),
            [send["targets"][i]["session"] for i in mine],
        )
