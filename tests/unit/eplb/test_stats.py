"""ExpertLoadStats (sliding window, deltas of cumulative counters, group sum) and the stats /
placement files (round trips, telling them apart, error cases)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.eplb import (
    ExpertLoadStats,
    ExpertPlacementFile,
    ExpertStatsFile,
    load_expert_location,
    rebalance_experts,
    save_expert_stats,
    save_placement,
)
from tests.distributed.mp import run_ranks


def step_counts(i: int, L: int = 2, E: int = 3) -> torch.Tensor:
    """Distinct counts for step i, so a wrong window shows."""
    return torch.arange(L * E, dtype=torch.int64).view(L, E) + 100 * i


def test_window_of_single_steps_is_exact():
    stats = ExpertLoadStats(2, 3, window_steps=4, chunk_steps=1)
    for i in range(7):
        stats.add(step_counts(i))
        stats.step()
        first = max(0, i - 3)
        assert torch.equal(stats.window(), sum(step_counts(j) for j in range(first, i + 1)))
        assert stats.window_covers_steps == i + 1 - first
    assert stats.steps == 7


def test_chunked_window_covers_between_w_and_w_plus_chunk_minus_one():
    stats = ExpertLoadStats(2, 3, window_steps=4, chunk_steps=2)
    for i in range(9):
        stats.add(step_counts(i))
        stats.step()
        done = i + 1
        # closed chunks of 2 steps (the last 2 of them) plus the open chunk's steps
        first = max(0, (done // 2 - 2) * 2)
        assert torch.equal(stats.window(), sum(step_counts(j) for j in range(first, done)))
        assert 0 <= stats.window_covers_steps - min(done, 4) <= 1
    # counts added before the step ends are in the window already
    stats.add(torch.ones(2, 3, dtype=torch.int64))
    assert torch.equal(stats.window(), sum(step_counts(j) for j in range(4, 9)) + 1)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 9), st.booleans()), max_size=40),
)
def test_window_matches_a_plain_history(chunks, chunk_steps, events):
    """Random adds and step ends against a list of every step's counts: the window is the
    steps from the start of the oldest chunk still in the ring to now."""
    stats = ExpertLoadStats(1, 1, window_steps=chunks * chunk_steps, chunk_steps=chunk_steps)
    history = [0]  # counts of each step; the last one is in progress
    for count, end_step in events:
        stats.add(torch.tensor([[count]]))
        history[-1] += count
        if end_step:
            stats.step()
            history.append(0)
        done = len(history) - 1
        first = max(0, (done // chunk_steps - chunks) * chunk_steps)
        assert int(stats.window()) == sum(history[first:])
        assert stats.window_covers_steps == done - first


def test_add_layer_and_add_totals():
    stats = ExpertLoadStats(2, 3, window_steps=10, chunk_steps=5)
    stats.add_layer(1, torch.tensor([1, 2, 3]))
    totals = torch.tensor([[5, 0, 0], [0, 0, 7]])
    stats.add_totals(totals)  # first call: everything since the counters started
    stats.step()
    stats.add_totals(totals + torch.tensor([[1, 1, 1], [0, 0, 0]]))
    assert stats.window().tolist() == [[6, 1, 1], [1, 2, 10]]
    with pytest.raises(ValueError, match="went down"):
        stats.add_totals(totals)
    stats.reset()
    assert stats.window().sum() == 0 and stats.steps == 0
    stats.add_totals(totals)  # after reset the counters count from 0 again
    assert stats.window().tolist() == totals.tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window_steps=10, chunk_steps=3), "multiple of chunk_steps"),
        (dict(window_steps=0), "multiple"),
        (dict(num_layers=0), "need >= 1 layer"),
    ],
)
def test_constructor_errors(kwargs, match):
    args = dict(num_layers=2, num_experts=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ExpertLoadStats(**args)


def test_shape_errors():
    stats = ExpertLoadStats(2, 3, window_steps=2, chunk_steps=1)
    with pytest.raises(ValueError, match=r"counts must be \(2, 3\)"):
        stats.add(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="layer in"):
        stats.add_layer(2, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="counts of shape"):
        stats.add_layer(0, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"totals must be \(2, 3\)"):
        stats.add_totals(torch.zeros(2, 4, dtype=torch.int64))


def _group_window(rank: int, world_size: int) -> list:
    import torch.distributed as dist

    stats = ExpertLoadStats(1, 2, window_steps=2, chunk_steps=1, group=dist.group.WORLD)
    stats.add(torch.tensor([[rank + 1, 10 * rank]]))
    return stats.window().tolist()


def test_window_sums_over_the_group():
    assert run_ranks(_group_window, 2, timeout=60) == [[[3, 10]]] * 2


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_round_trips(tmp_path, suffix):
    load = torch.tensor([[5, 0, 9, 1], [2, 2, 2, 2]])
    save_expert_stats(tmp_path / f"s{suffix}", load, steps=42, layer_ids=[1, 3])
    got = load_expert_location(tmp_path / f"s{suffix}", 2, 4, layer_ids=[1, 3])
    assert isinstance(got, ExpertStatsFile)
    assert torch.equal(got.load_LE, load) and got.steps == 42 and got.layer_ids == (1, 3)

    phy2log, _, _ = rebalance_experts(load, 8, 2, 2, 4)
    save_placement(tmp_path / f"p{suffix}", phy2log)
    got = load_expert_location(tmp_path / f"p{suffix}", 2, 4, num_physical=8)
    assert isinstance(got, ExpertPlacementFile)
    assert torch.equal(got.phy2log_LP, phy2log) and got.layer_ids is None
    # without num_physical any P >= E is accepted
    assert isinstance(load_expert_location(tmp_path / f"p{suffix}", 2, 4), ExpertPlacementFile)


def test_stats_file_is_readable_json(tmp_path):
    save_expert_stats(tmp_path / "s.json", torch.tensor([[1, 2]]), steps=3)
    record = json.loads((tmp_path / "s.json").read_text())
    assert record == {"format": "moeserve.expert_stats", "version": 1, "steps": 3, "load": [[1, 2]]}


def _write_json(path, **record):
    path.write_text(json.dumps({"version": 1, **record}))
    return path


@pytest.mark.parametrize(
    "record, kwargs, match",
    [
        (dict(format="moeserve.expert_stats", load=[[1, 2, 3, 4]]), {}, r"stats of shape \(1, 4\)"),
        (dict(format="moeserve.expert_stats", load=[[1, -2]]), dict(num_experts=2), "negative"),
        (dict(format="moeserve.expert_stats", load=[[1.5, 2]]), dict(num_experts=2), "integers"),
        (dict(format="moeserve.expert_stats", load=[[1, 2], [3]]), {}, "rectangular"),
        (dict(format="moeserve.expert_stats"), {}, "without its 'load' table"),
        (dict(format="sglang", load=[[1, 2]]), {}, "neither"),
        (dict(format="moeserve.expert_placement", phy2log=[[0, 1, 1]]), {}, "no physical slot"),
        (dict(format="moeserve.expert_placement", phy2log=[[0, 1, 2, 5]]), {}, "outside"),
        (
            dict(format="moeserve.expert_placement", phy2log=[[0, 1, 2, 0]]),
            dict(num_physical=6),
            r"placement of shape \(1, 4\).*\(1, 6\)",
        ),
        (
            dict(format="moeserve.expert_placement", phy2log=[[0, 1], [1, 0]]),
            {},
            r"placement of shape \(2, 2\)",
        ),
        (
            dict(format="moeserve.expert_stats", load=[[1, 2]], layer_ids=[5]),
            dict(num_experts=2, layer_ids=[4]),
            r"model layers \[5\]",
        ),
    ],
)
def test_load_errors(tmp_path, record, kwargs, match):
    path = _write_json(tmp_path / "f.json", **record)
    args = dict(num_layers=1, num_experts=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        load_expert_location(path, **args)


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_expert_location(tmp_path / "missing.json", 1, 2)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_expert_location(tmp_path / "bad.json", 1, 2)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_expert_location(tmp_path / "bad.safetensors", 1, 2)
    (tmp_path / "x.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.json or \.safetensors"):
        load_expert_location(tmp_path / "x.pt", 1, 2)
    _write_json(tmp_path / "v.json", format="moeserve.expert_stats", load=[[1, 2]])
    (tmp_path / "v.json").write_text(
        (tmp_path / "v.json").read_text().replace('"version": 1', '"version": 9')
    )
    with pytest.raises(ValueError, match="version"):
        load_expert_location(tmp_path / "v.json", 1, 2)
    with pytest.raises(ValueError, match=r"\.json or \.safetensors"):
        save_expert_stats(tmp_path / "s.pickle", torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        save_expert_stats(tmp_path / "s.json", torch.zeros(1, 2))
    with pytest.raises(ValueError, match="layer ids"):
        save_placement(tmp_path / "p.json", torch.zeros(1, 2, dtype=torch.int64), layer_ids=[1, 2])
