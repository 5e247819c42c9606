"""One rank's recovery from a rank loss (elastic EP): leave the failed generation, agree on
the next (``elastic.Membership``), join it, move the engine onto it
(``engine/regroup.py``), and confirm together that every survivor made it.

    rank 0       leave -> decide the members -> join -> regroup -> confirm
    rank > 0     leave -> check in -> follow rank 0's decision -> join -> regroup -> confirm

A replacement rank joins the same way without a loss (:meth:`ElasticRank.grow` on the
members, ``launch/start.py`` on the replacement): leave -> rank 0 adds the replacements ->
join -> regroup (requests kept; EPLB places the experts over every rank and the
replacement's empty slots fill over the network) -> confirm.

Until the confirmation the new world's collectives wait up to ``dist_timeout_s`` (a
survivor may read experts from the checkpoint meanwhile); after it, the short collective
timeout applies again (``elastic_ep_timeout_s``: how long a silent rank takes to be noticed).
When a survivor fails to regroup (its slots cannot hold the experts, say), every survivor
hears it at the confirmation and the group ends with that reason (:class:`GroupEnded`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.config import EngineConfig
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import all_gather_json
from moeserve.engine.regroup import regroup_engine
from moeserve.launch.elastic import (
    CHECK_IN_MARGIN_S,
    GroupEnded,
    Membership,
    set_collective_timeout,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """What one recovery did and how long each part took (on this rank)."""

    generation: int
    started_at: float  # time.time() when this rank began it (its collective had failed)
    lost: tuple[int, ...]  # launch ranks left out
    live: tuple[int, ...]  # launch ranks of the new generation
    agree_s: float  # from leaving the failed group to knowing the members
    join_s: float  # forming the new process group
    reload_s: float  # reading experts from the checkpoint (the slowest survivor)
    experts_reloaded: int  # by all survivors (each expert of each layer counts once)
    bytes_read: int  # from the checkpoint, by all survivors
    requests_dropped: int  # by all survivors (rank 0 queues them all again)


class ElasticRank:
    """This process's part in recoveries."""

    def __init__(self, config: EngineConfig, membership: Membership) -> None:
        self.config, self.membership = config, membership
        self.timeout_s = config.elastic_ep_timeout_s

    def start_serving(self, groups: ParallelGroups) -> None:
        """From here on a silent peer fails a collective after the short timeout."""
        set_collective_timeout(groups, self.timeout_s)

    def recover(
        self, engine, cause: BaseException, known_dead: Callable[[], set[int]] = set
    ) -> tuple[ParallelGroups, Recovery]:
        """Recover after ``cause`` (a failed collective); returns the new groups. Raises
        GroupEnded when this rank is left out or the group cannot go on (the reason)."""
        m = self.membership
        old = m.members
        started_at, t0 = time.time(), time.monotonic()
        engine.release_groups()  # with the frames below: nothing holds the failed group
        cause = _without_frames(cause)
        m.leave_world()
        if m.spec.rank == 0:
            members = m.decide(known_dead, self.timeout_s + CHECK_IN_MARGIN_S)
            if not members:
                raise GroupEnded(
                    f"a collective failed but every rank is alive ({cause}): elastic EP "
                    "survives rank losses, not errors of a live rank"
                )
        else:
            m.check_in()
            members = m.follow(3 * (self.timeout_s + CHECK_IN_MARGIN_S))
        t1 = time.monotonic()
        logger.warning(
            "elastic EP: generation %d: ranks %s (lost %s) after: %s",
            m.generation,
            list(members),
            sorted(set(old) - set(members)),
            cause,
        )
        groups = m.init_world(self.config.dist_timeout_s)
        t2 = time.monotonic()
        reports = self.take_share(engine, groups, drop_requests=True)
        return groups, Recovery(
            m.generation,
            started_at,
            tuple(sorted(set(old) - set(members))),
            members,
            t1 - t0,
            t2 - t1,
            max(r["reload_s"] for r in reports),
            sum(r["experts_reloaded"] for r in reports),
            sum(r["bytes_read"] for r in reports),
            sum(r["requests_dropped"] for r in reports),
        )

    def grow(self, engine) -> ParallelGroups:
        """Every member, told to between two steps (``{cmd: grow}``): leave this generation
        and form the next with the replacements waiting to join (rank 0 decides it); this
        rank keeps its requests and KV. Returns the new groups."""
        m = self.membership
        engine.release_groups()
        gc.collect()
        m.leave_world()
        if m.spec.rank == 0:
            members = m.grow(m.joiners())
        else:
            members = m.follow(3 * (self.timeout_s + CHECK_IN_MARGIN_S))
        logger.warning("elastic EP: generation %d: ranks %s", m.generation, list(members))
        groups = m.init_world(self.config.dist_timeout_s)
        reports = self.take_share(engine, groups, drop_requests=False)
        logger.warning(
            "elastic EP: generation %d: the experts re-placed over %d ranks; %.1f MB moved "
            "to the ranks that lack them in %.2f s",
            m.generation,
            len(members),
            sum(r["bytes_received"] for r in reports) / 1e6,
            max(r["move_s"] for r in reports),
        )
        return groups

    def take_share(self, engine, groups: ParallelGroups, drop_requests: bool) -> list[dict]:
        """With every rank of a new generation: move the engine onto ``groups``
        (``regroup_engine``), then confirm together; returns every rank's report. Raises
        GroupEnded, with the first rank's error, when one of them could not."""
        mine: dict = {"error": None}
        try:
            spec = self.membership.spec
            node = spec.node_rank if spec.nnodes > 1 else None
            mine.update(dataclasses.asdict(regroup_engine(engine, groups, drop_requests, node)))
        except (ValueError, RuntimeError, OSError) as e:
            mine["error"] = f"rank {self.membership.spec.rank} could not take its share: {e}"
        reports = all_gather_json(mine, groups.world)  # the confirmation
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            self.membership.leave_world()
            raise GroupEnded(errors[0])
        self.start_serving(groups)
        return reports


def _without_frames(cause: BaseException) -> RuntimeError:
    """A copy of ``cause`` that holds no frame. A failed step's frames hold its collectives'
    pending work, which keeps the process group's connections open after it is destroyed:
    the peers blocked on this rank would then wait for the collective timeout instead of
    failing at once. The frames go now (and what they hold, collected)."""
    text = f"{type(cause).__name__}: {cause}" if not isinstance(cause, RuntimeError) else str(cause)
    for e in (cause, cause.__cause__, cause.__context__):
        if e is not None:
            e.__traceback__ = None
    gc.collect()
    return RuntimeError(text)
