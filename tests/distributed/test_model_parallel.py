"""Every parallel layout gives the one-process result: the same 32 greedy tokens and prompt
log-probabilities within 1e-4, for a batch of mixed-length prompts under continuous batching
(a small token budget forces chunked prefill, so DP replicas run different step patterns and
idle replicas join the expert all-to-alls with empty batches).

Each case spawns its ranks as processes (gloo over loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.models.synthetic import write_random_deepseek
from tests.checkpoints import build_hf_model, save_hf_checkpoint

PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
ENGINE = dict(dtype="float32", progress=False, max_model_len=160, max_num_batched_tokens=40)

# a DeepSeek-V3 whose experts dominate its size (the rest is a few MB)
BENCH_LIKE = dict(
    vocab_size=512,
    intermediate_size=1024,
    moe_intermediate_size=512,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    num_nextn_predict_layers=0,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2-tp2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "ep2-dp2": dict(data_parallel_size=2, enable_expert_parallel=True),
    "ep4-dp4": dict(data_parallel_size=4, enable_expert_parallel=True),
    "ep4-tp2xdp2": dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True),
    "dp2": dict(data_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}
# the 4-rank layouts of the second model run in the slow target
SLOW = {("qwen3_moe", "ep4-dp4"), ("qwen3_moe", "ep4-tp2xdp2"), ("qwen3_moe", "dp2")}


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 70, (n,), generator=g).tolist()
    return [torch.randint(2, 512, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    return {
        kind: save_hf_checkpoint(build_hf_model(kind), root / kind)
        for kind in ("deepseek_v3", "qwen3_moe")
    }


@pytest.fixture(scope="module")
def reference(checkpoints):
    out = {}
    for kind, path in checkpoints.items():
        llm = LLM(str(path), max_num_seqs=3, **ENGINE)
        out[kind] = llm.generate(prompts(), PARAMS)
    return out


def run_layout(path, layout: dict, ps, max_num_seqs: int = 3):
    llm = LLM(str(path), max_num_seqs=max_num_seqs, **ENGINE, **layout)
    try:
        return llm.generate(ps, PARAMS), llm
    finally:
        llm.shutdown()


def assert_same(ref, got) -> None:
    for r, g in zip(ref, got, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            (tok_a, lp_a), (tok_b, lp_b) = next(iter(a.items())), next(iter(b.items()))
            assert tok_a == tok_b and abs(lp_a.logprob - lp_b.logprob) < 1e-4


CASES = [
    pytest.param(kind, name, marks=[pytest.mark.slow] if (kind, name) in SLOW else [])
    for kind in ("deepseek_v3", "qwen3_moe")
    for name in LAYOUTS
]


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_layout_matches_one_process(checkpoints, reference, kind, layout):
    got, llm = run_layout(checkpoints[kind], LAYOUTS[layout], prompts())
    assert_same(reference[kind], got)
    # every spawned rank checked its KV cache at the stop and exited cleanly
    assert all(p.returncode == 0 for p in llm.engine.workers.procs.values())


@pytest.mark.parametrize("layout", ["ep2-dp2", pytest.param("ep2-tp2", marks=pytest.mark.slow)])
def test_two_batch_overlap_matches_without_it(checkpoints, reference, layout, monkeypatch):
    """``two_batch_overlap`` splits each MoE layer's rows on a rank in two halves around the
    all-to-alls: the same greedy tokens as without it and as one process. Rank 0 runs in this
    process, so a spy on its split counts how often both halves held rows."""
    from moeserve.distributed.ep import moe_step

    rows: list[int] = []
    split = moe_step._two_batch

    def spy(x_TD, *args):
        rows.append(x_TD.shape[0])
        return split(x_TD, *args)

    monkeypatch.setattr(moe_step, "_two_batch", spy)
    path, want = checkpoints["deepseek_v3"], reference["deepseek_v3"]
    plain, _ = run_layout(path, LAYOUTS[layout], prompts())
    assert not rows  # the plain path never splits
    tbo, llm = run_layout(path, dict(LAYOUTS[layout], two_batch_overlap=True), prompts())
    assert [o.outputs[0].token_ids for o in tbo] == [o.outputs[0].token_ids for o in plain]
    assert_same(want, tbo)
    # both micro-batches held rows in most MoE layer calls (prefill chunks and decodes of 2-3
    # sequences), the second one was empty only where a rank had one row or none
    assert sum(t >= 2 for t in rows) > len(rows) // 2
    assert all(p.returncode == 0 for p in llm.engine.workers.procs.values())


def test_all_requests_on_one_replica(checkpoints, reference):
    """One request: the other DP replica idles through every step (empty batches) without
    hanging the expert all-to-alls."""
    ps = prompts()[:1]
    got, _ = run_layout(checkpoints["deepseek_v3"], LAYOUTS["ep2-dp2"], ps)
    assert_same(reference["deepseek_v3"][:1], got)


def test_rank_info_reports_shards(checkpoints):
    """Each EP rank holds and reads only its experts; TP ranks split the attention."""
    llm = LLM(str(checkpoints["deepseek_v3"]), **ENGINE, **LAYOUTS["ep4-tp2xdp2"])
    try:
        info = llm.engine.rank_info()
    finally:
        llm.shutdown()
    single = LLM(str(checkpoints["deepseek_v3"]), **ENGINE).engine
    full = sum(p.numel() * p.element_size() for p in single.model.parameters())
    assert [i["rank"] for i in info] == [0, 1, 2, 3]
    assert sorted(i["ep_rank"] for i in info) == [0, 1, 2, 3]
    for i in info:
        assert i["weight_bytes"] < 0.6 * full
        assert i["checkpoint_bytes_read"] < 0.6 * single.load_report.num_bytes


def test_killed_rank_ends_the_group_with_its_name(checkpoints):
    llm = LLM(str(checkpoints["deepseek_v3"]), **ENGINE, **LAYOUTS["ep2-dp2"])
    victim = llm.engine.workers.procs[1]
    threading.Timer(1.0, lambda: os.kill(victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    long = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    # named with its node, host and pid: rank 1 (node 0, host H 127.0.0.1, pid N). 64 prompts
    # keep the group busy past the kill (4 finished within the second on a fast host)
    with pytest.raises(
        RuntimeError, match=r"rank 1 \(node 0, host .+, pid \d+\) was killed by signal 9"
    ):
        llm.generate(prompts(64), long)
    assert time.monotonic() - start < 30
    assert llm.engine.closed and victim.poll() is not None


def test_peer_that_never_arrives_fails_in_bounded_time(checkpoints):
    """A torchrun-style world of 2 whose rank 1 never starts: rank 0 gives up after the
    timeout with the rendezvous address in the message (in its own process: a failed
    torch.distributed start-up leaves state behind in the process that tried)."""
    from moeserve.launch.spec import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "moeserve.cli", "generate", "--prompt", "x", "-q"]
    cmd += ["--model", str(checkpoints["deepseek_v3"]), "--tp", "2", "--dist-timeout", "3"]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert done.returncode == 1
    assert "did not all join tcp://127.0.0.1" in done.stderr


def test_expert_parallel_ranks_keep_only_their_experts_resident(tmp_path):
    """Resident memory a fresh rank gains while loading, against its shard: with EP2 a rank
    holds half the experts (and reads only those bytes); as a plain DP replica it holds all."""
    cfg = dict(BENCH_LIKE, num_hidden_layers=3, n_routed_experts=32, hidden_size=512)
    path = write_random_deepseek(tmp_path / "ckpt", cfg, dtype="float32")
    expert_bytes = 2 * 32 * 3 * 512 * 512 * 4  # two MoE layers of 32 experts, fp32
    info = {}
    for name in ("dp2", "ep2-dp2"):
        llm = LLM(str(path), **ENGINE, **LAYOUTS[name])
        try:
            info[name] = llm.engine.rank_info()[1]  # rank 1: a fresh process
        finally:
            llm.shutdown()
    full, half = info["dp2"], info["ep2-dp2"]
    assert full["weight_bytes"] - half["weight_bytes"] == expert_bytes // 2
    assert full["checkpoint_bytes_read"] - half["checkpoint_bytes_read"] == expert_bytes // 2
    slack = 48 << 20  # allocator and interpreter noise
    for i in (full, half):
        assert i["weight_bytes"] - slack < i["load_rss_bytes"] < i["weight_bytes"] + slack


def test_full_replicas_refuse_new_requests_at_rank_0(checkpoints):
    from moeserve.engine.scheduler import QueueFullError

    llm = LLM(str(checkpoints["deepseek_v3"]), **ENGINE, **LAYOUTS["dp2"], max_waiting_requests=1)
    try:
        group = llm.engine
        group.add_request("a", [5, 6, 7], PARAMS)
        group.add_request("b", [5, 6, 8], PARAMS)  # the other replica
        with pytest.raises(QueueFullError, match="retry later"):
            group.add_request("c", [5, 6, 9], PARAMS)
        while group.has_unfinished_requests():
            group.step()
        group.add_request("c", [5, 6, 9], PARAMS)  # room again
        group.abort_request("c")
        assert not group.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_idle_group_outlives_its_collective_timeout(checkpoints, reference):
    """Workers wait for each step inside a collective with a timeout; a quiet group is kept
    awake by rank 0's pings, so a pause longer than the timeout loses nothing. The group's
    stats and finish_sample work across ranks too."""
    llm = LLM(str(checkpoints["deepseek_v3"]), **ENGINE, **LAYOUTS["ep2-dp2"], dist_timeout_s=3.0)
    try:
        time.sleep(5)
        assert_same(reference["deepseek_v3"][:2], llm.generate(prompts()[:2], PARAMS))
        group = llm.engine
        params = SamplingParams(max_tokens=50, n=2, ignore_eos=True, output_kind="delta")
        group.add_request("s", [5, 6, 7], params)
        group.step()
        group.finish_sample("s", 0)
        group.finish_sample("s", 1)
        outs = []
        while group.has_unfinished_requests():
            outs += group.step()
        final = [o for o in outs if o.request_id == "s"][-1]
        assert final.finished and len(final.outputs) == 2
        assert {c.finish_reason for c in final.outputs} == {"stop"}
        stats = group.stats()
        assert stats["integrity"] == "ok" and stats["num_running"] == 0
        assert len(stats["replicas"]) == 2 and stats["expert_counts"]
    finally:
        llm.shutdown()
