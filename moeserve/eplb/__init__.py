"""Expert-parallel load balancing (EPLB): measured expert load and redundant-expert placement,
a policy over the EP mesh below it (``moeserve.distributed.ep``: the slot tables, the choice of
a replica per routed token, moving experts). Pure functions and plain data; the engine calls
them.

- ``algorithm``: :func:`rebalance_experts` (placement from load), :func:`rank_load`,
  :func:`imbalance`, :func:`placement_tables`
- ``balancer``: :class:`ExpertBalancer` (an engine's statistics, initial placement and live
  re-placement of the MoE blocks the engine hands it; imported from ``moeserve.eplb.balancer``,
  it pulls in the EP mesh's expert migration)
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
    "balanced_packing",
    "imbalance",
    "load_expert_location",
    "placement_tables",
    "rank_load",
    "rebalance_experts",
    "replicate",
    "save_expert_stats",
    "save_placement",
]
