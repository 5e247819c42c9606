"""``moeserve plan``: rank parallel layouts for a model on a cluster, sweep node counts, or
calibrate this machine.

    moeserve plan --model deepseek-v3 --hardware h800 --nodes 4 --input-len 2000 \\
        --output-len 500 [--ttft-ms 800 --tpot-ms 45] [--json] [--top 5]
    moeserve plan --model ... --hardware ... --sweep-nodes 16,64,256,1024,8192
    moeserve plan --model ... --hardware ... --pd-instances 3 --pd-colocated 3 \\
        --phase 1024:4:0.2:120 --phase 64:128:0.3:120 [--ttft-ms ... --tpot-ms ...]
    moeserve plan calibrate [--out FILE] [--threads N] [--refit EARLIER_PROFILE]
    moeserve plan ... --availability [--node-mtbf-hours H] [--tolerate-failures K]
"""

from __future__ import annotations

import argparse
import json
import sys

from moeserve.planner.cli_availability import (
    add_availability_args,
    add_availability_json,
    failure_model_from_args,
    plan_availability,
    print_availability,
)
from moeserve.planner.cli_pd import add_pd_args, run_pd
from moeserve.planner.hardware import ProfileError, builtin_profiles, load_profile
from moeserve.planner.layout import Layout
from moeserve.planner.model_spec import ModelSpecError, builtin_models, load_model_spec
from moeserve.planner.search import Plan, Workload, rank_layouts, sweep


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """Register ``plan`` (and ``plan calibrate``) on the CLI's subparsers."""
    p = sub.add_parser(
        "plan",
        help="predict step times and choose a parallel layout (no torch needed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help=f"config.json, a HF model directory, or one of: {', '.join(builtin_models())}",
    )
    p.add_argument(
        "--hardware",
        help=f"profile YAML, or one of: {', '.join(builtin_profiles())}",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster")
    p.add_argument("--input-len", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=500)
    p.add_argument("--ttft-ms", type=float, default=None, help="TTFT target")
    p.add_argument("--tpot-ms", type=float, default=None, help="TPOT target")
    p.add_argument(
        "--sweep-nodes", default=None, help="comma-separated node counts: scaling efficiency"
    )
    p.add_argument("--top", type=int, default=5, help="layouts to print")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--mtp-acceptance", type=float, default=0.8, help="probability a draft is accepted"
    )
    p.add_argument(
        "--imbalance", type=float, default=1.0, help="expert load max/mean beyond uniform noise"
    )
    p.add_argument("--weight-dtype", default=None, help="override the profile's")
    p.add_argument("--kv-dtype", default=None, help="override the profile's")
    p.add_argument(
        "--max-decode-batch",
        type=int,
        default=None,
        help="per DP rank (default 1024; with --pd-instances 64, the engine's max_num_seqs)",
    )
    p.add_argument(
        "--instance-nodes",
        default=None,
        help="comma-separated instance sizes in nodes (default: every divisor of --nodes; "
        "the cluster runs nodes/size copies)",
    )
    p.add_argument(
        "--layout",
        default=None,
        help="evaluate one layout only, e.g. 'dp=72,ep=1,redundant=32,tbo=1,nodes=9' "
        "(keys: tp dp pp ep redundant tbo mtp nodes; ep=1 turns expert parallelism on)",
    )
    p.add_argument(
        "--plot", default=None, help="with --sweep-nodes: write a PNG of the sweep (matplotlib)"
    )
    add_pd_args(p)
    add_availability_args(p)
    p.set_defaults(func=run_plan)
    cal_sub = p.add_subparsers(dest="plan_command")
    c = cal_sub.add_parser("calibrate", help="measure this machine, write a profile YAML")
    c.add_argument("--out", default="this-machine.yaml", help="profile file to write")
    c.add_argument("--threads", type=int, default=None, help="default: every usable CPU")
    c.add_argument(
        "--refit",
        default=None,
        metavar="PROFILE",
        help="no measuring: fit an earlier calibration's raw measurements again",
    )
    c.set_defaults(func=run_calibrate)
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return vals


def run_plan(args: argparse.Namespace) -> int:
    if not args.model or not args.hardware:
        raise ValueError("moeserve plan needs --model and --hardware (or: plan calibrate)")
    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    fm = failure_model_from_args(args)
    try:
        spec = load_model_spec(args.model)
        hw = load_profile(args.hardware)
    except (ProfileError, ModelSpecError) as e:
        raise ValueError(str(e)) from None
    if args.pd_instances is not None:
        lay = parse_layout(args.layout, args.mtp_acceptance) if args.layout else None
        return run_pd(args, spec, hw, lay)
    w = Workload(
        args.input_len,
        args.output_len,
        args.ttft_ms,
        args.tpot_ms,
        imbalance=args.imbalance,
        max_decode_batch=1024 if args.max_decode_batch is None else args.max_decode_batch,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
    )
    enum_kw = dict(mtp_acceptance=args.mtp_acceptance)
    if args.sweep_nodes:
        points = sweep(spec, hw, _ints(args.sweep_nodes, "--sweep-nodes"), w, **enum_kw)
        if args.plot:
            from moeserve.planner.plot import plot_sweeps

            label = f"{spec.name} on {hw.name}"
            print(f"wrote {plot_sweeps([(label, points)], args.plot, label)}", file=sys.stderr)
        if args.json:
            print(json.dumps([_sweep_json(p, w) for p in points], indent=1))
        else:
            _print_sweep(spec.name, hw.name, points, w)
        return 0
    inst = _ints(args.instance_nodes, "--instance-nodes") if args.instance_nodes else None
    if inst and any(args.nodes % n for n in inst):
        raise ValueError(f"--instance-nodes {inst} must divide --nodes {args.nodes}")
    fixed = [parse_layout(args.layout, args.mtp_acceptance)] if args.layout else None
    if fixed:
        args.nodes = fixed[0].nodes
    plans = rank_layouts(spec, hw, args.nodes, w, layouts=fixed, instance_nodes=inst, **enum_kw)
    avail = [plan_availability(args, spec, hw, p, w, fm) for p in plans[: args.top]] if fm else []
    if args.json:
        out = {
            "model": spec.name,
            "hardware": hw.name,
            "nodes": args.nodes,
            "workload": vars(w),
            "plans": [plan_json(p, w) for p in plans[: args.top]],
            "layouts_evaluated": len(plans),
            "layouts_serving": sum(p.ok for p in plans),
        }
        if fm:
            add_availability_json(out, fm, avail)
        print(json.dumps(out, indent=1))
        return 0
    _print_plans(spec.name, hw.name, args.nodes, plans, w, args.top)
    if fm:
        print_availability(fm, avail)
    return 0 if plans and plans[0].ok else 1


_LAYOUT_KEYS = {"tp", "dp", "pp", "ep", "redundant", "tbo", "mtp", "nodes"}


def parse_layout(text: str, mtp_acceptance: float) -> Layout:
    """``'tp=1,dp=72,ep=1,redundant=32,tbo=1,nodes=9'`` -> :class:`Layout`."""
    vals: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _LAYOUT_KEYS:
            raise ValueError(
                f"--layout: expected key=value with keys {sorted(_LAYOUT_KEYS)}, got {item!r}"
            )
        try:
            vals[key] = int(value)
        except ValueError:
            raise ValueError(f"--layout: {key} must be an integer, got {value!r}") from None
    mtp = vals.get("mtp", 0)
    return Layout(
        tp=vals.get("tp", 1),
        dp=vals.get("dp", 1),
        pp=vals.get("pp", 1),
        expert_parallel=bool(vals.get("ep", 0)),
        redundant_experts=vals.get("redundant", 0),
        two_batch_overlap=bool(vals.get("tbo", 0)),
        mtp_depth=mtp,
        mtp_acceptance=mtp_acceptance if mtp else 0.0,
        nodes=vals.get("nodes", 1),
    )


def run_calibrate(args: argparse.Namespace) -> int:
    from moeserve.planner.calibrate import build_profile, read_measurements, write_profile

    refit = read_measurements(args.refit) if args.refit else None
    raw = build_profile(
        args.threads, log=lambda m: print(m, file=sys.stderr, flush=True), refit=refit
    )
    path = write_profile(raw, args.out)
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------- output


def _phase_json(ph) -> dict | None:
    if ph is None:
        return None
    return {
        "batch": ph.batch,
        "latency_ms": ph.latency_s * 1e3,
        "step_ms": ph.step.time_s * 1e3,
        "tokens_per_s_instance": ph.tokens_per_s_instance,
        "breakdown_ms": {k: v * 1e3 for k, v in sorted(ph.step.breakdown.items())},
        "by_kind_ms": {k: v * 1e3 for k, v in ph.step.by_kind.items()},
        "memory": ph.memory.as_dict(),
    }


def plan_json(p: Plan, w: Workload) -> dict:
    lay = p.layout
    return {
        "layout": {
            "describe": lay.describe(),
            "tp": lay.tp,
            "dp": lay.dp,
            "pp": lay.pp,
            "ep": lay.ep,
            "expert_parallel": lay.expert_parallel,
            "redundant_experts": lay.redundant_experts,
            "two_batch_overlap": lay.two_batch_overlap,
            "mtp_depth": lay.mtp_depth,
            "mtp_acceptance": lay.mtp_acceptance,
            "nodes": lay.nodes,
            "world": lay.world,
        },
        "ok": p.ok,
        "reasons": list(p.reasons),
        "decode_tokens_per_s_node": p.decode_tps_node,
        "decode_tokens_per_s_chip": p.decode_tps_chip,
        "prefill_tokens_per_s_node": p.prefill_tps_node,
        "serving_output_tokens_per_s_node": p.serving_tps_node(w),
        "tpot_ms": p.decode.latency_s * 1e3 if p.decode else None,
        "ttft_ms": p.prefill.latency_s * 1e3 if p.prefill else None,
        "decode": _phase_json(p.decode),
        "prefill": _phase_json(p.prefill),
    }


def _sweep_json(pt, w: Workload) -> dict:
    return {
        "nodes": pt.nodes,
        "decode_tokens_per_s_node": pt.decode_tps_node,
        "serving_output_tokens_per_s_node": pt.serving_tps_node,
        "efficiency": pt.efficiency,
        "replicated_decode_tokens_per_s_node": pt.replicated_tps_node,
        "replicated_efficiency": pt.replicated_efficiency,
        "best": plan_json(pt.best, w) if pt.best else None,
    }


def _print_plans(model: str, hw: str, nodes: int, plans: list[Plan], w: Workload, top: int):
    slo = []
    if w.ttft_ms:
        slo.append(f"TTFT <= {w.ttft_ms:g} ms")
    if w.tpot_ms:
        slo.append(f"TPOT <= {w.tpot_ms:g} ms")
    print(
        f"{model} on {nodes} x {hw}, input {w.input_len}, output {w.output_len}"
        + (f", {', '.join(slo)}" if slo else "")
        + f": {sum(p.ok for p in plans)} of {len(plans)} layouts serve"
    )
    head = (
        f"{'#':>2}  {'layout':<44}{'dec bs':>7}{'TPOT ms':>9}{'dec tok/s/node':>15}"
        f"{'/chip':>8}{'pre bs':>7}{'TTFT ms':>9}{'pre tok/s/node':>15}{'out tok/s/node':>15}"
    )
    print(head)
    for i, p in enumerate(plans[:top], 1):
        if not p.ok:
            print(f"{i:>2}  {p.layout.describe():<44}  cannot serve: {'; '.join(p.reasons)}")
            continue
        print(
            f"{i:>2}  {p.layout.describe():<44}{p.decode.batch:>7}"
            f"{p.decode.latency_s * 1e3:>9.1f}{p.decode_tps_node:>15.0f}"
            f"{p.decode_tps_chip:>8.0f}{p.prefill.batch:>7}{p.prefill.latency_s * 1e3:>9.1f}"
            f"{p.prefill_tps_node:>15.0f}{p.serving_tps_node(w):>15.0f}"
        )
    if plans and plans[0].ok:
        best = plans[0]
        for name, ph in (("decode step", best.decode), ("prefill step", best.prefill)):
            mem = ph.memory
            print(
                f"\nbest: {name} {ph.step.time_s * 1e3:.2f} ms (batch {ph.batch} per DP rank); "
                f"memory per rank {mem.total / 1e9:.2f} of {mem.capacity / 1e9:.2f} GB "
                f"(weights {mem.weights / 1e9:.2f}, KV {mem.kv_cache / 1e9:.2f}, "
                f"activations {mem.activations / 1e9:.2f})"
            )
            items = sorted(ph.step.breakdown.items(), key=lambda kv: -abs(kv[1]))
            for k, v in items:
                if v:
                    print(f"    {k:<18}{v * 1e3:>10.3f} ms {100 * v / ph.step.time_s:>6.1f}%")


def _print_sweep(model: str, hw: str, points, w: Workload) -> None:
    print(
        f"{model} on {hw}: one instance over all the nodes; 'as copies': the best smaller "
        f"instance swept, repeated. Input {w.input_len}, output {w.output_len}"
    )
    print(
        f"{'nodes':>6}  {'layout':<46}{'dec bs':>7}{'TPOT ms':>9}{'dec tok/s/node':>15}"
        f"{'out tok/s/node':>15}{'efficiency':>11}{'as copies':>11}{'eff':>7}"
    )
    for pt in points:
        rep = f"{pt.replicated_tps_node:>11.0f}{100 * pt.replicated_efficiency:>6.0f}%"
        if pt.best is None:
            print(f"{pt.nodes:>6}  {'no single instance serves':<46}{'':>57}{rep}")
            continue
        b = pt.best
        print(
            f"{pt.nodes:>6}  {b.layout.describe():<46}{b.decode.batch:>7}"
            f"{b.decode.latency_s * 1e3:>9.1f}{pt.decode_tps_node:>15.0f}"
            f"{pt.serving_tps_node:>15.0f}{100 * pt.efficiency:>10.1f}%{rep}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run without the rest of the CLI: ``python -m moeserve.planner.cli ...``."""
    parser = argparse.ArgumentParser(prog="moeserve")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
