"""Wiring speculative decoding into an engine: the checkpoint check, the MTP layer's cache and
the model runner with its proposer."""

from __future__ import annotations

import torch

from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.model_runner import ModelRunner
from moeserve.models.base import MoECausalLM
from moeserve.models.hf_config import ModelConfig
from moeserve.models.loader import checkpoint_tensor_names
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
) -> ModelRunner:
    """The runner; with ``num_spec_tokens`` the last cache is the MTP layer's, bound on the
    rank that holds the layer (the replica leader), which then proposes the drafts."""
    if not num_spec_tokens:
        return ModelRunner(model, caches, block_size, device, groups)
    mtp_layers = getattr(model, "mtp_layers", None) or []
    proposer = None
    if mtp_layers:
        mtp_layers[0].block.self_attn.kv_cache = caches[-1]
        proposer = MTPProposer(mtp_layers[0], block_size, device)
    elif groups.is_replica_leader:
        raise ValueError("speculative decoding needs the MTP layer, but the model loaded none")
    return ModelRunner(model, caches[:-1], block_size, device, groups, num_spec_tokens, proposer)
