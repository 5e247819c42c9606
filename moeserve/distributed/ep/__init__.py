"""Expert parallelism: the slot placement of experts, token dispatchers, and the EP MoE step.

``make_dispatcher("local")`` for one rank, ``make_dispatcher("all_to_all", group)`` over a
process group; the implementations are imported on first use.
"""

from __future__ import annotations

from moeserve.distributed.ep.base import (
    Dispatched,
    Dispatcher,
    DispatchMeta,
    Pending,
    PendingCombine,
    PendingDispatch,
)
from moeserve.distributed.ep.moe_step import ep_moe_forward
from moeserve.distributed.ep.placement import ExpertPlacement

DISPATCHERS = ("local", "all_to_all")


def make_dispatcher(kind: str, group=None) -> Dispatcher:
    """The dispatcher named ``kind`` (one of :data:`DISPATCHERS`); ``all_to_all`` needs
    ``group``. Raises ValueError for an unknown kind."""
    if kind == "local":
        from moeserve.distributed.ep.local import LocalDispatcher

        return LocalDispatcher()
    if kind == "all_to_all":
        from moeserve.distributed.ep.all_to_all import AllToAllDispatcher

        return AllToAllDispatcher(group)
    raise ValueError(f"unknown dispatcher {kind!r}; choose one of {DISPATCHERS}")


__all__ = [
    "DISPATCHERS",
    "Dispatched",
    "DispatchMeta",
    "Dispatcher",
    "ExpertPlacement",
    "Pending",
    "PendingCombine",
    "PendingDispatch",
    "ep_moe_forward",
    "make_dispatcher",
]
