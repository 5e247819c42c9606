"""Starting an engine over one or many ranks; sits above the engine it starts.

- ``start``: :func:`start_engine` (one process, or a group of ranks spawned here or elsewhere)
  and how a rank joins the world (:func:`run_rank` for every rank > 0)
- ``host``: ``serve`` where the API does not run: a ``--node-rank >= 1`` host's agent for
  its ranks, or a rank > 0 that torchrun or srun started
- ``agreement``: rank 0 publishes what the group was started with; other ranks compare
- ``liveness``: every rank's heartbeat, rank 0's monitor of them, failure and stop notices
  (through the rendezvous store)
- ``processes``: :class:`WorkerProcesses` (the ranks this process spawned, watched)
- ``worker``: the entry point of a spawned rank (``python -m moeserve.launch.worker``)
- ``spec``: :class:`LaunchSpec` (rank, world, rendezvous) from torchrun, Slurm or flags
- ``lws``: a Kubernetes LeaderWorkerSet pod's variables as the multi-host flags
- ``numa``: CPU topology and each local rank's thread binding
- ``netif``: the network interface gloo should use on a multi-host run, and the fail-fast
  check of the rendezvous address and port
- ``engine_group``: :class:`EngineGroup`, rank 0's request API over the group, and the step
  loop of the other ranks

The mesh these ranks build and the expert dispatch live below, in ``moeserve.distributed``.
"""
