"""The int8 weight format: per-row quantization and the views the weight loaders write."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.linear import copy_into
from moeserve.ops import formats
from moeserve.quant.int8 import Int8Tensor, Int8Weight, as_int8, quantize_rows


def test_rows_round_to_nearest_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=g) * torch.rand(37, 1, generator=g) * 10
    w0 = w.clone()
    q, scale = quantize_rows(w)
    assert torch.equal(w, w0)  # the input is left alone (a loader may copy it to several slots)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert (q.abs().amax(dim=1) == 127).all()  # every row uses the full range
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 127)


def test_zero_rows_bf16_and_stacked_inputs():
    w = torch.randn(3, 4, 16)
    w[1, 2] = 0
    q, scale = quantize_rows(w)
    assert q.shape == (3, 4, 16) and scale.shape == (3, 4)
    assert scale[1, 2] == 0 and (q[1, 2] == 0).all()
    q16, s16 = quantize_rows(w.bfloat16())
    q32, s32 = quantize_rows(w.bfloat16().float())
    assert torch.equal(q16, q32) and torch.equal(s16, s32)


def test_rejects_non_finite_and_integer_weights():
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="float tensor"):
        quantize_rows(torch.ones(2, 2, dtype=torch.int32))


def test_weight_views_quantize_the_rows_they_are_given():
    w = Int8Weight((2, 6, 8))
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    w[1, :3].copy_(a)  # an expert slot's gate half
    w[1, 3:].copy_(b)
    w[0].zero_()
    qa, sa = quantize_rows(a)
    assert torch.equal(w.q[1, :3], qa) and torch.equal(w.scale[1, :3], sa)
    assert (w.q[0] == 0).all() and (w.scale[0] == 0).all()
    torch.testing.assert_close(w.dequantize()[1], torch.cat((a, b)), atol=0.05, rtol=0.02)
    assert as_int8(w).q is w.q and as_int8(torch.ones(1)) is None
    assert torch.equal(formats.of(w).dense(w, torch.float32), w.dequantize())
    assert formats.of(a).dense(a, torch.float32) is a


def test_copy_into_pads_like_a_dense_parameter():
    """The padded last vocab shard: copy_into fills the leading rows and zeroes the rest."""
    w = Int8Weight((5, 4))
    w.q.fill_(9)
    t = torch.randn(3, 4)
    copy_into(w)(t)
    assert torch.equal(w.q[:3], quantize_rows(t)[0])
    assert (w.q[3:] == 0).all() and (w.scale[3:] == 0).all()


def test_bad_shapes_and_indices_are_clear():
    w = Int8Weight((4, 8))
    with pytest.raises(ValueError, match=r"shape \(3, 8\) into int8 rows of shape \(4, 8\)"):
        w.copy_(torch.randn(3, 8))
    with pytest.raises(IndexError, match="leading dims only"):
        w[:, 2:4]
    with pytest.raises(ValueError, match="an int8 weight needs"):
        Int8Weight((8,))
    with pytest.raises(ValueError, match="int8 q"):
        Int8Tensor(torch.zeros(2, 3), torch.zeros(2))


def test_parameters_hold_the_bytes():
    w = Int8Weight((16, 32))
    assert sum(p.numel() * p.element_size() for p in w.parameters()) == 16 * 32 + 16 * 4
    assert not any(p.requires_grad for p in w.parameters())
