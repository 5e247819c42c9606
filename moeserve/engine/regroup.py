"""One rank's engine moved onto the groups of a new generation (elastic EP: after a rank
loss, or as replacements join; ``launch/elastic.py`` forms the groups).

Collective over the new world (every rank calls :func:`regroup_engine` together)::

    gather   what each rank's slots hold, per MoE layer, its expert load (the EPLB window,
             else the counts since start) and its host
    compute  per layer, the same placement on every rank:
               after a loss   over the survivors (``distributed/ep/shrink.py``; too few
                              slots: CannotHoldExperts on every rank)
               as ranks join  EPLB's over every rank, aligned with what each holds
                              (``eplb/grow.py``; a replacement's slots are empty)
    apply    each layer routes over the new EP group; after a loss this rank reads the
             experts it must take from the checkpoint into their slots (sliced loading, as at
             start-up); as ranks join the experts move over the network
             (``distributed/ep/migrate.fill_slots``, the EPLB move machinery)
    forget   every request (rank 0 queues them again; not when ranks joined); the KV cache
             passes its self-check

Returns what it did, for the recovery's timings and logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeserve.distributed.ep.migrate import fill_slots
from moeserve.distributed.ep.placement import EMPTY_SLOT
from moeserve.distributed.ep.shrink import survivor_placement
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import all_gather_json
from moeserve.eplb.grow import grown_placement
from moeserve.models.weights import WeightSpec, load_checkpoint


@dataclass(frozen=True)
class RegroupReport:
    experts_reloaded: int  # from the checkpoint, by this rank
    bytes_read: int  # from the checkpoint, by this rank
    reload_s: float
    bytes_received: int  # from other ranks (replacements joined)
    move_s: float
    requests_dropped: int


def regroup_engine(
    engine, groups: ParallelGroups, drop_requests: bool = True, node: int | None = None
) -> RegroupReport:
    """Move ``engine`` (an ``LLMEngine``) onto ``groups``; see the module's doc. Without
    ``drop_requests`` (replacements joined: no rank was lost) the requests and their KV
    stay. ``node``: the host this rank runs on, when the group spans several (None: one)."""
    blocks = engine.model.moe_blocks()
    mine = {
        "held": [list(b.experts.slot_experts) for _, b in blocks],
        "load": _loads(engine, blocks),
        "node": node,
    }
    parts = all_gather_json(mine, groups.world)
    specs: dict[str, WeightSpec] = {}
    received, move_s = 0, 0.0
    for k, (layer, block) in enumerate(blocks):
        held = [p["held"][k] for p in parts]
        load_E = torch.tensor([p["load"][k] for p in parts], dtype=torch.float64).sum(0)
        nodes = None if any(p["node"] is None for p in parts) else [p["node"] for p in parts]
        E = block.gate.config.num_experts
        if any(EMPTY_SLOT in h for h in held):  # replacements join
            t0 = time.perf_counter()
            placement = grown_placement(held, E, load_E, nodes, _expert_groups(engine))
            old_P = [e for h in held for e in h]
            received += fill_slots(block.experts, old_P, placement, groups.ep.rank, groups.ep.group)
            move_s += time.perf_counter() - t0
            block.reform(groups.ep, placement)
            continue
        shrink = survivor_placement(held, E, nodes, load_E)
        block.reform(groups.ep, shrink.placement)
        for r in shrink.reloads:
            if r.rank == groups.ep.rank:
                prefix = f"model.layers.{layer}.mlp.experts.{r.expert}"
                specs.update(block.experts.slot_specs(prefix, [r.slot]))
    t0 = time.perf_counter()
    bytes_read = 0
    if specs:
        report = load_checkpoint(
            engine.config.model,
            specs,
            engine.dtype,
            fp8=engine.model_config.fp8,
            skip=lambda name: name not in specs,
            progress=False,
        )
        bytes_read = report.num_bytes
    reload_s = time.perf_counter() - t0
    engine.regroup(groups)
    dropped = engine.drop_all_requests() if drop_requests else []
    engine.scheduler.check_integrity()
    return RegroupReport(len(specs) // 3, bytes_read, reload_s, received, move_s, len(dropped))


def _expert_groups(engine) -> int:
    """The expert groups EPLB may keep on one node (1: the global form, as configured)."""
    if engine.config.eplb_algorithm == "global":
        return 1
    return max(1, int(engine.model_config.n_group or 1))


def _loads(engine, blocks) -> list[list[float]]:
    """This rank's recent load per MoE layer and expert: the EPLB window, else the counts
    since the start."""
    if engine.eplb is not None:
        window = engine.eplb.window_stats().local_window()
        if int(window.sum()) > 0:
            return window.double().tolist()
    return [b.expert_counts_E.double().tolist() for _, b in blocks]
