"""What a weight format provides, with the plain-torch body every format falls back to.

Shape legend: M rows, N outputs, K inputs, H heads, R rows sorted by expert, D model dim,
F expert FFN dim, E expert slots.

A format owns everything that differs between weight formats, so that no layer tests a type
or a dtype:

    at load        make_weight (the empty weight a layer holds before loading), dense,
                   take_rows, absorbed (MLA's W_UK / W_UV derived from kv_b_proj)
    compute        activation_dtype, linear, linear_into, moe_experts, head_gemm
    decode         bind_linear, bind_moe, bind_head_gemm: the kernel calls with their
                   weight-side arguments derived once (ops/cpu/bound.py); None where no
                   kernel takes the weight, and the caller runs the calls above
    cost           bytes_per_weight, weight_bytes: what the weights stream, for the
                   roofline and the planner

This class is the reference body (``F.linear`` with the weight widened to the activations'
dtype, ``bmm``) and the format of dense dtypes without kernels (fp16).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def widened(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``w`` in ``x``'s dtype (a weight held narrower than the activations is widened per
    call)."""
    return w if w.dtype == x.dtype else w.to(x.dtype)


def through_fp32_rows(
    x: torch.Tensor, N: int, matmul: Callable[[torch.Tensor], torch.Tensor], bias=None
) -> torch.Tensor:
    """``matmul`` (fp32 ``[M, K]`` rows to ``[M, N]``) applied to ``x [..., K]`` of any float
    dtype: the result in ``x``'s shape and dtype, plus ``bias``. The many-row body of the
    quantized formats, whose kernels take fp32 activations."""
    x2 = x.reshape(-1, x.shape[-1])
    y = matmul(x2 if x2.dtype == torch.float32 else x2.float()).view(*x.shape[:-1], N)
    if bias is not None:
        y = y.add_(bias)
    return y if y.dtype == x.dtype else y.to(x.dtype)


_BLOCK_BYTES = 1 << 20  # fp32 bytes of dequantized weight per block: stays in L2


def dequantized_blocks(
    x: torch.Tensor, w, out: torch.Tensor, dequantize_into: Callable
) -> torch.Tensor:
    """``out[:] = x @ w.T`` for many rows (prefill) of a quantized ``w [N, K]``: blocks of its
    rows dequantized (``dequantize_into(rows, buf)``) into one reused fp32 buffer that stays
    in cache, each block an MKL GEMM (as fast as dequantizing all first, without the
    full-size buffer: benchmarks/int8_gemm.py)."""
    N, K = w.shape
    nb = max(16, min(N, _BLOCK_BYTES // (4 * max(K, 1))))
    buf = torch.empty(nb, K, dtype=torch.float32)
    for n0 in range(0, N, nb):
        n1 = min(N, n0 + nb)
        out[:, n0:n1] = x @ dequantize_into(w[n0:n1], buf[: n1 - n0]).t()
    return out


def into_fp32_out(
    x: torch.Tensor, out: torch.Tensor, matmul, linear: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``out[:] = x @ w.T``: ``matmul(x, out)`` where both are fp32 with unit-stride rows (the
    kernel writes ``out``), else ``linear(x)`` copied in."""
    if out.dtype == torch.float32 and out.stride(-1) == 1 and x.dtype == torch.float32:
        return matmul(x, out)
    out.copy_(linear(x))
    return out


def dense_absorbed(
    w: torch.Tensor, H: int, N: int, V: int, C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [H, C, N], W_UV [H, V, C])`` from ``kv_b_proj``'s dense weight
    ``[H * (N + V), C]``."""
    w = w.view(H, N + V, C)
    return w[:, :N, :].transpose(1, 2).contiguous(), w[:, N:, :].contiguous()


class WeightFormat:
    """The plain-torch format; subclasses override what their kernels do faster."""

    # the activations this format's CPU kernels take (dtype="auto" then computes in them);
    # None: the model dtype
    activation_dtype: torch.dtype | None = None
    bytes_per_weight: float = 4.0  # what decode streams per weight element
    scale_bytes_per_row: float = 0.0  # per output row besides (int8: its fp32 scale)
    absorbed_bytes: float = 4.0  # per element of MLA's absorbed W_UK/W_UV as this format holds
    # whether a weight may be stored [K, N] behind its [N, K] view (models/base.relayout_kn:
    # MKL's few-row GEMMs where the kernels do not run); int8 rows stay as their kernels read
    kn_layout_ok: bool = True

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"

    def kernels_available(self) -> bool:
        """Whether this format's fast kernels run on this machine."""
        return False

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError when this format cannot serve on ``device`` (checked at load)."""

    # -- load ---------------------------------------------------------------------------

    def make_weight(self, p: nn.Parameter) -> nn.Module | nn.Parameter:
        """The weight a layer holds in place of its still-empty parameter ``p`` (same shape
        and device), filled as the checkpoint loads (its ``copy_`` converts)."""
        return p

    def dense(self, w, dtype: torch.dtype) -> torch.Tensor:
        """``w`` as a dense tensor (``w`` itself when it is one)."""
        return w

    def take_rows(self, w, ids_H: torch.Tensor):
        """A contiguous copy of rows ``ids_H`` of ``w [N, K]``, in this format."""
        return w.detach()[ids_H].contiguous()

    def absorbed(self, kv_b, dtype: torch.dtype, H: int, N: int, V: int, C: int) -> tuple:
        """MLA's absorbed ``(W_UK [H, C, N], W_UV [H, V, C])`` from this format's
        ``kv_b_proj`` weight ``[H * (N + V), C]``, as the decode's per-head products should
        hold them (weights :func:`~moeserve.ops.formats.of` answers for); here dense in
        ``dtype``."""
        return dense_absorbed(self.dense(kv_b, dtype), H, N, V, C)

    def weight_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes a weight of ``shape`` (``[..., N, K]``) streams per full read."""
        rows = 1
        for d in shape[:-1]:
            rows *= d
        return int(rows * (shape[-1] * self.bytes_per_weight + self.scale_bytes_per_row))

    # -- compute --------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` for ``x [..., K]``, ``w [N, K]``; the result has ``x``'s
        dtype."""
        return F.linear(x, widened(w, x), bias)

    def linear_into(self, x: torch.Tensor, w, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = x @ w.T`` for 2-D ``x`` and ``out``, without an intermediate where the
        kernel writes ``out`` directly."""
        return torch.matmul(x, widened(w, x).t(), out=out)

    def moe_experts(
        self,
        x_RD: torch.Tensor,
        experts: list[int],
        counts: list[int],
        w13_EFD,
        w2_EDF,
        weight_R: torch.Tensor,
    ) -> torch.Tensor | None:
        """Rows sorted by expert (``counts[i]`` rows for ``experts[i]``, all > 0) through
        their expert's gated FFN, each times its routing weight, in one kernel call; None
        where no kernel takes them (``ops/moe.py`` then runs its per-expert loop)."""
        return None

    def head_gemm(
        self, x_HMK: torch.Tensor, w_HNK: torch.Tensor, out_HMN: torch.Tensor
    ) -> torch.Tensor:
        """``out[h] = x[h] @ w[h].T`` (MLA's absorbed per-head products, ``w`` as
        :meth:`absorbed` holds it)."""
        return out_HMN.copy_(torch.bmm(x_HMK.to(w_HNK.dtype), w_HNK.transpose(1, 2)))

    # -- decode: prebound kernel calls -------------------------------------------------------

    def bind_linear(self, w, fallback: Callable[[torch.Tensor], torch.Tensor]):
        """A :class:`~moeserve.ops.cpu.bound.BoundGemm` for decode rows times ``w`` (rows it
        does not take go to ``fallback``), or None where no kernel takes ``w``."""
        return None

    def bind_moe(self, w13_EFD, w2_EDF):
        """A :class:`~moeserve.ops.cpu.bound.BoundExperts` for a decode step's experts, or
        None."""
        return None

    def bind_head_gemm(self, w_HNK: torch.Tensor):
        """A :class:`~moeserve.ops.cpu.bound.BoundHeadGemm` of fp32 rows times ``w_HNK``, or
        None."""
        return None
