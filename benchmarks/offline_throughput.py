"""Offline throughput: moeserve against transformers on the benchmark model, in one run.

For each weight format (fp32; int8 weight-only quantization; int4, 4-bit weights with a scale
per group of columns (int4-gN: groups of N); w8a8_int8 and w4a8_int8, the int8 and int4
weights with each GEMM's rows quantized to int8 per token, run on AMX's int8 products; bf16
weights with fp32 activations, ``--quantization bf16``, run on AMX): decode tokens/s at
batch 1, 8, 32 and 64 and prefill tokens/s of one 512- and one 2048-token prompt;
transformers' ``generate`` and forward on the same checkpoint in fp32; the roofline of each
case (decode: bytes a step reads / the read bandwidth measured here; prefill: FLOPs / the
GEMM peak measured here, fp32 for fp32, int8 and int4, int8 for w8a8_int8 and w4a8_int8, bf16
for bf16) and
the fraction of it
reached. Prints a table, writes JSON and a plot of
tokens/s against batch size with the rooflines drawn in.

    python benchmarks/offline_throughput.py [--formats fp32,int8,int4,w8a8_int8,bf16] [--threads 2]
        [--profile DIR]
    python benchmarks/offline_throughput.py --model DIR --speculative-num-tokens K[,K...] \
        [--formats fp32,int8] [--hot-vocab N | --speculative-token-map FILE]      # MTP
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, PROMPT_LEN, bench_model_path, bench_prompts  # noqa: E402
from roofline import MachineProbe, decode_bytes_per_step, prefill_flops  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402

PROMPT_SEED_OFFSET = 0  # --prompt-seed-offset: batch b decodes the prompts of seed b + offset
_ids = itertools.count()


def time_moeserve_decode(llm: LLM, batch: int, new_tokens: int, vocab: int, repeats: int) -> float:
    """Best of ``repeats`` runs (the machine is shared and noisy)."""
    return max(_moeserve_decode_once(llm, batch, new_tokens, vocab) for _ in range(repeats))


def _moeserve_decode_once(llm: LLM, batch: int, new_tokens: int, vocab: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for b, ids in enumerate(bench_prompts(batch + PROMPT_SEED_OFFSET, batch, vocab)):
        engine.add_request(f"bench-{batch}-{b}-{next(_ids)}", ids, params)
    produced: dict[str, int] = {}
    while len(produced) < batch or min(produced.values()) < 1:  # prefill every request
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    return batch * (new_tokens - 1) / dt


def time_moeserve_prefill(llm: LLM, n: int, vocab: int, repeats: int = 3) -> float:
    g = torch.Generator().manual_seed(7)
    best = float("inf")
    for _ in range(repeats):
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()  # fresh: no prefix hits
        t0 = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))
        best = min(best, time.perf_counter() - t0)
    return n / best


def time_hf_decode(model, batch: int, new_tokens: int, vocab: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, vocab, (batch, PROMPT_LEN), generator=g).to(model.device)
    kw = dict(do_sample=False, pad_token_id=0)

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t0

    t_first = min(gen(1) for _ in range(2))
    t_all = min(gen(new_tokens) for _ in range(repeats))
    return batch * (new_tokens - 1) / max(t_all - t_first, 1e-9)


def time_hf_prefill(model, n: int, vocab: int, repeats: int = 3) -> float:
    g = torch.Generator().manual_seed(7)
    best = float("inf")
    for _ in range(repeats):
        ids = torch.randint(2, vocab, (1, n), generator=g).to(model.device)
        t0 = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        best = min(best, time.perf_counter() - t0)
    return n / best


def format_kwargs(fmt: str) -> dict:
    """``LLM`` keyword arguments of a ``--formats`` entry: fp32, int8, w8a8_int8, bf16, int4 or
    w4a8_int8 (groups of 128), int4-gN or w4a8_int8-gN (groups of N)."""
    if fmt == "fp32":
        return {}
    name, _, group = fmt.partition("-g")
    if group:
        return {"quantization": name, "int4_group_size": int(group)}
    return {"quantization": fmt}


def run_moeserve(
    args, fmt: str, model_dir: str, vocab: int, probe: MachineProbe
) -> tuple[dict[str, float], dict[str, float]]:
    """tokens/s of every case for one weight format, and the machine figure next to each
    case (read bandwidth for decode, GEMM peak for prefill; the better of before and after)."""
    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        **format_kwargs(fmt),
        device=args.device,
        max_num_seqs=max(args.batches),
        max_model_len=max(args.prefill) + 64,
        max_num_batched_tokens=max(max(args.prefill), 2048),
        num_threads=args.threads,
        progress=False,
    )
    out: dict[str, float] = {}
    machine: dict[str, float] = {}
    time_moeserve_decode(llm, 1, 4, vocab, 1)  # warm-up
    for b in args.batches:
        before = probe.bandwidth()
        out[f"decode_b{b}"] = time_moeserve_decode(llm, b, args.new_tokens, vocab, args.repeats)
        machine[f"decode_b{b}"] = max(before, probe.bandwidth())
    time_moeserve_prefill(llm, 64, vocab, repeats=1)
    peak_dtype = peak_dtype_of(args, fmt)
    for n in args.prefill:
        before = probe.gemm_peak(dtype=peak_dtype)
        out[f"prefill_{n}"] = time_moeserve_prefill(llm, n, vocab)
        machine[f"prefill_{n}"] = max(before, probe.gemm_peak(dtype=peak_dtype))
    if args.profile:
        from moeserve.profiling import profile_to

        with profile_to(Path(args.profile) / f"{fmt}-decode-b{args.profile_batch}", top=30):
            _moeserve_decode_once(llm, args.profile_batch, args.new_tokens, vocab)
        with profile_to(Path(args.profile) / f"{fmt}-prefill-{args.prefill[0]}", top=30):
            time_moeserve_prefill(llm, args.prefill[0], vocab, repeats=1)
    llm.shutdown()
    del llm
    gc.collect()
    return out, machine


def peak_dtype_of(args, fmt: str) -> torch.dtype:
    """The GEMM peak a format's prefill is held to: bf16 for bf16 weights or activations,
    int8 (AMX's int8 products) for w8a8_int8 and w4a8_int8."""
    if fmt.startswith(("w8a8_int8", "w4a8_int8")):
        return torch.int8
    return torch.bfloat16 if fmt == "bf16" or args.dtype == "bfloat16" else torch.float32


def run_transformers(args, model_dir: str, vocab: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    hf = hf.to(args.device).eval()
    out: dict[str, float] = {}
    with torch.inference_mode():
        for b in args.batches:
            out[f"decode_b{b}"] = time_hf_decode(hf, b, args.new_tokens, vocab, args.repeats)
        for n in args.prefill:
            out[f"prefill_{n}"] = time_hf_prefill(hf, n, vocab)
    del hf
    gc.collect()
    return out


def rooflines(args, fmt: str, machine: dict[str, float]) -> dict[str, float]:
    """tokens/s each case would reach at the bandwidth (decode) or GEMM peak (prefill)
    measured next to it."""
    ctx = PROMPT_LEN + args.new_tokens // 2  # mean context over the timed steps
    roof = {}
    for b in args.batches:
        weights = "bf16" if fmt == "fp32" and args.dtype != "float32" else fmt
        step_bytes = decode_bytes_per_step(BENCH_CONFIG, b, ctx, weights)
        roof[f"decode_b{b}"] = b * machine[f"decode_b{b}"] / step_bytes
    for n in args.prefill:
        roof[f"prefill_{n}"] = n * machine[f"prefill_{n}"] / prefill_flops(BENCH_CONFIG, n)
    return roof


def plot(path: Path, args, results: dict, roofs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {
        "fp32": "tab:blue",
        "int8": "tab:orange",
        "int4": "tab:purple",
        "w8a8_int8": "tab:red",
        "w4a8_int8": "tab:pink",
        "bf16": "tab:green",
        "transformers": "tab:gray",
    }
    for name, tps in results.items():
        ys = [tps[f"decode_b{b}"] for b in args.batches]
        label = f"moeserve {name}" if name != "transformers" else "transformers fp32"
        ax.plot(args.batches, ys, "o-", color=colors.get(name), label=label)
    for fmt, roof in roofs.items():
        ys = [roof[f"decode_b{b}"] for b in args.batches]
        ax.plot(args.batches, ys, "--", color=colors.get(fmt), label=f"roofline {fmt}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(args.batches, [str(b) for b in args.batches])
    ax.set_xlabel("batch (sequences decoding together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("benchmark model, CPU, decode throughput against the memory roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def hot_vocab_ids(llm: LLM, args, vocab: int) -> list[int]:
    """``--hot-vocab N``: the N most frequent ids of the model's own greedy outputs on the
    prompts this run decodes (every batch), padded with the smallest unused ids to exactly N
    (the draft head's size is what costs). A stand-in for a token-frequency map of real text:
    on these prompts it covers every token the target emits."""
    from moeserve.spec.hot_vocab import most_frequent_ids

    stream: list[int] = []
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    for b in args.batches:
        prompts = bench_prompts(b + PROMPT_SEED_OFFSET, b, vocab)
        stream += [t for o in llm.generate(prompts, params) for t in o.outputs[0].token_ids]
    hot = most_frequent_ids(stream, args.hot_vocab, vocab)
    taken = set(hot)
    hot += [t for t in range(vocab) if t not in taken][: args.hot_vocab - len(hot)]
    return hot


def run_speculative(args, model_dir: str, vocab: int) -> None:
    """``--speculative-num-tokens K[,K...]``: decode tokens/s at each batch with MTP off and
    with each K drafts per step (greedy, the same prompts), per weight format. One engine per
    format switches between the modes (``spec_setup.set_speculation``) and the modes alternate
    within every repeat, so the machine's drifting bandwidth hits them alike; best of
    ``--repeats`` each. With a token map (``--speculative-token-map`` or ``--hot-vocab``)
    every K also runs with drafts from the hot ids only."""
    from moeserve.engine.spec_setup import set_speculation

    ks = args.speculative_ks
    rows = []
    for fmt in args.formats.split(","):
        llm = LLM(
            model=model_dir,
            dtype=args.dtype,
            **format_kwargs(fmt),
            device=args.device,
            max_num_seqs=max(args.batches),
            max_model_len=PROMPT_LEN + args.new_tokens + 8,
            num_threads=args.threads,
            progress=False,
            speculative_num_tokens=max(ks),
        )
        engine = llm.engine
        vocab = engine.model_config.vocab_size  # the prompts' range (any MTP checkpoint)
        token_map = args.speculative_token_map
        if args.hot_vocab:
            set_speculation(engine, 0)
            token_map = hot_vocab_ids(llm, args, vocab)
        modes = [("off", 0, None)] + [(f"k={k}", k, None) for k in ks]
        if token_map is not None:
            n = args.hot_vocab or "map"
            modes += [(f"k={k} hot {n}", k, token_map) for k in ks]
        set_speculation(engine, 0)
        time_moeserve_decode(llm, 1, 4, vocab, 1)  # warm-up
        for b in args.batches:
            best: dict[str, float] = {}
            counts = {m[0]: dict(draft_tokens=0, accepted_tokens=0, verify_steps=0) for m in modes}
            for _ in range(args.repeats):
                for name, k, tm in modes:
                    set_speculation(engine, k, tm)
                    st0 = engine.stats()
                    tps = time_moeserve_decode(llm, b, args.new_tokens, vocab, 1)
                    st1 = engine.stats()
                    for key in counts[name]:
                        counts[name][key] += (
                            st1[f"spec_decode_num_{key}"] - st0[f"spec_decode_num_{key}"]
                        )
                    best[name] = max(best.get(name, 0.0), tps)
            for name, k, tm in modes:
                d = counts[name]
                accept = 1 + d["accepted_tokens"] / d["verify_steps"] if d["verify_steps"] else None
                rows.append(
                    dict(
                        format=fmt,
                        mode=name,
                        k=k,
                        hot_ids=len(tm) if tm is not None and not isinstance(tm, str) else tm,
                        batch=b,
                        tokens_per_s=best[name],
                        speedup=best[name] / best["off"],
                        accept_length=accept,
                        **d,
                    )
                )
        llm.shutdown()
        del llm
        gc.collect()
    print(f"\nMTP speculative decoding, {args.threads} threads, best of {args.repeats} interleaved")
    print(f"{'format':<8}{'batch':>6}  {'mode':<16}{'tok/s':>10}{'speedup':>10}{'accept len':>12}")
    for r in rows:
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(
            f"{r['format']:<8}{r['batch']:>6}  {r['mode']:<16}{r['tokens_per_s']:>10.1f}"
            f"{r['speedup']:>9.2f}x{acc:>12}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(
        threads=args.threads,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        prompt_seed_offset=args.prompt_seed_offset,
        model=model_dir,
        rows=rows,
        torch=torch.__version__,
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--formats",
        default=None,
        help="weight formats: fp32, int8, w8a8_int8, bf16, int4 and w4a8_int8 (groups of 128), "
        "int4-g32, int4-g64, w4a8_int8-g32, w4a8_int8-g64 (default: fp32, int8 and int4, and on "
        "a CPU with AMX w8a8_int8, w4a8_int8 and bf16: "
        "without AMX bf16 weights are widened per call and w8a8_int8 rounds rows in torch)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        help="compute dtype of both engines (bfloat16 on GPUs; the fp32 format's weights then "
        "use it too)",
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda (transformers runs there too)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", default="512,2048", help="prompt lengths of the prefill cases")
    ap.add_argument("--repeats", type=int, default=2, help="decode runs per case; best kept")
    ap.add_argument("--model", default=None, help="default: the benchmark model (created once)")
    ap.add_argument("--skip-hf", action="store_true", help="moeserve only")
    ap.add_argument("--profile", metavar="DIR", help="also trace one decode and one prefill")
    ap.add_argument("--profile-batch", type=int, default=1)
    ap.add_argument(
        "--speculative-num-tokens",
        default="0",
        metavar="K[,K...]",
        help="only compare decode with MTP off and with K drafts per step (needs a model with "
        "an MTP layer: benchmarks/fit_mtp.py); batches default to 1,8,32, formats to fp32",
    )
    ap.add_argument(
        "--speculative-token-map",
        default=None,
        metavar="FILE",
        help="with --speculative-num-tokens: also draft from these hot ids only",
    )
    ap.add_argument(
        "--hot-vocab",
        type=int,
        default=0,
        metavar="N",
        help="with --speculative-num-tokens: also draft from the N most frequent ids of the "
        "model's greedy outputs on these prompts",
    )
    ap.add_argument(
        "--prompt-seed-offset",
        type=int,
        default=0,
        help="decode other random prompts (e.g. ones an MTP layer was not fitted on)",
    )
    ap.add_argument("--out", default="bench_out/offline_throughput.json")
    ap.add_argument("--plot", default="bench_out/offline_throughput.png")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prefill = [int(n) for n in args.prefill.split(",")]
    global PROMPT_SEED_OFFSET
    PROMPT_SEED_OFFSET = args.prompt_seed_offset
    if args.formats is None:
        from moeserve.ops.cpu import bf16_amx, int8_amx

        cpu = args.device == "cpu"
        args.formats = "fp32,int8,int4"
        args.formats += ",w8a8_int8,w4a8_int8" if cpu and int8_amx.available() else ""
        args.formats += ",bf16" if cpu and bf16_amx.available() else ""
    formats = args.formats.split(",")
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(bench_model_path())
    vocab = BENCH_CONFIG["vocab_size"]
    args.speculative_ks = [int(k) for k in args.speculative_num_tokens.split(",") if int(k)]
    if args.speculative_ks:
        if "--batches" not in sys.argv:
            args.batches = [1, 8, 32]
        if "--formats" not in sys.argv:
            args.formats = "fp32"
        if "--out" not in sys.argv:
            suffix = f"_seed{args.prompt_seed_offset}" if args.prompt_seed_offset else ""
            ks = "".join(str(k) for k in args.speculative_ks)
            fmts = args.formats.replace(",", "_")
            args.out = f"bench_out/offline_mtp_k{ks}_{fmts}{suffix}.json"
        return run_speculative(args, model_dir, vocab)

    probe = MachineProbe(args.device)
    results: dict[str, dict[str, float]] = {}
    machine: dict[str, dict[str, float]] = {}
    for fmt in formats:
        results[fmt], machine[fmt] = run_moeserve(args, fmt, model_dir, vocab, probe)
    if not args.skip_hf:
        results["transformers"] = run_transformers(args, model_dir, vocab)
    roofs = {fmt: rooflines(args, fmt, machine[fmt]) for fmt in formats}
    bws = [v for m in machine.values() for k, v in m.items() if k.startswith("decode")]
    peaks: dict[str, list[float]] = {}
    for fmt, m in machine.items():
        name = str(peak_dtype_of(args, fmt)).removeprefix("torch.")
        peaks.setdefault(name, []).extend(v for k, v in m.items() if k.startswith("prefill"))
    peak_text = ", ".join(
        f"{name} GEMM peak {min(v) / 1e9:.0f}-{max(v) / 1e9:.0f} GFLOP/s"
        for name, v in peaks.items()
        if v
    )
    print(
        f"\nbenchmark model, {args.threads} threads, read bandwidth {min(bws) / 1e9:.1f}-"
        f"{max(bws) / 1e9:.1f} GB/s, {peak_text} (measured next to each case), "
        f"{platform.processor() or platform.machine()}"
    )
    cols = ("case", "format", "tok/s", "transformers", "ratio", "GB/s|GFLOP/s", "roofline")
    cols += ("of roof", "vs fp32")
    print(f"{cols[0]:<14}{cols[1]:<8}" + "".join(f"{c:>13}" for c in cols[2:]))
    table = []
    hf = results.get("transformers", {})
    for case in results[formats[0]]:
        for fmt in formats:
            tps, roof = results[fmt][case], roofs[fmt][case]
            row = dict(
                case=case,
                format=fmt,
                tokens_per_s=tps,
                roofline=roof,
                of_roofline=tps / roof,
                machine_figure=machine[fmt][case],
            )
            if case in hf:
                row.update(transformers=hf[case], ratio=tps / hf[case])
            if "fp32" in results and fmt != "fp32":
                row["vs_fp32"] = tps / results["fp32"][case]
            table.append(row)
            cells = [
                f"{tps:.1f}",
                f"{hf[case]:.1f}" if case in hf else "-",
                f"{row['ratio']:.2f}x" if "ratio" in row else "-",
                f"{machine[fmt][case] / 1e9:.1f}",
                f"{roof:.1f}",
                f"{tps / roof:.0%}",
                f"{row['vs_fp32']:.2f}x" if "vs_fp32" in row else "-",
            ]
            print(f"{case:<14}{fmt:<8}" + "".join(f"{c:>13}" for c in cells))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "prompt_len": PROMPT_LEN,
        "rows": table,
        "torch": torch.__version__,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    if args.plot:
        plot(Path(args.plot), args, results, roofs)


if __name__ == "__main__":
    main()
