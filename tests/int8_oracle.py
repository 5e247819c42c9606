"""The fp32 oracle of a quantized engine: a copy of a checkpoint whose quantized weights are
replaced by what the engine holds, dequantized (int8: ``q.float() * scale``; int4: the group
codes). An fp32 engine on it must match the quantized engine up to summation order (~1e-5),
a check a broken kernel fails."""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeserve.ops.cpu import int4, int4_amx
from moeserve.quant.int8 import quantize_rows


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """Checkpoint tensors that ``--quantization int8`` converts (``quant/apply.py``): every 2-D
    weight but the embeddings and the routers (an LM head tied to the embeddings has no
    tensor of its own)."""
    return t.dim() == 2 and "embed_tokens" not in name and not name.endswith("mlp.gate.weight")


def fake_quantize(t: torch.Tensor, column_parts: int = 1) -> torch.Tensor:
    """``q * scale`` in fp32; with ``column_parts`` > 1 each column slice is quantized alone
    (the K shards of a row-parallel layer under tensor parallelism)."""
    parts = []
    for part in t.float().chunk(column_parts, dim=1):
        q, scale = quantize_rows(part)
        parts.append(q.float() * scale[:, None])
    return torch.cat(parts, dim=1)


def write_oracle(
    src: Path, dst: Path, convert: Callable[[str, torch.Tensor], torch.Tensor]
) -> Path:
    """Copy ``src`` to ``dst`` with every tensor a weight format converts (:func:`is_quantized`)
    replaced by ``convert(name, tensor)``: what that format's engine holds, in fp32."""
    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if is_quantized(name, t):
                tensors[name] = convert(name, t)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def write_int8_oracle(src: Path, dst: Path, tp: int = 1) -> Path:
    """Copy ``src`` to ``dst`` with every quantized tensor fake-quantized in fp32. ``tp``: the
    row-parallel weights (``o_proj``, ``down_proj``) are quantized per tensor-parallel
    column shard, as each rank does."""

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
        return fake_quantize(t, tp if row_parallel else 1)

    return write_oracle(src, dst, convert)


def assert_int4_outputs(got, want, rounds: bool | None = None) -> None:
    """An int4 engine's greedy outputs (``prompt_logprobs=0``) against the fp32 engine's on its
    dequantized weights (write_int4_oracle): the same tokens, and the prompt logprobs to 1e-4
    where the kernels compute in fp32. The integer dots and AMX's tiles (``rounds``; by
    default whether either runs here) take each GEMM's rows rounded to 2^-16 of their largest
    |x|
    (ops/cpu/int4.py round_rows_ref): ~1e-5 of most logprobs, but a near tie of an MoE router
    can then pick the other expert for one token (seen: 0.01 at one position of 89, then
    ~1e-3 where later tokens attend to it), so most positions to 1e-4 and all to 0.05 (the
    bound w8a8_int8's engines are held to)."""
    if rounds is None:
        rounds = (int4.available() and int4.rounds_rows(None, 1)) or int4_amx.available()
    gaps = []
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (tx, lx), (ty, ly) = next(iter(x.items())), next(iter(y.items()))
            assert tx == ty
            gaps.append(abs(lx.logprob - ly.logprob))
    if rounds:
        assert statistics.median(gaps) < 1e-4 and max(gaps) < 0.05, gaps
    else:
        assert max(gaps) < 1e-4, gaps


def write_int4_oracle(
    src: Path, dst: Path, group_size: int, symmetric: bool = True, tp: int = 1
) -> Path:
    """:func:`write_int8_oracle` for ``--quantization int4``: every quantized tensor replaced
    by its group-wise 4-bit codes dequantized in fp32 (``tp``: row-parallel weights per
    column shard, each shard's groups inside it)."""
    from moeserve.quant.int4 import dequantize_groups, quantize_groups

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
        parts = t.float().chunk(tp if row_parallel else 1, dim=1)
        return torch.cat(
            [dequantize_groups(*quantize_groups(p, group_size, symmetric)) for p in parts], dim=1
        )

    return write_oracle(src, dst, convert)
