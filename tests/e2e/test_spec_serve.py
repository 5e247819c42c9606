"""The server with MTP speculative decoding on (the demo model's MTP layer, k = 2): greedy
completions and chat completions, streamed or not, are the same as the plain server's (the
package's ``server`` fixture), and ``/metrics`` exports the ``moeserve:spec_decode_*`` series,
which the plain server does not."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server import RunningServer, start_server
from tests.e2e.test_metrics import _scrape

PROMPTS = ["The expert", "Speculative decoding drafts", "a b c d e f", "MoE layers route"]
GREEDY = dict(max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
SPEC_SERIES = (
    "moeserve:spec_decode_num_drafts_total",
    "moeserve:spec_decode_num_draft_tokens_total",
    "moeserve:spec_decode_num_accepted_tokens_total",
    "moeserve:spec_decode_mean_accept_length",
)


@pytest.fixture(scope="module")
def spec_server() -> RunningServer:
    srv = start_server("--speculative-num-tokens", "2", "--max-num-seqs", "16")
    yield srv
    srv.stop_cleanly()


@pytest.fixture()
def spec_client(spec_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=spec_server.v1, api_key="none", max_retries=0, timeout=120)


def _series(samples: dict) -> dict[str, float]:
    return {name: v for (name, _), v in samples.items() if name.startswith("moeserve:spec_decode")}


def _completions(client, model, stream: bool) -> list[str]:
    if not stream:
        r = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    out = []
    for p in PROMPTS:
        chunks = client.completions.create(model=model, prompt=p, stream=True, **GREEDY)
        out.append("".join(c.choices[0].text for c in chunks if c.choices))
    return out


def _chats(client, model, stream: bool) -> list[str]:
    out = []
    for p in PROMPTS:
        messages = [{"role": "user", "content": p}]
        if not stream:
            r = client.chat.completions.create(model=model, messages=messages, **GREEDY)
            out.append(r.choices[0].message.content)
            continue
        chunks = client.chat.completions.create(
            model=model, messages=messages, stream=True, **GREEDY
        )
        out.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", [_completions, _chats], ids=["completions", "chat"])
def test_greedy_output_identical_to_the_plain_server(client, model, spec_client, api, stream):
    spec_model = spec_client.models.list().data[0].id
    want = api(client, model, stream)
    got = api(spec_client, spec_model, stream)
    assert got == want
    assert all(want)


def test_spec_decode_series_in_metrics(server, spec_server, spec_client):
    model = spec_client.models.list().data[0].id
    spec_client.completions.create(model=model, prompt="count the drafts", **GREEDY)
    before = _series(_scrape(spec_server.url))
    r = spec_client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
    after = _series(_scrape(spec_server.url))
    assert set(SPEC_SERIES) <= set(after)
    steps = after[SPEC_SERIES[0]] - before[SPEC_SERIES[0]]
    drafts = after[SPEC_SERIES[1]] - before[SPEC_SERIES[1]]
    accepted = after[SPEC_SERIES[2]] - before[SPEC_SERIES[2]]
    # every verifying step checks 1..2 drafts; the batch's tokens come from steps + accepted
    assert 0 < steps <= drafts <= 2 * steps
    assert 0 <= accepted <= drafts
    assert r.usage.completion_tokens <= len(PROMPTS) * 24
    mean = after[SPEC_SERIES[3]]
    total_steps, total_accepted = after[SPEC_SERIES[0]], after[SPEC_SERIES[2]]
    assert mean == pytest.approx(1 + total_accepted / total_steps)
    # the plain server exports none of them
    assert not _series(_scrape(server.url))
