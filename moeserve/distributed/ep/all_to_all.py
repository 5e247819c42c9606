"""The all-to-all dispatcher: rows travel with ``all_to_all_single`` over an explicit group.

Shape legend: T tokens on this rank, D model dim, K top-k, N = T*K rows sent,
R rows received, S slots per rank, B bytes of one packed row.

dispatch = two collectives: the per-destination row counts (int64, synchronous), then the rows
with uneven splits (async). Each row carries its routing weight and destination local slot, so
the rows, weights and slots cross in one message; a row is packed as bytes::

    | x_D in the model dtype | pad to 8 B | weight fp32 | local slot int32 |
    0                        xb           xpad         xpad+4             B = xpad+8

combine = one async collective with the reverse splits; ``wait()`` scatter-adds the returned
(already weighted) rows into ``y_TD``. gloo handles uneven splits only in the single-tensor
form: the list form ``all_to_all`` with uneven sizes fails there, so it is not used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def _row_layout(D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(xb, xpad, B)``: bytes of x, offset of the weight, bytes of one packed row."""
    xb = D * torch.empty(0, dtype=dtype).element_size()
    xpad = -(-xb // 8) * 8
    return xb, xpad, xpad + 8


def _pack(x_ND: torch.Tensor, weight_N: torch.Tensor, slot_N: torch.Tensor) -> torch.Tensor:
    N, D = x_ND.shape
    xb, xpad, B = _row_layout(D, x_ND.dtype)
    buf_NB = torch.empty(N, B, dtype=torch.uint8, device=x_ND.device)
    buf_NB[:, :xb].view(x_ND.dtype).copy_(x_ND)
    buf_NB[:, xpad : xpad + 4].view(torch.float32).copy_(weight_N.unsqueeze(1))
    buf_NB[:, xpad + 4 :].view(torch.int32).copy_(slot_N.unsqueeze(1))
    return buf_NB


def _unpack(
    buf_RB: torch.Tensor, D: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``(x_RD, weight_R, slot_R)`` into a packed buffer (not contiguous)."""
    xb, xpad, _ = _row_layout(D, dtype)
    return (
        buf_RB[:, :xb].view(dtype),
        buf_RB[:, xpad : xpad + 4].view(torch.float32).squeeze(1),
        buf_RB[:, xpad + 4 :].view(torch.int32).squeeze(1),
    )


class AllToAllDispatcher(Dispatcher):
    """Expert parallelism over ``group`` (gloo or any backend with uneven
    ``all_to_all_single``); the placement's ``ep_size`` must equal the group's size and
    rank ``r`` of the group owns slots ``[r*S, (r+1)*S)``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        if group is None:
            raise ValueError("AllToAllDispatcher needs an explicit process group, got None")
        self.group = group
        self.rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_w_TK: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        placement: ExpertPlacement,
    ) -> PendingDispatch:
        check_ep_size(placement, self.ep_size)
        T = topk_ids_TK.shape[0]
        D, dtype, S = x_TD.shape[1], x_TD.dtype, placement.slots_per_rank
        # the rows sorted by physical slot (rank-major): grouped by destination rank
        phys_TK = placement.physical_ids(topk_ids_TK, own_rank=self.rank)
        rows = sort_rows(phys_TK, topk_w_TK, x_TD, placement.num_physical)
        token_N, counts_P = rows.token_R, torch.tensor(rows.slot_counts, device=x_TD.device)

        send_E = counts_P.view(self.ep_size, S).sum(dim=1)
        recv_E = torch.empty_like(send_E)
        dist.all_to_all_single(recv_E, send_E, group=self.group)
        send, recv = tuple(send_E.tolist()), tuple(recv_E.tolist())

        local_N = (
            torch.arange(S, device=x_TD.device).repeat(self.ep_size).repeat_interleave(counts_P)
        )
        buf_NB = _pack(rows.x_RD, rows.weight_R, local_N)
        buf_RB = torch.empty(sum(recv), buf_NB.shape[1], dtype=torch.uint8, device=x_TD.device)
        work = dist.all_to_all_single(
            buf_RB, buf_NB, list(recv), list(send), group=self.group, async_op=True
        )

        def finish() -> Dispatched:
            x_RD, weight_R, slot_R = _unpack(buf_RB, D, dtype)
            # rows arrive grouped by source rank, each group in slot order: sort by slot
            order_R = slot_R.argsort(stable=True)
            counts = torch.bincount(slot_R.long(), minlength=S).tolist()
            meta = DispatchMeta(T, token_N, send, recv, order_R)
            return Dispatched(x_RD.index_select(0, order_R), weight_R[order_R], tuple(counts), meta)

        return Pending(work, finish)

    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta) -> PendingCombine:
        # back to arrival order, then each row returns to the rank that sent it
        y_recv_RD = torch.empty_like(y_RD).index_copy_(0, meta.order_R, y_RD)
        y_ND = y_RD.new_empty(sum(meta.send_counts), y_RD.shape[1])
        work = dist.all_to_all_single(
            y_ND,
            y_recv_RD,
            list(meta.send_counts),
            list(meta.recv_counts),
            group=self.group,
            async_op=True,
        )
        return Pending(work, lambda: combine_rows(y_ND, meta.token_N, meta.num_tokens))
