"""Fit an MTP layer to the benchmark model by self-distillation, so MTP drafts have something
to predict (random weights give the draft nothing).

1. moeserve generates greedy continuations of random prompts with the benchmark model;
2. one prefill forward per sequence gives the final hidden states ``h_i`` and the model's own
   greedy next token at every position;
3. only the MTP layer is trained (``enorm``, ``hnorm``, ``eh_proj``, one decoder block: MLA +
   MoE, ``shared_head.norm``), to predict from ``(h_i, t_{i+1})`` the model's greedy token at
   ``i + 1``; the embedding and the head are the main model's, frozen. The block is
   transformers' ``DeepseekV3DecoderLayer`` (differentiable, the same maths as moeserve's, see
   tests/unit/spec/test_mtp_parity.py), started from the main model's last layer;
4. the result is a checkpoint directory next to the benchmark model: its shards linked, the
   MTP tensors in ``mtp.safetensors`` under DeepSeek's names (``model.layers.{N}.*``), and
   ``num_nextn_predict_layers: 1`` in its config.

A random model's next-next token is not learnable from one layer: what a layer fitted on a
few thousand positions learns is those positions. By default it is fitted on exactly the
prompts ``offline_throughput.py`` decodes, so the benchmark measures the engine at a high
accept length (an upper bound on what a trained MTP layer gives); the held-out accuracy it
prints is the honest draft quality on new prompts.

    python benchmarks/fit_mtp.py [--out DIR] [--train-seeds 1:1,8:8,32:32] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, NAME, bench_model_path  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.config import default_cache_dir  # noqa: E402
from moeserve.layers.attention_meta import AttentionMetadata  # noqa: E402

PROMPT_LEN = 32  # as benchmarks/offline_throughput.py


def bench_prompts(groups: list[tuple[int, int]]) -> list[list[int]]:
    """The random prompts offline_throughput.py decodes: ``n`` drawn from seed ``seed``, for
    each ``(seed, n)``."""
    vocab = BENCH_CONFIG["vocab_size"]
    prompts = []
    for seed, n in groups:
        g = torch.Generator().manual_seed(seed)
        prompts += [torch.randint(2, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]
    return prompts


def continuations(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]


@torch.inference_mode()
def hidden_and_targets(llm: LLM, seqs: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    """Per sequence: final hidden states [L, D] and the model's greedy token after each
    position [L] (one prefill forward in the idle engine's cache)."""
    engine = llm.engine
    model, bs = engine.model, engine.config.block_size
    out = []
    for ids in seqs:
        n = len(ids)
        meta = AttentionMetadata.build([0], [n], [list(range(-(-n // bs)))], bs)
        h = model(torch.tensor(ids), torch.arange(n), meta)
        greedy = model.compute_logits(h).argmax(-1)
        out.append((h.float().clone(), torch.tensor(ids), greedy))
    return out


class MTP(torch.nn.Module):
    """The MTP layer in transformers' modules (trainable); head and embedding frozen."""

    def __init__(self, cfg, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        D = cfg.hidden_size
        self.enorm = m.DeepseekV3RMSNorm(D, eps=cfg.rms_norm_eps)
        self.hnorm = m.DeepseekV3RMSNorm(D, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
        self.block = m.DeepseekV3DecoderLayer(cfg, cfg.num_hidden_layers)
        self.post_norm = m.DeepseekV3RMSNorm(D, eps=cfg.rms_norm_eps)
        self.rotary = m.DeepseekV3RotaryEmbedding(cfg)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("head", head, persistent=False)

    def forward(self, h_BLD: torch.Tensor, next_ids_BL: torch.Tensor) -> torch.Tensor:
        e = self.enorm(self.embed[next_ids_BL])
        x = self.eh_proj(torch.cat([e, self.hnorm(h_BLD)], dim=-1))
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        x = self.block(x, position_ids=pos, position_embeddings=self.rotary(x, pos))
        return torch.nn.functional.linear(self.post_norm(x), self.head)


def hf_config():
    import transformers as tf

    cfg = tf.DeepseekV3Config(**{k: v for k, v in BENCH_CONFIG.items() if k != "rope_scaling"})
    cfg._attn_implementation = "sdpa"
    return cfg


def init_from_last_layer(mtp: MTP, base: Path) -> None:
    """Start the block from the main model's last decoder layer; eh_proj passes h through."""
    n = BENCH_CONFIG["num_hidden_layers"]
    prefix = f"model.layers.{n - 1}."
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for name, file in index.items():
        if name.startswith(prefix):
            with safe_open(str(base / file), "pt") as f:
                state[name.removeprefix(prefix)] = f.get_tensor(name).float()
    E = BENCH_CONFIG["n_routed_experts"]
    fused = {
        "mlp.experts.gate_up_proj": torch.stack(
            [
                torch.cat(
                    [
                        state.pop(f"mlp.experts.{e}.gate_proj.weight"),
                        state.pop(f"mlp.experts.{e}.up_proj.weight"),
                    ]
                )
                for e in range(E)
            ]
        ),
        "mlp.experts.down_proj": torch.stack(
            [state.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)]
        ),
    }
    missing, unexpected = mtp.block.load_state_dict({**state, **fused}, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"layer copy: missing {missing}, unexpected {unexpected}")
    D = BENCH_CONFIG["hidden_size"]
    with torch.no_grad():
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, D:].copy_(torch.eye(D))
        mtp.eh_proj.weight[:, :D].copy_(torch.eye(D) * 0.5)


def train(mtp: MTP, data, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    losses = []
    mtp.train()
    for step in range(steps):
        idx = torch.randint(0, len(data), (batch,), generator=g).tolist()
        # rows i = 0 .. L-2: (h_i, t_{i+1}) -> the model's greedy token at i + 1
        h = torch.stack([data[i][0][:-1] for i in idx])
        nxt = torch.stack([data[i][1][1:] for i in idx])
        target = torch.stack([data[i][2][1:] for i in idx])
        logits = mtp(h, nxt)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    mtp.eval()
    return losses


@torch.no_grad()
def accuracy(mtp: MTP, data) -> float:
    """Fraction of continuation rows whose MTP argmax is the model's greedy token."""
    hit = total = 0
    for h, ids, greedy in data:
        pred = mtp(h[None, :-1], ids[None, 1:])[0].argmax(-1)
        sl = slice(PROMPT_LEN - 1, None)  # rows predicting generated tokens
        hit += int((pred[sl] == greedy[1:][sl]).sum())
        total += pred[sl].numel()
    return hit / max(total, 1)


def export(mtp: MTP, base: Path, out: Path, embed: torch.Tensor, head: torch.Tensor) -> None:
    """The checkpoint: base shards linked, mtp.safetensors, index and config updated."""
    n = BENCH_CONFIG["num_hidden_layers"]
    p = f"model.layers.{n}"
    tensors = {}
    for name, t in mtp.block.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                tensors[f"{p}.mlp.experts.{e}.gate_proj.weight"] = gate
                tensors[f"{p}.mlp.experts.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] = w
        elif "rotary" not in name:
            tensors[f"{p}.{name}"] = t
    tensors[f"{p}.enorm.weight"] = mtp.enorm.weight
    tensors[f"{p}.hnorm.weight"] = mtp.hnorm.weight
    tensors[f"{p}.eh_proj.weight"] = mtp.eh_proj.weight
    tensors[f"{p}.shared_head.norm.weight"] = mtp.post_norm.weight
    tensors[f"{p}.embed_tokens.weight"] = embed
    tensors[f"{p}.shared_head.head.weight"] = head
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.name not in ("config.json", "model.safetensors.index.json"):
            os.symlink(f.resolve(), tmp / f.name)
    keep_fp32 = ("e_score_correction_bias",)
    save_file(
        {
            k: v.detach()
            .contiguous()
            .to(torch.float32 if k.endswith(keep_fp32) else torch.bfloat16)
            for k, v in tensors.items()
        },
        str(tmp / "mtp.safetensors"),
        metadata={"format": "pt"},
    )
    index = json.loads((base / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in tensors})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((base / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help=f"default: $MOESERVE_CACHE/{NAME}-mtp")
    ap.add_argument(
        "--train-seeds",
        default="1:1,8:8,32:32",
        help="SEED:N,... prompt groups to fit on; the default is exactly the prompts "
        "offline_throughput.py decodes at batch 1, 8 and 32",
    )
    ap.add_argument("--held-out-seeds", default="1001:1,1008:8", help="prompts never fitted on")
    ap.add_argument("--new-tokens", type=int, default=32, help="as offline_throughput.py")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = bench_model_path()
    out = Path(args.out) if args.out else Path(default_cache_dir()) / f"{NAME}-mtp"
    t0 = time.perf_counter()
    llm = LLM(str(base), dtype="float32", max_num_seqs=64, progress=False, load_mtp=False)
    groups = [tuple(int(x) for x in g.split(":")) for g in args.train_seeds.split(",")]
    held = [tuple(int(x) for x in g.split(":")) for g in args.held_out_seeds.split(",")]
    train_seqs = continuations(llm, bench_prompts(groups), args.new_tokens)
    held_out = continuations(llm, bench_prompts(held), args.new_tokens)
    print(f"{len(train_seqs)} continuations in {time.perf_counter() - t0:.0f}s", flush=True)
    data = hidden_and_targets(llm, train_seqs)
    test = hidden_and_targets(llm, held_out)
    embed = llm.engine.model.embed_tokens.weight.detach().float().clone()
    head = llm.engine.model.lm_head.weight.detach().float().clone()
    del llm
    torch.manual_seed(args.seed)
    mtp = MTP(hf_config(), embed, head)
    init_from_last_layer(mtp, base)
    print(
        f"draft accuracy before: fitted prompts {accuracy(mtp, data):.3f}, held-out "
        f"{accuracy(mtp, test):.3f}",
        flush=True,
    )
    t1 = time.perf_counter()
    losses = train(mtp, data, args.steps, args.batch, args.lr, args.seed)
    print(
        f"trained {args.steps} steps in {time.perf_counter() - t1:.0f}s: loss {losses[0]:.3f} "
        f"-> {losses[-1]:.3f}; draft accuracy: fitted prompts {accuracy(mtp, data):.3f}, "
        f"held-out {accuracy(mtp, test):.3f}",
        flush=True,
    )
    export(mtp, base, out, embed, head)
    print(out)


if __name__ == "__main__":
    main()
