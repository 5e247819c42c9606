"""When adaptive P/D (``auto_pd.py``) moves an instance from one role to the other: the
signals it reads from every instance's ``/metrics`` and the rule, with its hysteresis. Pure
functions over plain data, so the rule is tested without servers.

Signals, over a sliding window of ``window_s`` seconds of samples (one per ``interval_s``):

- ``prefill_queue``: requests waiting in a prefill instance's engine queue, averaged over the
  prefill instances and the window (``moeserve:num_requests_waiting``): prompts that arrive
  faster than the prefill side computes them pile up here;
- ``decode_queue``: the same over the decode instances (a decode instance queues when its
  batch or KV pool is full);
- ``ttft_ok``: the fraction of the window's first tokens within ``ttft_ms``, from the decode
  instances' ``moeserve:time_to_first_token_seconds`` (a decode instance receives a request
  when its prefill instance does, so its TTFT is the request's: prefill queue, prefill,
  transfer, first decode step);
- ``tpot_ok``: the fraction of the window's inter-token gaps within ``tpot_ms``, from the
  decode instances' ``moeserve:inter_token_latency_seconds``.

A fraction counts from ``min_samples`` observations in the window (fewer: no verdict).
The rule: prefill is **short** when its queue is at least ``queue_high`` per instance, or
TTFT misses its target while prompts are queued (at least 1 per instance: a TTFT lost to
decode admission is not prefill's fault); decode is short when TPOT misses its target or its
queue is at least ``queue_high``. When exactly one role is short and the other has more than
``min_per_role`` instances, one instance of the other role should move to it. Hysteresis:
that verdict must hold at every tick for ``sustain_s``, and ``cooldown_s`` must have passed
since the last switch (whose window is then discarded: it measured the old split).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TTFT = "moeserve:time_to_first_token_seconds"
ITL = "moeserve:inter_token_latency_seconds"
WAITING = "moeserve:num_requests_waiting"
RUNNING = "moeserve:num_requests_running"


@dataclass(frozen=True)
class AutoPDOptions:
    """The controller's targets and its pace (``moeserve router --auto-pd-*`` flags)."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0
    target: float = 0.9  # the fraction of observations that must meet an SLO
    queue_high: float = 4.0  # queued requests per instance that make a role short by themselves
    interval_s: float = 1.0
    window_s: float = 10.0
    sustain_s: float = 5.0
    cooldown_s: float = 30.0
    min_samples: int = 5
    min_per_role: int = 1
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "queue_high", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--auto-pd-{name.replace('_', '-')} must be > 0")
        for name in ("sustain_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--auto-pd-{name.replace('_', '-')} must be >= 0")
        if not 0 < self.target <= 1:
            raise ValueError(f"--auto-pd-target must be in (0, 1], got {self.target}")
        if self.min_samples < 1 or self.min_per_role < 1:
            raise ValueError("--auto-pd-min-samples and --auto-pd-min-per-role must be >= 1")
        if self.drain_timeout_s <= 0:
            raise ValueError("--auto-pd-drain-timeout must be > 0")
        if self.window_s < self.interval_s:
            raise ValueError("--auto-pd-window must be at least one --auto-pd-interval")


@dataclass(frozen=True)
class Scrape:
    """What one instance's ``/metrics`` said at one moment: gauges summed over its DP
    replicas, histograms as cumulative (upper bound, count) pairs."""

    waiting: float
    running: float
    ttft: tuple[tuple[float, float], ...] = ()
    itl: tuple[tuple[float, float], ...] = ()


def parse_metrics(text: str) -> Scrape:
    """The parts of a moeserve ``/metrics`` text the controller reads (ValueError for a text
    that is no Prometheus exposition)."""
    gauges = {WAITING: 0.0, RUNNING: 0.0}
    hists: dict[str, list[tuple[float, float]]] = {TTFT: [], ITL: []}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in gauges:
                gauges[s.name] += s.value
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in hists:
                hists[s.name[: -len("_bucket")]].append((float(s.labels["le"]), s.value))
    return Scrape(
        waiting=gauges[WAITING],
        running=gauges[RUNNING],
        ttft=tuple(sorted(hists[TTFT])),
        itl=tuple(sorted(hists[ITL])),
    )


def fraction_within(
    first: Iterable[tuple[float, float]], last: Iterable[tuple[float, float]], bound_s: float
) -> tuple[float, float]:
    """(observations within ``bound_s``, all observations) between two scrapes of one
    cumulative histogram. Within: those in buckets whose upper bound is at most ``bound_s``
    (a conservative count, exact when the bound is a bucket edge)."""
    a, b = dict(first), dict(last)
    total = b.get(math.inf, 0.0) - a.get(math.inf, 0.0)
    edges = [le for le in b if le <= bound_s]
    within = 0.0
    if edges:
        le = max(edges)
        within = b[le] - a.get(le, 0.0)
    return max(within, 0.0), max(total, 0.0)


@dataclass(frozen=True)
class Signals:
    prefill_queue: float
    decode_queue: float
    ttft_ok: float | None  # None: fewer than min_samples observations in the window
    tpot_ok: float | None
    num_ttft: float = 0.0
    num_itl: float = 0.0


@dataclass(frozen=True)
class Sample:
    """One tick: each instance's scrape (instances that did not answer are missing)."""

    at: float
    roles: Mapping[str, str]  # url -> "prefill" | "decode"
    scrapes: Mapping[str, Scrape]


def signals(window: list[Sample], options: AutoPDOptions) -> Signals:
    """The window's signals (module docstring); ``window`` is oldest first."""

    def mean_queue(role: str) -> float:
        per_tick = []
        for s in window:
            queues = [sc.waiting for u, sc in s.scrapes.items() if s.roles.get(u) == role]
            if queues:
                per_tick.append(sum(queues) / len(queues))
        return sum(per_tick) / len(per_tick) if per_tick else 0.0

    within = {"ttft": 0.0, "itl": 0.0}
    total = {"ttft": 0.0, "itl": 0.0}
    if len(window) >= 2:
        first, last = window[0], window[-1]
        for url, sc in last.scrapes.items():
            if last.roles.get(url) != "decode" or url not in first.scrapes:
                continue
            old = first.scrapes[url]
            for key, bound in (("ttft", options.ttft_ms), ("itl", options.tpot_ms)):
                w, n = fraction_within(getattr(old, key), getattr(sc, key), bound / 1000)
                within[key] += w
                total[key] += n

    def ok(key: str) -> float | None:
        return within[key] / total[key] if total[key] >= options.min_samples else None

    return Signals(
        prefill_queue=mean_queue("prefill"),
        decode_queue=mean_queue("decode"),
        ttft_ok=ok("ttft"),
        tpot_ok=ok("itl"),
        num_ttft=total["ttft"],
        num_itl=total["itl"],
    )


def short_roles(sig: Signals, options: AutoPDOptions) -> set[str]:
    """The roles that lack capacity now (module docstring)."""
    short = set()
    ttft_missed = sig.ttft_ok is not None and sig.ttft_ok < options.target
    if sig.prefill_queue >= options.queue_high or (ttft_missed and sig.prefill_queue >= 1):
        short.add("prefill")
    tpot_missed = sig.tpot_ok is not None and sig.tpot_ok < options.target
    if tpot_missed or sig.decode_queue >= options.queue_high:
        short.add("decode")
    return short


def wanted_move(sig: Signals, counts: Mapping[str, int], options: AutoPDOptions) -> str | None:
    """The role one instance should move to now ("prefill" or "decode"), or None: only when
    exactly one role is short and the other can give up an instance."""
    short = short_roles(sig, options)
    if len(short) != 1:
        return None
    to = short.pop()
    donor = "decode" if to == "prefill" else "prefill"
    return to if counts.get(donor, 0) > options.min_per_role else None


@dataclass
class Hysteresis:
    """Turns the per-tick verdicts into switches: the same verdict for ``sustain_s``, and
    ``cooldown_s`` since the last switch."""

    options: AutoPDOptions
    since: float | None = None  # when the current verdict was first seen
    verdict: str | None = None
    last_switch: float = -math.inf
    history: list[tuple[float, str]] = field(default_factory=list)  # (time, role moved to)

    def observe(self, verdict: str | None, now: float) -> str | None:
        """This tick's verdict; returns the role to move an instance to now, or None."""
        if verdict != self.verdict:
            self.verdict, self.since = verdict, now
        if verdict is None or self.since is None:
            return None
        if now - self.since < self.options.sustain_s:
            return None
        if now - self.last_switch < self.options.cooldown_s:
            return None
        return verdict

    def switched(self, to: str, now: float) -> None:
        self.last_switch = now
        self.verdict, self.since = None, None
        self.history.append((now, to))
