"""The decoder-only MoE skeleton shared by DeepSeek-V3 and Qwen-MoE.

A model sees token ids, positions and the step's :class:`AttentionMetadata`; it never sees
requests. It declares its checkpoint tensors through ``weight_specs()`` and its per-token KV
footprint through ``kv_cache_spec()``; the runner binds one cache tensor per layer.

Under a parallel layout (:class:`ParallelGroups`) each rank builds only its part: its TP shard
of every layer, its experts, and (with pipeline parallelism) only its stage's layers; the
checkpoint tensors of other ranks' parts are skipped without being read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeserve.config import MoEOptions
from moeserve.distributed.groups import Axis, ParallelGroups
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from moeserve.layers.linear import GatedMLP, copy_into
from moeserve.layers.moe_block import MoEBlock
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.decode_stack import DecodeStack
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weight_format import format_targets
from moeserve.models.weights import WeightSpec
from moeserve.ops import formats
from moeserve.ops.cpu import fp32 as fp32_kernels


@dataclass(frozen=True)
class KVCacheSpec:
    """Each layer caches ``token_shape`` numbers of ``dtype`` per token."""

    num_layers: int
    token_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        n = 1
        for s in self.token_shape:
            n *= s
        return n * self.num_layers * torch.empty(0, dtype=self.dtype).element_size()


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        attn: nn.Module,
        dtype,
        groups: ParallelGroups | None = None,
        moe_options: MoEOptions | None = None,
    ) -> None:
        super().__init__()
        groups = groups or ParallelGroups.single()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoEBlock(config, dtype, groups, moe_options)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype, groups.tp)

    def forward(
        self, positions_T: torch.Tensor, h_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h_TD = h_TD + self.self_attn(positions_T, self.input_layernorm(h_TD), meta)
        return h_TD + self.mlp(self.post_attention_layernorm(h_TD))

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        specs = {
            f"{prefix}.{n}.weight": WeightSpec(tuple(m.weight.shape), copy_into(m.weight))
            for n, m in (
                ("input_layernorm", self.input_layernorm),
                ("post_attention_layernorm", self.post_attention_layernorm),
            )
        }
        specs.update(self.self_attn.weight_specs(f"{prefix}.self_attn"))
        specs.update(self.mlp.weight_specs(f"{prefix}.mlp"))
        return specs


class MoECausalLM(nn.Module):
    """embed -> decoder layers -> final norm; ``compute_logits`` applies the LM head.

    With pipeline parallelism the stage holds layers ``[layer_start, layer_end)``; the first
    stage embeds, the last applies the norm and the head. ``forward`` of a later stage takes
    the previous stage's hidden states instead of token ids.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        groups: ParallelGroups | None = None,
        moe_options: MoEOptions | None = None,
    ) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.groups = groups = groups or ParallelGroups.single()
        D, V = config.hidden_size, config.vocab_size
        self.layer_start, self.layer_end = stage_layers(
            config.num_hidden_layers, groups.dims.pp, groups.coords.pp_rank
        )
        tp = groups.tp
        first, last = groups.is_first_stage, groups.is_last_stage
        tied = config.tie_word_embeddings
        self.embed_tokens = (
            VocabParallelEmbedding(V, D, tp, dtype) if (first or (last and tied)) else None
        )
        self.rotary = self.make_rotary(max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config, i, self.make_attention(self.rotary, tp), dtype, groups, moe_options
            )
            for i in range(self.layer_start, self.layer_end)
        )
        self.norm = RMSNorm(D, config.rms_norm_eps, dtype) if last else None
        self._stack: DecodeStack | bool | None = None  # False: switched off
        self.lm_head = (
            ParallelLMHead(V, D, tp, dtype, self.embed_tokens.weight if tied else None)
            if last
            else None
        )

    @property
    def tp(self) -> Axis:
        return self.groups.tp

    def make_rotary(self, max_positions: int) -> RotaryEmbedding:
        raise NotImplementedError

    def make_attention(self, rotary: RotaryEmbedding, tp: Axis) -> nn.Module:
        raise NotImplementedError

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Give each layer of this stage its cache tensor ``[num_slots, *token_shape]``."""
        if len(caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layer caches, got {len(caches)}")
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.kv_cache = cache

    def forward(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        meta: AttentionMetadata,
        h_TD: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, D]``: after the final norm on the last stage, else the input of
        the next stage. A later stage passes the previous stage's output as ``h_TD``."""
        if h_TD is None:
            h_TD = self.embed_tokens(input_ids_T)
        stack = self._decode_stack()
        out_TD = None if stack is None else stack(positions_T, h_TD, meta)
        if out_TD is not None:  # decodes only: the layers' calls in call chains
            h_TD = out_TD
        else:
            for layer in self.layers:
                h_TD = layer(positions_T, h_TD, meta)
        return self.norm(h_TD) if self.norm is not None else h_TD

    def use_decode_stack(self, enabled: bool = True) -> None:
        """Run decode steps through :class:`~moeserve.models.decode_stack.DecodeStack` where it
        applies (the default), or, not ``enabled``, layer by layer as modules (its
        reference)."""
        self._stack = None if enabled else False

    def _decode_stack(self) -> DecodeStack | None:
        if self._stack is None:  # built on first use: every layer a DecoderLayer
            plain = all(type(layer) is DecoderLayer for layer in self.layers)
            self._stack = DecodeStack(self.layers) if plain and len(self.layers) else False
        return self._stack or None

    def moe_blocks(self) -> list[tuple[int, MoEBlock]]:
        """``(model layer index, MoEBlock)`` of this stage's MoE layers, in layer order (the
        MTP layers are not among them)."""
        return [
            (i, layer.mlp)
            for i, layer in zip(range(self.layer_start, self.layer_end), self.layers)
            if isinstance(layer.mlp, MoEBlock)
        ]

    def expert_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by layer index, for the MoE layers whose counts
        this rank reports; summed over the ranks that report, they are the whole model's."""
        return {i: b.expert_counts_E.tolist() for i, b in self.moe_blocks() if b.reports_counts}

    def compute_logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, V]`` (collective over tp); last stage only."""
        return self.lm_head(h_ND)

    def weight_specs(self) -> dict[str, WeightSpec]:
        specs: dict[str, WeightSpec] = {}
        if self.embed_tokens is not None:
            specs.update(self.embed_tokens.weight_specs("model.embed_tokens.weight"))
        if self.norm is not None:
            specs["model.norm.weight"] = WeightSpec(
                tuple(self.norm.weight.shape), copy_into(self.norm.weight)
            )
        if self.lm_head is not None:
            specs.update(self.lm_head.weight_specs("lm_head.weight"))
        for i, layer in zip(range(self.layer_start, self.layer_end), self.layers):
            specs.update(layer.weight_specs(f"model.layers.{i}"))
        return specs

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
        if prefers_kn_layout(next(self.parameters()).device, self.dtype):
            relayout_kn(self)

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        """Tensors some checkpoints carry that no model needs, and those other ranks own:
        other stages' layers, embedding/head/norm off their stage, other ranks' experts."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        if name == "model.embed_tokens.weight":
            return self.embed_tokens is None
        if name in ("model.norm.weight", "lm_head.weight"):
            return self.norm is None
        if not name.startswith("model.layers."):
            return False
        parts = name.split(".")
        idx = int(parts[2])
        if idx >= self.config.num_hidden_layers:
            return False  # MTP layers: the subclass decides
        if not self.layer_start <= idx < self.layer_end:
            return True
        if len(parts) > 6 and parts[3] == "mlp" and parts[4] == "experts":
            mlp = self.layers[idx - self.layer_start].mlp
            if isinstance(mlp, MoEBlock) and parts[5].isdigit():
                e = int(parts[5])
                return e < self.config.num_experts and not mlp.owns_expert(e)
        return False


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: as even as possible, earlier stages take
    the remainder (the last stage also runs the LM head)."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def prefers_kn_layout(device: torch.device, dtype: torch.dtype) -> bool:
    """Without the few-row kernel (``ops/cpu``), MKL's fp32 GEMMs with few rows (decode) stream
    a ``[K, N]`` weight ~1.2-2x faster than an ``[N, K]`` one on AVX2 CPUs (measured:
    docs/benchmarks.md); the kernel and bf16 want ``[N, K]``."""
    return device.type == "cpu" and dtype == torch.float32 and not fp32_kernels.available()


@torch.no_grad()
def relayout_kn(model: nn.Module) -> None:
    """Store every projection weight whose format allows it (``WeightFormat.kn_layout_ok``:
    dense ones; int8 rows stay as their kernels stream them) as ``[K, N]`` memory behind an
    ``[N, K]`` view.

    Code keeps calling ``F.linear(x, w)`` on the same ``[N, K]`` shape; only the strides change,
    so the GEMM reads the weight row-major over N. Embedding tables (row lookups) and router
    gates are no projections and stay as they are. One parameter is copied at a time.
    """
    for module, attr in format_targets(model):
        p = getattr(module, attr)
        if isinstance(p, nn.Parameter) and formats.of(p).kn_layout_ok:
            p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)
