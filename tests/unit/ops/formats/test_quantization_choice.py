"""Choosing the quantization: EngineConfig, the CLI flag and LLM's keyword."""

from __future__ import annotations

import pytest
import torch

from moeserve.cli import build_parser, engine_kwargs
from moeserve.config import EngineConfig
from moeserve.ops import formats


def test_engine_config_accepts_and_normalizes():
    assert EngineConfig(model="m").quantization is None
    assert EngineConfig(model="m", quantization="none").quantization is None
    cfg = EngineConfig(model="m", quantization="int8", device="cpu")
    assert cfg.quantization == "int8"
    # auto: the int8 kernels take fp32 activations
    assert formats.resolve("int8", cfg.dtype, cfg.torch_device) == ("int8", torch.float32)
    cfg16 = EngineConfig(model="m", quantization="int8", device="cpu", dtype="bfloat16")
    assert formats.resolve("int8", cfg16.dtype, cfg16.torch_device)[1] == torch.bfloat16


def test_unknown_quantization_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantization 'int3'; choose one of none, int8"):
        EngineConfig(model="m", quantization="int3")


def test_int4_options():
    cfg = EngineConfig(model="m", quantization="int4", int4_group_size=64, int4_symmetric=False)
    assert (cfg.int4_group_size, cfg.int4_symmetric) == (64, False)
    with pytest.raises(ValueError, match="int4_group_size must be one of 32, 64, 128"):
        EngineConfig(model="m", quantization="int4", int4_group_size=100)
    with pytest.raises(ValueError, match="quantization int4 and w4a8_int8 only, not int8"):
        EngineConfig(model="m", quantization="int8", int4_group_size=64)
    with pytest.raises(ValueError, match="quantization int4 and w4a8_int8 only, not none"):
        EngineConfig(model="m", int4_symmetric=False)
    args = build_parser().parse_args(
        ["serve", "--quantization", "int4", "--int4-group-size", "32", "--int4-asymmetric"]
    )
    kw = engine_kwargs(args)
    assert (kw["quantization"], kw["int4_group_size"], kw["int4_symmetric"]) == ("int4", 32, False)
    args = build_parser().parse_args(
        ["serve", "--quantization", "w4a8_int8", "--int4-group-size", "64"]
    )
    kw = engine_kwargs(args)
    assert (kw["quantization"], kw["int4_group_size"]) == ("w4a8_int8", 64)


def test_cli_flag(capsys):
    parser = build_parser()
    for cmd in ("generate", "serve"):
        extra = ["--prompt", "x"] if cmd == "generate" else []
        args = parser.parse_args([cmd, *extra, "--quantization", "int8"])
        assert engine_kwargs(args)["quantization"] == "int8"
        assert engine_kwargs(parser.parse_args([cmd, *extra]))["quantization"] == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--quantization", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
