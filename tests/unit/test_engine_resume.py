"""A request resumed from what its caller received (elastic EP's recovery path,
``LLMEngine.add_tokenized(progress=...)``) continues exactly as an uninterrupted run:
greedy and seeded random tokens, text, logprobs and delta outputs."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from moeserve.core import SampleProgress
from tests.checkpoints import build_hf_model, save_hf_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path_factory.mktemp("ds"))
    return LLM(model=str(path), dtype="float32", progress=False, max_model_len=256)


PROMPT = [5, 17, 99, 3, 250, 41, 77, 8]


def run(engine, request_id, params, progress=None) -> list:
    """Every output of one request, stepping the engine until it finishes."""
    engine.add_tokenized(request_id, PROMPT, params, None, progress)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    engine.scheduler.check_integrity()
    return outs


def progress_after(outs, k: int) -> list[SampleProgress]:
    """What a caller had after the first ``k`` tokens of each sample (cumulative outputs)."""
    final = outs[-1]
    return [
        SampleProgress(
            tuple(c.token_ids[:k]),
            tuple(c.logprobs[:k]) if c.logprobs else (),
            sum(lp[t].logprob for t, lp in zip(c.token_ids[:k], c.logprobs[:k]))
            if c.logprobs
            else 0.0,
        )
        for c in final.outputs
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=14, temperature=1.0, seed=7, n=2, ignore_eos=True),
        SamplingParams(
            max_tokens=14,
            temperature=0.8,
            top_p=0.9,
            seed=3,
            ignore_eos=True,
            presence_penalty=1.0,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
        ),  # fmt: skip
    ],
)
def test_resumed_request_continues_as_an_uninterrupted_one(llm, params):
    engine = llm.engine
    whole = run(engine, "whole", params)
    resumed = run(engine, "resumed", params, progress_after(whole, 5))
    for a, b in zip(whole[-1].outputs, resumed[-1].outputs):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        if params.logprobs is not None:
            assert [sorted(x) for x in b.logprobs] == [sorted(x) for x in a.logprobs]
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)


def test_delta_outputs_carry_only_the_tokens_after_the_resume(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    whole = run(engine, "d-whole", params)[-1].outputs[0]
    delta = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, output_kind="delta")
    outs = run(engine, "d-resumed", delta, [SampleProgress(tuple(whole.token_ids[:4]))])
    got = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert got == whole.token_ids[4:]
    text = "".join(c.text for o in outs for c in o.outputs)
    assert text == whole.text[len(_text(llm, whole, 4)) :]


def test_a_finished_sample_stays_finished(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2, ignore_eos=True)
    whole = run(engine, "f-whole", params)[-1].outputs
    done = SampleProgress(tuple(whole[0].token_ids), (), 0.0, "length")
    outs = run(engine, "f-resumed", params, [done, SampleProgress(tuple(whole[1].token_ids[:2]))])
    final = outs[-1].outputs
    assert [c.token_ids for c in final] == [c.token_ids for c in whole]
    assert [c.finish_reason for c in final] == ["length", "length"]


def test_drop_all_requests_frees_every_block(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_tokenized(f"x{i}", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert sorted(engine.drop_all_requests()) == ["x0", "x1", "x2"]
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks


def test_bad_progress_is_refused(llm):
    with pytest.raises(ValueError, match="one progress entry per sample"):
        llm.engine.add_tokenized("bad", PROMPT, SamplingParams(n=2), None, [SampleProgress()])


def _text(llm, completion, k: int) -> str:
    return llm.engine.tokenizer.decode(completion.token_ids[:k])


def test_earlier_outputs_are_recomputed_as_decode_rows(llm):
    """The prompt in one chunk (the prefill path), then the earlier outputs 32 per step as
    decode rows, then the next token sampled from the last of them."""
    engine = llm.engine
    done = SampleProgress(tuple(range(100, 140)))  # 40 earlier outputs
    engine.add_tokenized("rows", PROMPT, SamplingParams(max_tokens=45), None, [done])
    seen = []
    for _ in range(3):
        batch = engine.scheduler.schedule()
        (entry,) = batch.seqs
        seen.append((entry.num_new_tokens, entry.as_decode_rows, entry.sample))
        results = engine.runner.run(batch)
        engine.scheduler.update(batch, [(r.token_id, r.logprobs) for r in results])
    assert seen == [(8, False, False), (32, True, False), (8, True, True)]
    assert batch.num_decodes == 8
    engine.abort_request("rows")
    engine.scheduler.check_integrity()
