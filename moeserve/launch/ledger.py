"""What rank 0 knows of each unfinished request of an engine group: enough to queue it again
on another replica when its own is lost (elastic EP, ``launch/elastic.py``).

For each request: its prompt, sampling parameters, replica, and per sample what its caller
has received so far (``SampleProgress``), read from the outputs rank 0 hands its caller::

    output_kind "delta"        each output's tokens and logprobs are appended
    output_kind "cumulative"   each output replaces what was known
    output_kind "final"        nothing until the request ends: it resumes from its prompt

A sample that reported its finish stays finished. A sample the caller ended itself (a stop
string: ``finish_sample``) is not: the caller still waits for the engine to report it, so
that finish is sent to the new replica again after the request (``pending_finishes``).

:class:`StepOutbox` holds what rank 0 sends with its next step: the requests to add, the ids
to abort and the samples their callers ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.core import RequestOutput, SampleProgress, SamplingParams


@dataclass
class Tracked:
    """One unfinished request."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    replica: int
    progress: list[SampleProgress] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.progress:
            self.progress = [SampleProgress() for _ in range(self.params.n)]


@dataclass
class StepOutbox:
    """The request parts of rank 0's next step message: the requests to add (their
    messages), the ids to abort and the samples their callers ended (id, index, reason)."""

    adds: list[dict] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    finishes: list[tuple[str, int, str | None]] = field(default_factory=list)

    def abort(self, request_id: str) -> None:
        """An add not sent yet is dropped; else the request's replica is told."""
        pending = next((a for a in self.adds if a["id"] == request_id), None)
        if pending is not None:
            self.adds.remove(pending)
        else:
            self.aborts.append(request_id)

    def take(self) -> dict:
        """The step message's ``add``, ``abort`` and ``finish`` parts; the outbox is empty
        after."""
        parts = {"add": self.adds, "abort": self.aborts, "finish": self.finishes}
        self.adds, self.aborts, self.finishes = [], [], []
        return parts

    def requeue(self, adds: list[dict]) -> None:
        """After a recovery: ``adds`` (every unfinished request again) replace the pending
        adds and aborts, whose replicas are gone or renumbered."""
        self.adds, self.aborts = adds, []

    def finish_again(self, finishes: list[tuple[str, int, str | None]]) -> None:
        """Finishes of a lost step, sent again before the newer ones."""
        self.finishes = finishes + self.finishes


class RequestLedger:
    """Unfinished requests in arrival order, and the sequences each DP replica runs."""

    def __init__(self, num_replicas: int) -> None:
        self.requests: dict[str, Tracked] = {}
        self.load = [0] * num_replicas  # unfinished sequences per replica

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def least_loaded(self) -> int:
        return min(range(len(self.load)), key=lambda r: (self.load[r], r))

    def add(self, tracked: Tracked) -> None:
        if tracked.request_id in self.requests:
            raise ValueError(f"request id {tracked.request_id!r} is already in use")
        self.requests[tracked.request_id] = tracked
        self.load[tracked.replica] += tracked.params.n

    def forget(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        if tracked is not None:
            self.load[tracked.replica] -= tracked.params.n

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Record what the caller receives with this step's outputs; a finished request
        leaves the ledger."""
        for out in outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None:
                continue
            if out.finished:
                self.forget(out.request_id)
                continue
            delta = tracked.params.output_kind == "delta"
            for c in out.outputs:
                was = tracked.progress[c.index]
                tokens, logprobs = tuple(c.token_ids), tuple(c.logprobs or ())
                if delta:
                    tokens, logprobs = was.token_ids + tokens, was.logprobs + logprobs
                tracked.progress[c.index] = SampleProgress(
                    tokens,
                    logprobs,
                    c.cumulative_logprob or 0.0,
                    c.finish_reason,
                    c.stop_reason,
                )

    def reassign(self, num_replicas: int) -> list[Tracked]:
        """After a loss: every request goes to one of ``num_replicas`` replicas (the least
        loaded each, in arrival order); returns them in that order."""
        self.load = [0] * num_replicas
        out = []
        for tracked in self.requests.values():
            tracked.replica = self.least_loaded()
            self.load[tracked.replica] += tracked.params.n
            out.append(tracked)
        return out
