"""Expert-parallel load balance in simulation: imbalance before and after EPLB placement.

Imbalance is max over mean tokens per rank of a MoE layer (1.0 = every rank equally busy).
Loads, each [MoE layers, experts] (the benchmark model: 64 experts in 8 groups, top-6):

    zipf        synthetic: per layer, expert popularity ~ 1 / rank^s over a random order,
                tokens drawn from it (``--zipf-s``, ``--tokens``)
    bench       the real routing of the benchmark model (``benchmarks/bench_model.py``) on
                a prompt set (the demo corpus cut into pieces; prefill + a few decode steps),
                captured from each MoE layer's router
    bench-hot   the same with a gate bias that makes 4 experts per layer hot (added to
                ``e_score_correction_bias`` in memory, ``--hot-bias``)
    demo        the real routing of the trained demo model (16 experts in 4 groups, top-4,
                3 MoE layers; docs/demo_model.md) on held-out paragraphs of its training
                text: the load of a router that learned something, not a random one's

For EP4 (one node of 4 ranks) and EP8 (two nodes of 4: the hierarchical form) and 0, 4 and
8 redundant experts: ``before`` is the contiguous placement without redundancy (expert e on
rank e // (experts / EP)); ``after`` is ``rebalance_experts`` on the load (an expert's tokens split
evenly over its replicas), both on the whole load. ``held-out`` places from the first half of
the load (the first half of the prompts / of the tokens drawn) and measures on the second
half (the JSON also has ``before`` on that half). For the model loads, ``step bef`` and
``step aft`` replay every forward step of the second half token by token (without EPLB /
with the held-out placement): tokens are split evenly over the ranks (DP attention),
``ReplicaTable.select`` picks each choice's slot (own node first, then round-robin), and the
per-step imbalance is averaged over steps and layers. 68 (demo: 20) slots do not divide over 8
ranks, so EP8 has no 4-redundant case.

``step`` (a source) measures, not simulates: one MoE layer at EP4 on gloo ranks of this
machine, its step time before and after a live re-placement on a skewed load
(``benchmarks/eplb_step.py``: ``--step-tokens``, ``--step-iters``, ``--step-redundant``).

    python benchmarks/eplb.py [--sources zipf,bench,bench-hot,demo,step] [--prompts 64]
                              [--out bench_out/eplb.json] [--heatmap docs/img/eplb-load.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, bench_model_path  # noqa: E402

from moeserve.distributed.ep.replica import ReplicaTable  # noqa: E402
from moeserve.eplb import (  # noqa: E402
    imbalance,
    placement_tables,
    rank_load,
    rebalance_experts,
)


@dataclass(frozen=True)
class Shape:
    """The MoE shape of a model's routing."""

    experts: int
    top_k: int
    groups: int
    moe_layers: int
    first_moe: int  # the index of the first MoE layer (the dense ones come first)

    @classmethod
    def of(cls, config: dict) -> Shape:
        first = config["first_k_dense_replace"]
        return cls(
            experts=config["n_routed_experts"],
            top_k=config["num_experts_per_tok"],
            groups=config["n_group"],
            moe_layers=config["num_hidden_layers"] - first,
            first_moe=first,
        )


BENCH = Shape.of(BENCH_CONFIG)
LAYOUTS = ((4, 1), (8, 2))  # (EP ranks, nodes)
REDUNDANT = (0, 4, 8)
CORPUS = Path(__file__).resolve().parents[1] / "moeserve" / "data" / "demo_corpus.txt"


class Routing:
    """Token-level routing of a run: for every forward step, each MoE layer's topk ids."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.steps: list[list[torch.Tensor]] = []  # [step][layer] -> [T, K]

    def load(self, steps: slice = slice(None)) -> torch.Tensor:
        """``[L, E]`` tokens per layer and expert over the chosen steps."""
        E = self.shape.experts
        out = torch.zeros(self.shape.moe_layers, E, dtype=torch.int64)
        for layers in self.steps[steps]:
            for l, ids in enumerate(layers):
                out[l] += torch.bincount(ids.flatten(), minlength=E)
        return out


def zipf_load(tokens: int, s: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent ``[L, E]`` draws of ``tokens * K`` choices from the same per-layer
    Zipf popularity (placement from one, measurement on the other)."""
    E, K = BENCH.experts, BENCH.top_k
    g = torch.Generator().manual_seed(seed)
    draws = []
    popularity = []
    for _ in range(BENCH.moe_layers):
        rank_E = torch.randperm(E, generator=g).double() + 1
        popularity.append(rank_E.pow(-s))
    for _ in range(2):
        rows = [torch.multinomial(p, tokens * K, replacement=True, generator=g) for p in popularity]
        draws.append(torch.stack([torch.bincount(r, minlength=E) for r in rows]))
    return draws[0], draws[1]


def capture_model_routing(
    model_dir: Path, shape: Shape, prompts: list[str], new_tokens: int, hot_bias: float, threads
):
    """Run the model on ``prompts`` and record every MoE router's choices."""
    from moeserve import LLM, SamplingParams
    from moeserve.layers.moe_block import MoEBlock

    E, K, MOE_LAYERS = shape.experts, shape.top_k, shape.moe_layers
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        num_threads=threads,
        max_num_seqs=len(prompts),
        progress=False,
    )
    model = llm.engine.model
    # the main model's MoE layers (an MTP layer's block is not part of a decode's routing)
    blocks = [m for n, m in model.named_modules() if isinstance(m, MoEBlock) and "mtp" not in n]
    assert len(blocks) == MOE_LAYERS, f"expected {MOE_LAYERS} MoE layers, found {len(blocks)}"
    routing = Routing(shape)
    current: list[torch.Tensor] = []

    def hook(index: int):
        def record(module, args, output):
            ids_TK = output[1]
            ids_TK = ids_TK[:, :K]  # a folded shared expert is appended as the last column
            if index == 0:
                current.clear()
            current.append(ids_TK.detach().to("cpu", torch.int64).clone())
            if index == MOE_LAYERS - 1:
                routing.steps.append(list(current))

        return record

    handles = [b.gate.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    for b in blocks:  # decode through the gate module (the prebound calls route in C, unseen)
        b.use_decode_calls(False)
    saved = [b.gate.e_score_correction_bias.detach().clone() for b in blocks]
    if hot_bias:
        g = torch.Generator().manual_seed(11)
        for b in blocks:  # 4 random hot experts per layer
            hot = torch.randperm(E, generator=g)[:4]
            b.gate.e_score_correction_bias.data[hot] += hot_bias
    try:
        t0 = time.perf_counter()
        half = len(prompts) // 2
        params = dict(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:half], SamplingParams(**params))
        split = len(routing.steps)
        llm.generate(prompts[half:], SamplingParams(**params))
        elapsed = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
        for b in blocks:
            b.use_decode_calls()  # bind again on the next step
        for b, bias in zip(blocks, saved):
            b.gate.e_score_correction_bias.data.copy_(bias)
        llm.shutdown()
    return routing, split, elapsed


def prompt_set(n: int) -> list[str]:
    """The demo corpus cut into ``n`` consecutive pieces at word boundaries: distinct texts
    that share no prefix (so the prefix cache skips nothing)."""
    words = CORPUS.read_text(encoding="utf-8").split()
    if n > len(words) // 8:
        raise ValueError(f"--prompts {n}: the corpus has {len(words)} words, too few")
    return [" ".join(words[i * len(words) // n : (i + 1) * len(words) // n]) for i in range(n)]


def demo_prompts(n: int, words: int = 40) -> list[str]:
    """The first ``words`` words of ``n`` held-out paragraphs of the demo's training text
    (``scripts/train_demo.py``'s split): text in the model's domain it never trained on."""
    from demo_model import trainer

    td = trainer()
    paragraphs, _ = td.load_text()
    out = [
        " ".join(p.split()[:words])
        for i, p in enumerate(paragraphs)
        if td.held_out(i, 0.02) and len(p.split()) >= words
    ]
    if len(out) < n:
        raise ValueError(f"--prompts {n}: {len(out)} held-out paragraphs are long enough")
    return out[:n]


def contiguous(shape: Shape) -> torch.Tensor:
    """No EPLB: expert e in slot e, so on rank e // (E / EP)."""
    return torch.arange(shape.experts).expand(shape.moe_layers, shape.experts)


def per_step_imbalance(routing: Routing, steps: slice, phy2log, log2phy, logcnt, ranks, nodes):
    """Mean over steps and layers of the per-step imbalance when every token's choices go to
    the replica ``ReplicaTable.select`` picks (tokens split evenly over the ranks)."""
    S = phy2log.shape[1] // ranks
    node_of_rank = torch.arange(ranks) // (ranks // nodes)
    layers = range(routing.shape.moe_layers)
    tables = [ReplicaTable.build(log2phy[l], logcnt[l], S, node_of_rank) for l in layers]
    values = []
    for step, layers in enumerate(routing.steps[steps]):
        for table, ids_TK in zip(tables, layers):
            T = ids_TK.shape[0]
            own_T = torch.arange(T) * ranks // T
            phys = table.select(ids_TK, own_T, offset=step)
            per_rank = torch.bincount(phys.flatten() // S, minlength=ranks).double()
            values.append(float(per_rank.max() / per_rank.mean()))
    return sum(values) / len(values)


def evaluate(name: str, shape: Shape, train, test, routing=None, test_steps=None) -> list[dict]:
    """Rows for every layout and redundancy: ``before``/``after`` on the whole load,
    ``before_held_out``/``held_out`` on the test half with the placement from the train half."""
    rows = []
    full = train + test
    E, GROUPS = shape.experts, shape.groups
    for ranks, nodes in LAYOUTS:
        before = imbalance(rank_load(full, contiguous(shape), ranks))
        before_test = imbalance(rank_load(test, contiguous(shape), ranks))
        before_step = None
        if routing is not None:
            cont = (contiguous(shape), *placement_tables(contiguous(shape), E))
            before_step = per_step_imbalance(routing, test_steps, *cont, ranks, nodes)
        for extra in REDUNDANT:
            P = E + extra
            row = dict(source=name, ep=ranks, nodes=nodes, redundant=extra)
            row.update(before_mean=float(before.mean()), before_max=float(before.max()))
            row.update(
                before_held_out_mean=float(before_test.mean()),
                before_held_out_max=float(before_test.max()),
            )
            if P % ranks:
                row["skipped"] = f"{P} slots do not divide over {ranks} ranks"
                rows.append(row)
                continue
            phy2log, _, _ = rebalance_experts(full, P, GROUPS, nodes, ranks)
            after = imbalance(rank_load(full, phy2log, ranks))
            held = rebalance_experts(train, P, GROUPS, nodes, ranks)
            held_out = imbalance(rank_load(test, held[0], ranks))
            row.update(
                algorithm="hierarchical" if nodes > 1 else "global (1 node)",
                after_mean=float(after.mean()),
                after_max=float(after.max()),
                held_out_mean=float(held_out.mean()),
                held_out_max=float(held_out.max()),
            )
            if routing is not None:
                row["step_before"] = before_step
                row["step_after"] = per_step_imbalance(routing, test_steps, *held, ranks, nodes)
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ("source", "EP", "nodes", "redund", "before", "after", "held-out", "step bef")
    cols += ("step aft",)
    print("imbalance = max / mean tokens per rank; before/after/held-out: mean/max over layers")
    print(f"{cols[0]:<11}" + "".join(f"{c:>10}" for c in cols[1:]))
    for r in rows:
        head = f"{r['source']:<11}{r['ep']:>10}{r['nodes']:>10}{r['redundant']:>10}"
        before = f"{r['before_mean']:.2f}/{r['before_max']:.2f}"
        if "skipped" in r:
            print(head + f"{before:>10}   ({r['skipped']})")
            continue
        cells = [
            before,
            f"{r['after_mean']:.2f}/{r['after_max']:.2f}",
            f"{r['held_out_mean']:.2f}/{r['held_out_max']:.2f}",
            f"{r['step_before']:.2f}" if "step_before" in r else "-",
            f"{r['step_after']:.2f}" if "step_after" in r else "-",
        ]
        print(head + "".join(f"{c:>10}" for c in cells))


def heatmap(path: Path, loads: dict[str, tuple[Shape, torch.Tensor]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(loads), 1, figsize=(10, 1.6 + 1.7 * len(loads)), squeeze=False)
    for ax, (name, (shape, load)) in zip(axes[:, 0], loads.items()):
        rel = load.double() / load.double().mean(dim=1, keepdim=True).clamp_min(1e-9)
        im = ax.imshow(rel.numpy(), aspect="auto", cmap="magma", vmin=0)
        ax.set_title(f"{name}: tokens per expert / layer mean", fontsize=9)
        ax.set_ylabel("layer")
        first = shape.first_moe  # the dense layers have no experts
        ax.set_yticks(range(load.shape[0]), [str(first + i) for i in range(load.shape[0])])
        ax.tick_params(axis="y", labelsize=6)
        per_group = shape.experts // shape.groups
        ax.set_xticks(range(0, shape.experts, per_group))
        ax.set_xlabel(f"logical expert ({shape.groups} groups of {per_group})", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default="zipf,bench,bench-hot,step")
    ap.add_argument("--step-ep", type=int, default=4)
    ap.add_argument("--step-tokens", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--step-iters", type=int, default=10)
    ap.add_argument("--step-redundant", type=int, default=4)
    ap.add_argument("--step-hot-bias", type=float, default=1.0)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=8192, help="zipf: tokens in each half")
    ap.add_argument("--prompts", type=int, default=64, help="model: prompts (two halves)")
    ap.add_argument("--new-tokens", type=int, default=16, help="model: decode tokens each")
    ap.add_argument("--hot-bias", type=float, default=0.5, help="bench-hot: added gate bias")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/eplb.json")
    ap.add_argument("--heatmap", default="docs/img/eplb-load.png")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sources = args.sources.split(",")

    rows: list[dict] = []
    loads: dict[str, tuple[Shape, torch.Tensor]] = {}
    notes: dict[str, dict] = {}
    if "zipf" in sources:
        train, test = zipf_load(args.tokens, args.zipf_s, args.seed)
        name = f"zipf s={args.zipf_s:g}"
        rows += evaluate("zipf", BENCH, train, test)
        loads[name] = (BENCH, train + test)
        notes["zipf"] = dict(s=args.zipf_s, tokens_per_half=args.tokens)
    for src in ("bench", "bench-hot", "demo"):
        if src not in sources:
            continue
        hot = args.hot_bias if src == "bench-hot" else 0.0
        if src == "demo":
            from moeserve.demo import demo_model_path

            model_dir = demo_model_path()
            shape = Shape.of(json.loads((model_dir / "config.json").read_text()))
            prompts = demo_prompts(args.prompts)
        else:
            model_dir, shape, prompts = bench_model_path(), BENCH, prompt_set(args.prompts)
        routing, split, secs = capture_model_routing(
            model_dir, shape, prompts, args.new_tokens, hot, args.threads
        )
        train, test = routing.load(slice(0, split)), routing.load(slice(split, None))
        tokens = [int(layers[0].shape[0]) for layers in routing.steps]
        rel = (train + test).double()
        rel = rel / rel.mean(dim=1, keepdim=True)  # each expert's load over its layer's mean
        per_layer = [
            dict(layer=shape.first_moe + l, max=float(r.max()), min=float(r.min()))
            for l, r in enumerate(rel)
        ]
        notes[src] = dict(
            steps=len(tokens), tokens=sum(tokens), seconds=round(secs, 1), hot_bias=hot,
            expert_load=per_layer, shape=asdict(shape),
        )  # fmt: skip
        print(f"{src}: {len(tokens)} forward steps, {sum(tokens)} tokens, {secs:.0f} s")
        loads_text = ", ".join(f"{r['layer']}: {r['min']:.2f}-{r['max']:.2f}" for r in per_layer)
        print(f"  expert load / layer mean, min-max, per layer: {loads_text}")
        rows += evaluate(src, shape, train, test, routing, slice(split, None))
        label = "trained demo model" if src == "demo" else "benchmark model"
        label += f", hot gate bias +{hot:g}" if hot else ""
        loads[f"{label} ({sum(tokens)} tokens)"] = (shape, train + test)

    print()
    print_table(rows)
    step_rows = []
    if "step" in sources:
        import eplb_step

        step_rows = eplb_step.measure(
            args.step_ep,
            args.step_tokens,
            args.step_iters,
            args.step_redundant,
            args.step_hot_bias,
        )
        print()
        eplb_step.print_rows(step_rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the benchmark model's shape (zipf's too); a model source's own is in its notes
    record = dict(
        rows=rows, sources=notes, experts=BENCH.experts, groups=BENCH.groups,
        moe_layers=BENCH.moe_layers,
    )  # fmt: skip
    record.update(step_time=step_rows, command=" ".join(sys.argv))
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    if args.heatmap and loads:
        heatmap(Path(args.heatmap), loads)


if __name__ == "__main__":
    main()
