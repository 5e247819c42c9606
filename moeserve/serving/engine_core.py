"""The engine process: one engine (or world rank 0 of an engine group) driven by messages.

    python -m moeserve.serving.engine_core '<json: config, input, output, parent_pid>'

The API server spawns this process and binds two ZeroMQ PUSH/PULL pipes; this process
connects to both. Its loop, between two steps::

    take every queued message        AddRequest -> engine.add_request, answered by AddResult
                                     AbortRequests / FinishSample -> applied before the step
                                     Call -> answered (stats gathered from every rank)
    engine.step()                    when there is work; its RequestOutputs (deltas) go out
                                     as one StepOutputs message, after a StatsSnapshot when
                                     one is due (SnapshotSchedule)

The engine publishes its stats itself (``StatsSnapshot``, without the KV self-check): with a
step at most every ``messages.STATS_INTERVAL_S`` (0.5 s) while it runs requests, and once
when it goes idle with anything changed, so ``/metrics`` never sends a message here and what
the stats cost does not depend on how often anyone scrapes. With nothing to run it sleeps in
``poll`` until a message arrives (an engine group keeps its own workers awake meanwhile). It
stops on Shutdown, on SIGTERM, or when its parent dies, always shutting the engine group down
first; an engine that fails sends EngineDead with the reason and exits 1. SIGTERM while
the API server lives (a whole process tree signalled at once, as by scancel) leaves the stop
to it (it drains first, then sends Shutdown) for ``term_grace_s`` at most.

An engine group reports from its watcher threads (``Engine.watch``): a rank that died sends
EngineDead at once, on a socket of that thread's own (ZeroMQ sockets are not thread-safe),
even while this loop waits in a collective with the dead rank; the loop then ends. A rank
whose heartbeat is late is sent as GroupHealth (``/health`` answers 503 naming it), a host
that got SIGTERM as StopRequested (the server drains and stops).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import zmq

from moeserve.config import EngineConfig
from moeserve.disagg.connector import NotDrainedError
from moeserve.engine.interface import Engine
from moeserve.engine.scheduler import QueueFullError
from moeserve.serving import messages as m

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500


def engine_stats(stats: dict) -> dict:
    """An engine's ``stats()`` in one shape for a single process and a group (``replicas``
    for each DP replica, layer keys as strings)."""
    if "replicas" not in stats:
        keys = ("num_running", "num_waiting", "kv_cache_usage")
        stats["replicas"] = [{k: stats[k] for k in keys}]
    stats["expert_counts"] = {str(k): v for k, v in stats["expert_counts"].items()}
    return stats


def eplb_call(engine: Engine, action: str) -> dict:
    """An EPLB command (``ExpertBalancer.command``) on a single engine or a whole group; the
    dump goes to the engine's ``expert_stats_out`` (a caller cannot choose the path). Raises
    ValueError when it fails."""
    return engine.eplb_command(action)


class SnapshotSchedule:
    """When the engine publishes a stats snapshot: with a step, when the last snapshot is
    ``interval_s`` old or more (so at most one per step, and one per ``interval_s`` while the
    engine runs requests); and when the engine is idle and anything changed since the last
    one (a step ran, a message was applied; at the start: none published yet), so an idle
    engine's last snapshot holds its numbers as they stay. Nothing else publishes one."""

    def __init__(
        self, interval_s: float = m.STATS_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.last: float | None = None  # when the last snapshot was published
        self.changed = True
        self.published = 0

    def due_with_step(self) -> bool:
        """Whether the coming step should bring the engine's stats back."""
        return self.last is None or self.clock() - self.last >= self.interval_s

    def due_when_idle(self) -> bool:
        """Whether an idle engine should publish now."""
        return self.changed

    def touch(self) -> None:
        """The engine's state may have changed (a step, an applied message)."""
        self.changed = True

    def mark_published(self) -> int:
        """Record a snapshot published now; returns its sequence number (1, 2, ...)."""
        self.last = self.clock()
        self.changed = False
        self.published += 1
        return self.published


class EngineCore:
    def __init__(
        self,
        engine: Engine,
        inp: zmq.Socket,
        out: zmq.Socket,
        parent_pid: int | None,
        snapshots: SnapshotSchedule | None = None,
        report_to: str | None = None,
    ) -> None:
        """``report_to``: the address ``out`` is connected to, for the reports of other
        threads (:meth:`report_from_thread`)."""
        self.engine = engine
        self.inp, self.out = inp, out
        self.parent_pid = parent_pid
        self.snapshots = snapshots or SnapshotSchedule()
        self.calls_received = 0  # Call messages: /debug/engine and the admin calls, not /metrics
        self.stopping = False
        self.failure: str | None = None  # set by a watcher thread of an engine group
        self.stop_by: float | None = None  # SIGTERM: stop at this time if not told before
        self._report_to = report_to

    def send(self, msg: m.Message) -> None:
        self.out.send(m.encode(msg))

    def report_from_thread(self, msg: m.Message) -> None:
        """Send ``msg`` from a thread other than the loop's, on a socket of its own."""
        if self._report_to is None:
            raise RuntimeError("this EngineCore was built without report_to")
        sock = self.out.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        try:
            sock.connect(self._report_to)
            sock.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the server is gone: it no longer needs to know
            logger.warning("could not send %s to the API server: %s", type(msg).__name__, e)
        finally:
            sock.close()

    def engine_failed(self, reason: str) -> None:
        """``Engine.watch``'s failure handler (any thread): tell the API server now."""
        self.failure = reason
        self.report_from_thread(m.EngineDead(reason))

    def run(self) -> None:
        while not self.stopping:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("the API server process is gone: shutting the engine down")
                return
            if self.failure is not None:
                raise RuntimeError(self.failure)
            if self.stop_by is not None and time.monotonic() >= self.stop_by:
                logger.warning("no Shutdown from the API server after SIGTERM: stopping")
                return
            busy = self.engine.has_unfinished_requests()
            if not busy and self.snapshots.due_when_idle():
                self._publish(self.engine.stats(self_check=False))
            self._receive(0 if busy else _IDLE_POLL_MS)
            if self.stopping:
                break
            if self.engine.has_unfinished_requests():
                self._step()

    def _step(self) -> None:
        """One engine step. A snapshot due with it goes out before its StepOutputs, and so
        does the one of an engine that this step left idle: whoever has seen a request finish
        and then scrapes sees the stats of the step that finished it."""
        if self.snapshots.due_with_step():
            outputs, stats = self.engine.step_with_stats()
        else:
            outputs, stats = self.engine.step(), None
        self.snapshots.touch()
        if stats is None and not self.engine.has_unfinished_requests():
            stats = self.engine.stats(self_check=False)
        if stats is not None:
            self._publish(stats)
        if outputs:
            self.send(m.StepOutputs(outputs))

    def _publish(self, stats: dict) -> None:
        self.send(m.StatsSnapshot(engine_stats(stats), self.snapshots.mark_published()))

    def _receive(self, timeout_ms: int) -> None:
        if not self.inp.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(m.decode(frame))
            if self.stopping:
                return

    def _handle(self, msg: m.Message) -> None:
        if not (isinstance(msg, m.Call) and msg.method == "stats"):  # that one changes nothing
            self.snapshots.touch()
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
        elif isinstance(msg, m.FinishSample):
            self.engine.finish_sample(msg.request_id, msg.index, msg.stop)
        elif isinstance(msg, m.Call):
            self.calls_received += 1
            self.send(self._call(msg))
        elif isinstance(msg, m.Shutdown):
            self.stopping = True
        else:
            raise m.MessageError(f"unexpected message for the engine: {type(msg).__name__}")

    def _add(self, msg: m.AddRequest) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except QueueFullError as e:
            self.send(m.AddResult(msg.request_id, "queue_full", str(e)))
        except ValueError as e:
            self.send(m.AddResult(msg.request_id, "invalid", str(e)))
        else:
            self.send(m.AddResult(msg.request_id))

    def _call(self, msg: m.Call) -> m.CallResult:
        if msg.method == "stats":  # /debug/engine: fresh, with the KV self-check
            stats = engine_stats(self.engine.stats(self_check=True))
            stats["calls_received"] = self.calls_received
            return m.CallResult(msg.call_id, stats)
        if msg.method == "eplb":
            try:
                return m.CallResult(msg.call_id, eplb_call(self.engine, **(msg.args or {})))
            except (ValueError, TypeError) as e:
                return m.CallResult(msg.call_id, error=str(e))
        if msg.method == "disaggregation_mode":
            try:
                mode = (msg.args or {}).get("mode")
                return m.CallResult(msg.call_id, self.engine.set_disaggregation_mode(mode))
            except NotDrainedError as e:  # not an error: the caller asks again
                return m.CallResult(msg.call_id, {"not_drained": str(e)})
            except (ValueError, OSError) as e:  # OSError: a bootstrap port in use
                return m.CallResult(msg.call_id, error=str(e))
        return m.CallResult(msg.call_id, error=f"unknown method {msg.method!r}")


def ready_message(engine: Engine) -> m.Ready:
    cfg = engine.config
    return m.Ready(
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        architecture=engine.model_config.architecture,
        world_size=cfg.parallel_dims.world_size,
        data_parallel_size=cfg.data_parallel_size,
        max_num_seqs=cfg.max_num_seqs,
        max_waiting_requests=cfg.max_waiting_requests,
        nnodes=cfg.nnodes,
    )


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the API server decides when to stop; a terminal's Ctrl-C reaches it, not this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    for sock in (inp, out):
        sock.setsockopt(zmq.LINGER, 2000)
    inp.connect(spec["input"])
    out.connect(spec["output"])
    engine: Engine | None = None
    core: EngineCore | None = None
    code = 0
    try:
        from moeserve.launch.start import start_engine

        engine = start_engine(EngineConfig(**spec["config"]))
        core = EngineCore(engine, inp, out, spec.get("parent_pid"), report_to=spec["output"])
        engine.watch(
            on_failure=core.engine_failed,
            on_health=lambda missing, elastic=None: core.report_from_thread(
                m.GroupHealth(missing, elastic)
            ),
            on_stop=lambda reason: core.report_from_thread(m.StopRequested(reason)),
        )
        grace = float(spec.get("term_grace_s", 0))

        def on_term(signum, frame) -> None:
            parent = spec.get("parent_pid")
            if grace > 0 and parent is not None and os.getppid() == parent:
                core.stop_by = core.stop_by or time.monotonic() + grace
            else:
                core.stopping = True

        signal.signal(signal.SIGTERM, on_term)
        if spec.get("api_url"):
            engine.announce_api(spec["api_url"])
        core.send(ready_message(engine))
        core.run()
    except Exception as e:  # report any failure to the API server, then exit non-zero
        if core is not None and core.failure is not None:
            logger.error("engine failed: %s", core.failure)
        else:
            logger.exception("engine failed")
            out.send(m.encode(m.EngineDead(f"{type(e).__name__}: {e}")))
        code = 1
    finally:
        if engine is not None:  # None: the engine failed to start
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
                code = 1
        inp.close()
        out.close()
        ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
