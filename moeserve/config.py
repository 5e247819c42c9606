"""Engine configuration: frozen dataclasses, validated once; derived values are properties.

The ground floor: this module imports nothing of moeserve but the platform facts and the
weight-format registry's names, so every layer may read its options from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.distributed.parallel_dims import ParallelDims
from moeserve.ops.formats import check_options, normalize_quantization
from moeserve.platform import resolve_device, resolve_dtype


@dataclass(frozen=True)
class MoEOptions:
    """How an MoE layer runs under expert parallelism (``layers/moe_block.py``)."""

    overlap: bool = True  # run the shared experts while the dispatch is in flight
    two_batch: bool = False  # split each batch into two micro-batches around the all-to-alls
    num_redundant_experts: int = 0
    num_nodes: int = 1  # hosts the world spans (replicas on a token's own node come first)

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError("num_redundant_experts must be >= 0")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")


EPLB_ALGORITHMS = ("auto", "hierarchical", "global")


@dataclass(frozen=True)
class EplbOptions:
    """Expert-parallel load balancing (``eplb/balancer.py``). ``enable``: re-place every
    ``interval_steps`` steps from the last ``window_steps``. ``stats_out``: where ``dump``
    (and shutdown) writes the window; ``init_location``: a placement or raw-stats file that
    sets the placement at start (``eplb/stats.py``)."""

    enable: bool = False
    interval_steps: int = 1000
    window_steps: int = 1000
    algorithm: str = "auto"
    layers_per_step: int = 1
    min_gain: float = 0.01  # move a layer only if its imbalance drops by more than this
    stats_out: str | None = None
    init_location: str | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in EPLB_ALGORITHMS:
            raise ValueError(
                f"eplb_algorithm must be one of {EPLB_ALGORITHMS}, got {self.algorithm!r}"
            )
        for name in ("interval_steps", "window_steps", "layers_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"eplb {name} must be >= 1, got {getattr(self, name)}")
        if self.min_gain < 0:
            raise ValueError(f"eplb min_gain must be >= 0, got {self.min_gain}")

    @property
    def chunk_steps(self) -> int:
        """Granularity of the sliding window: the largest divisor of it up to 10."""
        return max(c for c in range(1, 11) if self.window_steps % c == 0)


DISAGGREGATION_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True)
class DisaggregationOptions:
    """Prefill/decode disaggregation (``moeserve/disagg/``; SGLang's flag names). ``mode``
    ``null`` serves colocated. ``host``: the address the other instances reach this one at
    (the bootstrap socket and the transfer engine); ``ib_device``: RDMA device for the
    transfer engine (None: TCP). ``transfer_timeout_s``: how long a KV transfer, or a side
    waiting for the other, may take before the request fails."""

    mode: str = "null"
    bootstrap_port: int = 8998
    host: str = "127.0.0.1"
    ib_device: str | None = None
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got {self.mode!r}"
            )
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError(
                f"disaggregation_bootstrap_port must be in [1, 65535], got {self.bootstrap_port}"
            )
        if self.transfer_timeout_s <= 0:
            raise ValueError(
                f"disaggregation_transfer_timeout must be > 0, got {self.transfer_timeout_s}"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


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
    # None | "none" | "int8" | "w8a8_int8" | "int4" | "w4a8_int8" | "bf16": applied at load
    quantization: str | None = None
    int4_group_size: int | None = None  # int4, w4a8_int8: columns per scale (32/64/128; 128)
    int4_symmetric: bool = True  # int4, w4a8_int8: zero point 8 (False: one per group)
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
    # elastic EP (launch/elastic.py): the survivors of a rank loss go on without it
    enable_elastic_ep: bool = False
    elastic_ep_timeout_s: float = 10.0  # a silent peer fails a collective after this long
    # launch ranks this process starts to join a running elastic group (replacements)
    elastic_rejoin: tuple[int, ...] = ()
    # a rank > 0 that gets SIGTERM waits this long for rank 0's stop (node 0 drains first)
    shutdown_grace_s: float = 45.0
    # joining ranks started elsewhere (torchrun, Slurm, other hosts); None: spawn them here
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # prefill/decode disaggregation (DisaggregationOptions; SGLang's names)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_host: str = "127.0.0.1"
    disaggregation_ib_device: str | None = None
    disaggregation_transfer_timeout_s: float = 30.0

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
        check_options(self.quantization, self.int4_group_size, self.int4_symmetric)
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
        self._check_elastic()
        if self.shutdown_grace_s <= 0:
            raise ValueError(f"shutdown_grace_s must be > 0, got {self.shutdown_grace_s}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        if self.disaggregation_options.enabled:
            if self.speculative_num_tokens:
                raise ValueError(
                    "speculative decoding with prefill/decode disaggregation is not supported "
                    "yet: drop --speculative-num-tokens or --disaggregation-mode"
                )
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    "prefill/decode disaggregation does not support pipeline parallelism yet: "
                    "drop --pp or --disaggregation-mode"
                )
            if self.nnodes > 1:
                raise ValueError(
                    "a prefill or decode instance spans one host for now (its ranks on other "
                    "hosts would advertise this host's address): run one instance per host, "
                    "or drop --nnodes"
                )

    def _check_elastic(self) -> None:
        object.__setattr__(self, "elastic_rejoin", tuple(int(r) for r in self.elastic_rejoin))
        world = self.parallel_dims.world_size
        if self.elastic_rejoin and (
            not self.enable_elastic_ep
            or any(not 0 < r < world for r in self.elastic_rejoin)
            or self.master_port is None
        ):
            raise ValueError(
                f"--elastic-rejoin {list(self.elastic_rejoin)}: needs --enable-elastic-ep, the "
                f"running group's --master-addr and --master-port, and ranks in [1, {world})"
            )
        if self.elastic_ep_timeout_s <= 0:
            raise ValueError(f"elastic_ep_timeout_s must be > 0, got {self.elastic_ep_timeout_s}")
        if not self.enable_elastic_ep:
            return
        problems = []
        if not self.enable_expert_parallel or self.data_parallel_size < 2:
            problems.append("it needs expert parallelism over 2 or more DP replicas (--ep N)")
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            problems.append("each replica must be one rank (no --tp or --pp)")
        if self.disaggregation_mode != "null":
            problems.append("prefill/decode disaggregation is not supported with it yet")
        if self.speculative_num_tokens:
            problems.append("speculative decoding is not supported with it yet")
        if problems:
            raise ValueError("--enable-elastic-ep: " + "; ".join(problems))

    @property
    def disaggregation_options(self) -> DisaggregationOptions:
        return DisaggregationOptions(
            mode=self.disaggregation_mode,
            bootstrap_port=self.disaggregation_bootstrap_port,
            host=self.disaggregation_host,
            ib_device=self.disaggregation_ib_device,
            transfer_timeout_s=self.disaggregation_transfer_timeout_s,
        )

    @property
    def parallel_dims(self) -> ParallelDims:
        return ParallelDims(
            self.tensor_parallel_size,
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.enable_expert_parallel,
        )

    @property
    def moe_options(self) -> MoEOptions:
        return MoEOptions(
            self.moe_overlap, self.two_batch_overlap, self.num_redundant_experts, self.nnodes
        )

    @property
    def eplb_options(self) -> EplbOptions:
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
