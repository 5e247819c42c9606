"""The KV-cache tensors: one ``[num_blocks * block_size, *token_shape]`` tensor per layer,
sized from a memory budget. Block bookkeeping lives in :mod:`moeserve.kvcache.block_manager`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.models.base import KVCacheSpec
from moeserve.ops.cpu.hugepages import huge_page_zeros


@dataclass
class KVCachePool:
    spec: KVCacheSpec
    num_blocks: int
    block_size: int
    caches: list[torch.Tensor]

    @staticmethod
    def blocks_for_budget(spec: KVCacheSpec, block_size: int, budget_bytes: float) -> int:
        return int(budget_bytes // (spec.bytes_per_token * block_size))

    @classmethod
    def allocate(
        cls, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str
    ) -> KVCachePool:
        if num_blocks < 1:
            raise ValueError(
                "the KV-cache budget holds no block: raise kv_cache_memory_gb "
                f"(one block of {block_size} tokens needs {spec.bytes_per_token * block_size} B)"
            )
        slots = num_blocks * block_size
        shape = (slots, *spec.token_shape)
        if torch.device(device).type == "cpu":  # in 2 MB pages where the kernel allows
            caches = [huge_page_zeros(shape, spec.dtype) for _ in range(spec.num_layers)]
        else:
            caches = [
                torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
            ]
        return cls(spec, num_blocks, block_size, caches)

    @property
    def num_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.caches)
