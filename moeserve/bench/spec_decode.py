"""Speculative-decoding counters of a benchmark run, from the server's ``/metrics``
(``moeserve:spec_decode_*``) scraped before and after the timed requests."""

from __future__ import annotations

import httpx

_COUNTERS = {
    "moeserve:spec_decode_num_drafts_total": "num_drafts",
    "moeserve:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "moeserve:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
}


async def scrape_counters(client: httpx.AsyncClient, root: str) -> dict[str, float] | None:
    """The counters now, or None when the server exports none (no speculation, no
    /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(root + "/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name in _COUNTERS:
                out[_COUNTERS[s.name]] = out.get(_COUNTERS[s.name], 0.0) + s.value
    return out or None


def summarize(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """What the run added: drafts, draft and accepted tokens, acceptance rate and mean
    acceptance length (tokens per verifying sequence-step, accepted drafts + 1)."""
    if not after:
        return None
    d = {k: after.get(k, 0.0) - (before or {}).get(k, 0.0) for k in _COUNTERS.values()}
    if d["num_drafts"] <= 0:
        return None
    return {
        "num_drafts": int(d["num_drafts"]),
        "num_draft_tokens": int(d["num_draft_tokens"]),
        "num_accepted_tokens": int(d["num_accepted_tokens"]),
        "acceptance_rate": d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
        "acceptance_length": 1.0 + d["num_accepted_tokens"] / d["num_drafts"],
    }
