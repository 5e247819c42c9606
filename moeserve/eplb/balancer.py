"""The engine side of EPLB: per-step expert-load statistics, the initial placement, and live
re-placement of the routed experts of this rank's MoE layers.

Shape legend: L MoE layers of this rank's pipeline stage, E logical experts, P physical slots.

One :class:`ExpertBalancer` per rank, driven by its engine::

    every step (on every rank, in lock step)   on_step():
        window  += what each MoEBlock.expert_counts_E gained        (local, no traffic; read
                   when a chunk of the window closes, a re-placement or an outside reader
                   needs it: the counters only grow, so the chunks hold the same counts)
        a re-placement in progress:  move the next layers_per_step layers   (EP collective)
        else every interval steps:   rebalance(): window summed over the EP group,
                                     rebalance_experts -> new tables, queue changed layers
    admin / shutdown                 command("rebalance" | "dump" | "status")

A layer moves (``distributed/ep/migrate.py``) only when the new table is predicted to lower
its imbalance (max over mean tokens per rank) by more than ``min_gain``; the layer routes by
its old table until its weights have arrived, then by the new one, so every step computes
with a consistent placement and outputs do not change. Every rank of the EP group reaches the
same decision: the window is all-reduced and the algorithm is deterministic.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from moeserve.config import EplbOptions
from moeserve.distributed.ep.migrate import move_experts
from moeserve.distributed.ep.placement import ExpertPlacement
from moeserve.eplb.algorithm import imbalance, rank_load, rebalance_experts
from moeserve.eplb.grow import node_count
from moeserve.eplb.stats import (
    ExpertLoadStats,
    ExpertPlacementFile,
    load_expert_location,
    save_expert_stats,
)

logger = logging.getLogger(__name__)


class BalancedBlock(Protocol):
    """What the balancer reads and drives of one MoE layer; ``layers.moe_block.MoEBlock`` is
    one. The engine hands the balancer its model's blocks, so eplb imports no layer."""

    expert_counts_E: torch.Tensor  # [E] int64: tokens routed to each expert since the start
    placement: ExpertPlacement | None  # the slot table it routes by; None without EP
    experts: Any  # the FusedExperts whose slots move_experts refills
    reports_counts: bool  # whether this rank's counts are part of the model's sum

    def set_placement(self, placement: ExpertPlacement) -> None: ...


class ExpertBalancer:
    """Statistics and placement of one rank's MoE layers (``blocks``: ``(model layer index,
    block)``), over the EP group ``ep``; ``world`` gathers a dump on rank 0."""

    def __init__(
        self,
        blocks: list[tuple[int, BalancedBlock]],
        all_moe_layers: list[int],
        ep,
        world,
        options: EplbOptions,
        num_groups: int = 1,
    ) -> None:
        if not blocks:
            raise ValueError("an ExpertBalancer needs at least one MoE layer")
        self.blocks, self.all_moe_layers = blocks, list(all_moe_layers)
        self.layer_ids = [i for i, _ in blocks]
        self.ep, self.world, self.options = ep, world, options
        self.num_experts = blocks[0][1].expert_counts_E.numel()
        self.num_groups = num_groups
        self.stats = ExpertLoadStats(
            len(blocks),
            self.num_experts,
            options.window_steps,
            options.chunk_steps,
            group=ep.group if ep.size > 1 else None,
        )
        self.rebalances = 0
        self.layers_moved = 0
        self.last: dict[int, tuple[float, float]] = {}  # layer -> imbalance (before, after)
        self._queue: list[tuple[int, torch.Tensor]] = []  # (block index, new phy2log_P)

    @classmethod
    def create(
        cls, blocks: list[tuple[int, BalancedBlock]], cfg, groups, options: EplbOptions
    ) -> ExpertBalancer | None:
        """The balancer of an engine's model: ``blocks`` are this stage's MoE layers
        (``MoECausalLM.moe_blocks()``), ``cfg`` the model's ``ModelConfig``. None when
        ``blocks`` is empty. Applies ``options.init_location`` (a collective over the EP
        group)."""
        if not blocks:
            return None
        all_moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        balancer = cls(blocks, all_moe, groups.ep, groups.world, options, cfg.n_group)
        if options.init_location:
            balancer.apply_location(options.init_location)
        return balancer

    def regroup(self, ep, world) -> None:
        """Work over new groups (elastic EP, after a rank loss): the window this rank counted
        stays; a re-placement in progress is dropped (its tables were for the old group)."""
        self.ep, self.world = ep, world
        self.stats.group = ep.group if ep.size > 1 else None
        self._queue = []

    # -- placement ------------------------------------------------------------------------

    @property
    def expert_parallel(self) -> bool:
        return self.blocks[0][1].placement is not None

    @property
    def num_physical(self) -> int:
        p = self.blocks[0][1].placement
        return p.num_physical if p is not None else self.num_experts

    def current_tables(self) -> torch.Tensor:
        """``[L, P]``: the slot table each layer routes by now."""
        return torch.stack([b.placement.phys2log_P for _, b in self.blocks])

    def _nodes(self) -> int:
        """Nodes of the EP group as the algorithm sees them (equal, contiguous), else 1."""
        return node_count(self.blocks[0][1].placement.node_of_rank)

    def compute_tables(self, load_LE: torch.Tensor) -> torch.Tensor:
        """``[L, P]``: the placement ``options.algorithm`` gives for ``load_LE``."""
        groups, nodes = self.num_groups, self._nodes()
        if self.options.algorithm == "global":
            groups = nodes = 1
        elif self.options.algorithm == "hierarchical" and groups % nodes:
            raise ValueError(
                f"eplb_algorithm=hierarchical needs the {groups} expert groups to split over "
                f"the {nodes} nodes; use auto or global"
            )
        phy2log_LP, _, _ = rebalance_experts(
            load_LE.to(torch.float64), self.num_physical, groups, nodes, self.ep.size
        )
        return phy2log_LP

    def apply_location(self, path: str) -> None:
        """Set the placement from a placement or raw-stats file, moving weights at once."""
        loc = load_expert_location(
            path,
            len(self.all_moe_layers),
            self.num_experts,
            self.num_physical if self.expert_parallel else None,
            self.all_moe_layers,
        )
        rows = [self.all_moe_layers.index(i) for i in self.layer_ids]
        if not self.expert_parallel:
            if isinstance(loc, ExpertPlacementFile):
                raise ValueError(
                    f"{path}: a placement needs expert parallelism (--enable-expert-parallel)"
                )
            logger.info("EPLB: %s holds stats; one rank holds every expert, nothing to place", path)
            return
        if isinstance(loc, ExpertPlacementFile):
            tables = loc.phy2log_LP[rows]
        else:
            tables = self.compute_tables(loc.load_LE[rows])
        for b, table in enumerate(tables):
            self._move(b, table)
        logger.info("EPLB: initial placement from %s", path)

    def _move(self, b: int, table_P: torch.Tensor) -> None:
        _, block = self.blocks[b]
        old = block.placement
        new = old.with_table(table_P)
        if torch.equal(old.phys2log_P, new.phys2log_P):
            return
        move_experts(block.experts, old, new, self.ep.rank, self.ep.group)
        block.set_placement(new)
        self.layers_moved += 1

    # -- the step hook --------------------------------------------------------------------

    def on_step(self) -> None:
        """Once per engine step on every rank: count, and move or plan (see module doc).
        The blocks' counters are read into the window when its open chunk closes or a
        re-placement reads it, and by every outside reader (:meth:`window_stats`): reading
        them every step cost ~0.2 ms a step (a handful of torch ops, each slow between weight
        streams), and the chunks hold the same counts either way."""
        due = (
            not self._queue
            and self.options.enable
            and self.expert_parallel
            and (self.stats.steps + 1) % self.options.interval_steps == 0
        )
        if due or self.stats.closes_chunk():
            self._count()
        self.stats.step()
        if self._queue:
            for _ in range(min(self.options.layers_per_step, len(self._queue))):
                self._move(*self._queue.pop(0))
        elif due:
            self.rebalance(now=False)

    def _count(self) -> None:
        """Add what the blocks' counters gained since the last call to the open chunk."""
        self.stats.add_totals(torch.stack([b.expert_counts_E for _, b in self.blocks]))

    def window_stats(self) -> ExpertLoadStats:
        """The window statistics with every count so far added."""
        self._count()
        return self.stats

    def rebalance(self, now: bool = False) -> dict:
        """Plan a new placement from the window (collective over the EP group) and queue the
        layers it improves; ``now`` moves them all before returning (else ``layers_per_step``
        per step). Returns ``{layer: {"before", "after", "moved"}}``."""
        if not self.expert_parallel:
            raise ValueError("EPLB re-placement needs expert parallelism (--ep N)")
        load_LE = self.window_stats().window()
        t0 = time.perf_counter()
        current_LP = self.current_tables()
        new_LP = self.compute_tables(load_LE)
        R = self.ep.size
        before_L = imbalance(rank_load(load_LE, current_LP, R))
        after_L = imbalance(rank_load(load_LE, new_LP, R))
        self._queue = []
        report = {}
        for b, layer in enumerate(self.layer_ids):
            gain = float(before_L[b] - after_L[b])
            moved = gain > self.options.min_gain and not torch.equal(new_LP[b], current_LP[b])
            if moved:
                self._queue.append((b, new_LP[b]))
            after = float(after_L[b]) if moved else float(before_L[b])
            self.last[layer] = (float(before_L[b]), after)
            report[layer] = {"before": float(before_L[b]), "after": after, "moved": moved}
        self.rebalances += 1
        logger.info(
            "EPLB rebalance over %d steps (%.1f ms): imbalance per layer %s -> %s; %d layers "
            "to move",
            self.stats.window_covers_steps,
            1e3 * (time.perf_counter() - t0),
            [round(float(x), 3) for x in before_L],
            [round(v["after"], 3) for v in report.values()],
            len(self._queue),
        )
        if now:
            while self._queue:
                self._move(*self._queue.pop(0))
        return report

    # -- outside calls --------------------------------------------------------------------

    def dump(self, path: str | None = None) -> dict:
        """Write the window of every MoE layer (summed over the EP group, gathered over the
        world) to ``path`` (default ``options.stats_out``) on world rank 0. Collective."""
        path = path or self.options.stats_out
        if not path:
            raise ValueError("no file to dump the expert statistics to: pass a path")
        load_LE = self.window_stats().window()
        mine = {str(i): row for i, row in zip(self.layer_ids, load_LE.tolist())}
        from moeserve.distributed.objects import all_gather_json

        merged: dict[str, list[int]] = {}
        for part in all_gather_json(mine, self.world):
            merged.update(part or {})
        if self.world.rank == 0:
            missing = [i for i in self.all_moe_layers if str(i) not in merged]
            if missing:
                raise ValueError(f"no statistics for MoE layers {missing}")
            table = torch.tensor([merged[str(i)] for i in self.all_moe_layers], dtype=torch.int64)
            save_expert_stats(path, table, self.stats.window_covers_steps, self.all_moe_layers)
            logger.info("EPLB: wrote the expert statistics to %s", path)
        return {"path": str(Path(path)), "steps": self.stats.window_covers_steps}

    def command(self, action: str, path: str | None = None) -> dict:
        """``rebalance`` (now), ``dump`` or ``status``; every rank of the world calls it."""
        if action == "rebalance":
            report = self.rebalance(now=True)
            return {"layers": {str(k): v for k, v in report.items()}}
        if action == "dump":
            return self.dump(path)
        if action == "status":
            return self.metrics()
        raise ValueError(f"unknown EPLB action {action!r}; use rebalance, dump or status")

    def metrics(self) -> dict:
        """This rank's share, without communication: its window counts of the layers it
        reports (summed over ranks they are the group's), the slot tables, and the imbalance
        before and after the last re-placement."""
        window = self.window_stats().local_window().tolist()
        return {
            "window": {str(i): row for (i, b), row in zip(self.blocks, window) if b.reports_counts},
            "window_steps": self.stats.window_covers_steps,
            "placement": (
                {str(i): b.placement.phys2log_P.tolist() for i, b in self.blocks}
                if self.expert_parallel
                else {}
            ),
            "ep_size": self.ep.size,
            "last_rebalance": {str(k): list(v) for k, v in self.last.items()},
            "rebalances": self.rebalances,
            "layers_moved": self.layers_moved,
        }


def run_command(
    balancer: ExpertBalancer | None, action: str, path: str | None = None, world=None
) -> dict:
    """:meth:`ExpertBalancer.command` as a JSON-able answer: ``{"result": ...}`` or
    ``{"error": "..."}``. A rank without MoE layers answers ``{"result": None}``; in a dump
    it still joins the gather over ``world`` that the other ranks make."""
    if balancer is None:
        if action == "dump" and world is not None:
            from moeserve.distributed.objects import all_gather_json

            all_gather_json({}, world)
        return {"result": None}
    try:
        return {"result": balancer.command(action, path)}
    except (ValueError, OSError) as e:
        return {"error": str(e)}
