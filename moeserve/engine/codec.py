"""Plain-JSON forms of the engine's messages, for links between processes.

Ranks of an engine group (and, later, the API server and the engine) exchange requests and
results as JSON: typed on both ends, nothing unpickled. Floats round-trip exactly (JSON keeps
Python's shortest repr).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moeserve.core import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    SampleProgress,
    SamplingParams,
)


@dataclasses.dataclass(frozen=True)
class SeqStepOutput:
    """What the model runner returns for one scheduled sequence of a step."""

    token_id: int | None = None
    logprobs: PositionLogprobs | None = None
    # prompt-logprob entries for prompt positions [first_position, first_position + len)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_position: int = 0
    # speculative decoding: tokens accepted after ``token_id`` in the same step, with their
    # logprobs, and the drafts proposed for the next step
    more_token_ids: tuple[int, ...] = ()
    more_logprobs: tuple[PositionLogprobs | None, ...] = ()
    draft_token_ids: tuple[int, ...] = ()


Json = dict[str, Any]


def params_to_json(p: SamplingParams) -> Json:
    out = dataclasses.asdict(p)
    out["stop"], out["stop_token_ids"] = list(p.stop), list(p.stop_token_ids)
    return out


def params_from_json(d: Json) -> SamplingParams:
    return SamplingParams(**d)


def logprobs_to_json(entry: PositionLogprobs | None) -> list[list] | None:
    if entry is None:
        return None
    return [[tok, lp.logprob, lp.rank, lp.decoded_token] for tok, lp in entry.items()]


def logprobs_from_json(rows: list[list] | None) -> PositionLogprobs | None:
    if rows is None:
        return None
    return {int(tok): Logprob(float(lp), int(rank), dec) for tok, lp, rank, dec in rows}


def progress_to_json(p: SampleProgress) -> Json:
    return {
        "token_ids": list(p.token_ids),
        "logprobs": [logprobs_to_json(e) for e in p.logprobs],
        "cumulative_logprob": p.cumulative_logprob,
        "finish_reason": p.finish_reason,
        "stop_reason": p.stop_reason,
    }


def progress_from_json(d: Json) -> SampleProgress:
    return SampleProgress(
        tuple(d["token_ids"]),
        tuple(logprobs_from_json(e) for e in d["logprobs"]),
        d["cumulative_logprob"],
        d["finish_reason"],
        d["stop_reason"],
    )


def _logprob_list(entries: list | None, decode) -> list | None:
    return None if entries is None else [decode(e) for e in entries]


def output_to_json(o: RequestOutput) -> Json:
    return {
        "request_id": o.request_id,
        "prompt": o.prompt,
        "prompt_token_ids": o.prompt_token_ids,
        "finished": o.finished,
        "prompt_logprobs": _logprob_list(o.prompt_logprobs, logprobs_to_json),
        "num_cached_tokens": o.num_cached_tokens,
        "metrics": o.metrics,
        "error": o.error,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": _logprob_list(c.logprobs, logprobs_to_json),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in o.outputs
        ],
    }


def output_from_json(d: Json) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=c["index"],
            text=c["text"],
            token_ids=list(c["token_ids"]),
            cumulative_logprob=c["cumulative_logprob"],
            logprobs=_logprob_list(c["logprobs"], logprobs_from_json),
            finish_reason=c["finish_reason"],
            stop_reason=c["stop_reason"],
        )
        for c in d["outputs"]
    ]
    return RequestOutput(
        request_id=d["request_id"],
        prompt=d["prompt"],
        prompt_token_ids=list(d["prompt_token_ids"]),
        outputs=outputs,
        finished=d["finished"],
        prompt_logprobs=_logprob_list(d["prompt_logprobs"], logprobs_from_json),
        num_cached_tokens=d["num_cached_tokens"],
        metrics=dict(d["metrics"]),
        error=d.get("error"),
    )


def step_output_to_json(o) -> Json:
    return {
        "token_id": o.token_id,
        "logprobs": logprobs_to_json(o.logprobs),
        "prompt_logprobs": _logprob_list(o.prompt_logprobs, logprobs_to_json),
        "first_position": o.first_position,
        "more_token_ids": list(o.more_token_ids),
        "more_logprobs": [logprobs_to_json(e) for e in o.more_logprobs],
        "draft_token_ids": list(o.draft_token_ids),
    }


def step_output_from_json(d: Json) -> SeqStepOutput:
    return SeqStepOutput(
        token_id=d["token_id"],
        logprobs=logprobs_from_json(d["logprobs"]),
        prompt_logprobs=_logprob_list(d["prompt_logprobs"], logprobs_from_json),
        first_position=d["first_position"],
        more_token_ids=tuple(d.get("more_token_ids", ())),
        more_logprobs=tuple(logprobs_from_json(e) for e in d.get("more_logprobs", ())),
        draft_token_ids=tuple(d.get("draft_token_ids", ())),
    )
