"""``moeserve`` command line: ``serve`` (the OpenAI-compatible server), ``generate`` (one
prompt, streamed to the terminal), ``router`` (sglang-router in front of prefill and decode
instances), ``bench serving`` and ``demo-model``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from moeserve.cli_pd import add_disaggregation_args, add_router_parser, disaggregation_kwargs
from moeserve.launch.lws import apply_lws
from moeserve.ops.formats import QUANTIZATIONS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (every command that builds an engine), in titled groups."""
    _add_model_args(p)
    _add_scheduling_args(p)
    _add_speculative_args(p)
    _add_parallel_args(p)
    _add_eplb_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and compute")
    g.add_argument("--model", help="Hugging Face model directory (default: the built-in demo)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="int8: weight-only int8 (per-output-channel scales), quantized at load from a "
        "bf16, fp32 or FP8 checkpoint; w8a8_int8: the same weights, and each GEMM rounds its "
        "input rows to int8 per token (AMX's int8 tiles where the CPU has them); int4: 4-bit "
        "weights with a scale per group of columns (--int4-group-size), about half of int8's "
        "bytes; w4a8_int8: int4's weights, each GEMM rounding its rows to int8 (AMX's int8 "
        "tiles); bf16: weights held in bf16 (the GEMMs run on AMX where the CPU has it); the "
        "tensors between ops stay fp32 under all of them (default: none)",
    )
    g.add_argument(
        "--int4-group-size",
        type=int,
        choices=(32, 64, 128),
        default=None,
        help="int4, w4a8_int8: columns sharing one scale (default 128; smaller: closer, more "
        "bytes)",
    )
    g.add_argument(
        "--int4-asymmetric",
        action="store_true",
        help="int4, w4a8_int8: a zero point per group too (min/max instead of max |w|), as AWQ "
        "and GPTQ",
    )
    g.add_argument("--no-mtp", action="store_true", help="do not load the MTP layers")
    g.add_argument("--threads", type=int, default=None, help="intra-op CPU threads per rank")


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling and KV cache")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="bound on queued sequences; the server answers 503 beyond it (default: none)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None)


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (MTP)")
    g.add_argument(
        "--speculative-num-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: draft K tokens per step with the MTP layer (0: off)",
    )
    g.add_argument(
        "--speculative-token-map",
        default=None,
        metavar="FILE",
        help="draft from these hot token ids only (.pt tensor, .json list or text of ids)",
    )


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (vLLM's meanings; ranks are spawned here)")
    g.add_argument("--tp", "--tensor-parallel-size", type=int, default=1, dest="tp")
    g.add_argument("--dp", "--data-parallel-size", type=int, default=None, dest="dp")
    g.add_argument("--pp", "--pipeline-parallel-size", type=int, default=1, dest="pp")
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over the tp x dp ranks of each stage",
    )
    g.add_argument(
        "--ep", type=int, default=None, help="shorthand for --dp N --enable-expert-parallel"
    )
    g.add_argument(
        "--ep-num-redundant-experts",
        "--num-redundant-experts",
        type=int,
        default=0,
        dest="num_redundant_experts",
        help="extra physical expert slots (E + R over the EP ranks) for copies of hot experts",
    )
    g.add_argument(
        "--no-moe-overlap",
        action="store_true",
        help="run the shared experts after the expert dispatch instead of during it",
    )
    g.add_argument("--two-batch-overlap", action="store_true")
    g.add_argument("--numa-bind", choices=("auto", "none"), default="auto")
    g.add_argument("--dist-timeout", type=float, default=120.0, help="seconds")
    g.add_argument(
        "--enable-elastic-ep",
        action="store_true",
        help="survive the loss of a rank other than rank 0: the others go on without it",
    )
    g.add_argument(
        "--elastic-rejoin",
        default=None,
        metavar="RANKS",
        help="with --enable-elastic-ep: start these launch ranks (comma-separated) to join the "
        "running group at --master-addr:--master-port in place of lost ones",
    )
    g.add_argument(
        "--elastic-ep-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --enable-elastic-ep: a silent rank is given up after this long",
    )
    g.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="hosts of a multi-host group (default 1; LWS_GROUP_SIZE under a LeaderWorkerSet)",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's index, 0 = the API's host (default 0; LWS_WORKER_INDEX under LWS)",
    )
    g.add_argument(
        "--master-addr",
        default=None,
        help="address of node rank 0, where the ranks meet (LWS_LEADER_ADDRESS under LWS)",
    )
    g.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="port there (MASTER_PORT, else 29500 under LWS)",
    )


def _add_eplb_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert-parallel load balancing (EPLB)")
    g.add_argument(
        "--enable-eplb",
        action="store_true",
        help="re-place the experts from measured load every --eplb-interval steps, live",
    )
    g.add_argument("--eplb-interval", type=int, default=1000, metavar="STEPS")
    g.add_argument(
        "--eplb-window", type=int, default=1000, metavar="STEPS", help="steps of statistics"
    )
    g.add_argument("--eplb-algorithm", choices=("auto", "hierarchical", "global"), default="auto")
    g.add_argument(
        "--eplb-layers-per-step",
        type=int,
        default=1,
        help="MoE layers whose weights move per engine step during a re-placement",
    )
    g.add_argument(
        "--expert-stats-out",
        metavar="FILE",
        default=None,
        help="write the expert-load window here at shutdown (.json or .safetensors)",
    )
    g.add_argument(
        "--init-expert-location",
        metavar="FILE",
        default=None,
        help="initial placement: a placement file, or raw stats to place from",
    )


def _ranks(text: str | None) -> tuple[int, ...]:
    """``--elastic-rejoin 2,3`` as launch ranks."""
    if not text:
        return ()
    try:
        return tuple(int(r) for r in text.split(","))
    except ValueError:
        raise ValueError(
            f"--elastic-rejoin takes launch ranks like 2 or 2,3, got {text!r}"
        ) from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the engine and parallel flags (shared by every command)."""
    dp, ep_on = args.dp, args.enable_expert_parallel
    if args.ep is not None:
        if dp is not None and dp != args.ep:
            raise ValueError(f"--ep {args.ep} means --dp {args.ep}; it conflicts with --dp {dp}")
        dp, ep_on = args.ep, True
    # a LeaderWorkerSet pod gets its place in the group from LWS's variables
    nnodes, node_rank, master_addr, master_port = apply_lws(
        os.environ, args.nnodes, args.node_rank, args.master_addr, args.master_port
    )
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise ValueError("--nnodes > 1 needs --master-addr and --master-port (node rank 0's)")
    return dict(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        int4_group_size=args.int4_group_size,
        int4_symmetric=not args.int4_asymmetric,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=args.max_waiting_requests,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        load_mtp=not args.no_mtp,
        speculative_num_tokens=args.speculative_num_tokens,
        speculative_token_map=args.speculative_token_map,
        num_threads=args.threads,
        tensor_parallel_size=args.tp,
        data_parallel_size=dp or 1,
        pipeline_parallel_size=args.pp,
        enable_expert_parallel=ep_on,
        num_redundant_experts=args.num_redundant_experts,
        enable_eplb=args.enable_eplb,
        eplb_interval=args.eplb_interval,
        eplb_window=args.eplb_window,
        eplb_algorithm=args.eplb_algorithm,
        eplb_layers_per_step=args.eplb_layers_per_step,
        expert_stats_out=args.expert_stats_out,
        init_expert_location=args.init_expert_location,
        moe_overlap=not args.no_moe_overlap,
        two_batch_overlap=args.two_batch_overlap,
        numa_bind=args.numa_bind,
        dist_timeout_s=args.dist_timeout,
        enable_elastic_ep=args.enable_elastic_ep,
        elastic_ep_timeout_s=args.elastic_ep_timeout,
        elastic_rejoin=_ranks(args.elastic_rejoin),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from moeserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args), progress=not args.quiet)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or (),
        ignore_eos=args.ignore_eos,
    )
    tok = llm.get_tokenizer()
    if args.chat:
        if tok is None:
            print("error: --chat needs a model with a tokenizer", file=sys.stderr)
            return 2
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = tok.encode(text, add_special_tokens=False)
    else:
        prompt = args.prompt
    try:
        if args.profile:
            from moeserve.profiling import profile_to

            with profile_to(args.profile):
                _stream(llm, prompt, params, args.quiet)
        else:
            _stream(llm, prompt, params, args.quiet)
    finally:
        llm.shutdown()
    return 0


def _stream(llm, prompt, params, quiet: bool) -> None:
    printed = 0
    last = None
    for out in llm.stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
        last = out
    sys.stdout.write("\n")
    if last is not None and not quiet:
        c = last.outputs[0]
        print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    from moeserve.config import EngineConfig
    from moeserve.launch.host import HOST, RANK, run_external_rank, run_host, serve_role
    from moeserve.serving.launcher import ServeOptions, serve

    logging.getLogger("moeserve").setLevel(args.log_level.upper())
    kwargs = engine_kwargs(args)
    if kwargs["model"] is None:
        from moeserve.demo import demo_model_path

        kwargs["model"] = str(demo_model_path())
    # a rank > 0 that gets SIGTERM waits for node 0's drain (the timeout) and the group's stop
    kwargs.update(disaggregation_kwargs(args))
    config = EngineConfig(**kwargs, progress=True, shutdown_grace_s=args.shutdown_timeout + 15)
    role = serve_role(config, os.environ)
    if role == HOST:  # --node-rank >= 1, or replacements joining an elastic group: no HTTP
        return run_host(config)
    if role == RANK:  # a rank > 0 that torchrun or srun started
        return run_external_rank(config, os.environ)
    body_limit = {}
    if args.max_request_body_bytes is not None:
        body_limit["max_request_body_bytes"] = args.max_request_body_bytes
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key if args.api_key is not None else os.environ.get("MOESERVE_API_KEY"),
        served_model_names=tuple(args.served_model_name or ()),
        shutdown_timeout_s=args.shutdown_timeout,
        debug_endpoints=args.enable_debug_endpoints,
        trust_request_chat_template=args.trust_request_chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        log_level=args.log_level,
        **body_limit,
    )
    return serve(config, options)


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from moeserve.demo import write_demo_model, write_tiny_model

    if args.tiny:
        print(f"wrote the tiny random model to {write_tiny_model(args.path)}")
    else:
        print(f"wrote the demo model to {write_demo_model(args.path)}")
    return 0


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or MOESERVE_API_KEY)"
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model directory's name)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM",
    )
    s.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="GET /debug/engine (stats, KV check) and the EPLB admin calls (/admin/eplb/...)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        default=None,
        help="split the thinking section of chat answers into reasoning_content "
        "(responses and stream deltas), as vLLM and SGLang do",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=["deepseek_v3", "deepseek_v31", "hermes"],
        default=None,
        help="the model's tool-call format (vLLM's names; hermes for Qwen2.5/Qwen3): chat "
        "answers' calls come back as tool_calls, and tool_choice required or a named "
        "function holds the model to calls that validate",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the model decides; needs --tool-call-parser)',
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates that requests send (chat_template, "
        "chat_template_kwargs.chat_template), in a sandbox process with a time, memory and "
        "output budget; refused (400) without this flag",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="larger request bodies get 413 (default: 8388608, 8 MiB)",
    )
    s.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error", "critical")
    )
    add_disaggregation_args(s)
    s.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    g.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="trace the generation with torch.profiler into DIR (trace.json for Perfetto, "
        "top_ops.txt) and print the top operations; under spawned ranks, rank 0 only",
    )
    g.set_defaults(func=_cmd_generate)

    _add_serve_parser(sub)

    add_router_parser(sub)

    b = sub.add_parser("bench", help="benchmarks against a running server")
    from moeserve.bench.serving import add_serving_parser

    add_serving_parser(b.add_subparsers(dest="bench_command", required=True))

    from moeserve.planner.cli import add_plan_parser

    add_plan_parser(sub)

    d = sub.add_parser("demo-model", help="write the built-in demo model as a HF directory")
    d.add_argument("path")
    d.add_argument(
        "--tiny", action="store_true", help="the tiny random model the tests use instead"
    )
    d.set_defaults(func=_cmd_demo_model)
    return parser


# oneDNN keeps every primitive it makes for a matmul shape in two caches: its own
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's in PyTorch (LRU_CACHE_CAPACITY), 1024 entries
# each by default (~250 MB with the demo model in bf16). A service sees ever new batch
# shapes, so its engine's memory would grow to that. 16 in both kept the engine flat through
# kills and rejoins and measured no slower (docs/benchmarks.md, elastic EP chaos soak); one
# of them alone did not. The environment overrides either.
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}


def main(argv: list[str] | None = None) -> int:
    for name, entries in ONEDNN_CACHES.items():  # before any engine process starts
        os.environ.setdefault(name, entries)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # an engine group that failed to start or lost a rank
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
