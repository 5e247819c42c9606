"""The offline API, with vLLM's names::

from moeserve import LLM, SamplingParams
llm = LLM(model="path/to/hf-dir")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from moeserve.config import EngineConfig
from moeserve.core import PromptType, RequestOutput, SamplingParams
from moeserve.engine.interface import Engine
from moeserve.launch.start import start_engine

Message = dict[str, str]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_memory_gb: float | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        **kwargs,
    ) -> None:
        """Any layout with more than one rank spawns the other ranks as processes on this
        host (or joins a torchrun / Slurm world); this process is rank 0. Other EngineConfig
        fields pass through ``kwargs``."""
        if model is None:
            from moeserve.demo import demo_model_path

            model = str(demo_model_path())
        self.engine: Engine = start_engine(
            EngineConfig(
                model=str(model),
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kv_cache_memory_gb=kv_cache_memory_gb,
                enable_prefix_caching=enable_prefix_caching,
                tensor_parallel_size=tensor_parallel_size,
                data_parallel_size=data_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
                **kwargs,
            )
        )
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Write the expert statistics (``expert_stats_out``) and stop the other ranks of a
        multi-process engine (a group also stops them at interpreter exit)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``prompts``: one string, a list of strings, one list of token ids, or a list of them.
        ``sampling_params``: one for all prompts or one per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts"
                )
        return self._run(zip(prompt_list, params_list))

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it cannot render chat messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    **(chat_template_kwargs or {}),
                ),
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (cumulative text)."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if self.engine.has_unfinished_requests():
                self.engine.abort_request(request_id)

    def _run(self, items) -> list[RequestOutput]:
        order: list[str] = []
        try:
            for prompt, params in items:
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params)
                order.append(request_id)
            done: dict[str, RequestOutput] = {}
            while len(done) < len(order):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                if not self.engine.has_unfinished_requests() and len(done) < len(order):
                    raise RuntimeError("the engine went idle with requests unfinished")
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [done[r] for r in order]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts
