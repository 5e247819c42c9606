"""Serving-benchmark metrics on hand-computed records (no server, no clock)."""

from __future__ import annotations

import json
import math

import pytest

from moeserve.bench.metrics import (
    RequestRecord,
    compute_metrics,
    in_flight_bins,
    parse_goodput,
    throughput_bins,
)
from moeserve.bench.table import format_table

# A: 5 tokens in 5 chunks; B: 1 token (no TPOT); C: 3 tokens; D: failed.
A = RequestRecord(
    success=True,
    prompt_len=10,
    output_len=5,
    start=0.0,
    ttft=0.1,
    e2e=0.5,
    itl=(0.1, 0.1, 0.1, 0.1),
    chunk_times=(0.1, 0.2, 0.3, 0.4, 0.5),
)
B = RequestRecord(
    success=True, prompt_len=20, output_len=1, start=0.5, ttft=0.3, e2e=0.3, chunk_times=(0.8,)
)
C = RequestRecord(
    success=True,
    prompt_len=30,
    output_len=3,
    start=1.0,
    ttft=0.2,
    e2e=1.2,
    itl=(0.5, 0.5),
    chunk_times=(1.2, 1.7, 2.2),
)
D = RequestRecord(success=False, prompt_len=40, start=1.5, e2e=0.1, error="HTTP 500: boom")
RECORDS = [A, B, C, D]
DURATION = 2.5


def test_counts_and_throughputs_exclude_failed_requests():
    r = compute_metrics(RECORDS, DURATION)
    assert (r.completed, r.failed) == (3, 1)
    assert (r.total_input_tokens, r.total_output_tokens) == (60, 9)
    assert r.request_throughput == pytest.approx(1.2)
    assert r.output_throughput == pytest.approx(3.6)
    assert r.total_token_throughput == pytest.approx(27.6)
    assert r.request_goodput is None


def test_latency_stats_in_ms():
    r = compute_metrics(RECORDS, DURATION)
    # TTFT [100, 300, 200]: p99 interpolates between 200 and 300 at 0.98
    assert r.ttft.mean == pytest.approx(200)
    assert r.ttft.median == pytest.approx(200)
    assert r.ttft.std == pytest.approx(math.sqrt(20000 / 3))
    assert r.ttft.p99 == pytest.approx(298)
    # TPOT: A (0.5-0.1)/4 = 100 ms, C (1.2-0.2)/2 = 500 ms; B (output_len 1) excluded
    assert r.tpot.mean == pytest.approx(300)
    assert r.tpot.p99 == pytest.approx(496)
    # ITL pooled: four 100 ms gaps and two 500 ms gaps
    assert r.itl.mean == pytest.approx(1400 / 6)
    assert r.itl.median == pytest.approx(100)
    assert r.itl.p99 == pytest.approx(500)
    assert r.e2el.mean == pytest.approx(2000 / 3)
    assert r.e2el.median == pytest.approx(500)


def test_tpot_property():
    assert A.tpot == pytest.approx(0.1)
    assert B.tpot is None


def test_empty_samples_report_zero():
    r = compute_metrics([D], 1.0)
    assert r.completed == 0 and r.failed == 1
    assert (r.ttft.mean, r.tpot.p99, r.itl.median, r.e2el.std) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "slos, expected",
    [
        ({"ttft": 250}, 2 / 2.5),  # A, C
        ({"tpot": 200}, 2 / 2.5),  # A, and B which has no TPOT
        ({"e2el": 400}, 1 / 2.5),  # B
        ({"ttft": 250, "tpot": 200}, 1 / 2.5),  # A
        ({"ttft": 1}, 0.0),
    ],
)
def test_goodput(slos, expected):
    assert compute_metrics(RECORDS, DURATION, slos).request_goodput == pytest.approx(expected)


def test_time_bins_and_peak_concurrency():
    assert throughput_bins([A, B, C], DURATION) == pytest.approx([6, 2, 1])
    # A [0, .5), B [.5, .8) do not overlap; C [1, 2.2) and D [1.5, 1.6) do
    peaks, peak = in_flight_bins(RECORDS, DURATION)
    assert peaks == [1, 2, 1] and peak == 2
    r = compute_metrics(RECORDS, DURATION)
    assert r.max_output_tokens_per_s == pytest.approx(6)
    assert r.max_concurrent_requests == 2


def test_throughput_bins_spread_multi_token_chunks():
    rec = RequestRecord(
        success=True, prompt_len=1, output_len=4, ttft=0.5, e2e=1.5, chunk_times=(0.5, 1.5)
    )
    assert throughput_bins([rec], 2.0) == pytest.approx([2, 2])


def test_json_has_vllm_fields_and_per_request_arrays():
    r = compute_metrics(RECORDS, DURATION, {"ttft": 250}, {"request_rate": math.inf})
    d = json.loads(r.to_json())
    for key in (
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "std_tpot_ms",
        "mean_itl_ms",
        "p99_e2el_ms",
    ):
        assert key in d, key
    assert d["input_lens"] == [10, 20, 30, 40]
    assert d["output_lens"] == [5, 1, 3, 0]
    assert d["ttfts"] == pytest.approx([0.1, 0.3, 0.2, 0.0])
    assert d["itls"][2] == pytest.approx([0.5, 0.5])
    assert d["errors"] == ["", "", "", "HTTP 500: boom"]
    assert d["config"] == {"request_rate": "inf"}


def test_table_lines():
    text = format_table(compute_metrics(RECORDS, DURATION, {"ttft": 250}))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     3" in lines
    assert "Failed requests:                         1" in lines
    assert "Request goodput (req/s):                 0.80" in lines
    assert "Mean TTFT (ms):                          200.00" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert lines[-1] == "=" * 50
    assert "Request goodput" not in format_table(compute_metrics(RECORDS, DURATION))


@pytest.mark.parametrize(
    "specs, message",
    [
        (["ttft"], "expected KEY:MS"),
        (["itl:5"], "unknown key 'itl'"),
        (["ttft:abc"], "is not a number"),
        (["ttft:-1"], "positive"),
        (["ttft:inf"], "positive"),
        (["ttft:1", "ttft:2"], "given twice"),
    ],
)
def test_goodput_parsing_errors(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_goodput(specs)


def test_goodput_parsing():
    assert parse_goodput(["TTFT:500", "tpot:50.5", "e2el:3000"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 3000.0,
    }
    assert parse_goodput([]) == {}
