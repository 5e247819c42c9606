"""Cost of each operation of one step on one rank: FLOPs, bytes, and the time they take.

Pure functions over plain data (a :class:`ModelSpec`, a :class:`Layout`, a
:class:`HardwareProfile`); the simulator adds them up per layer and per step.

Compute: a GEMM of ``M`` rows reaches ``efficiency(M) = M / (M + m_half)`` of the peak of
the path that runs it and cannot go faster than its bytes allow:
``t = max(flops / (peak * efficiency(M)), bytes / bandwidth) + op_overhead``. A profile may
give few rows their own path (``small_gemm_*``: moeserve's CPU kernels up to 128 rows, and
the MoE kernel's expert blocks), with its own peak and ``m_half``; more rows take the
device's large-GEMM rate (MKL).
Communication: ``latency + per_peer * peers + bytes / bandwidth`` per collective, split into
the part that stays inside a node and the part that crosses the NICs (shared by the node's
ranks). Routed experts: the rows a rank receives and the number of *distinct* experts they
hit, ``slots * (1 - (1 - K / slots_total) ** tokens)``, decide the weight bytes read.

Shape letters as in the engine: T tokens, D model dim, F expert FFN dim, E experts, K top-k,
R rows routed to this rank, H heads (per TP rank: H_t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeserve.planner.hardware import DTYPE_BYTES, HardwareProfile
from moeserve.planner.layout import Layout
from moeserve.planner.model_spec import ModelSpec

COMPUTE, COMM, OVERHEAD = "compute", "comm", "overhead"


@dataclass(frozen=True)
class OpCost:
    name: str
    kind: str  # compute | comm | overhead
    flops: float = 0.0
    bytes: float = 0.0  # memory traffic (compute) or bytes sent by this rank (comm)
    time_s: float = 0.0


@dataclass(frozen=True)
class Rank:
    """What one rank of a layout gets of the hardware, and the dtypes it runs.

    ``colocated``: instances of this layout that share the same nodes (this one included),
    e.g. three one-rank instances on one host. Their ranks split each device as the ranks of
    one oversubscribed instance do (every instance busy: the loaded case).
    """

    hw: HardwareProfile
    layout: Layout
    weight_dtype: str
    compute_dtype: str
    kv_dtype: str
    colocated: int = 1

    def __post_init__(self) -> None:
        if self.colocated < 1:
            raise ValueError(f"colocated must be >= 1, got {self.colocated}")

    @classmethod
    def of(
        cls,
        hw: HardwareProfile,
        layout: Layout,
        weight_dtype: str | None = None,
        compute_dtype: str | None = None,
        kv_dtype: str | None = None,
        colocated: int = 1,
    ) -> Rank:
        sw = hw.software
        return cls(
            hw,
            layout,
            weight_dtype or sw.weight_dtype,
            compute_dtype or sw.compute_dtype,
            kv_dtype or sw.kv_dtype,
            colocated,
        )

    @property
    def ranks_on_node(self) -> int:
        """Ranks on this rank's node: its instance's and those of the colocated instances."""
        return self.layout.ranks_per_node * self.colocated

    @property
    def share(self) -> float:
        """Ranks that share one device (more ranks than devices on a node: oversubscribed)."""
        return max(1.0, self.ranks_on_node / self.hw.devices)

    @property
    def cpu_share(self) -> float:
        """Host-side slowdown of Python and control work when ranks outnumber the cores."""
        if self.hw.kind != "cpu":
            return 1.0
        return max(1.0, self.ranks_on_node / (self.hw.devices * self.hw.device.cores))

    @property
    def wbytes(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def abytes(self) -> float:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def kvbytes(self) -> float:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def gemm_dtype(self) -> str:
        """Narrow weights the device multiplies natively (FP8 on Hopper, INT8 on an NPU)
        run at that rate; weight-only formats are widened to the compute dtype first."""
        tf = self.hw.device.matmul_tflops
        if self.weight_dtype in tf and self.wbytes < self.abytes:
            return self.weight_dtype
        return self.compute_dtype

    @property
    def flops_per_s(self) -> float:
        return self.hw.device.flops_per_s(self.gemm_dtype) / self.share

    @property
    def bytes_per_s(self) -> float:
        return self.hw.device.bytes_per_s / self.share

    @property
    def memory_bytes(self) -> float:
        cap = self.hw.device.memory_bytes / self.share
        return cap * (1 - self.hw.software.memory_reserve_fraction)

    @property
    def op_overhead_s(self) -> float:
        return self.hw.software.op_overhead_us * 1e-6 * self.cpu_share


# ------------------------------------------------------------------------------ compute


def gemm_efficiency(rank: Rank, m: float) -> float:
    mh = rank.hw.device.gemm_m_half
    return 1.0 if mh == 0 else m / (m + mh)


def gemm_flops_per_s(
    rank: Rank, m: float, m_half: float | None = None, large: bool = False
) -> float:
    """FLOP/s of an ``m``-row GEMM on this rank: the path that runs it (a profile may give
    few rows their own kernel and rate, ``small_gemm_*``; ``large`` forces the large-GEMM
    path) at ``m / (m + m_half)`` of its peak."""
    dev, dt = rank.hw.device, rank.gemm_dtype
    if dt == rank.hw.software.compute_dtype and not large:  # the few-row path's dtype
        peak, mh = dev.gemm_rate(dt, m)
    else:
        peak, mh = dev.flops_per_s(dt), dev.gemm_m_half
    mh = mh if m_half is None else m_half
    return peak / rank.share * (1.0 if mh == 0 else m / (m + mh))


def compute_time(
    rank: Rank,
    flops: float,
    nbytes: float,
    m: float,
    calls: float = 1,
    m_half: float | None = None,
    large: bool = False,
) -> float:
    if flops == 0 and nbytes == 0:
        return 0.0
    rate = gemm_flops_per_s(rank, max(m, 1e-9), m_half, large)
    return max(flops / rate, nbytes / rank.bytes_per_s) + calls * rank.op_overhead_s


def gemm(
    rank: Rank,
    name: str,
    m: float,
    n: float,
    k: float,
    w_bytes: float | None = None,
    large: bool = False,
):
    """``[m, k] @ [k, n]`` with an ``n x k`` weight read once (``large``: on the large-GEMM
    path whatever ``m``)."""
    if m <= 0:
        return OpCost(name, COMPUTE)
    wb = rank.wbytes if w_bytes is None else w_bytes
    flops = 2.0 * m * n * k
    nbytes = n * k * wb + (m * k + m * n) * rank.abytes
    return OpCost(name, COMPUTE, flops, nbytes, compute_time(rank, flops, nbytes, m, large=large))


def expert_gemm_path(rank: Rank, rows_per_expert: float) -> bool:
    """Whether experts with this many rows run as plain GEMMs (the large-GEMM path) rather
    than in the expert kernel (``device.expert_gemm_min_rows``)."""
    least = rank.hw.device.expert_gemm_min_rows
    return bool(least) and rows_per_expert >= least


def attention_decode(rank: Rank, spec: ModelSpec, seqs: float, q_per_seq: float, ctx: float):
    """Scores and values of ``q_per_seq`` new tokens of each of ``seqs`` sequences against a
    ``ctx``-token cache. MLA reads the latent once for all heads (absorbed); GQA its K/V."""
    if seqs <= 0:
        return OpCost("attn_core", COMPUTE)
    H_t = spec.num_heads / rank.layout.tp
    if spec.is_mla:
        width = spec.kv_lora_rank + spec.qk_rope_dim
        flops = 2 * seqs * q_per_seq * H_t * ctx * (width + spec.kv_lora_rank)
    else:
        width = spec.kv_elems_per_token_layer(rank.layout.tp)
        flops = 2 * seqs * q_per_seq * H_t * ctx * 2 * spec.head_dim
    nbytes = seqs * ctx * width * rank.kvbytes
    # the core is a batched dot product: its efficiency is that of q_per_seq * heads-per-kv rows
    rows = q_per_seq * (H_t if spec.is_mla else H_t / max(1, spec.num_kv_heads / rank.layout.tp))
    return OpCost("attn_core", COMPUTE, flops, nbytes, compute_time(rank, flops, nbytes, rows))


def attention_prefill(rank: Rank, spec: ModelSpec, seqs: float, new: float, prefix: float):
    """Causal attention of ``new`` tokens per sequence over ``prefix + new`` (half the square
    for the new part: the work an ideal causal kernel does)."""
    if seqs <= 0 or new <= 0:
        return OpCost("attn_core", COMPUTE)
    H_t = spec.num_heads / rank.layout.tp
    pairs = seqs * (new * prefix + new * (new + 1) / 2)
    qk = spec.qk_head_dim
    v = spec.v_head_dim if spec.is_mla else spec.head_dim
    flops = 2 * H_t * pairs * (qk + v)
    nbytes = seqs * (prefix + new) * H_t * (qk + v) * rank.abytes
    # per-head GEMMs with a short inner dimension, the score matrix written, masked,
    # softmaxed and read again, and the copies around them: a calibrated fraction of the
    # GEMM rate (moeserve's blocked CPU attention: ~0.1)
    eff = rank.hw.device.prefill_attention_efficiency
    t = compute_time(rank, flops / eff, nbytes / eff, new)
    return OpCost("attn_core", COMPUTE, flops, nbytes, t)


# -------------------------------------------------------------------------------- experts


def distinct_experts(slots_total: float, top_k: float, tokens: float, slots_here: float) -> float:
    """Expected distinct slots of ``slots_here`` hit by ``tokens`` tokens that each pick
    ``top_k`` of ``slots_total`` uniformly (occupancy)."""
    if tokens <= 0:
        return 0.0
    p_miss = (1.0 - min(1.0, top_k / slots_total)) ** tokens
    return slots_here * (1.0 - p_miss)


def rows_on_busiest_rank(mean: float, ranks: int, imbalance: float = 1.0) -> float:
    """Rows the most loaded of ``ranks`` EP ranks receives: uniform routing spreads
    ``mean`` rows per rank with binomial noise, whose maximum over ``ranks`` draws is about
    ``mean + sqrt(2 ln ranks) * sigma``; ``imbalance`` scales for skewed (real) routing."""
    if ranks <= 1 or mean <= 0:
        return mean
    sigma = math.sqrt(mean * (1 - 1 / ranks))
    return min(mean * ranks, (mean + math.sqrt(2 * math.log(ranks)) * sigma)) * imbalance


def routed_experts(rank: Rank, spec: ModelSpec, tokens_ep: float, imbalance: float = 1.0) -> OpCost:
    """Grouped GEMMs of the routed experts on the busiest rank. ``tokens_ep``: tokens routed
    in this rank's EP group per step (all DP replicas of the stage under EP; the replica's
    tokens without EP, where each rank holds ``F / tp`` of every expert)."""
    lay, D = rank.layout, spec.hidden
    if lay.expert_parallel:
        slots_total = spec.num_experts + lay.redundant_experts
        slots_here = slots_total / lay.ep
        F_local = spec.moe_intermediate
        rows = rows_on_busiest_rank(tokens_ep * spec.top_k / lay.ep, lay.ep, imbalance)
    else:
        slots_total = slots_here = spec.num_experts
        F_local = spec.moe_intermediate / lay.tp
        rows = tokens_ep * spec.top_k
    active = distinct_experts(slots_total, spec.top_k, tokens_ep, slots_here)
    if active <= 0 or rows <= 0:
        return OpCost("experts", COMPUTE)
    flops = 2.0 * rows * 3 * D * F_local
    nbytes = active * 3 * D * F_local * rank.wbytes + rows * (2 * D + 2 * F_local) * rank.abytes
    # the grouped kernel (row sorting, gathers, many small GEMMs) reaches expert_efficiency
    # of the peak of the path that runs its blocks (CPU: moeserve's MoE kernel, the few-row
    # path, blocks of at most small_gemm_max_rows rows), and half of that at expert_m_half
    # rows per expert where the profile gives it (the path's m_half otherwise): per-block
    # gathers, SiLU and scatter, and the down projection's short inner dimension, make its
    # rate grow with the rows differently from one plain GEMM's; its weights then stream at
    # the plain rate (the calibration measures both)
    m = rows / active
    if expert_gemm_path(rank, m):  # two plain GEMMs per expert
        t = compute_time(rank, flops, nbytes, m, calls=2 * active, large=True)
        return OpCost("experts", COMPUTE, flops, nbytes, t)
    eff = rank.hw.device.expert_efficiency
    if rank.hw.device.small_gemm_max_rows:  # the MoE kernel splits groups into blocks
        m = min(m, rank.hw.device.small_gemm_max_rows)
    e_half = rank.hw.device.expert_m_half
    # with its own rate curve the kernel streams the weights as any GEMM does; a bare factor
    # (no curve) stands for the whole kernel, bytes included
    b_eff = 1.0 if e_half is not None else eff
    t = compute_time(rank, flops / eff, nbytes / b_eff, m, m_half=e_half)
    return OpCost("experts", COMPUTE, flops, nbytes, t)


# --------------------------------------------------------------------------- collectives


def _levels(rank: Rank, n: int) -> tuple[int, int]:
    """Peers of a group of ``n`` consecutive ranks inside this node and on other nodes."""
    local = min(n, rank.layout.ranks_per_node)
    return local - 1, n - local


def collective_latency(
    rank: Rank, n: int, steps: int | None = None, allreduce: bool = False
) -> float:
    """Fixed cost of one collective among ``n`` ranks that takes ``steps`` rounds of
    messages (all-to-all: ``n - 1``; ring all-reduce: ``2 (n - 1)``)."""
    if n <= 1:
        return 0.0
    hw, sw = rank.hw, rank.hw.software
    local, remote = _levels(rank, n)
    steps = n - 1 if steps is None else steps
    link = hw.inter_node if remote else hw.intra_node
    base = link.allreduce_latency_us if allreduce else link.latency_us
    per_step = (hw.intra_node.per_peer_us * local + hw.inter_node.per_peer_us * remote) / (n - 1)
    us = sw.collective_overhead_us + base + per_step * steps
    if hw.kind == "cpu":  # ranks beyond the cores wait to be scheduled at every collective
        spare = rank.ranks_on_node - hw.devices * hw.device.cores
        us += sw.oversubscription_us * max(0, spare)
    return us * 1e-6


def all_to_all(rank: Rank, name: str, n: int, bytes_out: float) -> OpCost:
    """Each of ``n`` ranks sends ``bytes_out`` spread evenly over the group (its own share
    stays home)."""
    if n <= 1:
        return OpCost(name, COMM)
    hw = rank.hw
    local, remote = _levels(rank, n)
    b_intra = bytes_out * local / n
    b_inter = bytes_out * remote / n
    nic = hw.inter_node.bandwidth_gbs * 1e9 / rank.layout.ranks_per_node
    t = collective_latency(rank, n) + max(
        b_intra / (hw.intra_node.bandwidth_gbs * 1e9), b_inter / nic if b_inter else 0.0
    )
    return OpCost(name, COMM, 0.0, b_intra + b_inter, t)


def all_reduce(rank: Rank, name: str, n: int, nbytes: float) -> OpCost:
    """Ring all-reduce of ``nbytes``: ``2 (n-1)/n`` of it crosses each rank's link."""
    if n <= 1 or nbytes <= 0:
        return OpCost(name, COMM)
    hw = rank.hw
    _, remote = _levels(rank, n)
    moved = 2 * (n - 1) / n * nbytes
    bw = (
        hw.inter_node.bandwidth_gbs * 1e9 / rank.layout.ranks_per_node
        if remote
        else hw.intra_node.bandwidth_gbs * 1e9
    )
    return OpCost(
        name, COMM, 0.0, moved, collective_latency(rank, n, 2 * (n - 1), True) + moved / bw
    )


def all_gather(rank: Rank, name: str, n: int, nbytes_each: float) -> OpCost:
    if n <= 1:
        return OpCost(name, COMM)
    return all_to_all(rank, name, n, nbytes_each * n)


def send_recv(rank: Rank, name: str, nbytes: float, crosses_node: bool) -> OpCost:
    hw = rank.hw
    link = hw.inter_node if crosses_node else hw.intra_node
    bw = link.bandwidth_gbs * 1e9 / (rank.layout.ranks_per_node if crosses_node else 1)
    t = (hw.software.collective_overhead_us + link.latency_us) * 1e-6 + nbytes / bw
    return OpCost(name, COMM, 0.0, nbytes, t)
