"""What both ends of prefill/decode disaggregation share: the pool's layout, the transfer
engine, the rule for which requests move their KV, and the counters.

An engine in ``prefill`` or ``decode`` mode holds one connector (``factory.make_connector``) and
calls it around each step (``engine/engine.py``)::

    connector.poll()            messages, finished transfers, timeouts -> the scheduler
    batch = scheduler.schedule()
    connector.poll()            what the schedule parked (decode: ask for the KV now, so the
                                prefill side can write while this instance computes)
    ... the step ...
    connector.poll()            what the step parked (prefill: start writing at once)

``poll`` returns the sequences it finished (sent, failed), for the engine's outputs.
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
from moeserve.disagg.mooncake import MooncakeTransport
from moeserve.engine.scheduler import Scheduler
from moeserve.kvcache.pool import KVCachePool

logger = logging.getLogger(__name__)

# how long the blocks of a transfer that failed without the other side's word stay out of
# use, in case a write already on the wire still lands in them
LATE_WRITE_GRACE_S = 2.0


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


# upper bounds (seconds) of the transfer-latency histogram's buckets
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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


class Connector:
    """The parts both roles share; :class:`PrefillConnector` and :class:`DecodeConnector`
    add the protocol."""

    role = "null"

    def __init__(
        self,
        options: DisaggregationOptions,
        scheduler: Scheduler,
        pool: KVCachePool,
        model_dir: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.scheduler = scheduler
        self.clock = clock
        self.timeout_s = options.transfer_timeout_s
        self.layout = pool_layout(pool)
        self.model_hash = hashlib.sha256(Path(model_dir, "config.json").read_bytes()).hexdigest()
        self.transport = MooncakeTransport(options.host, options.ib_device)
        self.transport.register(self.layout.layer_addrs, self.layout.pool_bytes)
        self.stats = TransferStats()

    def on_add(self, seq: Sequence) -> None:
        """A sequence with a role was queued."""

    def poll(self) -> list[Sequence]:
        raise NotImplementedError

    def has_pending(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> None:
        """Sleep until a bootstrap message may have come, at most ``timeout_s``."""
        time.sleep(timeout_s)

    def close(self) -> None:
        self.transport.close()

    def info(self) -> dict:
        """What ``/server_info`` says of this instance's role."""
        return {
            "disaggregation_mode": self.role,
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_protocol": self.transport.protocol,
            "disaggregation_session": self.transport.session_id,
        }


def pool_layout(pool: KVCachePool, head_start: int = 0, total_heads: int = 0) -> PoolLayout:
    """The layout of this process's pool: MLA's latent (one vector per token) or GQA's
    ``[2, heads, head_dim]`` (this process's heads ``head_start ..`` of ``total_heads``)."""
    shape = pool.spec.token_shape
    kind = GQA if len(shape) == 3 else MLA
    if kind == GQA and not total_heads:
        total_heads = shape[1]
    return PoolLayout.of_pool(pool.caches, pool.block_size, kind, head_start, total_heads)
