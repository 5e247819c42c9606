"""The w4a8 kernels against their references: the int4 AMX kernels (``ops/cpu/int4_amx.c``,
"tiles") and int4's integer dots with the rows on their int8 grids ("dots",
``int4_idot.h``), each forced through ``FEW_ROWS``.

The rows are quantized with w8a8_int8's fp32 arithmetic and each group's integer sum is exact
in both, so the projection matches :func:`int4_amx.gemm_ref` up to the order of the fp32 sums
over groups. In the MoE call the hidden's activation can move a value across a rounding
boundary of its int8 grid: a few elements differ by one grid step (``test_int8_amx.py`` says
the same of w8a8_int8's).
"""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import int4 as int4_kernels
from moeserve.ops.cpu import int4_amx, int8_amx
from moeserve.ops.cpu.bound import MoEBuffers
from moeserve.quant.int4 import Int4Tensor, pack_nibbles, quantize_groups
from tests.helpers import fill_routing
from tests.unit.ops.cpu.test_int8_amx import max_hidden_scale as int8_max_hidden_scale

needs_amx = pytest.mark.skipif(not int4_amx.available(), reason="no AMX-INT8 here")
KERNELS = [int4_amx.TILES, int4_amx.DOTS, "dots-avx2"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch) -> str:
    """Each kernel forced where it runs (the tiles from one row, the dots up to any count;
    dots-avx2: the AVX2 dots on a CPU that would pick AVX-512 VNNI's), skipped where it does
    not."""
    if request.param == int4_amx.TILES:
        if not int4_amx.available():
            pytest.skip("no AMX-INT8 here")
        monkeypatch.setattr(int4_amx, "FEW_ROWS", 0)
        return int4_amx.TILES
    if request.param == "dots-avx2":
        monkeypatch.setattr(int4_kernels, "wide", lambda: False)
    if not int4_amx.dots_available():
        pytest.skip("no integer dots of int4 here (AVX-512 VNNI or AVX2)")
    monkeypatch.setattr(int4_amx, "FEW_ROWS", 1 << 30)
    return int4_amx.DOTS


def forced(kernel: str, rows: int, w: Int4Tensor) -> None:
    """Skip where ``kernel`` cannot take ``rows`` (VNNI's dots: fewer than 256)."""
    if int4_amx.route(rows, w) != kernel:
        pytest.skip(f"{kernel} does not take {rows} rows here")


def int4_weight(*shape: int, seed: int, group: int = 128, symmetric: bool = True) -> Int4Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    return Int4Tensor(*quantize_groups(w, group, symmetric), symmetric=symmetric)


def test_gemm_ref_is_the_rounded_rows_times_the_dequantized_weight():
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    for group in (32, 64, 128):
        w = int4_weight(48, 256, seed=2, group=group, symmetric=False)
        want = int8_amx.fake_quant(x) @ w.dequantize().t()
        torch.testing.assert_close(int4_amx.gemm_ref(x, w), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 32, 128),  # one token, one job
        (5, 48, 256),  # a 16-row job at the end
        (16, 64, 384),  # exactly one token block
        (9, 32, 192),  # 64 columns past the last 128 (groups of 32 and 64)
        (17, 96, 128),  # one token into the second block
        (37, 80, 1024),  # odd blocks, a 16-row tail
        (300, 64, 256),  # many blocks, pairs and a single
    ],
)
def test_gemm_matches_reference(kernel, M, N, K, group, symmetric):
    g = torch.Generator().manual_seed(M + N + K + group)
    x = torch.randn(M, K, generator=g)
    x[M // 2] = 0.0  # a zero row: scale 0, output 0
    if K % group:
        pytest.skip(f"groups of {group} do not divide {K} columns")
    w = int4_weight(N, K, seed=M, group=group, symmetric=symmetric)
    forced(kernel, M, w)
    out = torch.full((M, N), float("nan"))
    int4_amx.gemm_nt(x, w, out=out)
    torch.testing.assert_close(out, int4_amx.gemm_ref(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[M // 2], torch.zeros(N))


def test_every_code_and_zero_point(kernel):
    """Codes 0..15 against zero points 0..15 (u - zero spans -15..15 in the int8 tiles), with
    group scales of very different sizes."""
    N, K, group = 32, 256, 32
    u = torch.arange(N * K).remainder(16).view(N, K).to(torch.uint8)
    zero = torch.arange(N * K // group).remainder(16).view(N, K // group).to(torch.uint8)
    scale = torch.logspace(-4, 2, N * K // group).view(N, K // group)
    w = Int4Tensor(pack_nibbles(u), scale, zero, symmetric=False)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    forced(kernel, 3, w)
    torch.testing.assert_close(int4_amx.gemm_nt(x, w), int4_amx.gemm_ref(x, w), rtol=1e-5, atol=0)


def test_gemm_strided_rows_and_output(kernel):
    """Rows of a wider tensor, weight rows of a wider one, an output slice: strides are
    honoured and nothing outside is written."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=g)[:, 8:264]  # [9, 256], row stride 300
    full = int4_weight(96, 256, seed=4, group=64)
    w = full[16:80]  # rows of a wider weight (the codes' row stride is the weight's)
    forced(kernel, 9, w)
    out_full = torch.zeros(9, 100)
    int4_amx.gemm_nt(x, w, out=out_full[:, 10:74])
    torch.testing.assert_close(out_full[:, 10:74], int4_amx.gemm_ref(x, w), rtol=1e-5, atol=1e-5)
    assert not out_full[:, :10].any() and not out_full[:, 74:].any()


def test_routes():
    """The tiles take K % 64 and N % 16 from FEW_ROWS rows, the dots fewer rows and the shapes
    the tiles do not take; neither an act-order weight (the format gathers x first), other
    rows than fp32 ones or no rows."""
    x = torch.randn(4, 128)
    w = int4_weight(32, 128, seed=0)
    odd_k, odd_n = int4_weight(32, 96, seed=0, group=32), int4_weight(40, 128, seed=0)
    tiles = int4_amx.TILES if int4_amx.available() else None
    dots = int4_amx.DOTS if int4_amx.dots_available() else None
    assert int4_amx.route(int4_amx.FEW_ROWS, w) == (tiles or dots)
    assert int4_amx.route(1, w) == (dots or tiles)
    assert int4_amx.route(int4_amx.FEW_ROWS, odd_k) == int4_amx.route(1, odd_n) == dots
    assert not int4_amx.usable(x.bfloat16(), w)
    assert not int4_amx.usable(x[:0], w)
    ordered = Int4Tensor(w.q, w.scale, w.zero, perm=torch.arange(128, dtype=torch.int32))
    assert not int4_amx.usable(x, ordered) and int4_amx.route(1, ordered) is None
    assert int4_amx.usable(x, w) == ((tiles or dots) is not None)


def max_hidden_scale(x, experts, counts, w13) -> float:
    return int8_max_hidden_scale(x, experts, counts, w13, int4_amx.gemm_ref)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("counts", [[1], [15, 16, 17], [40, 1, 33, 2]])
def test_moe_matches_reference(kernel, counts, group):
    E, D, F_ = 6, 256, 128
    g = torch.Generator().manual_seed(sum(counts) + group)
    w13 = int4_weight(E, 2 * F_, D, seed=1, group=group, symmetric=False)
    w2 = int4_weight(E, D, F_, seed=2, group=group)
    if int4_amx.moe_route(sum(counts) / len(counts), max(counts), w13, w2) != kernel:
        pytest.skip(f"{kernel} does not take this call here")
    experts = [5, 0, 3, 2][: len(counts)]
    R = sum(counts)
    x = torch.randn(R, D, generator=g)
    weight = torch.rand(R, generator=g)
    got = int4_amx.moe_experts(x, experts, counts, w13, w2, weight)
    want = int4_amx.moe_ref(x, experts, counts, w13, w2, weight)
    # one grid step of the hidden moves an output by at most its scale times max |w2|
    step = max_hidden_scale(x, experts, counts, w13) * w2.dequantize().abs().max() * weight.max()
    diff = (got - want).abs()
    assert diff.max() <= 2 * step
    assert (diff > 1e-5 * want.abs().max()).float().mean() < 0.05  # almost all agree


@needs_amx
@pytest.mark.parametrize("rows16", [False, True])
def test_moe_workspace_reuse_gives_the_same_rows(monkeypatch, rows16):
    """The decode path calls the kernel with buffers kept across steps (MoEWorkspace): a
    second call with other rows of the same size overwrites every value it reads (both
    planes of the rows in 16-bit fixed point too)."""
    E, D, F_ = 4, 128, 64
    w13, w2 = int4_weight(E, 2 * F_, D, seed=5, group=64), int4_weight(E, D, F_, seed=6, group=64)
    experts, counts = [1, 3], [3, 2]
    meta = torch.tensor([experts, [0, 3], counts], dtype=torch.int64)
    ws = int4_amx.MoEWorkspace(32, D, F_, 1 + rows16)
    lib = int4_amx._library()
    monkeypatch.setattr(int4_amx, "FEW_ROWS", 0)  # moe_experts on the tiles too
    for seed in (7, 8):
        g = torch.Generator().manual_seed(seed)
        x, weight = torch.randn(5, D, generator=g), torch.rand(5, generator=g)
        y = torch.empty(5, D)
        failed = lib.moeserve_amx_i4_moe(
            2, meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), D, F_,
            x.data_ptr(), *int4_kernels.moe_w_args(w13, w2), weight.data_ptr(), y.data_ptr(),
            *ws.pointers(), int(rows16),
        )  # fmt: skip
        assert failed == 0
        want = int4_amx.moe_experts(x, experts, counts, w13, w2, weight, rows16)
        torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_a_nan_row_stays_nan(kernel):
    """A row with a nan has no int8 grid: its outputs are nan (as the reference's), the other
    rows are untouched."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    x[1, 70] = float("nan")
    w = int4_weight(32, 128, seed=10)
    out = int4_amx.gemm_nt(x, w)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    torch.testing.assert_close(out[[0, 2]], int4_amx.gemm_ref(x[[0, 2]], w), rtol=1e-5, atol=1e-5)
    w13 = int4_weight(2, 128, 128, seed=11, group=64)
    w2 = int4_weight(2, 128, 64, seed=12, group=64)
    y = int4_amx.moe_experts(x, [0, 1], [2, 1], w13, w2, torch.ones(3))
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()


@pytest.mark.parametrize("T", [1, 3, 16])
def test_bound_moe_picks_by_the_rows_an_expert(T):
    """The decode step's bound call: the dots for fewer than FEW_ROWS rows an expert on
    average, the tiles from there, each against the reference over two routings; experts
    with no rows left out."""
    if not (int4_amx.available() or int4_amx.dots_available()):
        pytest.skip("no w4a8 kernel here")
    E, D, F_ = 8, 128, 64
    w13 = int4_weight(E, 2 * F_, D, seed=T, group=64, symmetric=False)
    w2 = int4_weight(E, D, F_, seed=T + 1, group=64)
    bound = int4_amx.BoundMoE.bind(w13, w2)
    assert bound is not None
    R = 2 * T  # two choices a token
    buffers = MoEBuffers.empty(R, D, F_, E, tokens=T)
    bound.prepare(buffers)
    g = torch.Generator().manual_seed(T)
    for _ in range(2):
        experts, counts, G_ = fill_routing(buffers, E, g)
        got = bound.run(G_)
        assert got is buffers.y_sorted
        assert bound.kind == int4_amx.moe_route(R / G_, T, w13, w2)
        want = int4_amx.moe_ref(buffers.x_sorted, experts, counts, w13, w2, buffers.weight)
        step = max_hidden_scale(buffers.x_sorted, experts, counts, w13)
        step *= w2.dequantize().abs().max() * buffers.weight.max()
        assert (got - want).abs().max() <= 2 * step
