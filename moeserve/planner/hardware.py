"""Hardware profiles: what one node computes, holds and moves, read from YAML.

A profile describes one *node* made of ``devices`` identical devices (a GPU or NPU, or one
NUMA domain of a CPU: the engine puts one rank on each), the links inside the node and
between nodes, and the software stack's fixed costs. Every figure in the YAML is written as
``{value: X, source: "..."}``; the source names a vendor spec, a paper, a measurement
(``calibrated: ...``) or says ``assumption``. Loading checks every field and every source,
and names the file and the field when something is wrong.

Units: TFLOP/s, GB/s (1e9 bytes), GB of memory (1e9 bytes), microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
KINDS = ("cpu", "gpu", "npu")
# int4: the codes and, per group of 128 columns, an fp32 scale and a one-byte zero point
# (ops/formats/int4.py)
DTYPE_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 5 / 128,
}


class ProfileError(ValueError):
    """A hardware profile that is missing, unreadable or incomplete."""


@dataclass(frozen=True)
class Device:
    """One device: a GPU/NPU, or one NUMA domain of a CPU node."""

    matmul_tflops: dict[str, float]  # peak dense GEMM per compute dtype
    matmul_efficiency: float  # fraction of peak large GEMMs reach
    gemm_m_half: float  # GEMM rows at which half of that efficiency is reached
    expert_efficiency: float  # grouped expert GEMMs against one plain GEMM of the same work
    # (above 1 where the expert kernel streams better than the plain GEMM path)
    memory_bandwidth_gbs: float  # peak
    memory_efficiency: float  # fraction of peak a weight stream reaches
    memory_gb: float
    cores: int  # CPU cores of the domain (GPUs: SMs); informs oversubscription
    # a second GEMM path for few rows (moeserve's own CPU kernels: up to small_gemm_max_rows
    # rows, and every expert block of the MoE kernel) with its own rate; 0: one path
    small_gemm_max_rows: int = 0
    small_gemm_tflops: float = 0.0  # peak of that path, at the compute dtype
    small_gemm_m_half: float = 0.0
    expert_m_half: float | None = None  # rows per expert at half the expert kernel's rate
    # experts with at least this many rows in a step run as plain GEMMs (the large-GEMM path)
    # instead of the expert kernel (moeserve's CPU MoE: ops/cpu/fp32.MKL_MIN_ROWS); 0: never
    expert_gemm_min_rows: int = 0
    # the prefill attention core (scores, mask, softmax, values, with its copies) against a
    # plain GEMM of the same FLOPs at the same rows
    prefill_attention_efficiency: float = 1.0

    def gemm_rate(self, dtype: str, m: float) -> tuple[float, float]:
        """(FLOP/s at many rows, half-rate rows) of the path that runs an ``m``-row GEMM."""
        if self.small_gemm_max_rows and m <= self.small_gemm_max_rows:
            return self.small_gemm_tflops * 1e12, self.small_gemm_m_half
        return self.flops_per_s(dtype), self.gemm_m_half

    def __post_init__(self) -> None:
        if not self.matmul_tflops:
            raise ProfileError("device.matmul_tflops needs at least one dtype")
        for dt, v in self.matmul_tflops.items():
            if dt not in DTYPE_BYTES:
                raise ProfileError(f"device.matmul_tflops: unknown dtype {dt!r}")
            _positive(f"device.matmul_tflops.{dt}", v)
        for name in ("matmul_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ProfileError(f"device.{name} must be in (0, 1], got {v}")
        if not 0 < self.expert_efficiency <= 2:
            raise ProfileError(
                f"device.expert_efficiency must be in (0, 2], got {self.expert_efficiency}"
            )
        if not 0 < self.prefill_attention_efficiency <= 1:
            raise ProfileError(
                "device.prefill_attention_efficiency must be in (0, 1], got "
                f"{self.prefill_attention_efficiency}"
            )
        if self.expert_m_half is not None:
            _positive("device.expert_m_half", self.expert_m_half, zero_ok=True)
        _positive("device.expert_gemm_min_rows", self.expert_gemm_min_rows, zero_ok=True)
        if self.small_gemm_max_rows:
            _positive("device.small_gemm_tflops", self.small_gemm_tflops)
            _positive("device.small_gemm_m_half", self.small_gemm_m_half, zero_ok=True)
        _positive("device.gemm_m_half", self.gemm_m_half, zero_ok=True)
        _positive("device.memory_bandwidth_gbs", self.memory_bandwidth_gbs)
        _positive("device.memory_gb", self.memory_gb)
        _positive("device.cores", self.cores)

    def flops_per_s(self, dtype: str) -> float:
        """Large-GEMM FLOP/s for ``dtype`` (falls back to the slowest listed dtype that is at
        least as wide, then to the slowest listed)."""
        if dtype in self.matmul_tflops:
            peak = self.matmul_tflops[dtype]
        else:
            wider = [
                v for d, v in self.matmul_tflops.items() if DTYPE_BYTES[d] >= DTYPE_BYTES[dtype]
            ]
            peak = min(wider) if wider else min(self.matmul_tflops.values())
        return peak * 1e12 * self.matmul_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency

    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_gb * 1e9))


@dataclass(frozen=True)
class Link:
    """A network level. An all-to-all among n ranks over it costs
    ``latency_us + per_peer_us * (n - 1) + bytes / bandwidth`` (a ring all-reduce takes
    ``2 (n - 1)`` steps); ``bandwidth_gbs`` is what one device can send (inside a node) or
    what the whole node's NICs can send (between nodes)."""

    latency_us: float  # all-to-all, broadcast, point-to-point
    allreduce_latency_us: float  # an all-reduce's fixed cost (reduce, then share)
    per_peer_us: float
    bandwidth_gbs: float

    def __post_init__(self) -> None:
        _positive("link.latency_us", self.latency_us, zero_ok=True)
        _positive("link.allreduce_latency_us", self.allreduce_latency_us, zero_ok=True)
        _positive("link.per_peer_us", self.per_peer_us, zero_ok=True)
        _positive("link.bandwidth_gbs", self.bandwidth_gbs)


@dataclass(frozen=True)
class Software:
    """Fixed costs of the serving stack on this hardware (Python, launches, control plane)."""

    step_overhead_us: float  # per engine step (scheduling, input prep, sampling)
    layer_overhead_us: float  # per decoder layer per step (module calls, small ops)
    seq_overhead_us: float  # per sequence in the step (metadata, sampler, output)
    seq_layer_overhead_us: float  # per sequence per layer (per-sequence work in each layer)
    op_overhead_us: float  # per kernel call (launch / dispatch cost)
    collective_overhead_us: float  # per collective call, on top of the link model
    oversubscription_us: float  # per collective, per rank beyond the node's cores (waking a
    # descheduled peer: CPU ranks sharing cores)
    dispatch_collectives: int  # collectives per EP dispatch (row counts + rows: 2; DeepEP: 1)
    control_collectives: int  # small world-wide collectives per step (rank 0's messages)
    comm_overlaps_compute: bool  # can communication hide behind compute (own engines)?
    weight_dtype: str  # default weight storage dtype
    compute_dtype: str  # activations and GEMM dtype
    kv_dtype: str
    dispatch_dtype: str  # rows sent to the experts (DeepEP: fp8; combine stays compute_dtype)
    memory_reserve_fraction: float  # of device memory kept for the runtime, not the model

    def __post_init__(self) -> None:
        for name in ("weight_dtype", "compute_dtype", "kv_dtype", "dispatch_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ProfileError(
                    f"software.{name}: unknown dtype {getattr(self, name)!r}; "
                    f"choose from {', '.join(DTYPE_BYTES)}"
                )
        if not 0 <= self.memory_reserve_fraction < 1:
            raise ProfileError("software.memory_reserve_fraction must be in [0, 1)")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str
    description: str
    devices: int  # per node: GPUs/NPUs, or CPU NUMA domains (one rank each)
    device: Device
    intra_node: Link
    inter_node: Link
    software: Software
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ProfileError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        _positive("node.devices", self.devices)

    @property
    def node_memory_bytes(self) -> int:
        return self.devices * self.device.memory_bytes


def _positive(name: str, v: float, zero_ok: bool = False) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and not zero_ok):
        raise ProfileError(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {v!r}")


# ---------------------------------------------------------------------------------- loading

_DEVICE = (
    "memory_bandwidth_gbs",
    "memory_efficiency",
    "memory_gb",
    "cores",
    "matmul_efficiency",
    "gemm_m_half",
    "expert_efficiency",
)
_DEVICE_OPTIONAL = (
    "small_gemm_max_rows",
    "small_gemm_tflops",
    "small_gemm_m_half",
    "expert_m_half",
    "expert_gemm_min_rows",
    "prefill_attention_efficiency",
)
_LINK = ("latency_us", "allreduce_latency_us", "per_peer_us", "bandwidth_gbs")
_SOFTWARE = (
    "step_overhead_us",
    "layer_overhead_us",
    "seq_overhead_us",
    "seq_layer_overhead_us",
    "op_overhead_us",
    "collective_overhead_us",
    "oversubscription_us",
    "dispatch_collectives",
    "control_collectives",
    "comm_overlaps_compute",
    "weight_dtype",
    "compute_dtype",
    "kv_dtype",
    "dispatch_dtype",
    "memory_reserve_fraction",
)


class _Reader:
    """Reads ``{value, source}`` figures and remembers every source by its dotted name."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.sources: dict[str, str] = {}

    def fail(self, msg: str) -> ProfileError:
        return ProfileError(f"hardware profile {self.where}: {msg}")

    def section(self, raw: dict, key: str) -> dict:
        sec = raw.get(key)
        if not isinstance(sec, dict):
            raise self.fail(f"missing section {key!r} (a mapping)")
        return sec

    def figure(self, sec: dict, path: str, key: str) -> Any:
        name = f"{path}.{key}"
        if key not in sec:
            raise self.fail(f"missing field {name}")
        item = sec[key]
        if not isinstance(item, dict) or "value" not in item:
            raise self.fail(f"{name} must be {{value: ..., source: ...}}, got {item!r}")
        source = item.get("source")
        if not isinstance(source, str) or not source.strip():
            raise self.fail(f"{name} has no source (a vendor spec, a paper, or 'assumption')")
        self.sources[name] = source
        return item["value"]


def profile_from_dict(raw: Any, where: str = "<dict>") -> HardwareProfile:
    """Build a profile from parsed YAML; raises :class:`ProfileError` naming the field."""
    r = _Reader(where)
    if not isinstance(raw, dict):
        raise r.fail("the top level must be a mapping")
    for key in ("name", "kind"):
        if not isinstance(raw.get(key), str):
            raise r.fail(f"missing field {key!r} (a string)")
    node, dev, net, sw = (r.section(raw, k) for k in ("node", "device", "network", "software"))
    tflops_raw = dev.get("matmul_tflops")
    if not isinstance(tflops_raw, dict) or not tflops_raw:
        raise r.fail("missing field device.matmul_tflops (a mapping dtype -> {value, source})")
    try:
        device = Device(
            matmul_tflops={
                dt: float(r.figure(tflops_raw, "device.matmul_tflops", dt)) for dt in tflops_raw
            },
            **{k: _num(r, dev, "device", k) for k in _DEVICE},
            **{k: _num(r, dev, "device", k) for k in _DEVICE_OPTIONAL if k in dev},
        )
        links = {}
        for level in ("intra_node", "inter_node"):
            sec = r.section(net, level)
            links[level] = Link(**{k: _num(r, sec, f"network.{level}", k) for k in _LINK})
        sw_vals = {k: r.figure(sw, "software", k) for k in _SOFTWARE}
        for k in ("dispatch_collectives", "control_collectives"):
            sw_vals[k] = int(sw_vals[k])
        sw_vals["comm_overlaps_compute"] = bool(sw_vals["comm_overlaps_compute"])
        for k in ("weight_dtype", "compute_dtype", "kv_dtype", "dispatch_dtype"):
            sw_vals[k] = str(sw_vals[k])
        for k in _SOFTWARE:
            if k.endswith("_us") or k == "memory_reserve_fraction":
                if isinstance(sw_vals[k], bool) or not isinstance(sw_vals[k], (int, float)):
                    raise r.fail(f"software.{k} must be a number, got {sw_vals[k]!r}")
                sw_vals[k] = float(sw_vals[k])
        return HardwareProfile(
            name=raw["name"],
            kind=raw["kind"],
            description=str(raw.get("description", "")),
            devices=int(r.figure(node, "node", "devices")),
            device=device,
            intra_node=links["intra_node"],
            inter_node=links["inter_node"],
            software=Software(**sw_vals),
            sources=r.sources,
        )
    except ProfileError as e:
        if str(e).startswith("hardware profile"):
            raise
        raise r.fail(str(e)) from None
    except (TypeError, ValueError) as e:
        raise r.fail(str(e)) from None


def _num(r: _Reader, sec: dict, path: str, key: str) -> float:
    v = r.figure(sec, path, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise r.fail(f"{path}.{key} must be a number, got {v!r}")
    return v


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name (``h800``, ``this-machine``...) or a YAML file path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ProfileError(
                f"unknown hardware profile {name_or_path!r}: not a file, and not one of the "
                f"built-in profiles ({', '.join(builtin_profiles())})"
            )
    if not path.is_file():
        raise ProfileError(f"hardware profile {path}: not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ProfileError(f"hardware profile {path}: invalid YAML: {e}") from None
    return profile_from_dict(raw, str(path))
