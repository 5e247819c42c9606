"""scripts/demo_corpus.py (the demo's training text from Python's documentation) and
scripts/train_demo.py (the trainer): markup reduced to text, code dropped, and a tiny
training run whose checkpoint moeserve serves (its MTP layer as the draft) and transformers
reads the same way."""

from __future__ import annotations

import importlib.util
import json
import lzma
import sys
from pathlib import Path

import pytest
import torch

from tests.served_checkpoint import check_served_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus():
    return _script("demo_corpus")


@pytest.fixture(scope="module")
def trainer():
    return _script("train_demo")


@pytest.fixture(autouse=True)
def _torch_settings_restored():
    """The trainer sets the thread count and deterministic algorithms for the process."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def test_markup_becomes_text(corpus):
    got = corpus.inline(
        ":func:`len` of ``x``, :ref:`the tutorial <tut-intro>`, *this* and :class:`~a.B` [#]_"
    )
    assert got == "len() of x, the tutorial, this and B"


def test_code_and_directives_are_dropped(corpus):
    rst = """Title
=====

A paragraph that ends with code, which
is dropped::

   >>> print(1)
   1

.. index:: single: thing

.. function:: frob(x)

   Return the frobnicated value of x, with the usual care taken.

.. versionadded:: 3.2
"""
    qa: list[dict] = []
    items = list(corpus.blocks(rst.splitlines()))
    assert items[0] == ("title", 0, "Title")
    assert items[1] == ("para", 0, "A paragraph that ends with code, which is dropped:")
    assert items[2] == ("api", 0, ("function", "frob(x)"))
    assert not any("print" in str(i) or "versionadded" in str(i) for i in items)
    path = Path(__file__).parent / "_frob.rst.txt"
    try:
        path.write_text(rst)
        corpus.read_file(path, qa, glossary=False)
    finally:
        path.unlink()
    assert qa == [
        {
            "q": "What does frob() do?",
            "a": "Return the frobnicated value of x, with the usual care taken.",
        }
    ]


def test_the_shipped_text_is_what_the_script_makes_of_its_source(corpus):
    """The compressed files in moeserve/data come from demo_corpus.py (when Debian's
    python3.11-doc is installed here to compare)."""
    if not corpus.SOURCES.is_dir():
        pytest.skip("python3.11-doc is not installed here")
    paragraphs, qa = corpus.build(corpus.SOURCES)
    data = ROOT / "moeserve" / "data"
    assert lzma.decompress((data / "demo_text.txt.xz").read_bytes()).decode() == (
        "\n\n".join(paragraphs) + "\n"
    )
    shipped = lzma.decompress((data / "demo_qa.jsonl.xz").read_bytes()).decode().splitlines()
    assert [json.loads(line) for line in shipped] == qa


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
}


def test_a_tiny_run_gives_a_checkpoint_moeserve_serves(trainer, tmp_path):
    out = tmp_path / "model"
    tiny_run = ["--steps", "4", "--batch", "2", "--seq-len", "32", "--vocab", "600"]
    tiny_run += ["--max-paragraphs", "400", "--eval-every", "2", "--arch", json.dumps(TINY)]
    trainer.main(["--out", str(out), *tiny_run])
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["train"]] == [0, 1, 2, 3] and len(log["eval"]) == 2
    assert 0 < log["bigram_heldout_loss"] < 10  # the baseline, in nats per token
    assert (out / "loss.png").stat().st_size > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    # the same seed gives the same bytes (one machine, one thread count)
    again = tmp_path / "again"
    trainer.main(["--out", str(again), *tiny_run])
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    # moeserve serves it (the MTP layer drafting too) and transformers reads the same model
    check_served_checkpoint(out, "The list type is a sequence")
