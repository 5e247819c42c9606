"""Hugging Face ``config.json`` -> one frozen :class:`ModelConfig`, converted once at the edge.

Both config forms are accepted: the one published checkpoints use (``rope_theta`` and
``rope_scaling`` at the top level, ``torch_dtype``) and the one transformers 5 writes
(``rope_parameters`` holding ``rope_theta`` and ``rope_type``, ``dtype``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeserve.models.registry import supported_architectures


class ConfigError(ValueError):
    """A config.json that is missing, unreadable or describes something we cannot run."""


def resolve_architecture(architectures: list[str], source: str = "config.json") -> str:
    """The first supported entry of ``architectures``; a clear error listing what we support."""
    supported = supported_architectures()
    for arch in architectures:
        if arch in supported:
            return arch
    raise ConfigError(
        f"{source}: unsupported architecture {architectures or '(none given)'}; "
        f"supported: {', '.join(supported)}"
    )


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn" | "linear"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = False  # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...

    def __post_init__(self) -> None:
        if self.type not in ("default", "yarn", "linear"):
            raise ConfigError(
                f"unsupported rope type {self.type!r}; supported: default, yarn, linear"
            )


@dataclass(frozen=True)
class Fp8Config:
    """DeepSeek's FP8 checkpoint format: e4m3 weights with per-block ``weight_scale_inv``."""

    block_n: int = 128
    block_k: int = 128


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    rope: RopeConfig
    attention_bias: bool = False
    qk_norm: bool = False
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"  # "softmax" (Qwen) | "sigmoid" (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE gates the shared expert with a sigmoid
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MLA (DeepSeek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_nextn_predict_layers: int = 0
    # checkpoint facts
    checkpoint_dtype: str | None = None
    fp8: Fp8Config | None = None
    int4: Any = None  # an AWQ or GPTQ checkpoint: quant/int4_checkpoints.Int4CheckpointConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]"
                )
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ConfigError(
                    f"n_group={self.n_group} must divide num_experts={self.num_experts} and be "
                    f">= topk_group={self.topk_group}"
                )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (MTP layers included) has routed experts."""
        if not self.num_experts:
            return False
        if self.model_type.startswith("deepseek"):
            return layer_idx >= self.first_k_dense_replace
        return layer_idx not in self.mlp_only_layers and (
            (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ConfigError(f"model directory {model_dir} does not exist")
        if not path.is_file():
            raise ConfigError(f"expected config.json in {model_dir}: not found")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Convert a parsed ``config.json`` (``source`` names it in errors). Raises
        ConfigError for an unknown architecture, a missing required field or a feature we
        cannot run."""
        arch = resolve_architecture(raw.get("architectures") or [], source)
        common = _common_fields(raw, arch, source)
        if arch.startswith("Deepseek"):
            extra = _deepseek_fields(raw, source)
        else:
            extra = _qwen_fields(raw, arch, source)
        return cls(**common, **extra)


def _need(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return raw[key]


def _common_fields(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The fields every architecture has: sizes, norms, rope, checkpoint facts."""
    n_heads = int(_need(raw, "num_attention_heads", source))
    hidden = int(_need(raw, "hidden_size", source))
    n_kv = int(raw.get("num_key_value_heads") or n_heads)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    common: dict[str, Any] = dict(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        vocab_size=int(_need(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_need(raw, "intermediate_size", source)),
        num_hidden_layers=int(_need(raw, "num_hidden_layers", source)),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=int(raw.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        rope=_parse_rope(raw, interleave_default=arch.startswith("Deepseek"), source=source),
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        fp8=_parse_quant(raw.get("quantization_config"), source),
        int4=_parse_int4(raw.get("quantization_config"), source),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    if common["hidden_act"] != "silu":
        raise ConfigError(f"{source}: hidden_act {common['hidden_act']!r} is not supported")
    return common


def _deepseek_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3: sigmoid group-limited routing, shared experts, MLA, MTP layers."""
    n_experts = int(raw.get("n_routed_experts") or 0)
    extra: dict[str, Any] = dict(
        num_experts=n_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        scoring_func=str(raw.get("scoring_func", "sigmoid")),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(_need(raw, "kv_lora_rank", source)),
        qk_nope_head_dim=int(_need(raw, "qk_nope_head_dim", source)),
        qk_rope_head_dim=int(_need(raw, "qk_rope_head_dim", source)),
        v_head_dim=int(_need(raw, "v_head_dim", source)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    if extra["scoring_func"] != "sigmoid":
        raise ConfigError(f"{source}: scoring_func {extra['scoring_func']!r} unsupported")
    if extra["num_experts"]:
        extra["shared_expert_intermediate_size"] = (
            extra["moe_intermediate_size"] * extra["n_shared_experts"]
        )
    return extra


def _qwen_fields(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: softmax routing; Qwen2's gated shared expert and qkv bias,
    Qwen3's q/k norms."""
    is_qwen2 = arch.startswith("Qwen2")
    n_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    extra = dict(
        num_experts=n_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        scoring_func="softmax",
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if is_qwen2
        else 0,
        shared_expert_gate=is_qwen2,
        n_shared_experts=1 if is_qwen2 and raw.get("shared_expert_intermediate_size") else 0,
        attention_bias=bool(raw.get("qkv_bias", True))
        if is_qwen2
        else bool(raw.get("attention_bias", False)),
        qk_norm=not is_qwen2,
    )
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{source}: sliding-window attention is not supported")
    return extra


def _parse_rope(raw: dict[str, Any], interleave_default: bool, source: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params  # transformers 5: one dict with everything
        theta = params["rope_theta"]
    else:
        scaling = raw.get("rope_scaling") or {}
        theta = raw.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    interleave = raw.get("rope_interleave")
    kw: dict[str, Any] = dict(
        theta=float(theta),
        type=str(rope_type),
        interleave=interleave_default if interleave is None else bool(interleave),
    )
    if rope_type != "default":
        if "factor" not in scaling:
            raise ConfigError(f"{source}: rope scaling {rope_type!r} needs a 'factor'")
        kw["factor"] = float(scaling["factor"])
    if rope_type == "yarn":
        kw.update(
            original_max_position_embeddings=scaling.get("original_max_position_embeddings"),
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            mscale=scaling.get("mscale"),
            mscale_all_dim=scaling.get("mscale_all_dim"),
            attention_factor=scaling.get("attention_factor"),
            truncate=bool(scaling.get("truncate", True)),
        )
        if kw["original_max_position_embeddings"] is None:
            raise ConfigError(f"{source}: yarn rope needs 'original_max_position_embeddings'")
    return RopeConfig(**kw)


def _parse_int4(quant: dict[str, Any] | None, source: str) -> Any:
    """An AWQ or GPTQ checkpoint's ``Int4CheckpointConfig`` (None for any other); imported
    here only for a quantized checkpoint, so reading a config stays torch-free."""
    if not quant:
        return None
    from moeserve.quant.int4_checkpoints import METHODS as INT4_METHODS
    from moeserve.quant.int4_checkpoints import Int4CheckpointError, parse_int4_config

    if quant.get("quant_method") not in INT4_METHODS:
        return None
    try:
        return parse_int4_config(quant, source)
    except Int4CheckpointError as e:
        raise ConfigError(str(e)) from None


def _parse_quant(quant: dict[str, Any] | None, source: str) -> Fp8Config | None:
    if not quant:
        return None
    from moeserve.quant.int4_checkpoints import METHODS as INT4_METHODS

    method = quant.get("quant_method")
    if method in INT4_METHODS:
        return None  # _parse_int4's
    if method != "fp8":
        raise ConfigError(
            f"{source}: quantization method {method!r} is not supported (supported: fp8, "
            f"{', '.join(INT4_METHODS)})"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: fp8 format {fmt!r} is not supported (supported: e4m3)")
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ConfigError(f"{source}: weight_block_size must have two entries, got {block}")
    return Fp8Config(block_n=int(block[0]), block_k=int(block[1]))
