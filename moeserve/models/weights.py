"""Stream a Hugging Face safetensors checkpoint into a model, one tensor at a time.

A model declares what it expects as ``{hf_tensor_name: WeightSpec}``; :func:`load_checkpoint`
checks every header against that (names, shapes, dtypes) before reading any data, then reads one
tensor, converts it to the compute dtype (dequantizing DeepSeek FP8 weights), hands it to the
spec's ``load`` and drops it, so the model is never held twice in memory.

An AWQ or GPTQ checkpoint's ``X.weight`` comes as ``X.qweight``, ``X.qzeros``, ``X.scales``
(and GPTQ's ``X.g_idx``): those are read together and handed over decoded, as a
``PackedInt4`` (``quant/int4_checkpoints.py``), which an int4 weight stores as it is.

Only safetensors are read: nothing in the model directory is executed or unpickled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from moeserve.models.fp8 import dequantize_fp8_block, scale_shape
from moeserve.models.hf_config import Fp8Config
from moeserve.quant.int4_checkpoints import (
    Int4CheckpointConfig,
    Int4CheckpointError,
    decode,
    expected_shapes,
    packed_names,
)

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # "X.weight" is dequantized with "X.weight_scale_inv"
FP8_DTYPE = "F8_E4M3"
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, FP8_DTYPE: 1, "I32": 4}
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")  # AWQ's and GPTQ's tensors
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_LISTED = 5


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or does not match the model; one-line message."""


@dataclass(frozen=True)
class WeightSpec:
    """One tensor the model expects.

    ``shape`` is the tensor's shape in the checkpoint (for an FP8 weight, the weight's own shape,
    not its scale's). ``load`` receives the full tensor already converted to the compute dtype
    (dequantized if FP8) and copies what it needs into the model; it must not keep a reference.
    """

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]
    # (dim, start, length): read only this range of the tensor (a tensor-parallel shard); the
    # range is clipped to the tensor, so the last shard of a padded dimension may come shorter
    shard: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"WeightSpec shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if self.shard is not None:
            dim, start, length = self.shard
            if not (0 <= dim < len(shape) and 0 <= start and length > 0):
                raise ValueError(f"WeightSpec shard {self.shard} does not fit shape {shape}")

    def narrowed(self, full: torch.Tensor) -> torch.Tensor:
        """The part of a full checkpoint tensor this spec reads."""
        if self.shard is None:
            return full
        dim, start, length = self.shard
        return full.narrow(dim, start, max(0, min(length, full.shape[dim] - start)))


@dataclass(frozen=True)
class LoadReport:
    num_tensors: int  # tensors handed to a spec's load (FP8 scales not counted)
    num_bytes: int  # bytes read from disk, FP8 scales included
    skipped: tuple[str, ...]  # checkpoint tensors ignored because skip(name) was true
    seconds: float


@dataclass(frozen=True)
class _Entry:
    """What a safetensors header says about one tensor."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: "BF16", "F8_E4M3", ...

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``, in a stable order.

    Uses ``model.safetensors.index.json`` (its ``weight_map``) when present, otherwise every
    ``*.safetensors`` file. Raises CheckpointError if the directory or the weights are missing,
    the index is unreadable or names a shard that is not there.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    weight_map = _read_index(root)
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{root / INDEX_FILE} names {len(missing)} shard(s) missing from {root}: "
                f"{_listed(missing)}; re-download the checkpoint"
            )
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(
            f"{root} has only {_listed(pickled)}: only safetensors weights are supported; "
            "convert the checkpoint to safetensors"
        )
    raise CheckpointError(f"expected *.safetensors weights in {root}: none found")


def load_checkpoint(
    model_dir: str | Path,
    specs: Mapping[str, WeightSpec],
    dtype: torch.dtype,
    *,
    fp8: Fp8Config | None = None,
    int4: Int4CheckpointConfig | None = None,
    skip: Callable[[str], bool] | None = None,
    progress: bool = True,
) -> LoadReport:
    """Load every tensor named in ``specs`` from ``model_dir`` via its spec's ``load``.

    Tensors for which ``skip(name)`` is true are ignored (and not required); the scale of a
    skipped FP8 weight is skipped with it. With ``fp8``, ``float8_e4m3fn`` weights are
    dequantized with their ``<name>_scale_inv``, which must not be in ``specs``. With ``int4``
    (an AWQ or GPTQ checkpoint), a ``<base>.weight`` stored as ``<base>.qweight`` and the rest
    is handed over as a ``PackedInt4``. Every header is validated before any data is read.
    Raises CheckpointError for a missing or damaged file, a missing or unexpected tensor, a
    shape mismatch or an unsupported dtype.
    """
    start = time.perf_counter()
    root = Path(model_dir)
    entries = _scan_headers(checkpoint_files(root), _read_index(root), root)
    order, skipped = _plan(entries, specs, fp8, int4, skip or (lambda _name: False), root)
    num_bytes = 0
    with _OpenFiles() as files, torch.no_grad():
        bar = tqdm(order, desc="loading weights", unit="tensor", disable=not progress)
        for name, companions in bar:
            spec = specs[name]
            if int4 is not None and companions and companions[0].endswith(".qweight"):
                num_bytes += sum(entries[c].nbytes for c in companions)
                tensor = _read_packed(files, entries, int4, name, companions, spec)
            elif companions:
                # FP8 blocks straddle shard edges: dequantize the whole tensor, then cut
                assert fp8 is not None
                (scale_name,) = companions
                entry = entries[name]
                tensor = files.tensor(entry.file, name)
                scale = files.tensor(entries[scale_name].file, scale_name)
                num_bytes += entry.nbytes + entries[scale_name].nbytes
                tensor = dequantize_fp8_block(tensor, scale, fp8.block_n, fp8.block_k, dtype)
                tensor = spec.narrowed(tensor)
                del scale
            else:
                entry = entries[name]
                tensor = files.tensor(entry.file, name, spec.shard)
                num_bytes += tensor.numel() * ITEMSIZE[entry.dtype]
                tensor = tensor.to(dtype)
            spec.load(tensor)
            del tensor
    return LoadReport(len(order), num_bytes, skipped, time.perf_counter() - start)


def _read_packed(
    files: _OpenFiles,
    entries: Mapping[str, _Entry],
    int4: Int4CheckpointConfig,
    name: str,
    companions: tuple[str, ...],
    spec: WeightSpec,
):
    """The AWQ/GPTQ tensors of ``name`` decoded, then cut to the spec's shard."""
    base = name.removesuffix(".weight")
    parts = {c[len(base) + 1 :]: files.tensor(entries[c].file, c) for c in companions}
    N, K = spec.shape
    try:
        return spec.narrowed(decode(int4, parts, N, K, base))
    except Int4CheckpointError as e:
        raise CheckpointError(str(e)) from None


def _read_index(root: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> shard file name), or None without an index."""
    path = root / INDEX_FILE
    if not path.is_file():
        return None
    try:
        raw: Any = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path} has no 'weight_map' of tensor name -> file; re-download it")
    for shard in weight_map.values():
        if Path(shard).name != shard:
            raise CheckpointError(f"{path} names shard {shard!r} outside the model directory")
    return weight_map


def _scan_headers(
    files: list[Path], weight_map: dict[str, str] | None, root: Path
) -> dict[str, _Entry]:
    """Read every file's header (no tensor data); check the index agrees with the shards."""
    entries: dict[str, _Entry] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    entry = _Entry(path, tuple(sl.get_shape()), sl.get_dtype())
                    if name in entries:
                        raise CheckpointError(
                            f"tensor {name} is in both {entries[name].file.name} and "
                            f"{path.name}; the checkpoint is inconsistent, re-download it"
                        )
                    entries[name] = entry
        except SafetensorError as e:
            raise CheckpointError(_damaged(path, e)) from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
    for name, shard in (weight_map or {}).items():
        found = entries.get(name)
        if found is None or found.file.name != shard:
            where = "no shard" if found is None else found.file.name
            raise CheckpointError(
                f"{root / INDEX_FILE} puts {name} in {shard}, but it is in {where}; "
                "re-download the checkpoint"
            )
    return entries


def _plan(
    entries: Mapping[str, _Entry],
    specs: Mapping[str, WeightSpec],
    fp8: Fp8Config | None,
    int4: Int4CheckpointConfig | None,
    skip: Callable[[str], bool],
    root: Path,
) -> tuple[list[tuple[str, tuple[str, ...]]], tuple[str, ...]]:
    """Validate headers against ``specs``; return ``[(name, companion names)]`` to load, in
    file order (companions: an FP8 weight's scale, or the AWQ/GPTQ tensors that stand for
    ``name``), and the skipped checkpoint names. Raises CheckpointError on the first
    problem."""

    def is_skipped(name: str) -> bool:
        if skip(name):
            return True
        if name.endswith(SCALE_SUFFIX):
            return skip(name[: -len(SCALE_SUFFIX)])
        suffix = next((s for s in PACKED_SUFFIXES if name.endswith(s)), None)
        return suffix is not None and skip(name.removesuffix(suffix) + ".weight")

    skipped = tuple(sorted(n for n in entries if is_skipped(n)))
    wanted = [n for n in specs if not skip(n) and (n in entries or _packed(n, entries, int4))]
    order: list[tuple[str, tuple[str, ...]]] = []
    consumed: set[str] = set()

    def where(n: str) -> tuple[Path, str]:
        return (entries[n].file if n in entries else entries[_packed(n, entries, int4)[0]].file, n)

    for name in sorted(wanted, key=where):
        if name not in entries:
            companions = _packed(name, entries, int4)
            _check_packed(name, specs[name].shape, companions, entries, int4)
            consumed.update(companions)
            order.append((name, companions))
            continue
        entry = entries[name]
        _check_dtype(name, entry, fp8)
        if entry.shape != specs[name].shape:
            raise CheckpointError(
                f"{name}: expected shape {specs[name].shape}, got {entry.shape} "
                f"in {entry.file.name}; the checkpoint does not match the model config"
            )
        companions: tuple[str, ...] = ()
        if entry.dtype == FP8_DTYPE:
            assert fp8 is not None
            scale_name = name + SCALE_SUFFIX
            _check_scale(name, entry, entries.get(scale_name), fp8)
            consumed.add(scale_name)
            companions = (scale_name,)
        order.append((name, companions))
    missing = sorted(n for n in specs if not skip(n) and n not in wanted)
    extra = sorted(n for n in entries if n not in specs and n not in consumed and n not in skipped)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {_listed(missing)}")
        if extra:
            parts.append(f"{len(extra)} unexpected tensor(s): {_listed(extra)}")
        hint = ""
        if int4 is None and any(n.endswith(".qweight") for n in extra):
            hint = "; the checkpoint holds 4-bit tensors but config.json names no awq or gptq"
        raise CheckpointError(
            f"checkpoint {root} does not match the model: {'; '.join(parts)} "
            f"(wrong model directory or config? tensors to ignore can be skipped){hint}"
        )
    return order, skipped


def _packed(
    name: str, entries: Mapping[str, _Entry], int4: Int4CheckpointConfig | None
) -> tuple[str, ...]:
    """The AWQ/GPTQ tensors that stand for ``name`` (``<base>.weight``), or ()."""
    if int4 is None or not name.endswith(".weight"):
        return ()
    names = packed_names(name.removesuffix(".weight"), int4.method)
    if names[0] not in entries:
        return ()
    return tuple(n for n in names if n in entries)


def _check_packed(
    name: str,
    shape: tuple[int, ...],
    companions: tuple[str, ...],
    entries: Mapping[str, _Entry],
    int4: Int4CheckpointConfig,
) -> None:
    """Headers of ``name``'s packed tensors against the ``[N, K]`` weight and the config."""
    if len(shape) != 2:
        raise CheckpointError(f"{name}: a {int4.method} weight must be 2-D, got {shape}")
    N, K = shape
    want = expected_shapes(int4.method, N, K, int4.group_size)
    base = name.removesuffix(".weight")
    for key, expect in want.items():
        entry = entries.get(f"{base}.{key}")
        if entry is None:
            if key == "g_idx":
                continue
            raise CheckpointError(f"{base}.{key}: missing; the {int4.method} weight is incomplete")
        if entry.shape != expect:
            raise CheckpointError(
                f"{base}.{key}: expected shape {expect} for a [{N}, {K}] {int4.method} weight "
                f"with group size {int4.group_size}, got {entry.shape}: the packing disagrees "
                "with the quantization_config"
            )
        ok = entry.dtype in FLOAT_DTYPES if key == "scales" else entry.dtype == "I32"
        if not ok:
            raise CheckpointError(f"{base}.{key}: unsupported dtype {entry.dtype}")


def _check_dtype(name: str, entry: _Entry, fp8: Fp8Config | None) -> None:
    if entry.dtype in FLOAT_DTYPES or (entry.dtype == FP8_DTYPE and fp8 is not None):
        return
    supported = ", ".join(FLOAT_DTYPES)
    if entry.dtype == FP8_DTYPE:
        hint = f"; {FP8_DTYPE} needs an fp8 quantization_config in config.json"
    else:
        hint = f", or {FP8_DTYPE} with an fp8 quantization_config"
    raise CheckpointError(
        f"{name}: unsupported dtype {entry.dtype} in {entry.file.name}; "
        f"supported: {supported}{hint}"
    )


def _check_scale(name: str, weight: _Entry, scale: _Entry | None, fp8: Fp8Config) -> None:
    scale_name = name + SCALE_SUFFIX
    if scale is None:
        raise CheckpointError(
            f"{name}: {FP8_DTYPE} weight without its {scale_name}; the checkpoint is incomplete"
        )
    if len(weight.shape) != 2:
        raise CheckpointError(f"{name}: {FP8_DTYPE} weight must be 2-D, got shape {weight.shape}")
    expected = scale_shape(weight.shape, fp8.block_n, fp8.block_k)
    if scale.shape != expected:
        raise CheckpointError(
            f"{scale_name}: expected shape {expected} for blocks ({fp8.block_n}, {fp8.block_k}), "
            f"got {scale.shape}; check weight_block_size in config.json"
        )
    if scale.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{scale_name}: unsupported dtype {scale.dtype}; supported: {', '.join(FLOAT_DTYPES)}"
        )


class _OpenFiles(ExitStack):
    """Opens shards lazily and keeps them open until exit (an FP8 scale may sit in another
    shard than its weight). safe_open memory-maps, so open shards cost address space only."""

    def __init__(self) -> None:
        super().__init__()
        self._handles: dict[Path, Any] = {}

    def tensor(
        self, path: Path, name: str, shard: tuple[int, int, int] | None = None
    ) -> torch.Tensor:
        """The whole tensor, or only ``shard = (dim, start, length)`` of it (clipped)."""
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self.enter_context(safe_open(str(path), framework="pt"))
                self._handles[path] = handle
            if shard is None:
                return handle.get_tensor(name)
            dim, start, length = shard
            sl = handle.get_slice(name)
            stop = min(start + length, sl.get_shape()[dim])
            index = (slice(None),) * dim + (slice(start, max(start, stop)),)
            return sl[index]
        except SafetensorError as e:
            raise CheckpointError(_damaged(path, e)) from None
        except OSError as e:
            raise CheckpointError(f"cannot read {name} from {path}: {e}") from None


def _damaged(path: Path, err: Exception) -> str:
    detail = str(err).replace("\n", " ")
    return f"{path} is truncated or corrupt ({detail}); re-download it"


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")
