"""ops/cpu/int8.c's aarch64 bodies (NEON, and SVE at two vector lengths) built and run under
qemu (tests/arm/qemu.py), on test_int8.py's cases, against the same references and bounds:
the weight-only few-row GEMM (``linear_int8_ref``), the one-call MoE (``moe_int8_ref``) and
the dequantization that prefill hands to BLAS, and MLA's absorbed products on int8 codes
(``int8_heads.head_gemm_ref``: the fp32 form on every CPU). qemu's ``max`` CPUs report the
dot product and the int8 matrix multiply, so their GEMM and MoE calls run on SDOT (one row)
or SMMLA (int8_sdot.h) and are held to the references on rows rounded as those round them
(``int4.round_rows_ref``); the NEON CPU (a Cortex-A72) and the A64FX have no dot product and
run the fp32 form on every call (a CPU with SDOT but no SMMLA takes it up to
``int8.SDOT_MAX_ROWS`` rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeserve.ops.cpu import int4, int8, int8_heads
from moeserve.quant.head_codes import HeadCodes
from moeserve.quant.int8 import Int8Weight
from tests.arm import qemu
from tests.helpers import sort_by_expert
from tests.unit.ops.cpu.test_int8 import (
    GEMM_ROWS,
    GEMM_SHAPES,
    MOE_TOKENS,
    _sorted_inputs,
    ref,
    rows,
)
from tests.unit.ops.cpu.test_int8_heads import ROWS as HEAD_ROWS
from tests.unit.ops.cpu.test_int8_heads import SHAPES as HEAD_SHAPES
from tests.unit.ops.cpu.test_int8_heads import codes

pytestmark = pytest.mark.skipif(qemu.MISSING is not None, reason=qemu.MISSING or "")


driver = qemu.driver_fixture("int8")


def sdot(cpu: str, rows: int) -> bool:
    """Whether a call of ``rows`` rows (an MoE call: its largest expert's) runs on the integer
    dots (SDOT/SMMLA) with its rows rounded."""
    if not qemu.has(cpu, "asimddp"):
        return False
    return qemu.has(cpu, "i8mm") or rows <= int8.SDOT_MAX_ROWS


def rounded_ref(x: torch.Tensor, w) -> torch.Tensor:
    """The reference on rows rounded as the SDOT form takes them."""
    return int8.linear_int8_ref(int4.round_rows_ref(x), w.q, w.scale)


def max_hidden(x_RD: torch.Tensor, experts, counts, w13) -> float:
    """The largest |hidden| of an MoE call on rounded rows (its grid's step is this / XMAX)."""
    F2, best, start = w13.shape[1], 0.0, 0
    for e, n in zip(experts, counts):
        gate, up = rounded_ref(x_RD[start : start + n], w13[e]).split(F2 // 2, dim=-1)
        best = max(best, (F.silu(gate) * up).abs().max().item())
        start += n
    return best


def _q(t: torch.Tensor) -> np.ndarray:
    """int8 codes as the driver reads them (int64)."""
    return t.to(torch.int64).numpy().reshape(-1)


def test_gemm_matches_reference_on_arm(driver):
    """Every row count and shape of test_gemm_matches_reference (K off every vector width and
    past one converted chunk, odd N, M across the 12-row blocks)."""
    cpu, binary = driver
    for N, K in GEMM_SHAPES:
        for M in GEMM_ROWS:
            w = rows(N, K, M * 1000 + N + K)
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            arrays = [qemu.dims(0, M, N, K), x.numpy(), _q(w.q), w.scale.numpy()]
            (y,) = qemu.run(binary, cpu, arrays)
            got = torch.from_numpy(y).view(M, N)
            want = rounded_ref(x, w) if sdot(cpu, M) else ref(x, w)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T", MOE_TOKENS)
def test_moe_matches_reference_on_arm(driver, T):
    cpu, binary = driver
    E, D, Fd, K = 8, 40, 24, 2
    w13, w2 = Int8Weight((E, 2 * Fd, D)), Int8Weight((E, D, Fd))
    w13.copy_(torch.randn(E, 2 * Fd, D))
    w2.copy_(torch.randn(E, D, Fd))
    x, ids, w = _sorted_inputs(T, E, K, D, T)
    order, experts, counts = sort_by_expert(ids, E)
    x_RD, weight_R = x[order // K], w.reshape(-1)[order]
    arrays = [
        qemu.dims(1, len(experts), D, Fd),
        np.array(experts, dtype=np.int64),
        np.cumsum([0, *counts[:-1]]).astype(np.int64),
        np.array(counts, dtype=np.int64),
        x_RD.numpy(),
        _q(w13.data.q),
        w13.data.scale.numpy(),
        _q(w2.data.q),
        w2.data.scale.numpy(),
        weight_R.numpy(),
    ]
    (y,) = qemu.run(binary, cpu, arrays)
    got = torch.from_numpy(y).view(-1, D)
    if not sdot(cpu, max(counts)):
        want = int8.moe_int8_ref(x_RD, experts, counts, w13.data, w2.data, weight_R)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        return
    want = int8.moe_int8_ref(x_RD, experts, counts, w13.data, w2.data, weight_R, rounded_ref)
    # the kernel rounds the hidden after its own activation (e^x to ~1e-7): a hidden value
    # near the middle of two grid steps may round the other way, moving an output by at most
    # one step of its row's grid times max |w2| and the routing weight
    step = max_hidden(x_RD, experts, counts, w13.data) / int4.XMAX
    step *= w2.data.dequantize().abs().max() * weight_R.max()
    diff = (got - want).abs()
    assert diff.max() <= 1e-3 + 1e-4 * want.abs().max() + 2 * step
    assert (diff > 1e-3 + 1e-4 * want.abs()).float().mean() < 0.01  # almost all agree


def test_dequant_matches_on_arm(driver):
    cpu, binary = driver
    w = rows(9, 1003, 7)
    (out,) = qemu.run(binary, cpu, [qemu.dims(2, 9, 1003), _q(w.q), w.scale.numpy()])
    assert torch.equal(torch.from_numpy(out).view(9, 1003), w.dequantize())


@pytest.mark.parametrize("transposed", [False, True])
def test_head_products_match_on_arm(driver, transposed):
    """test_int8_heads.py's shapes and row counts: one scale a row over 72 or 40 columns (off
    the SVE vectors' widths: the scalar columns too), groups of 32, 64 and 128."""
    cpu, binary = driver
    H = 2
    for R, C, g in HEAD_SHAPES:
        q, s = codes(H, R, C, g, R + C)
        w = HeadCodes.columns(q, s) if transposed else HeadCodes.rows(q, s)
        for M in HEAD_ROWS:
            x = torch.randn(H, M, w.shape[2], generator=torch.Generator().manual_seed(M))
            N, K = w.shape[1], w.shape[2]
            dims = qemu.dims(3, H, M, K, N, g, int(w.grouped_out))
            (y,) = qemu.run(binary, cpu, [dims, x.numpy(), _q(w.q), w.scale.numpy()])
            got = torch.from_numpy(y).view(H, M, w.shape[1])
            want = int8_heads.head_gemm_ref(x, w)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
