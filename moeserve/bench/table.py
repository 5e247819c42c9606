"""The result table, in the layout of ``vllm bench serve`` (so scripts that grep it keep working).

Labels are left-aligned in 40 columns, integers as they are and floats with two decimals;
headers are centred in 50 columns between ``=`` (title) or ``-`` (sections).
"""

from __future__ import annotations

from moeserve.bench.metrics import BenchmarkResult, LatencyStats

WIDTH = 50
SECTIONS = (  # (attribute, section title, short name)
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def _row(label: str, value: int | float) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}".rstrip()
    return f"{label:<40} {value:<10}".rstrip()


def _latency_rows(short: str, stats: LatencyStats) -> list[str]:
    return [
        _row(f"Mean {short} (ms):", stats.mean),
        _row(f"Median {short} (ms):", stats.median),
        _row(f"P99 {short} (ms):", stats.p99),
    ]


def format_table(result: BenchmarkResult) -> str:
    """The multi-line table for ``result`` (no trailing newline)."""
    max_concurrency = result.config.get("max_concurrency")
    lines = [
        f"{' Serving Benchmark Result ':=^{WIDTH}}",
        _row("Successful requests:", result.completed),
        _row("Failed requests:", result.failed),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines += [
        _row("Benchmark duration (s):", result.duration),
        _row("Total input tokens:", result.total_input_tokens),
        _row("Total generated tokens:", result.total_output_tokens),
        _row("Request throughput (req/s):", result.request_throughput),
    ]
    if result.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", result.request_goodput))
    lines += [
        _row("Output token throughput (tok/s):", result.output_throughput),
        _row("Peak output token throughput (tok/s):", result.max_output_tokens_per_s),
        _row("Peak concurrent requests:", result.max_concurrent_requests),
        _row("Total Token throughput (tok/s):", result.total_token_throughput),
    ]
    for attr, title, short in SECTIONS:
        lines.append(f"{title:-^{WIDTH}}")
        lines += _latency_rows(short, getattr(result, attr))
    spec = result.config.get("spec_decode")
    if spec:  # scraped from the server's /metrics (bench/spec_decode.py)
        lines.append(f"{'Speculative Decoding':-^{WIDTH}}")
        lines += [
            _row("Acceptance rate (%):", 100.0 * spec["acceptance_rate"]),
            _row("Acceptance length:", spec["acceptance_length"]),
            _row("Drafts:", spec["num_drafts"]),
            _row("Draft tokens:", spec["num_draft_tokens"]),
            _row("Accepted tokens:", spec["num_accepted_tokens"]),
        ]
    lines.append("=" * WIDTH)
    return "\n".join(lines)
