"""The adaptive P/D rule: metrics parsing, the window's signals, the verdict, hysteresis."""

import math

import pytest

from moeserve.serving.auto_pd_policy import (
    AutoPDOptions,
    Hysteresis,
    Sample,
    Scrape,
    fraction_within,
    parse_metrics,
    short_roles,
    signals,
    wanted_move,
)

OPTS = AutoPDOptions(ttft_ms=500, tpot_ms=100, min_samples=2, sustain_s=3, cooldown_s=10)

METRICS = """# TYPE moeserve:num_requests_waiting gauge
moeserve:num_requests_waiting{engine="0",model_name="m"} 3.0
moeserve:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE moeserve:num_requests_running gauge
moeserve:num_requests_running{engine="0",model_name="m"} 1.0
# TYPE moeserve:time_to_first_token_seconds histogram
moeserve:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 4.0
moeserve:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 6.0
moeserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
moeserve:time_to_first_token_seconds_count{model_name="m"} 10.0
moeserve:time_to_first_token_seconds_sum{model_name="m"} 9.0
"""


def test_parse_metrics_sums_replicas_and_reads_buckets():
    sc = parse_metrics(METRICS)
    assert sc.waiting == 5.0 and sc.running == 1.0
    assert sc.ttft == ((0.5, 4.0), (1.0, 6.0), (math.inf, 10.0))
    assert sc.itl == ()


def test_fraction_within_is_the_delta_and_conservative():
    a = ((0.5, 4.0), (1.0, 6.0), (math.inf, 10.0))
    b = ((0.5, 5.0), (1.0, 9.0), (math.inf, 14.0))
    assert fraction_within(a, b, 0.5) == (1.0, 4.0)
    assert fraction_within(a, b, 0.7) == (1.0, 4.0)  # bucket 1.0 is not all within 0.7
    assert fraction_within(a, b, 0.2) == (0.0, 4.0)


def _hist(within: float, total: float, bound: float) -> tuple:
    return ((bound, within), (math.inf, total))


def _window(prefill_waiting, decode_waiting, ttft_in, ttft_n, itl_in, itl_n):
    roles = {"p": "prefill", "d": "decode"}
    first = Sample(0.0, roles, {"p": Scrape(prefill_waiting, 0), "d": Scrape(decode_waiting, 0)})
    last = Sample(
        1.0,
        roles,
        {
            "p": Scrape(prefill_waiting, 0),
            "d": Scrape(decode_waiting, 0, _hist(ttft_in, ttft_n, 0.5), _hist(itl_in, itl_n, 0.1)),
        },
    )
    return [first, last]


def test_signals_and_verdicts():
    sig = signals(_window(3, 0, 1, 10, 10, 10), OPTS)  # TTFT missed with prompts queued
    assert sig.prefill_queue == 3 and sig.decode_queue == 0
    assert sig.ttft_ok == pytest.approx(0.1) and sig.tpot_ok == 1.0
    assert short_roles(sig, OPTS) == {"prefill"}
    assert wanted_move(sig, {"prefill": 1, "decode": 2}, OPTS) == "prefill"
    assert wanted_move(sig, {"prefill": 2, "decode": 1}, OPTS) is None  # no decode to spare
    sig = signals(_window(0, 0, 1, 10, 10, 10), OPTS)  # TTFT lost to decode, not prefill
    assert short_roles(sig, OPTS) == set()
    sig = signals(_window(0, 0, 10, 10, 2, 10), OPTS)  # TPOT missed
    assert wanted_move(sig, {"prefill": 2, "decode": 1}, OPTS) == "decode"
    sig = signals(_window(5, 0, 10, 10, 2, 10), OPTS)  # both short: moving helps neither
    assert wanted_move(sig, {"prefill": 2, "decode": 2}, OPTS) is None
    sig = signals(_window(0, 0, 0, 1, 0, 1), OPTS)  # too few observations: no verdict
    assert sig.ttft_ok is None and sig.tpot_ok is None


def test_hysteresis_needs_a_sustained_verdict_and_a_cooldown():
    h = Hysteresis(OPTS)
    assert h.observe("decode", 0.0) is None
    assert h.observe("decode", 2.0) is None
    assert h.observe(None, 2.5) is None  # the verdict broke: start again
    assert h.observe("decode", 3.0) is None
    assert h.observe("decode", 6.0) == "decode"
    h.switched("decode", 6.0)
    assert h.observe("prefill", 7.0) is None
    assert h.observe("prefill", 12.0) is None  # sustained, but within the cooldown
    assert h.observe("prefill", 16.5) == "prefill"


@pytest.mark.parametrize(
    "field, value",
    [("ttft_ms", 0), ("target", 1.5), ("cooldown_s", -1), ("min_per_role", 0), ("window_s", 0.5)],
)
def test_bad_options_name_the_flag(field, value):
    with pytest.raises(ValueError, match="auto-pd"):
        AutoPDOptions(**{field: value})
