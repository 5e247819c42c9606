"""``moeserve plan ... --availability [--tolerate-failures K]``: the cost of a rank or node loss
and the uptime of each ranked layout (``availability``). Without any of these flags the plan's
output is left as it was.

    moeserve plan --model deepseek-v3 --hardware h800 \\
        --layout dp=16,ep=1,redundant=32,tbo=1,nodes=2 --availability --tolerate-failures 1
"""

from __future__ import annotations

import argparse
import dataclasses

from moeserve.planner.availability import (
    UNITS,
    Availability,
    FailureModel,
    Redundancy,
    availability,
    redundancy_needed,
)
from moeserve.planner.hardware import HardwareProfile
from moeserve.planner.model_spec import ModelSpec
from moeserve.planner.search import Plan, Workload

FM_FLAGS = {  # FailureModel fields set by a flag of the same name
    "node_mtbf_hours": "mean hours between failures of one node",
    "checkpoint_read_gbs": "GB/s one node reads the checkpoint at",
    "restart_s": "seconds of a full restart (default: fixed part + weights read)",
    "rejoin_s": "seconds until a lost rank or node is replaced (default: restart s)",
}

PlanAvailability = tuple[Availability | None, Redundancy | None]


def add_availability_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("availability under rank loss (elastic EP; docs/scaling.md)")
    a.add_argument(
        "--availability", action="store_true", help="add the cost of a loss and the uptime"
    )
    fm = FailureModel()
    for dest, help_ in FM_FLAGS.items():
        default = getattr(fm, dest)
        a.add_argument(
            "--" + dest.replace("_", "-"),
            type=float,
            default=None,
            metavar="X",
            help=help_ + (f" (default {default:g})" if default is not None else ""),
        )
    a.add_argument(
        "--tolerate-failures",
        type=int,
        default=None,
        metavar="K",
        help="report the redundant experts K losses of --failure-unit need",
    )
    a.add_argument("--failure-unit", choices=UNITS, default="rank")


def failure_model_from_args(args: argparse.Namespace) -> FailureModel | None:
    """None when no availability flag was given (the output stays as it was). Raises
    ValueError for the flags with ``--sweep-nodes`` or ``--pd-instances``, or a bad value."""
    given = {d: getattr(args, d) for d in FM_FLAGS if getattr(args, d) is not None}
    if not (args.availability or given or args.tolerate_failures is not None):
        return None
    if args.sweep_nodes or args.pd_instances is not None:
        raise ValueError(
            "availability flags work on the ranked layouts, not with "
            "--sweep-nodes or --pd-instances"
        )
    if args.tolerate_failures is not None and args.tolerate_failures < 1:
        raise ValueError(f"--tolerate-failures must be >= 1, got {args.tolerate_failures}")
    return dataclasses.replace(FailureModel(), **given)


def plan_availability(
    args: argparse.Namespace,
    spec: ModelSpec,
    hw: HardwareProfile,
    p: Plan,
    w: Workload,
    fm: FailureModel,
) -> PlanAvailability:
    """(availability, redundancy for ``--tolerate-failures``) of a plan, with its decode batch
    in flight in every replica; (None, None) for a plan that cannot serve."""
    if not p.ok:
        return None, None
    a = availability(spec, hw, p.layout, w, p.decode.batch * p.layout.dp, fm)
    if not args.tolerate_failures or a.elastic_reason:
        return a, None
    k, unit = args.tolerate_failures, args.failure_unit
    return a, redundancy_needed(spec, hw, p.layout, k, unit, w, p.decode.memory)


def add_availability_json(out: dict, fm: FailureModel, avail: list[PlanAvailability]) -> None:
    """Adds ``availability`` and ``redundancy`` to each of ``out["plans"]`` (in the order of
    ``avail``) and the failure model with its sources to ``out``."""
    for entry, (a, red) in zip(out["plans"], avail):
        entry["availability"] = a.as_dict() if a else None
        entry["redundancy"] = red.as_dict() if red else None
    out["failure_model"] = {**dataclasses.asdict(fm), "sources": fm.SOURCES}


def print_availability(fm: FailureModel, avail: list[PlanAvailability]) -> None:
    per = f"/{fm.period_days:g}d"
    rejoin = "as a restart" if fm.rejoin_s is None else f"{fm.rejoin_s:g} s"
    print(
        f"\navailability: node MTBF {fm.node_mtbf_hours:g} h, {100 * fm.rank_fault_fraction:.0f}%"
        f" of failures one rank, detect {fm.detect_s:.2f} s, checkpoint "
        f"{fm.checkpoint_read_gbs:g} GB/s, rejoin {rejoin} (docs/scaling.md)"
    )
    print(
        f"{'#':>2}  {'restart s':>9}{'fails' + per:>10}{'down s' + per:>11}{'degraded %':>11}"
        f"{'capacity %':>11}  loss: missing mean/worst, reload GB, recompute s, recovery s"
    )
    for i, (a, red) in enumerate(avail, 1):
        if a is None:
            print(f"{i:>2}  cannot serve")
            continue
        losses = [c for c in (a.rank_loss, a.node_loss) if c]
        text = "; ".join(
            f"{c.unit} {c.missing_experts_mean:.1f}/{c.missing_experts_worst}, "
            f"{c.reload_bytes_mean / 1e9:.1f}, {c.recompute_s:.2f}, "
            + (f"{c.recovery_s:.1f}" if c.survives else f"restart ({c.reason})")
            for c in losses
        )
        print(
            f"{i:>2}  {a.restart_s:>9.0f}{a.failures_per_period:>10.3f}"
            f"{a.down_s_per_period:>11.1f}{100 * a.degraded_fraction:>11.4f}"
            f"{100 * a.capacity_fraction:>11.4f}  {text or 'restart: ' + a.elastic_reason}"
        )
        if red:
            print(f"    {red.describe()}")
