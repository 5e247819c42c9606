"""The command line's prefill/decode disaggregation parts: ``serve``'s disaggregation flags
and the ``router`` command (``docs/disaggregation.md``)."""

from __future__ import annotations

import argparse
import logging


def disaggregation_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's disaggregation fields from serve's flags. The bootstrap socket and the
    transfer engine listen where the HTTP server does; a wildcard --host needs
    --disaggregation-host (the address the other instances reach this one at)."""
    host = args.disaggregation_host or args.host
    if args.disaggregation_mode != "null" and host in ("0.0.0.0", "::", ""):
        raise ValueError(
            f"--host {args.host} is no address the other instances can reach: set "
            "--disaggregation-host to this host's address"
        )
    return {
        "disaggregation_mode": args.disaggregation_mode,
        "disaggregation_bootstrap_port": args.disaggregation_bootstrap_port,
        "disaggregation_host": host,
        "disaggregation_ib_device": args.disaggregation_ib_device,
        "disaggregation_transfer_timeout_s": args.disaggregation_transfer_timeout,
    }


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disaggregation-mode",
        default="null",
        choices=("null", "prefill", "decode"),
        help="prefill/decode disaggregation role behind `moeserve router` (null: colocated)",
    )
    p.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="prefill: the port decode instances reach this one's bootstrap socket at",
    )
    p.add_argument(
        "--disaggregation-transfer-timeout",
        type=float,
        default=30.0,
        help="seconds a KV transfer (or the wait for the other side) may take before the "
        "request fails with 503",
    )
    p.add_argument(
        "--disaggregation-ib-device",
        default=None,
        help="RDMA device for the Mooncake transfer engine (e.g. mlx5_0); default: TCP",
    )
    p.add_argument(
        "--disaggregation-host",
        default=None,
        help="the address other instances reach this one at (default: --host)",
    )


def cmd_router(args: argparse.Namespace) -> int:
    from moeserve.serving.auto_pd_policy import AutoPDOptions
    from moeserve.serving.router import RouterOptions, run_router

    logging.getLogger("moeserve").setLevel(args.log_level.upper())
    auto_pd = None
    if args.auto_pd:
        auto_pd = AutoPDOptions(
            ttft_ms=args.auto_pd_ttft_ms,
            tpot_ms=args.auto_pd_tpot_ms,
            target=args.auto_pd_target,
            queue_high=args.auto_pd_queue_high,
            interval_s=args.auto_pd_interval,
            window_s=args.auto_pd_window,
            sustain_s=args.auto_pd_sustain,
            cooldown_s=args.auto_pd_cooldown,
            min_samples=args.auto_pd_min_samples,
            min_per_role=args.auto_pd_min_per_role,
            drain_timeout_s=args.auto_pd_drain_timeout,
        )
    options = RouterOptions(
        prefill_urls=tuple(args.prefill or ()),
        decode_urls=tuple(args.decode or ()),
        port=args.port,
        host=args.host,
        prometheus_port=args.prometheus_port,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        request_timeout_s=args.request_timeout,
        wait_timeout_s=args.wait_timeout,
        log_level=args.log_level,
        extra_args=tuple(args.router_args),
        auto_pd=auto_pd,
    )
    return run_router(options)


def add_router_parser(sub) -> None:
    from moeserve.serving.router import LOG_LEVELS, POLICIES

    r = sub.add_parser(
        "router",
        help="run sglang-router in front of prefill and decode instances (PD disaggregation)",
        description="Wait for each instance's /server_info, check its --disaggregation-mode, "
        "then run sglang-router --pd-disaggregation in front of them until a signal. "
        "Arguments after -- go to sglang-router as they are (they override ours).",
    )
    r.add_argument("--prefill", nargs="+", action="extend", metavar="URL", required=True)
    r.add_argument("--decode", nargs="+", action="extend", metavar="URL", required=True)
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    r.add_argument("--port", type=int, required=True)
    r.add_argument(
        "--prometheus-port", type=int, default=None, help="metrics port (default: --port + 1)"
    )
    r.add_argument("--policy", choices=POLICIES, default=None, help="both roles' policy")
    r.add_argument(
        "--prefill-policy", choices=POLICIES, default=None, help="(default: cache_aware)"
    )
    r.add_argument(
        "--decode-policy",
        choices=POLICIES,
        default=None,
        help="(default: power_of_two, round_robin for a single decode instance)",
    )
    r.add_argument(
        "--request-timeout", type=int, default=1800, metavar="S", help="seconds per request"
    )
    r.add_argument(
        "--wait-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait for every instance's /server_info (default: 600)",
    )
    r.add_argument("--log-level", default="info", choices=tuple(LOG_LEVELS))
    _add_auto_pd_args(r)
    r.add_argument("router_args", nargs="*", metavar="-- EXTRA", help="passed to sglang-router")
    r.set_defaults(func=cmd_router)


def _add_auto_pd_args(r: argparse.ArgumentParser) -> None:
    from moeserve.serving.auto_pd_policy import AutoPDOptions

    d = AutoPDOptions()
    g = r.add_argument_group(
        "adaptive P/D", "move instances between the roles as the load changes (auto_pd.py)"
    )
    a = g.add_argument
    a("--auto-pd", action="store_true", help="switch instances' roles when one role is short")
    a("--auto-pd-ttft-ms", type=float, default=d.ttft_ms, help="the TTFT target (ms)")
    a("--auto-pd-tpot-ms", type=float, default=d.tpot_ms, help="the inter-token target (ms)")
    a(
        "--auto-pd-target",
        type=float,
        default=d.target,
        help="the fraction of observations that must meet each target",
    )
    a(
        "--auto-pd-queue-high",
        type=float,
        default=d.queue_high,
        help="queued requests per instance that make a role short by themselves",
    )
    a("--auto-pd-interval", type=float, default=d.interval_s, metavar="S", help="between looks")
    a("--auto-pd-window", type=float, default=d.window_s, metavar="S", help="signals' window")
    a(
        "--auto-pd-sustain",
        type=float,
        default=d.sustain_s,
        metavar="S",
        help="how long a role must stay short before an instance moves",
    )
    a(
        "--auto-pd-cooldown",
        type=float,
        default=d.cooldown_s,
        metavar="S",
        help="the least time between two switches",
    )
    a("--auto-pd-min-samples", type=int, default=d.min_samples, help="per SLO verdict")
    a("--auto-pd-min-per-role", type=int, default=d.min_per_role, help="instances kept per role")
    a(
        "--auto-pd-drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        metavar="S",
        help="how long a switching instance may take to finish its requests",
    )
