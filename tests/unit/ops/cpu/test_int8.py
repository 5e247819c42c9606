"""The int8 kernels and the int8 projection's dispatch against their pure-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.cpu import int8
from moeserve.ops.linear import linear, linear_into
from moeserve.ops.linear import linear as linear_int8
from moeserve.ops.moe import experts_sorted, moe_grouped, moe_reference
from moeserve.quant.int8 import Int8Tensor, Int8Weight, quantize_rows
from tests.helpers import sort_by_expert

needs_kernels = pytest.mark.skipif(
    not int8.available(), reason="no AVX2/FMA CPU or no C compiler: the references are used"
)
# both variants of every kernel where this CPU runs them (AVX2 always, AVX-512F if present)
ISAS = [False, True] if int8.available() and int8.wide() else [False]
# the cases, shared with the aarch64 bodies' tests (test_arm_int8.py)
GEMM_ROWS = [1, 2, 3, 4, 5, 6, 7, 12, 13, 33, 64]
GEMM_SHAPES = [(64, 32), (33, 17), (130, 1001), (7, 8), (1, 3), (5, 2100)]
MOE_TOKENS = [1, 5, 30, 200]


def rows(N: int, K: int, seed: int) -> Int8Tensor:
    g = torch.Generator().manual_seed(seed)
    return Int8Tensor(*quantize_rows(torch.randn(N, K, generator=g)))


def ref(x: torch.Tensor, w: Int8Tensor) -> torch.Tensor:
    return int8.linear_int8_ref(x, w.q, w.scale)


@needs_kernels
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M", GEMM_ROWS)
@pytest.mark.parametrize("N,K", GEMM_SHAPES)
def test_gemm_matches_reference(M, N, K, avx512):
    """K not a multiple of 8, 16 or 64, odd N, K past one converted chunk (2048), M on both
    sides of a block (6 rows for AVX2, 12 for AVX-512)."""
    w = rows(N, K, M * 1000 + N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    assert int8.usable(x, w)
    got = int8.gemm_nt(x, w, avx512=avx512)
    torch.testing.assert_close(got, ref(x, w), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M", [3, 20])
def test_strided_rows_and_out(M, avx512):
    g = torch.Generator().manual_seed(0)
    big_x = torch.randn(M, 100, generator=g)
    stacked = rows(3 * 80, 100, 1)
    x = big_x[:, 10:74]
    w = Int8Tensor(stacked.q.view(3, 80, 100)[1, 5:45, 20:84], stacked.scale.view(3, 80)[1, 5:45])
    assert int8.usable(x, w)
    out = torch.full((M, 60), 7.0)
    int8.gemm_nt(x, w, out=out[:, 10:50], avx512=avx512)
    torch.testing.assert_close(out[:, 10:50], ref(x, w), rtol=1e-5, atol=1e-4)
    assert (out[:, :10] == 7).all() and (out[:, 50:] == 7).all()


@needs_kernels
@pytest.mark.skipif(ISAS != [False, True], reason="the packed panels need AVX-512F")
@pytest.mark.parametrize("M", [1, 7, 65, 300, 1000])
@pytest.mark.parametrize("N,K", [(700, 96), (64, 17), (1, 1001), (130, 64)])
def test_gemm_panels_matches_reference(M, N, K):
    """The GEMM with AVX-512 at any number of rows, packed panels from 24: part panels (N not
    a multiple of 64), K not a multiple of 16, rows not a multiple of the 6-row tile and fewer
    than 24 (the dot form), thread ranges cut inside a panel; x rows with a stride and a slice
    of a wider output left intact around it."""
    w = rows(N, K, M + N + K)
    x = torch.randn(M, K + 5, generator=torch.Generator().manual_seed(M))[:, :K]
    assert int8.usable(x, w)
    out = torch.full((M, N + 20), 7.0)
    int8.gemm_nt(x, w, out=out[:, 10 : N + 10], avx512=True)
    torch.testing.assert_close(out[:, 10 : N + 10], ref(x, w), rtol=1e-5, atol=1e-4)
    assert (out[:, :10] == 7).all() and (out[:, N + 10 :] == 7).all()


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M", [1, 64, 65, 300])
def test_projection_dispatch_matches_reference(M, avx512, monkeypatch):
    """The kernel up to 64 rows; beyond, the packed panels with AVX-512 and dequantized blocks
    for MKL with AVX2; bias, 3-D and bf16 inputs."""
    monkeypatch.setattr(int8, "wide", lambda: avx512)
    w, b = rows(700, 96, 2), torch.randn(700)
    x = torch.randn(M, 96)
    want = ref(x, w) + b
    torch.testing.assert_close(linear_int8(x, w, b), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        linear(x.view(1, M, 96), w, b), want.view(1, M, 700), rtol=1e-5, atol=1e-4
    )
    got16 = linear_int8(x.bfloat16(), w)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref(x.bfloat16(), w), rtol=1e-2, atol=1e-2)
    out = torch.empty(M, 700)
    linear_into(x, w, out)
    torch.testing.assert_close(out, want - b, rtol=1e-5, atol=1e-4)


def test_reference_fallback_without_kernels(monkeypatch):
    monkeypatch.setattr(int8, "available", lambda: False)
    w = Int8Weight((50, 40))
    t = torch.randn(50, 40)
    w.copy_(t)
    for M in (1, 100):
        x = torch.randn(M, 40)
        assert not int8.usable(x, w.data)
        torch.testing.assert_close(linear(x, w), F.linear(x, w.dequantize()), rtol=1e-5, atol=1e-4)


def _sorted_inputs(T: int, E: int, K: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids, w


@pytest.mark.parametrize("T", MOE_TOKENS)
def test_moe_matches_references(T):
    """The one-call MoE kernel (any number of rows per expert: 200 tokens give ~50), against
    the int8 reference and the fp32 oracle on the dequantized weights."""
    E, D, Fd, K = 8, 40, 24, 2
    w13 = Int8Weight((E, 2 * Fd, D))
    w2 = Int8Weight((E, D, Fd))
    w13.copy_(torch.randn(E, 2 * Fd, D))
    w2.copy_(torch.randn(E, D, Fd))
    x, ids, w = _sorted_inputs(T, E, K, D, T)
    oracle = moe_reference(x, w13.dequantize(), w2.dequantize(), w, ids)
    torch.testing.assert_close(moe_grouped(x, w13, w2, w, ids), oracle, rtol=1e-4, atol=1e-3)
    order, experts, counts = sort_by_expert(ids, E)
    x_RD, weight_R = x[order // K], w.reshape(-1)[order]
    want = int8.moe_int8_ref(x_RD, experts, counts, w13.data, w2.data, weight_R)
    got = experts_sorted(
        x_RD, weight_R, torch.bincount(ids.reshape(-1), minlength=E).tolist(), w13, w2
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert int8.moe_usable(x_RD, counts, w13.data, w2.data) == int8.available()
    if int8.available():
        for avx512 in ISAS:
            kernel = int8.moe_experts(x_RD, experts, counts, w13.data, w2.data, weight_R, avx512)
            torch.testing.assert_close(kernel, want, rtol=1e-4, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("mkl_min_rows", [None, 20, 1])
@pytest.mark.parametrize("D,Fd", [(40, 24), (64, 96)])
def test_moe_kernel_with_big_groups(avx512, mkl_min_rows, D, Fd, monkeypatch):
    """Groups of MKL_MIN_ROWS rows or more dequantized through MKL beside the kernel (all
    groups, none, a mix with big ones first and last; 150 rows past the kernel call's split
    at 128); the kernel's groups of 24+ rows take the AVX-512 packed-panel path, which converts
    and scales the int8 rows while packing. D = 40 and F = 24 leave column tails (K not a
    multiple of 16) and part panels, D = 64 and F = 96 whole panels and a part one."""
    monkeypatch.setattr(int8, "MKL_MIN_ROWS", mkl_min_rows)
    monkeypatch.setattr(int8, "MKL_MIN_ROWS_WIDE", mkl_min_rows)
    g = torch.Generator().manual_seed(D)
    counts = [30, 3, 25, 1, 150, 7, 22]
    E, R = len(counts), sum(counts)
    w13 = Int8Tensor(*quantize_rows(torch.randn(E, 2 * Fd, D, generator=g)))
    w2 = Int8Tensor(*quantize_rows(torch.randn(E, D, Fd, generator=g)))
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    experts = list(range(E))
    assert int8.moe_usable(x, counts, w13, w2)
    got = int8.moe_experts(x, experts, counts, w13, w2, weight, avx512)
    want = int8.moe_int8_ref(x, experts, counts, w13, w2, weight)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
