"""One rank per NUMA node, its threads pinned to that node's CPUs.

:func:`read_topology` reads the nodes from sysfs (``/sys/devices/system/node/nodeN/cpulist`` and
``meminfo``), keeping only the CPUs this process may run on. :func:`plan_binding` is a pure
function from that topology to one :class:`RankBinding` per local rank; :func:`apply_binding`
applies one in the rank's own process.

Memory is bound only by first touch: Linux places a page on the node of the CPU that first writes
it, so a rank that pins itself before loading its weights and allocating its KV cache finds them in
its node's memory. Strict memory policies (``numactl --membind``, ``mbind``) are out of scope.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from moeserve.platform import UNPINNED_CPUS_ENV

MODES = ("auto", "none")


@dataclass(frozen=True)
class NumaNode:
    """A NUMA node: its id, the CPUs on it (sorted) and its memory, None when unknown."""

    id: int
    cpus: tuple[int, ...]
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.id < 0:
            raise ValueError(f"NUMA node id must be >= 0, got {self.id}")
        _check_cpus(self.cpus, f"NUMA node {self.id}")
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise ValueError(f"NUMA node {self.id}: memory_bytes must be >= 0")


@dataclass(frozen=True)
class RankBinding:
    """Where one local rank runs: its CPUs (sorted), its intra-op thread count, and its NUMA
    node, None when the rank is unpinned or spans several nodes."""

    local_rank: int
    numa_node: int | None
    cpus: tuple[int, ...]
    num_threads: int

    def __post_init__(self) -> None:
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if self.numa_node is not None and self.numa_node < 0:
            raise ValueError(f"numa_node must be >= 0 or None, got {self.numa_node}")
        if not self.cpus:
            raise ValueError(f"local rank {self.local_rank} has no CPUs")
        _check_cpus(self.cpus, f"local rank {self.local_rank}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


def _check_cpus(cpus: tuple[int, ...], owner: str) -> None:
    if any(c < 0 for c in cpus) or list(cpus) != sorted(set(cpus)):
        raise ValueError(f"{owner}: cpus must be sorted, distinct and >= 0, got {cpus}")


# ---- cpulist format -----------------------------------------------------------------------------


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-3,8-11"`` -> ``(0, 1, 2, 3, 8, 9, 10, 11)``, sorted; an empty string is no CPUs."""
    cpus: set[int] = set()
    for piece in text.strip().split(","):
        piece = piece.strip()
        if not piece:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if m is None:
            raise ValueError(f"bad CPU list {text.strip()!r}: {piece!r} is not N or N-M")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"bad CPU list {text.strip()!r}: range {piece!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist`: ``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``."""
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in _runs(cpus))


def _runs(cpus: Iterable[int]) -> list[tuple[int, ...]]:
    """Maximal runs of consecutive CPU numbers: ``0,1,2,8,9`` -> ``[(0, 1, 2), (8, 9)]``."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return [tuple(r) for r in runs]


# ---- reading the topology -----------------------------------------------------------------------


def process_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def read_topology(
    sysfs_root: str | os.PathLike[str] = "/sys/devices/system/node",
    allowed_cpus: Iterable[int] | None = None,
) -> list[NumaNode]:
    """The NUMA nodes under ``sysfs_root`` in id order, restricted to ``allowed_cpus``
    (default: this process's affinity mask); nodes left without CPUs are dropped.

    Falls back to one node 0 holding all allowed CPUs when the tree is absent or none of its
    nodes holds an allowed CPU. Allowed CPUs on no node are left out. Raises ValueError when no
    CPU is allowed or a cpulist file cannot be parsed.
    """
    allowed = set(process_cpus() if allowed_cpus is None else allowed_cpus)
    if not allowed:
        raise ValueError("no CPUs allowed: the affinity mask of this process is empty")
    nodes = []
    for node_id, path in _node_dirs(Path(sysfs_root)):
        try:
            cpus = parse_cpulist(_read(path / "cpulist") or "")
        except ValueError as e:
            raise ValueError(f"{path / 'cpulist'}: {e}") from None
        cpus = tuple(c for c in cpus if c in allowed)
        if cpus:
            nodes.append(NumaNode(node_id, cpus, _mem_total(_read(path / "meminfo"))))
    return nodes or [NumaNode(0, tuple(sorted(allowed)), None)]


def _node_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = re.fullmatch(r"node(\d+)", path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _mem_total(meminfo: str | None) -> int | None:
    """Bytes of ``Node 0 MemTotal:  32768000 kB``; None when absent."""
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo or "")
    return int(m.group(1)) * 1024 if m else None


# ---- planning -----------------------------------------------------------------------------------


def plan_binding(
    topology: Sequence[NumaNode], local_world_size: int, mode: str = "auto"
) -> list[RankBinding]:
    """One binding per local rank, in local-rank order. Nodes without CPUs are ignored.

    ``none``: every rank may run on every CPU, with ``total_cpus // local_world_size`` threads.
    ``auto`` (CPU sets are disjoint, threads = CPUs given):

    - as many ranks as nodes: rank i gets node i;
    - fewer ranks than nodes: consecutive nodes are grouped per rank, group sizes differing by
      at most one;
    - more ranks than nodes: the ranks are dealt over the nodes as evenly as possible (any extra
      ranks go to the nodes with the most CPUs), consecutive ranks on one node, and each node's
      CPUs are split into parts differing by at most one CPU. Where a node lists its hardware
      threads as equal runs (``0-15,64-79``: Linux numbers each core's second thread in a
      separate range), every part takes the same slice of each run, so a core's threads stay on
      one rank.

    Raises ValueError for an unknown mode, no CPUs, nodes sharing CPUs, or a rank left without
    a CPU (more ranks on a node than it has CPUs).
    """
    if mode not in MODES:
        raise ValueError(f"unknown NUMA binding mode {mode!r}; choose {' | '.join(MODES)}")
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    nodes = [n for n in topology if n.cpus]
    all_cpus = tuple(sorted({c for n in nodes for c in n.cpus}))
    if not all_cpus:
        raise ValueError("the NUMA topology holds no CPUs")
    if len(all_cpus) != sum(len(n.cpus) for n in nodes):
        raise ValueError("NUMA nodes share CPUs; each CPU must belong to one node")

    if mode == "none":
        threads = max(1, len(all_cpus) // local_world_size)
        return [RankBinding(r, None, all_cpus, threads) for r in range(local_world_size)]

    if local_world_size <= len(nodes):
        groups = _even_chunks(nodes, local_world_size)
        return [
            RankBinding(
                local_rank=r,
                numa_node=group[0].id if len(group) == 1 else None,
                cpus=tuple(sorted(c for n in group for c in n.cpus)),
                num_threads=sum(len(n.cpus) for n in group),
            )
            for r, group in enumerate(groups)
        ]

    bindings: list[RankBinding] = []
    for node, count in zip(nodes, _ranks_per_node(nodes, local_world_size)):
        if len(node.cpus) < count:
            raise ValueError(
                f"cannot give each of {local_world_size} ranks its own CPUs: NUMA node {node.id} "
                f"has {len(node.cpus)} CPUs for {count} ranks ({len(all_cpus)} CPUs on "
                f"{len(nodes)} nodes); start fewer ranks per host or use binding mode 'none'"
            )
        for part in _split_cpus(node.cpus, count):
            bindings.append(RankBinding(len(bindings), node.id, part, len(part)))
    return bindings


def _ranks_per_node(nodes: Sequence[NumaNode], ranks: int) -> list[int]:
    """Deal ``ranks`` over the nodes evenly; the ``ranks % len(nodes)`` extra ones go to the
    nodes with the most CPUs (ties: lower position first)."""
    base, extra = divmod(ranks, len(nodes))
    order = sorted(range(len(nodes)), key=lambda i: (-len(nodes[i].cpus), i))
    lucky = set(order[:extra])
    return [base + (i in lucky) for i in range(len(nodes))]


def _split_cpus(cpus: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """``parts`` disjoint pieces of ``cpus`` whose sizes differ by at most one."""
    runs = _runs(cpus)
    if len(runs) > 1 and len({len(r) for r in runs}) == 1 and len(runs[0]) % parts == 0:
        # hardware-thread runs: "0-15,64-79" with 2 parts -> 0-7,64-71 | 8-15,72-79
        size = len(runs[0]) // parts
        return [tuple(c for r in runs for c in r[j * size : (j + 1) * size]) for j in range(parts)]
    return [tuple(chunk) for chunk in _even_chunks(cpus, parts)]


def _even_chunks(items: Sequence, parts: int) -> list[Sequence]:
    """Consecutive chunks, the first ``len(items) % parts`` one longer than the rest."""
    base, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for j in range(parts):
        end = start + base + (j < extra)
        chunks.append(items[start:end])
        start = end
    return chunks


# ---- applying and reporting ---------------------------------------------------------------------


def apply_binding(binding: RankBinding) -> None:
    """Pin this process to ``binding.cpus`` and size torch's intra-op pool to
    ``binding.num_threads``; OMP_NUM_THREADS is set too, for child processes.

    Call it first thing in the rank's process, before torch runs an op and before weights are
    loaded: threads started earlier keep their old affinity, and pages touched earlier stay
    where they were placed.
    """
    import torch

    if hasattr(os, "sched_setaffinity"):
        # what the process had before, for threads that must not share the rank's cores
        # with its busy compute threads (the KV transfer engine's: moeserve/disagg/mooncake.py)
        os.environ.setdefault(UNPINNED_CPUS_ENV, ",".join(map(str, process_cpus())))
        os.sched_setaffinity(0, binding.cpus)
    torch.set_num_threads(binding.num_threads)
    os.environ["OMP_NUM_THREADS"] = str(binding.num_threads)


def describe(bindings: Sequence[RankBinding]) -> str:
    """One log line per rank: ``local rank 0: NUMA node 1, 8 CPUs 8-15, 8 threads``."""
    lines = []
    for b in bindings:
        node = f"NUMA node {b.numa_node}" if b.numa_node is not None else "NUMA node -"
        lines.append(
            f"local rank {b.local_rank}: {node}, {len(b.cpus)} CPUs {format_cpulist(b.cpus)}, "
            f"{b.num_threads} threads"
        )
    return "\n".join(lines)
