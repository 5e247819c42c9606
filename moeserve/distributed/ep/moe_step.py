"""One expert-parallel MoE layer step: dispatch, routed experts, combine, plus the shared expert
overlapped with the collectives.

Shape legend: T tokens on this rank, D model dim, F expert FFN dim, K top-k, R rows this rank
computes, S local slots.

Timeline on one rank (``|...|`` = collective in flight)::

    overlap=False   dispatch|...| experts combine|...| shared
    overlap=True    dispatch|.shared.| experts combine|...|
    two_batch=True  dispatch A|..  dispatch B|..  experts A  combine A|..  experts B
                    combine B|..  shared  wait A, B

With two micro-batches one computes while the other's rows travel, at the price of three more
collectives and of reading an expert's weights once per micro-batch: it pays off only for
large batches (benchmarks/moe_layer.py). Every rank issues the same collectives in the same
order whatever its T (T = 0 and odd T included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moeserve.distributed.ep.base import Dispatched, Dispatcher
from moeserve.distributed.ep.placement import ExpertPlacement

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]
SharedFn = Callable[[torch.Tensor], torch.Tensor]


def ep_moe_forward(
    x_TD: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    experts_fn: ExpertsFn,
    shared_fn: SharedFn | None,
    dispatcher: Dispatcher,
    placement: ExpertPlacement,
    overlap: bool = True,
    two_batch: bool = False,
) -> torch.Tensor:
    """Routed experts (through ``dispatcher``) plus ``shared_fn(x_TD)`` when given.

    ``experts_fn(x_RD, weight_R, slot_counts)`` returns each row's expert output already
    scaled by its weight, in row order; it is not called on a rank that received no rows
    (``ops.moe.experts_sorted`` or ``FusedExperts.compute_sorted`` fit). ``overlap`` runs
    the shared expert while the dispatch is in flight; ``two_batch`` splits the tokens in two
    halves (the second may be empty) and interleaves them, which implies ``overlap``.
    """
    if two_batch:
        return _two_batch(
            x_TD, topk_w_TK, topk_ids_TK, experts_fn, shared_fn, dispatcher, placement
        )
    pending = dispatcher.dispatch(x_TD, topk_w_TK, topk_ids_TK, placement)
    s_TD = shared_fn(x_TD) if (overlap and shared_fn is not None) else None
    d = pending.wait()
    y_TD = dispatcher.combine(_run_experts(experts_fn, d), d.meta).wait()
    if shared_fn is not None and s_TD is None:
        s_TD = shared_fn(x_TD)
    return y_TD if s_TD is None else y_TD + s_TD


def _two_batch(
    x_TD: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    experts_fn: ExpertsFn,
    shared_fn: SharedFn | None,
    dispatcher: Dispatcher,
    placement: ExpertPlacement,
) -> torch.Tensor:
    h = (x_TD.shape[0] + 1) // 2
    halves = [slice(0, h), slice(h, None)]
    pending = [
        dispatcher.dispatch(x_TD[s], topk_w_TK[s], topk_ids_TK[s], placement) for s in halves
    ]
    combines = []
    for p in pending:
        d = p.wait()
        combines.append(dispatcher.combine(_run_experts(experts_fn, d), d.meta))
    s_TD = shared_fn(x_TD) if shared_fn is not None else None
    y_TD = torch.cat([c.wait() for c in combines])
    return y_TD if s_TD is None else y_TD + s_TD


def _run_experts(experts_fn: ExpertsFn, d: Dispatched) -> torch.Tensor:
    if d.x_RD.shape[0] == 0:
        return torch.empty_like(d.x_RD)
    return experts_fn(d.x_RD, d.weight_R, d.slot_counts)
