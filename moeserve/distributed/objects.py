"""JSON-serialisable objects over a process group (utf-8 bytes in uint8 tensors; no pickle)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from moeserve.distributed.groups import Axis


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.numpy()).decode())


def broadcast_json(obj: Any, axis: Axis, src_index: int = 0) -> Any:
    """Every member returns the object the member at ``src_index`` passed."""
    if axis.size == 1:
        return obj
    is_src = axis.rank == src_index
    data = _encode(obj) if is_src else None
    length = torch.tensor([data.numel() if is_src else 0], dtype=torch.int64)
    axis.broadcast(length, src_index)
    if not is_src:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    axis.broadcast(data, src_index)
    return obj if is_src else _decode(data)


def all_gather_json(obj: Any, axis: Axis) -> list[Any]:
    """Every member's object, in index order, on every member."""
    if axis.size == 1:
        return [obj]
    data = _encode(obj)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(axis.size)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64), group=axis.group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(axis.size)]
    dist.all_gather(parts, padded, group=axis.group)
    return [_decode(p[: int(n.item())]) for p, n in zip(parts, lengths)]
