"""``moeserve:spec_decode_*`` in the server's Prometheus metrics, from the engine's stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moeserve.serving.metrics import _EngineCollector


def _scrape(stats: dict) -> dict[str, float]:
    registry = CollectorRegistry()
    collector = _EngineCollector("m")
    collector.stats = stats
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


BASE = {
    "replicas": [{"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.5}],
    "prefix_cache_queries": 10,
    "prefix_cache_hits": 4,
    "num_preemptions": 0,
    "expert_counts": {},
}


def test_spec_decode_metrics():
    st = dict(BASE)
    st.update(
        spec_decode_num_draft_tokens=30,
        spec_decode_num_accepted_tokens=12,
        spec_decode_num_verify_steps=10,
    )
    got = _scrape(st)
    assert got["moeserve:spec_decode_num_draft_tokens_total"] == 30
    assert got["moeserve:spec_decode_num_accepted_tokens_total"] == 12
    assert got["moeserve:spec_decode_num_drafts_total"] == 10
    assert got["moeserve:spec_decode_mean_accept_length"] == 2.2


def test_no_spec_decode_metrics_without_speculation():
    st = dict(BASE, spec_decode_num_verify_steps=0)
    assert not any(k.startswith("moeserve:spec_decode") for k in _scrape(st))
    assert not any(k.startswith("moeserve:spec_decode") for k in _scrape(BASE))
