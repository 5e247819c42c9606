"""One decode step and one prefill step of a model under a layout, as the sum of its ops.

Every rank of a pipeline stage runs the same ops on its share; the step time is that of the
busiest rank (its share of routed rows is the binomial maximum, `cost_model`). A pass goes
through the ``pp`` stages in turn (one micro-batch; the others fill the other stages), so
``pass time = sum over all layers + hand-offs + fixed costs``.

Overlap rules (from the profile's ``software.comm_overlaps_compute``): with a spare engine
for communication (GPU copy engines, NICs with RDMA), the shared expert hides under the
dispatch and two-batch overlap runs each layer in ``max(compute, comm)`` of its two halves;
where communication takes the same cores (gloo on a small CPU), nothing hides and two-batch
overlap only adds the cost of the second half's weight reads and collectives.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import moeserve.planner.cost_model as cm
from moeserve.planner.cost_model import COMM, COMPUTE, OVERHEAD, OpCost, Rank
from moeserve.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class StepCost:
    """Time of one pass (seconds) and where it goes (seconds per op name, over all layers)."""

    time_s: float
    breakdown: dict[str, float] = field(default_factory=dict)
    by_kind: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0
    bytes: float = 0.0


class _Acc:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.kind: dict[str, float] = defaultdict(float)
        self.flops = 0.0
        self.bytes = 0.0
        self.time = 0.0

    def add(self, ops: list[OpCost], times: int | float = 1, time_s: float | None = None):
        for op in ops:
            self.t[op.name] += op.time_s * times
            self.kind[op.kind] += op.time_s * times
            self.flops += op.flops * times
            self.bytes += op.bytes * times if op.kind == COMPUTE else 0.0
        self.time += (sum(op.time_s for op in ops) if time_s is None else time_s) * times

    def result(self) -> StepCost:
        return StepCost(self.time, dict(self.t), dict(self.kind), self.flops, self.bytes)


# ----------------------------------------------------------------------------- one layer


def attention_ops(
    rank: Rank, spec: ModelSpec, T: float, seqs: float, q_per_seq: float, ctx: float, decode: bool
) -> list[OpCost]:
    """Projections, the attention core and the TP all-reduce of one attention block for ``T``
    tokens (``seqs`` sequences with ``q_per_seq`` new tokens each over a ``ctx`` cache)."""
    lay, D = rank.layout, spec.hidden
    H_t = spec.num_heads / lay.tp
    ops: list[OpCost] = []
    if spec.is_mla:
        kv_a = spec.kv_lora_rank + spec.qk_rope_dim
        if spec.q_lora_rank:
            ops.append(cm.gemm(rank, "attn_qkv_a", T, spec.q_lora_rank + kv_a, D))
            ops.append(cm.gemm(rank, "attn_q_b", T, H_t * spec.qk_head_dim, spec.q_lora_rank))
        else:
            ops.append(cm.gemm(rank, "attn_qkv_a", T, H_t * spec.qk_head_dim + kv_a, D))
        if decode:  # absorbed: W_UK into the query, W_UV after; the latent is never expanded
            ops.append(cm.gemm(rank, "attn_absorb", T, H_t * spec.kv_lora_rank, spec.qk_nope_dim))
            ops.append(cm.attention_decode(rank, spec, seqs, q_per_seq, ctx))
            ops.append(cm.gemm(rank, "attn_absorb", T, H_t * spec.v_head_dim, spec.kv_lora_rank))
        else:  # naive: expand the latent of every context token with kv_b_proj
            n_kv = H_t * (spec.qk_nope_dim + spec.v_head_dim)
            ops.append(cm.gemm(rank, "attn_kv_b", seqs * ctx, n_kv, spec.kv_lora_rank))
            ops.append(cm.attention_prefill(rank, spec, seqs, q_per_seq, ctx - q_per_seq))
        ops.append(cm.gemm(rank, "attn_o", T, D, H_t * spec.v_head_dim))
    else:
        kv_t = max(1, spec.num_kv_heads // lay.tp)
        ops.append(cm.gemm(rank, "attn_qkv", T, (H_t + 2 * kv_t) * spec.head_dim, D))
        if decode:
            ops.append(cm.attention_decode(rank, spec, seqs, q_per_seq, ctx))
        else:
            ops.append(cm.attention_prefill(rank, spec, seqs, q_per_seq, ctx - q_per_seq))
        ops.append(cm.gemm(rank, "attn_o", T, D, H_t * spec.head_dim))
    ops.append(cm.all_reduce(rank, "tp_all_reduce", lay.tp, T * D * rank.abytes))
    return ops


def dense_mlp_ops(rank: Rank, spec: ModelSpec, T: float) -> list[OpCost]:
    lay, D, I_t = rank.layout, spec.hidden, spec.dense_intermediate / rank.layout.tp
    return [
        cm.gemm(rank, "dense_mlp", T, 2 * I_t, D),
        cm.gemm(rank, "dense_mlp", T, D, I_t),
        cm.all_reduce(rank, "tp_all_reduce", lay.tp, T * D * rank.abytes),
    ]


def moe_ops(rank: Rank, spec: ModelSpec, T: float, imbalance: float) -> tuple[list[OpCost], float]:
    """The MoE block for ``T`` tokens of this replica, and the seconds the overlap of the
    shared expert with the dispatch hides (0 where communication cannot overlap)."""
    lay, sw, D = rank.layout, rank.hw.software, spec.hidden
    E, K, Fs = spec.num_experts, spec.top_k, spec.shared_intermediate
    if not lay.expert_parallel:
        ops = [
            cm.gemm(rank, "router", T, E, D, w_bytes=rank.abytes),
            cm.routed_experts(rank, spec, T, imbalance),
        ]
        if Fs:  # a slot of the expert call where it folds in (DeepSeek): the same path rule
            big = cm.expert_gemm_path(rank, T)
            ops.append(cm.gemm(rank, "shared_expert", T, 2 * Fs / lay.tp, D, large=big))
            ops.append(cm.gemm(rank, "shared_expert", T, D, Fs / lay.tp, large=big))
        ops.append(cm.all_reduce(rank, "tp_all_reduce", lay.tp, T * D * rank.abytes))
        return ops, 0.0
    T_loc = T / lay.tp  # each TP rank routes its share of the replica's rows
    disp_bytes = cm.DTYPE_BYTES[sw.dispatch_dtype]
    # the busiest rank receives more rows than it sends (skewed routing): its all-to-alls
    # move the larger of the two
    rows = cm.rows_on_busiest_rank(T_loc * K, lay.ep, imbalance)
    dispatch = cm.all_to_all(rank, "dispatch", lay.ep, rows * (D * disp_bytes + 8))
    if sw.dispatch_collectives > 1:  # the row-count exchange before the rows
        extra = (sw.dispatch_collectives - 1) * cm.collective_latency(rank, lay.ep)
        dispatch = OpCost("dispatch", COMM, 0.0, dispatch.bytes, dispatch.time_s + extra)
    ops = [
        cm.gemm(rank, "router", T_loc, E, D, w_bytes=rank.abytes),
        dispatch,
        cm.routed_experts(rank, spec, T * lay.dp, imbalance),
        cm.all_to_all(rank, "combine", lay.ep, rows * D * rank.abytes),
    ]
    shared_t = 0.0
    if Fs:
        up = cm.gemm(rank, "shared_expert", T_loc, 2 * Fs, D)
        down = cm.gemm(rank, "shared_expert", T_loc, D, Fs)
        ops += [up, down]
        shared_t = up.time_s + down.time_s
    ops.append(cm.all_gather(rank, "tp_all_gather", lay.tp, T_loc * D * rank.abytes))
    # the rows are sent asynchronously and the shared expert runs meanwhile: with a spare
    # engine for communication it hides under the whole dispatch; otherwise under the wait
    # for the peers (the latency of the rows' all-to-all), unless ranks outnumber the cores
    # and every wait is someone else's compute
    if sw.comm_overlaps_compute:
        hidden = min(shared_t, dispatch.time_s)
    elif rank.cpu_share <= 1:
        hidden = min(shared_t, cm.collective_latency(rank, lay.ep))
    else:
        hidden = 0.0
    return ops, hidden


def _layer(rank: Rank, spec: ModelSpec, moe: bool, T, seqs, q, ctx, decode, imbalance):
    ops = attention_ops(rank, spec, T, seqs, q, ctx, decode)
    hidden = 0.0
    if moe:
        mo, hidden = moe_ops(rank, spec, T, imbalance)
        ops += mo
    else:
        ops += dense_mlp_ops(rank, spec, T)
    return ops, hidden


def layer_time(rank: Rank, spec: ModelSpec, moe: bool, T, seqs, q, ctx, decode, imbalance):
    """(ops at full size for the breakdown, seconds the layer takes with the overlap rules)."""
    ops, hidden = _layer(rank, spec, moe, T, seqs, q, ctx, decode, imbalance)
    plain = sum(o.time_s for o in ops) - hidden
    if not rank.layout.two_batch_overlap:
        return ops, plain
    half, _ = _layer(rank, spec, moe, T / 2, seqs / 2, q, ctx, decode, imbalance)
    c = 2 * sum(o.time_s for o in half if o.kind == COMPUTE)
    m = 2 * sum(o.time_s for o in half if o.kind == COMM)
    t = max(c, m) if rank.hw.software.comm_overlaps_compute else c + m
    # the breakdown shows the two halves' ops summed
    return [OpCost(o.name, o.kind, 2 * o.flops, 2 * o.bytes, 2 * o.time_s) for o in half], t


# ------------------------------------------------------------------------------ one pass


def _fixed(rank: Rank, spec: ModelSpec, seqs: float) -> list[OpCost]:
    """Per-step costs that are not a layer's ops: Python and scheduling, and rank 0's control
    messages to the whole group."""
    sw, lay = rank.hw.software, rank.layout
    layers = spec.num_layers * (2 if lay.two_batch_overlap else 1)
    host_us = (
        sw.step_overhead_us
        + sw.seq_overhead_us * seqs
        + (sw.layer_overhead_us + sw.seq_layer_overhead_us * seqs) * layers
    )
    # rank 0's step message and the gathered outputs go to the whole group; the replica's
    # leader shares the sampled tokens with its tp x pp ranks (half as many collectives)
    ctl = sw.control_collectives * cm.collective_latency(rank, lay.world)
    ctl += sw.control_collectives // 2 * cm.collective_latency(rank, lay.tp * lay.pp)
    return [
        OpCost("host_overhead", OVERHEAD, time_s=host_us * 1e-6 * rank.cpu_share),
        OpCost("control", COMM, time_s=ctl),
    ]


def forward_pass(
    rank: Rank,
    spec: ModelSpec,
    seqs: float,
    q_per_seq: float,
    ctx: float,
    decode: bool,
    logits_rows: float,
    imbalance: float = 1.0,
    mtp_passes: int = 0,
) -> StepCost:
    """``seqs`` sequences of one DP replica, ``q_per_seq`` new tokens each, over a context of
    ``ctx`` tokens (the new ones included), through every layer and the LM head."""
    lay, D = rank.layout, spec.hidden
    T = seqs * q_per_seq
    acc = _Acc()
    acc.add(_fixed(rank, spec, seqs))
    acc.add([OpCost("embedding", COMPUTE, 0, T * D * rank.abytes, 0.0)])
    acc.add([cm.all_reduce(rank, "tp_all_reduce", lay.tp, T * D * rank.abytes)])
    for moe, count in ((False, spec.num_dense_layers), (True, spec.num_moe_layers)):
        if count:
            ops, t = layer_time(rank, spec, moe, T, seqs, q_per_seq, ctx, decode, imbalance)
            acc.add(ops, count, time_s=t)
    if lay.pp > 1:
        crosses = lay.ranks_per_node < lay.tp * lay.pp
        acc.add([cm.send_recv(rank, "pp_send_recv", T * D * rank.abytes, crosses)], lay.pp - 1)
    acc.add(_lm_head(rank, spec, logits_rows))
    for _ in range(mtp_passes):  # one MTP module: a projection, one MoE layer, the LM head
        acc.add([cm.gemm(rank, "mtp", seqs, D, 2 * D)])
        ops, t = layer_time(rank, spec, True, seqs, seqs, 1, ctx, decode, imbalance)
        acc.add([OpCost("mtp", o.kind, o.flops, o.bytes, o.time_s) for o in ops], time_s=t)
        acc.add(
            [OpCost("mtp", o.kind, o.flops, o.bytes, o.time_s) for o in _lm_head(rank, spec, seqs)]
        )
    return acc.result()


def _lm_head(rank: Rank, spec: ModelSpec, rows: float) -> list[OpCost]:
    lay = rank.layout
    return [
        cm.gemm(rank, "lm_head", rows, spec.vocab / lay.tp, spec.hidden),
        cm.all_gather(rank, "tp_all_gather", lay.tp, rows * spec.vocab / lay.tp * 4),
    ]


def decode_step(
    rank: Rank, spec: ModelSpec, seqs: float, ctx: float, imbalance: float = 1.0
) -> StepCost:
    """One decode step of ``seqs`` sequences per DP replica at mean context ``ctx``: the main
    model verifies ``1 + mtp_depth`` tokens per sequence, then the MTP module drafts."""
    d = rank.layout.mtp_depth
    return forward_pass(
        rank, spec, seqs, 1 + d, ctx + d, True, seqs * (1 + d), imbalance, mtp_passes=d
    )


def prefill_step(
    rank: Rank,
    spec: ModelSpec,
    seqs: float,
    new_tokens: float,
    prefix: float = 0.0,
    imbalance: float = 1.0,
) -> StepCost:
    """A prefill of ``seqs`` prompts of ``new_tokens`` each (after ``prefix`` cached ones) per
    DP replica; logits for the last row of each."""
    return forward_pass(rank, spec, seqs, new_tokens, prefix + new_tokens, False, seqs, imbalance)
