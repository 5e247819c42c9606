"""The engine side of EPLB on one process: the window follows the routed tokens, dumps and
loads its file, exports metrics; options, merge and the Prometheus export."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import EngineConfig, EplbOptions
from moeserve.eplb import load_expert_location, save_placement
from moeserve.eplb.balancer import run_command
from moeserve.launch.group_stats import merge_eplb
from moeserve.serving.metrics import ServerMetrics, rank_imbalance
from tests.checkpoints import build_hf_model, save_hf_checkpoint

ENGINE = dict(dtype="float32", progress=False, max_model_len=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path_factory.mktemp("ds"))


def test_window_counts_every_routed_token_and_dumps(checkpoint, tmp_path):
    out = tmp_path / "stats.json"
    llm = LLM(str(checkpoint), **ENGINE, expert_stats_out=str(out), eplb_window=1000)
    engine = llm.engine
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the hook counts the previous step's tokens at the start of the next
    m = engine.stats()["eplb"]
    counts = engine.stats()["expert_counts"]
    assert m["window"] == {str(k): v for k, v in counts.items()}
    assert sum(m["window"]["1"]) == 4 * (5 + 3)  # top-4 of 5 prompt + 3 decode tokens
    assert m["placement"] == {} and m["rebalances"] == 0
    with pytest.raises(ValueError, match="expert parallelism"):
        engine.eplb.rebalance()
    assert "error" in run_command(engine.eplb, "rebalance")
    assert "error" in run_command(engine.eplb, "nonsense")
    llm.shutdown()
    record = json.loads(out.read_text())
    assert record["layer_ids"] == [1, 2] and record["load"] == [counts[1], counts[2]]
    loaded = load_expert_location(out, 2, 16)
    assert loaded.load_LE.tolist() == [counts[1], counts[2]]
    # raw stats on one process: nothing to place, accepted; a placement needs EP
    LLM(str(checkpoint), **ENGINE, init_expert_location=str(out))
    placement = tmp_path / "placement.json"
    save_placement(placement, [list(range(16))] * 2, layer_ids=[1, 2])
    with pytest.raises(ValueError, match="needs expert parallelism"):
        LLM(str(checkpoint), **ENGINE, init_expert_location=str(placement))


def test_options_are_validated():
    with pytest.raises(ValueError, match="eplb_algorithm"):
        EplbOptions(algorithm="best")
    with pytest.raises(ValueError, match="interval_steps"):
        EplbOptions(interval_steps=0)
    assert EplbOptions(window_steps=1000).chunk_steps == 10
    assert EplbOptions(window_steps=7).chunk_steps == 7
    with pytest.raises(ValueError, match="need expert parallelism"):
        EngineConfig("m", enable_eplb=True)
    with pytest.raises(ValueError, match="need expert parallelism"):
        EngineConfig("m", num_redundant_experts=2)


def test_cli_names_and_alias():
    from moeserve.cli import build_parser, engine_kwargs

    base = ["serve", "--ep", "2"]
    for flag in ("--ep-num-redundant-experts", "--num-redundant-experts"):
        args = build_parser().parse_args(
            [*base, flag, "2", "--enable-eplb", "--eplb-interval", "9"]
        )
        kw = engine_kwargs(args)
        assert kw["num_redundant_experts"] == 2 and kw["enable_eplb"] and kw["eplb_interval"] == 9
    args = build_parser().parse_args([*base, "--eplb-algorithm", "global"])
    assert engine_kwargs(args)["eplb_algorithm"] == "global"


def test_rank_imbalance_and_merge_and_export():
    # 2 ranks, slots [0 1 | 0 2]: expert 0 split over both ranks
    assert rank_imbalance([8, 4, 0], [0, 1, 0, 2], 2) == pytest.approx(8 / 6)
    assert rank_imbalance([0, 0, 0], [0, 1, 0, 2], 2) == 1.0
    rank = {
        "window": {"1": [4, 2, 0]},
        "window_steps": 5,
        "placement": {"1": [0, 1, 0, 2]},
        "ep_size": 2,
        "last_rebalance": {"1": [1.5, 1.1]},
        "rebalances": 1,
        "layers_moved": 1,
    }
    merged = merge_eplb([rank, None, {**rank, "window": {"1": [4, 2, 0]}}])
    assert merged["window"] == {"1": [8, 4, 0]} and merge_eplb([None]) is None
    metrics = ServerMetrics("m")
    metrics.set_engine_stats(
        {
            "replicas": [{"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}],
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            "expert_counts": {},
            "eplb": merged,
        }
    )
    text = metrics.render().decode()
    assert 'moeserve:eplb_window_expert_tokens{expert="0",layer="1",model_name="m"} 8.0' in text
    assert 'moeserve:eplb_imbalance{layer="1",model_name="m"} 1.333' in text
    assert 'moeserve:eplb_imbalance_before{layer="1",model_name="m"} 1.5' in text
    assert 'moeserve:eplb_imbalance_after{layer="1",model_name="m"} 1.1' in text
    assert 'moeserve:eplb_rebalances_total{model_name="m"} 1.0' in text


def fake_balancer(algorithm: str, num_groups: int, nodes=(0, 0, 1, 1)):
    """A balancer over 2 fake MoE layers of 16 experts on 4 EP ranks (no processes)."""
    from types import SimpleNamespace

    import torch

    from moeserve.distributed.ep import ExpertPlacement
    from moeserve.eplb.balancer import ExpertBalancer

    placement = ExpertPlacement.contiguous(16, 4, 4, node_of_rank=nodes)
    blocks = [
        (
            i,
            SimpleNamespace(
                expert_counts_E=torch.zeros(16, dtype=torch.int64), placement=placement
            ),
        )
        for i in (1, 2)
    ]
    ep = SimpleNamespace(size=4, rank=0, group=None)
    return ExpertBalancer(blocks, [1, 2], ep, ep, EplbOptions(algorithm=algorithm), num_groups)


def test_algorithm_choice_keeps_groups_on_their_node():
    import torch

    load = torch.zeros(2, 16)
    load[:, :4] = 100.0  # group 0 (experts 0-3) hot
    load[:, 4:] = 1.0
    tables = fake_balancer("auto", 4).compute_tables(load)  # hierarchical: 4 groups, 2 nodes
    for table in tables.tolist():
        for g in range(4):  # every slot of a group's experts lies on one node (8 slots each)
            nodes = {p // 10 for p, e in enumerate(table) if e // 4 == g}
            assert len(nodes) == 1
        assert sorted(set(table)) == list(range(16)) and len(table) == 20
    flat = fake_balancer("global", 4).compute_tables(load)
    assert flat.shape == (2, 20)
    with pytest.raises(ValueError, match="hierarchical needs"):
        fake_balancer("hierarchical", 1).compute_tables(load)
    # nodes that are not contiguous equal blocks: treated as one node
    assert fake_balancer("auto", 4, nodes=(0, 1, 0, 1))._nodes() == 1
    assert fake_balancer("auto", 4)._nodes() == 2


def test_the_window_holds_every_steps_counts_when_read_per_chunk():
    """on_step reads the blocks' counters only when a chunk closes (and for every outside
    reader): the window is the one of counting every step, after any step."""
    from types import SimpleNamespace

    from moeserve.distributed.groups import Axis
    from moeserve.eplb.balancer import ExpertBalancer
    from moeserve.eplb.stats import ExpertLoadStats

    g = torch.Generator().manual_seed(0)
    blocks = [
        (i, SimpleNamespace(expert_counts_E=torch.zeros(8, dtype=torch.int64), placement=None,
                            reports_counts=True))
        for i in (1, 2, 3)
    ]  # fmt: skip
    options = EplbOptions(window_steps=40)  # chunks of 4 steps
    balancer = ExpertBalancer(blocks, [1, 2, 3], Axis.single("ep"), Axis.single("world"), options)
    assert options.chunk_steps > 1
    every = ExpertLoadStats(3, 8, options.window_steps, options.chunk_steps)
    for step in range(100):
        for _, b in blocks:  # a step's routing
            b.expert_counts_E += torch.randint(0, 5, (8,), generator=g)
        every.add_totals(torch.stack([b.expert_counts_E for _, b in blocks]))
        every.step()
        balancer.on_step()
        if step % 7 == 0:  # an outside reader now and then
            assert torch.equal(balancer.window_stats().local_window(), every.local_window())
    assert torch.equal(balancer.window_stats().local_window(), every.local_window())
    assert balancer.window_stats().window_covers_steps == every.window_covers_steps
