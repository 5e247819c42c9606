"""The engine's side of serving: delta outputs without detokenization, samples finished by
the caller, and the stats the server exports."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from moeserve.demo import TINY_CONFIG, tiny_model_path

PROMPT = [5, 17, 33, 60, 101, 7, 250]


@pytest.fixture(scope="module")
def engine():
    llm = LLM(model=str(tiny_model_path()), max_model_len=256, progress=False)
    return llm.engine


def _run(engine, request_id, params, prompt=PROMPT):
    engine.add_request(request_id, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def test_delta_outputs_add_up_to_the_cumulative_ones(engine):
    kw = dict(max_tokens=9, temperature=0.9, seed=3, n=2, logprobs=2, ignore_eos=True)
    cumulative = _run(engine, "c", SamplingParams(**kw))[-1]
    deltas = _run(engine, "d", SamplingParams(**kw, output_kind="delta", detokenize=False))
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for i in range(2):
        parts = [c for o in deltas for c in o.outputs if c.index == i]
        assert sum((c.token_ids for c in parts), []) == cumulative.outputs[i].token_ids
        assert all(c.text == "" for c in parts)  # detokenize=False: the caller decodes
        logprobs = sum((c.logprobs for c in parts), [])
        assert [sorted(p) for p in logprobs] == [sorted(p) for p in cumulative.outputs[i].logprobs]
        assert [c.finish_reason for c in parts][-1] == "length"
        assert all(c.finish_reason is None for c in parts[:-1])
    metrics = deltas[-1].metrics
    assert metrics["queue_time"] >= 0 and metrics["first_token_time"] >= metrics["arrival_time"]


def test_final_output_kind_sends_one_output(engine):
    outs = _run(engine, "f", SamplingParams(max_tokens=5, ignore_eos=True, output_kind="final"))
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 5


def test_finish_sample_frees_its_blocks_and_reports_it(engine):
    params = SamplingParams(
        max_tokens=200, ignore_eos=True, n=2, output_kind="delta", detokenize=False
    )
    engine.add_request("s", PROMPT, params)
    for _ in range(3):
        engine.step()
    used = engine.scheduler.block_manager.num_free_blocks
    engine.finish_sample("s", 0, "the stop")
    assert engine.scheduler.block_manager.num_free_blocks > used  # freed at once
    out = [o for o in engine.step() if o.request_id == "s"][0]
    first = [c for c in out.outputs if c.index == 0]
    assert first[0].finish_reason == "stop" and first[0].stop_reason == "the stop"
    assert not out.finished
    engine.finish_sample("s", 1)
    engine.finish_sample("s", 1)  # twice: ignored
    engine.finish_sample("nope", 0)  # unknown: ignored
    assert engine.has_unfinished_requests()  # the finish is still to be reported
    outs = engine.step()
    assert [o.finished for o in outs if o.request_id == "s"] == [True]
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()


def test_stats_count_routed_tokens(engine):
    before = engine.stats()
    outs = _run(
        engine,
        "st",
        SamplingParams(max_tokens=6, ignore_eos=True),
        prompt=[9, 8, 7, 6, 5, 4, 3, 2, 11, 12, 13],
    )
    after = engine.stats()
    cached = outs[-1].num_cached_tokens
    computed = 11 - cached + 6 - 1
    moe_layers = range(TINY_CONFIG["first_k_dense_replace"], TINY_CONFIG["num_hidden_layers"])
    assert sorted(after["expert_counts"]) == list(moe_layers)
    top_k = TINY_CONFIG["num_experts_per_tok"]
    for layer in moe_layers:
        grew = sum(after["expert_counts"][layer]) - sum(before["expert_counts"][layer])
        assert grew == top_k * computed
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 11
    assert after["integrity"] == "ok"
    assert after["num_running"] == after["num_waiting"] == 0


def test_delta_text_never_shows_what_a_stop_string_takes_back(engine):
    full = _run(engine, "t0", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = full[-1].outputs[0].text
    at = next(i for i in range(3, len(text) - 4) if text.find(text[i : i + 4]) == i)
    stop = text[at : at + 4]
    params = SamplingParams(
        max_tokens=30, temperature=0, ignore_eos=True, stop=stop, output_kind="delta"
    )
    deltas = _run(engine, "t1", params)
    assert "".join(c.text for o in deltas for c in o.outputs) == text[:at]
    assert deltas[-1].outputs[-1].finish_reason == "stop"
