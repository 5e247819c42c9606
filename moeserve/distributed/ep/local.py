"""The dispatcher of a single expert-parallel rank: no communication, a sort by slot.

Shape legend: T tokens, D model dim, K top-k, N = T*K rows, R = N rows computed here.
"""

from __future__ import annotations

import torch

from moeserve.distributed.ep.base import (
    Dispatched,
    Dispatcher,
    DispatchMeta,
    Pending,
    PendingCombine,
    PendingDispatch,
    check_ep_size,
    scatter_rows,
    sort_by_slot,
)
from moeserve.distributed.ep.placement import ExpertPlacement


class LocalDispatcher(Dispatcher):
    """EP size 1: every slot is local, rows are only reordered."""

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_w_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        placement: ExpertPlacement,
    ) -> PendingDispatch:
        check_ep_size(placement, 1)
        T, K = topk_ids_TK.shape
        order_N, slot_N = sort_by_slot(topk_ids_TK, placement)
        token_N = order_N // K
        N = order_N.numel()
        meta = DispatchMeta(T, token_N, (N,), (N,), torch.arange(N))
        dispatched = Dispatched(
            x_RD=x_TD.index_select(0, token_N),
            weight_R=topk_w_TK.reshape(-1).float()[order_N],
            slot_counts=tuple(torch.bincount(slot_N, minlength=placement.slots_per_rank).tolist()),
            meta=meta,
        )
        return Pending(None, lambda: dispatched)

    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta) -> PendingCombine:
        y_TD = scatter_rows(y_RD, meta.token_N, meta.num_tokens)
        return Pending(None, lambda: y_TD)
