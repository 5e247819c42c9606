"""The fp32 CPU kernels against their pure-torch references: the few-row GEMM (``F.linear``),
the one-call MoE (``moe_reference``), the per-head GEMM (``torch.bmm``), RMSNorm and routing.
The GEMMs run on both of their variants where this CPU has them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.linear import linear, linear_into
from tests.helpers import sort_by_expert

pytestmark = pytest.mark.skipif(
    not fp32_kernels.available(), reason="no AVX2/FMA CPU or no C compiler: F.linear is used"
)
# both variants of every GEMM where this CPU runs them (AVX2 always, AVX-512F if present)
ISAS = [False, True] if fp32_kernels.available() and fp32_kernels.wide() else [False]
# the cases, shared with the aarch64 bodies' tests (test_arm_fp32.py)
GEMM_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 16, 25, 33, 64, 70, 130]
GEMM_SHAPES = [(64, 32), (33, 17), (130, 1001), (7, 8), (1, 3), (9, 72)]
MOE_SHAPES = [(1, 40, 24), (5, 40, 24), (30, 40, 24), (100, 37, 21)]
HEAD_SHAPES = [(1, 40), (3, 40), (8, 40), (13, 40), (64, 40), (13, 128)]
ROUTING_CASES = [(8, 4, True), (1, 1, False), (4, 4, True)]


def moe_case(T: int, D: int, Fd: int):
    """test_moe_kernel_matches_reference's inputs: ``(x, w13, w2, w, ids)`` of T tokens
    routed to 2 of 8 experts."""
    g = torch.Generator().manual_seed(T)
    E, K = 8, 2
    x = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * Fd, D, generator=g), torch.randn(E, D, Fd, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, w13, w2, w, ids


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M", GEMM_ROWS)
@pytest.mark.parametrize("N,K", GEMM_SHAPES)
def test_matches_linear(M, N, K, avx512):
    """Odd N and N % 4 != 0 (AVX-512 takes quads of weight rows), K not a multiple of 8, 16
    or 64, M on both sides of a block (6 rows; 12 for AVX-512's pairs), of the AVX-512 pairs'
    range (5..7 rows) and of MAX_ROWS (the kernel takes any M; the dispatch stops there)."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    got = fp32_kernels.gemm_nt(x, w, avx512=avx512)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M", [5, 20])
def test_strided_operands_and_out(M, avx512):
    g = torch.Generator().manual_seed(0)
    big_x = torch.randn(M, 100, generator=g)
    stacked = torch.randn(3, 80, 100, generator=g)
    x, w = big_x[:, 10:74], stacked[1, 5:45, 20:84]  # row strides 100, unit column strides
    assert fp32_kernels.usable(x, w)
    out = torch.full((M, 60), 7.0)
    fp32_kernels.gemm_nt(x, w, out=out[:, 10:50], avx512=avx512)
    torch.testing.assert_close(out[:, 10:50], F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert (out[:, :10] == 7).all() and (out[:, 50:] == 7).all()  # nothing outside written


def test_dispatch_falls_back_where_the_kernel_does_not_apply():
    rows = fp32_kernels.MAX_ROWS + 1
    x, w, b = torch.randn(rows, 8), torch.randn(4, 8), torch.randn(4)
    assert not fp32_kernels.usable(x, w)  # too many rows
    assert not fp32_kernels.usable(x[:2].double(), w.double())
    assert not fp32_kernels.usable(x[:2], w.t().contiguous().t())  # column-major weight
    for rows in (1, fp32_kernels.MAX_ROWS + 1):
        torch.testing.assert_close(linear(x[:rows], w, b), F.linear(x[:rows], w, b))
    out = torch.empty(3, 4)
    linear_into(x[:3], w, out)
    torch.testing.assert_close(out, F.linear(x[:3], w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("T,D,Fd", MOE_SHAPES)
def test_moe_kernel_matches_reference(T, D, Fd, avx512):
    """Groups of 1 to ~35 rows (past a 12-row block); D odd and F odd in the last case."""
    from moeserve.ops.moe import moe_grouped, moe_reference

    x, w13, w2, w, ids = moe_case(T, D, Fd)
    E, K = w13.shape[0], ids.shape[1]
    ref = moe_reference(x, w13, w2, w, ids)
    order, experts, counts = sort_by_expert(ids, E)
    y_RD = fp32_kernels.moe_experts(
        x[order // K], experts, counts, w13, w2, w.reshape(-1)[order], avx512
    )
    got = torch.zeros_like(x).index_add_(0, order // K, y_RD)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(moe_grouped(x, w13, w2, w, ids), ref, rtol=1e-4, atol=1e-3)


def _expert_loop(x, counts, w13, w2, weight):
    """Each expert's rows through F.linear: the reference of the grouped calls below."""
    Fd = w2.shape[2]
    want, start = torch.empty_like(x), 0
    for e, n in enumerate(counts):
        gate, up = F.linear(x[start : start + n], w13[e]).split(Fd, dim=-1)
        want[start : start + n] = F.linear(F.silu(gate) * up, w2[e]) * weight[start:, None][:n]
        start += n
    return want


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("mkl_min_rows", [None, 20, 1])
def test_moe_kernel_with_big_groups_through_mkl(avx512, mkl_min_rows, monkeypatch):
    """Groups of MKL_MIN_ROWS rows or more run as MKL GEMMs beside the kernel, which then
    takes the groups between them (rows not back to back: its activation pass must skip the
    rows it leaves out); all groups big, none big, and a mix with big ones first and last.
    Groups of 24+ rows left to the AVX-512 kernel take its packed-panel path (moe_packed.h),
    D = 40 and F = 24 leaving column tails and a part panel."""
    monkeypatch.setattr(fp32_kernels, "MKL_MIN_ROWS", mkl_min_rows)
    monkeypatch.setattr(fp32_kernels, "MKL_MIN_ROWS_WIDE", mkl_min_rows)
    g = torch.Generator().manual_seed(5)
    counts = [30, 3, 25, 1, 40, 7, 22]
    E, D, Fd, R = len(counts), 40, 24, sum(counts)
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    w13, w2 = torch.randn(E, 2 * Fd, D, generator=g), torch.randn(E, D, Fd, generator=g)
    got = fp32_kernels.moe_experts(x, list(range(E)), counts, w13, w2, weight, avx512)
    want = _expert_loop(x, counts, w13, w2, weight)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("avx512", ISAS)
def test_moe_kernel_activation_at_extreme_gates(avx512):
    """The vector silu (e^-|g| for both signs) against F.silu where gates reach the hundreds
    (e^-g over- or underflows in a naive form) and sit near 0; F = 37 leaves a scalar tail."""
    g = torch.Generator().manual_seed(9)
    counts, D, Fd = [9, 4], 16, 37
    R = sum(counts)
    x, weight = torch.randn(R, D, generator=g) * 60, torch.rand(R, generator=g)
    x[-1] *= 1e-6
    w13, w2 = torch.randn(2, 2 * Fd, D, generator=g), torch.randn(2, D, Fd, generator=g)
    got = fp32_kernels.moe_experts(x, [0, 1], counts, w13, w2, weight, avx512)
    want = _expert_loop(x, counts, w13, w2, weight)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("avx512", ISAS)
def test_moe_kernel_splits_groups_past_max_rows(avx512, monkeypatch):
    """Prefill: the folded shared-expert slot takes every token; its rows are split into
    groups of at most MAX_ROWS and the one-call kernel still applies (with MKL_MIN_ROWS out of
    the way; the int8 kernel always splits)."""
    from moeserve.ops.moe import experts_sorted

    monkeypatch.setattr(fp32_kernels, "MKL_MIN_ROWS", None)
    monkeypatch.setattr(fp32_kernels, "MKL_MIN_ROWS_WIDE", None)
    g = torch.Generator().manual_seed(3)
    E, D, Fd = 3, 24, 20
    counts = [5, 0, 2 * fp32_kernels.MAX_ROWS + 7]
    R = sum(counts)
    x, weight = torch.randn(R, D, generator=g), torch.rand(R, generator=g)
    w13, w2 = torch.randn(E, 2 * Fd, D, generator=g), torch.randn(E, D, Fd, generator=g)
    want = _expert_loop(x, counts, w13, w2, weight)
    meta = fp32_kernels.moe_call_buffers(R, D, Fd, [0, 2], [5, counts[2]], weight)[0]
    assert meta.shape[1] == 4 and meta[2].max() <= fp32_kernels.MAX_ROWS and meta[2].sum() == R
    assert fp32_kernels.moe_usable(x, [5, counts[2]], w13, w2)
    got = fp32_kernels.moe_experts(x, [0, 2], [5, counts[2]], w13, w2, weight, avx512)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(
        experts_sorted(x, weight, counts, w13, w2), want, rtol=1e-4, atol=1e-3
    )


@pytest.mark.parametrize("n_group,topk_group,norm", ROUTING_CASES)
def test_routing_kernel_matches_reference(n_group, topk_group, norm):
    from moeserve.ops.routing import route_grouped_sigmoid

    g = torch.Generator().manual_seed(n_group)
    logits, bias = torch.randn(16, 64, generator=g), torch.randn(64, generator=g) * 0.1
    got_w, got_ids = fp32_kernels.route_grouped_sigmoid(
        logits, bias, 6, n_group, topk_group, norm, 2.5
    )
    ref_w, ref_ids = route_grouped_sigmoid(logits, bias, 6, n_group, topk_group, norm, 2.5)
    got_sorted, got_order = got_ids.sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    assert torch.equal(got_sorted, ref_sorted)
    torch.testing.assert_close(got_w.gather(1, got_order), ref_w.gather(1, ref_order))


def test_rms_norm_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 2, 1003, generator=g), torch.randn(1003, generator=g)
    got = fp32_kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (1003,), w, 1e-6), rtol=1e-5, atol=1e-5)
    too_many = torch.randn(fp32_kernels.MAX_ROWS + 1, 8)
    assert fp32_kernels.rms_norm(too_many, torch.ones(8), 1e-6) is None


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M,K", HEAD_SHAPES)
def test_head_gemm_matches_bmm(M, K, avx512):
    """Per-head GEMMs as MLA's absorbed decode calls them: head-major views of batch-major
    tensors in, a batch-major output written through a transposed view."""
    g = torch.Generator().manual_seed(M)
    H, N = 5, 33
    x_MHK = torch.randn(M, H, K + 3, generator=g)[:, :, 3:]  # row stride != K
    w_HNK = torch.randn(H, N, K, generator=g)
    x_HMK = x_MHK.transpose(0, 1)
    want = torch.bmm(x_HMK, w_HNK.transpose(1, 2))
    got = fp32_kernels.head_gemm_nt(x_HMK, w_HNK, avx512=avx512)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    out_MHN = torch.full((M, H, N), 7.0)
    assert fp32_kernels.head_gemm_nt(x_HMK, w_HNK, out_MHN.transpose(0, 1), avx512) is not None
    torch.testing.assert_close(out_MHN.transpose(0, 1), want, rtol=1e-5, atol=1e-4)
    assert fp32_kernels.head_gemm_nt(x_HMK.double(), w_HNK.double()) is None


def test_routing_kernel_counts_and_appends_the_shared_slot():
    from moeserve.ops.routing import route_grouped_sigmoid

    g = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(9, 64, generator=g), torch.randn(64, generator=g) * 0.1
    args = (logits, bias, 6, 8, 4, True, 2.5)
    want_w, want_ids = route_grouped_sigmoid(*args)
    counts = torch.full((64,), 3, dtype=torch.int64)
    got_w, got_ids = fp32_kernels.route_grouped_sigmoid(*args, counts_E=counts, extra_id=64)
    assert got_ids.shape == (9, 7) and (got_ids[:, 6] == 64).all() and (got_w[:, 6] == 1).all()
    order_got, order_want = got_ids[:, :6].sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(
        got_w[:, :6].gather(1, order_got.indices), want_w.gather(1, order_want.indices)
    )
    assert torch.equal(counts, 3 + torch.bincount(want_ids.flatten(), minlength=64))


# bf16 weights: the same bodies with each weight widened in registers (the bf16 format's
# kernels without AMX), against the same references on the widened weights
BF16_ROWS = [1, 3, 5, 12, 13, 33]


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("M", BF16_ROWS)
@pytest.mark.parametrize("N,K", [(33, 17), (130, 1001), (9, 72)])
def test_bf16_weights_match_linear(M, N, K, avx512):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
    assert fp32_kernels.usable(x, w)
    got = fp32_kernels.gemm_nt(x, w, avx512=avx512)
    torch.testing.assert_close(got, F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    bound = fp32_kernels.bind_gemm(w, lambda x_: F.linear(x_, w.float()))  # this CPU's ISA
    torch.testing.assert_close(bound(x), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("T,D,Fd", MOE_SHAPES)
def test_bf16_weights_moe_matches_reference(T, D, Fd, avx512):
    from moeserve.ops.moe import moe_reference

    x, w13, w2, w, ids = moe_case(T, D, Fd)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    E, K = w13.shape[0], ids.shape[1]
    ref = moe_reference(x, w13.float(), w2.float(), w, ids)
    order, experts, counts = sort_by_expert(ids, E)
    x_RD, weight_R = x[order // K], w.reshape(-1)[order]
    assert fp32_kernels.moe_usable(x_RD, counts, w13, w2)
    y_RD = fp32_kernels.moe_experts(x_RD, experts, counts, w13, w2, weight_R, avx512)
    got = torch.zeros_like(x).index_add_(0, order // K, y_RD)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("avx512", ISAS)
def test_bf16_weights_head_gemm_matches_bmm(avx512):
    g = torch.Generator().manual_seed(7)
    H, M, N, K = 5, 13, 33, 40
    x_HMK = torch.randn(H, M, K, generator=g)
    w_HNK = torch.randn(H, N, K, generator=g).bfloat16()
    want = torch.bmm(x_HMK, w_HNK.float().transpose(1, 2))
    got = fp32_kernels.head_gemm_nt(x_HMK, w_HNK, avx512=avx512)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert fp32_kernels.bind_head_gemm(w_HNK) is not None
    assert fp32_kernels.head_gemm_nt(x_HMK, w_HNK.half()) is None  # fp16: not a kernel's
