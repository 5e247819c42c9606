"""ops/cpu/residual.py: the residual call (``moeserve_add_rms_norm``) is torch's add and the
norm kernel's RMSNorm bit for bit, close to ``F.rms_norm``; :class:`ResidualRows` makes the
same call on its buffers."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu.chain import CallChain
from moeserve.ops.cpu.fp32 import BoundRMSNorm
from moeserve.ops.cpu.residual import ResidualRows, add_rms_norm, add_rms_norm_ref

pytestmark = pytest.mark.skipif(not fp32_kernels.available(), reason="no C kernels here")


def _case(T: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, y = torch.randn(T, D, generator=g) * 4, torch.randn(T, D, generator=g)
    return h, y, torch.rand(D, generator=g) + 0.5


@pytest.mark.parametrize("T,D", [(1, 1024), (3, 7), (5, 1003), (128, 64)])
def test_add_then_norm_is_the_add_and_the_norm_kernel(T, D):
    h, y, w = _case(T, D)
    want_h = h + y
    want = fp32_kernels.rms_norm(want_h, w, 1e-6)
    got = add_rms_norm(h, y, w, 1e-6)
    assert torch.equal(h, want_h) and torch.equal(got, want)
    ref_h = h - y  # the reference from the same start
    torch.testing.assert_close(got, add_rms_norm_ref(ref_h, y, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_norm_alone_add_alone_and_strided_rows():
    h, y, w = _case(4, 96)
    before = h.clone()
    assert torch.equal(add_rms_norm(h, None, w, 1e-5), fp32_kernels.rms_norm(h, w, 1e-5))
    assert torch.equal(h, before)  # no y: h untouched
    assert add_rms_norm(h, y, None, 1e-5) is h and torch.equal(h, before + y)
    wide = torch.randn(4, 200)  # rows of h and y inside wider tensors
    hs, ys = wide[:, 10:106], torch.randn(4, 300)[:, 5:101]
    want_h = hs + ys
    got = add_rms_norm(hs, ys, w, 1e-5)
    assert torch.equal(hs, want_h) and torch.equal(got, fp32_kernels.rms_norm(want_h, w, 1e-5))


def test_what_the_call_does_not_take_is_left_alone():
    h, y, w = _case(2, 16)
    before = h.clone()
    assert add_rms_norm(h.double(), y.double(), w.double(), 1e-6) is None
    assert add_rms_norm(h, y.t().contiguous().t(), w, 1e-6) is None  # y's rows strided
    assert add_rms_norm(h, torch.randn(3, 16), w, 1e-6) is None
    assert add_rms_norm(h, y, torch.ones(8), 1e-6) is None
    assert add_rms_norm(torch.randn(fp32_kernels.MAX_ROWS + 1, 16), None, w, 1e-6) is None
    assert torch.equal(h, before)


def test_residual_rows_chain_the_calls():
    """The first norm (in a call chain), add with the y buffer, add with a tensor, add alone:
    what a layer step does."""
    T, D = 3, 40
    h0, y, w = _case(T, D, seed=1)
    w2 = torch.rand(D) + 0.5
    n1, n2 = BoundRMSNorm.bind(w, 1e-6), BoundRMSNorm.bind(w2, 1e-5)
    r = ResidualRows(T, D)
    assert ResidualRows.usable(h0) and not ResidualRows.usable(h0.t())
    r.h.copy_(h0)
    c = CallChain()
    r.chain_norm(c, n1)
    c.build().run()
    assert torch.equal(r.h, h0) and torch.equal(r.x, fp32_kernels.rms_norm(h0, w, 1e-6))
    r.y.copy_(y)
    r.add(None, n2)
    want = h0 + y
    assert torch.equal(r.h, want) and torch.equal(r.x, fp32_kernels.rms_norm(want, w2, 1e-5))
    y2 = torch.randn(T, D)
    x_before = r.x.clone()
    r.add(y2, None)
    assert torch.equal(r.h, want + y2) and torch.equal(r.x, x_before)
    assert r.key == (T, r.x.data_ptr(), r.y.data_ptr())
