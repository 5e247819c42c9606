"""KV-transfer bandwidth of prefill/decode disaggregation against Mooncake's raw bandwidth on
the same link, in the same run (issue 22, part 7: target at least 70%).

A prefill and a decode engine on the benchmark model (float32: 12 layers x 288 latent
floats = 13.5 KiB per token) in one process, their Mooncake engines on loopback TCP. For
each of ``--repeat`` rounds and each prompt length:

- **kv**: one disaggregated request of that prompt (computed on the prefill engine first, so
  the timed part is the transfer alone): the prefill side's batch from its start to the
  peer's last acknowledgement, as ``moeserve:kv_transfer_seconds`` measures it;
- **raw**: the same number of bytes written with one ``batch_transfer_sync_write`` of one
  contiguous region, from the prefill pool into the decode pool (the link's best case).

A disaggregated instance faults its pool's pages in at start (``disagg/factory.make_rank``):
before that, KV written into never-touched pages of the decode pool ran at 0.14 GB/s against
the raw write's 0.73 (20%), each page faulting in under Mooncake's receiving thread.

    python benchmarks/pd_transfer.py [--lengths 1024 4000] [--repeat 5] \
        [--out bench_out/pd_transfer.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import BENCH_CONFIG, bench_model_path  # noqa: E402

from moeserve.config import EngineConfig  # noqa: E402
from moeserve.core import KVTransferParams, SamplingParams  # noqa: E402
from moeserve.engine.engine import LLMEngine  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    return model


def _engines(model: str, port: int) -> tuple[LLMEngine, LLMEngine]:
    common = dict(
        model=model,
        dtype="float32",
        progress=False,
        max_model_len=BENCH_CONFIG["max_position_embeddings"],
        max_num_seqs=4,
        kv_cache_memory_gb=1.0,
    )
    prefill = LLMEngine(
        EngineConfig(**common, disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    )
    decode = LLMEngine(EngineConfig(**common, disaggregation_mode="decode"))
    return prefill, decode


def kv_transfer(prefill: LLMEngine, decode: LLMEngine, port: int, length: int, room: int):
    """One request of ``length`` tokens through both engines; (seconds, bytes) of the prefill
    side's transfer."""
    prompt = [2 + (i * 7919 + room) % (BENCH_CONFIG["vocab_size"] - 2) for i in range(length)]
    kv = KVTransferParams("127.0.0.1", port, room)
    params = SamplingParams(temperature=0, max_tokens=1, kv_transfer=kv)
    before = prefill.kv_connector.stats.to_json()
    prefill.add_tokenized(f"p{room}", prompt, params)
    while prefill.scheduler.num_waiting or prefill.scheduler.num_running:
        prefill.step()  # the prompt is computed (and parked) before the decode side asks
    decode.add_tokenized(f"d{room}", prompt, params)
    deadline = time.monotonic() + 120
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        prefill.step()
        decode.step()
        if time.monotonic() > deadline:
            raise RuntimeError("the transfer did not finish in 120 s")
    after = prefill.kv_connector.stats.to_json()
    if after["transfers"] != before["transfers"] + 1:
        raise RuntimeError(f"the transfer failed: {after}")
    return after["seconds_sum"] - before["seconds_sum"], after["bytes"] - before["bytes"]


def raw_write(prefill: LLMEngine, decode: LLMEngine, num_bytes: int) -> float:
    """Seconds for one contiguous write of ``num_bytes`` from the prefill pool's first layer
    into the decode pool's (split over layers when one layer's tensor is smaller)."""
    src = prefill.kv_connector.rank
    dst = decode.kv_connector.rank
    per_layer = src.layout.pool_bytes[0]
    srcs, dsts, lengths, left = [], [], [], num_bytes
    for s_addr, d_addr in zip(src.layout.layer_addrs, dst.layout.layer_addrs):
        n = min(left, per_layer)
        srcs.append(s_addr)
        dsts.append(d_addr)
        lengths.append(n)
        left -= n
        if not left:
            break
    engine = src.transport.engine
    t = time.perf_counter()
    rc = engine.batch_transfer_sync_write(dst.transport.session_id, srcs, dsts, lengths)
    seconds = time.perf_counter() - t
    if rc != 0:
        raise RuntimeError(f"the raw write failed ({rc})")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4000])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default=None, help="default: the benchmark model")
    ap.add_argument("--out", default="bench_out/pd_transfer.json")
    args = ap.parse_args()
    model = str(bench_model_path(args.model))
    port = _free_port()
    prefill, decode = _engines(model, port)
    rows = []
    room = 1
    raw_write(prefill, decode, 1 << 20)  # the first contact's handshake, untimed
    for length in args.lengths:
        kv_s, raw_s = [], []
        num_bytes = 0
        for _ in range(args.repeat):
            seconds, num_bytes = kv_transfer(prefill, decode, port, length, room)
            room += 1
            kv_s.append(seconds)
            raw_s.append(raw_write(prefill, decode, num_bytes))
        kv_bw = num_bytes / statistics.median(kv_s) / 1e9
        raw_bw = num_bytes / statistics.median(raw_s) / 1e9
        rows.append(
            {
                "prompt_tokens": length,
                "bytes": num_bytes,
                "kv_seconds": kv_s,
                "raw_seconds": raw_s,
                "kv_GBps": kv_bw,
                "raw_GBps": raw_bw,
                "ratio": kv_bw / raw_bw,
            }
        )
    print(f"{'prompt':>7} | {'MiB':>6} | {'kv GB/s':>8} | {'raw GB/s':>8} | kv/raw")
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} | {r['bytes'] / 2**20:>6.1f} | {r['kv_GBps']:>8.2f} | "
            f"{r['raw_GBps']:>8.2f} | {r['ratio']:.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"host": _host(), "rows": rows}, indent=1))
    print(f"wrote {args.out} (medians of {args.repeat}; host: {_host()})")
    prefill.shutdown()
    decode.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
