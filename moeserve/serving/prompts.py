"""A request's prompt as token ids, prepared off the event loop.

Rendering a chat template and tokenizing take time proportional to the request; on the event
loop, one large request would stall every other client (and ``/health``). Both run on a small
pool of threads here: ``tokenizers`` releases the GIL while it encodes (see
``Tokenizer.encode``), and a jinja render gives it up every switch interval. A template sent
by the request is refused unless the operator allows it (``--trust-request-chat-template``,
vLLM's flag) and then renders in :class:`TemplateSandbox`, with a time, memory and output
budget. Every failure is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from moeserve.chat_template import ChatTemplateError
from moeserve.libc import release_free_heap
from moeserve.serving.errors import bad_request
from moeserve.serving.protocol import ChatMessage
from moeserve.serving.template_sandbox import TemplateBudget, TemplateSandbox
from moeserve.tokenizer import Tokenizer, TokenizerError

T = TypeVar("T")
DEFAULT_THREADS = 4
_TRIM_AFTER_CHARS = 1 << 20


def chat_dict(msg: ChatMessage) -> dict:
    """A message as chat templates expect it (text parts joined, ``developer`` as
    ``system``)."""
    content = msg.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    # OpenAI's newer name for the system role; chat templates know "system"
    role = "system" if msg.role == "developer" else msg.role
    out = {"role": role, "content": content or ""}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.reasoning_content is not None:
        out["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        out["tool_calls"] = msg.tool_calls
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


class PromptWorkers:
    """Tokenize and render for the API server, off its event loop."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        trust_request_chat_template: bool = False,
        budget: TemplateBudget | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.trust_request_chat_template = trust_request_chat_template
        self.sandbox = TemplateSandbox(budget or TemplateBudget())
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moeserve-prompt")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; 400 naming ``field`` when it cannot be tokenized."""
        try:
            return await self.run(self._encode, text, add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as e:
            # e.g. a lone UTF-16 surrogate ("\\ud800") that JSON allows but UTF-8 cannot hold
            raise bad_request(f"'{field}' cannot be tokenized: {e}", field) from None

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens)
        finally:
            if len(text) > _TRIM_AFTER_CHARS:
                # the tokenizer's working memory (offsets, ~100x the text) is free again;
                # without this the process would stay at its peak size
                release_free_heap()

    async def decode(self, ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode_long, ids, False)

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        chat_template_kwargs: dict | None,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation (``tools``: the request's, shown to the
        template); 400 for what cannot be rendered."""
        if add_generation_prompt and continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        chat = await self.run(lambda: [chat_dict(m) for m in messages])
        if continue_final_message and chat[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        template, field = self._request_template(chat_template, kwargs)
        try:
            if template is None:
                text = await self.run(self._render_own, chat, add_generation_prompt, kwargs)
            else:
                tools = kwargs.pop("tools", None)
                variables = self.tokenizer.chat_variables(kwargs)
                text = await self.sandbox.render(
                    template, chat, add_generation_prompt, tools, variables
                )
        except (TokenizerError, ChatTemplateError, TypeError) as e:  # TypeError: a kwarg
            # that clashes with apply_chat_template's own arguments
            raise bad_request(f"the chat template cannot render 'messages': {e}", field) from None
        if continue_final_message:
            final = chat[-1]["content"]
            cut = text.rfind(final) if final else -1
            if cut >= 0:
                text = text[: cut + len(final)]
        return await self.encode(text, "messages", add_special_tokens=add_special_tokens)

    def _request_template(self, chat_template: str | None, kwargs: dict) -> tuple[str | None, str]:
        """The template the request brings (None: the model's own) and the field to blame.
        Takes ``chat_template`` out of ``kwargs``; 400 for a foreign template unless the
        operator trusts them."""
        field = "messages"
        given = kwargs.pop("chat_template", None)
        if given is not None:
            field = "chat_template_kwargs.chat_template"
        if chat_template is not None:
            given, field = chat_template, "chat_template"
        if given is None:
            return None, field
        if not isinstance(given, str):
            raise bad_request(f"'{field}' must be a string", field)
        if self.tokenizer.is_own_chat_template(given):
            kwargs["chat_template"] = given  # the model's own (e.g. "tool_use"): trusted
            return None, field
        if not self.trust_request_chat_template:
            raise bad_request(
                f"'{field}': this server does not render chat templates sent by requests "
                "(the operator can allow them with --trust-request-chat-template)",
                field,
                "untrusted_chat_template",
            )
        return given, field

    def _render_own(self, chat: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, **kwargs
        )

    async def close(self) -> None:
        await self.sandbox.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
