"""Fast ops against their plain references: grouped MoE, routing, absorbed MLA, YaRN rope."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.mla import MLAttention
from moeserve.layers.rotary import RotaryEmbedding, inv_freq_and_attention_factor
from moeserve.models.hf_config import ModelConfig
from moeserve.ops.cpu.mla_decode import MLADecodeCalls
from moeserve.ops.moe import moe_grouped, moe_reference
from moeserve.ops.routing import route_grouped_sigmoid
from moeserve.quant.head_codes import HeadCodes
from tests.checkpoints import DEEPSEEK_KW


@pytest.mark.parametrize("T", [1, 3, 40])
def test_moe_grouped_matches_reference(T):
    g = torch.Generator().manual_seed(T)
    E, D, F, K = 8, 32, 16, 3
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * F, D, generator=g)
    w2 = torch.randn(E, D, F, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    torch.testing.assert_close(
        moe_grouped(x, w13, w2, w, ids), moe_reference(x, w13, w2, w, ids), rtol=1e-5, atol=1e-4
    )


def test_group_limited_routing_matches_transformers():
    import transformers as tf

    cfg = tf.DeepseekV3Config(**DEEPSEEK_KW)
    router = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(50, cfg.hidden_size)
    _, ref_w, ref_ids = router(x)
    logits = x @ router.weight.t()
    w, ids = route_grouped_sigmoid(
        logits,
        router.e_score_correction_bias,
        cfg.num_experts_per_tok,
        cfg.n_group,
        cfg.topk_group,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    )
    # same experts chosen, same weights per expert (order within top-k is unspecified)
    ref_sorted, order_ref = ref_ids.sort(dim=1)
    got_sorted, order_got = ids.sort(dim=1)
    assert torch.equal(ref_sorted, got_sorted)
    torch.testing.assert_close(w.gather(1, order_got), ref_w.gather(1, order_ref))
    # every chosen expert lies in one of the topk_group allowed groups
    groups = ids // (cfg.n_routed_experts // cfg.n_group)
    assert all(len(set(row.tolist())) <= cfg.topk_group for row in groups)


def test_yarn_inv_freq_matches_transformers():
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.DeepseekV3Config(**DEEPSEEK_KW)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    mc = ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    inv, factor = inv_freq_and_attention_factor(mc.rope, mc.qk_rope_head_dim)
    torch.testing.assert_close(inv, ref_inv, rtol=0, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_absorbed_decode_equals_naive_attention():
    """The decode path (weights absorbed into q and o) against naive expansion of the latent."""
    raw = {**DEEPSEEK_KW, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    cfg = ModelConfig.from_hf(raw)
    torch.manual_seed(0)
    attn = MLAttention(cfg, RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, 256))
    for p in attn.parameters():
        p.data.normal_(0, 0.2)
    attn.process_weights_after_loading()
    bs, L = 4, 23
    attn.kv_cache = torch.zeros(8 * bs, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    table = [5, 2, 7, 0, 1, 3]  # scattered blocks
    x = torch.randn(L, cfg.hidden_size)
    pos = torch.arange(L)
    with torch.no_grad():
        naive = attn(pos, x, AttentionMetadata.build([0], [L], [table], bs))
        # replay the last token as a decode over the cached first L-1 tokens
        attn.kv_cache.zero_()
        attn(pos[:-1], x[:-1], AttentionMetadata.build([0], [L - 1], [table], bs))
        absorbed = attn(pos[-1:], x[-1:], AttentionMetadata.build([L - 1], [1], [table], bs))
        # the same token as a one-token prefill chunk (a prompt's last token after a prefix
        # hit): naive attention over the cached context, as the whole prompt's prefill
        chunk = AttentionMetadata.build([L - 1], [1], [table], bs, num_decodes=0)
        one = attn(pos[-1:], x[-1:], chunk)
    torch.testing.assert_close(absorbed[0], naive[-1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(one[0], naive[-1], rtol=1e-5, atol=1e-6)


def test_one_token_prefill_chunk_metadata():
    table, bs = [5, 2, 7, 0, 1, 3], 4
    meta = AttentionMetadata.build([3, 22], [1, 1], [table, table], bs, num_decodes=1)
    assert meta.num_decodes == 1 and meta.decode_context_lens_B.tolist() == [4]
    (chunk,) = meta.prefills
    assert (chunk.token_start, chunk.num_tokens, chunk.context_start) == (1, 1, 22)
    assert chunk.slots_L.tolist() == [table[p // bs] * bs + p % bs for p in range(23)]
    with pytest.raises(ValueError, match="decodes"):
        AttentionMetadata.build([0], [3], [table], bs, num_decodes=1)


def _random_mla(int8: bool) -> MLAttention:
    raw = {**DEEPSEEK_KW, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    cfg = ModelConfig.from_hf(raw)
    torch.manual_seed(0)
    attn = MLAttention(cfg, RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, 256))
    _fill_random(attn, 0.2, int8)
    attn.process_weights_after_loading()
    return attn


def _fill_random(module: torch.nn.Module, scale: float, int8: bool) -> None:
    """Random weights (``scale`` x normal) loaded into ``module``, int8-quantized first when
    asked, as a checkpoint's would be."""
    from moeserve.models.weight_format import apply_weight_format

    dense = {n: torch.randn(p.shape) * scale for n, p in module.named_parameters()}
    if int8:
        apply_weight_format(module, "int8")
    for name, t in dense.items():
        mod_name, _, attr = name.rpartition(".")
        getattr(module.get_submodule(mod_name), attr).copy_(t)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("B", [1, 3])
def test_mla_decode_calls_equal_the_torch_path(B, int8):
    """The prebound decode calls (``MLADecodeCalls``) give the same output and cache rows, bit
    for bit, as the per-op path they replace, over several steps of B decodes."""
    from moeserve.ops.cpu import fp32 as fp32_kernels

    if not fp32_kernels.available():
        pytest.skip("no CPU kernels here")
    attn = _random_mla(int8)
    bs = 4
    width = attn.C + attn.R
    tables = [[5, 2, 7, 0], [1, 3, 6, 4], [9, 8, 10, 11]][:B]
    caches = [torch.randn(12 * bs, width) for _ in range(2)]
    caches[1].copy_(caches[0])
    outs = []
    for fast, cache in zip((True, False), caches):
        attn.kv_cache = cache
        attn.use_decode_calls(fast)
        got = []
        with torch.no_grad():
            for step in range(3):
                starts = [5 + step + b for b in range(B)]
                meta = AttentionMetadata.build(starts, [1] * B, tables, bs)
                x = torch.randn(
                    B, attn.qkv_a_proj.in_features, generator=torch.Generator().manual_seed(step)
                )
                got.append(attn(torch.tensor(starts), x, meta))
        outs.append(got)
        if fast:  # the calls ran (bound for B rows), not the fallback
            assert isinstance(attn._decode_calls, MLADecodeCalls) and attn._decode_calls.T == B
            # int8: the absorbed products on kv_b_proj's codes (ops/cpu/int8_heads.py)
            assert isinstance(attn._decode_calls.w.uk.w, HeadCodes) == int8
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_moe_decode_calls_equal_the_torch_path(T, int8):
    """The prebound MoE decode calls (``MoEDecodeCalls``: routing, sort, one-call experts,
    combine) give the same output and expert counts, bit for bit, as the torch path."""
    from moeserve.layers.moe_block import MoEBlock
    from moeserve.ops.cpu import fp32 as fp32_kernels
    from moeserve.ops.cpu.moe_decode import MoEDecodeCalls

    if not fp32_kernels.available():
        pytest.skip("no CPU kernels here")
    raw = {**DEEPSEEK_KW, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    cfg = ModelConfig.from_hf(raw)
    torch.manual_seed(0)
    block = MoEBlock(cfg)
    assert block.shared_slot is not None  # DeepSeek's shared expert runs as one more slot
    _fill_random(block, 0.3, int8)
    outs, counts = [], []
    for fast in (True, False):
        block.use_decode_calls(fast)
        block.expert_counts_E.zero_()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            outs.append([block(torch.randn(T, cfg.hidden_size, generator=g)) for _ in range(3)])
        counts.append(block.expert_counts_E.clone())
        if fast:
            assert isinstance(block._decode_calls, MoEDecodeCalls) and block._decode_calls.T == T
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(counts[0], counts[1]) and int(counts[0].sum()) == 3 * T * 4


def test_mla_decode_calls_follow_moved_weights():
    """Weights moved after the calls were bound (``p.data`` replaced, as the huge-page move
    does) are bound again, not read at their old address."""
    from moeserve.ops.cpu import fp32 as fp32_kernels

    if not fp32_kernels.available():
        pytest.skip("no CPU kernels here")
    attn = _random_mla(int8=False)
    attn.kv_cache = torch.zeros(8 * 4, attn.C + attn.R)
    meta = AttentionMetadata.build([3], [1], [[1, 0]], 4)
    x, pos = torch.randn(1, attn.qkv_a_proj.in_features), torch.tensor([3])
    with torch.no_grad():
        attn(pos, x, meta)
        first = attn._decode_calls
        for p in attn.parameters():
            p.data = p.data * 2  # new storage, new values
        attn.process_weights_after_loading()  # w_uk / w_uv derived again
        attn._decode_calls = first  # as if nobody had told the layer
        fast = attn(pos, x, meta)
        assert attn._decode_calls is not first
        attn._decode_calls = False
        torch.testing.assert_close(fast, attn(pos, x, meta), rtol=0, atol=0)
