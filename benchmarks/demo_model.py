"""The trained demo model, measured (docs/demo_model.md): held-out perplexity against a bigram
model of the same tokens, greedy chat answers, and MTP speculative decoding on held-out text.

- **Perplexity.** The trainer's held-out stream (``scripts/train_demo.py``: 2% of the
  paragraphs and 5% of the question/answer pairs, never trained on), cut into consecutive
  windows of ``--window`` tokens, scored by moeserve's prompt logprobs (fp32 compute). The
  bigram baseline is the trainer's: add-k smoothed counts of the training stream.
- **Answers.** Greedy chat answers (``LLM.chat``) to questions from the held-out pairs, shown
  with the documentation's answer, and to a few questions asked in other words.
- **MTP.** Greedy decode of ``--new-tokens`` after the first ``--prompt-tokens`` tokens of
  held-out paragraphs, with MTP off and with k = 1..3 drafts per step from the trained MTP
  layer: tokens/s (best of ``--repeats``, the modes interleaved), the mean acceptance
  length (tokens per verify step) and whether every mode gave the same tokens. The same on
  training paragraphs, for contrast (acceptance only).

    python benchmarks/demo_model.py [--model DIR] [--threads 2] [--batches 1,8] \
        [--out bench_out/demo_model.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moeserve import LLM, SamplingParams
from moeserve.demo import demo_model_path

ROOT = Path(__file__).resolve().parents[1]
# held-out questions as the documentation asks them, and the same subjects asked otherwise
OWN_WORDS = (
    "What is a generator?",
    "What is a dictionary?",
    "What does sorted() do?",
    "How do I read a file line by line?",
    "What is the difference between a list and a tuple?",
    "Why do I get an ImportError?",
)


def host() -> str:
    """The CPU's model name and its widest vector extensions (figures name their host)."""
    from pd import host as cpu_name

    from moeserve.platform import cpu_flags

    flags = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    isa = [f for f in flags if f in cpu_flags()]
    return f"{cpu_name()} ({', '.join(isa) or 'no AVX2'})"


def trainer():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def perplexity(llm: LLM, held: torch.Tensor, window: int) -> tuple[float, int]:
    """Mean next-token cross-entropy of the held-out stream in consecutive windows (the first
    token of each window has no context and is not scored), and how many tokens were."""
    ids = held.tolist()
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    total, n = 0.0, 0
    for out in llm.generate(windows, params):
        for entry in out.prompt_logprobs[1:]:
            total -= next(iter(entry.values())).logprob
            n += 1
    return total / n, n


def answers(llm: LLM, qa_held: list[dict], n: int, max_tokens: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    asked = [(d["q"], d["a"]) for d in qa_held[:n]] + [(q, None) for q in OWN_WORDS]
    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in asked], params)
    return [
        dict(question=q, answer=o.outputs[0].text, documentation=a)
        for (q, a), o in zip(asked, outs, strict=True)
    ]


def decode(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """Tokens/s of a greedy decode of every prompt at once (prefill excluded), and the
    tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"demo-{time.monotonic_ns()}-{i}", ids, params)
    produced: dict[str, int] = {}
    while len(produced) < len(prompts) or min(produced.values()) < 1:  # prefill every request
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    t0 = time.perf_counter()
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    done = [tokens[k] for k in sorted(tokens, key=lambda k: int(k.rsplit("-", 1)[1]))]
    return len(prompts) * (new_tokens - 1) / dt, done


def mtp_rows(llm: LLM, sets: dict[str, list[list[int]]], batches, args) -> list[dict]:
    from moeserve.engine.spec_setup import set_speculation

    engine = llm.engine
    keys = ("draft_tokens", "accepted_tokens", "verify_steps")
    rows = []
    set_speculation(engine, 0)
    decode(llm, sets["held-out"][:2], 8)  # warm-up
    for name, prompts in sets.items():
        for b in batches if name == "held-out" else [max(batches)]:
            best: dict[int, float] = {}
            counts = {k: dict.fromkeys(keys, 0) for k in range(4)}
            tokens: dict[int, list] = {}
            for _ in range(args.repeats if name == "held-out" else 1):
                for k in range(4):
                    set_speculation(engine, k)
                    st0 = engine.stats()
                    tps, got = decode(llm, prompts[:b], args.new_tokens)
                    st1 = engine.stats()
                    for key in keys:
                        key_st = f"spec_decode_num_{key}"
                        counts[k][key] += st1[key_st] - st0[key_st]
                    best[k] = max(best.get(k, 0.0), tps)
                    tokens.setdefault(k, got)
            for k in range(4):
                d = counts[k]
                rows.append(
                    dict(
                        prompts=name,
                        batch=b,
                        k=k,
                        tokens_per_s=best[k],
                        speedup=best[k] / best[0],
                        accept_length=1 + d["accepted_tokens"] / d["verify_steps"]
                        if d["verify_steps"]
                        else None,
                        same_tokens_as_off=tokens[k] == tokens[0],
                        **d,
                    )
                )
    set_speculation(engine, 0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the shipped demo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=256, help="perplexity: tokens per window")
    ap.add_argument("--questions", type=int, default=6, help="held-out pairs asked")
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8", help="MTP: sequences decoded at once")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_out/demo_model.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = Path(args.model) if args.model else demo_model_path()
    print(f"{model} on {host()}, {args.threads} threads")
    td = trainer()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    paragraphs, qa = td.load_text()
    train, held = td.streams(tok, paragraphs, qa)
    vocab = tok.get_vocab_size()
    bigram = td.bigram_loss(train, held, vocab)
    llm = LLM(
        model=str(model),
        dtype="float32",
        num_threads=args.threads,
        max_num_seqs=max(batches),
        max_model_len=max(args.window, args.prompt_tokens + args.new_tokens) + 8,
        speculative_num_tokens=3,
        progress=False,
    )
    t0 = time.perf_counter()
    loss, scored = perplexity(llm, held, args.window)
    print(
        f"held-out: {scored} tokens in windows of {args.window}: {loss:.3f} nats per token "
        f"(ppl {math.exp(loss):.1f}); bigram {bigram:.3f} (ppl {math.exp(bigram):.1f}); "
        f"{time.perf_counter() - t0:.0f} s"
    )
    qa_held = [d for i, d in enumerate(qa) if td.held_out(10**6 + i, 0.05)]
    said = answers(llm, qa_held, args.questions, args.answer_tokens)
    for a in said:
        print(f"\nQ: {a['question']}\nA: {a['answer']}")
        if a["documentation"]:
            print(f"   (documentation: {a['documentation'][:160]})")

    def starts(held_set: bool) -> list[list[int]]:
        out = []
        for i, p in enumerate(paragraphs):
            if td.held_out(i, 0.02) == held_set:
                ids = tok.encode(p).ids
                if len(ids) >= args.prompt_tokens + 16:
                    out.append(ids[: args.prompt_tokens])
            if len(out) == max(batches):
                return out
        return out

    sets = {"held-out": starts(True), "training": starts(False)}
    rows = mtp_rows(llm, sets, batches, args)
    print(f"\nMTP, greedy, {args.new_tokens} new tokens after {args.prompt_tokens}, fp32,")
    print(f"{args.threads} threads, best of {args.repeats} interleaved (training: acceptance)")
    print(f"{'prompts':<10}{'batch':>6}{'k':>4}{'tok/s':>10}{'speedup':>9}{'accept':>8}  same")
    for r in rows:
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(
            f"{r['prompts']:<10}{r['batch']:>6}{r['k']:>4}{r['tokens_per_s']:>10.1f}"
            f"{r['speedup']:>8.2f}x{acc:>8}  {r['same_tokens_as_off']}"
        )
    llm.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(
        command=" ".join(sys.argv),
        model=str(model),
        host=host(),
        threads=args.threads,
        heldout=dict(tokens=scored, window=args.window, loss=loss, bigram_loss=bigram),
        answers=said,
        mtp=rows,
        torch=torch.__version__,
    )
    out.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
