"""One MLA layer's absorbed decode step as prebound kernel calls.

Shape legend: T decode rows, H heads, C kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim,
V v_head_dim, Q q_lora_rank (0 without a q LoRA), D model dim.

Per step, seven ctypes calls and no torch ops besides the output's allocation::

    qkv = x @ [q_a | kv_a]                      the bound projection (any weight format)
    qn  = rms_norm(qkv[:, :Q]);  q = qn @ q_b   (q = x @ q_proj without a q LoRA)
    rope(q_pe), [norm(c_kv) | rope(k_pe)] -> the latent cache        (rope.c)
    q_lat[h] = q_nope[h] @ W_UK[h]^T            the bound per-head GEMM (fp32, bf16 or int8
                                                codes: the weight's format)
    o_lat = paged attention over the latent cache                    (attention.c)
    out[t, h] = o_lat[h, t] @ W_UV[h]^T;  y = out @ o_proj (+ all-reduce over tp)

``layers/mla.py``'s torch path is the reference and runs where this does not apply.

``__call__`` takes any rows ``x`` and returns a new output; the decode stack
(``models/decode_stack.py``) binds the calls once to its own buffers (:meth:`MLADecodeCalls.
rows`) and adds them to a call chain (:meth:`MLADecodeCalls.chain`, ``chain.py``): no torch
call at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeserve.ops.cpu import attention as cpu_attention
from moeserve.ops.cpu import fp32 as fp32_kernels
from moeserve.ops.cpu import rope
from moeserve.ops.cpu.bound import BoundHeadGemm, Pointers, pointers
from moeserve.ops.cpu.chain import CallChain


@dataclass(frozen=True, eq=False)
class MLADecodeWeights:
    """What the absorbed decode of one layer reads, as tensors and constants: the bound
    projections ``qkv_a`` (``[Q + C + R, D]``), ``q_b`` (``q_b_proj``, or ``q_proj`` when Q is
    0) and ``o`` (callables ``(x, out)`` with ``kernel``, ``max_rows`` and ``pointers``), the
    norms' weights, the rope tables, the bound absorbed weights ``uk`` (``W_UK [H, C, N]``)
    and ``uv`` (``W_UV [H, V, C]``), the latent ``cache [slots, C + R]``, and ``reduce``
    (``o_proj``'s all-reduce, or None)."""

    H: int
    C: int
    R: int
    N: int
    V: int
    Q: int
    scale: float
    qkv_a: object
    q_b: object
    o: object
    reduce: Callable[[torch.Tensor], torch.Tensor] | None
    q_norm: torch.Tensor | None
    q_norm_eps: float
    kv_norm: torch.Tensor
    kv_norm_eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    interleave: bool
    uk: BoundHeadGemm | None
    uv: BoundHeadGemm | None
    cache: torch.Tensor | None
    biased: bool  # qkv_a or o carries a bias (the calls add none)


class MLADecodeCalls:
    """The calls of the module docstring over ``w``; arguments derived when the number of
    decodes changes. Rebound by the owner when :meth:`fresh` says the weights moved."""

    def __init__(self, w: MLADecodeWeights) -> None:
        self.w = w
        self.cache = w.cache
        self.max_rows = min(w.qkv_a.max_rows, w.q_b.max_rows, w.o.max_rows, fp32_kernels.MAX_ROWS)
        self.norm_fn = fp32_kernels._library().moeserve_rms_norm
        self.rope_fn = rope._library().moeserve_mla_rope_cache
        self.attn_fn = cpu_attention._library().moeserve_paged_decode_attention
        norms = [w.kv_norm] + ([w.q_norm] if w.Q else [])
        self.pointers: Pointers = pointers(*norms, w.cos, w.sin, w.cache)
        self.pointers += w.uk.pointers + w.uv.pointers
        self.pointers += w.qkv_a.pointers + w.q_b.pointers + w.o.pointers
        self.T = 0  # the row count the buffers and argument tuples below are for
        self.raw: tuple | None = None  # the projections' calls on the bound rows (rows)
        self.raw_rows: tuple = ()

    @staticmethod
    def bind(w: MLADecodeWeights) -> MLADecodeCalls | None:
        """The calls for ``w``, or None where they do not apply: no kernels here, a projection
        or absorbed weight without a bound kernel, norms, rope tables or cache not fp32
        contiguous on the CPU, biases, a layout the kernels do not take."""
        norms = [w.kv_norm] + ([w.q_norm] if w.Q else [])
        fp32 = [*norms, w.cos, w.sin, w.cache]
        ok = (
            w.cache is not None
            and w.uk is not None
            and w.uv is not None
            and all(
                t is not None
                and t.dtype == torch.float32
                and t.device.type == "cpu"
                and t.is_contiguous()
                for t in fp32
            )
            and w.cache.dim() == 2
            and w.cache.shape[1] == w.C + w.R
            and not w.biased
            and w.H <= cpu_attention.MAX_HEADS_PER_KV
            and w.R <= 2 * rope.MAX_HALF
            and w.cos.shape[1] * 2 == w.R
            and fp32_kernels.available()
            and cpu_attention.available()
            and rope._library() is not None
            and all(p.kernel is not None for p in (w.qkv_a, w.q_b, w.o))
        )
        return MLADecodeCalls(w) if ok else None

    def fresh(self, cache: torch.Tensor | None, uk: torch.Tensor, uv: torch.Tensor) -> bool:
        """Whether the layer still has this cache and these absorbed weights, and every bound
        tensor is at the same address (loading or moving weights into huge pages replaces
        them)."""
        w = self.w
        if not (cache is self.cache and uk is w.uk.w and uv is w.uv.w):
            return False
        return all(t.data_ptr() == p for t, p in self.pointers)

    def _prepare(self, T: int) -> None:
        """Buffers for T decode rows, reused by every step of that size, and the argument
        tuples that point into them."""
        w = self.w
        H, C, R, N, V, Q = w.H, w.C, w.R, w.N, w.V, w.Q
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
            self.qnorm_args = (T, Q, qkv, ld, w.q_norm.data_ptr(), w.q_norm_eps)
            self.qnorm_args += (self.qn.data_ptr(), Q)
        # rope: (T, H, N, R, C, q, ldq, kv, ldkv, norm_w, eps, cos, sin) + (pos, il, cache, slots)
        self.rope_head = (T, H, N, R, C, q, H * K, qkv + 4 * Q, ld, w.kv_norm.data_ptr())
        self.rope_head += (w.kv_norm_eps, w.cos.data_ptr(), w.sin.data_ptr())
        self.rope_mid = (int(w.interleave), self.cache.data_ptr())
        # q_lat[h] = q_nope[h] @ W_UK[h]^T: x rows [h, t] at q + h*K + t*H*K
        self.uk_args = (H, T, C, N, q, K, H * K, *w.uk.w_args)
        self.uk_args += (self.q_lat.data_ptr(), T * C, C, w.uk.wide)
        # attention: (B, G, Hg, Dk, Dv, D1, q1 [b, h] at b*C + h*T*C, q2 = q_pe, scale, cache)
        self.attn_head = (T, 1, H, C + R, C, C, self.q_lat.data_ptr(), C, T * C)
        self.attn_head += (q + 4 * N, H * K, K, w.scale, self.cache.data_ptr(), C + R, 0, 0, 0, 0)
        # 0: the cache is fp32; the ISA the GEMMs run (the AVX-512F scores and values)
        self.attn_out = (self.o_lat.data_ptr(), C, T * C, 0, int(fp32_kernels.wide()))
        # out[t, h] = o_lat[h, t] @ W_UV[h]^T
        self.uv_args = (H, T, V, C, self.o_lat.data_ptr(), T * C, C, *w.uv.w_args)
        self.uv_args += (self.out.data_ptr(), V, H * V, w.uv.wide)
        self.raw, self.raw_rows = None, ()  # rows must bind again to the new buffers
        self.T = T

    def __call__(
        self,
        positions_T: torch.Tensor,
        x_TD: torch.Tensor,
        slots_T: torch.Tensor,
        step: tuple | None,
    ) -> torch.Tensor | None:
        """``o_proj(attention)`` of T decode rows ``x_TD`` (each its sequence's new token at
        ``positions_T``, its latent written to cache slot ``slots_T``), over the paged context
        ``step`` (block table, its row stride, lengths, block size: the attention metadata's
        kernel arguments); None, having done nothing, where the kernels do not take these
        rows."""
        T = x_TD.shape[0]
        if not (0 < T <= self.max_rows and step is not None and steps_ok(positions_T, slots_T)):
            return None
        if T != self.T:
            self._prepare(T)
        w = self.w
        w.qkv_a(x_TD, self.qkv)
        if self.qn is not None:
            self.norm_fn(*self.qnorm_args)
            w.q_b(self.qn, self.q)
        else:
            w.q_b(x_TD, self.q)
        self._attend(positions_T.data_ptr(), slots_T.data_ptr(), step)
        y_TD = w.o(self.out)
        return y_TD if w.reduce is None else w.reduce(y_TD)

    def rows(self, x_TD: torch.Tensor, y_TD: torch.Tensor) -> bool:
        """Bind :meth:`chain`'s calls to the rows of ``x_TD`` and to ``y_TD`` for o_proj's
        output (both ``[T, D]`` fp32 with unit-stride rows, kept where they are by the caller:
        the decode stack's buffers). False where the calls do not take them: more rows than
        the kernels take, or an all-reduce after o_proj (tensor parallelism)."""
        T = x_TD.shape[0]
        if not (0 < T <= self.max_rows) or self.w.reduce is not None:
            return False
        if T != self.T:
            self._prepare(T)
        w = self.w
        qkv = w.qkv_a.kernel.call_args(x_TD, self.qkv)
        q_b = w.q_b.kernel.call_args(x_TD if self.qn is None else self.qn, self.q)
        o = w.o.kernel.call_args(self.out, y_TD)
        if qkv is None or q_b is None or o is None:
            return False
        self.raw = (w.qkv_a.kernel.fn, qkv, w.q_b.kernel.fn, q_b, w.o.kernel.fn, o)
        self.raw_rows = (T, x_TD.data_ptr(), y_TD.data_ptr())
        return True

    def bound_rows(self) -> tuple:
        """``(T, x address, y address)`` that :meth:`chain`'s calls are bound to; empty when
        they are not (a ``__call__`` of another row count prepares new buffers)."""
        return self.raw_rows

    def chain(self, c: CallChain, positions, slots, step: tuple) -> None:
        """Add the step of ``__call__`` on the rows :meth:`rows` bound (``y_TD`` written) to
        ``c``; ``positions`` and ``slots`` (addresses of int64 rows) and ``step``'s four
        values as the chain passes them (its registers)."""
        w = self.w
        qkv_fn, qkv, q_b_fn, q_b, o_fn, o = self.raw
        c.add(qkv_fn, qkv, name="MLA qkv_a projection")
        if self.qn is not None:
            c.add(self.norm_fn, self.qnorm_args, name="MLA q norm")
        c.add(q_b_fn, q_b, name="MLA q_b projection")
        c.add(self.rope_fn, (*self.rope_head, positions, *self.rope_mid, slots), name="MLA rope")
        c.add(w.uk.fn, self.uk_args, name="MLA W_UK")
        c.add(self.attn_fn, (*self.attn_head, *step, *self.attn_out), name="MLA attention")
        c.add(w.uv.fn, self.uv_args, name="MLA W_UV")
        c.add(o_fn, o, name="MLA o_proj")

    def _attend(self, positions_ptr: int, slots_ptr: int, step: tuple) -> None:
        """rope and the cache write, W_UK, the paged attention and W_UV: ``q`` -> ``out``."""
        w = self.w
        self.rope_fn(*self.rope_head, positions_ptr, *self.rope_mid, slots_ptr)
        failed = w.uk.fn(*self.uk_args)  # the AMX call reports a failed allocation
        if failed or self.attn_fn(*self.attn_head, *step, *self.attn_out) != 0:
            raise MemoryError("MLA decode: out of memory for the kernels' scratch buffers")
        if w.uv.fn(*self.uv_args):
            raise MemoryError("MLA decode: out of memory for the kernels' scratch buffers")


def steps_ok(positions_T: torch.Tensor, slots_T: torch.Tensor) -> bool:
    """Whether the rope and cache kernel takes these positions and slots (int64, contiguous)."""
    return (
        positions_T.dtype == slots_T.dtype == torch.int64
        and positions_T.is_contiguous()
        and slots_T.is_contiguous()
    )
