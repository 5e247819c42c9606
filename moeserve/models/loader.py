"""Build a model from a Hugging Face directory: config -> class -> streamed weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve.config import MoEOptions
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.parallel_dims import ParallelDims
from moeserve.models.base import MoECausalLM
from moeserve.models.hf_config import ModelConfig
from moeserve.models.registry import model_class
from moeserve.models.weight_format import apply_weight_format, settle_int4
from moeserve.models.weights import INDEX_FILE, LoadReport, checkpoint_files, load_checkpoint
from moeserve.ops import formats
from moeserve.ops.formats.base import WeightFormat

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
    groups: ParallelGroups | None = None,
    moe_options: MoEOptions | None = None,
    weight_format: str | WeightFormat | None = None,
) -> tuple[MoECausalLM, ModelConfig, LoadReport]:
    """Build this rank's part of the model and read only its tensors (or their slices).
    With a ``weight_format`` (``ops/formats``: "int8", "w8a8_int8", "int4", "w4a8_int8",
    "bf16", or a configured format) the weights are converted to it as they are read
    (``models/weight_format.py``)."""
    config = ModelConfig.from_dir(model_dir)
    if config.int4 is not None:  # AWQ / GPTQ: int4 as the checkpoint has it
        name = checkpoint_quantization(model_dir, weight_format)
        c = config.int4
        weight_format = formats.get(name).configured(c.group_size, c.symmetric, c.act_order)
    if weight_format is not None:
        fmt = formats.get(weight_format) if isinstance(weight_format, str) else weight_format
        fmt.check_device(torch.device(device))
    groups = groups or ParallelGroups.single()
    check_layout(config, groups.dims, moe_options or MoEOptions())
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
        model = cls(
            config,
            dtype=dtype,
            max_positions=max_positions,
            load_mtp=load_mtp,
            groups=groups,
            moe_options=moe_options,
        )
    # a 4-bit checkpoint that keeps its LM head 16-bit (as published ones do) keeps it so
    keep_head = config.int4 is not None and "lm_head.qweight" not in checkpoint_tensor_names(
        model_dir
    )
    apply_weight_format(model, weight_format, keep_lm_head=keep_head)
    report = load_checkpoint(
        model_dir,
        model.weight_specs(),
        dtype,
        fp8=config.fp8,
        int4=config.int4,
        skip=model.ignored_checkpoint_tensor,
        progress=progress,
    )
    settle_int4(model)
    model.process_weights_after_loading()
    model.eval()
    return model, config, report


def checkpoint_quantization(
    model_dir: str | Path,
    requested: str | WeightFormat | None,
    int4_group_size: int | None = None,
) -> str | None:
    """The weight format a checkpoint must be served in: for an AWQ or GPTQ one, a format of
    int4 weights (``requested`` if it is one, int4 when None; ``int4_group_size`` None or the
    checkpoint's), else ``requested``'s name. ValueError naming the conflict."""
    name = requested.name if isinstance(requested, WeightFormat) else requested
    c = ModelConfig.from_dir(model_dir).int4
    if c is None:
        return name
    if name not in (None, *formats.INT4_FORMATS):
        raise ValueError(
            f"{model_dir} is a 4-bit {c.method} checkpoint: serve it with --quantization "
            f"{' or '.join(formats.INT4_FORMATS)} (or none), not {name}"
        )
    if int4_group_size not in (None, c.group_size):
        raise ValueError(
            f"{model_dir} is a {c.method} checkpoint with group size {c.group_size}; "
            f"--int4-group-size {int4_group_size} cannot regroup it"
        )
    return name or "int4"


def check_layout(config: ModelConfig, dims: ParallelDims, options: MoEOptions) -> None:
    """Raise ValueError (naming the size) when the model cannot be split as ``dims`` says."""
    L = config.num_hidden_layers
    ffn = [config.intermediate_size] if not all(config.is_moe_layer(i) for i in range(L)) else []
    if config.shared_expert_intermediate_size and not dims.enable_expert_parallel:
        ffn.append(config.shared_expert_intermediate_size)
    if config.num_experts and not dims.enable_expert_parallel:
        ffn.append(config.moe_intermediate_size)
    dims.check_model(
        num_heads=config.num_attention_heads,
        # MLA keeps one latent per token, replicated over tp: only query heads are split
        num_kv_heads=config.num_attention_heads if config.is_mla else config.num_key_value_heads,
        num_experts=config.num_experts,
        num_layers=config.num_hidden_layers,
        ffn_sizes=tuple(ffn),
        num_redundant_experts=options.num_redundant_experts,
    )
