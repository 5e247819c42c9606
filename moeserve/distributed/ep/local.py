"""The dispatcher of a single expert-parallel rank: no communication, a sort by slot.

Shape legend: T tokens, D model dim, K top-k, N = T*K rows, R = N rows computed here.

It composes the sort and the combine of ``ops/moe.py`` (``sort_rows``, ``combine_rows``: the
C kernels for decode batches, torch for more), the same pair :func:`moe_grouped` uses; the
MoE layer of one process runs through it as an expert-parallel rank runs through
``AllToAllDispatcher``.
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
)
from moeserve.distributed.ep.placement import ExpertPlacement
from moeserve.ops.moe import combine_rows, sort_rows


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
        # slot e holds expert e (one process): the ids are the slots, checked by the sort
        slots_TK = topk_ids_TK if placement.is_identity else placement.physical_ids(topk_ids_TK)
        rows = sort_rows(slots_TK, topk_w_TK, x_TD, placement.num_physical)
        N = rows.token_R.numel()
        meta = DispatchMeta(x_TD.shape[0], rows.token_R, (N,), (N,), torch.arange(N))
        dispatched = Dispatched(rows.x_RD, rows.weight_R, rows.slot_counts, meta)
        return Pending(None, lambda: dispatched)

    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta) -> PendingCombine:
        y_TD = combine_rows(y_RD, meta.token_N, meta.num_tokens)
        return Pending(None, lambda: y_TD)
