"""A Kubernetes LeaderWorkerSet group as moeserve's multi-host launch flags.

LeaderWorkerSet (LWS, kubernetes-sigs/lws) runs a group of ``size`` pods, one per host, and
injects three variables into every container of every pod:

    LWS_LEADER_ADDRESS  <lws>-<group>.<lws>.<namespace>  (the leader's name in LWS's headless
                        service, which publishes pods before they are ready)  -> --master-addr
    LWS_GROUP_SIZE      pods in the group                                     -> --nnodes
    LWS_WORKER_INDEX    0 for the leader, 1..size-1 for the workers           -> --node-rank

The rendezvous port is ``MASTER_PORT`` when the pod sets it, else :data:`DEFAULT_MASTER_PORT`.

:func:`lws_topology` reads those from an environment mapping; :func:`apply_lws` merges them with
the command-line flags. Explicit flags and LWS must agree: the environment fills in a flag that
was not given (``None``), a flag equal to the environment's value is accepted, and a flag that
differs is an error naming both (a pod whose flags say one rank and LWS another would join the
wrong place in the group). ``--master-port`` conflicts only with a ``MASTER_PORT`` the pod sets,
not with the default, which only fills in. Outside LWS (none of the three variables set) the
flags pass through, with ``--nnodes`` and ``--node-rank`` defaulting to 1 and 0.

Pure functions over plain data: nothing here reads ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
GROUP_SIZE = "LWS_GROUP_SIZE"
WORKER_INDEX = "LWS_WORKER_INDEX"
MASTER_PORT = "MASTER_PORT"
LWS_VARIABLES = (LEADER_ADDRESS, GROUP_SIZE, WORKER_INDEX)

# torch.distributed's customary port; the leader pod should declare it as a containerPort
DEFAULT_MASTER_PORT = 29500

_HINT = "LeaderWorkerSet sets LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX in every pod"


@dataclass(frozen=True)
class LwsTopology:
    """This pod's place in its LWS group, as moeserve's multi-host launch values.

    ``port_from_env`` says whether ``master_port`` came from ``MASTER_PORT`` (a value an
    explicit ``--master-port`` must agree with) or is :data:`DEFAULT_MASTER_PORT`.
    """

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    port_from_env: bool = False

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"{GROUP_SIZE}={self.nnodes} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"{WORKER_INDEX}={self.node_rank} is outside the group of "
                f"{GROUP_SIZE}={self.nnodes} pods; expected 0..{self.nnodes - 1}"
            )
        if not self.master_addr or any(c.isspace() for c in self.master_addr):
            raise ValueError(f"{LEADER_ADDRESS}={self.master_addr!r} is not a host name")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"{MASTER_PORT}={self.master_port} is not a TCP port (1-65535)")

    @property
    def is_leader(self) -> bool:
        """The leader pod (index 0): rank 0 and the HTTP API run here."""
        return self.node_rank == 0


def lws_topology(env: Mapping[str, str]) -> LwsTopology | None:
    """The LWS group this pod belongs to according to ``env``, or None outside LWS (none of
    the three LWS variables set; an empty value counts as unset).

    Raises ValueError naming the variable when one of the three is missing while another is
    set, or when a value is not an integer, out of range, or not a port.
    """
    present = [name for name in LWS_VARIABLES if env.get(name, "").strip()]
    if not present:
        return None
    missing = [name for name in LWS_VARIABLES if name not in present]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set while {', '.join(present)} is; {_HINT}, "
            f"so set all three or none"
        )
    port_from_env = bool(env.get(MASTER_PORT, "").strip())
    return LwsTopology(
        nnodes=_int(env, GROUP_SIZE),
        node_rank=_int(env, WORKER_INDEX),
        master_addr=env[LEADER_ADDRESS].strip(),
        master_port=_int(env, MASTER_PORT) if port_from_env else DEFAULT_MASTER_PORT,
        port_from_env=port_from_env,
    )


def apply_lws(
    env: Mapping[str, str],
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
) -> tuple[int, int, str | None, int | None]:
    """``(nnodes, node_rank, master_addr, master_port)`` from the flags (None: not given) and
    the LWS variables in ``env``.

    Under LWS each value comes from the environment, and a given flag must equal it (for
    ``--master-port`` only when ``MASTER_PORT`` is set; otherwise the flag wins over the
    default port). Outside LWS the flags are returned, ``nnodes`` and ``node_rank`` defaulting
    to 1 and 0; ``master_addr`` and ``master_port`` may stay None (one host). Raises ValueError
    on a conflict, naming the flag and the variable, and as :func:`lws_topology` does.
    """
    topo = lws_topology(env)
    if topo is None:
        nnodes = 1 if nnodes is None else nnodes
        node_rank = 0 if node_rank is None else node_rank
        return nnodes, node_rank, master_addr, master_port
    _agree("--nnodes", nnodes, GROUP_SIZE, topo.nnodes)
    _agree("--node-rank", node_rank, WORKER_INDEX, topo.node_rank)
    _agree("--master-addr", master_addr, LEADER_ADDRESS, topo.master_addr)
    if topo.port_from_env:
        _agree("--master-port", master_port, MASTER_PORT, topo.master_port)
    port = topo.master_port if master_port is None else master_port
    return topo.nnodes, topo.node_rank, topo.master_addr, port


def _agree(flag: str, given: int | str | None, var: str, value: int | str) -> None:
    if given is not None and given != value:
        raise ValueError(
            f"{flag} {given} conflicts with {var}={value} set by LeaderWorkerSet; "
            f"drop {flag} (the environment fills it in) or make the two agree"
        )


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError(f"{name}={text!r} is not a non-negative integer")
    return int(text)
