"""The model as the planner sees it: shapes that decide FLOPs and bytes, from a HF config.json.

Read once at the edge (DeepSeek-V3 with MLA, Qwen3-MoE and Qwen2-MoE with GQA); nothing here
imports torch or the engine. ``load_model_spec`` takes a config.json, a Hugging Face model
directory, or a built-in name (``deepseek-v3``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b``: the
published configs, shipped under ``planner/models/``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).resolve().parent / "models"


class ModelSpecError(ValueError):
    """A config the planner cannot read or does not model."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # "deepseek_v3" | "qwen3_moe" | "qwen2_moe"
    vocab: int
    hidden: int  # D
    num_layers: int
    num_dense_layers: int  # layers whose MLP is dense (DeepSeek's first_k_dense_replace)
    dense_intermediate: int  # I of a dense MLP
    moe_intermediate: int  # F of one routed expert
    num_experts: int  # E routed
    top_k: int  # K
    shared_intermediate: int  # F of the shared expert(s) together; 0: none
    num_heads: int  # H
    num_kv_heads: int  # GQA
    head_dim: int  # GQA
    q_lora_rank: int  # MLA; 0: q_proj is one D x H*(nope+rope) matrix
    kv_lora_rank: int  # MLA; 0: GQA
    qk_rope_dim: int
    qk_nope_dim: int
    v_head_dim: int
    num_mtp_layers: int  # DeepSeek's next-token-prediction modules
    tie_embeddings: bool
    checkpoint_weight_bytes: float  # 1 for FP8 checkpoints, 2 for bf16

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "num_layers", "num_heads", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ModelSpecError(f"{self.name}: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ModelSpecError(f"{self.name}: num_dense_layers out of range")
        if self.top_k > self.num_experts:
            raise ModelSpecError(f"{self.name}: top_k {self.top_k} > experts {self.num_experts}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim if self.is_mla else self.head_dim

    def kv_elems_per_token_layer(self, tp: int = 1) -> int:
        """Cache entries per token per layer on one TP rank: MLA keeps the latent (replicated
        over TP); GQA keeps K and V of its KV heads (a head is never split: at least one)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim

    def attention_params(self) -> int:
        """Weights of one attention block (projections only)."""
        D, H = self.hidden, self.num_heads
        if self.is_mla:
            q = (
                D * self.q_lora_rank + self.q_lora_rank * H * self.qk_head_dim
                if self.q_lora_rank
                else D * H * self.qk_head_dim
            )
            kv = D * (self.kv_lora_rank + self.qk_rope_dim)
            kv += self.kv_lora_rank * H * (self.qk_nope_dim + self.v_head_dim)
            return q + kv + H * self.v_head_dim * D
        hd = self.head_dim
        return D * (H + 2 * self.num_kv_heads) * hd + H * hd * D

    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def total_params(self) -> int:
        """Weights of the main model (not the MTP layers)."""
        D = self.hidden
        per_dense = self.attention_params() + 3 * D * self.dense_intermediate
        per_moe = (
            self.attention_params()
            + self.num_experts * self.expert_params()
            + 3 * D * self.shared_intermediate
            + D * self.num_experts
        )
        emb = self.vocab * D * (1 if self.tie_embeddings else 2)
        return self.num_dense_layers * per_dense + self.num_moe_layers * per_moe + emb

    def active_params(self) -> int:
        D = self.hidden
        per_moe = (
            self.attention_params()
            + self.top_k * self.expert_params()
            + 3 * D * self.shared_intermediate
            + D * self.num_experts
        )
        per_dense = self.attention_params() + 3 * D * self.dense_intermediate
        return (
            self.num_dense_layers * per_dense
            + self.num_moe_layers * per_moe
            + self.vocab * D * (1 if self.tie_embeddings else 2)
        )


def spec_from_config(raw: dict[str, Any], name: str = "model") -> ModelSpec:
    """One :class:`ModelSpec` from a parsed config.json."""
    if not isinstance(raw, dict):
        raise ModelSpecError(f"{name}: config.json must hold a JSON object")
    mt = str(raw.get("model_type", ""))
    archs = raw.get("architectures") or []
    arch = {"deepseek_v3": "deepseek_v3", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe"}.get(
        mt
    )
    if arch is None:
        supported = "deepseek_v3, qwen3_moe, qwen2_moe"
        raise ModelSpecError(
            f"{name}: model_type {mt!r} ({archs}) is not modelled; supported: {supported}"
        )

    def req(key: str) -> int:
        if raw.get(key) is None:
            raise ModelSpecError(f"{name}: config.json lacks {key!r}")
        return int(raw[key])

    D, H, L = req("hidden_size"), req("num_attention_heads"), req("num_hidden_layers")
    quant = raw.get("quantization_config") or {}
    wbytes = 1.0 if quant.get("quant_method") == "fp8" else 2.0
    common = dict(
        name=name,
        arch=arch,
        vocab=req("vocab_size"),
        hidden=D,
        num_layers=L,
        dense_intermediate=int(raw.get("intermediate_size") or 0),
        num_heads=H,
        num_kv_heads=int(raw.get("num_key_value_heads") or H),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        checkpoint_weight_bytes=wbytes,
    )
    if arch == "deepseek_v3":
        F = req("moe_intermediate_size")
        return ModelSpec(
            **common,
            num_dense_layers=min(L, int(raw.get("first_k_dense_replace") or 0)),
            moe_intermediate=F,
            num_experts=req("n_routed_experts"),
            top_k=req("num_experts_per_tok"),
            shared_intermediate=F * int(raw.get("n_shared_experts") or 0),
            head_dim=int(raw.get("qk_nope_head_dim", 0)) + int(raw.get("qk_rope_head_dim", 0)),
            q_lora_rank=int(raw.get("q_lora_rank") or 0),
            kv_lora_rank=req("kv_lora_rank"),
            qk_rope_dim=req("qk_rope_head_dim"),
            qk_nope_dim=req("qk_nope_head_dim"),
            v_head_dim=req("v_head_dim"),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )
    step = int(raw.get("decoder_sparse_step") or 1)
    mlp_only = set(raw.get("mlp_only_layers") or ())
    dense = sum(1 for i in range(L) if i in mlp_only or (i + 1) % step != 0)
    return ModelSpec(
        **common,
        num_dense_layers=dense,
        moe_intermediate=req("moe_intermediate_size"),
        num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
        top_k=req("num_experts_per_tok"),
        shared_intermediate=int(raw.get("shared_expert_intermediate_size") or 0),
        head_dim=int(raw.get("head_dim") or D // H),
        q_lora_rank=0,
        kv_lora_rank=0,
        qk_rope_dim=0,
        qk_nope_dim=0,
        v_head_dim=0,
        num_mtp_layers=0,
    )


def builtin_models() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_model_spec(model: str | Path) -> ModelSpec:
    """From a built-in name, a config.json, or a directory holding one."""
    path = Path(model)
    if (BUILTIN_DIR / f"{model}.json").is_file() and not path.exists():
        path = BUILTIN_DIR / f"{model}.json"
    elif path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelSpecError(f"expected config.json in {model}: not found")
    elif not path.is_file():
        raise ModelSpecError(
            f"model {model!r}: not a config.json, a model directory, or a built-in name "
            f"({', '.join(builtin_models())})"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"{path}: cannot read config: {e}") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return spec_from_config(raw, name)
