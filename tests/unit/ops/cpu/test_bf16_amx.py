"""The bf16 AMX kernels (``ops/cpu/bf16_amx.c``) against fp32 references on the same bf16 values.

Products of bf16 values are exact in fp32, so against a reference on the bf16-rounded inputs
only the summation order differs (fp32 results: ~1e-6). bf16 results add one rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.cpu import bf16_amx
from moeserve.ops.moe import moe_grouped, moe_reference

pytestmark = pytest.mark.skipif(not bf16_amx.available(), reason="no AMX here: the references run")


def bf(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 and back: the values the kernel multiplies"""
    return t.bfloat16().float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 32, 32),  # one token, one job
        (5, 48, 64),  # a 16-row job at the end
        (16, 64, 96),  # exactly one token block
        (17, 96, 128),  # one token into the second block
        (37, 80, 1024),  # odd blocks, a 16-row tail
        (300, 64, 128),  # many blocks, pairs and a single
    ],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_reference(M, N, K, x_dtype):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = torch.randn(N, K, generator=g).bfloat16()
    ref = bf(x) @ w.float().t()
    out32 = torch.full((M, N), float("nan"))
    bf16_amx.gemm_nt(x, w, out=out32)
    assert rel(out32, ref) < 1e-6
    y = bf16_amx.gemm_nt(x, w)  # the activations' dtype by default
    assert y.dtype == x_dtype and rel(y, ref) < 5e-3


def test_gemm_strided_rows_and_leading_dims():
    """Rows of a wider tensor, a weight slice of a wider matrix, a 3-D input, an output
    slice: strides are honoured and nothing outside is written."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 200, generator=g)[..., 8:136]  # [2, 9, 128], row stride 200
    w_full = torch.randn(64, 160, generator=g).bfloat16()
    w = w_full[:, 32:]  # [64, 128], row stride 160
    out_full = torch.zeros(18, 100)
    out = out_full[:, 10:74]
    bf16_amx.gemm_nt(x.reshape(18, 128), w, out=out)
    ref = bf(x.reshape(18, 128)) @ w.float().t()
    assert rel(out, ref) < 1e-6
    assert out_full[:, :10].eq(0).all() and out_full[:, 74:].eq(0).all()
    y = bf16_amx.gemm_nt(x, w)
    assert y.shape == (2, 9, 64) and rel(y.reshape(18, 64), ref) < 1e-6


@pytest.mark.parametrize("H,M,N,K", [(16, 1, 512, 128), (16, 5, 128, 512), (3, 20, 48, 64)])
def test_head_gemm_matches_bmm(H, M, N, K):
    """MLA's absorbed products: head-major inputs of a batch-major tensor, output written
    into a batch-major tensor seen head-major."""
    g = torch.Generator().manual_seed(H + M)
    x_HMK = torch.randn(M, H, K, generator=g).transpose(0, 1)
    w_HNK = torch.randn(H, N, K, generator=g).bfloat16()
    ref = torch.bmm(bf(x_HMK), w_HNK.float().transpose(1, 2))
    out_MHN = torch.full((M, H, N), float("nan"))
    bf16_amx.head_gemm_nt(x_HMK, w_HNK, out_MHN.transpose(0, 1))
    assert rel(out_MHN.transpose(0, 1), ref) < 1e-6
    y = bf16_amx.head_gemm_nt(x_HMK.bfloat16(), w_HNK)
    assert y.dtype == torch.bfloat16 and rel(y, ref) < 5e-3


def test_usable_declines_what_the_kernel_cannot_take():
    x = torch.randn(4, 64)
    assert bf16_amx.usable(x, torch.randn(32, 64).bfloat16())
    assert not bf16_amx.usable(x, torch.randn(32, 64))  # fp32 weight
    assert not bf16_amx.usable(torch.randn(4, 48), torch.randn(32, 48).bfloat16())  # K % 32
    assert not bf16_amx.usable(x, torch.randn(40, 64).bfloat16())  # N % 16
    assert not bf16_amx.usable(x, torch.randn(64, 32).bfloat16().t())  # weight columns strided
    many = torch.randn(bf16_amx.MAX_ROWS + 1, 64)
    assert bf16_amx.usable(many, torch.randn(32, 64).bfloat16())  # fp32 rows: any count
    assert not bf16_amx.usable(many.bfloat16(), torch.randn(32, 64).bfloat16())  # oneDNN's


def moe_case(T: int, E: int, K: int, D: int, F_: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    w13 = (torch.randn(E, 2 * F_, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F_, generator=g) / F_**0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return x, w13, w2, weights, ids


def moe_ref(x, w13, w2, weights, ids) -> torch.Tensor:
    """moe_reference on the kernel's values: bf16 inputs, the hidden rounded to bf16 once"""
    F_ = w2.shape[2]
    y = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e].float() @ bf(x[t])).split(F_)
            y[t] += weights[t, k] * (w2[e].float() @ bf(F.silu(gate) * up))
    return y


@pytest.mark.parametrize(
    "T,E,K,D,F_",
    [
        (1, 8, 2, 64, 32),  # decode: one row per expert
        (5, 8, 8, 64, 64),  # every expert, several rows
        (40, 16, 4, 128, 96),  # groups across a token block
        (300, 8, 2, 96, 64),  # many blocks per expert
    ],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_reference(T, E, K, D, F_, x_dtype):
    x, w13, w2, weights, ids = moe_case(T, E, K, D, F_, seed=T + E)
    got = moe_grouped(x.to(x_dtype), w13, w2, weights, ids)  # dispatches to the kernel
    assert got.dtype == x_dtype
    tol = 1e-4 if x_dtype == torch.float32 else 5e-3
    assert rel(got, moe_ref(x, w13, w2, weights, ids)) < tol
    # and the readable oracle in fp32 on the bf16 weights, at bf16 rounding distance
    loose = moe_reference(x, w13.float(), w2.float(), weights, ids)
    assert rel(got, loose) < 2e-2


def test_moe_takes_the_kernel(monkeypatch):
    """The layer's sorted path reaches the AMX call for bf16 weights (and its result is what
    the test above checks)."""
    called = []
    real = bf16_amx.moe_experts
    monkeypatch.setattr(bf16_amx, "moe_experts", lambda *a: called.append(1) or real(*a))
    x, w13, w2, weights, ids = moe_case(6, 8, 2, 64, 32, seed=1)
    moe_grouped(x, w13, w2, weights, ids)
    assert called
