"""EPLB through the server: `moeserve serve --ep 2` with redundant experts and live
re-placement exports the window and the imbalance in /metrics, answers the admin calls,
keeps its greedy outputs across a re-placement, and writes --expert-stats-out at shutdown."""

from __future__ import annotations

import json

import httpx
import openai

from tests.e2e.server import start_server
from tests.e2e.test_metrics import _scrape


def test_admin_calls_metrics_and_shutdown_dump(tmp_path):
    out = tmp_path / "stats.safetensors"
    srv = start_server(
        "--ep", "2", "--ep-num-redundant-experts", "2", "--enable-eplb", "--eplb-interval",
        "1000000", "--expert-stats-out", str(out), "--enable-debug-endpoints",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete() -> list[str]:
            r = client.completions.create(
                model=model, prompt=[f"expert {i}" for i in range(4)], max_tokens=10,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

        before = complete()
        r = httpx.post(f"{srv.url}/admin/eplb/rebalance", timeout=120)
        assert r.status_code == 200, r.text
        layers = r.json()["layers"]
        assert set(layers) == {"1", "2"}
        assert all(v["after"] <= v["before"] for v in layers.values())
        assert complete() == before
        status = httpx.get(f"{srv.url}/admin/eplb", timeout=30).json()
        assert status["rebalances"] == 1 and status["ep_size"] == 2
        samples = _scrape(srv.url)
        tokens = [v for (n, _), v in samples.items() if n == "moeserve:eplb_window_expert_tokens"]
        assert len(tokens) == 2 * 16 and sum(tokens) > 0
        now = {
            dict(k)["layer"]: v for (n, k), v in samples.items() if n == "moeserve:eplb_imbalance"
        }
        assert set(now) == {"1", "2"} and all(v >= 1.0 for v in now.values())
        assert samples[("moeserve:eplb_rebalances_total", ())] == 1.0
        assert httpx.post(f"{srv.url}/admin/eplb/dump", timeout=60).status_code == 200
        assert out.is_file()
        out.unlink()
    finally:
        code = srv.stop()
    assert code == 0, srv.text()
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:  # written again at shutdown
        assert json.loads(f.metadata()["layer_ids"]) == [1, 2]
        assert f.get_tensor("load").shape == (2, 16)


def test_admin_calls_need_the_flag_and_a_stats_file():
    srv = start_server("--ep", "2", "--enable-debug-endpoints")
    try:
        r = httpx.post(f"{srv.url}/admin/eplb/dump", timeout=60)
        assert r.status_code == 400 and "no file" in r.text
    finally:
        assert srv.stop() == 0
