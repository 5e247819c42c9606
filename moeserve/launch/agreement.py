"""Every host must start the group the same way: rank 0 publishes what it was started with,
every other rank compares before it joins.

Ranks started with different layouts (``--ep 2`` on node 0, ``--ep 4`` on node 1) would
otherwise wait in ``init_process_group`` for ranks that never come and fail only at
``--dist-timeout``, saying nothing of why. Rank 0 writes its :func:`group_terms` to the
rendezvous store from a thread as soon as the store is up (``init_process_group`` blocks rank
0's own thread meanwhile); a rank > 0 reads them before it joins and fails at once, naming
each term that differs. Rank 0 itself then fails at ``--dist-timeout``, as for any rank that
never joins.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.launch.liveness import connect_store
from moeserve.launch.spec import LaunchSpec

_KEY = "moeserve/terms"


def group_terms(config: EngineConfig, spec: LaunchSpec) -> dict:
    """What every rank of one group must agree on: the layout, the hosts, the weights' format
    and the checkpoint (its ``config.json``'s content, wherever each host mounts it)."""
    dims = config.parallel_dims
    try:
        checkpoint = hashlib.sha256(Path(config.model, "config.json").read_bytes()).hexdigest()
    except OSError:
        checkpoint = "unreadable"
    return {
        "layout": dims.describe(),
        "world size": dims.world_size,
        "nodes": spec.nnodes,
        "redundant experts": config.num_redundant_experts,
        "quantization": config.quantization or "none",
        "int4 options": f"group {config.int4_group_size}, symmetric {config.int4_symmetric}",
        "dtype": config.dtype,
        "checkpoint config.json sha256": checkpoint[:16],
    }


def publish_terms(spec: LaunchSpec, terms: dict, timeout_s: float) -> threading.Thread:
    """Rank 0: write ``terms`` once the store is up (from a thread, returned)."""

    def write() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                connect_store(spec, timeout_s=2.0).set(_KEY, json.dumps(terms))
                return
            except (RuntimeError, dist.DistError, OSError):
                time.sleep(0.2)  # the store is not up yet

    thread = threading.Thread(target=write, name="moeserve-group-terms", daemon=True)
    thread.start()
    return thread


def check_terms(spec: LaunchSpec, terms: dict, timeout_s: float) -> None:
    """A rank > 0: raise ValueError naming every term that differs from rank 0's, and
    RuntimeError when rank 0 has published nothing within ``timeout_s`` (it is not up)."""
    deadline = time.monotonic() + timeout_s
    theirs = None
    while theirs is None and time.monotonic() < deadline:
        try:
            store = connect_store(spec, timeout_s=2.0)
            if store.check([_KEY]):
                theirs = json.loads(store.get(_KEY))
                break
        except (RuntimeError, dist.DistError, OSError):
            pass
        time.sleep(0.2)
    if theirs is None:
        raise RuntimeError(
            f"rank {spec.rank}: rank 0 did not come up at {spec.master_addr}:{spec.master_port} "
            f"within {timeout_s:g}s ({spec.source} launch): is node 0 started, and is that "
            f"its address?"
        )
    differ = [
        f"{name}: {terms.get(name)!r} here, {theirs.get(name)!r} on node 0"
        for name in sorted(set(terms) | set(theirs))
        if terms.get(name) != theirs.get(name)
    ]
    if differ:
        raise ValueError(
            f"rank {spec.rank} (node {spec.node_rank}) was started unlike node 0 ("
            + "; ".join(differ)
            + "): start every host with the same layout flags, --nnodes, model and "
            "quantization"
        )
