"""Rank 0's record of an elastic EP group (``--enable-elastic-ep``): the ranks seen dead and
not yet left out, why each lost rank was given up, the recoveries and their times, and the
replacements taken in. ``EngineGroup`` runs the recoveries and the growth
(``launch/recovery.py``); this says what happened, for ``/health``, ``/metrics`` and
``stats()["elastic"]``."""

from __future__ import annotations

import dataclasses
import logging

from moeserve.launch.liveness import RankMonitor
from moeserve.launch.recovery import ElasticRank, Recovery

logger = logging.getLogger(__name__)


class ElasticRecord:
    """What the group lost, recovered and took in so far (see the module's doc)."""

    def __init__(self, elastic: ElasticRank, world_size: int) -> None:
        """``world_size``: the launch's, which a group back at full strength has again."""
        self.rank, self.world_size = elastic, world_size
        self.lost: dict[int, str] = {}  # launch rank -> why it was last given up
        self.rank_failures = 0  # ranks lost so far (one rank lost twice counts twice)
        self.dead_now: set[int] = set()  # seen dead, not yet left out by a recovery
        self.recoveries: list[Recovery] = []
        self.recovery_seconds: list[float] = []
        self.joined: list[int] = []  # launch ranks taken in as replacements

    @property
    def members(self) -> tuple[int, ...]:
        """The launch ranks of the current generation."""
        return self.rank.membership.members

    def rank_lost(self, rank: int, reason: str) -> None:
        """A watcher saw launch rank ``rank`` die (its exit, or its heartbeat stopped); the
        recovery leaves it out at once instead of waiting for its check-in."""
        if rank not in self.dead_now:
            logger.error("engine group: %s; the others go on without it", reason)
            self.dead_now.add(rank)
            self.lost[rank] = reason

    def known_dead(self, monitor: RankMonitor, silent_after_s: float) -> set[int]:
        """Ranks a recovery need not wait for: seen dead, or silent for ``silent_after_s``."""
        return set(self.dead_now) | monitor.silent_ranks(silent_after_s)

    def recovered(
        self, rec: Recovery, seconds: float, cause: BaseException, monitor: RankMonitor
    ) -> None:
        """Record a recovery that took ``seconds`` after ``cause``; the monitor forgets the
        ranks it left out."""
        why = str(cause).split(". ")[0]  # gloo's first sentence names the broken link
        for rank in rec.lost:
            if rank not in self.dead_now:  # nobody saw it die: its link broke
                self.lost[rank] = f"{monitor.describe(rank)} was lost: {why}"
            self.rank_failures += 1
        self.dead_now -= set(rec.lost)
        monitor.forget(rec.lost)
        self.recoveries.append(rec)
        self.recovery_seconds.append(seconds)

    def status(self, live_ranks: int) -> dict:
        """Live ranks, losses and recoveries so far (``/health``, ``/metrics``)."""
        return {
            "live_ranks": live_ranks,
            "members": list(self.members),
            "world_size": self.world_size,
            "rank_failures": self.rank_failures,
            "recoveries": len(self.recoveries),
            "recovery_seconds": list(self.recovery_seconds),
            "lost": [self.lost[r] for r in sorted(self.lost) if r not in self.members],
            "rejoins": len(self.joined),
            "history": [
                {**dataclasses.asdict(r), "total_s": s}
                for r, s in zip(self.recoveries, self.recovery_seconds)
            ],
        }
