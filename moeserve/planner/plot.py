"""Plot a node sweep: predicted decode tokens/s per node and parallel efficiency against the
node count, one line per (model, hardware). matplotlib is imported here only."""

from __future__ import annotations

from pathlib import Path


def plot_sweeps(series: list[tuple[str, list]], path: str | Path, title: str = "") -> Path:
    """``series``: (label, [SweepPoint]) pairs. Writes a PNG with two panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, pts in series:
        ok = [p for p in pts if p.best is not None]
        xs = [p.nodes for p in ok]
        (line,) = ax1.plot(xs, [p.decode_tps_node for p in ok], "o-", label=label)
        rep = [p for p in pts if p.replicated_tps_node]
        ax1.plot(
            [p.nodes for p in rep],
            [p.replicated_tps_node for p in rep],
            "--",
            color=line.get_color(),
            alpha=0.6,
        )
        top = max((p.decode_tps_node for p in ok), default=0.0)
        if top:
            ax2.plot(xs, [100 * p.decode_tps_node / top for p in ok], "o-", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("decode tokens/s per node")
    ax2.set_ylabel("% of the best per-node tokens/s")
    ax2.set_ylim(0, 110)
    ax1.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m moeserve.planner.plot OUT.png MODEL:PROFILE[:TPOT_MS] ...``: sweep each
    (model, hardware) pair over 1..8192 nodes and draw them together."""
    import argparse

    from moeserve.planner.hardware import load_profile
    from moeserve.planner.model_spec import load_model_spec
    from moeserve.planner.search import Workload, sweep

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out")
    ap.add_argument("series", nargs="+", help="MODEL:PROFILE[:TPOT_MS]")
    ap.add_argument("--nodes", default=",".join(str(2**i) for i in range(14)))
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=500)
    args = ap.parse_args(argv)
    nodes = [int(n) for n in args.nodes.split(",")]
    series = []
    for item in args.series:
        model, hw, *rest = item.split(":")
        tpot = float(rest[0]) if rest else None
        w = Workload(args.input_len, args.output_len, tpot_ms=tpot)
        pts = sweep(load_model_spec(model), load_profile(hw), nodes, w)
        label = f"{model} on {hw}" + (f", TPOT <= {tpot:g} ms" if tpot else "")
        series.append((label, pts))
        for p in pts:
            print(
                f"{label}: {p.nodes} nodes {p.decode_tps_node:.0f} tok/s/node "
                f"eff {100 * p.efficiency:.0f}%"
            )
    title = (
        f"predicted decode throughput (input {args.input_len}, output {args.output_len}); "
        "solid: one instance over all the nodes, dashed: copies of the best smaller one"
    )
    print(f"wrote {plot_sweeps(series, args.out, title)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
