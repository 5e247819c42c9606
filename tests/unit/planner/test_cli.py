"""``moeserve plan``: ranked layouts as text and JSON, the sweep, errors; and the planner
imports without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from moeserve.planner.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_plan_json(capsys):
    rc = main(
        [
            "--model",
            "qwen3-30b-a3b",
            "--hardware",
            "h100",
            "--nodes",
            "2",
            "--input-len",
            "1000",
            "--output-len",
            "200",
            "--tpot-ms",
            "50",
            "--json",
            "--top",
            "3",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["model"] == "qwen3-30b-a3b" and out["nodes"] == 2
    assert len(out["plans"]) == 3 and out["layouts_serving"] > 0
    best = out["plans"][0]
    assert best["ok"] and best["tpot_ms"] <= 50
    assert best["decode"]["breakdown_ms"]["experts"] > 0
    assert best["decode"]["memory"]["total_bytes"] <= best["decode"]["memory"]["capacity_bytes"]
    tps = [p["serving_output_tokens_per_s_node"] for p in out["plans"]]
    assert tps == sorted(tps, reverse=True)


def test_plan_text_and_sweep(capsys):
    assert main(["--model", "qwen3-30b-a3b", "--hardware", "h20", "--nodes", "1"]) == 0
    text = capsys.readouterr().out
    assert "layouts serve" in text and "best: decode step" in text
    rc = main(["--model", "qwen3-30b-a3b", "--hardware", "h20", "--sweep-nodes", "1,2", "--json"])
    pts = json.loads(capsys.readouterr().out)
    assert rc == 0 and [p["nodes"] for p in pts] == [1, 2]
    assert pts[0]["efficiency"] == 1.0


def test_plan_errors(capsys):
    assert main(["--model", "nope", "--hardware", "h100"]) == 2
    assert "not a config.json" in capsys.readouterr().err
    assert main(["--model", "deepseek-v3", "--hardware", "nope"]) == 2
    assert "unknown hardware profile 'nope'" in capsys.readouterr().err
    assert main(["--model", "deepseek-v3"]) == 2
    assert "needs --model and --hardware" in capsys.readouterr().err
    assert main(["--model", "deepseek-v3", "--hardware", "h800", "--sweep-nodes", "a"]) == 2


def test_project_cli_has_plan(capsys):
    from moeserve.cli import main as moeserve_main

    rc = moeserve_main(
        ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100", "--json", "--top", "1"]
    )
    assert rc == 0 and json.loads(capsys.readouterr().out)["plans"]


BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
    sys.meta_path.insert(0, NoTorch())
    import moeserve, moeserve.planner, moeserve.planner.cli  # the real package, no torch
    from moeserve.planner import cost_model, hardware, layout, memory, model_spec, search
    from moeserve.planner import simulator, calibrate  # calibrate imports torch lazily only
    rc = moeserve.planner.cli.main(
        ["--model", "deepseek-v3", "--hardware", "h800", "--nodes", "2", "--json", "--top", "1"]
    )
    assert rc == 0, rc
    assert "torch" not in sys.modules
    print("torch-free")
    """
)


def test_planner_imports_without_torch():
    res = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("torch-free")


def test_fixed_layout(capsys):
    from moeserve.planner.cli import parse_layout

    lay = parse_layout("tp=2,dp=4,ep=1,redundant=8,tbo=1,mtp=1,nodes=1", 0.7)
    assert (lay.tp, lay.dp, lay.ep, lay.redundant_experts, lay.mtp_acceptance) == (2, 4, 8, 8, 0.7)
    rc = main(
        [
            "--model",
            "deepseek-v3",
            "--hardware",
            "h800",
            "--layout",
            "dp=16,ep=1,tbo=1,nodes=2",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["layouts_evaluated"] == 1
    assert out["plans"][0]["layout"]["ep"] == 16 and out["nodes"] == 2
    assert main(["--model", "deepseek-v3", "--hardware", "h800", "--layout", "tp2"]) == 2
    assert "--layout: expected key=value" in capsys.readouterr().err


def test_sweep_plot(tmp_path, capsys):
    import pytest

    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.png"
    rc = main(
        [
            "--model",
            "qwen3-30b-a3b",
            "--hardware",
            "h100",
            "--sweep-nodes",
            "1,2",
            "--plot",
            str(out),
        ]
    )
    assert rc == 0 and out.stat().st_size > 0
    assert "as copies" in capsys.readouterr().out
