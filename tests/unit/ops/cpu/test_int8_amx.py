"""The w8a8 int8 AMX kernels (``ops/cpu/int8_amx.c``) against their references.

The activation quantization is the same fp32 arithmetic in both, and int32 sums of int8
products are exact, so the projection matches :func:`int8_amx.gemm_ref` up to the order of
two fp32 multiplications. In the MoE call the hidden's activation (a vector e^x) can move a
value across a rounding boundary of its int8 grid: a few elements differ by one grid step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.cpu import int8_amx
from moeserve.quant.int8 import Int8Tensor, quantize_rows

needs_amx = pytest.mark.skipif(not int8_amx.available(), reason="no AMX-INT8 here")


def int8_weight(*shape: int, seed: int) -> Int8Tensor:
    g = torch.Generator().manual_seed(seed)
    return Int8Tensor(*quantize_rows(torch.randn(*shape, generator=g) / shape[-1] ** 0.5))


def test_quantize_rows_ref_grid():
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [3.0, 3.0, -3.0]])
    xq, s = int8_amx.quantize_rows_ref(x)
    assert xq.dtype == torch.int8
    assert xq.tolist() == [[32, -127, 64], [0, 0, 0], [127, 127, -127]]  # 31.75 -> 32
    assert torch.equal(s, torch.tensor([2.0, 0.0, 3.0]) / 127)
    back = int8_amx.fake_quant(x)
    assert (back - x).abs().max() <= (s.max() / 2) + 1e-7  # within half a grid step


def test_quantize_rows_ref_divides_as_the_kernel():
    """The row's inverse scale is ``127 / max`` in one fp32 division, as in the kernel;
    torch's ``127 / t`` is ``t.reciprocal() * 127``, rounded twice. On this row the division
    puts 0.043700784 at 1.5 (rounded to 2, an even tie) and the reciprocal at 1.4999998 (1)."""
    x = torch.tensor([[3.7, 0.043700784]])
    xq, _ = int8_amx.quantize_rows_ref(x)
    assert xq.tolist() == [[127, 2]]
    if int8_amx.available():  # the kernel, through a weight that picks the second column
        w = torch.zeros(16, 64, dtype=torch.int8)
        w[0, 1] = 1
        row = torch.zeros(1, 64)
        row[0, :2] = x[0]
        y = int8_amx.gemm_nt(row, Int8Tensor(w, torch.ones(16)))
        assert y[0, 0].item() == pytest.approx(2 * 3.7 / 127, rel=1e-6)


def test_gemm_ref_is_the_quantized_product():
    """The reference multiplies the rows rounded to their grids by the dequantized weight."""
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(1))
    w = int8_weight(48, 128, seed=2)
    want = int8_amx.fake_quant(x) @ w.dequantize().t()
    torch.testing.assert_close(int8_amx.gemm_ref(x, w), want, rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 32, 64),  # one token, one job
        (5, 48, 64),  # a 16-row job at the end
        (16, 64, 128),  # exactly one token block
        (17, 96, 192),  # one token into the second block
        (37, 80, 1024),  # odd blocks, a 16-row tail
        (300, 64, 128),  # many blocks, pairs and a single
    ],
)
def test_gemm_matches_reference(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g)
    x[M // 2] = 0.0  # a zero row: scale 0, output 0
    w = int8_weight(N, K, seed=M)
    out = torch.full((M, N), float("nan"))
    int8_amx.gemm_nt(x, w, out=out)
    torch.testing.assert_close(out, int8_amx.gemm_ref(x, w), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[M // 2], torch.zeros(N))


@needs_amx
def test_gemm_strided_rows_and_output():
    """Rows of a wider tensor, a weight slice of a wider one, an output slice: strides are
    honoured and nothing outside is written."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=g)[:, 8:136]  # [9, 128], row stride 300
    w_full = int8_weight(64, 192, seed=4)
    w = Int8Tensor(w_full.q[:, 64:], w_full.scale)  # [64, 128], row stride 192
    out_full = torch.zeros(9, 100)
    int8_amx.gemm_nt(x, w, out=out_full[:, 10:74])
    torch.testing.assert_close(out_full[:, 10:74], int8_amx.gemm_ref(x, w), rtol=1e-6, atol=1e-6)
    assert not out_full[:, :10].any() and not out_full[:, 74:].any()


def test_usable_declines_what_the_tiles_do_not_take():
    x = torch.randn(4, 128)
    assert not int8_amx.usable(x, int8_weight(32, 96, seed=0))  # K % 64
    assert not int8_amx.usable(x[:, :120], int8_weight(40, 120, seed=0))  # N % 16, K
    assert not int8_amx.usable(x.bfloat16(), int8_weight(32, 128, seed=0))  # fp32 rows only
    assert not int8_amx.usable(x[:0], int8_weight(32, 128, seed=0))  # no rows
    assert int8_amx.usable(x, int8_weight(32, 128, seed=0)) == int8_amx.available()


@needs_amx
@pytest.mark.parametrize("counts", [[1], [15, 16, 17], [40, 1, 33, 2]])
def test_moe_matches_reference(counts):
    E, D, F_ = 6, 128, 64
    g = torch.Generator().manual_seed(sum(counts))
    w13, w2 = int8_weight(E, 2 * F_, D, seed=1), int8_weight(E, D, F_, seed=2)
    experts = [5, 0, 3, 2][: len(counts)]
    R = sum(counts)
    x = torch.randn(R, D, generator=g)
    weight = torch.rand(R, generator=g)
    got = int8_amx.moe_experts(x, experts, counts, w13, w2, weight)
    want = int8_amx.moe_ref(x, experts, counts, w13, w2, weight)
    # one grid step of the hidden moves an output by at most its scale times max |w2|
    h_scale = max_hidden_scale(x, experts, counts, w13)
    step = h_scale * w2.dequantize().abs().max() * weight.max()
    diff = (got - want).abs()
    assert diff.max() <= 2 * step
    assert (diff > 1e-5 * want.abs().max()).float().mean() < 0.05  # almost all agree


def max_hidden_scale(x, experts, counts, w13, gemm_ref=int8_amx.gemm_ref) -> float:
    """The largest grid step of an MoE call's hidden rows (``gemm_ref``: the projection's
    reference; test_int4_amx.py passes w4a8's)."""
    F_ = w13.shape[1] // 2
    best, start = 0.0, 0
    for e, n in zip(experts, counts):
        gate, up = gemm_ref(x[start : start + n], w13[e]).split(F_, dim=-1)
        best = max(best, (F.silu(gate) * up).abs().max().item() / int8_amx.QMAX)
        start += n
    return best


@needs_amx
def test_moe_workspace_reuse_gives_the_same_rows():
    """The decode path calls the kernel with buffers kept across steps (MoEWorkspace): a
    second call with other rows of the same size overwrites every value it reads."""
    E, D, F_ = 4, 64, 64
    w13, w2 = int8_weight(E, 2 * F_, D, seed=5), int8_weight(E, D, F_, seed=6)
    experts, counts = [1, 3], [3, 2]
    meta = torch.tensor([experts, [0, 3], counts], dtype=torch.int64)
    ws = int8_amx.MoEWorkspace(32, D, F_)
    lib = int8_amx._library()
    for seed in (7, 8):
        g = torch.Generator().manual_seed(seed)
        x, weight = torch.randn(5, D, generator=g), torch.rand(5, generator=g)
        y = torch.empty(5, D)
        lib.moeserve_amx_i8_moe(
            2, meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), D, F_,
            x.data_ptr(), w13.q.data_ptr(), w13.scale.data_ptr(), w2.q.data_ptr(),
            w2.scale.data_ptr(), weight.data_ptr(), y.data_ptr(), *ws.pointers(),
        )  # fmt: skip
        want = int8_amx.moe_experts(x, experts, counts, w13, w2, weight)
        torch.testing.assert_close(y, want, rtol=0, atol=0)


@needs_amx
def test_a_nan_row_stays_nan():
    """A row with a nan has no int8 grid: its outputs are nan (as the reference's), the other
    rows are untouched."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    x[1, 70] = float("nan")
    w = int8_weight(32, 128, seed=10)
    out = int8_amx.gemm_nt(x, w)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    torch.testing.assert_close(out[[0, 2]], int8_amx.gemm_ref(x[[0, 2]], w), rtol=1e-6, atol=1e-6)
    assert int8_amx.gemm_ref(x, w)[1].isnan().all()
    w13, w2 = int8_weight(2, 128, 128, seed=11), int8_weight(2, 128, 64, seed=12)
    y = int8_amx.moe_experts(x, [0, 1], [2, 1], w13, w2, torch.ones(3))
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
