"""Build a model from a Hugging Face directory: config -> class -> streamed weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve.models.base import MoECausalLM
from moeserve.models.hf_config import ModelConfig
from moeserve.models.registry import model_class
from moeserve.models.weights import INDEX_FILE, LoadReport, checkpoint_files, load_checkpoint

logger = logging.getLogger(__name__)


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    """Tensor names from the index, or from the safetensors headers (no data is read)."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        try:
            return set(json.loads((root / INDEX_FILE).read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError):
            pass  # load_checkpoint reports a broken index precisely
    names: set[str] = set()
    for path in checkpoint_files(root):
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        except Exception:  # noqa: BLE001 - load_checkpoint reports damaged files precisely
            pass
    return names


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    load_mtp: bool = True,
    progress: bool = True,
) -> tuple[MoECausalLM, ModelConfig, LoadReport]:
    config = ModelConfig.from_dir(model_dir)
    if load_mtp and config.num_nextn_predict_layers:
        first_mtp = f"model.layers.{config.num_hidden_layers}."
        if not any(n.startswith(first_mtp) for n in checkpoint_tensor_names(model_dir)):
            logger.info(
                "config names %d MTP layer(s) but the checkpoint has none; skipping them",
                config.num_nextn_predict_layers,
            )
            load_mtp = False
    cls = model_class(config.architecture)
    with torch.device(device):
        model = cls(config, dtype=dtype, max_positions=max_positions, load_mtp=load_mtp)
    report = load_checkpoint(
        model_dir,
        model.weight_specs(),
        dtype,
        fp8=config.fp8,
        skip=model.ignored_checkpoint_tensor,
        progress=progress,
    )
    model.process_weights_after_loading()
    model.eval()
    return model, config, report
