"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged latent cache.

Shape legend: T tokens, H heads, C kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim,
V v_head_dim, L context length, B decode sequences, D model dim.

Tensor parallelism splits the heads: each rank holds H / tp of them (``q_b_proj`` and
``kv_b_proj`` split by output rows, ``o_proj`` by input columns, one all-reduce); the
latent projections and the latent cache are replicated, as in vLLM and SGLang.

The cache keeps, per token, ``[c_kv (C, normed) | k_pe (R, roped)]``: C + R numbers instead of
H * (N + R + V). Two ways to attend over it, kept side by side:

- naive (prefill): expand the latent with ``kv_b_proj`` into per-head keys and values, then
  ordinary attention. Cheap when many queries share the expansion.
- absorbed (decode): fold ``W_UK`` into the query and ``W_UV`` into the output, so scores are
  taken directly against the latent: ``score = (q_nope W_UK) . c_kv + q_pe . k_pe``. No
  per-token expansion, so each decode step reads only C + R numbers per cached token.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.groups import Axis
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, copy_into
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from moeserve.models.hf_config import ModelConfig
from moeserve.models.weights import WeightSpec
from moeserve.ops.cpu import attention as cpu_attention
from moeserve.ops.cpu import rope as rope_kernels
from moeserve.ops.cpu.bound import Guard, calls_guard
from moeserve.ops.cpu.mla_decode import MLADecodeCalls
from moeserve.ops.mla import absorbed_weights, bind_mla_decode, head_gemm
from moeserve.ops.prefill_attention import causal_attention_parts


class MLAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype=torch.float32,
        tp: Axis | None = None,
    ) -> None:
        super().__init__()
        c = config
        tp = tp or Axis.single("tp")
        H = c.num_attention_heads
        if H % tp.size:
            raise ValueError(f"{H} attention heads do not divide by tensor-parallel size {tp.size}")
        self.H = H // tp.size  # heads on this rank
        self.C, self.R = c.kv_lora_rank, c.qk_rope_head_dim
        self.N, self.V = c.qk_nope_head_dim, c.v_head_dim
        D = c.hidden_size
        # the two down-projections of x (q_a_proj, kv_a_proj_with_mqa) are one weight
        # [Q + C + R, D] (Q = q_lora_rank, 0 without a q LoRA): one weight stream, one call
        self.Q = c.q_lora_rank or 0
        self.qkv_a_proj = Linear(D, self.Q + self.C + self.R, bias=c.attention_bias, dtype=dtype)
        if self.Q:
            self.q_a_layernorm = RMSNorm(self.Q, c.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(self.Q, H * (self.N + self.R), tp, dtype=dtype)
            self.q_proj = None
        else:
            self.q_proj = ColumnParallelLinear(D, H * (self.N + self.R), tp, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.C, c.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.C, H * (self.N + self.V), tp, dtype=dtype)
        self.o_proj = RowParallelLinear(H * self.V, D, tp, bias=c.attention_bias, dtype=dtype)
        self.rotary = rotary  # shared by all layers; rotates the R rope dims
        self.scale = yarn_softmax_scale(c.rope, self.N + self.R)
        self.kv_cache: torch.Tensor | None = None  # [num_slots, C + R], bound by the runner
        # absorbed weights, derived from kv_b_proj after loading
        # absorbed weights, as [out, in] blocks per head for the per-head GEMM kernel
        self.w_uk_HCN: torch.Tensor | None = None  # q_lat[h] = q_nope[h] @ W_UK[h]
        self.w_uv_HVC: torch.Tensor | None = None  # out[h] = o_lat[h] @ W_UV[h]
        # the decode step as prebound kernel calls (built on first use; False: not here)
        self._decode_calls: MLADecodeCalls | bool | None = None

    def use_decode_calls(self, enabled: bool = True) -> None:
        """Decode through the prebound kernel calls (bound again on the next step), or, not
        ``enabled``, through the modules in torch (what hooks on the submodules see; the
        kernels' reference)."""
        self._decode_calls = None if enabled else False

    def process_weights_after_loading(self) -> None:
        self._decode_calls = None  # weights move or change: bind again on the next decode
        # a quantized kv_b_proj is absorbed dequantized, in the model dtype, and held as its
        # format wants (w8a8_int8: bf16 where the AMX kernels take it)
        dtype = self.kv_a_layernorm.weight.dtype
        self.w_uk_HCN, self.w_uv_HVC = absorbed_weights(
            self.kv_b_proj.weight, dtype, self.H, self.N, self.V, self.C
        )

    def decode_calls(self) -> MLADecodeCalls | None:
        """The prebound decode calls, bound again where the weights or the cache moved; None
        where they do not apply or are switched off (:meth:`use_decode_calls`)."""
        calls = self._decode_calls
        if calls is None or (calls and not calls.fresh(*self._bound_tensors())):
            calls = self._decode_calls = self._bind_decode()
        return calls or None

    def decode_guard(self) -> Guard:
        """What :meth:`decode_calls` checks, as a guard (``ops/cpu/bound.py``): it holds while
        :meth:`decode_calls` would return the calls it returned last, bound to the same
        rows."""
        calls = self._decode_calls
        same = [(self, "_decode_calls", calls)]
        if not calls:
            return Guard(same)
        same += [(self, "kv_cache", calls.cache), (self, "w_uk_HCN", calls.w.uk.w)]
        return calls_guard(calls, [*same, (self, "w_uv_HVC", calls.w.uv.w)])

    def _bind_decode(self) -> MLADecodeCalls | bool:
        """The prebound decode calls of this layer, or False where they do not apply."""
        o, rot = self.o_proj, self.rotary
        q_norm = self.q_a_layernorm if self.Q else None
        calls = bind_mla_decode(
            self.qkv_a_proj.weight,
            self.q_b_proj.weight if self.Q else self.q_proj.weight,
            o.weight,
            self.w_uk_HCN,
            self.w_uv_HVC,
            H=self.H,
            C=self.C,
            R=self.R,
            N=self.N,
            V=self.V,
            Q=self.Q,
            scale=self.scale,
            reduce=o.tp.all_reduce if (o.reduce and o.tp.size > 1) else None,
            q_norm=None if q_norm is None else q_norm.weight,
            q_norm_eps=0.0 if q_norm is None else q_norm.eps,
            kv_norm=self.kv_a_layernorm.weight,
            kv_norm_eps=self.kv_a_layernorm.eps,
            cos=rot.cos_cached,
            sin=rot.sin_cached,
            interleave=rot.interleave,
            cache=self.kv_cache,
            biased=self.qkv_a_proj.bias is not None or o.bias is not None,
        )
        return False if calls is None else calls

    def weight_specs(self, prefix: str) -> dict[str, WeightSpec]:
        specs: dict[str, WeightSpec] = {}
        fused = self.qkv_a_proj
        parts = {"kv_a_proj_with_mqa": (self.Q, self.Q + self.C + self.R)}
        if self.Q:
            parts["q_a_proj"] = (0, self.Q)
        for name, (a, b) in parts.items():
            specs[f"{prefix}.{name}.weight"] = WeightSpec(
                (b - a, fused.in_features), copy_into(fused.weight[a:b])
            )
            if fused.bias is not None:
                specs[f"{prefix}.{name}.bias"] = WeightSpec((b - a,), copy_into(fused.bias[a:b]))
        names = ["kv_a_layernorm", "kv_b_proj", "o_proj"]
        names += ["q_proj"] if self.q_proj is not None else ["q_a_layernorm", "q_b_proj"]
        for name in names:
            mod = getattr(self, name)
            if isinstance(mod, RMSNorm):
                specs[f"{prefix}.{name}.weight"] = WeightSpec(
                    tuple(mod.weight.shape), copy_into(mod.weight)
                )
            else:
                specs.update(mod.weight_specs(f"{prefix}.{name}"))
        return specs

    def _bound_tensors(self) -> tuple:
        return self.kv_cache, self.w_uk_HCN, self.w_uv_HVC

    def forward(
        self, positions_T: torch.Tensor, x_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T, Q = x_TD.shape[0], self.Q
        if meta.num_decodes == T and self.kv_cache is not None:
            # decodes only: the prebound kernel calls, where they apply
            calls = self.decode_calls()
            if calls is not None:
                y_TD = calls(positions_T, x_TD, meta.slot_mapping_T, meta.decode_kernel_args)
                if y_TD is not None:
                    return y_TD
        qkv_a = self.qkv_a_proj(x_TD)  # [T, Q + C + R]
        if self.q_proj is not None:
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(qkv_a[:, :Q]))
        q_THK = q.view(T, self.H, self.N + self.R)
        rot, norm = self.rotary, self.kv_a_layernorm
        # q_pe roped in place, [norm(c_kv) | rope(k_pe)] written into the cache: one C call
        fused = self.kv_cache is not None and rope_kernels.mla_rope_cache(
            q_THK,
            qkv_a[:, Q:],
            norm.weight,
            norm.eps,
            rot.cos_cached,
            rot.sin_cached,
            positions_T,
            rot.interleave,
            self.kv_cache,
            meta.slot_mapping_T,
        )
        q_nope_THN, q_pe_THR = q_THK.split([self.N, self.R], dim=-1)
        latent_T = None  # this step's latent rows, when they are not read back from the cache
        if not fused:  # the reference path (q_pe roped in q_THK too, as the C call does)
            q_pe_THR.copy_(rot(positions_T, q_pe_THR))
            c_kv_TC = norm(qkv_a[:, Q : Q + self.C])
            k_pe_TR = rot(positions_T, qkv_a[:, Q + self.C :])
            latent_T = torch.cat((c_kv_TC, k_pe_TR), dim=-1)
            if self.kv_cache is not None:
                self.kv_cache.index_copy_(0, meta.slot_mapping_T, latent_T)

        nd = meta.num_decodes
        if nd and nd == T:  # decodes only: their output is the whole output
            out_THV = self.forward_absorbed(q_nope_THN, q_pe_THR, meta)
            return self.o_proj(out_THV.reshape(T, self.H * self.V))
        out_THV = x_TD.new_empty(T, self.H, self.V)
        if nd:
            out_THV[:nd] = self.forward_absorbed(q_nope_THN[:nd], q_pe_THR[:nd], meta)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            if chunk.slots_L is None:
                ctx_LK = (
                    latent_T[rows]
                    if latent_T is not None
                    else self.kv_cache.index_select(0, meta.slot_mapping_T[rows])
                )
            else:
                ctx_LK = self.kv_cache.index_select(0, chunk.slots_L)
            self.forward_naive(q_THK[rows], ctx_LK, out_THV[rows])
        return self.o_proj(out_THV.view(T, self.H * self.V))

    def forward_naive(
        self, q_THK: torch.Tensor, ctx_LK: torch.Tensor, out_THV: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One sequence's chunk: queries (``[q_nope | q_pe]`` per head, roped) are the last T
        of its L context positions; the latent rows expand into per-head k_nope and values,
        k_pe is shared by all heads. Written into ``out_THV`` when given."""
        L = ctx_LK.shape[0]
        c_kv_LC, k_pe_LR = ctx_LK.split([self.C, self.R], dim=-1)
        kv_LHK = self.kv_b_proj(c_kv_LC).view(L, self.H, self.N + self.V)
        k_nope_LHN, v_LHV = kv_LHK.split([self.N, self.V], dim=-1)
        k_pe_LHR = k_pe_LR[:, None, :].expand(L, self.H, self.R)
        return causal_attention_parts(q_THK, k_nope_LHN, k_pe_LHR, v_LHV, self.scale, out_THV)

    def forward_absorbed(
        self, q_nope_BHN: torch.Tensor, q_pe_BHR: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Decodes (one query each) against their latent context, weights absorbed. The
        kernel reads each cached latent row once, straight from its block; the gather
        reference (``mla_decode_ref``) runs where it does not apply."""
        B, dev = q_nope_BHN.shape[0], q_nope_BHN.device
        # the CPU kernel takes fp32 queries over a cache of either dtype: a bf16 model's
        # latent queries and outputs stay fp32 between the head GEMMs
        cpu = dev.type == "cpu" and cpu_attention.available()
        lat = torch.float32 if cpu else q_nope_BHN.dtype
        # q_lat[b, h] = q_nope[b, h] @ W_UK[h]; head-major
        q_lat_HBC = head_gemm(
            q_nope_BHN.transpose(0, 1),
            self.w_uk_HCN,
            torch.empty(self.H, B, self.C, dtype=lat, device=dev),
        )
        o_lat_HBC = q_lat_HBC.new_empty(self.H, B, self.C)
        done = cpu_attention.mla_decode(
            q_lat_HBC.transpose(0, 1),
            q_pe_BHR.to(lat),
            self.kv_cache,
            meta.decode_block_table_BN,
            meta.decode_context_lens_B,
            meta.block_size,
            self.scale,
            out_BHC=o_lat_HBC.transpose(0, 1),
        )
        if done is None:
            cache_dtype = self.kv_cache.dtype
            o_lat_BHC = cpu_attention.mla_decode_ref(
                q_lat_HBC.transpose(0, 1).to(cache_dtype),
                q_pe_BHR.to(cache_dtype),
                self.kv_cache,
                meta.decode_slots_BL,
                meta.decode_bias_B1L,
                self.scale,
            )
            o_lat_HBC = o_lat_BHC.transpose(0, 1)
        # out[b, h] = o_lat[b, h] @ W_UV[h]  -> [B, H, V], written batch-major for o_proj
        out_BHV = q_nope_BHN.new_empty(B, self.H, self.V)
        head_gemm(o_lat_HBC, self.w_uv_HVC, out_BHV.transpose(0, 1))
        return out_BHV
