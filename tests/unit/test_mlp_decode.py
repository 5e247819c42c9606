"""A gated MLP's decode calls (``ops/cpu/mlp_decode.py``, ``fp32.c: moeserve_silu_mul``)
against torch: the activation within a few ulps of ``F.silu``, every weight format's calls
close to the module's torch path, the same bits from the module, the bound rows and a call
chain, and weights moved after binding bound again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.layers.linear import GatedMLP
from moeserve.models.weight_format import apply_weight_format
from moeserve.ops.cpu import chain
from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu.mlp_decode import GatedMLPDecodeCalls, silu_mul

pytestmark = pytest.mark.skipif(not fp32_kernels.available(), reason="no C kernels here")

D, FF = 256, 128  # int4's groups (up to 128 columns) divide both


def test_silu_mul_is_the_silu_of_the_gate_times_up():
    """Rows 2F + 5 apart (a column slice), F with a tail past the vectors, gates from -100
    (e^-g would overflow) to 100: the gate half becomes silu(gate) * up, nothing else
    changes; many rows (threaded) alike."""
    g = torch.Generator().manual_seed(0)
    F_, rows = 29, 3
    big = torch.randn(rows, 2 * F_ + 5, generator=g) * 4
    big[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-4, -30.0])
    before = big.clone()
    out = silu_mul(big[:, : 2 * F_])
    assert out.data_ptr() == big.data_ptr() and out.shape == (rows, F_)
    want = F.silu(before[:, :F_]) * before[:, F_ : 2 * F_]
    torch.testing.assert_close(out, want, rtol=4e-7, atol=1e-30)
    assert torch.equal(big[:, F_:], before[:, F_:])  # up and the columns past it untouched
    assert silu_mul(torch.zeros(2, 7)) is None  # odd width: no gate/up halves
    assert silu_mul(torch.zeros(4, 8).t()) is None  # strided rows
    many = torch.randn(3000, 2 * F_, generator=g)  # over the threads: the same numbers
    want = F.silu(many[:, :F_]) * many[:, F_:]
    torch.testing.assert_close(silu_mul(many), want, rtol=4e-7, atol=1e-30)
    assert silu_mul(torch.zeros(2, 8, dtype=torch.float64)) is None


def _mlp(quantization: str | None, seed: int = 0) -> GatedMLP:
    """A GatedMLP with random weights, in ``quantization``'s format (loaded as a checkpoint's
    would be)."""
    mlp = GatedMLP(D, FF)
    g = torch.Generator().manual_seed(seed)
    dense = {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in mlp.named_parameters()}
    apply_weight_format(mlp, quantization)
    with torch.no_grad():
        for name, t in dense.items():
            mod, _, attr = name.rpartition(".")
            getattr(mlp.get_submodule(mod), attr).copy_(t)
    return mlp


QUANTIZATIONS = [None, "bf16", "int8", "w8a8_int8", "int4", "w4a8_int8"]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("T", [1, 5])
def test_the_calls_are_the_modules_numbers(quantization, T):
    """Few rows through the calls: close to the submodules in torch (the reference; the
    activation and the projections' kernels round apart), and the same bits from the module,
    from the calls bound to rows and from a call chain. Where no kernel takes the format here
    the module runs in torch."""
    mlp = _mlp(quantization)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mlp.use_decode_calls(False)
        want = mlp(x)
        assert mlp.decode_calls() is None
        mlp.use_decode_calls(True)
        got = mlp(x)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4)
    calls = mlp.decode_calls()
    if calls is None or T > calls.max_rows:
        # no kernel for this format here (the AMX formats elsewhere), or rows its tiles take
        assert torch.equal(got, want)
        return
    assert isinstance(calls, GatedMLPDecodeCalls) and calls.T == T
    assert mlp.whole_decode_calls() is calls
    y = torch.full((T, D), float("nan"))
    assert calls.rows(x, y) and calls.bound_rows() == (T, x.data_ptr(), y.data_ptr())
    calls.run()
    assert torch.equal(y, got)
    if chain.available():
        c = chain.CallChain()
        assert calls.chain(c) and len(c) == 3
        y.fill_(float("nan"))
        c.build().run()
        assert torch.equal(y, got)


def test_more_rows_than_the_calls_take_keep_their_activation(monkeypatch):
    """Rows past the calls' limit (a prefill) run the projections by their format and the
    calls' activation in place, so a prompt's rows round alike however a prefix-cache hit
    splits them; switched off, the submodules and ``F.silu`` (the reference)."""
    mlp = _mlp("int8")
    x = torch.randn(3, D)
    with torch.no_grad():
        fast = mlp(x)
        assert mlp.decode_calls() is not None
        monkeypatch.setattr(fp32_kernels, "MAX_ROWS", 2)
        mlp.use_decode_calls(True)  # bound again under the smaller limit
        assert mlp.decode_calls()(x) is None
        many = mlp(x)
        h = mlp.gate_up_proj(x)
        assert torch.equal(many, mlp.down_proj(silu_mul(h)))
        mlp.use_decode_calls(False)
        ref = mlp(x)
    torch.testing.assert_close(many, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_moved_weights_are_bound_again():
    """A weight whose storage was replaced after binding (``p.data``, as the huge-page move
    does) is read at its new address: the calls bind again."""
    mlp = _mlp(None)
    x = torch.randn(2, D)
    with torch.no_grad():
        mlp(x)
        first = mlp.decode_calls()
        for p in mlp.parameters():
            p.data = p.data * 2  # new storage, new values
        fast = mlp(x)
        assert mlp.decode_calls() is not first
        mlp.use_decode_calls(False)
        torch.testing.assert_close(fast, mlp(x), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_calls_leave_the_stack_the_module():
    """With tp > 1 the output needs the all-reduce after it: not the whole output the decode
    stack may run in the module's place."""
    mlp = _mlp(None)
    assert mlp.tp.size == 1 and mlp.whole_decode_calls() is not None
    mlp.tp = type("TwoRanks", (), {"size": 2})()
    assert mlp.whole_decode_calls() is None
