"""The server on a distributed engine (EP over two DP replicas, two spawned ranks)."""

from __future__ import annotations

import time

import httpx
import openai

from moeserve.demo import TINY_CONFIG
from tests.e2e.server import start_server
from tests.e2e.test_metrics import _expert_sums, _scrape


def test_serving_on_an_expert_parallel_group(tmp_path):
    # a short collective timeout: the idle server must keep the workers awake (keepalive);
    # a temp dir of its own, to see that the server leaves nothing there
    srv = start_server(
        "--ep",
        "2",
        "--dist-timeout",
        "4",
        "--enable-debug-endpoints",
        env={"TMPDIR": str(tmp_path)},
    )
    try:
        assert len(srv.engine_pids()) >= 2  # the engine and its second rank
        client = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        time.sleep(6)  # longer than the collective timeout, with nothing to do
        one = client.completions.create(
            model=model, prompt="The expert", max_tokens=12, temperature=0
        )
        text = one.choices[0].text
        at = next(i for i in range(2, len(text) - 3) if text.find(text[i : i + 3]) == i)
        cut = client.completions.create(
            model=model, prompt="The expert", max_tokens=12, temperature=0, stop=[text[at : at + 3]]
        )
        assert cut.choices[0].text == text[:at]
        assert cut.choices[0].finish_reason == "stop"
        batch = client.completions.create(
            model=model,
            prompt=[f"prompt {i}" for i in range(6)],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert batch.usage.completion_tokens == 48
        # both replicas took requests; both report their queues; expert counts add up
        samples = _scrape(srv.url)
        engines = {dict(k[1]).get("engine") for k in samples if k[0].endswith("requests_running")}
        assert engines == {"0", "1"}
        sums = _expert_sums(samples)
        moe = range(TINY_CONFIG["first_k_dense_replace"], TINY_CONFIG["num_hidden_layers"])
        assert sorted(sums) == [str(i) for i in moe]
        assert len({sums[str(i)] for i in moe}) == 1  # every layer saw the same tokens
        stats = httpx.get(f"{srv.url}/debug/engine").json()
        assert stats["integrity"] == "ok" and len(stats["replicas"]) == 2
    finally:
        code = srv.stop()
    assert code == 0, srv.text()
    assert not srv.engine_pids()
    assert not list(tmp_path.iterdir())  # no moeserve-ranks-*, no moeserve-ipc-*
