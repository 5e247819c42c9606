"""The text rules of ``moeserve/text_tracker.py`` through both paths that apply them: the offline
API (``LLM.generate``, and the engine's delta outputs for a stream) and the API server's
(``build_params``, ``Generation``, ``RequestTracker``, ``FinishSample``: ``tests/serving_path.py``).

The engines are the demo model's with a scripted runner, so a test knows every token and how
steps group them: ``plain`` samples one token a step; ``spec`` runs 3 speculative tokens whose
drafts are always right, so after the prefill every step appends 4 tokens. Every case expects
the same completion from both engines and both paths.
"""

from __future__ import annotations

import dataclasses

import pytest

from moeserve import LLM, SamplingParams
from moeserve.core import Logprob
from moeserve.demo import tiny_model_path
from moeserve.engine.codec import SeqStepOutput
from moeserve.text_tracker import TextOptions, TextStep, TextTracker, find_stop
from moeserve.tokenizer import Tokenizer
from tests.serving_path import Completion, serve_completion

K = 3  # speculative tokens of the spec engine
LOGPROB = -0.5  # every scripted token's logprob
PROMPT = [5, 17, 33, 60, 101, 7, 250]


class ScriptedRunner:
    """Stands in for the model runner: a sequence's next tokens are its prompt's script.

    With ``k`` speculative tokens it drafts the script's next ``k`` tokens, so a verifying
    step accepts every draft and appends ``k + 1`` tokens (the scheduler cuts them at a
    token-level stop)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.script: list[int] = []

    def run(self, batch) -> list[SeqStepOutput]:
        drafts = getattr(batch, "drafts", None) or [()] * len(batch.seqs)
        out = []
        for entry, verified in zip(batch.seqs, drafts, strict=True):
            if not entry.sample:
                out.append(SeqStepOutput())
                continue
            seq = entry.seq
            n = len(seq.output_token_ids)
            toks = self.script[n : n + 1 + len(verified)]
            assert list(verified) == toks[: len(verified)], "the drafts were the script"
            want_lp = seq.params.logprobs is not None
            lps = [{t: Logprob(LOGPROB, 1)} if want_lp else None for t in toks]
            end = n + len(toks)
            out.append(
                SeqStepOutput(
                    toks[0],
                    lps[0],
                    more_token_ids=tuple(toks[1:]),
                    more_logprobs=tuple(lps[1:]),
                    draft_token_ids=tuple(self.script[end : end + self.k]) if self.k else (),
                )
            )
        return out

    def run_empty(self) -> None:
        pass


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_path())


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    out = {}
    for name, k in (("plain", 0), ("spec", K)):
        kw = {"speculative_num_tokens": k} if k else {}
        llm = LLM(model=str(tiny_model_path()), max_model_len=256, progress=False, **kw)
        llm.engine.runner = ScriptedRunner(k)
        out[name] = llm
    return out


def offline_completion(llm: LLM, prompt_ids: list[int], stream=True, **fields) -> Completion:
    """``LLM.generate`` for the final output, the engine's delta outputs for the stream
    (``deltas`` empty when not ``stream``); ``LLM.stream``'s cumulative texts must each be a
    prefix of the final text."""
    params = SamplingParams(temperature=0, **fields)  # the request fields have vLLM's names
    (c,) = llm.generate([prompt_ids], params)[0].outputs
    if params.logprobs is not None:  # the dropped tokens' logprobs left the sum too
        kept = sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))
        assert c.cumulative_logprob == pytest.approx(kept)
    engine, deltas = llm.engine, []
    if stream:
        for out in llm.stream(prompt_ids, params):
            assert c.text.startswith(out.outputs[0].text)
        engine.add_request("stream", prompt_ids, dataclasses.replace(params, output_kind="delta"))
    while engine.has_unfinished_requests():
        deltas += [o.text for out in engine.step() for o in out.outputs]
    return Completion(
        c.text, c.token_ids, len(c.logprobs or []), c.finish_reason, c.stop_reason, deltas
    )


def complete(engines, path: str, engine: str, tok, script: list[int], **fields) -> Completion:
    llm = engines[engine]
    filler = tok.encode(" so on and so on", add_special_tokens=False) * 8
    llm.engine.runner.script = script + filler
    fields.setdefault("max_tokens", 24)
    fields.setdefault("logprobs", 0)
    if path == "offline":
        return offline_completion(llm, PROMPT, **fields)
    return serve_completion(llm.engine, tok, PROMPT, temperature=0, **fields)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


BOTH = pytest.mark.parametrize(
    "path,engine",
    [(p, e) for p in ("offline", "server") for e in ("plain", "spec")],
    ids=lambda x: x,
)

# 't', 'he', ' ex', 'per', 't', ' sa', 'id', ' he', 'll', 'o', ' the', 're'
EXPERT = "the expert said hello there"
# 't', 'he', ' c', 'at', ' and', ' the', ' do', 'g', ' and', ' the', ' b', 'ir', 'd'
ANIMALS = "the cat and the dog and the bird"


def _check(got: Completion, text: str, token_ids: list[int], reason: str, stop_reason) -> None:
    assert (got.text, got.finish_reason, got.stop_reason) == (text, reason, stop_reason)
    assert got.token_ids == token_ids
    assert got.num_logprobs == len(token_ids)  # logprobs of dropped tokens are dropped too
    assert "".join(got.deltas) == text  # no streamed text was taken back


@BOTH
def test_stop_string_across_token_boundaries(engines, tok, path, engine):
    # "said h" spans ' sa', 'id', ' he'; spec steps are [t] [he ex per t] [sa id he ll]:
    # 'll' came in the stop's step and is dropped
    script = ids(tok, EXPERT)
    got = complete(engines, path, engine, tok, script, stop=["said h"])
    _check(got, "the expert ", script[:8], "stop", "said h")
    assert not any("sa" in d for d in got.deltas)  # held back until the stop was known


@BOTH
def test_include_stop_str_in_output(engines, tok, path, engine):
    script = ids(tok, EXPERT)
    got = complete(
        engines, path, engine, tok, script, stop=["said h"], include_stop_str_in_output=True
    )
    _check(got, "the expert said h", script[:8], "stop", "said h")  # ' he' is cut after 'h'


@BOTH
def test_stop_string_in_the_first_tokens(engines, tok, path, engine):
    script = ids(tok, ANIMALS)
    got = complete(engines, path, engine, tok, script, stop=["t"])
    _check(got, "", script[:1], "stop", "t")
    got = complete(engines, path, engine, tok, script, stop=["he c"])  # ends in token 3
    _check(got, "t", script[:3], "stop", "he c")


@BOTH
def test_min_tokens_holds_back_a_stop_string(engines, tok, path, engine):
    script = ids(tok, ANIMALS)
    got = complete(engines, path, engine, tok, script, stop=["the"])
    _check(got, "", script[:2], "stop", "the")
    # vLLM's rule: a stop string may not end in the first min_tokens tokens' text
    got = complete(engines, path, engine, tok, script, stop=["the"], min_tokens=2)
    _check(got, "the cat and ", script[:6], "stop", "the")
    got = complete(engines, path, engine, tok, script, stop=["the"], min_tokens=1)
    _check(got, "", script[:2], "stop", "the")
    # ... but it may start there: "the c" ends in token 3
    got = complete(engines, path, engine, tok, script, stop=["the c"], min_tokens=2)
    _check(got, "", script[:3], "stop", "the c")


@BOTH
def test_min_tokens_holds_back_eos(engines, tok, path, engine):
    eos = tok.eos_token_id
    script = [*ids(tok, "the"), eos, *ids(tok, " cat"), eos]  # EOS as token 3 and 6
    got = complete(engines, path, engine, tok, script, min_tokens=4)
    _check(got, "the cat", script[:6], "stop", None)
    got = complete(engines, path, engine, tok, script)
    _check(got, "the", script[:3], "stop", None)


@BOTH
def test_stop_token_id(engines, tok, path, engine):
    script = ids(tok, EXPERT)
    # 'id' (token 7) is the stop: spec's step [sa id he ll] is cut after it by the scheduler
    got = complete(engines, path, engine, tok, script, stop_token_ids=[script[6]])
    _check(got, "the expert said", script[:7], "stop", script[6])
    # not before min_tokens: the next 'the' (' the', token 11) ends it
    script = ids(tok, ANIMALS)
    got = complete(engines, path, engine, tok, script, stop_token_ids=[script[5]], min_tokens=7)
    _check(got, "the cat and the dog and the", script[:10], "stop", script[5])


@BOTH
def test_a_stop_string_beats_a_later_token_stop_in_the_same_step(engines, tok, path, engine):
    eos = tok.eos_token_id
    script = ids(tok, EXPERT)
    # spec step [he ex per EOS]: "per" ends at 'per', so the EOS after it is dropped
    got = complete(engines, path, engine, tok, [*script[:4], eos, *script[4:]], stop=["per"])
    _check(got, "the ex", script[:4], "stop", "per")
    # max_tokens=8 ends at ' he', which also completes "said h": the stop string wins
    got = complete(engines, path, engine, tok, script, stop=["said h"], max_tokens=8)
    _check(got, "the expert ", script[:8], "stop", "said h")
    got = complete(engines, path, engine, tok, script, stop=["said x"], max_tokens=8)
    _check(got, "the expert said he", script[:8], "length", None)


@BOTH
def test_skip_special_tokens_and_a_partial_character(engines, tok, path, engine):
    eos = tok.eos_token_id
    script = [*ids(tok, "the"), eos]
    got = complete(engines, path, engine, tok, script, skip_special_tokens=False)
    _check(got, "the" + tok.eos_token, script, "stop", None)
    got = complete(engines, path, engine, tok, script)
    _check(got, "the", script, "stop", None)
    # max_tokens ends inside '→': the last bytes are flushed as U+FFFD, as a full decode gives
    script = ids(tok, "héllo →")
    got = complete(engines, path, engine, tok, script, max_tokens=len(script) - 1)
    assert tok.decode(script[:-1]) == "héllo \ufffd"
    _check(got, "héllo \ufffd", script[:-1], "length", None)


def test_the_spec_engine_appends_k_plus_one_tokens_a_step(engines, tok):
    llm = engines["spec"]
    llm.engine.runner.script = ids(tok, ANIMALS * 2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind="delta")
    llm.engine.add_request("steps", PROMPT, params)
    sizes = []
    while llm.engine.has_unfinished_requests():
        sizes += [len(c.token_ids) for out in llm.engine.step() for c in out.outputs]
    assert sizes == [1, K + 1, K + 1, 12 - 1 - 2 * (K + 1)]


# --- the demo model's own tokens --------------------------------------------------------------


def test_the_demo_model_gives_the_same_completion_through_both_paths(tok):
    llm = LLM(model=str(tiny_model_path()), max_model_len=256, progress=False)
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    text, token_ids = base[0].outputs[0].text, base[0].outputs[0].token_ids
    stop = next(text[i : i + 2] for i in range(4, len(text)) if text.find(text[i : i + 2]) < i)
    first = text.index(stop)
    cases = [
        dict(stop=[stop]),
        dict(stop=[stop], include_stop_str_in_output=True),
        dict(stop=[stop], min_tokens=len(tok.encode(text[: first + 2], False))),
        dict(stop_token_ids=[token_ids[2]], min_tokens=5),
        dict(stop=[stop], max_tokens=3),
    ]
    for fields in cases:
        fields = {"max_tokens": 24, "ignore_eos": True, "logprobs": 1, **fields}
        offline = offline_completion(llm, PROMPT, stream=False, **fields)
        server = serve_completion(llm.engine, tok, PROMPT, temperature=0, **fields)
        assert dataclasses.replace(server, deltas=[]) == offline, fields
        assert "".join(server.deltas) == server.text
    assert offline_completion(llm, PROMPT, False, **cases[0], max_tokens=24).text == text[:first]


# --- the tracker alone ------------------------------------------------------------------------


def test_tracker_holds_back_what_a_stop_could_claim(tok):
    t = TextTracker(tok, PROMPT, TextOptions(stop=("said h", "xy")))
    shown = []
    for i in ids(tok, "the expert sa"):
        assert t.update([i]) == TextStep(1)
        shown.append(t.take_delta(finished=False))
    assert "".join(shown) == "the expe" and t.shown(finished=False) == "the expe"
    assert t.shown(finished=True) == "the expert sa"
    step = t.update(ids(tok, "id hello"))  # ' id'... ' he', 'll', 'o': stop at ' he'
    assert step.stop == "said h" and step.num_tokens == 2 and t.text == "the expert "
    assert t.take_delta(finished=False) == "rt "
    assert t.update(ids(tok, " more")).num_tokens == 0  # after a stop, nothing is taken


def test_tracker_holds_nothing_back_when_the_stop_is_kept(tok):
    t = TextTracker(tok, PROMPT, TextOptions(stop=("said h",), include_stop_str_in_output=True))
    t.update(ids(tok, "the expert sa"))
    assert t.take_delta(finished=False) == "the expert sa"


def test_text_options_from_params_and_checks():
    p = SamplingParams(stop=["a"], min_tokens=3, include_stop_str_in_output=True)
    assert TextOptions.from_params(p) == TextOptions(("a",), True, True, 3)
    assert TextOptions(stop=("abc", "de")).hold == 2 and TextOptions().hold == 0
    with pytest.raises(ValueError, match="non-empty"):
        TextOptions(stop=("",))


def test_find_stop():
    assert find_stop("hello world", 0, ["wor"]) == (6, "wor")
    assert find_stop("hello world", 0, ["zz", ""]) is None
    assert find_stop("abcSTOPdef", 0, ["def", "STOP"]) == (3, "STOP")
    assert find_stop("ab", 0, ["b", "ab"]) == (0, "ab")
    assert find_stop("xx", 0, []) is None


def test_find_stop_only_new_region():
    # an old match entirely before `start` was already handled: not reported again
    assert find_stop("END and more", 8, ["END"]) is None
    # a match that straddles the old/new boundary is found
    assert find_stop("the EN" + "D", 6, ["END"]) == (4, "END")
    assert find_stop("the END", 5, ["END"]) == (4, "END")
    assert find_stop("the END", 7, ["END"]) is None  # no new text


def test_find_stop_streaming():
    text, stops, hit = "", ["</s>", "\n\n"], None
    for piece in ["Hel", "lo <", "/", "s> tail"]:
        start = len(text)
        text += piece
        hit = find_stop(text, start, stops)
        if hit:
            break
    assert hit == (6, "</s>")
    assert text[: hit[0]] == "Hello "
