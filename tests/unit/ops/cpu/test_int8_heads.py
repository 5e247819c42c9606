"""MLA's absorbed products on int8 codes (``ops/cpu/int8_heads.py``, ``int8.c``'s
``head_gemm``): the kernel against its reference and the dense weights, on both x86 bodies,
and the codes' form against ``kv_b_proj``'s weight for int8 and int4."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import int8, int8_heads
from moeserve.quant.head_codes import HeadCodes
from moeserve.quant.int4 import Int4Tensor, quantize_groups
from moeserve.quant.int8 import quantize_rows

needs_kernels = pytest.mark.skipif(not int8_heads.available(), reason="no int8 kernels here")
ISAS = [False, True] if int8.wide() else [False]  # avx512: the AVX2 body, and AVX-512F's

# (R rows of kv_b_proj per head, C columns, columns per scale): int8's one scale a row, int4's
# groups of 32/64/128, kv_lora 512 as DeepSeek's; outputs off the vector widths both ways (W_UV's
# R 24 and 8, W_UK's C 72 and 40 with a group that splits a vector: the scalar paths)
SHAPES = [(16, 72, 72), (24, 40, 40), (64, 256, 128), (16, 96, 32), (48, 128, 64), (8, 512, 512)]
ROWS = [1, 2, 3, 5, 7, 13, 40]


def codes(H: int, R: int, C: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 codes ``[H, R, C]`` and positive scales ``[H, R, C / g]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (H, R, C), generator=gen, dtype=torch.int8)
    return q, torch.rand(H, R, C // g, generator=gen) * 0.01 + 1e-3


def test_the_forms_are_the_rows_and_their_transpose():
    q, s = codes(2, 6, 64, 32, 0)
    dense = q.float() * s.repeat_interleave(32, dim=2)
    rows, cols = HeadCodes.rows(q, s), HeadCodes.columns(q, s)
    assert rows.shape == (2, 6, 64) and cols.shape == (2, 64, 6)
    assert torch.equal(rows.dequantize(), dense)
    assert torch.equal(cols.dequantize(), dense.transpose(1, 2))
    with pytest.raises(ValueError, match="HeadCodes needs int8 codes"):
        HeadCodes(rows.q.float(), rows.scale, 32, False)
    with pytest.raises(ValueError, match=r"\[H, K, N / group\]"):
        HeadCodes(rows.q, rows.scale, 32, True)  # the rows' scale layout


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_and_int4_kv_b_give_their_weights_exactly(symmetric):
    """int8 rows (a scale each) and int4's codes less their zero points (a scale per group):
    W_UK and W_UV dequantize to kv_b_proj's blocks bit for bit."""
    H, N, V, C = 3, 16, 24, 128
    w = torch.randn(H * (N + V), C)
    q8, s8 = quantize_rows(w)
    q4, s4, z4 = quantize_groups(w, 32, symmetric)
    int4 = Int4Tensor(q4, s4, z4, symmetric)
    for codes_, scale, dense in (
        (q8.view(H, N + V, C), s8.view(H, N + V, 1), q8.float() * s8[:, None]),
        (int4.signed_codes().view(H, N + V, C), s4.view(H, N + V, -1), int4.dequantize()),
    ):
        uk, uv = (
            HeadCodes.columns(codes_[:, :N], scale[:, :N]),
            HeadCodes.rows(codes_[:, N:], scale[:, N:]),
        )
        dense = dense.view(H, N + V, C)
        assert torch.equal(uk.dequantize(), dense[:, :N].transpose(1, 2))
        assert torch.equal(uv.dequantize(), dense[:, N:])
    assert int(int4.signed_codes().abs().max()) <= 15


@needs_kernels
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("R,C,g", SHAPES)
def test_kernel_matches_the_reference(R, C, g, transposed, avx512):
    H = 3
    q, s = codes(H, R, C, g, R + C + g)
    w = HeadCodes.columns(q, s) if transposed else HeadCodes.rows(q, s)
    dense = w.dequantize()
    K = w.shape[2]
    for M in ROWS:
        x = torch.randn(H, M, K, generator=torch.Generator().manual_seed(M))
        want = torch.bmm(x, dense.transpose(1, 2))
        ref = int8_heads.head_gemm_ref(x, w)
        torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-4)
        got = int8_heads.head_gemm_nt(x, w, avx512=avx512)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("R,C,g", SHAPES)
def test_a_row_alone_gives_its_bits_in_a_block(R, C, g, transposed, avx512):
    """One token row (a decode step at batch 1: head_gemm1, whole rows of outputs a job) gives
    the bits that row gets among others (head_gemm's blocks of token rows): a request's
    outputs do not depend on its batch."""
    H = 5  # more heads than threads, so jobs are stolen
    q, s = codes(H, R, C, g, 3 * R + C)
    w = HeadCodes.columns(q, s) if transposed else HeadCodes.rows(q, s)
    x = torch.randn(H, 9, w.shape[2], generator=torch.Generator().manual_seed(R))
    together = int8_heads.head_gemm_nt(x, w, avx512=avx512)
    for m in (0, 4, 8):
        alone = int8_heads.head_gemm_nt(x[:, m : m + 1].contiguous(), w, avx512=avx512)
        assert torch.equal(alone, together[:, m : m + 1])


@needs_kernels
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("transposed", [False, True])
def test_strided_rows_and_outputs_and_a_nan_row(transposed, avx512):
    """Token rows read and outputs written through head/row strides (the decode's layouts:
    ``q_nope [B, H, N]`` seen head-major, ``out [B, H, V]`` likewise); a nan row stays in its
    row."""
    H, R, C, g, B = 4, 32, 128, 64, 5
    q, s = codes(H, R, C, g, 9)
    w = HeadCodes.columns(q, s) if transposed else HeadCodes.rows(q, s)
    K, N = w.shape[2], w.shape[1]
    x_BHK = torch.randn(B, H, K + 3)[..., :K]  # row stride past K
    x_BHK[2, 1] = float("nan")
    out_BHN = torch.full((B, H, N), 7.0)
    int8_heads.head_gemm_nt(x_BHK.transpose(0, 1), w, out_BHN.transpose(0, 1), avx512=avx512)
    want = int8_heads.head_gemm_ref(x_BHK.transpose(0, 1), w).transpose(0, 1)
    assert out_BHN[2, 1].isnan().all()
    keep = ~torch.isnan(want)
    assert keep.sum() == keep.numel() - N
    torch.testing.assert_close(out_BHN[keep], want[keep], rtol=1e-5, atol=1e-4)


def test_what_the_kernels_take():
    q, s = codes(2, 8, 64, 32, 1)
    w = HeadCodes.rows(q, s)
    x = torch.randn(2, 3, 64)
    assert int8_heads.usable(x, w) == int8_heads.available()
    assert not int8_heads.usable(x.double(), w)
    assert not int8_heads.usable(x[..., :32], w)  # K disagrees with the weight
    assert not int8_heads.usable(x[:, :0], w)
    assert not int8_heads.weight_ok(torch.randn(2, 8, 64))
    if int8_heads.available():
        bound = int8_heads.bind_head_gemm(w)
        assert bound.w is w and {t for t, _ in bound.pointers} == {w.q, w.scale}
    q3, s3 = codes(2, 24, 64, 32, 2)
    assert (int8_heads.absorbed(q3, s3, 8, torch.float32) is None) != int8_heads.available()
    assert int8_heads.absorbed(q3, s3, 8, torch.bfloat16) is None  # the kernels take fp32 rows
