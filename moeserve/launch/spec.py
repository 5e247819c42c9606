"""Where this process sits in the world: rank, world size, node and rendezvous address.

moeserve ranks start one of four ways:

- ``spawn``: a single host; moeserve spawns its local ranks itself (:func:`plan_local_ranks`).
- ``torchrun``: the elastic agent sets RANK, WORLD_SIZE, LOCAL_RANK, ... (:func:`detect_external`).
- ``slurm``: ``srun`` sets SLURM_PROCID, SLURM_NTASKS, ... (:func:`detect_external`).
- ``flags``: by hand across hosts, ``--nnodes N --node-rank I --master-addr A --master-port P``;
  each host's moeserve spawns its share of the ranks (:func:`plan_local_ranks`).

Everything here reads plain data (an environment mapping, a node list string) and returns frozen
:class:`LaunchSpec` values, so it is tested without processes. Nothing is stored in module globals.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

SOURCES = ("spawn", "torchrun", "slurm", "flags")

# Default rendezvous port under Slurm when MASTER_PORT is not set: every task derives the same
# port from SLURM_JOB_ID without talking, and two jobs sharing a node rarely collide.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class LaunchSpec:
    """One rank's place in the world and the address every rank meets at."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown launch source {self.source!r}; choose {' | '.join(SOURCES)}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(
                f"local_world_size must be in [1, world_size={self.world_size}], "
                f"got {self.local_world_size}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, {self.local_world_size}), got {self.local_rank}"
            )
        if not 1 <= self.nnodes <= self.world_size:
            raise ValueError(
                f"nnodes must be in [1, world_size={self.world_size}], got {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.source == "spawn" and self.nnodes != 1:
            raise ValueError(f"a spawned world lives on one host, got nnodes={self.nnodes}")
        if not self.master_addr.strip():
            raise ValueError("master_addr is empty; give the address of the host of rank 0")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")

    @property
    def init_method(self) -> str:
        """``tcp://addr:port`` for ``torch.distributed.init_process_group``; IPv6 bracketed."""
        addr = self.master_addr
        if ":" in addr and not addr.startswith("["):
            addr = f"[{addr}]"
        return f"tcp://{addr}:{self.master_port}"

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that owns the scheduler and talks to clients."""
        return self.rank == 0


# ---- node lists -------------------------------------------------------------------------------


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``"node[01-03,07],gpu5,x[1-2]-ib"`` ->
    ``[node01, node02, node03, node07, gpu5, x1-ib, x2-ib]``.

    Commas separate hosts only outside brackets. A name may hold several bracket groups
    (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2: the leftmost group varies slowest). A range keeps
    the zero padding of its lower bound (``[08-10]`` -> 08, 09, 10). Raises ValueError on an
    empty list, an empty name, unbalanced or nested brackets, or a malformed range.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("empty node list; expected e.g. 'node[01-04]' or 'host1,host2'")
    hosts: list[str] = []
    for item in _split_top_level(text):
        if not item.strip():
            raise ValueError(f"empty host name in node list {nodelist!r}")
        hosts.extend(_expand_host(item.strip(), nodelist))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets; checks that brackets balance and don't nest."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' at position {i} in node list {text!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"unmatched ']' at position {i} in node list {text!r}")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in node list {text!r}")
    items.append(text[start:])
    return items


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    # pattern alternates literal text and bracket bodies: "x[1-2]-ib" -> "x", "1-2", "-ib"
    parts = re.split(r"\[([^\]]*)\]", pattern)
    names = [""]
    for i, part in enumerate(parts):
        choices = _expand_ranges(part, nodelist) if i % 2 else [part]
        names = [name + choice for name in names for choice in choices]
    return names


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]``."""
    out: list[str] = []
    for piece in body.split(","):
        piece = piece.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if m is None:
            raise ValueError(
                f"bad range {piece!r} in node list {nodelist!r}; expected N or N-M with digits"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise ValueError(f"range {piece!r} in node list {nodelist!r} runs backwards")
        width = len(lo_text)
        out.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's task counts per node: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for piece in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"bad task count {piece!r} in {spec!r}; expected e.g. '4(x2),3'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# ---- environments set by a launcher ------------------------------------------------------------


def detect_external(env: Mapping[str, str]) -> LaunchSpec | None:
    """The spec set by an external launcher in ``env``, or None when there is none.

    torchrun is recognised by RANK and WORLD_SIZE, Slurm by SLURM_PROCID and SLURM_NTASKS;
    torchrun wins when both are present (torchrun started under srun sets both). Raises
    ValueError naming the variable when one the launcher should have set is missing or invalid.
    Note that an sbatch script also sets SLURM_PROCID=0: start multi-task runs with ``srun``.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return None


def _from_torchrun(env: Mapping[str, str]) -> LaunchSpec:
    hint = "torchrun sets it; when setting RANK and WORLD_SIZE by hand, set it too"
    world_size = _env_int(env, "WORLD_SIZE", hint, minimum=1)
    rank = _env_int(env, "RANK", hint)
    local_rank = _env_int(env, "LOCAL_RANK", hint)
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", hint, minimum=1)
    if "GROUP_WORLD_SIZE" in env:
        nnodes = _env_int(env, "GROUP_WORLD_SIZE", hint, minimum=1)
    elif world_size % local_world_size == 0:
        nnodes = world_size // local_world_size
    else:
        raise ValueError(
            f"GROUP_WORLD_SIZE is not set and WORLD_SIZE={world_size} is not a multiple of "
            f"LOCAL_WORLD_SIZE={local_world_size}; set GROUP_WORLD_SIZE to the number of nodes"
        )
    if "GROUP_RANK" in env:
        node_rank = _env_int(env, "GROUP_RANK", hint)
    else:
        node_rank = rank // local_world_size
    return _build(
        source="torchrun",
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=_env_str(env, "MASTER_ADDR", hint),
        master_port=_env_port(env, "MASTER_PORT", hint),
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchSpec:
    hint = "srun sets it; start moeserve with srun"
    world_size = _env_int(env, "SLURM_NTASKS", hint, minimum=1)
    rank = _env_int(env, "SLURM_PROCID", hint)
    local_rank = _env_int(env, "SLURM_LOCALID", hint)
    node_rank = _env_int(env, "SLURM_NODEID", hint)

    tasks_var = _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tasks_var is None:
        raise ValueError(f"SLURM_STEP_TASKS_PER_NODE is not set ({hint})")
    try:
        counts = expand_tasks_per_node(env[tasks_var])
    except ValueError as e:
        raise ValueError(f"{tasks_var}: {e}") from None
    nnodes = (
        _env_int(env, "SLURM_NNODES", hint, minimum=1) if "SLURM_NNODES" in env else len(counts)
    )
    if len(counts) != nnodes:
        raise ValueError(
            f"{tasks_var}={env[tasks_var]!r} lists {len(counts)} nodes but SLURM_NNODES={nnodes}"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is outside the step's {nnodes} nodes")
    if sum(counts) != world_size:
        raise ValueError(
            f"{tasks_var}={env[tasks_var]!r} adds up to {sum(counts)} tasks "
            f"but SLURM_NTASKS={world_size}"
        )

    if "MASTER_ADDR" in env:
        master_addr = _env_str(env, "MASTER_ADDR", hint)
    else:
        list_var = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        if list_var is None:
            raise ValueError(f"SLURM_STEP_NODELIST is not set ({hint}), nor is MASTER_ADDR")
        try:
            master_addr = expand_nodelist(env[list_var])[0]
        except ValueError as e:
            raise ValueError(f"{list_var}: {e}") from None
    if "MASTER_PORT" in env:
        master_port = _env_port(env, "MASTER_PORT", hint)
    else:
        job_id = _env_int(env, "SLURM_JOB_ID", f"{hint}, or set MASTER_PORT")
        master_port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return _build(
        source="slurm",
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        local_world_size=counts[node_rank],
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )


def _build(source: str, **fields: int | str) -> LaunchSpec:
    """A LaunchSpec whose validation errors say which launcher's variables were inconsistent."""
    try:
        return LaunchSpec(source=source, **fields)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"inconsistent {source} environment: {e}") from None


def _first_set(env: Mapping[str, str], *names: str) -> str | None:
    return next((name for name in names if env.get(name, "").strip()), None)


def _env_str(env: Mapping[str, str], name: str, hint: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ValueError(f"{name} is not set ({hint})")
    return value


def _env_int(env: Mapping[str, str], name: str, hint: str, minimum: int = 0) -> int:
    text = _env_str(env, name, hint)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _env_port(env: Mapping[str, str], name: str, hint: str) -> int:
    port = _env_int(env, name, hint)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={port} is not a TCP port; expected 1-65535")
    return port


# ---- ranks moeserve spawns itself --------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it before
    rank 0 binds it, which init_process_group then reports)."""
    addr = host.strip("[]")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def plan_local_ranks(
    world_size: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> list[LaunchSpec]:
    """The specs of the ranks this host spawns: ``node_rank * nproc .. + nproc - 1`` with
    ``nproc = world_size / nnodes``.

    One host (``nnodes == 1``) picks a free port when none is given; several hosts must agree
    on one, so ``master_port`` is then required. Raises ValueError when world_size does not
    divide by nnodes, node_rank is out of range, or the port is missing.
    """
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if world_size % nnodes:
        raise ValueError(
            f"world size {world_size} does not divide evenly over --nnodes {nnodes}; "
            f"every host runs the same number of ranks"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(
            f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, got {node_rank}"
        )
    if master_port is None:
        if nnodes > 1:
            raise ValueError(
                f"--master-port is required with --nnodes {nnodes}: every host must use the same "
                f"port on --master-addr {master_addr}"
            )
        master_port = free_port(master_addr)
    nproc = world_size // nnodes
    return [
        LaunchSpec(
            world_size=world_size,
            rank=node_rank * nproc + local_rank,
            local_rank=local_rank,
            local_world_size=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            source="spawn" if nnodes == 1 else "flags",
        )
        for local_rank in range(nproc)
    ]


_STARTED_BY = {
    "torchrun": ("torchrun started", "start torchrun with --nnodes x --nproc-per-node = {n}"),
    "slurm": ("srun started", "run srun with --ntasks {n}"),
    "spawn": ("moeserve planned", "this is a bug in the launch plan"),
    "flags": ("moeserve planned", "check --nnodes"),
}


def check_world_size(spec: LaunchSpec, expected: int, layout: str) -> None:
    """Raise ValueError when the launcher's world size differs from what the parallel layout
    needs; ``layout`` describes it for the message, e.g. ``"--tp 2 --dp 4 --pp 1"``."""
    if spec.world_size == expected:
        return
    started, fix = _STARTED_BY[spec.source]
    raise ValueError(
        f"{started} {spec.world_size} ranks but {layout} needs {expected}; {fix.format(n=expected)}"
    )
