"""Prefill/decode disaggregation end to end in one process: a prefill engine, a decode engine
and a colocated engine on the same checkpoint, stepped in turn, with real Mooncake transfers
over TCP and the real ZeroMQ bootstrap on 127.0.0.1. The decode engine's greedy tokens and
logprobs must equal the colocated engine's; every fault (a side that never comes, a side
that drops the request, a prefill instance that goes away, two sides that disagree) must end
the request with an error within the transfer timeout and leave every block free."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.core import KVTransferParams, RequestOutput, SamplingParams
from moeserve.demo import tiny_model_path
from moeserve.disagg import decode as decode_side
from moeserve.disagg.mooncake import FAILED, PENDING
from moeserve.engine.engine import LLMEngine
from tests.checkpoints import build_hf_model, save_hf_checkpoint

HOST = "127.0.0.1"
ENGINE = dict(
    dtype="float32",
    progress=False,
    num_threads=1,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=32,
)
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
FAST_TIMEOUT_S = 1.0  # the fault engines' transfer timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def engine(model: str, mode: str = "null", **kw) -> LLMEngine:
    if mode == "prefill":
        kw.setdefault("disaggregation_bootstrap_port", free_port())
    return LLMEngine(
        EngineConfig(
            model=model, **ENGINE, disaggregation_mode=mode, disaggregation_host=HOST, **kw
        )
    )


def port_of(prefill: LLMEngine) -> int:
    return prefill.config.disaggregation_bootstrap_port


_rooms = iter(range(1000, 1 << 30))


class Pair:
    """A prefill and a decode engine (and optionally a colocated one) on one checkpoint."""

    def __init__(self, model: str, colocated: bool = True, **kw) -> None:
        self.P = engine(model, "prefill", **kw)
        self.D = engine(model, "decode", **kw)
        self.C = engine(model) if colocated else None

    def engines(self) -> list[LLMEngine]:
        return [e for e in (self.P, self.D, self.C) if e is not None]

    def kv(self, prefill: LLMEngine | None = None) -> KVTransferParams:
        return KVTransferParams(HOST, port_of(prefill or self.P), next(_rooms))

    def add(self, rid: str, prompt: list[int], kv: KVTransferParams, **params) -> None:
        """The router's move: the same request to both sides, prefill first."""
        p = SamplingParams(**{**GREEDY, **params}, kv_transfer=kv)
        self.P.add_tokenized(rid, prompt, p)
        self.D.add_tokenized(rid, prompt, p)

    def close(self) -> None:
        for e in self.engines():
            e.shutdown()


def drive(
    engines: list[LLMEngine],
    timeout_s: float,
    until: Callable[[], bool] | None = None,
) -> list[dict[str, RequestOutput]]:
    """Step each engine in turn until ``until()`` (default: none has anything left, its
    connector included) and return each engine's finished outputs by request id. Fails after
    ``timeout_s``."""
    got: list[dict[str, RequestOutput]] = [{} for _ in engines]
    deadline = time.monotonic() + timeout_s
    while True:
        for e, out in zip(engines, got):
            for o in e.step():
                if o.finished:
                    out[o.request_id] = o
        if until() if until else not any(e.has_unfinished_requests() for e in engines):
            return got
        assert time.monotonic() < deadline, f"not done within {timeout_s}s"


def colocated(C: LLMEngine, prompts: dict[str, list[int]], **params) -> dict[str, RequestOutput]:
    for rid, prompt in prompts.items():
        C.add_tokenized(rid, prompt, SamplingParams(**{**GREEDY, **params}))
    return drive([C], 60)[0]


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.error is None, got.error
    assert len(got.outputs) == len(want.outputs)
    for a, b in zip(got.outputs, want.outputs):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            for tok in x:
                assert abs(x[tok].logprob - y[tok].logprob) < 1e-5
    if want.prompt_logprobs is not None:
        for x, y in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in y)


def assert_idle(*engines: LLMEngine) -> None:
    for e in engines:
        bm = e.scheduler.block_manager
        e.scheduler.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks, f"{e.kv_connector.role}: blocks held"
        assert not e.scheduler.quarantined and not e.scheduler.parked
        assert e.kv_connector is None or not e.kv_connector.has_pending()
        assert not e.has_unfinished_requests()


def assert_ended_at_once_on_prefill(out: RequestOutput) -> None:
    assert out.error is None and out.outputs[0].token_ids == []
    assert out.outputs[0].finish_reason == "length"


def assert_failed(out: RequestOutput, *reasons: str) -> None:
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.error and any(r in out.error for r in reasons), out.error


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    """Blocks a late write may still reach come back after 0.2 s instead of 2 s."""
    monkeypatch.setattr(decode_side, "LATE_WRITE_GRACE_S", 0.2)


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory) -> str:
    return str(save_hf_checkpoint(build_hf_model("qwen3_moe"), tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module", params=["demo", "qwen3_moe"])
def pair(request) -> Pair:
    """MLA (the demo DeepSeek-V3) and GQA (a tiny Qwen3-MoE)."""
    model = (
        str(tiny_model_path())
        if request.param == "demo"
        else request.getfixturevalue("qwen_checkpoint")
    )
    p = Pair(model)
    yield p
    p.close()


@pytest.fixture(scope="module")
def fast() -> Pair:
    """Demo engines whose transfers time out after FAST_TIMEOUT_S."""
    p = Pair(
        str(tiny_model_path()),
        colocated=False,
        disaggregation_transfer_timeout_s=FAST_TIMEOUT_S,
    )
    yield p
    p.close()


# -- parity -----------------------------------------------------------------------------------


def test_decode_tokens_and_logprobs_equal_the_colocated_engine(pair):
    rng = random.Random(0)
    long = tokens(rng, 90)  # three chunks of 32 on the prefill side
    prompts = {
        "short": tokens(rng, 5),
        "two": tokens(rng, 2),  # one token of KV moves
        "aligned": tokens(rng, 33),  # 32 tokens of KV: two whole blocks
        "long": long,
    }
    want = colocated(pair.C, prompts)
    for rid, prompt in prompts.items():  # all in flight at once
        pair.add(rid, prompt, pair.kv())
    hits = pair.P.scheduler.block_manager.prefix_cache_hits
    got_p, got_d = drive([pair.P, pair.D], 60)
    for rid in prompts:
        assert_same(got_d[rid], want[rid])
        assert_ended_at_once_on_prefill(got_p[rid])
    # a prompt sharing 48 tokens with "long": the prefill side computes only the rest
    shared = {"shared": long[:48] + tokens(rng, 11)}
    want = colocated(pair.C, shared)
    pair.add("shared", shared["shared"], pair.kv())
    got_p, got_d = drive([pair.P, pair.D], 60)
    assert_same(got_d["shared"], want["shared"])
    assert pair.P.scheduler.block_manager.prefix_cache_hits - hits == 48
    stats_p, stats_d = pair.P.stats()["disaggregation"], pair.D.stats()["disaggregation"]
    assert stats_p["transfers"] == stats_d["transfers"] >= 5
    assert stats_p["failures"] == stats_d["failures"] == 0
    assert stats_p["bytes"] == stats_d["bytes"] > 0
    assert_idle(*pair.engines())


def test_what_the_decode_side_must_compute_falls_back_there(pair):
    """A one-token prompt, prompt logprobs, n=2: the prefill side ends such a request at once
    with no token; the decode side computes all of it as a colocated engine would."""
    rng = random.Random(1)
    cases = {
        "one": ([42], {}),
        "prompt_lp": (tokens(rng, 20), dict(prompt_logprobs=1)),
        "n2": (tokens(rng, 20), dict(n=2)),
    }
    for rid, (prompt, params) in cases.items():
        pair.add(rid, prompt, pair.kv(), **params)
    [got_p] = drive([pair.P], 5, until=lambda: True)  # one step
    got_d = drive([pair.D], 60)[0]
    for rid, (prompt, params) in cases.items():
        assert_ended_at_once_on_prefill(got_p[rid])
        assert_same(got_d[rid], colocated(pair.C, {rid: prompt}, **params)[rid])
    assert not pair.D.scheduler.num_parked
    assert_idle(*pair.engines())


def test_a_room_in_use_on_the_prefill_side_is_refused(pair):
    kv = pair.kv()
    params = SamplingParams(**GREEDY, kv_transfer=kv)
    pair.P.add_tokenized("first", [5, 6, 7], params)
    with pytest.raises(ValueError, match=f"bootstrap_room {kv.room} is already in use"):
        pair.P.add_tokenized("second", [5, 6, 7], params)
    # a request id in use is refused before its room is taken
    other = SamplingParams(**GREEDY, kv_transfer=pair.kv())
    with pytest.raises(ValueError, match="request id 'first' is already in use"):
        pair.P.add_tokenized("first", [5, 6, 7], other)
    assert set(pair.P.kv_connector.control.rooms) == {kv.room}
    pair.D.add_tokenized("first", [5, 6, 7], params)
    got_p, got_d = drive([pair.P, pair.D], 30)
    assert got_d["first"].error is None and len(got_d["first"].outputs[0].token_ids) == 6
    assert_idle(*pair.engines())


# -- faults -----------------------------------------------------------------------------------


def test_a_want_nobody_answers_fails_within_the_timeout(fast):
    """No request with that room ever reaches the prefill side."""
    fast.D.add_tokenized("lonely", [5, 6, 7, 8], SamplingParams(**GREEDY, kv_transfer=fast.kv()))
    t0 = time.monotonic()
    _, got_d = drive([fast.P, fast.D], 5, until=lambda: not fast.D.scheduler.has_unfinished())
    assert time.monotonic() - t0 < FAST_TIMEOUT_S + 1
    assert_failed(got_d["lonely"], "no KV from the prefill instance", "got no request")
    drive([fast.P, fast.D], 5)  # the blocks come back once no late write can reach them
    assert_idle(fast.P, fast.D)


def test_a_prefill_request_nobody_asks_for_fails_within_the_timeout(fast):
    kv = fast.kv()
    fast.P.add_tokenized("unasked", [5, 6, 7, 8], SamplingParams(**GREEDY, kv_transfer=kv))
    t0 = time.monotonic()
    [got_p] = drive([fast.P], 5)
    assert time.monotonic() - t0 < FAST_TIMEOUT_S + 1
    assert_failed(got_p["unasked"], f"no decode instance asked for bootstrap_room {kv.room}")
    assert_idle(fast.P, fast.D)


def test_a_decode_side_abort_while_parked_is_cancelled_on_both_sides(fast):
    fast.add("dropped", [5, 6, 7, 8, 9], fast.kv())
    fast.D.step()  # parked, the want sent
    fast.D.abort_request("dropped")
    fast.D.step()  # the cancel sent
    time.sleep(0.2)  # the want and the cancel reach the prefill side before it steps
    got_p, got_d = drive([fast.P, fast.D], 5)
    assert_failed(got_p["dropped"], "the decode instance dropped the request")
    assert "dropped" not in got_d  # an aborted request reports nothing
    assert_idle(fast.P, fast.D)
    # a cancel that comes before the prefill side's request: the request is refused
    kv = fast.kv()
    fast.D.add_tokenized("early", [5, 6, 7], SamplingParams(**GREEDY, kv_transfer=kv))
    fast.D.step()
    fast.D.abort_request("early")
    drive([fast.P, fast.D], 5, until=lambda: kv.room in fast.P.kv_connector.control.cancelled)
    with pytest.raises(ValueError, match=f"already dropped bootstrap_room {kv.room}"):
        fast.P.add_tokenized("early", [5, 6, 7], SamplingParams(**GREEDY, kv_transfer=kv))
    drive([fast.P, fast.D], 5)
    assert_idle(fast.P, fast.D)


def hold_transfers(monkeypatch, prefill: LLMEngine) -> list[bool]:
    """Make the prefill side's batches look in flight while ``held[0]`` is True."""
    transport = prefill.kv_connector.rank.transport
    status = transport.status
    held = [True]
    monkeypatch.setattr(transport, "status", lambda b: PENDING if held[0] else status(b))
    return held


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_an_abort_while_the_kv_is_on_the_wire_frees_both_sides(fast, monkeypatch, side):
    """The request is dropped on one side while its batch runs: both sides keep the blocks
    until the batch has ended (and, over TCP, a grace period for its bytes to land), then
    free them; the other side's request ends with an error."""
    held = hold_transfers(monkeypatch, fast.P)
    kv = fast.kv()
    fast.add("wire", [5, 6, 7, 8, 9, 10], kv)
    drive([fast.P, fast.D], 5, until=lambda: kv.room in fast.P.kv_connector.control.transfers)
    (fast.D if side == "decode" else fast.P).abort_request("wire")
    drive(
        [fast.P, fast.D], 5, until=lambda: fast.P.kv_connector.control.transfers[kv.room].abandoned
    )
    held[0] = False
    got_p, got_d = drive([fast.P, fast.D], 5)
    if side == "decode":
        assert_failed(got_p["wire"], "the decode instance dropped the request")
    else:
        assert_failed(got_d["wire"], "the prefill instance dropped the request")
    assert_idle(fast.P, fast.D)


def test_a_failed_batch_fails_both_sides_and_the_decode_side_waits_out_late_writes(
    fast, monkeypatch
):
    monkeypatch.setattr(fast.P.kv_connector.rank.transport, "status", lambda handle: FAILED)
    fast.add("broken", [5, 6, 7, 8, 9], fast.kv())
    got_p, got_d = drive([fast.P, fast.D], 5, until=lambda: not fast.D.scheduler.has_unfinished())
    reason = "the KV transfer failed (the decode instance is unreachable or gone)"
    assert_failed(got_p["broken"], reason)
    assert_failed(got_d["broken"], reason)
    # over TCP the writes that finished may still be landing: the blocks wait in quarantine
    assert fast.D.scheduler.quarantined and fast.D.kv_connector.control.late
    drive([fast.P, fast.D], 5)
    assert_idle(fast.P, fast.D)


def test_a_prefill_instance_that_goes_away_fails_its_rooms(pair):
    """Closed while the decode side waits: the bootstrap connection drops and the room
    fails at once, long before the transfer timeout."""
    gone = engine(pair.P.config.model, "prefill")
    kv = pair.kv(gone)
    pair.D.add_tokenized("gone", [5, 6, 7, 8], SamplingParams(**GREEDY, kv_transfer=kv))
    drive([gone, pair.D], 5, until=lambda: kv.room in gone.kv_connector.control.wants)
    gone.shutdown()
    t0 = time.monotonic()
    [got_d] = drive([pair.D], 5, until=lambda: not pair.D.scheduler.has_unfinished())
    assert time.monotonic() - t0 < 1
    assert pair.D.config.disaggregation_transfer_timeout_s > 10
    assert_failed(got_d["gone"], f"the prefill instance at {HOST}:{port_of(gone)} disconnected")
    # a request paired with it after the drop (the router had not noticed yet): refused at
    # once instead of waiting out the transfer timeout
    again = KVTransferParams(HOST, kv.port, next(_rooms))
    pair.D.add_tokenized("late", [5, 6, 7, 8], SamplingParams(**GREEDY, kv_transfer=again))
    t0 = time.monotonic()
    [got_d] = drive([pair.D], 5, until=lambda: not pair.D.scheduler.has_unfinished())
    assert time.monotonic() - t0 < 1
    assert_failed(got_d["late"], f"the prefill instance at {HOST}:{port_of(gone)} is not reachable")
    # its blocks free at once ("gone"'s wait out the late-write grace)
    assert [q.request_id for q in pair.D.scheduler.quarantined.values()] == ["gone"]
    drive([pair.D], 5)
    assert_idle(pair.D)


def test_a_prefill_instance_that_never_listened_times_out(fast):
    kv = KVTransferParams(HOST, free_port(), next(_rooms))
    fast.D.add_tokenized("void", [5, 6, 7, 8], SamplingParams(**GREEDY, kv_transfer=kv))
    t0 = time.monotonic()
    [got_d] = drive([fast.D], 5, until=lambda: not fast.D.scheduler.has_unfinished())
    assert FAST_TIMEOUT_S <= time.monotonic() - t0 < FAST_TIMEOUT_S + 1
    assert_failed(got_d["void"], f"no KV from the prefill instance at {HOST}:{kv.port} within 1s")
    drive([fast.D], 5)
    assert_idle(fast.D)


@pytest.mark.parametrize("want_first", [False, True])
def test_a_decode_side_with_another_prompt_fails_on_both_sides(fast, want_first):
    """The same room, prompts of one length that differ before the last token (the decode
    side computes that one itself): the KV must not move."""
    kv = fast.kv()
    params = SamplingParams(**GREEDY, kv_transfer=kv)
    sent = fast.P.stats()["disaggregation"]["transfers"]
    if want_first:  # the want waits on the prefill side for its request
        fast.D.add_tokenized("other", [5, 6, 7, 8, 9], params)
        drive([fast.P, fast.D], 5, until=lambda: kv.room in fast.P.kv_connector.control.wants)
        fast.P.add_tokenized("other", [5, 6, 70, 8, 9], params)
    else:
        fast.P.add_tokenized("other", [5, 6, 70, 8, 9], params)
        fast.D.add_tokenized("other", [5, 6, 7, 8, 9], params)
    got_p, got_d = drive([fast.P, fast.D], 5)
    for out in (got_p["other"], got_d["other"]):
        assert_failed(out, "the prefill and decode instances tokenized the request differently")
    assert fast.P.stats()["disaggregation"]["transfers"] == sent
    assert_idle(fast.P, fast.D)


def test_another_checkpoint_on_the_decode_side_fails_on_both_sides(fast, tmp_path):
    model = shutil.copytree(tiny_model_path(), tmp_path / "demo")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "note": "another checkpoint"}))
    other = engine(str(model), "decode", disaggregation_transfer_timeout_s=FAST_TIMEOUT_S)
    kv = fast.kv()
    params = SamplingParams(**GREEDY, kv_transfer=kv)
    fast.P.add_tokenized("ckpt", [5, 6, 7, 8], params)
    other.add_tokenized("ckpt", [5, 6, 7, 8], params)
    got_p, got_d = drive([fast.P, other], 5)
    for out in (got_p["ckpt"], got_d["ckpt"]):
        assert_failed(out, "the prefill and decode instances serve different checkpoints")
    assert_idle(fast.P, other)
    other.shutdown()


@pytest.mark.slow
def test_under_load_the_decode_side_never_runs_on_kv_still_landing(monkeypatch):
    """160 transfers beside a busy core: at the moment each request is let run, its blocks
    hold the KV the prefill side computed. (When a batch of many writes looked done after its
    first write, a few in a hundred ran on KV still on its way, or on blocks the prefill side
    had reused already.)"""
    pair = Pair(str(tiny_model_path()), colocated=False)
    P, D = pair.P, pair.D
    sent: dict[int, list[torch.Tensor]] = {}
    start, arrived = P.kv_connector.control._start, D.scheduler.kv_arrived

    def slots(table: list[int], n: int) -> torch.Tensor:
        return torch.tensor([table[t // 16] * 16 + t % 16 for t in range(n)])

    def snapshot_then_start(room, now):
        r = P.kv_connector.control.rooms[room]
        idx = slots(r.blocks, r.num_tokens)
        sent[room] = [c[idx].clone() for c in P.kv_pool.caches]
        start(room, now)

    checked, stale = [], []

    def check_then_run(seq):
        room, idx = seq.params.kv_transfer.room, slots(seq.block_table, seq.num_prompt_tokens - 1)
        checked.append(room)
        if not all(torch.equal(c[idx], kv) for c, kv in zip(D.kv_pool.caches, sent[room])):
            stale.append(room)
        arrived(seq)

    monkeypatch.setattr(P.kv_connector.control, "_start", snapshot_then_start)
    monkeypatch.setattr(D.scheduler, "kv_arrived", check_then_run)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rng = random.Random(0)
        for wave in range(40):
            for i in range(4):
                pair.add(f"{wave}.{i}", tokens(rng, rng.randint(2, 90)), pair.kv())
            drive([P, D], 60)
    finally:
        hog.kill()
        hog.wait()
    assert len(checked) == 40 * 4
    assert not stale, f"{len(stale)} of {len(checked)} requests ran before their KV landed"
    assert_idle(P, D)
    pair.close()
