"""What every rank of an engine group does with rank 0's messages, one at a time (the worker
loop, :func:`serve_steps`), and the step they take together. Each step::

    rank 0    msg = {cmd: step, add: [...], abort: [...], finish: [...]}  -- broadcast (JSON)
    all       apply the adds meant for their replica, the aborts and the samples finished by
              the caller (stop strings found by the API server); engine.step()
              (a replica with nothing to run joins the expert all-to-alls with an empty batch)
    all       replica leaders' RequestOutputs are gathered to every rank (JSON); rank 0
              returns them to its caller (with ``stats: true`` in the step's message, every
              rank's :meth:`LLMEngine.stats` without the self-check rides on that gather)

``{cmd: stats}`` gathers every rank's :meth:`LLMEngine.stats`; ``{cmd: ping}`` only wakes the
workers (their wait is a collective with a timeout, so rank 0 pings a quiet group every few
seconds from a background thread); ``{cmd: grow}`` (elastic EP) forms the next generation
with the replacements waiting to join; ``{cmd: stop}`` ends the workers' loops. Rank 0's side
is ``launch/engine_group.EngineGroup``.
"""

from __future__ import annotations

from moeserve.core import RequestOutput
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import all_gather_json, broadcast_json
from moeserve.engine import codec
from moeserve.engine.engine import LLMEngine
from moeserve.eplb.balancer import run_command
from moeserve.launch.elastic import GroupEnded
from moeserve.launch.group_disagg import KV_MODE
from moeserve.launch.ledger import Tracked
from moeserve.launch.liveness import stall_dump
from moeserve.launch.recovery import ElasticRank

STEP, STOP, INFO, STATS, PING = "step", "stop", "info", "stats", "ping"
GROW = "grow"  # elastic EP: replacements wait to join; every member forms the next generation
EPLB = "eplb"  # {cmd: eplb, action: rebalance | dump | status, path}: every rank, at once


def run_step(engine: LLMEngine, groups: ParallelGroups, msg: dict) -> list[RequestOutput]:
    """Apply one control message to this rank's replica and take one engine step: the KV
    transfers' commands of prefill/decode disaggregation first (``disagg/rank.py``), then
    the new requests, aborts and samples ended by the caller."""
    engine.apply_kv_commands(msg.get("kv") or {})
    for add in msg["add"]:
        if add["replica"] == groups.coords.dp_rank:
            params = codec.params_from_json(add["params"])
            progress = add.get("progress")  # a request resumed after a rank loss
            if progress is not None:
                progress = [codec.progress_from_json(p) for p in progress]
            engine.add_tokenized(add["id"], add["prompt_ids"], params, add["prompt"], progress)
    for request_id in msg["abort"]:
        engine.abort_request(request_id)
    for request_id, index, stop in msg["finish"]:
        engine.finish_sample(request_id, index, stop)
    return engine.step()


def exchange_outputs(
    groups: ParallelGroups,
    outputs: list[RequestOutput],
    stats: dict | None = None,
    kv_events: dict | None = None,
) -> tuple[list[RequestOutput], list[dict], list[dict]]:
    """Every replica leader's outputs of this step, on every rank, the ``stats`` each rank
    passed (in rank order; empty when none did) and every rank's KV-transfer events (in rank
    order), in the same gather."""
    mine = [codec.output_to_json(o) for o in outputs] if groups.is_replica_leader else []
    parts = all_gather_json({"outputs": mine, "stats": stats, "kv": kv_events}, groups.world)
    gathered = [codec.output_from_json(o) for part in parts for o in part["outputs"]]
    stats_out = [part["stats"] for part in parts if part["stats"] is not None]
    return gathered, stats_out, [part["kv"] or {} for part in parts]


def rank_info(engine: LLMEngine, groups: ParallelGroups) -> dict:
    """What this rank holds: its coordinates, weights and KV cache, and what loading cost."""
    c = groups.coords
    return {
        "rank": c.rank,
        "tp_rank": c.tp_rank,
        "dp_rank": c.dp_rank,
        "pp_rank": c.pp_rank,
        "ep_rank": c.ep_rank,
        "layers": [engine.model.layer_start, engine.model.layer_end],
        "weight_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "checkpoint_bytes_read": engine.load_report.num_bytes,
        "load_rss_bytes": engine.load_rss_bytes,
        "kv_cache_bytes": engine.kv_pool.num_bytes,
        "unfinished": engine.has_unfinished_requests(),
        "kv_transfer": engine.kv_rank.describe() if engine.kv_rank is not None else None,
        "disaggregation_mode": engine.disaggregation_mode,
    }


def serve_steps(
    engine: LLMEngine, groups: ParallelGroups, elastic: ElasticRank | None = None
) -> None:
    """A worker rank's loop: follow rank 0's messages until it says stop; at the stop its
    KV cache must be consistent (an inconsistency fails the rank, and the driver sees it).
    With elastic EP a failed collective is a rank loss: the rank recovers with the others
    (``launch/recovery.py``) and follows rank 0 again; GroupEnded when it cannot."""
    if elastic is not None:
        elastic.start_serving(groups)
    # with elastic EP a message taking half the collective timeout dumps this rank's stacks
    # (liveness.stall_dump): a stall of a live rank ends the group, and the log says where
    stall_s = elastic.timeout_s / 2 if elastic is not None else None
    while True:
        try:
            groups = _serve_one(engine, groups, elastic, stall_s)
            if groups is None:
                return
        except RuntimeError as e:
            if elastic is None or isinstance(e, GroupEnded):
                raise
            groups = groups.without_handles()  # the failed group closes once nothing holds it
            groups, _ = elastic.recover(engine, e)


def _serve_one(
    engine: LLMEngine,
    groups: ParallelGroups,
    elastic: ElasticRank | None,
    stall_s: float | None = None,
) -> ParallelGroups | None:
    """Follow one message of rank 0; returns the groups to follow the next one on (new ones
    after the group grew), None once rank 0 said stop. A step taking past ``stall_s`` dumps
    this rank's stacks (waiting for the message does not count, nor the commands that move
    experts: a growth, a rebalance)."""
    msg = broadcast_json(None, groups.world, 0)
    with stall_dump(stall_s if msg["cmd"] == STEP else None):
        return _handle(engine, groups, elastic, msg)


def _handle(
    engine: LLMEngine, groups: ParallelGroups, elastic: ElasticRank | None, msg: dict
) -> ParallelGroups | None:
    if msg["cmd"] == STOP:
        engine.scheduler.check_integrity()
        return None
    if msg["cmd"] == GROW and elastic is not None:
        return elastic.grow(engine)
    if msg["cmd"] == INFO:
        all_gather_json(rank_info(engine, groups), groups.world)
    elif msg["cmd"] == STATS:
        all_gather_json(engine.stats(msg.get("self_check", True)), groups.world)
    elif msg["cmd"] == EPLB:
        answer = run_command(engine.eplb, msg["action"], msg.get("path"), groups.world)
        all_gather_json(answer, groups.world)
    elif msg["cmd"] == KV_MODE:  # launch/group_disagg.send_mode
        engine.set_disaggregation_mode(msg["mode"])
    elif msg["cmd"] == STEP:
        outputs = run_step(engine, groups, msg)
        stats = engine.stats(False) if msg.get("stats") else None
        exchange_outputs(groups, outputs, stats, engine.kv_events())
    return groups  # PING: only woke this rank


def add_message(tracked: Tracked, resumed: bool) -> dict:
    """The step message's entry that queues ``tracked`` on its replica; ``resumed`` carries
    what its caller has received (after a rank loss)."""
    add = {
        "id": tracked.request_id,
        "replica": tracked.replica,
        "prompt": tracked.prompt,
        "prompt_ids": tracked.prompt_ids,
        "params": codec.params_to_json(tracked.params),
    }
    if resumed:
        add["progress"] = [codec.progress_to_json(p) for p in tracked.progress]
    return add
