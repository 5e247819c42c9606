"""DeepSeek's block-wise FP8 weight format, as pure functions over tensors.

A weight ``w_NK`` (N output rows, K input columns) is stored as ``float8_e4m3fn`` with a float32
``scale_inv`` of shape ``[ceil(N / block_n), ceil(K / block_k)]``: block ``(i, j)`` covers rows
``i*block_n : (i+1)*block_n`` and columns ``j*block_k : (j+1)*block_k``, cropped at the edges, and
``w ~= w_fp8.float() * scale_inv[i, j]`` inside it.

    K ->  |<- block_k ->|<- block_k ->|<- rest ->|
    N     | s[0, 0]     | s[0, 1]     | s[0, 2]  |   block_n rows
    |     | s[1, 0]     | s[1, 1]     | s[1, 2]  |   block_n rows
    v     | s[2, 0]     | s[2, 1]     | s[2, 2]  |   the last N % block_n rows
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def scale_shape(shape_NK: tuple[int, ...], block_n: int, block_k: int) -> tuple[int, int]:
    """The ``scale_inv`` shape that goes with a 2-D weight of ``shape_NK``."""
    n, k = shape_NK
    return (-(-n // block_n), -(-k // block_k))


def dequantize_fp8_block(
    w_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Return ``w_NK.float() * scale_inv`` expanded block-wise, cast to ``out_dtype``.

    The product is always taken in float32 and then cast, so the result for ``out_dtype`` equals
    ``dequantize_fp8_block(...).to(out_dtype)`` exactly. Works one row-block at a time, so peak
    extra memory is the output plus one fp32 row-block. Raises ValueError on mismatched shapes.
    """
    if w_NK.dim() != 2:
        raise ValueError(f"fp8 weight must be 2-D, got shape {tuple(w_NK.shape)}")
    n, k = w_NK.shape
    expected = scale_shape((n, k), block_n, block_k)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv for a weight of shape ({n}, {k}) with blocks ({block_n}, {block_k}) "
            f"must have shape {expected}, got {tuple(scale_inv.shape)}"
        )
    out = torch.empty((n, k), dtype=out_dtype, device=w_NK.device)
    scale = scale_inv.to(device=w_NK.device, dtype=torch.float32)
    for i in range(expected[0]):
        rows = slice(i * block_n, min((i + 1) * block_n, n))
        scale_row_K = scale[i].repeat_interleave(block_k)[:k]
        out[rows] = (w_NK[rows].to(torch.float32) * scale_row_K).to(out_dtype)
    return out


def quantize_fp8_block(
    w_NK: torch.Tensor, block_n: int = 128, block_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to ``(w_fp8 [N, K] float8_e4m3fn, scale_inv float32)``.

    As DeepSeek does: per block, ``scale_inv = amax(|w|) / 448`` and ``w_fp8 = w / scale_inv``.
    An all-zero block gets ``scale_inv = 1``. Used to build FP8 test checkpoints.
    """
    if w_NK.dim() != 2:
        raise ValueError(f"fp8 weight must be 2-D, got shape {tuple(w_NK.shape)}")
    n, k = w_NK.shape
    nb, kb = scale_shape((n, k), block_n, block_k)
    padded = torch.zeros((nb * block_n, kb * block_k), dtype=torch.float32, device=w_NK.device)
    padded[:n, :k] = w_NK.to(torch.float32)
    blocks = padded.view(nb, block_n, kb, block_k)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    w_fp8 = q.view(nb * block_n, kb * block_k)[:n, :k].to(torch.float8_e4m3fn).contiguous()
    return w_fp8, scale_inv.contiguous()
