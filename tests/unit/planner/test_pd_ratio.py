"""The prefill:decode split: utilisation and queueing formulas, the choice for prefill-heavy,
decode-heavy and phased workloads, and the errors."""

from __future__ import annotations

import math

import pytest

from moeserve.planner.layout import Layout
from moeserve.planner.pd_ratio import Fleet, Phase, predict_on_host, predict_splits

PREFILL_HEAVY = (200, 1)  # input, output
DECODE_HEAVY = (16, 200)


def _rates(tiny, profile, fleet):
    """Requests/s at which one prefill (one decode) instance is at 2.5 times its capacity: the
    utilisations are linear in the rate, so a probe at 1 request/s gives them."""
    probe = predict_splits(tiny, profile, fleet, [Phase(*PREFILL_HEAVY, 1.0, 1.0)])
    pre = probe.splits[0].phases[0].prefill_util  # P = 1
    probe = predict_splits(tiny, profile, fleet, [Phase(*DECODE_HEAVY, 1.0, 1.0)])
    dec = probe.splits[-1].phases[0].decode_util  # D = 1
    return 2.5 / pre, 2.5 / dec


def test_utilisation_and_queueing_formulas(tiny, profile):
    fleet = Fleet(Layout(), 4)
    ph = Phase(200, 20, 50.0, 30.0, ttft_ms=5.0)
    pred = predict_splits(tiny, profile, fleet, [ph])
    assert [(s.prefill, s.decode) for s in pred.splits] == [(1, 3), (2, 2), (3, 1)]
    base = pred.splits[0].phases[0]
    for s in pred.splits:
        r = s.phases[0]
        assert r.prefill_util == pytest.approx(ph.rate * r.prefill_s / s.prefill)
        # Little's law on each decode instance: batch = arrivals x time in decode
        assert r.decode_batch == pytest.approx(ph.rate / s.decode * ph.output_len * r.tpot_s)
        assert r.decode_util == pytest.approx(base.decode_util * 3 / s.decode)
        assert r.prefill_keeps_up and r.decode_keeps_up
        assert r.prefill_backlog_s == 0 and r.decode_backlog_s == 0
        # M/D/1 mean wait, and its exponential tail for the share meeting the TTFT target
        rho, s_p = r.prefill_util, r.prefill_s
        ewq = rho * s_p / (2 * (1 - rho))
        fixed = r.transfer_s + 1.5 * r.tpot_s
        assert r.ttft_s == pytest.approx(ewq + s_p + fixed)
        y = ph.ttft_ms / 1e3 - fixed - s_p
        assert r.goodput == pytest.approx(ph.rate * (1 - rho * math.exp(-rho * y / ewq)))
    assert pred.best.prefill == 3  # the shortest prefill queue meets TTFT most often


def test_prefill_heavy_picks_more_prefill(tiny, profile):
    fleet = Fleet(Layout(), 4)
    r_pre, _ = _rates(tiny, profile, fleet)
    pred = predict_splits(tiny, profile, fleet, [Phase(*PREFILL_HEAVY, r_pre, 60, ttft_ms=20)])
    best = pred.best
    assert (best.prefill, best.decode) == (3, 1)
    one = pred.splits[0].phases[0]
    assert not one.prefill_keeps_up and one.prefill_backlog_s == pytest.approx(1.5 * 60)
    assert pred.splits[0].goodput < best.goodput


def test_decode_heavy_picks_more_decode(tiny, profile):
    fleet = Fleet(Layout(), 4)
    _, r_dec = _rates(tiny, profile, fleet)
    pred = predict_splits(tiny, profile, fleet, [Phase(*DECODE_HEAVY, r_dec, 60, ttft_ms=20)])
    assert (pred.best.prefill, pred.best.decode) == (1, 3)
    one = pred.splits[-1].phases[0]  # D = 1 falls behind: requests wait for a decode slot
    assert not one.decode_keeps_up and one.decode_backlog_s > 0
    assert one.decode_batch == fleet.max_decode_batch


def test_tpot_target_counts(tiny, profile):
    fleet = Fleet(Layout(), 3)
    ph = Phase(*DECODE_HEAVY, 100.0, 10)
    r = predict_splits(tiny, profile, fleet, [ph]).splits[0].phases[0]
    tight = Phase(*DECODE_HEAVY, 100.0, 10, tpot_ms=r.tpot_s * 1e3 * 0.99)
    assert predict_splits(tiny, profile, fleet, [tight]).splits[0].phases[0].goodput == 0
    assert r.goodput == ph.rate  # no targets: every request counts


def test_phased_choice_follows_the_phases(tiny, profile):
    fleet = Fleet(Layout(), 4)
    r_pre, r_dec = _rates(tiny, profile, fleet)

    def phases(t_pre, t_dec):
        return [
            Phase(*PREFILL_HEAVY, r_pre, t_pre, ttft_ms=20),
            Phase(*DECODE_HEAVY, r_dec, t_dec, ttft_ms=20),
        ]

    mostly_prefill = predict_splits(tiny, profile, fleet, phases(100, 1))
    mostly_decode = predict_splits(tiny, profile, fleet, phases(1, 100))
    assert (mostly_prefill.best.prefill, mostly_prefill.best.decode) == (3, 1)
    assert (mostly_decode.best.prefill, mostly_decode.best.decode) == (1, 3)
    for pred in (mostly_prefill, mostly_decode):
        for s in pred.splits:
            # the first phase starts empty: as if it ran alone
            alone = predict_splits(tiny, profile, fleet, [s.phases[0].phase])
            assert s.phases[0] == alone.splits[s.prefill - 1].phases[0]
            total = sum(r.phase.duration_s for r in s.phases)
            mean = sum(r.goodput * r.phase.duration_s for r in s.phases) / total
            assert s.goodput == pytest.approx(mean)
    # the backlog of an overloaded prefill phase spills into the next
    spill = mostly_prefill.splits[0].phases  # 1:3
    assert spill[0].prefill_backlog_s > 100 and spill[1].ttft_s > 100


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(input_len=0), "input_len"),
        (dict(output_len=1.5), "output_len"),
        (dict(rate=-1.0), "rate"),
        (dict(duration_s=0), "duration_s"),
        (dict(ttft_ms=0), "ttft_ms"),
        (dict(tpot_ms=float("nan")), "tpot_ms"),
    ],
)
def test_bad_phase(kw, field):
    args = {**dict(input_len=64, output_len=8, rate=1.0, duration_s=10.0), **kw}
    with pytest.raises(ValueError, match=field):
        Phase(**args)


def test_bad_fleet_and_workload(tiny, profile):
    with pytest.raises(ValueError, match="instances must be >= 2"):
        Fleet(Layout(), 1)
    with pytest.raises(ValueError, match="colocated must be in 1..instances"):
        Fleet(Layout(), 3, colocated=4)
    with pytest.raises(ValueError, match="max_decode_batch"):
        Fleet(Layout(), 3, max_decode_batch=0)
    with pytest.raises(ValueError, match="phases"):
        predict_splits(tiny, profile, Fleet(Layout(), 2), [])


def test_predict_on_host(tiny_config):
    phases = [Phase(1024, 4, 0.2, 60, ttft_ms=15000), Phase(64, 128, 0.3, 60)]
    pred = predict_on_host(tiny_config, phases)  # the calibrated this-machine profile
    assert pred.fleet.instances == pred.fleet.colocated == 3
    assert pred.as_dict()["best"] == f"{pred.best.prefill}:{pred.best.decode}"
    with pytest.raises(ValueError, match="does not fit in memory"):
        predict_on_host("deepseek-v3", phases)  # 671B on a 25 GB host
