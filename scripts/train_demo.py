"""Train the demo model: a small DeepSeek-V3 (MLA with q/kv LoRA, a dense first layer, routed
and shared experts with grouped sigmoid routing, one MTP layer) on the demo text.

What it trains, with transformers' DeepseekV3 modules (the implementation moeserve's parity
tests hold it to) and one MTP module of DeepSeek-V3's form written here (transformers has
none): ``h'_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])`` through one more decoder layer,
then the shared head's norm and the main model's LM head predict ``t_{i+2}`` (moeserve's
``MTPLayer``; ``h_i`` is the main model's hidden state after its final norm).

- Loss: next-token cross-entropy plus ``--mtp-weight`` times the MTP layer's (DeepSeek-V3:
  0.3, then 0.1).
- Auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): after every step each MoE
  layer's ``e_score_correction_bias`` moves by ``--bias-rate`` towards the experts that got
  fewer tokens than the mean (``b_e += rate * sign(mean - load_e)``); the bias only picks
  experts, the gate weights stay the sigmoid scores.
- Data (``scripts/demo_corpus.py``): the documentation's paragraphs and its question/answer
  pairs in the chat template, in one token stream; windows of ``--seq-len`` tokens at random
  offsets (seeded). A fixed 2% of the paragraphs and 5% of the pairs are held out.
- Tokenizer: the demo's byte-level BPE (``moeserve.demo.train_bpe``) retrained on the
  training paragraphs with ``--vocab`` ids (its special, tool-call and thinking tokens kept).
- AdamW with warmup and cosine decay, fp32, ``--threads`` threads; the same seed and thread
  count give the same weights on one machine.

Writes a Hugging Face directory (config, bf16 safetensors with the MTP layer, tokenizer,
``train_log.json`` with the loss curve, ``loss.png``):

    python scripts/train_demo.py --out /tmp/demo-trained [--steps 4000] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DATA = Path(__file__).resolve().parent.parent / "moeserve" / "data"

# A few million parameters: what 2 cores train in about two hours
ARCH: dict = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
}


def load_text() -> tuple[list[str], list[dict]]:
    text = lzma.decompress((DATA / "demo_text.txt.xz").read_bytes()).decode()
    qa = [
        json.loads(line)
        for line in lzma.decompress((DATA / "demo_qa.jsonl.xz").read_bytes()).decode().splitlines()
    ]
    return [p for p in text.split("\n\n") if p.strip()], qa


def held_out(i: int, share: float) -> bool:
    """A fixed pseudo-random ``share`` of the items, by index."""
    return random.Random(i * 7919 + 17).random() < share


def chat(q: str, a: str) -> str:
    """One pair as the demo chat template renders it (moeserve.demo.CHAT_TEMPLATE)."""
    from moeserve.demo import ASSISTANT, EOS, USER

    return f"{USER}{q}{ASSISTANT}{a}{EOS}"


def streams(tok, paragraphs: list[str], qa: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: each paragraph after BOS, each pair in the template
    after BOS, in a seeded order."""
    docs = [(p, held_out(i, 0.02)) for i, p in enumerate(paragraphs)]
    docs += [(chat(d["q"], d["a"]), held_out(10**6 + i, 0.05)) for i, d in enumerate(qa)]
    random.Random(0).shuffle(docs)
    train, held = [], []
    for text, out in docs:
        ids = tok.encode(text).ids  # BOS first (the post-processor)
        (held if out else train).extend(ids)
    return torch.tensor(train), torch.tensor(held)


class MTP(nn.Module):
    """DeepSeek-V3's MTP module at depth 1 around one transformers decoder layer; the
    embedding and the LM head are the main model's."""

    def __init__(self, config, layer_idx: int) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        D = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(D, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(D, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx)
        self.head_norm = DeepseekV3RMSNorm(D, eps=config.rms_norm_eps)

    def forward(self, e_next, h, position_embeddings, position_ids):
        x = self.eh_proj(torch.cat((self.enorm(e_next), self.hnorm(h)), dim=-1))
        x = self.block(x, position_embeddings=position_embeddings, position_ids=position_ids)
        return self.head_norm(x)


def build(vocab: int, seed: int, arch: dict | None = None):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moeserve.demo import TINY_CONFIG

    torch.manual_seed(seed)
    arch = {**ARCH, **(arch or {})}
    keys = set(DeepseekV3Config().to_dict()) | set(arch)
    cfg = {k: v for k, v in {**TINY_CONFIG, **arch}.items() if k in keys}
    cfg["vocab_size"] = vocab
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config).float()
    mtp = MTP(config, config.num_hidden_layers).float()
    for m in mtp.modules():  # the init transformers gives its own layers
        model._init_weights(m)
    return config, model, mtp


def losses(model, mtp, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token and MTP cross-entropy on ``batch [B, L + 2]``."""
    inputs, next1, next2 = batch[:, :-2], batch[:, 1:-1], batch[:, 2:]
    L = inputs.shape[1]
    pos = torch.arange(L).unsqueeze(0)
    h = model.model(input_ids=inputs, position_ids=pos).last_hidden_state
    logits = model.lm_head(h)
    main = F.cross_entropy(logits.flatten(0, 1), next1.flatten())
    e_next = model.model.embed_tokens(next1)
    pe = model.model.rotary_emb(h, pos)
    h2 = mtp(e_next, h, pe, pos)
    extra = F.cross_entropy(model.lm_head(h2).flatten(0, 1), next2.flatten())
    return main, extra


class Balancer:
    """Counts each MoE gate's chosen experts during a step (forward hooks) and moves its
    correction bias afterwards."""

    def __init__(self, gates: list[nn.Module], rate: float) -> None:
        self.gates, self.rate = gates, rate
        self.counts = [torch.zeros(g.num_experts) for g in gates]
        for i, g in enumerate(gates):
            g.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, out):
            self.counts[i] += torch.bincount(out[2].flatten(), minlength=module.num_experts)

        return hook

    def step(self) -> list[float]:
        """Update the biases; return each gate's max/mean load of the step."""
        imbalance = []
        with torch.no_grad():
            for g, c in zip(self.gates, self.counts, strict=True):
                g.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
                imbalance.append(float(c.max() / c.mean()))
                c.zero_()
        return imbalance


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, mtp, held: torch.Tensor, seq: int, batches: int = 16) -> tuple[float, float]:
    """Mean next-token and MTP cross-entropy on fixed held-out windows."""
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(held) - seq - 2, (batches, 8), generator=g)
    m = x = 0.0
    for row in starts:
        batch = torch.stack([held[s : s + seq + 2] for s in row.tolist()])
        a, b = losses(model, mtp, batch)
        m, x = m + float(a), x + float(b)
    return m / batches, x / batches


def bigram_loss(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """The held-out cross-entropy per token of a bigram model of the training stream, the
    baseline the trained model is measured against: add-k smoothing, k picked from 1e-3..1
    on the last 5% of the training stream (fitted on the rest), then refitted on all of it."""

    def fit(ids: torch.Tensor) -> torch.Tensor:
        pairs = ids[:-1] * vocab + ids[1:]
        return torch.bincount(pairs, minlength=vocab * vocab).view(vocab, vocab).double()

    def loss(counts: torch.Tensor, k: float, ids: torch.Tensor) -> float:
        p = (counts + k) / (counts.sum(1, keepdim=True) + k * vocab)
        return float(-p[ids[:-1], ids[1:]].log().mean())

    cut = len(train) * 95 // 100
    part = fit(train[:cut])
    k = min((1e-3, 1e-2, 0.1, 1.0), key=lambda k: loss(part, k, train[cut:]))
    return loss(fit(train), k, held)


def save(out: Path, config, model, mtp, tok, log: dict) -> None:
    """A Hugging Face directory moeserve loads, the MTP layer as layer num_hidden_layers."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    from moeserve.demo import GENERATION_CONFIG, TOKENIZER_CONFIG

    n = config.num_hidden_layers
    config.num_hidden_layers = n + 1  # write the MTP block as one more layer, then rename
    full = DeepseekV3ForCausalLM(config).float()
    state = model.state_dict()
    state.update({f"model.layers.{n}.{k}": v for k, v in mtp.block.state_dict().items()})
    full.load_state_dict(state)
    config.num_hidden_layers = n
    out.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(out, safe_serialization=True)
    # bf16, but the routers stay fp32 as DeepSeek's checkpoints keep them
    router = ("gate.weight", "e_score_correction_bias")
    tensors = {
        k: v if k.endswith(router) else v.to(torch.bfloat16)
        for k, v in load_file(out / "model.safetensors").items()
    }
    p = f"model.layers.{n}"
    tensors[f"{p}.enorm.weight"] = mtp.enorm.weight.detach().to(torch.bfloat16)
    tensors[f"{p}.hnorm.weight"] = mtp.hnorm.weight.detach().to(torch.bfloat16)
    tensors[f"{p}.eh_proj.weight"] = mtp.eh_proj.weight.detach().to(torch.bfloat16)
    tensors[f"{p}.shared_head.norm.weight"] = mtp.head_norm.weight.detach().to(torch.bfloat16)
    tensors[f"{p}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{p}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=1, dtype="bfloat16")
    cfg["torch_dtype"] = "bfloat16"  # the name before transformers 4.56
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    for name, obj in (
        ("tokenizer_config.json", TOKENIZER_CONFIG),
        ("generation_config.json", GENERATION_CONFIG),
    ):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in log["train"]]
    ax.plot(steps, [r["loss"] for r in log["train"]], label="train, next token", lw=0.8)
    ax.plot(steps, [r["mtp"] for r in log["train"]], label="train, MTP (token after next)", lw=0.8)
    ev = log["eval"]
    ax.plot([r["step"] for r in ev], [r["loss"] for r in ev], "o-", label="held out, next token")
    ax.plot([r["step"] for r in ev], [r["mtp"] for r in ev], "s-", label="held out, MTP")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--arch", type=json.loads, default={}, help="JSON: config keys over ARCH")
    ap.add_argument("--max-paragraphs", type=int, default=None, help="the first N only (tests)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    from moeserve.demo import train_bpe

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    paragraphs, qa = load_text()
    if args.max_paragraphs is not None:
        paragraphs, qa = paragraphs[: args.max_paragraphs], qa[: args.max_paragraphs // 10]
    tok = train_bpe([p for i, p in enumerate(paragraphs) if not held_out(i, 0.02)], args.vocab)
    train, held = streams(tok, paragraphs, qa)
    config, model, mtp = build(args.vocab, args.seed, args.arch)
    params = list(model.parameters()) + list(mtp.parameters())
    n_params = sum(p.numel() for p in params)
    tokens = f"{len(train) / 1e6:.2f}M train tokens, {len(held) / 1e6:.2f}M held out"
    print(f"{n_params / 1e6:.1f}M parameters; {tokens}")
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    balancer = Balancer(gates + [mtp.block.mlp.gate], args.bias_rate)
    g = torch.Generator().manual_seed(args.seed)
    log: dict = {"bigram_heldout_loss": bigram_loss(train, held, args.vocab)}
    print(f"bigram baseline, held out: {log['bigram_heldout_loss']:.3f} nats per token")
    log |= {
        "args": {k: str(v) for k, v in vars(args).items()},
        "params": n_params,
        "train": [],
        "eval": [],
    }
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(0, len(train) - args.seq_len - 2, (args.batch,), generator=g)
        batch = torch.stack([train[s : s + args.seq_len + 2] for s in starts.tolist()])
        main_loss, mtp_loss = losses(model, mtp, batch)
        opt.zero_grad(set_to_none=True)
        (main_loss + args.mtp_weight * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = balancer.step()
        row = {
            "step": step,
            "loss": main_loss.item(),
            "mtp": mtp_loss.item(),
            "imbalance": imbalance,
        }
        log["train"].append(row)
        bar.set_postfix(
            loss=f"{row['loss']:.3f}", mtp=f"{row['mtp']:.3f}", imb=f"{max(imbalance):.2f}"
        )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            ev, evm = evaluate(model, mtp, held, args.seq_len)
            model.train()
            log["eval"].append({"step": step, "loss": ev, "mtp": evm, "seconds": time.time() - t0})
            tqdm.write(
                f"step {step + 1}: held-out loss {ev:.3f} (ppl {math.exp(ev):.1f}), MTP {evm:.3f}"
            )
    log["seconds"] = time.time() - t0
    save(args.out, config, model, mtp, tok, log)
    plot(log, args.out / "loss.png")
    print(f"wrote {args.out} ({log['seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
