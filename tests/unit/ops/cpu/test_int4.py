"""The int4 kernels against their pure-torch references (``ops/cpu/int4.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.cpu import build, int4
from moeserve.ops.cpu.bound import MoEBuffers
from moeserve.quant.int4 import Int4Tensor, Int4Weight, pack_nibbles, quantize_groups
from tests.helpers import fill_routing

needs_kernels = pytest.mark.skipif(
    not int4.available(), reason="no AVX2/FMA CPU or no C compiler: the references are used"
)
# every variant of the kernels this CPU runs: AVX2's FMA form and integer dots always,
# AVX-512F's lookups and AVX-512 VNNI's integer dots where present
ISAS = [int4.AVX2, int4.AVX2_IDOT]
if int4.available() and int4.wide():
    ISAS += [int4.AVX512] + ([int4.VNNI] if int4.isa() == int4.VNNI else [])
WIDE = [level for level in ISAS if level in (int4.AVX512, int4.VNNI)]  # any number of rows
ROUNDING = [level for level in ISAS if int4.rounds_rows(level, 1)]  # the integer dots
# on both sides of a register block (AVX2: 6 rows, then the fp32 chunks; AVX-512: blocks of
# 4 over quads of weight rows), past the GEMM's MAX_ROWS (64) through gemm_nt directly
ROWS = [1, 2, 3, 4, 5, 6, 7, 12, 13, 31, 64, 100]


def weights(N: int, K: int, G: int, kind: str, seed: int) -> Int4Tensor:
    """``[N, K]`` int4 rows with groups of ``G``: fp32 quantized symmetric or asymmetric, or
    random codes, zero points (any of 0..15) and scales."""
    g = torch.Generator().manual_seed(seed)
    if kind != "codes":
        w = torch.randn(N, K, generator=g)
        return Int4Tensor(*quantize_groups(w, G, symmetric=kind == "symmetric"))
    u = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    zero = torch.randint(0, 16, (N, K // G), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, K // G, generator=g) * 0.1
    return Int4Tensor(pack_nibbles(u), scale, zero)


def assert_close(got: torch.Tensor, want: torch.Tensor, level: int = int4.AVX2) -> None:
    """fp32 sums in another order (and dequantizing as u * s - z * s): relative to the
    result's magnitude. An MoE call on the integer dots rounds its hidden rows, which the
    reference computes in another order: an element on a tie of the 2^-16 grid may round to
    the other neighbour (5x the margin; seen: 1.25x)."""
    atol = (5e-5 if int4.rounds_rows(level, 1) else 1e-5) * max(1.0, want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


def _shapes():
    for N, K in [(64, 32), (33, 96), (130, 128), (7, 384), (1, 384), (20, 1152)]:
        for G in (32, 64, 128):
            if K % G == 0:
                yield N, K, G


@needs_kernels
@pytest.mark.parametrize("level", ISAS)
@pytest.mark.parametrize("kind", ["symmetric", "asymmetric", "codes"])
@pytest.mark.parametrize("N,K,G", list(_shapes()))
def test_gemm_matches_reference(N, K, G, kind, level):
    """N not a multiple of the panel (8) or of a quad, K of one run (32) up to past one
    dequantized chunk (1024 columns), every group size that divides K."""
    w = weights(N, K, G, kind, N * 1000 + K + G)
    g = torch.Generator().manual_seed(K)
    for M in ROWS:
        x = torch.randn(M, K, generator=g)
        assert int4.usable(x, w) == (M <= int4.MAX_ROWS or int4.wide())
        assert_close(int4.gemm_nt(x, w, level=level), int4.linear_isa_ref(x, w, level))


@needs_kernels
@pytest.mark.skipif(not WIDE, reason="any number of rows needs AVX-512F")
@pytest.mark.parametrize("level", WIDE)
@pytest.mark.parametrize("M", [65, 129, 255, 256, 300])
def test_gemm_many_rows(M, level):
    """With AVX-512 the GEMM takes any number of rows, in passes of at least 64 rows (here
    64: K = 2048) over the weight, with VNNI on the integer dots up to 255 rows; strided x
    rows and output columns."""
    N, K = 70, 2048
    w = weights(N, K, 64, "asymmetric", M)
    x = torch.randn(M, K + 3, generator=torch.Generator().manual_seed(M))[:, :K]
    assert int4.usable(x, w)
    out = torch.full((M, N + 20), 7.0)
    int4.gemm_nt(x, w, out=out[:, 10 : N + 10], level=level)
    assert_close(out[:, 10 : N + 10], int4.linear_isa_ref(x, w, level))
    assert (out[:, :10] == 7).all() and (out[:, N + 10 :] == 7).all()


@needs_kernels
@pytest.mark.parametrize("level", ROUNDING)
@pytest.mark.parametrize("M", [1, 5])
def test_integer_dots_against_fp32(M, level):
    """The integer dots against the fp32 reference on x as it is: each output within the
    rounding of x to 2^-16 of its row's largest |x| (|w| summed against half a step), with
    rows of outliers (one channel 300x the rest) as LLM activations have; a zero row gives
    zeros, a row with an inf or a nan gives nan (its other rows are exact)."""
    N, K, G = 96, 1024, 128
    w = weights(N, K, G, "asymmetric", M)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g)
    x[:, 7] *= 300.0
    got = int4.gemm_nt(x, w, level=level)
    step = x.abs().amax(dim=1, keepdim=True) / int4.XMAX  # [M, 1]
    bound = 0.5 * step * w.dequantize().abs().sum(dim=1) + 1e-5 * got.abs().amax()
    want = int4.linear_int4_ref(x, w)
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # rounded: not the fp32 products
    bad = torch.randn(5, K, generator=g)
    bad[0] = 0.0
    bad[1, 3], bad[2, 9] = float("inf"), float("nan")
    got = int4.gemm_nt(bad[:M] if M > 1 else bad[1:2], w, level=level)
    want = int4.linear_isa_ref(bad[:M] if M > 1 else bad[1:2], w, level)
    assert got.isnan().equal(want.isnan()) and want[:, 0].isnan().any()
    assert_close(got.nan_to_num(), want.nan_to_num())
    if M > 1:
        assert (got[0] == 0).all() and got[1:3].isnan().all()


# AVX-512 GEMMs from 40 rows (int4.c's Q4_GEMM_PACK_MIN_ROWS): packed panels of 64 weight
# rows, 6-row tiles
PANEL_ROWS = [24, 39, 40, 41, 47, 100, 200]


@needs_kernels
@pytest.mark.skipif(not WIDE, reason="the packed panels need AVX-512F")
@pytest.mark.parametrize("kind", ["symmetric", "asymmetric", "codes"])
@pytest.mark.parametrize("N,K,G", [(70, 256, 32), (130, 384, 64), (64, 384, 128), (200, 512, 128)])
def test_gemm_packed_panels(N, K, G, kind):
    """Many rows with AVX-512: N not a multiple of the panel (64), every group size, fewer
    than 16 groups a row and more; strided x rows and output columns."""
    w = weights(N, K, G, kind, N + K + G)
    g = torch.Generator().manual_seed(G)
    for M in PANEL_ROWS:
        x = torch.randn(M, K + 5, generator=g)[:, :K]
        out = torch.full((M, N + 9), 7.0)
        int4.gemm_nt(x, w, out=out[:, 4 : N + 4], level=int4.AVX512)
        assert_close(out[:, 4 : N + 4], int4.linear_int4_ref(x, w))
        assert (out[:, :4] == 7).all() and (out[:, N + 4 :] == 7).all()


@needs_kernels
@pytest.mark.skipif(not WIDE, reason="the packed panels need AVX-512F")
@pytest.mark.parametrize("level", WIDE)
@pytest.mark.parametrize("G,kind", [(32, "asymmetric"), (64, "symmetric"), (128, "asymmetric")])
def test_moe_many_rows(G, kind, level, monkeypatch):
    """An AVX-512 MoE call with experts of 32 rows or more: those through packed panels, the
    others (1-31 rows) in registers in the same call; with VNNI, all on the integer dots
    (the call splits an expert of 256 rows into two groups of 128); with groups of 32, D
    (w2's rows) not a multiple of 64."""
    monkeypatch.setattr(int4, "MKL_MIN_ROWS_WIDE", None)
    counts = [40, 3, 33, 120, 31, 200, 24, 64] + ([256] if G == 64 else [])
    experts = [6, 0, 2, 7, 1, 3, 5, 4, 8][: len(counts)]
    D, Fd = (352, 160) if G == 32 else (384, 256)
    w13, w2 = _moe_weights(len(counts), D, Fd, G, kind, G)
    g = torch.Generator().manual_seed(G + 1)
    R = sum(counts)
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    got = int4.moe_experts(x, experts, counts, w13, w2, weight, level)
    assert_close(got, int4.moe_int4_ref(x, experts, counts, w13, w2, weight, level), level)


@needs_kernels
@pytest.mark.parametrize("level", ISAS)
@pytest.mark.parametrize("M", [1, 3, 7, 20])
def test_strided_rows_and_out(M, level):
    """x rows and code rows with a stride, a slice of a wider output left intact around."""
    K, G, N = 128, 32, 42
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K + 40, generator=g)[:, 16 : 16 + K]
    full = weights(50, K, G, "asymmetric", M)
    wide_q = torch.zeros(50, K // 2 + 24, dtype=torch.uint8)
    wide_q[:, 8 : 8 + K // 2] = full.q
    w = Int4Tensor(wide_q[3 : 3 + N, 8 : 8 + K // 2], full.scale[3 : 3 + N], full.zero[3 : 3 + N])
    assert w.q.stride(0) == K // 2 + 24 and int4.usable(x, w)
    out = torch.full((M, N + 20), 7.0)
    int4.gemm_nt(x, w, out=out[:, 10 : N + 10], level=level)
    assert_close(out[:, 10 : N + 10], int4.linear_isa_ref(x, full[3 : 3 + N], level))
    assert (out[:, :10] == 7).all() and (out[:, N + 10 :] == 7).all()


@needs_kernels
def test_bound_gemm():
    """The bound call for decode rows (into ``out`` too); more rows than MAX_ROWS (with
    either ISA), or another dtype, go to the fallback."""
    w = weights(72, 256, 64, "asymmetric", 3)
    calls = []

    def fallback(x):
        calls.append(x.shape[0])
        return int4.linear_int4_ref(x, w)

    bound = int4.bind_gemm(w, fallback)
    assert bound is not None and [t for t, _ in bound.pointers] == [w.q, w.scale, w.zero]
    for M in (1, 5, 64):
        x = torch.randn(M, 256)
        assert_close(bound(x), int4.linear_isa_ref(x, w))
        out = torch.empty(M, 72)
        assert bound(x, out) is out
        assert_close(out, int4.linear_isa_ref(x, w))
    assert not calls
    x = torch.randn(65, 256)
    assert_close(bound(x), int4.linear_int4_ref(x, w))
    bound(x.bfloat16())
    assert calls == [65, 65]
    assert int4.bind_gemm(Int4Tensor(w.q, w.scale.t().contiguous().t(), w.zero), fallback) is None


@needs_kernels
@pytest.mark.parametrize("kind", ["symmetric", "codes"])
@pytest.mark.parametrize("N,K,G", [(1, 32, 32), (37, 384, 128), (300, 192, 64)])
def test_dequantize_into(N, K, G, kind):
    """Into a wider fp32 buffer (rows ldo apart), rows of a bigger weight."""
    w = weights(N + 5, K, G, kind, N)[2 : N + 2]
    buf = torch.full((N, K + 8), 3.0)
    got = int4.dequantize_into(w, buf[:, :K])
    assert got.data_ptr() == buf.data_ptr()
    want = w.dequantize()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())
    assert (buf[:, K:] == 3).all()


def _moe_weights(E, D, Fd, G, kind, seed):
    g = torch.Generator().manual_seed(seed)
    sym = kind == "symmetric"
    w13 = Int4Tensor(*quantize_groups(torch.randn(E, 2 * Fd, D, generator=g), G, sym))
    w2 = Int4Tensor(*quantize_groups(torch.randn(E, D, Fd, generator=g), G, sym))
    return w13, w2


@needs_kernels
@pytest.mark.parametrize("level", ISAS)
@pytest.mark.parametrize("mkl_min_rows", [None, 20, 1])
@pytest.mark.parametrize("D,Fd,G,kind", [(64, 96, 32, "asymmetric"), (128, 256, 128, "symmetric")])
def test_moe_matches_reference(level, mkl_min_rows, D, Fd, G, kind, monkeypatch):
    """Uneven groups (1 to 150 rows: past fp32.MAX_ROWS, where the call splits a group), of
    experts out of order; the groups of mkl_min_rows rows or more dequantized for MKL beside
    the kernel (none, a mix with big ones first and last, all)."""
    monkeypatch.setattr(int4, "MKL_MIN_ROWS", mkl_min_rows)
    monkeypatch.setattr(int4, "MKL_MIN_ROWS_WIDE", mkl_min_rows)
    counts = [30, 3, 25, 1, 150, 7, 22]
    experts = [5, 0, 2, 6, 1, 3, 4]
    w13, w2 = _moe_weights(7, D, Fd, G, kind, D + G)
    g = torch.Generator().manual_seed(Fd)
    R = sum(counts)
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    assert int4.moe_usable(x, counts, w13, w2)
    got = int4.moe_experts(x, experts, counts, w13, w2, weight, level)
    assert_close(got, int4.moe_int4_ref(x, experts, counts, w13, w2, weight, level), level)


@needs_kernels
@pytest.mark.parametrize("T", [1, 4, 16])
def test_bound_moe(T):
    """The decode step's bound call over sorted rows in MoEBuffers, reused for two routings;
    experts with no rows left out."""
    E, D, Fd, G = 8, 64, 32, 32
    w13, w2 = _moe_weights(E, D, Fd, G, "asymmetric", T)
    bound = int4.BoundMoE.bind(w13, w2)
    assert bound is not None
    g = torch.Generator().manual_seed(T)
    R = 2 * T
    buffers = MoEBuffers.empty(R, D, Fd, E)
    bound.prepare(buffers)
    for _ in range(2):
        experts, counts, G_ = fill_routing(buffers, E, g)
        got = bound.run(G_)
        assert got is buffers.y_sorted
        want = int4.moe_int4_ref(buffers.x_sorted, experts, counts, w13, w2, buffers.weight)
        assert_close(got, want, int4.isa())


def test_group_sizes_the_kernels_take():
    """One group size for both MoE projections, and one of 32, 64, 128 (an Int4Tensor built
    by hand may have another)."""
    w13, _ = _moe_weights(2, 64, 64, 64, "symmetric", 0)
    _, w2 = _moe_weights(2, 64, 64, 32, "symmetric", 0)
    x = torch.randn(3, 64)
    assert not int4.moe_usable(x, [3], w13, w2)
    assert int4.BoundMoE.bind(w13, w2) is None
    w = weights(8, 256, 128, "codes", 0)
    w256 = Int4Tensor(w.q, w.scale[:, :1].contiguous(), w.zero[:, :1].contiguous())
    assert w256.group_size == 256
    assert not int4.usable(torch.randn(1, 256), w256)
    assert int4.bind_gemm(w256, lambda x: x) is None


def test_reference_fallback_without_kernels(monkeypatch):
    """MOESERVE_CPU_KERNELS=0: no library, so nothing takes the kernels and the projection
    runs the reference."""
    monkeypatch.setenv("MOESERVE_CPU_KERNELS", "0")
    assert build.load.__wrapped__(int4._SOURCE) is None  # what _library() then holds
    monkeypatch.setattr(int4, "available", lambda: False)
    w = Int4Weight((50, 64), group_size=32, symmetric=False)
    w.copy_(torch.randn(50, 64))
    w13, w2 = _moe_weights(2, 64, 32, 32, "symmetric", 1)
    assert int4.bind_gemm(w.data, lambda x: x) is None
    assert int4.BoundMoE.bind(w13, w2) is None
    assert not int4.moe_usable(torch.randn(3, 64), [3], w13, w2)
    for M in (1, 100):
        x = torch.randn(M, 64)
        assert not int4.usable(x, w.data)
        want = F.linear(x, w.dequantize())
        torch.testing.assert_close(int4.linear_int4_ref(x, w.data), want)
        from moeserve.ops.linear import linear  # the int4 format's dispatch

        torch.testing.assert_close(linear(x, w), want, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("level", ROUNDING)
def test_any_thread_count_gives_the_same_bits(level):
    """The threads share the panels and the MoE jobs out by work stealing (common.h's
    jobs_next): which thread runs a job must not change a bit of the result, with 1 to 3
    threads and with a GEMM below the parallel threshold (one thread runs, the other slots
    are stolen)."""
    g = torch.Generator().manual_seed(7)
    big, small = weights(520, 256, 64, "asymmetric", 1), weights(40, 128, 32, "codes", 2)
    x_big, x_small = torch.randn(1, 256, generator=g), torch.randn(3, 128, generator=g)
    counts, experts = [1, 2, 1, 3, 1], [4, 0, 3, 1, 2]
    w13, w2 = _moe_weights(5, 128, 96, 32, "asymmetric", 3)
    x_moe, weight = torch.randn(sum(counts), 128, generator=g), torch.rand(sum(counts), generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(
                (
                    int4.gemm_nt(x_big, big, level=level),
                    int4.gemm_nt(x_small, small, level=level),
                    int4.moe_experts(x_moe, experts, counts, w13, w2, weight, level),
                )
            )
    finally:
        torch.set_num_threads(before)
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)
    assert_close(results[0][0], int4.linear_isa_ref(x_big, big, level), level)
    want_moe = int4.moe_int4_ref(x_moe, experts, counts, w13, w2, weight, level)
    assert_close(results[0][2], want_moe, level)


@needs_kernels
def test_zero_points_of_8_are_not_read(monkeypatch):
    """A bound call on symmetric weights whose zero points are all 8 flags its isa
    (``ZERO8``): the integer dots take 8 without reading them. Shown with the flag and zero
    points of 3: the dots give the result of 8, any other form reads the 3s. The bound calls
    set the flag only for symmetric weights of zero points 8 (one 7, or an asymmetric weight:
    no flag)."""
    w = weights(40, 256, 64, "symmetric", 5)
    assert bool((w.zero == 8).all()) and int4.zero8(w) == int4.ZERO8
    off = Int4Tensor(w.q, w.scale, torch.full_like(w.zero, 3))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    for level in ISAS:
        got = int4.gemm_nt(x, off, level=level | int4.ZERO8)
        want = off if level not in ROUNDING else w
        assert_close(got, int4.linear_isa_ref(x, want, level), level)
    odd = Int4Tensor(w.q, w.scale, w.zero.clone())
    odd.zero[5, 1] = 7
    assert int4.zero8(odd) == 0
    assert int4.zero8(Int4Tensor(w.q, w.scale, w.zero, symmetric=False)) == 0
    assert int4.zero8(w, odd) == 0
    monkeypatch.setenv("MOESERVE_INT4_ZERO8", "0")
    assert int4.zero8(w) == 0
    monkeypatch.delenv("MOESERVE_INT4_ZERO8")
    for weight in (w, odd):  # bound: the flag where it holds, the zero points read where not
        bound = int4.bind_gemm(weight, lambda x: None)
        assert bound.wide == int4.isa() | int4.zero8(weight)
        assert_close(bound(x), int4.linear_isa_ref(x, weight), int4.isa())
    E, D, Fd, G = 4, 128, 64, 64
    w13, w2 = _moe_weights(E, D, Fd, G, "symmetric", 6)
    bound_moe = int4.BoundMoE.bind(w13, w2)
    assert bound_moe.isa == int4.isa() | int4.ZERO8
    buffers = MoEBuffers.empty(6, D, Fd, E)
    bound_moe.prepare(buffers)
    experts, counts, G_ = fill_routing(buffers, E, torch.Generator().manual_seed(6))
    want = int4.moe_int4_ref(buffers.x_sorted, experts, counts, w13, w2, buffers.weight)
    assert_close(bound_moe.run(G_), want, int4.isa())
