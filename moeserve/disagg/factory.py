"""The parts an engine's disaggregation mode asks for: a rank's end of the transfers, the
control, and both glued for one process."""

from __future__ import annotations

from moeserve.config import DisaggregationOptions
from moeserve.disagg.connector import Control, LocalConnector, RankInfo, pool_layout
from moeserve.disagg.decode import DecodeControl
from moeserve.disagg.prefill import PrefillControl
from moeserve.disagg.rank import KVRank
from moeserve.engine.scheduler import Scheduler
from moeserve.kvcache.pool import KVCachePool


def make_rank(
    options: DisaggregationOptions,
    scheduler: Scheduler,
    pool: KVCachePool,
    rank: int = 0,
    head_start: int = 0,
    total_heads: int = 0,
) -> KVRank | None:
    """This rank's end of the transfers (None when colocated). GQA: ``head_start`` is the
    first of the model's ``total_heads`` KV heads this rank's pool holds."""
    if not options.enabled:
        return None
    # fault the pool's pages in now: the transfer engine writes a peer's KV into them from
    # its receiving thread, where first touches ran the writes at a third of their speed
    # (benchmarks/pd_transfer.py)
    for cache in pool.caches:
        cache.fill_(0)
    return KVRank(options, scheduler, pool_layout(pool, head_start, total_heads), rank)


def make_control(
    options: DisaggregationOptions, ranks: list[RankInfo], model_dir: str
) -> Control | None:
    """The control of ``options.mode`` over ``ranks`` (None when colocated)."""
    if options.mode == "prefill":
        return PrefillControl(options, ranks, model_dir)
    if options.mode == "decode":
        return DecodeControl(options, ranks, model_dir)
    return None


def make_local_connector(
    options: DisaggregationOptions,
    scheduler: Scheduler,
    pool: KVCachePool,
    model_dir: str,
    head_start: int = 0,
    total_heads: int = 0,
) -> LocalConnector | None:
    """One process's control and rank (None when colocated)."""
    rank = make_rank(options, scheduler, pool, 0, head_start, total_heads)
    if rank is None:
        return None
    try:
        control = make_control(options, [RankInfo(0, 0, 0, **rank.describe())], model_dir)
    except BaseException:
        rank.close()
        raise
    return LocalConnector(control, rank)
