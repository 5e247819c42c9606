"""SamplingParams validation and normalisation, Sequence bookkeeping."""

from __future__ import annotations

import pytest

from moeserve.core import FinishReason, SamplingParams, Sequence


def test_sampling_params_normalise_vllm_style_inputs():
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], top_k=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.top_k == -1
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"n": 0}, "n must be"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_bad_sampling_params_are_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_sequence_token_stops():
    p = SamplingParams(max_tokens=5, stop_token_ids=[9], min_tokens=2)
    seq = Sequence("r", [1, 2, 3], p, eos_token_ids=frozenset({0}))
    seq.append_token(0, None)  # EOS before min_tokens: ignored
    assert not seq.check_token_stop()
    seq.append_token(9, None)
    assert seq.check_token_stop() and seq.finish_reason is FinishReason.STOP
    assert seq.stop_reason == 9
    assert seq.token_ids_slice(2, 5) == [3, 0, 9]
    long = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=None), max_model_len=5)
    long.append_token(4, None)
    assert not long.check_token_stop()
    long.append_token(4, None)
    assert long.check_token_stop() and long.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="at least one token"):
        Sequence("r", [], SamplingParams())
