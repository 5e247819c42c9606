"""An engine spread over many ranks, driven by world rank 0 in lock step.

Every rank runs one :class:`LLMEngine` for its DP replica. Each step::

    rank 0    msg = {cmd: step, add: [...], abort: [...], finish: [...]}  -- broadcast (JSON)
    all       apply the adds meant for their replica, the aborts and the samples finished by
              the caller (stop strings found by the API server); engine.step()
              (a replica with nothing to run joins the expert all-to-alls with an empty batch)
    all       replica leaders' RequestOutputs are gathered to every rank (JSON); rank 0
              returns them to its caller (with ``stats: true`` in the step's message, every
              rank's :meth:`LLMEngine.stats` without the self-check rides on that gather)

Rank 0 assigns each request to the replica with the fewest unfinished sequences, so every DP
replica owns its requests and KV cache. ``{cmd: stats}`` gathers every rank's
:meth:`LLMEngine.stats`; ``{cmd: ping}`` only wakes the workers (their wait is a collective
with a timeout, so rank 0 pings a quiet group every few seconds from a background thread);
``{cmd: stop}`` ends the workers' loops.

Failure: a collective that fails (a peer's connection dropped, or this rank failed) ends the
group and raises; so does :meth:`EngineGroup.fail`, which the watchers call from their
threads: the :class:`~moeserve.launch.processes.WorkerProcesses` that see a spawned rank exit,
and the :class:`~moeserve.launch.liveness.RankMonitor` that sees a rank's heartbeat stop (on
any host) or reads a host's failure report. Either way the caller's ``on_failure`` hears why
at once, even while its own thread is stuck in a collective with the dead peer.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.core import PromptType, RequestOutput, SamplingParams
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import all_gather_json, broadcast_json
from moeserve.engine import codec
from moeserve.engine.engine import LLMEngine
from moeserve.engine.scheduler import QueueFullError
from moeserve.eplb.balancer import run_command
from moeserve.launch.group_disagg import KV_MODE, GroupDisagg, send_mode
from moeserve.launch.group_stats import merge_stats
from moeserve.launch.liveness import RankMonitor, announce_api, wait_for_ranks_to_leave
from moeserve.launch.spec import LaunchSpec

logger = logging.getLogger(__name__)

STEP, STOP, INFO, STATS, PING = "step", "stop", "info", "stats", "ping"
_GRACE_S = 10.0  # after a failure, how long the caller may take to close the group itself
EPLB = "eplb"  # {cmd: eplb, action: rebalance | dump | status, path}: every rank, at once


def run_step(engine: LLMEngine, groups: ParallelGroups, msg: dict) -> list[RequestOutput]:
    """Apply one control message to this rank's replica and take one engine step: the KV
    transfers' commands of prefill/decode disaggregation first (``disagg/rank.py``), then
    the new requests, aborts and samples ended by the caller."""
    engine.apply_kv_commands(msg.get("kv") or {})
    for add in msg["add"]:
        if add["replica"] == groups.coords.dp_rank:
            params = codec.params_from_json(add["params"])
            engine.add_tokenized(add["id"], add["prompt_ids"], params, add["prompt"])
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


def serve_steps(engine: LLMEngine, groups: ParallelGroups) -> None:
    """A worker rank's loop: follow rank 0's messages until it says stop; at the stop its
    KV cache must be consistent (an inconsistency fails the rank, and the driver sees it)."""
    while True:
        msg = broadcast_json(None, groups.world, 0)
        if msg["cmd"] == STOP:
            engine.scheduler.check_integrity()
            return
        if msg["cmd"] == INFO:
            all_gather_json(rank_info(engine, groups), groups.world)
            continue
        if msg["cmd"] == STATS:
            all_gather_json(engine.stats(msg.get("self_check", True)), groups.world)
            continue
        if msg["cmd"] == PING:
            continue
        if msg["cmd"] == EPLB:
            answer = run_command(engine.eplb, msg["action"], msg.get("path"), groups.world)
            all_gather_json(answer, groups.world)
            continue
        if msg["cmd"] == KV_MODE:  # launch/group_disagg.send_mode
            engine.set_disaggregation_mode(msg["mode"])
            continue
        outputs = run_step(engine, groups, msg)
        stats = engine.stats(False) if msg.get("stats") else None
        exchange_outputs(groups, outputs, stats, engine.kv_events())


class EngineGroup:
    """Rank 0's handle on the group: an :class:`~moeserve.engine.interface.Engine`, the same
    request API as :class:`LLMEngine`."""

    config: EngineConfig

    def __init__(
        self,
        engine: LLMEngine,
        groups: ParallelGroups,
        spec: LaunchSpec,
        workers=None,
        on_close=None,
    ) -> None:
        """``spec``: rank 0's place (the store its RankMonitor reads); ``workers``: the ranks
        this process spawned (``launch/processes.WorkerProcesses``), if any; ``on_close`` runs
        once the group is shut down or has failed."""
        if groups.rank != 0:
            raise ValueError("EngineGroup runs on world rank 0; other ranks run serve_steps")
        self.engine, self.groups = engine, groups
        self.config = engine.config
        self.workers = workers
        self._on_close = on_close
        self._spec = spec
        self.failure: str | None = None  # why the group ended, when it failed
        self._on_failure: Callable[[str], None] = lambda reason: None
        self._on_health: Callable[[list[str]], None] = lambda missing: None
        self._on_stop: Callable[[str], None] = lambda reason: None
        self._monitor = RankMonitor(
            spec,
            on_health=lambda missing: self._on_health(missing),
            on_failure=self.fail,
            on_stop=lambda reason: self._on_stop(reason),
            dead_after_s=min(self.config.dist_timeout_s, 10.0),
        ).start()
        atexit.register(self.shutdown)
        self._adds: list[dict] = []
        self._aborts: list[str] = []
        self._finishes: list[tuple[str, int, str | None]] = []
        # unfinished request -> (its DP replica, its sequences); unfinished sequences per replica
        self._replica_of: dict[str, tuple[int, int]] = {}
        self._load = [0] * groups.dims.dp
        self.closed = False
        # one command at a time on the wire: the caller's, or the keep-awake thread's ping
        self._lock = threading.RLock()
        self._last_command = time.monotonic()
        self._stopping = threading.Event()
        self._keeper = threading.Thread(
            target=self._keep_awake,
            args=(min(5.0, self.config.dist_timeout_s / 4),),
            name="engine-group-keepalive",
            daemon=True,
        )
        self._keeper.start()
        # prefill/decode disaggregation: the protocol's control runs here, each rank's
        # transfers on that rank (launch/group_disagg.py)
        self.disagg = GroupDisagg(self.config.model)
        if self.config.disaggregation_options.enabled:
            self.disagg.start(self.config.disaggregation_options, self.rank_info())

    # what LLM and the CLI read from an engine
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> None:
        """Validate here, then queue for the least-loaded replica (sent with the next step)."""
        params = params or SamplingParams()
        if request_id in self._replica_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.engine.tokenize(prompt)
        self.engine.validate_prompt(ids, params)
        replica = min(range(len(self._load)), key=lambda r: (self._load[r], r))
        cap = self.config.max_waiting_requests
        if cap is not None and self._load[replica] + params.n > cap:
            # rank 0 cannot see a replica's waiting queue, so it bounds all its unfinished
            # sequences: the replica's own queue can then never overflow mid-step
            raise QueueFullError(
                f"every DP replica has {cap} or more unfinished sequences; retry later"
            )
        self.disagg.on_add(request_id, params, ids)  # raises for a room in use
        self._adds.append(
            {
                "id": request_id,
                "replica": replica,
                "prompt": text,
                "prompt_ids": ids,
                "params": codec.params_to_json(params),
            }
        )
        self._replica_of[request_id] = (replica, params.n)
        self._load[replica] += params.n

    def abort_request(self, request_id: str) -> None:
        if request_id not in self._replica_of:
            return
        pending = [a for a in self._adds if a["id"] == request_id]
        if pending:
            self._adds.remove(pending[0])
        else:
            self._aborts.append(request_id)
        self.disagg.on_abort(request_id)
        self._forget(request_id)

    def finish_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample with finish reason ``stop`` on its replica (sent with the next step);
        the step after reports it, and the request's finished output, if it was the last."""
        if request_id in self._replica_of:
            self._finishes.append((request_id, index, stop_reason))

    def has_unfinished_requests(self) -> bool:
        return bool(self._replica_of) or self.disagg.has_pending()

    def step(self) -> list[RequestOutput]:
        return self._step(with_stats=False)[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], dict]:
        """One step; every rank's stats (without the self-check) taken after it come back in
        the step's own gather of outputs, merged as :meth:`stats` merges them."""
        outputs, per_rank = self._step(with_stats=True)
        return outputs, self._with_kv_stats(merge_stats(per_rank, self.groups.dims))

    def _with_kv_stats(self, stats: dict) -> dict:
        """The group's stats with its KV transfers' counters (the control's)."""
        stats["disaggregation"] = self.disagg.stats()
        return stats

    def _step(self, with_stats: bool) -> tuple[list[RequestOutput], list[dict]]:
        msg = {"cmd": STEP, "add": self._adds, "abort": self._aborts, "finish": self._finishes}
        if with_stats:
            msg["stats"] = True
        kv_cmds = self.disagg.take_commands()
        if kv_cmds:
            msg["kv"] = kv_cmds
        self._adds, self._aborts, self._finishes = [], [], []

        def take_step() -> tuple[list[RequestOutput], list[dict], list[dict]]:
            broadcast_json(msg, self.groups.world, 0)
            outputs = run_step(self.engine, self.groups, msg)
            stats = self.engine.stats(False) if with_stats else None
            return exchange_outputs(self.groups, outputs, stats, self.engine.kv_events())

        outputs, per_rank, kv_events = self._collective(take_step)
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        self.disagg.poll(kv_events, idle=not outputs)
        return outputs, per_rank

    def stats(self, self_check: bool = True) -> dict:
        """:meth:`LLMEngine.stats` of the whole group: queues and KV cache per DP replica
        (``replicas``, from each replica leader), prefix-cache counters and expert counts summed
        (each MoE layer's counts from the ranks that report them), and with ``self_check`` the
        self-check of every rank (``integrity``: "ok" or the first failure). One broadcast and
        one gather over the world: between two steps, :meth:`step_with_stats` costs less."""
        msg = {"cmd": STATS, "self_check": self_check}

        def gather() -> list[dict]:
            broadcast_json(msg, self.groups.world, 0)
            return all_gather_json(self.engine.stats(self_check), self.groups.world)

        return self._with_kv_stats(merge_stats(self._collective(gather), self.groups.dims))

    def eplb_command(self, action: str, path: str | None = None) -> dict:
        """An EPLB command on every rank (``ExpertBalancer.command``): ``rebalance`` now,
        ``dump`` the statistics (to ``path`` or ``expert_stats_out``), or ``status``.
        Returns rank 0's answer; raises ValueError with the first rank's error."""
        msg = {"cmd": EPLB, "action": action, "path": path}

        def gather() -> list[dict]:
            broadcast_json(msg, self.groups.world, 0)
            answer = run_command(self.engine.eplb, action, path, self.groups.world)
            return all_gather_json(answer, self.groups.world)

        answers = self._collective(gather)
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            raise ValueError(errors[0])
        return next((a["result"] for a in answers if a["result"] is not None), {})

    def set_disaggregation_mode(self, mode: str) -> dict:
        """Switch the group between the prefill and decode roles (``LLMEngine.
        set_disaggregation_mode``): only with no request and no transfer in flight; the
        control here is replaced, and every rank takes the role for the requests of the
        steps after (``{cmd: kv_mode}``: ``group_disagg.send_mode``). Returns the new role's
        ``/server_info`` fields; ValueError says why not (NotDrainedError: not yet)."""
        self.disagg.switch(mode, len(self._replica_of))
        self._collective(lambda: send_mode(self.engine, self.groups, mode))
        return self.disagg.info()

    def keepalive(self) -> None:
        """Wake the workers without a step (their wait for rank 0's next message is a
        collective with the group's timeout). A background thread calls this whenever the
        group has been quiet for a few seconds, so an idle group never times out."""
        self._collective(lambda: broadcast_json({"cmd": PING}, self.groups.world, 0))

    def rank_info(self) -> list[dict]:
        """:func:`rank_info` of every rank, in rank order."""

        def gather() -> list[dict]:
            broadcast_json({"cmd": INFO}, self.groups.world, 0)
            return all_gather_json(rank_info(self.engine, self.groups), self.groups.world)

        return self._collective(gather)

    def _collective(self, fn):
        """Run ``fn`` (rank 0's side of one command) alone; if it fails the ranks are out of
        step (a peer died, or this rank failed), so the group ends: RuntimeError names why."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the engine group has been shut down")
            try:
                return fn()
            except Exception as e:
                reason = f"engine group stopped: {self._culprit() or e}"
                self.failure = self.failure or reason
                self._close(kill=True)
                self._on_failure(reason)
                raise RuntimeError(reason) from e
            finally:
                self._last_command = time.monotonic()

    def _culprit(self) -> str | None:
        """Who made a collective fail: a spawned rank seen exiting, a host's report, or the
        ranks whose heartbeat stopped (each takes a moment to show after the connection
        drops); None when every rank looks alive (this rank failed)."""
        if self.failure is not None:
            return self.failure
        if self.workers is not None:
            found = self.workers.failure(wait_s=1.0)
            if found is not None:
                return found
        return self._monitor.culprit(wait_s=4.0)

    def watch(
        self,
        on_failure: Callable[[str], None],
        on_health: Callable[[list[str]], None],
        on_stop: Callable[[str], None],
    ) -> None:
        """``on_failure(reason)``: the group failed (called once, from any thread, at once);
        ``on_health(missing)``: the ranks whose heartbeat is late changed (a line each);
        ``on_stop(reason)``: another host was asked to stop (SIGTERM)."""
        self._on_failure, self._on_health, self._on_stop = on_failure, on_health, on_stop

    def announce_api(self, url: str) -> None:
        """Record the API's URL in the group's store; the other hosts log it."""
        announce_api(self._spec, url)

    def fail(self, reason: str) -> None:
        """End the group from a watcher's thread: a rank died (``reason`` names it). The
        caller hears it (``on_failure``), the spawned ranks are killed, and this process
        exits when its own thread does not close the group within ``_GRACE_S`` (it is stuck
        in a collective with the dead peer)."""
        if self.closed or self.failure is not None:
            return
        self.failure = reason
        logger.error("engine group: %s; stopping every rank", reason)
        self._on_failure(reason)
        if self.workers is not None:
            self.workers.kill_all()
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline and not self.closed:
            time.sleep(0.2)
        if not self.closed:
            sys.stderr.write(f"moeserve: engine group ended: {reason}\n")
            sys.stderr.flush()
            os._exit(1)

    def _keep_awake(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s / 4):
            if time.monotonic() - self._last_command < interval_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a command is on the wire: no ping needed
            try:
                if not self.closed:
                    self.keepalive()
            except RuntimeError:
                return  # the group failed: _collective told the caller (on_failure)
            finally:
                self._lock.release()

    def _forget(self, request_id: str) -> None:
        entry = self._replica_of.pop(request_id, None)
        if entry is not None:
            replica, n = entry
            self._load[replica] -= n

    def shutdown(self) -> None:
        """Tell every worker to stop and wait for the spawned ones; idempotent."""
        with self._lock:
            if self.closed:
                return
            if self.failure is not None:  # a rank is dead: nobody to tell
                self._close(kill=True)
                return
            if self.config.expert_stats_out:
                try:
                    self.eplb_command("dump")
                except (ValueError, RuntimeError) as e:
                    logger.error("could not write the expert statistics: %s", e)
            if self.closed:  # the dump failed the group
                return
            # the ranks stop beating as they stop: a slow exit is not a death
            self._monitor.stop()
            try:
                broadcast_json({"cmd": STOP}, self.groups.world, 0)
            finally:
                self._close(kill=False)

    def _close(self, kill: bool) -> None:
        self.closed = True
        atexit.unregister(self.shutdown)
        self.disagg.close()
        self._stopping.set()  # the keep-alive thread never waits for the lock, so this joins
        if self._keeper is not threading.current_thread():
            self._keeper.join()
        self._monitor.stop()
        if self.workers is not None and kill:
            self.workers.kill_all()
        elif self.workers is not None:
            self.workers.join()
        if not kill:  # a clean stop: the other ranks close their store connections first
            late = wait_for_ranks_to_leave(self._spec)
            if late:
                logger.warning("ranks %s did not confirm their stop", late)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._on_close is not None:
            self._on_close()
