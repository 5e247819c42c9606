"""Serving benchmark at several request rates against one `moeserve serve` on the benchmark
model: starts the server, runs `moeserve bench serving` (same code) per rate, prints each
rate's table and a summary, writes one JSON and a plot per rate. Each rate gets its own
prompts (seed = its position), so the prefix cache cannot serve one run from another.

With ``--offline-compare`` the prompts of the last rate also run through the offline engine
(``LLM.generate``, same engine settings, all at once) after the server stops: the ratio of
output throughputs is what the server, the HTTP and the process hop cost.

    python benchmarks/serving_sweep.py --rates 1,2,4,inf --num-prompts 64 \\
        --input-len 256 --output-len 64 --max-concurrency 32 --offline-compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import bench_model_path  # noqa: E402
from server_process import start_server  # noqa: E402

from moeserve.bench.datasets import LocalCodec, build_requests  # noqa: E402
from moeserve.bench.plot import save_plot  # noqa: E402
from moeserve.bench.serving import ServingBenchConfig, run_benchmark  # noqa: E402
from moeserve.bench.table import format_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,2,inf", help="comma-separated requests/s")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--out-dir", default="bench-serving")
    ap.add_argument("--server-args", default="--max-num-seqs 32", help="extra `serve` flags")
    ap.add_argument("--offline-compare", action="store_true")
    args = ap.parse_args()

    model = bench_model_path()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(["--model", str(model), *args.server_args.split()])
    summary = []
    try:
        for seed, rate in enumerate(float(r) for r in args.rates.split(",")):
            config = ServingBenchConfig(
                seed=seed,
                base_url=url,
                endpoint=args.endpoint,
                tokenizer=str(model),
                num_prompts=args.num_prompts,
                random_input_len=args.input_len,
                random_output_len=args.output_len,
                random_range_ratio=args.range_ratio,
                request_rate=rate,
                max_concurrency=args.max_concurrency,
                disable_tqdm=True,
            )
            result = asyncio.run(run_benchmark(config))
            print(f"\n## request rate {rate:g}/s\n{format_table(result)}")
            tag = "inf" if math.isinf(rate) else f"{rate:g}"
            save_plot(result, out / f"serving-rate-{tag}.png")
            summary.append({"request_rate": rate, **result.to_dict()})
    finally:
        proc.terminate()
        proc.wait(120)
    print("\n| rate (req/s) | done | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        print(
            f"| {s['request_rate']:g} | {s['completed']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.1f} | {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} "
            f"| {s['median_tpot_ms']:.0f} / {s['p99_tpot_ms']:.0f} |"
        )
    if args.offline_compare:
        summary[-1]["offline"] = offline(model, config, args.server_args, summary[-1])
    (out / "serving_sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def offline(model: Path, config: ServingBenchConfig, server_args: str, served: dict) -> dict:
    """The last rate's prompts through ``LLM.generate`` in this process."""
    from moeserve import LLM, SamplingParams
    from moeserve.cli import build_parser, engine_kwargs

    codec = LocalCodec.from_dir(model)
    reqs = build_requests(
        "random",
        codec,
        config.num_prompts,
        config.random_input_len,
        config.random_output_len,
        config.random_range_ratio,
        config.seed,
    )
    cli = build_parser().parse_args(["generate", "--prompt", "-", *server_args.split()])
    llm = LLM(**{**engine_kwargs(cli), "model": str(model)}, progress=False)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    took = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"duration": took, "output_tokens": tokens, "output_throughput": tokens / took}
    ratio = served["output_throughput"] / result["output_throughput"]
    print(
        f"\noffline LLM.generate, same {len(reqs)} prompts: {took:.1f} s, "
        f"{result['output_throughput']:.1f} output tok/s; the server reached {ratio:.2f}x of it"
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
