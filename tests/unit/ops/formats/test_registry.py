"""The weight-format registry: names, what a weight's format is, how an engine resolves one,
and every format against the contract's plain-torch body."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeserve.ops import formats
from moeserve.ops.cpu import int4, int4_amx
from moeserve.ops.formats.base import WeightFormat
from moeserve.quant.int8 import Int8Weight

NAMES = ["fp32", "int8", "w8a8_int8", "bf16", "int4", "w4a8_int8"]


def test_registry_names_and_quantization_choices():
    assert formats.QUANTIZATIONS == ("none", "int8", "w8a8_int8", "bf16", "int4", "w4a8_int8")
    for name in NAMES:
        fmt = formats.get(name)
        assert isinstance(fmt, WeightFormat) and fmt.name == name
    with pytest.raises(KeyError, match="no weight format 'int3'; registered: fp32, int8"):
        formats.get("int3")
    assert formats.normalize_quantization("none") is None
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        formats.normalize_quantization("int3")


def test_a_weight_carries_its_format():
    assert formats.of(torch.zeros(2, 2)) is formats.get("fp32")
    assert formats.of(torch.zeros(2, 2, dtype=torch.bfloat16)) is formats.get("bf16")
    fp16 = formats.of(torch.zeros(2, 2, dtype=torch.float16))
    assert fp16.name == "float16" and type(fp16) is WeightFormat  # plain torch
    for name in ("int8", "w8a8_int8"):
        w = Int8Weight((4, 8), weight_format=name)
        assert formats.of(w) is formats.get(name)
        assert formats.of(w[1:3]) is formats.get(name)  # slices keep it
    with pytest.raises(TypeError, match="has no weight format"):
        formats.of(torch.zeros(2, 2, dtype=torch.int8))


@pytest.mark.parametrize("name", NAMES)
def test_make_weight_holds_the_format(name):
    p = nn.Parameter(torch.empty(16, 128), requires_grad=False)
    w = formats.get(name).make_weight(p)
    assert formats.of(w) is formats.get(name)
    assert tuple(w.shape) == (16, 128)


def test_weight_bytes():
    assert formats.get("fp32").weight_bytes((16, 64)) == 16 * 64 * 4
    assert formats.get("bf16").weight_bytes((16, 64)) == 16 * 64 * 2
    assert formats.get("int8").weight_bytes((2, 16, 64)) == 2 * 16 * (64 + 4)


@pytest.mark.parametrize(
    ("quantization", "dtype", "want"),
    [
        ("int8", "auto", ("int8", torch.float32)),
        ("w8a8_int8", "auto", ("w8a8_int8", torch.float32)),
        ("w4a8_int8", "auto", ("w4a8_int8", torch.float32)),
        ("bf16", "auto", ("bf16", torch.float32)),
        ("int8", "bfloat16", ("int8", torch.bfloat16)),  # an explicit dtype is kept
        (None, "float32", (None, torch.float32)),
        (None, "bfloat16", (None, torch.bfloat16)),
    ],
)
def test_resolve(quantization, dtype, want):
    assert formats.resolve(quantization, dtype, torch.device("cpu")) == want


def _weight(name: str, w: torch.Tensor):
    stored = formats.get(name).make_weight(nn.Parameter(torch.empty(w.shape), requires_grad=False))
    stored.copy_(w)
    return stored


# each format against F.linear on what it holds (bf16-rounded or q * scale); w8a8 and w4a8
# also round the rows, so their bound is the rounding of x (measured ~0.02 on these values), and
# so does int4 on the integer dots and on AMX's tiles, to 2^-16 of each row's max (~1.4e-3 here)
INT4_ROUNDS = (int4.available() and int4.rounds_rows(None, 130)) or int4_amx.available()
BOUNDS = {"fp32": 1e-5, "bf16": 1e-2, "int8": 1e-4, "w8a8_int8": 0.15, "w4a8_int8": 0.15}
BOUNDS["int4"] = 5e-4 if INT4_ROUNDS else 1e-4


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("M", [1, 5, 130])
def test_linear_paths_agree_with_the_plain_body(name, M):
    g = torch.Generator().manual_seed(M)
    w = _weight(name, torch.randn(48, 128, generator=g))
    x = torch.randn(M, 128, generator=g)
    fmt = formats.of(w)
    held = fmt.dense(w, torch.float32).float()
    want = x @ held.t()
    torch.testing.assert_close(fmt.linear(x, w), want, rtol=0, atol=BOUNDS[name] * 10)
    out = torch.empty(M, 48)
    torch.testing.assert_close(fmt.linear_into(x, w, out), want, rtol=0, atol=BOUNDS[name] * 10)
    bound = fmt.bind_linear(w, lambda x_: fmt.linear(x_, w))
    if bound is not None:  # where a kernel takes the weight: the same as linear
        torch.testing.assert_close(bound(x), fmt.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_planner_streams_what_the_formats_state():
    """The planner is torch-free, so it keeps its own table of bytes per weight; it must agree
    with what each format states."""
    from moeserve.planner.hardware import DTYPE_BYTES

    for name in ("fp32", "bf16", "int8", "int4"):
        assert DTYPE_BYTES[name] == formats.get(name).bytes_per_weight


def test_relayout_moves_only_weights_whose_format_allows_it():
    """Without the kernels, dense projections are stored [K, N] behind their view; int8 rows
    stay [N, K] (``kn_layout_ok``)."""
    from moeserve.layers.linear import Linear
    from moeserve.models.base import relayout_kn
    from moeserve.models.weight_format import apply_weight_format

    dense, quantized = Linear(64, 16), Linear(64, 16)
    apply_weight_format(quantized, "int8")
    relayout_kn(nn.ModuleList([dense, quantized]))
    assert dense.weight.shape == (16, 64) and dense.weight.stride() == (1, 16)
    assert quantized.weight.q.stride() == (64, 1)
