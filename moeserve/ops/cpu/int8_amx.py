"""The w8a8_int8 kernels of ``int8_amx.c`` (int8 weights times activations quantized to int8
per token row, on AMX's TDPBSSD) and their pure-torch references.

    s[m] = max|x[m]| / 127,   xq[m] = round(x[m] * (127 / max|x[m]|))      (0 for a zero row)
    y[m, n] = (xq[m] . q[n]) * scale[n] * s[m]

Weights are :class:`~moeserve.quant.int8.Int8Tensor` rows (``q [N, K]`` int8, ``scale [N]``);
activations and outputs fp32. :func:`quantize_rows_ref` is the activation quantization, the
same fp32 operations as the kernel's, so both give the same int8 rows; :func:`gemm_ref` and
:func:`moe_ref` are the references of :func:`gemm_nt` and :func:`moe_experts`, and
:func:`fake_quant` is what the format runs where the kernels do not (the weight-only int8 paths
on rows already rounded to the int8 grid). :func:`available` is False without AMX-INT8, when
the kernel refuses the AMX state, when the source cannot be built, or with
``MOESERVE_CPU_KERNELS=0`` / ``MOESERVE_CPU_AMX=0``.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu.bf16_amx import aligned_empty, load_amx_library
from moeserve.ops.cpu.bound import BoundGemm, MoEBuffers, on_cpu_contiguous, pointers
from moeserve.ops.cpu.build import I64, INT, PTR
from moeserve.ops.cpu.int8 import MAX_ROWS as INT8_ROWS
from moeserve.ops.cpu.int8 import moe_int8_ref
from moeserve.quant.int8 import Int8Tensor

_SOURCE = Path(__file__).with_name("int8_amx.c")
_FLAGS = {"amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
K_ALIGN, N_ALIGN = 64, 16  # a tile row holds 64 int8 of k; a tile 16 weight rows
QMAX = 127


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq int8 [..., K], s fp32 [...])``: each row of fp32 ``x`` on the int8 grid, as the
    kernel packs it (``round(x * (127 / max|row|))``, nearest even; ``s = max|row| / 127``);
    a row with a nan or an inf gets ``s`` nan (and codes 0), so its outputs are nan."""
    x = x.float()
    finite = torch.isfinite(x).all(dim=-1)
    x = torch.where(finite.unsqueeze(-1), x, 0.0)
    amax = x.abs().amax(dim=-1)
    # a tensor numerator: ``127 / t`` is ``t.reciprocal() * 127`` in torch, rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return xq, torch.where(finite, amax / QMAX, torch.nan)


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to its rows' int8 grids and back (fp32): what the kernels multiply."""
    xq, s = quantize_rows_ref(x)
    return xq.float() * s.unsqueeze(-1)


def gemm_ref(x: torch.Tensor, w: Int8Tensor) -> torch.Tensor:
    """Reference of :func:`gemm_nt`: exact integer sums (in fp64), scaled in fp32."""
    xq, s = quantize_rows_ref(x)
    acc = (xq.double() @ w.q.double().t()).float()
    return acc * w.scale * s.unsqueeze(-1)


def moe_ref(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int8Tensor,
    w2: Int8Tensor,
    weight_R: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`moe_experts`: each group's gated FFN with :func:`gemm_ref` (the rows
    and the hidden quantized per row), times the routing weights."""
    return moe_int8_ref(x_RD.float(), experts, counts, w13, w2, weight_R, gemm=gemm_ref)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_amx_library(_SOURCE, _FLAGS, "moeserve_amx_i8_enable")
    if lib is None:
        return None
    # the argument list of int8.c's few-row GEMM
    build.declare(
        lib, "moeserve_amx_i8_gemm_nt", I64, I64, I64, PTR, I64, PTR, I64, PTR, PTR, I64, INT
    )
    lib.moeserve_amx_i8_gemm_nt.restype = INT
    build.declare(
        lib,
        "moeserve_amx_i8_moe",
        *(I64, PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR),
        *(PTR, PTR, PTR, PTR, PTR),
    )
    return lib


def available() -> bool:
    return _library() is not None


def weight_ok(w: Int8Tensor) -> bool:
    """Whether the kernels take ``w`` (``[..., N, K]``): CPU rows of unit stride, contiguous
    scales, K a multiple of 64 and N of 16."""
    return (
        w.q.device.type == "cpu"
        and w.q.dim() >= 2
        and w.q.stride(-1) == 1
        and w.scale.is_contiguous()
        and w.shape[-1] % K_ALIGN == 0
        and w.shape[-2] % N_ALIGN == 0
    )


def usable(x: torch.Tensor, w: Int8Tensor) -> bool:
    """Whether :func:`gemm_nt` runs the kernel for fp32 ``x [M, K]`` (unit-stride rows)."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(1) == 1
        and w.q.dim() == 2
        and weight_ok(w)
        and available()
    )


def gemm_nt(x: torch.Tensor, w: Int8Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gemm_ref(x, w)`` for fp32 ``x [M, K]`` and ``w [N, K]`` (:func:`usable`), into ``out``
    (fp32 ``[M, N]``, unit-stride rows) when given."""
    M, K = x.shape
    N = w.q.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"the int8 AMX GEMM writes fp32 rows, got {out.dtype} {out.stride()}")
    failed = _library().moeserve_amx_i8_gemm_nt(
        M, N, K, x.data_ptr(), x.stride(0), w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr(),
        out.data_ptr(), out.stride(0), 0,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"int8 projection of {M} rows: out of memory for its workspace")
    return out


def bind_gemm(w: Int8Tensor, fallback) -> BoundGemm | None:
    """:func:`gemm_nt` (any row count) with ``w`` bound; None where the kernel does not take
    ``w``."""
    if not (w.q.dim() == 2 and weight_ok(w) and available()):
        return None
    fn = _library().moeserve_amx_i8_gemm_nt
    w_args = (w.q.data_ptr(), w.q.stride(0), w.scale.data_ptr())
    bound = pointers(w.q, w.scale)
    return BoundGemm(fn, tuple(w.shape), w_args, sys.maxsize, 0, bound, fallback)


def moe_usable(x_RD: torch.Tensor, counts: list[int], w13: Int8Tensor, w2: Int8Tensor) -> bool:
    """Whether :func:`moe_experts` runs the kernel: fp32 contiguous rows, contiguous weights
    with D and F multiples of 64."""
    return (
        0 < max(counts, default=0)
        and x_RD.dtype == torch.float32
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and all(t.is_contiguous() for t in (w13.q, w13.scale, w2.q, w2.scale))
        and weight_ok(w13)
        and weight_ok(w2)
        and available()
    )


class MoEWorkspace:
    """The buffers of one :func:`moe_experts`-style call of at most ``padded`` rows (each
    expert's rows padded to 16), reused across calls of the same size (decode)."""

    def __init__(self, padded: int, D: int, F_: int) -> None:
        self.padded = padded
        self.xp, self.hp = (
            aligned_empty(padded * D, torch.int8),
            aligned_empty(padded * F_, torch.int8),
        )
        self.xs = torch.empty(padded, dtype=torch.float32)
        self.hs = torch.empty(padded, dtype=torch.float32)
        self.h = torch.empty(padded, 2 * F_, dtype=torch.int32)

    def pointers(self) -> tuple[int, ...]:
        """In the order of ``moeserve_amx_i8_moe``'s last five arguments."""
        return tuple(t.data_ptr() for t in (self.xp, self.xs, self.h, self.hp, self.hs))


def moe_experts(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int8Tensor,
    w2: Int8Tensor,
    weight_R: torch.Tensor,
) -> torch.Tensor:
    """Rows of fp32 ``x_RD`` sorted by expert (``counts[i]`` rows for ``experts[i]``) through
    their experts' gated FFN (int8 ``w13 [E, 2F, D]``, ``w2 [E, D, F]``), each times its
    routing weight, in one call (:func:`moe_usable`). The reference is :func:`moe_ref`."""
    R, D = x_RD.shape
    F_ = w2.q.shape[2]
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    meta = torch.tensor([experts, starts, counts], dtype=torch.int64)
    ws = MoEWorkspace(sum(-(-n // 16) * 16 for n in counts), D, F_)
    weight32_R = weight_R.float().contiguous()
    y = torch.empty(R, D, dtype=torch.float32)
    _library().moeserve_amx_i8_moe(
        len(counts), meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), D, F_,
        x_RD.data_ptr(), w13.q.data_ptr(), w13.scale.data_ptr(), w2.q.data_ptr(),
        w2.scale.data_ptr(), weight32_R.data_ptr(), y.data_ptr(), *ws.pointers(),
    )  # fmt: skip
    return y


class BoundMoE:
    """The w8a8_int8 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`):
    one ``moeserve_amx_i8_moe`` call over the sorted groups, its workspace reused."""

    max_rows = INT8_ROWS  # decode batches (the int8 row kernels' bound); more go to moe_experts

    def __init__(self, w13: Int8Tensor, w2: Int8Tensor) -> None:
        weights = (w13.q, w13.scale, w2.q, w2.scale)
        self.w_args = tuple(t.data_ptr() for t in weights)
        self.pointers = pointers(*weights)
        self.fn = _library().moeserve_amx_i8_moe

    @staticmethod
    def bind(w13: Int8Tensor, w2: Int8Tensor) -> BoundMoE | None:
        ok = weight_ok(w13) and weight_ok(w2) and available()
        ok = ok and on_cpu_contiguous(w13.q, w13.scale, w2.q, w2.scale)
        return BoundMoE(w13, w2) if ok else None

    def prepare(self, b: MoEBuffers) -> None:
        self.ws = MoEWorkspace(b.padded_rows, b.D, b.F)
        self.y = b.y_sorted
        self.args = (*b.group_args(), *self.w_args, b.weight.data_ptr())
        self.args += (b.y_sorted.data_ptr(), *self.ws.pointers())

    def call_args(self) -> tuple:
        return self.fn, self.args, self.y

    def run(self, G: int) -> torch.Tensor:
        self.fn(G, *self.args)
        return self.y
