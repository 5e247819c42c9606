"""One stats dict for an engine group, from every rank's ``LLMEngine.stats``."""

from __future__ import annotations


def merge_stats(per_rank: list[dict], dims) -> dict:
    """One stats dict from every rank's (in rank order): the fields of one replica's stats
    summed over replicas, plus ``replicas`` (each replica leader's own) and ``integrity``
    (when the ranks ran their self-check)."""
    leaders = [per_rank[dims.rank_of(d, dims.pp - 1, 0)] for d in range(dims.dp)]
    experts: dict[int, list[int]] = {}
    for st in per_rank:
        for layer, counts in st["expert_counts"].items():
            layer = int(layer)  # JSON keys are strings
            acc = experts.setdefault(layer, [0] * len(counts))
            for e, c in enumerate(counts):
                acc[e] += c
    failures = [
        f"rank {r}: {st['integrity']}"
        for r, st in enumerate(per_rank)
        if st.get("integrity", "ok") != "ok"
    ]
    summed = ("num_running", "num_waiting", "num_preemptions", "num_blocks", "num_free_blocks")
    summed += ("num_cached_blocks", "prefix_cache_queries", "prefix_cache_hits")
    out = {k: sum(st[k] for st in leaders) for k in summed}
    out["kv_cache_usage"] = 1.0 - out["num_free_blocks"] / max(1, out["num_blocks"])
    for k in ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps"):
        out[f"spec_decode_{k}"] = sum(st.get(f"spec_decode_{k}", 0) for st in leaders)
    out["num_parked"] = sum(st.get("num_parked", 0) for st in leaders)
    out["expert_counts"] = dict(sorted(experts.items()))
    out["eplb"] = merge_eplb([st.get("eplb") for st in per_rank])
    if all("integrity" in st for st in per_rank):
        out["integrity"] = failures[0] if failures else "ok"
    out["replicas"] = [
        {k: st[k] for k in ("num_running", "num_waiting", "kv_cache_usage")} for st in leaders
    ]
    return out


def merge_eplb(per_rank: list[dict | None]) -> dict | None:
    """The ranks' EPLB metrics as one: windows summed (each rank's are its own tokens), slot
    tables and last imbalances from any rank of the layer's stage (they agree)."""
    parts = [p for p in per_rank if p]
    if not parts:
        return None
    out = {**parts[0], "window": {}, "placement": {}, "last_rebalance": {}}
    for p in parts:
        for layer, counts in p["window"].items():
            acc = out["window"].setdefault(layer, [0] * len(counts))
            out["window"][layer] = [a + c for a, c in zip(acc, counts)]
        out["placement"].update(p["placement"])
        out["last_rebalance"].update(p["last_rebalance"])
        out["rebalances"] = max(out["rebalances"], p["rebalances"])
    return out
