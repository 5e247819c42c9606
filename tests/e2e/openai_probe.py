"""The official ``openai`` client against a server, as a program: a test runs it inside a
network namespace (``ip netns exec``), where the test process itself cannot connect.

    python -m tests.e2e.openai_probe URL greedy     one JSON object: greedy completion, chat
                                                    and both streamed (their joined text)
    python -m tests.e2e.openai_probe URL stream N   a streamed completion of N tokens: a JSON
                                                    line per event, then {"error": ...} or
                                                    {"done": true}
    python -m tests.e2e.openai_probe URL streams S N  S concurrent greedy streams of N tokens:
                                                    {"started": true} once each has 8, then
                                                    {"streams": [each one's tokens]}
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable

import openai

PROMPT = "The expert said"
MESSAGES = [{"role": "user", "content": "Name three experts."}]


def greedy(client: openai.OpenAI, model: str) -> dict:
    params = {"model": model, "max_tokens": 16, "temperature": 0}
    completion = client.completions.create(prompt=PROMPT, **params)
    chat = client.chat.completions.create(messages=MESSAGES, **params)
    streamed = client.completions.create(prompt=PROMPT, stream=True, **params)
    chat_streamed = client.chat.completions.create(messages=MESSAGES, stream=True, **params)
    return {
        "completion": completion.choices[0].text,
        "chat": chat.choices[0].message.content,
        "completion_stream": "".join(c.choices[0].text for c in streamed if c.choices),
        "chat_stream": "".join(
            c.choices[0].delta.content or "" for c in chat_streamed if c.choices
        ),
    }


def stream(client: openai.OpenAI, model: str, max_tokens: int) -> None:
    events = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        for chunk in events:
            text = chunk.choices[0].text if chunk.choices else ""
            print(json.dumps({"text": text}), flush=True)
    except openai.APIError as e:  # the server's error event in the stream
        print(json.dumps({"error": str(e)}), flush=True)
        return
    print(json.dumps({"done": True}), flush=True)


def stream_tokens(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, started: threading.Event
) -> list[str]:
    """One streamed greedy completion's tokens (from its logprobs), in order; ``started`` is
    set once 8 have arrived."""
    tokens: list[str] = []
    events = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in events:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
        if len(tokens) >= 8:
            started.set()
    return tokens


def run_streams(
    client: openai.OpenAI,
    model: str,
    num: int,
    max_tokens: int,
    on_started: Callable[[], None] | None = None,
) -> list:
    """``num`` concurrent streams ("stream i says"): each one's tokens, or its exception.
    ``on_started`` runs once every stream has its first 8 tokens."""
    results: list = [None] * num
    started = [threading.Event() for _ in range(num)]

    def one(i: int) -> None:
        try:
            results[i] = stream_tokens(client, model, f"stream {i} says", max_tokens, started[i])
        except Exception as e:  # noqa: BLE001 - the caller compares the results
            results[i] = repr(e)
            started[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    if on_started is not None:
        for e in started:
            e.wait(120)
        on_started()
    for t in threads:
        t.join(300)
    return results


def main(argv: list[str]) -> int:
    url, mode = argv[0], argv[1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    if mode == "greedy":
        print(json.dumps(greedy(client, model)))
    elif mode == "streams":

        def say_started() -> None:
            print(json.dumps({"started": True}), flush=True)

        found = run_streams(client, model, int(argv[2]), int(argv[3]), say_started)
        print(json.dumps({"streams": found}), flush=True)
    else:
        stream(client, model, int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
