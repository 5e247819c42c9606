"""Pydantic models of the OpenAI-compatible API (requests and responses).

Field names, defaults and ranges follow OpenAI's API; the extra sampling fields vLLM accepts
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``) are accepted too.
Unknown fields are ignored, as OpenAI and vLLM do; a known field of the wrong type or out of
range is a 400 naming the field. The ranges live in the schema, so ``/openapi.json`` states
them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20
MAX_N = 128
_INT64 = (-(2**63), 2**63 - 1)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- errors -------------------------------------------------------------------------------------


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


# -- shared request fields ---------------------------------------------------------------------


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class JsonSchemaFormat(_Model):
    """OpenAI's ``response_format.json_schema``: ``strict`` refuses a schema with keywords
    the grammar engine cannot enforce (400), instead of ignoring them."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Model):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=_INT64[0], le=_INT64[1])
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output: OpenAI's response_format, or vLLM's guided_* fields (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None
    # prefill/decode disaggregation (SGLang's bootstrap fields, set by the router)
    bootstrap_host: str | None = Field(None, min_length=1, max_length=255)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=2**64 - 1)


# -- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: (
        str
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class CompletionLogprobs(_Model):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(_Model):
    cached_tokens: int = 0


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions ----------------------------------------------------------------------


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = Field(None, ge=0)  # vLLM's: tokens of thinking at most


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Model):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {id, type: function, function: {...}}


class ChatChoice(_Model):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(_Model):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {index, id?, type?, function: {...}}


class ChatChunkChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- other endpoints ---------------------------------------------------------------------------


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moeserve"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Model):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Model):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Model):
    prompt: str


class ServerInfo(_Model):
    """GET /server_info: what a router asks of a worker (SGLang's names)."""

    model_path: str
    # SGLang's field: sglang-router takes a worker's model id from it (from model_path when
    # it is missing) and lists that id in its /v1/models, so it must be a name we accept
    served_model_name: str
    served_model_names: list[str]
    max_model_len: int
    disaggregation_mode: Literal["null", "prefill", "decode"] = "null"
    disaggregation_bootstrap_port: int | None = None
    disaggregation_transfer_backend: str | None = None
    version: str


class RoleSwitchRequest(_Model):
    """POST /admin/disaggregation/role: switch this instance to another role of prefill/decode
    disaggregation (adaptive P/D), after draining it for at most ``drain_timeout_s``."""

    mode: Literal["prefill", "decode"]
    drain_timeout_s: float = Field(60.0, gt=0, le=3600)


class RoleSwitchResponse(_Model):
    disaggregation_mode: Literal["prefill", "decode"]
    disaggregation_bootstrap_port: int | None = None
    switched: bool  # False: it already served in that role
    drain_s: float  # how long it waited for the requests in flight to end


class ModelInfo(_Model):
    """GET /model_info (SGLang's names)."""

    model_path: str
    tokenizer_path: str
    is_generation: bool = True


class VersionResponse(_Model):
    version: str
