"""Prefill of one fresh prompt: moeserve against transformers (or against moeserve in another
weight format) on the benchmark model, the two alternating in one process (fp32
activations, 2 threads), round after round.

``offline_throughput.py`` measures every moeserve case and then every transformers case, minutes
apart; on a shared host whose speed drifts by tens of percent that can flip a ratio near 1.
Here each round times moeserve, then the other, on prompts of the same length (best of
``--repeats`` fresh prompts each), and the table shows every round's ratio and their median.

    python benchmarks/prefill_ab.py [--tokens 512 2048] [--rounds 6] [--repeats 2]
                                    [--format fp32|int8|bf16] [--against transformers|fp32|...]
                                    [--threads 2] [--out bench_out/prefill_ab.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, bench_model_path  # noqa: E402
from offline_throughput import time_hf_prefill, time_moeserve_prefill  # noqa: E402

from moeserve import LLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("fp32", "int8", "bf16")


def moeserve_engine(model: str, fmt: str, args) -> LLM:
    return LLM(
        model=model,
        dtype="float32",
        **({} if fmt == "fp32" else {"quantization": fmt}),
        progress=False,
        num_threads=args.threads,
        max_model_len=max(args.tokens) + 64,
        max_num_batched_tokens=max(max(args.tokens), 2048),
        enable_prefix_caching=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="fresh prompts per engine and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the benchmark model")
    ap.add_argument("--format", default="fp32", choices=FORMATS, help="moeserve's weight format")
    ap.add_argument(
        "--against",
        default="transformers",
        choices=("transformers", *FORMATS),
        help="transformers, or moeserve in another weight format",
    )
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "prefill_ab.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(bench_model_path(args.model))
    vocab = BENCH_CONFIG["vocab_size"]
    llm = moeserve_engine(model, args.format, args)
    other = None
    if args.against == "transformers":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

        def theirs_prefill(n: int, repeats: int) -> float:
            return time_hf_prefill(hf, n, vocab, repeats)
    else:
        other = moeserve_engine(model, args.against, args)

        def theirs_prefill(n: int, repeats: int) -> float:
            return time_moeserve_prefill(other, n, vocab, repeats)

    ours_name = f"moeserve {args.format}"
    theirs_name = args.against if other is None else f"moeserve {args.against}"
    rows = []
    try:
        with torch.inference_mode():
            time_moeserve_prefill(llm, 64, vocab, repeats=1)  # warm-up
            theirs_prefill(64, 1)
            for n in args.tokens:
                rounds = []
                for r in range(args.rounds):
                    ours = time_moeserve_prefill(llm, n, vocab, args.repeats)
                    theirs = theirs_prefill(n, args.repeats)
                    rounds.append(dict(moeserve=ours, other=theirs, ratio=ours / theirs))
                    print(
                        f"{n} tokens, round {r + 1}: {ours_name} {ours:.1f} tok/s, "
                        f"{theirs_name} {theirs:.1f} tok/s, {ours / theirs:.2f}x",
                        flush=True,
                    )
                med = statistics.median(x["ratio"] for x in rounds)
                rows.append(dict(tokens=n, median_ratio=med, rounds=rounds))
    finally:
        llm.shutdown()
        if other is not None:
            other.shutdown()
    print()
    print(
        f"| prompt | {ours_name} tok/s (median) | {theirs_name} tok/s (median) "
        "| ratio per round | median ratio |"
    )
    print("|---:|---:|---:|---|---:|")
    for row in rows:
        ours = statistics.median(x["moeserve"] for x in row["rounds"])
        theirs = statistics.median(x["other"] for x in row["rounds"])
        each = ", ".join(f"{x['ratio']:.2f}" for x in row["rounds"])
        print(
            f"| {row['tokens']} | {ours:.1f} | {theirs:.1f} | {each} | {row['median_ratio']:.2f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        threads=args.threads,
        machine=platform.processor() or platform.machine(),
        format=args.format,
        against=args.against,
    )
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
