"""ops/linear.BoundLinear: the prebound few-row projection against ``linear``."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.linear import BoundLinear, linear
from moeserve.quant.int8 import Int8Weight


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("M", [1, 5, 200])
def test_bound_linear_equals_linear(M, int8):
    g = torch.Generator().manual_seed(M)
    dense = torch.randn(48, 40, generator=g)
    w = dense
    if int8:
        w = Int8Weight((48, 40))
        w.copy_(dense)
    x = torch.randn(M, 40, generator=g)
    bound = BoundLinear(w)
    if fp32_kernels.available():
        assert bound.kernel is not None and bound.pointers
    want = linear(x, w)
    assert torch.equal(bound(x), want)  # 200 rows: beyond the fp32_kernels, through linear
    out = torch.full((M, 2 * 48), float("nan"))[:, :48]  # a strided destination
    assert bound(x, out) is out and torch.equal(out, want)
