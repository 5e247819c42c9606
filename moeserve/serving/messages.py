"""Typed messages between the API server process and the engine process (over ZeroMQ).

Every message is one ZeroMQ frame of UTF-8 JSON ``{"type": ..., **fields}``; each type is a
frozen dataclass here, and :func:`decode` refuses a type or field it does not know. Nothing is
pickled, so a message can carry user text without the engine ever executing it.

API server -> engine                         engine -> API server
  AddRequest    a tokenized request            Ready        the engine loaded; its limits
  AbortRequests drop requests now              AddResult    accepted, or refused and why
  FinishSample  a stop string ended a sample   StepOutputs  this step's RequestOutputs (deltas)
  Call          ask for stats / a self-check   CallResult   the answer to a Call
  Shutdown      stop the engine group          StatsSnapshot the engine's stats, unasked
                                               GroupHealth  the ranks whose heartbeat is late
                                               StopRequested another host was told to stop
                                               EngineDead   the engine failed; it will exit
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from moeserve.core import RequestOutput, SamplingParams
from moeserve.engine import codec


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class FinishSample:
    request_id: str
    index: int
    stop: str | None = None


@dataclass(frozen=True)
class Call:
    """``method``: ``stats`` (LLMEngine.stats of the whole engine), or ``eplb`` with
    ``args`` ``{"action": "rebalance" | "dump" | "status"}`` (expert load balancing), or
    ``disaggregation_mode`` with ``{"mode": "prefill" | "decode"}`` (switch roles, drained)."""

    call_id: int
    method: str
    args: dict | None = None


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    max_model_len: int
    vocab_size: int
    architecture: str
    world_size: int
    data_parallel_size: int
    max_num_seqs: int
    max_waiting_requests: int | None = None  # per DP replica; None: unbounded
    nnodes: int = 1  # the hosts the engine's ranks run on


@dataclass(frozen=True)
class AddResult:
    """``error_kind``: None when accepted, else ``queue_full`` (503) or ``invalid`` (400)."""

    request_id: str
    error_kind: str | None = None
    message: str = ""


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)


@dataclass(frozen=True)
class CallResult:
    call_id: int
    result: Any = None
    error: str | None = None


STATS_INTERVAL_S = 0.5  # the shortest gap between two StatsSnapshots of an engine at work


@dataclass(frozen=True)
class StatsSnapshot:
    """The engine's stats (``engine_core.engine_stats``, without the self-check), published by
    the engine on its own schedule (``engine_core.SnapshotSchedule``), never in answer to a
    message; ``seq`` counts the snapshots published so far, this one included."""

    stats: dict
    seq: int


@dataclass(frozen=True)
class GroupHealth:
    """The ranks of an engine group whose heartbeat is late, a line each naming the rank and
    its host (empty: every rank is alive again). Sent when the list changes, and with elastic
    EP when the group lost ranks or took replacements in (``elastic``: its live ranks, world
    size and lost ranks, ``EngineGroup.elastic_status``)."""

    missing: list[str] = field(default_factory=list)
    elastic: dict | None = None


@dataclass(frozen=True)
class StopRequested:
    """A host of the engine group other than this one got SIGTERM: the server drains and
    stops as on its own SIGTERM."""

    reason: str


@dataclass(frozen=True)
class EngineDead:
    message: str


_TYPES = {
    cls.__name__: cls
    for cls in (
        AddRequest,
        AbortRequests,
        FinishSample,
        Call,
        Shutdown,
        Ready,
        AddResult,
        StepOutputs,
        CallResult,
        StatsSnapshot,
        GroupHealth,
        StopRequested,
        EngineDead,
    )
}
Message = (
    AddRequest
    | AbortRequests
    | FinishSample
    | Call
    | Shutdown
    | Ready
    | AddResult
    | StepOutputs
    | CallResult
    | StatsSnapshot
    | GroupHealth
    | StopRequested
    | EngineDead
)


class MessageError(ValueError):
    """A frame that is not a message of this protocol."""


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"type": type(msg).__name__}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, SamplingParams):
            value = codec.params_to_json(value)
        elif f.name == "outputs":
            value = [codec.output_to_json(o) for o in value]
        body[f.name] = value
    return json.dumps(body, separators=(",", ":")).encode()


def decode(frame: bytes) -> Message:
    try:
        body = json.loads(frame)
        cls = _TYPES[body.pop("type")]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MessageError(f"not a moeserve message: {e!r}") from None
    if "params" in body:
        body["params"] = codec.params_from_json(body["params"])
    if cls is StepOutputs:
        body["outputs"] = [codec.output_from_json(o) for o in body["outputs"]]
    try:
        return cls(**body)
    except TypeError as e:
        raise MessageError(f"bad {cls.__name__} message: {e}") from None
