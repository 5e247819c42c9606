"""From an OpenAI request to the engine's SamplingParams, with the checks that need the
model's limits (context length) and the model's default sampling settings.

The engine gets ``output_kind="delta"`` and ``detokenize=False``: it streams token ids, and
this process detokenizes and applies stop strings (``TextOptions``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moeserve.core import KVTransferParams, SamplingParams
from moeserve.guided import GuidedDecodingParams
from moeserve.serving.errors import bad_request
from moeserve.serving.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.text_tracker import TextOptions

_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelDefaults:
    """Sampling defaults from the model's generation_config.json (vLLM's behaviour): used
    for the fields a request leaves out."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelDefaults:
        path = Path(model_dir) / "generation_config.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls()
        picked = {k: cfg[k] for k in _DEFAULT_KEYS if isinstance(cfg.get(k), int | float)}
        if cfg.get("do_sample") is False:
            picked["temperature"] = 0.0
        return cls(**picked)


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias", "unsupported")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of", "unsupported")


def max_tokens_for(
    requested: int | None, prompt_len: int, max_model_len: int, prompt_field: str, tokens_field
) -> int:
    """The output budget: ``requested`` or what the context leaves; 400 when it does not fit."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens, which leaves no room for the output",
            prompt_field,
            "context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{prompt_len + requested} were requested ({prompt_len} in the prompt, "
            f"{requested} for the output); reduce the prompt or {tokens_field}",
            tokens_field,
            "context_length_exceeded",
        )
    return requested


def kv_transfer(req: CompletionRequest | ChatCompletionRequest) -> KVTransferParams | None:
    """The request's bootstrap fields (prefill/decode disaggregation): all three or none."""
    fields = (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if all(f is None for f in fields):
        return None
    if any(f is None for f in fields):
        missing = [
            n
            for n, f in zip(("bootstrap_host", "bootstrap_port", "bootstrap_room"), fields)
            if f is None
        ]
        raise bad_request(
            f"the bootstrap fields go together: {', '.join(missing)} missing", missing[0]
        )
    return KVTransferParams(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)


def build_params(
    req: CompletionRequest | ChatCompletionRequest,
    defaults: ModelDefaults,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    guided: GuidedDecodingParams | None = None,
) -> tuple[SamplingParams, TextOptions]:
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())

    def pick(name: str):
        value = getattr(req, name)
        return getattr(defaults, name) if value is None else value

    try:
        params = SamplingParams(
            n=req.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            output_kind="delta",
            detokenize=False,
            kv_transfer=kv_transfer(req),
            guided_decoding=guided,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise bad_request(str(e), field if field in type(req).model_fields else None) from None
    options = TextOptions(
        stop=stops,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        min_tokens=req.min_tokens,
    )
    return params, options
