"""The API server's pure pieces: the engine link's messages, text tracking with stop
strings, logprob shapes, error locations, request checks, merged group stats."""

from __future__ import annotations

import pytest

from moeserve.core import CompletionOutput, Logprob, RequestOutput, SamplingParams
from moeserve.demo import tiny_model_path
from moeserve.distributed.parallel_dims import ParallelDims
from moeserve.launch.group_stats import merge_stats
from moeserve.serving import messages as m
from moeserve.serving.errors import APIError, _field
from moeserve.serving.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from moeserve.serving.outputs import RequestTracker
from moeserve.serving.protocol import CompletionRequest
from moeserve.serving.sampling import ModelDefaults, build_params, max_tokens_for
from moeserve.text_tracker import TextOptions
from moeserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_path())


def test_messages_round_trip_and_refuse_strangers():
    params = SamplingParams(n=2, stop=("x",), seed=5, output_kind="delta", detokenize=False)
    out = RequestOutput(
        "r",
        None,
        [1, 2],
        [CompletionOutput(0, "", [3], None, [{3: Logprob(-0.5, 1)}], "stop", "x")],
        True,
        metrics={"queue_time": 0.25},
    )
    for msg in (
        m.AddRequest("r", [1, 2, 3], params),
        m.AbortRequests(["a", "b"]),
        m.FinishSample("r", 1, "x"),
        m.Call(7, "stats"),
        m.Shutdown(),
        m.Ready(2048, 512, "DeepseekV3ForCausalLM", 2, 2, 64),
        m.AddResult("r", "queue_full", "full"),
        m.StepOutputs([out]),
        m.CallResult(7, {"a": [1]}),
        m.StatsSnapshot({"replicas": [{"num_running": 1}], "expert_counts": {"1": [2]}}, 3),
        m.EngineDead("boom"),
    ):
        assert m.decode(m.encode(msg)) == msg
    for frame in (b"not json", b'{"type": "Pickle"}', b'{"type": "Shutdown", "x": 1}', b"[]"):
        with pytest.raises(m.MessageError):
            m.decode(frame)


def _out(index, ids, finish=None, stop_reason=None):
    return RequestOutput(
        "r",
        None,
        [],
        [CompletionOutput(index, "", ids, None, None, finish, stop_reason)],
        finish is not None,
    )


def test_tracker_cuts_at_a_stop_string_split_across_outputs(tok):
    ids = tok.encode("the expert said hello there", add_special_tokens=False)
    tracker = RequestTracker(tok, [0], 1, TextOptions(stop=("said h",)))
    texts, finished = [], None
    for t in ids:
        (delta,) = tracker.update(_out(0, [t]))
        texts.append(delta.text)
        if delta.finish_reason:
            finished = delta
            break
    assert "".join(texts) == "the expert "
    assert finished.stop_found and finished.stop_reason == "said h"
    # no text was shown that the stop string later took back
    assert all("said" not in t for t in texts)
    assert tracker.finished
    assert tracker.update(_out(0, [5])) == []  # a token the engine made before it heard


def test_tracker_include_stop_min_tokens_and_engine_finish(tok):
    ids = tok.encode("ab ab ab", add_special_tokens=False)
    opts = TextOptions(stop=("ab",), include_stop_str_in_output=True, min_tokens=2)
    tracker = RequestTracker(tok, [0], 1, opts)
    text = ""
    for t in ids:
        (d,) = tracker.update(_out(0, [t]))
        text += d.text
        if d.finish_reason:
            break
    assert text.endswith("ab") and len(tracker.samples[0].token_ids) >= 2
    tracker = RequestTracker(tok, [0], 2, TextOptions())
    (d,) = tracker.update(_out(1, ids, "length"))
    assert d.text == "ab ab ab" and d.finish_reason == "length" and not tracker.finished


def test_token_texts_give_exact_bytes_of_partial_characters(tok):
    texts = TokenTexts(tok)
    ids = tok.encode("héllo →", add_special_tokens=False)
    raw = b"".join(bytes(texts.get(t)[1]) for t in ids)
    assert raw.decode() == "héllo →"
    partial = [t for t in ids if texts.get(t)[0].startswith("bytes:")]
    for t in partial:
        assert texts.get(t)[0] == "bytes:" + "".join(f"\\x{b:02x}" for b in texts.get(t)[1])
    eos = tok.eos_token_id
    assert texts.get(eos)[0] == tok.eos_token and texts.visible_len(eos) == 0


def test_logprob_shapes(tok):
    texts = TokenTexts(tok)
    entry = {5: Logprob(-0.1, 1), 6: Logprob(-2.0, 2), 7: Logprob(-3.0, 3)}
    chosen = {6: Logprob(-2.0, 2), 5: Logprob(-0.1, 1)}
    (c,) = chat_logprobs([6], [chosen], 1, texts)
    assert c.logprob == -2.0 and [t.logprob for t in c.top_logprobs] == [-0.1]
    lp = completion_logprobs([5, 6], [None, entry], 2, texts, 10)
    assert lp.token_logprobs == [None, -2.0] and lp.top_logprobs[0] is None
    assert lp.text_offset == [10, 10 + len(texts.get(5)[0])]
    assert len(lp.top_logprobs[1]) == 2
    inf = completion_logprobs([5], [{5: Logprob(float("-inf"), 1)}], 0, texts, 0)
    assert inf.token_logprobs == [-3.0e38]


def test_error_locations_name_the_field():
    assert _field(("body", "temperature")) == "temperature"
    assert _field(("body", "messages", 0, "content")) == "messages[0].content"
    assert _field(("body", "prompt", "list[int]", 3)) == "prompt[3]"
    assert _field(("body",)) is None
    err = APIError(503, "full", headers={"Retry-After": "1"})
    assert err.body()["error"]["type"] == "ServiceUnavailableError"
    assert err.response().headers["retry-after"] == "1"


def test_context_checks_and_params():
    with pytest.raises(APIError) as e:
        max_tokens_for(None, 100, 100, "prompt", "max_tokens")
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        max_tokens_for(10, 95, 100, "prompt", "max_tokens")
    assert e.value.param == "max_tokens"
    assert max_tokens_for(None, 60, 100, "prompt", "max_tokens") == 40
    req = CompletionRequest(prompt="x", stop="##", top_k=0, seed=-3, min_tokens=50)
    params, opts = build_params(req, ModelDefaults(temperature=0.6), 8, logprobs=None)
    assert params.temperature == 0.6 and params.top_k == -1 and params.min_tokens == 8
    assert params.stop == () and opts.stop == ("##",)  # stop strings stay in the API server
    assert params.output_kind == "delta" and not params.detokenize


def test_model_defaults_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_k": 20}')
    d = ModelDefaults.from_model_dir(tmp_path)
    assert (d.temperature, d.top_k, d.top_p) == (0.3, 20, 1.0)
    assert ModelDefaults.from_model_dir(tmp_path / "missing") == ModelDefaults()


def test_merge_stats_sums_replicas_and_reports_failures():
    dims = ParallelDims(tp=2, dp=2, pp=1, enable_expert_parallel=True)

    def rank(running, counts, integrity="ok"):
        return {
            "num_running": running,
            "num_waiting": 1,
            "num_preemptions": 0,
            "kv_cache_usage": 0.5,
            "num_blocks": 10,
            "num_free_blocks": 5,
            "num_cached_blocks": 1,
            "prefix_cache_queries": 4,
            "prefix_cache_hits": 2,
            "expert_counts": {"1": counts},
            "integrity": integrity,
        }

    per_rank = [rank(3, [1, 0]), rank(3, [0, 2]), rank(1, [4, 4], "bad"), rank(1, [1, 1])]
    st = merge_stats(per_rank, dims)
    assert st["num_running"] == 4 and st["num_waiting"] == 2
    assert st["expert_counts"] == {1: [6, 7]}  # every EP rank routes its own rows
    assert st["integrity"] == "rank 2: bad"
    assert [r["num_running"] for r in st["replicas"]] == [3, 1]
    assert st["kv_cache_usage"] == 0.5
    # stats taken without the self-check (the snapshots) merge without an integrity verdict
    unchecked = [{k: v for k, v in r.items() if k != "integrity"} for r in per_rank]
    assert "integrity" not in merge_stats(unchecked, dims)
