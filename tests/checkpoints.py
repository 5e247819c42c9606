"""Tiny random-weight Hugging Face checkpoints made with ``transformers`` (the parity oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512  # the demo tokenizer's vocabulary, so tests can use a real tokenizer

DEEPSEEK_KW = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    routed_scaling_factor=2.5,
    max_position_embeddings=1024,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    bos_token_id=0,
    eos_token_id=1,
)

# DEEPSEEK_KW's overrides that put every GEMM on the AMX tiles (K % 64, N % 16) and the
# absorbed MLA products on the bf16 ones: the w8a8_int8 and w4a8_int8 tests' model
DEEPSEEK_TILES = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
)

QWEN_KW = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=1,
)


def build_hf_model(kind: str, seed: int = 0, **overrides):
    """A transformers model of ``kind`` in fp32 with random weights (eval mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{**DEEPSEEK_KW, **overrides})
        model = tf.DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # non-zero correction bias so it is exercised
            for layer in model.model.layers[cfg.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**QWEN_KW, "norm_topk_prob": True, **overrides})
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**{**QWEN_KW, "shared_expert_intermediate_size": 48, **overrides})
        model = tf.Qwen2MoeForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger weights than the 0.02 init so outputs are not flat
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.mul_(3.0)
    return model.float().eval()


def save_hf_checkpoint(model, path: Path, with_tokenizer: bool = True) -> Path:
    path = Path(path)
    model.save_pretrained(path)
    if with_tokenizer:
        from tests.helpers import copy_demo_tokenizer

        copy_demo_tokenizer(path)
    return path
