"""The serving benchmark's speculative-decoding section: counters scraped from /metrics."""

from __future__ import annotations

from moeserve.bench.metrics import compute_metrics
from moeserve.bench.spec_decode import summarize
from moeserve.bench.table import format_table
from tests.unit.bench.test_metrics import DURATION, RECORDS


def test_summary_of_the_run():
    before = {"num_drafts": 5.0, "num_draft_tokens": 10.0, "num_accepted_tokens": 4.0}
    after = {"num_drafts": 25.0, "num_draft_tokens": 70.0, "num_accepted_tokens": 34.0}
    s = summarize(before, after)
    assert s["num_drafts"] == 20 and s["num_draft_tokens"] == 60
    assert s["acceptance_rate"] == 0.5 and s["acceptance_length"] == 2.5
    assert summarize(None, None) is None
    assert summarize(after, after) is None  # no drafts during the run


def test_table_section_only_with_speculation():
    spec = summarize(None, {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6})
    meta = {"spec_decode": spec}
    lines = format_table(compute_metrics(RECORDS, DURATION, None, meta)).splitlines()
    assert "---------------Speculative Decoding---------------" in lines
    assert "Acceptance length:                       2.50" in lines
    assert "Acceptance rate (%):                     75.00" in lines
    assert lines[-1] == "=" * 50
    assert "Speculative" not in format_table(compute_metrics(RECORDS, DURATION))
