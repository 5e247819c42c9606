"""Two commits' offline throughput, alternating in one run: is a change free of cost?

Each commit is checked out once into a temporary git worktree, and every round runs each
commit's own ``benchmarks/offline_throughput.py`` (moeserve only) once per weight format,
the commits' order swapped from one round to the next, so the host's drifting memory
bandwidth hits both alike. The table gives each case's best tok/s per commit and the median
over the rounds of new / old.

    python benchmarks/commit_ab.py --old REV [--new HEAD] [--formats fp32,int8,w8a8_int8,bf16]
                                   [--batches 1,32] [--prefill 512] [--rounds 2] [--threads 2]
                                   [--out bench_out/commit_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str, parent: Path) -> tuple[str, Path]:
    """``(commit hash, worktree)`` of ``rev``, checked out under ``parent``."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = parent / sha[:12]
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), sha], check=True
    )
    return sha, tree


def run_once(tree: Path, fmt: str, args, out: Path) -> dict[str, float]:
    """``{case: tok/s}`` of one offline_throughput run of ``tree`` on format ``fmt``."""
    cmd = [
        sys.executable,
        str(tree / "benchmarks" / "offline_throughput.py"),
        "--skip-hf",
        "--formats", fmt,
        "--batches", args.batches,
        "--prefill", args.prefill,
        "--threads", str(args.threads),
        "--out", str(out),
        "--plot", "",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(cmd, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return {r["case"]: r["tokens_per_s"] for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the commit to compare against")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--formats", default="fp32,int8,w8a8_int8,bf16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prefill", default="512")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench_out/commit_ab.json")
    args = ap.parse_args()
    formats = args.formats.split(",")
    runs: dict[tuple[str, str, str], list[float]] = {}  # (format, case, "old"|"new") -> tok/s
    with tempfile.TemporaryDirectory(prefix="commit-ab-") as tmp:
        parent = Path(tmp)
        trees = {
            name: checkout(rev, parent) for name, rev in (("old", args.old), ("new", args.new))
        }
        try:
            for r in range(args.rounds):
                for fmt in formats:
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    for name in order:
                        got = run_once(trees[name][1], fmt, args, parent / "run.json")
                        for case, tps in got.items():
                            runs.setdefault((fmt, case, name), []).append(tps)
                        print(f"round {r + 1} {fmt:<10} {name}: {got}", flush=True)
        finally:
            for _, tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
    rows = []
    for fmt, case, _ in sorted({(f, c, "") for f, c, _ in runs}):
        old, new = runs[(fmt, case, "old")], runs[(fmt, case, "new")]
        ratios = [b / a for a, b in zip(old, new)]
        rows.append(
            dict(format=fmt, case=case, old=old, new=new, median_ratio=statistics.median(ratios))
        )
    print(
        f"\n{trees['old'][0][:10]} (old) against {trees['new'][0][:10]} (new), {args.rounds} "
        f"rounds alternating, {args.threads} threads, {platform.processor() or platform.machine()}"
    )
    print(f"{'format':<11}{'case':<14}{'old tok/s':>12}{'new tok/s':>12}{'new/old':>10}  rounds")
    for row in rows:
        per = " ".join(f"{b / a:.3f}" for a, b in zip(row["old"], row["new"]))
        print(
            f"{row['format']:<11}{row['case']:<14}{max(row['old']):>12.1f}"
            f"{max(row['new']):>12.1f}{row['median_ratio']:>10.3f}  {per}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(old=trees["old"][0], new=trees["new"][0], threads=args.threads, rows=rows)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
