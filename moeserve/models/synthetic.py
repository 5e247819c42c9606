"""Random-weight DeepSeek-V3 checkpoints in the exact Hugging Face layout (names, shapes,
sharding with ``model.safetensors.index.json``), for the demo and benchmark models.

Weights are drawn tensor by tensor from a seeded generator, so the same config and seed give
the same bytes, and memory stays at one shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def deepseek_tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a DeepSeek-V3 checkpoint, MTP layers included."""
    D, V, H = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    E, F = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    F_shared = F * cfg.get("n_shared_experts", 0)
    n_layers, n_mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)

    yield "model.embed_tokens.weight", (V, D)
    for i in range(n_layers + n_mtp):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (D,)
        yield f"{p}.post_attention_layernorm.weight", (D,)
        a = f"{p}.self_attn"
        if q_lora:
            yield f"{a}.q_a_proj.weight", (q_lora, D)
            yield f"{a}.q_a_layernorm.weight", (q_lora,)
            yield f"{a}.q_b_proj.weight", (H * (nope + rope), q_lora)
        else:
            yield f"{a}.q_proj.weight", (H * (nope + rope), D)
        yield f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, D)
        yield f"{a}.kv_a_layernorm.weight", (kv_lora,)
        yield f"{a}.kv_b_proj.weight", (H * (nope + v), kv_lora)
        yield f"{a}.o_proj.weight", (D, H * v)
        m = f"{p}.mlp"
        if i < cfg.get("first_k_dense_replace", 0):
            inter = cfg["intermediate_size"]
            yield f"{m}.gate_proj.weight", (inter, D)
            yield f"{m}.up_proj.weight", (inter, D)
            yield f"{m}.down_proj.weight", (D, inter)
        else:
            yield f"{m}.gate.weight", (E, D)
            yield f"{m}.gate.e_score_correction_bias", (E,)
            for e in range(E):
                yield f"{m}.experts.{e}.gate_proj.weight", (F, D)
                yield f"{m}.experts.{e}.up_proj.weight", (F, D)
                yield f"{m}.experts.{e}.down_proj.weight", (D, F)
            if F_shared:
                yield f"{m}.shared_experts.gate_proj.weight", (F_shared, D)
                yield f"{m}.shared_experts.up_proj.weight", (F_shared, D)
                yield f"{m}.shared_experts.down_proj.weight", (D, F_shared)
        if i >= n_layers:  # MTP extras
            yield f"{p}.enorm.weight", (D,)
            yield f"{p}.hnorm.weight", (D,)
            yield f"{p}.eh_proj.weight", (D, 2 * D)
            yield f"{p}.embed_tokens.weight", (V, D)
            yield f"{p}.shared_head.norm.weight", (D,)
            yield f"{p}.shared_head.head.weight", (V, D)
    yield "model.norm.weight", (D,)
    yield "lm_head.weight", (V, D)


@dataclass(frozen=True)
class InitScales:
    """Standard deviations of the random weights; norms are ones."""

    matrix: float = 0.0  # 0 scales each matrix by fan_in ** -0.5 (activations keep their size)
    head: float | None = None  # lm_head and MTP heads; None: like any matrix
    bias: float = 0.01  # e_score_correction_bias


def random_tensor(
    name: str, shape: tuple[int, ...], g: torch.Generator, scales: InitScales
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * scales.bias
    std = scales.matrix if scales.matrix > 0 else (shape[-1] if len(shape) > 1 else 1) ** -0.5
    if scales.head is not None and name.endswith(("lm_head.weight", "shared_head.head.weight")):
        std = scales.head
    return torch.randn(shape, generator=g) * std


def write_random_deepseek(
    path: str | Path,
    config: dict,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 2 << 30,
    scales: InitScales = InitScales(),
) -> Path:
    """Write ``config.json`` and sharded safetensors with random weights into ``path``.

    Tensors are drawn in checkpoint order from one generator seeded with ``seed``: the same
    arguments give the same bytes. Tokenizer files are the caller's business.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = _DTYPES[dtype]
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    # plan the shards from the shapes first, so each shard is written as soon as it is full
    plan: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in deepseek_tensor_shapes(config):
        nbytes = itemsize * int(torch.Size(shape).numel())
        if size and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, shape))
        size += nbytes
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(plan):
        fname = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        shard = {}
        for name, shape in names:
            t = random_tensor(name, shape, g, scales)
            keep_fp32 = name.endswith("e_score_correction_bias")
            shard[name] = t.to(torch.float32 if keep_fp32 else torch_dtype)
            weight_map[name] = fname
            total += shard[name].numel() * shard[name].element_size()
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # safetensors writes 0600; weights are no secret
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    full = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": dtype,
        **config,
    }
    (out / "config.json").write_text(json.dumps(full, indent=2, ensure_ascii=False) + "\n")
    return out
