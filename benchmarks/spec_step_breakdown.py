"""Where the time of a speculative decode step goes, against a plain step (one process, one
model, MTP off and on interleaved; the machine's bandwidth drifts, so only same-run ratios
mean anything).

Each engine step is split by wrapping the engine's parts with timers:

    schedule / update / process   scheduler and output processor (Python)
    target forward                the main model's layers over the step's rows
    target head                   the LM head (compute_logits) over the sampled/verified rows
    sample | verify               plain sampler | spec/verify.py (accept/reject)
    mtp forward                   the MTP layer: the pass over kept positions + recursion rows
    draft head                    the draft logits (the full head, or the hot ids')
    sample drafts                 spec/verify.py: sample_drafts
    metadata                      AttentionMetadata.build (all of them)
    runner other                  the rest of ModelRunner.run (tensor building, bookkeeping)
    engine other                  the rest of LLMEngine.step

and the bytes each part reads are estimated from the model's shapes (``roofline.py``): the
target reads the routed experts its rows hit (``1 + drafts`` rows per sequence), the MTP
layer one decoder layer plus ``eh_proj`` per pass, the heads ``V x D`` (or ``H x D``) each.

    python benchmarks/spec_step_breakdown.py --model DIR [--batch 1] [--k 1] [--hot-vocab N]
        [--formats fp32,int8] [--cprofile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG  # noqa: E402
from roofline import FORMATS, MachineProbe, Shapes  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.engine import model_runner as runner_mod  # noqa: E402
from moeserve.engine.spec_setup import set_speculation  # noqa: E402
from moeserve.layers.attention_meta import AttentionMetadata  # noqa: E402
from moeserve.spec import mtp as mtp_mod  # noqa: E402
from moeserve.spec.hot_vocab import most_frequent_ids  # noqa: E402

PROMPT_LEN = 32
PARTS = (
    "schedule",
    "update",
    "process",
    "target forward",
    "target head",
    "sample",
    "verify",
    "mtp forward",
    "draft head",
    "sample drafts",
    "metadata",
    "runner other",
    "engine other",
)


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0

        return timed


class TimedLayer:
    """The MTP layer with its calls timed (``MTPProposer`` calls ``layer(...)``)."""

    def __init__(self, layer, timers: Timers) -> None:
        self._layer, self._call = layer, timers.wrap("mtp forward", layer.__call__)

    def __call__(self, *args):
        return self._call(*args)

    def __getattr__(self, name):
        return getattr(self._layer, name)


def instrument(engine, timers: Timers):
    """Wrap the parts of ``engine`` (after set_speculation, which makes a new runner); returns
    the function that undoes the module-level patches."""
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = timers.wrap("schedule", type(sched).schedule.__get__(sched))
    sched.update = timers.wrap("update", type(sched).update.__get__(sched))
    engine.outputs.process = timers.wrap(
        "process", type(engine.outputs).process.__get__(engine.outputs)
    )
    runner.run = timers.wrap("run", type(runner).run.__get__(runner))
    runner._forward_stage = timers.wrap(
        "target forward", type(runner)._forward_stage.__get__(runner)
    )
    model = runner.model
    model.compute_logits = timers.wrap("target head", type(model).compute_logits.__get__(model))
    runner.sampler = timers.wrap("sample", runner.sampler)
    if runner.proposer is not None:
        p = runner.proposer
        p.layer = TimedLayer(p.layer, timers)
        p.draft_logits = timers.wrap("draft head", type(p).draft_logits.__get__(p))
    saved = (runner_mod.verify, mtp_mod.sample_drafts, AttentionMetadata.__dict__["build"])
    runner_mod.verify = timers.wrap("verify", saved[0])
    mtp_mod.sample_drafts = timers.wrap("sample drafts", saved[1])
    AttentionMetadata.build = staticmethod(timers.wrap("metadata", saved[2].__func__))

    def undo() -> None:
        runner_mod.verify, mtp_mod.sample_drafts = saved[0], saved[1]
        AttentionMetadata.build = saved[2]
        model.__dict__.pop("compute_logits", None)
        for obj, attr in ((sched, "schedule"), (sched, "update"), (engine.outputs, "process")):
            obj.__dict__.pop(attr, None)

    return undo


def decode(llm: LLM, batch: int, new_tokens: int, seed: int, timers: Timers | None):
    """Greedy decode of ``batch`` random prompts; timed from the first token on. Returns
    (seconds, engine steps, the output token ids)."""
    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for b in range(batch):
        ids = torch.randint(2, engine.model_config.vocab_size, (PROMPT_LEN,), generator=g).tolist()
        engine.add_request(f"r{time.monotonic_ns()}-{b}", ids, params)
    outs: dict[str, list[int]] = {}
    while len(outs) < batch or min(len(o) for o in outs.values()) < 1:
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    step = engine.step
    if timers is not None:
        timers.total.clear()  # the prefill steps above do not count
        step = timers.wrap("step", engine.step)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        for out in step():
            outs[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return time.perf_counter() - t0, steps, [outs[k] for k in sorted(outs)]


def step_bytes(fmt: str, batch: int, k: int, accept: float, hot: int) -> dict[str, float]:
    """Estimated bytes of one step's parts with ``k`` drafts per step (0: a plain step) at
    mean accept length ``accept``: the target over ``1 + k`` rows per sequence, the MTP pass
    over the ``accept`` kept rows and ``k - 1`` one-row recursion passes, ``k`` draft-head
    reads (``hot`` rows each, or the whole head)."""
    s, b = Shapes.of(BENCH_CONFIG), FORMATS[fmt]

    def mat(r: int, c: int) -> float:
        return r * c * b["linear"] + r * b["scale"]

    def experts(rows: float) -> float:  # shared + expected distinct routed experts, bytes
        return (s.n_shared + s.E * (1 - (1 - s.K / s.E) ** rows)) * expert

    attn = sum(mat(r, k) for r, k in s.linears()) + s.kvl * s.H * (s.nope + s.v) * b["kv_b"]
    expert = mat(2 * s.F, s.D) + mat(s.D, s.F)
    dense = mat(2 * s.I, s.D) + mat(s.D, s.I)
    n_moe = s.L - s.n_dense
    head = mat(s.V, s.D)
    target = s.L * attn + s.n_dense * dense + n_moe * experts(batch * (1 + k))
    out = {"target forward": target, "target head": head}
    if k:
        layer = attn + mat(s.D, 2 * s.D)  # + eh_proj
        out["mtp forward"] = layer + experts(batch * accept) + (k - 1) * (layer + experts(batch))
        out["draft head"] = k * (mat(hot, s.D) if hot else head)
    return out


def run(args, fmt: str, probe: MachineProbe) -> dict:
    llm = LLM(
        args.model,
        dtype="float32",
        **({} if fmt == "fp32" else {"quantization": fmt}),
        max_num_seqs=max(args.batch, 1),
        max_model_len=PROMPT_LEN + args.new_tokens + 8,
        num_threads=args.threads,
        progress=False,
        speculative_num_tokens=args.k,
    )
    engine = llm.engine
    hot = None
    if args.hot_vocab:
        set_speculation(engine, 0)
        _, _, outs = decode(llm, args.batch, args.new_tokens, args.batch + args.seed_offset, None)
        stream = [t for o in outs for t in o]
        V = engine.model_config.vocab_size
        hot = most_frequent_ids(stream, args.hot_vocab, V)
        hot += [t for t in range(V) if t not in set(hot)][: args.hot_vocab - len(hot)]
    modes = {"plain": (0, None), f"k={args.k}": (args.k, None)}
    if hot is not None:
        modes[f"k={args.k} hot {args.hot_vocab}"] = (args.k, hot)
    seed = args.batch + args.seed_offset
    res: dict[str, dict] = {}
    for rep in range(args.repeats):
        for name, (k, tm) in modes.items():
            set_speculation(engine, k, tm)
            timers = Timers()
            undo = instrument(engine, timers)
            st0 = engine.stats()
            gc.collect()
            prof = cProfile.Profile() if args.cprofile and rep == args.repeats - 1 else None
            if prof:
                prof.enable()
            dt, steps, outs = decode(llm, args.batch, args.new_tokens, seed, timers)
            if prof:
                prof.disable()
                d = Path(args.cprofile)
                d.mkdir(parents=True, exist_ok=True)
                fname = d / f"{fmt}-b{args.batch}-{name.replace(' ', '_').replace('=', '')}.txt"
                with open(fname, "w") as f:
                    pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            undo()
            st1 = engine.stats()
            verify_steps = st1["spec_decode_num_verify_steps"] - st0["spec_decode_num_verify_steps"]
            accepted = (
                st1["spec_decode_num_accepted_tokens"] - st0["spec_decode_num_accepted_tokens"]
            )
            parts = {p: timers.total.get(p, 0.0) / steps for p in PARTS}
            run_t = timers.total["run"] / steps
            inner = ("target forward", "target head", "sample", "verify", "mtp forward")
            inner += ("draft head", "sample drafts", "metadata")
            parts["runner other"] = run_t - sum(parts[p] for p in inner)
            outer = ("schedule", "update", "process")
            parts["engine other"] = (
                timers.total["step"] / steps - run_t - sum(parts[p] for p in outer)
            )
            row = dict(
                seconds=dt,
                steps=steps,
                step_ms=1e3 * dt / steps,
                tokens_per_s=args.batch * (args.new_tokens - 1) / dt,
                accept_length=1 + accepted / verify_steps if verify_steps else None,
                parts_ms={p: 1e3 * v for p, v in parts.items()},
                outputs=outs,
                bandwidth=probe.bandwidth(repeats=2),
            )
            best = res.get(name)
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                res[name] = row
    ref = res["plain"]["outputs"]
    for name, row in res.items():
        row["identical_to_plain"] = row.pop("outputs") == ref
        k = args.k if name != "plain" else 0
        hot_n = args.hot_vocab if "hot" in name else 0
        row["bytes"] = step_bytes(fmt, args.batch, k, row["accept_length"] or 1.0, hot_n)
    llm.shutdown()
    del llm
    gc.collect()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint with an MTP layer (fit_mtp.py)")
    ap.add_argument("--formats", default="fp32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--hot-vocab", type=int, default=0, metavar="N", help="also time N hot ids")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; best kept")
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cprofile", metavar="DIR", help="cProfile the last round of each mode")
    ap.add_argument("--out", default="bench_out/spec_step_breakdown.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    probe = MachineProbe()
    record = {"args": vars(args), "formats": {}}
    for fmt in args.formats.split(","):
        res = run(args, fmt, probe)
        record["formats"][fmt] = res
        names = list(res)
        print(f"\n{fmt}, batch {args.batch}: ms per step (best of {args.repeats} interleaved)")
        print(f"{'':<16}" + "".join(f"{n:>20}" for n in names))
        for p in PARTS:
            print(f"{p:<16}" + "".join(f"{res[n]['parts_ms'][p]:>20.2f}" for n in names))
        for key, f in (("step_ms", "{:.2f}"), ("tokens_per_s", "{:.1f}")):
            print(f"{key:<16}" + "".join(f"{f.format(res[n][key]):>20}" for n in names))
        acc = [f"{res[n]['accept_length']:.2f}" if res[n]["accept_length"] else "-" for n in names]
        print(f"{'accept length':<16}" + "".join(f"{a:>20}" for a in acc))
        sp = [f"{res[n]['tokens_per_s'] / res['plain']['tokens_per_s']:.2f}x" for n in names]
        print(f"{'speedup':<16}" + "".join(f"{s:>20}" for s in sp))
        mb = [sum(res[n]["bytes"].values()) / 1e6 for n in names]
        print(f"{'est. MB/step':<16}" + "".join(f"{m:>20.0f}" for m in mb))
        same = [str(res[n]["identical_to_plain"]) for n in names]
        print(f"{'same outputs':<16}" + "".join(f"{s:>20}" for s in same))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
