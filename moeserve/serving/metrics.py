"""Prometheus metrics of the server (``/metrics``), with vLLM's names under ``moeserve:``.

Latencies and token counts are observed here, in the API server, as clients see them. Queue
lengths, KV-cache use, prefix-cache counters and the tokens routed to each expert come from
the engine's latest stats snapshot, which the engine publishes on its own (with a step at
most every ``messages.STATS_INTERVAL_S`` while it runs requests, and once when it goes
idle); a scrape exports the snapshot as it is, however old (``engine_stats_age_seconds``
says how old), and never asks the engine. Snapshots arrive in order, so the engine's
counters stay monotonic. The engine's series (tens of thousands for a large MoE: tokens per
expert per layer) are rendered once per snapshot, not per scrape (:meth:`ServerMetrics.render`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from moeserve.serving.messages import STATS_INTERVAL_S

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
_TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
_LONG_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
_LONG_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Exports the last engine stats snapshot (see ``LLMEngine.stats``)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict | None = None
        self.seq = 0  # the snapshot's number (the engine counts them from 1); 0: unknown
        self.received_at: float | None = None  # time.monotonic() when it arrived

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        if st is None:
            return
        name = self.model_name
        per_engine = [
            ("num_requests_running", "Requests running (holding KV blocks).", "num_running"),
            ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
                "kv_cache_usage",
            ),
        ]
        for metric, doc, key in per_engine:
            g = GaugeMetricFamily(f"moeserve:{metric}", doc, labels=["model_name", "engine"])
            for i, replica in enumerate(st["replicas"]):
                g.add_metric([name, str(i)], replica[key])
            yield g
        for metric, doc in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
            ("num_preemptions", "Sequences preempted (KV freed, recomputed later)."),
        ):
            c = CounterMetricFamily(f"moeserve:{metric}", doc, labels=["model_name"])
            c.add_metric([name], st[metric])
            yield c
        yield from _disaggregation_metrics(name, st.get("disaggregation"), st.get("num_parked", 0))
        if st.get("eplb"):
            yield from _eplb_metrics(name, st["eplb"])
        if st.get("elastic"):
            yield from _elastic_metrics(name, st["elastic"])
        if st.get("spec_decode_num_verify_steps"):
            yield from _spec_decode_metrics(name, st)
        experts = st.get("expert_counts") or {}
        if not experts:
            return
        tokens = CounterMetricFamily(
            "moeserve:expert_tokens",
            "Tokens routed to each expert of each MoE layer.",
            labels=["model_name", "layer", "expert"],
        )
        ratio = GaugeMetricFamily(
            "moeserve:expert_load_max_mean_ratio",
            "Per MoE layer: the busiest expert's token count over the mean (1 = balanced), "
            "over all tokens since start.",
            labels=["model_name", "layer"],
        )
        for layer, counts in sorted(experts.items(), key=lambda kv: int(kv[0])):
            for e, n in enumerate(counts):
                tokens.add_metric([name, str(layer), str(e)], n)
            total = sum(counts)
            if total:
                ratio.add_metric([name, str(layer)], max(counts) * len(counts) / total)
        yield tokens
        yield ratio


class _SnapshotCollector(Collector):
    """The age and number of the engine's snapshot: rendered at every scrape (the age moves)."""

    def __init__(self, engine: _EngineCollector) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        if e.stats is not None and e.received_at is not None:
            yield from _snapshot_metrics(e.model_name, e.seq, time.monotonic() - e.received_at)


def _snapshot_metrics(name: str, seq: int, age_s: float) -> Iterator[Metric]:
    age = GaugeMetricFamily(
        "moeserve:engine_stats_age_seconds",
        "Seconds since the engine published the stats exported here. It publishes at most "
        f"every {STATS_INTERVAL_S:g} s while it runs requests and once when it goes idle, so a "
        "large age with requests running means a long step or a stuck engine; with none, "
        "nothing changed.",
        labels=["model_name"],
    )
    age.add_metric([name], max(0.0, age_s))
    yield age
    published = CounterMetricFamily(
        "moeserve:engine_stats_snapshots",
        "Stats snapshots the engine has published (on its own schedule, not per scrape).",
        labels=["model_name"],
    )
    published.add_metric([name], seq)
    yield published


def _disaggregation_metrics(name: str, pd: dict | None, num_parked: int) -> Iterator[Metric]:
    """This instance's prefill/decode role (``null``: colocated) and, in a role, its KV
    transfers (``disagg/connector.TransferStats``): on a prefill instance each batch from its
    start to its completion, on a decode instance each request from asking for its KV to
    having it (the prefill side's queue and compute included). With the per-instance
    ``request_queue_time_seconds``, that is the time a request spends in each stage."""
    role = GaugeMetricFamily(
        "moeserve:disaggregation_role",
        "1 for this instance's prefill/decode role (null: colocated).",
        labels=["model_name", "role"],
    )
    role.add_metric([name, pd["role"] if pd else "null"], 1)
    yield role
    if not pd:
        return
    parked = GaugeMetricFamily(
        "moeserve:num_requests_transferring",
        "Requests whose KV is moving between instances (holding blocks, not stepping).",
        labels=["model_name"],
    )
    parked.add_metric([name], num_parked)
    yield parked
    for metric, doc, key in (
        ("kv_transfers", "KV transfers completed.", "transfers"),
        ("kv_transfer_failures", "KV transfers failed or timed out.", "failures"),
        ("kv_transfer_bytes", "KV-cache bytes transferred.", "bytes"),
        ("kv_transfer_tokens", "Prompt tokens whose KV was transferred.", "tokens"),
    ):
        c = CounterMetricFamily(f"moeserve:{metric}", doc, labels=["model_name"])
        c.add_metric([name], pd[key])
        yield c
    h = HistogramMetricFamily(
        "moeserve:kv_transfer_seconds",
        "Prefill: a transfer batch's start to its completion. Decode: asking for a "
        "request's KV to having it.",
        labels=["model_name"],
    )
    cumulative, buckets = 0, []
    for le, n in zip((*pd["buckets"], float("inf")), pd["bucket_counts"]):
        cumulative += n
        buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
    h.add_metric([name], buckets, pd["seconds_sum"])
    yield h


def _spec_decode_metrics(name: str, st: dict) -> Iterator[Metric]:
    """MTP speculative decoding: drafts verified, drafts accepted, and the mean number of
    tokens a verifying sequence-step emits (accepted drafts + 1)."""
    for metric, doc, key in (
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
        (
            "spec_decode_num_drafts",
            "Sequence-steps that verified drafts.",
            "num_verify_steps",
        ),
    ):
        c = CounterMetricFamily(f"moeserve:{metric}", doc, labels=["model_name"])
        c.add_metric([name], st[f"spec_decode_{key}"])
        yield c
    steps = st["spec_decode_num_verify_steps"]
    mean = GaugeMetricFamily(
        "moeserve:spec_decode_mean_accept_length",
        "Tokens emitted per sequence-step that verified drafts (accepted drafts + 1), since start.",
        labels=["model_name"],
    )
    mean.add_metric([name], 1.0 + st["spec_decode_num_accepted_tokens"] / steps)
    yield mean


def rank_imbalance(counts: list[int], phy2log: list[int], ep_size: int) -> float:
    """Max over mean tokens per EP rank when each expert's tokens split evenly over its
    slots (rank ``r`` holds slots ``[r*S, (r+1)*S)``); 1.0 without tokens."""
    replicas = [0] * len(counts)
    for e in phy2log:
        replicas[e] += 1
    S = len(phy2log) // ep_size
    per_rank = [
        sum(counts[e] / replicas[e] for e in phy2log[r * S : (r + 1) * S]) for r in range(ep_size)
    ]
    mean = sum(per_rank) / ep_size
    return max(per_rank) / mean if mean > 0 else 1.0


def _eplb_metrics(name: str, eplb: dict) -> Iterator[Metric]:
    """Expert load over the EPLB window, the imbalance per MoE layer now and around the last
    re-placement (``ExpertBalancer.metrics``, merged over ranks)."""
    window = GaugeMetricFamily(
        "moeserve:eplb_window_expert_tokens",
        "Tokens routed to each logical expert over the EPLB window, summed over the EP group.",
        labels=["model_name", "layer", "expert"],
    )
    for layer, counts in sorted(eplb["window"].items(), key=lambda kv: int(kv[0])):
        for e, n in enumerate(counts):
            window.add_metric([name, layer, str(e)], n)
    yield window
    steps = GaugeMetricFamily(
        "moeserve:eplb_window_steps", "Engine steps the EPLB window covers.", labels=["model_name"]
    )
    steps.add_metric([name], eplb["window_steps"])
    yield steps
    now = GaugeMetricFamily(
        "moeserve:eplb_imbalance",
        "Per MoE layer: max over mean tokens per EP rank over the window, with the current "
        "placement (1 = balanced).",
        labels=["model_name", "layer"],
    )
    for layer, table in eplb["placement"].items():
        counts = eplb["window"].get(layer)
        if counts:
            now.add_metric([name, layer], rank_imbalance(counts, table, eplb["ep_size"]))
    yield now
    for i, (metric, doc) in enumerate(
        (
            ("eplb_imbalance_before", "before the last re-placement (from its window)"),
            ("eplb_imbalance_after", "after the last re-placement (predicted on its window)"),
        )
    ):
        g = GaugeMetricFamily(
            f"moeserve:{metric}",
            f"Per MoE layer: max over mean tokens per EP rank {doc}.",
            labels=["model_name", "layer"],
        )
        for layer, pair in eplb["last_rebalance"].items():
            g.add_metric([name, layer], pair[i])
        yield g
    c = CounterMetricFamily(
        "moeserve:eplb_rebalances", "EPLB re-placements computed.", labels=["model_name"]
    )
    c.add_metric([name], eplb["rebalances"])
    yield c


_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def _elastic_metrics(name: str, el: dict) -> Iterator[Metric]:
    """Elastic EP: the live ranks, the ranks lost, the recoveries and how long each took."""
    g = GaugeMetricFamily(
        "moeserve:live_ranks", "Ranks of the engine group serving now.", labels=["model_name"]
    )
    g.add_metric([name], el["live_ranks"])
    yield g
    for metric, doc, key in (
        ("rank_failures", "Ranks of the engine group lost (elastic EP).", "rank_failures"),
        ("recoveries", "Recoveries of the engine group after a rank loss.", "recoveries"),
    ):
        c = CounterMetricFamily(f"moeserve:{metric}", doc, labels=["model_name"])
        c.add_metric([name], el[key])
        yield c
    seconds = el["recovery_seconds"]
    buckets = [(str(b), sum(1 for x in seconds if x <= b)) for b in _RECOVERY_BUCKETS]
    buckets.append(("+Inf", len(seconds)))
    h = HistogramMetricFamily(
        "moeserve:recovery_seconds",
        "Time from a failed step to serving again without the lost rank(s).",
        labels=["model_name"],
    )
    h.add_metric([name], buckets, sum(seconds))
    yield h


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram(
            "moeserve:time_to_first_token_seconds",
            "Time from the request's arrival to its first output token.",
            _TTFT_BUCKETS,
        )
        self.itl = histogram(
            "moeserve:inter_token_latency_seconds",
            "Time between two outputs of a request.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "moeserve:e2e_request_latency_seconds",
            "Time from the request's arrival to its last token.",
            _LONG_BUCKETS,
        )
        self.queue_time = histogram(
            "moeserve:request_queue_time_seconds",
            "Time a request waited in the engine before its first step.",
            _LONG_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "moeserve:prompt_tokens", "Prompt tokens of accepted requests.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "moeserve:generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "moeserve:request_success",
            "Requests finished, by the finish reason of their first choice.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.engine = _EngineCollector(model_name)
        r.register(_SnapshotCollector(self.engine))
        self.engine_registry = CollectorRegistry()  # the snapshot's series, rendered apart
        self.engine_registry.register(self.engine)
        self._engine_version = 0  # bumped by every new snapshot
        self._engine_text: tuple[int, bytes] = (0, b"")  # (version, its rendering)

    def request_success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def set_engine_stats(self, stats: dict, seq: int = 0, received_at: float | None = None) -> None:
        """Export ``stats`` (snapshot number ``seq``, arrived at ``received_at``, a
        ``time.monotonic()``; without it no age is exported) from now on. The same snapshot
        again changes nothing."""
        c = self.engine
        if stats is c.stats and seq == c.seq and received_at == c.received_at:
            return
        c.stats, c.seq, c.received_at = stats, seq, received_at
        self._engine_version += 1

    def render(self) -> bytes:
        """The Prometheus text of every series: this server's rendered now, the engine's as
        rendered once for its current snapshot (they change only with the snapshot)."""
        version, text = self._engine_text
        if version != self._engine_version:
            text = generate_latest(self.engine_registry)
            self._engine_text = (self._engine_version, text)
        return generate_latest(self.registry) + text
