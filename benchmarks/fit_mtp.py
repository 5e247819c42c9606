"""Fit an MTP layer to the benchmark model by self-distillation, so MTP drafts have something
to predict (random weights give the draft nothing).

1. moeserve generates greedy continuations of random prompts with the benchmark model;
2. one prefill forward per sequence gives the final hidden states ``h_i`` and the model's own
   greedy next token at every position;
3. only the MTP layer is trained (``enorm``, ``hnorm``, ``eh_proj``, one decoder block: MLA +
   MoE, ``shared_head.norm``), to predict from ``(h_i, t_{i+1})`` the model's greedy token at
   ``i + 1``, and (``--depth D``, default 3) the recursion ``k > 1`` drafts run: from its own
   output ``h'_i`` and ``t_{i+2}`` at position ``i + 1`` the token at ``i + 2``, and so on
   (``unroll``: the rows and the attention mask reproduce what the recursion attends to at
   inference). The embedding and the head are the main model's, frozen. The block is
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
                                 [--depth 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import (  # noqa: E402
    BENCH_CONFIG,
    NAME,
    PROMPT_LEN,
    bench_model_path,
    bench_prompts,
)

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.layers.attention_meta import AttentionMetadata  # noqa: E402
from moeserve.ops import formats  # noqa: E402
from moeserve.platform import default_cache_dir  # noqa: E402


def fit_prompts(groups: list[tuple[int, int]]) -> list[list[int]]:
    """The prompts offline_throughput.py decodes (``bench_model.bench_prompts``): ``n`` from
    seed ``seed``, for each ``(seed, n)``."""
    vocab = BENCH_CONFIG["vocab_size"]
    return [p for seed, n in groups for p in bench_prompts(seed, n, vocab)]


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

    def forward(
        self,
        h_BLD: torch.Tensor,
        next_ids_BL: torch.Tensor,
        pos_L: torch.Tensor,
        mask_LL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output hidden states (after ``shared_head.norm``, what the recursion
        feeds back); rows at positions ``pos_L``, attending as ``mask_LL`` allows (True:
        attend; None: causal)."""
        e = self.enorm(self.embed[next_ids_BL])
        x = self.eh_proj(torch.cat([e, self.hnorm(h_BLD)], dim=-1))
        pos = pos_L[None].expand(x.shape[0], -1)
        mask = None if mask_LL is None else mask_LL[None, None]
        x = self.block(
            x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos)
        )
        return self.post_norm(x)

    def logits(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x_BLD, self.head)


@dataclass(frozen=True)
class Unroll:
    """The rows of one training sequence of ``L`` tokens at recursion depth ``D``.

    Level 1 has a row per chain start ``i = 0 .. L-2``: input ``(h_i, t_{i+1})`` at position
    ``i``, target the model's greedy token at ``i + 1``. Level ``d >= 2`` has a row per chain
    start ``i`` in ``chains`` (the rows that draft generated tokens, ``i >= PROMPT_LEN - 1``):
    input (level ``d - 1``'s output of chain ``i``, ``t_{i+d}``) at position ``i + d - 1``,
    target the greedy token at ``i + d``. Rows are level 1, then level 2, ...; as in the
    engine's MTP cache, a level-``d`` row attends to the level-1 rows ``<= i`` (the cache the
    pass over kept positions wrote) and to its own chain's rows of levels ``2 .. d`` (the
    recursion's speculative slots)::

        level 1   0 1 2 ... i ... L-2      (causal)
        level 2           i+1              sees level 1 [0, i] and itself
        level 3             i+2            sees level 1 [0, i], its level-2 row and itself
    """

    L: int
    depth: int

    @property
    def chains(self) -> torch.Tensor:
        return torch.arange(PROMPT_LEN - 1, self.L - self.depth)

    def level_slice(self, d: int) -> slice:
        n1, n = self.L - 1, len(self.chains)
        return slice(0, n1) if d == 1 else slice(n1 + (d - 2) * n, n1 + (d - 1) * n)

    def positions(self) -> torch.Tensor:
        c = self.chains
        return torch.cat([torch.arange(self.L - 1)] + [c + d - 1 for d in range(2, self.depth + 1)])

    def mask(self) -> torch.Tensor:
        N = self.level_slice(self.depth).stop
        n1, c, r = self.L - 1, self.chains, torch.arange(len(self.chains))
        m = torch.zeros(N, N, dtype=torch.bool)
        m[:n1, :n1] = torch.ones(n1, n1, dtype=torch.bool).tril()
        for d in range(2, self.depth + 1):
            rows = r + self.level_slice(d).start
            m[rows, :n1] = torch.arange(n1)[None] <= c[:, None]
            for e in range(2, d + 1):
                m[rows, r + self.level_slice(e).start] = True
        return m

    def targets(self, greedy_BL: torch.Tensor) -> torch.Tensor:
        c = self.chains
        return torch.cat(
            [greedy_BL[:, 1:]] + [greedy_BL[:, c + d] for d in range(2, self.depth + 1)], dim=1
        )


def unroll(mtp: MTP, u: Unroll, h_BLD: torch.Tensor, ids_BL: torch.Tensor) -> torch.Tensor:
    """Hidden states of every row of ``u`` (the last pass with gradients): level ``d``'s
    inputs are level ``d - 1``'s outputs, from passes over levels ``1 .. d - 1`` without
    gradients (the recursion runs one level after the other; only the last pass is
    differentiated, so the inputs of the deeper levels are treated as given)."""
    c, pos, mask = u.chains, u.positions(), u.mask()
    h_in, ids_in = [h_BLD[:, :-1]], [ids_BL[:, 1:]]
    for d in range(2, u.depth + 1):
        n = u.level_slice(d - 1).stop
        with torch.no_grad():
            x = mtp(torch.cat(h_in, 1), torch.cat(ids_in, 1), pos[:n], mask[:n, :n])
        prev = x[:, c] if d == 2 else x[:, u.level_slice(d - 1)]
        h_in.append(prev)
        ids_in.append(ids_BL[:, c + d])
    return mtp(torch.cat(h_in, 1), torch.cat(ids_in, 1), pos, mask)


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


def init_from_fitted(mtp: MTP, ckpt: Path) -> None:
    """Load the MTP layer that :func:`export` wrote into ``ckpt``."""
    p = f"model.layers.{BENCH_CONFIG['num_hidden_layers']}."
    with safe_open(str(ckpt / "mtp.safetensors"), "pt") as f:
        t = {k.removeprefix(p): f.get_tensor(k).float() for k in f.keys()}
    E = BENCH_CONFIG["n_routed_experts"]
    gate_up = [
        torch.cat([t.pop(f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up")])
        for e in range(E)
    ]
    down = [t.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)]
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        t.pop(name)
    own = {n: t.pop(f"{n}.weight") for n in ("enorm", "hnorm", "eh_proj")}
    post = t.pop("shared_head.norm.weight")
    t["mlp.experts.gate_up_proj"], t["mlp.experts.down_proj"] = (
        torch.stack(gate_up),
        torch.stack(down),
    )
    missing, unexpected = mtp.block.load_state_dict(t, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"fitted layer: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for n, w in own.items():
            getattr(mtp, n).weight.copy_(w)
        mtp.post_norm.weight.copy_(post)


def train(mtp: MTP, data, steps: int, batch: int, lr: float, seed: int, depth: int):
    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    u = Unroll(len(data[0][1]), depth)
    losses = []
    mtp.train()
    for step in range(steps):
        idx = torch.randint(0, len(data), (batch,), generator=g).tolist()
        h = torch.stack([data[i][0] for i in idx])
        ids = torch.stack([data[i][1] for i in idx])
        target = u.targets(torch.stack([data[i][2] for i in idx]))
        logits = mtp.logits(unroll(mtp, u, h, ids))
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
def accuracy(mtp: MTP, data, depth: int) -> list[float]:
    """Per recursion level, the fraction of rows drafting generated tokens whose MTP argmax is
    the model's greedy token."""
    u = Unroll(len(data[0][1]), depth)
    hit, total = [0] * depth, [0] * depth
    for h, ids, greedy in data:
        pred = mtp.logits(unroll(mtp, u, h[None], ids[None]))[0].argmax(-1)
        target = u.targets(greedy[None])[0]
        for d in range(1, depth + 1):
            sl = u.level_slice(d)
            if d == 1:  # rows predicting generated tokens
                sl = slice(PROMPT_LEN - 1, sl.stop)
            hit[d - 1] += int((pred[sl] == target[sl]).sum())
            total[d - 1] += pred[sl].numel()
    return [h / max(t, 1) for h, t in zip(hit, total, strict=True)]


def fmt_acc(acc: list[float]) -> str:
    return " / ".join(f"{a:.3f}" for a in acc)


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
    ap.add_argument(
        "--depth",
        type=int,
        default=3,
        help="recursion levels fitted (k = 1 .. depth drafts per step); 1: the first draft only",
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quantization",
        default=None,
        help="int8: fit to the int8 model's continuations and hidden states (its greedy "
        "outputs differ from fp32's); default output $MOESERVE_CACHE/{NAME}-mtp-int8",
    )
    ap.add_argument(
        "--init",
        default=None,
        metavar="DIR",
        help="start from the MTP layer of a checkpoint this script wrote, not the last layer",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = bench_model_path()
    suffix = f"-{args.quantization}" if args.quantization else ""
    out = Path(args.out) if args.out else Path(default_cache_dir()) / f"{NAME}-mtp{suffix}"
    t0 = time.perf_counter()
    llm = LLM(
        str(base),
        dtype="float32",
        max_num_seqs=64,
        progress=False,
        load_mtp=False,
        quantization=args.quantization,
    )
    groups = [tuple(int(x) for x in g.split(":")) for g in args.train_seeds.split(",")]
    held = [tuple(int(x) for x in g.split(":")) for g in args.held_out_seeds.split(",")]
    train_seqs = continuations(llm, fit_prompts(groups), args.new_tokens)
    held_out = continuations(llm, fit_prompts(held), args.new_tokens)
    print(f"{len(train_seqs)} continuations in {time.perf_counter() - t0:.0f}s", flush=True)
    data = hidden_and_targets(llm, train_seqs)
    test = hidden_and_targets(llm, held_out)
    embed = llm.engine.model.embed_tokens.weight.detach().float().clone()
    w = llm.engine.model.lm_head.weight
    head = formats.of(w).dense(w, torch.float32).detach().float().clone()
    del llm
    torch.manual_seed(args.seed)
    mtp = MTP(hf_config(), embed, head)
    if args.init:
        init_from_fitted(mtp, Path(args.init))
    else:
        init_from_last_layer(mtp, base)
    print(
        f"draft accuracy per level before: fitted prompts "
        f"{fmt_acc(accuracy(mtp, data, args.depth))}, held-out "
        f"{fmt_acc(accuracy(mtp, test, args.depth))}",
        flush=True,
    )
    t1 = time.perf_counter()
    losses = train(mtp, data, args.steps, args.batch, args.lr, args.seed, args.depth)
    print(
        f"trained {args.steps} steps in {time.perf_counter() - t1:.0f}s: loss {losses[0]:.3f} "
        f"-> {losses[-1]:.3f}; draft accuracy per level: fitted prompts "
        f"{fmt_acc(accuracy(mtp, data, args.depth))}, held-out "
        f"{fmt_acc(accuracy(mtp, test, args.depth))}",
        flush=True,
    )
    export(mtp, base, out, embed, head)
    print(out)


if __name__ == "__main__":
    main()
