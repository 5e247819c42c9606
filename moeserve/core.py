"""Request-level data types shared by the engine, the scheduler and the offline API.

A user request with ``n`` samples becomes ``n`` :class:`Sequence` objects that share the prompt
(prefix caching lets them share its KV blocks). The scheduler and the model runner work on
sequences; the engine groups them back into one :class:`RequestOutput` per request.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from moeserve.guided import GuidedDecodingParams

_GREEDY_EPS = 1e-5
OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclass(frozen=True)
class KVTransferParams:
    """Where a disaggregated request's KV moves (SGLang's bootstrap fields, which the router
    adds to the request it sends to a prefill and a decode instance at once): the prefill
    instance's bootstrap ``host`` and ``port`` and the ``room`` naming this request on both
    sides (``moeserve/disagg/``)."""

    host: str
    port: int
    room: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("bootstrap_host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"bootstrap_port must be in [1, 65535], got {self.port}")
        if not 0 <= self.room < 1 << 64:
            raise ValueError(f"bootstrap_room must be in [0, 2**64), got {self.room}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; the names and defaults follow vLLM's ``SamplingParams``.

    ``stop`` and ``stop_token_ids`` accept a single value or any sequence and are stored as
    tuples. ``temperature == 0`` means greedy. ``logprobs=N`` returns, for every generated token,
    its log-probability and the top-N alternatives (computed from the model's raw distribution,
    before temperature and penalties, as vLLM does). ``prompt_logprobs=N`` returns the same for
    every prompt token (``None`` for the first).

    ``output_kind`` says what each :class:`RequestOutput` carries (vLLM's ``RequestOutputKind``):
    ``cumulative`` everything so far, ``delta`` only what is new since the previous output of
    the request (samples without news are left out), ``final`` one output when it finishes.
    ``detokenize=False`` leaves text empty and stop strings unchecked: the caller detokenizes
    (the API server does, in its own process) and ends a sample at a stop string itself.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    detokenize: bool = True
    # prefill/decode disaggregation: where this request's KV comes from or goes to
    kv_transfer: KVTransferParams | None = None
    # structured output: what the output is held to (a JSON schema, a regex, ...)
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kv_transfer, dict):
            object.__setattr__(self, "kv_transfer", KVTransferParams(**self.kv_transfer))
        if isinstance(self.guided_decoding, dict):
            object.__setattr__(
                self, "guided_decoding", GuidedDecodingParams(**self.guided_decoding)
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if isinstance(self.stop_token_ids, int):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        elif not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be >= 0, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (
                self.output_kind in OUTPUT_KINDS,
                f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its KV freed, to be recomputed)
    RUNNING = "running"  # owns KV blocks and takes part in steps
    PARKED = "parked"  # owns KV blocks that move between instances (disaggregation)
    FINISHED = "finished"


class KVRole(enum.Enum):
    """A sequence's part in prefill/decode disaggregation."""

    LOCAL = "local"  # computes its prompt and its outputs here
    PREFILL = "prefill"  # computes the prompt's KV here for a decode instance; never samples
    DECODE = "decode"  # receives its prompt's KV from a prefill instance, then decodes


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log-probability; ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# token id -> Logprob, for the chosen token and the top-N alternatives of one position
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class SampleProgress:
    """What one sample of a request produced before its replica was lost, as the request's
    caller received it: the state it resumes from on another replica (elastic EP). A
    finished sample stays finished (``finish_reason``)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[PositionLogprobs, ...] = ()
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample of one request: its tokens, KV-cache blocks and progress.

    Invariants: ``num_computed_tokens <= num_tokens``; the KV of tokens
    ``[0, num_computed_tokens)`` lives in the blocks of ``block_table``; the scheduler owns
    ``status``, ``block_table`` and ``num_computed_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int = 0  # 0..n-1 within its request
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None  # first admission to the running queue
    first_token_time: float | None = None
    kv_role: KVRole = KVRole.LOCAL
    error: str | None = None  # why it ended abnormally (a failed KV transfer), for the caller
    # resumed (resume_from): its outputs' KV is computed again through the decode path that
    # first computed it (a row per token), so what follows matches an uninterrupted run
    replay_outputs: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed + self.sample_index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output without building the full list."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int, logprobs: PositionLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            if token_id in logprobs:
                self.cumulative_logprob += logprobs[token_id].logprob
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_token_stop(self) -> bool:
        """Finish on EOS / stop token / max_tokens / max_model_len after the last appended token.

        Stop *strings* need text and are checked by the engine's detokenizer. Returns True when
        the sequence finished (``status``, ``finish_reason`` and ``stop_reason`` are set).
        """
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        p = self.params
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.finish(FinishReason.STOP, None)
                return True
            if last in p.stop_token_ids:
                self.finish(FinishReason.STOP, last)
                return True
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            self.num_tokens >= self.max_model_len
        ):
            self.finish(FinishReason.LENGTH, None)
            return True
        return False

    def resume_from(self, progress: SampleProgress) -> None:
        """Continue after ``progress``: its tokens become this sequence's outputs (their KV is
        computed again through the decode path: ``replay_outputs``), and a seeded random sample's
        generator skips the one draw each of them took, so the tokens after them are the
        ones an uninterrupted run samples."""
        if self.output_token_ids or self.num_computed_tokens:
            raise ValueError("only a new sequence can resume")
        self.output_token_ids = list(progress.token_ids)
        self.replay_outputs = bool(progress.token_ids)
        self.logprobs = list(progress.logprobs)
        self.cumulative_logprob = progress.cumulative_logprob
        if self.generator is not None and not self.params.greedy and progress.token_ids:
            for _ in progress.token_ids:  # as the sampler draws: one scalar per token
                torch.rand((), generator=self.generator, dtype=torch.float64)
        if progress.finish_reason is not None:
            self.finish(FinishReason(progress.finish_reason), progress.stop_reason)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's ``CompletionOutput``."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (vLLM's names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the request failed (finish reason "abort"): why


PromptType = str | SequenceABC[int]


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: run tokens ``[start, start + num_new_tokens)``.

    ``start == seq.num_computed_tokens`` when scheduled. ``sample`` is True when this chunk
    reaches the last known token, so the step samples the sequence's next token; a chunk that
    ends inside the prompt (chunked prefill) does not sample.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool = field(init=False)  # fixed when scheduled: appending a token must not flip it

    def __post_init__(self) -> None:
        sample = self.end == self.seq.num_tokens and self.seq.kv_role is not KVRole.PREFILL
        object.__setattr__(self, "sample", sample)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token, run through the decode path (MLA: absorbed attention over the
        paged cache). A prompt token runs the prefill path even alone (a prefix-cache hit or
        a chunk that leaves one token): the two paths round differently, and a prompt's
        numbers must not depend on how it was cached or split."""
        return self.num_new_tokens == 1 and self.start >= self.seq.num_prompt_tokens

    @property
    def as_decode_rows(self) -> bool:
        """Run as decode rows, one per token, each over the context before it: a decode, or a
        resumed sequence's chunk of earlier outputs (``Sequence.replay_outputs``), whose KV
        must round as the decodes that first computed it did."""
        return self.is_decode or (
            self.seq.replay_outputs and self.start >= self.seq.num_prompt_tokens
        )


@dataclass(frozen=True)
class Batch:
    """What the scheduler hands the model runner for one step.

    Decode rows (:attr:`ScheduledSeq.as_decode_rows`) come first, then prefill chunks (one or
    more prompt tokens, or recomputed tokens after a preemption); the attention backends rely
    on that order.
    """

    seqs: tuple[ScheduledSeq, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def num_decodes(self) -> int:
        """Rows that run as decodes (the first ones of the step)."""
        return sum(s.num_new_tokens for s in self.seqs if s.as_decode_rows)

    def __len__(self) -> int:
        return len(self.seqs)
