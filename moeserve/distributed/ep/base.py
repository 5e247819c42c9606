"""The token dispatcher strategy: send each (token, expert) row to the rank holding the expert's
slot, and bring the expert outputs back.

Shape legend: T tokens on this rank, D model dim, K top-k, N = T*K rows this rank sends,
R rows this rank receives (and computes), S physical slots per rank.

One MoE layer on one rank::

    pending = dispatcher.dispatch(x_TD, topk_w_TK, topk_ids_TK, placement)
    ...                                  # free to compute (the shared expert) meanwhile
    d = pending.wait()                   # d.x_RD sorted by local slot, d.slot_counts[s] rows each
    y_RD = experts(d.x_RD, d.weight_R, d.slot_counts)   # already scaled by d.weight_R
    y_TD = dispatcher.combine(y_RD, d.meta).wait()      # sum over the K choices of each token

Every rank of the group calls ``dispatch`` and ``combine`` the same number of times in the same
order, whatever its T (T = 0 included): the collectives inside must line up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from moeserve.distributed.ep.placement import ExpertPlacement

_Result = TypeVar("_Result")


class Pending(Generic[_Result]):
    """A result whose collective may still be in flight. ``wait()`` blocks on the collective
    (``work``, None when there is none), runs ``finish`` once, and returns the cached result."""

    def __init__(self, work, finish: Callable[[], _Result]) -> None:
        self._work, self._finish = work, finish
        self._done, self._result = False, None

    def wait(self) -> _Result:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._done, self._work, self._finish = True, None, None
        return self._result  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class DispatchMeta:
    """What ``combine`` needs to bring the rows of one ``dispatch`` back.

    ``token_N``: source token of each sent row, in send order (grouped by destination rank).
    ``send_counts``/``recv_counts``: rows sent to / received from each rank of the group.
    ``order_R``: received row ``order_R[i]`` is row ``i`` of ``Dispatched.x_RD`` (slot order).
    """

    num_tokens: int
    token_N: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    order_R: torch.Tensor


@dataclass(frozen=True, eq=False)
class Dispatched:
    """The rows this rank computes: ``x_RD`` sorted by local slot, ``slot_counts[s]`` rows for
    local slot ``s`` (``len == S``), ``weight_R`` (fp32) the routing weight of each row."""

    x_RD: torch.Tensor
    weight_R: torch.Tensor
    slot_counts: tuple[int, ...]
    meta: DispatchMeta


PendingDispatch = Pending[Dispatched]
PendingCombine = Pending[torch.Tensor]


class Dispatcher(ABC):
    """Moves MoE rows between the ranks of one expert-parallel group."""

    @abstractmethod
    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_w_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        placement: ExpertPlacement,
    ) -> PendingDispatch:
        """Start sending row ``(t, k)`` (``x_TD[t]`` with weight ``topk_w_TK[t, k]``) to the slot
        ``placement.physical_ids`` picks for ``topk_ids_TK[t, k]``. ``x_TD`` keeps its dtype.
        Raises ValueError when the placement's ep_size is not this dispatcher's."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta) -> PendingCombine:
        """Start returning the weighted expert outputs ``y_RD`` (row order of
        ``Dispatched.x_RD``); ``wait()`` gives ``y_TD [T, D]``, the sum over each token's K
        rows (zeros for a token without rows), in ``y_RD``'s dtype."""


def check_ep_size(placement: ExpertPlacement, ep_size: int) -> None:
    if placement.ep_size != ep_size:
        raise ValueError(
            f"placement is cut for ep_size={placement.ep_size} but the dispatcher's group "
            f"has {ep_size} ranks; build the placement with ep_size={ep_size}"
        )
