"""Reusable test helpers (no fixtures here; conftest-free on purpose)."""

from __future__ import annotations

from pathlib import Path


def copy_demo_tokenizer(dst_dir: str | Path) -> Path:
    """Put the demo tokenizer (vocab 512) into a checkpoint directory a test made.

    Writes tokenizer.json, tokenizer_config.json (with the DeepSeek-V3-style chat template)
    and generation_config.json (bos 0, eos 1), replacing any that are there.
    """
    from moeserve.demo import write_demo_tokenizer

    return write_demo_tokenizer(dst_dir)
