"""``moeserve serve`` on a host that does not run the HTTP API: its ranks, and nothing else.

The API runs where world rank 0 runs (node 0). Every other ``serve`` is one of two kinds:

- ``--nnodes N --node-rank I`` (I >= 1): :func:`run_host`, an agent that spawns this host's
  ranks, logs the API they serve once node 0 announces it, and watches them: when they all
  exit 0 (rank 0 stopped the group) it exits 0; when one fails it reports the failure to
  the group (``liveness.publish_failure``: node 0 then names it and ends the service), kills
  the others and exits 1. With elastic EP it reports the dead rank instead
  (``elastic.report_dead``: the others go on without it) and keeps watching the rest. With
  ``--elastic-rejoin RANKS`` (on any host) it starts only those ranks, which join a running
  elastic group in place of lost ones.
- a rank > 0 started by torchrun or srun: :func:`~moeserve.launch.start.run_rank` in this
  very process.

:func:`serve_role` tells which; ``cli.py`` asks before it binds any port.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Mapping

from moeserve.config import EngineConfig
from moeserve.launch.elastic import report_dead
from moeserve.launch.liveness import connect_store, publish_failure, read_api_url, request_stop
from moeserve.launch.netif import check_rendezvous
from moeserve.launch.processes import WorkerProcesses
from moeserve.launch.spec import LaunchSpec, check_world_size, detect_external
from moeserve.launch.start import bindings, local_specs, run_rank, with_topology
from moeserve.models.hf_config import ModelConfig
from moeserve.models.loader import check_layout

logger = logging.getLogger("moeserve.serve")

API, HOST, RANK = "api", "host", "rank"


def serve_role(config: EngineConfig, env: Mapping[str, str]) -> str:
    """``api`` where world rank 0 runs (it serves HTTP), ``host`` for another host's agent
    (``--node-rank >= 1``), ``rank`` for a rank > 0 that torchrun or srun started."""
    external = detect_external(env)
    if external is not None:
        return API if external.rank == 0 else RANK
    return API if config.node_rank == 0 and not config.elastic_rejoin else HOST


def run_external_rank(config: EngineConfig, env: Mapping[str, str]) -> int:
    """This process is a rank > 0 that torchrun or srun started: run it until the group ends."""
    spec = detect_external(env)
    if spec is None or spec.rank == 0:
        raise ValueError("run_external_rank runs a rank > 0 that torchrun or srun started")
    dims = config.parallel_dims
    check_world_size(spec, dims.world_size, dims.describe())
    config = with_topology(config, spec)
    check_layout(ModelConfig.from_dir(config.model), dims, config.moe_options)
    check_rendezvous(spec)
    logger.info(
        "rank %d of %d (node %d): the API runs on node 0",
        spec.rank,
        spec.world_size,
        spec.node_rank,
    )
    return run_rank(spec, config, bindings(config, spec.local_world_size)[spec.local_rank])


def run_host(config: EngineConfig) -> int:
    """Node I >= 1 of ``--nnodes N``: spawn this host's ranks and watch them (see the module
    docstring). SIGTERM or SIGINT: wait ``config.shutdown_grace_s`` for
    the group to stop from node 0, then kill the ranks and exit 1; a second SIGINT kills at
    once. Returns the exit code."""
    dims = config.parallel_dims
    specs = local_specs(config)
    if config.elastic_rejoin:  # replacements: only these ranks, joining a running group
        specs = [s for s in specs if s.rank in config.elastic_rejoin]
        if len(specs) != len(config.elastic_rejoin):
            raise ValueError(
                f"--elastic-rejoin {list(config.elastic_rejoin)}: node {config.node_rank} runs "
                f"ranks {[s.rank for s in local_specs(config)]}"
            )
    check_layout(ModelConfig.from_dir(config.model), dims, config.moe_options)
    check_rendezvous(specs[0])
    grace_s = config.shutdown_grace_s
    stop_by: list[float] = []  # when a signal asked to stop: the deadline
    forced = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop_by and signum == signal.SIGINT:
            forced.set()
        elif not stop_by:
            name = signal.Signals(signum).name
            logger.info("%s: asking node 0 to stop the group; waiting up to %gs", name, grace_s)
            request_stop(specs[0], f"node {config.node_rank} got {name}")
            stop_by.append(time.monotonic() + grace_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    workers = WorkerProcesses(specs, config, bindings(config, specs[0].local_world_size))
    ranks = [s.rank for s in specs]
    logger.info(
        "node %d of %d: ranks %d-%d of %d (%s); the API runs on node 0, rendezvous %s:%d",
        config.node_rank,
        config.nnodes,
        ranks[0],
        ranks[-1],
        dims.world_size,
        dims.describe(),
        specs[0].master_addr,
        specs[0].master_port,
    )
    return _watch(workers, specs[0], stop_by, forced, config.enable_elastic_ep)


def _watch(
    workers: WorkerProcesses,
    spec: LaunchSpec,
    stop_by: list[float],
    forced: threading.Event,
    elastic: bool = False,
) -> int:
    announced = False
    next_look = 0.0
    reported: set[int] = set()
    while True:
        if elastic:  # the group goes on without a dead rank: report it, keep the others
            for rank, why in workers.failed().items():
                if rank not in reported:
                    reported.add(rank)
                    logger.error("%s; the group goes on without it", why)
                    report_dead(spec, rank, why)
        else:
            failure = workers.failure()
            if failure is not None:
                logger.error("%s; stopping this host's ranks", failure)
                publish_failure(spec, failure)
                workers.kill_all()
                return 1
        if workers.all_exited():
            clean = len(reported) < len(workers.procs)  # a rank here stopped with the group
            workers.join()
            logger.info("node %d: the group stopped; every rank exited", spec.node_rank)
            return 0 if clean else 1
        if forced.is_set() or (stop_by and time.monotonic() > stop_by[0]):
            logger.error(
                "node %d: the group did not stop in time; killing its ranks", spec.node_rank
            )
            workers.kill_all()
            return 1
        if not announced and time.monotonic() >= next_look:
            url = _api_url(spec)
            if url is not None:
                logger.info("node %d serves the API at %s (on node 0)", spec.node_rank, url)
                announced = True
            next_look = time.monotonic() + 1.0
        time.sleep(0.2)


def _api_url(spec: LaunchSpec) -> str | None:
    """The URL node 0 announced, or None while its store is not up (it is loading)."""
    try:
        return read_api_url(connect_store(spec, timeout_s=1.0))
    except (RuntimeError, OSError):
        return None
