"""Serving-benchmark metrics: pure functions from per-request records to a result.

No I/O and no clocks here: the runner measures, this module only computes. Times in a
:class:`RequestRecord` are seconds relative to the benchmark start; the result reports latencies
in milliseconds, with vLLM's definitions and JSON field names:

- TTFT: request start to the first chunk that carries text.
- TPOT: ``(e2e - ttft) / (output_len - 1)``, only for requests with ``output_len > 1``.
- ITL: the gaps between successive text chunks, pooled over all requests.
- E2EL: request start to the end of the stream.

Percentiles interpolate linearly (``numpy.percentile``), std is the population std, and an empty
sample reports 0.0, as vLLM does. Failed requests count only in ``failed`` and ``errors``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys, values in ms


@dataclass(frozen=True)
class RequestRecord:
    """What the runner measured for one request (times in seconds since the benchmark start).

    ``chunk_times`` holds the arrival time of every chunk that carried text, so
    ``ttft == chunk_times[0] - start`` and ``itl[i] == chunk_times[i + 1] - chunk_times[i]``.
    """

    success: bool
    prompt_len: int
    output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: tuple[float, ...] = ()
    chunk_times: tuple[float, ...] = ()
    error: str = ""
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None when ``output_len <= 1``."""
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    @property
    def end(self) -> float:
        return self.start + self.e2e


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency sample, in milliseconds."""

    mean: float
    median: float
    std: float
    p99: float

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> LatencyStats:
        if len(values_s) == 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values_s, dtype=np.float64) * 1000.0
        return cls(
            float(a.mean()), float(np.median(a)), float(a.std()), float(np.percentile(a, 99))
        )


@dataclass(frozen=True)
class BenchmarkResult:
    """Aggregate metrics of one benchmark run; ``records`` and ``config`` go into the JSON."""

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None when no SLO was given
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    output_throughput_per_s: tuple[float, ...]  # tokens generated in [i, i + 1) s
    requests_in_flight_per_s: tuple[int, ...]  # peak requests in flight in [i, i + 1) s
    max_concurrent_requests: int
    slos_ms: Mapping[str, float] = field(default_factory=dict)
    records: tuple[RequestRecord, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def max_output_tokens_per_s(self) -> float:
        return max(self.output_throughput_per_s, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: vLLM's field names, the per-request arrays, and ``config``."""
        out: dict[str, Any] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            for stat, value in asdict(getattr(self, name)).items():
                out[f"{stat}_{name}_ms"] = value
        out["goodput_slos_ms"] = dict(self.slos_ms)
        out["output_throughput_per_s"] = list(self.output_throughput_per_s)
        out["requests_in_flight_per_s"] = list(self.requests_in_flight_per_s)
        # per-request arrays, in dispatch order (failed requests included, as in vLLM)
        rs = self.records
        out["input_lens"] = [r.prompt_len for r in rs]
        out["output_lens"] = [r.output_len if r.success else 0 for r in rs]
        out["ttfts"] = [r.ttft if r.success else 0.0 for r in rs]
        out["itls"] = [list(r.itl) if r.success else [] for r in rs]
        out["e2els"] = [r.e2e if r.success else 0.0 for r in rs]
        out["start_times"] = [r.start for r in rs]
        out["generated_texts"] = [r.generated_text for r in rs]
        out["errors"] = [r.error for r in rs]
        out["config"] = dict(self.config)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text (strict: an infinite number is written as "inf")."""
        return json.dumps(_finite(self.to_dict()), indent=indent, allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` (vLLM's ``--goodput``) into ``{key: ms}``.

    Raises ValueError naming the bad item: no colon, an unknown key, a repeated key, or a value
    that is not a positive finite number of milliseconds.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"--goodput item {spec!r}: expected KEY:MS, e.g. ttft:500")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput item {spec!r}: unknown key {key!r}; use {SLO_KEYS}")
        if key in slos:
            raise ValueError(f"--goodput item {spec!r}: {key} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {spec!r}: {value!r} is not a number of ms") from None
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"--goodput item {spec!r}: the SLO must be a positive number of ms")
        slos[key] = ms
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """True for a successful request within every SLO (a request without TPOT meets tpot)."""
    if not record.success:
        return False
    tpot = record.tpot
    measured = {"ttft": record.ttft, "tpot": 0.0 if tpot is None else tpot, "e2el": record.e2e}
    return all(measured[k] * 1000.0 <= v for k, v in slos_ms.items())


def throughput_bins(records: Sequence[RequestRecord], duration: float) -> list[float]:
    """Output tokens generated in each 1-second bin ``[i, i + 1)`` of the run.

    A request's ``output_len`` tokens are spread evenly over its text chunks (a chunk may carry
    several tokens, e.g. with speculative decoding). Bins: ``max(1, ceil(duration))``.
    """
    bins = np.zeros(max(1, math.ceil(duration)), dtype=np.float64)
    for r in records:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        for t in r.chunk_times:
            bins[min(max(int(t), 0), len(bins) - 1)] += per_chunk
    return bins.tolist()


def in_flight_bins(records: Sequence[RequestRecord], duration: float) -> tuple[list[int], int]:
    """Peak number of requests in flight in each 1-second bin, and the overall peak.

    A request is in flight on ``[start, start + e2e)``; failed requests count too (they held a
    connection). An end and a start at the same instant do not overlap.
    """
    n_bins = max(1, math.ceil(duration))
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    peaks = [0] * n_bins
    current = 0
    last_bin = 0
    for t, delta in events:
        b = min(max(int(t), 0), n_bins - 1)
        for carried in range(last_bin + 1, b + 1):  # bins with no event hold the running count
            peaks[carried] = max(peaks[carried], current)
        last_bin = max(last_bin, b)
        current += delta
        peaks[b] = max(peaks[b], current)
    return peaks, max(peaks, default=0)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    slos_ms: Mapping[str, float] | None = None,
    config: Mapping[str, Any] | None = None,
) -> BenchmarkResult:
    """Aggregate ``records`` of a run that took ``duration`` seconds into a BenchmarkResult.

    Raises ValueError if ``duration`` is not positive or an SLO key is unknown.
    """
    if not duration > 0:
        raise ValueError(f"benchmark duration must be positive, got {duration}")
    slos = dict(slos_ms or {})
    unknown = set(slos) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)}; use {SLO_KEYS}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [gap for r in ok for gap in r.itl]
    goodput = sum(meets_slos(r, slos) for r in ok) / duration if slos else None
    in_flight, peak = in_flight_bins(records, duration)
    return BenchmarkResult(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        request_goodput=goodput,
        ttft=LatencyStats.of_seconds([r.ttft for r in ok]),
        tpot=LatencyStats.of_seconds(tpots),
        itl=LatencyStats.of_seconds(itls),
        e2el=LatencyStats.of_seconds([r.e2e for r in ok]),
        output_throughput_per_s=tuple(throughput_bins(ok, duration)),
        requests_in_flight_per_s=tuple(in_flight),
        max_concurrent_requests=peak,
        slos_ms=slos,
        records=tuple(records),
        config=dict(config or {}),
    )
