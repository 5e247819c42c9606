"""Record what the engine says on the benchmark model, per weight format, and compare two records.

A restructuring must not change a single token or logprob. This script records, for every
weight format this CPU runs (fp32, int8, w8a8_int8 and bf16 weights where AMX runs, bf16
activations where the CPU has fast bf16), the greedy tokens of a batch of 1 and of 8 prompts
(the prebound decode calls and the batched kernels) and the prompt logprobs of each prompt
(prefill), with prefix caching off, and writes them as JSON:

    python scripts/behaviour_snapshot.py record OUT.json [--model DIR] [--formats a,b]
    python scripts/behaviour_snapshot.py compare OLD.json NEW.json

``compare`` prints one line per format and case and exits 1 on any difference: tokens must
be identical and logprobs equal as floats (same kernels, same order of sums).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_model import bench_model_path, bench_prompts  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 24
FORMATS = {  # name: LLM keyword arguments
    "fp32": dict(dtype="float32"),
    "int8": dict(dtype="float32", quantization="int8"),
    "w8a8_int8": dict(dtype="float32", quantization="w8a8_int8"),
    "bf16": dict(dtype="float32", quantization="bf16"),
    "bf16_activations": dict(dtype="bfloat16"),
}


def default_formats() -> list[str]:
    """fp32 and int8 everywhere; the AMX formats where /proc/cpuinfo names the tiles (read
    here rather than asked of the kernels, so that the script runs on any commit)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    names = ["fp32", "int8"]
    names += ["w8a8_int8"] if "amx_int8" in flags else []
    names += ["bf16", "bf16_activations"] if "amx_bf16" in flags else []
    return names


def record_format(model: str, fmt: str, vocab: int) -> dict:
    llm = LLM(
        model=model,
        **FORMATS[fmt],
        max_num_seqs=8,
        max_model_len=128,
        kv_cache_memory_gb=0.25,
        enable_prefix_caching=False,
        num_threads=2,
        progress=False,
    )
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    out: dict = {}
    for batch in (1, 8):
        prompts = bench_prompts(100 + batch, batch, vocab)
        res = llm.generate(prompts, greedy)
        out[f"greedy_b{batch}"] = [
            dict(
                tokens=list(r.outputs[0].token_ids),
                logprobs=[next(iter(p.values())).logprob for p in r.outputs[0].logprobs],
            )
            for r in res
        ]
    prompts = bench_prompts(7, 4, vocab, length=48)
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    out["prompt_logprobs"] = [
        [pos[tok].logprob for tok, pos in zip(p[1:], r.prompt_logprobs[1:])]
        for p, r in zip(prompts, scored)
    ]
    llm.shutdown()
    return out


def record(args) -> None:
    model = args.model or str(bench_model_path())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    formats = args.formats.split(",") if args.formats else default_formats()
    result = {"torch": torch.__version__, "formats": {}}
    for fmt in formats:
        result["formats"][fmt] = record_format(model, fmt, vocab)
        gc.collect()
        print(f"recorded {fmt}", flush=True)
    Path(args.out).write_text(json.dumps(result) + "\n")
    print(f"wrote {args.out}")


def compare(args) -> int:
    old = json.loads(Path(args.old).read_text())["formats"]
    new = json.loads(Path(args.new).read_text())["formats"]
    bad = 0
    for fmt in sorted(set(old) | set(new)):
        if fmt not in old or fmt not in new:
            print(f"{fmt:<18} only in {'new' if fmt in new else 'old'}")
            bad += 1
            continue
        for case in old[fmt]:
            same = old[fmt][case] == new[fmt][case]
            bad += not same
            print(f"{fmt:<18} {case:<16} {'identical' if same else 'DIFFERENT'}")
    print("all identical" if not bad else f"{bad} differences")
    return int(bad > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--model", default=None, help="default: the benchmark model")
    r.add_argument("--formats", default=None, help=f"of {', '.join(FORMATS)}")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args)
    else:
        sys.exit(compare(args))


if __name__ == "__main__":
    main()
