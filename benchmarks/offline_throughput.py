"""Offline throughput: moeserve against transformers on the benchmark model, in one run.

Prints decode tokens/s at batch 1, 8 and 32 and prefill tokens/s for one 512-token prompt,
the ratio moeserve / transformers, and the decode memory-bandwidth roofline (bytes of weights
and KV a step touches / the read bandwidth this script measures). Writes the table as JSON.

    python benchmarks/offline_throughput.py [--threads 2] [--dtype float32] [--out FILE]
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
from bench_model import BENCH_CONFIG, bench_model_path  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402

PROMPT_LEN = 32
_ids = itertools.count()


def measure_read_bandwidth(device: str = "cpu", gib: float = 1.0, repeats: int = 5) -> float:
    """Best-of-N bytes/s for summing a large fp32 tensor (a streaming read)."""
    t = torch.ones(int(gib * (1 << 30)) // 4, device=device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum().item()
        best = min(best, time.perf_counter() - t0)
    return t.numel() * 4 / best


def decode_bytes_per_step(batch: int, context: int, elem: int) -> float:
    """Weights (and latent KV) one decode step reads, experts counted as expected distinct."""
    c = BENCH_CONFIG
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    L, E, K = c["num_hidden_layers"], c["n_routed_experts"], c["num_experts_per_tok"]
    F, nope, rope, v = (
        c["moe_intermediate_size"],
        c["qk_nope_head_dim"],
        c["qk_rope_head_dim"],
        c["v_head_dim"],
    )
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    attn = D * ql + ql * H * (nope + rope) + D * (kvl + rope) + kvl * H * (nope + v) + H * v * D
    dense = 3 * D * c["intermediate_size"]
    n_moe = L - c["first_k_dense_replace"]
    shared = 3 * D * F * c["n_shared_experts"] + E * D
    expert = 3 * D * F
    distinct = E * (1 - (1 - K / E) ** batch)  # expected experts hit per layer
    params = L * attn + c["first_k_dense_replace"] * dense + n_moe * (shared + distinct * expert)
    params += V * D  # lm_head
    kv = batch * context * (kvl + rope) * L
    return (params + kv) * elem


def time_moeserve_decode(llm: LLM, batch: int, new_tokens: int, vocab: int, repeats: int) -> float:
    """Best of ``repeats`` runs (the machine is shared and noisy)."""
    return max(_moeserve_decode_once(llm, batch, new_tokens, vocab) for _ in range(repeats))


def _moeserve_decode_once(llm: LLM, batch: int, new_tokens: int, vocab: int) -> float:
    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for b in range(batch):
        ids = torch.randint(2, vocab, (PROMPT_LEN,), generator=g).tolist()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (transformers runs there too)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="decode runs per case; best kept")
    ap.add_argument("--model", default=None, help="default: the benchmark model (created once)")
    ap.add_argument("--skip-hf", action="store_true", help="moeserve only")
    ap.add_argument("--out", default="bench_out/offline_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = args.model or str(bench_model_path())
    vocab = BENCH_CONFIG["vocab_size"]

    bandwidth = measure_read_bandwidth(args.device)
    rows: dict[str, dict[str, float]] = {}

    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batches),
        max_model_len=1024,
        num_threads=args.threads,
        progress=False,
    )
    time_moeserve_decode(llm, 1, 4, vocab, 1)  # warm-up
    for b in batches:
        rows[f"decode_b{b}"] = {
            "moeserve": time_moeserve_decode(llm, b, args.new_tokens, vocab, args.repeats)
        }
    time_moeserve_prefill(llm, 64, vocab, repeats=1)
    rows[f"prefill_{args.prefill}"] = {"moeserve": time_moeserve_prefill(llm, args.prefill, vocab)}
    del llm
    gc.collect()

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
        with torch.inference_mode():
            for b in batches:
                rows[f"decode_b{b}"]["transformers"] = time_hf_decode(
                    hf, b, args.new_tokens, vocab, args.repeats
                )
            rows[f"prefill_{args.prefill}"]["transformers"] = time_hf_prefill(
                hf, args.prefill, vocab
            )
        del hf
        gc.collect()

    elem = torch.empty(0, dtype=dtype).element_size()
    for b in batches:
        ctx = PROMPT_LEN + args.new_tokens // 2
        roof = b * bandwidth / decode_bytes_per_step(b, ctx, elem)
        row = rows[f"decode_b{b}"]
        row["roofline"] = roof
        row["fraction_of_roofline"] = row["moeserve"] / roof
    for row in rows.values():
        if "transformers" in row:
            row["ratio"] = row["moeserve"] / row["transformers"]

    print(
        f"\nbenchmark model, {args.dtype}, {args.threads} threads, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {platform.processor() or platform.machine()}"
    )
    print(
        f"{'case':<14}{'moeserve tok/s':>16}{'transformers':>14}{'ratio':>8}"
        f"{'roofline':>10}{'of roof':>9}"
    )
    for name, row in rows.items():
        hf_s = f"{row['transformers']:.1f}" if "transformers" in row else "-"
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        roof = f"{row['roofline']:.1f}" if "roofline" in row else "-"
        frac = f"{row['fraction_of_roofline']:.0%}" if "roofline" in row else "-"
        print(f"{name:<14}{row['moeserve']:>16.1f}{hf_s:>14}{ratio:>8}{roof:>10}{frac:>9}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "dtype": args.dtype,
                "threads": args.threads,
                "bandwidth_bytes_per_s": bandwidth,
                "new_tokens": args.new_tokens,
                "prompt_len": PROMPT_LEN,
                "results": rows,
                "torch": torch.__version__,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
