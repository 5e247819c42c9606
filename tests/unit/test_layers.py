"""Fast ops against their plain references: grouped MoE, routing, absorbed MLA, YaRN rope."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.layers.mla import MLAttention
from moeserve.layers.moe import moe_grouped, moe_reference, route_grouped_sigmoid
from moeserve.layers.rotary import RotaryEmbedding, inv_freq_and_attention_factor
from moeserve.models.hf_config import ModelConfig
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
    torch.testing.assert_close(absorbed[0], naive[-1], rtol=1e-4, atol=1e-5)
