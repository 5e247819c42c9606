"""Elastic EP: after a rank loss the survivors form a new world without it
(``--enable-elastic-ep``), a new *generation* of the group on the same rendezvous store.

Generation ``g`` is a list of launch ranks (``LaunchSpec.rank``, fixed for a process's life);
world rank ``i`` of generation ``g`` is its ``i``-th member, so rank 0 (the API and the
coordination) stays world rank 0. The store (owned by rank 0's process for the service's
life: :func:`open_store`) holds::

    moeserve/elastic/gen                the newest generation rank 0 decided
    moeserve/elastic/<g>/members        its members (JSON list of launch ranks)
    moeserve/elastic/<g>/here/<rank>    a member of generation g whose collective failed
    moeserve/elastic/dead/<rank>        a rank seen dead by whoever spawned it
    moeserve/elastic/join/<rank>        a replacement for launch rank <rank> waits to join
    moeserve/elastic/<g>/pg/...         generation g's process-group rendezvous

A failed collective (a peer's connection reset: at once; a silent peer: the collective
timeout, ``elastic_ep_timeout_s``) sends every member here::

    every member     destroy the process group (its sockets close, so members blocked on
                     this one fail too), then check in: here/<rank> of generation g
    rank 0           waits until every member of g checked in or is known dead (exit seen,
                     a dead/<rank> report, no heartbeat), at most the timeout + a margin;
                     members of g+1 = rank 0 + those that checked in; publishes them
    a member         waits for generation g+1: in it, it joins its process group; not in it
                     (it checked in too late), it exits; no decision in time, it exits

A generation whose members are all of the last one (nobody died) ends the group instead:
elastic EP survives rank losses, not errors of a live rank. Rank 0 publishes an empty
member list then, and every member exits.

A replacement (``--elastic-rejoin``) asks to join (join/<rank>) and waits for a generation
that includes it. Rank 0 sees the request between two steps and tells the members to grow;
every member leaves its generation, rank 0 publishes the next one (the members, then the
replacements: no member's world rank changes) and all of them form it together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from moeserve.distributed.groups import Axis, ParallelGroups
from moeserve.distributed.parallel_dims import ParallelDims
from moeserve.launch.liveness import connect_store
from moeserve.launch.spec import LaunchSpec

logger = logging.getLogger(__name__)

_PREFIX = "moeserve/elastic"
_GEN_KEY = f"{_PREFIX}/gen"
_JOINS_KEY = f"{_PREFIX}/joins"  # join requests so far (a counter): rank 0 scans when it moves
CHECK_IN_MARGIN_S = 5.0  # rank 0 waits this long past the collective timeout for check-ins


class GroupEnded(RuntimeError):
    """This rank is not part of the group any more (excluded, or the group ended)."""


def _members_key(gen: int) -> str:
    return f"{_PREFIX}/{gen}/members"


def _join_key(rank: int) -> str:
    return f"{_PREFIX}/join/{rank}"


def _here_key(gen: int, rank: int) -> str:
    return f"{_PREFIX}/{gen}/here/{rank}"


def dead_key(rank: int) -> str:
    return f"{_PREFIX}/dead/{rank}"


def report_dead(spec: LaunchSpec, rank: int, why: str) -> bool:
    """A host's agent: tell rank 0 that launch rank ``rank`` of this host died, so a recovery
    need not wait for it. False when the store cannot be reached (rank 0 is gone too)."""
    try:
        connect_store(spec, timeout_s=3.0).set(dead_key(rank), why)
        return True
    except (RuntimeError, dist.DistError, OSError) as e:
        logger.warning("could not report rank %d's death to the group: %s", rank, e)
        return False


def open_store(spec: LaunchSpec, timeout_s: float) -> dist.TCPStore:
    """The group's rendezvous store: rank 0 serves it (for the life of this process, across
    generations), the others connect to it."""
    return dist.TCPStore(
        spec.master_addr.strip("[]"),
        spec.master_port,
        world_size=None,
        is_master=spec.rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def set_collective_timeout(groups: ParallelGroups, seconds: float) -> None:
    """Every process group of ``groups`` fails a collective that waits ``seconds``."""
    seen = set()
    for axis in (groups.world, groups.ep, groups.tp, groups.pp, groups.replica):
        group = axis.group
        if axis.size == 1 or group is None or id(group) in seen:
            continue
        seen.add(id(group))
        group._get_backend(torch.device("cpu")).set_timeout(timedelta(seconds=seconds))


def grown_config(config, num_ranks: int, num_experts: int):
    """``config`` for a rank joining a group of ``num_ranks``: each rank keeps the slots per
    rank of the original layout, so the redundant slots follow the rank count."""
    S = (num_experts + config.num_redundant_experts) // config.data_parallel_size
    return dataclasses.replace(
        config,
        data_parallel_size=num_ranks,
        num_redundant_experts=num_ranks * S - num_experts,
        elastic_rejoin=(),
    )


def elastic_dims(num_ranks: int) -> ParallelDims:
    """An elastic group's layout: every rank its own DP replica, the experts over all."""
    return ParallelDims(tp=1, dp=num_ranks, pp=1, enable_expert_parallel=True)


class Membership:
    """This process's view of the generations (see the module's doc)."""

    def __init__(
        self, spec: LaunchSpec, store: dist.TCPStore, backend: str, joining: bool = False
    ) -> None:
        """``joining``: a replacement, whose generation :meth:`join` finds."""
        self.spec, self.store, self.backend = spec, store, backend
        self.generation = 0
        self.members: tuple[int, ...] = tuple(range(spec.world_size))
        self._joins_seen = 0
        if spec.rank == 0 and not joining:
            store.set(_GEN_KEY, "0")
            store.set(_members_key(0), json.dumps(list(self.members)))

    @property
    def index(self) -> int:
        """This rank's world rank in the current generation."""
        return self.members.index(self.spec.rank)

    def init_world(self, timeout_s: float) -> ParallelGroups:
        """Join the current generation's process group; returns its groups."""
        n = len(self.members)
        if n > 1:
            prefix = f"{_PREFIX}/{self.generation}/pg/"
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(prefix, self.store),
                rank=self.index,
                world_size=n,
                timeout=timedelta(seconds=timeout_s),
            )
        dims = elastic_dims(n)
        if n == 1:
            return _alone(dims)
        return ParallelGroups.build(dims)

    def leave_world(self) -> None:
        """Drop the current process group (closing its connections)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - a broken group may fail to close cleanly
                logger.debug("destroying the failed process group: %s", e)

    def check_in(self) -> None:
        self.store.set(_here_key(self.generation, self.spec.rank), "1")

    def decide(self, known_dead: Callable[[], set[int]], wait_s: float) -> tuple[int, ...]:
        """Rank 0: the members of the next generation (published before this returns).
        Waits up to ``wait_s`` for every member to check in or be known dead."""
        gen = self.generation
        deadline = time.monotonic() + wait_s
        while True:
            dead = known_dead() | self._reported_dead()
            here = {r for r in self.members[1:] if self.store.check([_here_key(gen, r)])}
            pending = [r for r in self.members[1:] if r not in here and r not in dead]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        nxt = (0, *sorted(here - dead))
        if len(nxt) == len(self.members):
            nxt = ()  # nobody died: the group ends (see the module's doc)
        self.store.set(_members_key(gen + 1), json.dumps(list(nxt)))
        self.store.set(_GEN_KEY, str(gen + 1))
        if pending:
            logger.warning("ranks %s did not check in within %.0fs: left out", pending, wait_s)
        return self._advance(nxt)

    def follow(self, wait_s: float) -> tuple[int, ...]:
        """A rank > 0: the members of the next generation, once rank 0 published them.
        Raises GroupEnded when it leaves this rank out, ends the group, or is not decided
        within ``wait_s``."""
        key = _members_key(self.generation + 1)
        deadline = time.monotonic() + wait_s
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                raise GroupEnded(f"rank 0 decided no new generation within {wait_s:.0f}s")
            time.sleep(0.05)
        nxt = tuple(json.loads(self.store.get(key)))
        if self.spec.rank not in nxt:
            raise GroupEnded(
                "the group ended" if not nxt else f"the group went on without this rank: {nxt}"
            )
        return self._advance(nxt)

    def joiners(self) -> list[int]:
        """Rank 0: the launch ranks waiting to join (not members now); one store request
        while nobody asked since the last look."""
        asked = self.store.add(_JOINS_KEY, 0)
        if asked == self._joins_seen:
            return []
        world = self.spec.world_size
        found = [
            r for r in range(1, world) if r not in self.members and self.store.check([_join_key(r)])
        ]
        if not found:  # every request seen is served (or withdrawn)
            self._joins_seen = asked
        return found

    def grow(self, joiners: list[int]) -> tuple[int, ...]:
        """Rank 0: publish the next generation, the members then ``joiners``."""
        gen = self.generation
        nxt = (*self.members, *joiners)
        for r in joiners:
            self.store.delete_key(_join_key(r))
        self.store.set(_members_key(gen + 1), json.dumps(list(nxt)))
        self.store.set(_GEN_KEY, str(gen + 1))
        return self._advance(nxt)

    def current_members(self) -> tuple[int, ...]:
        """The members of the newest generation, as the store has them."""
        return self._newest()[1]

    def _newest(self) -> tuple[int, tuple[int, ...]]:
        """The newest generation and its members, as the store has them."""
        gen = int(self.store.get(_GEN_KEY))
        return gen, tuple(json.loads(self.store.get(_members_key(gen))))

    def join(self, wait_s: float) -> tuple[int, ...]:
        """A replacement: ask to join and wait (up to ``wait_s``) for the generation that
        includes this rank; its members. Raises GroupEnded when none comes, and ValueError
        when this launch rank is a member now."""
        rank = self.spec.rank
        if rank in self.current_members():
            raise ValueError(f"launch rank {rank} is a member of the running group already")
        self.store.delete_key(dead_key(rank))  # its predecessor's death is history
        self.store.set(_join_key(rank), "1")
        self.store.add(_JOINS_KEY, 1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            gen, members = self._newest()
            if rank in members:
                self.generation, self.members = gen, members
                return members
            time.sleep(0.1)
        self.store.delete_key(_join_key(rank))
        raise GroupEnded(f"the group did not take launch rank {rank} in within {wait_s:.0f}s")

    def _advance(self, members: tuple[int, ...]) -> tuple[int, ...]:
        self.generation += 1
        self.members = members
        return members

    def _reported_dead(self) -> set[int]:
        return {r for r in self.members if self.store.check([dead_key(r)])}


def detached_groups(num_ranks: int, index: int) -> ParallelGroups:
    """The groups world rank ``index`` of ``num_ranks`` will have, without process groups: a
    replacement builds its engine (loads its weights) on these before it joins, so the group
    does not wait for its loading; the real ones replace them when it joins."""
    dims = elastic_dims(num_ranks)
    ranks = tuple(range(num_ranks))
    return ParallelGroups(
        dims,
        dims.coords(index),
        Axis.single("tp", index),
        Axis("ep", num_ranks, index, ranks),
        Axis.single("pp", index),
        Axis.single("replica", index),
        Axis("world", num_ranks, index, ranks),
    )


def _alone(dims: ParallelDims) -> ParallelGroups:
    """The groups of a world of one that keeps the expert-parallel layout's meaning."""
    single = ParallelGroups.single()
    return ParallelGroups(
        dims,
        dims.coords(0),
        single.tp,
        single.ep,
        single.pp,
        single.replica,
        single.world,
    )
