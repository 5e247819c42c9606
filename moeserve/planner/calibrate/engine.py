"""The engine's own decode steps of a tiny DeepSeek-V3 for ``moeserve plan calibrate``: host
overheads from one process, the cost of collectives as the engine issues them from TP 2, EP 2
and EP 4. torch and the engine are imported inside the functions only."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from moeserve.demo import TINY_CONFIG

# the tiny random model's shapes (TINY_CONFIG), without YaRN and the MTP layer; layers set
# per call
TINY = {
    **TINY_CONFIG,
    "rope_scaling": None,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 512,
}


def time_decode_steps(
    llm: Any, batch: int, prompt_len: int, steps: int, vocab: int, seed: int | None = None
) -> float:
    """Median seconds of one engine decode step with ``batch`` sequences decoding (after
    their prefill); ``llm`` is a :class:`moeserve.LLM`; prompts drawn with ``seed`` (default:
    the batch size)."""
    import torch

    from moeserve import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(batch if seed is None else seed)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    tag = time.perf_counter_ns()
    for b in range(batch):
        ids = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"cal-{tag}-{b}", ids, params)
    seen: set[str] = set()
    while len(seen) < batch:  # every prompt prefilled
        for out in engine.step():
            seen.add(out.request_id)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[:-1] or times)


def measure_engine(threads: int) -> list[dict]:
    """Decode-step seconds of a tiny DeepSeek with 2 and 8 layers at batch 1 and 16."""
    from moeserve import LLM
    from moeserve.models.synthetic import write_random_deepseek

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (2, 8):
            cfg = {**TINY, "num_hidden_layers": layers}
            path = Path(tmp) / f"l{layers}"
            write_random_deepseek(path, cfg, seed=0, dtype="float32")
            llm = LLM(
                model=str(path),
                dtype="float32",
                num_threads=threads,
                progress=False,
                max_num_seqs=16,
                max_model_len=256,
            )
            try:
                time_decode_steps(llm, 1, 8, 8, cfg["vocab_size"])  # warm-up
                for batch in (1, 4, 16):
                    # best of 3: another tenant of the machine slows whole runs, and one slowed
                    # row drags the least-squares fit of the overheads
                    t = min(
                        time_decode_steps(llm, batch, 16, 24, cfg["vocab_size"]) for _ in range(3)
                    )
                    rows.append(dict(layers=layers, batch=batch, ctx=24, seconds=t))
            finally:
                llm.shutdown()
    return rows


ENGINE_LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(data_parallel_size=2, enable_expert_parallel=True),
    "ep4": dict(data_parallel_size=4, enable_expert_parallel=True),
}


def measure_engine_layouts(layers: int = 8) -> list[dict]:
    """Decode-step seconds of the tiny DeepSeek under TP 2, EP 2 and EP 4 (ranks spawned as
    ``moeserve generate --tp/--ep`` does), one sequence per DP replica: with next to no
    compute, the step is the engine's collectives as the engine issues them (back to back,
    between Python, with gloo's threads sharing the cores)."""
    from moeserve import LLM
    from moeserve.models.synthetic import write_random_deepseek

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {**TINY, "num_hidden_layers": layers}
        path = Path(tmp) / "m"
        write_random_deepseek(path, cfg, seed=0, dtype="float32")
        for name, kw in ENGINE_LAYOUTS.items():
            llm = LLM(
                model=str(path),
                dtype="float32",
                progress=False,
                max_num_seqs=16,
                max_model_len=256,
                **kw,
            )
            try:
                dp = kw.get("data_parallel_size", 1)
                time_decode_steps(llm, dp, 8, 8, cfg["vocab_size"])  # warm-up
                # best of 3: another tenant of the machine slows whole runs
                t = min(time_decode_steps(llm, dp, 16, 32, cfg["vocab_size"]) for _ in range(3))
                rows.append(dict(layout=name, layers=layers, batch=dp, ctx=24, seconds=t, **kw))
            finally:
                llm.shutdown()
    return rows


_LATENCY_KNOBS = (
    ("network", "latency_us"),
    ("network", "allreduce_latency_us"),
    ("software", "oversubscription_us"),
)


def fit_engine_collectives(rows: list[dict], raw: dict) -> tuple[float, float, float]:
    """(all-to-all latency, all-reduce latency, oversubscription) in microseconds such that
    the cost model's decode steps of the tiny model under each layout match the measured
    ones: the model is linear in the three, so each one's coefficient is the change of the
    prediction when it alone is 1 us; least squares, clamped at 0."""
    import copy

    import numpy as np

    from moeserve.planner.hardware import profile_from_dict

    def predict(values: tuple[float, float, float]) -> list[float]:
        r = copy.deepcopy(raw)
        for (sec, key), v in zip(_LATENCY_KNOBS, values):
            if sec == "network":
                for level in ("intra_node", "inter_node"):
                    r["network"][level][key]["value"] = v
                    r["network"][level]["per_peer_us"]["value"] = 0.0
            else:
                r["software"][key]["value"] = v
        profile = profile_from_dict(r, "calibration")
        return [_predict_engine(profile, row) for row in rows]

    base = np.array(predict((0.0, 0.0, 0.0)))
    cols = [np.array(predict(tuple(float(i == j) for j in range(3)))) - base for i in range(3)]
    A = np.stack(cols, axis=1) * 1e6  # seconds per microsecond of each knob -> per second
    y = (np.array([r["seconds"] for r in rows]) - base) * 1e6
    keep = [j for j in range(3) if np.any(A[:, j] > 0)]
    sol = np.zeros(3)
    while keep:
        part, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        if (part >= 0).all():
            sol[keep] = part
            break
        keep.pop(int(np.argmin(part)))  # a negative knob: drop it and refit the others
    return tuple(float(v) for v in sol)


def _predict_engine(profile, row: dict) -> float:
    from moeserve.planner.cost_model import Rank
    from moeserve.planner.layout import Layout
    from moeserve.planner.model_spec import spec_from_config
    from moeserve.planner.simulator import decode_step

    lay = Layout(
        tp=row.get("tensor_parallel_size", 1),
        dp=row.get("data_parallel_size", 1),
        expert_parallel=row.get("enable_expert_parallel", False),
    )
    spec = spec_from_config({**TINY, "num_hidden_layers": row["layers"]}, "tiny")
    return decode_step(Rank.of(profile, lay), spec, row["batch"] / lay.dp, row["ctx"]).time_s


def fit_overheads(rows: list[dict], predict_compute) -> tuple[float, float, float, float]:
    """(step, layer, seq, seq-layer) microseconds: least squares of the measured step time
    minus the cost model's compute for it, against
    ``step + layers * layer + batch * seq + batch * layers * seq_layer``."""
    import numpy as np

    A = np.array([[1.0, r["layers"], r["batch"], r["batch"] * r["layers"]] for r in rows])
    b = np.array([r["seconds"] - predict_compute(r) for r in rows]) * 1e6
    sol, *_ = np.linalg.lstsq(A, b, rcond=None)
    return tuple(max(0.0, float(v)) for v in sol)


def _compute_only(profile, row: dict) -> float:
    """The cost model's decode step of the tiny model without software overheads."""
    from moeserve.planner.cost_model import Rank
    from moeserve.planner.layout import Layout
    from moeserve.planner.model_spec import spec_from_config
    from moeserve.planner.simulator import decode_step

    spec = spec_from_config({**TINY, "num_hidden_layers": row["layers"]}, "tiny")
    step = decode_step(Rank.of(profile, Layout()), spec, row["batch"], row["ctx"])
    return step.time_s - step.breakdown.get("host_overhead", 0.0)
