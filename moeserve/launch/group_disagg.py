"""Rank 0's side of prefill/decode disaggregation in an engine group.

The protocol's control runs here, over every rank's pool; each rank runs its own transfers
(``engine/disagg_mode.py``). The control's commands ride on the next step's broadcast and the
ranks' events come back on the step's gather of outputs (``launch/engine_group.py``)::

    rank 0    msg = {cmd: step, ..., kv: commands}      -- take_commands()
    all       engine.apply_kv_commands(kv); engine.step(); gather outputs + kv_events()
    rank 0    poll(events): the commands of the next step

A role switch (adaptive P/D) replaces the control here (:meth:`GroupDisagg.switch`), then
``{cmd: kv_mode, mode}`` (:func:`send_mode`) tells every rank the role of the requests of the
steps after.
"""

from __future__ import annotations

from moeserve.config import DisaggregationOptions
from moeserve.core import SamplingParams
from moeserve.disagg.connector import Control, NotDrainedError, RankInfo, moves_kv
from moeserve.disagg.factory import check_switch, make_control, switch_control
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.objects import broadcast_json
from moeserve.engine.engine import LLMEngine

KV_MODE = "kv_mode"  # {cmd: kv_mode, mode: prefill | decode}: the role of requests from now on
_KV_WAIT_S = 0.002  # a step with nothing but KV in flight waits this long for a message


class GroupDisagg:
    """The group's control (``control``: None when colocated) and its commands for the next
    step."""

    def __init__(self, model_dir: str) -> None:
        """Colocated until :meth:`start`."""
        self.model_dir = model_dir
        self.control: Control | None = None
        self._cmds: dict = {}

    def start(self, options: DisaggregationOptions, rank_infos: list[dict]) -> None:
        """Make the control of ``options.mode`` over every rank's pool (``rank_infos``: each
        rank's ``engine_group.rank_info``, in rank order). Raises ValueError for a bootstrap
        port taken."""
        infos = [
            RankInfo(r["rank"], r["dp_rank"], r["tp_rank"], **r["kv_transfer"]) for r in rank_infos
        ]
        self.control = make_control(options, infos, self.model_dir)

    @property
    def mode(self) -> str:
        """The group's role: "null" (colocated), "prefill" or "decode"."""
        return self.control.role if self.control is not None else "null"

    def on_add(self, request_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        """A request queued for a replica; raises ValueError for a room in use."""
        if self.control is not None and moves_kv(prompt_ids, params):
            self.control.on_add(request_id, params, prompt_ids)

    def on_abort(self, request_id: str) -> None:
        if self.control is not None:
            self.control.on_abort(request_id)

    def has_pending(self) -> bool:
        return self.control is not None and self.control.has_pending()

    def take_commands(self) -> dict:
        """The commands for the step about to be broadcast (each is sent once)."""
        cmds, self._cmds = self._cmds, {}
        return cmds

    def poll(self, events: list[dict], idle: bool) -> None:
        """Every rank's KV events of the step just taken (in rank order) -> the commands of
        the next step. After an ``idle`` step (no output) with only KV in flight and no
        command, wait a moment for a bootstrap message instead of spinning."""
        if self.control is None:
            return
        self._cmds = self.control.poll(events)
        if idle and not self._cmds and self.control.has_pending():
            self.control.wait(_KV_WAIT_S)

    def stats(self) -> dict | None:
        """The role and the transfers' counters (None when colocated)."""
        c = self.control
        return {"role": c.role, **c.stats.to_json()} if c is not None else None

    def switch(self, mode: str, num_requests: int) -> None:
        """Replace the control by one of role ``mode`` (``disagg/factory.switch_control``:
        the old one keeps serving when the new one fails). Raises ValueError
        (``check_switch``; a bootstrap port taken), NotDrainedError while the group holds
        ``num_requests`` > 0 requests or KV transfers are in flight."""
        check_switch(self.mode, mode)
        if num_requests:
            raise NotDrainedError(f"not drained: {num_requests} request(s) in the group")
        self.control = switch_control(self.control, mode, self.model_dir)

    def info(self) -> dict:
        """The role's ``/server_info`` fields ({} when colocated)."""
        return self.control.info() if self.control is not None else {}

    def close(self) -> None:
        """Close the control's sockets (the ranks close their transfers as they stop)."""
        if self.control is not None:
            self.control.close()


def send_mode(engine: LLMEngine, groups: ParallelGroups, mode: str) -> None:
    """Rank 0's side of ``{cmd: kv_mode}``: every rank (rank 0's engine too) takes the role
    ``mode`` for the requests it is sent from now on; a worker applies it in
    ``serve_steps``. A collective: run it inside ``EngineGroup._collective``."""
    broadcast_json({"cmd": KV_MODE, "mode": mode}, groups.world, 0)
    engine.set_disaggregation_mode(mode)
