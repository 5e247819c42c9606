"""Both engines implement the whole :class:`Engine` protocol with the protocol's signatures,
so ``LLM`` and the engine process never need to tell them apart."""

from __future__ import annotations

import inspect

import pytest

from moeserve.engine.engine import LLMEngine
from moeserve.engine.interface import Engine
from moeserve.launch.engine_group import EngineGroup
from tests.checkpoints import build_hf_model, save_hf_checkpoint

IMPLEMENTATIONS = [LLMEngine, EngineGroup]


def protocol_members() -> tuple[list[str], list[str]]:
    """(data members, methods) of the protocol: its properties and its plain functions."""
    data, methods = [], []
    for name, member in vars(Engine).items():
        if isinstance(member, property):
            data.append(name)
        elif inspect.isfunction(member) and not name.startswith("_"):
            methods.append(name)
    return data, methods


def _norm(annotation) -> str:
    return "".join(str(annotation).split())  # annotations are strings here (PEP 563)


def test_the_protocol_lists_the_request_api():
    data, methods = protocol_members()
    assert set(data) == {"config", "model_config", "tokenizer", "max_model_len"}
    assert set(methods) == {
        "add_request",
        "abort_request",
        "finish_sample",
        "has_unfinished_requests",
        "set_disaggregation_mode",
        "step",
        "step_with_stats",
        "stats",
        "eplb_command",
        "watch",
        "announce_api",
        "shutdown",
    }


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_data_member_is_declared(cls):
    """A data member is a property of the class or an attribute annotated on it."""
    data, _ = protocol_members()
    annotated = {k for c in cls.__mro__ for k in vars(c).get("__annotations__", {})}
    missing = [n for n in data if not isinstance(getattr(cls, n, None), property)]
    assert [n for n in missing if n not in annotated] == []


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_method_has_the_protocol_signature(cls):
    """Same parameters in the same order, kinds, defaults and annotations; an implementation
    may add parameters only with defaults."""
    _, methods = protocol_members()
    for name in methods:
        assert inspect.isfunction(getattr(cls, name, None)), f"{cls.__name__}.{name} is missing"
        want = list(inspect.signature(getattr(Engine, name)).parameters.values())
        have = list(inspect.signature(getattr(cls, name)).parameters.values())
        where = f"{cls.__name__}.{name}"
        assert len(have) >= len(want), where
        for w, h in zip(want, have):
            assert (h.name, h.kind, h.default) == (w.name, w.kind, w.default), where
            assert _norm(h.annotation) == _norm(w.annotation), where
        extra = have[len(want) :]
        assert all(p.default is not inspect.Parameter.empty for p in extra), where
        ret_want = inspect.signature(getattr(Engine, name)).return_annotation
        ret_have = inspect.signature(getattr(cls, name)).return_annotation
        assert _norm(ret_have) == _norm(ret_want), where


def test_a_one_process_engine_answers_the_whole_protocol(tmp_path):
    ckpt = save_hf_checkpoint(build_hf_model("deepseek_v3"), tmp_path / "ds")
    from moeserve import LLM, SamplingParams
    from moeserve.serving.engine_core import eplb_call

    llm = LLM(model=str(ckpt), dtype="float32", progress=False, max_model_len=64)
    engine: Engine = llm.engine
    data, _ = protocol_members()
    assert all(hasattr(engine, n) for n in data)
    assert engine.max_model_len == 64 and engine.config.max_model_len == 64
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    outputs, stats = engine.step_with_stats()
    assert stats["num_running"] == 1 and "integrity" not in stats  # no self-check with a step
    assert outputs[0].request_id == "r"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_running"] == 0 and engine.stats()["integrity"] == "ok"
    assert "integrity" not in engine.stats(self_check=False)
    assert engine.eplb_command("status") == engine.eplb.metrics()
    assert eplb_call(engine, "status") == engine.eplb.metrics()  # the engine process's call
    with pytest.raises(ValueError, match="unknown EPLB action"):
        engine.eplb_command("nonsense")
    llm.shutdown()  # no expert_stats_out: nothing to write
