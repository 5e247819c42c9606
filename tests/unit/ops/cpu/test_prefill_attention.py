"""Prefill attention (the blocked form, the AVX-512 kernel with split keys and shared kv heads)
against SDPA with the causal mask (its reference)."""

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


def _split_keys_ref(q_THK, k1_LGD, k2_LGD, v_LGV, scale):
    """The reference on per-query-head keys and values built from the parts."""
    L, G = k1_LGD.shape[:2]
    k_LGK = k1_LGD if k2_LGD is None else torch.cat((k1_LGD, k2_LGD.expand(L, G, -1)), dim=-1)
    rep = q_THK.shape[1] // G
    k_HLK = k_LGK.repeat_interleave(rep, dim=1).transpose(0, 1)
    v_HLV = v_LGV.repeat_interleave(rep, dim=1).transpose(0, 1)
    return pa.causal_attention_ref(q_THK.transpose(0, 1), k_HLK, v_HLV, scale).transpose(0, 1)


# T queries, L positions, H query heads, G kv heads, key parts D1 and D2 (0: none), V
SPLIT_CASES = [
    (512, 512, 16, 16, 64, 32, 64),  # the benchmark model's MLA: k_pe shared by all heads
    (130, 517, 4, 2, 17, 5, 70),  # cached prefix, GQA pairs, dims off 16, two value panels
    (7, 7, 2, 1, 8, 0, 8),  # fewer queries than a tile, one kv head for two query heads
    (1, 300, 3, 3, 16, 0, 128),  # one query at the end of a long context
    (97, 97, 5, 5, 24, 8, 40),
]


@pytest.mark.parametrize("T,L,H,G,D1,D2,V", SPLIT_CASES)
@pytest.mark.parametrize("use_kernel", [True, False])
def test_split_keys_match_reference(monkeypatch, T, L, H, G, D1, D2, V, use_kernel):
    """causal_attention_parts: the AVX-512 kernel where this CPU has it, else (and with the
    kernel turned off) the blocked form on concatenated, repeated keys; written into a slice
    of a wider output that stays intact around it."""
    if not use_kernel:
        monkeypatch.setattr(pa.kernel, "available", lambda: False)
    g = torch.Generator().manual_seed(T * L + D2)
    q = torch.randn(T, H, D1 + D2, generator=g)
    k1, v = torch.randn(L, G, D1, generator=g), torch.randn(L, G, V, generator=g)
    k2 = torch.randn(L, 1, D2, generator=g).expand(L, G, D2) if D2 else None
    want = _split_keys_ref(q, k1, k2, v, 0.3)
    wide = torch.full((T, H, V + 9), 7.0)
    got = pa.causal_attention_parts(q, k1, k2, v, 0.3, out_THV=wide[:, :, 4 : V + 4])
    assert got.data_ptr() == wide[:, :, 4:].data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (wide[:, :, :4] == 7).all() and (wide[:, :, V + 4 :] == 7).all()
    if use_kernel:  # the kernel took these operands wherever it runs
        ran = pa.kernel.causal_attention(q, k1, k2, v, 0.3) is not None
        assert ran == pa.kernel.available()


def test_kernel_declines_what_it_cannot_take():
    """Not fp32, keys with an inner stride, or more queries than positions: None, so the
    caller runs the blocked form."""
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    assert pa.kernel.causal_attention(q.double(), k.double(), None, v.double(), 1.0) is None
    assert pa.kernel.causal_attention(q, torch.randn(4, 2, 16)[:, :, ::2], None, v, 1.0) is None
    assert pa.kernel.causal_attention(q, k[:3], None, v[:3], 1.0) is None
