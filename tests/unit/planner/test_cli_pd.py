"""``moeserve plan --pd-instances N --phase ...``: the table, JSON, the phase parser, errors."""

from __future__ import annotations

import json

import pytest

from moeserve.planner.cli import main
from moeserve.planner.cli_pd import parse_phase


@pytest.fixture
def model_dir(tmp_path, tiny_config):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config))
    return str(tmp_path)


def _args(model_dir, *extra):
    return ["--model", model_dir, "--hardware", "this-machine", "--pd-instances", "3", *extra]


def test_pd_json(model_dir, capsys):
    rc = main(
        _args(
            model_dir,
            "--pd-colocated",
            "3",
            "--phase",
            "1024:4:0.2:60",
            "--phase",
            "64:128:0.3:60:15000",
            "--tpot-ms",
            "600",
            "--json",
        )
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["instances"] == 3 and out["colocated"] == 3
    assert out["max_decode_batch"] == 64  # the engine's max_num_seqs by default
    assert [s["split"] for s in out["splits"]] == ["1:2", "2:1"]
    ph = out["splits"][0]["phases"]
    assert ph[0]["phase"]["ttft_ms"] is None and ph[1]["phase"]["ttft_ms"] == 15000
    assert ph[0]["phase"]["tpot_ms"] == ph[1]["phase"]["tpot_ms"] == 600
    best = max(out["splits"], key=lambda s: s["goodput"])
    assert out["best"] == best["split"]


def test_pd_text(model_dir, capsys):
    assert main(_args(model_dir, "--phase", "256:32:5:30", "--max-decode-batch", "8")) == 0
    text = capsys.readouterr().out
    assert "P:D 1:2" in text and "P:D 2:1" in text and "best: P:D" in text
    assert "decode batch <= 8" in text


def test_parse_phase():
    ph = parse_phase("1024:4:0.5:120:900", None, 50.0)
    assert (ph.input_len, ph.output_len, ph.rate, ph.duration_s) == (1024, 4, 0.5, 120.0)
    assert (ph.ttft_ms, ph.tpot_ms) == (900.0, 50.0)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("1024:4:0.5", "expected IN:OUT:RATE:SECONDS"),
        ("1024:4.5:0.5:10", "output_len must be an integer"),
        ("1024:4:fast:10", "rate must be a number"),
        ("1024:4:0.5:0", "duration_s must be a number > 0"),
    ],
)
def test_parse_phase_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_phase(text, None, None)


def test_pd_errors(model_dir, capsys):
    assert main(_args(model_dir)) == 2
    assert "needs at least one --phase" in capsys.readouterr().err
    assert main(_args(model_dir, "--phase", "64:8:1:10", "--pd-colocated", "4")) == 2
    assert "colocated must be in 1..instances" in capsys.readouterr().err
