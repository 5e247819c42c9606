"""Writers of AWQ and GPTQ checkpoints for the tests, and each format's own dequantization.

The packers and the ``*_dequantize`` functions follow the formats' definitions (AutoAWQ's
``WQLinear_GEMM`` packing and its ``unpack_awq`` / ``reverse_awq_order``; AutoGPTQ's
``QuantLinear.pack`` and its v1 zero points), written from those definitions here, apart from
the decoder under test (``moeserve/quant/int4_checkpoints.py``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.int8_oracle import is_quantized, write_oracle

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ writes column order_map[i] to nibble i
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # and reads nibble reverse[j] for column j


def _pack_rows_of_8(values_RC: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``[R, C]`` 4-bit values -> ``[R, C / 8]`` int32, nibble i = column 8c + order[i]."""
    R, C = values_RC.shape
    v = values_RC.to(torch.int64).view(R, C // 8, 8)
    out = torch.zeros(R, C // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= (v[:, :, col] & 0xF) << (4 * i)
    return _to_int32(out)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values of 32 bits as int32 (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def quantize_asym(w_NK: torch.Tensor, G: int, symmetric: bool = False):
    """Codes ``[N, K]``, zeros and scales ``[N, K / G]`` of a weight, GPTQ/AWQ style."""
    N, K = w_NK.shape
    g = w_NK.float().view(N, K // G, G)
    if symmetric:
        amax = g.abs().amax(-1)
        scale = (2 * amax / 15).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    scale = scale.half().float()  # the checkpoint keeps fp16 scales
    return codes.view(N, K).to(torch.uint8), zero.to(torch.uint8), scale


def awq_tensors(codes_NK, zero_NG, scale_NG) -> dict[str, torch.Tensor]:
    """AWQ GEMM's tensors: qweight [K, N/8], qzeros [K/G, N/8] (AWQ's order), scales fp16."""
    q = _pack_rows_of_8(codes_NK.t().contiguous(), AWQ_PACK_ORDER)
    z = _pack_rows_of_8(zero_NG.t().contiguous(), AWQ_PACK_ORDER)
    return {"qweight": q, "qzeros": z, "scales": scale_NG.t().contiguous().half()}


def awq_dequantize(qweight, qzeros, scales, G: int) -> torch.Tensor:
    """AutoAWQ's dequantization: unpack along N, reverse AWQ's order, ``(w - z) * s``;
    returns ``[N, K]`` (the transpose of AWQ's ``[K, N]``)."""
    shifts = torch.arange(0, 32, 4)
    w = (qweight[:, :, None].to(torch.int64) >> shifts).view(qweight.shape[0], -1)
    z = (qzeros[:, :, None].to(torch.int64) >> shifts).view(qzeros.shape[0], -1)
    rev = torch.arange(w.shape[1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    w, z = w[:, rev] & 0xF, z[:, rev] & 0xF
    z = z.repeat_interleave(G, dim=0)
    s = scales.float().repeat_interleave(G, dim=0)
    return ((w - z) * s).t().contiguous()


def gptq_tensors(codes_NK, zero_NG, scale_NG, g_idx_K, v1: bool = True) -> dict:
    """GPTQ's tensors: qweight [K/8, N] packed along K in order, qzeros [K/G, N/8] (v1:
    zero - 1 in 4 bits), scales fp16, g_idx. ``codes`` and the group tensors are in the
    weight's own column order; group ``g_idx[k]`` holds column k."""
    K = codes_NK.shape[1]
    q = codes_NK.t().to(torch.int64).view(K // 8, 8, -1)  # [K/8, 8, N]
    packed = torch.zeros(K // 8, codes_NK.shape[0], dtype=torch.int64)
    for i in range(8):
        packed |= q[:, i, :] << (4 * i)
    zeros = zero_NG.t().to(torch.int64) - (1 if v1 else 0)  # [K/G, N]
    z = zeros.view(zeros.shape[0], -1, 8)
    packed_z = torch.zeros(z.shape[0], z.shape[1], dtype=torch.int64)
    for i in range(8):
        packed_z |= (z[:, :, i] & 0xF) << (4 * i)
    return {
        "qweight": _to_int32(packed),
        "qzeros": _to_int32(packed_z),
        "scales": scale_NG.t().contiguous().half(),
        "g_idx": g_idx_K.to(torch.int32),
    }


def gptq_dequantize(qweight, qzeros, scales, g_idx, v1: bool = True) -> torch.Tensor:
    """AutoGPTQ's dequantization: codes along K, zeros along N (+1 for v1),
    ``scales[g_idx[k]] * (w - zeros[g_idx[k]])``; returns ``[N, K]``."""
    shifts = torch.arange(0, 32, 4)
    w = (qweight[:, None, :].to(torch.int64) >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    w = w.reshape(-1, qweight.shape[1])  # [K, N]
    z = ((qzeros[:, :, None].to(torch.int64) >> shifts) & 0xF).view(qzeros.shape[0], -1)
    z = (z + (1 if v1 else 0)) & 0xF
    gi = g_idx.long()
    return (scales.float()[gi] * (w - z[gi])).t().contiguous()


def act_order_g_idx(K: int, G: int, seed: int) -> torch.Tensor:
    """A GPTQ act-order ``g_idx``: columns taken in a random order, G to a group."""
    order = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[order] = torch.arange(K) // G
    return g_idx


def _input_group(name: str) -> str:
    """Weights that read the same input share GPTQ's act order (fused gate/up, q/k/v, MLA's
    q_a and kv_a)."""
    name = re.sub(r"(gate|up)_proj\.weight$", "gate_up", name)
    name = re.sub(r"(q|k|v)_proj\.weight$", "qkv", name)
    return re.sub(r"(q_a_proj|kv_a_proj_with_mqa)\.weight$", "qkv_a", name)


def write_int4_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    G: int,
    *,
    symmetric: bool = False,
    act_order: bool = False,
    v1: bool = True,
    quantize_lm_head: bool = False,
) -> Path:
    """A copy of ``src`` as an AWQ or GPTQ checkpoint (every weight ``--quantization``
    converts, the LM head only with ``quantize_lm_head``, as published checkpoints keep it
    16-bit), and ``dst / "oracle"``: the same model in fp32 with each 4-bit weight as its
    format's own dequantization gives it."""
    shutil.copytree(src, dst)
    dequantized: dict[str, torch.Tensor] = {}
    for path in dst.glob("*.safetensors"):
        out = {}
        for name, t in load_file(str(path)).items():
            if not is_quantized(name, t) or (name == "lm_head.weight" and not quantize_lm_head):
                out[name] = t
                continue
            base = name.removesuffix(".weight")
            codes, zero, scale = quantize_asym(t, G, symmetric)
            if method == "awq":
                parts = awq_tensors(codes, zero, scale)
                dequantized[name] = awq_dequantize(
                    parts["qweight"], parts["qzeros"], parts["scales"], G
                )
            else:
                K = t.shape[1]
                seed = sum(map(ord, _input_group(name))) + K
                g_idx = act_order_g_idx(K, G, seed) if act_order else torch.arange(K) // G
                # GPTQ's groups are the columns g_idx puts together: quantize those
                perm = torch.argsort(g_idx, stable=True)
                c, z, s = quantize_asym(t[:, perm], G, symmetric)
                codes = torch.empty_like(c)
                codes[:, perm] = c
                parts = gptq_tensors(codes, z, s, g_idx, v1)
                dequantized[name] = gptq_dequantize(
                    parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], v1
                )
            out.update({f"{base}.{k}": v for k, v in parts.items()})
        save_file(out, str(path), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if method == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm",
                 "zero_point": not symmetric}  # fmt: skip
    else:
        quant = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": symmetric,
                 "desc_act": act_order,
                 "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    write_oracle(src, dst / "oracle", lambda name, t: dequantized.get(name, t))
    return dst
