"""POST /admin/disaggregation/role: switch a prefill/decode instance to the other role, the
step of adaptive P/D (``serving/auto_pd.py``) that happens on the instance itself.

    POST {"mode": "decode", "drain_timeout_s": 60}
      new requests get 503 from now on (the controller removed the instance from the router
      first, so only a request already on its way gets one, and the router retries it)
      wait until every request in flight here has ended, then ask the engine to switch:
      it answers "not drained" while a KV transfer is still in flight, and is asked again
      engine: the bootstrap control of the old role is closed, one of the new role made
      (the KV pool and its transfer-engine registration stay); /server_info says the new role
      -> 200 {disaggregation_mode, disaggregation_bootstrap_port, switched, drain_s}
    a drain longer than drain_timeout_s: 409, the instance keeps its role and serves again;
    an engine that cannot take the role (its bootstrap port taken, colocated): 400, the same

Only on an instance started with ``--disaggregation-mode prefill|decode``; one started as
decode binds ``--disaggregation-bootstrap-port`` (default 8998) when it becomes a prefill
instance. Behind the API key like every non-public path.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter

from moeserve.serving.client import EngineDeadError
from moeserve.serving.errors import APIError, ErrorResponse, bad_request
from moeserve.serving.protocol import RoleSwitchRequest, RoleSwitchResponse
from moeserve.serving.state import ServerState, unavailable

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # between two looks at the requests in flight, or two asks of the engine
_CALL_TIMEOUT_S = 30.0  # one ask: closing and opening bootstrap sockets is quick
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 409, 503)}


def role_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    lock = asyncio.Lock()  # one switch at a time

    @router.post("/admin/disaggregation/role", responses=_ERRORS)
    async def switch_role(body: RoleSwitchRequest) -> RoleSwitchResponse:
        if lock.locked():
            raise APIError(409, "another role switch is in progress", "mode", "conflict")
        async with lock:
            return await _switch(state, body)

    return router


async def _switch(state: ServerState, body: RoleSwitchRequest) -> RoleSwitchResponse:
    state.check_accepting()
    if body.mode == state.disaggregation_mode:
        return RoleSwitchResponse(
            disaggregation_mode=body.mode,
            disaggregation_bootstrap_port=state.bootstrap_port,
            switched=False,
            drain_s=0.0,
        )
    t0 = time.monotonic()
    deadline = t0 + body.drain_timeout_s
    state.switching_to = body.mode
    # a request past the HTTP check but not yet queued (its prompt being tokenized) is
    # refused by the client, which counts every request it queued: none slips past the drain
    state.client.paused = f"this instance is switching to the {body.mode} role"
    logger.info("draining to switch from the %s role to %s", state.disaggregation_mode, body.mode)
    try:
        info = await _drain_and_switch(state, body.mode, deadline, body.drain_timeout_s)
    finally:
        state.switching_to = None
        state.client.paused = None
    state.disaggregation_mode = body.mode
    state.bootstrap_port = info.get("disaggregation_bootstrap_port")
    drain_s = time.monotonic() - t0
    logger.info("now serving in the %s role (drained in %.2f s)", body.mode, drain_s)
    return RoleSwitchResponse(
        disaggregation_mode=body.mode,
        disaggregation_bootstrap_port=state.bootstrap_port,
        switched=True,
        drain_s=round(drain_s, 3),
    )


async def _drain_and_switch(state: ServerState, mode: str, deadline: float, wait_s: float):
    client = state.client
    last = ""
    while True:
        if client.num_unfinished:
            last = f"{client.num_unfinished} request(s) still running here"
        else:
            try:
                answer = await client.call(
                    "disaggregation_mode", timeout=_CALL_TIMEOUT_S, args={"mode": mode}
                )
            except (asyncio.TimeoutError, EngineDeadError):
                raise unavailable("the engine did not answer") from None
            except RuntimeError as e:  # the engine's answer: why it cannot take the role
                raise bad_request(str(e), "mode") from None
            if "not_drained" not in answer:
                return answer
            last = answer["not_drained"]
        if time.monotonic() >= deadline:
            raise APIError(
                409,
                f"the instance did not drain within {wait_s:g} s ({last}); it keeps the "
                f"{state.disaggregation_mode} role",
                "drain_timeout_s",
                "not_drained",
            )
        await asyncio.sleep(_POLL_S)
