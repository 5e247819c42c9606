"""What losing ranks costs an instance under elastic expert parallelism, and the availability
that follows from a failure rate.

With ``--enable-elastic-ep`` a dead EP rank (one DP-attention replica: TP 1, PP 1) is survived:
the others detect it, re-form their process groups, reload the experts left without a live copy
and recompute the in-flight requests' KV. The service ends until the orchestrator restarts it
when rank 0 (API and coordinator) dies, when the survivors' slots cannot hold every expert, or
when their KV pools cannot take the dead replicas' requests. Formulas: docs/scaling.md,
"Availability under rank loss". Torch-free; each module imports only those listed above it::

    failure_model.py  FailureModel (every default with its source), failure units and domains
    placement.py      experts without a live copy under the contiguous placement (plain ints)
    loss.py           the cost of one survived loss, and of a full restart
    uptime.py         time fractions full / degraded / down over a renewal cycle
    redundancy.py     the redundant experts K losses need, and their bytes per rank
"""

from moeserve.planner.availability.failure_model import UNITS, FailureModel
from moeserve.planner.availability.loss import (
    LossCost,
    elastic_reason,
    loss_cost,
    restart_seconds,
)
from moeserve.planner.availability.placement import (
    expert_domains,
    missing_experts,
    missing_per_domain,
    slots_per_rank,
)
from moeserve.planner.availability.redundancy import (
    Redundancy,
    RedundancyOption,
    redundancy_needed,
)
from moeserve.planner.availability.uptime import Availability, availability

__all__ = [
    "UNITS",
    "Availability",
    "FailureModel",
    "LossCost",
    "Redundancy",
    "RedundancyOption",
    "availability",
    "elastic_reason",
    "expert_domains",
    "loss_cost",
    "missing_experts",
    "missing_per_domain",
    "redundancy_needed",
    "restart_seconds",
    "slots_per_rank",
]
