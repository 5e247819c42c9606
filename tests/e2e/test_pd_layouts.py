"""Prefill/decode disaggregation between instances of different parallel layouts
(``test_pd_router.py`` has the setting): the KV moves from each prefill rank into the decode
rank that holds the same heads (or, for GQA heads split differently, regrouped on the way:
``disagg/regroup.py``), and every output is the colocated one. (slow)
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from moeserve.demo import tiny_model_path
from tests.e2e import pd_cluster as pc
from tests.e2e.pd_compare import (
    Deployment,
    assert_same,
    complete,
    concurrent_streams,
    prefill_args,
    stop_all,
    words,
)


def layout_outputs(d: Deployment, prefill_extra: tuple, decode_extra: tuple, path: str):
    """Eight prompts through a prefill and a decode instance started with the extra layout
    flags; returns (outputs, prompts)."""
    prefill, decode = pc.start_servers(
        prefill_args(path, *prefill_extra), pc.decode_args(path, *decode_extra)
    )
    rng = random.Random(f"layouts {prefill_extra} {decode_extra}")
    prompts = [words(rng, rng.randint(20, 120)) for _ in range(8)]
    try:
        router = pc.start_router([prefill], [decode])
        try:
            got = concurrent_streams(router.url, d.model, prompts)
        except Exception as e:  # the router's view of the workers says why a request failed
            raise AssertionError(f"{e!r}; the router's log:\n{router.text()[-4000:]}") from e
        finally:
            router.stop()
        pc.wait_idle([prefill, decode])
    finally:
        stop_all([prefill, decode])
    return got, prompts


@pytest.mark.slow
def test_prefill_tp2_into_decode_ep2_matches_colocated(pd_demo):
    """MLA's latent moves from a tensor-parallel prefill instance into one of two
    DP-attention replicas of an expert-parallel decode instance."""
    got, prompts = layout_outputs(pd_demo, ("--tp", "2"), ("--ep", "2"), str(tiny_model_path()))
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(pd_demo.colocated.url, pd_demo.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"TP2 -> EP2 stream {i}")


GQA_LAYOUTS = {
    "tp2-tp2": (("--tp", "2"), ("--tp", "2")),  # each decode rank's heads from one prefill rank
    "tp2-tp1": (("--tp", "2"), ()),  # packed from both prefill ranks, unpacked on the decode rank
    "tp1-tp2": ((), ("--tp", "2")),  # gathered into a staging buffer on the prefill rank
    "tp2-ep2": (("--tp", "2"), ("--ep", "2")),  # into DP-attention replicas holding every head
}


@pytest.mark.slow
@pytest.mark.parametrize("layouts", list(GQA_LAYOUTS.values()), ids=list(GQA_LAYOUTS))
def test_gqa_between_head_splits_matches_colocated(pd_qwen, layouts):
    """A GQA model's KV heads regrouped between prefill and decode instances that split them
    differently (``disagg/regroup.py``), or moved whole when they split them alike."""
    path = json.loads(httpx.get(f"{pd_qwen.colocated.url}/server_info", timeout=10).text)
    got, prompts = layout_outputs(pd_qwen, *layouts, path["model_path"])
    for i, (g, p) in enumerate(zip(got, prompts, strict=True)):
        want = complete(pd_qwen.colocated.url, pd_qwen.model, p, stream=False, max_tokens=16)
        assert_same(g, want, f"GQA {layouts} stream {i}")
