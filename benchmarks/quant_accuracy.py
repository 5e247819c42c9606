"""Accuracy of the weight formats (int8, w8a8_int8, int4, w4a8_int8, bf16) against fp32 on the
benchmark model.

Engines on the same checkpoint (``benchmarks/bench_model.py``) see the same random prompts:

    fp32         fp32 weights and activations: the reference
    int8         ``quantization="int8"`` (fp32 activations)
    oracle       the fp32 engine with its weights replaced in place by ``q * scale``: what the
                 int8 engine holds, so int8 against oracle isolates the kernels (~1e-6
                 expected)
    w8a8         ``quantization="w8a8_int8"``: int8's weights, each GEMM's rows rounded to int8
                 per token; against oracle it shows what the activations' rounding adds
    int4-gN      ``quantization="int4"`` with groups of N columns (32, 64, 128; symmetric, and
                 ``int4-g128a`` asymmetric); ``int4 oracle`` the fp32 engine on the weights
                 int4-g128 holds, dequantized (isolates its kernels as oracle does int8's)
    w4a8-gN      ``quantization="w4a8_int8"``: int4-gN's weights, each GEMM's rows rounded to
                 int8 per token; against int4 oracle (N 128) what the activations' rounding
                 adds
    bf16w        ``quantization="bf16"``: bf16 weights, fp32 activations (on AMX the GEMMs
                 round their input rows to bf16)
    bf16 oracle  the fp32 engine with those weights rounded to bf16 in place: bf16w against it
                 isolates what the AMX GEMMs add (the activations' rounding)
    bf16         ``dtype="bfloat16"``: bf16 weights and activations throughout; how much this
                 model moves under a perturbation of that order (its random weights make it
                 chaotic: routing flips between near-tied experts)

Against fp32, for each: prompt log-probabilities (for every position after the first, the
log-probability of the prompt's token; mean and max absolute difference, and how often the
most likely token agrees) and greedy continuations (how many prompts continue identically,
where the others first diverge). Prints a table and writes JSON (``--out``).

``--outliers`` runs it all on a copy of the checkpoint whose quantized weights look like a
trained model's rather than Gaussian noise (``outlier_copy``): heavy-tailed values (Student's t
with 4 degrees of freedom, rescaled to each tensor's standard deviation) and 1% of the input
channels of every weight scaled by 8, the salient channels LLM.int8() and AWQ describe. A
per-row scale (int8) then stretches over each row's outlier channels, while a group's scale
(int4) is stretched only in the groups that hold one.

    python benchmarks/quant_accuracy.py [--prompts 8] [--prompt-len 128] [--new-tokens 32]
        [--outliers] [--int4-groups 32,64,128]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import bench_model_path  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.models.weight_format import format_targets  # noqa: E402
from moeserve.quant.int4 import dequantize_groups, quantize_groups  # noqa: E402
from moeserve.quant.int8 import quantize_rows  # noqa: E402


def evaluate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """Per prompt: [(logprob of the prompt token, most likely token)] for positions 1.., and
    the greedy continuation."""
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    greedy = llm.generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    )
    positions = []
    for prompt, out in zip(prompts, scored):
        rows = []
        for tok, pos in zip(prompt[1:], out.prompt_logprobs[1:]):
            top = next(t for t, lp in pos.items() if lp.rank == 1)
            rows.append((pos[tok].logprob, top))
        positions.append(rows)
    return {"positions": positions, "tokens": [list(o.outputs[0].token_ids) for o in greedy]}


@torch.no_grad()
def fake_quantize(llm: LLM, fmt: str = "int8") -> None:
    """Replace every weight the format converts by what it holds, in fp32, in place: int8's
    ``q * scale``, int4's groups of 128 dequantized, or the weight rounded to bf16."""
    model = llm.engine.model
    for module, name in list(format_targets(model)):
        p = getattr(module, name)
        if fmt == "int8":
            q, scale = quantize_rows(p.data)
            p.data.copy_(q.float() * scale.unsqueeze(-1))
        elif fmt == "int4":
            p.data.copy_(dequantize_groups(*quantize_groups(p.data, 128)))
        else:
            p.data.copy_(p.data.bfloat16().float())
    model.process_weights_after_loading()  # MLA's absorbed weights from the new kv_b_proj


def outlier_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """A copy of checkpoint ``src`` whose quantized weights (every 2-D weight but embeddings
    and routers) are heavy-tailed with outlier input channels (the module's doc)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (dst / "config.json").is_file():
        return dst
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    t_dist = torch.distributions.StudentT(4.0)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if t.dim() != 2 or "embed_tokens" in name or name.endswith("mlp.gate.weight"):
                continue
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
            heavy = t_dist.sample(t.shape)
            w = heavy * (t.float().std() / heavy.std())
            channels = torch.randperm(t.shape[1], generator=g)[: max(1, t.shape[1] // 100)]
            w[:, channels] *= 8
            tensors[name] = w.to(t.dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


@torch.no_grad()
def weight_errors(model_dir: Path, int4_groups: list[int], seed: int = 0) -> dict[str, dict]:
    """Per format, over every weight the formats convert: the relative RMS error of the
    weight as held (``|W_q - W| / |W|``) and of a projection of Gaussian rows
    (``|x W_q^T - x W^T| / |x W^T|``), averaged over the tensors. Unlike the end-to-end
    figures this does not saturate on a chaotic random model."""
    from safetensors.torch import load_file

    def int8(w):
        q, s = quantize_rows(w)
        return q.float() * s.unsqueeze(-1)

    held = {"int8": int8}
    for G in int4_groups:
        held[f"int4-g{G}"] = lambda w, G=G: dequantize_groups(*quantize_groups(w, G))
        held[f"int4-g{G}a"] = lambda w, G=G: dequantize_groups(*quantize_groups(w, G, False))
    sums = {k: [0.0, 0.0] for k in held}
    n = 0
    g = torch.Generator().manual_seed(seed)
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            if t.dim() != 2 or "embed_tokens" in name or name.endswith("mlp.gate.weight"):
                continue
            w = t.float()
            x = torch.randn(16, w.shape[1], generator=g)
            y = x @ w.t()
            for k, fn in held.items():
                wq = fn(w)
                sums[k][0] += float((wq - w).norm() / w.norm())
                sums[k][1] += float((x @ wq.t() - y).norm() / y.norm())
            n += 1
    return {k: {"weight_rel_err": a / n, "output_rel_err": b / n} for k, (a, b) in sums.items()}


def compare(ref: dict, got: dict) -> dict:
    pairs = [(a, b) for pa, pb in zip(ref["positions"], got["positions"]) for a, b in zip(pa, pb)]
    diffs = [abs(a[0] - b[0]) for a, b in pairs]
    div = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        for a, b in zip(ref["tokens"], got["tokens"])
    ]
    return {
        "mean_abs_logprob_diff": statistics.fmean(diffs),
        "max_abs_logprob_diff": max(diffs),
        "argmax_agreement": sum(a[1] == b[1] for a, b in pairs) / len(pairs),
        "greedy_identical": sum(d is None for d in div),
        "greedy_first_divergence": div,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the benchmark model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 runs")
    ap.add_argument("--int4-groups", default="32,64,128", help="int4 group sizes to run")
    ap.add_argument(
        "--outliers", action="store_true", help="on a copy with outlier weights (module doc)"
    )
    ap.add_argument("--out", default="quant_accuracy.json")
    args = ap.parse_args()
    model = args.model or str(bench_model_path())
    if args.outliers:
        model = str(
            outlier_copy(Path(model), Path(model).parent / (Path(model).name + "-outliers"))
        )
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    engine = dict(
        model=model,
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=args.prompts,
        kv_cache_memory_gb=0.5,
        enable_prefix_caching=False,  # the oracle must not reuse the fp32 run's cached KV
        num_threads=args.threads,
        progress=False,
    )
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    llm = LLM(dtype="float32", **engine)
    runs["fp32"] = evaluate(llm, prompts, args.new_tokens)
    fake_quantize(llm)
    runs["oracle"] = evaluate(llm, prompts, args.new_tokens)
    del llm
    gc.collect()
    runs["int8"] = evaluate(
        LLM(dtype="float32", quantization="int8", **engine), prompts, args.new_tokens
    )
    gc.collect()
    runs["w8a8"] = evaluate(
        LLM(dtype="float32", quantization="w8a8_int8", **engine), prompts, args.new_tokens
    )
    gc.collect()
    groups = [int(x) for x in args.int4_groups.split(",") if x]
    for G in groups:
        kw = dict(quantization="int4", int4_group_size=G)
        runs[f"int4-g{G}"] = evaluate(
            LLM(dtype="float32", **kw, **engine), prompts, args.new_tokens
        )
        gc.collect()
    for G in groups:
        kw = dict(quantization="w4a8_int8", int4_group_size=G)
        runs[f"w4a8-g{G}"] = evaluate(
            LLM(dtype="float32", **kw, **engine), prompts, args.new_tokens
        )
        gc.collect()
    if 128 in groups:
        kw = dict(quantization="int4", int4_group_size=128, int4_symmetric=False)
        runs["int4-g128a"] = evaluate(
            LLM(dtype="float32", **kw, **engine), prompts, args.new_tokens
        )
        gc.collect()
        llm = LLM(dtype="float32", **engine)
        fake_quantize(llm, "int4")
        runs["int4 oracle"] = evaluate(llm, prompts, args.new_tokens)
        del llm
        gc.collect()
    if not args.no_bf16:
        runs["bf16w"] = evaluate(
            LLM(dtype="float32", quantization="bf16", **engine), prompts, args.new_tokens
        )
        gc.collect()
        llm = LLM(dtype="float32", **engine)
        fake_quantize(llm, "bf16")
        runs["bf16 oracle"] = evaluate(llm, prompts, args.new_tokens)
        del llm
        gc.collect()
        runs["bf16"] = evaluate(LLM(dtype="bfloat16", **engine), prompts, args.new_tokens)
    cases = {
        "int8 vs fp32": compare(runs["fp32"], runs["int8"]),
        "int8 vs oracle": compare(runs["oracle"], runs["int8"]),
        "w8a8 vs fp32": compare(runs["fp32"], runs["w8a8"]),
        "w8a8 vs oracle": compare(runs["oracle"], runs["w8a8"]),
    }
    for name in [n for n in runs if n.startswith(("int4-", "w4a8-"))]:
        cases[f"{name} vs fp32"] = compare(runs["fp32"], runs[name])
    if "int4 oracle" in runs:
        cases["int4-g128 vs int4 oracle"] = compare(runs["int4 oracle"], runs["int4-g128"])
        cases["w4a8-g128 vs int4 oracle"] = compare(runs["int4 oracle"], runs["w4a8-g128"])
    if "bf16" in runs:
        cases["bf16w vs fp32"] = compare(runs["fp32"], runs["bf16w"])
        cases["bf16w vs bf16 oracle"] = compare(runs["bf16 oracle"], runs["bf16w"])
        cases["bf16 vs fp32"] = compare(runs["fp32"], runs["bf16"])
    ref_lp = [a[0] for p in runs["fp32"]["positions"] for a in p]
    result = {
        "model": model,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "positions": len(ref_lp),
        "mean_fp32_prompt_logprob": statistics.fmean(ref_lp),
        "cases": cases,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    n = args.prompts
    print(f"{model}: {n} random prompts of {args.prompt_len} tokens, {len(ref_lp)} positions")
    print(f"mean fp32 prompt logprob {result['mean_fp32_prompt_logprob']:.3f}")
    print(
        "| case | mean abs dlogprob | max abs dlogprob | argmax agrees "
        f"| identical greedy ({args.new_tokens} tok) | first divergence |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, c in cases.items():
        div = ", ".join("-" if d is None else str(d) for d in c["greedy_first_divergence"])
        print(
            f"| {name} | {c['mean_abs_logprob_diff']:.2e} | {c['max_abs_logprob_diff']:.2e} "
            f"| {100 * c['argmax_agreement']:.1f}% | {c['greedy_identical']}/{n} | {div} |"
        )
    if (
        "bf16 oracle" in runs
        and compare(runs["fp32"], runs["bf16 oracle"])["max_abs_logprob_diff"] == 0
    ):
        result["bf16_oracle_is_fp32"] = True
        print("(the bf16 oracle equals fp32: the checkpoint's weights are bf16 already, so")
        print(" bf16w differs from fp32 only by the activations rounded inside its GEMMs)")
    errors = weight_errors(Path(model), groups)
    result["weight_errors"] = errors
    print("\nper weight, averaged over the converted tensors (relative RMS errors):")
    print("| format | weight | output of Gaussian rows |")
    print("|---|---:|---:|")
    for name, e in errors.items():
        print(f"| {name} | {e['weight_rel_err']:.2e} | {e['output_rel_err']:.2e} |")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
