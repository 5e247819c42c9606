"""An engine spread over many ranks, driven by world rank 0 in lock step: rank 0's handle
(:class:`EngineGroup`, the request API); every other rank follows it in
``launch/group_steps.serve_steps``, where the messages and the step are described.

Rank 0 assigns each request to the replica with the fewest unfinished sequences, so every DP
replica owns its requests and KV cache.

Failure: a collective that fails (a peer's connection dropped, or this rank failed) ends the
group and raises; so does :meth:`EngineGroup.fail`, which the watchers call from their
threads: the :class:`~moeserve.launch.processes.WorkerProcesses` that see a spawned rank exit,
and the :class:`~moeserve.launch.liveness.RankMonitor` that sees a rank's heartbeat stop (on
any host) or reads a host's failure report. Either way the caller's ``on_failure`` hears why
at once, even while its own thread is stuck in a collective with the dead peer. With elastic
EP the survivors recover instead (``launch/recovery.py``).
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
from moeserve.engine.engine import LLMEngine
from moeserve.engine.scheduler import QueueFullError
from moeserve.eplb.balancer import run_command
from moeserve.launch.elastic import GroupEnded
from moeserve.launch.group_disagg import GroupDisagg, send_mode
from moeserve.launch.group_elastic import ElasticRecord
from moeserve.launch.group_stats import merge_stats
from moeserve.launch.group_steps import (
    EPLB,
    GROW,
    INFO,
    PING,
    STATS,
    STEP,
    STOP,
    add_message,
    exchange_outputs,
    rank_info,
    run_step,
)
from moeserve.launch.ledger import RequestLedger, StepOutbox, Tracked
from moeserve.launch.liveness import (
    MISSING_AFTER_S,
    RankMonitor,
    announce_api,
    wait_for_ranks_to_leave,
)
from moeserve.launch.recovery import ElasticRank
from moeserve.launch.spec import LaunchSpec

logger = logging.getLogger(__name__)

_JOIN_CHECK_S = 1.0  # how often rank 0 looks for replacements waiting to join
_GRACE_S = 10.0  # after a failure, how long the caller may take to close the group itself


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
        elastic: ElasticRank | None = None,
    ) -> None:
        """``spec``: rank 0's place (the store its RankMonitor reads); ``workers``: the ranks
        this process spawned (``launch/processes.WorkerProcesses``), if any; ``on_close`` runs
        once the group is shut down or has failed; ``elastic``: this rank's part in
        recoveries from a rank loss (``--enable-elastic-ep``), None to end at one."""
        if groups.rank != 0:
            raise ValueError("EngineGroup runs on world rank 0; other ranks run serve_steps")
        self.engine, self.groups = engine, groups
        self.config = engine.config
        self.workers = workers
        self._on_close = on_close
        self._spec = spec
        self.failure: str | None = None  # why the group ended, when it failed
        self._on_failure: Callable[[str], None] = lambda reason: None
        self._on_health: Callable[[list[str], dict | None], None] = lambda missing, el: None
        self._on_stop: Callable[[str], None] = lambda reason: None
        self._elastic = elastic
        # elastic EP: what the group lost, recovered and took in (launch/group_elastic.py)
        self.elastic = ElasticRecord(elastic, spec.world_size) if elastic is not None else None
        self._monitor = RankMonitor(
            spec,
            on_health=lambda missing: self._on_health(missing, self._elastic_or_none()),
            on_failure=self.fail,
            on_stop=lambda reason: self._on_stop(reason),
            dead_after_s=min(self.config.dist_timeout_s, 10.0),
            on_dead=self.elastic.rank_lost if self.elastic is not None else None,
        ).start()
        atexit.register(self.shutdown)
        self._outbox = StepOutbox()  # sent with the next step
        # unfinished requests: their replicas, and what their callers have received
        self._ledger = RequestLedger(groups.dims.dp)
        self._next_join_check = 0.0
        self.closed = False
        # one command at a time on the wire: the caller's, or the keep-awake thread's ping
        self._lock = threading.RLock()
        self._last_command = time.monotonic()
        self._stopping = threading.Event()
        quiet_s = min(5.0, self.config.dist_timeout_s / 4)
        if elastic is not None:  # collectives fail after elastic_ep_timeout_s from now on
            quiet_s = min(quiet_s, self.config.elastic_ep_timeout_s / 4)
            elastic.start_serving(groups)
        self._keeper = threading.Thread(
            target=self._keep_awake,
            args=(quiet_s,),
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
        if request_id in self._ledger:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.engine.tokenize(prompt)
        self.engine.validate_prompt(ids, params)
        replica = self._ledger.least_loaded()
        cap = self.config.max_waiting_requests
        if cap is not None and self._ledger.load[replica] + params.n > cap:
            # rank 0 cannot see a replica's waiting queue, so it bounds all its unfinished
            # sequences: the replica's own queue can then never overflow mid-step
            raise QueueFullError(
                f"every DP replica has {cap} or more unfinished sequences; retry later"
            )
        self.disagg.on_add(request_id, params, ids)  # raises for a room in use
        tracked = Tracked(request_id, text, ids, params, replica)
        self._ledger.add(tracked)
        self._outbox.adds.append(add_message(tracked, resumed=False))

    def abort_request(self, request_id: str) -> None:
        if request_id not in self._ledger:
            return
        self._outbox.abort(request_id)
        self.disagg.on_abort(request_id)
        self._ledger.forget(request_id)

    def finish_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample with finish reason ``stop`` on its replica (sent with the next step);
        the step after reports it, and the request's finished output, if it was the last."""
        if request_id in self._ledger:
            self._outbox.finishes.append((request_id, index, stop_reason))

    def has_unfinished_requests(self) -> bool:
        return bool(self._ledger) or self.disagg.has_pending()

    def step(self) -> list[RequestOutput]:
        return self._step(with_stats=False)[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], dict]:
        """One step; every rank's stats (without the self-check) taken after it come back in
        the step's own gather of outputs, merged as :meth:`stats` merges them."""
        outputs, per_rank = self._step(with_stats=True)
        return outputs, self._with_kv_stats(merge_stats(per_rank, self.groups.dims))

    def _with_kv_stats(self, stats: dict) -> dict:
        """The group's stats with its KV transfers' counters (the control's) and, with elastic
        EP, its rank losses and recoveries."""
        stats["disaggregation"] = self.disagg.stats()
        if self.elastic is not None:
            stats["elastic"] = self.elastic_status()
        return stats

    def _elastic_or_none(self) -> dict | None:
        return self.elastic_status() if self.elastic is not None else None

    def elastic_status(self) -> dict:
        """Live ranks, losses and recoveries so far (``/health``, ``/metrics``)."""
        return self.elastic.status(self.groups.dims.world_size)

    def _step(self, with_stats: bool) -> tuple[list[RequestOutput], list[dict]]:
        self._take_joiners()
        msg = {"cmd": STEP, **self._outbox.take()}
        if with_stats:
            msg["stats"] = True
        kv_cmds = self.disagg.take_commands()
        if kv_cmds:
            msg["kv"] = kv_cmds

        def take_step() -> tuple[list[RequestOutput], list[dict], list[dict]]:
            broadcast_json(msg, self.groups.world, 0)
            outputs = run_step(self.engine, self.groups, msg)
            stats = self.engine.stats(False) if with_stats else None
            return exchange_outputs(self.groups, outputs, stats, self.engine.kv_events())

        def after_recovery():
            # the lost step's samples ended by the caller end again on their new replicas,
            # after the requests are queued there (the ledger queued every request again)
            self._outbox.finish_again(msg["finish"])
            return None

        result = self._collective(take_step, after_recovery)
        if result is None:
            return self._step(with_stats)
        outputs, per_rank, kv_events = result
        self._ledger.observe(outputs)
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
        self.disagg.switch(mode, len(self._ledger))
        self._collective(lambda: send_mode(self.engine, self.groups, mode))
        return self.disagg.info()

    def keepalive(self) -> None:
        """Wake the workers without a step (their wait for rank 0's next message is a
        collective with the group's timeout). A background thread calls this whenever the
        group has been quiet for a few seconds, so an idle group never times out."""
        self._take_joiners()  # an idle group takes replacements in too
        self._collective(lambda: broadcast_json({"cmd": PING}, self.groups.world, 0))

    def rank_info(self) -> list[dict]:
        """:func:`rank_info` of every rank, in rank order."""

        def gather() -> list[dict]:
            broadcast_json({"cmd": INFO}, self.groups.world, 0)
            return all_gather_json(rank_info(self.engine, self.groups), self.groups.world)

        return self._collective(gather)

    def _collective(self, fn, again: Callable | None = None):
        """Run ``fn`` (rank 0's side of one command) alone; if it fails the ranks are out of
        step (a peer died, or this rank failed), so the group ends: RuntimeError names why.
        With elastic EP the survivors recover instead (:meth:`_recover`), then ``again()``
        answers (default: ``fn`` once more)."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the engine group has been shut down")
            try:
                return fn()
            except Exception as e:
                if self._elastic is not None and self._recover(e):
                    return again() if again is not None else self._collective(fn)
                reason = f"engine group stopped: {self.failure or self._culprit() or e}"
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
        on_health: Callable[[list[str], dict | None], None],
        on_stop: Callable[[str], None],
    ) -> None:
        """``on_failure(reason)``: the group failed (called once, from any thread, at once);
        ``on_health(missing, elastic)``: the ranks whose heartbeat is late changed (a line
        each), or (elastic EP) the group lost ranks or took replacements in (``elastic``:
        :meth:`elastic_status`; None without elastic EP);
        ``on_stop(reason)``: another host was asked to stop (SIGTERM). With elastic EP a lost
        rank is not a failure: the stats say what the group went on with (``elastic``)."""
        self._on_failure, self._on_health, self._on_stop = on_failure, on_health, on_stop

    def _take_joiners(self) -> None:
        """Elastic EP, between two steps (at most every ``_JOIN_CHECK_S``): when replacements
        wait to join, every member forms the next generation with them (:meth:`ElasticRank.
        grow`); each keeps its requests and KV, the new replicas take new requests."""
        if self._elastic is None or time.monotonic() < self._next_join_check:
            return
        self._next_join_check = time.monotonic() + _JOIN_CHECK_S
        with self._lock:
            joiners = self._elastic.membership.joiners()
            if not joiners:
                return

            def grow() -> ParallelGroups:
                broadcast_json({"cmd": GROW}, self.groups.world, 0)
                self.groups = self.groups.without_handles()
                return self._elastic.grow(self.engine)

            self.groups = self._collective(grow, again=lambda: self.groups)
            joiners = [r for r in joiners if r in self._elastic.membership.members]
            if not joiners:  # a loss came first: the recovery took over
                return
            self._ledger.load += [0] * (self.groups.dims.dp - len(self._ledger.load))
            self._monitor.watch_again(joiners)
            self.elastic.joined += joiners
            self._on_health(self._monitor.missing, self.elastic_status())
            logger.warning(
                "engine group: ranks %s joined: %d rank(s) live",
                joiners,
                self.groups.dims.world_size,
            )

    def _known_dead(self) -> set[int]:
        """Ranks a recovery need not wait for: seen dead, or silent for a while."""
        return self.elastic.known_dead(self._monitor, MISSING_AFTER_S)

    def _recover(self, cause: BaseException) -> bool:
        """Elastic EP: go on without the lost ranks (``launch/recovery.py``) and queue every
        unfinished request again on the survivors, from what its caller has received. False
        (``failure`` says why) when the group cannot go on."""
        t0 = time.monotonic()
        self.groups = self.groups.without_handles()  # the failed group closes once unheld
        try:
            groups, rec = self._elastic.recover(self.engine, cause, self._known_dead)
        except (GroupEnded, ValueError, RuntimeError, OSError) as e:
            self.failure = self.failure or str(e)
            return False
        self.groups = groups
        self.elastic.recovered(rec, time.monotonic() - t0, cause, self._monitor)
        resumed = [add_message(t, resumed=True) for t in self._ledger.reassign(groups.dims.dp)]
        self._outbox.requeue(resumed)
        self._on_health(self._monitor.missing, self.elastic_status())
        logger.warning(
            "engine group: recovered in %.2fs (agree %.2fs, join %.2fs, reload %.2fs of %d "
            "expert(s)); %d rank(s) live, %d request(s) queued again",
            self.elastic.recovery_seconds[-1],
            rec.agree_s,
            rec.join_s,
            rec.reload_s,
            rec.experts_reloaded,
            groups.dims.world_size,
            len(resumed),
        )
        return True

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

    def _live_ranks(self) -> list[int]:
        """The launch ranks > 0 of the group as it is now."""
        if self._elastic is not None:
            return list(self._elastic.membership.members[1:])
        return list(range(1, self._spec.world_size))

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
            late = wait_for_ranks_to_leave(self._spec, self._live_ranks())
            if late:
                logger.warning("ranks %s did not confirm their stop", late)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._on_close is not None:
            self._on_close()
