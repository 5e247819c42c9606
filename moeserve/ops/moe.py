"""The routed experts of an MoE layer: rows sorted by expert through their gated FFNs.

Shape legend: T tokens, D model dim, F expert FFN dim, E expert slots, K top-k, R = T * K
(token, expert) rows.

:func:`moe_grouped` sorts the T*K pairs by expert, runs :func:`experts_sorted` (the weight
format's one-call kernel, else one GEMM pair per expert that has rows) and adds the rows back
per token; :func:`moe_reference` is the per-token loop used as the oracle. For decode steps
:func:`bind_moe_decode` prebinds routing, sort, experts and combine as kernel calls
(``ops/cpu/moe_decode.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops import formats
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


def moe_grouped(
    x_TD: torch.Tensor,
    w13_EFD,
    w2_EDF,
    topk_w_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert, one GEMM pair per active expert, weighted scatter.

    ``w13_EFD`` holds gate rows then up rows (``[E, 2F, D]``), ``w2_EDF`` is ``[E, D, F]``.
    Expert ids must lie in ``[0, E)``.
    """
    T, K = topk_ids_TK.shape
    E = w13_EFD.shape[0]
    ids_R = topk_ids_TK.reshape(-1)
    if T == 1:
        # decode at batch 1: K experts, one row each; distinct, so sorting them is free
        ids = ids_R.tolist()
        order = sorted(range(K), key=ids.__getitem__)
        counts_E = [0] * E
        for e in ids:
            counts_E[e] += 1
        x_RD = x_TD.expand(K, x_TD.shape[1]).contiguous()
        weight_R = topk_w_TK.reshape(-1)[order]
        return experts_sorted(x_RD, weight_R, counts_E, w13_EFD, w2_EDF).sum(dim=0, keepdim=True)
    order_R = ids_R.argsort(stable=True)
    counts_E = torch.bincount(ids_R, minlength=E).tolist()
    token_R = order_R // K
    x_RD = x_TD.index_select(0, token_R)
    weight_R = topk_w_TK.reshape(-1)[order_R]
    y_RD = experts_sorted(x_RD, weight_R, counts_E, w13_EFD, w2_EDF)
    return torch.zeros_like(x_TD).index_add_(0, token_R, y_RD)


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
