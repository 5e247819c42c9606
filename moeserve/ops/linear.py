"""``linear(x, w, bias)``: the projection every layer calls, dispatched to the fastest kernel.

Few-row fp32 inputs on AVX2 CPUs (decode) go to the streaming kernel in
``ops/cpu/kernels.c``. bf16 weights on CPUs with AMX go to ``ops/cpu/amx.c``: with fp32
activations (``--quantization bf16``) always, with bf16 ones up to ``amx.MAX_ROWS`` rows
(oneDNN's GEMM behind ``F.linear`` is faster above). Everything else, and the reference, is
``F.linear`` (a bf16 weight with fp32 activations widened per call). Int8 weights
(``quant/int8.py``) go to ``ops/linear_int8.py``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from moeserve.ops.cpu import amx, amx_int8, kernels
from moeserve.ops.cpu import int8 as int8_kernels
from moeserve.ops.linear_int8 import linear_int8, linear_int8_into
from moeserve.quant.int8 import as_int8


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [..., K]``, ``w [N, K]`` (dense or int8)."""
    if (q := as_int8(w)) is not None:
        return linear_int8(x, q, bias)
    if kernels.usable(x, w):
        y = kernels.gemm_nt(x, w)
        return y if bias is None else y.add_(bias)
    if amx.usable(x, w):
        y = amx.gemm_nt(x, w)
        return y if bias is None else y.add_(bias)
    # a weight held narrower than the activations (--quantization bf16) is widened per call
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)


def linear_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ w.T`` without an intermediate for the kernel path."""
    if (q := as_int8(w)) is not None:
        return linear_int8_into(x, q, out)
    if kernels.usable(x, w) and out.stride(-1) == 1:
        return kernels.gemm_nt(x, w, out=out)
    if amx.usable(x, w) and out.stride(-1) == 1 and out.dtype in (torch.bfloat16, torch.float32):
        return amx.gemm_nt(x, w, out=out)
    return torch.matmul(x, (w if w.dtype == x.dtype else w.to(x.dtype)).t(), out=out)


class BoundLinear:
    """``x @ w.T`` for decode rows with the kernel arguments that depend only on ``w`` (its
    pointer, strides, shape, the ISA choice) derived once, so a call costs one ctypes call and
    the checks on ``x``: the fp32, int8 or (bf16 weights, on AMX) bf16 few-row kernel, or for
    w8a8_int8 weights on AMX the int8 tile kernel. Rows the kernel does not take (too many,
    other dtype or layout) go through :func:`linear`, the reference dispatch. ``w`` must stay
    where it is while bound: ``pointers`` lists each bound tensor with the address used, so
    the owner can see a moved weight (``p.data`` replaced) and bind again."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.N, self.K = w.shape[0], w.shape[-1]
        self.fn = None
        self.max_rows = 0
        self.pointers: tuple[tuple[torch.Tensor, int], ...] = ()
        q = as_int8(w)
        if q is not None and q.act_int8:  # w8a8_int8: the AMX kernel, any row count
            if w.dim() == 2 and amx_int8.weight_ok(q) and amx_int8.available():
                self.fn = amx_int8._library().moeserve_amx_i8_gemm_nt
                self.max_rows = sys.maxsize
                self.w_args = (q.q.data_ptr(), q.q.stride(0), q.scale.data_ptr())
                self.wide = 0
                self.pointers = ((q.q, q.q.data_ptr()), (q.scale, q.scale.data_ptr()))
        elif q is not None:
            if int8_kernels.available() and w.dim() == 2 and int8_kernels._rows_ok(q):
                lib = int8_kernels._library()
                self.fn = lib.moeserve_int8_gemm_nt_small
                self.max_rows = int8_kernels.MAX_ROWS
                self.w_args = (q.q.data_ptr(), q.q.stride(0), q.scale.data_ptr())
                self.wide = int(int8_kernels.wide())
                self.pointers = ((q.q, q.q.data_ptr()), (q.scale, q.scale.data_ptr()))
        elif w.device.type == "cpu" and kernels.weight_ok(w):
            self.fn = kernels._library().moeserve_gemm_nt_small
            self.max_rows = kernels.MAX_ROWS
            self.w_args = (w.data_ptr(), w.stride(0))
            self.wide = int(kernels.wide())
            self.pointers = ((w, w.data_ptr()),)
        elif w.dim() == 2 and amx.weight_ok(w) and amx.available():  # bf16 weight, fp32 rows
            self.fn = amx._library().moeserve_amx_gemm_nt_f32
            self.max_rows = amx.MAX_ROWS
            self.w_args = (w.data_ptr(), w.stride(0))
            self.wide = 0
            self.pointers = ((w, w.data_ptr()),)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` (into ``out``, unit-stride rows, when given)."""
        if self.fn is None or not kernels.few_rows(x, self.max_rows):
            y = linear(x, self.w)
            return y if out is None else out.copy_(y)
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.N, dtype=torch.float32)
        failed = self.fn(
            M, self.N, self.K, x.data_ptr(), x.stride(0), *self.w_args,
            out.data_ptr(), out.stride(0), self.wide,
        )  # fmt: skip
        if failed:  # the AMX calls allocate their packed rows (the others return nothing)
            raise MemoryError(f"projection of {M} rows: out of memory for its workspace")
        return out
