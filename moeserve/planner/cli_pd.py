"""``moeserve plan --pd-instances N --phase IN:OUT:RATE:SECONDS ...``: the best fixed
prefill:decode split of N instances for a phased workload (``pd_ratio``).

    moeserve plan --model DIR --hardware this-machine --pd-instances 3 --pd-colocated 3 \\
        --phase 1024:4:0.2:120 --phase 64:128:0.3:120 --ttft-ms 15000 --tpot-ms 600 [--json]
"""

from __future__ import annotations

import argparse
import json

from moeserve.planner.hardware import HardwareProfile
from moeserve.planner.layout import Layout
from moeserve.planner.model_spec import ModelSpec
from moeserve.planner.pd_ratio import Fleet, PDPrediction, Phase, predict_splits

PD_MAX_DECODE_BATCH = 64  # the engine's default max_num_seqs (moeserve/config.py)


def add_pd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill:decode split (with --pd-instances)")
    g.add_argument(
        "--pd-instances",
        type=int,
        default=None,
        help="predict the best fixed prefill:decode split of N instances of --layout "
        "(default: one rank each) for the --phase workload",
    )
    g.add_argument(
        "--phase",
        action="append",
        default=None,
        metavar="IN:OUT:RATE:SECONDS[:TTFT_MS[:TPOT_MS]]",
        help="a phase of the workload: prompt and output tokens, requests/s, duration; its "
        "targets (default: --ttft-ms, --tpot-ms); repeat for phases in order",
    )
    g.add_argument(
        "--pd-colocated",
        type=int,
        default=1,
        help="instances that share each node (all N on one host: N)",
    )


def parse_phase(text: str, ttft_ms: float | None, tpot_ms: float | None) -> Phase:
    """``'1024:4:0.2:120[:15000[:600]]'`` -> :class:`Phase` (targets default to the given)."""
    parts = text.split(":")
    if not 4 <= len(parts) <= 6:
        raise ValueError(f"--phase {text!r}: expected IN:OUT:RATE:SECONDS[:TTFT_MS[:TPOT_MS]]")
    names = ("input_len", "output_len", "rate", "duration_s", "ttft_ms", "tpot_ms")
    vals: dict = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}
    for name, v in zip(names, parts):
        integer = name in ("input_len", "output_len")
        try:
            vals[name] = int(v) if integer else float(v)
        except ValueError:
            what = "an integer" if integer else "a number"
            raise ValueError(f"--phase {text!r}: {name} must be {what}, got {v!r}") from None
    try:
        return Phase(**vals)
    except ValueError as e:
        raise ValueError(f"--phase {text!r}: {e}") from None


def run_pd(
    args: argparse.Namespace, spec: ModelSpec, hw: HardwareProfile, layout: Layout | None
) -> int:
    if not args.phase:
        raise ValueError("--pd-instances needs at least one --phase IN:OUT:RATE:SECONDS")
    phases = [parse_phase(t, args.ttft_ms, args.tpot_ms) for t in args.phase]
    batch = PD_MAX_DECODE_BATCH if args.max_decode_batch is None else args.max_decode_batch
    fleet = Fleet(layout or Layout(), args.pd_instances, args.pd_colocated, batch, args.imbalance)
    pred = predict_splits(spec, hw, fleet, phases)
    if args.json:
        print(json.dumps({"model": spec.name, "hardware": hw.name, **pred.as_dict()}, indent=1))
    else:
        print_prediction(spec.name, hw.name, pred)
    return 0


def print_prediction(model: str, hw: str, pred: PDPrediction) -> None:
    f = pred.fleet
    print(
        f"{model}: {f.instances} instances of {f.layout.describe()} on {hw}, "
        f"{f.colocated} per node, decode batch <= {f.max_decode_batch}"
    )
    for i, ph in enumerate((r.phase for r in pred.splits[0].phases), 1):
        slo = [f"{k} <= {v:g} ms" for k, v in (("TTFT", ph.ttft_ms), ("TPOT", ph.tpot_ms)) if v]
        print(f"phase {i}: {_phase(ph)}, targets: {', '.join(slo) or 'none'}")
    head = (
        f"  {'phase':<26}{'pre util':>9}{'dec util':>9}{'dec bs':>7}{'prefill ms':>11}"
        f"{'TTFT ms':>10}{'TPOT ms':>9}{'backlog s':>10}{'goodput/s':>10}"
    )
    print("util: utilisation ('!': >= 1, that side falls behind); backlog: seconds of work left")
    print("queued per instance at the phase's end; goodput: requests/s meeting the targets")
    for s in pred.splits:
        print(f"\nP:D {s.prefill}:{s.decode}: goodput {s.goodput:.3f} req/s")
        print(head)
        for r in s.phases:
            backlog = max(r.prefill_backlog_s, r.decode_backlog_s)
            print(
                f"  {_phase(r.phase):<26}{_util(r.prefill_util):>9}{_util(r.decode_util):>9}"
                f"{r.decode_batch:>7.1f}{r.prefill_s * 1e3:>11.0f}{r.ttft_s * 1e3:>10.0f}"
                f"{r.tpot_s * 1e3:>9.0f}{backlog:>10.1f}{r.goodput:>10.3f}"
            )
    b = pred.best
    print(f"\nbest: P:D {b.prefill}:{b.decode}, {b.goodput:.3f} good requests/s")


def _phase(ph: Phase) -> str:
    return f"{ph.input_len}/{ph.output_len} @{ph.rate:g}/s {ph.duration_s:g}s"


def _util(u: float) -> str:
    return f"{u:.2f}" + ("" if u < 1 else "!")
