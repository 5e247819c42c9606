"""A tiny DeepSeek-V3 checkpoint with an MTP layer, and transformers' ``MtpModel`` over it
(the oracle for the draft module): transformers keeps no MTP weights in
``DeepseekV3ForCausalLM``, so the tests draw the MTP layer themselves and write its tensors
under ``model.layers.{num_hidden_layers}`` as DeepSeek's checkpoints name them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.checkpoints import build_hf_model, save_hf_checkpoint


def build_hf_mtp(hf, seed: int = 1):
    """transformers' MTP module for ``hf`` (embedding and head shared with it), random weights
    scaled like the main model's."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    mtp = MtpModel(hf, 1)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith("layers.") and p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.02 * 3.0)
        mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return mtp.float().eval()


def mtp_checkpoint_tensors(hf, mtp) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors in DeepSeek's checkpoint names."""
    n = hf.config.num_hidden_layers
    out = {}
    for name, p in mtp.layers[0].state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2F, D], gate rows first
            prefix = f"model.layers.{n}.mlp.experts"
            for e, w in enumerate(p):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):  # [E, D, F]
            for e, w in enumerate(p):
                out[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = w
        elif name.startswith("mtp_block."):
            out[f"model.layers.{n}.{name.removeprefix('mtp_block.')}"] = p
        elif name.startswith("post_norm."):
            out[f"model.layers.{n}.shared_head.norm.{name.removeprefix('post_norm.')}"] = p
        else:
            out[f"model.layers.{n}.{name}"] = p
    out[f"model.layers.{n}.embed_tokens.weight"] = hf.model.embed_tokens.weight
    out[f"model.layers.{n}.shared_head.head.weight"] = hf.lm_head.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_mtp_checkpoint(path: Path, seed: int = 0, with_tokenizer: bool = True, **overrides):
    """(hf main model, hf MtpModel, checkpoint dir) of a tiny DeepSeek-V3 with one MTP layer."""
    hf = build_hf_model("deepseek_v3", seed=seed, **overrides)
    mtp = build_hf_mtp(hf, seed + 1)
    path = save_hf_checkpoint(hf, Path(path), with_tokenizer=with_tokenizer)
    files = sorted(path.glob("*.safetensors"))
    if (path / "model.safetensors.index.json").exists() or len(files) != 1:
        raise RuntimeError("expected a single-file checkpoint from save_pretrained")
    save_file(mtp_checkpoint_tensors(hf, mtp), str(path / "mtp.safetensors"))
    return hf, mtp, path
