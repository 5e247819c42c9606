"""One rank's engine moved onto the groups of a new generation (elastic EP, after a rank
loss; ``launch/elastic.py`` forms the groups).

Collective over the new world (every survivor calls :func:`regroup_engine` together)::

    gather   what each rank's slots hold, per MoE layer, its expert load (the EPLB window,
             else the counts since start) and its node
    compute  per layer, the placement over the survivors (``distributed/ep/shrink.py``: the
             same on every rank; CannotHoldExperts on every rank when the slots are too few)
    apply    each layer routes over the new EP group; this rank reads the experts it must
             take from the checkpoint into their slots (sliced loading, as at start-up)
    forget   every request (rank 0 queues them again; not when a replacement joined); the
             KV cache passes its self-check

Returns what it did, for the recovery's timings and logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeserve.distributed.ep.shrink import survivor_placement
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import all_gather_json
from moeserve.models.weights import WeightSpec, load_checkpoint


@dataclass(frozen=True)
class RegroupReport:
    experts_reloaded: int  # by this rank
    bytes_read: int  # from the checkpoint, by this rank
    reload_s: float
    requests_dropped: int


def regroup_engine(engine, groups: ParallelGroups, drop_requests: bool = True) -> RegroupReport:
    """Move ``engine`` (an ``LLMEngine``) onto ``groups``; see the module's doc. Without
    ``drop_requests`` (a replacement joined: no rank was lost) the requests and their KV
    stay."""
    blocks = engine.model.moe_blocks()
    loads = _loads(engine, blocks)
    mine = {
        "held": [list(b.experts.slot_experts) for _, b in blocks],
        "load": loads,
        "node": [_node(b) for _, b in blocks],
    }
    parts = all_gather_json(mine, groups.world)
    specs: dict[str, WeightSpec] = {}
    for k, (layer, block) in enumerate(blocks):
        held = [p["held"][k] for p in parts]
        load_E = torch.tensor([p["load"][k] for p in parts], dtype=torch.float64).sum(0)
        nodes = [p["node"][k] for p in parts]
        shrink = survivor_placement(
            held, block.gate.config.num_experts, None if None in nodes else nodes, load_E
        )
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
    return RegroupReport(len(specs) // 3, bytes_read, reload_s, len(dropped))


def _loads(engine, blocks) -> list[list[float]]:
    """This rank's recent load per MoE layer and expert: the EPLB window, else the counts
    since the start."""
    if engine.eplb is not None:
        window = engine.eplb.stats.local_window()
        if int(window.sum()) > 0:
            return window.double().tolist()
    return [b.expert_counts_E.double().tolist() for _, b in blocks]


def _node(block) -> int | None:
    nodes = block.placement.node_of_rank
    return None if nodes is None else nodes[block.ep.rank]
