"""The benchmark model every CPU benchmark uses, so figures stay comparable across issues.

DeepSeek-V3 architecture, 1.23B total / ~230M active parameters, random bf16 weights:
vocab 32000, hidden 1024, 12 layers (layer 0 dense, intermediate 2816), 16 heads, q_lora 384,
kv_lora 256, rope 32, nope 64, v 64, 64 routed experts top-6 in 8 groups / top-4 groups,
expert FFN 512, 1 shared expert.

Its tokenizer (for the server) is the demo's byte-level BPE grown to 32000 tokens with
synthetic in-word merges, so every id the model can emit decodes to text; the chat template
and special tokens are the demo's. It is added to an existing checkpoint without touching the
weights.

    python benchmarks/bench_model.py [PATH]     # default: $MOESERVE_CACHE/bench-deepseek-1.2b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from moeserve.demo import GENERATION_CONFIG, TOKENIZER_CONFIG, TOKENIZER_PATH
from moeserve.models.synthetic import write_random_deepseek
from moeserve.platform import default_cache_dir

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


PROMPT_LEN = 32  # the decode benchmarks' prompt length


def bench_prompts(seed: int, n: int, vocab: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """The decode benchmarks' random prompts: ``n`` of ``length`` ids in ``[2, vocab)`` drawn
    from seed ``seed``. ``offline_throughput.py`` decodes batch ``b`` from seed ``b`` (plus its
    ``--prompt-seed-offset``), and ``fit_mtp.py`` fits the MTP layer on those same prompts."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def write_bench_tokenizer(out: Path, vocab_size: int = BENCH_CONFIG["vocab_size"]) -> None:
    """tokenizer.json (+ config files) with exactly ``vocab_size`` tokens; deterministic."""
    tok = json.loads(TOKENIZER_PATH.read_text(encoding="utf-8"))
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    merged = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 260]
    # word-internal merges only (the right part never starts a word), in a fixed order; the
    # demo tokenizer is small (Python's documentation), so the merges made in one pass are
    # the left parts of the next until the vocabulary is full
    rights, lefts = [t for t in merged if not t.startswith("\u0120")], merged
    while lefts and len(vocab) < vocab_size:
        made = []
        for right in rights:
            for left in lefts:
                if len(vocab) == vocab_size:
                    break
                if left + right not in vocab:
                    vocab[left + right] = len(vocab)
                    merges.append([left, right])
                    made.append(left + right)
        lefts = made
    if len(vocab) != vocab_size:
        raise RuntimeError(f"bench tokenizer reached {len(vocab)} tokens, want {vocab_size}")
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    config = {**TOKENIZER_CONFIG, "model_max_length": BENCH_CONFIG["max_position_embeddings"]}
    for name, obj in (
        ("tokenizer_config.json", config),
        ("generation_config.json", GENERATION_CONFIG),
    ):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


def bench_model_path(path: str | None = None) -> Path:
    """Create the benchmark checkpoint once (atomically) and return its directory."""
    target = Path(path) if path else Path(default_cache_dir()) / NAME
    if (target / "model.safetensors.index.json").is_file():
        if not (target / "tokenizer.json").is_file():
            write_bench_tokenizer(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-", dir=target.parent))
    try:
        write_random_deepseek(tmp, BENCH_CONFIG, seed=1234, dtype="bfloat16")
        write_bench_tokenizer(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?")
    print(bench_model_path(ap.parse_args().path))
