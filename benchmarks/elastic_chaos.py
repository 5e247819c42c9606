"""A chaos soak of an elastic-EP service (issue 23, part 6): ``moeserve bench serving`` load
for ``--minutes`` while a random rank other than rank 0 is killed (SIGKILL) about every
``--interval`` seconds and a replacement (``moeserve serve ... --elastic-rejoin R``, the same
flags) joins after each recovery.

Reported: requests lost (failed, or finished with fewer tokens than asked: must be 0), the
error rate, TTFT/ITL/E2E p99, each kill's recovery and rejoin times, the RSS of the server's
API server and of rank 0's engine over time (flat when nothing leaks there; killed ranks
leave and replacements are new processes) and the KV-cache self-check at the end.

    python benchmarks/elastic_chaos.py [--model tiny|demo|bench|DIR] [--minutes 10] \
        [--interval 60] [--rate 2] [--input-len 64] [--output-len 64] \
        [--out bench_out/elastic_chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic import model_dir, rank_pid  # noqa: E402
from pd import host  # noqa: E402
from server_process import start_server  # noqa: E402

from moeserve.bench.serving import ServingBenchConfig, run_benchmark  # noqa: E402
from moeserve.launch.spec import free_port  # noqa: E402


def server_rss_mb(api_pid: int) -> tuple[float, float]:
    """Resident MB of the API server and of its engine process (world rank 0), not of the
    ranks the engine spawned (killed ones leave, replacements are processes of their own)."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,rss=,args="], capture_output=True, text=True
    ).stdout
    api = engine = 0
    for line in out.splitlines():
        pid, ppid, rss, cmd = line.split(None, 3)
        if int(pid) == api_pid:
            api = int(rss)
        elif int(ppid) == api_pid and "engine_core" in cmd:
            engine = int(rss)
    return api / 1024, engine / 1024


def elastic_status(url: str) -> dict:
    """The group's elastic status; asked again while the engine is too busy to answer (a
    recovery holds it: /debug/engine then answers 503)."""
    deadline = time.monotonic() + 120
    while True:
        r = httpx.get(f"{url}/debug/engine", timeout=60)
        if r.status_code == 200:
            return r.json()["elastic"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"/debug/engine: {r.status_code} {r.text[:200]}")
        time.sleep(0.5)


def wait_for(check, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - t0


class Chaos:
    """Kills a random member (not rank 0) every interval and starts its replacement."""

    def __init__(self, args, url: str, server_pid: int, flags: list[str], port: int) -> None:
        self.args, self.url, self.server_pid = args, url, server_pid
        self.flags, self.port = flags, port
        self.rng = random.Random(args.seed)
        self.events: list[dict] = []
        self.agents: list[subprocess.Popen] = []
        self.stop = threading.Event()
        self.error: str | None = None
        self.log_dir = Path(args.out).with_suffix("")  # the replacements' logs
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        try:
            while not self.stop.wait(self.args.interval * self.rng.uniform(0.8, 1.2)):
                self.one_round()
        except Exception as e:  # noqa: BLE001 - reported in the results
            self.error = f"{type(e).__name__}: {e}"

    def one_round(self) -> None:
        st = elastic_status(self.url)
        victim = self.rng.choice(st["members"][1:])
        pid = self._pid(victim)
        recoveries = st["recoveries"]
        killed = time.time()
        subprocess.run(["kill", "-9", str(pid)], check=True)
        recovered = wait_for(
            lambda: elastic_status(self.url)["recoveries"] > recoveries, 120, "recovery"
        )
        cmd = [sys.executable, "-m", "moeserve.cli", "serve", *self.flags]
        cmd += ["--elastic-rejoin", str(victim), "--master-addr", "127.0.0.1"]
        log_path = self.log_dir / f"replacement{len(self.agents)}-rank{victim}.log"
        with open(log_path, "w") as log:
            agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.agents.append(agent)
        world = len(st["members"])
        try:
            rejoined = wait_for(
                lambda: len(elastic_status(self.url)["members"]) == world, 300, "rejoin"
            )
        except RuntimeError as e:
            raise RuntimeError(f"{e}; {log_path}:\n{log_path.read_text()[-3000:]}") from None
        self.events.append(
            {"at": killed, "rank": victim, "recovered_s": recovered, "rejoined_s": rejoined}
        )
        print(
            f"  killed rank {victim}: recovered in {recovered:.1f} s, replacement joined "
            f"{rejoined:.1f} s later",
            flush=True,
        )

    def _pid(self, rank: int) -> int:
        for root in [self.server_pid, *(a.pid for a in self.agents if a.poll() is None)]:
            try:
                return rank_pid(root, rank)
            except RuntimeError:
                continue
        raise RuntimeError(f"rank {rank} runs nowhere")


def soak(args: argparse.Namespace, model_dir: Path) -> dict:
    port = free_port()
    flags = [
        "--model", str(model_dir), "--ep", str(args.ep), "--enable-elastic-ep",
        "--ep-num-redundant-experts", str(args.redundant), "--threads", "1",
        "--master-port", str(port),
    ]  # fmt: skip
    proc, url = start_server([*flags, "--enable-debug-endpoints"])
    chaos = Chaos(args, url, proc.pid, flags, port)
    rss: list[tuple[float, float, float]] = []  # (seconds, API server MB, engine MB)
    try:
        duration = args.minutes * 60
        config = ServingBenchConfig(
            base_url=url, num_prompts=max(1, int(args.rate * duration)), request_rate=args.rate,
            random_input_len=args.input_len, random_output_len=args.output_len,
            seed=args.seed, disable_tqdm=True, timeout=900,
        )  # fmt: skip
        sampler_stop = threading.Event()

        def sample_rss() -> None:
            t0 = time.monotonic()
            while not sampler_stop.wait(5):
                rss.append((time.monotonic() - t0, *server_rss_mb(proc.pid)))

        threads = [threading.Thread(target=chaos.run), threading.Thread(target=sample_rss)]
        for t in threads:
            t.start()
        result = asyncio.run(run_benchmark(config))
        chaos.stop.set()
        sampler_stop.set()
        for t in threads:
            t.join()
        engine = httpx.get(f"{url}/debug/engine", timeout=120).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(180)
        agents = [a.wait(60) for a in chaos.agents]
    short = [r for r in result.records if r.success and r.output_len < args.output_len]
    third = max(1, len(rss) // 3)
    return {
        "requests": len(result.records),
        "completed": result.completed,
        "failed": result.failed,
        "lost": result.failed + len(short),
        "error_rate": result.failed / max(1, len(result.records)),
        "errors": sorted({r.error[:200] for r in result.records if not r.success}),
        "ttft_p99_ms": result.ttft.p99,
        "itl_p99_ms": result.itl.p99,
        "e2e_p99_ms": result.e2el.p99,
        "output_tokens_per_s": result.output_throughput,
        "kills": chaos.events,
        "chaos_error": chaos.error,
        "rss_mb": rss,
        "rss_first_third_mb": [sum(x[i] for x in rss[:third]) / third for i in (1, 2)],
        "rss_last_third_mb": [sum(x[i] for x in rss[-third:]) / third for i in (1, 2)],
        "integrity": engine["integrity"],
        "elastic": engine["elastic"],
        "server_exit": code,
        "replacement_exits": agents,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, demo, bench or a directory")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--redundant", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/elastic_chaos.json")
    args = p.parse_args()
    r = soak(args, model_dir(args.model))
    print(f"elastic EP chaos soak: {args.model}, --ep {args.ep}, {args.minutes:g} min; {host()}")
    latency = f"{r['ttft_p99_ms']:.0f} / {r['itl_p99_ms']:.0f} / {r['e2e_p99_ms']:.0f} ms"
    first, last = r["rss_first_third_mb"], r["rss_last_third_mb"]
    rss = f"API {first[0]:.0f} -> {last[0]:.0f} MB, engine {first[1]:.0f} -> {last[1]:.0f} MB"
    ends = f"{r['integrity']}, {r['server_exit']}, {r['replacement_exits']}"
    rows = [
        ("requests: completed / failed / lost", f"{r['completed']} / {r['failed']} / {r['lost']}"),
        ("kills (each recovered, then rejoined)", str(len(r["kills"]))),
        ("TTFT / ITL / E2E p99", latency),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("RSS, first third -> last third", rss),
        ("KV self-check, server exit, replacement exits", ends),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if r["chaos_error"]:
        print(f"chaos stopped early: {r['chaos_error']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "host": host(), **r}, indent=2))
    return 0 if r["lost"] == 0 and not r["chaos_error"] else 1


if __name__ == "__main__":
    sys.exit(main())
