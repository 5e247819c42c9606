"""Weight formats side by side, interleaved in one process: is format A faster than B here?

``offline_throughput.py`` runs one format's cases after another's, so a format can meet a
different memory bandwidth than the next (this shared host's moves by 2x within minutes).
Here every format's engine is loaded once, then each round times every case for every format,
the order of the formats reversed from one round to the next, so drift hits them alike. The
table gives each case's best tok/s per format and the median over the rounds of each format
against the first (``--base``).

    python benchmarks/format_ab.py [--formats int8,int4] [--batches 1,32] [--prefill 512]
                                   [--rounds 5] [--threads 2] [--out bench_out/format_ab.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, PROMPT_LEN, bench_model_path  # noqa: E402
from offline_throughput import (  # noqa: E402
    format_kwargs,
    time_moeserve_decode,
    time_moeserve_prefill,
)

from moeserve import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,int4", help="the first is the base")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prefill", default="512")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the benchmark model")
    ap.add_argument("--out", default="bench_out/format_ab.json")
    args = ap.parse_args()
    formats = args.formats.split(",")
    batches = [int(b) for b in args.batches.split(",") if b]
    prefill = [int(n) for n in args.prefill.split(",") if n]
    torch.set_num_threads(args.threads)
    model = args.model or str(bench_model_path())
    vocab = BENCH_CONFIG["vocab_size"]
    engines = {}
    for fmt in formats:
        engines[fmt] = LLM(
            model=model,
            dtype="float32",
            **format_kwargs(fmt),
            max_num_seqs=max(batches, default=1),
            max_model_len=max([*prefill, PROMPT_LEN + args.new_tokens]) + 64,
            max_num_batched_tokens=max([*prefill, 2048]),
            num_threads=args.threads,
            enable_prefix_caching=False,  # each round prefills the same prompt afresh
            progress=False,
        )
        time_moeserve_decode(engines[fmt], 1, 4, vocab, 1)  # warm-up
        gc.collect()
    cases = [f"decode_b{b}" for b in batches] + [f"prefill_{n}" for n in prefill]
    runs: dict[str, dict[str, list[float]]] = {c: {f: [] for f in formats} for c in cases}
    for r in range(args.rounds):
        order = formats if r % 2 == 0 else formats[::-1]
        for case in cases:
            for fmt in order:
                llm = engines[fmt]
                if case.startswith("decode"):
                    b = int(case.removeprefix("decode_b"))
                    tps = time_moeserve_decode(llm, b, args.new_tokens, vocab, 1)
                else:
                    tps = time_moeserve_prefill(llm, int(case.removeprefix("prefill_")), vocab, 1)
                runs[case][fmt].append(tps)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    base = formats[0]
    print(
        f"\nbenchmark model, {args.threads} threads, {args.rounds} interleaved rounds, "
        f"{platform.machine()}; tok/s: best of the rounds; ratio: median of per-round ratios"
    )
    header = "| case | " + " | ".join(formats)
    header += " | " + " | ".join(f"{f}/{base}" for f in formats[1:]) + " |"
    print(header)
    print("|---" * (len(formats) * 2) + "|")
    table = {}
    for case in cases:
        best = {f: max(runs[case][f]) for f in formats}
        ratios = {
            f: statistics.median(a / b for a, b in zip(runs[case][f], runs[case][base]))
            for f in formats[1:]
        }
        table[case] = {"best_tok_s": best, "median_ratio_to_base": ratios, "runs": runs[case]}
        cells = [f"{best[f]:.1f}" for f in formats] + [f"{ratios[f]:.2f}x" for f in formats[1:]]
        print(f"| {case} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"formats": formats, "base": base, "cases": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
