"""What an engine sizes once while it starts, given its config and loaded model: the context
length, the KV cache, the scheduler's settings, the tokenizer (``engine/engine.py`` calls
these from ``LLMEngine.__init__``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from moeserve.config import EngineConfig
from moeserve.engine.scheduler import SchedulerConfig
from moeserve.engine.spec_setup import check_mtp_checkpoint
from moeserve.kvcache.pool import KVCachePool
from moeserve.models.hf_config import ModelConfig
from moeserve.tokenizer import Tokenizer

GIB = 1 << 30
DEFAULT_KV_CAP_GB = 4.0


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The model directory's ``tokenizer.json``, or None when it has none."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return Tokenizer.from_dir(model_dir)
    return None


def resident_bytes() -> int:
    """This process's resident set size (Linux; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The configured ``max_model_len`` (default: the model's, at most 8192); raises
    ValueError past the model's ``max_position_embeddings``."""
    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or min(limit, 8192)
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
        )
    return max_model_len


def allocate_kv_pool(
    config: EngineConfig,
    model,
    model_config: ModelConfig,
    max_model_len: int,
    device: torch.device,
) -> KVCachePool:
    """The KV cache: ``kv_cache_memory_gb`` of blocks, or by default enough for
    ``max_num_seqs`` full contexts within 4 GiB; one more layer for the MTP layer under
    speculative decoding. Raises ValueError when it cannot hold ``max_model_len``."""
    spec = model.kv_cache_spec()
    if config.speculative_num_tokens:
        check_mtp_checkpoint(config.model, model_config)
        # one more cache layer, for the MTP layer (on every rank: the pools must agree)
        spec = dataclasses.replace(spec, num_layers=spec.num_layers + 1)
    bs = config.block_size
    if config.kv_cache_memory_gb is not None:
        num_blocks = KVCachePool.blocks_for_budget(spec, bs, config.kv_cache_memory_gb * GIB)
    else:
        want = config.max_num_seqs * (-(-max_model_len // bs)) + 1
        cap = KVCachePool.blocks_for_budget(spec, bs, DEFAULT_KV_CAP_GB * GIB)
        num_blocks = min(want, cap)
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"the KV cache holds only {num_blocks * bs} tokens, fewer than max_model_len="
            f"{max_model_len}: raise kv_cache_memory_gb or lower max_model_len"
        )
    return KVCachePool.allocate(spec, num_blocks, bs, device)


def scheduler_config(config: EngineConfig, max_model_len: int, num_blocks: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_waiting=config.max_waiting_requests,
        num_spec_tokens=config.speculative_num_tokens,
    )
