"""``linear(x, w, bias)``: the projection every layer calls, run by the weight's format.

Each format (``ops/formats``) picks its fastest kernel: few-row fp32 inputs on AVX2 CPUs
(decode) the streaming kernel of ``ops/cpu/fp32.c``; bf16 weights on CPUs with AMX
``ops/cpu/bf16_amx.c``; int8 weights ``ops/cpu/int8.c`` (and, for w8a8_int8 on AMX,
``ops/cpu/int8_amx.c``). Everything else, and the reference, is ``F.linear`` (a weight held
narrower than the activations widened per call).
"""

from __future__ import annotations

import torch

from moeserve.ops import formats
from moeserve.ops.cpu.mlp_decode import GatedMLPDecodeCalls


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [..., K]``, ``w [N, K]`` (of any format)."""
    return formats.of(w).linear(x, w, bias)


def linear_into(x: torch.Tensor, w, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ w.T`` without an intermediate for the kernel paths."""
    return formats.of(w).linear_into(x, w, out)


class BoundLinear:
    """``x @ w.T`` for decode rows with the kernel arguments that depend only on ``w`` (its
    pointer, strides, shape, the ISA choice) derived once by its format, so a call costs one
    ctypes call and the checks on ``x`` (``ops/cpu/bound.py``). Rows the kernel does not take
    (too many, other dtype or layout) go through :func:`linear`, the reference dispatch.
    ``kernel`` is None where no kernel takes ``w``. ``w`` must stay where it is while bound:
    ``pointers`` lists each bound tensor with the address used, so the owner can see a moved
    weight (``p.data`` replaced) and bind again."""

    def __init__(self, w) -> None:
        self.w = w
        self.kernel = formats.of(w).bind_linear(w, self._fallback)
        self.max_rows = 0 if self.kernel is None else self.kernel.max_rows
        self.pointers = () if self.kernel is None else self.kernel.pointers

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` (into ``out``, unit-stride rows, when given)."""
        if self.kernel is None:
            y = linear(x, self.w)
            return y if out is None else out.copy_(y)
        return self.kernel(x, out)  # checks the rows, and falls back to linear itself


def bind_gated_mlp_decode(w13, w2) -> GatedMLPDecodeCalls | None:
    """A gated MLP's decode step (gate/up weight ``w13 [2F, D]``, down ``w2 [D, F]``, each
    bound by its format) as prebound kernel calls (``ops/cpu/mlp_decode.py``); None where
    they do not apply."""
    return GatedMLPDecodeCalls.bind(BoundLinear(w13), BoundLinear(w2))
