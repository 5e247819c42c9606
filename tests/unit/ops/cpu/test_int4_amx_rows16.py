"""int4's own numerics on AMX's tiles (``int4_amx.gemm_nt`` / ``moe_experts`` with ``rows16``):
each token row in 16-bit fixed point (``int4.rows16_ref``, the rounding of int4's integer
dots), split into two byte planes, a tile product per plane, the planes' int32 sums added per
group (256 high + low, exact) and scaled. Against ``int4_amx.gemm_ref(..., rows16=True)`` (the
group sums exact in fp64) up to the order of the fp32 sums over groups, and against int4's
integer dots themselves (the same rounding, so the same result up to that order)."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import int4 as int4_kernels
from moeserve.ops.cpu import int4_amx
from moeserve.quant.int4 import Int4Tensor, pack_nibbles
from tests.unit.ops.cpu.test_int4_amx import int4_weight
from tests.unit.ops.cpu.test_int8_amx import max_hidden_scale

pytestmark = pytest.mark.skipif(not int4_amx.available(), reason="no AMX-INT8 here")


def gemm16(x: torch.Tensor, w: Int4Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return int4_amx.gemm_nt(x, w, out=out, rows16=True)


def ref16(x: torch.Tensor, w: Int4Tensor) -> torch.Tensor:
    return int4_amx.gemm_ref(x, w, rows16=True)


def test_ref_is_the_rows_rounded_as_int4s_dots_times_the_dequantized_weight():
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    for group in (32, 64, 128):
        w = int4_weight(48, 256, seed=2, group=group, symmetric=False)
        want = int4_kernels.round_rows_ref(x) @ w.dequantize().t()
        torch.testing.assert_close(ref16(x, w), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 32, 128),  # one token: a block of 15 zero rows
        (5, 48, 256),  # a 16-row job at the end
        (16, 64, 384),  # exactly one token block
        (9, 32, 192),  # 64 columns past the last 128 (groups of 32 and 64)
        (17, 96, 128),  # one token into the second block
        (37, 80, 1024),  # odd blocks, a 16-row tail
        (300, 64, 256),  # many blocks
    ],
)
def test_gemm_matches_reference(M, N, K, group, symmetric):
    if K % group:
        pytest.skip(f"groups of {group} do not divide {K} columns")
    g = torch.Generator().manual_seed(M + N + K + group)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M).unsqueeze(1)  # row scales
    x[M // 2] = 0.0  # a zero row: scale 0, output 0
    w = int4_weight(N, K, seed=M, group=group, symmetric=symmetric)
    out = torch.full((M, N), float("nan"))
    gemm16(x, w, out=out)
    want = ref16(x, w)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(out[M // 2], torch.zeros(N))


def test_same_numbers_as_int4s_integer_dots():
    """The tiles and int4's dots round the rows alike and sum exactly: the same products up to
    the order of the fp32 sums (where the dots run here)."""
    if not int4_kernels.rounds_rows(None, 40):
        pytest.skip("int4's integer dots do not run here")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 512, generator=g)
    for group in (32, 128):
        w = int4_weight(96, 512, seed=group, group=group, symmetric=False)
        dots = int4_kernels.gemm_nt(x, w)
        torch.testing.assert_close(gemm16(x, w), dots, rtol=1e-5, atol=1e-5)


def test_every_code_zero_point_and_the_planes_extremes():
    """Codes 0..15 against zero points 0..15 (u - zero in -15..15), group scales far apart,
    and rows whose integers reach +-32639 (high bytes +-127, low bytes across [-128, 127]):
    a group's plane sums stay exact in int32."""
    N, K, group = 32, 256, 32
    u = torch.arange(N * K).remainder(16).view(N, K).to(torch.uint8)
    zero = torch.arange(N * K // group).remainder(16).view(N, K // group).to(torch.uint8)
    scale = torch.logspace(-4, 2, N * K // group).view(N, K // group)
    w = Int4Tensor(pack_nibbles(u), scale, zero, symmetric=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, K, generator=g)
    x[1] = torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)  # every value at +-XMAX
    x[2] = torch.arange(K, dtype=torch.float32) - 128.0  # every low byte
    torch.testing.assert_close(gemm16(x, w), ref16(x, w), rtol=1e-5, atol=0)


def test_nonfinite_rows_are_nan_and_stay_in_their_row():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(20, 128, generator=g)
    x[3, 7], x[11, 0] = float("nan"), float("inf")
    w = int4_weight(32, 128, seed=1)
    got = gemm16(x, w)
    assert got[3].isnan().all() and got[11].isnan().all()
    keep = [i for i in range(20) if i not in (3, 11)]
    torch.testing.assert_close(got[keep], ref16(x[keep], w), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_output():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 300, generator=g)[:, 8:264]  # [21, 256], row stride 300
    w = int4_weight(96, 256, seed=4, group=64)[16:80]  # rows of a wider weight
    out_full = torch.zeros(21, 100)
    gemm16(x, w, out=out_full[:, 10:74])
    torch.testing.assert_close(out_full[:, 10:74], ref16(x, w), rtol=1e-5, atol=1e-5)
    assert not out_full[:, :10].any() and not out_full[:, 74:].any()


def test_usable_from_rows16_min_rows_on_the_tiles_shapes():
    w = int4_weight(32, 128, seed=0)
    least = int4_amx.ROWS16_MIN
    assert int4_amx.rows16_usable(torch.randn(least, 128), w)
    assert not int4_amx.rows16_usable(torch.randn(least - 1, 128), w)
    assert not int4_amx.rows16_usable(torch.randn(least, 96), int4_weight(32, 96, seed=0, group=32))
    assert not int4_amx.rows16_usable(torch.randn(least, 128).bfloat16(), w)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("counts", [[1], [15, 16, 17], [40, 1, 33, 2], [70, 64]])
def test_moe_matches_reference(counts, group):
    E, D, F_ = 6, 256, 128
    g = torch.Generator().manual_seed(sum(counts) + group)
    w13 = int4_weight(E, 2 * F_, D, seed=1, group=group, symmetric=False)
    w2 = int4_weight(E, D, F_, seed=2, group=group)
    experts = [5, 0, 3, 2][: len(counts)]
    R = sum(counts)
    x = torch.randn(R, D, generator=g)
    weight = torch.rand(R, generator=g)
    got = int4_amx.moe_experts(x, experts, counts, w13, w2, weight, rows16=True)
    want = int4_amx.moe_ref(x, experts, counts, w13, w2, weight, rows16=True)
    # the kernel rounds the hidden after its own activation: one step of the hidden's 16-bit
    # grid (a 2^-16 of the int8 one) moves an output by at most its scale times max |w2|
    ref = lambda x_, w_: ref16(x_, w_)  # noqa: E731
    step = max_hidden_scale(x, experts, counts, w13, ref) * 127 / int4_kernels.XMAX
    step *= w2.dequantize().abs().max() * weight.max()
    diff = (got - want).abs()
    assert diff.max() <= 1e-5 * want.abs().max() + 2 * step
    assert (diff > 1e-5 * want.abs().max()).float().mean() < 0.05  # almost all agree


def test_moe_usable_from_rows16_min_rows_an_expert():
    E, D, F_ = 4, 128, 128
    w13, w2 = int4_weight(E, 2 * F_, D, seed=1), int4_weight(E, D, F_, seed=2)
    least = int4_amx.MOE_ROWS16_MIN
    x = torch.randn(2 * least, D)
    assert int4_amx.moe_rows16_usable(x, [least, least], w13, w2)
    assert not int4_amx.moe_rows16_usable(x[:-1], [least, least - 1], w13, w2)
    other = int4_weight(E, D, F_, seed=2, group=64)
    assert not int4_amx.moe_rows16_usable(x, [least, least], w13, other)
