"""The routed experts of an MoE layer: rows sorted by expert through their gated FFNs.

Shape legend: T tokens, D model dim, F expert FFN dim, E expert slots, K top-k, R = T * K
(token, expert) rows.

:func:`moe_grouped` sorts the T*K pairs by expert (:func:`sort_rows`), runs
:func:`experts_sorted` (the weight format's one-call kernel, else one GEMM pair per expert that
has rows) and adds the rows back per token (:func:`combine_rows`); the dispatchers of
``distributed/ep/`` use the same sort and combine. :func:`moe_reference` is the one per-token
loop every expert path is tested against. For decode steps
:func:`bind_moe_decode` prebinds routing, sort, experts and combine as kernel calls
(``ops/cpu/moe_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.ops import formats
from moeserve.ops.cpu import moe_sort
from moeserve.ops.cpu.moe_decode import GroupedRouting, MoEDecodeCalls
from moeserve.ops.linear import BoundLinear, linear, linear_into


def moe_reference(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
) -> torch.Tensor:
    """Per-token, per-choice loop: the readable oracle for :func:`moe_grouped`."""
    F_ = w2_EDF.shape[2]
    y_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(topk_ids_TK.shape[1]):
            e = int(topk_ids_TK[t, k])
            gate, up = (w13_EFD[e] @ x_TD[t]).split(F_)
            y_TD[t] += topk_w_TK[t, k].to(x_TD.dtype) * (w2_EDF[e] @ (F.silu(gate) * up))
    return y_TD


def experts_sorted(
    x_RD: torch.Tensor,
    weight_R: torch.Tensor,
    slot_counts: list[int] | tuple[int, ...],
    w13_EFD,
    w2_EDF,
) -> torch.Tensor:
    """Rows already sorted by expert: the first ``slot_counts[0]`` rows go to expert 0, the
    next ``slot_counts[1]`` to expert 1, and so on. Returns each row's expert output times its
    ``weight_R``, in the same order: one call of the weights' format where its kernel takes
    them, else one GEMM pair per expert that has rows (each ``linear`` run by the format:
    w8a8_int8 weights round the rows and the hidden per row there)."""
    if x_RD.shape[0] == 0:
        return torch.empty_like(x_RD)
    experts = [e for e, n in enumerate(slot_counts) if n]
    counts = [slot_counts[e] for e in experts]
    fmt = formats.of(w13_EFD)
    if formats.of(w2_EDF) is fmt:
        y_RD = fmt.moe_experts(x_RD, experts, counts, w13_EFD, w2_EDF, weight_R)
        if y_RD is not None:
            return y_RD
    y_RD = torch.empty_like(x_RD)
    F2 = w13_EFD.shape[1]
    start = 0
    for e, n in zip(experts, counts):
        end = start + n
        gate, up = linear(x_RD[start:end], w13_EFD[e]).split(F2 // 2, dim=-1)
        linear_into(F.silu(gate) * up, w2_EDF[e], out=y_RD[start:end])
        start = end
    return y_RD.mul_(weight_R.unsqueeze(1).to(y_RD.dtype))


# tokens up to which a sort or combine runs in its C call (decode batches: one call instead of
# five torch ops); more (prefill) take torch's multi-threaded gather and index_add_
SORT_KERNEL_TOKENS = 128


@dataclass(frozen=True, eq=False)
class SortedRows:
    """The T*K (token, choice) rows in stable order of their slot: ``slot_counts[s]`` rows go
    to slot ``s``; row ``r`` is token ``token_R[r]``'s ``x_TD`` row with routing weight
    ``weight_R[r]`` (fp32)."""

    slot_counts: tuple[int, ...]
    token_R: torch.Tensor
    weight_R: torch.Tensor
    x_RD: torch.Tensor


def sort_rows(
    ids_TK: torch.Tensor, w_TK: torch.Tensor, x_TD: torch.Tensor, num_slots: int
) -> SortedRows:
    """Sort the (token, choice) rows by slot ``ids_TK`` (stable) and gather their rows: the C
    kernel (``ops/cpu/moe_sort.c``, one thread) for up to ``SORT_KERNEL_TOKENS`` fp32 tokens
    on the CPU, else its reference, a stable argsort and torch's gather; the same rows either
    way. Raises ValueError for a slot outside ``[0, num_slots)``."""
    few = x_TD.shape[0] <= SORT_KERNEL_TOKENS
    fast = moe_sort.moe_sort(ids_TK, w_TK, x_TD, num_slots) if few else None
    sort = fast if fast is not None else moe_sort.moe_sort_ref(ids_TK, w_TK, x_TD, num_slots)
    meta, token_R, weight_R, x_RD = sort
    counts = [0] * num_slots
    for s, n in zip(meta[0].tolist(), meta[2].tolist()):
        counts[s] = n
    return SortedRows(tuple(counts), token_R, weight_R, x_RD)


def combine_rows(y_RD: torch.Tensor, token_R: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``y_TD [num_tokens, D]``: each token's rows of ``y_RD`` added up in row order with fp32
    sums (the C kernel for fp32 rows of up to ``SORT_KERNEL_TOKENS`` tokens on the CPU, else
    ``index_add_``), in ``y_RD``'s dtype; a
    token without rows gets zeros. The decode calls (``ops/cpu/moe_decode.py``) add up in
    the same order, so the two agree bit for bit (``y_RD.sum(0)``, which this took for one
    token, adds up in another order when there are many rows: 33 here)."""
    few = num_tokens <= SORT_KERNEL_TOKENS
    fast = moe_sort.moe_combine(y_RD, token_R, num_tokens) if few else None
    return fast if fast is not None else moe_sort.moe_combine_ref(y_RD, token_R, num_tokens)


def moe_grouped(
    x_TD: torch.Tensor,
    w13_EFD,
    w2_EDF,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert (:func:`sort_rows`), one call or one GEMM pair per
    active expert (:func:`experts_sorted`), the weighted rows added back per token
    (:func:`combine_rows`): what the single-process dispatcher (``distributed/ep/local.py``)
    composes too.

    ``w13_EFD`` holds gate rows then up rows (``[E, 2F, D]``), ``w2_EDF`` is ``[E, D, F]``.
    Expert ids must lie in ``[0, E)``.
    """
    rows = sort_rows(topk_ids_TK, topk_w_TK, x_TD, w13_EFD.shape[0])
    y_RD = experts_sorted(rows.x_RD, rows.weight_R, rows.slot_counts, w13_EFD, w2_EDF)
    return combine_rows(y_RD, rows.token_R, x_TD.shape[0])


def bind_moe_decode(
    gate_weight_ED: torch.Tensor,
    routing: GroupedRouting,
    bias_E: torch.Tensor | None,
    counts_E: torch.Tensor,
    w13_EFD,
    w2_EDF,
    extra: int = -1,
) -> MoEDecodeCalls | None:
    """The decode step of one MoE layer (fp32 router ``gate_weight_ED``, DeepSeek's grouped
    routing, the experts ``w13_EFD``/``w2_EDF`` of one format; ``extra``: the slot every
    token also goes to, or -1) as prebound kernel calls; None where they do not apply."""
    if gate_weight_ED.dtype != torch.float32:
        return None
    fmt = formats.of(w13_EFD)
    experts = fmt.bind_moe(w13_EFD, w2_EDF) if formats.of(w2_EDF) is fmt else None
    gate = BoundLinear(gate_weight_ED)
    shape = tuple(w13_EFD.shape)
    return MoEDecodeCalls.bind(gate, routing, bias_E, counts_E, experts, shape, extra)
