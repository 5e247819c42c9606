"""The engine process: one engine (or world rank 0 of an engine group) driven by messages.

    python -m moeserve.serving.engine_core '<json: config, input, output, parent_pid>'

The API server spawns this process and binds two ZeroMQ PUSH/PULL pipes; this process
connects to both. Its loop, between two steps::

    take every queued message        AddRequest -> engine.add_request, answered by AddResult
                                     AbortRequests / FinishSample -> applied before the step
                                     Call -> answered (stats gathered from every rank)
    engine.step()                    when there is work; its RequestOutputs (deltas) go out
                                     as one StepOutputs message

With nothing to run it sleeps in ``poll`` until a message arrives (an engine group keeps its
own workers awake meanwhile). It stops on Shutdown, on SIGTERM,
or when its parent dies, always shutting the engine group down first; an engine that fails
sends EngineDead with the reason and exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import zmq

from moeserve.config import EngineConfig
from moeserve.engine.interface import Engine
from moeserve.engine.scheduler import QueueFullError
from moeserve.serving import messages as m

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500


def engine_stats(engine: Engine) -> dict:
    """The whole engine's stats in one shape for a single process and a group."""
    stats = engine.stats()
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


class EngineCore:
    def __init__(
        self, engine: Engine, inp: zmq.Socket, out: zmq.Socket, parent_pid: int | None
    ) -> None:
        self.engine = engine
        self.inp, self.out = inp, out
        self.parent_pid = parent_pid
        self.stopping = False

    def send(self, msg: m.Message) -> None:
        self.out.send(m.encode(msg))

    def run(self) -> None:
        while not self.stopping:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("the API server process is gone: shutting the engine down")
                return
            busy = self.engine.has_unfinished_requests()
            self._receive(0 if busy else _IDLE_POLL_MS)
            if self.stopping:
                break
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if outputs:
                    self.send(m.StepOutputs(outputs))

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
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
        elif isinstance(msg, m.FinishSample):
            self.engine.finish_sample(msg.request_id, msg.index, msg.stop)
        elif isinstance(msg, m.Call):
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
        if msg.method == "stats":
            return m.CallResult(msg.call_id, engine_stats(self.engine))
        if msg.method == "eplb":
            try:
                return m.CallResult(msg.call_id, eplb_call(self.engine, **(msg.args or {})))
            except (ValueError, TypeError) as e:
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
    code = 0
    try:
        from moeserve.launch.start import start_engine

        engine = start_engine(EngineConfig(**spec["config"]))
        core = EngineCore(engine, inp, out, spec.get("parent_pid"))

        def on_term(signum, frame) -> None:
            core.stopping = True

        signal.signal(signal.SIGTERM, on_term)
        core.send(ready_message(engine))
        core.run()
    except Exception as e:  # report any failure to the API server, then exit non-zero
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
