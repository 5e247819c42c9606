"""Expert-parallel load balancing (EPLB): measured expert load, redundant-expert placement and
the choice of a replica per routed token. Pure functions and plain data; the EP dispatcher
and the engine call them.

- ``algorithm``: :func:`rebalance_experts` (placement from load), :func:`rank_load`,
  :func:`imbalance`, :func:`placement_tables`
- ``replica``: :class:`ReplicaTable` / :func:`select_replicas` (the physical slot serving
  each routed choice)
- ``balancer``: :class:`ExpertBalancer` (an engine's statistics, initial placement and live
  re-placement; imported from ``moeserve.eplb.balancer``, it pulls in the EP layers)
- ``stats``: :class:`ExpertLoadStats` (sliding-window token counts) and the stats / placement
  files (:func:`save_expert_stats`, :func:`save_placement`, :func:`load_expert_location`)
"""

from __future__ import annotations

from moeserve.eplb.algorithm import (
    balanced_packing,
    imbalance,
    placement_tables,
    rank_load,
    rebalance_experts,
    replicate,
)
from moeserve.eplb.replica import ReplicaTable, select_replicas
from moeserve.eplb.stats import (
    ExpertLoadStats,
    ExpertPlacementFile,
    ExpertStatsFile,
    load_expert_location,
    save_expert_stats,
    save_placement,
)

__all__ = [
    "ExpertLoadStats",
    "ExpertPlacementFile",
    "ExpertStatsFile",
    "ReplicaTable",
    "balanced_packing",
    "imbalance",
    "load_expert_location",
    "placement_tables",
    "rank_load",
    "rebalance_experts",
    "replicate",
    "save_expert_stats",
    "save_placement",
    "select_replicas",
]
