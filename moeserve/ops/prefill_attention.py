"""Causal attention of a prefill chunk.

Shape legend: H heads, G kv heads, T queries (the last T of the L context positions), L keys,
K q/k head dim, V value head dim, Q a block of queries, D1 and D2 the two parts of a key.

:func:`causal_attention_parts` is what the layers call: keys given as two parts (MLA's
per-head k_nope and its k_pe shared by all heads; GQA's keys alone) and kv heads shared by
groups of query heads. On a CPU with AVX-512F it runs the kernel of
``ops/cpu/prefill_attention.c`` (packed key panels, no concatenated or repeated copies).
Otherwise it builds per-head keys and values and calls :func:`causal_attention`.

On CPU, torch's ``scaled_dot_product_attention`` runs at ~70 GFLOP/s here and computes the
masked half of the square too. :func:`causal_attention`, the blocked form, takes blocks of Q
queries; each block multiplies only against the keys it can see (MKL ``bmm``), masks its
diagonal part, softmaxes in place and multiplies by the values: 3x faster at 512 tokens and
4x at 2048 on this machine (docs/benchmarks.md). Elsewhere (CUDA) SDPA with the same mask is
used; it is also the reference (:func:`causal_attention_ref`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import prefill_attention as kernel

_SCORE_ELEMS = 1 << 22  # fp32 scores per block (16 MB): bounds the block at long contexts


def causal_bias(
    num_q: int, context_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """[num_q, context_len] additive mask for queries at positions ``context_len - num_q ..``."""
    if num_q == 1:
        return None
    offset = context_len - num_q
    q_pos = torch.arange(num_q, device=device)[:, None] + offset
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = torch.zeros(num_q, context_len, dtype=dtype, device=device)
    return mask.masked_fill_(k_pos > q_pos, float("-inf"))


def causal_attention_ref(
    q_HTK: torch.Tensor, k_HLK: torch.Tensor, v_HLV: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with the causal mask of queries at positions ``L - T .. L - 1``; ``[H, T, V]``."""
    T, L = q_HTK.shape[1], k_HLK.shape[1]
    mask = causal_bias(T, L, q_HTK.dtype, q_HTK.device)
    return F.scaled_dot_product_attention(q_HTK, k_HLK, v_HLV, attn_mask=mask, scale=scale)


def causal_attention(
    q_HTK: torch.Tensor, k_HLK: torch.Tensor, v_HLV: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[H, T, V]`` attention of the T queries over the keys each may see (causal)."""
    if q_HTK.device.type != "cpu" or q_HTK.dtype != torch.float32 or q_HTK.shape[1] == 1:
        return causal_attention_ref(q_HTK, k_HLK, v_HLV, scale)
    H, T, _ = q_HTK.shape
    L = k_HLK.shape[1]
    offset = L - T  # positions of the cached prefix before the first query
    block = max(16, min(128, _SCORE_ELEMS // max(1, H * L)))
    out_HTV = q_HTK.new_empty(H, T, v_HLV.shape[2])
    k_HKL = k_HLK.transpose(1, 2)
    for s in range(0, T, block):
        e = min(T, s + block)
        end = offset + e  # keys visible to the block's last query
        scores_HQL = torch.bmm(q_HTK[:, s:e], k_HKL[:, :, :end]).mul_(scale)
        # in the block's diagonal part, query offset + i sees keys up to offset + i
        q_pos = torch.arange(offset + s, end, device=q_HTK.device)[:, None]
        k_pos = torch.arange(offset + s, end, device=q_HTK.device)[None, :]
        scores_HQL[:, :, offset + s :].masked_fill_(k_pos > q_pos, float("-inf"))
        torch.softmax(scores_HQL, dim=-1, out=scores_HQL)
        torch.bmm(scores_HQL, v_HLV[:, :end], out=out_HTV[:, s:e])
    return out_HTV


def _float(k_LGD: torch.Tensor | None) -> torch.Tensor | None:
    """``k_LGD`` in fp32, an expanded view (head stride 0) staying one"""
    if k_LGD is None or k_LGD.stride(1) != 0:
        return None if k_LGD is None else k_LGD.float()
    return k_LGD[:, :1].float().expand(k_LGD.shape)


def causal_attention_parts(
    q_THK: torch.Tensor,
    k1_LGD: torch.Tensor,
    k2_LGD: torch.Tensor | None,
    v_LGV: torch.Tensor,
    scale: float,
    out_THV: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, H, V]`` causal attention where query head h uses kv head ``h // (H // G)``, whose
    keys are ``[k1 | k2]`` (``k2_LGD`` None: ``k1`` alone; it may be an expanded view, head
    stride 0) and ``q_THK`` holds the matching D1 + D2 values; written into ``out_THV`` when
    given. On a CPU, other dtypes (bf16) compute in fp32 and are cast back."""
    if q_THK.device.type == "cpu" and q_THK.dtype != torch.float32:
        out32 = causal_attention_parts(
            q_THK.float(), k1_LGD.float(), _float(k2_LGD), v_LGV.float(), scale
        )
        return out32.to(q_THK.dtype) if out_THV is None else out_THV.copy_(out32)
    got = kernel.causal_attention(q_THK, k1_LGD, k2_LGD, v_LGV, scale, out_THV)
    if got is not None:
        return got
    L, G = k1_LGD.shape[:2]
    rep = q_THK.shape[1] // G
    k_LGK = k1_LGD if k2_LGD is None else torch.cat((k1_LGD, k2_LGD.expand(L, G, -1)), dim=-1)
    if rep > 1:
        k_LGK, v_LGV = k_LGK.repeat_interleave(rep, dim=1), v_LGV.repeat_interleave(rep, dim=1)
    out_HTV = causal_attention(
        q_THK.transpose(0, 1), k_LGK.transpose(0, 1), v_LGV.transpose(0, 1), scale
    )
    if out_THV is None:
        return out_HTV.transpose(0, 1)
    return out_THV.copy_(out_HTV.transpose(0, 1))
