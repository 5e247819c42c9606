"""Blocked causal prefill attention against SDPA with the causal mask (its reference)."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops import prefill_attention as pa


@pytest.mark.parametrize(
    "H,T,L,K,V",
    [(4, 1, 1, 8, 8), (4, 7, 7, 16, 8), (16, 300, 300, 96, 64), (2, 130, 517, 8, 12)],
)
@pytest.mark.parametrize("small_blocks", [False, True])
def test_matches_masked_sdpa(monkeypatch, H, T, L, K, V, small_blocks):
    if small_blocks:  # force several blocks, including a ragged last one
        monkeypatch.setattr(pa, "_SCORE_ELEMS", 16 * H * L)
    g = torch.Generator().manual_seed(T + L)
    q, k = torch.randn(H, T, K, generator=g), torch.randn(H, L, K, generator=g)
    v = torch.randn(H, L, V, generator=g)
    got = pa.causal_attention(q, k, v, K**-0.5)
    want = pa.causal_attention_ref(q, k, v, K**-0.5)
    assert got.shape == (H, T, V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_inputs():
    """The layers pass transposed views (heads not outermost in memory)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(40, 3, 16, generator=g).transpose(0, 1)
    k = torch.randn(50, 3, 16, generator=g).transpose(0, 1)
    v = torch.randn(50, 3, 8, generator=g).transpose(0, 1)
    torch.testing.assert_close(
        pa.causal_attention(q, k, v, 0.25), pa.causal_attention_ref(q, k, v, 0.25)
    )
