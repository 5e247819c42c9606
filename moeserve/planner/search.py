"""Choose a layout: for each candidate, the largest decode and prefill batches that fit in
memory and meet the TPOT / TTFT targets, the throughput they give, and a ranking.

Serving model (prefill and decode disaggregated, as DeepSeek and SGLang deploy at scale):
a node does either; splitting the nodes in the ratio of the work gives
``output tokens/s per node = out / (in / prefill_tps_node + out / decode_tps_node)``.
TTFT is one prefill pass of the batch the request joins; TPOT is a decode pass divided by
the tokens a step yields (1 + accepted MTP drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.planner.cost_model import Rank
from moeserve.planner.hardware import DTYPE_BYTES, HardwareProfile
from moeserve.planner.layout import Layout, enumerate_layouts
from moeserve.planner.memory import MemoryUse, rank_memory
from moeserve.planner.model_spec import ModelSpec
from moeserve.planner.simulator import StepCost, decode_step, prefill_step


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    imbalance: float = 1.0  # max/mean expert load beyond uniform-routing noise (workload)
    max_decode_batch: int = 1024  # sequences per DP replica per micro-batch
    max_prefill_tokens: int = 16384  # tokens per DP replica per prefill step
    weight_dtype: str | None = None  # None: the profile's
    compute_dtype: str | None = None
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.imbalance < 1:
            raise ValueError(f"imbalance must be >= 1, got {self.imbalance}")
        for name in ("weight_dtype", "compute_dtype", "kv_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPE_BYTES:
                raise ValueError(
                    f"{name}: unknown dtype {v!r}; choose from {', '.join(DTYPE_BYTES)}"
                )


@dataclass(frozen=True)
class PhasePlan:
    batch: int  # sequences per DP replica per micro-batch
    step: StepCost
    latency_s: float  # TPOT (decode) or TTFT (prefill)
    tokens_per_s_instance: float
    memory: MemoryUse


@dataclass(frozen=True)
class Plan:
    layout: Layout
    decode: PhasePlan | None
    prefill: PhasePlan | None
    devices_per_node: int
    reasons: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.decode is not None and self.prefill is not None and not self.reasons

    @property
    def decode_tps_node(self) -> float:
        return self.decode.tokens_per_s_instance / self.layout.nodes if self.decode else 0.0

    @property
    def prefill_tps_node(self) -> float:
        return self.prefill.tokens_per_s_instance / self.layout.nodes if self.prefill else 0.0

    @property
    def decode_tps_chip(self) -> float:
        return self.decode.tokens_per_s_instance / self.layout.world if self.decode else 0.0

    def serving_tps_node(self, w: Workload) -> float:
        """Output tokens/s per node with the nodes split between prefill and decode."""
        if not (self.decode_tps_node and self.prefill_tps_node):
            return 0.0
        per_req = w.input_len / self.prefill_tps_node + w.output_len / self.decode_tps_node
        return w.output_len / per_req


def _rank(hw: HardwareProfile, layout: Layout, w: Workload) -> Rank:
    return Rank.of(hw, layout, w.weight_dtype, w.compute_dtype, w.kv_dtype)


def decode_plan(spec: ModelSpec, rank: Rank, w: Workload, batch: int) -> PhasePlan:
    lay = rank.layout
    ctx = w.input_len + w.output_len / 2  # mean context over a request's decode
    step = decode_step(rank, spec, batch, ctx, w.imbalance)
    tokens = batch * (1 + lay.mtp_depth)
    mem = rank_memory(rank, spec, lay.pp * batch, w.input_len + w.output_len, tokens, tokens)
    tpot = step.time_s / lay.tokens_per_step
    tps = lay.dp * lay.pp * batch * lay.tokens_per_step / step.time_s
    return PhasePlan(batch, step, tpot, tps, mem)


def prefill_plan(spec: ModelSpec, rank: Rank, w: Workload, prompts: int) -> PhasePlan:
    lay = rank.layout
    step = prefill_step(rank, spec, prompts, w.input_len, 0.0, w.imbalance)
    tokens = prompts * w.input_len
    mem = rank_memory(rank, spec, lay.pp * prompts, w.input_len, tokens, prompts)
    tps = lay.dp * lay.pp * tokens / step.time_s
    return PhasePlan(prompts, step, step.time_s, tps, mem)


def largest_batch(make, limit: int, ok) -> PhasePlan | None:
    """The plan of the largest batch up to ``limit`` that ``ok`` accepts. Memory and latency
    grow with the batch, so: binary search over the powers of two, then over the integers
    between the best power and the next."""
    sizes, b = [], 1
    while b <= limit:
        sizes.append(b)
        b *= 2
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = make(sizes[mid])
        if ok(p):
            best, lo = p, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return None
    lo, hi = best.batch + 1, min(limit, 2 * best.batch - 1)
    while lo <= hi:
        mid = (lo + hi) // 2
        p = make(mid)
        if ok(p):
            best, lo = p, mid + 1
        else:
            hi = mid - 1
    return best


def evaluate(spec: ModelSpec, hw: HardwareProfile, layout: Layout, w: Workload) -> Plan:
    """Best batches of ``layout`` under the workload's targets; ``reasons`` says why a layout
    cannot serve (weights do not fit, or even batch 1 misses a target)."""
    rank = _rank(hw, layout, w)
    reasons = []
    tpot_s = w.tpot_ms / 1e3 if w.tpot_ms else float("inf")
    ttft_s = w.ttft_ms / 1e3 if w.ttft_ms else float("inf")
    dec = largest_batch(
        lambda b: decode_plan(spec, rank, w, b),
        w.max_decode_batch,
        lambda p: p.memory.fits and p.latency_s <= tpot_s,
    )
    if dec is None:
        one = decode_plan(spec, rank, w, 1)
        reasons.append(
            "does not fit in memory"
            if not one.memory.fits
            else f"TPOT {one.latency_s * 1e3:.1f} ms at batch 1 > {w.tpot_ms} ms"
        )
    max_prompts = max(1, w.max_prefill_tokens // w.input_len)
    pre = largest_batch(
        lambda n: prefill_plan(spec, rank, w, n),
        max_prompts,
        lambda p: p.memory.fits and p.latency_s <= ttft_s,
    )
    if pre is None:
        one = prefill_plan(spec, rank, w, 1)
        reasons.append(
            "prefill does not fit in memory"
            if not one.memory.fits
            else f"TTFT {one.latency_s * 1e3:.1f} ms for one prompt > {w.ttft_ms} ms"
        )
    return Plan(layout, dec, pre, hw.devices, tuple(reasons))


def rank_layouts(
    spec: ModelSpec,
    hw: HardwareProfile,
    nodes: int,
    w: Workload,
    layouts: list[Layout] | None = None,
    **enum_kw,
) -> list[Plan]:
    """Every candidate evaluated; those that serve first, by output tokens/s per node."""
    cands = (
        layouts if layouts is not None else enumerate_layouts(spec, nodes, hw.devices, **enum_kw)
    )
    plans = [evaluate(spec, hw, lay, w) for lay in cands]
    return sorted(plans, key=lambda p: (not p.ok, -p.serving_tps_node(w)))


@dataclass(frozen=True)
class SweepPoint:
    nodes: int
    best: Plan | None  # one instance over all the nodes
    decode_tps_node: float
    serving_tps_node: float
    efficiency: float  # decode tokens/s per node against the first point
    replicated_tps_node: float = 0.0  # best of copies of a smaller instance (size divides)
    replicated_efficiency: float = 0.0


def sweep(
    spec: ModelSpec, hw: HardwareProfile, node_counts: list[int], w: Workload, **enum_kw
) -> list[SweepPoint]:
    """For each node count, the best layout of one instance spanning all the nodes (one EP
    domain: how far expert parallelism scales), and its per-node efficiency against the
    smallest count that serves; beside it, the best the nodes do as copies of any smaller
    instance among the counts swept (a size that divides the count)."""
    points, base, rep_base = [], None, None
    seen: dict[int, float] = {}
    for n in sorted(node_counts):
        plans = rank_layouts(spec, hw, n, w, instance_nodes=[n], **enum_kw)
        best = plans[0] if plans and plans[0].ok else None
        dec = best.decode_tps_node if best else 0.0
        srv = best.serving_tps_node(w) if best else 0.0
        seen[n] = dec
        rep = max(v for m, v in seen.items() if n % m == 0)
        if base is None and dec:
            base = dec
        if rep_base is None and rep:
            rep_base = rep
        points.append(
            SweepPoint(
                n,
                best,
                dec,
                srv,
                dec / base if base else 0.0,
                rep,
                rep / rep_base if rep_base else 0.0,
            )
        )
    return points
