"""The bf16 AMX kernels of ``bf16_amx.c``: the projection ``x @ w.T``, its per-head form (MLA's
absorbed products) and the routed-expert FFN of an MoE layer, for bf16 weights and fp32 or
bf16 activations (fp32 rows are rounded to bf16 as they are packed) on CPUs with AMX
(``amx_bf16``, with AVX512-BF16 for the conversions). The weight is read straight from its
``[N, K]`` rows, so no packed copy is kept; the activations are packed per call.

References: ``F.linear`` in bf16 (fp32 accumulation, bf16 result) for :func:`gemm_nt`, and
``ops/moe.py: moe_reference`` for :func:`moe_experts`. :func:`available` is False (and
callers use the references) without AMX, when the kernel refuses the AMX state, when the
source cannot be built, or with ``MOESERVE_CPU_KERNELS=0`` / ``MOESERVE_CPU_AMX=0``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu.bound import (
    BoundGemm,
    BoundHeadGemm,
    MoEBuffers,
    on_cpu_contiguous,
    pointers,
)
from moeserve.ops.cpu.build import I64, INT, PTR
from moeserve.ops.cpu.fp32 import MAX_ROWS as ROW_KERNEL_ROWS  # the fp32 decode bound
from moeserve.platform import cpu_flags

_SOURCE = Path(__file__).with_name("bf16_amx.c")
_FLAGS = {"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
# bf16 token rows up to which a projection runs in the kernel; above, oneDNN's AMX GEMM
# (F.linear in bf16) is as fast or faster (benchmarks/amx_gemm.py, N 2816 K 2048: the kernel
# 1.2-1.6x oneDNN at 1-512 rows, 0.87x at 2048). fp32 rows always run here: oneDNN would need
# them converted to bf16 and back.
MAX_ROWS = 512
K_ALIGN, N_ALIGN = 32, 16  # a tile row holds 32 bf16 of k; a tile 16 weight rows


def load_amx_library(source: Path, flags: set[str], enable: str) -> ctypes.CDLL | None:
    """``source`` built and loaded with this process granted the AMX tile state (``enable``:
    the library's call of amx_tiles.h's request); None with ``MOESERVE_CPU_AMX=0``, on a CPU
    without ``flags``, when the build fails or when Linux refuses the state."""
    if os.environ.get("MOESERVE_CPU_AMX", "1") == "0" or not flags <= cpu_flags():
        return None
    lib = build.load(source)
    if lib is None:
        return None
    fn = getattr(lib, enable)
    fn.restype, fn.argtypes = ctypes.c_int, []
    return lib if fn() == 0 else None


def aligned_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` uninitialised elements of ``dtype`` starting on a 64-byte boundary (the packed
    blocks the tiles load)."""
    size = torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(n + 64 // size, dtype=dtype)
    return buf[(-buf.data_ptr() % 64) // size :][:n]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_amx_library(_SOURCE, _FLAGS, "moeserve_amx_enable")
    if lib is None:
        return None
    build.declare(
        lib,
        "moeserve_amx_gemm_nt",
        *(I64, I64, I64, I64, PTR, I64, I64, INT, PTR, I64, I64, PTR, I64, I64, INT, PTR),
    )
    # the argument lists of fp32.c's few-row and per-head GEMMs (fp32 x and out)
    build.declare(lib, "moeserve_amx_gemm_nt_f32", I64, I64, I64, PTR, I64, PTR, I64, PTR, I64, INT)
    build.declare(
        lib,
        "moeserve_amx_head_gemm_nt_f32",
        *(I64, I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, I64, INT),
    )
    for name in ("gemm_nt", "gemm_nt_f32", "head_gemm_nt_f32"):
        getattr(lib, f"moeserve_amx_{name}").restype = INT
    build.declare(
        lib,
        "moeserve_amx_moe",
        *(I64, PTR, PTR, PTR, I64, I64, PTR, INT, PTR, PTR, PTR, PTR, INT, PTR, PTR, PTR),
    )
    return lib


def available() -> bool:
    return _library() is not None


def _packed(rows: int, K: int) -> torch.Tensor:
    """A workspace for ``rows`` token rows packed in 16-row blocks (64-byte aligned)."""
    return aligned_empty(-(-rows // 16) * 16 * K, torch.bfloat16)


def weight_ok(w: torch.Tensor) -> bool:
    """Whether the kernels take ``w [..., N, K]`` as a weight: bf16 CPU rows of unit stride
    with K a multiple of 32 and N of 16."""
    return (
        w.dtype == torch.bfloat16
        and w.device.type == "cpu"
        and w.dim() >= 2
        and w.stride(-1) == 1
        and w.shape[-1] % K_ALIGN == 0
        and w.shape[-2] % N_ALIGN == 0
    )


def usable(x: torch.Tensor, w: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether :func:`gemm_nt` runs the kernel for ``x [..., K]`` and ``w [N, K]``: fp32
    rows (rounded to bf16 as they are packed) of any count, bf16 ones up to ``max_rows``."""
    return (
        x.dtype in (torch.bfloat16, torch.float32)
        and x.device.type == "cpu"
        and w.dim() == 2
        and weight_ok(w)
        and x.stride(-1) == 1
        and 0 < (rows := x.numel() // max(x.shape[-1], 1))
        and (rows <= max_rows or x.dtype == torch.float32)
        and available()
    )


def gemm_nt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for ``x [..., K]`` and bf16 ``w [N, K]`` (:func:`usable`), into ``out``
    (bf16 or fp32 rows of unit stride) when given, else a new tensor of ``x``'s dtype."""
    K, N = x.shape[-1], w.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    o2 = out if out.dim() == 2 else out.view(-1, N)
    _call(x2[None], w[None], o2[None])
    return out


def bind_gemm(w: torch.Tensor, fallback) -> BoundGemm | None:
    """fp32 rows (up to ``MAX_ROWS``) times the bf16 ``w`` with ``w`` bound; None where the
    kernel does not take ``w``."""
    if not (w.dim() == 2 and weight_ok(w) and available()):
        return None
    fn = _library().moeserve_amx_gemm_nt_f32
    return BoundGemm(
        fn, tuple(w.shape), (w.data_ptr(), w.stride(0)), MAX_ROWS, 0, pointers(w), fallback
    )


def bind_head_gemm(w_HNK: torch.Tensor) -> BoundHeadGemm | None:
    """:func:`head_gemm_nt` of fp32 rows with the bf16 weight bound; None where the kernel
    does not take it."""
    if not (w_HNK.is_contiguous() and weight_ok(w_HNK) and available()):
        return None
    return BoundHeadGemm.dense(_library().moeserve_amx_head_gemm_nt_f32, w_HNK, 0)


def head_usable(x_HMK: torch.Tensor, w_HNK: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether :func:`head_gemm_nt` runs the kernel: bf16 or fp32 ``x``, bf16 weights."""
    return (
        x_HMK.dtype in (torch.bfloat16, torch.float32)
        and x_HMK.device.type == "cpu"
        and x_HMK.dim() == w_HNK.dim() == 3
        and x_HMK.stride(2) == 1
        and 0 < x_HMK.shape[1] <= max_rows
        and weight_ok(w_HNK)
        and available()
    )


def head_gemm_nt(
    x_HMK: torch.Tensor, w_HNK: torch.Tensor, out_HMN: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[h] @ w[h].T`` for every head h in one call (:func:`head_usable`; the reference is
    ``torch.bmm(x, w.transpose(1, 2))``). fp32 ``x`` is rounded to bf16 as it is packed.
    Any head and row strides with unit-stride rows; ``out_HMN`` (bf16 or fp32) receives the
    result when given, else a new tensor of ``x``'s dtype."""
    if out_HMN is None:
        out_HMN = torch.empty(*x_HMK.shape[:2], w_HNK.shape[1], dtype=x_HMK.dtype)
    _call(x_HMK, w_HNK, out_HMN)
    return out_HMN


def _call(x_HMK: torch.Tensor, w_HNK: torch.Tensor, out_HMN: torch.Tensor) -> None:
    H, M, K = x_HMK.shape
    N = w_HNK.shape[1]
    if out_HMN.dtype not in (torch.bfloat16, torch.float32) or out_HMN.stride(2) != 1:
        raise ValueError(
            f"the AMX GEMM writes bf16 or fp32 rows, got {out_HMN.dtype} {out_HMN.stride()}"
        )
    xp = _packed(H * -(-M // 16) * 16, K)  # held until the call returns
    _library().moeserve_amx_gemm_nt(
        H, M, N, K, x_HMK.data_ptr(), x_HMK.stride(0), x_HMK.stride(1),
        int(x_HMK.dtype == torch.float32), w_HNK.data_ptr(), w_HNK.stride(0), w_HNK.stride(1),
        out_HMN.data_ptr(), out_HMN.stride(0), out_HMN.stride(1),
        int(out_HMN.dtype == torch.bfloat16), xp.data_ptr(),
    )  # fmt: skip


def moe_usable(
    x_RD: torch.Tensor, counts: list[int], w13_EFD: torch.Tensor, w2_EDF: torch.Tensor
) -> bool:
    """Whether :func:`moe_experts` runs the kernel: bf16 weights, bf16 or fp32 rows, all
    contiguous, D and F multiples of 32."""
    return (
        0 < max(counts, default=0)
        and w13_EFD.dtype == w2_EDF.dtype == torch.bfloat16
        and x_RD.dtype in (torch.bfloat16, torch.float32)
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and w13_EFD.is_contiguous()
        and w2_EDF.is_contiguous()
        and x_RD.shape[1] % K_ALIGN == 0
        and w2_EDF.shape[2] % K_ALIGN == 0
        and available()
    )


def moe_experts(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    weight_R: torch.Tensor,
) -> torch.Tensor:
    """Rows of ``x_RD`` sorted by expert (``counts[i]`` rows for ``experts[i]``) through
    their experts' gated FFN, each scaled by its routing weight, in one call; the result has
    ``x_RD``'s dtype. The reference is ``ops/moe.py: moe_reference``."""
    R, D = x_RD.shape
    F = w2_EDF.shape[2]
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    meta = torch.tensor([experts, starts, counts], dtype=torch.int64)
    padded = sum(-(-n // 16) * 16 for n in counts)
    weight32_R = weight_R.float().contiguous()
    h = torch.empty(padded, 2 * F, dtype=torch.float32)  # by column per group, rows padded
    y = torch.empty(R, D, dtype=x_RD.dtype)
    x_f32 = int(x_RD.dtype == torch.float32)
    xp, hp = _packed(padded, D), _packed(padded, F)
    _library().moeserve_amx_moe(
        len(counts), meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), D, F,
        x_RD.data_ptr(), x_f32, w13_EFD.data_ptr(), w2_EDF.data_ptr(), weight32_R.data_ptr(),
        y.data_ptr(), x_f32, xp.data_ptr(), h.data_ptr(), hp.data_ptr(),
    )  # fmt: skip
    return y


class BoundMoE:
    """The bf16 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`) on
    fp32 rows: one ``moeserve_amx_moe`` call over the sorted groups."""

    max_rows = ROW_KERNEL_ROWS  # decode batches; more go through moe_experts

    def __init__(self, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> None:
        self.w_args = (w13_EFD.data_ptr(), w2_EDF.data_ptr())
        self.pointers = pointers(w13_EFD, w2_EDF)
        self.fn = _library().moeserve_amx_moe

    @staticmethod
    def bind(w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> BoundMoE | None:
        ok = (
            w13_EFD.dtype == w2_EDF.dtype == torch.bfloat16
            and available()
            and w13_EFD.shape[2] % K_ALIGN == 0
            and w2_EDF.shape[2] % K_ALIGN == 0
            and on_cpu_contiguous(w13_EFD, w2_EDF)
        )
        return BoundMoE(w13_EFD, w2_EDF) if ok else None

    def prepare(self, b: MoEBuffers) -> None:
        P = b.padded_rows
        self.h = torch.empty(P, 2 * b.F, dtype=torch.float32)  # by column, rows padded
        self.xp, self.hp = _packed(P, b.D), _packed(P, b.F)
        self.y = b.y_sorted
        # fp32 rows in and out (the 1s), bf16 weights
        self.args = (*b.group_args(), 1, *self.w_args, b.weight.data_ptr())
        self.args += (b.y_sorted.data_ptr(), 1, self.xp.data_ptr(), self.h.data_ptr())
        self.args += (self.hp.data_ptr(),)

    def call_args(self) -> tuple:
        return self.fn, self.args, self.y

    def run(self, G: int) -> torch.Tensor:
        self.fn(G, *self.args)
        return self.y
