"""Hosts started unlike node 0 fail before they join, naming what differs."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.launch.agreement import check_terms, group_terms, publish_terms
from moeserve.launch.spec import LaunchSpec, free_port
from tests.checkpoints import build_hf_model, save_hf_checkpoint


def _spec(rank: int, port: int) -> LaunchSpec:
    return LaunchSpec(4, rank, 0, 2, 2, rank // 2, "127.0.0.1", port, "flags")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("terms")
    return {
        name: save_hf_checkpoint(build_hf_model(name), root / name)
        for name in ("deepseek_v3", "qwen3_moe")
    }


def _config(model, **kw) -> EngineConfig:
    kw.setdefault("data_parallel_size", 4)
    return EngineConfig(model=str(model), enable_expert_parallel=True, **kw)


def test_the_same_start_passes_and_a_different_one_is_named(ckpts):
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    mine = group_terms(_config(ckpts["deepseek_v3"]), _spec(0, port))
    publish_terms(_spec(0, port), mine, timeout_s=5).join()
    check_terms(_spec(2, port), group_terms(_config(ckpts["deepseek_v3"]), _spec(2, port)), 5)
    other = _config(ckpts["qwen3_moe"], data_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError) as e:
        check_terms(_spec(3, port), group_terms(other, _spec(3, port)), 5)
    text = str(e.value)
    assert text.startswith("rank 3 (node 1) was started unlike node 0 (")
    for name in ("layout", "world size", "quantization", "checkpoint config.json sha256"):
        assert name in text
    assert "'tp=1 dp=2 pp=1 ep=2 (world 2)' here, 'tp=1 dp=4 pp=1 ep=4 (world 4)'" in text
    del store


def test_no_rank_0_is_a_bounded_clear_error(ckpts):
    port = free_port()
    terms = group_terms(_config(ckpts["deepseek_v3"]), _spec(1, port))
    with pytest.raises(RuntimeError, match=f"rank 0 did not come up at 127.0.0.1:{port} within"):
        check_terms(_spec(1, port), terms, timeout_s=1.0)
