"""benchmarks/fit_mtp.py fits the MTP recursion (k > 1) on rows laid out as the engine runs
them: one pass over the unrolled rows with its attention mask gives, for every chain, the
same hidden states as running the layer level after level, each recursion row attending to
the level-1 rows up to its chain start and to its own chain's earlier rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

FIT = Path(__file__).resolve().parents[3] / "benchmarks" / "fit_mtp.py"


@pytest.fixture(scope="module")
def fit():
    spec = importlib.util.spec_from_file_location("fit_mtp", FIT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fit_mtp", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def tiny_mtp(fit):
    import transformers as tf

    cfg = tf.DeepseekV3Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_shared_experts=1,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = fit.MTP(cfg, torch.randn(50, 32), torch.randn(50, 32)).eval()
    with torch.no_grad():
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.ones_(p)
    return m


@torch.no_grad()
def test_unrolled_rows_match_the_recursion_step_by_step(fit):
    m = tiny_mtp(fit)
    L, D = fit.PROMPT_LEN + 6, 3
    u = fit.Unroll(L, D)
    h = torch.randn(1, L, 32)
    ids = torch.randint(0, 50, (1, L))
    x = fit.unroll(m, u, h, ids)
    assert x.shape[1] == u.level_slice(D).stop == u.positions().numel() == u.mask().shape[0]
    for c, i in enumerate(u.chains.tolist()):
        # level 1: causal over rows 0..i, as the pass over kept positions
        hs, ts, ps = [h[:, : i + 1]], [ids[:, 1 : i + 2]], [torch.arange(i + 1)]
        prev = m(hs[0], ts[0], ps[0])[:, -1:]
        torch.testing.assert_close(prev[:, 0], x[:, i])
        for d in range(2, D + 1):  # (h' of the level before, t_{i+d}) at position i + d - 1
            hs.append(prev)
            ts.append(ids[:, i + d : i + d + 1])
            ps.append(torch.tensor([i + d - 1]))
            prev = m(torch.cat(hs, 1), torch.cat(ts, 1), torch.cat(ps))[:, -1:]
            torch.testing.assert_close(prev[:, 0], x[:, u.level_slice(d).start + c])
    # targets: level 1 the greedy token after i + 1, level d the one after i + d
    g = torch.arange(L)[None]
    t = u.targets(g)[0]
    assert t[u.level_slice(1)].tolist() == list(range(1, L))
    assert t[u.level_slice(3)].tolist() == (u.chains + 3).tolist()
