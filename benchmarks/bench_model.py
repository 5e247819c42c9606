"""The benchmark model every CPU benchmark uses, so figures stay comparable across issues.

DeepSeek-V3 architecture, 1.23B total / ~230M active parameters, random bf16 weights:
vocab 32000, hidden 1024, 12 layers (layer 0 dense, intermediate 2816), 16 heads, q_lora 384,
kv_lora 256, rope 32, nope 64, v 64, 64 routed experts top-6 in 8 groups / top-4 groups,
expert FFN 512, 1 shared expert.

    python benchmarks/bench_model.py [PATH]     # default: $MOESERVE_CACHE/bench-deepseek-1.2b
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from moeserve.config import default_cache_dir
from moeserve.models.synthetic import write_random_deepseek

BENCH_CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=12,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    num_nextn_predict_layers=0,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
NAME = "bench-deepseek-1.2b-v1"


def bench_model_path(path: str | None = None) -> Path:
    """Create the benchmark checkpoint once (atomically) and return its directory."""
    target = Path(path) if path else Path(default_cache_dir()) / NAME
    if (target / "model.safetensors.index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-", dir=target.parent))
    try:
        write_random_deepseek(tmp, BENCH_CONFIG, seed=1234, dtype="bfloat16")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?")
    print(bench_model_path(ap.parse_args().path))
