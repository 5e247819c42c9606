"""Checkpoint reader: round trips, shards, skip, FP8 and every error message, on tiny files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moeserve.models.fp8 import dequantize_fp8_block, quantize_fp8_block
from moeserve.models.hf_config import Fp8Config
from moeserve.models.weights import (
    CheckpointError,
    LoadReport,
    WeightSpec,
    checkpoint_files,
    load_checkpoint,
)

FP8 = Fp8Config(128, 128)


def write_checkpoint(root: Path, *shards: dict[str, torch.Tensor]) -> Path:
    """One shard -> model.safetensors; several -> model-0000i-of-0000n + index json."""
    root.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(root / "model.safetensors"))
        return root
    weight_map = {}
    for i, tensors in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(root / fname))
        weight_map.update({name: fname for name in tensors})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def specs_for(
    shapes: dict[str, tuple[int, ...]], out: dict[str, torch.Tensor]
) -> dict[str, WeightSpec]:
    def loader(name: str):
        return lambda t: out.__setitem__(name, t.clone())

    return {name: WeightSpec(shape, loader(name)) for name, shape in shapes.items()}


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors.items()}


def load(root: Path, shapes, dtype=torch.float32, **kw) -> tuple[dict, LoadReport]:
    out: dict[str, torch.Tensor] = {}
    report = load_checkpoint(root, specs_for(shapes, out), dtype, progress=False, **kw)
    return out, report


def tiny(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(dtype),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(12, 8, generator=g).to(dtype),
        "model.norm.weight": torch.randn(8, generator=g).to(dtype),
        "lm_head.weight": torch.randn(16, 8, generator=g).to(dtype),
    }


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = tiny(dtype)
    out, report = load(write_checkpoint(tmp_path, tensors), shapes_of(tensors), dtype)
    assert out.keys() == tensors.keys()
    for name, t in tensors.items():
        assert out[name].dtype == dtype
        assert torch.equal(out[name], t), name
    assert report.num_tensors == len(tensors)
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.skipped == ()


def test_converts_to_compute_dtype(tmp_path: Path) -> None:
    tensors = tiny(torch.bfloat16)
    out, _ = load(write_checkpoint(tmp_path, tensors), shapes_of(tensors), torch.float32)
    for name, t in tensors.items():
        assert out[name].dtype == torch.float32
        assert torch.equal(out[name], t.float())


def test_sharded_index(tmp_path: Path) -> None:
    tensors = tiny()
    names = list(tensors)
    first = {n: tensors[n] for n in names[:2]}
    second = {n: tensors[n] for n in names[2:]}
    root = write_checkpoint(tmp_path, first, second)
    (root / "consolidated.safetensors").write_bytes(b"not listed in the index")
    files = checkpoint_files(root)
    assert [f.name for f in files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    out, report = load(root, shapes_of(tensors))
    assert all(torch.equal(out[n], t) for n, t in tensors.items())
    assert report.num_tensors == 4


def test_skip_is_neither_extra_nor_required(tmp_path: Path) -> None:
    tensors = tiny()
    stored = dict(tensors)
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    stored["model.layers.1.mlp.up_proj.weight"] = torch.ones(3, 3, dtype=torch.int64)  # MTP
    shapes = shapes_of(tensors) | {"model.layers.2.eh_proj.weight": (8, 16)}  # skipped, absent

    def skip(name: str) -> bool:
        return "rotary_emb.inv_freq" in name or ".layers.1." in name or ".layers.2." in name

    out, report = load(write_checkpoint(tmp_path, stored), shapes, skip=skip)
    assert out.keys() == tensors.keys()
    assert report.skipped == (
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.1.mlp.up_proj.weight",
    )


# ---- FP8 -----------------------------------------------------------------------------------


def test_fp8_quantize_shapes_and_zero_block() -> None:
    w = torch.zeros(130, 260)
    w[:128, :128] = torch.randn(128, 128)
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (130, 260)
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    assert s[1, 2] == 1.0  # all-zero block
    assert torch.equal(dequantize_fp8_block(q, s, 128, 128)[128:], torch.zeros(2, 260))
    with pytest.raises(ValueError, match="must have shape"):
        dequantize_fp8_block(q, s[:1], 128, 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_dequantizes_with_scale_in_another_shard(tmp_path: Path, dtype: torch.dtype) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = quantize_fp8_block(w, 128, 128)
    assert s.shape == (3, 3)
    norm = torch.randn(260, dtype=torch.bfloat16)
    root = write_checkpoint(
        tmp_path, {name: q}, {"model.norm.weight": norm, name + "_scale_inv": s}
    )
    shapes = {name: (300, 260), "model.norm.weight": (260,)}
    out, report = load(root, shapes, dtype, fp8=FP8)
    assert out[name].dtype == dtype
    assert torch.equal(out[name], dequantize_fp8_block(q, s, 128, 128).to(dtype))
    rel = (out[name].float() - w.float()).norm() / w.float().norm()
    assert rel < 0.07, rel
    assert torch.equal(out["model.norm.weight"], norm.to(dtype))
    assert report.num_tensors == 2
    assert report.num_bytes == 300 * 260 + 9 * 4 + 260 * 2


def test_fp8_scale_of_skipped_weight_is_skipped(tmp_path: Path) -> None:
    q, s = quantize_fp8_block(torch.randn(4, 4))
    root = write_checkpoint(
        tmp_path, {"mtp.weight": q, "mtp.weight_scale_inv": s, "a": torch.ones(2)}
    )
    out, report = load(root, {"a": (2,)}, fp8=FP8, skip=lambda n: n == "mtp.weight")
    assert report.skipped == ("mtp.weight", "mtp.weight_scale_inv")


# ---- errors --------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"model directory .*nope does not exist"):
        load(tmp_path / "nope", {})


def test_no_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"expected \*\.safetensors weights in .*none found"):
        checkpoint_files(tmp_path)


def test_pickle_only_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: only safetensors"):
        load(tmp_path, {})


def test_index_names_missing_shard(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, {"a": torch.ones(1)}, {"b": torch.ones(1)})
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names 1 shard\(s\) missing .*00002-of-00002"):
        checkpoint_files(root)


def test_index_disagrees_with_shard(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, {"a": torch.ones(1)}, {"b": torch.ones(1)})
    index = root / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["a"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="puts a in model-00002-of-00002.safetensors, but"):
        load(root, {"a": (1,), "b": (1,)})


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_file(tmp_path: Path, damage: str) -> None:
    root = write_checkpoint(tmp_path, tiny())
    path = root / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x13\x37" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or corrupt"):
        load(root, shapes_of(tiny()))


def test_missing_tensors_lists_five_and_count(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, {"a": torch.ones(1)})
    shapes = {"a": (1,)} | {f"m{i}": (1,) for i in range(7)}
    msg = r"7 missing tensor\(s\): m0, m1, m2, m3, m4, \.\.\. \(2 more\)"
    with pytest.raises(CheckpointError, match=msg):
        load(root, shapes)


def test_unexpected_tensor(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, {"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): b \("):
        load(root, {"a": (1,)})


def test_shape_mismatch_fails_before_any_load(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, {"a": torch.ones(3), "w": torch.ones(5, 4)})
    calls = []
    specs = {
        "a": WeightSpec((3,), calls.append),
        "w": WeightSpec((4, 5), calls.append),
    }
    with pytest.raises(CheckpointError, match=r"^w: expected shape \(4, 5\), got \(5, 4\)"):
        load_checkpoint(root, specs, torch.float32, progress=False)
    assert calls == []


@pytest.mark.parametrize("bad", [torch.int64, torch.int8, torch.bool, torch.float8_e5m2])
def test_unsupported_dtype(tmp_path: Path, bad: torch.dtype) -> None:
    root = write_checkpoint(tmp_path, {"w": torch.zeros(2, 2).to(bad)})
    with pytest.raises(CheckpointError, match=r"^w: unsupported dtype \w+ .*supported: F32, F16"):
        load(root, {"w": (2, 2)}, fp8=FP8)


def test_fp8_without_fp8_config(tmp_path: Path) -> None:
    q, s = quantize_fp8_block(torch.randn(4, 4))
    root = write_checkpoint(tmp_path, {"w": q, "w_scale_inv": s})
    with pytest.raises(CheckpointError, match="w: unsupported dtype F8_E4M3 .*quantization_config"):
        load(root, {"w": (4, 4)})


def test_fp8_weight_without_scale(tmp_path: Path) -> None:
    q, _ = quantize_fp8_block(torch.randn(4, 4))
    root = write_checkpoint(tmp_path, {"x.weight": q})
    with pytest.raises(CheckpointError, match="x.weight: F8_E4M3 weight without its x.weight_sc"):
        load(root, {"x.weight": (4, 4)}, fp8=FP8)


def test_fp8_scale_with_wrong_block_size(tmp_path: Path) -> None:
    q, s = quantize_fp8_block(torch.randn(200, 200), 64, 64)
    root = write_checkpoint(tmp_path, {"x.weight": q, "x.weight_scale_inv": s})
    with pytest.raises(CheckpointError, match=r"expected shape \(2, 2\) .* got \(4, 4\)"):
        load(root, {"x.weight": (200, 200)}, fp8=FP8)
