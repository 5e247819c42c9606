"""A one-page figure of a benchmark result: latency histograms and throughput over time.

matplotlib is imported only when a plot is asked for, and only its object-oriented API with the
Agg canvas is used, so no display and no pyplot global state are touched.
"""

from __future__ import annotations

from pathlib import Path

from moeserve.bench.metrics import BenchmarkResult

BINS = 40


def _latencies_ms(result: BenchmarkResult) -> dict[str, list[float]]:
    ok = [r for r in result.records if r.success]
    return {
        "TTFT": [r.ttft * 1000 for r in ok],
        "TPOT": [t * 1000 for r in ok if (t := r.tpot) is not None],
        "ITL": [g * 1000 for r in ok for g in r.itl],
        "E2E latency": [r.e2e * 1000 for r in ok],
    }


def save_plot(result: BenchmarkResult, path: str | Path) -> Path:
    """Save histograms of TTFT/TPOT/ITL/E2E, their CDFs, and output tok/s with requests in
    flight per second, to ``path`` (format from its suffix, e.g. ``.png``). Returns the path."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    samples = _latencies_ms(result)
    for ax, (name, values) in zip(axes.flat[:4], samples.items()):
        if values:
            ax.hist(values, bins=BINS, color="tab:blue", alpha=0.8)
            ax.axvline(float(np.median(values)), color="k", ls="--", lw=1, label="median")
            ax.axvline(float(np.percentile(values, 99)), color="r", ls=":", lw=1, label="p99")
            ax.legend(fontsize=8)
        ax.set_title(f"{name} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")

    ax = axes.flat[4]
    for name, values in samples.items():
        if values:
            x = np.sort(values)
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=name)
    ax.set_xscale("log")
    ax.set_title("latency CDFs")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    if any(samples.values()):
        ax.legend(fontsize=8)

    ax = axes.flat[5]
    edges = np.arange(len(result.output_throughput_per_s) + 1)
    ax.stairs(result.output_throughput_per_s, edges, color="tab:green", lw=1.5)
    ax.set_ylim(bottom=0)
    ax.set_title("output throughput and requests in flight (1 s bins)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s", color="tab:green")
    twin = ax.twinx()
    twin.stairs(result.requests_in_flight_per_s, edges, color="tab:orange", lw=1.5)
    twin.set_ylim(bottom=0, top=max(result.requests_in_flight_per_s, default=0) * 1.1 + 1)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    twin.set_ylabel("peak requests in flight", color="tab:orange")

    model = result.config.get("model_id", "")
    rate = result.config.get("request_rate", "")
    conc = result.config.get("max_concurrency")
    fig.suptitle(
        f"{model}  rate={rate}  max_concurrency={conc}  "
        f"completed={result.completed} failed={result.failed}  "
        f"{result.output_throughput:.1f} output tok/s"
    )
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out
