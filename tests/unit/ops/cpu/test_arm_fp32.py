"""ops/cpu/fp32.c's aarch64 bodies (NEON, and SVE at two vector lengths) built and run under
qemu (tests/arm/qemu.py), on test_fp32.py's cases, against the same references and bounds:
the few-row GEMM (``F.linear``), the one-call MoE (``moe_reference``), the per-head GEMM
(``torch.bmm``), RMSNorm and routing; and the GEMMs' twins on bf16 weights (the bf16 format's
kernels on ARM), against the references on the widened weights. Where the CPU reports the
BF16 extension (qemu's ``max`` CPUs), those twins run on BFMMLA/BFDOT (bf16_mmla.h) and are held
to the references on rows rounded to bf16 (and the MoE hidden rounded once), as
test_bf16_amx.py holds AMX; elsewhere (NEON, the A64FX) to the exact ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.moe import moe_reference
from moeserve.ops.routing import route_grouped_sigmoid
from tests.arm import qemu
from tests.helpers import sort_by_expert
from tests.unit.ops.cpu.test_bf16_amx import bf, moe_ref
from tests.unit.ops.cpu.test_fp32 import (
    GEMM_ROWS,
    GEMM_SHAPES,
    HEAD_SHAPES,
    MOE_SHAPES,
    ROUTING_CASES,
    moe_case,
)

pytestmark = pytest.mark.skipif(qemu.MISSING is not None, reason=qemu.MISSING or "")


driver = qemu.driver_fixture("fp32")


def test_gemm_matches_linear_on_arm(driver):
    """Every row count and shape of test_matches_linear (odd N, K off every vector width, M
    across the 12-row blocks), one emulated process per shape."""
    cpu, binary = driver
    for N, K in GEMM_SHAPES:
        for M in GEMM_ROWS:
            g = torch.Generator().manual_seed(M * 1000 + N + K)
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            (y,) = qemu.run(binary, cpu, [qemu.dims(0, M, N, K), x.numpy(), w.numpy()])
            got = torch.from_numpy(y).view(M, N)
            torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T,D,Fd", MOE_SHAPES)
def test_moe_matches_reference_on_arm(driver, T, D, Fd):
    cpu, binary = driver
    x, w13, w2, w, ids = moe_case(T, D, Fd)
    E, K = w13.shape[0], ids.shape[1]
    order, experts, counts = sort_by_expert(ids, E)
    starts = np.cumsum([0, *counts[:-1]])
    arrays = [
        qemu.dims(1, len(experts), D, Fd),
        np.array(experts, dtype=np.int64),
        starts.astype(np.int64),
        np.array(counts, dtype=np.int64),
        x[order // K].numpy(),
        w13.numpy(),
        w2.numpy(),
        w.reshape(-1)[order].numpy(),
    ]
    (y,) = qemu.run(binary, cpu, arrays)
    got = torch.zeros_like(x).index_add_(0, order // K, torch.from_numpy(y).view(-1, D))
    ref = moe_reference(x, w13, w2, w, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


def test_head_gemm_matches_bmm_on_arm(driver):
    cpu, binary = driver
    for M, K in HEAD_SHAPES:
        g = torch.Generator().manual_seed(M)
        H, N = 5, 33
        x, w = torch.randn(H, M, K, generator=g), torch.randn(H, N, K, generator=g)
        (y,) = qemu.run(binary, cpu, [qemu.dims(2, H, M, N, K), x.numpy(), w.numpy()])
        want = torch.bmm(x, w.transpose(1, 2))
        torch.testing.assert_close(torch.from_numpy(y).view(H, M, N), want, rtol=1e-5, atol=1e-4)


def test_rms_norm_matches_reference_on_arm(driver):
    cpu, binary = driver
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 1003, generator=g), torch.randn(1003, generator=g)
    eps = np.array([1e-6], dtype=np.float32)
    (y,) = qemu.run(binary, cpu, [qemu.dims(3, 6, 1003), x.numpy(), w.numpy(), eps])
    want = F.rms_norm(x, (1003,), w, 1e-6)
    torch.testing.assert_close(torch.from_numpy(y).view(6, 1003), want, rtol=1e-5, atol=1e-5)


def test_residual_call_on_arm(driver):
    """``moeserve_add_rms_norm``: the add as torch's and the norm as the norm kernel's."""
    cpu, binary = driver
    g = torch.Generator().manual_seed(1)
    x, r, w = (torch.randn(*s, generator=g) for s in ((5, 1003), (5, 1003), (1003,)))
    eps = np.array([1e-6], dtype=np.float32)
    arrays = [qemu.dims(3, 5, 1003, 1), x.numpy(), w.numpy(), eps, r.numpy()]
    h, y = qemu.run(binary, cpu, arrays)
    assert torch.equal(torch.from_numpy(h).view(5, 1003), x + r)
    (want,) = qemu.run(binary, cpu, [qemu.dims(3, 5, 1003), (x + r).numpy(), w.numpy(), eps])
    assert np.array_equal(y, want)


@pytest.mark.parametrize("n_group,topk_group,norm", ROUTING_CASES)
def test_routing_matches_reference_on_arm(driver, n_group, topk_group, norm):
    cpu, binary = driver
    g = torch.Generator().manual_seed(n_group)
    logits, bias = torch.randn(16, 64, generator=g), torch.randn(64, generator=g) * 0.1
    dims = qemu.dims(4, 16, 64, n_group, topk_group, 6, int(norm), -1)
    scale = np.array([2.5], dtype=np.float32)
    ids, weights, counts = qemu.run(binary, cpu, [dims, logits.numpy(), bias.numpy(), scale])
    got_ids, got_w = torch.from_numpy(ids).view(16, 6), torch.from_numpy(weights).view(16, 6)
    ref_w, ref_ids = route_grouped_sigmoid(logits, bias, 6, n_group, topk_group, norm, 2.5)
    got_sorted, got_order = got_ids.sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    assert torch.equal(got_sorted, ref_sorted)
    torch.testing.assert_close(got_w.gather(1, got_order), ref_w.gather(1, ref_order))
    assert torch.equal(torch.from_numpy(counts), torch.bincount(ref_ids.reshape(-1), minlength=64))


def _bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 weight as the driver reads it: its bits (uint16)."""
    return t.view(torch.uint16).numpy()


def _rows(cpu: str, x: torch.Tensor) -> torch.Tensor:
    """The token rows a bf16-weight call multiplies on ``cpu``: rounded to bf16 where it has
    BFMMLA/BFDOT, as they are elsewhere."""
    return bf(x) if qemu.has(cpu, "bf16") else x


# M: BFDOT's one row, an odd count (the zero row), a full 12-row block, blocks and a tail;
# (N, K): last jobs of 1, 2 and 3 weight rows, K below one step, K % 16 of 9 and of 8
@pytest.mark.parametrize("M", [1, 2, 3, 12, 13, 33])
def test_bf16_weights_gemm_on_arm(driver, M):
    cpu, binary = driver
    for N, K in [(33, 17), (130, 1001), (9, 72), (7, 5)]:
        g = torch.Generator().manual_seed(M * 1000 + N + K)
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
        (y,) = qemu.run(binary, cpu, [qemu.dims(5, M, N, K), x.numpy(), _bits(w)])
        want = F.linear(_rows(cpu, x), w.float())
        torch.testing.assert_close(torch.from_numpy(y).view(M, N), want, rtol=1e-5, atol=1e-4)


def test_bf16_weights_nan_row_stays_in_its_row_on_arm(driver):
    """A nan in one token row makes that row's outputs nan and no other's (BFMMLA pairs rows:
    its partner row's lanes are separate sums)."""
    cpu, binary = driver
    g = torch.Generator().manual_seed(3)
    M, N, K = 5, 9, 40
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
    x[2, 7] = float("nan")
    (y,) = qemu.run(binary, cpu, [qemu.dims(5, M, N, K), x.numpy(), _bits(w)])
    got = torch.from_numpy(y).view(M, N)
    assert got[2].isnan().all()
    keep = [0, 1, 3, 4]
    want = F.linear(_rows(cpu, x[keep]), w.float())
    torch.testing.assert_close(got[keep], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T,D,Fd", MOE_SHAPES)
def test_bf16_weights_moe_on_arm(driver, T, D, Fd):
    cpu, binary = driver
    x, w13, w2, w, ids = moe_case(T, D, Fd)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    E, K = w13.shape[0], ids.shape[1]
    order, experts, counts = sort_by_expert(ids, E)
    arrays = [
        qemu.dims(6, len(experts), D, Fd),
        np.array(experts, dtype=np.int64),
        np.cumsum([0, *counts[:-1]]).astype(np.int64),
        np.array(counts, dtype=np.int64),
        x[order // K].numpy(),
        _bits(w13),
        _bits(w2),
        w.reshape(-1)[order].numpy(),
    ]
    (y,) = qemu.run(binary, cpu, arrays)
    got = torch.zeros_like(x).index_add_(0, order // K, torch.from_numpy(y).view(-1, D))
    if qemu.has(cpu, "bf16"):
        ref = moe_ref(x, w13, w2, w, ids)
    else:
        ref = moe_reference(x, w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("M", [1, 4, 13])
def test_bf16_weights_head_gemm_on_arm(driver, M):
    cpu, binary = driver
    g = torch.Generator().manual_seed(7 + M)
    H, N, K = 5, 33, 40
    x, w = torch.randn(H, M, K, generator=g), torch.randn(H, N, K, generator=g).bfloat16()
    (y,) = qemu.run(binary, cpu, [qemu.dims(7, H, M, N, K), x.numpy(), _bits(w)])
    want = torch.bmm(_rows(cpu, x), w.float().transpose(1, 2))
    torch.testing.assert_close(torch.from_numpy(y).view(H, M, N), want, rtol=1e-5, atol=1e-4)
