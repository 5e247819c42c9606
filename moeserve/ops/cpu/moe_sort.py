"""A decode step's (token, choice) pairs sorted by expert, and the expert rows added back per
token (``moe_sort.c``), with their pure-torch references, which ``ops/moe.py: sort_rows`` and
``combine_rows`` run where the kernels do not apply.

Shape legend: T tokens, K choices per token, R = T * K pairs, D model dim, G experts with
pairs, S expert slots.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import I64, PTR

_SOURCE = Path(__file__).with_name("moe_sort.c")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    build.declare(lib, "moeserve_moe_sort", *(I64,) * 3, PTR, PTR, PTR, I64, I64, *(PTR,) * 6)
    lib.moeserve_moe_sort.restype = I64
    build.declare(lib, "moeserve_moe_combine", I64, I64, I64, PTR, PTR, PTR)
    return lib


def available() -> bool:
    return _library() is not None


def moe_sort_ref(
    ids_TK: torch.Tensor, w_TK: torch.Tensor, x_TD: torch.Tensor, num_slots: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(meta_3G, token_R, weight_R, x_RD)``: the pairs in stable order of expert; ``meta_3G``
    holds each expert with pairs, its first sorted row and its count. With ``num_slots``,
    ValueError for an id outside ``[0, num_slots)`` (as the kernel)."""
    K = ids_TK.shape[1]
    ids_R = ids_TK.reshape(-1)
    if num_slots is not None and ids_R.numel():
        if not (0 <= int(ids_R.min()) and int(ids_R.max()) < num_slots):
            raise ValueError(f"expert ids must lie in [0, {num_slots})")
    order_R = ids_R.argsort(stable=True)
    experts, counts = torch.unique(ids_R, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    token_R = order_R // K
    meta = torch.stack((experts, starts, counts)).to(torch.int64)
    return meta, token_R, w_TK.reshape(-1)[order_R].float(), x_TD.index_select(0, token_R)


def moe_combine_ref(y_RD: torch.Tensor, token_R: torch.Tensor, T: int) -> torch.Tensor:
    """``[T, D]``: each token's sorted rows added up in row order with fp32 sums, in
    ``y_RD``'s dtype."""
    acc_TD = y_RD.new_zeros(T, y_RD.shape[1], dtype=torch.float32)
    return acc_TD.index_add_(0, token_R, y_RD.float()).to(y_RD.dtype)


def moe_sort(
    ids_TK: torch.Tensor, w_TK: torch.Tensor, x_TD: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The kernel of :func:`moe_sort_ref` (int64 ids, fp32 weights and rows with unit-stride
    rows, CPU); None where it does not apply. Raises ValueError on an id outside
    ``[0, num_slots)``."""
    T, K = ids_TK.shape
    D = x_TD.shape[1]
    if not (
        available()
        and ids_TK.dtype == torch.int64
        and w_TK.dtype == x_TD.dtype == torch.float32
        and ids_TK.is_contiguous()
        and w_TK.is_contiguous()
        and x_TD.stride(1) == 1
        and x_TD.device.type == "cpu"
    ):
        return None
    R = T * K
    meta = torch.empty(3, R, dtype=torch.int64)
    token = torch.empty(R, dtype=torch.int64)
    weight = torch.empty(R, dtype=torch.float32)
    x_RD = torch.empty(R, D, dtype=torch.float32)
    G = _library().moeserve_moe_sort(
        T, K, num_slots, ids_TK.data_ptr(), w_TK.data_ptr(), x_TD.data_ptr(), x_TD.stride(0), D,
        meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), token.data_ptr(),
        weight.data_ptr(), x_RD.data_ptr(),
    )  # fmt: skip
    if G < 0:
        raise ValueError(f"expert ids must lie in [0, {num_slots})")
    return meta[:, :G], token, weight, x_RD


def moe_combine(y_RD: torch.Tensor, token_R: torch.Tensor, T: int) -> torch.Tensor | None:
    """The kernel of :func:`moe_combine_ref` (fp32 contiguous rows, CPU); None where it does
    not apply."""
    if not (
        available()
        and y_RD.dtype == torch.float32
        and y_RD.is_contiguous()
        and token_R.dtype == torch.int64
        and token_R.is_contiguous()
        and y_RD.device.type == "cpu"
    ):
        return None
    R, D = y_RD.shape
    y = torch.empty(T, D, dtype=torch.float32)
    _library().moeserve_moe_combine(R, T, D, y_RD.data_ptr(), token_R.data_ptr(), y.data_ptr())
    return y
