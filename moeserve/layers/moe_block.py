"""The MoE layer: router, routed experts, shared experts, under each parallel layout.

Shape legend: T tokens, Tl this TP rank's share of them, D model dim, E logical experts,
K top-k, R rows dispatched to this rank.

    one process        gate -> the single-rank dispatcher (a sort by expert) -> experts
                       (all E) -> combine -> + shared: the EP step with LocalDispatcher; a
                       shared expert as wide as a routed one and ungated (DeepSeek) is slot E
                       of the routed experts, so one call computes both
    TP, no EP          every rank: all E experts with F / tp each; shared expert split the
                       same way; one all-reduce over tp sums routed + shared partials
    EP (= tp x dp)     rank holds E / ep experts (slots from an ExpertPlacement table);
                       each TP rank routes its Tl rows, dispatches them to the owners
                       (all-to-all), the replicated shared expert runs while the dispatch is
                       in flight, combine brings rows back; an all-gather over tp rebuilds T
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moeserve.config import MoEOptions
from moeserve.distributed.ep.all_to_all import AllToAllDispatcher
from moeserve.distributed.ep.local import LocalDispatcher
from moeserve.distributed.ep.moe_step import ep_moe_forward
from moeserve.distributed.ep.placement import EMPTY_SLOT, ExpertPlacement
from moeserve.distributed.groups import Axis, ParallelGroups
from moeserve.layers.linear import GatedMLP, Linear
from moeserve.layers.moe import FusedExperts, Router
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu.bound import Guard, calls_guard
from moeserve.ops.cpu.moe_decode import GroupedRouting, MoEDecodeCalls
from moeserve.ops.moe import bind_moe_decode


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
            # without its process group (a replacement loading before it joins: elastic EP)
            # the layer waits for reform() to route; its slots stay empty (nothing is read
            # from the checkpoint): the members fill them over the network as it joins
            detached = self.ep.group is None
            self.dispatcher = LocalDispatcher() if detached else AllToAllDispatcher(self.ep.group)
            slots = self.placement.local_logical(self.ep.rank)
            if detached:
                slots = [EMPTY_SLOT] * len(slots)
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
        if self.placement is None:  # one EP rank: slot e = expert e (and the folded shared)
            self.dispatcher = LocalDispatcher()
            self.local_placement = ExpertPlacement.contiguous(len(slots) + int(fold), 1)
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

    def use_decode_calls(self, enabled: bool = True) -> None:
        """Decode through the prebound kernel calls (bound again on the next step), or, not
        ``enabled``, through the modules in torch (what hooks on the submodules see; the
        kernels' reference)."""
        self._decode_calls = None if enabled else False

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

    def release_group(self) -> None:
        """Drop the handles on the EP process group (elastic EP, as it fails); :meth:`reform`
        gives new ones. Routes nowhere meanwhile."""
        self.ep = dataclasses.replace(self.ep, group=None)
        self.dispatcher = LocalDispatcher()

    def reform(self, ep: Axis, placement: ExpertPlacement) -> None:
        """Route over a new EP group by ``placement`` from now on (elastic EP, after a rank
        loss): this rank keeps its slots, the caller fills those whose expert changed.
        Raises ValueError without EP or when the slots per rank differ."""
        if self.placement is None or placement.slots_per_rank != self.placement.slots_per_rank:
            raise ValueError("reform needs expert parallelism and the same slots per rank")
        if placement.ep_size != ep.size:
            raise ValueError(f"a placement over {placement.ep_size} ranks for {ep.size}")
        self.ep, self.placement = ep, placement
        self.dispatcher = AllToAllDispatcher(ep.group) if ep.size > 1 else LocalDispatcher()
        self.experts.slot_experts = placement.local_logical(ep.rank)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.placement is None:
            calls = self.decode_calls()
            y_TD = calls(x_TD) if calls is not None else None
            if y_TD is not None:
                if self.shared is not None:
                    y_TD = y_TD + self._shared(x_TD)
                return self.tp.all_reduce(y_TD)
            # routed choices counted; every token also to the shared slot when it is folded
            topk_w_TK, topk_ids_TK = self.gate(x_TD, self.expert_counts_E, self.shared_slot)
            y_TD = ep_moe_forward(
                x_TD,
                topk_w_TK,
                topk_ids_TK,
                self.experts.compute_sorted,
                self._shared if self.shared is not None else None,
                self.dispatcher,
                self.local_placement,
                overlap=False,
            )
            return self.tp.all_reduce(y_TD)
        return self._forward_ep(x_TD)

    def decode_calls(self) -> MoEDecodeCalls | None:
        """The routed experts' prebound decode calls, bound again where the weights moved;
        None where they do not apply (EP, softmax routing, no kernels) or are switched off
        (:meth:`use_decode_calls`)."""
        calls = self._decode_calls
        if calls is None or (calls and not calls.fresh(self.expert_counts_E)):
            calls = self._decode_calls = self._bind_decode()
        return calls or None

    def whole_decode_calls(self) -> MoEDecodeCalls | None:
        """:meth:`decode_calls` where they compute the block's whole output (the shared expert
        folded in, no all-reduce after): what the decode stack may run in the block's place."""
        if self.shared is not None or self.tp.size > 1:
            return None
        return self.decode_calls()

    def decode_guard(self) -> Guard:
        """What :meth:`whole_decode_calls` checks, as a guard (``ops/cpu/bound.py``): it holds
        while that would return the calls it returned last, bound to the same rows."""
        calls = self._decode_calls
        same = [(self, "shared", self.shared), (self, "tp", self.tp)]
        same.append((self, "_decode_calls", calls))
        if not calls:
            return Guard(same)
        return calls_guard(calls, [*same, (self, "expert_counts_E", calls.counts)])

    def _bind_decode(self) -> MoEDecodeCalls | bool:
        """The routed experts of a decode step (few rows, no EP, DeepSeek's sigmoid routing)
        as prebound kernel calls, or False where they do not apply."""
        gate, c = self.gate, self.gate.config
        if self.placement is not None or not gate.sigmoid:
            return False
        routing = GroupedRouting(
            c.num_experts,
            c.n_group,
            c.topk_group,
            c.num_experts_per_tok,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        calls = bind_moe_decode(
            gate.weight,
            routing,
            gate.e_score_correction_bias,
            self.expert_counts_E,
            self.experts.w13_EFD,
            self.experts.w2_EDF,
            -1 if self.shared_slot is None else self.shared_slot,
        )
        return False if calls is None else calls

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
