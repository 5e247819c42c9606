"""What fails and how often: the failure assumptions and the failure domain a loss takes.

Failures come per node (``node_mtbf_hours``): a GPU fault kills the one rank on that GPU
(``rank_fault_fraction`` of failures), anything else (host, NIC, network, software) the whole
node, i.e. all its ranks at once. A *failure domain* is what one failure takes: a rank, or a
node's ``ranks_per_node`` consecutive EP ranks. Every default of :class:`FailureModel` names its
source in ``SOURCES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moeserve.planner.layout import Layout

UNITS = ("rank", "node")


@dataclass(frozen=True)
class FailureModel:
    """Failure assumptions. ``detect_s`` mixes a crash (the peers' gloo connection resets) and
    a hang or a lost host (the heartbeat's ``DEAD_AFTER_S``). ``restart_s`` None: derived as
    ``restart_fixed_s`` plus the node's weights read at ``checkpoint_read_gbs`` (hardware
    profiles have no storage figure yet)."""

    node_mtbf_hours: float = 6300.0
    rank_fault_fraction: float = 0.587
    crash_fraction: float = 0.5
    crash_detect_s: float = 0.1
    hang_detect_s: float = 10.0
    regroup_s: float = 0.05
    checkpoint_read_gbs: float = 5.0
    restart_fixed_s: float = 120.0
    restart_s: float | None = None
    rejoin_s: float | None = None
    period_days: float = 30.0

    SOURCES: ClassVar[dict[str, str]] = {
        "node_mtbf_hours": "Llama 3 report (arXiv 2407.21783) sec. 3.3.4: 419 unexpected "
        "interruptions in 54 days on 16,384 H100s = 2,048 nodes of 8, one per node every "
        "~6,300 h (training at full load; an inference fleet may fail less)",
        "rank_fault_fraction": "Llama 3 report table 5: 58.7% of those interruptions were GPU "
        "faults (one GPU, one rank); the rest counted as the whole node",
        "crash_fraction": "assumption: half of the failures crash (connection reset), half "
        "hang or take the host (found by the heartbeat)",
        "crash_detect_s": "assumption: the peers' next gloo call sees the reset",
        "hang_detect_s": "moeserve/launch/liveness.py DEAD_AFTER_S (10 s)",
        "regroup_s": "assumption: a new torch.distributed rendezvous on the same store (ms)",
        "checkpoint_read_gbs": "assumption: one NVMe Gen4 drive reads ~7 GB/s; 5 GB/s per "
        "node through safetensors; measure the checkpoint's filesystem and pass it",
        "restart_fixed_s": "assumption: reschedule, container start, process groups, warm-up "
        "(CUDA graphs) before the weights are read",
        "rejoin_s": "assumption: None, a replacement from the spare pool starts and loads as "
        "a restart does (restart_s); without spares, until the repair (hours)",
        "period_days": "reporting period",
    }

    def __post_init__(self) -> None:
        for name in ("node_mtbf_hours", "checkpoint_read_gbs", "period_days"):
            _check(name, getattr(self, name), lo=0.0, lo_ok=False)
        for name in ("rank_fault_fraction", "crash_fraction"):
            _check(name, getattr(self, name), lo=0.0, hi=1.0)
        for name in ("crash_detect_s", "hang_detect_s", "regroup_s", "restart_fixed_s"):
            _check(name, getattr(self, name), lo=0.0)
        for name in ("restart_s", "rejoin_s"):
            if getattr(self, name) is not None:
                _check(name, getattr(self, name), lo=0.0)

    @property
    def detect_s(self) -> float:
        cf = self.crash_fraction
        return cf * self.crash_detect_s + (1 - cf) * self.hang_detect_s


def _check(name: str, v: float, lo: float, hi: float | None = None, lo_ok: bool = True) -> None:
    bad = isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v)
    bad = bad or v < lo or (v == lo and not lo_ok) or (hi is not None and v > hi)
    if bad:
        rng = f"in [{lo:g}, {hi:g}]" if hi is not None else f"{'>=' if lo_ok else '>'} {lo:g}"
        raise ValueError(f"failure model: {name} must be {rng}, got {v!r}")


def domain_ranks(layout: Layout, unit: str) -> int:
    """EP ranks in one failure domain of ``unit`` (one of :data:`UNITS`) in ``layout``.
    Raises ValueError for an unknown unit or a node whose ranks do not divide EP."""
    if unit not in UNITS:
        raise ValueError(f"failure unit must be one of {', '.join(UNITS)}, got {unit!r}")
    group = 1 if unit == "rank" else layout.ranks_per_node
    if layout.ep % group:
        raise ValueError(f"a node's {group} ranks do not divide EP {layout.ep}")
    return group
