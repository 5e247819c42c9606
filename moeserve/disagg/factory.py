"""The parts an engine's disaggregation mode asks for: a rank's end of the transfers, the
control, and both glued for one process."""

from __future__ import annotations

import dataclasses

from moeserve.config import DisaggregationOptions
from moeserve.disagg.connector import (
    Control,
    LocalConnector,
    NotDrainedError,
    RankInfo,
    pool_layout,
)
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
    layout = pool_layout(pool, head_start, total_heads)
    return KVRank(options, scheduler, layout, rank, pool.caches)


def make_control(
    options: DisaggregationOptions, ranks: list[RankInfo], model_dir: str
) -> Control | None:
    """The control of ``options.mode`` over ``ranks`` (None when colocated)."""
    if options.mode == "prefill":
        return PrefillControl(options, ranks, model_dir)
    if options.mode == "decode":
        return DecodeControl(options, ranks, model_dir)
    return None


def check_switch(current_mode: str, new_mode: str) -> None:
    """Raise ValueError unless an instance (or a rank) in ``current_mode`` may take the role
    ``new_mode``: a colocated instance ("null") never switches, and the role must be
    "prefill" or "decode" (the current one is allowed: a switch that changes nothing)."""
    if current_mode == "null":
        raise ValueError(
            "this instance serves colocated: only one started with --disaggregation-mode "
            "prefill or decode can switch roles"
        )
    if new_mode not in ("prefill", "decode"):
        raise ValueError(f"the role must be 'prefill' or 'decode', got {new_mode!r}")


def switch_control(control: Control, mode: str, model_dir: str) -> Control:
    """A control of role ``mode`` over the same ranks, in place of ``control``, which must
    have nothing in flight (the instance drained first: ``has_pending`` is False). The new
    one is made before the old one closes, so a failure (say, the bootstrap port of a new
    prefill role taken) leaves ``control`` serving; its counters carry over, as Prometheus
    counters must never go down. Returns ``control`` itself when it already has the role.
    Raises ValueError for a bad ``mode`` (:func:`check_switch`), NotDrainedError for a busy
    control."""
    check_switch(control.role, mode)
    if mode == control.role:
        return control
    if control.has_pending():
        raise NotDrainedError("KV transfers are still in flight: drain the instance first")
    options = dataclasses.replace(control.options, mode=mode)
    new = make_control(options, control.ranks, model_dir)
    new.stats = control.stats
    control.close()
    return new


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
