"""What the engine's stats cost next to a decode step, in one process and in an EP group:
``stats()`` with the KV self-check (what a scrape cost before the snapshots), without it,
and ``step_with_stats()`` against ``step()`` (a group adds its ranks' stats to the step's
gather of outputs). Steps and steps with stats alternate, so the growing contexts hit both
alike; every figure is a median.

    python benchmarks/engine_stats_cost.py [--ep 2] [--seqs 16] [--steps 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from moeserve import LLM, SamplingParams
from moeserve.demo import tiny_model_path


def timed_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=1, help="DP x EP ranks (1: one process)")
    ap.add_argument("--seqs", type=int, default=16, help="decoding sequences")
    ap.add_argument("--steps", type=int, default=300, help="pairs of step / step_with_stats")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    kw = {"max_num_seqs": 64, "num_threads": args.threads, "progress": False}
    if args.ep > 1:
        kw.update(data_parallel_size=args.ep, enable_expert_parallel=True)
    llm = LLM(model=str(tiny_model_path()), **kw)
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * args.steps + 50, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", f"hello number {i} " * 4, params)
    for _ in range(5):
        engine.step()
    step, with_stats = [], []
    for _ in range(args.steps):
        step.append(timed_ms(engine.step))
        with_stats.append(timed_ms(engine.step_with_stats))
    checked = [timed_ms(engine.stats) for _ in range(30)]
    unchecked = [timed_ms(lambda: engine.stats(self_check=False)) for _ in range(30)]
    med = statistics.median
    where = f"EP group of {args.ep} ranks (rank 0)" if args.ep > 1 else "one process"
    blocks = engine.stats(self_check=False)["num_blocks"]  # summed over DP replicas
    print(f"{where}, {args.seqs} sequences, {args.threads} thread(s) per rank, {blocks} KV blocks:")
    print(f"  step()                   {med(step):8.2f} ms")
    print(f"  step_with_stats()        {med(with_stats):8.2f} ms")
    print(f"  stats() with self-check  {med(checked):8.2f} ms")
    print(f"  stats(self_check=False)  {med(unchecked):8.3f} ms")
    engine.shutdown()


if __name__ == "__main__":
    main()
