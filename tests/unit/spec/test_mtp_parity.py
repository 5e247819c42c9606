"""The MTP draft module against transformers' ``MtpModel`` on the same tiny checkpoint (the
tests add the MTP tensors; transformers' DeepseekV3ForCausalLM drops them)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.layers.attention_meta import AttentionMetadata
from moeserve.models.loader import load_model
from tests.mtp_checkpoint import save_mtp_checkpoint


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    return save_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ck")


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def test_checkpoint_mtp_layer_is_loaded(trio):
    _, _, path = trio
    model, _, _ = load_model(path, torch.float32, load_mtp=True, progress=False)
    assert len(model.mtp_layers) == 1
    model, _, _ = load_model(path, torch.float32, load_mtp=False, progress=False)
    assert len(model.mtp_layers) == 0


@pytest.mark.parametrize("n", [1, 12, 37])
def test_mtp_logits_match_transformers(trio, n):
    """Every row of the MTP layer over a prompt: logits within 1e-4 of transformers'."""
    hf, mtp, path = trio
    model, _, _ = load_model(path, torch.float32, load_mtp=True, progress=False)
    spec = model.kv_cache_spec()
    caches = [torch.zeros(64, *spec.token_shape) for _ in range(spec.num_layers + 1)]
    model.bind_kv_caches(caches[:-1])
    layer = model.mtp_layers[0]
    layer.block.self_attn.kv_cache = caches[-1]
    ids = torch.tensor(_prompt(n, n))
    meta = AttentionMetadata.build([0], [n], [[0, 1, 2, 3]], 16)
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
        nxt = out.logits[0, -1].argmax().view(1)
        shifted = torch.cat([ids[1:], nxt])
        h_ref = mtp.forward_layer(
            0, out.hidden_states[-1], torch.arange(1, n + 1)[None], None, input_ids=shifted[None]
        )
        want = mtp._project_to_logits(h_ref)[0]
        h = model(ids, torch.arange(n), meta)
        got = layer.compute_logits(layer(shifted, torch.arange(n), h, meta))
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("k", [1, 2])
def test_engine_drafts_match_transformers(trio, k):
    """The drafts the engine proposes after a prompt's prefill: d_1 is transformers' MTP
    argmax at the last row; d_2 (k = 2) applies the layer again on its own output at the next
    position, as the row ``(h'_P, d_1)`` appended to the same causal sequence."""
    hf, mtp, path = trio
    ids = _prompt(5, 23)
    llm = LLM(
        str(path), dtype="float32", max_model_len=128, progress=False, speculative_num_tokens=k
    )
    runner = llm.engine.runner
    seen = []
    inner = runner.proposer.propose

    def record(h_TD, entries):
        out = inner(h_TD, entries)
        seen.append(out[0][0])
        return out

    runner.proposer.propose = record
    llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    n = len(ids)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        t_n = int(out.logits[0, -1].argmax())
        h_main = out.hidden_states[-1]
        shifted = torch.tensor([ids[1:] + [t_n]])
        h1 = mtp.forward_layer(0, h_main, torch.arange(1, n + 1)[None], None, input_ids=shifted)
        d1 = int(mtp._project_to_logits(h1)[0, -1].argmax())
        want = [d1]
        if k == 2:
            h_in = torch.cat([h_main, h1[:, -1:]], dim=1)
            ids2 = torch.cat([shifted, torch.tensor([[d1]])], dim=1)
            h2 = mtp.forward_layer(0, h_in, torch.arange(1, n + 2)[None], None, input_ids=ids2)
            want.append(int(mtp._project_to_logits(h2)[0, -1].argmax()))
    assert seen[0] == want


def test_mtp_layer_shares_the_main_embedding_and_head(trio, tmp_path):
    """DeepSeek's MTP layer shares the embedding and the head: on one rank they are the main
    model's (no copies in memory), and a checkpoint without its own copies loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, _, path = trio
    model, _, _ = load_model(path, torch.float32, load_mtp=True, progress=False)
    layer = model.mtp_layers[0]
    assert layer.embed_tokens is model.embed_tokens.weight and layer.head is model.lm_head
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    tensors = load_file(str(bare / "mtp.safetensors"))
    n = model.config.num_hidden_layers
    del tensors[f"model.layers.{n}.embed_tokens.weight"]
    del tensors[f"model.layers.{n}.shared_head.head.weight"]
    save_file(tensors, str(bare / "mtp.safetensors"))
    ids = _prompt(7, 15)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=64, progress=False)
    want = LLM(str(path), **engine).generate(ids, params)[0].outputs[0].token_ids
    llm = LLM(str(bare), speculative_num_tokens=2, **engine)
    assert llm.generate(ids, params)[0].outputs[0].token_ids == want
