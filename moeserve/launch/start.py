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

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.engine import LLMEngine
from moeserve.launch.engine_group import EngineGroup, serve_steps
from moeserve.launch.netif import interface_towards
from moeserve.launch.numa import (
    RankBinding,
    apply_binding,
    describe,
    plan_binding,
    read_topology,
)
from moeserve.launch.spec import (
    LaunchSpec,
    check_world_size,
    detect_external,
    plan_local_ranks,
)
from moeserve.models.hf_config import ModelConfig
from moeserve.models.loader import check_layout

logger = logging.getLogger(__name__)

_GRACE_S = 10.0  # after a rank dies, how long the driver may take to notice by itself


def start_engine(config: EngineConfig) -> LLMEngine | EngineGroup:
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


def worker_command(spec: LaunchSpec, config: EngineConfig, binding: RankBinding) -> list[str]:
    """A fresh interpreter for one rank (nothing of the caller's ``__main__`` is re-run)."""
    payload = {
        "spec": dataclasses.asdict(spec),
        "config": dataclasses.asdict(config),
        "binding": dataclasses.asdict(binding),
    }
    return [sys.executable, "-m", "moeserve.launch.worker", json.dumps(payload)]


class WorkerProcesses:
    """The ranks this process spawned; watches them and ends the group when one dies."""

    def __init__(self, specs: list[LaunchSpec], config: EngineConfig, bindings) -> None:
        self._errdir = tempfile.mkdtemp(prefix="moeserve-ranks-")
        self.procs: dict[int, subprocess.Popen] = {}
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._failure: str | None = None
        for spec in specs:
            env = dict(os.environ, MOESERVE_ERROR_FILE=self._error_file(spec.rank))
            self.procs[spec.rank] = subprocess.Popen(
                worker_command(spec, config, bindings[spec.local_rank]), env=env
            )
        if specs:
            logger.info("spawned ranks %s\n%s", sorted(self.procs), describe(bindings))

    def _error_file(self, rank: int) -> str:
        return os.path.join(self._errdir, f"rank{rank}.err")

    def failure(self, wait_s: float = 0.0) -> str | None:
        """What went wrong with the first rank that failed, if one did; waits up to
        ``wait_s`` for one to be seen exiting (a peer's connection may drop before its exit
        status is known)."""
        deadline = time.monotonic() + wait_s
        while self._failure is None and self._scan() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._failure

    def _scan(self) -> str | None:
        if self._failure is None:
            for rank, p in sorted(self.procs.items()):
                code = p.poll()
                if code not in (None, 0):
                    detail = ""
                    try:
                        with open(self._error_file(rank)) as f:
                            detail = ": " + f.read().strip()
                    except OSError:
                        pass
                    how = (
                        f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    )
                    self._failure = f"rank {rank} {how}{detail}"
                    break
        return self._failure

    def watch(self, group: EngineGroup) -> None:
        def loop() -> None:
            while not self._stopping.wait(0.5):
                failure = self.failure()
                if failure is None or self._stopping.is_set():
                    continue
                logger.error("engine group: %s; stopping every rank", failure)
                self.kill_all()
                deadline = time.monotonic() + _GRACE_S
                while time.monotonic() < deadline and not group.closed:
                    time.sleep(0.2)
                if not group.closed:
                    # the driver is stuck in a collective with a dead peer: end it too
                    sys.stderr.write(f"moeserve: engine group ended: {failure}\n")
                    os._exit(1)
                return

        self._watcher = threading.Thread(target=loop, name="moeserve-rank-watch", daemon=True)
        self._watcher.start()

    def _stop_watching(self) -> None:
        """End the watcher and wait for it: a daemon thread still holding the engine when the
        interpreter exits would free its tensors during finalization and abort the process."""
        self._stopping.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join()

    def kill_all(self) -> None:
        self._stop_watching()
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(timeout=10)

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the ranks to exit after a stop; kill what is left."""
        self._stop_watching()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()
