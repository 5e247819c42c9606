"""ops/cpu/chain.py: kernel calls made in one call from C (libffi) do what the same calls do
from Python (:class:`PythonChain`, the reference), with registers, results passed on, float
arguments, and a failed call stopping the chain."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops.cpu import chain, fp32, moe_sort
from moeserve.ops.cpu.chain import (
    NEGATIVE,
    BuiltChain,
    CallChain,
    ChainError,
    PythonChain,
    Register,
    Result,
)

pytestmark = pytest.mark.skipif(
    not (fp32.available() and moe_sort.available()), reason="no C kernels here"
)
needs_chain = pytest.mark.skipif(not chain.available(), reason="no chain library (libffi)")


def _program(ids: torch.Tensor, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, out):
    """Sort 3 x 2 (token, expert) pairs (returns the number of experts G), then add the first
    G rows of y into h (the address of h a register) and norm them with eps 1e-3 into out."""
    T, K = ids.shape
    D = h.shape[1]
    keep = [torch.empty(3, T * K, dtype=torch.int64), torch.empty(T * K, dtype=torch.int64)]
    keep += [torch.empty(T * K), torch.empty(T * K, D), torch.ones(T, K), torch.randn(T, D)]
    meta, token, weight, x_sorted, w_TK, x = keep
    c = CallChain()
    sort = (T, K, 8, ids.data_ptr(), w_TK.data_ptr(), x.data_ptr(), D, D)
    sort += (meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), token.data_ptr())
    sort += (weight.data_ptr(), x_sorted.data_ptr())
    G = c.add(moe_sort._library().moeserve_moe_sort, sort, NEGATIVE, "sort")
    norm = (Result(G), D, Register(1), D, y.data_ptr(), D, w.data_ptr(), 1e-3, out.data_ptr(), D)
    c.add(fp32._library().moeserve_add_rms_norm, norm, name="add and norm")
    return c, keep


def _case():
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    return h, y, torch.rand(40, generator=g) + 0.5, torch.zeros(6, 40)


@pytest.mark.parametrize("built", [pytest.param(True, marks=needs_chain), False])
def test_calls_with_registers_results_and_floats(built, monkeypatch):
    if not built:
        monkeypatch.setattr(chain, "_library", lambda: None)
    ids = torch.tensor([[0, 3], [3, 5], [0, 7]])  # 4 experts: G = 4
    h, y, w, out = _case()
    c, _keep = _program(ids, h, y, w, out)
    program = c.build()
    assert isinstance(program, BuiltChain if built else PythonChain)
    want_h = h.clone()
    want_h[:4] += y[:4]
    want = fp32.rms_norm(want_h[:4], w, 1e-3)
    program.run(0, h.data_ptr())
    assert torch.equal(h, want_h) and torch.equal(out[:4], want) and not out[4:].any()
    program.run(0, h.data_ptr())  # again: the same calls on what they left
    want_h[:4] += y[:4]
    assert torch.equal(h, want_h)


@pytest.mark.parametrize("built", [pytest.param(True, marks=needs_chain), False])
def test_a_failed_call_stops_the_chain(built, monkeypatch):
    if not built:
        monkeypatch.setattr(chain, "_library", lambda: None)
    ids = torch.tensor([[0, 3], [3, 9], [0, 7]])  # 9 is not one of the 8 experts: sort fails
    h, y, w, out = _case()
    c, _keep = _program(ids, h, y, w, out)
    before = h.clone()
    with pytest.raises(ChainError, match=r"call 0 of the chain \(sort\) failed") as e:
        c.build().run(0, h.data_ptr())
    assert e.value.index == 0 and torch.equal(h, before)  # the add never ran


@needs_chain
def test_slots_hold_the_arguments():
    lib = fp32._library()
    c = CallChain()
    c.add(lib.moeserve_rms_norm, (2, 8, 4096, 8, None, 0.5, Register(3), 8))
    slots = c.build().slots()
    assert slots[:5] == [2, 8, 4096, 8, 0] and slots[5] == 0x3F000000  # 0.5f's bits
    assert len(slots) == 8


def test_what_a_chain_refuses():
    lib = fp32._library()
    c = CallChain()
    with pytest.raises(ValueError, match="arguments"):
        c.add(lib.moeserve_rms_norm, (1, 2))
    with pytest.raises(ValueError, match="register or result"):
        c.add(lib.moeserve_rms_norm, (1, 8, 0, 8, 0, Register(0), 0, 8))  # eps is a float
    with pytest.raises(ValueError, match="earlier"):
        c.add(lib.moeserve_rms_norm, (Result(0), 8, 0, 8, 0, 1e-6, 0, 8))
    with pytest.raises(ValueError, match="arguments"):
        c.add(print, ())  # not a ctypes function
    with pytest.raises(ValueError, match=r"argument 1 \(8.5\) is not an integer"):
        c.add(lib.moeserve_rms_norm, (1, 8.5, 0, 8, 0, 1e-6, 0, 8))
    assert len(c) == 0
