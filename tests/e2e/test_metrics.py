"""``/metrics`` parses with prometheus-client's parser and its counters match what was sent."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from moeserve.demo import TINY_CONFIG


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _delta(after, before, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _expert_sums(samples) -> dict[str, float]:
    sums: dict[str, float] = {}
    for (name, labels), v in samples.items():
        if name == "moeserve:expert_tokens_total":
            layer = dict(labels)["layer"]
            sums[layer] = sums.get(layer, 0.0) + v
    return sums


def test_counters_match_what_was_sent(server, http, client, model):
    before = _scrape(server.url)
    sent = []
    for i in range(4):
        r = client.completions.create(
            model=model,
            prompt=f"metrics request number {i} " * (i + 1),
            max_tokens=5 + i,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        sent.append(r.usage)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "and a stream"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    sent.append([c.usage for c in stream if c.usage is not None][0])
    after = _scrape(server.url)

    prompt = sum(u.prompt_tokens for u in sent)
    generated = sum(u.completion_tokens for u in sent)
    assert _delta(after, before, "moeserve:prompt_tokens_total") == prompt
    assert _delta(after, before, "moeserve:generation_tokens_total") == generated
    success = "moeserve:request_success_total"
    assert _delta(after, before, success, finished_reason="length") == len(sent)
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert _delta(after, before, f"moeserve:{hist}_seconds_count") == len(sent)
    assert _delta(after, before, "moeserve:inter_token_latency_seconds_count") == generated - len(
        sent
    )
    assert after[("moeserve:num_requests_running", (("engine", "0"),))] == 0
    assert after[("moeserve:num_requests_waiting", (("engine", "0"),))] == 0
    assert 0 <= after[("moeserve:kv_cache_usage_perc", (("engine", "0"),))] <= 1

    # prefix cache: queries cover every prompt token, hits what usage reports as cached
    cached = sum(u.prompt_tokens_details.cached_tokens for u in sent)
    assert _delta(after, before, "moeserve:prefix_cache_queries_total") == prompt
    assert _delta(after, before, "moeserve:prefix_cache_hits_total") == cached

    # every computed token was routed to top_k experts in each MoE layer
    computed = sum(
        u.prompt_tokens - u.prompt_tokens_details.cached_tokens + u.completion_tokens - 1
        for u in sent
    )
    top_k = TINY_CONFIG["num_experts_per_tok"]
    moe_layers = [
        str(i)
        for i in range(TINY_CONFIG["first_k_dense_replace"], TINY_CONFIG["num_hidden_layers"])
    ]
    sums_before, sums_after = _expert_sums(before), _expert_sums(after)
    assert sorted(sums_after) == moe_layers
    for layer in moe_layers:
        assert sums_after[layer] - sums_before.get(layer, 0.0) == top_k * computed
        ratio = after[("moeserve:expert_load_max_mean_ratio", (("layer", layer),))]
        assert ratio >= 1.0


def _families(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_scrapes_read_the_engines_snapshot_and_never_ask_the_engine(server, http, client, model):
    """Scrapes in a tight loop during a generation: every answer is valid Prometheus text with
    the engine's series; the engine received no message for them (its Call count moves only
    by the /debug/engine call that reads it); its snapshots came on its own schedule, fewer
    than the scrapes, changed while it generated, and once idle hold the request's counts."""
    import threading
    import time

    from moeserve.serving.messages import STATS_INTERVAL_S

    calls_before = http.get("/debug/engine").json()["calls_received"]
    before = _scrape(server.url)
    prompt = "a long generation while someone scrapes"
    usages = []

    def generate() -> None:
        # long generations one after another, until several snapshot intervals have passed
        # (one of 1500 tokens took 1.15 s on a fast host: under three intervals)
        while not usages or time.monotonic() - t0 < 4 * STATS_INTERVAL_S:
            r = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=1500,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            usages.append(r.usage)

    worker = threading.Thread(target=generate)
    seen = []  # (snapshot number, requests running, generated tokens) of each scrape
    with httpx.Client(base_url=server.url, timeout=30) as c:
        t0 = time.monotonic()
        worker.start()
        while worker.is_alive():
            r = c.get("/metrics")
            assert r.status_code == 200
            s = _families(r.text)
            seen.append(
                (
                    s[("moeserve:engine_stats_snapshots_total", ())],
                    s[("moeserve:num_requests_running", (("engine", "0"),))],
                    sum(v for (n, _), v in s.items() if n == "moeserve:expert_tokens_total"),
                )
            )
            assert 0 <= s[("moeserve:kv_cache_usage_perc", (("engine", "0"),))] <= 1
            assert s[("moeserve:engine_stats_age_seconds", ())] >= 0
        took = time.monotonic() - t0
    worker.join()
    after = _scrape(server.url)
    calls_after = http.get("/debug/engine").json()["calls_received"]

    assert took > 3 * STATS_INTERVAL_S, took  # else the test says nothing about the schedule
    assert calls_after - calls_before == 1  # the second /debug/engine call itself
    assert len(seen) >= 20
    published = after[("moeserve:engine_stats_snapshots_total", ())] - seen[0][0]
    assert published < len(seen)
    assert published <= took / STATS_INTERVAL_S + 3  # busy: one per interval; + going idle
    # while generating: the request ran, and the snapshots moved (expert counts grew)
    running = [x for x in seen if x[1] == 1]
    assert running and len({x[0] for x in running}) >= 2
    assert len({x[2] for x in running}) >= 2
    assert all(a[0] <= b[0] and a[2] <= b[2] for a, b in zip(seen, seen[1:]))  # monotonic

    # idle: the last snapshot holds the finished requests' counts
    assert after[("moeserve:num_requests_running", (("engine", "0"),))] == 0
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert _delta(after, before, "moeserve:prefix_cache_queries_total") == prompt_tokens
    computed = sum(
        u.prompt_tokens - u.prompt_tokens_details.cached_tokens + u.completion_tokens - 1
        for u in usages
    )
    sums_before, sums_after = _expert_sums(before), _expert_sums(after)
    for layer, total in sums_after.items():
        assert total - sums_before.get(layer, 0.0) == TINY_CONFIG["num_experts_per_tok"] * computed
