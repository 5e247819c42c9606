"""A packed token bitmask applied to logits, in plain torch.

Shape legend: B rows, W = ceil(V / 32) int32 words per row, V vocabulary.

llguidance writes bit ``i`` of word ``w`` for token ``32 w + i`` (set: allowed). One AND
against the 32 bit values unpacks every word at once (no byte order involved)::

    mask_BW (int32) & BITS[32] -> [B, W, 32] == 0 -> [B, 32W] -> first V: the tokens to drop

(llguidance's own ``apply_token_bitmask_inplace`` runs ``torch.compile``, which a CPU
engine should not pay for at its first constrained request.) fp32 logits go through the C
kernel of ``ops/cpu/bitmask.c``, which skips all-allowed words.
"""

from __future__ import annotations

import torch

from moeserve.ops.cpu.bitmask import apply_token_bitmask

# BITS[i]: the int32 whose only set bit is bit i
BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def disallowed_BV(mask_BW: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` bool: which tokens ``mask_BW`` does not allow (V <= 32 W)."""
    off = (mask_BW.unsqueeze(-1) & BITS.to(mask_BW.device)) == 0
    return off.reshape(mask_BW.shape[0], -1)[:, :vocab]


def apply_bitmask(logits_BV: torch.Tensor, mask_BW: torch.Tensor) -> None:
    """Set the logits of the tokens ``mask_BW`` does not allow to -inf, in place. Tokens
    past the mask's ``32 W`` are not allowed either. fp32 logits on a CPU with kernels go
    through ``ops/cpu/bitmask.c``; everything else through :func:`torch_apply_bitmask`."""
    if not apply_token_bitmask(logits_BV, mask_BW):
        torch_apply_bitmask(logits_BV, mask_BW)


def torch_apply_bitmask(logits_BV: torch.Tensor, mask_BW: torch.Tensor) -> None:
    """:func:`apply_bitmask` in plain torch (vectorized; also the kernel's fallback)."""
    V = logits_BV.shape[1]
    covered = min(V, 32 * mask_BW.shape[1])
    if covered < V:
        logits_BV[:, covered:] = float("-inf")
    logits_BV[:, :covered].masked_fill_(disallowed_BV(mask_BW, covered), float("-inf"))


def reference_apply_bitmask(logits_BV: torch.Tensor, mask_BW: torch.Tensor) -> None:
    """:func:`apply_bitmask` token by token (the test oracle)."""
    words = mask_BW.tolist()
    for b in range(logits_BV.shape[0]):
        for t in range(logits_BV.shape[1]):
            w = t // 32
            if w >= len(words[b]) or not (words[b][w] >> (t % 32)) & 1:
                logits_BV[b, t] = float("-inf")
