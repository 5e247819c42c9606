"""The routers' rules in plain torch: DeepSeek-V3's grouped sigmoid routing (the reference of
``ops/cpu/fp32.c: moeserve_route_grouped_sigmoid``, which ``layers/moe.py: Router`` calls
first for few fp32 rows) and Qwen-MoE's softmax top-k.

Shape legend: T tokens, E experts, G groups, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_grouped_sigmoid(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (noaux_tc): sigmoid scores, group-limited top-k on score + bias.

    Groups are ranked by the sum of their two best biased scores; only the ``topk_group`` best
    groups may be chosen. Weights come from the unbiased scores. Returns (topk_w_TK fp32,
    topk_ids_TK).
    """
    scores_TE = logits_TE.sigmoid()
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    T, E = choice_TE.shape
    if n_group > 1 and topk_group < n_group:
        group_TG = choice_TE.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep_ids = group_TG.topk(topk_group, dim=-1, sorted=False)[1]
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, keep_ids, True)
        keep_TE = keep_TG.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    topk_ids_TK = choice_TE.topk(top_k, dim=-1, sorted=False)[1]
    topk_w_TK = scores_TE.gather(1, topk_ids_TK)
    if norm_topk_prob:
        topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_w_TK * scaling, topk_ids_TK


def route_softmax(
    logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE routing: softmax over all experts, top-k, optional renormalisation."""
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    topk_w_TK, topk_ids_TK = probs_TE.topk(top_k, dim=-1)
    if norm_topk_prob:
        topk_w_TK = topk_w_TK / topk_w_TK.sum(dim=-1, keepdim=True)
    return topk_w_TK, topk_ids_TK
