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
        unpack    [[request id, [[head, heads]]]]      before arrived: the KV came packed from
                                                       prefill ranks with those GQA heads
                                                       (``regroup.py``)

    every rank -> control  events, after a step
        parked       [{id, room, blocks}]    what its scheduler parked (replica leaders count)
        quarantined  [request id]            parked sequences aborted here
        transfers    {room: 1 | -1}          its batches that completed (1) or failed (-1)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from moeserve.config import DisaggregationOptions
from moeserve.core import FinishReason, Sequence, SequenceStatus
from moeserve.disagg import regroup
from moeserve.disagg.layout import GQA, PoolLayout, Writes, check_tables, plan_writes
from moeserve.disagg.mooncake import DONE, FAILED, MooncakeTransport
from moeserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

_MIN_STAGING_BYTES = 1 << 20


class StagingBuffers:
    """Registered host buffers a rank gathers KV into before writing it (``regroup.GATHER``).

    A buffer serves one transfer at a time: :meth:`take` hands out the smallest free one
    that fits, or registers a new one (a power of two of at least 1 MiB, its pages faulted
    in); :meth:`give_back` returns it once its batch completed. A buffer whose batch failed
    is retired, never reused (a write of it may still be on the wire). All are unregistered
    with the transport, at its close."""

    def __init__(self, transport: MooncakeTransport) -> None:
        self.transport = transport
        self.free: list[torch.Tensor] = []
        self.retired: list[torch.Tensor] = []
        self.num_registered = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        fits = [b for b in self.free if b.numel() >= num_bytes]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            self.free.remove(buf)
            return buf
        size = max(_MIN_STAGING_BYTES, 1 << (num_bytes - 1).bit_length())
        buf = torch.zeros(size, dtype=torch.uint8)
        self.transport.register([buf.data_ptr()], [size])
        self.num_registered += 1
        return buf

    def give_back(self, bufs: Seq[torch.Tensor], reusable: bool) -> None:
        (self.free if reusable else self.retired).extend(bufs)


class KVRank:
    """This rank's transfer engine (its pool registered once) and the commands' effects."""

    def __init__(
        self,
        options: DisaggregationOptions,
        scheduler: Scheduler,
        layout: PoolLayout,
        rank: int = 0,
        caches: Seq[torch.Tensor] = (),
    ) -> None:
        """``caches``: the pool's per-layer tensors (``layout`` describes them), which GQA
        needs to regroup heads between different tensor-parallel splits (``regroup.py``)."""
        self.scheduler = scheduler
        self.layout = layout
        self.caches = list(caches)
        self.rank = rank
        self.transport = MooncakeTransport(
            options.host, options.ib_device, options.transfer_timeout_s
        )
        self.transport.register(layout.layer_addrs, layout.pool_bytes)
        self.staging = StagingBuffers(self.transport)
        self._batches: dict[int, list[int]] = {}  # room -> this rank's batches for it
        self._staged: dict[int, list[torch.Tensor]] = {}  # room -> its staging buffers
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
            self.staging.give_back(self._staged.pop(room, ()), transfers[room] == DONE)
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
        for request_id, sources in cmds.get("unpack", ()):
            seq = self._parked(request_id)
            if seq is not None:
                regroup.unpack(
                    self.caches, self.layout, sources, seq.block_table, seq.num_prompt_tokens - 1
                )
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
        staged: list[torch.Tensor] = []
        try:
            for i in mine:
                target = send["targets"][i]
                writes = self._plan(
                    PoolLayout.from_json(target["layout"]), seq.block_table, send, staged
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
            self.staging.give_back(staged, reusable=False)
            self._failed.add(room)
            return
        if staged:
            self._staged[room] = staged
        self._batches[room] = batches
        logger.debug(
            "room %d: rank %d started %d batch(es) to %s",
            room,
            self.rank,
            len(batches),
            [send["targets"][i]["session"] for i in mine],
        )

    def _plan(self, dst: PoolLayout, table: list[int], send: dict, staged: list) -> Writes:
        """This rank's writes into ``dst``, by how its heads relate to the destination's
        (``regroup.py``): the same (or MLA) whole slots; more, gathered into a staging buffer
        (appended to ``staged``); fewer, packed (the control sent the decode side the
        ``sources`` to unpack them)."""
        n, blocks, src = send["num_tokens"], send["blocks"], self.layout
        check_tables(src, dst, table, blocks, n)
        lo, hi = dst.head_start, dst.head_start + dst.num_heads
        mine_lo, mine_hi = src.head_start, src.head_start + src.num_heads
        if src.kind != GQA or (mine_lo, mine_hi) == (lo, hi):
            return plan_writes(src, dst, table, blocks, n)
        if lo <= mine_lo and mine_hi <= hi:
            return regroup.plan_packed_writes(src, dst, table, blocks, n)
        if not (mine_lo <= lo and hi <= mine_hi):
            raise ValueError(
                f"this rank holds KV heads [{mine_lo}, {mine_hi}), neither within nor around "
                f"the decode rank's [{lo}, {hi})"
            )
        if not self.caches:
            raise ValueError("this rank was not given its pool's tensors to gather KV heads from")
        shape = regroup.staging_shape(src, dst, n)
        dtype = self.caches[0].dtype
        num_bytes = dtype.itemsize * torch.Size(shape).numel()
        buf = self.staging.take(num_bytes)
        staged.append(buf)
        out = buf[:num_bytes].view(dtype).view(shape)
        regroup.gather(self.caches, src, dst, table, n, out)
        return regroup.plan_gathered_writes(out.data_ptr(), dst, blocks, n)
