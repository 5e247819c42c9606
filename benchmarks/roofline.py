"""Rooflines of the benchmark model: bytes one decode step reads, FLOPs one prefill does, and
the two machine figures they are divided by (read bandwidth, fp32 GEMM peak), measured here.

Decode is bound by memory: every weight the step touches is read once (the expected number of
distinct routed experts at that batch), plus the latent KV of every sequence. Prefill is bound
by compute: the FLOPs of every projection for every token, the MLA expansion of the context
(``kv_b_proj``) and causal attention (half of the square, the work an ideal kernel does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeserve.ops import formats

# bytes read by decode per weight element (int4: with its scale and zero point per group of
# 128), per output row (int8's fp32 scale) and per element
# of the absorbed MLA weights (derived from kv_b_proj), as each weight format states them
# (ops/formats); the router and norms stay fp32. bf16 also stands for the fp32 format held in
# bf16 (GPUs).
FORMATS = {
    name: dict(
        linear=(f := formats.get(name)).bytes_per_weight,
        scale=f.scale_bytes_per_row,
        kv_b=f.absorbed_bytes,
    )
    for name in ("fp32", "int8", "w8a8_int8", "int4", "w4a8_int8", "bf16")
}
for _name in formats.INT4_FORMATS:  # by group size: offline_throughput's int4-gN, w4a8_int8-gN
    for _g in (32, 64, 128):
        _f = formats.configured(_name, _g)
        FORMATS[f"{_name}-g{_g}"] = dict(
            linear=_f.bytes_per_weight, scale=0.0, kv_b=_f.absorbed_bytes
        )


@dataclass(frozen=True)
class Shapes:
    D: int
    V: int
    H: int
    L: int
    E: int
    K: int
    F: int
    I: int
    n_dense: int
    n_shared: int
    nope: int
    rope: int
    v: int
    ql: int
    kvl: int

    @classmethod
    def of(cls, c: dict) -> Shapes:
        return cls(
            D=c["hidden_size"],
            V=c["vocab_size"],
            H=c["num_attention_heads"],
            L=c["num_hidden_layers"],
            E=c["n_routed_experts"],
            K=c["num_experts_per_tok"],
            F=c["moe_intermediate_size"],
            I=c["intermediate_size"],
            n_dense=c["first_k_dense_replace"],
            n_shared=c["n_shared_experts"],
            nope=c["qk_nope_head_dim"],
            rope=c["qk_rope_head_dim"],
            v=c["v_head_dim"],
            ql=c["q_lora_rank"],
            kvl=c["kv_lora_rank"],
        )

    def linears(self) -> list[tuple[int, int]]:
        """(rows, cols) of the projections of one attention block except kv_b."""
        s = self
        return [
            (s.ql, s.D),
            (s.H * (s.nope + s.rope), s.ql),
            (s.kvl + s.rope, s.D),
            (s.D, s.H * s.v),
        ]


def decode_bytes_per_step(c: dict, batch: int, context: int, fmt: str = "fp32") -> float:
    """Bytes one decode step of ``batch`` sequences with ``context`` cached tokens reads."""
    s, b = Shapes.of(c), FORMATS[fmt]

    def mat(rows: int, cols: int) -> float:
        return rows * cols * b["linear"] + rows * b["scale"]

    attn = sum(mat(r, k) for r, k in s.linears()) + s.kvl * s.H * (s.nope + s.v) * b["kv_b"]
    norms = (s.ql + s.kvl + 2 * s.D) * 4
    dense = mat(2 * s.I, s.D) + mat(s.D, s.I)
    expert = mat(2 * s.F, s.D) + mat(s.D, s.F)
    router = s.E * s.D * 4 + s.E * 4
    distinct = s.E * (1 - (1 - s.K / s.E) ** batch)  # expected experts hit per layer
    n_moe = s.L - s.n_dense
    total = s.L * (attn + norms) + s.n_dense * dense
    total += n_moe * (router + (s.n_shared + distinct) * expert)
    total += mat(s.V, s.D) + batch * s.D * 4  # lm_head, embedding rows
    total += batch * context * (s.kvl + s.rope) * 4 * s.L  # latent KV, fp32
    return total


def prefill_flops(c: dict, n: int) -> float:
    """FLOPs of one prefill of ``n`` tokens from an empty cache (logits of the last only)."""
    s = Shapes.of(c)
    per_token_attn = 2 * sum(r * k for r, k in s.linears())
    per_token_attn += 2 * s.kvl * s.H * (s.nope + s.v)  # context expansion (naive MLA)
    causal_pairs = n * (n + 1) / 2
    attn_scores = 2 * s.H * (s.nope + s.rope + s.v) * causal_pairs
    dense = 2 * 3 * s.D * s.I
    moe = 2 * 3 * s.D * s.F * (s.K + s.n_shared) + 2 * s.E * s.D
    n_moe = s.L - s.n_dense
    per_token = s.L * per_token_attn + s.n_dense * dense + n_moe * moe
    return n * per_token + s.L * attn_scores + 2 * s.V * s.D


class MachineProbe:
    """The two machine figures, measured on demand: this machine's memory bandwidth and clock
    move between runs and within one (shared host), so a benchmark measures them next to
    each case and divides by those figures."""

    def __init__(self, device: str = "cpu", gib: float = 1.0) -> None:
        self.device = device
        self._t = torch.ones(int(gib * (1 << 30)) // 4, device=device)  # allocated once

    def bandwidth(self, repeats: int = 4) -> float:
        """Best-of-N bytes/s for summing a large fp32 tensor (a streaming read)."""
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._t.sum().item()
            best = min(best, time.perf_counter() - t0)
        return self._t.numel() * 4 / best

    def gemm_peak(self, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
        return measure_gemm_peak(self.device, repeats, dtype)


def measure_gemm_peak(
    device: str = "cpu", repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """Best FLOP/s of ``F.linear`` in ``dtype`` over a few large shapes (the prefill ceiling);
    on a CPU also of moeserve's own kernel (fp32: at its largest row block,
    ``ops/cpu/fp32.py``, which outruns MKL where it has AVX-512; bf16: the AMX kernel,
    ``ops/cpu/bf16_amx.py``), so that no case can pass 100%. bf16 on a CPU without AMX: the fp32
    figure (the bf16 weight format then computes in fp32). int8: the int8 AMX kernel
    (``ops/cpu/int8_amx.py``, int8 operations per second), else the fp32 figure."""
    if dtype == torch.int8:
        from moeserve.ops.cpu import int8_amx

        if device != "cpu" or not int8_amx.available():
            return measure_gemm_peak(device, repeats)
        return _amx_int8_gemm_peak(repeats)
    if dtype == torch.bfloat16 and device == "cpu":
        from moeserve.ops.cpu import bf16_amx

        if not bf16_amx.available():
            return measure_gemm_peak(device, repeats)
        best = _amx_gemm_peak(repeats)
    else:
        best = _kernel_gemm_peak(repeats) if device == "cpu" else 0.0
    for m, n, k in ((2048, 4096, 1024), (1024, 2816, 1024), (2048, 2048, 2048)):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        torch.matmul(x, w.t(), out=out)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(x, w.t(), out=out)
            if device != "cpu":
                torch.cuda.synchronize()
            best = max(best, 2 * m * n * k / (time.perf_counter() - t0))
    return best


def _best_gemm_rate(gemm, shapes, weight, repeats: int) -> float:
    """Best FLOP/s of ``gemm(x, w, out=out)`` over ``shapes`` (m, n, k), with fp32 rows and
    the weight ``weight(n, k)`` makes."""
    best = 0.0
    for m, n, k in shapes:
        x, w, out = torch.randn(m, k), weight(n, k), torch.empty(m, n)
        gemm(x, w, out=out)
        for _ in range(repeats):
            t0 = time.perf_counter()
            gemm(x, w, out=out)
            best = max(best, 2 * m * n * k / (time.perf_counter() - t0))
    return best


def _amx_int8_gemm_peak(repeats: int) -> float:
    """The int8 AMX kernel (w8a8_int8) at the rows of a prefill MoE expert and of a
    projection, and at 512 rows where it peaks (benchmarks/amx_gemm.py)."""
    from moeserve.ops.cpu import int8_amx
    from moeserve.quant.int8 import Int8Tensor, quantize_rows

    shapes = ((192, 4096, 1024), (512, 2816, 2048), (2048, 2048, 1024))
    weight = lambda n, k: Int8Tensor(*quantize_rows(torch.randn(n, k)))  # noqa: E731
    return _best_gemm_rate(int8_amx.gemm_nt, shapes, weight, repeats)


def _amx_gemm_peak(repeats: int) -> float:
    """The AMX kernel on fp32 rows and bf16 weights (what --quantization bf16 runs), at the
    rows of a 2048-token prefill's MoE expert and of a projection."""
    from moeserve.ops.cpu import bf16_amx

    shapes = ((192, 4096, 1024), (2048, 2048, 1024))
    weight = lambda n, k: torch.randn(n, k, dtype=torch.bfloat16)  # noqa: E731
    return _best_gemm_rate(bf16_amx.gemm_nt, shapes, weight, repeats)


def _kernel_gemm_peak(repeats: int) -> float:
    from moeserve.ops.cpu import fp32 as fp32_kernels

    m, n, k = fp32_kernels.MAX_ROWS, 4096, 1024
    x, w = torch.randn(m, k), torch.randn(n, k)
    if not fp32_kernels.usable(x, w):
        return 0.0
    out = torch.empty(m, n)
    fp32_kernels.gemm_nt(x, w, out=out)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fp32_kernels.gemm_nt(x, w, out=out)
        best = max(best, 2 * m * n * k / (time.perf_counter() - t0))
    return best
