"""``moeserve bench serving``: load a running OpenAI-compatible server and measure it.

Like ``vllm bench serve``: requests (random or from a JSONL file) are sent streamed, with Poisson
arrivals at ``--request-rate`` (``inf``: all at once) and at most ``--max-concurrency`` in
flight; each one's TTFT, inter-token latencies and end-to-end latency are measured, and the
result is printed as vLLM's table, optionally written as JSON and plotted.

Python use::

    result = asyncio.run(run_benchmark(ServingBenchConfig(num_prompts=100, request_rate=4)))
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from moeserve.bench import spec_decode
from moeserve.bench.client import send_request
from moeserve.bench.datasets import (
    BenchRequest,
    DatasetError,
    LocalCodec,
    ServerCodec,
    TokenCodec,
    build_requests,
)
from moeserve.bench.metrics import (
    SLO_KEYS,
    BenchmarkResult,
    RequestRecord,
    compute_metrics,
    parse_goodput,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchmarkError(RuntimeError):
    """The benchmark could not run: server unreachable, no model, warm-up request failed."""


@dataclass(frozen=True)
class ServingBenchConfig:
    """Everything one run needs; validated on construction (ValueError says which field)."""

    base_url: str = "http://127.0.0.1:8000"  # the server root, without /v1
    endpoint: str = "completions"  # "completions" or "chat"
    model: str | None = None  # None: the first id of GET /v1/models
    tokenizer: str | None = None  # None: the server's /tokenize and /detokenize
    dataset: str = "random"  # "random" or a .jsonl path
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 is Poisson
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None  # None: $OPENAI_API_KEY if set
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout: float = 600.0  # seconds per request
    num_warmups: int = 1
    goodput: Mapping[str, float] = field(default_factory=dict)  # SLO key -> ms
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.endpoint in ENDPOINTS, f"--endpoint must be one of {list(ENDPOINTS)}")
        need(self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}")
        need(self.random_input_len >= 1, "--random-input-len must be >= 1")
        need(self.random_output_len >= 1, "--random-output-len must be >= 1")
        need(0.0 <= self.random_range_ratio < 1.0, "--random-range-ratio must be in [0, 1)")
        need(self.request_rate > 0, f"--request-rate must be > 0, got {self.request_rate}")
        need(self.burstiness > 0, f"--burstiness must be > 0, got {self.burstiness}")
        need(
            self.max_concurrency is None or self.max_concurrency >= 1,
            f"--max-concurrency must be >= 1, got {self.max_concurrency}",
        )
        need(self.timeout > 0, f"--timeout must be > 0 s, got {self.timeout}")
        need(self.num_warmups >= 0, f"--num-warmups must be >= 0, got {self.num_warmups}")
        need(self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")
        need(set(self.goodput) <= set(SLO_KEYS), f"goodput keys must be among {SLO_KEYS}")

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def api_url(self) -> str:
        return self.root + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        key = self.api_key if self.api_key is not None else os.environ.get("OPENAI_API_KEY")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def to_dict(self) -> dict[str, Any]:
        """The config for the result JSON (without the API key)."""
        d = asdict(self)
        d.pop("api_key")
        d["goodput"] = dict(self.goodput)
        return d


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s after the start) of ``n`` requests: gaps ~ Gamma(b, 1/(rate*b)).

    ``burstiness`` 1 gives exponential gaps (Poisson arrivals); the first request goes at 0;
    an infinite rate sends everything at 0.
    """
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def request_body(config: ServingBenchConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {"model": model}
    if config.endpoint == "chat":
        body["messages"] = (
            list(req.messages) if req.messages else [{"role": "user", "content": req.prompt}]
        )
    else:
        body["prompt"] = req.prompt
    body |= {
        "max_tokens": req.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _model_info(client: httpx.AsyncClient, config: ServingBenchConfig) -> dict[str, Any]:
    """The /v1/models entry for ``config.model`` (or the first one); {} if the server has none."""
    url = config.root + "/v1/models"
    try:
        r = await client.get(url)
    except httpx.HTTPError as e:
        raise BenchmarkError(f"cannot reach {url} ({e!r}); is the server running?") from None
    try:
        data = r.json().get("data", []) if r.status_code == 200 else []
    except (ValueError, AttributeError):  # not JSON, or not an object
        data = []
    if not data and config.model is None:
        raise BenchmarkError(f"GET {url} returned no model (HTTP {r.status_code}); pass --model")
    matching = [m for m in data if m.get("id") == config.model]
    return (matching or data or [{}])[0]


def _make_codec(config: ServingBenchConfig, vocab_size: int | None) -> TokenCodec:
    if config.tokenizer is not None:
        return LocalCodec.from_dir(config.tokenizer)
    if config.dataset == "random" and vocab_size is None:
        raise DatasetError(
            "the server's /v1/models does not report vocab_size, needed for random prompts; "
            "pass --tokenizer DIR"
        )
    return ServerCodec(config.root, vocab_size or 0, config.headers(), config.timeout)


def _load_requests(config: ServingBenchConfig, vocab_size: int | None) -> list[BenchRequest]:
    codec = _make_codec(config, vocab_size)
    try:
        reqs = build_requests(
            config.dataset,
            codec,
            config.num_prompts,
            config.random_input_len,
            config.random_output_len,
            config.random_range_ratio,
            config.seed,
        )
    finally:
        if isinstance(codec, ServerCodec):
            codec.close()
    if config.endpoint == "completions" and any(r.messages for r in reqs):
        raise DatasetError(f"{config.dataset} holds chat messages; use --endpoint chat")
    return reqs


async def _timed_run(
    client: httpx.AsyncClient, config: ServingBenchConfig, model: str, reqs: list[BenchRequest]
) -> tuple[list[RequestRecord], float]:
    from tqdm.auto import tqdm

    chat = config.endpoint == "chat"
    offsets = arrival_offsets(len(reqs), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency or len(reqs))
    pbar = tqdm(total=len(reqs), disable=config.disable_tqdm, desc="requests", unit="req")
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        async with limit:  # the record's start is taken after this wait, as in vLLM
            body = request_body(config, model, reqs[i])
            rec = await send_request(
                client, config.api_url, body, chat, reqs[i].prompt_len, t0, config.timeout
            )
        pbar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i) for i in range(len(reqs))))
    finally:
        pbar.close()
    return records, time.perf_counter() - t0


async def run_benchmark(config: ServingBenchConfig) -> BenchmarkResult:
    """Build the requests, warm up, send them all, and return the metrics.

    Writes nothing (see :func:`run_from_args` for the table, JSON and plot). Raises
    BenchmarkError if the server is unreachable or a warm-up request fails, DatasetError
    (a ValueError) for a bad dataset. Failed timed requests are counted, not raised.
    """
    timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 30.0))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        headers=config.headers(), timeout=timeout, limits=limits
    ) as client:
        info = await _model_info(client, config)
        model = config.model or info.get("id")
        if not model:
            raise BenchmarkError("GET /v1/models gave no model id; pass --model")
        reqs = await asyncio.to_thread(_load_requests, config, info.get("vocab_size"))
        chat = config.endpoint == "chat"
        for _ in range(config.num_warmups):
            body = request_body(config, model, reqs[0])
            rec = await send_request(
                client, config.api_url, body, chat, reqs[0].prompt_len, 0.0, config.timeout
            )
            if not rec.success:
                raise BenchmarkError(
                    f"the warm-up request to {config.api_url} failed: {rec.error}; check the "
                    "benchmark arguments and the server"
                )
        spec_before = await spec_decode.scrape_counters(client, config.root)
        records, duration = await _timed_run(client, config, model, reqs)
        spec = spec_decode.summarize(
            spec_before, await spec_decode.scrape_counters(client, config.root)
        )
    meta = {**config.to_dict(), "model_id": model, "backend": "openai", "date": _now()}
    if spec is not None:
        meta["spec_decode"] = spec
    return compute_metrics(records, duration, config.goodput, meta)


def _now() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def add_serving_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serving`` sub-command (all flags; ``func=run_from_args``) and return it."""
    p = subparsers.add_parser(
        "serving",
        help="benchmark a running OpenAI-compatible server (like `vllm bench serve`)",
        description=__doc__.split("\n\n")[1],
    )
    d = ServingBenchConfig()
    a = p.add_argument
    a("--base-url", default=None, help="server root, e.g. http://host:8000 (overrides host/port)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a(
        "--endpoint",
        choices=list(ENDPOINTS),
        default=d.endpoint,
        help="completions: /v1/completions with prompt; chat: /v1/chat/completions with messages",
    )
    a("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    a(
        "--tokenizer",
        default=None,
        help="tokenizer directory for building prompts (default: the server's /tokenize)",
    )
    a(
        "--dataset",
        default=d.dataset,
        help='"random", or a .jsonl file of {"prompt"|"messages", "output_len"?} per line',
    )
    a("--num-prompts", type=int, default=d.num_prompts)
    a("--random-input-len", type=int, default=d.random_input_len)
    a(
        "--random-output-len",
        type=int,
        default=d.random_output_len,
        help="output tokens per request (also the default for a .jsonl line without output_len)",
    )
    a(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths are drawn uniformly from the integers in [L*(1-r), L*(1+r)], 0 <= r < 1 "
        "(vLLM's current definition; older vLLM releases used [L*r, L])",
    )
    a(
        "--request-rate",
        type=float,
        default=d.request_rate,
        help="requests/s with Poisson arrivals (exponential gaps); inf sends all at once",
    )
    a(
        "--burstiness",
        type=float,
        default=d.burstiness,
        help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 steadier",
    )
    a("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    a("--seed", type=int, default=d.seed, help="seeds the prompts and the arrival times")
    a("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY if set)")
    a(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (a vLLM extension that makes output lengths exact)",
    )
    a("--temperature", type=float, default=d.temperature)
    a("--timeout", type=float, default=d.timeout, help="seconds per request")
    a("--num-warmups", type=int, default=d.num_warmups, help="untimed requests sent first")
    a(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs for goodput, keys ttft, tpot, e2el in ms, e.g. --goodput ttft:500 tpot:50",
    )
    a("--output-json", default=None, metavar="F.json", help="write metrics and per-request data")
    a("--plot", default=None, metavar="F.png", help="save latency histograms and throughput")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_from_args)
    return p


def config_from_args(args: argparse.Namespace) -> ServingBenchConfig:
    """The config of a parsed ``serving`` command line (ValueError for a bad value)."""
    return ServingBenchConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        endpoint=args.endpoint,
        model=args.model,
        tokenizer=args.tokenizer,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout=args.timeout,
        num_warmups=args.num_warmups,
        goodput=parse_goodput(args.goodput),
        disable_tqdm=args.disable_tqdm,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write ``--output-json`` / ``--plot``.

    Returns 0, or 1 when no request succeeded. Raises ValueError for bad arguments or dataset,
    BenchmarkError (a RuntimeError) when the benchmark cannot run.
    """
    from moeserve.bench.table import format_table

    config = config_from_args(args)
    result = asyncio.run(run_benchmark(config))
    print(format_table(result))
    if result.failed:
        errors = Counter(r.error for r in result.records if not r.success)
        for msg, n in errors.most_common(5):
            print(f"{n} failed request(s): {msg}", file=sys.stderr)
    if args.output_json:
        Path(args.output_json).write_text(result.to_json() + "\n", encoding="utf-8")
    if args.plot:
        from moeserve.bench.plot import save_plot

        save_plot(result, args.plot)
    return 0 if result.completed else 1
