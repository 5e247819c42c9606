"""Start an engine: one process, or a group of ranks spawned here or started elsewhere.

    start_engine(config)
      world 1, no launcher       -> LLMEngine in this process
      torchrun / srun (env vars) -> this process is the rank the launcher made it
      otherwise                  -> this process is its host's first rank and spawns the
                                    others (one host, or --nnodes/--node-rank/--master-*)
    rank 0 gets an EngineGroup (the request API); any other rank runs the worker loop until
    rank 0 stops it, then exits.

Failure: a spawned rank that dies is named (rank, exit code, its error) and the group is
ended: the other ranks are killed and the driver raises, or exits if it is stuck in a
collective; a spawned rank whose parent disappears exits on its own. A peer that never
arrives fails init after ``dist_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.engine import LLMEngine
from moeserve.engine.interface import Engine
from moeserve.launch.engine_group import EngineGroup, serve_steps
from moeserve.launch.netif import interface_towards
from moeserve.launch.numa import (
    RankBinding,
    apply_binding,
    plan_binding,
    read_topology,
)
from moeserve.launch.processes import WorkerProcesses
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
    if external is None and dims.world_size == 1:
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
    else:
        specs = plan_local_ranks(
            dims.world_size,
            config.nnodes,
            config.node_rank,
            config.master_addr or "127.0.0.1",
            config.master_port,
        )
        spec = specs[0]
        workers = WorkerProcesses(specs[1:], config, _bindings(config, len(specs)))
    binding = _bindings(config, spec.local_world_size)[spec.local_rank]
    restore = _placement_restorer()  # rank 0 is the caller's process: undo the pinning later
    try:
        engine, groups = _join(spec, config, binding)
    except BaseException as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        restore()
        if workers is not None:
            cause = workers.failure()  # a rank that failed first is the likelier culprit
            workers.kill_all()
            raise RuntimeError(f"engine group failed to start: {cause or e}") from e
        raise
    if spec.rank == 0:
        group = EngineGroup(engine, groups, workers, on_close=restore)
        if workers is not None:
            workers.watch(group)
        logger.info("engine group ready: %s", dims.describe())
        return group
    _run_worker(engine, groups)
    if workers is not None:
        workers.join()
    sys.exit(0)


def _placement_restorer():
    """A function that gives this process back its CPU affinity and thread count."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()

    def restore() -> None:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)

    return restore


def _bindings(config: EngineConfig, local_world: int) -> list[RankBinding]:
    topology = read_topology()
    cpus = sum(len(n.cpus) for n in topology)
    mode = config.numa_bind if local_world <= cpus else "none"  # oversubscribed: no pinning
    return plan_binding(topology, local_world, mode)


def _join(
    spec: LaunchSpec, config: EngineConfig, binding: RankBinding
) -> tuple[LLMEngine, ParallelGroups]:
    """Bind threads, join the world, build the groups and this rank's engine."""
    if config.num_threads:
        binding = RankBinding(
            binding.local_rank, binding.numa_node, binding.cpus, config.num_threads
        )
    apply_binding(binding)
    if spec.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_towards(spec.master_addr)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    backend = "gloo"
    if config.torch_device.type == "cuda":
        # one GPU per local rank; NCCL moves CUDA tensors, gloo the CPU control messages
        torch.cuda.set_device(spec.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    try:
        dist.init_process_group(
            backend,
            init_method=spec.init_method,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=config.dist_timeout_s),
        )
    except (dist.DistError, RuntimeError) as e:
        raise RuntimeError(
            f"rank {spec.rank}: the {spec.world_size} ranks did not all join {spec.init_method} "
            f"within {config.dist_timeout_s:g}s ({spec.source} launch): {e}"
        ) from e
    groups = ParallelGroups.build(config.parallel_dims)
    return LLMEngine(config, groups), groups


def _run_worker(engine: LLMEngine, groups: ParallelGroups) -> None:
    try:
        serve_steps(engine, groups)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
