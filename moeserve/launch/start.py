"""Start an engine: one process, or a group of ranks spawned here or started elsewhere.

    start_engine(config)
      world 1, no launcher       -> LLMEngine in this process
      torchrun / srun (env vars) -> this process is the rank the launcher made it
      otherwise                  -> this process is its host's first rank and spawns the
                                    others (one host, or --nnodes/--node-rank/--master-*)
    rank 0 gets an EngineGroup (the request API); any other rank runs the worker loop until
    rank 0 stops it (:func:`run_rank`), then exits.

Under a launcher the topology (nodes, this node's index, the rendezvous) comes from its
variables (:func:`with_topology`), so node-affine replicas and hierarchical EPLB see the real
node count. Before joining, :func:`~moeserve.launch.netif.check_rendezvous` fails fast on a
master address or port this host cannot use.

Failure: a rank that dies is named (rank, host, exit code or silence, its error) and the group
ends (``engine_group.EngineGroup.fail``); every rank > 0 beats (``liveness.Heartbeat``) and
exits once rank 0 is gone or the group failed; a spawned rank whose parent disappears exits
on its own. A peer that never arrives fails init after ``dist_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.engine import LLMEngine
from moeserve.engine.interface import Engine
from moeserve.launch.agreement import check_terms, group_terms, publish_terms
from moeserve.launch.elastic import (
    GroupEnded,
    Membership,
    detached_groups,
    grown_config,
    open_store,
)
from moeserve.launch.engine_group import EngineGroup
from moeserve.launch.group_steps import serve_steps
from moeserve.launch.liveness import Heartbeat, request_stop
from moeserve.launch.netif import check_rendezvous, interface_towards
from moeserve.launch.numa import (
    RankBinding,
    apply_binding,
    plan_binding,
    read_topology,
)
from moeserve.launch.processes import WorkerProcesses
from moeserve.launch.recovery import ElasticRank
from moeserve.launch.spec import (
    LaunchSpec,
    check_world_size,
    detect_external,
    plan_local_ranks,
)
from moeserve.models.hf_config import ModelConfig
from moeserve.models.loader import check_layout

logger = logging.getLogger(__name__)


def start_engine(config: EngineConfig) -> Engine:
    dims = config.parallel_dims
    external = detect_external(os.environ)
    if dims.world_size == 1 and (external is None or external.world_size == 1):
        # one rank, whoever started it (a one-task srun step too): no group to run, and the
        # engine runs its prefill/decode control itself (a group would start a second one)
        return LLMEngine(config)
    layout = f"--tp {dims.tp} --dp {dims.dp} --pp {dims.pp}" + (
        " --enable-expert-parallel" if dims.enable_expert_parallel else ""
    )
    # a layout the model cannot take fails here, before any rank starts
    check_layout(ModelConfig.from_dir(config.model), dims, config.moe_options)
    workers = None
    if external is not None:
        check_world_size(external, dims.world_size, layout)
        spec = external
        config = with_topology(config, spec)
        check_rendezvous(spec)
    else:
        specs = local_specs(config)
        spec = specs[0]
        check_rendezvous(spec)  # before any rank starts
        workers = WorkerProcesses(specs[1:], config, bindings(config, len(specs)))
    if spec.rank != 0:
        code = run_rank(spec, config, bindings(config, spec.local_world_size)[spec.local_rank])
        if workers is not None:
            workers.join()
        sys.exit(code)
    binding = bindings(config, spec.local_world_size)[spec.local_rank]
    restore = _placement_restorer()  # rank 0 is the caller's process: undo the pinning later
    try:
        engine, groups, elastic = _join(spec, config, binding)
    except BaseException as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        restore()
        if workers is not None:
            cause = workers.failure()  # a rank that failed first is the likelier culprit
            workers.kill_all()
            raise RuntimeError(f"engine group failed to start: {cause or e}") from e
        raise
    group = EngineGroup(engine, groups, spec, workers, on_close=restore, elastic=elastic)
    if workers is not None:
        workers.watch(group, elastic=elastic is not None)
    logger.info("engine group ready: %s over %d node(s)", dims.describe(), spec.nnodes)
    return group


def local_specs(config: EngineConfig) -> list[LaunchSpec]:
    """The ranks this host runs when moeserve starts them itself (one host, or --nnodes)."""
    return plan_local_ranks(
        config.parallel_dims.world_size,
        config.nnodes,
        config.node_rank,
        config.master_addr or "127.0.0.1",
        config.master_port,
    )


def with_topology(config: EngineConfig, spec: LaunchSpec) -> EngineConfig:
    """``config`` with the node count, node index and rendezvous a launcher set (torchrun,
    srun); a ``--nnodes``/``--node-rank`` given as well must agree with them."""
    for flag, given, found in (
        ("--nnodes", config.nnodes, spec.nnodes),
        ("--node-rank", config.node_rank, spec.node_rank),
    ):
        if given not in (found, 0 if flag == "--node-rank" else 1):
            raise ValueError(
                f"{flag} {given} disagrees with the {spec.source} environment ({found}); "
                f"drop the flag: {spec.source} decides where ranks run"
            )
    return dataclasses.replace(
        config,
        nnodes=spec.nnodes,
        node_rank=spec.node_rank,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
    )


def run_rank(spec: LaunchSpec, config: EngineConfig, binding: RankBinding) -> int:
    """A rank > 0: join, beat, follow rank 0's steps until it says stop; returns 0 then.
    SIGTERM does not cut a step: the rank asks node 0 to stop the group (it drains first, as
    on its own SIGTERM) and waits ``shutdown_grace_s`` for that, then exits 1."""
    if spec.rank == 0:
        raise ValueError("rank 0 runs the EngineGroup, not the worker loop")
    grace = config.shutdown_grace_s

    def on_term(signum, frame) -> None:
        request_stop(spec, f"rank {spec.rank} (node {spec.node_rank}) got SIGTERM")
        _exit_after(spec.rank, grace)

    signal.signal(signal.SIGTERM, on_term)
    engine, groups, elastic = _join(spec, config, binding)
    heartbeat = Heartbeat(spec).start()
    try:
        if spec.rank in config.elastic_rejoin:  # with the members, as they grow
            mine = elastic.take_share(engine, groups, drop_requests=False)[groups.rank]
            logger.warning(
                "rank %d joined the group (%s): received %.1f MB of experts from the members "
                "in %.2f s",
                spec.rank,
                groups.dims.describe(),
                mine["bytes_received"] / 1e6,
                mine["move_s"],
            )
        serve_steps(engine, groups, elastic)
    except GroupEnded as e:
        sys.stderr.write(f"moeserve: rank {spec.rank} leaves: {e}\n")
        return 1
    finally:
        heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _join_running(
    spec: LaunchSpec, config: EngineConfig, backend: str
) -> tuple[LLMEngine, ParallelGroups, ElasticRank]:
    """A replacement (``--elastic-rejoin``): load the model for the place it expects (after
    the members) except the routed experts, whose slots stay empty, then ask to join and form
    the next generation with them; the group pauses only for the joining and the experts'
    move, not for the loading (``ElasticRank.take_share`` follows: EPLB places the experts
    over every rank and the members send this rank its share)."""
    membership = Membership(spec, open_store(spec, config.dist_timeout_s), backend, True)
    expected = len(membership.current_members()) + 1
    num_experts = ModelConfig.from_dir(config.model).num_experts
    grown = grown_config(config, expected, num_experts)
    engine = LLMEngine(grown, detached_groups(expected, expected - 1))
    membership.join(config.dist_timeout_s)
    groups = membership.init_world(config.dist_timeout_s)
    return engine, groups, ElasticRank(grown, membership)


def _exit_after(rank: int, grace_s: float) -> None:
    """From a SIGTERM handler: end this process in ``grace_s`` unless it ended by then."""

    def later() -> None:
        sys.stderr.write(f"moeserve: rank {rank}: no stop from rank 0 {grace_s:g}s after SIGTERM\n")
        os._exit(1)

    timer = threading.Timer(grace_s, later)
    timer.daemon = True
    timer.start()


def _placement_restorer():
    """A function that gives this process back its CPU affinity and thread count."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()

    def restore() -> None:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)

    return restore


def bindings(config: EngineConfig, local_world: int) -> list[RankBinding]:
    """Each local rank's CPUs and threads (pinned per NUMA node unless oversubscribed)."""
    topology = read_topology()
    cpus = sum(len(n.cpus) for n in topology)
    mode = config.numa_bind if local_world <= cpus else "none"  # oversubscribed: no pinning
    return plan_binding(topology, local_world, mode)


def _join(
    spec: LaunchSpec, config: EngineConfig, binding: RankBinding
) -> tuple[LLMEngine, ParallelGroups, ElasticRank | None]:
    """Bind threads, join the world, build the groups and this rank's engine (and its part
    in recoveries, with elastic EP)."""
    if config.num_threads:
        binding = RankBinding(
            binding.local_rank, binding.numa_node, binding.cpus, config.num_threads
        )
    apply_binding(binding)
    if spec.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_towards(spec.master_addr)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    terms = group_terms(config, spec)
    if spec.rank == 0:
        publish_terms(spec, terms, config.dist_timeout_s)
    else:  # a host started unlike node 0 fails here, at once, naming what differs
        check_terms(spec, terms, config.dist_timeout_s)
    backend = "gloo"
    if config.torch_device.type == "cuda":
        # one GPU per local rank; NCCL moves CUDA tensors, gloo the CPU control messages
        torch.cuda.set_device(spec.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    elastic = None
    try:
        if config.enable_elastic_ep and spec.rank in config.elastic_rejoin:
            return _join_running(spec, config, backend)
        if config.enable_elastic_ep:
            # generations of the group meet on one store that rank 0 keeps (launch/elastic.py)
            store = open_store(spec, config.dist_timeout_s)
            elastic = ElasticRank(config, Membership(spec, store, backend))
            groups = elastic.membership.init_world(config.dist_timeout_s)
        else:
            dist.init_process_group(
                backend,
                init_method=spec.init_method,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timedelta(seconds=config.dist_timeout_s),
            )
            groups = ParallelGroups.build(config.parallel_dims)
    except (dist.DistError, RuntimeError) as e:
        raise RuntimeError(
            f"rank {spec.rank}: the {spec.world_size} ranks did not all join {spec.init_method} "
            f"within {config.dist_timeout_s:g}s ({spec.source} launch; every host must start, "
            f"with the same layout: here {config.parallel_dims.describe()} over {spec.nnodes} "
            f"node(s)): {e}"
        ) from e
    return LLMEngine(config, groups), groups, elastic
