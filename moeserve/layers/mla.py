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
from moeserve.ops.cpu import amx
from moeserve.ops.cpu import attention as cpu_attention
from moeserve.ops.cpu import kernels as cpu_kernels
from moeserve.ops.cpu import rope as rope_kernels
from moeserve.ops.linear import BoundLinear
from moeserve.ops.prefill_attention import causal_attention_parts
from moeserve.quant.int8 import as_int8, dense


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

    def process_weights_after_loading(self) -> None:
        self._decode_calls = None  # weights move or change: bind again on the next decode
        # an int8 kv_b_proj (quant/) is absorbed dequantized, in the model dtype; a w8a8_int8
        # one in bf16 where the AMX kernels take it (its GEMMs already round their inputs to
        # int8; the bf16 head products are 3.3x the fp32 ones at 32 rows)
        q = as_int8(self.kv_b_proj.weight)
        dtype = self.kv_a_layernorm.weight.dtype
        w = dense(self.kv_b_proj.weight, dtype).view(self.H, self.N + self.V, self.C)
        self.w_uk_HCN = w[:, : self.N, :].transpose(1, 2).contiguous()
        self.w_uv_HVC = w[:, self.N :, :].contiguous()
        if q is not None and q.act_int8 and q.device.type == "cpu" and amx.available():
            uk, uv = self.w_uk_HCN.bfloat16(), self.w_uv_HVC.bfloat16()
            if amx.weight_ok(uk) and amx.weight_ok(uv):
                self.w_uk_HCN, self.w_uv_HVC = uk, uv

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

    def forward(
        self, positions_T: torch.Tensor, x_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        T, Q = x_TD.shape[0], self.Q
        if meta.num_decodes == T and self.kv_cache is not None:
            # decodes only: the prebound kernel calls, where they apply
            calls = self._decode_calls
            if calls is None or (calls and not calls.fresh()):
                calls = self._decode_calls = MLADecodeCalls.bind(self)
            if calls:
                y_TD = calls(positions_T, x_TD, meta)
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
        q_lat_HBC = _head_gemm(
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
        _head_gemm(o_lat_HBC, self.w_uv_HVC, out_BHV.transpose(0, 1))
        return out_BHV


def _head_gemm(x_HMK: torch.Tensor, w_HNK: torch.Tensor, out_HMN: torch.Tensor) -> torch.Tensor:
    """``out[h] = x[h] @ w[h].T``: the fp32 kernel, the AMX one for bf16 weights, or ``bmm``
    (the reference) in the weight's dtype."""
    if cpu_kernels.head_gemm_nt(x_HMK, w_HNK, out_HMN) is not None:
        return out_HMN
    if amx.head_usable(x_HMK, w_HNK):
        return amx.head_gemm_nt(x_HMK, w_HNK, out_HMN)
    return out_HMN.copy_(torch.bmm(x_HMK.to(w_HNK.dtype), w_HNK.transpose(1, 2)))


class MLADecodeCalls:
    """One MLA layer's absorbed decode as kernel calls whose arguments are derived once: the
    weights' pointers and strides when bound, the step's buffers and per-step arguments when
    the number of decodes changes. Seven ctypes calls per layer and no torch ops besides the
    output's allocation; :meth:`MLAttention.forward`'s torch path is the reference (and runs
    where this does not apply). Rebound when the cache or the weights change."""

    def __init__(self, attn: MLAttention) -> None:
        self.attn = attn
        self.cache = attn.kv_cache
        self.qkv_a = BoundLinear(attn.qkv_a_proj.weight)
        self.q_b = BoundLinear(attn.q_b_proj.weight if attn.Q else attn.q_proj.weight)
        self.o = BoundLinear(attn.o_proj.weight)
        o = attn.o_proj
        self.reduce = o.tp.all_reduce if (o.reduce and o.tp.size > 1) else None
        self.max_rows = min(self.qkv_a.max_rows, self.q_b.max_rows, self.o.max_rows)
        self.max_rows = min(self.max_rows, cpu_kernels.MAX_ROWS)
        self.norm_fn = cpu_kernels._library().moeserve_rms_norm
        # the absorbed W_UK / W_UV: fp32 (kernels.c) or bf16 (--quantization bf16, AMX)
        if attn.w_uk_HCN.dtype == torch.bfloat16:
            self.head_fn = amx._library().moeserve_amx_head_gemm_nt_f32
        else:
            self.head_fn = cpu_kernels._library().moeserve_head_gemm_nt_small
        self.rope_fn = rope_kernels._library().moeserve_mla_rope_cache
        self.attn_fn = cpu_attention._library().moeserve_paged_decode_attention
        self.wide = int(cpu_kernels.wide())
        self.w_uk, self.w_uv = attn.w_uk_HCN, attn.w_uv_HVC
        rot = attn.rotary
        norms = [attn.kv_a_layernorm.weight] + ([attn.q_a_layernorm.weight] if attn.Q else [])
        # every tensor whose address the calls use, with that address
        self.pointers = [(t, t.data_ptr()) for t in (*norms, rot.cos_cached, rot.sin_cached)]
        self.pointers += [(t, t.data_ptr()) for t in (self.w_uk, self.w_uv, self.cache)]
        for lin in (self.qkv_a, self.q_b, self.o):
            self.pointers += lin.pointers
        self.T = 0  # the row count the buffers and argument tuples below are for

    def fresh(self) -> bool:
        """Whether the layer still has the cache and weights bound, at the same addresses
        (loading or moving weights into huge pages replaces them)."""
        for t, ptr in self.pointers:
            if t.data_ptr() != ptr:
                return False
        a = self.attn
        return a.kv_cache is self.cache and a.w_uk_HCN is self.w_uk and a.w_uv_HVC is self.w_uv

    @staticmethod
    def bind(attn: MLAttention) -> MLADecodeCalls | bool:
        """The calls for ``attn``, or False where they do not apply (no kernels here, not
        fp32 on the CPU (the absorbed weights may be bf16 on AMX), biases, a layout the
        kernels do not take)."""
        rot, cache = attn.rotary, attn.kv_cache
        norms = [attn.kv_a_layernorm.weight] + ([attn.q_a_layernorm.weight] if attn.Q else [])
        absorbed = [attn.w_uk_HCN, attn.w_uv_HVC]
        fp32 = [*norms, rot.cos_cached, rot.sin_cached, cache]
        if absorbed[0].dtype == torch.float32:
            fp32 += absorbed
        elif not all(w.dtype == torch.bfloat16 and amx.weight_ok(w) for w in absorbed):
            return False
        ok = (
            cache is not None
            and all(
                t is not None
                and t.dtype == torch.float32
                and t.device.type == "cpu"
                and t.is_contiguous()
                for t in fp32
            )
            and all(w.is_contiguous() and w.device.type == "cpu" for w in absorbed)
            and (absorbed[0].dtype == torch.float32 or amx.available())
            and cache.dim() == 2
            and cache.shape[1] == attn.C + attn.R
            and attn.qkv_a_proj.bias is None
            and attn.o_proj.bias is None
            and attn.H <= cpu_attention.MAX_HEADS_PER_KV
            and attn.R <= 2 * rope_kernels.MAX_HALF
            and rot.cos_cached.shape[1] * 2 == attn.R
            and cpu_kernels.available()
            and cpu_attention.available()
            and rope_kernels._library() is not None
        )
        if not ok:
            return False
        calls = MLADecodeCalls(attn)
        if not (calls.qkv_a.fn and calls.q_b.fn and calls.o.fn):
            return False
        return calls

    def _prepare(self, T: int) -> None:
        """Buffers for T decode rows, reused by every step of that size, and the argument
        tuples that point into them."""
        a = self.attn
        H, C, R, N, V, Q = a.H, a.C, a.R, a.N, a.V, a.Q
        f32 = dict(dtype=torch.float32)
        self.qkv = torch.empty(T, Q + C + R, **f32)  # [q_a | c_kv | k_pe] before norms
        self.qn = torch.empty(T, Q, **f32) if Q else None  # normed q_a
        self.q = torch.empty(T, H * (N + R), **f32)  # per head [q_nope | q_pe]
        self.q_lat = torch.empty(H, T, C, **f32)
        self.o_lat = torch.empty(H, T, C, **f32)
        self.out = torch.empty(T, H * V, **f32)  # per head [V], o_proj's input
        qkv, q, K = self.qkv.data_ptr(), self.q.data_ptr(), N + R
        ld = Q + C + R
        if Q:
            w = a.q_a_layernorm.weight
            self.qnorm_args = (T, Q, qkv, ld, w.data_ptr(), a.q_a_layernorm.eps)
            self.qnorm_args += (self.qn.data_ptr(), Q)
        norm, rot = a.kv_a_layernorm, a.rotary
        # rope: (T, H, N, R, C, q, ldq, kv, ldkv, norm_w, eps, cos, sin) + (pos, il, cache, slots)
        self.rope_head = (T, H, N, R, C, q, H * K, qkv + 4 * Q, ld, norm.weight.data_ptr())
        self.rope_head += (norm.eps, rot.cos_cached.data_ptr(), rot.sin_cached.data_ptr())
        self.rope_mid = (int(rot.interleave), self.cache.data_ptr())
        # q_lat[h] = q_nope[h] @ W_UK[h]^T: x rows [h, t] at q + h*K + t*H*K
        uk = a.w_uk_HCN
        self.uk_args = (H, T, C, N, q, K, H * K, uk.data_ptr(), C * N, N)
        self.uk_args += (self.q_lat.data_ptr(), T * C, C, self.wide)
        # attention: (B, G, Hg, Dk, Dv, D1, q1 [b, h] at b*C + h*T*C, q2 = q_pe, scale, cache)
        self.attn_head = (T, 1, H, C + R, C, C, self.q_lat.data_ptr(), C, T * C)
        self.attn_head += (q + 4 * N, H * K, K, a.scale, self.cache.data_ptr(), C + R, 0, 0, 0, 0)
        self.attn_out = (self.o_lat.data_ptr(), C, T * C, 0)  # 0: the cache is fp32
        # out[t, h] = o_lat[h, t] @ W_UV[h]^T
        uv = a.w_uv_HVC
        self.uv_args = (H, T, V, C, self.o_lat.data_ptr(), T * C, C, uv.data_ptr(), V * C, C)
        self.uv_args += (self.out.data_ptr(), V, H * V, self.wide)
        self.T = T

    def __call__(
        self, positions_T: torch.Tensor, x_TD: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """``o_proj(attention)`` of T decode rows ``x_TD`` (each its sequence's new token at
        ``positions_T``), their latents written into the cache; None, having done nothing,
        where the kernels do not take these rows."""
        T = x_TD.shape[0]
        step = meta.decode_kernel_args  # (block table, its row stride, lengths, block size)
        if not (0 < T <= self.max_rows) or step is None:
            return None
        pos, slots = positions_T, meta.slot_mapping_T
        if not (
            pos.dtype == slots.dtype == torch.int64
            and pos.is_contiguous()
            and slots.is_contiguous()
        ):
            return None
        if T != self.T:
            self._prepare(T)
        self.qkv_a(x_TD, self.qkv)
        if self.qn is not None:
            self.norm_fn(*self.qnorm_args)
            self.q_b(self.qn, self.q)
        else:
            self.q_b(x_TD, self.q)
        self.rope_fn(*self.rope_head, pos.data_ptr(), *self.rope_mid, slots.data_ptr())
        failed = self.head_fn(*self.uk_args)  # the AMX call reports a failed allocation
        if failed or self.attn_fn(*self.attn_head, *step, *self.attn_out) != 0:
            raise MemoryError("MLA decode: out of memory for the kernels' scratch buffers")
        if self.head_fn(*self.uv_args):
            raise MemoryError("MLA decode: out of memory for the kernels' scratch buffers")
        y_TD = self.o(self.out)
        return y_TD if self.reduce is None else self.reduce(y_TD)
