"""The token-bitmask kernel of ``bitmask.c`` (structured output). The pure-torch reference
lives with its caller, ``moeserve/grammar/bitmask.py``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import I64, PTR

_SOURCE = Path(__file__).with_name("bitmask.c")


@lru_cache(maxsize=1)
def _library():
    lib = build.load(_SOURCE)
    if lib is not None:
        build.declare(lib, "moeserve_apply_token_bitmask", PTR, I64, I64, I64, PTR, I64)
    return lib


def apply_token_bitmask(logits_BV: torch.Tensor, mask_BW: torch.Tensor) -> bool:
    """Apply ``mask_BW`` to ``logits_BV`` in place with the C kernel; False (nothing done)
    when it does not apply: no kernel here, not fp32 on the CPU, or rows not unit-stride."""
    lib = _library()
    if (
        lib is None
        or logits_BV.dtype != torch.float32
        or logits_BV.device.type != "cpu"
        or logits_BV.stride(1) != 1
        or mask_BW.dtype != torch.int32
    ):
        return False
    mask = mask_BW.contiguous()
    B, V = logits_BV.shape
    lib.moeserve_apply_token_bitmask(
        logits_BV.data_ptr(), B, V, logits_BV.stride(0), mask.data_ptr(), mask.shape[1]
    )
    return True
