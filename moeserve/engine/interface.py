"""The request API of an engine, whatever runs it: :class:`Engine`.

Two classes implement it, and callers (``moeserve/llm.py``, ``serving/engine_core.py``) see
only this protocol:

    LLMEngine     engine/engine.py                 the whole engine, in this process
    EngineGroup   launch/engine_group.py           world rank 0's handle on an engine spread
                                                   over many ranks, driven in lock step

Requests are keyed by the caller's ``request_id``. Between two calls of :meth:`Engine.step`
a caller may add requests, abort them and finish samples; the step applies all of them and
returns the outputs of the requests it advanced. Every method runs on the caller's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from moeserve.config import EngineConfig
    from moeserve.core import PromptType, RequestOutput, SamplingParams
    from moeserve.models.hf_config import ModelConfig
    from moeserve.tokenizer import Tokenizer


class Engine(Protocol):
    """What ``LLM`` and the engine process use of an engine (see the module docstring)."""

    @property
    def config(self) -> EngineConfig:
        """The config the engine was built from."""
        ...

    @property
    def model_config(self) -> ModelConfig:
        """The model's converted ``config.json``."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; None when the model directory has no ``tokenizer.json``."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output tokens) a request may reach."""
        ...

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> None:
        """Queue a request (text or token ids). Raises ValueError for a prompt the engine
        cannot run, ``QueueFullError`` (``engine/scheduler.py``) when its queue is full."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Drop a request (an unknown id is ignored); it is never reported again."""
        ...

    def finish_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample of a request with finish reason ``stop`` (the caller found a stop
        string in its text); a later step reports it."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether a request is still running, waiting, or has outputs to report."""
        ...

    def step(self) -> list[RequestOutput]:
        """Apply what was queued since the last step and advance every scheduled request by
        one engine step; returns the outputs of the requests that changed."""
        ...

    def step_with_stats(self) -> tuple[list[RequestOutput], dict]:
        """:meth:`step`, and :meth:`stats` without the self-check as they stand after it (an
        engine group gathers every rank's with the step's outputs: no extra collective)."""
        ...

    def stats(self, self_check: bool = True) -> dict:
        """Queues, KV cache, prefix-cache and speculative-decoding counters, expert counts,
        EPLB metrics and, with ``self_check``, the KV-cache self-check (``integrity``;
        ``LLMEngine.stats`` has the keys)."""
        ...

    def eplb_command(self, action: str, path: str | None = None) -> dict:
        """An EPLB command (``ExpertBalancer.command``): ``rebalance``, ``dump`` (to ``path``
        or ``expert_stats_out``) or ``status``. Returns its result ({} without MoE layers);
        raises ValueError with the balancer's error."""
        ...

    def set_disaggregation_mode(self, mode: str) -> dict:
        """Switch between the prefill and decode roles of disaggregation (adaptive P/D), only
        with nothing in flight; returns the role's ``/server_info`` fields. ValueError: why
        not (colocated, not drained, the bootstrap port taken)."""
        ...

    def watch(
        self,
        on_failure: Callable[[str], None],
        on_health: Callable[[list[str], dict | None], None],
        on_stop: Callable[[str], None],
    ) -> None:
        """Hear of what happens outside the caller's calls: ``on_failure(reason)`` once the
        engine failed (a rank of its group died), ``on_health(missing, elastic)`` when the
        ranks whose heartbeat is late change or (elastic EP: ``elastic`` says how, else None)
        the group lost ranks or took replacements in, ``on_stop(reason)`` when a host of the
        group was asked to stop. Each may run on another thread; an engine in one process
        never calls them."""
        ...

    def announce_api(self, url: str) -> None:
        """Tell every rank where the HTTP API is served (the other hosts log it); nothing to
        do for an engine in one process."""
        ...

    def shutdown(self) -> None:
        """Write the expert statistics (``expert_stats_out``) and release what the engine
        holds (an engine group stops its ranks). The caller's last call; a second one does no
        harm."""
        ...
