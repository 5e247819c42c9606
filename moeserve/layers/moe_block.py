"""The MoE layer: router, routed experts, shared experts, under each parallel layout.

Shape legend: T tokens, Tl this TP rank's share of them, D model dim, E logical experts,
K top-k, R rows dispatched to this rank.

    one process        gate -> experts (all E) -> + shared; a shared expert as wide as a
                       routed one and ungated (DeepSeek) is slot E of the routed experts,
                       so one call computes both
    TP, no EP          every rank: all E experts with F / tp each; shared expert split the
                       same way; one all-reduce over tp sums routed + shared partials
    EP (= tp x dp)     rank holds E / ep experts (slots from an ExpertPlacement table);
                       each TP rank routes its Tl rows, dispatches them to the owners
                       (all-to-all), the replicated shared expert runs while the dispatch is
                       in flight, combine brings rows back; an all-gather over tp rebuilds T
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeserve.distributed.ep.all_to_all import AllToAllDispatcher
from moeserve.distributed.ep.moe_step import ep_moe_forward
from moeserve.distributed.ep.placement import ExpertPlacement
from moeserve.distributed.groups import Axis, ParallelGroups
from moeserve.layers.linear import GatedMLP, Linear
from moeserve.layers.moe import FusedExperts, Router
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu import amx, amx_int8, kernels, moe_sort
from moeserve.ops.cpu import int8 as int8_kernels
from moeserve.ops.linear import BoundLinear
from moeserve.quant.int8 import as_int8


@dataclass(frozen=True)
class MoEOptions:
    overlap: bool = True  # run the shared experts while the dispatch is in flight
    two_batch: bool = False  # split each batch into two micro-batches around the all-to-alls
    num_redundant_experts: int = 0
    num_nodes: int = 1  # hosts the world spans (replicas on a token's own node come first)

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError("num_redundant_experts must be >= 0")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")


class MoEBlock(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype=torch.float32,
        groups: ParallelGroups | None = None,
        options: MoEOptions | None = None,
    ) -> None:
        super().__init__()
        groups = groups or ParallelGroups.single()
        self.options = options or MoEOptions()
        self.tp, self.ep = groups.tp, groups.ep
        E, D = config.num_experts, config.hidden_size
        self.gate = Router(config)
        if self.ep.size > 1:
            self.placement = ExpertPlacement.contiguous(
                E, self.ep.size, self.options.num_redundant_experts, self._ep_nodes(groups)
            )
            self.dispatcher = AllToAllDispatcher(self.ep.group)
            slots = self.placement.local_logical(self.ep.rank)
            expert_tp = shared_tp = Axis.single("tp")  # whole experts; shared replicated
        else:
            if self.options.num_redundant_experts:
                raise ValueError("redundant experts need expert parallelism")
            self.placement = None
            slots = list(range(E))
            expert_tp = shared_tp = self.tp
        # without EP, an ungated shared expert as wide as a routed one (DeepSeek) is one more
        # slot of the routed experts (slot E, weight 1 for every token): one call computes
        # routed and shared together. Under EP it stays apart, to run during the dispatch.
        shared_F = config.shared_expert_intermediate_size
        fold = (
            self.placement is None
            and bool(shared_F)
            and shared_F == config.moe_intermediate_size
            and not config.shared_expert_gate
        )
        self.shared_slot = E if fold else None
        self.experts = FusedExperts(
            slots, D, config.moe_intermediate_size, dtype, expert_tp, extra_slots=int(fold)
        )
        self.shared = (
            GatedMLP(D, shared_F, dtype, shared_tp, reduce=False) if shared_F and not fold else None
        )
        self.shared_gate = (
            Linear(D, 1, dtype=dtype)
            if (self.shared is not None and config.shared_expert_gate)
            else None
        )
        self.shared_name = "shared_expert" if config.shared_expert_gate else "shared_experts"
        # tokens routed to each logical expert since start (metrics, EPLB). Under EP every rank
        # routes its own rows, so the ranks' counts add up; without EP the TP ranks route the
        # same rows and only TP rank 0 reports.
        self.register_buffer("expert_counts_E", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.reports_counts = self.placement is not None or self.tp.rank == 0
        # the decode step as prebound kernel calls (built on first use; False: not here)
        self._decode_calls: MoEDecodeCalls | bool | None = None

    def process_weights_after_loading(self) -> None:
        self._decode_calls = None  # weights change: bind again on the next step

    def _ep_nodes(self, groups: ParallelGroups) -> tuple[int, ...] | None:
        """The node of each EP rank, when the world spans several (equal) nodes."""
        world, nodes = groups.dims.world_size, self.options.num_nodes
        if nodes == 1 or world % nodes:
            return None
        return tuple(r // (world // nodes) for r in self.ep.ranks)

    def owns_expert(self, e: int) -> bool:
        return e in self.experts.local_experts

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from now on; the caller has already put its experts into this
        rank's slots (``distributed/ep/migrate.py``). Raises ValueError without EP or when the
        slot count or EP size differs."""
        old = self.placement
        if old is None or (placement.num_physical, placement.ep_size) != (
            old.num_physical,
            old.ep_size,
        ):
            raise ValueError(
                "set_placement needs expert parallelism and a placement with the same slots "
                "and EP size as the current one"
            )
        self.placement = placement
        self.experts.slot_experts = placement.local_logical(self.ep.rank)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.placement is None:
            calls = self._decode_calls
            if calls is None or (calls and not calls.fresh()):
                calls = self._decode_calls = MoEDecodeCalls.bind(self)
            y_TD = calls(x_TD) if calls else None
            if y_TD is not None:
                if self.shared is not None:
                    y_TD = y_TD + self._shared(x_TD)
                return self.tp.all_reduce(y_TD)
            # routed choices counted; every token also to the shared slot when it is folded
            topk_w_TK, topk_ids_TK = self.gate(x_TD, self.expert_counts_E, self.shared_slot)
            y_TD = self.experts(x_TD, topk_w_TK, topk_ids_TK)
            if self.shared is not None:
                y_TD = y_TD + self._shared(x_TD)
            return self.tp.all_reduce(y_TD)
        return self._forward_ep(x_TD)

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        s_TD = self.shared(x_TD)
        if self.shared_gate is not None:
            s_TD = torch.sigmoid(self.shared_gate(x_TD)) * s_TD
        return s_TD

    def _forward_ep(self, x_TD: torch.Tensor) -> torch.Tensor:
        T, tp = x_TD.shape[0], self.tp
        # the TP ranks of a replica hold the same T rows: each routes and dispatches its share
        chunk = -(-T // tp.size)
        x_local = x_TD[tp.rank * chunk : (tp.rank + 1) * chunk]
        topk_w, topk_ids = self.gate(x_local, self.expert_counts_E)
        y_local = ep_moe_forward(
            x_local,
            topk_w,
            topk_ids,
            self.experts.compute_sorted,
            self._shared if self.shared is not None else None,
            self.dispatcher,
            self.placement,
            overlap=self.options.overlap,
            two_batch=self.options.two_batch,
        )
        if tp.size == 1 or chunk == 0:
            return y_local
        pad = chunk - y_local.shape[0]
        if pad:
            y_local = torch.cat((y_local, y_local.new_zeros(pad, y_local.shape[1])))
        return tp.all_gather(y_local, dim=0)[:T]

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        specs = {**self.gate.weight_specs(f"{prefix}.gate")}
        specs.update(self.experts.weight_specs(f"{prefix}.experts"))
        if self.shared is not None:
            specs.update(self.shared.weight_specs(f"{prefix}.{self.shared_name}"))
        if self.shared_slot is not None:
            shared_prefix = f"{prefix}.{self.shared_name}"
            specs.update(self.experts.slot_specs(shared_prefix, [self.shared_slot]))
        if self.shared_gate is not None:
            specs.update(self.shared_gate.weight_specs(f"{prefix}.shared_expert_gate"))
        return specs


class MoEDecodeCalls:
    """The routed experts of a decode step (few rows, no EP) as kernel calls whose arguments
    are derived once: router logits, routing (``kernels.c``), the pairs sorted by expert and
    gathered (``moe_sort.c``), the one-call MoE kernel (int8, w8a8_int8 and bf16 weights
    directly, fp32 through ``kernels.moe_experts``), the rows added back per token. The torch
    path of :meth:`MoEBlock.forward` (``FusedExperts``, ``moe_grouped``) is the reference and
    runs where this does not apply; the two agree bit for bit."""

    def __init__(self, block: MoEBlock) -> None:
        c, gate, experts = block.gate.config, block.gate, block.experts
        self.block = block
        self.gate = BoundLinear(gate.weight)
        self.num_slots = experts.w13_EFD.shape[0]
        self.D, self.F = experts.w13_EFD.shape[2], experts.w13_EFD.shape[1] // 2
        extra = -1 if block.shared_slot is None else block.shared_slot
        self.K = c.num_experts_per_tok + (extra >= 0)
        bias = gate.e_score_correction_bias
        self.route_fn = kernels._library().moeserve_route_grouped_sigmoid
        self.route_const = (c.num_experts, c.n_group, c.topk_group, c.num_experts_per_tok)
        self.route_mid = (None if bias is None else bias.data_ptr(), int(c.norm_topk_prob))
        self.route_mid += (c.routed_scaling_factor,)
        self.extra = extra
        self.counts = block.expert_counts_E
        self.sort_fn = moe_sort._library().moeserve_moe_sort
        self.combine_fn = moe_sort._library().moeserve_moe_combine
        q13, q2 = as_int8(experts.w13_EFD), as_int8(experts.w2_EDF)
        self.int8_fn = self.w8a8_fn = None
        self.max_rows = kernels.MAX_ROWS
        if q13 is not None:
            self.int8_w = tuple(t.data_ptr() for t in (q13.q, q13.scale, q2.q, q2.scale))
            self.max_rows = int8_kernels.MAX_ROWS  # decode batches; more go to experts_sorted
        if q13 is not None and q13.act_int8:  # w8a8_int8 on AMX: amx_int8.c directly
            self.w8a8_fn = amx_int8._library().moeserve_amx_i8_moe
        elif q13 is not None:
            self.int8_fn = int8_kernels._library().moeserve_int8_moe_small
        self.amx_fn = None  # bf16 weights (--quantization bf16, on AMX): amx.c directly
        bf16 = (experts.w13_EFD, experts.w2_EDF) if q13 is None else ()
        if bf16 and bf16[0].dtype == torch.bfloat16:
            self.amx_fn = amx._library().moeserve_amx_moe
            self.amx_w = tuple(t.data_ptr() for t in bf16)
        else:
            bf16 = ()
        self.wide = int(kernels.wide())
        # every tensor whose address the calls use, with that address
        w = (q13.q, q13.scale, q2.q, q2.scale) if q13 is not None else bf16
        w += (*(() if bias is None else (bias,)), self.counts)
        self.pointers = [(t, t.data_ptr()) for t in w] + list(self.gate.pointers)
        self.T = 0  # the row count the buffers below are for

    def fresh(self) -> bool:
        """Whether the block still has the weights and counts bound, at the same addresses
        (loading or moving weights into huge pages replaces them)."""
        for t, ptr in self.pointers:
            if t.data_ptr() != ptr:
                return False
        return self.counts is self.block.expert_counts_E

    @staticmethod
    def bind(block: MoEBlock) -> MoEDecodeCalls | bool:
        """The calls for ``block``, or False where they do not apply (EP, softmax routing, no
        kernels here, weights off the CPU or not fp32/int8 contiguous)."""
        gate, experts = block.gate, block.experts
        c = gate.config
        w13, w2 = experts.w13_EFD, experts.w2_EDF
        q13, q2 = as_int8(w13), as_int8(w2)
        if q13 is not None and q2 is not None and q13.act_int8:
            weights = (q13.q, q13.scale, q2.q, q2.scale)
            ok_weights = q2.act_int8 and amx_int8.weight_ok(q13) and amx_int8.weight_ok(q2)
            ok_weights = ok_weights and amx_int8.available()
        elif q13 is not None and q2 is not None:
            weights = (q13.q, q13.scale, q2.q, q2.scale)
            ok_weights = int8_kernels.available()
        elif q13 is None and q2 is None:
            weights = (w13, w2)
            ok_weights = w13.dtype == w2.dtype == torch.float32 or (
                w13.dtype == w2.dtype == torch.bfloat16
                and amx.available()
                and w13.shape[2] % amx.K_ALIGN == 0
                and w2.shape[2] % amx.K_ALIGN == 0
            )
        else:
            return False
        bias = gate.e_score_correction_bias
        counts = block.expert_counts_E
        ok = (
            block.placement is None
            and gate.sigmoid
            and ok_weights
            and all(t.device.type == "cpu" and t.is_contiguous() for t in weights)
            and gate.weight.dtype == torch.float32
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and counts.dtype == torch.int64
            and counts.is_contiguous()
            and c.num_experts <= 1024
            and c.n_group <= 256
            and c.num_experts_per_tok <= c.topk_group * (c.num_experts // c.n_group)
            and kernels.available()
            and moe_sort.available()
        )
        if not ok:
            return False
        calls = MoEDecodeCalls(block)
        return calls if calls.gate.fn is not None else False

    def _prepare(self, T: int) -> None:
        """Buffers for T rows, reused by every step of that size."""
        R, D = T * self.K, self.D
        self.logits = torch.empty(T, self.route_const[0], dtype=torch.float32)
        self.ids = torch.empty(T, self.K, dtype=torch.int64)
        self.w = torch.empty(T, self.K, dtype=torch.float32)
        self.meta = torch.empty(3, R, dtype=torch.int64)  # expert, first row, rows
        self.token = torch.empty(R, dtype=torch.int64)
        self.weight = torch.empty(R, dtype=torch.float32)
        self.x_sorted = torch.empty(R, D, dtype=torch.float32)
        self.h = torch.empty(R, 2 * self.F, dtype=torch.float32)
        self.y_sorted = torch.empty(R, D, dtype=torch.float32)
        self.route_out = (self.ids.data_ptr(), self.w.data_ptr())
        m = self.meta
        self.sort_args = (T, self.K, self.num_slots, self.ids.data_ptr(), self.w.data_ptr())
        self.sort_out = (D, m[0].data_ptr(), m[1].data_ptr(), m[2].data_ptr())
        self.sort_out += (self.token.data_ptr(), self.weight.data_ptr(), self.x_sorted.data_ptr())
        self.int8_meta = (m[0].data_ptr(), m[1].data_ptr(), m[2].data_ptr(), D, self.F)
        self.int8_meta += (self.x_sorted.data_ptr(),)
        self.int8_out = (self.weight.data_ptr(), self.h.data_ptr(), self.y_sorted.data_ptr())
        # the AMX calls pad each expert's rows to 16: at most 15 more per expert hit
        P = R + 15 * min(R, self.num_slots)
        if self.w8a8_fn is not None:
            self.w8a8_ws = amx_int8.MoEWorkspace(P, D, self.F)
            self.w8a8_args = (*self.int8_meta, *self.int8_w, self.weight.data_ptr())
            self.w8a8_args += (self.y_sorted.data_ptr(), *self.w8a8_ws.pointers())
        if self.amx_fn is not None:
            self.amx_h = torch.empty(P, 2 * self.F, dtype=torch.float32)
            self.amx_xp, self.amx_hp = amx._packed(P, D), amx._packed(P, self.F)
            self.amx_x = (*self.int8_meta, 1, *self.amx_w, self.weight.data_ptr())
            self.amx_out = (self.y_sorted.data_ptr(), 1, self.amx_xp.data_ptr())
            self.amx_out += (self.amx_h.data_ptr(), self.amx_hp.data_ptr())
        self.T = T

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        """The routed (and folded shared) experts' output ``[T, D]`` for few fp32 rows, the
        choices counted; None, having done nothing, where the kernels do not take them."""
        if not kernels.few_rows(x_TD, self.max_rows):
            return None
        T = x_TD.shape[0]
        if T != self.T:
            self._prepare(T)
        self.gate(x_TD, self.logits)
        self.route_fn(
            T, *self.route_const, self.logits.data_ptr(), *self.route_mid, *self.route_out,
            self.counts.data_ptr(), self.extra,
        )  # fmt: skip
        G = self.sort_fn(*self.sort_args, x_TD.data_ptr(), x_TD.stride(0), *self.sort_out)
        if G < 0:  # the routing kernel only writes ids in [0, E): a broken invariant
            raise RuntimeError(f"MoE decode: an expert id outside [0, {self.num_slots})")
        if self.int8_fn is not None:
            self.int8_fn(G, *self.int8_meta, *self.int8_w, *self.int8_out, self.wide)
            y_RD = self.y_sorted
        elif self.w8a8_fn is not None:
            self.w8a8_fn(G, *self.w8a8_args)
            y_RD = self.y_sorted
        elif self.amx_fn is not None:  # fp32 rows in and out (the 1s), bf16 weights
            self.amx_fn(G, *self.amx_x, *self.amx_out)
            y_RD = self.y_sorted
        else:  # fp32: the kernel through its wrapper, which takes the groups as lists
            experts, _starts, counts = self.meta[:, :G].tolist()
            e = self.block.experts
            y_RD = kernels.moe_experts(
                self.x_sorted, experts, counts, e.w13_EFD, e.w2_EDF, self.weight
            )
        if T == 1:  # the reference's sum, so the result matches it bit for bit
            return y_RD.sum(dim=0, keepdim=True)
        y_TD = torch.empty(T, self.D, dtype=torch.float32)
        self.combine_fn(
            T * self.K, T, self.D, y_RD.data_ptr(), self.token.data_ptr(), y_TD.data_ptr()
        )
        return y_TD
