"""What structured output costs decode: tokens/s of a batch held to a JSON schema against
the same batch free, in one run (rounds alternate, medians reported).

The schema keeps every sequence running to ``--max-tokens`` whatever a random model says
(an object whose one string field needs at least 4000 characters), so both sides decode the
same number of tokens at the same batch size: the difference is the grammar's work
(llguidance's mask per row, in parallel over the rows, then the mask applied to the logits).

    python benchmarks/structured_output.py [--model tiny|demo|bench|DIR] [--batches 1 32] \
        [--max-tokens 64] [--rounds 3] [--threads 2] [--out bench_out/structured_output.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic import model_dir  # noqa: E402
from pd import host  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 4000}},
    "required": ["notes"],
    "additionalProperties": False,
}


def tokens_per_s(llm: LLM, batch: int, params: SamplingParams) -> float:
    prompts = [f"Note {i}: the experts of layer {i % 7} say" for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, demo, bench or a directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_out/structured_output.json")
    args = ap.parse_args()
    kw = {"progress": False, "num_threads": args.threads, "max_num_seqs": max(args.batches)}
    llm = LLM(model=str(model_dir(args.model)), **kw)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    held = SamplingParams(
        max_tokens=args.max_tokens, temperature=0, guided_decoding={"json": SCHEMA}
    )
    tokens_per_s(llm, 2, free)  # warm-up: kernels, and the grammar's tokenizer
    tokens_per_s(llm, 2, held)
    rows = []
    for batch in args.batches:
        runs = {"free": [], "json_schema": []}
        for _ in range(args.rounds):
            runs["free"].append(tokens_per_s(llm, batch, free))
            runs["json_schema"].append(tokens_per_s(llm, batch, held))
        f, j = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
        rows.append({"batch": batch, "free": f, "json_schema": j, "cost": 1 - j / f, "runs": runs})
    print(f"structured output, {args.model} model, {args.max_tokens} tokens, {host()}")
    print(f"{'batch':>6} {'free tok/s':>11} {'json_schema tok/s':>18} {'cost':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['free']:>11.1f} {r['json_schema']:>18.1f} {r['cost']:>7.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "host": host(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
