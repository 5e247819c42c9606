"""Who in the group is alive: every rank's heartbeat, rank 0's view of them, failure notices.

Everything goes through the rendezvous store (the ``TCPStore`` that ``init_process_group``
starts in world rank 0's process at ``--master-addr:--master-port``), on connections of its
own, so no collective of the engine is involved and a rank stuck in one still beats::

    moeserve/who/<rank>   set once by each rank: {"rank", "node", "host", "addr", "pid"}
    moeserve/hb/<rank>    a counter each rank > 0 adds 1 to every HEARTBEAT_INTERVAL_S
    moeserve/failed       the first failure a host reported (its agent saw a rank die)
    moeserve/api          the API's URL, once node 0 serves it (the other hosts log it)
    moeserve/left/<rank>  a rank stopped beating after the group's stop (rank 0 waits for
                          these before its store closes)
    moeserve/stop         a host other than node 0 was asked to stop (SIGTERM): node 0
                          drains and stops the whole group, as if it had been signalled

Rank 0 (:class:`RankMonitor`) reads the counters: a rank whose counter has not moved for
``MISSING_AFTER_S`` is *missing* (``/health`` answers 503 naming it), for ``dead_after_s`` it
is *dead* and the group ends. A rank > 0 (:class:`Heartbeat`) that cannot reach the store for
``MISSING_AFTER_S`` knows rank 0 is gone, and one that reads ``moeserve/failed`` knows the
group failed: either way it exits, so no rank outlives its group, however it was started
(moeserve, torchrun, srun).

torch's elastic agent has a heartbeat of its own, but only between torchrun's agents and
only under a c10d rendezvous; srun and moeserve's own launch have none, so the check is
here, once, for every launcher.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TextIO

import torch.distributed as dist

from moeserve.launch.netif import source_address
from moeserve.launch.spec import LaunchSpec

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
MISSING_AFTER_S = 3.0  # no heartbeat for this long: /health names the rank
DEAD_AFTER_S = 10.0  # ... for this long: the rank is dead and the group ends
_STORE_TIMEOUT_S = 5.0  # one store operation; longer means the store's host is gone
_FAILED_KEY = "moeserve/failed"
_API_KEY = "moeserve/api"
_STOP_KEY = "moeserve/stop"


@contextlib.contextmanager
def stall_dump(seconds: float | None, out: TextIO | None = None) -> Iterator[None]:
    """Every thread's stack to ``out`` (stderr: the rank's log) if the block runs past
    ``seconds`` (None: no watch). A worker rank handles each of rank 0's messages inside one,
    so a rank that stalls (a heartbeat that stops while the process lives, a collective of
    its peers about to time out) says where it is. faulthandler's watchdog is a C thread: it
    runs when the stalled thread holds the GIL too."""
    if seconds is None:
        yield
        return
    faulthandler.dump_traceback_later(seconds, file=out or sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _hb_key(rank: int) -> str:
    return f"moeserve/hb/{rank}"


def _who_key(rank: int) -> str:
    return f"moeserve/who/{rank}"


def _left_key(rank: int) -> str:
    return f"moeserve/left/{rank}"


def wait_for_ranks_to_leave(
    spec: LaunchSpec, ranks: list[int] | None = None, timeout_s: float = 5.0
) -> list[int]:
    """Rank 0, after its stop: wait until every rank > 0 (or those in ``ranks``) has stopped
    beating (``Heartbeat.stop``) before the store closes; returns the ranks that did not say
    so within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = list(range(1, spec.world_size)) if ranks is None else list(ranks)
    while pending and time.monotonic() < deadline:
        try:
            store = connect_store(spec, timeout_s=2.0)
            pending = [r for r in pending if not store.check([_left_key(r)])]
        except (RuntimeError, dist.DistError, OSError):
            return pending
        if pending:
            time.sleep(0.05)
    return pending


def connect_store(spec: LaunchSpec, timeout_s: float = _STORE_TIMEOUT_S) -> dist.TCPStore:
    """A new client connection to the group's rendezvous store; raises ConnectionError when
    nothing listens there (probed with a plain socket first: the store's own client logs
    every refused attempt at length)."""
    addr = (spec.master_addr.strip("[]"), spec.master_port)
    try:
        socket.create_connection(addr, timeout=min(timeout_s, 2.0)).close()
    except OSError as e:
        raise ConnectionError(f"nothing listens at {addr[0]}:{addr[1]}: {e}") from None
    return dist.TCPStore(
        spec.master_addr.strip("[]"),
        spec.master_port,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


@dataclass(frozen=True)
class RankIdentity:
    """Where a rank runs, as it said when it joined: for messages that name a dead rank."""

    rank: int
    node: int
    host: str
    addr: str
    pid: int

    @staticmethod
    def of_this_process(spec: LaunchSpec) -> RankIdentity:
        addr = source_address(spec.master_addr.strip("[]")) or ""
        return RankIdentity(spec.rank, spec.node_rank, socket.gethostname(), addr, os.getpid())

    def describe(self) -> str:
        where = f"{self.host} {self.addr}".strip()
        return f"rank {self.rank} (node {self.node}, host {where}, pid {self.pid})"


def publish_failure(spec: LaunchSpec, message: str) -> bool:
    """Tell the group (rank 0's monitor, every rank's heartbeat) that it failed, and why; the
    first report wins. Returns False when the store cannot be reached (rank 0 is gone too:
    there is nobody left to tell)."""
    try:
        store = connect_store(spec, timeout_s=3.0)
        store.compare_set(_FAILED_KEY, "", message)
        return True
    except (RuntimeError, dist.DistError, OSError) as e:
        logger.warning("could not report the failure to the group: %s", e)
        return False


def request_stop(spec: LaunchSpec, reason: str) -> threading.Thread:
    """Ask node 0 to stop the group (it drains first), from a thread (returned): a signal
    handler may run this while the process waits in a collective. The first request wins."""

    def send() -> None:
        try:
            connect_store(spec, timeout_s=3.0).compare_set(_STOP_KEY, "", reason)
        except (RuntimeError, dist.DistError, OSError) as e:
            logger.warning("could not ask node 0 to stop: %s", e)

    thread = threading.Thread(target=send, name="moeserve-stop-request", daemon=True)
    thread.start()
    return thread


def announce_api(spec: LaunchSpec, url: str) -> None:
    """Record where the API of this group is served, for the other hosts to log."""
    connect_store(spec).set(_API_KEY, url)


def read_api_url(store: dist.TCPStore) -> str | None:
    return store.get(_API_KEY).decode() if store.check([_API_KEY]) else None


class LivenessTable:
    """The pure bookkeeping of :class:`RankMonitor`: when each rank's counter last moved, on
    this process's clock (the hosts' clocks never meet)."""

    def __init__(self, ranks: list[int], now: float, dead_after_s: float = DEAD_AFTER_S) -> None:
        self.dead_after_s = dead_after_s
        self.counters: dict[int, int | None] = dict.fromkeys(ranks)
        self.moved_at = dict.fromkeys(ranks, now)
        self.who: dict[int, RankIdentity] = {}

    def observe(self, rank: int, counter: int, now: float) -> None:
        if counter != self.counters[rank]:
            self.counters[rank] = counter
            self.moved_at[rank] = now

    def silent_for(self, rank: int, now: float) -> float:
        return now - self.moved_at[rank]

    def missing(self, now: float) -> list[str]:
        """A line for each rank silent for MISSING_AFTER_S or more (rank order)."""
        return [
            f"{self.describe(r)}: no heartbeat for {self.silent_for(r, now):.1f}s"
            for r in self.counters
            if self.silent_for(r, now) >= MISSING_AFTER_S
        ]

    def dead(self, now: float) -> str | None:
        """Why the group must end, when a rank has been silent for ``dead_after_s``."""
        found = self.dead_ranks(now)
        return found[0][1] if found else None

    def dead_ranks(self, now: float) -> list[tuple[int, str]]:
        """Each rank silent for ``dead_after_s``, and why it is dead."""
        return [
            (
                r,
                f"{self.describe(r)} sent no heartbeat for {self.silent_for(r, now):.1f}s: "
                f"its process died or its host is unreachable",
            )
            for r in self.counters
            if self.silent_for(r, now) >= self.dead_after_s
        ]

    def silent(self, now: float, seconds: float) -> set[int]:
        """The ranks silent for ``seconds`` or more."""
        return {r for r in self.counters if self.silent_for(r, now) >= seconds}

    def forget(self, ranks) -> None:
        """Stop watching ``ranks`` (a group that went on without them)."""
        for r in ranks:
            self.counters.pop(r, None)
            self.moved_at.pop(r, None)

    def describe(self, rank: int) -> str:
        who = self.who.get(rank)
        return who.describe() if who is not None else f"rank {rank}"


class RankMonitor:
    """World rank 0's watch over the other ranks' heartbeats (a daemon thread).

    ``on_health(missing)`` runs when the list of missing ranks changes (an empty list: all
    back); ``on_stop(reason)`` once, when another host asks the group to stop;
    ``on_failure(reason)`` once, when a rank is dead or a host reported a failure; then the
    monitor stops. With ``on_dead`` (elastic EP) a dead rank is reported there instead, once,
    and the monitor goes on watching the others (the group forgets it: :meth:`forget`).
    :meth:`culprit` names the likely cause of a failed collective."""

    def __init__(
        self,
        spec: LaunchSpec,
        on_health: Callable[[list[str]], None],
        on_failure: Callable[[str], None],
        on_stop: Callable[[str], None],
        dead_after_s: float = DEAD_AFTER_S,
        poll_s: float = 0.5,
        on_dead: Callable[[int, str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.on_dead = on_dead
        self._reported_dead: set[int] = set()
        self.on_health, self.on_failure, self.on_stop = on_health, on_failure, on_stop
        self._stop_seen = False
        self.poll_s = poll_s
        self.table = LivenessTable(list(range(1, spec.world_size)), time.monotonic(), dead_after_s)
        self.failure: str | None = None
        self._missing: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="moeserve-rank-monitor", daemon=True)

    def start(self) -> RankMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_STORE_TIMEOUT_S + 1)

    @property
    def missing(self) -> list[str]:
        with self._lock:
            return list(self._missing)

    def silent_ranks(self, seconds: float) -> set[int]:
        """The ranks whose heartbeat has been still for ``seconds`` or more."""
        with self._lock:
            return self.table.silent(time.monotonic(), seconds)

    def describe(self, rank: int) -> str:
        """``rank (node, host address, pid)`` as the rank said when it joined."""
        with self._lock:
            return self.table.describe(rank)

    def forget(self, ranks) -> None:
        """Stop watching ``ranks``: the group went on without them."""
        with self._lock:
            self.table.forget(ranks)

    def watch_again(self, ranks) -> None:
        """Watch ``ranks`` (replacements that joined) from now on, as new ranks."""
        with self._lock:
            now = time.monotonic()
            for r in ranks:
                self.table.counters[r] = None
                self.table.moved_at[r] = now
                self.table.who.pop(r, None)
                self._reported_dead.discard(r)

    def culprit(self, wait_s: float) -> str | None:
        """The failure found, or the ranks missing, waiting up to ``wait_s`` for one (a
        collective fails the moment a peer's connection drops; its heartbeat stops later)."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.failure is not None:
                return self.failure
            missing = self.missing
            if missing:
                return "; ".join(missing)
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return None
            time.sleep(0.1)

    def _run(self) -> None:
        store = None
        while not self._stop.wait(self.poll_s):
            try:
                store = store or connect_store(self.spec)
                failure = self._poll(store, time.monotonic())
            except (RuntimeError, dist.DistError, OSError) as e:
                # the store lives in this process: it fails only while the group is closing
                logger.debug("rank monitor: store unavailable: %s", e)
                store = None
                continue
            if failure is not None and not self._stop.is_set():
                self.failure = failure
                self.on_failure(failure)
                return

    def _poll(self, store, now: float) -> str | None:
        table = self.table
        with self._lock:
            ranks = list(table.counters)
        seen = {}
        for r in ranks:
            if r not in table.who and store.check([_who_key(r)]):
                table.who[r] = RankIdentity(**json.loads(store.get(_who_key(r))))
            seen[r] = store.add(_hb_key(r), 0)
        with self._lock:
            for r, counter in seen.items():
                if r in table.counters:  # not forgotten meanwhile
                    table.observe(r, counter, now)
            missing = table.missing(now)
            changed, self._missing = missing != self._missing, missing
            dead = table.dead_ranks(now) if self.on_dead is not None else []
        if changed:
            self.on_health(missing)
        if not self._stop_seen and store.check([_STOP_KEY]):
            self._stop_seen = True
            self.on_stop(store.get(_STOP_KEY).decode())
        if store.check([_FAILED_KEY]):
            return store.get(_FAILED_KEY).decode()
        if self.on_dead is not None:
            for r, why in dead:
                if r not in self._reported_dead:
                    self._reported_dead.add(r)
                    self.on_dead(r, why)
            return None
        return table.dead(now)


class Heartbeat:
    """A rank > 0's heartbeat (a daemon thread); it ends this process (``os._exit(1)``) when
    rank 0 is unreachable for MISSING_AFTER_S or the group reports a failure, unless
    :meth:`stop` came first (the group stopped as asked)."""

    def __init__(self, spec: LaunchSpec, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        if spec.rank == 0:
            raise ValueError("rank 0 runs the RankMonitor, not a heartbeat")
        self.spec, self.interval_s = spec, interval_s
        self.identity = RankIdentity.of_this_process(spec)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeserve-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        store = connect_store(self.spec)  # the group has just formed: the store is up
        store.set(_who_key(self.spec.rank), json.dumps(self.identity.__dict__))
        store.add(_hb_key(self.spec.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread (no request of it is left in flight), then
        tell rank 0 this rank has left: rank 0 closes the store only after every rank left
        (:func:`wait_for_ranks_to_leave`; a store torn down under a request in flight aborts
        its process)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + _STORE_TIMEOUT_S + 1)
        try:
            connect_store(self.spec).set(_left_key(self.spec.rank), "1")
        except (RuntimeError, dist.DistError, OSError) as e:
            logger.debug("could not tell rank 0 that rank %d left: %s", self.spec.rank, e)

    def _run(self) -> None:
        store, unreachable_since = None, None
        # the first rank of each host that torchrun or srun started says which API it serves
        # (an agent of moeserve's own, on --node-rank >= 1 hosts, says it for its ranks)
        tell_api = self.spec.local_rank == 0 and self.spec.source in ("torchrun", "slurm")
        while not self._stop.wait(self.interval_s):
            try:
                store = store or connect_store(self.spec)
                store.add(_hb_key(self.spec.rank), 1)
                failed = store.get(_FAILED_KEY).decode() if store.check([_FAILED_KEY]) else None
                unreachable_since = None
                if tell_api and (url := read_api_url(store)) is not None:
                    logging.getLogger("moeserve.serve").info(
                        "node %d serves the API at %s (on node 0)", self.spec.node_rank, url
                    )
                    tell_api = False
            except (RuntimeError, dist.DistError, OSError) as e:
                store, failed = None, None
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since < MISSING_AFTER_S:
                    continue
                failed = (
                    f"rank 0's store at {self.spec.master_addr}:{self.spec.master_port} is "
                    f"unreachable ({e}): rank 0 is gone"
                )
            if failed is not None and not self._stop.is_set():
                self._exit(failed)

    def _exit(self, why: str) -> None:
        sys.stderr.write(f"moeserve: {self.identity.describe()} exits: the group ended: {why}\n")
        sys.stderr.flush()
        os._exit(1)
