"""GQA KV between different tensor-parallel splits (``disagg/regroup.py``): the routes the
prefill and decode sides agree on; GATHER (prefill TP1 -> decode TP2) and PACK (prefill TP2 ->
decode TP1) against ``layout.copy_reference``, first with ``ctypes.memmove`` over random block
tables, then through real ranks (``KVRank``) and real Mooncake over TCP on 127.0.0.1, 50
rounds each way, every byte in place once the batches read "done"; the prefill control's
assignment of writers and the decode control's unpack command."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from moeserve.config import DisaggregationOptions
from moeserve.demo import tiny_model_path
from moeserve.disagg import bootstrap as b
from moeserve.disagg import regroup
from moeserve.disagg.connector import RankInfo
from moeserve.disagg.decode import DecodeControl, _Pending
from moeserve.disagg.layout import GQA, PoolLayout, copy_reference
from moeserve.disagg.mooncake import DONE, FAILED
from moeserve.disagg.prefill import PrefillControl
from tests.unit.disagg.test_layout import Pool, execute

HEADS = 4  # the model's KV heads; TP2 ranks hold 2 each, TP4 ranks 1
TP1, TP2, TP4 = [(0, 4)], [(0, 2), (2, 2)], [(0, 1), (1, 1), (2, 1), (3, 1)]


def pools(ranges, num_blocks: int, block_size: int, seed: int) -> list[Pool]:
    return [
        Pool(GQA, num_blocks, block_size, heads=(a, a + n), seed=seed + i)
        for i, (a, n) in enumerate(ranges)
    ]


def table(rng: random.Random, num_blocks: int, need: int, fragmented: bool) -> list[int]:
    if fragmented:
        return rng.sample(range(num_blocks), need)
    start = rng.randrange(num_blocks - need + 1)
    return list(range(start, start + need))


def layout_of(a: int, n: int) -> PoolLayout:
    return Pool(GQA, 1, 4, heads=(a, a + n)).layout


# -- routes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, how, used",
    [
        (TP2, (0, 2), regroup.SLOTS, [(0, 2)]),
        (TP1, (2, 2), regroup.GATHER, [(0, 4)]),
        (TP2, (3, 1), regroup.GATHER, [(2, 2)]),
        (TP2, (0, 4), regroup.PACK, [(0, 2), (2, 2)]),
        (TP4, (2, 2), regroup.PACK, [(2, 1), (3, 1)]),
        (TP4 + TP1, (2, 2), regroup.GATHER, [(0, 4)]),
    ],
)
def test_route(src, dst, how, used):
    assert regroup.route(layout_of(*dst), src) == (how, used)


def test_heads_neither_covered_nor_tiled_are_refused():
    with pytest.raises(ValueError, match=r"no prefill rank holds or tiles .* \[0, 4\)"):
        regroup.route(layout_of(0, 4), [(0, 2)])
    with pytest.raises(ValueError, match="holds or tiles"):
        regroup.route(layout_of(1, 2), TP2)  # each source holds only part of [1, 3)


# -- the plans, with memmove ------------------------------------------------------------------


def run_gather(src: Pool, dst: Pool, src_table, dst_table, n: int) -> int:
    out = torch.empty(regroup.staging_shape(src.layout, dst.layout, n))
    regroup.gather(src.caches, src.layout, dst.layout, src_table, n, out)
    writes = regroup.plan_gathered_writes(out.data_ptr(), dst.layout, dst_table, n)
    execute(writes)
    return len(writes)


@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("src_bs, dst_bs", [(4, 4), (4, 8), (8, 2)])
def test_gather_then_runs_equal_the_reference(fragmented, src_bs, dst_bs):
    """Prefill TP1 -> decode TP2 and TP4: each decode pool gets its heads from the one
    prefill pool, gathered and written as runs of slots."""
    rng = random.Random(src_bs * 10 + dst_bs + fragmented)
    for dst_ranges in (TP2, TP4):
        for n in (1, 5, 17, 40):
            [src] = pools(TP1, 16, src_bs, 1)
            dsts = pools(dst_ranges, 24, dst_bs, 50)
            src_table = table(rng, 16, -(-n // src_bs), fragmented)
            dst_table = table(rng, 24, -(-n // dst_bs), fragmented)
            for dst in dsts:
                want = dst.clone()
                copy_reference(src.caches, want, src.layout, dst.layout, src_table, dst_table, n)
                num_writes = run_gather(src, dst, src_table, dst_table, n)
                assert all(torch.equal(g, w) for g, w in zip(dst.caches, want))
                # runs of consecutive slots x layers, not tokens; one per layer at best
                assert num_writes <= 3 * len(dst_table)
                if not fragmented:
                    assert num_writes == 3


def run_pack(srcs: list[Pool], dst: Pool, src_table, dst_table, n: int, ranges) -> int:
    num_writes = 0
    for src in srcs:
        writes = regroup.plan_packed_writes(src.layout, dst.layout, src_table, dst_table, n)
        execute(writes)
        num_writes += len(writes)
    regroup.unpack(dst.caches, dst.layout, ranges, dst_table, n)
    return num_writes


@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("src_bs, dst_bs", [(4, 4), (4, 8), (8, 2), (3, 5)])
def test_packed_streams_unpacked_equal_the_reference(fragmented, src_bs, dst_bs):
    """Prefill TP2 and TP4 -> decode TP1, TP4 -> TP2: every source writes its slots as one
    stream into the decode blocks; the decode side unpacks them into place."""
    rng = random.Random(src_bs * 10 + dst_bs + fragmented)
    for src_ranges, dst_ranges in ((TP2, TP1), (TP4, TP1), (TP4, TP2)):
        for n in (1, 5, 17, 40):
            srcs = pools(src_ranges, 16, src_bs, 1)
            src_table = table(rng, 16, -(-n // src_bs), fragmented)
            for dst in pools(dst_ranges, 24, dst_bs, 50):
                dst_table = table(rng, 24, -(-n // dst_bs), fragmented)
                want = dst.clone()
                lo, hi = dst.layout.head_start, dst.layout.head_start + dst.layout.num_heads
                feeding = [s for s in srcs if lo <= s.layout.head_start < hi]
                for src in feeding:
                    copy_reference(
                        src.caches, want, src.layout, dst.layout, src_table, dst_table, n
                    )
                num_writes = run_pack(feeding, dst, src_table, dst_table, n, src_ranges)
                assert all(torch.equal(g, w) for g, w in zip(dst.caches, want))
                if not fragmented:  # one write per layer and source
                    assert num_writes == 3 * len(feeding)


def test_unpack_leaves_whole_slots_alone():
    """Only a PACK route is unpacked: the same split, or a covering source, moved whole."""
    [dst] = pools(TP2[:1], 4, 4, 3)
    before = dst.clone()
    regroup.unpack(dst.caches, dst.layout, TP2, [0, 1], 6)
    regroup.unpack(dst.caches, dst.layout, TP1, [0, 1], 6)
    assert all(torch.equal(g, w) for g, w in zip(dst.caches, before))


# -- controls ---------------------------------------------------------------------------------


def infos(ranges) -> list[RankInfo]:
    return [
        RankInfo(i, 0, i, f"127.0.0.1:{9000 + i}", layout_of(a, n).to_json())
        for i, (a, n) in enumerate(ranges)
    ]


def targets(ranges) -> list[dict]:
    return [i.target for i in infos(ranges)]


def test_prefill_assigns_writers_for_every_split():
    n = 10
    head_bytes = 3 * 4  # test_layout's head_dim, float32
    per_token = 2 * head_bytes * 3  # K and V, 3 layers
    # the same split: each decode rank from its twin
    assert PrefillControl._assign(infos(TP2), targets(TP2), n) == (
        {0: [0], 1: [1]},
        n * per_token * 4,
        None,
    )
    # TP1 -> TP2: the one prefill rank gathers for both
    assert PrefillControl._assign(infos(TP1), targets(TP2), n) == (
        {0: [0, 1]},
        n * per_token * 4,
        None,
    )
    # TP2 -> TP1: both write packed, and the decode side hears their heads
    assert PrefillControl._assign(infos(TP2), targets(TP1), n) == (
        {0: [0], 1: [0]},
        n * per_token * 4,
        [[0, 2], [2, 2]],
    )


def test_decode_unpacks_before_the_last_token_runs():
    options = DisaggregationOptions(mode="decode")
    control = DecodeControl(options, infos(TP1), str(tiny_model_path()))
    try:
        peer = ("127.0.0.1", 1)
        for room, sources in ((1, [[0, 2], [2, 2]]), (2, None), (3, [[0, 1]])):
            control.pending[room] = _Pending(f"r{room}", peer, 1e9, 0.0, 0, 4)
            msg = {"op": b.DONE, "room": room}
            if sources is not None:
                msg["sources"] = sources
            control._on_message(peer, msg, 1.0)
        assert control._cmds["unpack"] == [["r1", [[0, 2], [2, 2]]]]
        assert control._cmds["arrived"] == ["r1", "r2"]
        [[rid, reason, error, late]] = control._cmds["release"]  # [0, 1) tiles nothing
        assert rid == "r3" and reason == "abort" and "cannot unpack" in error and not late
    finally:
        control.close()


# -- real ranks, real Mooncake ----------------------------------------------------------------

ROUNDS = 50
NUM_BLOCKS, BLOCK_SIZE = 24, 4


class StubScheduler:
    """What ``KVRank`` reads of a scheduler: parked sequences and the step's news."""

    def __init__(self) -> None:
        self.parked: dict[int, SimpleNamespace] = {}
        self.newly_parked: list = []
        self.newly_quarantined: list = []

    def park(self, request_id: str, blocks: list[int], num_tokens: int) -> None:
        self.parked = {
            0: SimpleNamespace(
                request_id=request_id, block_table=blocks, num_prompt_tokens=num_tokens + 1
            )
        }


def make_ranks(ranges, seed: int):
    from moeserve.disagg.rank import KVRank

    options = DisaggregationOptions(mode="prefill", host="127.0.0.1", transfer_timeout_s=30)
    out = []
    for i, pool in enumerate(pools(ranges, NUM_BLOCKS, BLOCK_SIZE, seed)):
        rank = KVRank(options, StubScheduler(), pool.layout, i, pool.caches)
        out.append((rank, pool))
    return out


def wait_done(ranks, room: int, timeout_s: float = 30) -> None:
    """Every writing rank reports the room's batches ended; all must be DONE."""
    deadline = time.monotonic() + timeout_s
    pending = {r.rank for r in ranks if room in r._batches}
    while pending:
        assert time.monotonic() < deadline, f"room {room}: batches stalled"
        for r in ranks:
            state = r.events().get("transfers", {}).get(str(room))
            if state is not None:
                assert state == DONE, f"room {room}: rank {r.rank}'s batch failed ({FAILED})"
                pending.discard(r.rank)
        time.sleep(0.0005)


@pytest.mark.parametrize(
    "src_ranges, dst_ranges", [(TP1, TP2), (TP2, TP1)], ids=["tp1-tp2", "tp2-tp1"]
)
def test_regrouped_kv_lands_whole_through_mooncake(src_ranges, dst_ranges):
    """50 prompts of random lengths and block tables through the ranks' real path (the
    prefill control's assignment, ``KVRank._send``, Mooncake over TCP, the decode control's
    unpack): when every batch reads done, every decode pool equals the reference."""
    pytest.importorskip("mooncake.engine")
    rng = random.Random(7)
    prefill, decode = make_ranks(src_ranges, 1), make_ranks(dst_ranges, 100)
    try:
        src_infos = [RankInfo(r.rank, 0, r.rank, **r.describe()) for r, _ in prefill]
        dst_targets = [r.describe() for r, _ in decode]
        for room in range(ROUNDS):
            n = rng.randint(1, 40)
            need = -(-n // BLOCK_SIZE)
            src_table = table(rng, NUM_BLOCKS, need, rng.random() < 0.5)
            dst_table = table(rng, NUM_BLOCKS, need, rng.random() < 0.5)
            for _, pool in prefill:  # new KV each round, so nothing passes by luck
                for c in pool.caches:
                    c.copy_(torch.randn_like(c))
            for _, pool in decode:
                for c in pool.caches:
                    c.fill_(float("nan"))
            writers, _, sources = PrefillControl._assign(src_infos, dst_targets, n)
            send = {
                "id": f"r{room}",
                "room": room,
                "blocks": dst_table,
                "num_tokens": n,
                "targets": dst_targets,
                "writers": {str(k): v for k, v in writers.items()},
            }
            for rank, _ in prefill:
                rank.scheduler.park(f"r{room}", src_table, n)
                rank.apply({"send": [send]})
            wait_done([r for r, _ in prefill], room)
            for rank, pool in decode:
                rank.scheduler.park(f"r{room}", dst_table, n)
                if sources is not None:
                    rank.apply({"unpack": [[f"r{room}", sources]]})
                want = [torch.full_like(c, float("nan")) for c in pool.caches]
                for _, src in prefill:
                    copy_reference(
                        src.caches, want, src.layout, pool.layout, src_table, dst_table, n
                    )
                for got, ref in zip(pool.caches, want):
                    assert torch.equal(got.nan_to_num(), ref.nan_to_num()), f"room {room}"
        for rank, _ in prefill:  # staging buffers come back and are reused, not piled up
            assert not rank._staged
            assert rank.staging.num_registered <= len(decode)  # one per target at most
            assert not rank.staging.retired
    finally:
        for rank, _ in prefill + decode:
            rank.close()
