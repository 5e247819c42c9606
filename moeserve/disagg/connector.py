"""What both roles of prefill/decode disaggregation share: the rule for which requests move
their KV, the counters, the pool's layout, the control's base, and the one-process glue.

An instance has one control (``prefill.PrefillControl`` or ``decode.DecodeControl``: the
bootstrap protocol, per room) and one :class:`~moeserve.disagg.rank.KVRank` per rank that
holds a KV pool (the transfer engine, the writes). One process runs both through
:class:`LocalConnector`, around each step (``engine/engine.py``)::

    connector.poll()            events -> control -> commands applied here: messages,
                                finished transfers, timeouts reach the scheduler
    batch = scheduler.schedule()
    connector.poll()            what the schedule parked (decode: ask for the KV now, so the
                                prefill side writes while this instance computes)
    ... the step ...
    connector.poll()            what the step parked (prefill: start writing at once)

An engine group runs the control on world rank 0 and carries commands and events on its step
messages (``launch/engine_group.py``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moeserve.config import DisaggregationOptions
from moeserve.core import SamplingParams, Sequence
from moeserve.disagg.layout import GQA, MLA, PoolLayout
from moeserve.disagg.rank import KVRank
from moeserve.kvcache.pool import KVCachePool

logger = logging.getLogger(__name__)

# how long the blocks of a transfer that failed without the other side's word stay out of
# use, in case a write already on the wire still lands in them
LATE_WRITE_GRACE_S = 2.0
# upper bounds (seconds) of the transfer-latency histogram's buckets
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NotDrainedError(ValueError):
    """An instance cannot switch roles yet: requests or KV transfers are still in flight."""


def moves_kv(prompt_ids: list[int], params: SamplingParams) -> bool:
    """Whether a request with bootstrap fields moves its KV from the prefill instance (both
    sides decide alike, from the same request): not for a one-token prompt (nothing to send:
    the decode side computes it), prompt logprobs (the decode side needs every prompt
    position's logits) or several samples (the decode side computes such a request itself)."""
    return (
        params.kv_transfer is not None
        and len(prompt_ids) >= 2
        and params.prompt_logprobs is None
        and params.n == 1
    )


@dataclass
class TransferStats:
    """Cumulative counters of this instance's KV transfers, for ``/metrics``: on a prefill
    instance from the batch's start to its completion, on a decode instance from the ``want``
    to the ``done`` (which includes the prefill side's queue and compute)."""

    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    tokens: int = 0
    seconds_sum: float = 0.0
    # observations per bucket of LATENCY_BUCKETS (not cumulative), the last one for +Inf
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, seconds: float, num_bytes: int, num_tokens: int) -> None:
        self.transfers += 1
        self.bytes += num_bytes
        self.tokens += num_tokens
        self.seconds_sum += seconds
        i = next((k for k, le in enumerate(LATENCY_BUCKETS) if seconds <= le), -1)
        self.bucket_counts[i] += 1

    def to_json(self) -> dict:
        return {
            "transfers": self.transfers,
            "failures": self.failures,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "seconds_sum": self.seconds_sum,
            "buckets": list(LATENCY_BUCKETS),
            "bucket_counts": list(self.bucket_counts),
        }


@dataclass(frozen=True)
class RankInfo:
    """A rank that holds a KV pool, as the control sees it: its DP replica, its place in the
    replica's tensor-parallel group, and what :meth:`KVRank.describe` said."""

    rank: int
    replica: int
    tp_rank: int
    session: str
    layout: dict

    @property
    def target(self) -> dict:
        return {"session": self.session, "layout": self.layout}


def pool_layout(pool: KVCachePool, head_start: int = 0, total_heads: int = 0) -> PoolLayout:
    """The layout of this process's pool: MLA's latent (one vector per token) or GQA's
    ``[2, heads, head_dim]`` (this process's heads ``head_start ..`` of ``total_heads``)."""
    shape = pool.spec.token_shape
    kind = GQA if len(shape) == 3 else MLA
    if kind == GQA and not total_heads:
        total_heads = shape[1]
    return PoolLayout.of_pool(pool.caches, pool.block_size, kind, head_start, total_heads)


class Control:
    """The protocol's state on one instance; :class:`~moeserve.disagg.prefill.PrefillControl`
    and :class:`~moeserve.disagg.decode.DecodeControl` add each role's part."""

    role = "null"

    def __init__(
        self,
        options: DisaggregationOptions,
        ranks: list[RankInfo],
        model_dir: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.clock = clock
        self.timeout_s = options.transfer_timeout_s
        self.model_hash = hashlib.sha256(Path(model_dir, "config.json").read_bytes()).hexdigest()
        self.stats = TransferStats()
        self.ranks = ranks
        self.replicas: dict[int, list[RankInfo]] = {}
        for info in sorted(ranks, key=lambda r: (r.replica, r.tp_rank)):
            self.replicas.setdefault(info.replica, []).append(info)

    def on_add(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        """A request with bootstrap fields whose KV moves was queued (``moves_kv``)."""

    def poll(self, events: list[dict]) -> dict:
        """Every rank's events (leaders' parked and quarantined sequences count) -> the
        commands every rank applies next (``rank.py``)."""
        raise NotImplementedError

    def has_pending(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> None:
        """Sleep until a bootstrap message may have come, at most ``timeout_s``."""
        time.sleep(timeout_s)

    def close(self) -> None:
        """Close the bootstrap sockets."""

    def info(self) -> dict:
        """What ``/server_info`` says of this instance's role."""
        return {"disaggregation_mode": self.role, "disaggregation_transfer_backend": "mooncake"}

    def leaders(self, events: list[dict], key: str) -> list[tuple[RankInfo, object]]:
        """The ``key`` entries of the replica leaders' events, each with its rank (a
        replica's other ranks park the same sequences in the same step)."""
        return [
            (info, entry)
            for info, ev in zip(self.ranks, events)
            if info.tp_rank == 0
            for entry in ev.get(key, ())
        ]

    def on_abort(self, request_id: str) -> None:
        """The request was aborted on this instance (its client left)."""


class LocalConnector:
    """One process's control and rank, glued: what :class:`~moeserve.engine.engine.LLMEngine`
    calls (the module docstring)."""

    def __init__(self, control: Control, rank: KVRank) -> None:
        self.control = control
        self.rank = rank

    @property
    def role(self) -> str:
        return self.control.role

    @property
    def stats(self) -> TransferStats:
        return self.control.stats

    def on_add(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.control.on_add(request_id, params, prompt_ids)

    def on_abort(self, request_id: str) -> None:
        self.control.on_abort(request_id)

    def poll(self) -> list[Sequence]:
        return self.rank.apply(self.control.poll([self.rank.events()]))

    def has_pending(self) -> bool:
        return self.control.has_pending() or self.rank.sending

    def wait(self, timeout_s: float) -> None:
        self.control.wait(timeout_s)

    def info(self) -> dict:
        return self.control.info()

    def close(self) -> None:
        self.control.close()
        self.rank.close()
