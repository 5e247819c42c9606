"""The connector an engine's disaggregation mode asks for."""

from __future__ import annotations

from moeserve.config import DisaggregationOptions
from moeserve.disagg.connector import Connector
from moeserve.disagg.decode import DecodeConnector
from moeserve.disagg.prefill import PrefillConnector
from moeserve.engine.scheduler import Scheduler
from moeserve.kvcache.pool import KVCachePool


def make_connector(
    options: DisaggregationOptions, scheduler: Scheduler, pool: KVCachePool, model_dir: str
) -> Connector | None:
    """The connector of ``options.mode`` (None when colocated)."""
    if options.mode == "prefill":
        return PrefillConnector(options, scheduler, pool, model_dir)
    if options.mode == "decode":
        return DecodeConnector(options, scheduler, pool, model_dir)
    return None
