"""Wiring speculative decoding into an engine: the checkpoint check, the MTP layer's cache, the
model runner with its proposer (and hot vocabulary), and switching speculation on an idle
engine (benchmarks compare MTP off and on in one process)."""

from __future__ import annotations

import dataclasses

import torch

from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.model_runner import ModelRunner
from moeserve.models.base import MoECausalLM
from moeserve.models.hf_config import ModelConfig
from moeserve.models.loader import checkpoint_tensor_names
from moeserve.spec.hot_vocab import HotVocab, load_token_map
from moeserve.spec.mtp import MTPProposer


def check_mtp_checkpoint(model_dir: str, config: ModelConfig) -> None:
    """Raise ValueError unless the checkpoint has an MTP layer to draft with."""
    first = f"model.layers.{config.num_hidden_layers}."
    if not config.num_nextn_predict_layers or not any(
        n.startswith(first) for n in checkpoint_tensor_names(model_dir)
    ):
        raise ValueError(
            f"speculative decoding drafts with the checkpoint's MTP layer, but {model_dir} has "
            f"none (num_nextn_predict_layers={config.num_nextn_predict_layers}, no tensors "
            f"under {first}*): set speculative_num_tokens=0"
        )


def make_runner(
    model: MoECausalLM,
    caches: list[torch.Tensor],
    block_size: int,
    device: torch.device,
    groups: ParallelGroups,
    num_spec_tokens: int,
    token_map: str | list[int] | None = None,
) -> ModelRunner:
    """The runner; with ``num_spec_tokens`` the last cache is the MTP layer's, bound on the
    rank that holds the layer (the replica leader), which then proposes the drafts, from the
    ids of ``token_map`` (a file, or the ids) only when given."""
    if not num_spec_tokens:
        return ModelRunner(model, caches, block_size, device, groups)
    mtp_layers = getattr(model, "mtp_layers", None) or []
    proposer = None
    if mtp_layers:
        mtp_layers[0].block.self_attn.kv_cache = caches[-1]
        hot = None
        if token_map is not None:
            head_weight = mtp_layers[0].head.weight
            ids = (
                load_token_map(token_map, head_weight.shape[0])
                if isinstance(token_map, str)
                else token_map
            )
            hot = HotVocab(head_weight, ids)
        proposer = MTPProposer(mtp_layers[0], block_size, device, hot)
    elif groups.is_replica_leader:
        raise ValueError("speculative decoding needs the MTP layer, but the model loaded none")
    return ModelRunner(model, caches[:-1], block_size, device, groups, num_spec_tokens, proposer)


def set_speculation(engine, num_spec_tokens: int, token_map: str | list[int] | None = None) -> None:
    """Switch an idle one-process engine built with speculative decoding (its pool holds the
    MTP cache layer) to ``num_spec_tokens`` drafts per step (0: plain steps) from
    ``token_map``'s ids; the weights, caches and block manager stay. Raises ValueError while
    requests are in flight or on an engine without the MTP cache."""
    if not engine.config.speculative_num_tokens or engine.groups.dims.world_size > 1:
        raise ValueError("set_speculation needs a one-process engine built with speculation")
    if engine.has_unfinished_requests():
        raise ValueError("set_speculation needs an idle engine: requests are in flight")
    engine.scheduler.drafts.clear()
    engine.scheduler.config = dataclasses.replace(
        engine.scheduler.config, num_spec_tokens=num_spec_tokens
    )
    caches = engine.kv_pool.caches
    if num_spec_tokens:
        engine.runner = make_runner(
            engine.model,
            caches,
            engine.config.block_size,
            engine.device,
            engine.groups,
            num_spec_tokens,
            token_map,
        )
    else:
        engine.runner = ModelRunner(
            engine.model, caches[:-1], engine.config.block_size, engine.device, engine.groups
        )
    engine.runner.grammars = engine.grammars
