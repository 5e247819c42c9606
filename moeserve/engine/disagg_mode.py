"""One engine's side of prefill/decode disaggregation: the role its requests take, the
transfer parts it owns, and the switch between the prefill and decode roles (adaptive P/D).

One process runs the protocol's control and its rank's transfers (``connector``); a rank of
an engine group runs only its transfers (``rank``), as the group's rank 0 runs the control
(``launch/group_disagg.py``). :class:`~moeserve.engine.engine.LLMEngine` calls this around
each step, as its ``disagg``.
"""

from __future__ import annotations

import logging

from moeserve.config import EngineConfig
from moeserve.core import KVRole, SamplingParams, Sequence
from moeserve.disagg.connector import LocalConnector, NotDrainedError, moves_kv
from moeserve.disagg.factory import (
    check_switch,
    make_local_connector,
    make_rank,
    switch_control,
)
from moeserve.disagg.rank import KVRank
from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.scheduler import Scheduler
from moeserve.kvcache.pool import KVCachePool

logger = logging.getLogger(__name__)

_CONNECTOR_WAIT_S = 0.002  # an idle step's wait for a bootstrap message or a transfer


def kv_heads(model, num_key_value_heads: int) -> tuple[int, int]:
    """GQA: the first of the model's KV heads this rank's cache holds, and how many the
    model has (``num_key_value_heads``); (0, 0) for MLA's latent, the same on every rank."""
    attn = model.layers[0].self_attn if len(model.layers) else None
    head0 = getattr(attn, "kv_head0", None)
    if head0 is None:
        return 0, 0
    return head0, num_key_value_heads


class DisaggMode:
    """An engine's disaggregation role (``mode``: "null" when colocated, "prefill" or
    "decode") and its transfer parts: ``connector`` on one process, only ``rank`` on a rank
    of an engine group; both None when colocated. The role changes only by :meth:`switch`."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        pool: KVCachePool,
        groups: ParallelGroups,
        heads: tuple[int, int],
    ) -> None:
        """Register ``pool`` with the transfer engine and, on one process, start the control
        (a prefill role binds its bootstrap port: ValueError when taken). ``heads``: this
        rank's first KV head and the model's count (:func:`kv_heads`)."""
        options = config.disaggregation_options
        self.mode = options.mode
        self.model_dir = config.model
        self.scheduler = scheduler
        self.connector: LocalConnector | None = None
        if groups.dims.world_size == 1:
            self.connector = make_local_connector(options, scheduler, pool, config.model, *heads)
            self.rank: KVRank | None = self.connector.rank if self.connector else None
        else:
            self.rank = make_rank(options, scheduler, pool, groups.rank, *heads)

    # -- requests -----------------------------------------------------------------------------

    def role_of(self, prompt_ids: list[int], params: SamplingParams) -> KVRole:
        """The part a new request plays here: LOCAL unless its KV moves in this role."""
        if self.mode == "null" or not moves_kv(prompt_ids, params):
            return KVRole.LOCAL
        return KVRole.PREFILL if self.mode == "prefill" else KVRole.DECODE

    def is_prefill_side(self, params: SamplingParams) -> bool:
        """A request with bootstrap fields on a prefill instance. One whose KV does not move
        (a one-token prompt, prompt logprobs, n > 1) ends at once with no token: the decode
        instance computes it all."""
        return self.mode == "prefill" and params.kv_transfer is not None

    def on_add(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> bool:
        """Tell the control of a request whose KV moves; True when it now holds the request's
        room (:meth:`on_abort` frees it). Raises ValueError for a room in use."""
        if self.connector is None:
            return False
        self.connector.on_add(request_id, params, prompt_ids)
        return True

    def on_abort(self, request_id: str) -> None:
        if self.connector is not None:
            self.connector.on_abort(request_id)

    # -- the step -----------------------------------------------------------------------------

    def poll(self) -> list[Sequence]:
        """One process: run the control and apply its commands; the sequences they ended."""
        return self.connector.poll() if self.connector is not None else []

    def wait_for_transfers(self) -> None:
        """On an idle step, wait a moment for a bootstrap message or a transfer in flight
        instead of spinning; returns at once when none is."""
        if self.connector is not None and self.connector.has_pending():
            self.connector.wait(_CONNECTOR_WAIT_S)

    def apply(self, cmds: dict) -> list[Sequence]:
        """A group's rank: apply the control's commands (``disagg/rank.py``); the sequences
        they ended."""
        return self.rank.apply(cmds) if self.rank is not None and cmds else []

    def events(self) -> dict:
        """A group's rank: what its scheduler parked and its transfers did."""
        return self.rank.events() if self.rank is not None else {}

    def has_pending(self) -> bool:
        """A transfer or a bootstrap exchange is in flight (its blocks are not free yet)."""
        return (self.connector is not None and self.connector.has_pending()) or (
            self.rank is not None and self.rank.sending
        )

    # -- the role switch ----------------------------------------------------------------------

    def switch(self, mode: str, drained: bool) -> dict:
        """Take the role ``mode`` for the requests from now on; on one process, replace the
        control (``disagg/factory.switch_control``), which needs the engine ``drained`` (no
        request, no transfer). Returns the new role's ``/server_info`` fields ({} on a
        group's rank). Raises ValueError (``check_switch``; a bootstrap port taken, which
        leaves the old role serving), NotDrainedError when not ``drained``."""
        check_switch(self.mode, mode)
        if self.connector is not None:
            if not drained:
                raise NotDrainedError(self._busy_reason())
            self.connector.control = switch_control(self.connector.control, mode, self.model_dir)
        if mode != self.mode:
            logger.info("switched from the %s role to %s", self.mode, mode)
        self.mode = mode
        return self.connector.info() if self.connector is not None else {}

    def _busy_reason(self) -> str:
        """What keeps this instance from switching roles (the drain is not over)."""
        sched = self.scheduler
        return (
            f"not drained: {sched.num_running} running, {sched.num_waiting} waiting, "
            f"{sched.num_parked} parked sequence(s), KV transfers in flight: "
            f"{self.connector is not None and self.connector.has_pending()}"
        )

    def stats(self) -> dict | None:
        """The role and the transfers' counters (None without a control here)."""
        c = self.connector
        return {"role": c.role, **c.stats.to_json()} if c is not None else None

    def close(self) -> None:
        """Close the control's sockets and deregister the pool from the transfer engine."""
        if self.connector is not None:
            self.connector.close()
        elif self.rank is not None:
            self.rank.close()
