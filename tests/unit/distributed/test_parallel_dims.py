"""ParallelDims: rank coordinates, group membership and model checks; micro-batch splits;
the JSON codec of the engine's messages; the CLI's parallel flags."""

from __future__ import annotations

import pytest

from moeserve.cli import build_parser, engine_kwargs
from moeserve.core import CompletionOutput, Logprob, RequestOutput, SamplingParams
from moeserve.distributed.parallel_dims import ParallelDims
from moeserve.engine import codec
from moeserve.models.base import stage_layers


def test_coords_round_trip_and_tp_is_fastest():
    dims = ParallelDims(tp=2, dp=3, pp=2, enable_expert_parallel=True)
    assert dims.world_size == 12 and dims.ep == 6
    for rank in range(12):
        c = dims.coords(rank)
        assert dims.rank_of(c.dp_rank, c.pp_rank, c.tp_rank) == rank
        assert c.ep_rank == c.dp_rank * 2 + c.tp_rank
    assert dims.coords(1).tp_rank == 1 and dims.coords(2).pp_rank == 1
    with pytest.raises(ValueError, match="outside a world of 12"):
        dims.coords(12)


@pytest.mark.parametrize("tp,dp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2), (1, 4, 1)])
def test_every_axis_partitions_the_world(tp, dp, pp):
    dims = ParallelDims(tp, dp, pp, enable_expert_parallel=True)
    for groups, size in (
        (dims.tp_groups(), tp),
        (dims.ep_groups(), tp * dp),
        (dims.pp_groups(), pp),
        (dims.replica_groups(), tp * pp),
    ):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(dims.world_size))
        assert all(len(g) == size for g in groups)
    # an EP group is one stage: every member has the same pp rank
    for g in dims.ep_groups():
        assert len({dims.coords(r).pp_rank for r in g}) == 1


def test_bad_sizes_and_models_are_refused():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelDims(tp=0)
    dims = ParallelDims(tp=4, dp=2, enable_expert_parallel=True)
    with pytest.raises(ValueError) as err:
        dims.check_model(num_heads=6, num_kv_heads=3, num_experts=12, num_layers=2, ffn_sizes=(10,))
    msg = str(err.value)
    assert "6 attention heads do not divide by tp=4" in msg
    assert "12 expert slots do not divide by ep=8" in msg
    assert "FFN size 10 does not divide by tp=4" in msg
    dims.check_model(num_heads=8, num_kv_heads=2, num_experts=16, num_layers=2, ffn_sizes=(8,))


def test_stage_layers_cover_every_layer_once():
    for n, pp in ((12, 1), (12, 5), (3, 3), (7, 2)):
        ranges = [stage_layers(n, pp, r) for r in range(pp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
    with pytest.raises(ValueError, match="exceeds"):
        stage_layers(2, 3, 0)


def test_codec_round_trips_outputs_and_params():
    p = SamplingParams(n=2, temperature=0.5, stop=["x"], stop_token_ids=[3], seed=7, logprobs=2)
    assert codec.params_from_json(codec.params_to_json(p)) == p
    lp = {5: Logprob(-0.125, 1, "a"), 9: Logprob(-3.0000000000000004, 2, None)}
    out = RequestOutput(
        "r1",
        "hi",
        [1, 2],
        [CompletionOutput(0, "ab", [5, 9], -1.5, [lp, lp], "stop", "x")],
        True,
        prompt_logprobs=[None, lp],
        num_cached_tokens=16,
        metrics={"ttft": 0.25},
    )
    assert codec.output_from_json(codec.output_to_json(out)) == out


def parse(*argv: str) -> dict:
    return engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x", *argv]))


def test_cli_parallel_flags():
    kw = parse("--ep", "4", "--tp", "2")
    assert (kw["data_parallel_size"], kw["enable_expert_parallel"]) == (4, True)
    assert kw["tensor_parallel_size"] == 2 and kw["pipeline_parallel_size"] == 1
    kw = parse("--dp", "2", "--enable-expert-parallel", "--two-batch-overlap")
    assert kw["enable_expert_parallel"] and kw["two_batch_overlap"] and kw["moe_overlap"]
    with pytest.raises(ValueError, match="conflicts with --dp 2"):
        parse("--ep", "4", "--dp", "2")
    with pytest.raises(ValueError, match="needs --master-addr"):
        parse("--nnodes", "2", "--node-rank", "1")
