"""The w4a8_int8 kernels: ``int4_amx.c`` (group-wise int4 weights unpacked to int8 tiles,
times activations quantized to int8 per token row, on AMX's TDPBSSD), and for few rows int4's
integer dots (``int4.c``, ``int4_idot.h``) on the rows put on the same int8 grids; and their
pure-torch references. The same tiles also run the int4 format's many-row products in its
own numerics (``rows16``: each row in 16-bit fixed point on two byte planes, as int4's
integer dots round it; :func:`rows16_usable`, :func:`moe_rows16_usable`).

    s[m] = max|x[m]| / 127,   xq[m] = round(x[m] * (127 / max|x[m]|))      (0 for a zero row)
    y[m, n] = s[m] * sum_g scale[n, g] * sum_{k in g} xq[m, k] * (u[n, k] - zero[n, g])

Weights are :class:`~moeserve.quant.int4.Int4Tensor` rows (``q [N, K/2]`` packed codes,
``scale`` and ``zero [N, K/G]``); activations and outputs fp32. The row quantization is
w8a8_int8's (``int8_amx.quantize_rows_ref``, the same fp32 operations as the kernels').
:func:`gemm_ref` and :func:`moe_ref` are the references of :func:`gemm_nt` and
:func:`moe_experts`. :func:`available` is False without AMX-INT8, when the kernel refuses the
AMX state, when the source cannot be built, or with ``MOESERVE_CPU_KERNELS=0`` /
``MOESERVE_CPU_AMX=0``.

Which runs (:func:`route`): a tile product streams each weight once per 16 token rows but
multiplies 16 rows whatever their number, so below :data:`FEW_ROWS` rows (a projection's, or
an MoE call's rows an expert on average: :func:`moe_route`) int4's integer dots run instead,
with ``INT8_ROWS``: each row rounded to its int8 grid first (``xi = 257 xq``, exact in their
16-bit form), the same integer sums. They also run where the tiles do not (a CPU without
AMX-INT8, or a weight whose shape the tiles do not take), for any rows they take (AVX2: any;
VNNI: fewer than 256).
Elsewhere :func:`route` is None and the format rounds the rows in torch
(``int8_amx.fake_quant``) before int4's weight-only paths.
"""

from __future__ import annotations

import itertools
import sys
from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu import int4 as int4_kernels
from moeserve.ops.cpu.bf16_amx import aligned_empty, load_amx_library
from moeserve.ops.cpu.bound import BoundGemm, MoEBuffers, on_cpu_contiguous, pointers
from moeserve.ops.cpu.build import I64, INT, PTR
from moeserve.ops.cpu.int4 import MAX_ROWS as INT4_ROWS
from moeserve.ops.cpu.int4 import moe_w_args, w_args  # int4.c's argument lists, shared
from moeserve.ops.cpu.int8 import moe_int8_ref
from moeserve.ops.cpu.int8_amx import quantize_rows_ref
from moeserve.quant.int4 import GROUP_SIZES, Int4Tensor, unpack_nibbles

_SOURCE = Path(__file__).with_name("int4_amx.c")
_FLAGS = {"amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2"}
K_ALIGN, N_ALIGN = 64, 16  # a packed token block holds 64 int8 of k; a tile 16 weight rows
# Fewer rows than this run on int4's integer dots where they can (2816 x 2048, group 128,
# Xeon with AMX, 1 or 2 threads alike): VNNI's dots at 1 / 2 rows 2.0x / 1.7x the tiles, even
# at 4, the tiles at 8 / 32 rows 1.8x / 4.2x the dots (docs/benchmarks.md)
FEW_ROWS = 4
TILES, DOTS = "tiles", "dots"
# int4's own numerics on the tiles (``rows16``): each row in 16-bit fixed point
# (``int4.rows16_ref``, the rounding of int4's integer dots) on two byte planes, a tile
# product per plane. The int4 format runs projections of ROWS16_MIN rows or more, and MoE
# calls of MOE_ROWS16_MIN rows an expert on average or more, there instead of on its dots or
# fp32 panels (group 128, 2 threads, Xeon with AMX; docs/benchmarks.md "int4 on AMX's
# tiles"). benchmarks/amx_gemm.py: a 2816 x 2048 projection alone 0.82x the dots at 4 rows,
# 1.26x at 6, 1.5x at 8, 4x from 32; the benchmark model's MoE call 0.72x at 4 rows an
# expert, 1.14x at 6, 2.7x at 48. The engine's decode (its smaller projections, one after
# another): the tiles from 6 rows cost 4-8% at batch 8, from 9 rows gave 1.05x at 16 and 1.14x
# at 32 against the dots.
ROWS16_MIN = 12
MOE_ROWS16_MIN = 6


def gemm_ref(x: torch.Tensor, w: Int4Tensor, rows16: bool = False) -> torch.Tensor:
    """Reference of :func:`gemm_nt`: the rows on their int8 grids (w4a8_int8), or with
    ``rows16`` in 16-bit fixed point (int4's, ``int4.rows16_ref``); each group's integer sum
    exact (in fp64), times the group's scale and summed in fp32, times the row's scale."""
    if rows16:
        xq, s = int4_kernels.rows16_ref(x)
        s = s.squeeze(-1)
    else:
        xq, s = quantize_rows_ref(x)
    N, K = w.shape
    G = w.group_size
    u = unpack_nibbles(w.q).double().view(N, K // G, G) - w.zero.double().unsqueeze(-1)
    sums = torch.einsum("mgk,ngk->mng", xq.double().view(-1, K // G, G), u)  # exact
    return (sums.float() * w.scale).sum(-1) * s.unsqueeze(-1)


def moe_ref(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int4Tensor,
    w2: Int4Tensor,
    weight_R: torch.Tensor,
    rows16: bool = False,
) -> torch.Tensor:
    """Reference of :func:`moe_experts`: each group's gated FFN with :func:`gemm_ref` (the rows
    and the hidden quantized per row, to int8 or with ``rows16`` to 16 bits), times the routing
    weights."""
    gemm = lambda x, w: gemm_ref(x, w, rows16)  # noqa: E731
    return moe_int8_ref(x_RD.float(), experts, counts, w13, w2, weight_R, gemm=gemm)


@lru_cache(maxsize=1)
def _library():
    lib = load_amx_library(_SOURCE, _FLAGS, "moeserve_amx_i4_enable")
    if lib is None:
        return None
    # the argument list of int4.c's few-row GEMM
    build.declare(
        lib,
        "moeserve_amx_i4_gemm_nt",
        *(I64, I64, I64, PTR, I64, PTR, I64, PTR, PTR, I64, PTR, I64, INT),
    )
    lib.moeserve_amx_i4_gemm_nt.restype = INT
    build.declare(
        lib,
        "moeserve_amx_i4_moe",
        *(I64, PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64),
        *(PTR, PTR, PTR, PTR, PTR, PTR, PTR, INT),
    )
    lib.moeserve_amx_i4_moe.restype = INT
    return lib


def available() -> bool:
    """Whether the tile kernels run here."""
    return _library() is not None


def dots_available() -> bool:
    """Whether int4's integer dots run here (with the rows on their int8 grids)."""
    return _dots_level(1) is not None


def _dots_level(rows: int) -> int | None:
    """int4's integer-dot ``isa`` with :data:`~moeserve.ops.cpu.int4.INT8_ROWS` for ``rows``
    token rows, or None where they do not take them."""
    if not int4_kernels.available():
        return None
    level = int4_kernels.isa()
    if level == int4_kernels.AVX2_IDOT or (
        level == int4_kernels.VNNI and rows < int4_kernels.IDOT_MAX_ROWS
    ):
        return level | int4_kernels.INT8_ROWS
    return None


def weight_ok(w: Int4Tensor) -> bool:
    """Whether either kernel takes ``w`` (``[..., N, K]``): CPU code rows of unit stride,
    contiguous scales and zero points, a group size of :data:`GROUP_SIZES`, columns in order
    (no GPTQ act-order)."""
    return (
        w.q.device.type == "cpu"
        and w.q.dim() >= 2
        and w.q.stride(-1) == 1
        and w.scale.is_contiguous()
        and w.zero.is_contiguous()
        and w.perm is None
        and w.group_size in GROUP_SIZES
    )


def tiles_take(w: Int4Tensor) -> bool:
    """Whether the tile kernels take ``w`` (:func:`weight_ok`, K a multiple of 64 and N of 16)
    and run here."""
    return (
        weight_ok(w) and w.shape[-1] % K_ALIGN == 0 and w.shape[-2] % N_ALIGN == 0 and available()
    )


def route(rows: int, w: Int4Tensor) -> str | None:
    """Which kernel computes ``rows`` token rows times ``w`` (an MoE call: :func:`moe_route`):
    :data:`DOTS` below :data:`FEW_ROWS` rows or where the tiles do not run, else
    :data:`TILES`; None where neither takes them."""
    tiles = tiles_take(w)
    dots = weight_ok(w) and _dots_level(rows) is not None
    if dots and (rows < FEW_ROWS or not tiles):
        return DOTS
    return TILES if tiles else None


def _rows_ok(x: torch.Tensor, w: Int4Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(1) == 1
        and w.q.dim() == 2
    )


def usable(x: torch.Tensor, w: Int4Tensor) -> bool:
    """Whether :func:`gemm_nt` runs a kernel for fp32 ``x [M, K]`` (unit-stride rows)."""
    return _rows_ok(x, w) and route(x.shape[0], w) is not None


def rows16_usable(x: torch.Tensor, w: Int4Tensor) -> bool:
    """Whether the int4 format runs ``x [M, K]`` times ``w`` on the tiles in its own numerics
    (:func:`gemm_nt` with ``rows16``): :data:`ROWS16_MIN` rows or more, a weight the tiles
    take."""
    return _rows_ok(x, w) and x.shape[0] >= ROWS16_MIN and tiles_take(w)


def gemm_nt(
    x: torch.Tensor, w: Int4Tensor, out: torch.Tensor | None = None, rows16: bool = False
) -> torch.Tensor:
    """``gemm_ref(x, w, rows16)`` for fp32 ``x [M, K]`` and ``w [N, K]``, into ``out`` (fp32
    ``[M, N]``, unit-stride rows) when given: by the kernel :func:`route` picks (:func:`usable`),
    or with ``rows16`` on the tiles (:func:`rows16_usable`, any rows the tiles take)."""
    M, K = x.shape
    N = w.q.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"the w4a8 GEMM writes fp32 rows, got {out.dtype} {out.stride()}")
    args = (
        M,
        N,
        K,
        x.data_ptr(),
        x.stride(0),
        *w_args(w),
        out.data_ptr(),
        out.stride(0),
    )
    if not rows16 and route(M, w) == DOTS:
        failed = int4_kernels.entry("gemm_nt_small")(*args, _dots_level(M))
    else:
        failed = _library().moeserve_amx_i4_gemm_nt(*args, int(rows16))
    if failed:
        raise MemoryError(f"int4 projection of {M} rows: out of memory for its workspace")
    return out


def bind_gemm(w: Int4Tensor, fallback) -> BoundGemm | None:
    """:func:`gemm_nt` with ``w`` bound: the integer dots for the rows :func:`route` gives them
    (more go to ``fallback``), else the tiles for any rows; None where neither takes ``w``."""
    if w.q.dim() != 2:
        return None
    bound = pointers(w.q, w.scale, w.zero)
    if route(1, w) == DOTS:
        fn = int4_kernels.entry("gemm_nt_small")
        tiles = tiles_take(w)
        most = FEW_ROWS - 1 if tiles else _dots_rows()
        return BoundGemm(fn, tuple(w.shape), w_args(w), most, _dots_level(1), bound, fallback)
    if route(1, w) == TILES:
        fn = _library().moeserve_amx_i4_gemm_nt
        return BoundGemm(fn, tuple(w.shape), w_args(w), sys.maxsize, 0, bound, fallback)
    return None


def _dots_rows() -> int:
    """The most rows int4's integer dots take here (VNNI: fewer than 256)."""
    if int4_kernels.isa() == int4_kernels.VNNI:
        return int4_kernels.IDOT_MAX_ROWS - 1
    return sys.maxsize


def moe_route(mean: float, most: int, w13: Int4Tensor, w2: Int4Tensor) -> str | None:
    """Which kernel runs an MoE call whose experts have ``mean`` rows on average and ``most``
    at most: the dots below :data:`FEW_ROWS` rows an expert on average (a tile product costs
    16 rows whatever their number, the dots' cost grows with the rows: summed over the
    experts, the mean decides) or where the tiles do not take both projections, else the
    tiles; None where neither takes the call (the projections' group sizes differ)."""
    if w13.group_size != w2.group_size:
        return None
    tiles = tiles_take(w13) and tiles_take(w2)
    dots = weight_ok(w13) and weight_ok(w2) and _dots_level(most) is not None
    if dots and (mean < FEW_ROWS or not tiles):
        return DOTS
    return TILES if tiles else None


def _moe_rows_ok(x_RD: torch.Tensor, counts: list[int], w13: Int4Tensor, w2: Int4Tensor) -> bool:
    return (
        0 < max(counts, default=0)
        and x_RD.dtype == torch.float32
        and x_RD.device.type == "cpu"
        and x_RD.is_contiguous()
        and on_cpu_contiguous(*w13.parts(), *w2.parts())
    )


def moe_usable(x_RD: torch.Tensor, counts: list[int], w13: Int4Tensor, w2: Int4Tensor) -> bool:
    """Whether :func:`moe_experts` runs a kernel: fp32 contiguous rows, contiguous weights of
    one group size that :func:`moe_route` gives a kernel."""
    return _moe_rows_ok(x_RD, counts, w13, w2) and (
        moe_route(sum(counts) / len(counts), max(counts), w13, w2) is not None
    )


def moe_rows16_usable(
    x_RD: torch.Tensor, counts: list[int], w13: Int4Tensor, w2: Int4Tensor
) -> bool:
    """Whether the int4 format runs this MoE call on the tiles in its own numerics
    (:func:`moe_experts` with ``rows16``): :data:`MOE_ROWS16_MIN` rows an expert or more on
    average, weights of one group size that the tiles take."""
    return (
        _moe_rows_ok(x_RD, counts, w13, w2)
        and sum(counts) >= MOE_ROWS16_MIN * len(counts)
        and w13.group_size == w2.group_size
        and tiles_take(w13)
        and tiles_take(w2)
    )


class MoEWorkspace:
    """The buffers of one ``moeserve_amx_i4_moe`` call of at most ``padded`` rows (each
    expert's rows padded to 16), reused across calls of the same size (decode); ``planes``
    2 for the rows in 16-bit fixed point."""

    def __init__(self, padded: int, D: int, F_: int, planes: int = 1) -> None:
        self.padded = padded
        self.xp = aligned_empty(planes * padded * D, torch.int8)
        self.hp = aligned_empty(planes * padded * F_, torch.int8)
        self.xs = torch.empty(padded, dtype=torch.float32)
        self.hs = torch.empty(padded, dtype=torch.float32)
        self.h = torch.empty(padded, 2 * F_, dtype=torch.float32)

    def pointers(self) -> tuple[int, ...]:
        """In the order of ``moeserve_amx_i4_moe``'s last five arguments."""
        return tuple(t.data_ptr() for t in (self.xp, self.xs, self.h, self.hp, self.hs))


def _check(failed: int, rows: int) -> None:
    if failed:
        raise MemoryError(f"int4 experts of {rows} rows: out of memory for a thread's workspace")


def moe_experts(
    x_RD: torch.Tensor,
    experts: list[int],
    counts: list[int],
    w13: Int4Tensor,
    w2: Int4Tensor,
    weight_R: torch.Tensor,
    rows16: bool = False,
) -> torch.Tensor:
    """Rows of fp32 ``x_RD`` sorted by expert (``counts[i]`` rows for ``experts[i]``) through
    their experts' gated FFN (int4 ``w13 [E, 2F, D]``, ``w2 [E, D, F]``), each times its
    routing weight, in one call of the kernel :func:`moe_route` picks (:func:`moe_usable`),
    or with ``rows16`` of the tiles in int4's numerics (:func:`moe_rows16_usable`). The
    reference is :func:`moe_ref`."""
    R, D = x_RD.shape
    F_ = w2.shape[2]
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    meta = torch.tensor([experts, starts, counts], dtype=torch.int64)
    weight32_R = weight_R.float().contiguous()
    y = torch.empty(R, D, dtype=torch.float32)
    groups = (len(counts), meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), D, F_)
    operands = (x_RD.data_ptr(), *moe_w_args(w13, w2), weight32_R.data_ptr())
    most = max(counts)
    if not rows16 and moe_route(sum(counts) / len(counts), most, w13, w2) == DOTS:
        h = torch.empty(R, 2 * F_, dtype=torch.float32)
        fn = int4_kernels.entry("moe_small")
        failed = fn(*groups, *operands, h.data_ptr(), y.data_ptr(), _dots_level(most))
    else:
        ws = MoEWorkspace(sum(-(-n // 16) * 16 for n in counts), D, F_, 1 + rows16)
        tiles = _library().moeserve_amx_i4_moe
        failed = tiles(*groups, *operands, y.data_ptr(), *ws.pointers(), int(rows16))
    _check(failed, R)
    return y


class BoundMoE:
    """The w4a8_int8 experts of a decode step (:class:`~moeserve.ops.cpu.bound.BoundExperts`):
    one call over the sorted groups, by the kernel :func:`moe_route` picks for the step's
    rows an expert on average (its rows over its groups; no expert gets more than the step's
    tokens), the tiles' workspace reused."""

    max_rows = INT4_ROWS  # decode batches (the int4 row kernels' bound); more go to moe_experts

    def __init__(self, w13: Int4Tensor, w2: Int4Tensor) -> None:
        self.w13, self.w2 = w13, w2
        self.w_args = moe_w_args(w13, w2)
        self.pointers = pointers(*w13.parts(), *w2.parts())
        self.kind: str | None = None  # the last call's

    @staticmethod
    def bind(w13: Int4Tensor, w2: Int4Tensor) -> BoundMoE | None:
        if not on_cpu_contiguous(*w13.parts(), *w2.parts()):
            return None
        most = BoundMoE.max_rows  # a kernel for any step: the tiles, or dots for this many
        routes = (moe_route(1, most, w13, w2), moe_route(most, most, w13, w2))
        return BoundMoE(w13, w2) if None not in routes else None

    def prepare(self, b: MoEBuffers) -> None:
        self.y, self.R, T = b.y_sorted, b.R, b.tokens
        common = (*b.group_args(), *self.w_args, b.weight.data_ptr())
        # the dots where they take every expert of such a step, the tiles where they run
        self.dots = self.tiles = None
        if moe_route(1, T, self.w13, self.w2) == DOTS:
            self.dots = (*common, b.h.data_ptr(), b.y_sorted.data_ptr(), _dots_level(T))
            self.dots_fn = int4_kernels.entry("moe_small")
        if moe_route(self.max_rows, T, self.w13, self.w2) == TILES:
            self.ws = MoEWorkspace(b.padded_rows, b.D, b.F)
            self.tiles = (*common, b.y_sorted.data_ptr(), *self.ws.pointers(), 0)
            self.tiles_fn = _library().moeserve_amx_i4_moe

    def call_args(self) -> None:
        return None  # run does more than one call

    def run(self, G: int) -> torch.Tensor:
        if self.dots is not None and (self.tiles is None or self.R < FEW_ROWS * G):
            self.kind, failed = DOTS, self.dots_fn(G, *self.dots)
        else:
            self.kind, failed = TILES, self.tiles_fn(G, *self.tiles)
        _check(failed, G)
        return self.y
