"""The per-step floor of decode: Python, torch dispatch and ctypes calls around the kernels.

Times engine decode steps of two models of the same structure (DeepSeek-V3, 12 layers, 16
heads, 64 experts top-6 + 1 shared):

    tiny    hidden 64, tiny FFNs and latent: the weights stay in cache, so a step is almost
            all overhead; this is the floor.
    bench   the benchmark model (benchmarks/bench_model.py): the floor plus the weight streams.

For each model, weight format (fp32, int8) and batch: the median step time (and the same
steps with the decode stack off, the layers as modules: "step ms as modules"), then one
cProfile of a few steps broken down by module (the time inside each module's forward, per
step and per layer; cProfile inflates Python, so read the shares, not the absolute times)
and the calls per step (module calls, ctypes kernel calls). Prints a table, writes JSON.

    python benchmarks/decode_floor.py [--models tiny,bench] [--formats fp32,int8]
                                      [--batches 1,8] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import BENCH_CONFIG, PROMPT_LEN, bench_model_path, bench_prompts  # noqa: E402

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.models.synthetic import write_random_deepseek  # noqa: E402
from moeserve.ops.cpu import chain  # noqa: E402

# the benchmark model's structure with tiny dimensions
TINY_CONFIG = {
    **BENCH_CONFIG,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 1024,
}

# (row label, the qualified names of the functions whose cumulative time it is)
# (a decode step goes through models/decode_stack.DecodeStack, which runs the layers' calls
# without their modules, in call chains: the attention and MoE rows count only what runs
# outside them)
MODULES = [
    ("attention (MLA)", ("MLAttention.forward",)),
    ("MoE block", ("MoEBlock.forward", "MoEDecodeCalls.run")),
    ("dense MLP (layer 0)", ("GatedMLP.forward",)),
    ("RMSNorm", ("RMSNorm.forward", "ResidualRows.add")),
    ("decoder layers", ("DecoderLayer.forward", "DecodeStack.__call__")),
    ("model forward", ("MoECausalLM.forward",)),
    ("lm_head + sampler", ("ModelRunner._sample",)),
    ("runner.prepare", ("ModelRunner.prepare",)),
    ("engine.step", ("LLMEngine.step",)),
]


def start_requests(llm: LLM, batch: int, new_tokens: int, vocab: int, tag: str) -> None:
    """Add ``batch`` greedy requests and run steps until every prompt is prefilled."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for b, ids in enumerate(bench_prompts(batch, batch, vocab)):
        engine.add_request(f"{tag}-{b}", ids, params)
    seen: set[str] = set()
    while len(seen) < batch:
        for out in engine.step():
            seen.add(out.request_id)


def step_times(llm: LLM, batch: int, steps: int, vocab: int, tag: str) -> list[float]:
    """Seconds of each decode step of ``batch`` sequences (after their prefill)."""
    start_requests(llm, batch, steps + 2, vocab, tag)
    times = []
    engine = llm.engine
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[:-1]  # the last step also finishes the requests


def kernel_libraries() -> list[ctypes.CDLL]:
    """The loaded C kernel libraries (ops/cpu)."""
    import importlib
    import pkgutil

    import moeserve.ops.cpu as pkg

    libs = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"moeserve.ops.cpu.{info.name}")
        lib_fn = getattr(mod, "_library", None)
        if lib_fn is not None and (lib := lib_fn()) is not None and lib not in libs:
            libs.append(lib)
    return libs


@contextlib.contextmanager
def counting_ctypes(counts: dict[str, int], model: torch.nn.Module):
    """Count the calls of every ``moeserve_*`` function of the kernel libraries: the wrappers
    replace the library attributes, and the layers that hold prebound kernel functions (decode
    calls, RMSNorm, the decode stack) bind again inside the block, and once more after it.
    Inside it the decode stack's call chains make their calls from Python (the chain library
    calls C functions, not the wrappers): the same calls, each counted."""
    saved = []
    for lib in kernel_libraries():
        for name in [n for n in vars(lib) if n.startswith("moeserve_")]:
            fn = getattr(lib, name)

            def wrapper(*args, _fn=fn, _name=name):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*args)

            wrapper.argtypes, wrapper.restype = getattr(fn, "argtypes", None), fn.restype
            saved.append((lib, name, fn))
            setattr(lib, name, wrapper)
    library = chain._library
    chain._library = lambda: None
    unbind(model)
    try:
        yield
    finally:
        for lib, name, fn in saved:
            setattr(lib, name, fn)
        chain._library = library
        unbind(model)


def unbind(model: torch.nn.Module) -> None:
    """Drop the prebound kernel calls of every layer and the decode stack (they bind again on
    their next call)."""
    model.use_decode_stack()
    for m in model.modules():
        if hasattr(m, "use_decode_calls"):
            m.use_decode_calls()
        if getattr(m, "_kernel", None) is not None:
            m._kernel = None


def profile_steps(llm: LLM, batch: int, steps: int, vocab: int, tag: str) -> dict:
    """cProfile of ``steps`` decode steps: seconds per step inside each row of MODULES, module
    calls and ctypes calls per step."""
    start_requests(llm, batch, steps + 2, vocab, tag)
    engine = llm.engine
    prof = cProfile.Profile()
    counts: dict[str, int] = {}
    n = 0
    t0 = time.perf_counter()
    with counting_ctypes(counts, engine.runner.model):
        prof.enable()
        for _ in range(steps):
            engine.step()
            n += 1
        prof.disable()
    wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    st = pstats.Stats(prof)
    quals = _qualnames()
    cum: dict[str, float] = {}
    module_calls = 0
    for (file, _line, func), (_cc, nc, _tt, ct, _callers) in st.stats.items():
        qual = quals.get((file, _line, func), func)
        if func == "_call_impl" and "torch/nn/modules/module.py" in file:
            module_calls += nc
        for label, names in MODULES:
            if qual in names:
                cum[label] = cum.get(label, 0.0) + ct
    return dict(
        profiled_ms_per_step=1e3 * wall / n,
        module_ms_per_step={k: 1e3 * v / n for k, v in cum.items()},
        module_calls_per_step=module_calls / n,
        ctypes_calls_per_step=sum(counts.values()) / n,
        ctypes_by_function={k: v / n for k, v in sorted(counts.items())},
    )


def _qualnames() -> dict[tuple[str, int, str], str]:
    """(file, first line, name) of each method of the classes MODULES names -> ``Class.name``
    (cProfile keys functions by file, line and bare name)."""
    from moeserve.engine.engine import LLMEngine
    from moeserve.engine.model_runner import ModelRunner
    from moeserve.layers.linear import GatedMLP
    from moeserve.layers.mla import MLAttention
    from moeserve.layers.moe_block import MoEBlock
    from moeserve.layers.norm import RMSNorm
    from moeserve.models.base import DecoderLayer, MoECausalLM
    from moeserve.models.decode_stack import DecodeStack
    from moeserve.ops.cpu.moe_decode import MoEDecodeCalls
    from moeserve.ops.cpu.residual import ResidualRows

    out = {}
    for cls in (LLMEngine, ModelRunner, GatedMLP, MLAttention, MoEBlock, RMSNorm):
        out.update(_methods(cls))
    for cls in (DecoderLayer, MoECausalLM, DecodeStack, MoEDecodeCalls):
        out.update(_methods(cls))
    out.update(_methods(ResidualRows))
    return out


def _methods(cls) -> dict[tuple[str, int, str], str]:
    out = {}
    for name, fn in vars(cls).items():
        code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
        if code is not None:
            out[(code.co_filename, code.co_firstlineno, name)] = f"{cls.__name__}.{name}"
    return out


def run_case(llm: LLM, name: str, fmt: str, batch: int, args, vocab: int, layers: int) -> dict:
    times: list[float] = []
    for r in range(args.repeats):
        times += step_times(llm, batch, args.steps, vocab, f"{name}-{fmt}-{batch}-{r}")
    step_ms = 1e3 * statistics.median(times)
    model = llm.engine.runner.model
    model.use_decode_stack(False)  # the same steps layer by layer, as modules
    layer_times: list[float] = []
    for r in range(args.repeats):
        layer_times += step_times(llm, batch, args.steps, vocab, f"{name}-{fmt}-{batch}-l{r}")
    model.use_decode_stack()
    row = dict(model=name, format=fmt, batch=batch, step_ms=step_ms, tok_s=batch / step_ms * 1e3)
    row["layers_step_ms"] = 1e3 * statistics.median(layer_times)
    if not args.no_profile:
        row.update(profile_steps(llm, batch, args.profile_steps, vocab, f"p-{name}-{fmt}-{batch}"))
        row["layers"] = layers
    return row


HEADER = (
    "| model | format | batch | step ms | tok/s | step ms as modules | module calls/step "
    "| ctypes calls/step | per layer (profiled): attention / MoE / norms us "
    "| outside layers (profiled) ms |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"
)


def print_table(rows: list[dict]) -> None:
    print(HEADER)
    for r in rows:
        print(table_row(r))


def table_row(r: dict) -> str:
    """One table row; per-layer figures divide by the layers (attention, norms) or the MoE
    layers (all but the first, dense one)."""
    m = r.get("module_ms_per_step", {})
    L = r.get("layers", 1)
    per_layer = (
        f"{1e3 * m.get('attention (MLA)', 0) / L:.0f} / "
        f"{1e3 * m.get('MoE block', 0) / max(L - 1, 1):.0f} / "
        f"{1e3 * m.get('RMSNorm', 0) / L:.0f}"
    )
    outside = m.get("engine.step", 0) - m.get("decoder layers", 0)
    return (
        f"| {r['model']} | {r['format']} | {r['batch']} | {r['step_ms']:.2f} "
        f"| {r['tok_s']:.1f} | {r['layers_step_ms']:.2f} | {r.get('module_calls_per_step', 0):.0f} "
        f"| {r.get('ctypes_calls_per_step', 0):.0f} | {per_layer} | {outside:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,bench")
    ap.add_argument("--formats", default="fp32,int8")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default="bench_out/decode_floor.json")
    args = ap.parse_args()
    formats = args.formats.split(",")
    batches = [int(b) for b in args.batches.split(",")]

    rows: list[dict] = []
    print(HEADER)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                path = write_random_deepseek(Path(tmp) / "tiny", TINY_CONFIG, dtype="float32")
                cfg = TINY_CONFIG
            elif name == "bench":
                path, cfg = bench_model_path(), BENCH_CONFIG
            else:
                raise SystemExit(f"unknown model {name!r}: expected tiny or bench")
            for fmt in formats:
                llm = LLM(
                    model=str(path),
                    dtype="float32",
                    **({} if fmt == "fp32" else {"quantization": fmt}),
                    max_num_seqs=max(batches),
                    max_model_len=PROMPT_LEN + args.steps + 64,
                    num_threads=args.threads,
                    progress=False,
                )
                step_times(llm, 1, 4, cfg["vocab_size"], f"warm-{name}-{fmt}")
                for b in batches:
                    rows.append(
                        run_case(
                            llm, name, fmt, b, args, cfg["vocab_size"], cfg["num_hidden_layers"]
                        )
                    )
                    print(table_row(rows[-1]), flush=True)
                llm.shutdown()
                del llm
    print()
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(
        command=" ".join(sys.argv),
        machine=platform.processor() or platform.machine(),
        torch=torch.__version__,
        threads=args.threads,
        rows=rows,
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
