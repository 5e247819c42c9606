"""The ``moeserve`` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from moeserve import LLM, SamplingParams
from moeserve.demo import TINY_NAME, demo_model_path


def _run(*args: str, cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOESERVE_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "moeserve.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_generate_streams_with_the_demo_model(tmp_path):
    r = _run(
        "generate", "--prompt", "Hello there", "--max-tokens", "12", "--ignore-eos", cache=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "[12 tokens, finish_reason=length]" in r.stderr
    assert not (tmp_path / TINY_NAME).exists()  # the shipped demo, read in place
    # greedy CLI output equals the offline API's text for the same prompt
    llm = LLM(model=str(demo_model_path()), progress=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert r.stdout == llm.generate("Hello there", params)[0].outputs[0].text + "\n"


def test_generate_chat_and_demo_model_command(tmp_path):
    out = tmp_path / "exported"
    r = _run("demo-model", str(out), "--tiny", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()
    r = _run("demo-model", str(tmp_path / "demo"), cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "demo" / "model.safetensors").is_file()
    r = _run(
        "generate",
        "--model",
        str(out),
        "--prompt",
        "Hi",
        "--chat",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "-q",
        cache=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    # the prompt went through the chat template: greedy output equals LLM.chat's, which
    # differs from the bare prompt's
    llm = LLM(model=str(out), progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": "Hi"}], params)[0].outputs[0].text
    assert chat != llm.generate("Hi", params)[0].outputs[0].text
    assert r.stdout == chat + "\n"


def test_bad_model_dir_is_a_one_line_error(tmp_path):
    r = _run("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", cache=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error:") and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_fails_fast_on_a_busy_port_and_bad_flags(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _run("serve", "--port", str(port), cache=tmp_path)
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    r = _run("serve", "--port", "70000", cache=tmp_path)
    assert r.returncode == 2 and "port must be in" in r.stderr
    r = _run("serve", "--model", str(tmp_path / "nowhere"), cache=tmp_path)
    assert r.returncode == 2 and "tokenizer.json" in r.stderr


def test_bench_serving_help_states_the_range_ratio_definition(tmp_path):
    r = _run("bench", "serving", "--help", cache=tmp_path)
    assert r.returncode == 0
    assert "[L*(1-r), L*(1+r)]" in " ".join(r.stdout.split())


def test_generate_profile_writes_a_trace_and_prints_the_top_ops(tmp_path):
    prof = tmp_path / "prof"
    r = _run(
        "generate",
        "--prompt",
        "Hi",
        "--max-tokens",
        "4",
        "-q",
        "--profile",
        str(prof),
        cache=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    trace = json.loads((prof / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "moeserve" in names and any(str(n).startswith("aten::") for n in names)
    assert "Self CPU time total" in r.stderr and str(prof / "trace.json") in r.stderr
    assert "Self CPU" in (prof / "top_ops.txt").read_text()
