"""The built-in models: the trained demo every command falls back to, and a tiny random
checkpoint for tests.

**The demo** (``demo_model_path()``) is a small DeepSeek-V3 (9.1M parameters: MLA with q/kv
LoRA, a dense layer then routed and shared experts, one MTP layer) trained on Python's
documentation by ``scripts/train_demo.py`` and shipped as bf16 safetensors in
``data/demo_model`` (docs/demo_model.md). It answers in English words. ``write_demo_model``
copies it.

**The tiny random model** (``tiny_model_path()``, ``write_tiny_model``) is what tests use
where exactness and speed matter: a complete Hugging Face directory (config.json, sharded
safetensors with MTP weights, tokenizer.json, tokenizer_config.json with a DeepSeek-V3-style
chat template, generation_config.json) whose fixed-seed random weights exercise every code
path of a real checkpoint: MLA with q/kv LoRA, yarn rope, one dense layer then MoE layers with
grouped sigmoid routing, a shared expert, a score-correction bias, and an MTP layer. Same
bytes on every call; it speaks noise.

The tiny model's tokenizer is a byte-level BPE trained with ``tokenizers`` on
``data/demo_corpus.txt``, with DeepSeek-V3's tool-call and R1's thinking tokens added (512 ids
in all). The result ships as ``data/demo_tokenizer.json`` so nothing is trained at run time;
``train_demo_tokenizer()`` regenerates it (``python -m moeserve.demo``), and a test checks
that regenerating gives the shipped file byte for byte. The trained demo's tokenizer is the
same BPE retrained on its text with 2,048 ids (the same special and marker tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
CORPUS_PATH = DATA_DIR / "demo_corpus.txt"
TOKENIZER_PATH = DATA_DIR / "demo_tokenizer.json"
DEMO_DIR = DATA_DIR / "demo_model"  # the trained demo, shipped
DEMO_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
TINY_NAME = "tiny-random-v4"  # bump when the written bytes change, so caches are rebuilt

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT)  # ids 0..3, in this order
# DeepSeek-V3's tool-call tokens and R1's thinking tokens: added tokens that decode as text
# ("special": false, as in DeepSeek's tokenizer.json), the last ids of the vocabulary
MARKER_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = 512
SEED = 1234
INIT_STD = 0.1  # matrices; above the usual 0.02 so greedy output does not repeat one token
HEAD_STD = 0.5  # output heads: peaky logits, so greedy parity tests have clear argmaxes
BIAS_STD = 0.05  # e_score_correction_bias: small but large enough to change routing

# DeepSeek-V3's template with its tool calls (the format of vLLM's tool_chat_template_deepseekv3
# and of --tool-call-parser deepseek_v3) and R1's thinking switch. Each marker is one token
# of the demo tokenizer (MARKER_TOKENS), as in DeepSeek's. ``tools`` go into the
# system prompt; ``thinking=true`` (chat_template_kwargs) opens a <think> section after the
# assistant tag. A conversation of system, user and assistant turns without tools renders
# as it did before tools and thinking were added.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true, is_tool=false) %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{% else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}"
    "{% endif %}{% endif %}{% endfor %}"
    "{% if tools %}"
    "{% set ns.system_prompt = ns.system_prompt + ('\\n\\n' if ns.system_prompt else '')"
    " + '## Tools\\nYou have access to the following tools:\\n' %}"
    "{% for tool in tools %}{% set fn = tool['function'] %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n### ' + fn['name'] + '\\nDescription: '"
    " + (fn['description'] or '') + '\\n\\nParameters: ' + (fn['parameters'] or {}) | tojson"
    " + '\\n' %}{% endfor %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\nIMPORTANT: ALWAYS adhere to this exact "
    "format for tool use:\\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "tool_call_name\\n```json\\ntool_call_arguments\\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' %}"
    "{% endif %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.is_tool = false %}{% endif %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.is_tool = false %}{% endif %}"
    "{{ '<｜Assistant｜>' + (message['content'] or '') }}"
    "{% if message['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{% for call in message['tool_calls'] %}{% set args = call['function']['arguments'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call['function']['name']"
    " + '\\n```json\\n' + (args if args is string else args | tojson)"
    " + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if not ns.is_tool %}{{ '<｜tool▁outputs▁begin｜>' }}{% set ns.is_tool = true %}"
    "{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{% elif message['role'] != 'system' %}"
    "{{ raise_exception('the demo chat template supports system, user, assistant and tool "
    "roles, not ' + message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{% if thinking is defined and thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)

TINY_CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "use_cache": True,
    "torch_dtype": "float32",
}

TOKENIZER_CONFIG: dict = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "clean_up_tokenization_spaces": False,
    "model_max_length": TINY_CONFIG["max_position_embeddings"],
    "chat_template": CHAT_TEMPLATE,
}

GENERATION_CONFIG: dict = {"bos_token_id": 0, "eos_token_id": 1}


def train_bpe(lines, vocab_size: int):
    """A byte-level BPE trained with ``tokenizers`` on ``lines`` (an iterable of strings) to
    ``vocab_size`` ids: the special tokens first (ids 0..3), the marker tokens last, BOS
    added in front of every encoding. Deterministic: the same lines give the same tokenizer
    in any process. The demo's tokenizer, and the trained demo's (scripts/train_demo.py)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKER_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    # What transformers builds for add_bos_token=True, so the file alone also adds BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE has {tok.get_vocab_size()} tokens, want {vocab_size}")
    return tok


def train_demo_tokenizer(corpus_path: Path = CORPUS_PATH) -> str:
    """Train the demo byte-level BPE on ``corpus_path``; return tokenizer.json text.

    Deterministic: the same corpus gives the same string in any process.
    """
    lines = corpus_path.read_text(encoding="utf-8").splitlines(keepends=True)
    return train_bpe(lines, VOCAB_SIZE).to_str(pretty=True) + "\n"


def _dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_tokenizer(path: str | os.PathLike) -> Path:
    """Write the demo's tokenizer.json, tokenizer_config.json and generation_config.json."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TOKENIZER_PATH, out / "tokenizer.json")
    _dump_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)
    _dump_json(out / "generation_config.json", GENERATION_CONFIG)
    return out


def write_tiny_model(path: str | os.PathLike) -> Path:
    """Write the tiny random model as a Hugging Face directory at ``path`` and return it.

    Creates ``path`` if needed and overwrites the model's files in it; leaves other files
    alone. The output is byte-identical on every call (same torch version).
    """
    from moeserve.models.synthetic import InitScales, write_random_deepseek

    out = write_demo_tokenizer(path)
    scales = InitScales(matrix=INIT_STD, head=HEAD_STD, bias=BIAS_STD)
    # 2.2 MB of fp32 weights in two shards: the sharded (index) path is exercised
    write_random_deepseek(
        out, TINY_CONFIG, seed=SEED, dtype="float32", max_shard_bytes=1_200_000, scales=scales
    )
    return out


def _cache_root() -> Path:
    env = os.environ.get("MOESERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "moeserve"


def tiny_model_path() -> Path:
    """Path of the tiny random model in ``$MOESERVE_CACHE`` (default ``~/.cache/moeserve``).

    Written once into a temporary sibling directory and renamed into place, so a crash never
    leaves a half-written model and concurrent callers agree on one copy.
    """
    root = _cache_root()
    final = root / TINY_NAME
    if (final / "model.safetensors.index.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}.tmp-", dir=root))
    try:
        write_tiny_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors.index.json").is_file():
                raise  # not a lost race with another writer: a real error
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def demo_model_path() -> Path:
    """The trained demo model shipped with the package (read in place, never written)."""
    missing = [f for f in DEMO_FILES if not (DEMO_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model in {DEMO_DIR} lacks {', '.join(missing)}: the package was installed "
            "without its data files (python scripts/train_demo.py --out DIR writes the model; "
            "pass --model DIR)"
        )
    return DEMO_DIR


def write_demo_model(path: str | os.PathLike) -> Path:
    """Copy the trained demo model's files to ``path`` (created if needed) and return it."""
    src = demo_model_path()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for name in DEMO_FILES:
        shutil.copyfile(src / name, out / name)
    return out


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (used to check determinism)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


if __name__ == "__main__":  # regenerate the shipped tokenizer after editing the corpus
    TOKENIZER_PATH.write_text(train_demo_tokenizer(), encoding="utf-8")
    print(f"wrote {TOKENIZER_PATH}")
