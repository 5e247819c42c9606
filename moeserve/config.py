"""Engine configuration: one frozen dataclass, validated once; derived values are properties."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from moeserve.quant import FP32_ACTIVATIONS, normalize_quantization

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (Linux); empty when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AVX-512-BF16 or AMX-BF16: bf16 compute is then faster than fp32 on this CPU."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs with fast bf16, else fp32 (the fast path on AVX2)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose auto, {', '.join(sorted(set(_DTYPES)))}"
        ) from None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # default: enough for max_num_seqs full contexts, <= 4
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None
    load_mtp: bool = True
    # speculative decoding with the checkpoint's MTP layer: draft tokens per step; 0: off
    speculative_num_tokens: int = 0
    # a file of hot token ids the drafts are proposed from (spec/hot_vocab.py); None: all
    speculative_token_map: str | None = None
    quantization: str | None = None  # None | "none" | "int8" | "w8a8_int8" | "bf16": at load
    num_threads: int | None = None
    seed: int = 0
    progress: bool = True
    # parallel layout (vLLM's names); see moeserve/distributed/parallel_dims.py
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0  # --ep-num-redundant-experts: E + R physical slots
    # expert-parallel load balancing (moeserve/eplb/balancer.py)
    enable_eplb: bool = False  # re-place the experts every eplb_interval steps
    eplb_interval: int = 1000
    eplb_window: int = 1000  # steps of expert-load statistics
    eplb_algorithm: str = "auto"  # auto | hierarchical | global
    eplb_layers_per_step: int = 1
    expert_stats_out: str | None = None  # dump the window here at shutdown
    init_expert_location: str | None = None  # placement or raw stats file
    moe_overlap: bool = True  # shared experts run while the expert dispatch is in flight
    two_batch_overlap: bool = False
    numa_bind: str = "auto"  # auto | none: one rank per NUMA node, threads pinned
    dist_timeout_s: float = 120.0  # a peer that never arrives or stops answering
    # joining ranks started elsewhere (torchrun, Slurm, other hosts); None: spawn them here
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.speculative_num_tokens < 0:
            raise ValueError(
                f"speculative_num_tokens must be >= 0, got {self.speculative_num_tokens}"
            )
        if self.speculative_token_map and not self.speculative_num_tokens:
            raise ValueError("speculative_token_map needs speculative_num_tokens >= 1")
        if self.speculative_num_tokens and not self.load_mtp:
            raise ValueError("speculative_num_tokens drafts with the MTP layer: drop --no-mtp")
        if self.speculative_num_tokens and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding does not support pipeline parallelism yet")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        resolve_dtype(self.dtype, torch.device("cpu"))  # validates the name
        object.__setattr__(self, "quantization", normalize_quantization(self.quantization))
        _ = self.parallel_dims  # validates the layout
        _ = self.eplb_options  # validates the EPLB settings
        if (self.enable_eplb or self.num_redundant_experts) and not self.enable_expert_parallel:
            raise ValueError(
                "enable_eplb and redundant experts need expert parallelism "
                "(enable_expert_parallel / --ep N)"
            )
        if self.numa_bind not in ("auto", "none"):
            raise ValueError(f"numa_bind must be auto or none, got {self.numa_bind!r}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )

    @property
    def parallel_dims(self):
        from moeserve.distributed.parallel_dims import ParallelDims

        return ParallelDims(
            self.tensor_parallel_size,
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.enable_expert_parallel,
        )

    @property
    def moe_options(self):
        from moeserve.layers.moe_block import MoEOptions

        return MoEOptions(
            self.moe_overlap, self.two_batch_overlap, self.num_redundant_experts, self.nnodes
        )

    @property
    def eplb_options(self):
        from moeserve.eplb.balancer import EplbOptions

        return EplbOptions(
            enable=self.enable_eplb,
            interval_steps=self.eplb_interval,
            window_steps=self.eplb_window,
            algorithm=self.eplb_algorithm,
            layers_per_step=self.eplb_layers_per_step,
            stats_out=self.expert_stats_out,
            init_location=self.init_expert_location,
        )

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def weight_format(self) -> str | None:
        """The format the weights are held in: ``quantization`` when set; with ``dtype="auto"``
        on a CPU whose AMX kernels run, bf16 (with fp32 activations, ``torch_dtype``): faster
        than computing in bf16 throughout and closer to fp32 (docs/benchmarks.md); else None
        (the model dtype)."""
        if self.quantization is not None or self.dtype != "auto":
            return self.quantization
        if self.torch_device.type != "cpu" or not cpu_has_fast_bf16():
            return None
        from moeserve.ops.cpu import amx  # builds the kernels on first use

        return "bf16" if amx.available() else None

    @property
    def torch_dtype(self) -> torch.dtype:
        device = self.torch_device
        if self.dtype == "auto" and device.type == "cpu" and self.weight_format in FP32_ACTIVATIONS:
            return torch.float32  # the int8 and bf16-weight CPU kernels take fp32 activations
        return resolve_dtype(self.dtype, device)


def default_cache_dir() -> str:
    return os.environ.get("MOESERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moeserve"
    )
